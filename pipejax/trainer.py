"""The elastic training loop (paper Algorithm 1 end to end).

Each epoch runs the compiled step of the current plan over the loader's
batches: the frozen prefix forward-only and data-parallel over all devices
(``stop_gradient`` at the boundary), then the pipelined step over the active
units, then AdamW on the active parameters only. At the end of each freeze
timestep the policy decides F (Eq. 1); a change of F is the only thing that
changes the plan: AutoPipe repartitions and compresses K, AutoDP rebuilds the
mesh as (N/K, K), moves the state and the step is compiled (or taken from the
cache). Frozen parameters live outside the optimizer: no moment, no weight
decay, no update ever touches them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import json
import math
import os
import threading
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.layered import LayeredModel
from pipejax import autodp, autopipe, distributed, freeze, pipeline, reporting, resume
from pipejax import partition as part
from pipejax.frozen_prefix import FrozenPrefix, make_cache
from pipejax.optimizer import optimizer_for, schedule_count, with_schedule_count
from pipejax.data import Loader
from pipejax.programs import ProgramStore

Params = Any
PROFILE_ROUNDS = 2  # timed steps per micro-batch candidate
_EVAL_BATCHES_IN_FLIGHT = 8  # evaluation waits for the batch this many back
# Evaluation's default batch, in global train batches: a forward keeps no
# activations for a backward and no optimizer state, and fewer, larger batches
# cost fewer dispatches (the default run's evaluation: 2.1 -> 1.4 s).
EVAL_BATCH_FACTOR = 4


@dataclasses.dataclass
class Transition:
  """One change of plan, timed."""
  epoch: int
  step: int
  frozen_layers: int
  old: str
  new: str
  reshard_seconds: float
  compile_seconds: float
  compiled_ahead: bool
  cache_seconds: float = 0.0
  total_seconds: float = 0.0  # the whole transition: decision, compile wait, move, cache
  warmup_seconds: float = 0.0  # the new plan's first step beyond the epoch's mean step
  cache: bool | None = None  # the cache serves the new depth (None: a record from before)


def layer_grad_norms(grads: Params, partition: part.Partition, tables=None) -> jax.Array:
  """``[L]`` gradient norm of every block (attention and MLP halves together)
  from gradients in the stage layout; frozen blocks get 0. ``tables``: the
  slot tables as runtime arrays ``(layer, has_attention, has_mlp_in,
  has_mlp_out)`` (a split MLP's halves on two stages add up; default:
  ``partition``'s, as constants)."""
  t = part.SlotTables(*(partition.tables.arrays() if tables is None else tables))

  def slot_sq(stack):
    return sum(jnp.sum(jnp.square(g), axis=tuple(range(2, g.ndim)))
               for g in jax.tree.leaves(stack))

  sq = slot_sq(grads['attention']) * t.has_attention + slot_sq(grads['mlp']) * t.has_mlp
  per_layer = jnp.zeros(partition.num_layers, jnp.float32).at[t.layer.reshape(-1)].add(
      sq.reshape(-1))
  return jnp.sqrt(per_layer)


class _Ahead(NamedTuple):
  """The next plan being prepared in the background (:meth:`Trainer.prepare_next`)."""
  move: tuple[part.Partition, part.Partition]  # (from, to)
  future: concurrent.futures.Future  # -> (move program, prefix programs)
  stale: threading.Event  # set: stop between two compiles


def _failed(future: concurrent.futures.Future) -> bool:
  """Whether ``future`` ended without a result (raised or was cancelled)."""
  return future.done() and (future.cancelled() or future.exception() is not None)


class LossNotFinite(FloatingPointError):
  """The training loss, or a block's gradient norm, became NaN or infinite:
  training stops (a diverged state is never checkpointed). ``step`` is the
  step at which it was seen (the loss is read every 10 steps; both are read
  before every checkpoint and at the end of each epoch). ``what`` names the
  value (default: the training loss) and ``value`` is what it was."""

  def __init__(self, value: float, epoch: int, step: int, what: str = 'the training loss'):
    self.value, self.epoch, self.step = value, epoch, step
    super().__init__(f'{what} is {value} at step {step} (epoch {epoch})')


class TrainingInterrupted(Exception):
  """Training stopped on request (SIGTERM/SIGINT) after a step, with the
  state saved in ``checkpoint`` (None when nothing was saved: checkpoints
  disabled, or a start over cancelled; the caller says which)."""

  def __init__(self, epoch: int, step: int, checkpoint: str | None):
    self.epoch, self.step, self.checkpoint = epoch, step, checkpoint
    super().__init__(f'stopped on request after step {step} (epoch {epoch}); '
                     f'checkpoint: {checkpoint or "none"}')


def _without_frozen(state: dict) -> dict:
  """The part of a trainer state that a train step reads and writes."""
  return {k: v for k, v in state.items() if k != 'frozen'}


def _correct(metrics: dict) -> jax.Array:
  """The summed ``correct`` of a step's metrics; NaN for a regression head
  (no accuracy: the epoch's ``train_accuracy`` is then None)."""
  return metrics['correct'] if 'correct' in metrics else jnp.full((), jnp.nan, jnp.float32)


def _background_pool() -> concurrent.futures.ThreadPoolExecutor:
  """The one thread that prepares the next plan, at the lowest priority."""
  return concurrent.futures.ThreadPoolExecutor(max_workers=1, initializer=_background_priority)


def _background_priority() -> None:
  """Gives the calling thread (the one that prepares the next plan) the
  lowest CPU priority (Linux: per-thread nice 19), so it fills the cores'
  idle moments instead of slowing the training step's device threads; a
  transition that has to wait for it leaves it the cores."""
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
  except (AttributeError, OSError):
    pass  # not Linux, or not permitted: normal priority


def _spec(tree) -> Any:
  """Arrays as shapes with their shardings (to compile against)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _zeros_like(x: jax.Array) -> jax.Array:
  """Zeros with ``x``'s sharding (compiled steps insist on their shardings)."""
  return jax.device_put(jnp.zeros(x.shape, x.dtype), x.sharding)


def check_batch_for_freezing(config, num_devices: int) -> None:
  """Raises :class:`pipejax.pipeline.PlanError` unless every plan the run
  can reach splits its global batch over its R·K devices, as the frozen
  blocks' data-parallel forward needs (:func:`pipejax.autodp.check_frozen_batches`);
  nothing to check without freezing."""
  c = config
  if c.freeze.policy == 'none':
    return
  lengths = (autopipe.reachable_lengths(c.pipeline.initial_length, num_devices)
             if c.freeze.compress else [c.pipeline.initial_length])
  autodp.check_frozen_batches(c.train.batch_size, c.train.batch_mode, num_devices, lengths,
                              c.pipeline.autodp)


def traced_config(config) -> dict:
  """The config keys that the run's programs may be traced from (a key of
  the program store): all but ``checkpoint``, ``resume`` and ``data.workers``
  (saving, resuming and the threads that read the data never enter a traced
  program)."""
  traced = {k: v for k, v in config.to_dict().items() if k not in ('checkpoint', 'resume')}
  if isinstance(traced.get('data'), dict):
    traced['data'] = {k: v for k, v in traced['data'].items() if k != 'workers'}
  return traced

#: What :meth:`Trainer.restore` reads of a checkpoint's meta, by key path:
#: the JSON types each must have (an int where a float is named is one too).
_META_SCHEMA = {
    'epoch': int, 'step_in_epoch': int, 'epoch_done': bool, 'step': int, 'devices': int,
    'wall_seconds': float, 'transitions': list,
    'plan': {'frozen_layers': int, 'stage_sizes': list, 'pipeline_length': int,
             'replicas': int, 'micro_batches': int},
    'freeze_state': {'num_frozen_layers': int, 'bound': float, 'timestep': int, 'history': list},
    'micro_batches': {'chosen': dict, 'trials': dict, 'announced': list, 'timings': dict},
    'cache': {'decisions': list, 'use_cache': bool, 'depth': (int, type(None))},
}


def meta_problem(meta: dict, schema: dict = _META_SCHEMA, where: str = '') -> str | None:
  """What makes ``meta`` (a checkpoint's, JSON) unusable for
  :meth:`Trainer.restore`: the first key it lacks, or holds a value of
  another type, by its path; None when it has them all (a hand-edited or
  damaged meta is set aside as unreadable, not a traceback)."""
  for key, want in schema.items():
    name = f'{where}{key}'
    if key not in meta:
      return f'it has no {name!r}'
    value = meta[key]
    if isinstance(want, dict):
      if not isinstance(value, dict):
        return f'its {name!r} is a {type(value).__name__}, not an object'
      inner = meta_problem(value, want, f'{name}.')
      if inner:
        return inner
      continue
    kinds = want if isinstance(want, tuple) else (want,)
    if float in kinds:
      kinds = (*kinds, int)
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
      kind = kinds[0].__name__
      return f'its {name!r} is {value!r:.40}, not {"an" if kind[0] in "aeiou" else "a"} {kind}'
  return None


class Trainer:
  """Elastic PipeTransformer training of one model.

  Args:
    model: the layered model.
    params: its canonical parameters (random or pretrained).
    config: the run's ``ml_collections.ConfigDict`` (see
      ``experiments/vit_imagenet.py`` for the fields).
    workdir: where metrics, summary and checkpoints go.
    train_loader, eval_loader: :class:`pipejax.data.Loader`\\ s.
    devices: devices to use (default: all).
    log: a ``print``-like function for one-line progress messages.
    evaluator: optional ``(trainer, canonical_params) -> dict`` replacing the
      built-in evaluation (``correct / count`` of the model's loss metrics);
      it must return ``eval_accuracy`` and may add other ``eval_*`` keys,
      which go into the epoch's metrics row (e.g. SQuAD's exact match and F1).
      A regression head (metrics without ``correct``) needs one; its rows
      have ``train_accuracy`` None.
    program_store: the folder where compiled programs are kept for later runs
      (:class:`pipejax.programs.ProgramStore`); None turns the store off.
  """

  def __init__(self, model: LayeredModel, params: Params, config, workdir: str,
               train_loader: Loader, eval_loader: Loader, devices=None,
               log: Callable[[str], None] = print,
               evaluator: Callable[['Trainer', Params], dict] | None = None,
               program_store: str | None = None):
    self.model, self.config, self.workdir = model, config, workdir
    self.evaluator = evaluator
    self.train_loader, self.eval_loader = train_loader, eval_loader
    self.devices = list(jax.devices() if devices is None else devices)
    self.log = log
    self.num_devices = len(self.devices)
    # All devices as one 'batch' axis: evaluation and the layout-free state.
    self._flat_mesh = Mesh(np.array(self.devices), ('batch',))
    c = config
    min_active = c.freeze.min_active_layers
    if not c.freeze.compress:
      # A static pipeline of length K needs K active units: 2·(L − F) + 1 ≥ K.
      needed = math.ceil((c.pipeline.initial_length - 1) / 2)
      if needed > min_active and c.freeze.policy != 'none':
        log(f'freeze: at least {needed} blocks stay trainable (freeze.min_active_layers='
            f'{min_active}): with freeze.compress=False the {c.pipeline.initial_length} '
            f'stages need a unit each')
      min_active = max(min_active, needed)
    self.policy = freeze.FreezePolicy(c.freeze.policy, model.num_layers, c.freeze.alpha,
                                      min(min_active, model.num_layers))
    self.costs = autopipe.parameter_costs(
        params, model.mlp_in_keys if model.can_split_mlp else (),
        c.pipeline.split_mlp_min_gain)
    self.initial_length = c.pipeline.initial_length
    autodp.replicas_for(self.num_devices, self.initial_length)  # raises if K does not divide N
    self.pipe = pipeline.Pipeline(model, devices=self.devices,
                                  exchange=c.pipeline.exchange)
    # The learning-rate schedule's unit: a step of the starting global batch
    # (of the starting plan's replicas).
    self.starting_batch_size = autodp.global_batch_size(
        c.train.batch_size, self._replicas(self.initial_length), c.train.batch_mode)
    self.steps_per_epoch = dataclasses.replace(
        train_loader, batch_size=self.starting_batch_size).steps_per_epoch()
    # What the programs of this run are traced from, besides the code and
    # their arguments (the learning-rate schedule needs the steps per epoch).
    self.programs = ProgramStore(program_store, {
        'config': traced_config(config), 'model': model.name, 'hf': model.hf_config.to_dict(),
        'steps_per_epoch': self.steps_per_epoch, 'fill': self.pipe.fill,
        'devices': [int(d.id) for d in self.devices]}, log)
    self.prefix = FrozenPrefix(model, self.devices, train_loader.source,
                               make_cache(config, model, train_loader.source, params, workdir,
                                          log, own_ids=train_loader.ids), c.cache.policy, log,
                               programs=self.programs)
    about = autopipe.profile_about(model.hf_config, devices=self.num_devices,
                                   batch=c.train.batch_size, batch_mode=c.train.batch_mode,
                                   platform=self.devices[0].platform,
                                   schedule=c.pipeline.schedule, exchange=self.pipe.exchange,
                                   autodp=c.pipeline.autodp)
    # The key (hashed) is the description with the HF config as its repr.
    key = {'model': repr(model.hf_config.to_dict()),
           **{k: v for k, v in about.items() if k != 'hf_config'}}
    # A fixed pipeline.micro_batches never reads or writes the profile file.
    self.profile = autopipe.MicroBatchProfile(
        (c.pipeline.profile_path or None) if not c.pipeline.micro_batches else None, key, about,
        log=self.log)
    self.lr, self.optimizer = optimizer_for(c.train, self.steps_per_epoch)
    self._steps: dict[tuple, Any] = {}  # by pipeline.program_key
    self._eval: dict[tuple, concurrent.futures.Future] = {}  # compiled evaluation forwards
    self._executables: dict[tuple, Any] = {}  # compiled steps, by pipeline.program_key
    self._pool = _background_pool()
    self._ahead = None
    self._trials: dict[int, dict] = {}
    self._announced: set[int] = set()
    self._refitted: set[tuple[int, int]] = set()  # (R, M) whose refit M was said
    self._portable: dict[tuple, Any] = {}
    self._portable_compiled: dict[tuple, Any] = {}
    self.transitions: list[Transition] = []
    self._first_step_pending = False  # time the first step after a transition
    self.micro_batch_timings: dict[int, dict[int, float]] = {}
    partition = autopipe.partition_for(self.costs, 0, self.initial_length,
                                       c.freeze.lambda_frozen).partition
    self._param_shapes = jax.eval_shape(lambda: params)
    self.plan = self._plan(partition, micro_batches=None, initial=True)
    check_batch_for_freezing(c, self.num_devices)  # before an epoch is trained for nothing
    self.state = self._init_state(params, self.plan)
    # Where run() starts: (epoch, batches already done in it, whether the
    # freeze decision at the end of the epoch before is still to be made).
    self._start = (0, 0, False)
    self._wall_offset, self._run_start = 0.0, time.perf_counter()

  # -- plans -------------------------------------------------------------------
  def _replicas(self, pipeline_length: int) -> int:
    """R for a pipeline of length K (:func:`pipejax.autodp.replicas_for`)."""
    return autodp.replicas_for(self.num_devices, pipeline_length, self.config.pipeline.autodp)

  def _plan(self, partition: part.Partition, micro_batches: int | None,
            initial: bool = False) -> pipeline.Plan:
    k = partition.pipeline_length
    replicas = self._replicas(k)
    m = micro_batches or self.config.pipeline.micro_batches or k
    plan = pipeline.Plan(partition, replicas, m, self.config.pipeline.schedule)
    per_replica = self.batch_size(plan) // replicas
    if not initial and (self.batch_size(plan) % replicas == 0) and per_replica % m:
      # A fixed M that no longer divides the replica's batch after R grew.
      fitting = autopipe.largest_divisor(per_replica, m)
      if (replicas, m) not in self._refitted:  # once (compiled ahead, then moved to)
        self._refitted.add((replicas, m))
        self.log(f'  micro-batches: M={m} does not divide the {per_replica} samples per '
                 f'replica at R={replicas}; using M={fitting}')
      plan = dataclasses.replace(plan, micro_batches=fitting)
    pipeline.check_batch(self.batch_size(plan), plan)
    return plan

  def batch_size(self, plan: pipeline.Plan) -> int:
    return autodp.global_batch_size(self.config.train.batch_size, plan.replicas,
                                    self.config.train.batch_mode)

  def micro_batch_candidates(self, plan: pipeline.Plan) -> list[int]:
    if self.config.pipeline.micro_batches:
      return [plan.micro_batches]  # fixed by the config (adjusted by _plan if needed)
    per_replica = self.batch_size(plan) // plan.replicas
    return autopipe.micro_batch_candidates(plan.pipeline_length, per_replica)

  def mesh(self, plan: pipeline.Plan) -> Mesh:
    """The plan's ``(R, K)`` mesh over the first R·K devices."""
    return self.pipe.mesh(plan)

  # -- state -------------------------------------------------------------------
  def _init_fn(self, partition: part.Partition):
    """``params -> state`` for ``partition`` (also gives any plan's state shapes)."""
    def init(params):
      active = part.to_stage_params(params, partition)
      return {'step': jnp.zeros((), jnp.int32),
              'frozen': part.frozen_prefix(params, partition.num_frozen_layers),
              'active': active,
              'opt': self.optimizer.init(active),
              'rng': jax.random.PRNGKey(self.config.seed + 1),
              'layer_norms': jnp.zeros(self.model.num_layers, jnp.float32),
              'sums': jnp.zeros(3, jnp.float32)}
    return init

  def _state_shapes(self, partition: part.Partition) -> dict:
    return jax.eval_shape(self._init_fn(partition), self._param_shapes)

  def _init_state(self, params: Params, plan: pipeline.Plan) -> dict:
    init = self._init_fn(plan.partition)
    shardings = autodp.state_shardings(self._state_shapes(plan.partition), self.mesh(plan))
    return jax.jit(init, out_shardings=shardings)(params)

  def portable_state(self) -> dict:
    """The state in the canonical layout, replicated on every device:
    ``{'params', 'opt', 'step', 'rng', 'layer_norms', 'sums'}`` with the
    optimizer moments as canonical trees (zero for frozen blocks), the freeze
    policy's gradient-norm accumulators ``[L]`` and the running epoch sums
    ``[3]`` (loss, correct, count). Its structure is the same for every plan,
    so checkpoints are layout-free and cheap to write."""
    portable = self._portable_compiled_for(self.plan, self._state_spec())(self.state)
    if self.plan.num_devices < self.num_devices:  # no AutoDP: spread to every device
      portable = jax.device_put(portable, NamedSharding(self._flat_mesh, P()))
    return portable

  def _portable_fn(self, plan: pipeline.Plan):
    partition = plan.partition
    key = (partition, plan.num_devices)
    if key not in self._portable:
      mesh = self._flat_mesh if plan.num_devices == self.num_devices else self.mesh(plan)

      def portable(s):
        s = autodp.gathered_stages(s, NamedSharding(mesh, P()))  # one collective, not hundreds
        zeros = jax.tree.map(jnp.zeros_like, s['frozen'])
        return {'params': part.from_stage_params(s['active'], partition, s['frozen']),
                'opt': autodp.map_param_trees(
                    lambda t: part.from_stage_params(t, partition, zeros), s['opt']),
                'step': s['step'], 'rng': s['rng'], 'layer_norms': s['layer_norms'],
                'sums': s['sums']}

      self._portable[key] = jax.jit(portable, out_shardings=NamedSharding(mesh, P()))
    return self._portable[key]

  def _portable_compiled_for(self, plan: pipeline.Plan, state_shapes: dict,
                             background: bool = False):
    """:meth:`_portable_fn` of ``plan`` compiled for ``state_shapes`` (from
    the program store when it has it). ``background``: only start compiling
    it in the compile-ahead thread (returns None); a later call waits for it."""
    key = (plan.partition, plan.num_devices)

    def compile_it():
      return self.programs.compile('portable', key, (state_shapes,),
                                   lambda: self._portable_fn(plan), library_fusions=False)

    future = self._compiled_once(self._portable_compiled, key, compile_it, background)
    return None if background else future.result()

  def _compiled_once(self, held: dict, key, compile_it: Callable[[], Any],
                     background: bool) -> concurrent.futures.Future:
    """The future of ``compile_it()`` kept in ``held[key]``: submitted to the
    compile-ahead thread (``background``) or run now. A kept one is reused
    unless it was cancelled (the run ended before it started) or failed (then
    compiled afresh); a caller that needs it now runs one still queued (e.g.
    behind the next plan's compile) itself."""
    future = held.get(key)
    if future is not None and not background and not future.done() and future.cancel():
      future = None
    if future is None or _failed(future):
      if background:
        future = self._pool.submit(compile_it)
      else:
        future = concurrent.futures.Future()
        future.set_result(compile_it())  # kept only once compiled: an error is raised again
      held[key] = future
    return future

  def canonical_params(self) -> Params:
    """The current parameters in the canonical tree (``model.to_hf`` gives HF's)."""
    return self.portable_state()['params']

  # -- checkpoints -----------------------------------------------------------------
  def abstract_portable(self) -> dict:
    """:meth:`portable_state`'s shapes, replicated over this run's devices
    (the target a checkpoint is restored into, whatever plan wrote it)."""
    shapes = jax.eval_shape(self._portable_fn(self.plan),
                            self._state_shapes(self.plan.partition))
    replicated = NamedSharding(self._flat_mesh, P())
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                        shapes)

  def checkpoint_meta(self, epoch: int, step_in_epoch: int, epoch_done: bool) -> dict:
    """What a checkpoint holds besides the state tree (JSON): the position
    (``epoch``, batches done in it, global ``step``), the plan, the freeze
    policy's state and history, the micro-batch choices and any profiling in
    progress, the cache's decisions, the transitions so far."""
    plan = self.plan
    meta = {
        'epoch': epoch, 'step_in_epoch': step_in_epoch,
        'epoch_done': epoch_done,
        'step': int(self.state['step']), 'devices': self.num_devices,
        'starting_batch_size': self.starting_batch_size,
        'data_shards': self._data_shards(),
        'plan': {'frozen_layers': plan.partition.num_frozen_layers,
                 'stage_sizes': list(plan.partition.stage_sizes),
                 'min_slots': plan.partition.min_slots,
                 'split_mlp': list(plan.partition.split_mlp),
                 'pipeline_length': plan.pipeline_length, 'replicas': plan.replicas,
                 'micro_batches': plan.micro_batches, 'schedule': plan.schedule,
                 'describe': plan.describe()},
        'freeze_state': self.policy.state.to_dict(),
        'micro_batches': {
            'chosen': {str(k): self.profile.get(k) for k in sorted(
                {int(k) for k in self.profile.entries} | self._announced)
                if self.profile.get(k) is not None},
            'trials': {str(k): {'queue': [list(q) for q in t['queue']],
                                'timings': {str(m): v for m, v in t['timings'].items()}}
                       for k, t in self._trials.items()},
            'announced': sorted(self._announced),
            'timings': {str(k): {str(m): v for m, v in t.items()}
                        for k, t in self.micro_batch_timings.items()}},
        'cache': self.prefix.checkpoint_meta(),
        'transitions': [dataclasses.asdict(t) for t in self.transitions],
        'wall_seconds': self._wall_offset + time.perf_counter() - self._run_start,
    }
    return json.loads(json.dumps(meta, default=float))  # numpy scalars -> JSON numbers

  def _restored_partition(self, meta: dict) -> part.Partition:
    """The saved partition, or, on another device count (or a saved K that
    no longer divides it), AutoPipe's partition for the saved frozen layers
    with the longest pipeline that fits the devices and the config."""
    saved = meta['plan']
    num_frozen = saved['frozen_layers']
    k = self._restored_length(meta)
    if k == saved['pipeline_length'] and meta['devices'] == self.num_devices:
      split = tuple(saved.get('split_mlp', ()))
      return part.Partition(self.model.num_layers, num_frozen, tuple(saved['stage_sizes']),
                            saved.get('min_slots', 0), split,
                            self.model.mlp_in_keys if split else ())
    partition = autopipe.partition_for(self.costs, num_frozen, k,
                                       self.config.freeze.lambda_frozen).partition
    where = (f'on {self.num_devices} devices (saved on {meta["devices"]})'
             if meta['devices'] != self.num_devices else
             f'where a pipeline spans at most {distributed.pipeline_span(self.devices)} '
             f'devices (one process\'s)')
    self.log(f'  resuming {where}: K={saved["pipeline_length"]} -> K={k}')
    return partition

  def _restored_length(self, meta: dict) -> int:
    """The pipeline length :meth:`_restored_partition` restores: the saved
    one on the same devices (where it fits in each process), else the
    longest that divides these devices, fits in each process, and does not
    exceed the saved one once blocks are frozen (a compressed run never
    grows back), nor the config's starting length."""
    saved = meta['plan']
    k = saved['pipeline_length']
    span = distributed.pipeline_span(self.devices)
    if meta['devices'] == self.num_devices and span % k == 0:
      return k
    limit = min(k, self.initial_length) if saved['frozen_layers'] else self.initial_length
    return autopipe.largest_divisor(span, limit)

  def _data_shards(self) -> int:
    """How many shards the training order is drawn over (1: the plain loader)."""
    return int(getattr(self.train_loader, 'shards', 1))

  def check_resumable(self, meta: dict) -> None:
    """Raises :class:`pipejax.resume.CheckpointMismatch` when the checkpoint
    ``meta`` started from another global batch (``per_pipeline`` on other
    devices or another ``pipeline.initial_length``): its step count, schedule
    and epoch position are in units of that batch; or when it was saved
    mid-epoch with the samples drawn over another number of data shards (the
    epoch's order differs), or with a plan batch other than the plan restored
    on these devices takes (``per_pipeline``: its position counts batches).
    Cheap: callers check the newest checkpoint before restoring anything."""
    saved_shards = meta.get('data_shards', self._data_shards())
    if not meta['epoch_done'] and saved_shards != self._data_shards():
      raise resume.CheckpointMismatch(
          f'the checkpoint was saved in the middle of epoch {meta["epoch"]} with the samples '
          f'drawn over {saved_shards} data shard(s), this run draws them over '
          f'{self._data_shards()}: the rest of that epoch would repeat some samples and skip '
          f'others; resume with --config.distributed.data_shards={saved_shards} on a number '
          f'of processes that divides {saved_shards} (one process always does: it reads '
          f'every shard)')
    c = self.config
    if not meta['epoch_done']:
      mid, here = (autodp.global_batch_size(c.train.batch_size, r, c.train.batch_mode)
                   for r in (meta['plan']['replicas'],
                             self._replicas(self._restored_length(meta))))
      if mid != here:
        raise resume.CheckpointMismatch(
            f'the checkpoint was saved in the middle of epoch {meta["epoch"]}, '
            f'{meta["step_in_epoch"]} batches of {mid} samples in; on {self.num_devices} '
            f'devices its plan takes batches of {here} (train.batch_mode=per_pipeline): the '
            f'rest of that epoch would repeat or skip samples; resume on the '
            f'{meta["devices"]} devices it was saved on, or from a checkpoint at an epoch\'s end')
    saved_batch = meta.get('starting_batch_size', self.starting_batch_size)
    if saved_batch != self.starting_batch_size:
      raise resume.CheckpointMismatch(
          f'the checkpoint\'s run started with a global batch of {saved_batch} samples, this '
          f'one with {self.starting_batch_size} (train.batch_mode=per_pipeline: '
          f'train.batch_size x devices / pipeline.initial_length); resume with the devices and '
          f'pipeline.initial_length it was saved with, or --config.resume=False to start over')

  def restore(self, portable: dict, meta: dict) -> None:
    """Continues from a checkpoint: ``portable`` restored into
    :meth:`abstract_portable`, ``meta`` from :meth:`checkpoint_meta`. Rebuilds
    the saved plan (recomputed on another device count), lays the state out
    for it, restores the freeze policy, the micro-batch choices (reused, not
    re-profiled), the cache's decisions (its entries are rebuilt: they are only
    a speed-up) and the position :meth:`run` continues from.

    Raises:
      pipejax.resume.CheckpointMismatch: the checkpoint's starting global batch
        differs (``train.batch_mode=per_pipeline`` on other devices or another
        ``pipeline.initial_length``): its step count, learning-rate schedule and
        position in the epoch are in units of that batch; or, saved in the
        middle of an epoch, its plan's batch differs from the plan restored
        on these devices (``per_pipeline``): its position counts that batch.
    """
    self.check_resumable(meta)
    partition = self._restored_partition(meta)
    mb = meta['micro_batches']
    same_devices = meta['devices'] == self.num_devices
    if same_devices:
      # M was chosen for this device count: reuse it, never re-profile. Exactly
      # what the run knew then: a K it profiled only after the checkpoint (and
      # wrote to the profile file) is profiled again, as it was then.
      self.profile.entries = {k: {'micro_batches': m, 'seconds': {}}
                              for k, m in mb['chosen'].items()}
      self._trials = {int(k): {'queue': [tuple(q) for q in t['queue']],
                               'timings': {int(m): v for m, v in t['timings'].items()}}
                      for k, t in mb['trials'].items()}
      self._announced = set(mb['announced'])
      self.micro_batch_timings = {int(k): {int(m): v for m, v in t.items()}
                                  for k, t in mb['timings'].items()}
    saved_m = meta['plan']['micro_batches']
    same_plan = same_devices and partition.pipeline_length == meta['plan']['pipeline_length']
    fixed = self.config.pipeline.micro_batches  # a fixed M in the config wins
    self.plan = self._plan(partition, saved_m if same_plan and not fixed else None)
    self.policy.state = freeze.FreezeState.from_dict(meta['freeze_state'])
    self.transitions = [Transition(**t) for t in meta['transitions']]
    shapes = self._state_shapes(partition)
    shardings = autodp.state_shardings(shapes, self.mesh(self.plan))

    def from_portable(p):
      active = part.to_stage_params(p['params'], partition)
      template = jax.eval_shape(self.optimizer.init, active)
      return {'step': p['step'], 'rng': p['rng'], 'layer_norms': p['layer_norms'],
              'sums': p['sums'], 'active': active,
              'frozen': part.frozen_prefix(p['params'], partition.num_frozen_layers),
              'opt': autodp.map_param_trees(lambda t: part.to_stage_params(t, partition),
                                            p['opt'], template)}

    if self.plan.num_devices < self.num_devices:  # no AutoDP: the plan's devices only
      portable = jax.device_put(portable, NamedSharding(self.mesh(self.plan), P()))
    self.state = jax.jit(from_portable, out_shardings=shardings)(portable)
    self.prefix.restore(meta['cache'], self.batch_size(self.plan))
    self._start = (meta['epoch'] + int(meta['epoch_done']),
                   0 if meta['epoch_done'] else meta['step_in_epoch'], meta['epoch_done'])
    self._wall_offset = meta['wall_seconds']
    self.log(f'resumed at step {meta["step"]} (epoch {meta["epoch"]}, '
             f'{meta["step_in_epoch"]}/{self.steps_per_epoch} batches): {self.plan.describe()}')

  @property
  def seconds_before(self) -> float:
    """The seconds the run's earlier processes counted up to the checkpoint
    this one resumed from (0 for a fresh run): its rows' ``wall_seconds``
    and the summary's times go on from there."""
    return self._wall_offset

  def close(self) -> None:
    """Stops the background compiles (a started preparation stops at its
    next compile) and closes the activation cache; :meth:`run` ends with it."""
    self._drop_ahead()
    self._pool.shutdown(wait=False, cancel_futures=True)
    if self.prefix.cache is not None:
      self.prefix.cache.close()

  def _timestep_follows(self, step: int) -> bool:
    """Whether a ``freeze.timestep_steps`` timestep ends after ``step``
    (the next multiple of it before the last step, as :meth:`train_epoch`
    decides at them)."""
    every = self.config.freeze.timestep_steps
    return (step // every + 1) * every < self.config.train.epochs * self.steps_per_epoch

  @property
  def epochs_done(self) -> int:
    """Whole epochs trained before :meth:`run` (after :meth:`restore`: the
    checkpoint's)."""
    return self._start[0]

  # -- compiled steps ------------------------------------------------------------
  def _step_program(self, plan: pipeline.Plan):
    """The jitted ``(state, feed, tables) -> state`` of ``plan``, shared by
    the plans with its :func:`pipejax.pipeline.program_key` (donates the state).

    ``state`` lacks ``'frozen'`` (the step never touches frozen parameters),
    ``feed`` is the batch, or, with a frozen prefix, its output ``'hidden'``
    with the labels and the keys every block reads (see :meth:`_feed`), and
    ``tables`` the plan's slot tables (:meth:`pipejax.pipeline.Pipeline.tables`).
    """
    key = pipeline.program_key(plan)
    if key in self._steps:
      return self._steps[key]
    mesh = self.mesh(plan)
    partition = plan.partition
    state_shapes = _without_frozen(self._state_shapes(partition))
    grad = self.pipe.grad_fn(plan, state_shapes['active'], train=True).jitted
    base_steps = self._base_steps_per_step(plan)

    def step(state, feed, tables):
      rng, step_rng = jax.random.split(state['rng'])
      loss, metrics, grads = grad(state['active'], feed, step_rng, tables)
      updates, opt = self.optimizer.update(grads, state['opt'], state['active'],
                                           base_steps=base_steps)
      return {**state, 'step': state['step'] + 1, 'rng': rng, 'opt': opt,
              'active': optax.apply_updates(state['active'], updates),
              'layer_norms': state['layer_norms'] + layer_grad_norms(grads, partition, tables),
              'sums': state['sums'] + jnp.stack([loss, _correct(metrics), metrics['count']])}

    fn = jax.jit(step, donate_argnums=0, out_shardings=autodp.state_shardings(state_shapes, mesh))
    self._steps[key] = fn
    return fn

  def _compile_step(self, plan: pipeline.Plan, state_shapes: dict, feed) -> None:
    """Compiles ``plan``'s step (or loads it from the program store)
    unless its program is compiled already (a freeze event that keeps K and,
    with ``freeze.keep_slot_width``, the slot width reuses it)."""
    key = pipeline.program_key(plan)
    if key not in self._executables:
      # The store's key names the schedule's move too: with per_pipeline it
      # depends on the data's size, which the store's own key does not hold.
      self._executables[key] = self.programs.compile(
          'step', (*key, self._base_steps_per_step(plan)),
          (state_shapes, feed, self.pipe.tables(plan)),
          lambda: self._step_program(plan), donate_argnums=(0,))

  def _train_step(self, plan: pipeline.Plan, feed: dict):
    """``plan``'s train step ``(state, feed) -> state``: its compiled
    program (compiled now for the current state and ``feed`` if not yet)
    with its slot tables bound."""
    key = pipeline.program_key(plan)
    if key not in self._executables:
      self._compile_step(plan, _without_frozen(self._state_spec()), _spec(feed))
    fn, tables = self._executables[key], self.pipe.tables(plan)
    return lambda state, feed: fn(state, feed, tables)

  def _feed(self, sample_ids: np.ndarray, batch: dict, plan: pipeline.Plan) -> dict:
    """The pipeline's input on the devices: the batch, or the frozen prefix's
    output (computed or cached) with the keys blocks and the head read."""
    if plan.partition.has_embed:
      return distributed.put_batch(batch, NamedSharding(self.mesh(plan), P(pipeline.DATA)))
    return self.prefix.feed(sample_ids, batch, plan, self.state['frozen'])

  def _state_spec(self) -> dict:
    """The current state as shapes with shardings (to compile against)."""
    return _spec(self.state)

  def _run_step(self, fn, feed: dict) -> None:
    """One train step on the current state (the frozen prefix stays put)."""
    frozen = self.state['frozen']
    self.state = {**fn(_without_frozen(self.state), feed), 'frozen': frozen}

  # -- the loop ----------------------------------------------------------------
  def _next_micro_batches(self, plan: pipeline.Plan) -> tuple[int, bool]:
    """M for the next step of ``plan`` and whether to time that step.

    With a new K and no remembered choice, the candidates take turns on live
    training steps (M does not change the maths, only the schedule): one
    untimed warm-up round, then ``PROFILE_ROUNDS`` timed ones; the candidate
    with the fastest step is chosen and remembered.
    """
    k = plan.pipeline_length
    candidates = self.micro_batch_candidates(plan)
    if len(candidates) == 1:
      return candidates[0], False
    known = self.profile.get(k)
    if known in candidates:
      if k not in self._announced:
        self._announced.add(k)
        where = self.profile.path or 'this run, no profile file'
        self.log(f'  micro-batches for K={k}: M={known} (remembered in {where})')
      return known, False
    # Round-robin, so a slow spell of a shared machine hits every candidate:
    # one untimed warm-up round, then PROFILE_ROUNDS timed rounds.
    trial = self._trials.setdefault(k, {'queue': [(m, r > 0) for r in range(PROFILE_ROUNDS + 1)
                                                  for m in candidates], 'timings': {}})
    return trial['queue'].pop(0)

  def _record_timing(self, plan: pipeline.Plan, seconds: float) -> None:
    """Stores a timed step; once every candidate is timed, chooses M."""
    k = plan.pipeline_length
    trial = self._trials[k]
    trial['timings'].setdefault(plan.micro_batches, []).append(seconds)
    if trial['queue']:
      return
    # The fastest of a candidate's timed steps: interference only adds time.
    timings = {m: min(t) for m, t in trial['timings'].items()}
    chosen, _ = self.profile.choose(k, list(timings), timings.__getitem__)
    self.micro_batch_timings[k] = dict(timings)
    self._announced.add(k)
    self.log(f'  micro-batches for K={k}: M={chosen} (profiled '
             f'{", ".join(f"{m}: {t * 1e3:.0f} ms" for m, t in timings.items())})')

  def train_epoch(self, epoch: int, progress, start_step: int = 0,
                  after_step: Callable[[int, int], None] | None = None) -> dict:
    """Runs one epoch (with freeze timesteps inside it when
    ``freeze.timestep_steps`` is set) from batch ``start_step`` (a resumed
    epoch: the running sums are in the state). ``after_step(epoch, steps)``
    runs after every step and any transition it ended (interrupts and
    step-count checkpoints)."""
    loader = self._train_loader()
    every = self.config.freeze.timestep_steps
    start = time.perf_counter()
    steps = start_step
    transition_seconds = 0.0
    first_step_seconds = None
    last_step = self.config.train.epochs * self.steps_per_epoch
    # The run's step before this epoch's first batch (one host sync per epoch):
    # what freeze timesteps count and a non-finite loss names.
    first_step = int(self.state['step']) - start_step
    self.prefix.prefetch(loader.batch_ids(epoch, start_step), self.plan, self.state['frozen'])
    progress.update(start_step)
    for sample_ids, batch in loader.epoch(epoch, start_step):
      m, timed = self._next_micro_batches(self.plan)
      self.plan = dataclasses.replace(self.plan, micro_batches=m)
      feed = self._feed(sample_ids, batch, self.plan)
      fn = self._train_step(self.plan, feed)
      first = self._first_step_pending
      if timed or first:  # time this step alone, not the tail of the one before
        jax.block_until_ready((self.state, feed))
      t0 = time.perf_counter()
      self._run_step(fn, feed)
      if timed or first:
        jax.block_until_ready(self.state['sums'])
        elapsed = time.perf_counter() - t0
        if timed:
          self._record_timing(self.plan, elapsed)
        if first:
          first_step_seconds, self._first_step_pending = elapsed, False
      steps += 1
      progress.update(1)
      if steps % 10 == 0:  # the loss leaves the device only here and at the epoch's end
        # (a copy, not an index: indexing would run one more program on every device)
        loss_sum = float(np.asarray(self.state['sums'])[0])
        self._check_finite(loss_sum, epoch, first_step + steps)
        progress.set_postfix(loss=f'{loss_sum / steps:.4f}')
      step = first_step + steps
      if every and step % every == 0 and step < last_step:
        depth = self.plan.partition.num_frozen_layers
        transition_seconds += self.maybe_transition(epoch, batch)
        if self.plan.partition.num_frozen_layers != depth:
          # The cache stopped reading ahead at the new depth: plan the rest of the epoch.
          self.prefix.prefetch(loader.batch_ids(epoch, steps), self.plan, self.state['frozen'])
        if self._timestep_follows(step):
          self.prepare_next(batch)
        else:
          self._drop_ahead()  # the last timestep has ended: nothing would use it
      if after_step is not None and steps < loader.steps_per_epoch():
        after_step(epoch, steps)
    sums, _ = self.check_not_diverged(epoch)
    if self.config.train.batch_mode == 'per_pipeline' and steps == loader.steps_per_epoch():
      # The epoch's fractional base steps, summed in float32, end exactly at its end.
      self.state['opt'] = with_schedule_count(self.state['opt'],
                                              (epoch + 1) * self.steps_per_epoch)
    seconds = time.perf_counter() - start
    if first_step_seconds is not None and self.transitions:
      mean_step = (seconds - transition_seconds) / max(steps - start_step, 1)
      self.transitions[-1].warmup_seconds = max(0.0, first_step_seconds - mean_step)
    self.state['sums'] = _zeros_like(self.state['sums'])
    return {'train_loss': float(sums[0] / max(steps, 1)),
            'train_accuracy': (None if np.isnan(sums[1])  # a regression head
                               else float(sums[1] / max(sums[2], 1))),
            'epoch_seconds': seconds - transition_seconds, 'steps': steps - start_step,
            'transition_seconds': transition_seconds,
            'samples_per_second': (steps - start_step) * loader.batch_size / seconds}

  @staticmethod
  def _check_finite(loss_sum: float, epoch: int, step: int) -> None:
    """Stops training on a NaN or infinite loss (see :class:`LossNotFinite`)."""
    if not math.isfinite(loss_sum):
      raise LossNotFinite(loss_sum, epoch, step)

  def check_not_diverged(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Raises :class:`LossNotFinite` if this epoch's loss sum or a block's
    gradient norm accumulated since the last freeze decision is not finite.
    Run before every checkpoint: a step whose loss was finite can still
    have applied a non-finite gradient, which only the norms show (the next
    step's loss would, but that step may come after a save). Returns the
    running sums and the norms it read (on the host)."""
    step = int(self.state['step'])
    sums = np.asarray(self.state['sums'])
    self._check_finite(float(sums[0]), epoch, step)
    norms = np.asarray(self.state['layer_norms'])
    bad = np.flatnonzero(~np.isfinite(norms))
    if bad.size:
      raise LossNotFinite(float(norms[bad[0]]), epoch, step,
                          what=f'the gradient norm of block {int(bad[0])}')
    return sums, norms

  def evaluate(self, params: Params | None = None) -> dict[str, float]:
    """Evaluation metrics, at least ``{'eval_accuracy': ...}``, on the eval
    loader (or from the ``evaluator`` given to the constructor).

    Evaluation runs the canonical parameters data-parallel over all devices
    (one compiled function for the whole run, whatever the plan), so a
    transition never pays for compiling an evaluation step; :meth:`run`
    starts compiling it (from the program store when it has it) while the
    first epoch trains. The per-batch counts stay on the devices until the
    end (one transfer, not a wait per batch).
    """
    params = self.canonical_params() if params is None else params
    if self.evaluator is not None:
      metrics = dict(self.evaluator(self, params))
      if 'eval_accuracy' not in metrics:
        raise ValueError(f'the evaluator returned no eval_accuracy: {sorted(metrics)}')
      return metrics
    flat = self._flat_mesh
    params = jax.device_put(params, NamedSharding(flat, P()))  # a no-op for portable_state()'s
    param_shapes = _spec(params)
    per_batch = []  # kept on the devices: one transfer at the end, not a wait per batch
    for _, batch in self._eval_loader().epoch(0):
      batch = distributed.put_batch(batch, NamedSharding(flat, P('batch')))
      metrics = self._eval_compiled(param_shapes, _spec(batch)).result()(params, batch)
      if 'correct' not in metrics:
        raise ValueError(f'{self.model.name} reports no accuracy (a regression head): give the '
                         f'Trainer an evaluator')
      per_batch.append((metrics['correct'], metrics['count']))
      if len(per_batch) > _EVAL_BATCHES_IN_FLIGHT:  # bounds the batches queued on the devices
        per_batch[-_EVAL_BATCHES_IN_FLIGHT - 1][0].block_until_ready()
    correct = count = 0.0
    for c, n in jax.device_get(per_batch):
      correct += float(c)
      count += float(n)
    return {'eval_accuracy': correct / max(count, 1.0)}

  def eval_batch_size(self) -> int:
    """``train.eval_batch_size``, by default :data:`EVAL_BATCH_FACTOR` times the
    run's starting global batch, whatever the plan (so
    ``batch_mode='per_pipeline'``, whose batch grows with R, does not recompile
    evaluation at a transition)."""
    size = self.config.train.eval_batch_size
    if size:
      return int(size)
    return EVAL_BATCH_FACTOR * self.starting_batch_size

  def _train_loader(self, plan: pipeline.Plan | None = None) -> Loader:
    """The train loader at ``plan``'s global batch (default: the current
    plan's; per_pipeline: it grows with R, so an epoch has fewer steps)."""
    return dataclasses.replace(self.train_loader,
                               batch_size=self.batch_size(plan or self.plan))

  def _base_steps_per_step(self, plan: pipeline.Plan) -> float | int:
    """How far a step of ``plan`` moves the learning-rate schedule: 1 with a
    constant batch; with per_pipeline, the starting plan's steps per epoch
    over ``plan``'s, so that every epoch is ``steps_per_epoch`` base steps
    (R/R₀ when R·B divides the data and no cap binds)."""
    if self.config.train.batch_mode != 'per_pipeline':
      return 1
    return self.steps_per_epoch / max(1, self._train_loader(plan).steps_per_epoch())

  def _eval_loader(self) -> Loader:
    return dataclasses.replace(self.eval_loader, batch_size=self.eval_batch_size())

  def _eval_compiled(self, param_shapes, batch_shapes, background: bool = False):
    """A future of the evaluation forward compiled for these shapes (from the
    program store when it has it; one per batch shape, usually one per run).
    ``background``: compile it in the compile-ahead thread."""
    key = (jax.tree.structure((param_shapes, batch_shapes)),
           tuple((s.shape, str(s.dtype)) for s in jax.tree.leaves((param_shapes, batch_shapes))))
    flat = self._flat_mesh

    def build():
      return jax.jit(lambda p, b: self.model.loss(p, b)[1],
                     in_shardings=(NamedSharding(flat, P()), NamedSharding(flat, P('batch'))),
                     out_shardings=NamedSharding(flat, P()))

    def compile_it():
      return self.programs.compile('eval', key[1], (param_shapes, batch_shapes), build,
                                   library_fusions=False)

    return self._compiled_once(self._eval, key, compile_it, background)

  def _compile_eval_ahead(self) -> None:
    """Starts compiling the evaluation forward (and the current plan's
    portable-state program, which evaluation reads) while the first epoch
    trains.

    The batch's shapes come from one sample and the eval batch size (reading
    a whole eval batch here would decode it on the main thread and count its
    IDs as served); an empty eval set has nothing to compile.
    """
    # The first epoch's end reads the portable state (evaluation, checkpoints).
    self._portable_compiled_for(self.plan, self._state_spec(), background=True)
    if self.evaluator is not None:
      return
    loader = self._eval_loader()
    ids = np.asarray(loader.ids)
    if not len(ids):
      return
    sample = dict(loader.source[ids[:1]])
    if not loader.drop_remainder:
      sample['example_mask'] = np.ones((1,), np.float32)
    flat = self._flat_mesh
    self._eval_compiled(
        jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                    sharding=NamedSharding(flat, P())),
                     self._param_shapes),
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (loader.batch_size,) + np.shape(x)[1:],
            jax.dtypes.canonicalize_dtype(np.asarray(x).dtype),
            sharding=NamedSharding(flat, P('batch'))), sample),
        background=True)

  def _partition_after(self, num_frozen: int) -> part.Partition:
    """AutoPipe's partition once ``num_frozen`` blocks are frozen."""
    c = self.config.freeze
    old = self.plan.partition
    k = old.pipeline_length
    if not c.compress:
      partition = autopipe.partition_for(self.costs, num_frozen, k, c.lambda_frozen).partition
    else:
      partition = autopipe.compress(self.costs, num_frozen, k, self.initial_length,
                                    c.lambda_frozen, num_devices=self.num_devices).partition
      k = partition.pipeline_length
    if (k == old.pipeline_length and not old.has_embed
        and self.config.freeze.keep_slot_width):
      # Same K: keep the slot width, so the step compiled for it runs on. Off
      # by default: a padded slot costs every tick (the default model's K = 8
      # step at F = 8: 29.7 ms padded to the two slots of Algorithm 1's F = 4
      # partition, which runs no longer use, 23.5 ms at its own;
      # `python -m experiments.bench_plans` times both), more than loading
      # the narrower step ahead.
      partition = dataclasses.replace(partition, min_slots=old.tables.num_slots)
    return partition

  def _prepare(self, old: part.Partition, new: part.Partition, plans: list[pipeline.Plan],
               state_shapes: dict, sample_batch: dict,
               stale: threading.Event | None = None) -> tuple[Any, dict]:
    """Compiles the move to ``new`` and the train steps of ``plans``; returns
    the move and the prefix programs. In the background, ``stale`` set (the
    prediction was replaced or not taken) stops it between two compiles
    (``CancelledError``), so it leaves the cores to the transition."""

    def check():
      if stale is not None and stale.is_set():
        raise concurrent.futures.CancelledError('a newer prediction replaced this one')

    mesh = self.mesh(plans[0])
    state_shapes = autodp.on_mesh(state_shapes, mesh)  # no AutoDP: K shrank, fewer devices
    move = self.programs.compile(
        'move', (old, new), (state_shapes,),
        lambda: autodp.relayout_fn(state_shapes, old, new, mesh, self.optimizer.init),
        donate_argnums=(0,), library_fusions=False)
    new_shapes = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              move.out_info, move.output_shardings)
    check()
    prefixes = self.prefix.compile_ahead(plans[0], old.num_frozen_layers, new_shapes['frozen'],
                                         sample_batch, self.batch_size(plans[0]))
    feed = prefixes.pop('feed')
    for plan in plans:
      check()
      self._compile_step(plan, _without_frozen(new_shapes), feed)
    check()
    self._portable_compiled_for(plans[0], new_shapes)
    return move, prefixes

  def _candidate_plans(self, partition: part.Partition) -> list[pipeline.Plan]:
    """The plans a partition may run: the config's fixed M, the remembered M,
    or every candidate M."""
    remembered = (None if self.config.pipeline.micro_batches  # a fixed M wins, as in restore
                  else self.profile.get(partition.pipeline_length))
    plan = self._plan(partition, remembered)
    if remembered is not None:
      return [plan]
    return [dataclasses.replace(plan, micro_batches=m) for m in self.micro_batch_candidates(plan)]

  def prepare_next(self, sample_batch: dict) -> None:
    """Starts compiling, in the background, the plan that the freeze bound
    predicts for the end of this timestep (the α term of Eq. 1; the argmin
    term can only freeze less, which then compiles at the transition)."""
    if self.config.freeze.policy == 'none' or not self.config.freeze.compile_ahead:
      return
    _, predicted = self.policy.bound_result()
    old = self.plan.partition
    new = (None if predicted == self.policy.num_frozen_layers
           else self._partition_after(predicted))
    if self._ahead is not None and self._ahead.move == (old, new) and not _failed(
        self._ahead.future):
      return  # the same prediction as at the last timestep: its job runs on
    self._drop_ahead()  # a stale prediction must not delay the next one
    if new is None:
      return
    plans = self._candidate_plans(new)
    stale = threading.Event()
    self._ahead = _Ahead((old, new), self._pool.submit(
        self._prepare, old, new, plans, self._state_spec(), sample_batch, stale), stale)

  def _drop_ahead(self) -> None:
    """Stops the background preparation (if any): not started, it never
    starts; started, it stops before its next compile."""
    if self._ahead is not None:
      self._ahead.stale.set()
      self._ahead.future.cancel()
      self._ahead = None

  def base_steps_done(self) -> int:
    """Training so far in base steps, ``steps_per_epoch`` an epoch (the
    learning-rate schedule's position, rounded down; the steps taken,
    ``state['step']``, are fewer once ``batch_mode='per_pipeline'`` has
    grown the batch)."""
    return int(schedule_count(self.state['opt']))

  def _epochs_left(self) -> int:
    """Whole epochs of training after the current step (at least 1)."""
    total = self.config.train.epochs * self.steps_per_epoch
    return max(1, math.ceil((total - self.base_steps_done()) / self.steps_per_epoch))

  def maybe_transition(self, epoch: int, sample_batch: dict) -> float:
    """Ends a freeze timestep: decide F, and on a change re-plan, move the
    state and compile (or take what :meth:`prepare_next` compiled). Returns the
    seconds spent."""
    start = time.perf_counter()
    _, norms = self.check_not_diverged(epoch)  # Eq. 1 on NaN norms would freeze arbitrary blocks
    decision = self.policy.decide(norms, step=int(self.state['step']))
    self.log('  ' + decision.describe() + (
        f'; norms {np.array2string(norms, precision=3, max_line_width=200)}'
        if decision.norms is not None else ''))
    self.state['layer_norms'] = _zeros_like(self.state['layer_norms'])
    if decision.result == self.plan.partition.num_frozen_layers:
      return time.perf_counter() - start  # prepare_next keeps a job that still applies
    old = self.plan
    new_partition = self._partition_after(decision.result)
    plans = self._candidate_plans(new_partition)
    ahead = self._ahead
    ahead_used = ahead is not None and ahead.move == (old.partition, new_partition)
    if ahead_used:
      self._ahead = None
    else:
      self._drop_ahead()  # the argmin froze fewer blocks than the bound predicted
    t0 = time.perf_counter()
    if ahead_used:
      try:
        move, prefixes = ahead.future.result()  # waits only for what still compiles
      except Exception as e:  # noqa: BLE001 - failed or cancelled there: once more, here
        text = distributed.first_line(str(e), 200)
        self.log(f'  preparing the next plan ahead failed ({type(e).__name__}'
                 f'{": " + text if text else ""}); preparing it now')
        ahead_used = False
    if not ahead_used:
      move, prefixes = self._prepare(old.partition, new_partition, plans, self._state_spec(),
                                     sample_batch)
    compile_s = time.perf_counter() - t0
    self.prefix.adopt(prefixes)
    t0 = time.perf_counter()
    self.state = move(autodp.on_mesh(self.state, self.mesh(plans[0])))
    jax.block_until_ready(self.state)
    reshard = time.perf_counter() - t0
    self.plan = plans[0]
    new = self.plan
    cache_s = self.prefix.change_depth(new, self.state['frozen'], sample_batch,
                                        self.batch_size(new), self._epochs_left())
    # Several plans: the steps time each M in turn (the choice is logged then).
    described = new.describe([p.micro_batches for p in plans])
    self.transitions.append(Transition(epoch, int(self.state['step']), decision.result,
                                       old.describe(), described, reshard, compile_s,
                                       ahead_used, cache_s, time.perf_counter() - start,
                                       cache=self.prefix.use_cache))
    self._first_step_pending = True
    self.log(f'  transition: {old.describe()} -> {described} (reshard {reshard:.2f}s, '
             f'cache {cache_s:.2f}s, compile {compile_s:.1f}s{" waited, compiled ahead" if ahead_used else ""})')
    return time.perf_counter() - start

  def run(self, epochs: int, progress_factory, *,
          save: Callable[[dict, dict, bool], str | None] | None = None,
          stop_requested: Callable[[], bool] | None = None, save_every_steps: int = 0) -> dict:
    """Trains up to epoch ``epochs`` (from the start, or from where
    :meth:`restore` left off); returns the per-epoch rows (with those of
    earlier runs already in ``metrics.jsonl``).

    Args:
      epochs: the epoch count of the whole run.
      progress_factory: ``(epoch, steps) -> context manager`` giving a tqdm-like bar.
      save: ``(portable_state, meta, stopping) -> checkpoint path or None``
        (see :meth:`checkpoint_meta`; ``meta['row']`` is the epoch's row at an
        epoch end); called at each epoch end, every ``save_every_steps``
        batches and, with ``stopping`` True (a save to wait for), when a stop
        is requested.
      stop_requested: polled after every step and epoch but the last: True
        saves (waiting for the write) and raises :class:`TrainingInterrupted`.
    """
    metrics_log = reporting.MetricsLog(self.workdir)
    self._run_start = time.perf_counter()
    sample_batch = next(iter(self.train_loader.epoch(0)))[1]
    if self._pool._shutdown:  # noqa: SLF001 - a second run() gets a fresh pool
      self._pool = _background_pool()
    if self.prefix.cache is not None:
      self.prefix.cache.open()  # and the cache's disk file the first one closed
    by_steps = bool(self.config.freeze.timestep_steps)

    def after_step(epoch: int, steps: int) -> None:
      stop = stop_requested is not None and stop_requested()
      path = None
      if save is not None and (stop or (save_every_steps and steps % save_every_steps == 0)):
        self.check_not_diverged(epoch)
        path = save(self.portable_state(), self.checkpoint_meta(epoch, steps, False), stop)
      if stop:
        raise TrainingInterrupted(epoch, int(self.state['step']), path)

    # What exists now (JAX, the model, the data) lives through the run: out of
    # the garbage collector's sight, its full collections scan only what the
    # run creates (measured: 0.26 -> 0.05 s of collections in the baseline's
    # run, 0.31 -> 0.13 s in the default run's).
    # (Only when nothing is frozen yet: unfreezing must not release what a
    # caller froze.)
    own_freeze = gc.get_freeze_count() == 0
    if own_freeze:
      gc.freeze()
    try:
      # First in the background queue: what the first epoch's end (or a save
      # inside it) reads, then the next plan.
      self._compile_eval_ahead()
      if by_steps and self._timestep_follows(int(self.state['step'])):
        self.prepare_next(sample_batch)
      self._run_epochs(epochs, progress_factory, metrics_log, by_steps, sample_batch,
                       save, stop_requested, after_step)
    finally:
      if own_freeze:
        gc.unfreeze()
      self.close()
    return {'rows': metrics_log.rows, 'seconds': time.perf_counter() - self._run_start}

  def _run_epochs(self, epochs, progress_factory, metrics_log, by_steps, sample_batch,
                  save, stop_requested, after_step) -> None:
    start_epoch, start_step, pending = self._start
    transition_seconds = 0.0
    if pending and start_epoch < epochs and not by_steps:
      # Saved at an epoch end, before that epoch's freeze decision.
      transition_seconds = self.maybe_transition(start_epoch - 1, sample_batch)
    for epoch in range(start_epoch, epochs):
      if epoch + 1 < epochs and not by_steps:
        self.prepare_next(sample_batch)
      elif not by_steps:
        self._drop_ahead()  # the last epoch: a job kept from the one before has no use
      with progress_factory(epoch, self._train_loader().steps_per_epoch()) as bar:
        stats = self.train_epoch(epoch, bar, start_step if epoch == start_epoch else 0,
                                 after_step)
      transition_seconds += stats['transition_seconds']
      t0 = time.perf_counter()
      portable = self.portable_state()
      eval_metrics = self.evaluate(portable['params'])
      accuracy = eval_metrics['eval_accuracy']
      eval_seconds = time.perf_counter() - t0
      plan = self.plan
      row = {'epoch': epoch, 'frozen_layers': plan.partition.num_frozen_layers,
             'pipeline_length': plan.pipeline_length, 'replicas': plan.replicas,
             'micro_batches': plan.micro_batches, 'cache': self.prefix.use_cache,
             'train_loss': stats['train_loss'], 'train_accuracy': stats['train_accuracy'],
             **eval_metrics, 'epoch_seconds': stats['epoch_seconds'],
             'samples_per_second': stats['samples_per_second'],
             'transition_seconds': transition_seconds, 'eval_seconds': eval_seconds,
             'step': int(self.state['step']), 'stage_sizes': list(plan.partition.stage_sizes),
             'split_mlp': list(plan.partition.split_mlp)}
      row.update(self.prefix.stats())
      t0 = time.perf_counter()
      path = None
      if save is not None:
        # The checkpoint's copy of the row (it replaces a row lost in a crash):
        # complete but for the save's own seconds.
        saved_row = dict(row, checkpointed=True, checkpoint_seconds=0.0,
                         wall_seconds=self._wall_offset + t0 - self._run_start)
        path = save(portable, {**self.checkpoint_meta(epoch, stats['steps'] + (
            start_step if epoch == start_epoch else 0), True), 'row': saved_row}, False)
      # False: no checkpoint will ever hold this epoch (checkpoints off), so a
      # later run cannot take these rows for a crash's before its first one.
      row['checkpointed'] = path is not None
      row['checkpoint_seconds'] = time.perf_counter() - t0
      row['wall_seconds'] = self._wall_offset + time.perf_counter() - self._run_start
      metrics_log.append(row)
      extra = ''.join(f' {k[len("eval_"):]} {v:.4f}' for k, v in eval_metrics.items()
                      if k != 'eval_accuracy' and isinstance(v, float))
      self.log(f'epoch {epoch}: loss {row["train_loss"]:.4f} eval acc {accuracy:.4f}{extra} '
               f'F={row["frozen_layers"]} K={row["pipeline_length"]} R={row["replicas"]} '
               f'M={row["micro_batches"]} {row["epoch_seconds"]:.1f}s '
               f'({row["samples_per_second"]:.0f} samples/s)')
      # After the last epoch nothing is left to stop: the run finishes (its
      # summary written), and the caller says that the signal came late.
      if epoch + 1 < epochs and stop_requested is not None and stop_requested():
        raise TrainingInterrupted(epoch, row['step'], path)  # saved just above
      transition_seconds = 0.0
      if epoch + 1 < epochs and not by_steps:
        transition_seconds = self.maybe_transition(epoch, sample_batch)
