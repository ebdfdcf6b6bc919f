"""The frozen prefix's output for the pipeline: computed or served by AutoCache.

With F > 0 frozen blocks the pipeline's input is the output of the frozen
prefix (embedding and blocks 0..F−1). :class:`FrozenPrefix` produces it for
every batch, either

* by running the prefix forward only, data-parallel over *all* devices (one
  jitted function per depth; the paper ran it on each pipeline's first
  device), or
* from the :class:`pipejax.autocache.ActivationCache` (paper §3.4): entries are
  keyed by sample ID, filled the first time a sample is seen at a depth, and
  pushed through the newly frozen blocks once at every freeze event
  (:meth:`FrozenPrefix.change_depth`), so no sample passes a frozen layer
  twice.

Whether the cache serves a depth is measured, not assumed: at a depth change
the prefix's forward over one batch is timed against a cache read and write of
the same batch (:mod:`pipejax.autocache_policy`), and the decision is logged
with its inputs; after a filled cache has won, a deeper depth keeps it without
timing (:func:`pipejax.autocache_policy.keep_caching`: the read costs the same,
the forward more). ``policy='always'`` caches from the first frozen layer.

Several processes (hosts, paper App. D.1): each process's cache holds only the
samples of its own data shards, which stay on that process for the whole run
(:class:`pipejax.data.ShardedLoader`), so entries are reused every epoch. How
many entries a process must compute or advance depends on its own cache, so
that work runs on the process's own devices only — the prefix is forward-only
and per sample, it needs no collective — with as many calls as the process
needs: no program that spans processes ever depends on host-local state. The
cached output of the local batch joins the global batch like any input
(:func:`pipejax.distributed.put_batch`). What must agree does so through a
combine every process runs at the same point: the caching decision (each
timing is the slowest process's) and the counters in the metrics (summed).
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import os
import time
import zlib
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.layered import LayeredModel
from pipejax import autocache_policy, distributed, pipeline, resume
from pipejax.autocache import ActivationCache
from pipejax.programs import ProgramStore

Params = Any
CACHE_POLICIES = ('profile', 'always')
#: Cached entries are advanced in calls of up to this many bytes (as float32).
ADVANCE_BYTES = 256 << 20
_DECISION_ROUNDS = 3  # timings per caching decision (the fastest counts)


class FrozenPrefix:
  """Feeds the pipeline when blocks are frozen (see module docstring).

  Args:
    model: the layered model.
    devices: the devices of every mesh.
    source: the training source (``source[ids]`` gives the keys blocks read,
      e.g. BERT's ``attention_mask``, when cached entries are advanced).
    cache: the activation cache, or None to always run the prefix.
    policy: ``'profile'`` (cache a depth when it measures faster) or
      ``'always'``.
    log: one-line messages.
    programs: where its compiled programs are kept (the trainer's
      :class:`pipejax.programs.ProgramStore`); None compiles them as usual.
  """

  def __init__(self, model: LayeredModel, devices, source, cache: ActivationCache | None,
               policy: str = 'profile', log: Callable[[str], None] = print,
               programs: ProgramStore | None = None):
    if policy not in CACHE_POLICIES:
      raise ValueError(f'cache.policy must be one of {CACHE_POLICIES}, got {policy!r}')
    self.model, self.devices, self.source = model, list(devices), source
    self.cache, self.policy, self.log = cache, policy, log
    self.programs = programs or ProgramStore(None, {})
    self.use_cache = False
    self._batch_size = 0  # the global batch, set at each depth change
    self.processes = jax.process_count()
    self.decisions: list[autocache_policy.CachingDecision] = []
    self._prefixes: dict[tuple, Any] = {}
    self._advances: dict[tuple, Any] = {}
    self._compiled: dict[tuple, Any] = {}
    self._local_params: tuple | None = None  # (frozen, devices, a copy on this process's)

  # -- compiled functions --------------------------------------------------------
  def mesh(self, plan: pipeline.Plan):
    return pipeline.make_mesh(plan.pipeline_length, self.devices[:plan.num_devices])

  def spread(self, plan: pipeline.Plan) -> NamedSharding:
    """Split over every device: the prefix's input."""
    return NamedSharding(self.mesh(plan), P((pipeline.DATA, pipeline.STAGE)))

  def data(self, plan: pipeline.Plan) -> NamedSharding:
    """Split over ``'data'``: what the pipeline reads."""
    return NamedSharding(self.mesh(plan), P(pipeline.DATA))

  def local_mesh(self, plan: pipeline.Plan) -> Mesh:
    """This process's devices of ``plan`` as one ``'batch'`` axis: where the
    cache's misses and advances run with several processes."""
    mine = [d for d in self.devices[:plan.num_devices]
            if d.process_index == jax.process_index()]
    return Mesh(np.array(mine), ('batch',))

  def _layout(self, plan: pipeline.Plan, local: bool):
    """``(parameters, input, output)`` shardings of the prefix: over the job's
    devices (input over all, output over ``'data'``), or ``local``ly over this
    process's devices (both split over ``'batch'``)."""
    if not local:
      return NamedSharding(self.mesh(plan), P()), self.spread(plan), self.data(plan)
    mesh = self.local_mesh(plan)
    return NamedSharding(mesh, P()), NamedSharding(mesh, P('batch')), NamedSharding(
        mesh, P('batch'))

  @property
  def local_batch_size(self) -> int:
    """The samples of a global batch that this process reads."""
    return self._batch_size // self.processes

  def _params_here(self, plan: pipeline.Plan, frozen: Params) -> Params:
    """``frozen`` (replicated over the job's devices) as a copy on this
    process's devices, for the local functions; kept while ``frozen`` is the
    same tree (it changes only at a freeze event)."""
    held = self._local_params
    if held is None or held[0] is not frozen or held[1] != plan.num_devices:
      replicated = self._layout(plan, local=True)[0]

      def copy(x):
        if not x.sharding.is_fully_replicated:
          raise ValueError(f'frozen parameters must be replicated, got {x.sharding}')
        return jax.device_put(x.addressable_data(0), replicated)

      self._local_params = (frozen, plan.num_devices, jax.tree.map(copy, frozen))
    return self._local_params[2]

  def feed_keys(self) -> tuple[str, ...]:
    """What the pipeline reads besides ``'hidden'``."""
    return tuple(dict.fromkeys(self.model.block_keys + self.model.label_keys +
                               ('example_mask',)))

  @staticmethod
  def key(plan: pipeline.Plan) -> tuple[int, int]:
    return plan.partition.num_frozen_layers, plan.pipeline_length

  def prefix_fn(self, plan: pipeline.Plan, local: bool = False):
    """Jitted ``(frozen, inputs) -> hidden [batch, seq, hidden]``: embed and
    the first F blocks, forward only; input split over all devices, output
    over ``'data'`` (``local``: this process's batch on its own devices, see
    :meth:`_layout`). Cached per (F, K, local)."""
    key = self.key(plan) + (local,)
    if key not in self._prefixes:
      depth = plan.partition.num_frozen_layers

      def prefix(frozen, inputs):
        return jax.lax.stop_gradient(self.model.hidden_states(frozen, inputs, upto_layer=depth))

      params, inputs, outputs = self._layout(plan, local)
      self._prefixes[key] = jax.jit(prefix, in_shardings=(params, inputs),
                                    out_shardings=outputs)
    return self._prefixes[key]

  def advance_fn(self, plan: pipeline.Plan, from_depth: int, local: bool = False):
    """Jitted ``(frozen, hidden, extra) -> hidden``: blocks
    ``from_depth..F−1`` forward only, split over all devices (``local``: this
    process's devices; ``extra`` holds the keys blocks read). Cached per
    (from, F, K, local)."""
    key = (from_depth,) + self.key(plan) + (local,)
    if key not in self._advances:
      to_depth = plan.partition.num_frozen_layers

      def advance(frozen, hidden, extra):
        for unit in range(2 * from_depth + 1, 2 * to_depth + 1):
          hidden = self.model.sublayer(frozen, unit, hidden, extra)
        return jax.lax.stop_gradient(hidden)

      params, spread, _ = self._layout(plan, local)
      self._advances[key] = jax.jit(advance, in_shardings=(params, spread, spread),
                                    out_shardings=spread)
    return self._advances[key]

  def abstract_inputs(self, plan: pipeline.Plan, sample_batch: dict, batch_size: int):
    """``(prefix inputs, feed)`` of ``plan`` as shapes with shardings."""
    def shapes(keys, sharding):
      return {k: jax.ShapeDtypeStruct((batch_size,) + np.shape(sample_batch[k])[1:],
                                      np.asarray(sample_batch[k]).dtype, sharding=sharding)
              for k in keys if k in sample_batch}
    return shapes(self.model.input_keys, self.spread(plan)), shapes(self.feed_keys(),
                                                                    self.data(plan))

  def compile_ahead(self, plan: pipeline.Plan, from_depth: int, frozen_shapes,
                    sample_batch: dict, batch_size: int) -> dict:
    """Compiles the prefix of ``plan`` (and the cache's advance from
    ``from_depth``; with several processes also the prefix and the advance on
    this process's devices, which serve its cache); returns ``(kind, key) ->
    executable`` for :meth:`adopt` and the feed's shapes under ``'feed'``."""
    inputs, rest = self.abstract_inputs(plan, sample_batch, batch_size)
    # Without XLA:CPU's library fusions (see pipejax.programs): with the cache
    # a prefix runs for a fill epoch's batches and the stragglers, an advance
    # once a transition, and their first call's set-up outweighs what the
    # library saves. Without the cache the prefix runs every step, where it
    # costs up to ~1 ms a step more on the default model (measured); kept so.
    store = functools.partial(self.programs.compile, library_fusions=False)
    key = self.key(plan) + (False,)
    out = {}
    if self._serves_every_sample():
      # Cached entries will feed every step (advanced at the transition), so
      # the prefix would never run: it is not loaded (in the default run 3 of
      # its 6 prefixes, ~0.3 s of CPU each); a call that needs it after all
      # loads it then (:meth:`_prefix`). Its output's shape, from a trace:
      hidden = jax.eval_shape(self.prefix_fn(plan), frozen_shapes, inputs)
    else:
      prefix = store('prefix', key, (frozen_shapes, inputs), lambda: self.prefix_fn(plan))
      out[('prefix', key)] = prefix
      hidden = prefix.out_info
    out['feed'] = {'hidden': jax.ShapeDtypeStruct(hidden.shape, hidden.dtype,
                                                  sharding=self.data(plan)), **rest}
    if self.cache is None:
      return out
    local = self.processes > 1
    if local:  # the cache's misses and advances run on this process's devices
      frozen_shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                                   frozen_shapes)
      batch_size //= self.processes
      inputs = {k: jax.ShapeDtypeStruct((batch_size,) + v.shape[1:], v.dtype)
                for k, v in inputs.items()}
      key = self.key(plan) + (True,)
      out[('prefix', key)] = store('prefix', key, (frozen_shapes, inputs),
                                   lambda: self.prefix_fn(plan, local=True))
    if 0 < from_depth < plan.partition.num_frozen_layers:
      spread = self._layout(plan, local)[1]
      chunk = self.advance_size(batch_size)
      h = jax.ShapeDtypeStruct((chunk,) + hidden.shape[1:], hidden.dtype, sharding=spread)
      extra = {k: jax.ShapeDtypeStruct((chunk,) + v.shape[1:], v.dtype, sharding=spread)
               for k, v in inputs.items() if k in self.model.block_keys}
      key = (from_depth,) + self.key(plan) + (local,)
      out[('advance', key)] = store('advance', key, (frozen_shapes, h, extra),
                                    lambda: self.advance_fn(plan, from_depth, local))
    return out

  def advance_size(self, batch_size: int) -> int:
    """Samples per call when cached entries are advanced (the compiled
    shape): whole batches, enough for every sample this process may cache in
    one call unless that exceeds :data:`ADVANCE_BYTES`, and at least one
    batch. Each call is a round trip through the host that waits for the
    devices, so fewer is faster: the default run advances its 1,437 entries in
    one call (it took 6 of 256)."""
    entry = int(np.prod(self.cache.entry_shape)) * 4
    whole = -(-self.cache.num_owned // batch_size)
    return max(1, min(whole, ADVANCE_BYTES // max(entry * batch_size, 1))) * batch_size

  def adopt(self, compiled: dict) -> None:
    """Takes executables from :meth:`compile_ahead`."""
    self._compiled.update({k: v for k, v in compiled.items() if k != 'feed'})

  def _serves_every_sample(self) -> bool:
    """Whether the cache serves the current depth and holds an entry for
    every sample it may hold: the next depth's steps are then all fed from
    entries advanced at the transition (one process; several compile
    everything ahead)."""
    # The last decision must be one that the next depth keeps without timing
    # (which would run the prefix): filled entries chose the cache.
    last = self.decisions[-1] if self.decisions else None
    return (self.cache is not None and self.use_cache and self.processes == 1
            and last is not None and last.use_cache and last.filled
            and self.cache.holds_every_sample())

  def _prefix(self, plan, frozen: Params, inputs: dict, local: bool = False):
    """The compiled prefix of ``plan`` for ``(frozen, inputs)``: the one
    compiled ahead, else compiled now through the program store as
    :meth:`compile_ahead` would (not loaded ahead because the cache held every
    sample, or the plan of a resumed run), so that it is the same program."""
    key = self.key(plan) + (local,)
    if ('prefix', key) not in self._compiled:
      def spec(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=None if local else x.sharding)

      self._compiled[('prefix', key)] = self.programs.compile(
          'prefix', key, jax.tree.map(spec, (frozen, inputs)),
          lambda: self.prefix_fn(plan, local), library_fusions=False)
    return self._compiled[('prefix', key)]

  def _advance(self, plan, from_depth, local: bool = False):
    return (self._compiled.get(('advance', (from_depth,) + self.key(plan) + (local,))) or
            self.advance_fn(plan, from_depth, local))

  # -- per step ----------------------------------------------------------------------
  def feed(self, sample_ids: np.ndarray, batch: dict, plan: pipeline.Plan, frozen: Params
           ) -> dict:
    """The pipeline's input for one batch of ``plan`` (F > 0): ``'hidden'``
    ``[batch, seq, hidden]`` and the keys blocks and the head read, on the
    devices, split over ``'data'``."""
    data = self.data(plan)
    rest = {k: batch[k] for k in self.feed_keys() if k in batch}

    def compute(rows=None):
      hidden = self._forward(plan, frozen, batch)
      return hidden if rows is None else np.asarray(hidden)[rows]

    def compute_here(rows):  # several processes: this process's batch, on its devices
      return self._forward_here(plan, frozen, batch)[rows]

    if not self.use_cache:
      return {'hidden': compute(), **distributed.put_batch(rest, data)}
    if self.processes == 1 and self.cache.is_new(sample_ids):
      # A batch seen for the first time feeds the step straight from the
      # devices; its host copy is stored when the cache is next used, so the
      # host never waits for the prefix in the middle of the step stream.
      hidden = compute()
      hidden.copy_to_host_async()
      self.cache.defer(sample_ids, lambda: np.asarray(hidden))
      return {'hidden': hidden, **distributed.put_batch(rest, data)}
    hidden = self.cache.fetch(sample_ids, compute if self.processes == 1 else compute_here,
                              lambda ids, h, d0, d1: self._advance_host(plan, frozen, ids, h, d0))
    # One transfer for the entries and the rest (two cost ~1 ms a step more).
    return distributed.put_batch({'hidden': hidden, **rest}, data)

  def _forward(self, plan, frozen, batch: dict) -> jax.Array:
    """The prefix's output ``[batch, seq, hidden]`` of a global ``batch`` on
    the devices, split over ``'data'`` (not waited for)."""
    inputs = distributed.put_batch({k: batch[k] for k in self.model.input_keys},
                                   self.spread(plan))
    return self._prefix(plan, frozen, inputs)(frozen, inputs)

  def _forward_here(self, plan, frozen, batch: dict, to_host: bool = True):
    """The prefix's output ``[local batch, seq, hidden]`` of this process's
    ``batch``, computed on its own devices (several processes); on the host
    (numpy), or where it was computed when not ``to_host``."""
    inputs = jax.device_put({k: batch[k] for k in self.model.input_keys},
                            self._layout(plan, local=True)[1])
    frozen = self._params_here(plan, frozen)
    out = self._prefix(plan, frozen, inputs, local=True)(frozen, inputs)
    return np.asarray(out) if to_host else out

  def _advance_host(self, plan, frozen, ids: np.ndarray, hidden: np.ndarray,
                    from_depth: int) -> np.ndarray:
    """Cached entries ``hidden [m, seq, hidden]`` pushed from ``from_depth`` to
    the plan's depth (padded to :meth:`advance_size`, the compiled
    shape; with several processes on this process's devices, batches of its
    own samples)."""
    size = self.advance_size(self.local_batch_size)
    m = len(ids)
    pad = np.concatenate([np.arange(m), np.zeros(size - m, np.int64)]) if m < size else None
    rows = (lambda a: a[pad]) if pad is not None else (lambda a: a)
    extra = {}
    if self.model.block_keys:
      looked_up = self.source[np.asarray(ids)]
      extra = {k: rows(np.asarray(looked_up[k])) for k in self.model.block_keys}
    local = self.processes > 1
    if local:
      frozen = self._params_here(plan, frozen)
    spread = self._layout(plan, local)[1]
    out = self._advance(plan, from_depth, local)(frozen, jax.device_put(rows(hidden), spread),
                                                 jax.device_put(extra, spread))
    return np.asarray(out)[:m]

  # -- freeze events -----------------------------------------------------------------
  def change_depth(self, plan: pipeline.Plan, frozen: Params, sample_batch: dict,
                   batch_size: int, epochs_ahead: int) -> float:
    """At a new depth (the first freeze, or a freeze event): decides whether
    the cache serves it and advances the cached entries once. Returns the
    seconds spent."""
    self._batch_size = batch_size
    if self.cache is None or plan.partition.num_frozen_layers == 0:
      return 0.0
    start = time.perf_counter()
    depth = plan.partition.num_frozen_layers
    stats = self.cache.stats()
    filled = self.use_cache and stats['memory_entries'] + stats['disk_entries'] > 0
    epochs_ahead = max(epochs_ahead, 1)
    # Settled without timing when the cache served the last depth from filled
    # entries (the same on every process: decisions are taken jointly).
    kept = autocache_policy.keep_caching(self.decisions[-1] if self.decisions else None,
                                         depth, epochs_ahead) if self.use_cache else None
    if kept is not None:
      self.decisions.append(kept)
      self.log('  ' + kept.describe())
      self.use_cache = kept.use_cache
    else:
      self.use_cache = self._decide(plan, frozen, sample_batch, epochs_ahead, filled)
    if self.use_cache and filled:  # this process's entries (a local computation)
      self.cache.advance(depth, lambda ids, h, d0, d1: self._advance_host(plan, frozen, ids, h,
                                                                          d0),
                         self.advance_size(self.local_batch_size))
    else:  # nothing to carry over: entries (if any) were filled at a depth no longer served
      self.cache.advance(depth)
      self.cache.clear()
    return time.perf_counter() - start

  def _decide(self, plan, frozen, sample_batch, epochs_ahead: int, filled: bool) -> bool:
    """Whether the cache serves ``plan``'s depth: the same answer on every
    process (with several, each timing is the slowest process's and the
    cache counts as filled only if every process's is)."""
    depth = plan.partition.num_frozen_layers
    size = self.local_batch_size  # the plan's (per_pipeline: it grows with R)
    sample_batch = {k: np.asarray(v)[np.arange(size) % len(v)] for k, v in sample_batch.items()}
    inputs = None
    if self.processes == 1:
      inputs = jax.device_put({k: sample_batch[k] for k in self.model.input_keys},
                              self.spread(plan))

    def forward():  # on the devices, as the step without the cache runs it
      if inputs is None:  # this process's share, on its devices (as a miss runs)
        return self._forward_here(plan, frozen, sample_batch, to_host=False)
      return self._prefix(plan, frozen, inputs)(frozen, inputs)

    jax.block_until_ready(forward())  # the first call also loads the program
    # The fastest of a few rounds: one timing of a few milliseconds on a busy
    # machine can be off by several times, and flip the decision.
    timings = []
    for _ in range(_DECISION_ROUNDS):
      start = time.perf_counter()
      out = jax.block_until_ready(forward())
      forward_seconds = time.perf_counter() - start
      # A miss also copies its output to the host and a hit its entries to the
      # devices: the cache's costs, which the prefix run on the devices saves.
      start = time.perf_counter()
      hidden = np.asarray(out)
      to_host = time.perf_counter() - start
      start = time.perf_counter()
      jax.block_until_ready(jax.device_put(hidden, out.sharding))
      to_devices = time.perf_counter() - start
      write, read = self.cache.measure_io(hidden)
      timings.append((forward_seconds, write + to_host, read + to_devices))
    forward_seconds, write, read = np.min(timings, axis=0).tolist()
    fits = self.cache.fits()
    combined = ''
    if self.processes > 1:
      forward_seconds, read, write, filled, fits = combine_decision_inputs(
          distributed.gather_exact([forward_seconds, read, write, float(filled), fits]))
      combined = f' (timings: the slowest of {self.processes} processes)'
    decision = autocache_policy.decide_caching(depth, forward_seconds, read, write, epochs_ahead,
                                               filled, fits=fits, batch_size=size)
    self.decisions.append(decision)
    use = decision.use_cache or self.policy == 'always'
    self.log('  ' + decision.describe() + combined + (
        ' — policy always: caching' if use and not decision.use_cache else ''))
    return use

  def prefetch(self, batches: list[np.ndarray], plan: pipeline.Plan, frozen: Params) -> int:
    """Prepares the cache for an epoch's ``batches`` (their sample IDs, in
    order) when it serves the current depth: computes the *stragglers* (with
    ``plan``'s prefix and the ``frozen`` parameters), then reads disk entries ahead
    (with a disk tier). Returns the stragglers computed.

    A straggler is a sample without an entry in a batch that has some: a
    sample the epochs since the cache was filled did not draw (an epoch drops
    its last partial batch). A batch with one would be served by a blocking
    round trip through the host (the prefix on the devices, behind the running
    step, copied back to be merged with the cached rows) — one per such batch,
    27 of the default run's 44 in the epoch after the fill. Computed here,
    together, in batches of the prefix's compiled size, each is one miss and
    one pass through the frozen blocks, as it would have been; a batch of new
    samples only keeps the faster path of :meth:`feed` (computed on the
    devices, stored later). Only as many as the cache can still store are
    computed here: with budgets below the data set, one it must refuse would
    be computed twice (here and in :meth:`feed`).
    """
    if not self.use_cache:
      return 0
    computed = self._fill_stragglers(plan, frozen, batches)
    if self.cache.disk_bytes:
      self.cache.prefetch(batches)
    return computed

  def _fill_stragglers(self, plan: pipeline.Plan, frozen: Params,
                       batches: list[np.ndarray]) -> int:
    if not batches:
      return 0
    batches = [np.asarray(ids) for ids in batches]
    # One lookup for the whole epoch (per batch it took 0.4 s of an ImageNet epoch).
    missing = np.split(self.cache.depths(np.concatenate(batches)) < 0,
                       np.cumsum([len(ids) for ids in batches])[:-1])
    stragglers = [ids[m] for ids, m in zip(batches, missing) if m.any() and not m.all()]
    # Only those the cache can still store: one it must refuse would be
    # computed here and again by feed (with a budget below the data set).
    ids = np.unique(np.concatenate(stragglers))[:self.cache.room()] if stragglers else []
    if not len(ids):
      return 0
    start_time = time.perf_counter()
    size = self.local_batch_size
    for start in range(0, len(ids), size):
      chunk = ids[start:start + size]
      padded = np.resize(chunk, size)  # the compiled batch; repeats are computed, not stored

      def compute(rows, padded=padded):
        batch = self.source[padded]
        if self.processes > 1:
          return self._forward_here(plan, frozen, batch)[rows]
        return np.asarray(self._forward(plan, frozen, batch))[rows]

      self.cache.fetch(chunk, compute)
    self.log(f'  autocache: {len(ids)} sample{"s" * (len(ids) != 1)} without an entry in this '
             f'epoch\'s partly cached batches computed and stored in '
             f'{time.perf_counter() - start_time:.2f}s')
    return len(ids)

  def checkpoint_meta(self) -> dict:
    """The cache's metadata for a checkpoint: whether it serves the current
    depth, its decisions so far and its counters (not its entries; with
    several processes their sums, see :meth:`stats`), with each sample's
    depth reached and frozen-block passes (``samples``, packed). A
    collective with several processes, like :meth:`stats`."""
    meta = {'use_cache': self.use_cache, 'batch_size': self._batch_size,
            'depth': None if self.cache is None else self.cache.depth,
            'decisions': [dataclasses.asdict(d) for d in self.decisions],
            'stats': self.stats()}
    if self.cache is not None:
      counters = self.cache.counters()
      # A process counts only its own samples (disjoint): the maximum over
      # the processes is each sample's value.
      meta['samples'] = {name: _pack(distributed.gather_max(counters[name]))
                         for name in ('reached', 'passes')}
    return meta

  def restore(self, meta: dict, batch_size: int) -> None:
    """Takes the decisions of :meth:`checkpoint_meta` (no re-profiling) and
    starts the cache empty at the saved depth: entries are only a speed-up,
    and a cached activation equals the computed one, so they are rebuilt as
    batches come. The counters go on from the checkpoint's (with several
    processes, process 0 carries the saved sums); refilling the cache
    counts as repeated frozen-block passes, which it is."""
    self.decisions = [autocache_policy.CachingDecision(**d) for d in meta['decisions']]
    self._batch_size = batch_size
    self.use_cache = bool(meta['use_cache']) and self.cache is not None
    if self.cache is not None:
      self.cache.advance(max(meta['depth'] or 0, self.cache.depth))
      self.cache.clear()
      saved = {k[len('cache_'):]: v for k, v in meta.get('stats', {}).items()}
      if not distributed.is_main_process():
        saved = {}  # the sums are process 0's to carry
      samples = meta.get('samples')  # absent in checkpoints of pipejax before 2026-11-30
      self.cache.restore_counters(
          saved, saved, *((_unpack(samples[name]) for name in ('reached', 'passes'))
                          if samples else ()))

  def stats(self) -> dict:
    """Cache counters for the metrics row (empty without a cache). With
    several processes every counter (entries, bytes and seconds too) is the
    sum over the processes, ``depth`` excepted: a collective, which every
    process calls at the same point (an epoch's end, a checkpoint)."""
    if self.cache is None:
      return {}
    stats = self.cache.stats()
    if self.processes > 1:
      keys = sorted(k for k in stats if k != 'depth')
      totals = distributed.gather_exact([stats[k] for k in keys]).sum(axis=0)
      for k, total in zip(keys, totals):
        stats[k] = float(total) if isinstance(stats[k], float) else int(total)
    return {f'cache_{k}': v for k, v in stats.items()}

  def local_stats(self) -> dict:
    """This process's own cache counters (what :meth:`stats` sums; after a
    resume, process 0's include the job's sums from the checkpoint) and the
    IDs its cache holds; empty without a cache."""
    if self.cache is None:
      return {}
    return {**{f'cache_{k}': v for k, v in self.cache.stats().items()},
            'cached_ids': self.cache.cached_ids().tolist()}


def _pack(values: np.ndarray) -> str:
  """Small non-negative integers ``[n]`` as compact JSON-safe text."""
  return base64.b64encode(zlib.compress(np.asarray(values, '<i8').tobytes())).decode('ascii')


def _unpack(text: str) -> np.ndarray:
  return np.frombuffer(zlib.decompress(base64.b64decode(text)), '<i8').astype(np.int64)


def combine_decision_inputs(everyone: np.ndarray) -> tuple[float, float, float, bool, float]:
  """The caching decision's inputs agreed by several processes, from a row
  per process of ``(forward, read, write seconds, filled, fits)``: the
  slowest process's timings, filled only if every process's cache is, and
  the smallest fraction of its samples that a process's budgets hold."""
  forward_seconds, read, write = (float(v) for v in everyone[:, :3].max(axis=0))
  return forward_seconds, read, write, bool(everyone[:, 3].all()), float(everyone[:, 4].min())


def make_cache(config, model: LayeredModel, source, params: Params, workdir: str,
               log: Callable[[str], None] = print, own_ids: np.ndarray | None = None
               ) -> ActivationCache | None:
  """The run's AutoCache from ``config.cache`` (None when disabled, or refused
  because the source is randomly augmented). ``own_ids``: the sample IDs this
  process reads (its data shards), the only ones its cache may hold. With
  several processes each has its own directory, ``<cache dir>/process_<i>``."""
  c = config.cache
  if not c.enabled:
    return None
  if not autocache_policy.caching_allowed(getattr(source, 'randomly_augmented', False),
                                          c.accept_reused_augmentation, log):
    return None
  sample = source[np.arange(1)]
  entry = jax.eval_shape(lambda p, b: model.hidden_states(p, b, upto_layer=0), params,
                         {k: sample[k] for k in model.input_keys})
  # What decides the frozen layers' output: the keys that decide a
  # checkpoint's state (training decides the frozen weights; the HF model
  # config among them), the data. Not what a resumed run may change
  # (train.epochs, pipeline.*, cache.*, checkpoint.*): a resume starts the
  # cache empty at the checkpoint's depth (FrozenPrefix.restore), so such a
  # change must not make the run refuse its own directory.
  settings = resume.identity(config, model.hf_config.to_dict(), bookkeeping=True,
                             inputs=getattr(source, 'preparation', None))
  directory = c.directory or os.path.join(workdir, 'cache')
  if jax.process_count() > 1:
    # The coordinator's address and this process's rank may change from one
    # launch of the job to the next without changing any output.
    settings['distributed'] = {'processes': jax.process_count(),
                               'data_shards': config.distributed.data_shards}
    directory = os.path.join(directory, f'process_{jax.process_index()}')
  identity = hashlib.sha256(json.dumps(
      {'config': settings, 'samples': len(source), 'entry': list(entry.shape[1:])},
      sort_keys=True, default=str).encode()).hexdigest()[:16]
  return ActivationCache(
      identity=identity, num_samples=len(source), entry_shape=entry.shape[1:],
      dtype=c.dtype, memory_bytes=int(c.memory_mb * 2**20), disk_bytes=int(c.disk_mb * 2**20),
      # The workdir's own cache/ is this workdir's runs' alone (its lock): one
      # of another identity is an earlier run's there (resumed with a newer
      # transformers, another process count; started over), not to refuse.
      directory=directory, on_mismatch=c.on_mismatch if c.directory else 'clear',
      own_ids=own_ids,
      reuse=False,  # a run starts with nothing frozen, a resume empty at its depth
      log=lambda msg: log('  ' + msg))  # under the epoch's line, like the run's other events
