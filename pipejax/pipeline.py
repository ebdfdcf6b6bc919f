"""One SPMD pipeline executor: ``shard_map`` over the mesh ``('data', 'stage')``.

The executor runs any valid :class:`pipejax.schedule.Schedule` over a
:class:`pipejax.partition.Partition` of a :class:`models.LayeredModel`:

* every device is one stage of one replica; it loops over the schedule's ticks
  (``lax.scan``) and at each tick does what its cell says:
  - ``FWD m``: run the stage on micro-batch m's input (the embedding's input
    on stage 0, the received activation elsewhere) and send the output on;
  - ``BWD m``: recompute the stage with ``jax.vjp`` from the stashed input,
    apply the received cotangent, accumulate parameter gradients and send the
    input cotangent back. The last stage skips its FWD work and fuses it into
    BWD (loss, then backward), so a pipeline of length 1 costs what plain
    data parallelism costs;
  - ``IDLE``: nothing (a bubble);
  - ``BOTH`` (fused tables): a FWD of one micro-batch, then a BWD of another;
* two ``ppermute``\\ s per tick move activations forward and cotangents back
  (on CPU devices one ``all_gather`` carries both: see :data:`EXCHANGES`);
  arrivals land in the buffer slots chosen by :func:`pipejax.schedule.buffer_plan`;
* at the end gradients are averaged over ``'data'`` (and summed over
  ``'stage'`` for the replicated embedding and head, which only their own
  stage touches).

Padded block slots are skipped with ``lax.cond`` (inside ``shard_map``, so
only the taken branch runs) and receive exactly zero gradient.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.layered import LayeredModel, unit_rng
from pipejax import distributed
from pipejax import schedule as schedule_lib
from pipejax.partition import Partition, to_stage_params

Params = Any
Batch = Mapping[str, jax.Array]
DATA, STAGE = 'data', 'stage'


class PlanError(ValueError):
  """A pipeline plan that cannot run on the given devices or batch."""


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything that determines one compiled pipeline step.

  Attributes:
    partition: the stages and what each runs (its length is K).
    replicas: R, pipeline replicas (the mesh is ``(R, K)``).
    micro_batches: M, micro-batches per replica per step.
    schedule: name of the training schedule (``'gpipe'``, ``'1f1b'`` or
      ``'1f1b-fused'``: :data:`pipejax.schedule.SCHEDULES`).
  """
  partition: Partition
  replicas: int
  micro_batches: int
  schedule: str = '1f1b'

  @property
  def pipeline_length(self) -> int:
    return self.partition.pipeline_length

  @property
  def num_devices(self) -> int:
    return self.replicas * self.pipeline_length

  def describe(self, profiling: Sequence[int] = ()) -> str:
    """One line; ``profiling``: the candidate M that steps will still time
    (shown in place of this plan's M, the first of them)."""
    split = (f' split_mlp={list(self.partition.split_mlp)}' if self.partition.split_mlp
             else '')
    m = f'profiled among {list(profiling)}' if len(profiling) > 1 else self.micro_batches
    return (f'K={self.pipeline_length} R={self.replicas} M={m} '
            f'{self.schedule} stages={list(self.partition.stage_sizes)}{split} '
            f'frozen={self.partition.num_frozen_layers}')


