"""Index-based data loading: every batch carries the IDs of its samples.

A *source* is anything with ``len(source)`` and ``source[ids] -> dict of
arrays`` for an integer array of sample IDs (``tfds.data_source`` wrapped by
:class:`TfdsSource`, or in-memory arrays in :class:`ArraySource`). The
:class:`Loader` draws a fresh permutation every epoch, deterministic in
``(seed, epoch)``, and yields ``(sample_ids, batch)``. IDs are what AutoCache
keys activations by; the order is known ahead of time, so a cache can prefetch
(:meth:`Loader.batch_ids`). Multi-host runs read a :class:`ShardedLoader`:
:func:`host_subset` fixes each data shard's share of the IDs for the whole run
and the shard's Loader shuffles within it (paper App. D.1), so a host-local
cache is reused every epoch.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Callable, Iterator, Mapping

import numpy as np

Batch = dict[str, np.ndarray]


class ArraySource:
  """In-memory arrays indexed by sample ID (all arrays share axis 0).

  ``randomly_augmented`` (here always False) tells AutoCache whether a
  sample's input changes from one read to the next.
  """

  randomly_augmented = False

  def __init__(self, arrays: Mapping[str, np.ndarray]):
    sizes = {k: len(v) for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
      raise ValueError(f'arrays disagree on the number of samples: {sizes}')
    self.arrays = dict(arrays)

  def __len__(self) -> int:
    return len(next(iter(self.arrays.values())))

  def __getitem__(self, ids: np.ndarray) -> Batch:
    return {k: v[ids] for k, v in self.arrays.items()}


class DataReadError(RuntimeError):
  """A prepared data set whose records cannot be read (damaged files)."""


def default_workers() -> int:
  """Threads that read a batch by default: the CPU cores this process may
  run on (its affinity, not the machine's count), at most 32."""
  try:
    cores = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):  # not on Linux
    cores = os.cpu_count() or 1
  return max(1, min(32, cores))


class TfdsSource:
  """A ``tfds.data_source`` (array_record, random access, no TensorFlow)
  mapped example by example through ``transform(example) -> dict``.

  A batch's examples are read, decoded and transformed by ``workers``
  threads (default: one per CPU core this process may run on, at most 32):
  decoding an image and resizing it run in PIL without Python's global lock,
  so an ImageNet batch loads up to as many times faster as there are cores,
  less what holds the lock (1.6x with 2 threads on 2 cores:
  ``python -m experiments.bench_loading``). The batch is the same, row for
  row, whatever the number of workers; ``transform`` must then be safe to
  call from several threads at once (the experiments' are: they keep no
  state)."""

  def __init__(self, data_source, transform: Callable[[dict], Batch],
               randomly_augmented: bool = False, workers: int | None = None,
               preparation: dict | None = None):
    """``randomly_augmented``: whether ``transform`` draws random
    augmentations (AutoCache then refuses to cache unless told otherwise).
    ``workers``: threads that read a batch (1: the calling thread alone).
    ``preparation``: JSON-able settings of ``transform`` that the run's config
    does not give (a checkpoint's image processor); they join the identity of
    checkpoints and of AutoCache's disk entries."""
    self.data_source, self.transform = data_source, transform
    self.randomly_augmented = randomly_augmented
    self.preparation = preparation
    self.workers = default_workers() if workers is None else int(workers)
    if self.workers < 1:
      raise ValueError(f'workers must be >= 1, got {workers}')
    self._pool, self._pool_pid = None, None
    self._pool_lock = threading.Lock()

  def __len__(self) -> int:
    return len(self.data_source)

  def _example(self, sample_id) -> Batch:
    try:
      example = self.data_source[int(sample_id)]
    except Exception as e:  # array_record raises RuntimeError, OSError, ValueError, …
      raise DataReadError(f'cannot read the prepared data set {self.data_source} '
                          f'({type(e).__name__}: {str(e)[:160]}): its files are damaged; '
                          f'prepare it again (tfds build)') from e
    return self.transform(example)

  def __getitem__(self, ids: np.ndarray) -> Batch:
    if self.workers == 1 or len(ids) < 2:
      rows = [self._example(i) for i in ids]
    else:
      with self._pool_lock:  # one pool per source and process, made at its first batch
        if self._pool is None or self._pool_pid != os.getpid():  # a forked child has no threads
          self._pool = concurrent.futures.ThreadPoolExecutor(
              self.workers, thread_name_prefix='pipejax-data')
          self._pool_pid = os.getpid()
      rows = list(self._pool.map(self._example, ids))  # in order; the first error is raised
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

  def batch_ids(self, epoch: int, start_step: int = 0) -> list[np.ndarray]:
    """The ``sample_ids [batch]`` of every batch :meth:`epoch` will yield, in
    order (the last one padded by repeating IDs when ``drop_remainder`` is
    False); what a cache's ``prefetch`` wants."""
    order = self.order(epoch)
    batches = []
    for step in range(start_step, self.steps_per_epoch()):
      ids = order[step * self.batch_size:(step + 1) * self.batch_size]
      if len(ids) < self.batch_size:
        ids = np.concatenate([ids, np.resize(ids, self.batch_size - len(ids))])
      batches.append(ids)
    return batches

  def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[np.ndarray, Batch]]:
    """Yields ``(sample_ids [batch], batch)`` for ``epoch`` from ``start_step``."""
    real = len(self.ids) - start_step * self.batch_size
    for step, ids in enumerate(self.batch_ids(epoch, start_step)):
      batch = self.source[ids]
      if not self.drop_remainder:
        count = min(self.batch_size, real - step * self.batch_size)
        batch['example_mask'] = (np.arange(self.batch_size) < count).astype(np.float32)
      yield ids, batch


