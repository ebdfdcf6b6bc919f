"""AutoPipe: optimal balance, Eq. 2 compression, micro-batch profile, plan CLI."""
import itertools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import models
from pipejax import autopipe
from pipejax.partition import Partition, PartitionError
from tests import fixtures


def _brute_force(costs, k, offset=0.0):
  n, best = len(costs), None
  for cuts in itertools.combinations(range(1, n), k - 1):
    bounds = (0,) + cuts + (n,)
    sums = [sum(costs[a:b]) + (offset if i == 0 else 0) for i, (a, b) in
            enumerate(zip(bounds, bounds[1:]))]
    if best is None or max(sums) < best - 1e-9:
      best = max(sums)
  return best


@pytest.mark.parametrize('seed', range(6))
def test_balance_is_optimal(seed):
  rng = np.random.default_rng(seed)
  costs = list(rng.integers(1, 20, size=int(rng.integers(4, 11))).astype(float))
  for k in range(1, min(5, len(costs)) + 1):
    offset = float(rng.integers(0, 15))
    sizes = autopipe.balance(costs, k, offset)
    assert len(sizes) == k and min(sizes) >= 1 and sum(sizes) == len(costs)
    starts = np.cumsum((0,) + sizes)
    got = max(sum(costs[a:b]) + (offset if i == 0 else 0)
              for i, (a, b) in enumerate(zip(starts, starts[1:])))
    assert got == pytest.approx(_brute_force(costs, k, offset))


def _splits(n, k):
  for cuts in itertools.combinations(range(1, n), k - 1):
    bounds = (0,) + cuts + (n,)
    yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _stage_sums(costs, sizes, offset):
  starts = np.cumsum((0,) + tuple(sizes))
  return [sum(costs[a:b]) + (offset if i == 0 else 0)
          for i, (a, b) in enumerate(zip(starts, starts[1:]))]


def _width(blocks, sizes):
  starts = np.cumsum((0,) + tuple(sizes))
  return max(len({x for x in blocks[a:b] if x is not None}) for a, b in zip(starts, starts[1:]))


