"""Index-based data loading: every batch carries the IDs of its samples.

A *source* is anything with ``len(source)`` and ``source[ids] -> dict of
arrays`` for an integer array of sample IDs (``tfds.data_source`` wrapped by
:class:`TfdsSource`, or in-memory arrays in :class:`ArraySource`). The
:class:`Loader` draws a fresh permutation every epoch, deterministic in
``(seed, epoch)``, and yields ``(sample_ids, batch)``. IDs are what AutoCache
keys activations by; the order is known ahead of time, so a cache can prefetch.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Mapping

import numpy as np

Batch = dict[str, np.ndarray]


class ArraySource:
  """In-memory arrays indexed by sample ID (all arrays share axis 0)."""

  def __init__(self, arrays: Mapping[str, np.ndarray]):
    sizes = {k: len(v) for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
      raise ValueError(f'arrays disagree on the number of samples: {sizes}')
    self.arrays = dict(arrays)

  def __len__(self) -> int:
    return len(next(iter(self.arrays.values())))

  def __getitem__(self, ids: np.ndarray) -> Batch:
    return {k: v[ids] for k, v in self.arrays.items()}


class TfdsSource:
  """A ``tfds.data_source`` (array_record, random access, no TensorFlow)
  mapped example by example through ``transform(example) -> dict``."""

  def __init__(self, data_source, transform: Callable[[dict], Batch]):
    self.data_source, self.transform = data_source, transform

  def __len__(self) -> int:
    return len(self.data_source)

  def __getitem__(self, ids: np.ndarray) -> Batch:
    examples = [self.data_source[int(i)] for i in ids]
    rows = [self.transform(e) for e in examples]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


@dataclasses.dataclass
class Loader:
  """Batches of a source in an order reshuffled every epoch.

  Attributes:
    source: the data.
    batch_size: global batch size.
    seed: the shuffle seed; epoch e uses ``default_rng([seed, e])``.
    shuffle: False keeps ID order (evaluation).
    drop_remainder: drop the last partial batch (training); otherwise it is
      padded by repeating IDs, with ``example_mask`` 0 on the padding.
    ids: restrict to these sample IDs (a host's subset in multi-host runs).
    max_steps: cap on batches per epoch (0: no cap), for smoke runs.
  """
  source: object
  batch_size: int
  seed: int = 0
  shuffle: bool = True
  drop_remainder: bool = True
  ids: np.ndarray | None = None
  max_steps: int = 0

  def __post_init__(self):
    if self.batch_size < 1:
      raise ValueError(f'batch size must be >= 1, got {self.batch_size}')
    if self.ids is None:
      self.ids = np.arange(len(self.source))
    if self.drop_remainder and len(self.ids) < self.batch_size:
      raise ValueError(f'batch size {self.batch_size} exceeds the {len(self.ids)} samples')

  def steps_per_epoch(self) -> int:
    n = len(self.ids)
    steps = n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)
    return min(steps, self.max_steps) if self.max_steps else steps

  def order(self, epoch: int) -> np.ndarray:
    """The sample IDs of ``epoch`` in the order they will be served."""
    if not self.shuffle:
      return np.asarray(self.ids)
    return np.random.default_rng([self.seed, epoch]).permutation(self.ids)

  def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[np.ndarray, Batch]]:
    """Yields ``(sample_ids [batch], batch)`` for ``epoch`` from ``start_step``."""
    order = self.order(epoch)
    for step in range(start_step, self.steps_per_epoch()):
      ids = order[step * self.batch_size:(step + 1) * self.batch_size]
      mask = np.ones(len(ids), np.float32)
      if len(ids) < self.batch_size:
        pad = self.batch_size - len(ids)
        mask = np.concatenate([mask, np.zeros(pad, np.float32)])
        ids = np.concatenate([ids, np.resize(ids, pad)])
      batch = self.source[ids]
      if not self.drop_remainder:
        batch['example_mask'] = mask
      yield ids, batch
