"""Schedules as data: generators, validator, simulator, buffer plan."""
import numpy as np
import pytest

from pipejax import schedule as S

SIZES = [(1, 1), (1, 4), (2, 2), (2, 5), (4, 4), (4, 8), (8, 8), (8, 3), (3, 7)]


@pytest.mark.parametrize('k,m', SIZES)
def test_gpipe_bubble_fraction_matches_formula(k, m):
  sim = S.simulate(S.gpipe(k, m))
  assert sim.ticks == 2 * (m + k - 1)
  assert sim.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))


@pytest.mark.parametrize('k,m', SIZES)
def test_stash_gpipe_m_versus_1f1b_at_most_k(k, m):
  assert S.simulate(S.gpipe(k, m)).peak_stash == (m,) * k
  peaks = S.simulate(S.one_f_one_b(k, m)).peak_stash
  assert max(peaks) <= k
  # PipeDream-Flush: stage s keeps min(K - s, M) inputs.
  assert peaks == tuple(min(k - s, m) for s in range(k))
  # Same length as GPipe: 1F1B saves memory, not time.
  assert S.simulate(S.one_f_one_b(k, m)).ticks == 2 * (m + k - 1)


def _by_hand_1f1b_k2_m3():
  # stage 0: F0 F1 .  B0 F2 B1 .  B2
  # stage 1: .  F0 B0 F1 B1 F2 B2 .
  ops = [[1, 0], [1, 1], [0, 2], [2, 1], [1, 2], [2, 1], [0, 2], [2, 0]]
  mb = [[0, -1], [1, 0], [-1, 0], [0, 1], [2, 1], [1, 2], [-1, 2], [2, -1]]
  return np.array(ops, np.int8), np.array(mb, np.int32)


def test_1f1b_equals_hand_written_table():
  ops, mb = _by_hand_1f1b_k2_m3()
  sched = S.one_f_one_b(2, 3)
  np.testing.assert_array_equal(sched.ops, ops)
  np.testing.assert_array_equal(np.where(sched.ops > 0, sched.micro_batch, -1), mb)


def test_validator_rejects_violated_dependencies():
  ops, mb = _by_hand_1f1b_k2_m3()
  S.validate(S.Schedule('hand', ops, mb))
  # Stage 1 forwards micro-batch 0 in the same tick as stage 0.
  bad_ops, bad_mb = ops.copy(), mb.copy()
  bad_ops[0, 1], bad_mb[0, 1] = 1, 0
  bad_ops[1, 1], bad_mb[1, 1] = 0, -1
  with pytest.raises(S.ScheduleError, match='FWD of micro-batch 0 on stage 1 at tick 0 needs FWD'):
    S.validate(S.Schedule('bad', bad_ops, bad_mb))
  # Stage 0 backwards micro-batch 0 before stage 1 did.
  bad_ops, bad_mb = ops.copy(), mb.copy()
  bad_ops[2, 0], bad_mb[2, 0] = 2, 0
  bad_ops[3, 0], bad_mb[3, 0] = 0, -1
  with pytest.raises(S.ScheduleError, match='BWD of micro-batch 0 on stage 0 at tick 2 needs BWD'):
    S.validate(S.Schedule('bad', bad_ops, bad_mb))
  # A micro-batch forwarded twice, another never.
  bad_ops, bad_mb = ops.copy(), mb.copy()
  bad_mb[1, 0] = 0
  with pytest.raises(S.ScheduleError, match='runs twice'):
    S.validate(S.Schedule('bad', bad_ops, bad_mb))
  # A backward that never runs (its FWD does): every op must run.
  t, st = np.argwhere(ops == 2)[-1]
  bad_ops, bad_mb = ops.copy(), mb.copy()
  m = bad_mb[t, st]
  bad_ops[t, st], bad_mb[t, st] = 0, -1
  with pytest.raises(S.ScheduleError, match=f'BWD of micro-batch {m} never runs on stage {st}'):
    S.validate(S.Schedule('bad', bad_ops, bad_mb))
  # BWD before FWD on the same stage.
  with pytest.raises(S.ScheduleError, match='precedes its FWD'):
    S.validate(S.Schedule('bad', ops[::-1].copy(), mb[::-1].copy()))
  with pytest.raises(S.ScheduleError, match='unknown op 7'):
    S.validate(S.Schedule('bad', np.where(ops == 2, 7, ops).astype(np.int8), mb))