@pytest.mark.parametrize('seed', range(8))
def test_balance_takes_the_narrowest_of_the_optimal_splits(seed):
  """With the units' blocks given, the split is still optimal in its
  largest stage, and of all optimal splits (brute force) its widest stage
  touches the fewest blocks; without a narrower one it is the plain split."""
  rng = np.random.default_rng(100 + seed)
  layers = int(rng.integers(2, 6))
  frozen = int(rng.integers(0, layers))
  units = Partition(layers, frozen, (2 * (layers - frozen) + 1 + int(frozen == 0),)).active_units
  blocks = [(u - 1) // 2 if 1 <= u <= 2 * layers else None for u in units]
  costs = [float(rng.choice([1.0, 2.0, 3.0])) for _ in units]
  for k in range(1, min(6, len(costs)) + 1):
    offset = float(rng.integers(0, 8))
    plain = autopipe.balance(costs, k, offset)
    sizes = autopipe.balance(costs, k, offset, blocks=blocks)
    best = _brute_force(costs, k, offset)
    assert max(_stage_sums(costs, sizes, offset)) == pytest.approx(best)
    narrowest = min(_width(blocks, s) for s in _splits(len(costs), k)
                    if max(_stage_sums(costs, s, offset)) <= best + 1e-9)
    assert _width(blocks, sizes) == narrowest
    if _width(blocks, plain) == narrowest:
      assert sizes == plain


def test_the_default_model_s_stages_after_a_freeze_are_one_block_wide_where_balance_allows():
  """The embedded default (12 blocks, parameter costs, λ_frozen = 1/6),
  balanced around the frozen charge as Algorithm 1 does: at F = 6 the charge
  on stage 0 leaves the others room, and a split with the same largest stage
  puts every stage within one block (the plain split straddled blocks: two
  slots a stage); at F = 4 no such split exists."""
  attn, mlp = 16.6, 33.1
  costs = autopipe.UnitCosts(12, (12.0,) + (attn, mlp) * 12 + (0.6,))
  six = autopipe.partition_for(costs, 6, 8, 1 / 6, charge_first_stage=True)
  plain = autopipe.balance(costs.active(6), 8, costs.frozen(6) / 6)
  assert Partition(12, 6, plain).tables.num_slots == 2
  assert six.partition.tables.num_slots == 1
  assert six.memory_proxy == pytest.approx(
      max(_stage_sums(costs.active(6), plain, costs.frozen(6) / 6)))
  assert autopipe.partition_for(costs, 4, 8, 1 / 6,
                                charge_first_stage=True).partition.tables.num_slots == 2


@pytest.mark.parametrize('frozen', [2, 4, 6, 7, 8])
def test_a_run_s_partition_balances_the_active_units_alone(frozen):
  """The frozen prefix runs outside the pipeline, so the partition a run
  trains with balances the active units without the frozen charge (brute
  force), where Algorithm 1's, balanced around it, loads the other stages
  more; Eq. 2's proxy of either charges stage 0. compress decides K on the
  charged partitions and returns the run's partition at that K."""
  attn, mlp = 16.6, 33.1
  costs = autopipe.UnitCosts(12, (12.0,) + (attn, mlp) * 12 + (0.6,))
  active, charge = costs.active(frozen), costs.frozen(frozen) / 6
  run = autopipe.partition_for(costs, frozen, 8, 1 / 6)
  charged = autopipe.partition_for(costs, frozen, 8, 1 / 6, charge_first_stage=True)
  assert max(run.stage_costs) == pytest.approx(_brute_force(active, 8))
  assert charged.memory_proxy == pytest.approx(_brute_force(active, 8, charge))
  assert max(charged.stage_costs) >= max(run.stage_costs) - 1e-9
  if frozen == 4:  # here the charge moves units off stage 0 onto the largest stage
    assert max(charged.stage_costs) > max(run.stage_costs) + 10.0
  for plan in (run, charged):
    assert plan.memory_proxy == pytest.approx(max(_stage_sums(
        active, plan.partition.stage_sizes, charge)))
  reference = _brute_force(costs.active(0), 8)
  for lam in (0.0, 0.1, 1 / 6, 1.0):
    k = 8
    while k > len(active):
      k //= 2
    while k > 1 and _brute_force(active, k // 2, lam * costs.frozen(frozen)) <= reference:
      k //= 2
    got = autopipe.compress(costs, frozen, 8, 8, lam)
    assert got.partition == autopipe.partition_for(costs, frozen, k, lam).partition


def test_a_run_s_split_mlp_is_balanced_without_the_frozen_charge():
  """6 blocks of (attention 2, MLP 4 in halves of 2), F = 1 and λ = 1 (a
  charge of 7 on stage 0), 4 stages: without the charge the pieces balance
  at 8 against 10 whole (bisection), so the run splits an MLP; balanced
  around the charge, or judged with it, the split would not be this one."""
  costs = autopipe.UnitCosts(6, (1.0,) + (2.0, 4.0) * 6 + (1.0,), (2.0,) * 6,
                             ('intermediate',), autopipe.SPLIT_MLP_MIN_GAIN)
  run = autopipe.partition_for(costs, 1, 4, 1.0)
  assert run.partition.split_mlp
  assert max(run.stage_costs) == _min_max_by_bisection([2.0] * 15 + [1.0], 4) == 8.0
  assert _min_max_by_bisection([2.0, 4.0] * 5 + [1.0], 4) == 10.0


def _uniform(num_layers, embed=1.0, sub=2.0, head=1.0):
  return autopipe.UnitCosts(num_layers, (embed,) + (sub,) * (2 * num_layers) + (head,))


def test_compression_follows_eq2():
  costs = _uniform(8)  # 18 units: embed 1, 16 sub-layers of 2, head 1
  # T=0 at K=8: 34 over 8 stages; best max is 5 (1+2+2, 2+2 ×6, 2+2+1).
  assert autopipe.partition_for(costs, 0, 8, 1 / 6).memory_proxy == pytest.approx(5.0)
  # Freezing 2 blocks: 12 sub-layers + head = 25 (+ 1.5) over 4 stages ≥ 6.6 > 5: stay.
  assert autopipe.compress(costs, 2, 8, 8, 1 / 6).partition.pipeline_length == 8
  # Freezing 5 with λ=0.05: S_frozen = 1 + 5·4 = 21, stage 0 pays 1.05.
  # 6 sub-layers + head over 4 stages: 1.05+2 | 2+2 | 2+2 | 2+1 → max 4 ≤ 5 → K=4;
  # over 2 stages ≥ 7 > 5 → stop.
  plan = autopipe.compress(costs, 5, 8, 8, 0.05)
  assert plan.partition.pipeline_length == 4
  assert autopipe.eq2_proxy(costs, 5, 4, 0.05) == pytest.approx(4.0)
  assert plan.frozen_cost == pytest.approx(21.0)
  # The run's partition at K = 4 balances the 7 active units (cost 13) alone (max 4 as
  # well; its first stage takes 2+2, so its own Eq. 2 proxy is 5.05).
  assert max(plan.stage_costs) == pytest.approx(4.0)
  assert plan.memory_proxy == pytest.approx(5.05)
  # With λ=1 and 4 frozen blocks, stage 0 carries 17: no compression.
  assert autopipe.compress(costs, 4, 8, 8, 1.0).partition.pipeline_length == 8
  # More stages than active units forces halving, whatever the memory: 5 frozen
  # blocks leave 7 units (→ K=4), 7 frozen leave 3 (→ K=2).
  assert autopipe.compress(costs, 5, 8, 8, 1.0).partition.pipeline_length == 4
  assert autopipe.compress(costs, 7, 8, 8, 1.0).partition.pipeline_length == 2
  # Never grows.
  assert autopipe.compress(costs, 5, 2, 8, 0.05).partition.pipeline_length == 2
  # An odd length halved for want of units may not divide the devices: 7 frozen
  # leave 3 units, and on 5 devices K = 5 → 2 becomes 1, the largest length
  # that divides 5. (6 frozen leave 5 units: K = 6 → 3 divides 6 devices.)
  assert autopipe.compress(costs, 7, 5, 5, 1.0).partition.pipeline_length == 2
  assert autopipe.compress(costs, 7, 5, 5, 1.0, num_devices=5).partition.pipeline_length == 1
  assert autopipe.compress(costs, 6, 6, 6, 1.0, num_devices=6).partition.pipeline_length == 3
  # A candidate *equal* to the T=0 proxy is within it (Eq. 2's ≤): 4 frozen blocks
  # with λ=0: 8 sub-layers + head over 4 stages, 2+2 | 2+2 | 2+2 | 2+2+1 → max 5 = 5,
  # K=4; over 2 stages ≥ 8.5 → stop.
  plan = autopipe.compress(costs, 4, 8, 8, 0.0)
  assert (plan.partition.pipeline_length, plan.memory_proxy) == (4, pytest.approx(5.0))
  # And down to one stage: 7 frozen leave 2 sub-layers + head = 5 ≤ 5 → K=1.
  plan = autopipe.compress(costs, 7, 8, 8, 0.0)
  assert (plan.partition.pipeline_length, plan.memory_proxy) == (1, pytest.approx(5.0))


@pytest.mark.parametrize('initial, devices, expected', [
    (8, 8, [8, 4, 2, 1]), (4, 8, [4, 2, 1]), (5, 10, [5, 2, 1]), (6, 12, [6, 3, 1]),
    (5, 5, [5, 1]), (1, 8, [1])])
def test_reachable_lengths_hold_every_length_compression_reaches(initial, devices, expected):
  assert autopipe.reachable_lengths(initial, devices) == expected
  # Against compress itself: every run of freeze events (F rising, any λ)
  # from the initial length on these devices.
  costs, reached, seen = _uniform(8), set(), set()

  def follow(k, frozen):
    if (k, frozen) in seen:
      return
    seen.add((k, frozen))
    reached.add(k)
    for more in range(frozen + 1, 8):
      for lam in (0.0, 1 / 6, 1.0):
        follow(autopipe.compress(costs, more, k, initial, lam,
                                 num_devices=devices).partition.pipeline_length, more)

  follow(initial, 0)
  assert reached <= set(expected) and max(reached) == initial


def test_a_batch_that_a_later_plan_cannot_split_is_named():
  from pipejax import autodp
  from pipejax.pipeline import PlanError
  autodp.check_frozen_batches(16, 'constant', 8, [8, 4, 2, 1])
  autodp.check_frozen_batches(12, 'constant', 8, [4, 2, 1], autodp=False)  # R = 1: K | 12
  with pytest.raises(PlanError, match=r'^train.batch_size=12 gives a global batch of 12 at '
                     r'pipeline length 8 \(R = 1\), which its 8 devices'):
    autodp.check_frozen_batches(12, 'constant', 8, [8, 4], autodp=False)
  # per_pipeline, K = 5 on 10 devices: 5 a pipeline suits K = 5, but K = 2
  # gives 5 replicas x 5 = 25 samples over 10 devices.
  autodp.check_frozen_batches(10, 'per_pipeline', 10, [5, 2, 1])
  with pytest.raises(PlanError, match=r'^train.batch_size=5 gives a global batch of 25 at '
                     r'pipeline length 2 \(R = 5\), which its 10 devices cannot split: .* '
                     r'a multiple of 10$'):
    autodp.check_frozen_batches(5, 'per_pipeline', 10, [5, 2, 1])


def test_partition_has_active_units_only():
  costs = _uniform(4)
  plan = autopipe.partition_for(costs, 2, 2, 1 / 6)
  assert plan.partition.active_units == (5, 6, 7, 8, 9)
  assert sum(plan.stage_costs) == pytest.approx(4 * 2.0 + 1.0)
  # One stage: it holds every active unit, its proxy charged λ · S_frozen (the
  # embedding and 2 blocks: 1 + 4 × 2).
  one = autopipe.partition_for(costs, 2, 1, 1 / 6)
  assert one.stage_costs == (9.0,) and one.memory_proxy == pytest.approx(9.0 + 9.0 / 6)
  with pytest.raises(PartitionError):
    autopipe.balance([1.0, 2.0], 3)


def test_micro_batch_candidates():
  assert autopipe.micro_batch_candidates(4, 32) == [4, 8, 16]
  assert autopipe.micro_batch_candidates(1, 8) == [1, 2, 4]
  # Up to 6K, inclusive.
  assert autopipe.micro_batch_candidates(1, 6) == [1, 2, 3, 6]
  assert autopipe.micro_batch_candidates(2, 12) == [2, 4, 6, 12]
  assert autopipe.micro_batch_candidates(2, 14) == [2]  # 14 > 6K: not a candidate
  # No multiple of K divides: divisors between K and 6K, else the largest below K.
  assert autopipe.micro_batch_candidates(8, 12) == [12]
  assert autopipe.micro_batch_candidates(8, 60) == [10, 12, 15, 20, 30]
  for k, batch in ((4, 0), (0, 8)):
    with pytest.raises(ValueError, match='both must be >= 1'):
      autopipe.micro_batch_candidates(k, batch)
  assert autopipe.micro_batch_candidates(8, 4) == [4]
  assert autopipe.micro_batch_candidates(4, 7) == [7]
  assert autopipe.micro_batch_candidates(8, 7) == [7]
  assert autopipe.micro_batch_candidates(4, 3) == [3]


def test_micro_batch_profile_is_remembered_across_runs(tmp_path):
  path = str(tmp_path / 'profile.json')
  calls = []

  def measure(m):
    calls.append(m)
    return {4: 0.3, 8: 0.1, 16: 0.2}[m]

  profile = autopipe.MicroBatchProfile(path, {'model': 'x'})
  assert profile.choose(4, [4, 8, 16], measure)[0] == 8
  assert calls == [4, 8, 16]
  again = autopipe.MicroBatchProfile(path, {'model': 'x'})
  assert again.choose(4, [4, 8, 16], measure)[0] == 8
  assert calls == [4, 8, 16]  # not measured again
  other = autopipe.MicroBatchProfile(path, {'model': 'y'})
  assert other.get(4) is None
  with open(path, 'w') as f:
    f.write('{corrupt')
  with pytest.warns(UserWarning, match=r'cannot read the micro-batch profile .*moved to '
                                       r'.*profile\.json\.corrupt'):
    reopened = autopipe.MicroBatchProfile(path, {'model': 'x'})
  assert reopened.get(4) is None
  reopened.choose(4, [4, 8], measure)
  # The damaged file is kept aside, never overwritten, a second one beside it.
  assert open(path + '.corrupt').read() == '{corrupt'
  assert autopipe.MicroBatchProfile(path, {'model': 'x'}).get(4) == 8
  with open(path, 'w') as f:
    f.write('')  # empty: a profile's write cut short too
  with pytest.warns(UserWarning, match=r'profile\.json\.corrupt\.2'):
    autopipe.MicroBatchProfile(path, {'model': 'x'})
  assert open(path + '.corrupt').read() == '{corrupt'
  assert open(path + '.corrupt.2').read() == ''


def test_a_json_file_that_is_no_profile_is_left_as_it_is(tmp_path):
  """``pipeline.profile_path`` pointed at another JSON file by mistake (a
  run's summary): never merged into, moved or rewritten; the choices stay in
  memory, said once, in one line."""
  path = tmp_path / 'summary.json'
  path.write_text(json.dumps({'final_eval_accuracy': 0.97, 'epochs': 10}))
  before = path.read_bytes()
  lines = []
  profile = autopipe.MicroBatchProfile(str(path), {'model': 'x'}, {'devices': 8},
                                       log=lines.append)
  assert profile.choose(4, [4, 8], {4: 0.2, 8: 0.1}.get)[0] == 8
  assert profile.get(4) == 8
  assert lines == [f"{path} is not a micro-batch profile (its key 'final_eval_accuracy' is no "
                   f"configuration digest and holds float); it is left as it is; the "
                   f"micro-batch counts are kept for this run only"]
  assert path.read_bytes() == before
  assert sorted(os.listdir(tmp_path)) == ['summary.json', 'summary.json.lock']
  # An object of objects is no profile either, unless its keys are digests.
  config = tmp_path / 'tsconfig.json'
  config.write_text(json.dumps({'compilerOptions': {'target': 'es5'}}))
  before = config.read_bytes()
  lines.clear()
  kept = autopipe.MicroBatchProfile(str(config), {'model': 'x'}, log=lines.append)
  assert kept.choose(4, [4, 8], {4: 0.2, 8: 0.1}.get)[0] == 8
  assert lines == [f"{config} is not a micro-batch profile (its key 'compilerOptions' is no "
                   f"configuration digest and holds no micro-batch record); it is left as it "
                   f"is; the micro-batch counts are kept for this run only"]
  assert config.read_bytes() == before
  # Nor is a file that does not start as a JSON object does (notes, a JSON
  # array, a binary file), nor JSON lines, such as another run's metrics.jsonl
  # (they were moved away as a damaged profile, and that run's rows with them).
  not_an_object = 'it does not start as a JSON object does'
  rows = ''.join(json.dumps({'epoch': e, 'train_loss': 1.0 / (e + 1)}) + '\n' for e in range(3))
  for name, content, why in (
      ('notes.txt', b'my notes\n', not_an_object), ('list.json', b' [1, 2]', not_an_object),
      ('image.png', b'\x89PNG\r\n\x1a\n\x00', not_an_object),
      ('metrics.jsonl', rows.encode(), 'more follows its first JSON object: JSON lines?')):
    other = tmp_path / name
    other.write_bytes(content)
    lines.clear()
    kept = autopipe.MicroBatchProfile(str(other), {'model': 'x'}, log=lines.append)
    assert kept.choose(4, [4, 8], {4: 0.2, 8: 0.1}.get)[0] == 8
    assert lines == [f'{other} is not a micro-batch profile ({why}); it is left as it is; the '
                     f'micro-batch counts are kept for this run only'], name
    assert other.read_bytes() == content and not os.path.exists(f'{other}.corrupt')
  # A damaged profile is set aside and written anew, said in one line too.
  damaged = tmp_path / 'profile.json'
  damaged.write_text('{corrupt')
  lines.clear()
  autopipe.MicroBatchProfile(str(damaged), {'model': 'x'}, log=lines.append).choose(
      4, [4, 8], {4: 0.2, 8: 0.1}.get)
  assert len(lines) == 1 and '\n' not in lines[0] and 'moved to' in lines[0], lines
  assert (tmp_path / 'profile.json.corrupt').read_text() == '{corrupt'
  assert autopipe.MicroBatchProfile(str(damaged), {'model': 'x'}).get(4) == 8
  # One damaged record of a profile: that configuration profiles again, and
  # the file stays the profile it is (written back with the new choice).
  data = json.loads(damaged.read_text())
  key = next(k for k in data if k != autopipe.ABOUT)
  damaged.write_text(json.dumps({**data, key: 7}))
  lines.clear()
  again = autopipe.MicroBatchProfile(str(damaged), {'model': 'x'}, log=lines.append)
  assert again.get(4) is None and lines == []
  again.choose(4, [4, 8], {4: 0.1, 8: 0.2}.get)
  assert autopipe.MicroBatchProfile(str(damaged), {'model': 'x'}).get(4) == 4


def test_a_profile_path_under_home_is_the_users_home_not_a_folder_named_tilde(
    tmp_path, monkeypatch):
  # The default pipeline.profile_path starts with '~'; a Trainer built without
  # the CLI (the benchmarks do) used to create ./~/.cache/pipejax/ in the cwd.
  home, cwd = tmp_path / 'home', tmp_path / 'cwd'
  cwd.mkdir()
  monkeypatch.setenv('HOME', str(home))
  monkeypatch.chdir(cwd)
  profile = autopipe.MicroBatchProfile('~/.cache/pipejax/profile.json', {'model': 'x'})
  profile.choose(4, [4, 8], {4: 0.2, 8: 0.1}.get)
  assert json.load(open(home / '.cache/pipejax/profile.json'))
  assert list(cwd.iterdir()) == []


def test_concurrent_writers_of_one_profile_keep_every_record(tmp_path):
  """Runs of other configurations share the file: no record is lost to a
  concurrent read-merge-write, no temporary file is left."""
  import concurrent.futures  # noqa: PLC0415
  path = str(tmp_path / 'profile.json')

  def write(i):
    autopipe.MicroBatchProfile(path, {'model': i}).choose(
        4, [4, 8], lambda m: float(m if i % 2 else -m))

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(write, range(24)))
  for i in range(24):
    assert autopipe.MicroBatchProfile(path, {'model': i}).get(4) == (4 if i % 2 else 8)
  assert sorted(os.listdir(tmp_path)) == ['profile.json', 'profile.json.lock']


def test_a_profile_is_read_and_written_where_no_lock_can_be_taken(tmp_path):
  path = str(tmp_path / 'profile.json')
  autopipe.MicroBatchProfile(path, {'model': 'x'}).choose(4, [4, 8], float)
  os.remove(path + '.lock')
  os.mkdir(path + '.lock')  # open() of the lock file fails, as in a read-only directory
  assert autopipe.MicroBatchProfile(path, {'model': 'x'}).get(4) == 4
  autopipe.MicroBatchProfile(path, {'model': 'y'}).choose(2, [2, 4], lambda m: -m)
  assert autopipe.MicroBatchProfile(path, {'model': 'y'}).get(2) == 4
  assert autopipe.MicroBatchProfile(path, {'model': 'x'}).get(4) == 4


def _min_max_by_bisection(pieces, stages):
  """The least largest-stage sum of a contiguous split of ``pieces`` into
  ``stages`` stages: the smallest contiguous sum with which greedy packing
  needs no more stages (independent of AutoPipe's dynamic programme)."""
  prefix = np.concatenate([[0], np.cumsum(pieces)])
  candidates = sorted({int(prefix[j] - prefix[i]) for i in range(len(pieces))
                       for j in range(i + 1, len(pieces) + 1)})

  def fits(limit):
    used, load = 1, 0
    for x in pieces:
      if x > limit:
        return False
      if load + x > limit:
        used, load = used + 1, 0
      load += x
    return used <= stages

  lo, hi = 0, len(candidates) - 1
  while lo < hi:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if fits(candidates[mid]) else (mid + 1, hi)
  return candidates[lo]


def _plan_main(capsys, *args) -> dict:
  """``python -m pipejax.plan --model vit-b16 --devices 8 *args`` in this
  process (the test below runs the real command once): its JSON."""
  from pipejax import plan as plan_lib  # noqa: PLC0415
  capsys.readouterr()
  assert plan_lib.main(['--model', 'vit-b16', '--devices', '8', *args]) == 0
  return json.loads(capsys.readouterr().out)


def test_plan_cli_vit_b16(capsys):
  out = subprocess.run([sys.executable, '-m', 'pipejax.plan', '--model', 'vit-b16',
                        '--devices', '8', '--frozen-layers', '0'],
                       capture_output=True, text=True, check=True)
  plan = json.loads(out.stdout)
  assert plan['pipeline_length'] == 8 and plan['replicas'] == 1
  # One MLP is split between two stages: its first half ends stage 6, its
  # second half starts stage 7.
  assert plan['split_mlp'] == [6]
  assert plan['stages'][6]['sublayers'][-1] == 'mlp.10.in'
  assert plan['stages'][7]['sublayers'][0] == 'mlp.10.out'
  names = [n for s in plan['stages'] for n in s['sublayers']]
  units = [f'{k}.{i}' for i in range(12) for k in ('attn', 'mlp')]
  cut = units.index('mlp.10')
  assert names == ['embed'] + units[:cut] + ['mlp.10.in', 'mlp.10.out'] + units[cut + 1:] + [
      'head']
  total = sum(s['parameters'] for s in plan['stages'])
  assert total == pytest.approx(86.6e6, rel=0.01)  # ViT-B/16 with a 1000-class head
  # The issue's bound: no stage over 12.0M (the authors' code reached 14.2M).
  assert plan['max_stage_parameters'] <= 12_000_000
  # The optimum, independently: ViT-B/16's units counted by hand, each MLP
  # in its two halves (LN + first dense layer; second dense layer).
  d = 768
  embed = d * 3 * 16 * 16 + d + d + 197 * d                      # patches, cls, positions
  attn = 4 * (d * d + d) + 2 * d
  mlp_in, mlp_out = 2 * d + d * 3072 + 3072, 3072 * d + d
  head = 2 * d + d * 1000 + 1000                                  # final LN, classifier
  pieces = [embed] + [attn, mlp_in, mlp_out] * 12 + [head]
  assert sum(pieces) == total
  assert plan['max_stage_parameters'] == _min_max_by_bisection(pieces, 8) == 11_815_680
  # Whole sub-layers only (--split-mlp-min-gain 1): every split of the units
  # into 8 contiguous stages; none reaches 12.0M.
  whole = _plan_main(capsys, '--split-mlp-min-gain', '1')
  assert whole['split_mlp'] == []
  units = [embed] + [attn, mlp_in + mlp_out] * 12 + [head]
  prefix = np.concatenate([[0], np.cumsum(units)])
  cuts = np.array(list(itertools.combinations(range(1, len(units)), 7)))  # 480,700 splits
  bounds = np.concatenate([np.zeros((len(cuts), 1), int), cuts,
                           np.full((len(cuts), 1), len(units))], axis=1)
  best = int(np.diff(prefix[bounds], axis=1).max(axis=1).min())
  assert whole['max_stage_parameters'] == best == _min_max_by_bisection(units, 8) == 12_582_376
  # A gain threshold above what the split brings (6.1 %) keeps whole sub-layers.
  assert _plan_main(capsys, '--split-mlp-min-gain', '0.07')['max_stage_parameters'] == 12_582_376
  assert len(plan['estimated_memory_per_stage']) == 8
  # A device holds its layout (its own stage inside it) and the frozen prefix.
  from pipejax import plan as plan_lib  # noqa: PLC0415
  for f in (0, 6):
    for m in plan_lib.build_plan('vit-b16', 8, f)['estimated_memory_per_stage']:
      assert m['trainable_parameter_bytes'] <= m['stage_layout_bytes']
      assert m['total_bytes'] == m['stage_layout_bytes'] + m['frozen_prefix_bytes']
      assert (m['frozen_prefix_bytes'] == 0) == (f == 0)
  def frozen(layers, *gain):
    return _plan_main(capsys, '--frozen-layers', str(layers), *gain)

  # Eq. 2 compresses against the whole-sub-layer largest stage at T = 0
  # (12.58M), not the split one (11.82M): a split does not change what a
  # device stores. With 8 blocks frozen, K = 4's proxy is 11.94M (its first
  # stage carries λ·S_frozen = 9.57M): within 12.58M, so K = 4 either way.
  for gain in ((), ('--split-mlp-min-gain', '1')):
    eight = frozen(8, *gain)
    assert eight['pipeline_length'] == 4 and eight['memory_proxy_eq2'] == 11_938_176
  assert frozen(9)['pipeline_length'] == 4  # 7 active units: K = 8 cannot run
  assert plan_lib.main(['--model', 'vit-x', '--devices', '8']) == 2
  assert "unknown model 'vit-x'" in capsys.readouterr().err
  assert plan_lib.PRESETS == tuple(sorted(models.PRESETS))  # what --help lists
  with pytest.raises(ValueError, match='--devices must be >= 1, got 0'):
    plan_lib.build_plan('vit-b16', 0, 0)
  with pytest.raises(ValueError, match='--initial-pipeline-length must be >= 1, got 0'):
    plan_lib.build_plan('vit-b16', 8, 0, initial_pipeline_length=0)
  for value in (-1.0, float('nan'), 2.0):
    with pytest.raises(ValueError, match=r'--lambda-frozen must be in \[0, 1\]'):
      plan_lib.build_plan('vit-b16', 8, 0, lambda_frozen=value)
  with pytest.raises(ValueError, match='--batch-size must be >= 1, got -4'):
    plan_lib.build_plan('vit-b16', 8, 0, batch_size=-4)
  # Without a profile, M is the smallest that training would try for the
  # batch: never more micro-batches than each replica's samples.
  for devices, frozen, batch, k, m in ((8, 0, 64, 8, 8), (8, 0, 4, 8, 4), (8, 0, 12, 8, 12),
                                       (8, 11, 24, 2, 2), (8, 11, 4, 2, 1)):
    plan = plan_lib.build_plan('vit-b16', devices, frozen, batch_size=batch)
    assert (plan['pipeline_length'], plan['micro_batches']) == (k, m), (batch, plan)
    assert (batch // plan['replicas']) % m == 0
    assert plan['micro_batches_source'].startswith('default (K;' if m == k else
                                                   'default (the smallest M that splits')
  with pytest.raises(ValueError, match=r'^--batch-size 6 does not split over the 4 replicas of '
                                       r'this plan \(K=2 on 8 devices; with batch_mode '
                                       r'constant it is the global batch\)$'):
    plan_lib.build_plan('vit-b16', 8, 11, batch_size=6)
  # per_pipeline: the batch is each pipeline's, whatever R is.
  for frozen, batch, m in ((11, 6, 2), (11, 3, 3), (0, 4, 4)):
    plan = plan_lib.build_plan('vit-b16', 8, frozen, batch_size=batch, batch_mode='per_pipeline')
    assert plan['micro_batches'] == m, (frozen, batch, plan)
  with pytest.raises(ValueError, match=r"--batch-mode must be one of \['constant', "
                                       r"'per_pipeline'\], got 'global'"):
    plan_lib.build_plan('vit-b16', 8, 0, batch_size=8, batch_mode='global')
  for value in (-0.1, float('nan'), 1.5):
    with pytest.raises(ValueError, match=r'--split-mlp-min-gain must be in \[0, 1\]'):
      plan_lib.build_plan('vit-b16', 8, 0, split_mlp_min_gain=value)
  with pytest.raises(ValueError, match=r'a pipeline of 64 stages needs as many units; vit-b16 has '
                                       r'26 .*--initial-pipeline-length 16 or less'):
    plan_lib.build_plan('vit-b16', 64, 0)
  assert plan_lib.build_plan('vit-b16', 64, 0, initial_pipeline_length=16)['replicas'] == 4
  # 5 devices, 11 of 12 blocks frozen: 3 active units halve K = 5 to 2, which does
  # not divide 5 devices; the trainer then runs K = 1 on 5 replicas, and so
  # does the plan (not K = 2 on 2 replicas, one device idle).
  odd = plan_lib.build_plan('vit-b16', 5, 11)
  assert (odd['pipeline_length'], odd['replicas']) == (1, 5)


def _plan_cli(*args):
  return subprocess.run([sys.executable, '-m', 'pipejax.plan', '--model', 'vit-b16',
                         '--devices', '8', *args], capture_output=True, text=True)


def test_the_plan_reads_the_micro_batch_choice_that_a_training_run_profiled(tmp_path):
  """``pipejax.plan --profile``: the M that a run of the same model on as many
  devices chose (the trainer's record, with its ``about``), not another
  model's, another device count's or a record without a description."""
  path = str(tmp_path / 'profile.json')
  vit_b16 = models.config_for('vit', **models.PRESETS['vit-b16'][1])
  bert = models.config_for('bert-classification', **models.PRESETS['bert-base'][1])

  def about(hf_config, devices, batch):
    return autopipe.profile_about(hf_config, devices=devices, batch=batch, batch_mode='global',
                                  platform='cpu', schedule='1f1b', exchange='all_gather')

  def remember(hf_config, key, devices, batch, k, m):
    profile = autopipe.MicroBatchProfile(path, {'run': key}, about(hf_config, devices, batch))
    assert profile.choose(k, [k, m], lambda x: 1.0 / x)[0] == m  # the larger M is faster

  remember(bert, 'bert', 8, 64, 8, 24)         # another model
  remember(vit_b16, 'vit on 16', 16, 64, 8, 32)  # another device count
  remember(vit_b16, 'vit', 8, 64, 8, 16)
  with open(path) as f:
    data = json.load(f)
  data['written-before-about'] = {'8': {'micro_batches': 40, 'seconds': {}}}
  with open(path, 'w') as f:
    json.dump(data, f)
  plan = json.loads(_plan_cli('--profile', path).stdout)
  assert plan['micro_batches'] == 16 and plan['micro_batches_source'].startswith('profile ')
  # No choice for K = 4 (an initial pipeline of 4): K itself, saying why.
  plan = json.loads(_plan_cli('--profile', path, '--initial-pipeline-length', '4').stdout)
  assert plan['micro_batches'] == 4 and plan['micro_batches_source'].endswith(
      'no described choice for K=4 of vit-b16 on 8 devices: its matching runs chose M for '
      'K in [8] only)')
  # A described run without choices (a file edited by hand): K, saying so.
  fresh = str(tmp_path / 'fresh.json')
  with open(fresh, 'w') as f:
    json.dump({'k': {}, autopipe.ABOUT: {'k': about(vit_b16, 8, 64)}}, f)
  assert json.loads(_plan_cli('--profile', fresh).stdout)['micro_batches_source'].endswith(
      'its matching runs have chosen no M yet)')
  # No run of this device count: K, naming how the closest run differs.
  out = subprocess.run([sys.executable, '-m', 'pipejax.plan', '--model', 'vit-b16',
                        '--devices', '2', '--profile', path], capture_output=True, text=True,
                       check=True)
  source = json.loads(out.stdout)['micro_batches_source']
  assert 'the closest of its 3 described runs differs in devices ' in source
  assert source.endswith(' (not 2))') and 'model_type' not in source
  assert autopipe.profile_differences(
      about(bert, 8, 64), {'model_type': 'vit', 'hidden_size': 768}, 4, 64) == [
          "model_type 'bert' (not 'vit')", 'devices 8 (not 4)']
  # A profile without descriptions yet (written before them): K, not an error.
  undescribed = str(tmp_path / 'old.json')
  with open(undescribed, 'w') as f:
    json.dump({'abc': {'8': {'micro_batches': 16, 'seconds': {}}}}, f)
  out = _plan_cli('--profile', undescribed)
  assert out.returncode == 0 and json.loads(out.stdout)['micro_batches'] == 8
  assert 'no run is described yet' in json.loads(out.stdout)['micro_batches_source']
  # A run recorded before runs noted pipeline.autodp (its M may be an R = 1
  # run's): not used, and said so.
  old_about = {k: v for k, v in about(vit_b16, 8, 64).items() if k != 'autodp'}
  pre_autodp = str(tmp_path / 'pre-autodp.json')
  with open(pre_autodp, 'w') as f:
    json.dump({'k': {'8': {'micro_batches': 40, 'seconds': {}}},
               autopipe.ABOUT: {'k': old_about}}, f)
  plan = json.loads(_plan_cli('--profile', pre_autodp).stdout)
  assert plan['micro_batches'] == 8 and plan['micro_batches_source'].endswith(
      'its one described run differs in autodp not recorded (a run from before runs noted it))')
  # Two runs of the model that chose differently: train.batch_size decides.
  remember(vit_b16, 'vit, batch 128', 8, 128, 8, 24)
  out = _plan_cli('--profile', path)
  assert out.returncode == 2 and out.stderr.count('\n') == 1
  assert ("chose different M for K=8 (they differ in: batch ['128', '64']); pass --batch-size"
          in out.stderr)
  assert json.loads(_plan_cli('--profile', path, '--batch-size', '128').stdout)[
      'micro_batches'] == 24
  # A per_pipeline run's batch (6 a pipeline at K = 2, R = 4) need not split
  # over the replicas: its remembered M is read, not refused.
  remember(vit_b16, 'vit, per pipeline', 8, 6, 2, 6)
  from pipejax import plan as plan_lib  # noqa: PLC0415
  assert plan_lib.build_plan('vit-b16', 8, 0, initial_pipeline_length=2, batch_size=6,
                             profile=path)['micro_batches'] == 6
  with open(path, 'w') as f:
    f.write('{corrupt')
  out = _plan_cli('--profile', path)
  assert out.returncode == 2 and 'cannot read the micro-batch profile' in out.stderr
  assert 'Traceback' not in out.stderr


def test_a_profile_written_before_records_had_a_description_is_still_used(tmp_path):
  """Choices keep their old shape (``{K: {...}}`` under the key's hash, which
  older pipejax versions read); a description is added under "about" as soon
  as a run that knows it opens the file, and files that are not profiles are
  re-measured, never trusted or fatal."""
  path = str(tmp_path / 'profile.json')
  key = {'model': 'x'}
  digest = autopipe.MicroBatchProfile(None, key).key
  old = {'8': {'micro_batches': 16, 'seconds': {}}}
  with open(path, 'w') as f:
    json.dump({digest: old, 'other': {'2': {'micro_batches': 4, 'seconds': {}}}}, f)
  profile = autopipe.MicroBatchProfile(path, key, {'devices': 8})
  assert profile.get(8) == 16
  with open(path) as f:
    data = json.load(f)
  assert data == {digest: old, 'other': {'2': {'micro_batches': 4, 'seconds': {}}},
                  'about': {digest: {'devices': 8}}}
  assert profile.choose(4, [4, 8], lambda m: 1.0 / m)[0] == 8
  with open(path) as f:
    assert json.load(f)[digest] == {
        '8': {'micro_batches': 16, 'seconds': {}},
        '4': {'micro_batches': 8, 'seconds': {'4': 0.25, '8': 0.125}}}
  # A damaged record: measured again and saved.
  with open(path, 'w') as f:
    f.write('{"%s": {"8": {"micro_batches": "16"}}}' % digest)
  profile = autopipe.MicroBatchProfile(path, key, {'devices': 8})
  assert profile.get(8) is None
  assert profile.choose(8, [8, 16], lambda m: 1.0 / m)[0] == 16
  with open(path) as f:
    assert json.load(f)[digest]['8']['micro_batches'] == 16
  # JSON that is no object is no profile: measured for this run, the file left as it is.
  for content in ('null', '[1]', '"x"'):
    with open(path, 'w') as f:
      f.write(content)
    with pytest.warns(UserWarning, match='is not a micro-batch profile'):
      profile = autopipe.MicroBatchProfile(path, key, {'devices': 8})
    assert profile.get(8) is None
    assert profile.choose(8, [8, 16], lambda m: 1.0 / m)[0] == 16
    with open(path) as f:
      assert f.read() == content


def test_partition_rejects_bad_frozen_count():
  with pytest.raises(PartitionError, match='frozen layers must be in'):
    Partition(4, 4, (3,))


def test_a_split_mlp_is_taken_when_it_lowers_the_largest_stage_enough():
  """With ``split_mlp_min_gain`` g, the partition over MLP halves is taken
  when its largest stage is at most (1 − g) × the whole-sub-layer optimum;
  both optima checked independently (bisection with greedy packing)."""
  created = fixtures.tiny('vit', num_layers=4)
  params, keys = created.params, created.model.mlp_in_keys
  whole = autopipe.parameter_costs(params)
  size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
  mlp_in = size({k: params['mlp'][k] for k in keys}) // 4
  mlp_out = size(params['mlp']) // 4 - mlp_in
  attn = size(params['attention']) // 4
  pieces = [size(params['embed'])] + [attn, mlp_in, mlp_out] * 4 + [size(params['head'])]
  units = [size(params['embed'])] + [attn, mlp_in + mlp_out] * 4 + [size(params['head'])]
  for k in (2, 4, 8):
    plain = autopipe.partition_for(whole, 0, k, 1 / 6)
    assert plain.memory_proxy == _min_max_by_bisection(units, k)
    best = _min_max_by_bisection(pieces, k)
    gain = 1 - best / plain.memory_proxy
    for threshold in (0.0, gain - 1e-3, gain + 1e-3, 1.0):
      got = autopipe.partition_for(autopipe.parameter_costs(params, keys, threshold), 0, k, 1 / 6)
      if gain > 0 and threshold <= gain:
        assert got.memory_proxy == best and got.partition.split_mlp
        assert got.partition.mlp_in_keys == keys
        assert sum(got.stage_costs) == sum(pieces)
      else:
        assert got == plain
  # L = 4 on 8 stages: 1,696 parameters on the largest stage with mlp.2 split
  # (stage 5 ends with its first half), 2,000 with whole sub-layers.
  split = autopipe.partition_for(autopipe.parameter_costs(params, keys, 0.05), 0, 8, 1 / 6)
  assert (split.memory_proxy, split.partition.split_mlp) == (1696, (5,))
  # Compression (Eq. 2) is decided on whole sub-layers: a split lowers what a
  # stage owns, not what its device stores. At F = 2 from K = 4, K = 2 with
  # mlp.2 split would own 2,869 parameters on its largest stage, within the
  # T = 0 stage's 3,104, but whole it owns 3,112: K stays 4.
  split_costs = autopipe.parameter_costs(params, keys, 0.0)
  charged = dict(charge_first_stage=True)  # Algorithm 1's partitions, as Eq. 2 compares
  assert autopipe.partition_for(split_costs, 2, 2, 1 / 6, **charged).memory_proxy < 3104 < (
      autopipe.partition_for(whole, 2, 2, 1 / 6, **charged).memory_proxy)
  assert autopipe.eq2_proxy(split_costs, 2, 2, 1 / 6) == 3112
  assert autopipe.eq2_proxy(split_costs, 0, 4, 1 / 6) == 3104
  for start in (8, 4):
    for frozen in range(4):
      got = autopipe.compress(split_costs, frozen, start, start, 1 / 6).partition
      want = autopipe.compress(whole, frozen, start, start, 1 / 6).partition
      assert got.pipeline_length == want.pipeline_length
      assert got == autopipe.partition_for(split_costs, frozen, got.pipeline_length,
                                           1 / 6).partition
  assert autopipe.compress(split_costs, 2, 4, 4, 1 / 6).partition.pipeline_length == 4


def test_boundaries_of_compression_balance_and_the_profile():
  """Each edge the algorithms state, at the edge (found by mutating them)."""
  # A K equal to the active units fits them one a stage: kept, not halved.
  costs = _uniform(8)  # F = 6: 2 blocks = 4 sub-layers + head = 5 active units
  assert autopipe.compress(costs, 6, 5, 5, 1.0, num_devices=5).partition.pipeline_length == 5
  # Of equal largest stages, the first split found (earlier boundaries)...
  assert autopipe.balance([1.0, 2.0, 1.0], 2) == (1, 2)
  # ...and with blocks, another split only where its widest stage is strictly
  # narrower: (1, 1, 5)'s widest stage touches 2 blocks, as (1, 3, 3)'s does.
  assert autopipe.balance([2, 1, 1, 1, 1, 1, 1], 3, 7.0,
                          blocks=[3, 3, 4, 4, 5, 5, None]) == (1, 3, 3)
  # A remembered M that is no candidate now is measured again, not used.
  profile = autopipe.MicroBatchProfile(None, {'model': 'x'})
  profile.entries['4'] = {'micro_batches': 3, 'seconds': {}}
  measured = []
  m, timings = profile.choose(4, [2, 4], lambda m: measured.append(m) or 1.0 / m)
  assert (m, measured, profile.get(4)) == (4, [2, 4], 4)
  # A record of M = 0 (a hand-edited file) is no choice.
  assert autopipe._choices({'4': {'micro_batches': 0, 'seconds': {}}}) == {}  # noqa: SLF001


def test_layout_edges_even_split_and_replicas():
  """``even`` puts the larger stages first; R = N / K refuses a K that does
  not divide the devices (its own check, before any Plan is made)."""
  from pipejax import autodp, partition as part  # noqa: PLC0415
  from pipejax.pipeline import PlanError  # noqa: PLC0415
  assert part.even(4, 4).stage_sizes == (3, 3, 2, 2)  # 10 units
  assert autodp.replicas_for(8, 4) == 2 and autodp.replicas_for(8, 3, autodp=False) == 1
  with pytest.raises(PlanError, match='pipeline length 3 does not divide the 8 devices'):
    autodp.replicas_for(8, 3)