def host_subset(num_samples: int, process_index: int, process_count: int,
                seed: int = 0) -> np.ndarray:
  """This host's fixed share of the sample IDs (paper App. D.1).

  The IDs are permuted once with ``seed`` (the same on every host) and split
  into ``process_count`` equal parts; host ``process_index`` gets one part,
  sorted, for the whole run. :class:`ShardedLoader` gives it to a shard's
  ``Loader(ids=...)``, which reshuffles only within it every epoch, so a
  sample never moves to another host and its cached activations stay
  useful. The ``num_samples %
  process_count`` left-over IDs are dropped so every host runs the same
  number of steps.

  Returns:
    ``[num_samples // process_count]`` int64 sample IDs.
  """
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f'process index {process_index} is not in [0, {process_count})')
  if num_samples < process_count:
    raise ValueError(f'{num_samples} samples cannot be split over {process_count} hosts')
  share = num_samples // process_count
  permutation = np.random.default_rng([seed, 0x5eed]).permutation(num_samples)
  return np.sort(permutation[process_index * share:(process_index + 1) * share]).astype(np.int64)


def shard_ids(num_samples: int, shard: int, shards: int, seed: int, equal: bool) -> np.ndarray:
  """The sample IDs of data shard ``shard`` of ``shards``.

  ``equal=True`` (training): :func:`host_subset`, equal shares (a few
  left-over IDs dropped) fixed for the run. ``equal=False`` (evaluation):
  contiguous ranges that together hold every sample once.
  """
  if equal:
    return host_subset(num_samples, shard, shards, seed)
  return np.array_split(np.arange(num_samples), shards)[shard]


@dataclasses.dataclass
class ShardedLoader:
  """A :class:`Loader` over ``shards`` disjoint data shards, of which this
  process reads ``local_shards`` (multi-host runs, paper App. D.1).

  Each shard has its own Loader of ``batch_size // shards`` samples per step
  over :func:`shard_ids`; the global batch of a step is the shards' batches
  concatenated in shard order. :meth:`epoch` yields this process's part: its
  local shards' batches concatenated, so one process reading every shard
  yields exactly the global batches of a job whose processes read one shard
  each (:func:`pipejax.distributed.put_batch` assembles them in process order).
  Without ``drop_remainder`` every shard runs the same number of steps, short
  shards padded with ``example_mask`` 0.

  Attributes are those of :class:`Loader` (``batch_size`` is global), plus
  ``shards``, ``local_shards`` and ``served``: a set that collects every
  sample ID this loader (and its ``dataclasses.replace`` copies) served.
  """
  source: object
  batch_size: int
  shards: int
  local_shards: tuple[int, ...]
  seed: int = 0
  shuffle: bool = True
  drop_remainder: bool = True
  max_steps: int = 0
  served: set = dataclasses.field(default_factory=set)

  def __post_init__(self):
    if self.shards < 1 or self.batch_size % self.shards:
      raise ValueError(f'batch size {self.batch_size} is not divisible by the {self.shards} '
                       f'data shards')
    if not self.local_shards or not set(self.local_shards) <= set(range(self.shards)):
      raise ValueError(f'local shards {self.local_shards} are not in [0, {self.shards})')
    n = len(self.source)
    self.local_batch = self.batch_size // self.shards
    sizes = [len(shard_ids(n, s, self.shards, self.seed, self.drop_remainder))
             for s in range(self.shards)]
    self._loaders = [Loader(self.source, self.local_batch, self.seed, self.shuffle,
                            self.drop_remainder,
                            shard_ids(n, s, self.shards, self.seed, self.drop_remainder))
                     for s in self.local_shards]
    steps = (min(sizes) // self.local_batch if self.drop_remainder
             else -(-max(sizes) // self.local_batch))
    self._steps = min(steps, self.max_steps) if self.max_steps else steps

  @property
  def ids(self) -> np.ndarray:
    """Every sample ID this process may read (its shards' IDs)."""
    return np.concatenate([loader.ids for loader in self._loaders])

  def steps_per_epoch(self) -> int:
    return self._steps

  def _shard_batches(self, loader: Loader, epoch: int, start_step: int):
    """``(ids, real count)`` of a shard's batches, padded to the common steps."""
    order = loader.order(epoch)
    out = []
    for step in range(start_step, self._steps):
      ids = order[step * self.local_batch:(step + 1) * self.local_batch]
      count = len(ids)
      if count < self.local_batch:  # padding repeats real IDs (or the shard's first)
        fill = ids if count else order[:1]
        if not len(fill):  # an empty shard (fewer samples than shards): one this process reads
          # (a process whose shards are all empty reads sample 0, masked: nothing else exists)
          fill = self.ids[:1] if len(self.ids) else np.zeros(1, order.dtype)
        ids = np.resize(fill, self.local_batch)
      out.append((ids, count))
    return out

  def batch_ids(self, epoch: int, start_step: int = 0) -> list[np.ndarray]:
    """This process's ``sample_ids [batch // processes]`` of every step."""
    per_shard = [self._shard_batches(lo, epoch, start_step) for lo in self._loaders]
    return [np.concatenate([ids for ids, _ in step]) for step in zip(*per_shard)]

  def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[np.ndarray, Batch]]:
    """Yields this process's ``(sample_ids, batch)`` of each step of ``epoch``."""
    per_shard = [self._shard_batches(lo, epoch, start_step) for lo in self._loaders]
    for step in zip(*per_shard):
      ids = np.concatenate([i for i, _ in step])
      self.served.update(np.concatenate([i[:count] for i, count in step]).tolist())  # not padding
      batch = self.source[ids]
      if not self.drop_remainder:
        batch['example_mask'] = np.concatenate(
            [(np.arange(self.local_batch) < count).astype(np.float32) for _, count in step])
      yield ids, batch