def test_a_micro_batch_beyond_the_count_is_refused():
  """A table made for M + 1 micro-batches, validated for M: micro-batch M is
  out of range (an executor indexing it would clamp it to M - 1)."""
  with pytest.raises(S.ScheduleError, match=r'^micro-batch 3 at tick \d+, stage 0 is outside '
                                            r'\[0, 3\)$'):
    S.validate(S.gpipe(2, 4), 3)
  with pytest.raises(S.ScheduleError, match=r'micro-batch -1 at tick 0, stage 0 is outside'):
    ops, mb = _by_hand_1f1b_k2_m3()
    mb = mb.copy()
    mb[0, 0] = -1
    S.validate(S.Schedule('bad', ops, mb))
  S.validate(S.gpipe(2, 3), 3)


def test_deadlocking_orders_are_rejected():
  with pytest.raises(S.ScheduleError, match='deadlocks'):
    S.from_orders('x', [[(S.BWD, 0), (S.FWD, 0)], [(S.FWD, 0), (S.BWD, 0)]])


def test_unknown_schedule_and_bad_sizes():
  with pytest.raises(S.ScheduleError, match="unknown schedule 'zb'"):
    S.make('zb', 2, 2)
  with pytest.raises(S.ScheduleError, match='micro-batch count must be >= 1'):
    S.gpipe(2, 0)


@pytest.mark.parametrize('name', ['gpipe', '1f1b', '1f1b-fused', 'forward-only'])
@pytest.mark.parametrize('k,m', SIZES)
def test_buffer_plan_never_overwrites_a_live_slot(name, k, m):
  """Replays the table: a slot is never written while its micro-batch is
  live (until its BWD, or in an evaluation table its FWD, has read it)."""
  sched = S.forward_only(k, m) if name == 'forward-only' else S.make(name, k, m)
  plan = S.buffer_plan(sched)
  owner = [[None] * plan.num_slots for _ in range(k)]
  for t in range(sched.num_ticks):
    for s in range(k):  # reads happen before the tick's arrivals are stored
      for op, mb in sched.cell(t, s):
        slot = plan.slot[t, s] if op == S.FWD else plan.backward_slot[t, s]
        if s > 0 or op == S.BWD:
          assert owner[s][slot] == mb, (t, s)
        if op == S.BWD or sched.forward_only:
          owner[s][slot] = None
    for s in range(k):
      for table, src, want in ((plan.recv_activation_slot, s - 1, S.FWD),
                               (plan.recv_cotangent_slot, s + 1, S.BWD)):
        slot = table[t, s]
        if slot >= 0:
          sent = dict(sched.cell(t, src))
          assert want in sent
          assert owner[s][slot] in (None, sent[want]), (t, s, slot)
          owner[s][slot] = sent[want]
      first = dict(sched.cell(t, 0))
      if s == 0 and S.FWD in first:
        assert owner[0][plan.slot[t, 0]] is None
        owner[0][plan.slot[t, 0]] = first[S.FWD]
  bound = {'gpipe': m, '1f1b': min(m, k) + 1, '1f1b-fused': min(m, 2 * k - 1),
           'forward-only': 1}[name]
  assert plan.num_slots <= bound


