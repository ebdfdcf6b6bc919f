"""AutoCache (paper §3.4, App. E): frozen-prefix activations keyed by sample ID.

An :class:`ActivationCache` holds, for each sample ID, the output of the
frozen prefix (embedding and the first F blocks), ``[seq, hidden]``, tagged
with the depth F it was computed at; the cache belongs to one run identity (a
string the trainer derives from everything that determines the frozen
layers' output: model config, parameters' origin, seed, input pipeline,
storage dtype). Entries live in host memory up to ``memory_bytes``, then on
disk up to ``disk_bytes`` (:mod:`pipejax.autocache_disk`); what fits in
neither is not cached and is recomputed when asked for. Values go in as
float32 and come out as float32; ``dtype='bfloat16'`` or ``'float16'`` halves
the storage (bound in :func:`storage_error_bound`).

No sample passes a frozen layer twice: on a freeze event F → F′ an entry at
depth F is pushed through layers F..F′ by the caller's ``advance_fn`` and
replaced (eagerly in :meth:`ActivationCache.advance`, or lazily when
:meth:`ActivationCache.fetch` meets it). Every sample×layer pass the cache asks
for is counted (``layer_passes``), and so are those that repeat a pass the
sample already had (``repeated_layer_passes``: 0 unless entries were lost to
the budgets or to corruption).

How the trainer uses it (``frozen`` = the frozen parameters, ``F`` = frozen
blocks, ``loader`` a :class:`pipejax.data.Loader`)::

  cache = ActivationCache(identity=run_hash, num_samples=len(source),
                          entry_shape=(seq, hidden), dtype=c.cache.dtype,
                          memory_bytes=..., disk_bytes=..., directory=workdir + '/cache',
                          on_mismatch=c.cache.on_mismatch, reuse=False, log=log)
  # each epoch, before its first step (disk entries are read ahead):
  cache.prefetch(loader.batch_ids(epoch, start_step))
  # each step, instead of running the prefix inside the step:
  hidden = cache.fetch(
      ids,
      compute_fn=lambda rows: prefix(frozen, take(batch, rows)),       # [m, seq, hidden]
      advance_fn=lambda ids, h, d0, d1: blocks(frozen, h, source_keys(ids), d0, d1))
  step(state, {'hidden': hidden, **block_keys_and_labels(batch)})
  # at a freeze event F -> F2 (the prefix's new blocks are frozen by now):
  cache.advance(F2, advance_fn, batch_size)   # or cache.advance(F2): lazily in fetch
  # metrics row:
  row.update({f'cache_{k}': v for k, v in cache.stats().items()})

``compute_fn(rows)`` gets indices into the batch's ``sample_ids`` (the first
occurrence of each ID that must be computed) and returns their prefix output
at the current depth. ``advance_fn(sample_ids [m], hidden [m, seq, hidden],
from_depth, to_depth)`` runs blocks ``from_depth..to_depth-1`` forward only;
it gets the IDs so BERT's ``attention_mask`` can be looked up in the source
(the mask stays in the batch, not in the cache). Both may be jitted
data-parallel functions; they are called with at most the batch size (or the
``batch_size`` given to :meth:`ActivationCache.advance`) rows, and pad inside
if they need a fixed shape; padded rows are not counted.

Whether to cache at all is the profiler's call (:mod:`pipejax.autocache_policy`).

Several hosts (paper App. D.1): each host has its own cache, given the IDs of
the samples it reads (``own_ids``, fixed for the run); it refuses any other ID,
so a host never holds another host's samples.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from pipejax.autocache_disk import CacheMismatchError, DiskTier, storage_dtype

__all__ = ['ActivationCache', 'CacheMismatchError', 'storage_error_bound']

NONE, MEMORY, DISK = 0, 1, 2
ComputeFn = Callable[[np.ndarray], np.ndarray]
AdvanceFn = Callable[[np.ndarray, np.ndarray, int, int], np.ndarray]


def storage_error_bound(dtype: str) -> float:
  """Largest relative error of one stored value, ``|stored − x| ≤ bound·|x|``
  (round to nearest: half a unit in the last place; 0 for float32). float16
  also loses values beyond ±65504 (inf) and below 6.1e-5 (subnormal, absolute
  error ≤ 2⁻²⁵). An entry advanced from a rounded entry is not rounded again
  relative to the exact value: errors add up over depth changes."""
  return {'float32': 0.0, 'bfloat16': 2.0 ** -8, 'float16': 2.0 ** -11}[storage_dtype(dtype).name]


class ActivationCache:
  """Frozen-prefix activations of one run, by sample ID, in memory then on disk.

  Args:
    identity: the run/config identity; a disk directory of another identity
      is refused or cleared (``on_mismatch``), never read.
    num_samples: IDs are in ``[0, num_samples)``.
    entry_shape: one sample's activation, e.g. ``(seq, hidden)``.
    dtype: storage dtype, ``'float32'`` (exact), ``'bfloat16'`` or ``'float16'``.
    memory_bytes: host-memory budget for entries *and* prefetched disk entries.
    disk_bytes: size budget of the disk file (0: no disk tier).
    directory: the cache directory (needed when ``disk_bytes > 0``). Entries a
      previous run of the same identity left there, at ``depth`` or less, are
      used (checked on read) when ``reuse`` is True, else dropped at once.
    prefetch_bytes: the part of ``memory_bytes`` kept for read-ahead of disk
      entries (default: ``memory_bytes // 8`` when there is a disk tier).
    on_mismatch: ``'refuse'`` or ``'clear'`` a directory of another identity.
    depth: the current number of frozen blocks.
    reuse: take over the entries of ``directory`` (False: start empty, the
      trainer's case: a run or a resume starts at depth 0 or refills).
    log: one-line messages (decisions, corruption, clearing).
    own_ids: the sample IDs this host may cache (its data shards, paper App.
      D.1), or None for all: another ID given to :meth:`fetch` or
      :meth:`prefetch` is refused (ValueError), and records of other IDs found
      in the directory are dropped. Each host of a multi-host run owns a
      fixed subset of the samples and caches only that.
  """

  def __init__(self, *, identity: str, num_samples: int, entry_shape: Sequence[int],
               dtype: str = 'float32', memory_bytes: int, disk_bytes: int = 0,
               directory: str | None = None, prefetch_bytes: int | None = None,
               on_mismatch: str = 'refuse', depth: int = 0, reuse: bool = True,
               log: Callable[[str], None] = print, own_ids: np.ndarray | None = None):
    self.dtype = storage_dtype(dtype)
    self.entry_shape = tuple(int(d) for d in entry_shape)
    self.entry_bytes = int(np.prod(self.entry_shape)) * self.dtype.itemsize
    if memory_bytes < 0 or disk_bytes < 0:
      raise ValueError(f'cache budgets must be >= 0, got memory {memory_bytes}, disk {disk_bytes}')
    if disk_bytes and not directory:
      raise ValueError('a disk budget needs a cache directory')
    if prefetch_bytes is None:
      prefetch_bytes = memory_bytes // 8 if disk_bytes else 0
    if not 0 <= prefetch_bytes <= memory_bytes:
      raise ValueError(f'prefetch_bytes {prefetch_bytes} must be in [0, memory_bytes '
                       f'{memory_bytes}]')
    self.num_samples, self.depth, self.log = int(num_samples), int(depth), log
    self.memory_bytes, self.disk_bytes = memory_bytes, disk_bytes
    self.prefetch_bytes = prefetch_bytes
    # The entries memory holds (the prefetch buffer is part of its budget).
    self._memory_slots = (memory_bytes - prefetch_bytes) // self.entry_bytes
    n = self.num_samples
    self._owned = None
    if own_ids is not None:
      self._owned = np.zeros(n, bool)
      self._owned[self._check_ids(own_ids)] = True
    self._tier = np.zeros(n, np.int8)
    self._depth = np.full(n, -1, np.int32)
    self._slot = np.full(n, -1, np.int64)
    self._version = np.zeros(n, np.int64)
    self._reached = np.zeros(n, np.int32)  # deepest depth each sample was carried to
    self._passes = np.zeros(n, np.int64)   # frozen-block passes done for each sample
    self._memory: dict[int, np.ndarray] = {}
    self._lock = threading.Lock()
    # A batch computed on the devices and stored when its host copy is
    # needed (see :meth:`defer`): (ids, depth, values getter) or None.
    self._pending: tuple[np.ndarray, int, Callable[[], Any]] | None = None
    self._counts = dict.fromkeys(
        ['hits', 'misses', 'advanced', 'uncached', 'corrupt', 'evicted', 'prefetched',
         'layer_passes', 'repeated_layer_passes'], 0)
    self._seconds = dict.fromkeys(['read_seconds', 'write_seconds', 'prefetch_seconds'], 0.0)
    self._disk = None
    self._free: list[int] = []
    self._disk_off = False  # a write failed (a full disk): no new disk entries
    self._float16_warned = False
    if disk_bytes:
      self._disk = DiskTier(directory, identity, self.entry_shape, self.dtype.name, disk_bytes,
                            n, on_mismatch, log)
      if reuse:
        self._reopen()
      else:  # one truncation, not a header read and a write per leftover record
        self._disk.clear()
        self._free = list(range(self._disk.slots - 1, -1, -1))
    # Prefetch state: the planned batches, the next one to be fetched, staged entries.
    self._plan: list[np.ndarray] = []
    self._plan_index: dict[int, list[int]] = {}
    self._cursor = 0
    # sample id -> (batch index, version, depth, value in the storage dtype)
    self._staged: dict[int, tuple[int, int, int, np.ndarray]] = {}
    self._staged_bytes = 0
    self._peak_memory = 0
    self._changed = threading.Condition(self._lock)
    self._thread: threading.Thread | None = None
    self._stop = False

  # -- lifecycle ------------------------------------------------------------------
  def _reopen(self) -> None:
    """Takes over the valid-looking records a run of this identity left."""
    slots, ids, depths = self._disk.scan()
    usable = (ids >= 0) & (ids < self.num_samples) & (depths >= 0) & (depths <= self.depth)
    if self._owned is not None:
      usable[usable] = self._owned[ids[usable]]
    # Per ID keep the deepest usable record; the others are dropped.
    order = np.lexsort((-depths, ids))
    taken = np.zeros(self.num_samples, bool)
    drop = []
    for i in order:
      if not usable[i] or taken[ids[i]]:
        drop.append(slots[i])
        continue
      taken[ids[i]] = True
      self._tier[ids[i]], self._slot[ids[i]], self._depth[ids[i]] = DISK, slots[i], depths[i]
      self._reached[ids[i]] = depths[i]
    self._disk.invalidate(np.array(drop, np.int64))
    used = set(self._slot[self._tier == DISK].tolist())
    self._free = [s for s in range(self._disk.slots - 1, -1, -1) if s not in used]
    if taken.any():
      self.log(f'autocache: reusing {int(taken.sum())} entries this run left in '
               f'{self._disk.directory}')

  def open(self) -> None:
    """Reopens the disk file after :meth:`close` (a trainer's next run)."""
    if self._disk is not None:
      self._disk.open()

  def close(self) -> None:
    """Stops prefetching and closes the disk file (entries stay on disk)."""
    self.stop_prefetch()
    if self._disk is not None:
      self._disk.close()

  def __enter__(self) -> ActivationCache:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- queries ------------------------------------------------------------------
  @property
  def num_owned(self) -> int:
    """How many sample IDs this cache may hold (its ``own_ids``, or all)."""
    return self.num_samples if self._owned is None else int(self._owned.sum())

  def holds_every_sample(self) -> bool:
    """Whether every ID this cache may hold has an entry (at any depth).
    Safe from another thread: it does not settle, so entries still being
    written (:meth:`defer`) are not counted yet."""
    with self._lock:
      held = self._tier != NONE
      return bool(held.all() if self._owned is None else held[self._owned].all())

  def contains(self, sample_ids: np.ndarray) -> np.ndarray:
    """``[n]`` bool: which IDs have an entry at the current depth."""
    self._settle()
    ids = self._check_ids(sample_ids)
    return (self._tier[ids] != NONE) & (self._depth[ids] == self.depth)

  def depths(self, sample_ids: np.ndarray) -> np.ndarray:
    """``[n]`` int32: each ID's entry depth (-1: not cached)."""
    self._settle()
    return self._depth[self._check_ids(sample_ids)].copy()

  def fits(self) -> float:
    """The fraction of this cache's samples (:meth:`num_owned`) that its
    budgets, memory and disk together, can hold (1: every one; after a failed
    disk write, the disk holds only what it has)."""
    disk = 0 if self._disk is None else self._disk.slots
    if self._disk_off:
      disk = int(np.count_nonzero(self._tier == DISK))
    slots = self._memory_slots + disk
    return min(1.0, slots / max(self.num_owned, 1))

  def room(self) -> int:
    """How many new entries the budgets can still take (memory, then disk)."""
    self._settle()
    with self._lock:
      return max(0, self._memory_slots - len(self._memory)) + len(self._free)

  def cached_ids(self) -> np.ndarray:
    """The sorted IDs that have an entry (at any depth)."""
    self._settle()
    return np.nonzero(self._tier != NONE)[0]

  def layer_passes_per_sample(self) -> np.ndarray:
    """``[num_samples]``: frozen-block passes the cache asked for, per sample."""
    self._settle()
    return self._passes.copy()

  def repeated_samples(self) -> np.ndarray:
    """IDs that went through some frozen block more than once."""
    self._settle()
    return np.nonzero(self._passes > self._reached)[0]

  def counters(self) -> dict[str, Any]:
    """What :meth:`restore_counters` takes back (a checkpoint's): the
    cumulative ``counts`` and ``seconds`` of :meth:`stats`, and per sample
    the depth it was carried to (``reached``) and its frozen-block
    ``passes``."""
    self._settle()
    with self._lock:
      return {'counts': dict(self._counts), 'seconds': dict(self._seconds),
              'reached': self._reached.copy(), 'passes': self._passes.copy()}

  def restore_counters(self, counts: dict, seconds: dict, reached: np.ndarray | None = None,
                       passes: np.ndarray | None = None) -> None:
    """Continues the counters of :meth:`counters` (a resumed run's metrics
    rows go on from the checkpoint's; a sample refilled after the resume
    repeats the passes it had). Missing keys stay as they are."""
    self._settle()
    with self._lock:
      self._counts.update({k: int(counts[k]) for k in self._counts if k in counts})
      self._seconds.update({k: float(seconds[k]) for k in self._seconds if k in seconds})
      for name, values in (('reached', reached), ('passes', passes)):
        if values is not None:
          values = np.asarray(values)
          if values.shape != (self.num_samples,):
            raise ValueError(f'{name} has shape {values.shape}, the cache has '
                             f'{self.num_samples} samples')
          getattr(self, f'_{name}')[:] = values

  def stats(self) -> dict[str, float]:
    """Counters for the metrics row: hits / misses / advanced (samples),
    uncached (computed but beyond both budgets), corrupt, evicted, prefetched,
    layer_passes, repeated_layer_passes, entries and bytes per tier, peak
    memory bytes, and read / write / prefetch seconds."""
    self._settle()
    with self._lock:
      memory = len(self._memory) * self.entry_bytes + self._staged_bytes
      disk_entries = int(np.sum(self._tier == DISK))
      return {**self._counts, **self._seconds, 'depth': self.depth,
              'memory_entries': len(self._memory), 'disk_entries': disk_entries,
              'bytes_in_memory': memory, 'peak_bytes_in_memory': self._peak_memory,
              'bytes_on_disk': disk_entries * (self._disk.record_bytes if self._disk else 0),
              'disk_file_bytes': self._disk.file_bytes if self._disk else 0}

  def _check_ids(self, sample_ids) -> np.ndarray:
    ids = np.asarray(sample_ids, np.int64).reshape(-1)
    if len(ids) and (ids.min() < 0 or ids.max() >= self.num_samples):
      raise ValueError(f'sample IDs must be in [0, {self.num_samples}), got '
                       f'[{ids.min()}, {ids.max()}]')
    return ids

  def _check_own(self, ids: np.ndarray) -> np.ndarray:
    """``ids`` if this host owns them all (see ``own_ids``), else ValueError."""
    if self._owned is not None and len(ids) and not self._owned[ids].all():
      foreign = np.unique(ids[~self._owned[ids]])
      raise ValueError(f'sample IDs {foreign[:8].tolist()}{"…" if len(foreign) > 8 else ""} '
                       f'are not among the IDs this cache may hold (another host\'s samples)')
    return ids

  def _note_memory(self) -> None:
    self._peak_memory = max(self._peak_memory,
                            len(self._memory) * self.entry_bytes + self._staged_bytes)

  # -- reading --------------------------------------------------------------------
  def _load(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entries of unique ``ids [n]`` at whatever depth they have: ``(values
    [n, *entry_shape] float32, depths [n])``, depth -1 where there is none
    (not cached, or found corrupt: then dropped, counted and logged)."""
    values = np.zeros((len(ids),) + self.entry_shape, np.float32)
    start = time.perf_counter()
    with self._lock:
      tier, depths = self._tier[ids].copy(), self._depth[ids].copy()
      slots, versions = self._slot[ids].copy(), self._version[ids].copy()
      for i in np.nonzero(tier == MEMORY)[0]:
        values[i] = self._memory[int(ids[i])]
      on_disk = np.nonzero(tier == DISK)[0]
      unread = []
      for i in on_disk:
        staged = self._staged.pop(int(ids[i]), None)
        if staged is not None:
          self._staged_bytes -= self.entry_bytes
        if staged is not None and staged[1] == versions[i]:
          values[i] = staged[3]
          self._counts['prefetched'] += 1
        else:
          unread.append(i)
      self._changed.notify_all()
    if unread:
      unread = np.array(unread)
      payload, valid = self._disk.read(slots[unread], ids[unread], depths[unread])
      values[unread[valid]] = payload[valid]
      if not valid.all():
        bad = unread[~valid]
        with self._lock:
          for i in bad:
            self._drop_if_current(int(ids[i]), versions[i])
          self._counts['corrupt'] += len(bad)
        depths[bad] = -1
        self.log(f'autocache: {len(bad)} corrupt disk entries (IDs {ids[bad][:8].tolist()}'
                 f'{"…" if len(bad) > 8 else ""}) dropped; they are recomputed')
    self._seconds['read_seconds'] += time.perf_counter() - start
    depths[tier == NONE] = -1
    return values, depths

  def _drop_if_current(self, sample_id: int, version: int) -> None:
    """Removes an entry (lock held) unless it was rewritten since ``version``."""
    if self._version[sample_id] != version or self._tier[sample_id] == NONE:
      return
    if self._tier[sample_id] == MEMORY:
      del self._memory[sample_id]
    else:
      self._disk.invalidate(self._slot[sample_id:sample_id + 1])
      self._free.append(int(self._slot[sample_id]))
    self._tier[sample_id], self._depth[sample_id], self._slot[sample_id] = NONE, -1, -1
    self._version[sample_id] += 1

  # -- writing --------------------------------------------------------------------
  def _store(self, ids: np.ndarray, values: np.ndarray, depth: int) -> None:
    """Stores unique ``ids [n]`` with ``values [n, *entry_shape]`` at ``depth``:
    in place where an entry exists, else in memory while the budget allows,
    else on disk while slots are free, else not at all (``uncached``).
    float16 storage leaves out rows it cannot hold (beyond ±65504: inf)."""
    start = time.perf_counter()
    with np.errstate(over='ignore'):  # float16's overflow: dropped below, and said once
      stored = np.ascontiguousarray(values, self.dtype)
    if self.dtype == np.float16:
      ids, stored = self._within_float16(ids, values, stored)
    with self._lock:
      to_disk = []
      for i, sample_id in enumerate(ids.tolist()):
        tier = self._tier[sample_id]
        if tier == NONE:
          if len(self._memory) < self._memory_slots:
            tier = MEMORY
          elif self._free:
            tier, self._slot[sample_id] = DISK, self._free.pop()
          else:
            self._counts['uncached'] += 1
            continue
        self._tier[sample_id], self._depth[sample_id] = tier, depth
        self._version[sample_id] += 1
        if tier == MEMORY:
          self._memory[sample_id] = stored[i].copy()
        else:
          to_disk.append(i)
      if to_disk:
        # Under the lock: the prefetcher reads a record only after it is whole.
        rows = np.array(to_disk)
        try:
          self._disk.write(self._slot[ids[rows]], ids[rows], np.full(len(rows), depth),
                           stored[rows])
        except OSError as e:  # not cached after all; the rest of the run keeps off the disk
          self._disk_failed(e)
          lost = ids[rows]
          self._tier[lost], self._depth[lost], self._slot[lost] = NONE, -1, -1
          self._version[lost] += 1
          self._counts['uncached'] += len(lost)
      self._note_memory()
    self._seconds['write_seconds'] += time.perf_counter() - start

  def _within_float16(self, ids: np.ndarray, values: np.ndarray, stored: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` and ``stored`` without the rows that float16 turned infinite
    from finite values: served as computed, counted ``uncached``, and said
    once (a hit of inf would stop the run as a diverged loss)."""
    n = len(ids)
    lost = (~np.isfinite(stored.reshape(n, -1)).all(1)
            & np.isfinite(np.asarray(values).reshape(n, -1)).all(1))
    if not lost.any():
      return ids, stored
    with self._lock:
      self._counts['uncached'] += int(lost.sum())
      if not self._float16_warned:
        self._float16_warned = True
        self.log(f'autocache: {int(lost.sum())} entries hold values beyond float16\'s range '
                 f'(±65504) and are not cached (they are recomputed, and so are later ones '
                 f'like them); cache.dtype=bfloat16 keeps float32\'s range')
    return ids[~lost], stored[~lost]

  def _disk_failed(self, error: OSError) -> None:
    """Stops putting entries on disk after a failed write (a full disk, a
    file-size limit): the cache only saves time, so what memory does not
    hold is recomputed from now on, not the run stopped. The entries already
    there are still read (a record cut short fails its checksum and is
    recomputed). Lock held."""
    if not self._disk_off:
      self._disk_off = True
      self.log(f'autocache: writing {self._disk.path} failed ({error.strerror or error}); '
               f'no more entries go to disk in this run (what memory does not hold is '
               f'recomputed)')
    self._free = []

  def _count_passes(self, ids: np.ndarray, from_depths: np.ndarray, to_depth: int) -> None:
    """Books the frozen-block passes ``from_depths → to_depth`` of ``ids``."""
    passes = to_depth - from_depths
    new = np.maximum(0, to_depth - np.maximum(self._reached[ids], from_depths))
    self._passes[ids] += passes
    self._reached[ids] = np.maximum(self._reached[ids], to_depth)
    self._counts['layer_passes'] += int(passes.sum())
    self._counts['repeated_layer_passes'] += int((passes - new).sum())

  # -- the per-step call ------------------------------------------------------------
  def fetch(self, sample_ids: np.ndarray, compute_fn: ComputeFn,
            advance_fn: AdvanceFn | None = None) -> np.ndarray:
    """The frozen prefix's output for a batch at the current depth.

    Entries at the current depth are hits; entries at a smaller depth are
    advanced with ``advance_fn`` (recomputed if it is None); the rest are
    computed with ``compute_fn`` and stored if the budgets allow.

    Args:
      sample_ids: ``[batch]`` IDs (repeats, e.g. padding, are served once).
      compute_fn: ``rows [m] -> [m, *entry_shape]``, the prefix at the current
        depth for ``sample_ids[rows]``.
      advance_fn: ``(ids [m], hidden [m, *entry_shape], from_depth, to_depth)
        -> [m, *entry_shape]``, frozen blocks ``from_depth..to_depth-1``.

    Returns:
      ``[batch, *entry_shape]`` float32.
    """
    self._settle()
    ids = self._check_own(self._check_ids(sample_ids))
    self._follow_plan(ids)
    unique, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    if len(unique) == len(ids):  # no repeats: served in the batch's order, with no reorder
      unique, first, inverse = ids, np.arange(len(ids)), None
    values, depths = self._load(unique)
    if np.any(depths > self.depth):
      raise RuntimeError('cache entries deeper than the current depth: advance() was skipped')
    stale = (depths >= 0) & (depths < self.depth)
    if advance_fn is not None:
      for depth in np.unique(depths[stale]):
        group = np.nonzero(stale & (depths == depth))[0]
        values[group] = self._call(advance_fn, unique[group], values[group], int(depth),
                                   self.depth)
        self._count_passes(unique[group], depths[group], self.depth)
        self._counts['advanced'] += len(group)
      missing = depths < 0
    else:
      missing = depths < self.depth
    if missing.any():
      rows = np.nonzero(missing)[0]
      values[rows] = self._call(compute_fn, first[rows])
      self._count_passes(unique[rows], np.zeros(len(rows), np.int64), self.depth)
    self._counts['hits'] += int(np.sum(depths == self.depth))
    self._counts['misses'] += int(missing.sum())
    changed = np.nonzero(depths != self.depth)[0]
    if len(changed):
      self._store(unique[changed], values[changed], self.depth)
    return values if inverse is None else values[inverse.reshape(-1)]

  def is_new(self, sample_ids: np.ndarray) -> bool:
    """Whether no ID of the batch has an entry (at any depth) and none
    repeats: such a batch may be served by :meth:`defer`."""
    self._settle()
    ids = self._check_own(self._check_ids(sample_ids))
    return bool(len(ids)) and len(np.unique(ids)) == len(ids) and not np.any(
        self._tier[ids] != NONE)

  def defer(self, sample_ids: np.ndarray, compute_fn: Callable[[], Any]) -> None:
    """The first pass over a new batch (:meth:`is_new`) without a round trip
    through the host: the caller computes the batch's prefix output (e.g. on
    the devices, not waited for) and uses it directly; ``compute_fn() ->
    [batch, *entry_shape]`` gives its host copy, which is stored and counted
    as misses at the cache's next use (any later call).
    """
    if not self.is_new(sample_ids):
      raise ValueError('defer() needs a batch of new, distinct sample IDs (see is_new)')
    ids = self._check_ids(sample_ids)
    self._follow_plan(ids)
    self._pending = (ids, self.depth, compute_fn)

  def _settle(self) -> None:
    """Stores the batch :meth:`defer` left (its host copy is ready by now)."""
    if self._pending is None:
      return
    ids, depth, compute_fn = self._pending
    self._pending = None
    if depth != self.depth:
      raise RuntimeError(f'a deferred batch of depth {depth} meets the cache at {self.depth}')
    values = self._call(lambda rows: compute_fn(), ids)
    self._count_passes(ids, np.zeros(len(ids), np.int64), depth)
    self._counts['misses'] += len(ids)
    self._store(ids, values, depth)

  def _call(self, fn, *args) -> np.ndarray:
    out = np.asarray(fn(*args), np.float32)
    rows = len(args[0])
    if out.shape != (rows,) + self.entry_shape:
      raise ValueError(f'{getattr(fn, "__name__", "cache function")} returned shape '
                       f'{out.shape}, expected {(rows,) + self.entry_shape}')
    return out

  # -- freeze events ----------------------------------------------------------------
  def advance(self, new_depth: int, advance_fn: AdvanceFn | None = None,
              batch_size: int = 256) -> None:
    """Moves the cache to ``new_depth`` frozen blocks (a freeze event).

    With ``advance_fn`` every entry at a smaller depth is read, pushed through
    blocks ``depth..new_depth-1`` once, in chunks of ``batch_size`` samples of
    one depth, and replaced in place; without it entries stay at their depth
    and :meth:`fetch` advances them when their batch comes. Stops prefetching
    (call :meth:`prefetch` again for the next epoch).
    """
    if new_depth < self.depth:
      raise ValueError(f'the cache cannot go back from depth {self.depth} to {new_depth}')
    self.stop_prefetch()
    old, self.depth = self.depth, int(new_depth)
    if advance_fn is None or new_depth == old:
      return
    start = time.perf_counter()
    stale = np.nonzero((self._tier != NONE) & (self._depth < new_depth))[0]
    # One depth per call; disk entries in slot order so reads are sequential.
    order = np.lexsort((self._slot[stale], self._tier[stale], self._depth[stale]))
    stale, advanced = stale[order], 0
    for depth in np.unique(self._depth[stale]):
      group = stale[self._depth[stale] == depth]
      for chunk in np.array_split(group, -(-len(group) // batch_size)):
        values, depths = self._load(chunk)
        ok = depths == depth
        if ok.any():
          out = self._call(advance_fn, chunk[ok], values[ok], int(depth), self.depth)
          self._count_passes(chunk[ok], depths[ok], self.depth)
          self._store(chunk[ok], out, self.depth)
          advanced += int(ok.sum())
    self._counts['advanced'] += advanced
    self.log(f'autocache: advanced {advanced} entries from depth {old} to {new_depth} in '
             f'{time.perf_counter() - start:.2f}s')

  def evict_stale(self) -> int:
    """Drops every entry below the current depth; returns how many."""
    self.stop_prefetch()
    with self._lock:
      stale = np.nonzero((self._tier != NONE) & (self._depth < self.depth))[0]
      for sample_id in stale:
        self._drop_if_current(int(sample_id), self._version[sample_id])
      self._counts['evicted'] += len(stale)
    return len(stale)

  def clear(self) -> None:
    """Drops every entry (counters stay)."""
    self.stop_prefetch()
    with self._lock:
      self._counts['evicted'] += int(np.sum(self._tier != NONE))
      self._memory.clear()
      self._version += 1
      self._tier[:], self._depth[:], self._slot[:] = NONE, -1, -1
      if self._disk is not None:
        self._disk.clear()
        self._free = [] if self._disk_off else list(range(self._disk.slots - 1, -1, -1))

  def measure_io(self, hidden: np.ndarray) -> tuple[float, float]:
    """``(write_seconds, read_seconds)`` of one batch ``hidden [b, *entry_shape]``
    in the tier new entries would go to now (a scratch round trip; nothing is
    cached), for the caching decision."""
    hidden = np.asarray(hidden, np.float32)
    goes_to_memory = (len(self._memory) + len(hidden) <= self._memory_slots
                      or self._disk is None or self._disk_off)
    if not goes_to_memory:
      try:
        return self._disk.measure(hidden.astype(self.dtype))
      except OSError as e:
        with self._lock:
          self._disk_failed(e)
    start = time.perf_counter()
    stored = [row.astype(self.dtype) for row in hidden]
    write = time.perf_counter() - start
    start = time.perf_counter()
    read = np.zeros((len(stored),) + self.entry_shape, np.float32)
    for i, row in enumerate(stored):  # as a hit's read (_load) copies it
      read[i] = row
    return write, time.perf_counter() - start

  # -- prefetch -----------------------------------------------------------------------
  def prefetch(self, batches: Sequence[np.ndarray]) -> None:
    """Reads disk entries of the coming ``batches`` (``[batch]`` ID arrays, in
    the order :meth:`fetch` will ask for them) ahead, in a thread, within
    ``prefetch_bytes``. A fetch of the next planned batch consumes it; the
    staged entries of batches passed over are released."""
    self.stop_prefetch()
    batches = [self._check_own(self._check_ids(b)) for b in batches]
    if self._disk is None or self.prefetch_bytes < self.entry_bytes:
      return
    with self._lock:
      self._plan = batches
      self._plan_index = {}
      for i, batch in enumerate(self._plan):
        if len(batch):
          self._plan_index.setdefault(int(batch[0]), []).append(i)
      self._cursor, self._stop = 0, False
    self._thread = threading.Thread(target=self._prefetch_loop, name='autocache-prefetch',
                                    daemon=True)
    self._thread.start()

  def stop_prefetch(self) -> None:
    """Stops the read-ahead thread and releases what it staged."""
    self._settle()
    thread, self._thread = getattr(self, '_thread', None), None
    if thread is not None:
      with self._lock:
        self._stop = True
        self._changed.notify_all()
      thread.join()
    with self._lock:
      self._plan, self._plan_index, self._cursor = [], {}, 0
      self._staged.clear()
      self._staged_bytes = 0

  def _follow_plan(self, ids: np.ndarray) -> None:
    """Moves the prefetch cursor past the planned batch equal to ``ids``
    (being fetched now) and releases what was staged for batches before it."""
    if not self._plan or not len(ids):
      return
    with self._lock:
      for i in self._plan_index.get(int(ids[0]), []):
        if i >= self._cursor and np.array_equal(self._plan[i], ids):
          self._cursor = i + 1
          passed = [k for k, v in self._staged.items() if v[0] < i]
          for k in passed:
            del self._staged[k]
          self._staged_bytes -= len(passed) * self.entry_bytes
          self._changed.notify_all()
          break

  def _prefetch_loop(self) -> None:
    for index in range(len(self._plan)):
      pending = np.unique(self._plan[index])
      while len(pending):
        with self._lock:
          room = (self.prefetch_bytes - self._staged_bytes) // self.entry_bytes
          while not self._stop and index >= self._cursor and room < 1:
            self._changed.wait()
            room = (self.prefetch_bytes - self._staged_bytes) // self.entry_bytes
          if self._stop:
            return
          if index < self._cursor:
            break  # the consumer is past this batch
          take = pending[:room]
          pending = pending[room:]
          take = take[(self._tier[take] == DISK) & ~np.isin(take, list(self._staged))]
          snapshot = (self._slot[take].copy(), self._depth[take].copy(),
                      self._version[take].copy())
        if not len(take):
          continue
        start = time.perf_counter()
        payload, valid = self._disk.read(snapshot[0], take, snapshot[1])
        with self._lock:
          self._seconds['prefetch_seconds'] += time.perf_counter() - start
          if self._stop:
            return
          current = (self._version[take] == snapshot[2]) & (index >= self._cursor)
          bad = current & ~valid
          for i in np.nonzero(current & valid)[0]:
            if self._staged_bytes + self.entry_bytes > self.prefetch_bytes:
              break
            self._staged[int(take[i])] = (index, int(snapshot[2][i]), int(snapshot[1][i]),
                                          payload[i].copy())
            self._staged_bytes += self.entry_bytes
          for i in np.nonzero(bad)[0]:
            self._drop_if_current(int(take[i]), snapshot[2][i])
          self._counts['corrupt'] += int(bad.sum())
          self._note_memory()
        if bad.any():
          self.log(f'autocache: {int(bad.sum())} corrupt disk entries found by prefetch '
                   f'(IDs {take[bad][:8].tolist()}); they are recomputed')
