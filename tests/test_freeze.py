"""The freeze algorithm: Figure 4 curves and hand-computed Eq. 1 cases."""
import math

import numpy as np
import pytest

from pipejax import freeze


@pytest.mark.parametrize('alpha', [0.1, 0.2, 0.3, 0.5])
def test_schedule_policy_reproduces_figure_4(alpha):
  L = 24
  policy = freeze.FreezePolicy('schedule', L, alpha, min_active_layers=1)
  got = [0] + [policy.decide(None).result for _ in range(8)]
  # Figure 4's closed form, floor(L (1 − (1 − α)^T)); the policy iterates the bound.
  expected = [math.floor(L * (1 - (1 - alpha) ** t) + 1e-9) for t in range(9)]
  assert freeze.schedule_curve(L, alpha, 8) == expected
  # The cap keeps one layer trainable.
  assert got == [min(x, L - 1) for x in expected]
  # Worked by hand, floor(24 (1 − (1 − α)^T)) for T = 1..4, independent of
  # schedule_curve: e.g. α = 0.2: 4.8, 8.64, 11.69, 14.17.
  by_hand = {0.1: [2, 4, 6, 8],        # 2.4, 4.56, 6.50, 8.25
             0.2: [4, 8, 11, 14],
             0.3: [7, 12, 15, 18],     # 7.2, 12.24, 15.77, 18.24
             0.5: [12, 18, 21, 22]}    # 12, 18, 21, 22.5
  assert got[1:5] == by_hand[alpha]


def test_eq1_argmin_smaller_than_bound():
  policy = freeze.FreezePolicy('pipetransformer', 8, 0.5)
  # bound = 4; block 1 has the smallest norm → freeze blocks 0..1 → F = 2.
  d = policy.decide(np.array([5.0, 0.5, 3.0, 0.9, 2.0, 2.0, 2.0, 2.0]))
  assert (d.alpha_bound, d.bound, d.argmin, d.result) == (4.0, 2.0, 1, 2)
  # The log line names every input: the α bound compared, the argmin, the result.
  assert d.describe() == ('freeze T=1: F 0 -> 2 (α bound 4.00, argmin 1 (→2), '
                          'Eq. 1 bound 2.00)')
  # Next: bound = 2 + 0.5 * 6 = 5; norms of frozen blocks are ignored (block 0
  # has 0); among active blocks 2..7 the argmin is block 6 → 7, so bound wins.
  d = policy.decide(np.array([0.0, 0.0, 3.0, 1.0, 2.0, 2.0, 0.1, 2.0]))
  assert (d.argmin, d.alpha_bound, d.bound, d.result) == (6, 5.0, 5.0, 5)


def test_eq1_bound_smaller_and_cap_and_never_unfreeze():
  policy = freeze.FreezePolicy('pipetransformer', 4, 0.3, min_active_layers=2)
  d = policy.decide(np.array([3.0, 2.0, 1.0, 0.5]))  # bound 1.2 → 1; argmin 3 → 4
  assert (d.result, d.argmin) == (1, 3)
  d = policy.decide(np.array([9.0, 9.0, 9.0, 0.1]))  # bound 1.2 + 0.3*2.8 = 2.04 → 2
  assert d.result == 2
  for _ in range(5):  # capped at L - min_active = 2
    d = policy.decide(np.array([9.0, 0.0, 9.0, 0.1]))
    assert d.result == 2
    assert d.bound == 2.0  # the recorded bound is capped too (uncapped: 2.04 + 0.3·1.96 …)
  assert [h.result for h in policy.state.history] == [1, 2, 2, 2, 2, 2, 2]


def test_an_argmin_equal_to_the_alpha_count_keeps_the_real_valued_bound():
  # Eq. 1 takes the argmin's count only when it is *smaller*; on a tie the α
  # term's real-valued bound carries over to the next timestep.
  policy = freeze.FreezePolicy('pipetransformer', 8, 0.3)
  d = policy.decide(np.array([5.0, 0.1, 3, 3, 3, 3, 3, 3]))  # bound 2.4 → 2; argmin 1 → 2
  assert (d.result, d.argmin, d.bound) == (2, 1, pytest.approx(2.4))
  assert d.alpha_bound == pytest.approx(2.4)  # the real-valued α term, logged as it was
  d = policy.decide(np.array([0.0, 0.0, 3, 3, 3, 3, 3, 0.1]))  # 2.4 + 0.3·5.6 = 4.08 → 4
  assert (d.result, d.argmin, d.bound) == (4, 7, pytest.approx(4.08))
  assert d.alpha_bound == pytest.approx(4.08)