def test_fused_1f1b_runs_a_forward_and_a_backward_a_tick():
  """K = 3, M = 4 written out by hand: stage s forwards m at tick m + s and
  backwards it at m + 5 - s; M + 2K - 1 = 9 ticks against 1F1B's 12."""
  sched = S.one_f_one_b_fused(3, 4)
  assert sched.render() == (
      'stage 0: F0   F1   F2   F3    .   B0   B1   B2   B3   \n'
      'stage 1:  .   F0   F1   F2   F3B0 B1   B2   B3    .   \n'
      'stage 2:  .    .   F0   F1B0 F2B1 F3B2 B3    .    .   ')
  assert sched.num_ticks == 9 and S.one_f_one_b(3, 4).num_ticks == 12
  assert sched.cell(4, 1) == [(S.FWD, 3), (S.BWD, 0)] and sched.cell(0, 2) == []
  # Stage s keeps at most 2(K - s) inputs: more than 1F1B's K - s, fewer than
  # GPipe's M once M > 2K.
  assert S.simulate(sched).peak_stash == (4, 4, 2)
  assert S.simulate(S.one_f_one_b_fused(3, 12)).peak_stash == (6, 4, 2)
  # With equal stages and either exchange it takes GPipe's time, not 1F1B's.
  for k, m in SIZES:
    for exchange in S.EXCHANGES:
      fused = S.step_cost(S.one_f_one_b_fused(k, m), [1.0] * k, [2.5] * k, exchange)
      gpipe = S.step_cost(S.gpipe(k, m), [1.0] * k, [2.5] * k, exchange)
      assert fused.time <= gpipe.time + 1e-9, (k, m, exchange)


def test_validator_refuses_a_backward_in_a_forward_only_table():
  S.validate(S.forward_only(3, 4))
  train = S.gpipe(3, 4)
  with pytest.raises(S.ScheduleError, match='^a forward-only schedule contains BWD ops$'):
    S.validate(S.Schedule('x', train.ops, train.micro_batch, forward_only=True))


def test_validator_checks_both_cells():
  sched = S.one_f_one_b_fused(2, 2)
  S.validate(sched)
  no_table = S.Schedule('x', sched.ops, sched.micro_batch)
  with pytest.raises(S.ScheduleError, match='BOTH cells needs a'):
    S.validate(no_table)
  bad = sched.backward_micro_batch.copy()
  bad[sched.ops == S.BOTH] = 5
  with pytest.raises(S.ScheduleError, match=r'BWD micro-batch 5 at tick 2, stage 1 is outside'):
    S.validate(S.Schedule('x', sched.ops, sched.micro_batch, backward_micro_batch=bad))
  early = sched.backward_micro_batch.copy()
  early[2, 1] = 1  # cell (2, 1) becomes F1B1: B1 now runs twice on stage 1
  with pytest.raises(S.ScheduleError, match='BWD of micro-batch 1 runs twice on stage 1'):
    S.validate(S.Schedule('x', sched.ops, sched.micro_batch, backward_micro_batch=early))


def test_render_draws_the_table():
  """GPipe (all forwards, then backwards in reverse) and 1F1B (stage s warms
  up with K - s - 1 forwards) for K = 2, written out by hand."""
  assert S.gpipe(2, 2).render() == ('stage 0: F0 F1  .  . B1 B0 \n'
                                           'stage 1:  . F0 F1 B1 B0  . ')
  assert S.one_f_one_b(2, 3).render() == ('stage 0: F0 F1  . B0 F2 B1  . B2 \n'
                                                 'stage 1:  . F0 B0 F1 B1 F2 B2  . ')


def test_step_cost_of_the_hand_written_table():
  # forward [1, 0] (the last stage fuses its forward into the backward),
  # backward [3, 2]; per tick of _by_hand_1f1b_k2_m3, the slowest op:
  # F0 | .    -> 1     F1 | F0  -> 1     . | B0  -> 2     B0 | F1 -> 3
  # F2 | B1   -> 2     B1 | F2  -> 3     . | B2  -> 2     B2 | .  -> 3
  for exchange in S.EXCHANGES:  # two stages: each is the other's neighbour
    cost = S.step_cost(S.one_f_one_b(2, 3), forward=[1, 0], backward=[3, 2],
                       exchange=exchange)
    assert cost.time == 17
    assert cost.work == 3 * (1 + 3) + 3 * (0 + 2)
    assert cost.utilization == pytest.approx(18 / (17 * 2))


