"""Pipeline schedules as data.

A schedule is a static table ``(tick, stage) -> IDLE | FWD m | BWD m | BOTH``
(``BOTH``: the fused 1F1B's tick of a forward and a backward). It is
built in Python, checked by :func:`validate`, costed by :func:`simulate` and
interpreted by the SPMD executor in :mod:`pipejax.pipeline`, which also uses
:func:`buffer_plan` to know where each stage keeps each micro-batch's stashed
input and received cotangent.

Timing model (unit time): every FWD and every BWD takes one tick, and what a
stage sends at the end of tick ``t`` is usable by its neighbour from tick
``t + 1`` on. Generators (:func:`gpipe`, :func:`one_f_one_b`,
:func:`forward_only`) give each stage an ordered list of operations and place
each one at the earliest tick its dependencies allow.
:func:`one_f_one_b_fused` places its ops by formula, and a tick of it may run
a FWD and a BWD on one stage (a BOTH cell).

:func:`step_cost` prices a table with real op costs instead: the executor ends
every tick in an exchange, so a stage's slow op delays the others (all of them
at once when the exchange is one collective of all stages).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

IDLE, FWD, BWD = 0, 1, 2
#: A cell that runs a FWD and a BWD (of another micro-batch) in one tick.
BOTH = FWD | BWD
_OP_NAMES = {IDLE: 'IDLE', FWD: 'FWD', BWD: 'BWD'}


class ScheduleError(ValueError):
  """A schedule table that violates a dependency or the exactly-once rule."""


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """A static schedule table.

  Attributes:
    name: e.g. ``'gpipe'``, ``'1f1b'``.
    ops: ``[ticks, stages]`` int8 with IDLE / FWD / BWD, or BOTH (a FWD and
      a BWD in one tick).
    micro_batch: ``[ticks, stages]`` int32, the micro-batch of each op (-1 when
      idle; of the FWD in a BOTH cell).
    forward_only: True for inference schedules (no BWD at all).
    backward_micro_batch: ``[ticks, stages]`` int32, the micro-batch of each
      cell's BWD (-1 in cells without one; it overrides ``micro_batch`` in
      BWD cells); needed by tables with BOTH cells, None elsewhere.
  """

  name: str
  ops: np.ndarray
  micro_batch: np.ndarray
  forward_only: bool = False
  backward_micro_batch: np.ndarray | None = None

  @property
  def num_ticks(self) -> int:
    return int(self.ops.shape[0])

  @property
  def num_stages(self) -> int:
    return int(self.ops.shape[1])

  @property
  def num_micro_batches(self) -> int:
    return int(self.micro_batch.max()) + 1

  @property
  def fused(self) -> bool:
    """Whether some tick runs a FWD and a BWD on one stage."""
    return bool((self.ops == BOTH).any())

  def cell(self, tick: int, stage: int) -> list[tuple[int, int]]:
    """The ``(op, micro_batch)`` run at ``(tick, stage)``: none, one, or a
    FWD and a BWD."""
    op, m = int(self.ops[tick, stage]), int(self.micro_batch[tick, stage])
    out = [(FWD, m)] if op & FWD else []
    if op & BWD:
      out.append((BWD, m if self.backward_micro_batch is None
                  else int(self.backward_micro_batch[tick, stage])))
    return out

  def micro_batch_of_backward(self) -> np.ndarray:
    """``[ticks, stages]``: the micro-batch of each cell's BWD (-1 without)."""
    if self.backward_micro_batch is not None:
      return np.where((self.ops & BWD) > 0, self.backward_micro_batch, -1).astype(np.int32)
    return np.where(self.ops == BWD, self.micro_batch, -1).astype(np.int32)

  @functools.cached_property
  def key(self) -> tuple:
    """Hashable identity of the table (its hash and equality)."""
    return (self.name, self.forward_only, self.ops.shape, self.ops.tobytes(),
            self.micro_batch.tobytes(),
            None if self.backward_micro_batch is None else self.backward_micro_batch.tobytes())

  def __hash__(self) -> int:
    return hash(self.key)

  def __eq__(self, other) -> bool:
    return isinstance(other, Schedule) and self.key == other.key

  def render(self) -> str:
    """The table as text, one row per stage (``F3`` = FWD of micro-batch 3,
    ``F3B1`` = FWD of 3 and BWD of 1 in one tick)."""
    text = [[''.join(f'{"F" if op == FWD else "B"}{m}' for op, m in self.cell(t, s)) or '.'
             for t in range(self.num_ticks)] for s in range(self.num_stages)]
    width = max(len(c) for row in text for c in row) + 1 if self.fused else 3
    return '\n'.join(f'stage {s}: ' + ''.join((' . ' if c == '.' else c).ljust(width)
                                               for c in row) for s, row in enumerate(text))