def make_mesh(pipeline_length: int, devices=None) -> Mesh:
  """The ``('data', 'stage')`` mesh of shape (N / K, K) over ``devices``.

  Consecutive devices form one pipeline, so with several processes (devices
  ordered by :func:`pipejax.distributed.ordered_devices`) the stage axis stays
  inside a host and the data axis spans hosts; a pipeline that would cross
  hosts is refused.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if pipeline_length < 1 or n % pipeline_length:
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    raise PlanError(f'pipeline length {pipeline_length} does not divide the {n} devices; '
                    f'use one of {divisors}')
  distributed.check_pipeline_length(pipeline_length, devices)
  grid = np.array(devices, dtype=object).reshape(n // pipeline_length, pipeline_length)
  return Mesh(grid, (DATA, STAGE))


def check_batch(batch_size: int, plan: Plan) -> None:
  """Raises :class:`PlanError` unless R·M divides ``batch_size``."""
  per = plan.replicas * plan.micro_batches
  if batch_size % per:
    raise PlanError(f'batch size {batch_size} is not divisible by replicas x micro-batches '
                    f'= {plan.replicas} x {plan.micro_batches} = {per}; change train.batch_size or '
                    f'pipeline.micro_batches')


def stage_param_specs(stage_params: Params) -> Params:
  """PartitionSpecs of the stage layout: stacks over ``'stage'``, rest replicated."""
  return {k: jax.tree.map(lambda _: P(STAGE) if k in ('attention', 'mlp') else P(), v)
          for k, v in stage_params.items()}


def stage_param_shardings(stage_params: Params, mesh: Mesh) -> Params:
  """NamedShardings of the stage layout on ``mesh``."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), stage_param_specs(stage_params),
                      is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches are split over ``'data'`` and replicated over ``'stage'``."""
  return NamedSharding(mesh, P(DATA))


def _zeros_like_metrics(model: LayeredModel, params: Params, hidden, batch) -> dict:
  shapes = jax.eval_shape(lambda: model.loss_fn(params, hidden, batch, None, False)[1])
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def program_key(plan: Plan) -> tuple:
  """What a compiled step depends on. The slot tables (which block each slot
  runs, and which halves) are runtime data, so plans that differ only in them
  — a freeze event that keeps K and the slot width (see
  :attr:`pipejax.partition.Partition.min_slots`) — share one program."""
  partition, tables = plan.partition, plan.partition.tables
  key = (partition.num_layers, plan.pipeline_length, plan.replicas, plan.micro_batches,
         plan.schedule, tables.num_slots, partition.has_embed)
  if partition.split_mlp:  # its inner activation travels too; every half is a branch
    return key + ('split_mlp', partition.mlp_in_keys)
  return key + (bool(tables.has_attention.all()), bool(tables.has_mlp.all()))


def _stage_body(model: LayeredModel, plan: Plan, sched: schedule_lib.Schedule, train: bool,
                fill: float, trace_counter: list | None, exchange: str = 'ppermute'):
  """The per-device program: run ``sched`` for one (replica, stage). Only
  what :func:`program_key` names is read from ``plan``; the slot tables come
  in as the last argument."""
  partition = plan.partition
  num_stages = plan.pipeline_length
  num_micro = plan.micro_batches
  tables = partition.tables
  buffers = schedule_lib.buffer_plan(sched)
  head_unit = 2 * partition.num_layers + 1
  training = not sched.forward_only
  all_attn, all_mlp = bool(tables.has_attention.all()), bool(tables.has_mlp.all())
  # With a split MLP a stage sends ``[hidden | inner]`` (concatenated on the
  # feature axis, so that a tick still moves one array): the residual stream
  # and the MLP's inner activation, zero unless the sending stage ended with
  # the first half of a split MLP.
  split = bool(partition.split_mlp)
  if split and not model.can_split_mlp:
    raise PlanError(f'the partition splits an MLP sub-layer but model {model.name!r} has no '
                    'MLP halves (mlp_in_fn, mlp_out_fn, mlp_in_keys)')
  # One stage is first and last at once: its branches are known statically.
  single = num_stages == 1

  def body(stage_params, batch, rng, slot_tables):
    if trace_counter is not None:
      trace_counter.append(plan)
    stage = lax.axis_index(STAGE)
    replica = lax.axis_index(DATA)
    is_first, is_last = stage == 0, stage == num_stages - 1
    local = {k: jax.tree.map(lambda x: x[0], v) for k, v in stage_params.items()
             if k in ('attention', 'mlp')}
    shared = {k: v for k, v in stage_params.items() if k not in ('attention', 'mlp')}
    params = {**shared, **local}
    micro = jax.tree.map(lambda x: x.reshape((num_micro, -1) + x.shape[1:]), dict(batch))
    slot_layer, slot_attn, slot_mlp_in, slot_mlp_out = (t[0] for t in slot_tables)

    def stage_fn(p, x, m):
      """Stage forward on micro-batch m: ``x [mb, seq, d] -> (out, (loss, metrics))``
      (``[mb, seq, d + inner]`` with a split MLP)."""
      mb = jax.tree.map(lambda a: a[m], micro)
      key = jax.random.fold_in(rng, replica * num_micro + m)
      if split:
        x, inner = x[..., :hidden_shape.shape[-1]], x[..., hidden_shape.shape[-1]:]
      if partition.has_embed:
        embed = lambda: model.embed_fn(p['embed'], mb, unit_rng(key, 0), train)
        h = embed() if single else lax.cond(is_first, embed, lambda: x)
      else:
        h = jnp.where(is_first, mb['hidden'].astype(x.dtype), x)

      def block(h, xs):
        attn_p, mlp_p, layer, has_a, has_in, has_out = xs
        attn = lambda h: model.attention_fn(attn_p, h, mb, unit_rng(key, 1 + 2 * layer), train)
        mlp_key = unit_rng(key, 2 + 2 * layer)
        mlp = lambda h: model.mlp_fn(mlp_p, h, mb, mlp_key, train)
        if split:
          h, inner = h
          h = lax.cond(has_a, attn, lambda h: h, h)
          # 0: no MLP, 1: its first half (sent on), 2: its second half
          # (received), 3: the whole MLP.
          return lax.switch(has_in.astype(jnp.int32) + 2 * has_out.astype(jnp.int32), [
              lambda h, inner: (h, inner),
              lambda h, inner: (h, model.mlp_in_fn(mlp_p, h, mb, mlp_key, train)),
              lambda h, inner: (model.mlp_out_fn(mlp_p, inner, h, mb, mlp_key, train),
                                jnp.zeros_like(inner)),
              lambda h, inner: (mlp(h), inner)], h, inner), None
        # A half that every stage owns in this slot needs no branch.
        h = attn(h) if all_attn else lax.cond(has_a, attn, lambda h: h, h)
        h = mlp(h) if all_mlp else lax.cond(has_in, mlp, lambda h: h, h)
        return h, None

      # Unrolled: XLA then fuses across blocks and saves the loop's
      # per-iteration slicing (measured 1.29x -> 1.10x of plain DP at K=1).
      h, _ = lax.scan(block, (h, inner) if split else h,
                      (p['attention'], p['mlp'], slot_layer, slot_attn, slot_mlp_in,
                       slot_mlp_out), unroll=True)
      if split:
        h, inner = h
      zeros = (jnp.zeros((), jnp.float32), _zeros_like_metrics(model, p['head'], h, mb))
      head = lambda: model.loss_fn(p['head'], h, mb, unit_rng(key, head_unit), train)
      loss_and_metrics = head() if single else lax.cond(is_last, head, lambda: zeros)
      return (jnp.concatenate([h, inner.astype(h.dtype)], -1) if split else h), loss_and_metrics

    hidden_shape = jax.eval_shape(
        lambda: model.embed_fn(shared['embed'], jax.tree.map(lambda a: a[0], micro), None, False)
    ) if partition.has_embed else jax.ShapeDtypeStruct(micro['hidden'].shape[1:],
                                                       micro['hidden'].dtype)
    metric_zero = _zeros_like_metrics(
        model, shared['head'], jnp.zeros(hidden_shape.shape, hidden_shape.dtype),
        jax.tree.map(lambda a: a[0], micro))
    act_shape = hidden_shape.shape
    if split:
      inner_shape = jax.eval_shape(
          lambda h: model.mlp_in_fn(jax.tree.map(lambda x: x[0], local['mlp']), h,
                                    jax.tree.map(lambda a: a[0], micro), None, False),
          hidden_shape)
      act_shape = act_shape[:-1] + (act_shape[-1] + inner_shape.shape[-1],)
    act_zero = jnp.zeros(act_shape, hidden_shape.dtype)
    act_fill = jnp.full(act_shape, fill, hidden_shape.dtype)
    grads0 = jax.tree.map(jnp.zeros_like, params) if training else None
    buf0 = jnp.full((buffers.num_slots,) + act_shape, fill, hidden_shape.dtype)
    ops = jnp.asarray(sched.ops, jnp.int32)
    mbs = jnp.asarray(np.maximum(sched.micro_batch, 0), jnp.int32)
    slots = jnp.asarray(buffers.slot)
    # A fused table's tick may run a FWD and a BWD: then the BWD's own
    # micro-batch and slot (see schedule.one_f_one_b_fused). Any table with
    # backward_micro_batch gives a BWD its own, fused or not.
    fused, own_backward = sched.fused, sched.backward_micro_batch is not None
    backward_mbs = jnp.asarray(np.maximum(sched.micro_batch_of_backward(), 0), jnp.int32)
    backward_slots = jnp.asarray(buffers.backward_slot)
    recv_act = jnp.asarray(buffers.recv_activation_slot)
    recv_cot = jnp.asarray(buffers.recv_cotangent_slot)
    inv_m = 1.0 / num_micro
    if 'example_mask' in micro:
      # A padded batch (a last batch without drop_remainder): micro-batch m's
      # loss, a mean over its real rows, weighs count_m / (total / (M·R)), so
      # the step's loss and gradients are the mean over the global batch's
      # real rows, however the padding falls (1 for every micro-batch when
      # nothing is padded; 0 when no row is real).
      counts = jnp.sum(micro['example_mask'].astype(jnp.float32), axis=1)
      total = lax.psum(jnp.sum(counts), DATA)
      loss_weights = counts * (num_micro * lax.psum(1, DATA)) / jnp.maximum(total, 1.0)
    else:
      loss_weights = None

    def weighted(value, m):
      return value if loss_weights is None else value * loss_weights[m]

    def stage_input(act_buf, slot):
      # Stage 0 reads the batch, never its (unwritten) activation buffer.
      return jnp.where(is_first, act_zero, act_buf[slot])

    def tick(carry, t):
      act_buf, cot_buf, grads, loss_sum, metric_sum = carry
      op = ops[t, stage]
      m, slot = mbs[t, stage], slots[t, stage]
      bm, bslot = (backward_mbs[t, stage], backward_slots[t, stage]) if own_backward else (m, slot)

      def idle():
        return act_fill, act_fill, grads, loss_sum, metric_sum

      def forward(m=m, slot=slot):
        def run():
          out, (loss, metrics) = stage_fn(params, stage_input(act_buf, slot), m)
          if training:  # loss is taken in BWD, where the last stage fuses FWD.
            return out, act_fill, grads, loss_sum, metric_sum
          return (out, act_fill, grads, loss_sum + weighted(loss, m),
                  jax.tree.map(jnp.add, metric_sum, metrics))
        if not training:
          return run()
        return lax.cond(is_last, idle, run)

      def backward(m=m, slot=slot):
        x = stage_input(act_buf, slot)
        cot_out = jnp.where(is_last, act_zero, cot_buf[slot])
        (_, (loss, metrics)), vjp = jax.vjp(lambda p, x: stage_fn(p, x, m), params, x)
        cot_loss = jnp.where(is_last, weighted(inv_m, m), 0.0).astype(jnp.float32)
        g_params, g_x = vjp((cot_out, (cot_loss, jax.tree.map(jnp.zeros_like, metrics))))
        return (act_fill, g_x, jax.tree.map(jnp.add, grads, g_params),
                loss_sum + weighted(loss, m),
                jax.tree.map(jnp.add, metric_sum, metrics))

      if fused:  # a FWD, then a BWD of another micro-batch, each where the cell has one
        send_act = lax.cond((op & schedule_lib.FWD) > 0, lambda: forward()[0],
                            lambda: act_fill)
        send_cot, grads, loss_sum, metric_sum = lax.cond(
            (op & schedule_lib.BWD) > 0, lambda: backward(bm, bslot)[1:], lambda: idle()[1:])
      else:
        branches = ([idle, forward, functools.partial(backward, bm, bslot)] if training
                    else [idle, forward, idle])
        send_act, send_cot, grads, loss_sum, metric_sum = lax.switch(op, branches)
      if training and exchange == 'all_gather':
        # Both messages in one collective: every stage gathers what all sent
        # and keeps the activation of the stage before and the cotangent of
        # the one after (what the two ppermutes below deliver, zeros at the
        # ends included).
        sent = lax.all_gather(jnp.stack([send_act, send_cot]), STAGE)
        before = lax.dynamic_index_in_dim(sent, jnp.maximum(stage - 1, 0), keepdims=False)
        after = lax.dynamic_index_in_dim(sent, jnp.minimum(stage + 1, num_stages - 1),
                                         keepdims=False)
        act_buf = _store(act_buf, jnp.where(is_first, act_zero, before[0]), recv_act[t, stage])
        cot_buf = _store(cot_buf, jnp.where(is_last, act_zero, after[1]), recv_cot[t, stage])
      else:
        arrived = lax.ppermute(send_act, STAGE, [(i, i + 1) for i in range(num_stages - 1)])
        act_buf = _store(act_buf, arrived, recv_act[t, stage])
        if training:
          arrived = lax.ppermute(send_cot, STAGE, [(i + 1, i) for i in range(num_stages - 1)])
          cot_buf = _store(cot_buf, arrived, recv_cot[t, stage])
      return (act_buf, cot_buf, grads, loss_sum, metric_sum), None

    if single:
      # One stage exchanges nothing and reads the batch, never its buffers: its
      # only work is each micro-batch's BWD (training; its FWD is fused into
      # it) or FWD, in the table's order, run as a loop. Unrolled, the program
      # held M copies of the whole model, and its first compile grew with M.
      work = schedule_lib.BWD if training else schedule_lib.FWD
      of = sched.micro_batch_of_backward() if training else sched.micro_batch
      order = np.array([of[t, 0] for t in range(sched.num_ticks)
                        if int(sched.ops[t, 0]) & work], np.int32)

      def one(acc, m):
        grads, loss_sum, metric_sum = acc
        if training:
          (_, (loss, metrics)), vjp = jax.vjp(lambda p, x: stage_fn(p, x, m), params, act_zero)
          g_params, _ = vjp((act_zero, (jnp.asarray(weighted(inv_m, m), jnp.float32),
                                        jax.tree.map(jnp.zeros_like, metrics))))
          grads = jax.tree.map(jnp.add, grads, g_params)
        else:
          _, (loss, metrics) = stage_fn(params, act_zero, m)
        return (grads, loss_sum + weighted(loss, m),
                jax.tree.map(jnp.add, metric_sum, metrics)), None

      (grads, loss_sum, metric_sum), _ = lax.scan(
          one, (grads0, jnp.zeros((), jnp.float32), metric_zero), jnp.asarray(order))
    else:
      carry = (buf0, buf0 if training else buf0[:0], grads0, jnp.zeros((), jnp.float32),
               metric_zero)
      (_, _, grads, loss_sum, metric_sum), _ = lax.scan(tick, carry,
                                                        jnp.arange(sched.num_ticks))
    loss = lax.pmean(lax.psum(loss_sum, STAGE), DATA) * inv_m
    metrics = lax.psum(lax.psum(metric_sum, STAGE), DATA)
    if not training:
      return loss, metrics
    local_grads = {k: jax.tree.map(lambda g: lax.pmean(g, DATA)[None], v)
                   for k, v in grads.items() if k in ('attention', 'mlp')}
    shared_grads = {k: jax.tree.map(lambda g: lax.pmean(lax.psum(g, STAGE), DATA), v)
                    for k, v in grads.items() if k not in ('attention', 'mlp')}
    return loss, metrics, {**shared_grads, **local_grads}

  return body


def _store(buf: jax.Array, value: jax.Array, slot: jax.Array) -> jax.Array:
  """``buf[slot] = value`` when ``slot >= 0``; otherwise ``buf`` unchanged."""
  index = jnp.maximum(slot, 0)
  keep = lax.dynamic_index_in_dim(buf, index, 0, keepdims=False)
  return lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, value, keep), index, 0)


#: How a training tick moves its two messages between neighbouring stages:
#: ``'ppermute'``, two point-to-point collectives (activations forward,
#: cotangents back), each carrying only what its receiver needs; or
#: ``'all_gather'``, one collective in which every stage gathers both messages
#: of every stage (K times the bytes) and keeps its neighbours'.
#: (:func:`pipejax.schedule.step_cost` prices a schedule under each.)
EXCHANGES = schedule_lib.EXCHANGES


def default_exchange(devices) -> str:
  """``'all_gather'`` on CPU devices, ``'ppermute'`` on accelerators.

  On CPU "devices" (threads of one process, often more than the cores) every
  collective is a rendezvous that waits until each device's thread has been
  scheduled to reach it; with the default run's tiny messages that wait, not
  the bytes, is the tick's cost, so one collective per tick beats two (the
  default run's K = 8 step: see ``docs/results.md``). On accelerators the
  bytes count and point-to-point transfers move K times fewer.
  """
  return 'all_gather' if devices and devices[0].platform == 'cpu' else 'ppermute'


class _CheckedStep:
  """A compiled step of one plan that checks its batch before running it.

  ``jitted`` is ``(stage_params, batch, rng, tables) -> ...``, shared by every
  plan with the same :func:`program_key`; ``tables`` are this plan's.
  """

  def __init__(self, jitted, plan: Plan, needed_keys: tuple[str, ...], tables):
    self.jitted, self.plan, self.needed_keys, self.tables = jitted, plan, needed_keys, tables

  def __call__(self, stage_params, batch, rng):
    missing = [k for k in self.needed_keys if k not in batch]
    if missing:
      raise PlanError(f'batch lacks {missing}; it has {sorted(batch)}')
    sizes = {k: int(np.shape(v)[0]) for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
      raise PlanError(f'batch arrays disagree on the batch size: {sizes}')
    check_batch(next(iter(sizes.values())), self.plan)
    return self.jitted(stage_params, dict(batch), rng, self.tables)


class Pipeline:
  """Compiled pipeline steps for one model, cached per plan and shared per program key.

  ``Pipeline(model).grad_fn(plan, stage_params)`` returns a jitted
  ``(stage_params, batch, rng) -> (loss, metrics, grads)``; the same plan
  always returns the same compiled function, and plans with the same
  :func:`program_key` share one program, so it is traced and compiled once
  (``trace_count`` counts traces, for tests and logs).
  """

  def __init__(self, model: LayeredModel, *, devices=None, fill: float = 0.0,
               exchange: str = 'auto'):
    """Args:
      model: the layered model.
      devices: devices to build meshes over (default: all).
      fill: value of unwritten buffers and of what a bubble sends. 0 is the
        safe default; tests poison with NaN to prove nothing leaks.
      exchange: how a training tick moves activations forward and cotangents
        back (see :data:`EXCHANGES`); ``'auto'`` picks
        :func:`default_exchange` for the devices.
    """
    self.model = model
    self.devices = list(jax.devices() if devices is None else devices)
    self.fill = fill
    self.exchange = default_exchange(self.devices) if exchange == 'auto' else exchange
    if self.exchange not in EXCHANGES:
      raise PlanError(f"pipeline exchange must be 'auto' or one of {EXCHANGES}, got {exchange!r}")
    self._steps: dict[tuple, Any] = {}
    self._programs: dict[tuple, Any] = {}
    self._tables: dict[tuple, tuple] = {}
    self.traces: list[Plan] = []

  @property
  def trace_count(self) -> int:
    return len(self.traces)

  def mesh(self, plan: Plan) -> Mesh:
    if plan.num_devices > len(self.devices):
      raise PlanError(f'plan needs R x K = {plan.replicas} x {plan.pipeline_length} = '
                      f'{plan.num_devices} devices but only {len(self.devices)} are in use')
    return make_mesh(plan.pipeline_length, self.devices[:plan.num_devices])

  def tables(self, plan: Plan) -> tuple[jax.Array, ...]:
    """``plan``'s slot tables on its mesh, split over ``'stage'``: the runtime
    argument of its compiled step (see :func:`program_key`); cached."""
    key = (plan.partition, plan.replicas)
    if key not in self._tables:
      sharding = NamedSharding(self.mesh(plan), P(STAGE))
      self._tables[key] = tuple(
          jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
          for a in plan.partition.tables.arrays())
    return self._tables[key]

  def _build(self, plan: Plan, stage_params: Params, train: bool, forward: bool):
    treedef = jax.tree.structure(stage_params)
    key = (plan, train, forward, treedef)
    if key in self._steps:
      return self._steps[key]
    if plan.partition.num_layers != self.model.num_layers:
      raise PlanError(f'partition is for {plan.partition.num_layers} layers but the model has '
                      f'{self.model.num_layers}')
    mesh = self.mesh(plan)
    program = (program_key(plan), train, forward, treedef)
    if program not in self._programs:
      make = schedule_lib.forward_only if forward else functools.partial(
          schedule_lib.make, plan.schedule)
      sched = make(plan.pipeline_length, plan.micro_batches)
      if sched.num_stages != plan.pipeline_length:  # a registered generator of one's own
        raise schedule_lib.ScheduleError(
            f'schedule {plan.schedule!r} made a table of {sched.num_stages} stages for a '
            f'pipeline of length {plan.pipeline_length}')
      # Every micro-batch of the plan, each once: a table that leaves one out
      # would train on part of the batch without a word.
      schedule_lib.validate(sched, plan.micro_batches)
      specs = stage_param_specs(stage_params)
      body = _stage_body(self.model, plan, sched, train, self.fill, self.traces, self.exchange)
      out_specs = (P(), P()) if forward else (P(), P(), specs)
      mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DATA), P(), P(STAGE)),
                             out_specs=out_specs, check_vma=False)
      self._programs[program] = jax.jit(mapped)
    model = self.model
    inputs = model.input_keys if plan.partition.has_embed else ('hidden',) + model.block_keys
    step = _CheckedStep(self._programs[program], plan, inputs + model.label_keys,
                        self.tables(plan))
    self._steps[key] = step
    return step

  def grad_fn(self, plan: Plan, stage_params: Params, *, train: bool = True):
    """The compiled ``(stage_params, batch, rng) -> (loss, metrics, grads)``.

    ``loss`` is the mean loss over the global batch (over its real rows when
    it has an ``example_mask``), ``metrics`` the summed metrics, ``grads``
    has the layout and sharding of ``stage_params``.
    ``train=False`` disables dropout. ``rng`` is a PRNG key (ignored without
    dropout).
    """
    return self._build(plan, stage_params, train, forward=False)

  def eval_fn(self, plan: Plan, stage_params: Params):
    """The compiled forward-only ``(stage_params, batch, rng) -> (loss, metrics)``:
    the loss and metrics of :meth:`grad_fn`, padded rows left out alike."""
    return self._build(plan, stage_params, False, forward=True)


def shard_stage_params(params: Params, partition: Partition, mesh: Mesh) -> Params:
  """Lays canonical ``params`` out for ``partition`` directly on ``mesh``.

  Runs :func:`pipejax.partition.to_stage_params` under ``jax.jit`` with the
  stage layout's shardings as ``out_shardings``, so each device only receives
  its own stage's slots.
  """
  layout = functools.partial(to_stage_params, partition=partition)
  shardings = stage_param_shardings(jax.eval_shape(layout, params), mesh)
  return jax.jit(layout, out_shardings=shardings)(params)