def test_step_cost_ppermute_waits_for_the_neighbours_only():
  """GPipe, K = 3, M = 2, FWD [1, 2, 0], BWD [3, 1, 2], by hand:

  tick  ops (stages 0 1 2)  costs     reach the exchange  end (ppermute)  all_gather
  0     F0  .   .           1 0 0     1  0  0             1  1  0         1
  1     F1  F0  .           1 2 0     2  3  0             3  3  3         3
  2     .   F1  F0          0 2 0     3  5  3             5  5  5         5
  3     .   .   F1          0 0 0     5  5  5             5  5  5         5
  4     .   .   B1          0 0 2     5  5  7             5  7  7         7
  5     .   B1  B0          0 1 2     5  8  9             8  9  9         9
  6     B1  B0  .           3 1 0     11 10 9             11 11 10        12
  7     B0  .   .           3 0 0     14 11 10            14 14 11        15

  At tick 4 stage 0 does not wait for stage 2's backward, two stages away.
  """
  table = S.gpipe(3, 2)
  assert S.step_cost(table, [1, 2, 0], [3, 1, 2], exchange='ppermute').time == 14
  assert S.step_cost(table, [1, 2, 0], [3, 1, 2], exchange='all_gather').time == 15


@pytest.mark.parametrize('k,m', SIZES)
def test_step_cost_all_gather_with_equal_stages_matches_the_closed_forms(k, m):
  f, b = 1.0, 2.5
  gpipe = S.step_cost(S.gpipe(k, m), [f] * k, [b] * k, exchange='all_gather')
  assert gpipe.time == pytest.approx((m + k - 1) * (f + b))  # F ticks, then B ticks
  assert gpipe.utilization == pytest.approx(m / (m + k - 1))  # the unit-time bubble's
  ofob = S.step_cost(S.one_f_one_b(k, m), [f] * k, [b] * k, exchange='all_gather')
  # 1F1B: the first K ticks only forward; from the first backward (tick K) to
  # the end every tick holds a backward, which the tick waits for.
  expected = m * (f + b) if k == 1 else k * f + (2 * m + k - 2) * b
  assert ofob.time == pytest.approx(expected)
  assert ofob.work == gpipe.work == pytest.approx(m * k * (f + b))
  if k > 1:  # same ticks (test above), but 1F1B's mixed ticks cost a backward
    assert ofob.time > gpipe.time


@pytest.mark.parametrize('k,m', SIZES)
@pytest.mark.parametrize('name', ['gpipe', '1f1b', '1f1b-fused'])
def test_step_cost_ppermute_never_waits_longer(name, k, m):
  """Waiting for the neighbours only: never later than for every stage, the
  same with at most two stages, and never shorter than the busiest stage."""
  rng = np.random.default_rng(k * 100 + m)
  table = S.make(name, k, m)
  for _ in range(5):
    forward, backward = rng.uniform(0.1, 1, k), rng.uniform(0.1, 3, k)
    near = S.step_cost(table, forward, backward, exchange='ppermute')
    every = S.step_cost(table, forward, backward, exchange='all_gather')
    assert near.time <= every.time + 1e-9
    if k <= 2:
      assert near.time == pytest.approx(every.time)
    assert near.time >= m * max(forward + backward) - 1e-9
    assert near.work == pytest.approx(every.work) == pytest.approx(m * sum(forward + backward))


def test_step_cost_refuses_wrong_cost_lists_and_exchanges():
  with pytest.raises(S.ScheduleError, match=r'one forward and one backward cost per stage '
                                            r'\(2\); got 1 and 2'):
    S.step_cost(S.gpipe(2, 2), [1.0], [1.0, 1.0])
  with pytest.raises(S.ScheduleError, match=r"unknown exchange 'nccl'; expected one of "
                                            r"\('ppermute', 'all_gather'\)"):
    S.step_cost(S.gpipe(2, 2), [1.0, 1.0], [1.0, 1.0], exchange='nccl')