def _check_sizes(num_stages: int, num_micro_batches: int) -> None:
  if num_stages < 1:
    raise ScheduleError(f'pipeline length must be >= 1, got {num_stages}')
  if num_micro_batches < 1:
    raise ScheduleError(f'micro-batch count must be >= 1, got {num_micro_batches}')


def from_orders(name: str, orders: Sequence[Sequence[tuple[int, int]]],
                forward_only: bool = False) -> Schedule:
  """Places per-stage operation orders at the earliest ticks allowed.

  Args:
    name: the schedule's name.
    orders: for each stage, its operations in order as ``(op, micro_batch)``.
    forward_only: whether the schedule has no BWD.

  Returns:
    The :class:`Schedule`; raises :class:`ScheduleError` if the orders deadlock.
  """
  num_stages = len(orders)
  done: dict[tuple[int, int, int], int] = {}  # (op, stage, m) -> tick
  pos = [0] * num_stages
  rows_ops, rows_mb = [], []
  total = sum(len(o) for o in orders)
  tick = 0
  while len(done) < total:
    ops_row = np.zeros(num_stages, np.int8)
    mb_row = np.full(num_stages, -1, np.int32)
    progressed = False
    for s in range(num_stages):
      if pos[s] >= len(orders[s]):
        continue
      op, m = orders[s][pos[s]]
      if _ready(done, op, s, m, num_stages, tick):
        ops_row[s], mb_row[s] = op, m
        progressed = True
    if not progressed:
      # Readiness only depends on ops finished before this tick, so a tick
      # where nothing can run is followed by the same tick forever.
      raise ScheduleError(f'schedule {name!r} deadlocks at tick {tick}')
    for s in range(num_stages):
      if ops_row[s] != IDLE:
        done[(int(ops_row[s]), s, int(mb_row[s]))] = tick
        pos[s] += 1
    rows_ops.append(ops_row)
    rows_mb.append(mb_row)
    tick += 1
  return Schedule(name, np.stack(rows_ops), np.stack(rows_mb), forward_only)


def _ready(done, op, stage, m, num_stages, tick) -> bool:
  """Whether ``op`` of micro-batch ``m`` may run on ``stage`` at ``tick``."""
  def before(key):
    return key in done and done[key] < tick
  if op == FWD:
    return stage == 0 or before((FWD, stage - 1, m))
  if not before((FWD, stage, m)):
    return False
  return stage == num_stages - 1 or before((BWD, stage + 1, m))


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
  """GPipe: every stage forwards all M micro-batches, then backwards them in
  reverse order (torchgpipe's order)."""
  _check_sizes(num_stages, num_micro_batches)
  m_range = range(num_micro_batches)
  orders = [[(FWD, m) for m in m_range] + [(BWD, m) for m in reversed(m_range)]
            for _ in range(num_stages)]
  return from_orders('gpipe', orders)


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
  """1F1B / PipeDream-Flush: stage s runs min(K-s-1, M) warm-up forwards, then
  alternates one forward and one backward, then drains the backwards. A stage
  never holds more than K stashed micro-batches."""
  _check_sizes(num_stages, num_micro_batches)
  orders = []
  for s in range(num_stages):
    warmup = min(num_stages - s - 1, num_micro_batches)
    order = [(FWD, m) for m in range(warmup)]
    next_fwd, next_bwd = warmup, 0
    while next_bwd < num_micro_batches:
      if next_fwd < num_micro_batches:
        order.append((FWD, next_fwd))
        next_fwd += 1
      order.append((BWD, next_bwd))
      next_bwd += 1
    orders.append(order)
  return from_orders('1f1b', orders)


def forward_only(num_stages: int, num_micro_batches: int) -> Schedule:
  """Inference: every stage forwards the micro-batches in order."""
  _check_sizes(num_stages, num_micro_batches)
  orders = [[(FWD, m) for m in range(num_micro_batches)] for _ in range(num_stages)]
  return from_orders('forward', orders, forward_only=True)


