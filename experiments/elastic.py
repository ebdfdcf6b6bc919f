"""The shared body of the elastic training entry points: resolve data and model
from the config, run :class:`pipejax.trainer.Trainer`, write the outputs.

``task`` picks the data and model: ``'vit'`` (ImageNet, digits or synthetic, ViT),
``'bert_glue'`` (a GLUE task, ``FlaxBertForSequenceClassification``; one
output and a mean-squared-error loss for the regression STS-B)
or ``'bert_squad'`` (SQuAD v1.1, ``FlaxBertForQuestionAnswering``)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import errno
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from typing import Callable, Sequence

import jax
import numpy as np
from tqdm import tqdm

import models
from experiments import datasets, text_data, text_eval
from pipejax import (autodp, checkpoints, diskcache, distributed, freeze, frozen_prefix,
                     pipeline, reporting, resume, runtime, schedule)
from pipejax.autocache import CacheMismatchError
from pipejax.data import DataReadError, Loader, ShardedLoader
from pipejax.partition import PartitionError
from pipejax.trainer import (PROFILE_ROUNDS, LossNotFinite, Trainer, TrainingInterrupted,
                             check_batch_for_freezing, meta_problem)


class ConfigError(ValueError):
  """A configuration value outside what the run accepts."""


class TrainingDiverged(RuntimeError):
  """The loss became NaN or infinite (names the step and the last checkpoint)."""


def _log(msg: str) -> None:
  # Through tqdm, so that a line logged during an epoch clears the progress
  # bar (on stderr) first instead of ending up on the bar's line.
  tqdm.write(msg, file=sys.stdout)
  sys.stdout.flush()


def check_config(config, num_devices_available: int) -> None:
  """Validates the values that the library would only reject later."""
  c = config
  if c.train.epochs < 1:
    raise ConfigError(f'train.epochs must be >= 1, got {c.train.epochs}')
  if c.train.batch_size < 1:
    raise ConfigError(f'train.batch_size must be >= 1, got {c.train.batch_size}')
  if not 0 <= c.seed < 2 ** 32:  # numpy's and the data split's range
    raise ConfigError(f'seed must be in [0, 2**32), got {c.seed}')
  if c.train.batch_mode not in ('constant', 'per_pipeline'):
    raise ConfigError(f"train.batch_mode must be 'constant' or 'per_pipeline', got "
                      f'{c.train.batch_mode!r}')
  if c.pipeline.schedule not in schedule.SCHEDULES:
    raise ConfigError(f'pipeline.schedule must be one of {sorted(schedule.SCHEDULES)}, got '
                      f'{c.pipeline.schedule!r}')
  if c.pipeline.exchange not in ('auto',) + pipeline.EXCHANGES:
    raise ConfigError(f"pipeline.exchange must be 'auto' or one of {pipeline.EXCHANGES}, got "
                      f'{c.pipeline.exchange!r}')
  if c.pipeline.devices < 1 or c.pipeline.devices > num_devices_available:
    fits = [k for k in range(1, num_devices_available + 1) if num_devices_available % k == 0]
    also = ('' if c.pipeline.initial_length in fits else
            f'; on all of them, pipeline.initial_length={c.pipeline.initial_length} must become '
            f'one of {fits} too')
    raise ConfigError(f'pipeline.devices={c.pipeline.devices} must be in [1, '
                      f'{num_devices_available}]: {num_devices_available} devices are '
                      f'available{also}')
  n = c.pipeline.devices
  if c.pipeline.initial_length < 1 or n % c.pipeline.initial_length:
    ok = [k for k in range(1, n + 1) if n % k == 0]
    raise ConfigError(f'pipeline.initial_length={c.pipeline.initial_length} does not divide '
                      f'the {n} devices; use one of {ok}')
  if 'image_size' in c.data and c.data.image_size < 1:  # the ViT entry points'
    raise ConfigError(f'data.image_size must be >= 1, got {c.data.image_size}')
  if c.checkpoint.every_steps < 0:
    raise ConfigError(f'checkpoint.every_steps must be >= 0, got {c.checkpoint.every_steps}')
  if c.checkpoint.keep < 1:
    raise ConfigError(f'checkpoint.keep must be >= 1, got {c.checkpoint.keep}')
  if 'workers' in c.data and c.data.workers < 0:  # image data only
    raise ConfigError(f'data.workers must be >= 0 (0: one thread per CPU core), '
                      f'got {c.data.workers}')
  split_gain = c.pipeline.split_mlp_min_gain
  if not 0 <= split_gain <= 1:  # also refuses NaN
    raise ConfigError(f'pipeline.split_mlp_min_gain must be in [0, 1] (1: never split an '
                      f'MLP between stages), got {split_gain}')
  if c.pipeline.micro_batches < 0:
    raise ConfigError(f'pipeline.micro_batches must be >= 0 (0: profiled), got '
                      f'{c.pipeline.micro_batches}')
  if not 0 <= c.train.warmup_epochs < c.train.epochs:
    raise ConfigError(f'train.warmup_epochs={c.train.warmup_epochs} must be >= 0 and below '
                      f'train.epochs={c.train.epochs}')
  if c.freeze.timestep_steps < 0:
    raise ConfigError(f'freeze.timestep_steps must be >= 0, got {c.freeze.timestep_steps}')
  if not (np.isfinite(c.train.learning_rate) and c.train.learning_rate > 0):
    raise ConfigError(f'train.learning_rate must be > 0, got {c.train.learning_rate}')
  if not (np.isfinite(c.train.weight_decay) and c.train.weight_decay >= 0):
    raise ConfigError(f'train.weight_decay must be >= 0, got {c.train.weight_decay}')
  if not (np.isfinite(c.train.max_grad_norm) and c.train.max_grad_norm >= 0):
    raise ConfigError(f'train.max_grad_norm must be >= 0 (0: no clipping), got '
                      f'{c.train.max_grad_norm}')
  if c.train.max_steps_per_epoch < 0:
    raise ConfigError(f'train.max_steps_per_epoch must be >= 0 (0: whole epochs), got '
                      f'{c.train.max_steps_per_epoch}')
  if not 0 <= c.freeze.lambda_frozen <= 1:  # also refuses NaN
    raise ConfigError(f"freeze.lambda_frozen (a frozen layer's cost relative to a trained "
                      f'one) must be in [0, 1], got {c.freeze.lambda_frozen}')
  if c.freeze.timestep_steps and c.train.batch_mode != 'constant':
    raise ConfigError('freeze.timestep_steps needs train.batch_mode=constant (a transition '
                      'inside an epoch cannot change the batch size)')
  if c.train.batch_mode == 'per_pipeline' and c.train.batch_size % c.pipeline.initial_length:
    raise ConfigError(f'train.batch_size={c.train.batch_size} must be a multiple of '
                      f'pipeline.initial_length={c.pipeline.initial_length} with '
                      f'train.batch_mode=per_pipeline (the global batch, train.batch_size x '
                      f'replicas, is split over all {n} devices)')
  if c.train.batch_mode == 'constant' and c.train.batch_size % n:
    raise ConfigError(f'train.batch_size={c.train.batch_size} must be a multiple of the {n} '
                      f'devices (the frozen prefix and evaluation split it over all of them)')
  check_batch_for_freezing(c, n)  # the plans after a freeze (the trainer checks it too)
  if c.pipeline.micro_batches:  # the first plan's R x M (later plans fit M to their batch)
    r = autodp.replicas_for(n, c.pipeline.initial_length, c.pipeline.autodp)
    batch = autodp.global_batch_size(c.train.batch_size, r, c.train.batch_mode)
    if batch % (r * c.pipeline.micro_batches):
      raise ConfigError(f'the global batch {batch} (train.batch_size={c.train.batch_size}) is '
                        f'not divisible by replicas x micro-batches = {r} x '
                        f'{c.pipeline.micro_batches} at pipeline.initial_length='
                        f'{c.pipeline.initial_length}; change train.batch_size or '
                        f'pipeline.micro_batches')
  if c.train.eval_batch_size < 0 or c.train.eval_batch_size % n:
    raise ConfigError(f'train.eval_batch_size={c.train.eval_batch_size} must be 0 (4 x the '
                      f'global batch) or a multiple of the {n} devices')
  if c.cache.policy not in frozen_prefix.CACHE_POLICIES:
    raise ConfigError(f'cache.policy must be one of {frozen_prefix.CACHE_POLICIES}, got '
                      f'{c.cache.policy!r}')
  if c.cache.dtype not in ('float32', 'bfloat16', 'float16'):
    raise ConfigError(f"cache.dtype must be 'float32', 'bfloat16' or 'float16', got "
                      f'{c.cache.dtype!r}')
  if not all(0 <= mb < math.inf for mb in (c.cache.memory_mb, c.cache.disk_mb)):  # NaN too
    raise ConfigError(f'cache.memory_mb and cache.disk_mb must be finite and >= 0, got '
                      f'{c.cache.memory_mb} and {c.cache.disk_mb}')
  if c.cache.enabled and c.cache.disk_mb and c.cache.directory and (
      os.path.lexists(c.cache.directory) and not os.path.isdir(c.cache.directory)):
    raise ConfigError(f'cache.directory={c.cache.directory} is not a folder (the disk tier, '
                      f'cache.disk_mb={c.cache.disk_mb}, keeps its entries in one)')
  if c.cache.on_mismatch not in ('refuse', 'clear'):
    raise ConfigError(f"cache.on_mismatch must be 'refuse' or 'clear', got "
                      f'{c.cache.on_mismatch!r}')
  if c.model.preset == 'custom' and not c.model.pretrained:
    _check_custom_model(c.model)  # the data are not needed for these sizes
  # The ViT's key; a BERT is initialised as its HF config says.
  if 'initializer_range' in c.model and not 0 < c.model.initializer_range < math.inf:
    # NaN too: the first loss would blame training.
    raise ConfigError(f'model.initializer_range must be > 0 and finite, '
                      f'got {c.model.initializer_range}')
  # The layer count bound is checked once the model is built (a preset or a
  # pretrained model need not have model.num_layers blocks).
  freeze.check_config(c.freeze.policy, c.freeze.alpha,
                      max(c.model.num_layers, c.freeze.min_active_layers, 1),
                      c.freeze.min_active_layers)
  if jax.process_count() > 1:
    _check_multi_process(c)


def _check_multi_process(c) -> None:
  """What a job of several processes needs on top (see docs/guide.md, Several hosts)."""
  local = jax.local_device_count()
  if c.pipeline.devices != jax.device_count():
    raise ConfigError(f'pipeline.devices={c.pipeline.devices} must be all {jax.device_count()} '
                      f'devices of the {jax.process_count()} processes')
  if c.pipeline.initial_length > local or local % c.pipeline.initial_length:
    ok = [k for k in range(1, local + 1) if local % k == 0]
    raise ConfigError(f'pipeline.initial_length={c.pipeline.initial_length} does not fit in '
                      f'one process ({local} devices each; the stage axis stays inside a '
                      f'host); use one of {ok}')
  if not c.pipeline.micro_batches:
    raise ConfigError('pipeline.micro_batches=0 (profiling M) is not supported with several '
                      'processes (each would time its own steps and could choose another M); '
                      'set it, e.g. --config.pipeline.micro_batches=4')
  if not c.pipeline.autodp:
    raise ConfigError('pipeline.autodp=False is not supported with several processes (its one '
                      "pipeline would run on process 0's devices alone, with no share of the "
                      'batch for the others)')


TASKS = ('vit', 'bert_glue', 'bert_squad')


def _tokenizer_path(config) -> str:
  return config.model.tokenizer or config.model.pretrained


def _check_data_dir(config, why: str = '') -> None:
  """A local ``data.data_dir`` that is not a directory, refused (TFDS would
  report a missing file format); a remote one (``gs://``) is TFDS's to read."""
  data_dir = config.data.data_dir
  if data_dir and '://' not in data_dir and not os.path.isdir(os.path.expanduser(data_dir)):
    raise ConfigError(f'data.data_dir={data_dir} is not a directory{why}')


def resolve_data(config, task: str = 'vit'):
  """The task's data set (:class:`datasets.Dataset` or
  :class:`text_data.TextDataset`, with its evaluator for text tasks). The
  settings that can be refused without the data are, first."""
  check_settings_without_data(config, task)
  if task in ('bert_glue', 'bert_squad'):
    _check_data_dir(config)
  if task == 'bert_glue':
    name, _ = text_data.glue_task(config.data.name)
    data = text_data.glue(config.data.name, _tokenizer_path(config), config.data.max_seq_length,
                          config.data.data_dir)
    data.evaluator = text_eval.GlueEvaluator(name, data.eval.arrays['labels'], data.more_eval)
    return data
  if task == 'bert_squad':
    if config.data.name != 'squad/v1.1':
      raise ConfigError(f"data.name must be 'squad/v1.1', got {config.data.name!r}")
    for key in ('n_best_size', 'max_answer_length'):
      if config.data[key] < 1:
        raise ConfigError(f'data.{key} must be >= 1, got {config.data[key]}')
    data, features = text_data.squad(_tokenizer_path(config), config.data.max_seq_length,
                                     config.data.doc_stride, config.data.data_dir)
    data.evaluator = text_eval.SquadEvaluator(features, config.data.n_best_size,
                                              config.data.max_answer_length)
    return data
  if task != 'vit':
    raise ConfigError(f'unknown task {task!r}; expected one of {TASKS}')
  name = config.data.name
  if name == 'digits':
    return _digits(config)
  if name == 'synthetic':
    _log(f'data.name=synthetic: ImageNet-shaped random images of {config.data.image_size}x'
         f'{config.data.image_size} and random labels, for measuring speed (accuracy stays '
         f'at chance)')
    try:
      return datasets.synthetic(config.data.image_size, seed=config.seed)
    except MemoryError as e:  # its pool of images, made at once
      raise ConfigError(f'data.image_size={config.data.image_size}: the synthetic images do not '
                        f'fit in memory; use a smaller one') from e
  # 'auto' or 'imagenet2012' (data.name was checked first)
  data_dir = config.data.data_dir
  _check_data_dir(config, ' (data.name=auto falls back to the digits only where ImageNet is '
                  'absent)' if name == 'auto' else '')
  # 'auto' looks for a prepared copy first: without one, TFDS is not even imported.
  # A local copy that looks prepared but cannot be read is an error, never the
  # fallback; on a remote file system only TFDS can tell absent from broken.
  reason = datasets.imagenet_missing(data_dir) if name == 'auto' else None
  if reason is None:
    try:
      return datasets.imagenet(data_dir, config.data.image_size,
                               make_processor=lambda: _image_processor(config),
                               workers=config.data.workers or None)
    except datasets.DatasetMissing as e:
      root = data_dir or os.environ.get('TFDS_DATA_DIR', '')
      if name != 'auto' or '://' not in root:
        raise
      reason = str(e).split(';')[0]
  _log(f'ImageNet not found ({reason}); running the embedded default: '
       f'scikit-learn digits with {config.pipeline.devices} devices')
  return _digits(config)


#: The data sets of the ViT task (``data.name``).
VIT_DATA = ('auto', 'imagenet2012', 'digits', 'synthetic')


def check_settings_without_data(config, task: str) -> None:
  """Refuses the settings that need no data set to refuse (a
  :class:`ConfigError`): ``model.kind``, a BERT tokenizer that does not fit
  the model, and a ViT ``data.name`` other than :data:`VIT_DATA`."""
  check_kind(config, task)
  if task in ('bert_glue', 'bert_squad'):
    check_tokenizer_fits(config)  # before any text is tokenized
  if task == 'vit' and config.data.name not in VIT_DATA:
    names = ', '.join(map(repr, VIT_DATA[:-1]))
    raise ConfigError(f'data.name must be {names} or {VIT_DATA[-1]!r}, got '
                      f'{config.data.name!r}')


def _digits(config) -> datasets.Dataset:
  """The embedded digits; a ``data.image_size`` other than the default is
  said to have no effect on them (they are 8x8), in one line."""
  if config.data.image_size != datasets.DEFAULT_IMAGE_SIZE:
    _log(f'note: data.image_size={config.data.image_size} applies to ImageNet and synthetic '
         f'data; the digits stay 8x8')
  return datasets.digits(seed=config.seed)


#: The files a run writes into its workdir (beside ``checkpoints/``).
RUN_FILES = ('metrics.jsonl', 'summary.json', 'summary.png')
SAMPLE_IDS = 'sample_ids'  # process_<i>.json of each process of a sharded run
REPLACED = 'replaced'  # a run's outputs that --config.resume=False moved aside (_start_over)
_REPLACED_MARK = '.pipejax-replaced'  # in REPLACED: made by _start_over, names the phase
_REPLACED_PHASES = ('moving', 'replaced', 'clearing', 'returning')
LOCK_FILE = '.lock'  # held by the run writing the workdir (lock_workdir)


def check_workdir(workdir: str, checkpoints_enabled: bool,
                  files: tuple[str, ...] = RUN_FILES) -> None:
  """Creates ``workdir`` if needed; the paths of the outputs it will write
  (``files``, and ``checkpoints/`` when enabled) must be free or of the right
  kind (before training, not at the first save)."""
  problem = diskcache.outputs_problem(workdir, files, ('checkpoints',) * checkpoints_enabled)
  if problem:
    raise ConfigError(f'cannot use --workdir={workdir}: {problem}')


def _fresh_workdir(task: str) -> str:
  """A new folder ``runs/<task>-<date>-<time>`` (``-2``, ``-3``, … when a run
  started in the same second already took it): a run without ``--workdir``
  never resumes or overwrites another one."""
  base = os.path.join('runs', f'{task}-{datetime.datetime.now().strftime("%Y%m%d-%H%M%S")}')
  os.makedirs('runs', exist_ok=True)
  path, n = base, 1
  while True:
    try:
      os.mkdir(path)  # atomic: two runs cannot both create it
      return path
    except FileExistsError:
      n += 1
      path = f'{base}-{n}'


def _pretrained(kind: str, path: str, num_labels: int, seed: int) -> models.Created:
  """``model.pretrained`` loaded with a new head of ``num_labels`` classes
  (initialised from ``seed``); a path or hub name that does not load is a
  :class:`ConfigError`."""
  try:
    return models.create(kind, pretrained=path, num_labels=num_labels, seed=seed)
  except ValueError as e:
    raise ConfigError(f'model.pretrained: {e}') from e


def match_head_labels(created: models.Created, label_names: Sequence[str],
                      data_name: str) -> models.Created:
  """A pretrained classifier whose checkpoint names its classes (the HF
  config's ``id2label``) in another order than the data set's: its outputs
  reordered to the data's order, as HF's ``run_glue`` maps a checkpoint's
  labels (names compared without case); one line says so. A head whose names
  are not the data's is kept as it is, with a warning line; unnamed classes
  (``LABEL_0``, …: a new head, or a checkpoint without names) are left alone."""
  hf = created.model.hf_config
  n = len(label_names)
  if not n or getattr(hf, 'num_labels', 0) != n or 'classifier' not in created.params['head']:
    return created
  names = [str(hf.id2label.get(i, f'LABEL_{i}')) for i in range(n)]
  if all(name == f'LABEL_{i}' for i, name in enumerate(names)):
    return created
  have, want = [x.lower() for x in names], [x.lower() for x in label_names]
  if have == want:
    return created
  if sorted(have) != sorted(want) or len(set(want)) != n:
    _log(f'warning: the pretrained head names its classes {names}, {data_name} names them '
         f'{list(label_names)}: the head is used in its own order')
    return created
  order = np.array([have.index(name) for name in want])  # data class j: the head's order[j]
  head = created.params['head']
  classifier = {'kernel': head['classifier']['kernel'][:, order],
                'bias': head['classifier']['bias'][order]}
  hf = copy.deepcopy(hf)  # the caller's model and config stay as they were
  hf.id2label = {i: names[k] for i, k in enumerate(order.tolist())}
  hf.label2id = {name: i for i, name in hf.id2label.items()}
  _log(f'the pretrained head\'s classes {names} are reordered to {data_name}\'s order '
       f'{list(label_names)}')
  return dataclasses.replace(created, model=models.build(created.model.name, hf),
                             params={**created.params, 'head': {**head, 'classifier': classifier}})


def _check_custom_model(m) -> None:
  """The sizes of a ``model.preset='custom'`` model that HF would reject later."""
  for key in ('num_layers', 'hidden_size', 'num_heads', 'intermediate_size'):
    if m[key] < 1:
      raise ConfigError(f'model.{key} must be >= 1, got {m[key]}')
  if m.hidden_size % m.num_heads:
    raise ConfigError(f'model.hidden_size={m.hidden_size} must be a multiple of '
                      f'model.num_heads={m.num_heads}')
  if not 0 <= m.dropout < 1:  # also refuses NaN
    raise ConfigError(f'model.dropout must be in [0, 1), got {m.dropout}')


def check_tokenizer_fits(config) -> None:
  """Refuses, before any data is tokenized, a tokenizer with more tokens than
  the pretrained model embeds (the embedding's gather gives NaN for the rest)
  and a ``data.max_seq_length`` beyond its position embeddings: reads the
  model's config only, not its weights."""
  m = config.model
  if not m.pretrained:
    return  # a preset is sized to its tokenizer
  from transformers import AutoConfig  # noqa: PLC0415
  try:
    hf = AutoConfig.from_pretrained(m.pretrained)
    vocab, positions = hf.vocab_size, int(hf.max_position_embeddings)
  except Exception:  # noqa: BLE001 - loading the model says what is wrong, in one line
    return
  if config.data.max_seq_length > positions:  # before a whole data set is tokenized that long
    raise ConfigError(f'data.max_seq_length={config.data.max_seq_length} exceeds the model\'s '
                      f'{positions} position embeddings (model.pretrained={m.pretrained}; '
                      f'checked before the data is tokenized)')
  words = len(text_data.load_tokenizer(_tokenizer_path(config)))
  if words > vocab:
    raise ConfigError(f'the tokenizer of {_tokenizer_path(config)!r} has {words} tokens, the '
                      f'model {m.pretrained!r} embeds {vocab}: use the model\'s own tokenizer '
                      f'(leave model.tokenizer empty)')


def _image_processor(config):
  """``model.pretrained``'s HF image processor for ImageNet, or None (no
  checkpoint, or one saved without a processor)."""
  path = config.model.pretrained
  if not path:
    return None
  try:
    return datasets.image_processor(path, config.data.image_size, log=_log)
  except ValueError as e:
    raise ConfigError(f'model.pretrained: {e}') from e


def check_kind(config, task: str) -> None:
  """``model.kind`` names the entry point's model; another one is refused."""
  kind = config.model.kind
  if task in KINDS and kind != KINDS[task]:
    raise ConfigError(f'model.kind names the model of this entry point, {KINDS[task]!r}; got '
                      f'{kind!r} (another model needs another entry point)')


def _bert_model(config, data: text_data.TextDataset, kind: str) -> models.Created:
  """A pretrained BERT (``model.pretrained``) or a randomly initialised preset
  sized to the tokenizer's vocabulary."""
  m = config.model
  if m.pretrained:
    created = _pretrained(kind, m.pretrained, data.num_classes, config.seed)
    if getattr(data, 'label_names', ()):  # GLUE's classes, named by TFDS
      created = match_head_labels(created, data.label_names, data.name)
    hf = created.model.hf_config
    types = max((int(np.max(split.arrays['token_type_ids'])) + 1
                 for split in (getattr(data, 'train', None), getattr(data, 'eval', None))
                 if split is not None and len(split.arrays['token_type_ids'])), default=1)
    if types > getattr(hf, 'type_vocab_size', 2):  # sentence pairs on a one-type model
      raise ConfigError(f'model {m.pretrained!r} has {hf.type_vocab_size} token type(s); the '
                        f'data use {types} (sentence pairs)')
  else:
    presets = [k for k, v in models.PRESETS.items() if v[0].startswith('bert')]
    if m.preset == 'custom':
      _check_custom_model(m)
      overrides = dict(hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                       num_attention_heads=m.num_heads, intermediate_size=m.intermediate_size,
                       hidden_dropout_prob=m.dropout, attention_probs_dropout_prob=m.dropout)
    elif m.preset in presets:
      overrides = dict(models.PRESETS[m.preset][1])
    else:
      raise ConfigError(f"model.preset must be 'custom' or one of {presets}, got {m.preset!r}")
    vocab = len(text_data.load_tokenizer(_tokenizer_path(config)))
    overrides.update(vocab_size=vocab, num_labels=data.num_classes,
                     max_position_embeddings=max(512, data.max_seq_length))
    created = models.create(kind, models.config_for(kind, **overrides), seed=config.seed,
                            init_cache=runtime.init_cache_dir(), log=_log)
  limit = created.model.hf_config.max_position_embeddings
  if data.max_seq_length > limit:
    raise ConfigError(f'data.max_seq_length={data.max_seq_length} exceeds the model\'s '
                      f'{limit} position embeddings')
  return created


KINDS = {'vit': 'vit', 'bert_glue': 'bert-classification',
         'bert_squad': 'bert-question_answering'}  # each entry point's model.kind


def resolve_model(config, data, task: str = 'vit') -> models.Created:
  """The task's model: ViT, or BERT with a classification / QA head
  (``model.kind`` is checked by :func:`resolve_data`, which comes first)."""
  if task == 'bert_glue':
    return _bert_model(config, data, 'bert-classification')
  if task == 'bert_squad':
    return _bert_model(config, data, 'bert-question_answering')
  m = config.model
  if m.pretrained:
    created = _pretrained('vit', m.pretrained, data.num_classes, config.seed)
    hf = created.model.hf_config
    if (hf.num_channels, hf.image_size) != (data.channels, data.image_size):
      raise ConfigError(f'model.pretrained: {m.pretrained!r} takes {hf.image_size}x'
                        f'{hf.image_size} images of {hf.num_channels} channels, the data '
                        f'{data.name} has {data.image_size}x{data.image_size} of '
                        f'{data.channels}' + (' (set data.image_size)' if (
                            hf.num_channels == data.channels
                            and data.name != 'digits') else ''))
    return created
  preset = m.preset
  if preset == 'auto':
    preset = 'custom' if data.name == 'digits' else 'vit-b16'
  if preset == 'custom':
    _check_custom_model(m)
    overrides = dict(hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                     num_attention_heads=m.num_heads, intermediate_size=m.intermediate_size,
                     patch_size=m.patch_size, initializer_range=m.initializer_range,
                     hidden_dropout_prob=m.dropout, attention_probs_dropout_prob=m.dropout)
  elif preset in models.PRESETS and models.PRESETS[preset][0] == 'vit':
    overrides = dict(models.PRESETS[preset][1])
  else:
    vits = [k for k, v in models.PRESETS.items() if v[0] == 'vit']
    raise ConfigError(f"model.preset must be 'auto', 'custom' or one of {vits}, got {preset!r}")
  overrides.update(image_size=data.image_size, num_channels=data.channels,
                   num_labels=data.num_classes)
  patch = overrides.get('patch_size', models.config_for('vit').patch_size)
  if not 1 <= patch <= data.image_size or data.image_size % patch:
    # HF would cut the image's last rows and columns, or see no patch at all.
    source = 'model.patch_size' if preset == 'custom' else f'model.preset={preset}'
    raise ConfigError(f'the patch size {patch} ({source}) must divide the {data.image_size}x'
                      f'{data.image_size} images of {data.name}' + (
                          '' if preset == 'custom' else
                          '; use model.preset=custom with a model.patch_size that does'))
  return models.create('vit', models.config_for('vit', **overrides), seed=config.seed,
                       init_cache=runtime.init_cache_dir(), log=_log)


@contextlib.contextmanager
def _progress(epoch: int, total: int):
  bar = tqdm(total=total, desc=f'epoch {epoch}', leave=False, dynamic_ncols=True,
             file=sys.stderr, mininterval=1.0)
  try:
    yield bar
  finally:
    bar.close()


def _all_processes_here(value: float = 0.0) -> float:
  """With several processes, returns once every process has called it (what
  process 0 did to the workdir's files before is then done for all), with
  process 0's ``value``: every process then decides the same."""
  if jax.process_count() > 1:
    return float(distributed.gather_exact([value])[0, 0])
  return value


def _replaced(workdir: str) -> tuple[str, str] | None:
  """``(workdir/replaced, its phase)`` where :func:`_start_over` made it (its
  mark inside names the phase), else None. Phases: ``moving`` (the old run's
  outputs going in), ``replaced`` (all in), ``clearing`` (the new run's
  outputs being removed to put them back), ``returning`` (going back)."""
  path = os.path.join(workdir, REPLACED)
  try:
    with open(os.path.join(path, _REPLACED_MARK), encoding='utf-8') as f:
      phase = f.read().strip()
  except (OSError, ValueError):
    return None
  return path, phase if phase in _REPLACED_PHASES else 'replaced'


def _set_phase(replaced: str, phase: str) -> None:
  diskcache.write_atomic(os.path.join(replaced, _REPLACED_MARK), lambda f: f.write(phase))


def _outputs(workdir: str) -> list[str]:
  """A run's outputs in ``workdir``, relative: its run files, its processes'
  sample-ID records and its checkpoints (steps, set aside, unfinished)."""
  found = [name for name in RUN_FILES if os.path.isfile(os.path.join(workdir, name))]
  ids = os.path.join(workdir, SAMPLE_IDS)
  if os.path.isdir(ids):
    found += [os.path.join(SAMPLE_IDS, n) for n in sorted(os.listdir(ids))
              if re.fullmatch(r'process_\d+\.json', n)]
  return found + [os.path.join('checkpoints', n) for n in checkpoints.own_entries(workdir)]


def _move(names: list[str], source: str, target: str | None) -> None:
  """Moves ``names`` (relative paths) from ``source`` to ``target``, then
  the run's folders that this emptied; with ``target`` None removes them and
  keeps the folders (an orbax thread of the run just closed may still look
  at ``checkpoints/``)."""
  for name in names:
    path = os.path.join(source, name)
    if target is None:
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
      else:
        os.remove(path)
    else:
      os.makedirs(os.path.dirname(os.path.join(target, name)), exist_ok=True)
      os.replace(path, os.path.join(target, name))
  for sub in (SAMPLE_IDS, 'checkpoints') if target is not None else ():
    try:
      os.rmdir(os.path.join(source, sub))
    except OSError:
      pass  # not empty (the user's files stay), or none


def _start_over(workdir: str, checkpoints_enabled: bool = True) -> bool:
  """Moves a previous run's outputs (:func:`_outputs`) out of ``workdir``
  for ``--config.resume=False``, into ``workdir/replaced``:
  :func:`_drop_replaced` removes them once the new run has a finished
  checkpoint, and :func:`_recover` puts them back where it fails before (a
  value no check refuses, which makes the first loss NaN). The moves are
  journaled (:func:`_replaced`'s phases), so that a kill at any point loses
  nothing. Where ``replaced`` already holds a run's outputs (a start over
  killed before its first checkpoint), they stay and what the killed run
  left is removed. Refuses, moving nothing, a checkpoint folder or a
  ``replaced`` of another program's. Process 0 alone looks and moves (call
  :func:`_recover` first); returns whether ``replaced`` holds outputs that
  the new run replaces."""
  if jax.process_index() != 0:
    return False
  checkpoints.check_own(workdir)
  replaced = os.path.join(workdir, REPLACED)
  state = _replaced(workdir)
  if os.path.lexists(replaced) and state is None:
    raise ConfigError(f'{replaced} is not pipejax\'s (starting over moves the run\'s outputs '
                      f'there): move it out of {workdir}, or use another --workdir')
  outputs = _outputs(workdir)
  if not outputs:
    return state is not None
  shown = sorted({name.split(os.sep)[0] for name in outputs})
  if state is not None:  # the killed run's: no checkpoint (_recover dropped them otherwise)
    _move(outputs, workdir, None)
    _log(f'starting over in {workdir} (--config.resume=False): removed {", ".join(shown)} of '
         f'a run that ended before its first checkpoint; {replaced} keeps the outputs it '
         f'replaced')
    return True
  fresh = os.path.join(workdir, f'.{REPLACED}.new-{time.time_ns()}')
  os.makedirs(fresh)
  _set_phase(fresh, 'moving')
  os.rename(fresh, replaced)  # appears marked, or not at all
  try:
    _move(outputs, workdir, replaced)
  except OSError as e:
    if e.errno != errno.EXDEV:
      raise
    # The caller puts back what moved (_recover).
    raise ConfigError(f'cannot start over in {workdir}: {e.filename} is on another file '
                      f'system than {replaced} (a link?), and starting over moves the run\'s '
                      f'outputs there; move them out yourself, or use another --workdir') from e
  _set_phase(replaced, 'replaced')
  _log(f'starting over in {workdir} (--config.resume=False): moved {", ".join(shown)} to '
       f'{replaced}, removed once this run ' +
       ('has a checkpoint' if checkpoints_enabled else 'has finished'))
  return True


def _drop_replaced(workdir: str) -> bool:
  """Removes ``workdir/replaced`` (:func:`_start_over`): the run that
  replaced its outputs has a finished checkpoint (or, without checkpoints,
  has finished). Renamed first: a removal that fails or is killed halfway
  leaves a folder that the next run sweeps (:func:`_recover`), never a
  ``replaced`` to put back. False (said) where the rename failed."""
  state = _replaced(workdir)
  if state is None or jax.process_index() != 0:
    return True
  if not _remove_folder(workdir, state[0]):
    return False
  _log(f'removed {state[0]}: the outputs of a run that the one in {workdir} replaced')
  return True


def _remove_folder(workdir: str, folder: str) -> bool:
  """Renames ``folder`` to ``.replaced.removing-<ns>`` and removes that:
  whatever stops it, the next run sweeps what is left (:func:`_recover`).
  False (said) where the rename fails: the folder is kept, and the next run
  tries again."""
  doomed = os.path.join(workdir, f'.{REPLACED}.removing-{time.time_ns()}')
  try:
    os.rename(folder, doomed)
  except OSError as e:
    _log(f'could not remove {folder} ({e}); the next run tries again')
    return False
  shutil.rmtree(doomed, ignore_errors=True)  # what stays is swept by the next run
  return True


def _recover(workdir: str, resume_: bool = True) -> None:
  """Settles what a start over left in ``workdir`` (process 0; see
  :func:`_start_over`), before anything else reads the workdir:

  - a move stopped halfway (``moving``, ``returning``) is undone or
    finished: the old run's outputs return, nothing is removed;
  - with a finished checkpoint in the workdir, the run that replaced them
    reached it: ``replaced`` is dropped (a removal that failed or was killed);
  - otherwise the run that replaced them ended before its first checkpoint:
    with ``resume_`` they are put back (``clearing``: the later run's outputs
    removed; ``returning``: the old ones moved back); without, they stay for
    :func:`_start_over`.

  Folders of removals killed halfway are swept first."""
  if jax.process_index() != 0:
    return
  for name in os.listdir(workdir):
    if name.startswith((f'.{REPLACED}.removing-', f'.{REPLACED}.new-')):
      shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
  state = _replaced(workdir)
  if state is None:
    return
  replaced, phase = state
  # A finished checkpoint, or (checkpoints off) a summary, is the later run's.
  if phase in ('replaced', 'clearing'):
    # What clearing removes is the later run's: another program's step folder
    # is refused, as starting over refuses it.
    try:
      checkpoints.check_own(workdir)
    except checkpoints.CheckpointError as e:
      raise ConfigError(f'{e}; {replaced} keeps the outputs of the run that a start over '
                        f'replaced') from e
  if phase == 'replaced' and (checkpoints.has_finished(workdir) or
                              os.path.exists(os.path.join(workdir, 'summary.json'))):
    if not _drop_replaced(workdir):
      raise ConfigError(f'cannot remove {replaced}, the outputs of a run that a later one '
                        f'replaced (see above); remove it by hand')
    return
  if phase == 'replaced' and not resume_:
    return
  try:
    if phase in ('replaced', 'clearing'):
      _set_phase(replaced, 'clearing')
      _move(_outputs(workdir), workdir, None)  # the later run's: no checkpoint finished
      _set_phase(replaced, 'returning')
    _move(_outputs(replaced), replaced, workdir)
    _remove_folder(workdir, replaced)  # the mark, and a killed write's temporary file
  except (OSError, checkpoints.CheckpointError) as e:
    # Journaled: the next run goes on from where this stopped.
    raise ConfigError(f'cannot put the outputs in {replaced} back into {workdir} yet ({e}); '
                      f'they are safe there: once the cause is fixed (e.g. disk space freed), '
                      f'the same command without --config.resume=False puts them back before '
                      f'it starts') from e
  _log(f'the outputs of the run that --config.resume=False replaced are back in {workdir}: ' + (
      'that start over was stopped while it moved them' if phase == 'moving' else
      'the run that replaced them ended before its first checkpoint'))


def _summary_epochs(summary: dict | None) -> int | None:
  """The epochs a finished run's ``summary.json`` was written for (None
  when it does not say)."""
  try:
    epochs = summary['config']['train']['epochs']
  except (TypeError, KeyError):
    return None
  return epochs if isinstance(epochs, int) else None


def _finished_summary(path: str, repair: bool = True) -> dict | None:
  """A finished run's ``summary.json``; None when it cannot be read, and then
  (``repair``) with the file set aside and one line: the run writes it again
  from its checkpoint and metrics rows."""
  try:
    with open(path) as f:
      summary = json.load(f)
    if not isinstance(summary, dict):
      raise ValueError('not a JSON object')
    return summary
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not repair:
      return None
    why = f'{type(e).__name__}: {str(e)[:120]}'
    if jax.process_count() > 1:  # every process reads it: none may move it under the others
      raise ConfigError(f'{path} is unreadable ({why}); move it away and run again (the run '
                        f'writes it again from its checkpoint and metrics)') from e
    aside = diskcache.aside_name(path)
    os.replace(path, aside)
    _log(f'{path} is unreadable ({why}); set aside as {aside}, written again from the run\'s '
         f'checkpoint and metrics')
    return None


def _resume(workdir: str, trainer: Trainer, ckpt, ident: dict) -> None:
  """Continues ``trainer`` from the newest readable checkpoint (if any) and
  keeps only the metrics rows of the epochs it had finished."""
  restored = ckpt.restore(
      lambda meta: trainer.abstract_portable(), _log) if ckpt is not None else None
  if restored is None:
    rows = reporting.read_rows(workdir)
    aside = checkpoints.set_aside(workdir)
    finished = os.path.exists(os.path.join(workdir, 'summary.json'))
    # Rows of a run without checkpoints (checkpoint.enabled=False, plain_dp;
    # rows written before pipejax said so have no 'checkpointed').
    unsaved = any(r.get('checkpointed') is False for r in rows)
    # Only the last row's save may have been cut short (each save waits for
    # the one before): a checkpointed row before it had a checkpoint, since gone.
    # (A finished run's last save completed too.)
    gone = any(r.get('checkpointed') for r in (rows if finished else rows[:-1]))
    if rows and (aside or finished or unsaved or gone):
      # A finished run's results, those of a run whose checkpoints could not
      # be read or are gone, or of one that wrote none: never dropped without
      # --config.resume=False. (Rows without any of these are a crash's before
      # its first checkpoint was complete: the same command redoes them.)
      raise checkpoints.CheckpointError(
          f'{workdir} holds {len(rows)} metrics rows of an earlier run but no readable '
          f'checkpoint (' + (f'set aside as unreadable: {", ".join(aside)}' if aside else
                             'its checkpoints are gone' if finished and gone else
                             'that run finished without checkpoints' if finished else
                             'that run wrote none: checkpoint.enabled=False, or plain_dp'
                             if unsaved else 'its checkpoints are gone')
          + '); use another --workdir, or --config.resume=False to start over')
    dropped = reporting.keep_rows(workdir, 0)
    if dropped:
      _log(f'no checkpoint in {workdir}: starting from the beginning (dropped {dropped} '
           f'metrics rows of a run stopped before its first checkpoint)')
    return
  state, meta, path = restored
  resume.check_identity(meta, ident, path)  # a fallback checkpoint is checked too
  trainer.restore(state, meta)
  finished = meta['epoch'] + int(meta['epoch_done'])
  dropped = reporting.keep_rows(workdir, finished, meta.get('row'))
  _log(f'resuming from {path}' + (f' (dropped {dropped} metrics rows written after it)'
                                  if dropped else ''))
  held = {r['epoch'] for r in reporting.read_rows(workdir)}
  missing = [e for e in range(finished) if e not in held]
  if missing and jax.process_index() == 0:  # emptied or removed by hand: said, not made up
    # (process 0 alone rewrote the rows: the others may read them before it)
    shown = ', '.join(map(str, missing[:5])) + (', ...' if len(missing) > 5 else '')
    _log(f'note: {os.path.join(workdir, "metrics.jsonl")} lacks the rows of {len(missing)} '
         f'epoch{"s" * (len(missing) > 1)} the checkpoint has trained ({shown}): the rows '
         f'and the summary go on without them')


#: Config keys that name a local file or folder: a leading ``~`` in them is the
#: user's home (the shell does not expand it after ``--config.KEY=``).
PATH_KEYS = ('data.data_dir', 'model.pretrained', 'model.tokenizer', 'cache.directory',
             'pipeline.profile_path')


def expand_user_paths(config, workdir: str | None) -> str | None:
  """Expands a leading ``~`` in :data:`PATH_KEYS` (in place) and returns
  ``workdir`` expanded the same way."""
  with config.unlocked():
    for dotted in PATH_KEYS:
      section, key = dotted.split('.')
      value = config[section].get(key) if section in config else None
      if isinstance(value, str) and value.startswith('~'):
        config[section][key] = os.path.expanduser(value)
  return os.path.expanduser(workdir) if workdir else workdir


def run(config, workdir: str | None, task: str,
        stop_requested: Callable[[], bool] | None = None) -> dict:
  """Runs one elastic (or baseline) training; returns the summary.

  With ``config.resume`` (the default) a workdir holding checkpoints of a
  run continues from the newest readable one (plan recomputed if the device
  count changed); ``config.resume=False`` starts over, moving the old
  outputs aside until the new run's first checkpoint (:func:`_start_over`).
  ``stop_requested`` is polled after every step (see
  :class:`pipejax.resume.StopOnSignal`): when True the run saves and raises
  :class:`pipejax.trainer.TrainingInterrupted` (a start over stopped before
  its first checkpoint saves nothing and puts the replaced run back). The
  workdir is claimed for the run (:func:`lock_workdir`): a second run
  started on it meanwhile is refused.
  """
  with contextlib.ExitStack() as held:
    try:
      return _run(config, workdir, task, stop_requested, held)
    except BaseException:
      distributed.wait_if_leaving()  # another process failed: its line ends this one
      raise


def lock_workdir(workdir: str, held: contextlib.ExitStack,
                 log: Callable[[str], None] = print) -> None:
  """Claims ``workdir`` for this run until ``held`` closes: ``<workdir>/.lock``,
  which process 0 of a job of several takes too (so a one-process run and a
  job exclude each other), the other processes ``.lock.process_<i>``. Two
  runs writing one workdir would mix their rows and checkpoints: another live
  run on it is a :class:`ConfigError` naming it, on every process of the job
  at once (collective with several processes). Where the file system cannot
  lock, a warning and no claim."""
  index = jax.process_index()
  path = os.path.join(workdir, LOCK_FILE if index == 0 else f'{LOCK_FILE}.process_{index}')
  lock = refusal = None
  try:
    lock = diskcache.FolderLock(path)
  except diskcache.InUseError as e:
    refusal = f'--workdir={workdir} is in use by another run ({e})'
  except OSError as e:
    log(f'warning: cannot lock {path} ({e.strerror or e}): nothing keeps another run from '
        f'writing into {workdir} at the same time')
  if jax.process_count() > 1:
    who = distributed.processes_where(refusal is not None)
    if who and refusal is None:
      refusal = (f'--workdir={workdir} is in use by another run (refused on '
                 f'{distributed.name_processes(who)})')
  if lock is not None:
    held.callback(lock.release)
  if refusal is not None:
    raise ConfigError(f'{refusal}: wait for it to end or stop it, or use another --workdir')


def _claim_workdir(workdir: str, checkpoints_enabled: bool, held: contextlib.ExitStack) -> None:
  """Makes ``workdir`` ready (:func:`check_workdir`), holds it for the run
  until ``held`` closes (:func:`lock_workdir`) and, with several processes,
  checks that it is one folder for all of them, before anything is written
  there. Collective with several processes."""
  check_workdir(workdir, checkpoints_enabled)
  served = os.path.join(workdir, 'sample_ids')  # a sharded run's (_write_served_ids), at its end
  if os.path.lexists(served) and not os.path.isdir(served):
    raise ConfigError(f'cannot use --workdir={workdir}: {served} is a file, where a run over '
                      f'data shards writes its folder sample_ids')
  lock_workdir(workdir, held, _log)
  distributed.check_shared_folder(workdir)


def _run(config, workdir: str | None, task: str, stop_requested: Callable[[], bool] | None,
         held: contextlib.ExitStack) -> dict:
  """:func:`run`, holding what it claims until ``held`` closes."""
  start = time.perf_counter()
  workdir = expand_user_paths(config, workdir)
  distributed.initialize(config, _log)  # before any JAX computation
  distributed.watch_for_failures(_checkpoint_dir(workdir))  # another process's error ends this one
  # Together, on every process: another configuration, or a workdir given
  # to some processes only or elsewhere; given to none, the error just below.
  distributed.check_same_config(config, workdir)
  if not workdir and jax.process_count() > 1:  # before the data and the model load
    raise ConfigError('a run of several processes needs --workdir (the same folder for '
                      'every process)')
  devices_available = len(jax.devices())
  check_config(config, devices_available)
  _data_shards(config, jax.process_count())  # what the loaders need, before the data load
  if config.cache.enabled and config.cache.directory and not config.cache.disk_mb:
    _log(f'note: cache.directory={config.cache.directory} is not used: cache.disk_mb=0 '
         f'keeps the cache in memory only')
  if jax.process_count() > 1 and task in ('bert_glue', 'bert_squad'):
    # Before the data set is read and tokenized on every process.
    raise ConfigError(f'{task} evaluates on one process only (its evaluator reads whole '
                      f'batches); run it without distributed.coordinator')
  devices = distributed.ordered_devices()[:config.pipeline.devices]
  if jax.process_count() > 1:
    # A job's workdir (given, as checked above) is claimed and checked for
    # being one shared folder before every host reads its data and model,
    # which can take minutes; the settings refused without them come first.
    # One process claims it below: a data set or model that fails to load
    # then leaves no new folder behind.
    check_settings_without_data(config, task)
    _claim_workdir(workdir, config.checkpoint.enabled, held)
  data = resolve_data(config, task)
  # 'auto' looks on each host's own disk: every process must have found the same.
  distributed.check_same_data(config, f'{data.name}, {len(data.train)} training and '
                                      f'{len(data.eval)} evaluation samples')
  created = resolve_model(config, data, task)
  model = created.model
  if config.freeze.min_active_layers > model.num_layers:
    raise ConfigError(f'freeze.min_active_layers={config.freeze.min_active_layers} exceeds the '
                      f'{model.num_layers} layers')
  if not workdir:
    workdir = _fresh_workdir(task)
  if jax.process_count() == 1:
    _claim_workdir(workdir, config.checkpoint.enabled, held)
  # What a start over left: before anything reads the workdir's outputs.
  _recover(workdir, config.resume)
  _all_processes_here()
  if distributed.is_main_process():  # the one writer of the run's files
    # left by a killed write of one of them; the user's files stay
    diskcache.remove_stale_tmp(workdir, of=RUN_FILES)
  ident = resume.identity(config, model.hf_config.to_dict(),
                          inputs=getattr(data.train, 'preparation', None))
  if (config.resume and not config.checkpoint.enabled
      and os.path.exists(os.path.join(workdir, 'metrics.jsonl'))):
    raise ConfigError(f'{workdir} already holds a run but checkpoint.enabled=False cannot resume '
                      f'it; use --config.resume=False to start over, or another --workdir')
  largest = config.train.batch_size * (len(devices) if config.train.batch_mode == 'per_pipeline'
                                       else 1)
  if largest > len(data.train):
    raise ConfigError(f'the global batch can reach {largest} samples but {data.name} has '
                      f'{len(data.train)} training samples; lower train.batch_size')
  train_loader, eval_loader = _loaders(config, data)
  mode = 'baseline' if config.freeze.policy == 'none' else 'elastic'
  plot_title = f'{mode}: {data.name}, {_describe(model)}'
  meta_base = {'identity': ident, 'fingerprint': resume.fingerprint(ident), 'model': model.name}
  # From here on the checkpoint manager (and its threads) is closed on every exit.
  # Starting over opens it only once the old run is removed, which waits until
  # everything that can refuse this run's config has run: the trainer builds
  # the plan, its loaders and its cache.
  def open_checkpoints():
    return (checkpoints.Checkpoints(workdir, config.checkpoint.keep, meta_problem)
            if config.checkpoint.enabled else None)

  ckpt = open_checkpoints() if config.resume else None
  replacing = [False]  # outputs of a replaced run wait in workdir/replaced

  def save(portable, meta, stopping):
    if ckpt is None:
      return None
    if stopping and replacing[0]:
      # A stop (Ctrl-C, a preemption) before the start over's first regular
      # checkpoint cancels the start over: nothing of it is saved, and the
      # run it replaced comes back (below), instead of going for a step or two.
      return None
    # The trainer saves only a state whose loss and norms are finite. Its
    # first checkpoint on disk (written at once), the replaced run can go.
    ckpt.save(meta['step'], portable, {**meta_base, **meta}, wait=stopping or replacing[0])
    if replacing[0]:
      replacing[0] = False
      _drop_replaced(workdir)
    return ckpt.path(meta['step'])

  trained = False
  failure: BaseException | None = None  # what ended the run, said first if putting back fails
  try:
    latest = ckpt.latest_meta() if ckpt is not None and config.resume else None
    if latest is not None:  # refuse before building anything
      resume.check_identity(latest[0], ident, latest[1])
    _log(f'{mode} run: {data.name}, {_describe(model)}, '
         f'{len(devices)} {devices[0].platform} devices, K0={config.pipeline.initial_length}, '
         f'freeze={config.freeze.policy} α={config.freeze.alpha:.3f} → {workdir}')
    trainer = Trainer(model, created.params, config, workdir, train_loader, eval_loader,
                      devices=devices, log=_log, evaluator=data.evaluator,
                      program_store=runtime.program_store_dir())
    try:  # until trainer.run, which closes it itself
      if latest is not None:
        trainer.check_resumable(latest[0])  # before the state is loaded onto the devices
      if not config.resume:
        # Process 0 moves; the others wait before their orbax lists the steps.
        try:
          moved = _start_over(workdir, config.checkpoint.enabled)
        except BaseException:
          _recover(workdir)  # a move stopped halfway: undone
          raise
        replacing[0] = bool(_all_processes_here(float(moved)))
        ckpt = open_checkpoints()
      else:
        _resume(workdir, trainer, ckpt, ident)
        # Process 0 has dropped the rows after the checkpoint: the others read
        # metrics.jsonl (trainer.run) only after that.
        _all_processes_here()
        done = os.path.join(workdir, 'summary.json')
        past = trainer.epochs_done > config.train.epochs
        finished = _finished_summary(done, repair=not past) if (
            trainer.epochs_done >= config.train.epochs and os.path.exists(done)) else None
        summarized = _summary_epochs(finished)
        if summarized is not None and summarized != trainer.epochs_done:
          # Of the run before it was extended (and stopped after its last
          # epoch, before writing its own): not this run's.
          if not past:
            _log(f'{done} is of the run of {summarized} epochs this one extended to '
                 f'{trainer.epochs_done}: written again for them')
          finished = None
        if finished is not None:
          accuracy = finished.get('final_eval_accuracy')
          _log(f'{workdir} holds a finished run of {trainer.epochs_done} epochs: nothing to '
               f'train, its outputs are kept (--config.train.epochs=N trains on to epoch N, '
               f'--config.resume=False starts over)' + (
                   f'; final eval accuracy {accuracy:.4f}'
                   if isinstance(accuracy, (int, float)) else ''))
          trainer.close()
          png = os.path.join(workdir, 'summary.png')
          if distributed.is_main_process() and not os.path.exists(png):
            reporting.plot_summary(workdir, reporting.read_rows(workdir), plot_title)
            _log(f'{png} was missing: drawn again from {workdir}/metrics.jsonl')
          return finished
        if past:
          raise ConfigError(f'{workdir} holds a run {trainer.epochs_done} epochs in, past '
                            f'train.epochs={config.train.epochs}: use --config.train.epochs='
                            f'{trainer.epochs_done} or more to go on, or --config.resume=False '
                            f'to start over')
    except BaseException:
      trainer.close()
      raise
    agreed = distributed.agreed_stop(stop_requested)

    def poll() -> bool:
      if ckpt is not None:
        ckpt.check()  # a save that failed (a full disk) stops the run now
      return bool(agreed and agreed())

    result = trainer.run(config.train.epochs, _progress, save=save, stop_requested=poll,
                         save_every_steps=config.checkpoint.every_steps)
    trained = True
  except LossNotFinite as e:
    last = ckpt.latest() if ckpt is not None else None
    failure = TrainingDiverged(f'{e}; stopped. Last good checkpoint: '
                               f'{last or "none (checkpoints disabled or none saved yet)"}')
    raise failure from e
  except BaseException as e:
    failure = e
    raise
  finally:
    try:
      if ckpt is not None:
        ckpt.close()
    finally:
      if replacing[0] and not trained:
        # Failed or stopped: before its first checkpoint, the replaced run comes
        # back; after it (a save on disk that raised later), it goes.
        try:
          _recover(workdir)
        except ConfigError as e:
          if not isinstance(failure, Exception):
            raise
          # The cause first (a full disk stops both the save and the move back).
          raise ConfigError(f'{failure}; then {e}') from failure
  if isinstance(train_loader, ShardedLoader):
    _write_served_ids(workdir, train_loader, eval_loader, trainer.prefix.local_stats())
  rows = result['rows']
  process_seconds = time.perf_counter() - start
  summary = {
      'mode': mode, 'task': task, 'data': data.name, 'config': config.to_dict(),
      'devices': len(devices), 'platform': devices[0].platform,
      'num_layers': model.num_layers,
      # A resumed run's times count its earlier processes up to the checkpoint
      # resumed from, as its rows' wall_seconds do; process_seconds is this one's.
      'total_seconds': trainer.seconds_before + process_seconds,
      'train_seconds': trainer.seconds_before + result['seconds'],
      'process_seconds': process_seconds,
      'final_eval_accuracy': rows[-1]['eval_accuracy'],
      'best_eval_accuracy': max(r['eval_accuracy'] for r in rows),
      'final_eval': {k: v for k, v in rows[-1].items()
                     if k.startswith('eval_') and k != 'eval_seconds'},
      'final_train_loss': rows[-1]['train_loss'],
      'transitions': [t.__dict__ for t in trainer.transitions],
      'freeze_decisions': [d.__dict__ for d in trainer.policy.state.history],
      'cache_decisions': [d.__dict__ for d in trainer.prefix.decisions],
      'cache': trainer.prefix.stats(),
      'micro_batch_rounds': PROFILE_ROUNDS + 1,  # per candidate, with warm-up
      'micro_batch_timings': {str(k): v for k, v in trainer.micro_batch_timings.items()},
      'final_plan': trainer.plan.describe(),
      'programs': trainer.programs.stats(),
  }
  if distributed.is_main_process():
    # The plot first: summary.json marks the run finished (a rerun then trains
    # nothing and writes nothing), so it comes last.
    reporting.plot_summary(workdir, rows, plot_title)
    reporting.write_summary(workdir, summary)
  if replacing[0]:  # trained to the end without checkpoints: finished once its summary is
    _drop_replaced(workdir)
  resumed = (f' ({process_seconds:.1f}s in this process)' if trainer.seconds_before else '')
  _log(f'done in {summary["total_seconds"]:.1f}s{resumed}: final eval accuracy '
       f'{summary["final_eval_accuracy"]:.4f} (best {summary["best_eval_accuracy"]:.4f}); '
       f'outputs in {workdir}')
  return summary


def _loaders(config, data):
  """The train and eval loaders: plain, or over ``distributed.data_shards``
  disjoint shards of which this process reads its own (one per process by
  default)."""
  cap = config.train.max_steps_per_epoch
  processes = jax.process_count()
  shards = _data_shards(config, processes)
  if shards == 1 and processes == 1:
    return (Loader(data.train, config.train.batch_size, seed=config.seed, max_steps=cap),
            Loader(data.eval, config.train.batch_size, shuffle=False, drop_remainder=False,
                   max_steps=cap))
  per = shards // processes
  local = tuple(range(jax.process_index() * per, (jax.process_index() + 1) * per))
  return (ShardedLoader(data.train, config.train.batch_size, shards, local, seed=config.seed,
                        max_steps=cap),
          ShardedLoader(data.eval, config.train.batch_size, shards, local, shuffle=False,
                        drop_remainder=False, max_steps=cap))


def _data_shards(config, processes: int) -> int:
  """The data shards of a job of ``processes`` (``distributed.data_shards``,
  or one per process), checked against the processes and the batch sizes."""
  shards = config.distributed.data_shards or processes
  if shards == 1 and processes == 1:
    return shards
  if shards % processes or config.train.batch_size % shards or (
      config.train.eval_batch_size % shards):
    raise ConfigError(f'distributed.data_shards={shards} must be a multiple of the {processes} '
                      f'processes and divide train.batch_size={config.train.batch_size} '
                      f'(and train.eval_batch_size={config.train.eval_batch_size})')
  if config.train.batch_mode != 'constant':
    raise ConfigError('distributed.data_shards > 1 needs train.batch_mode=constant')
  return shards


def _write_served_ids(workdir: str, train_loader: ShardedLoader, eval_loader: ShardedLoader,
                      cache: dict):
  """``sample_ids/process_<i>.json``: the shards this process read, every
  sample ID it served and its own AutoCache (``cache``: its counters and the
  IDs it holds, see :meth:`pipejax.frozen_prefix.FrozenPrefix.local_stats`);
  multi-host runs check that hosts read and cache disjoint data."""
  directory = os.path.join(workdir, SAMPLE_IDS)
  os.makedirs(directory, exist_ok=True)
  record = {'process': jax.process_index(), 'shards': list(train_loader.local_shards),
            'train': sorted(train_loader.served), 'eval': sorted(eval_loader.served),
            'cache': cache}
  diskcache.write_atomic(os.path.join(directory, f'process_{jax.process_index()}.json'),
                         lambda f: json.dump(record, f))


def _describe(model) -> str:
  """The model kind and size for log lines and plot titles."""
  kind = {'vit': 'ViT', 'bert-classification': 'BERT classifier',
          'bert-question_answering': 'BERT QA'}.get(model.name, model.name)
  if model.name == 'bert-classification' and model.hf_config.num_labels == 1:
    kind = 'BERT regression'
  return f'{kind} L={model.num_layers} d={model.hf_config.hidden_size}'


KNOWN_ERRORS = (ConfigError, TrainingDiverged, CacheMismatchError, datasets.DatasetMissing,
                DataReadError, reporting.MetricsError,
                freeze.FreezeConfigError, pipeline.PlanError, PartitionError,
                schedule.ScheduleError, text_data.TextConfigError, checkpoints.CheckpointError,
                resume.CheckpointMismatch, distributed.DistributedError)


def _checkpoint_dir(workdir: str | None) -> str | None:
  return os.path.join(os.path.abspath(workdir), 'checkpoints') if workdir else None


def _runtime_cause(error: BaseException) -> jax.errors.JaxRuntimeError | None:
  """The failed computation behind ``error``, if any (orbax reports a broken
  collective as a checkpoint error, for one)."""
  return next((e for e in runtime.causes(error) if isinstance(e, jax.errors.JaxRuntimeError)),
              None)


_OUT_OF_MEMORY_ADVICE = (
    'a fixed, larger pipeline.micro_batches (smaller micro-batches) or a smaller '
    'train.eval_batch_size holds less at once, and a resumed run may change either; a '
    'smaller train.batch_size needs a new run (another --workdir)')


def _how_to_resume(config, stop: TrainingInterrupted, workdir: str | None = None) -> str:
  """What continues an interrupted run: the same command, unless it would
  start over (``--config.resume=False``) or nothing was saved; with the
  run's ``--workdir`` where the command had none (it would start a new run
  in a new folder)."""
  if stop.checkpoint is None and config.checkpoint.enabled and not config.resume:  # _run's save
    return ('it was a start over (--config.resume=False) stopped before its first checkpoint: '
            'nothing of it was saved, and the outputs of the run it replaced are back')
  if stop.checkpoint is None:
    return 'nothing was saved (checkpoint.enabled=False): the run cannot be resumed'
  named = '' if workdir else (
      f' with --workdir {shlex.quote(os.path.dirname(os.path.dirname(stop.checkpoint)))}')
  if not config.resume:
    return (f'run the command again{named} without --config.resume=False to resume (with it, '
            f'the run starts over again, and this checkpoint goes once the new run has one)')
  return f'run the same command{named} to resume'


def main(config, workdir: str | None, task: str) -> int:
  """CLI wrapper: known bad input → one line on stderr and exit code 2; a
  first SIGTERM/SIGINT → save after the current step and exit code 75
  (:data:`pipejax.resume.EXIT_INTERRUPTED`; the same command resumes, with
  ``--workdir <its runs/ folder>`` where the command had none); a
  second one → exit code 130 at once."""
  with resume.StopOnSignal(_log) as stop:
    try:
      run(config, workdir, task, stop_requested=stop)
    except TrainingInterrupted as e:
      print(f'interrupted: {e}; {_how_to_resume(config, e, workdir)}', file=sys.stderr)
      return resume.EXIT_INTERRUPTED
    # The machine's files (a full disk, a removed directory) too: one line. With
    # several processes the others are told (they would wait for this one).
    except (*KNOWN_ERRORS, OSError) as e:
      cause = _runtime_cause(e)
      if cause is not None and not runtime.out_of_memory(cause):
        # e.g. a checkpoint barrier that a lost peer broke
        distributed.exit_if_peer_lost(cause, _checkpoint_dir(workdir))  # several processes
      print(f'error: {e}', file=sys.stderr)
      distributed.tell_job_of_error(str(e))
      return 2
    except KeyboardInterrupt:
      print('aborted (nothing saved after the last checkpoint)', file=sys.stderr)
      distributed.tell_job_of_error('aborted (a second interrupt)')
      return resume.EXIT_ABORTED
    except jax.errors.JaxRuntimeError as e:
      if runtime.out_of_memory(e):  # this process's devices ran out of memory: no bug
        line = (f'out of device memory ({distributed.first_line(str(e), 200)}); '
                f'{_OUT_OF_MEMORY_ADVICE}')
        print(f'error: {line}', file=sys.stderr)
        distributed.tell_job_of_error(line)
        return 2
      # Several processes: one line, no hang at exit.
      distributed.exit_if_peer_lost(e, _checkpoint_dir(workdir))
      raise
    except Exception as e:  # a bug: the other processes told, then its traceback
      distributed.tell_job_of_error(f'{type(e).__name__}: {distributed.first_line(str(e), 200)} '
                                    f'(the traceback is in that process\'s output)')
      raise
  if stop.requested:  # it came after the last step: nothing was cut short
    _log('the signal came after the last step: the run finished and its outputs are '
         'complete (exit 0, nothing to resume)')
  return 0
