"""Run outputs: ``metrics.jsonl`` (flushed every epoch), ``summary.json`` and
``summary.png`` in the workdir."""
from __future__ import annotations

import json
import os
from typing import Any

import jax


class MetricsLog:
  """Appends one JSON row per epoch to ``metrics.jsonl`` and flushes it."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.rows: list[dict[str, Any]] = []

  def append(self, row: dict[str, Any]) -> None:
    self.rows.append(row)
    if jax.process_index():  # several processes: process 0 writes the run's files
      return
    with open(self.path, 'a') as f:
      f.write(json.dumps(row) + '\n')
      f.flush()
      os.fsync(f.fileno())


def write_summary(workdir: str, summary: dict[str, Any]) -> str:
  """Writes ``summary.json`` atomically and returns its path."""
  path = os.path.join(workdir, 'summary.json')
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(summary, f, indent=2, default=str)
  os.replace(tmp, path)
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
  axes[1].step(t, [r['frozen_layers'] for r in rows], where='post')
  axes[1].set_title('frozen layers')
  axes[1].set_xlabel('wall-clock s')
  axes[2].step(t, [r['pipeline_length'] for r in rows], where='post', label='K (pipeline length)')
  axes[2].step(t, [r['replicas'] for r in rows], where='post', label='R (replicas)')
  axes[2].legend()
  axes[2].set_title('K and R')
  axes[2].set_xlabel('wall-clock s')
  fig.suptitle(title)
  fig.tight_layout()
  path = os.path.join(workdir, 'summary.png')
  fig.savefig(path, dpi=80)
  plt.close(fig)
  return path