def one_f_one_b_fused(num_stages: int, num_micro_batches: int) -> Schedule:
  """1F1B with a forward and a backward in one tick: stage s forwards
  micro-batch m at tick ``m + s`` and backwards it at tick ``m + 2K − 1 − s``,
  the earliest its cotangent allows; from tick ``2K − 1 − s`` to ``M − 1 + s``
  (when ``M ≥ 2(K − s)``) its ticks hold a FWD and a BWD. ``M + 2K − 1`` ticks
  (1F1B: ``2(M + K − 1)``), and a stage keeps at most ``2(K − s)``
  micro-batches live (1F1B: ``K − s``; GPipe: M). Every tick ends in an
  exchange (:mod:`pipejax.pipeline`), so with 1F1B a stage that forwards
  waits for its neighbour's backward; here both run in the tick
  (:func:`step_cost`)."""
  _check_sizes(num_stages, num_micro_batches)
  k, m_count = num_stages, num_micro_batches
  ticks = m_count + 2 * k - 1
  ops = np.zeros((ticks, k), np.int8)
  forward_mb = np.full((ticks, k), -1, np.int32)
  backward_mb = np.full((ticks, k), -1, np.int32)
  for s in range(k):
    for m in range(m_count):
      ops[m + s, s] |= FWD
      forward_mb[m + s, s] = m
      ops[m + 2 * k - 1 - s, s] |= BWD
      backward_mb[m + 2 * k - 1 - s, s] = m
  micro_batch = np.where(ops == BWD, backward_mb, forward_mb)
  return Schedule('1f1b-fused', ops, micro_batch.astype(np.int32),
                  backward_micro_batch=backward_mb)


SCHEDULES = {'gpipe': gpipe, '1f1b': one_f_one_b, '1f1b-fused': one_f_one_b_fused}


def make(name: str, num_stages: int, num_micro_batches: int) -> Schedule:
  """The training schedule called ``name`` (one of :data:`SCHEDULES`)."""
  if name not in SCHEDULES:
    raise ScheduleError(f'unknown schedule {name!r}; expected one of {sorted(SCHEDULES)}')
  return SCHEDULES[name](num_stages, num_micro_batches)


def _op_ticks(schedule: Schedule) -> dict[tuple[int, int, int], int]:
  """``(op, stage, micro_batch) -> tick``, rejecting duplicates."""
  ticks: dict[tuple[int, int, int], int] = {}
  for t, s in zip(*np.nonzero(schedule.ops)):
    for op, m in schedule.cell(int(t), int(s)):
      key = (op, int(s), m)
      if key in ticks:
        raise ScheduleError(f'{_OP_NAMES[op]} of micro-batch {m} runs twice on stage {s} '
                            f'(ticks {ticks[key]} and {t}); each must run exactly once')
      ticks[key] = int(t)
  return ticks


def validate(schedule: Schedule, num_micro_batches: int | None = None) -> None:
  """Raises :class:`ScheduleError` unless ``schedule`` is runnable.

  Checks: only IDLE/FWD/BWD/BOTH; each micro-batch forwarded (and, for training
  schedules, backwarded) exactly once per stage; FWD on stage s after FWD on
  stage s-1; BWD on a stage after its own FWD and after BWD on stage s+1.
  """
  ops, mb = schedule.ops, schedule.micro_batch
  if ops.ndim != 2 or ops.shape != mb.shape:
    raise ScheduleError(f'schedule tables must both be [ticks, stages]; got {ops.shape} '
                        f'and {mb.shape}')
  bad = ~np.isin(ops, (IDLE, FWD, BWD, BOTH))
  if bad.any():
    t, s = np.argwhere(bad)[0]
    raise ScheduleError(f'unknown op {ops[t, s]} at tick {t}, stage {s}; '
                        f'expected IDLE=0, FWD=1, BWD=2 or BOTH=3')
  if schedule.forward_only and (ops & BWD).any():
    raise ScheduleError('a forward-only schedule contains BWD ops')
  if (ops == BOTH).any() and (schedule.backward_micro_batch is None
                              or schedule.backward_micro_batch.shape != ops.shape):
    raise ScheduleError('a schedule with BOTH cells needs a [ticks, stages] '
                        'backward_micro_batch table')
  num_m = num_micro_batches if num_micro_batches is not None else schedule.num_micro_batches
  bwd_mb = schedule.micro_batch_of_backward()
  for name, cells, table in (('micro-batch', ops != IDLE, mb),
                             ('BWD micro-batch', (ops & BWD) > 0, bwd_mb)):
    outside = cells & ((table < 0) | (table >= num_m))
    if outside.any():
      t, s = np.argwhere(outside)[0]
      raise ScheduleError(f'{name} {table[t, s]} at tick {t}, stage {s} is outside '
                          f'[0, {num_m})')
  ticks = _op_ticks(schedule)
  num_stages = schedule.num_stages
  wanted = (FWD,) if schedule.forward_only else (FWD, BWD)
  for s in range(num_stages):
    for m in range(num_m):
      for op in wanted:
        if (op, s, m) not in ticks:
          raise ScheduleError(f'{_OP_NAMES[op]} of micro-batch {m} never runs on stage {s}')
      f = ticks[(FWD, s, m)]
      if s > 0 and not ticks[(FWD, s - 1, m)] < f:
        raise ScheduleError(
            f'FWD of micro-batch {m} on stage {s} at tick {f} needs FWD on stage {s - 1} '
            f'first (it runs at tick {ticks[(FWD, s - 1, m)]})')
      if schedule.forward_only:
        continue
      b = ticks[(BWD, s, m)]
      if not f < b:
        raise ScheduleError(f'BWD of micro-batch {m} on stage {s} at tick {b} precedes '
                            f'its FWD at tick {f}')
      if s < num_stages - 1 and not ticks[(BWD, s + 1, m)] < b:
        raise ScheduleError(
            f'BWD of micro-batch {m} on stage {s} at tick {b} needs BWD on stage {s + 1} '
            f'first (it runs at tick {ticks[(BWD, s + 1, m)]})')


