"""experiments.bench_elastic: pairs, the ratio over them, the verdict and the
outputs, on synthetic runs (the real runs are the main job's own tests)."""
import json
import os

import pytest

from experiments import bench_cache, bench_elastic
from tests import fixtures


@pytest.fixture(autouse=True)
def _settings_pass(monkeypatch):
  """The runs are fakes here: the settings check (a child process) passes
  (tests/test_bench_cache.py runs the real one for both benchmarks)."""
  monkeypatch.setattr(bench_cache, 'check_settings', lambda passthrough: None)


def _result(total, policy_none, accuracy):
  frozen = [0, 0, 0] if policy_none else [0, 2, 3]
  k = [4, 4, 4] if policy_none else [4, 4, 2]
  replicas = [1, 1, 1] if policy_none else [1, 1, 2]
  rows = [{'epoch': e, 'frozen_layers': f, 'pipeline_length': kk, 'replicas': r,
           'step': 10 * (e + 1), 'cache': e == 2 and not policy_none,
           'epoch_seconds': 2.0 if kk == 4 else 1.0,
           'transition_seconds': 0.0 if policy_none else 0.5, 'eval_seconds': 0.25,
           'checkpoint_seconds': 0.1, 'wall_seconds': 3.0 * (e + 1), 'eval_accuracy': accuracy}
          for e, (f, kk, r) in enumerate(zip(frozen, k, replicas, strict=True))]
  summary = {'total_seconds': total, 'final_eval_accuracy': accuracy, 'num_layers': 4,
             'config': {'train': {'batch_size': 8, 'batch_mode': 'constant'}}}
  return {'summary': summary, 'rows': rows, 'process_seconds': total + 3.0}


def _fake(calls, elastic_totals, baseline_totals, elastic_acc=0.97, baseline_acc=0.975):
  """``elastic_acc`` / ``baseline_acc``: one accuracy, or one per pair."""
  def pick(acc, i):
    return acc[i] if isinstance(acc, list) else acc

  def run(workdir, args):
    name = os.path.basename(workdir)
    calls.append(name)
    none = '--config.freeze.policy=none' in args
    if name.startswith('warmup'):
      return _result(99.0, none, 0.0)
    i = int(name.rsplit('-', 1)[1])
    return (_result(baseline_totals[i], True, pick(baseline_acc, i)) if none
            else _result(elastic_totals[i], False, pick(elastic_acc, i)))
  return run