def test_tied_norms_freeze_up_to_the_first_smallest_block():
  """Eq. 1's argmin takes the first of equal norms (blocks whose gradient is
  exactly 0, say): the deepest would freeze more than the norms justify."""
  d = freeze.FreezePolicy('pipetransformer', 8, 0.5).decide(np.ones(8))
  assert (d.argmin, d.result) == (0, 1)
  d = freeze.FreezePolicy('pipetransformer', 8, 0.5).decide(np.array([2.0, 1, 3, 1, 1, 3, 3, 3]))
  assert (d.argmin, d.result) == (1, 2)


def test_a_resumed_policy_keeps_the_real_valued_bound():
  """A checkpoint's freeze state (JSON) restores the fractional α bound: a
  resumed run follows Fig. 4's curve as the uninterrupted run does (a bound
  restored as the integer F lags: L = 24, α = 0.2 gives 13 at T = 4, not 14)."""
  import json  # noqa: PLC0415
  for timesteps in range(1, 5):
    policy = freeze.FreezePolicy('schedule', 24, 0.2)
    for _ in range(timesteps):
      policy.decide(None)
    restored = freeze.FreezePolicy('schedule', 24, 0.2)
    restored.state = freeze.FreezeState.from_dict(json.loads(json.dumps(policy.state.to_dict())))
    assert restored.state.bound == pytest.approx(24 * (1 - 0.8 ** timesteps))
    got = [restored.decide(None).result for _ in range(7 - timesteps)]
    assert got == freeze.schedule_curve(24, 0.2, 7)[timesteps + 1:]
    assert got == [min(x, 23) for x in [math.floor(24 * (1 - 0.8 ** t) + 1e-9)
                                        for t in range(timesteps + 1, 8)]]


def test_argmin_at_first_active_layer_freezes_one_more():
  policy = freeze.FreezePolicy('pipetransformer', 6, 0.5)
  d = policy.decide(np.array([0.1, 1.0, 1.0, 1.0, 1.0, 1.0]))
  assert d.result == 1


def test_none_policy_and_state_round_trip():
  policy = freeze.FreezePolicy('none', 6, 0.5)
  assert policy.decide(None).result == 0
  p = freeze.FreezePolicy('pipetransformer', 6, 0.5)
  p.decide(np.arange(6.0)[::-1] + 1)
  restored = freeze.FreezeState.from_dict(p.state.to_dict())
  assert restored == p.state
  assert 'F 0 -> ' in p.state.history[0].describe()
  assert policy.state.history[0].alpha_bound is None  # no α term without a policy
  # A history saved before the α bound was recorded still loads.
  old = p.state.to_dict()
  for h in old['history']:
    del h['alpha_bound']
  assert freeze.FreezeState.from_dict(old).history[0].alpha_bound is None


@pytest.mark.parametrize('policy,alpha,match', [
    ('eq1', 0.5, "unknown freeze policy 'eq1'"),
    ('schedule', 1.0, r'alpha must be in \(0, 1\), got 1.0'),
    ('schedule', 0.0, r'alpha must be in \(0, 1\), got 0.0'),
])
def test_bad_config(policy, alpha, match):
  with pytest.raises(freeze.FreezeConfigError, match=match):
    freeze.FreezePolicy(policy, 12, alpha)


@pytest.mark.parametrize('min_active', [0, 13])
def test_min_active_layers_out_of_range_is_refused(min_active):
  """0 would let every block freeze (nothing left to train, no pipeline);
  more than L cannot be kept."""
  with pytest.raises(freeze.FreezeConfigError,
                     match=rf'^freeze.min_active_layers must be in \[1, 12\], got {min_active}$'):
    freeze.FreezePolicy('schedule', 12, 0.5, min_active_layers=min_active)


def test_eq1_needs_one_norm_per_block():
  policy = freeze.FreezePolicy('pipetransformer', 4, 0.5)
  with pytest.raises(ValueError, match='needs per-layer gradient norms'):
    policy.decide(None)
  with pytest.raises(ValueError, match='expected 4 layer norms, got 3'):
    policy.decide(np.ones(3))
  assert policy.state.num_frozen_layers == 0 and policy.state.timestep == 0  # nothing decided


def test_the_bound_and_the_settings_at_their_edges():
  """α·L that floating point puts a hair below an integer still freezes that
  many (0.58 · 50 = 28.999999999999996 → 29); every block may be kept
  trainable (min_active_layers = L: nothing ever freezes), not more."""
  assert freeze.FreezePolicy('schedule', 50, 0.58).decide(None).result == 29
  keep_all = freeze.FreezePolicy('schedule', 12, 0.5, min_active_layers=12)
  assert keep_all.decide(None).result == 0
  with pytest.raises(freeze.FreezeConfigError, match=r'min_active_layers must be in \[1, 12\]'):
    freeze.FreezePolicy('schedule', 12, 0.5, min_active_layers=13)