@dataclasses.dataclass(frozen=True)
class Simulation:
  """What a schedule costs in the unit-time model.

  Attributes:
    ticks: length of the schedule.
    bubble_fraction: idle (tick, stage) cells over all cells (a BOTH cell
      is one busy cell: the unit-time model does not price it;
      :func:`step_cost` does).
    peak_stash: per stage, the most micro-batches forwarded but not yet
      backwarded at any tick (their stage inputs must be kept).
  """
  ticks: int
  bubble_fraction: float
  peak_stash: tuple[int, ...]


def simulate(schedule: Schedule) -> Simulation:
  """Costs a valid schedule (see :class:`Simulation`)."""
  validate(schedule)
  busy = int(np.count_nonzero(schedule.ops))
  cells = schedule.num_ticks * schedule.num_stages
  peaks = []
  for s in range(schedule.num_stages):
    live = peak = 0
    for t in range(schedule.num_ticks):
      if schedule.ops[t, s] & FWD:
        live += 1
      peak = max(peak, live)
      if schedule.ops[t, s] & BWD:
        live -= 1
    peaks.append(peak if not schedule.forward_only else 1)
  return Simulation(schedule.num_ticks, 1.0 - busy / cells, tuple(peaks))


@dataclasses.dataclass(frozen=True)
class StepCost:
  """What one step of a schedule costs when its ops take real time.

  Attributes:
    time: from the first tick's start to the last stage's end.
    work: the ops' costs, summed over every stage and tick.
    utilization: ``work / (time · stages)``, the share of the devices' time
      spent in ops (1 minus it is the cost-weighted bubble); 1 for a step
      that costs nothing.
  """
  time: float
  work: float
  utilization: float


#: The executor's exchanges (:data:`pipejax.pipeline.EXCHANGES` is this
#: tuple), and so how :func:`step_cost` lets a tick end: ``'ppermute'``, when
#: the stage and its two neighbours have done their ops (point-to-point sends
#: and receives); ``'all_gather'``, when every stage has (one collective of
#: all stages).
EXCHANGES = ('ppermute', 'all_gather')


