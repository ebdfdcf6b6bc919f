"""Run outputs: ``metrics.jsonl`` (flushed every epoch), ``summary.json`` and
``summary.png`` in the workdir."""
from __future__ import annotations

import json
import os
from typing import Any

import jax

from pipejax import diskcache


class MetricsLog:
  """Appends one JSON row per epoch to ``metrics.jsonl``, flushed and
  fsync'd, so a crash loses at most the epoch in progress. Rows already in
  the file (a resumed run, see :func:`keep_rows`) are loaded into ``rows``.
  Only process 0 writes (multi-process runs)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.rows, untidy = _read_rows(self.path)
    if jax.process_index() == 0 and untidy:
      _rewrite(self.path, self.rows)  # rows appended after a torn line must start afresh

  def append(self, row: dict[str, Any]) -> None:
    self.rows.append(row)
    if jax.process_index():  # several processes: process 0 writes the run's files
      return
    with open(self.path, 'a') as f:
      f.write(json.dumps(row) + '\n')
      f.flush()
      os.fsync(f.fileno())


class MetricsError(ValueError):
  """``metrics.jsonl`` cannot be read: a line other than the last is not a
  row (the file is left as it is)."""


def read_rows(workdir: str) -> list[dict[str, Any]]:
  """The rows of ``workdir/metrics.jsonl`` (none if it does not exist; a
  torn last line, from a crash while writing, and blank lines are ignored).

  Raises:
    MetricsError: the file cannot be read, or a line is not a row with an
      ``epoch`` (the last line only when it is whole JSON: a torn one is the
      crash's; a damaged file is never rewritten: the rows after the damage
      would be lost).
  """
  return _read_rows(os.path.join(workdir, 'metrics.jsonl'))[0]


def _read_rows(path: str) -> tuple[list[dict[str, Any]], bool]:
  """:func:`read_rows` of the file ``path``, and whether it holds what they
  leave out (a torn last line, no final newline, blank lines), which a row
  appended after it would leave inside the file."""
  if not os.path.exists(path):
    return [], False
  try:
    with open(path, encoding='utf-8') as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise MetricsError(f'cannot read {path}: {e}') from e
  lines = text.splitlines()
  rows, untidy = [], bool(text) and not text.endswith('\n')
  last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
  for number, line in enumerate(lines, 1):
    if not line.strip():
      untidy = True
      continue  # a blank line (an editor's save): no row
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      row = None
    if not isinstance(row, dict) or not isinstance(row.get('epoch'), int):
      if number == last and row is None:
        untidy = True
        break  # torn by a crash while writing
      raise MetricsError(f'{path} line {number} is not a metrics row ({line[:40]!r}); repair '
                         f'or move the file, use another --workdir, or --config.resume=False '
                         f'to start over')
    rows.append(row)
  return rows, untidy


def keep_rows(workdir: str, epochs: int, last_row: dict[str, Any] | None = None) -> int:
  """Rewrites ``metrics.jsonl`` (atomically) with the rows of epochs
  ``< epochs`` only: a run resumed from a checkpoint drops the rows written
  after it. ``last_row`` (the checkpoint's copy of epoch ``epochs - 1``'s
  row) fills that row in if the crash came before it was written (a copy
  saved before the row had its timings is given ``checkpoint_seconds`` 0 and a
  ``wall_seconds`` of the row before plus this epoch's training, transitions
  and evaluation). Returns the rows dropped."""
  path = os.path.join(workdir, 'metrics.jsonl')
  rows, untidy = _read_rows(path)
  kept = [r for r in rows if r['epoch'] < epochs]
  if last_row is not None and not any(r['epoch'] == last_row['epoch'] for r in kept):
    if 'wall_seconds' not in last_row:
      before = kept[-1].get('wall_seconds', 0.0) if kept else 0.0
      last_row = {'checkpoint_seconds': 0.0, **last_row, 'wall_seconds': before + sum(
          last_row.get(k, 0.0) for k in ('epoch_seconds', 'transition_seconds', 'eval_seconds'))}
    kept.append(last_row)
  # Nothing to drop and nothing torn: leave the file alone.
  if jax.process_index() == 0 and (kept != rows or untidy):
    _rewrite(path, kept)
  return len(rows) - len([r for r in rows if r['epoch'] < epochs])


def _rewrite(path: str, rows: list[dict[str, Any]]) -> None:
  """Writes ``rows`` as ``path``, atomically."""
  diskcache.write_atomic(path, lambda f: f.writelines(json.dumps(r) + '\n' for r in rows))


def write_summary(workdir: str, summary: dict[str, Any]) -> str:
  """Writes ``summary.json`` atomically and returns its path."""
  path = os.path.join(workdir, 'summary.json')
  diskcache.write_atomic(path, lambda f: json.dump(summary, f, indent=2, default=str))
  return path


def plot_summary(workdir: str, rows: list[dict[str, Any]], title: str) -> str:
  """``summary.png``: loss and accuracy, frozen layers, K and R against
  wall-clock time (seconds since the start, at the end of each epoch)."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415

  t = [r['wall_seconds'] for r in rows]
  fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
  ax = axes[0]
  ax.plot(t, [r['train_loss'] for r in rows], 'o-', label='train loss')
  ax.set_xlabel('wall-clock s')
  ax.set_ylabel('train loss')
  ax2 = ax.twinx()
  ax2.plot(t, [r['eval_accuracy'] for r in rows], 's-', color='tab:green', label='eval acc')
  ax2.set_ylabel('eval accuracy')
  ax2.set_ylim(0, 1)
  ax.set_title('loss / accuracy')

  def steps(ax, key, **kwargs):  # a row's plan held during its epoch: from the last end to its own
    ax.step([0.0] + t, [rows[0][key]] + [r[key] for r in rows], where='pre', **kwargs)

  steps(axes[1], 'frozen_layers')
  axes[1].set_title('frozen layers')
  axes[1].set_xlabel('wall-clock s')
  steps(axes[2], 'pipeline_length', label='K (pipeline length)')
  steps(axes[2], 'replicas', label='R (replicas)')
  axes[2].legend()
  axes[2].set_title('K and R')
  axes[2].set_xlabel('wall-clock s')
  fig.suptitle(title)
  fig.tight_layout()
  path = os.path.join(workdir, 'summary.png')
  try:
    diskcache.write_atomic(path, lambda f: fig.savefig(f, dpi=80, format='png'), binary=True)
  finally:
    plt.close(fig)
  return path
