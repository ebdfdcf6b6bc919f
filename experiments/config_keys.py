"""What each config key of the training entry points means: ``--help`` prints
it under the key, and ``docs/config.md`` is this module's table
(``python -m experiments.config_keys > docs/config.md`` writes it again;
a test checks that it is current and that every key has its line here).
"""
from __future__ import annotations

#: The entry points whose ``get_config()`` the table shows, in its columns.
ENTRY_POINTS = ('vit_imagenet', 'bert_glue', 'bert_squad')

#: One line per key: what it does, its values, where the docs say more.
MEANINGS: dict[str, str] = {
    'seed': "seeds the initialisation, the data's order (and the digits' split) and dropout; "
            'in [0, 2**32)',
    'resume': "continue from the workdir's newest checkpoint; False starts over (the "
              "workdir's earlier outputs wait in <workdir>/replaced until the new run's first "
              "checkpoint, and come back if it fails before)",

    'data.name': "ViT: 'auto' (imagenet2012 if prepared for TFDS, else the embedded digits), "
                 "'imagenet2012', 'digits' or 'synthetic' (ImageNet-shaped random data, for speed: "
                 "accuracy stays at chance); GLUE: 'glue/<task>' (sst2, mnli, qnli, ...); "
                 "SQuAD: 'squad/v1.1'",
    'data.data_dir': "TFDS's data dir ('': $TFDS_DATA_DIR or ~/tensorflow_datasets)",
    'data.image_size': 'ImageNet and synthetic images are prepared at this size (square); the '
                       'digits are 8x8',
    'data.workers': 'threads that read an ImageNet batch (0: one per CPU core this process may '
                    'run on, at most 32); the batches are the same whatever the count',
    'data.max_seq_length': 'tokens per example (GLUE) or per window of a context (SQuAD); '
                           'longer inputs are truncated (GLUE) or split (SQuAD)',
    'data.doc_stride': 'SQuAD: tokens that consecutive windows of a context share',
    'data.n_best_size': 'SQuAD evaluation: the best start and end positions combined into '
                        'candidate answers',
    'data.max_answer_length': 'SQuAD evaluation: the longest answer, in tokens',

    'model.kind': "the entry point's model ('vit', 'bert-classification', "
                  "'bert-question_answering'); another is refused",
    'model.preset': "ViT: 'auto' (vit-b16 on ImageNet and synthetic data, custom on the "
                    "digits), 'vit-b16', 'vit-l16' or 'custom'; BERT without "
                    "model.pretrained: 'bert-base', 'bert-large' or 'custom'",
    'model.pretrained': "HF weights to start from: a local directory or an HF cache name "
                        "('': the preset, randomly initialised)",
    'model.tokenizer': "BERT: the tokenizer's directory or HF cache name ('': "
                       "model.pretrained's own)",
    'model.hidden_size': "model.preset=custom: the width of the residual stream",
    'model.num_layers': 'model.preset=custom: transformer blocks',
    'model.num_heads': 'model.preset=custom: attention heads (must divide model.hidden_size)',
    'model.intermediate_size': "model.preset=custom: the MLP's inner width",
    'model.patch_size': 'model.preset=custom (ViT): patch side in pixels (must divide the image '
                        'size)',
    'model.dropout': 'model.preset=custom: dropout of the hidden states and the attention '
                     'probabilities (a block stops applying it once it freezes)',
    'model.initializer_range': "model.preset=custom (ViT): the initial weights' standard "
                               "deviation (HF's 0.02 suits long pre-training)",

    'train.epochs': 'epochs to train (a resumed run may change it: the learning-rate schedule '
                    'follows the new total)',
    'train.batch_size': "the global batch (batch_mode=constant; a multiple of the devices) or "
                        "a pipeline's batch (per_pipeline; a multiple of "
                        "pipeline.initial_length)",
    'train.batch_mode': "'constant': the global batch stays the same when AutoDP adds replicas; "
                        "'per_pipeline': it grows with them (the paper), and an epoch's "
                        "fewer steps each move the learning-rate schedule further, so that it "
                        "still ends with the last epoch",
    'train.learning_rate': "AdamW's peak learning rate",
    'train.weight_decay': "AdamW's decoupled weight decay",
    'train.decay_biases_and_norms': "whether the weight decay applies to biases and LayerNorm "
                                    "scales too (False: to the other parameters only, as BERT's "
                                    "recipe and HF's Trainer do)",
    'train.max_grad_norm': "> 0: the trained parameters' gradient is scaled down to this global "
                           "L2 norm before AdamW where it is longer (HF's max_grad_norm); "
                           "0: not clipped",
    'train.warmup_epochs': 'linear warm-up to the peak learning rate, then cosine decay to 0',
    'train.max_steps_per_epoch': 'caps every epoch and evaluation at this many steps (smoke '
                                 'runs; 0: whole epochs); SQuAD scores only the questions '
                                 'whose windows all fit',
    'train.eval_batch_size': 'evaluation batch (0: 4 x the starting global batch); a multiple '
                             'of the devices',

    'pipeline.initial_length': 'K at the start: the stages of the first pipeline (divides '
                               'pipeline.devices)',
    'pipeline.schedule': "'1f1b', 'gpipe' or '1f1b-fused' (a forward and a backward in one "
                         "tick)",
    'pipeline.exchange': "how a tick's messages travel: 'ppermute', 'all_gather' ('auto': "
                         "all_gather on CPU devices, ppermute on accelerators)",
    'pipeline.micro_batches': 'M, the micro-batches of a step (0: profiled among K, ..., 6K once '
                              'per K and remembered in pipeline.profile_path); a fixed M that '
                              'stops dividing a replica\'s batch when R grows is lowered to '
                              'the largest divisor below it, in one line',
    'pipeline.profile_path': "where the profiled micro-batch counts are remembered ('': "
                             "nowhere)",
    'pipeline.devices': 'devices the run uses, the first this many (on a CPU: of the 8 fake '
                        'CPU devices, or as many as XLA_FLAGS sets)',
    'pipeline.autodp': 'False (ablation): R stays 1 and the devices that compression frees '
                       'idle',
    'pipeline.split_mlp_min_gain': "let a stage boundary fall inside an MLP when that lowers "
                                   "the largest stage's parameters by at least this fraction "
                                   "(1: never)",

    'freeze.policy': "'pipetransformer' (Eq. 1: gradient norms under the alpha bound), "
                     "'schedule' (the alpha bound alone) or 'none' (the baseline: no freezing, "
                     "a static pipeline)",
    'freeze.alpha': "Eq. 1's alpha: the bound moves this fraction of the way to all blocks "
                    "each timestep; in (0, 1)",
    'freeze.timestep_steps': 'a freeze decision every this many steps (0: at the end of each '
                             'epoch); needs train.batch_mode=constant',
    'freeze.min_active_layers': 'blocks that always stay trainable',
    'freeze.lambda_frozen': "Eq. 2's compression charges the frozen layers this fraction "
                            "of their parameters on stage 0 (Algorithm 1's lambda); the "
                            "stages a run trains balance the active layers alone",
    'freeze.compress': 'False: K never halves (no pipeline compression)',
    'freeze.compile_ahead': "compile the plan the alpha bound predicts next while the "
                            "current epoch trains",
    'freeze.keep_slot_width': "a freeze event that keeps K pads the stages to the old slot "
                              "width and reuses the compiled step (fewer programs, slower "
                              "steps)",

    'cache.enabled': "AutoCache: keep the frozen prefix's outputs per sample",
    'cache.policy': "'profile': cache a depth when a cache read is measured faster than the "
                    "prefix's forward; 'always'",
    'cache.dtype': "'float32', 'bfloat16' or 'float16' (half the bytes, rounded)",
    'cache.memory_mb': "MB of host memory for the cache's entries (with a disk tier, an "
                       "eighth of it holds the entries read ahead from disk)",
    'cache.disk_mb': 'MB of a checksummed disk file for the entries beyond memory (0: no disk '
                     'tier)',
    'cache.directory': "where the disk tier lives ('': <workdir>/cache)",
    'cache.on_mismatch': "a cache.directory written by another run: 'refuse' or 'clear' "
                         "(the workdir's own cache/ is cleared)",
    'cache.accept_reused_augmentation': 'cache a randomly augmented prefix input anyway (every '
                                        'epoch then sees the first augmentation); only a data '
                                        'source of your own can be one (randomly_augmented = '
                                        'True): those pipejax ships do not augment',

    'distributed.coordinator': "'host:port' of process 0, 'auto' (JAX detects SLURM, Open MPI, "
                               "...), or '' (one process)",
    'distributed.num_processes': 'processes of the job (with a host:port coordinator)',
    'distributed.process_id': 'this process, 0 to num_processes - 1',
    'distributed.heartbeat_timeout_seconds': 'a process silent this long counts as dead and '
                                             'stops the job',
    'distributed.initialization_timeout_seconds': 'how long the processes wait for each other '
                                                  'at the start',
    'distributed.data_shards': 'disjoint data shards, each read by one process (0: one per '
                               'process); a multiple of the processes',

    'checkpoint.enabled': 'save checkpoints (at the end of each epoch, on a stop request)',
    'checkpoint.keep': 'the newest checkpoints kept (at least 1)',
    'checkpoint.every_steps': 'also save every this many steps inside an epoch (0: never)',
}