def step_cost(schedule: Schedule, forward: Sequence[float], backward: Sequence[float],
              exchange: str = 'ppermute') -> StepCost:
  """Costs a valid schedule whose every tick ends in an exchange, as in
  :mod:`pipejax.pipeline`; the exchange itself is free.

  With ``'all_gather'`` the stages run in lock-step: a tick lasts as long as
  its slowest op, so a 1F1B tick that mixes forwards and backwards costs a
  backward. With ``'ppermute'`` a stage starts its next tick once it and its
  neighbours have ended this one, and a slow op delays the others a stage a
  tick.

  Args:
    schedule: the table.
    forward: per stage, what one FWD costs there (0 where the executor fuses
      the forward into the backward, as on its last stage).
    backward: per stage, what one BWD costs there (recomputed forward and
      backward together, as the executor runs it).
    exchange: one of :data:`EXCHANGES`.

  Raises:
    ScheduleError: an invalid table, not one cost per stage, or an unknown
      exchange.
  """
  validate(schedule)
  k = schedule.num_stages
  if len(forward) != k or len(backward) != k:
    raise ScheduleError(f'need one forward and one backward cost per stage ({k}); got '
                        f'{len(forward)} and {len(backward)}')
  if exchange not in EXCHANGES:
    raise ScheduleError(f'unknown exchange {exchange!r}; expected one of {EXCHANGES}')
  costs = np.zeros(schedule.ops.shape)
  for op, per_stage in ((FWD, forward), (BWD, backward)):  # a BOTH cell costs both
    where = (schedule.ops & op) > 0
    costs[where] += np.broadcast_to(np.asarray(per_stage, float), costs.shape)[where]
  end = np.zeros(k)  # when each stage ended the tick before
  for tick_costs in costs:
    done = end + tick_costs  # when each stage reaches the exchange
    if exchange == 'all_gather':
      end = np.full(k, done.max())
    else:
      end = np.maximum(done, np.maximum(np.r_[done[1:], 0.0], np.r_[0.0, done[:-1]]))
  time, work = float(end.max()), float(costs.sum())
  return StepCost(time, work, work / (time * k) if time else 1.0)


@dataclasses.dataclass(frozen=True, eq=False)
class BufferPlan:
  """Where each stage keeps its micro-batches, for the executor.

  A stage keeps the input it received for micro-batch m (and later the
  cotangent for m) in one buffer slot from the tick the input arrives until
  the tick it runs BWD of m; slots are reused as soon as they are free.

  Attributes:
    num_slots: buffer slots per stage.
    slot: ``[ticks, stages]``: the slot read by the op at (tick, stage) (by
      the FWD in a BOTH cell).
    recv_activation_slot: ``[ticks, stages]``: the slot that stores the
      activation arriving at the end of the tick, or -1.
    recv_cotangent_slot: ``[ticks, stages]``: likewise for cotangents.
    backward_slot: ``[ticks, stages]``: the slot read by the cell's BWD; equal
      to ``slot`` except in BOTH cells (0 when idle, as ``slot``).
  """
  num_slots: int
  slot: np.ndarray
  recv_activation_slot: np.ndarray
  recv_cotangent_slot: np.ndarray
  backward_slot: np.ndarray


def buffer_plan(schedule: Schedule) -> BufferPlan:
  """Assigns buffer slots to a valid schedule (interval colouring per stage)."""
  validate(schedule)
  ticks = _op_ticks(schedule)
  num_t, num_s = schedule.ops.shape
  num_m = schedule.num_micro_batches
  slot_of = {}
  num_slots = 1
  for s in range(num_s):
    intervals = []
    for m in range(num_m):
      start = ticks[(FWD, s - 1, m)] if s > 0 else ticks[(FWD, s, m)]
      end = ticks[(FWD, s, m)] if schedule.forward_only else ticks[(BWD, s, m)]
      intervals.append((start, end, m))
    free_at: list[int] = []  # per slot: last tick it is read
    for start, end, m in sorted(intervals):
      # A slot read at tick e may be written at the end of tick e (reads first).
      slot = next((i for i, e in enumerate(free_at) if e <= start), None)
      if slot is None:
        slot = len(free_at)
        free_at.append(end)
      free_at[slot] = end
      slot_of[(s, m)] = slot
    num_slots = max(num_slots, len(free_at))
  slot = np.zeros((num_t, num_s), np.int32)
  backward_slot = np.zeros((num_t, num_s), np.int32)
  recv_act = np.full((num_t, num_s), -1, np.int32)
  recv_cot = np.full((num_t, num_s), -1, np.int32)
  for t in range(num_t):
    for s in range(num_s):
      for i, (op, m) in enumerate(schedule.cell(t, s)):
        if i == 0:
          slot[t, s] = slot_of[(s, m)]
        backward_slot[t, s] = slot_of[(s, m)]
        if op == FWD and s + 1 < num_s:
          recv_act[t, s + 1] = slot_of[(s + 1, m)]
        if op == BWD and s > 0:
          recv_cot[t, s - 1] = slot_of[(s - 1, m)]
  return BufferPlan(num_slots, slot, recv_act, recv_cot, backward_slot)