def test_pairs_alternate_and_the_ratio_is_over_all_pairs(tmp_path, monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(bench_elastic, '_run', _fake(calls, [30.0, 20.0, 34.0], [40.0, 20.0, 60.0],
                                                   elastic_acc=[0.97, 0.966, 0.966]))
  assert bench_elastic.main(['--workdir', str(tmp_path / 'b'), '--repeats', '3',
                             '--config.train.epochs=3']) == 0
  # Warm-ups first, then pairs with the first run alternating.
  assert calls == ['warmup-elastic', 'warmup-baseline', 'elastic-0', 'baseline-0',
                   'baseline-1', 'elastic-1', 'elastic-2', 'baseline-2']
  with open(tmp_path / 'b' / 'bench_elastic.json') as f:
    out = json.load(f)
  # The ratio of the sums, not the mean of the pairs' ratios (0.75, 1.0, 0.567: 0.772).
  assert out['ratio_of_sums'] == pytest.approx(84 / 120)
  assert out['process_ratio_of_sums'] == pytest.approx(93 / 129)  # 3 s more per process
  assert [(p['elastic_process_seconds'], p['baseline_process_seconds']) for p in out['pairs']] == [
      (33.0, 43.0), (23.0, 23.0), (37.0, 63.0)]
  # Pair 1's run stands for the runs' accuracy and plan (the plan is the same in every pair).
  assert out['final_eval_accuracy'] == {'elastic': 0.97, 'baseline': 0.975}
  assert out['elastic_plan'] == {'frozen_layers': [0, 2, 3], 'pipeline_length': [4, 4, 2],
                                 'replicas': [1, 1, 2]}
  assert out['command'] == ('python -m experiments.bench_elastic --workdir '
                            f'{tmp_path / "b"} --repeats 3 --config.train.epochs=3')
  assert out['median_ratio'] == pytest.approx(0.75)
  assert [p['ratio'] for p in out['pairs']] == pytest.approx([0.75, 1.0, 34 / 60])
  assert [p['first'] for p in out['pairs']] == ['elastic', 'baseline', 'elastic']
  assert out['passthrough'] == ['--config.train.epochs=3']
  met = {c['criterion']: c['met'] for c in out['criteria']}
  assert all(met.values()), met  # 0.700 is within the target
  # Limits: 3 epochs of 80 samples; frozen 0, 2, 3 of 4 blocks; the last epoch cached.
  work = 16 + (8 + 2) + (4 + 3)
  assert out['limits']['frozen_forward_only'] == pytest.approx(48 / work)
  assert out['limits']['cached_blocks_free'] == pytest.approx(48 / (work - 3))
  phases = out['seconds_by_phase']['elastic']
  assert phases['epochs_at_starting_k'] == pytest.approx(4.0)
  assert phases['epochs_after'] == pytest.approx(1.0)
  assert phases['transitions'] == pytest.approx(1.5)
  assert phases['startup_and_rest'] == pytest.approx(84 / 3 - 4 - 1 - 1.5 - 0.75 - 0.3)
  assert os.path.getsize(tmp_path / 'b' / 'bench_elastic.png') > 1000
  assert '[met] wall time <= 0.70 x the baseline: 0.700' in capsys.readouterr().out


def test_a_missed_criterion_is_reported(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(bench_elastic, '_run',
                      _fake([], [36.0], [40.0], elastic_acc=0.955, baseline_acc=0.97))
  assert bench_elastic.main(['--workdir', str(tmp_path / 'b'), '--repeats', '1',
                             '--no-warmup']) == 0
  out = capsys.readouterr().out
  assert '[NOT met] wall time <= 0.70 x the baseline: 0.900' in out
  assert '[NOT met] within 1 point of the baseline: 0.9550 vs 0.9700 (-1.50 points)' in out
  assert '[met] final eval accuracy >= 0.95: 0.9550' in out


def test_criteria_hold_in_every_pair_and_strict_exits_non_zero(tmp_path, monkeypatch, capsys):
  """An accuracy gap of exactly one point is within it (no float noise); a
  criterion missed in a later pair is missed, naming that pair; --strict
  turns a missed criterion into exit status 1."""
  monkeypatch.setattr(bench_elastic, '_run', _fake([], [20.0, 20.0], [40.0, 40.0],
                                                   elastic_acc=[0.9694, 0.95],
                                                   baseline_acc=[0.9794, 0.9794]))
  assert bench_elastic.main(['--workdir', str(tmp_path / 'a'), '--repeats', '1',
                             '--no-warmup', '--strict']) == 0
  assert '[met] within 1 point of the baseline: 0.9694 vs 0.9794 (-1.00 points)' in (
      capsys.readouterr().out)
  assert bench_elastic.main(['--workdir', str(tmp_path / 'b'), '--repeats', '2',
                             '--no-warmup']) == 0
  out = capsys.readouterr().out
  assert ('[NOT met] within 1 point of the baseline: 0.9694 vs 0.9794 (-1.00 points); '
          'pair 2: 0.9500 vs 0.9794 (-2.94 points)') in out
  assert '[met] final eval accuracy >= 0.95: 0.9694; pair 2: 0.9500' in out  # 0.95 is enough
  assert '[met] wall time <= 0.70 x the baseline: 0.500' in out
  assert bench_elastic.main(['--workdir', str(tmp_path / 'c'), '--repeats', '2',
                             '--no-warmup', '--strict']) == 1


@pytest.mark.parametrize('key, values', [
    ('frozen_layers', [0, 0, 0]),      # nothing froze
    ('frozen_layers', [0, 3, 2]),      # a block unfroze
    ('pipeline_length', [4, 4, 4]),    # K never shrank
    ('pipeline_length', [4, 2, 4]),    # K shrank, then grew back to its start
    ('replicas', [1, 1, 1]),           # R never grew
    ('replicas', [1, 2, 1])])          # R grew, then fell back
def test_a_plan_that_does_not_freeze_compress_and_replicate_to_the_end_is_not_met(key, values):
  elastic, baseline = _result(20.0, False, 0.97), _result(40.0, True, 0.97)
  for row, value in zip(elastic['rows'], values, strict=True):
    row[key] = value
  criteria = {'frozen_layers': 'frozen layers rise',
              'pipeline_length': 'K shrinks from its starting length', 'replicas': 'R grows'}
  met = {c['criterion']: c['met'] for c in bench_elastic.verdict(elastic, baseline, 0.5)}
  assert met == {**{name: name != criteria[key] for name in criteria.values()},
                 'final eval accuracy >= 0.95': True, 'within 1 point of the baseline': True,
                 'wall time <= 0.70 x the baseline': True}


@pytest.mark.parametrize('argv, message', [
    (['--repeats', '0'], '--repeats must be >= 1'),
    (['--config.freeze.policy=none'], 'would make the elastic run a second baseline'),
    (['--config.freeze.policy', 'none'], 'would make the elastic run a second baseline')])
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, message):
  assert bench_elastic.main(['--workdir', str(tmp_path / 'w'), *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1


def test_refuses_a_used_workdir(tmp_path, capsys):
  fixtures.check_refuses_a_used_workdir(bench_elastic.main, tmp_path, capsys)