def shown(value) -> str:
  """A value as ``--help`` and ``docs/config.md`` write it after
  ``--config.KEY=``."""
  return repr(value) if isinstance(value, str) else str(value)


def flat(config, prefix: str = '') -> list[tuple[str, object]]:
  """``(dotted key, value)`` of every leaf of ``config`` (a ``ConfigDict``
  or a dict of them), in its order."""
  out = []
  for key, value in config.items():
    if hasattr(value, 'items'):
      out.extend(flat(value, f'{prefix}{key}.'))
    else:
      out.append((f'{prefix}{key}', value))
  return out


def flat_defaults() -> dict[str, dict[str, str]]:
  """Every entry point's keys, ``{key: {entry point: value as --help writes
  it}}``, in the order of their first ``get_config()``."""
  import importlib  # noqa: PLC0415

  out: dict[str, dict[str, str]] = {}
  for name in ENTRY_POINTS:
    config = importlib.import_module(f'experiments.{name}').get_config().to_dict()
    for key, value in flat(config):
      out.setdefault(key, {})[name] = shown(value)
  return out


def markdown() -> str:
  """``docs/config.md``: a table per section of keys, their defaults in each
  entry point (– where it has no such key) and their meanings."""
  defaults = flat_defaults()
  sections: dict[str, list[str]] = {'': []}  # the top-level keys first
  for key in defaults:
    sections.setdefault(key.split('.')[0] if '.' in key else '', []).append(key)
  lines = ['# Config keys', '',
           'Every key of the training entry points, its default in each, and what it does.',
           'Set one with `--config.KEY=VALUE`; `--help` prints every key with the value the',
           'rest of the command line gives it, and this meaning under it. Written by',
           '`python -m experiments.config_keys > docs/config.md` from',
           '`experiments/config_keys.py`; `docs/guide.md` says more of each part.', '']
  for section, keys in sections.items():
    lines += [f'## {section or "top level"}', '',
              '| key | `vit_imagenet` | `bert_glue` | `bert_squad` | meaning |',
              '| --- | --- | --- | --- | --- |']
    for key in keys:
      cells = [f'`{defaults[key][e]}`' if e in defaults[key] else '–' for e in ENTRY_POINTS]
      meaning = MEANINGS.get(key, '').replace('|', '\\|').replace('<', '&lt;')
      lines.append(f'| `{key}` | ' + ' | '.join(cells) + f' | {meaning} |')
    lines.append('')
  return '\n'.join(lines)


if __name__ == '__main__':
  print(markdown(), end='')
