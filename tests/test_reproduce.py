"""experiments.reproduce: the figures of merit on hand-computed runs, the parts'
tables on synthetic runs, and a real (tiny) invocation end to end."""
import json
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from experiments import bench_cache, reproduce
from tests import fixtures


def _summary(num_layers=4, batch=8, mode='constant', total=10.0, train=8.0, accuracy=0.9,
             transitions=(), timings=None, kind='elastic', alpha=1 / 3, seed=0):
  return {'mode': kind, 'num_layers': num_layers, 'total_seconds': total,
          'train_seconds': train, 'final_eval_accuracy': accuracy,
          'config': {'train': {'batch_size': batch, 'batch_mode': mode},
                     'freeze': {'alpha': alpha}, 'seed': seed},
          'transitions': list(transitions), 'micro_batch_rounds': 3,
          'micro_batch_timings': timings or {}}


def _row(epoch, frozen, steps_done, cache=False, passes=0, replicas=1, seconds=2.0):
  return {'epoch': epoch, 'frozen_layers': frozen, 'step': steps_done, 'cache': cache,
          'cache_layer_passes': passes, 'replicas': replicas, 'pipeline_length': 4,
          'epoch_seconds': seconds, 'transition_seconds': 0.5, 'eval_seconds': 0.25,
          'eval_accuracy': 0.5}


def test_flop_limit_counts_trained_frozen_and_cached_blocks():
  # 4 blocks, 10 steps of 8 samples per epoch: F = 0, then 2 (computed), then 2 (cached;
  # the cache computed 2 layers for 8 samples that epoch).
  rows = [_row(0, 0, 10), _row(1, 2, 20), _row(2, 2, 30, cache=True, passes=16)]
  n = 80
  baseline = 3 * 16 * n
  work = 16 * n + (8 * n + 2 * n) + (8 * n + 16)
  assert reproduce.flop_limit_speedup(_summary(), rows) == pytest.approx(baseline / work)
  # No freezing: no speed-up allowed.
  assert reproduce.flop_limit_speedup(_summary(), [_row(0, 0, 10), _row(1, 0, 20)]) == 1.0
  # A global batch that grows with R (per_pipeline) weighs later epochs more.
  grown = [_row(0, 0, 10), _row(1, 2, 20, replicas=2)]
  expected = (16 * 80 + 16 * 160) / (16 * 80 + 10 * 160)
  assert reproduce.flop_limit_speedup(_summary(mode='per_pipeline'), grown) == pytest.approx(
      expected)
  # plain_dp: no recomputed forward (3 units a block, against the pipeline's 4), and its
  # global batch is train.batch_size even with per_pipeline (its R = 8 does not grow it).
  dp = [_row(0, 0, 10, replicas=8), _row(1, 0, 20, replicas=8)]
  assert reproduce.flop_limit_speedup(_summary(kind='plain_dp'), dp) == pytest.approx(4 / 3)
  assert reproduce.samples_trained(_summary(kind='plain_dp', mode='per_pipeline'), dp) == [
      80, 80]
  assert reproduce.samples_trained(_summary(mode='per_pipeline'), dp) == [640, 640]


def test_flop_limit_prices_each_stretch_of_an_epoch_at_its_own_depth():
  """With freeze.timestep_steps, freeze events fall inside epochs: each
  stretch of steps is priced at the depth (and cache) it ran with, not the
  epoch's end."""
  # 12 blocks, one epoch of 100 steps; F 0 -> 6 at step 50 (computed prefix).
  summary = _summary(num_layers=12, transitions=[
      {'step': 50, 'frozen_layers': 6, 'cache': False}])
  rows = [_row(0, 6, 100)]
  assert reproduce.flop_limit_speedup(summary, rows) == pytest.approx(
      (48 * 100) / (48 * 50 + (4 * 6 + 6) * 50))  # not 48 / 30 (the end's depth throughout)
  # 4 blocks, 10 steps of 8: F = 0 for 4 steps, 2 (computed) for 3, 3 (cached) for 3; the
  # cache's own passes that epoch: 24. Then an epoch at the row's own depth and cache.
  summary = _summary(transitions=[{'step': 4, 'frozen_layers': 2, 'cache': False},
                                  {'step': 7, 'frozen_layers': 3, 'cache': True},
                                  {'step': 10, 'frozen_layers': 3, 'cache': True}])
  rows = [_row(0, 3, 10, cache=True, passes=24), _row(1, 3, 20, cache=True, passes=24)]
  work = (16 * 4 + (4 * 2 + 2) * 3 + 4 * 1 * 3) * 8 + 24 + 4 * 1 * 80
  assert reproduce.flop_limit_speedup(summary, rows) == pytest.approx(2 * 16 * 80 / work)
  # A transition record from before it noted the cache: the epoch's row decides.
  summary['transitions'][1].pop('cache')
  assert reproduce.flop_limit_speedup(summary, rows) == pytest.approx(2 * 16 * 80 / work)
  # Without the cache's help (bench_elastic's forward-only limit): computed prefixes.
  work = (16 * 4 + (4 * 2 + 2) * 3 + (4 * 1 + 3) * 3) * 8 + (4 * 1 + 3) * 80
  assert reproduce.flop_limit_speedup(summary, rows, cache_free=True) == pytest.approx(
      2 * 16 * 80 / work)
  # A timestep that ends with the epoch: its freeze event comes before the row is
  # written, so the row has the new depth; the epoch trained at the old one.
  summary = _summary(num_layers=12, transitions=[
      {'step': 10, 'frozen_layers': 6, 'cache': False}])
  rows = [_row(0, 6, 10), _row(1, 6, 20)]
  assert reproduce.flop_limit_speedup(summary, rows) == pytest.approx(96 / (48 + 30))


def test_describe_run_speedups_and_where_time_went():
  base = {'summary': _summary(total=20.0, train=18.0), 'process_seconds': 25.0,
          'process_cpu_seconds': 40.0, 'process_context_switches': 9000,
          'rows': [_row(0, 0, 10, seconds=8.0), _row(1, 0, 20, seconds=8.0)]}
  run = {'summary': _summary(total=10.0, train=8.0), 'process_seconds': 12.0,
         'process_cpu_seconds': 17.5, 'process_context_switches': 4000,
         'rows': [_row(0, 0, 10, seconds=4.0), _row(1, 2, 20, seconds=2.0)]}
  r = reproduce.describe_run(run, base)
  assert r['speedup'] == pytest.approx(2.0)
  assert r['train_speedup'] == pytest.approx(16.0 / 6.0)
  limit = (2 * 16 * 80) / (16 * 80 + 10 * 80)
  assert r['flop_limit_speedup'] == pytest.approx(limit)
  assert r['efficiency'] == pytest.approx(2.0 / limit)
  assert r['train_efficiency'] == pytest.approx((16.0 / 6.0) / limit)
  assert r['samples_per_second'] == pytest.approx(160 / 10.0)
  assert r['startup_seconds'] == pytest.approx(2.0)
  assert r['transition_seconds'] == pytest.approx(1.0)
  assert (r['process_cpu_seconds'], r['process_context_switches']) == (17.5, 4000)
  assert reproduce.describe_run(run, None)['speedup'] is None
  assert r['samples_trained'] == 160


def test_efficiency_is_per_sample_where_a_run_trains_more_samples():
  """``per_pipeline`` grows the batch with R, and ``max_steps_per_epoch``
  caps steps: ``full`` at R = 2 trains twice the baseline's samples in its
  second epoch. A run whose time is exactly its FLOP work (4 blocks, 8
  samples a step, 10 steps an epoch; F = 2 in epoch 1 at R = 2) is at its
  limit: efficiency 1, though its end-to-end speed-up is below 1."""
  def result(summary, rows):
    return {'summary': summary, 'rows': rows, 'process_seconds': 0.0,
            'process_cpu_seconds': 0.0, 'process_context_switches': 0}
  base_work = 2 * 80 * 16            # 160 samples, 4 blocks x 4 units each
  full_work = 80 * 16 + 160 * (4 * 2 + 2)  # then 160 samples: 2 trained, 2 forward only
  base = result(_summary(mode='per_pipeline', total=base_work, train=base_work),
                [_row(0, 0, 10, seconds=1280), _row(1, 0, 20, seconds=1280)])
  full = result(_summary(mode='per_pipeline', total=full_work, train=full_work),
                [_row(0, 0, 10, seconds=1280), _row(1, 2, 20, replicas=2, seconds=1600)])
  r = reproduce.describe_run(full, base)
  assert r['samples_trained'] == 240
  assert r['speedup'] == pytest.approx(base_work / full_work)
  assert r['flop_limit_speedup'] == pytest.approx(16 / (full_work / 240))  # per sample
  assert r['efficiency'] == pytest.approx(1.0)
  assert r['train_efficiency'] == pytest.approx(1.0)


def test_a_run_s_cpu_time_and_switches_are_its_process_s_all_threads():
  """A child that burns 0.3 s of CPU and sleeps 50 times in a second thread
  reports its own ``getrusage`` at its end: what the parent measured for it
  is at least that (the child's exit comes after its report)."""
  child = textwrap.dedent("""
      import resource, threading, time
      def naps():
        for _ in range(50):
          time.sleep(0.001)
      t = threading.Thread(target=naps); t.start()
      end = time.process_time() + 0.3
      while time.process_time() < end:
        pass
      t.join()
      u = resource.getrusage(resource.RUSAGE_SELF)
      print(u.ru_utime + u.ru_stime, u.ru_nvcsw + u.ru_nivcsw)
      """)
  proc, usage = reproduce.run_measured([sys.executable, '-c', child])
  assert proc.returncode == 0, proc.stderr
  cpu, switches = proc.stdout.split()
  assert usage['cpu_seconds'] >= float(cpu) >= 0.3
  assert usage['context_switches'] >= int(switches) >= 50
  # Only that child: a second one that does nothing measures far less.
  _, idle = reproduce.run_measured([sys.executable, '-c', 'pass'])
  assert idle['cpu_seconds'] < float(cpu) and idle['context_switches'] < int(switches)


class _FakeRunner(reproduce.Runner):
  """Synthetic runs: time falls and accuracy is fixed per variant and seed."""

  def __init__(self, alpha=1 / 3, seed=0, drop=0.0):
    super().__init__('/nonexistent', [], 'cold')
    self.calls = []
    self.alpha, self.seed = alpha, seed  # what runs without an override get (the config's)
    self.drop = drop  # the accuracy that freezing loses

  def _execute(self, name, module, args):
    self.calls.append((name, module, tuple(args)))
    seed = next((int(a.split('=')[1]) for a in args if a.startswith('--config.seed=')),
                self.seed)
    alpha = next((float(a.split('=')[1]) for a in args if 'freeze.alpha' in a), self.alpha)
    frozen = 0 if 'none' in ' '.join(args) or module == reproduce.PLAIN else 2
    total = 30.0 + seed if frozen == 0 else 10.0 + 10 * alpha + seed
    transitions = [] if not frozen else [{
        'epoch': 0, 'step': 10, 'frozen_layers': 2, 'old': 'K=4 R=1 M=4', 'new': 'K=2 R=2 M=2',
        'reshard_seconds': 0.1, 'compile_seconds': 1.0, 'compiled_ahead': True,
        'cache_seconds': 0.2, 'total_seconds': 1.5, 'warmup_seconds': 0.05}]
    timings = {'2': {'2': 0.01, '4': 0.03}} if frozen else {}
    summary = _summary(total=total, train=total - 1,
                       accuracy=0.9 + 0.01 * seed - (self.drop if frozen else 0.0),
                       transitions=transitions, timings=timings, alpha=alpha, seed=seed,
                       kind='plain_dp' if module == reproduce.PLAIN else 'elastic')
    rows = [_row(0, 0, 10), _row(1, frozen, 20)]
    return {'name': name, 'summary': summary, 'rows': rows, 'process_seconds': total + 3,
            'process_cpu_seconds': 1.5 * total, 'process_context_switches': 100 * total}


def test_the_micro_batch_search_is_charged_to_the_first_transition_to_its_k(tmp_path):
  """M is profiled once per K: a second transition to the same K (a freeze
  event that keeps it) pays no search; the starting K's search ran in epoch
  0, before any transition, and is not charged to one that keeps that K."""
  class Twice(_FakeRunner):
    def _execute(self, name, module, args):
      out = super()._execute(name, module, args)
      if out['summary']['transitions']:
        first = out['summary']['transitions'][0]
        keeps = dict(first, old='K=4 R=1 M=4', new='K=4 R=1 M=4')  # F 0 -> 1, K stays 4
        again = dict(first, epoch=1, frozen_layers=3, old='K=2 R=2 M=2')
        out['summary']['transitions'] = [keeps, first, again]
        out['summary']['micro_batch_timings']['4'] = {'4': 0.01, '8': 0.06}
      return out

  out = reproduce.transitions(Twice(), str(tmp_path))
  rows = out['rows']
  assert [r['new'] for r in rows] == ['K=4 R=1 M=4'] + ['K=2 R=2 M=2'] * 2
  assert [r['micro_batch_search_seconds'] for r in rows] == pytest.approx([0.0, 3 * 0.02, 0.0])
  assert out['initial_micro_batch_search_seconds'] == pytest.approx(3 * 0.05)


def test_parts_on_synthetic_runs(tmp_path):
  runner = _FakeRunner()
  out = reproduce.breakdown(runner, str(tmp_path))
  by = {r['variant']: r for r in out['rows']}
  assert list(by) == list(reproduce.BREAKDOWN)
  assert by['baseline']['speedup'] == 1.0 and by['full']['speedup'] == pytest.approx(30 / (40 / 3))
  assert out['targets']['full_vs_plain_dp'] == pytest.approx(30 / (40 / 3))
  assert out['targets_met'] == {'full_vs_baseline': False, 'full_vs_plain_dp': True,
                                'accuracy_points': True}
  alpha = reproduce.alpha(runner, str(tmp_path))
  assert [r['alpha'] for r in alpha['rows']] == list(reproduce.ALPHAS)
  assert [r['speedup'] for r in alpha['rows']] == pytest.approx(
      [30 / (10 + 10 * a) for a in reproduce.ALPHAS])
  table = reproduce.table1(runner, str(tmp_path))
  full = next(r for r in table['rows'] if r['variant'] == 'full')
  assert full['seeds'] == list(reproduce.SEEDS)
  assert full['accuracy']['mean'] == pytest.approx(0.91)
  assert full['accuracy']['std'] == pytest.approx(np.std([0.9, 0.91, 0.92], ddof=1))
  per_seed = [(30 + s) / (10 + 10 / 3 + s) for s in reproduce.SEEDS]
  assert table['speedup']['values'] == pytest.approx(per_seed)
  assert table['speedup']['mean'] == pytest.approx(sum(per_seed) / len(per_seed))
  trans = reproduce.transitions(runner, str(tmp_path))
  assert trans['rows'][0]['micro_batch_search_seconds'] == pytest.approx(3 * 0.02)
  # Runs shared by parts ran once: 6 variants, 3 other α, 2 × 2 other seeds.
  assert len(runner.calls) == len(set(runner.calls)) == 6 + 3 + 4
  for part in ('breakdown', 'alpha', 'table1', 'transitions'):
    with open(tmp_path / f'{part}.json') as f:
      assert json.load(f)['rows']
    assert os.path.getsize(tmp_path / f'{part}.png') > 1000


@pytest.mark.parametrize('variants, missing', [
    (('baseline', 'full'), {'full_vs_plain_dp': 'plain_dp not run (--variants)'}),
    (('baseline', 'freeze', 'plain_dp'),
     {key: 'full not run (--variants)' for key in reproduce.TARGETS})])
def test_a_target_that_the_variants_leave_out_says_so(tmp_path, capsys, variants, missing):
  runner = _FakeRunner()
  runner.variants = variants
  out = reproduce.breakdown(runner, str(tmp_path))
  assert [r['variant'] for r in out['rows']] == list(variants)
  assert out['targets_not_measured'] == missing
  assert set(out['targets']) == set(reproduce.TARGETS) - set(missing)
  printed = capsys.readouterr().out
  for key, why in missing.items():
    assert f'target {key}: not measured ({why})' in printed


@pytest.mark.parametrize('drop, points, met', [
    (0.01, 1.0, True),     # 0.9 - 0.89 is 1.0000000000000009 points: 1 point, met
    (0.02, 2.0, False),
    (-0.05, -5.0, True)])  # full more accurate than the baseline
def test_the_accuracy_target_is_the_baseline_minus_full_in_points(tmp_path, drop, points, met):
  out = reproduce.breakdown(_FakeRunner(drop=drop), str(tmp_path))
  assert out['targets']['accuracy_points'] == pytest.approx(points, abs=1e-9)
  assert out['targets_met']['accuracy_points'] is met


def test_on_synthetic_data_the_accuracy_target_is_not_measured(tmp_path, capsys):
  """Random labels keep accuracy at chance for every variant: the accuracy
  target says so instead of being met by equal chance levels."""
  class Synthetic(_FakeRunner):
    def _execute(self, name, module, args):
      out = super()._execute(name, module, args)
      out['summary']['data'] = 'synthetic'
      return out

  out = reproduce.breakdown(Synthetic(drop=0.0), str(tmp_path))
  assert set(out['targets']) == set(out['targets_met']) == {'full_vs_baseline',
                                                            'full_vs_plain_dp'}
  assert out['targets_not_measured'] == {
      'accuracy_points': 'synthetic data: random labels, accuracy stays at chance'}
  assert 'target accuracy_points: not measured (synthetic data' in capsys.readouterr().out
  with open(tmp_path / 'breakdown.json') as f:
    assert 'accuracy_points' in json.load(f)['targets_not_measured']
  assert reproduce.breakdown(_FakeRunner(), str(tmp_path))['targets_not_measured'] == {}
  # The other parts with accuracies say it too, printed and in their JSON.
  capsys.readouterr()
  for part in (reproduce.alpha, reproduce.table1):
    assert part(Synthetic(), str(tmp_path))['accuracy_not_measured'] == reproduce.CHANCE
    assert capsys.readouterr().out.count(f'accuracy: not measured ({reproduce.CHANCE})') == 1
    with open(tmp_path / f'{part.__name__}.json') as f:
      assert json.load(f)['accuracy_not_measured'] == reproduce.CHANCE
    assert 'accuracy_not_measured' not in part(_FakeRunner(), str(tmp_path))


def test_a_speed_target_reached_exactly_is_met(tmp_path):
  """The issue's targets are "at least": 2.5x the baseline and 1.3x plain_dp."""
  out = reproduce.breakdown(_FakeRunner(alpha=0.2), str(tmp_path))  # 30 s / 12 s
  assert out['targets']['full_vs_baseline'] == 2.5
  assert out['targets_met'] == {'full_vs_baseline': True, 'full_vs_plain_dp': True,
                                'accuracy_points': True}
  out = reproduce.breakdown(_FakeRunner(alpha=1.0), str(tmp_path))  # 30 s / 20 s
  assert out['targets']['full_vs_plain_dp'] == pytest.approx(1.5)
  assert out['targets_met'] == {'full_vs_baseline': False, 'full_vs_plain_dp': True,
                                'accuracy_points': True}


def test_without_the_cache_frozen_blocks_cost_their_forward_in_cached_epochs():
  """``cache_free`` (the forward-only limit: as if no depth were served by
  the cache) prices frozen blocks at their forward also in an epoch whose
  row says it was cached, when no transition says where the cache began.
  Baseline: 20 steps x 8 samples x 4 blocks x 4 units = 2560. The run: 10
  steps of 4 trained blocks (1280), then 10 steps of 2 trained blocks and 2
  frozen ones: 800 at their forward, or 640 and the cache's 16 passes."""
  rows = [_row(0, 0, 10), _row(1, 2, 20, cache=True, passes=16)]
  assert reproduce.flop_limit_speedup(_summary(), rows, cache_free=True) == pytest.approx(
      2560 / (1280 + 800))
  assert reproduce.flop_limit_speedup(_summary(), rows) == pytest.approx(
      2560 / (1280 + 640 + 16))


def test_rows_carry_the_alpha_and_seeds_their_runs_had(tmp_path):
  """A --config file with another α or seed: the rows say what ran, not the
  labels of the parts."""
  runner = _FakeRunner(alpha=0.25, seed=5)
  alpha = reproduce.alpha(runner, str(tmp_path))
  # α = 0.25 is no point of the part: one more row, and 1/3 still runs.
  assert [r['alpha'] for r in alpha['rows']] == pytest.approx([0.1, 0.2, 0.25, 1 / 3, 0.5])
  assert [name for name, *_ in runner.calls] == [
      'baseline', 'full', 'full-alpha0.1', 'full-alpha0.2', 'full-alpha0.333333',
      'full-alpha0.5']
  table = reproduce.table1(runner, str(tmp_path))
  assert [r['seeds'] for r in table['rows']] == [[5, 1, 2]] * 2
  # An α or seed that another point of the part would repeat: never twice.
  runner = _FakeRunner(alpha=0.2, seed=1)
  alpha = reproduce.alpha(runner, str(tmp_path))
  assert [r['alpha'] for r in alpha['rows']] == pytest.approx([0.1, 0.2, 1 / 3, 0.5])
  # The shared run is the 0.2 point; no other run has that α.
  assert [name for name, *_ in runner.calls] == [
      'baseline', 'full', 'full-alpha0.1', 'full-alpha0.333333', 'full-alpha0.5']
  table = reproduce.table1(runner, str(tmp_path))
  assert [r['seeds'] for r in table['rows']] == [[1, 2, 3]] * 2


@pytest.mark.parametrize('argv, message', [
    (['--only', 'nope'], "unknown part(s) ['nope']"),
    (['--only', ' , '], '--only names no part; choose from breakdown'),
    (['--only', 'breakdown', '--config.freeze.policy=none'],
     'would turn every variant into the baseline'),
    (['--variants', 'baseline,nope'], "unknown variant(s) ['nope']"),
    (['--bogus=1'], 'unexpected arguments'),
    (['--only', 'alpha', '--config.freeze.alpha=0.5'],
     '--config.freeze.alpha (the alpha part sets it)'),
    (['--only', 'breakdown,table1', '--config.seed', '3'], 'unexpected arguments'),
    (['--only', 'breakdown,table1', '--config.seed=3'], '--config.seed (the table1 part sets it)'),
    (['--only', 'breakdown', '--config'], '--config needs a FILE'),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, message):
  assert reproduce.main(['--workdir', str(tmp_path / 'w'), *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1


def test_config_file_and_overrides_pass_through_to_every_run(tmp_path, monkeypatch):
  """``--config FILE`` (as the main job takes it) and ``--config=FILE`` both
  reach the runs; an override of what no part sets is allowed."""
  seen = []

  class Stop(Exception):
    pass

  def runner(workdir, passthrough, *args):
    seen.append(passthrough)
    raise Stop
  monkeypatch.setattr(reproduce, 'Runner', runner)
  monkeypatch.setattr(bench_cache, 'check_settings', lambda passthrough: None)
  for i, argv in enumerate((['--config', 'my.py', '--config.train.epochs=2'],
                            ['--config=my.py', '--config.train.epochs=2'])):
    with pytest.raises(Stop):
      reproduce.main(['--workdir', str(tmp_path / str(i)), '--only', 'breakdown', *argv])
  assert seen == [['--config=my.py', '--config.train.epochs=2']] * 2


def test_settings_the_runs_would_refuse_are_refused_before_dir_is_written(tmp_path, capsys):
  """The main job's own checks run first (in a child), so a bad value leaves
  no DIR behind and the corrected command runs in it; a DIR the user made
  stays."""
  workdir = tmp_path / 'w'
  for argv, message in ((['--config.train.batch_size=-1'],
                         'error: train.batch_size must be >= 1, got -1'),
                        (['--config.data.name=mnist'], "error: data.name must be 'auto', "),
                        (['--config.train.bacth_size=8'],
                         "error: unknown config key 'train.bacth_size' (did you mean "
                         "'train.batch_size'?")):
    assert reproduce.main(['--workdir', str(workdir), '--only', 'transitions', *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count('\n') == 1, err
    assert not os.path.exists(workdir)
  workdir.mkdir()
  assert reproduce.main(['--workdir', str(workdir), '--config.train.epochs=0']) == 2
  assert 'train.epochs must be >= 1' in capsys.readouterr().err
  assert os.path.isdir(workdir) and not os.listdir(workdir)
  assert bench_cache.check_settings([f'--config.{k}={v}' for k, v in TINY.items()]) is None


def test_refuses_a_used_workdir(tmp_path, capsys):
  fixtures.check_refuses_a_used_workdir(reproduce.main, tmp_path, capsys)


TINY = {'data.name': 'digits', 'model.num_layers': 4, 'model.hidden_size': 16,
        'model.intermediate_size': 32, 'pipeline.initial_length': 4, 'train.epochs': 2,
        'train.max_steps_per_epoch': 3, 'freeze.alpha': 0.5, 'pipeline.micro_batches': 4}


def test_real_runs_end_to_end(tmp_path):
  """The baseline and ``full`` for real on a tiny config, in fresh processes
  sharing a compilation cache; the outputs as documented."""
  workdir = tmp_path / 'out'
  flags = [f'--config.{k}={v}' for k, v in TINY.items()]
  assert reproduce.main(['--workdir', str(workdir), '--only', 'breakdown,transitions',
                         '--variants', 'full', '--compile-cache', 'shared', *flags]) == 0
  with open(workdir / 'breakdown.json') as f:
    out = json.load(f)
  by = {r['variant']: r for r in out['rows']}
  assert list(by) == ['baseline', 'full']
  for r in by.values():
    assert r['total_seconds'] > 0 and 0 <= r['final_eval_accuracy'] <= 1
    # The whole process, start-up included; 8 device threads switch at every collective.
    assert r['process_cpu_seconds'] > r['total_seconds'] / 4, r
    assert r['process_context_switches'] > 1000, r
  assert by['baseline']['frozen_layers'] == [0, 0] and by['baseline']['speedup'] == 1.0
  assert by['full']['frozen_layers'][-1] > 0 and by['full']['flop_limit_speedup'] > 1
  assert by['baseline']['flop_limit_speedup'] == 1.0
  assert set(out['targets']) == {'full_vs_baseline', 'accuracy_points'}
  with open(workdir / 'transitions.json') as f:
    rows = json.load(f)['rows']
  assert rows and all(r['total_seconds'] >= r['reshard_seconds'] for r in rows)
  for part in ('breakdown', 'transitions'):
    assert os.path.getsize(workdir / f'{part}.png') > 1000


def _tiny_config(**more):
  from experiments import vit_imagenet  # noqa: PLC0415
  config = vit_imagenet.get_config()
  with config.unlocked():
    fixtures.override(config, {**TINY, 'checkpoint.enabled': False,
                               'pipeline.profile_path': '', **more})
  return config


@pytest.mark.parametrize('batch_mode', ['constant', 'per_pipeline'])
def test_microbatch_sweep(tmp_path, monkeypatch, batch_mode):
  """Each K's M are timed on the batch that training feeds that plan (with
  per_pipeline it grows with R), and throughput counts those samples."""
  from experiments import reproduce_microbatches  # noqa: PLC0415
  from pipejax.trainer import Trainer  # noqa: PLC0415
  fed = {}
  feed = Trainer._feed  # noqa: SLF001

  def recorded(self, ids, batch, plan):
    fed.setdefault(plan.pipeline_length, set()).add(len(ids))
    return feed(self, ids, batch, plan)

  monkeypatch.setattr(Trainer, '_feed', recorded)
  config = _tiny_config(**{'train.epochs': 3, 'train.batch_mode': batch_mode})
  out = reproduce_microbatches.sweep(config, str(tmp_path))
  lengths = sorted({r['pipeline_length'] for r in out['rows']}, reverse=True)
  assert lengths[0] == 4 and len(lengths) > 1  # the α bound compresses the pipeline
  for k in lengths:
    rows = [r for r in out['rows'] if r['pipeline_length'] == k]
    ms, skipped = [r['micro_batches'] for r in rows], out['skipped'][str(k)]
    replicas = config.pipeline.devices // k
    batch = config.train.batch_size * (replicas if batch_mode == 'per_pipeline' else 1)
    per_replica = batch // replicas
    assert {r['replicas'] for r in rows} == {replicas} and fed[k] == {batch}
    # M in {K, ..., 6K}: those that split a replica's batch evenly are timed, the rest skipped.
    assert ms == [m * k for m in range(1, 7) if per_replica % (m * k) == 0]
    assert skipped == [m * k for m in range(1, 7) if per_replica % (m * k)]
    assert all(r['step_seconds'] > 0 for r in rows)
    assert all(r['samples_per_second'] == pytest.approx(batch / r['step_seconds'])
               for r in rows)
  assert out['machine'] == reproduce.machine()
  assert os.path.getsize(tmp_path / 'microbatches.png') > 1000


def _sweep_on_a_fake_clock(tmp_path, monkeypatch, **overrides):
  """``reproduce_microbatches.sweep`` with no step run or compiled: each
  step advances a fake clock by 8/M seconds, so M's step time is known."""
  from experiments import reproduce_microbatches  # noqa: PLC0415
  from pipejax.trainer import Trainer  # noqa: PLC0415
  clock = [0.0]

  def step(self, fn, micro_batches):
    clock[0] += 8.0 / micro_batches

  monkeypatch.setattr(reproduce_microbatches, 'time',
                      types.SimpleNamespace(perf_counter=lambda: clock[0]))
  monkeypatch.setattr(Trainer, '_feed', lambda self, ids, batch, plan: plan.micro_batches)
  monkeypatch.setattr(Trainer, '_train_step', lambda self, plan, feed: None)
  monkeypatch.setattr(Trainer, '_run_step', step)
  return reproduce_microbatches.sweep(_tiny_config(**overrides), str(tmp_path))


def test_the_sweep_reports_a_step_s_seconds_and_the_fastest_m(tmp_path, monkeypatch, capsys):
  """Per-step seconds (not per round), the largest M fastest on this clock,
  and the candidates from the batch a replica gets: with per_pipeline 48
  samples at every K (the config's batch, not split over R: at K = 4, R = 2
  the M that divide 24 would drop 16)."""
  out = _sweep_on_a_fake_clock(tmp_path, monkeypatch, **{
      'train.epochs': 3, 'train.batch_mode': 'per_pipeline', 'train.batch_size': 48})
  printed = capsys.readouterr().out
  lengths = sorted({r['pipeline_length'] for r in out['rows']}, reverse=True)
  assert lengths[0] == 4 and len(lengths) > 1
  for k in lengths:
    rows = [r for r in out['rows'] if r['pipeline_length'] == k]
    assert [r['micro_batches'] for r in rows] == [m * k for m in range(1, 7) if 48 % (m * k) == 0]
    assert [r['step_seconds'] for r in rows] == pytest.approx(
        [8.0 / r['micro_batches'] for r in rows])
    assert f'-> fastest M={rows[-1]["micro_batches"]}' in next(
        line for line in printed.splitlines() if line.startswith(f'K={k} '))


def test_the_sweep_times_each_k_at_the_first_depth_that_reaches_it(tmp_path, monkeypatch):
  """8 blocks at α = 0.2: K = 4 from the start until F = 5 compresses it to 2
  (then F = 6, 7 keep K = 2); each K is timed at the depth where it began."""
  out = _sweep_on_a_fake_clock(tmp_path, monkeypatch, **{
      'train.epochs': 6, 'model.num_layers': 8, 'freeze.alpha': 0.2})
  assert out['lengths'] == {'4': 0, '2': 5}
  assert {(r['pipeline_length'], r['frozen_layers']) for r in out['rows']} == {(4, 0), (2, 5)}


def test_plain_dp_trains_the_same_model_as_the_pipeline(tmp_path):
  """Same initial weights, batches, optimizer and schedule: plain data
  parallelism and pipejax's static pipeline (no freezing) give the same
  per-epoch training losses; only the execution differs."""
  from experiments import elastic, plain_dp  # noqa: PLC0415
  config = _tiny_config(**{'freeze.policy': 'none', 'cache.enabled': False})
  plain = plain_dp.run(config, str(tmp_path / 'dp'))
  pipe = elastic.run(_tiny_config(**{'freeze.policy': 'none', 'cache.enabled': False}),
                     str(tmp_path / 'pipe'), 'vit')
  rows = [[json.loads(line) for line in open(tmp_path / d / 'metrics.jsonl')]
          for d in ('dp', 'pipe')]
  # Float rounding only: the losses differed by 2.8e-8 relative (measured), the
  # accuracies not at all; at most one of digits' 359 evaluation samples may flip.
  np.testing.assert_allclose([r['train_loss'] for r in rows[0]],
                             [r['train_loss'] for r in rows[1]], rtol=1e-6)
  samples = config.train.max_steps_per_epoch * config.train.batch_size
  for dp, pp in zip(rows[0], rows[1], strict=True):
    assert dp['eval_accuracy'] == pytest.approx(pp['eval_accuracy'], abs=1.01 / 359)
    assert dp['eval_accuracy'] * 359 == pytest.approx(round(dp['eval_accuracy'] * 359))
    assert dp['train_accuracy'] == pytest.approx(pp['train_accuracy'], abs=1.01 / samples)
    assert dp['replicas'] == config.pipeline.devices
  assert plain['final_eval_accuracy'] == pytest.approx(pipe['final_eval_accuracy'],
                                                       abs=1.01 / 359)
  assert plain['eval_batch_size'] == 4 * config.train.batch_size  # the main job's default
  assert rows[0][0]['train_loss'] != rows[0][-1]['train_loss']  # it trained
  # Never checkpointed in plain_dp (a later run on its workdir keeps its rows),
  # nor here in the pipeline, which ran with checkpoint.enabled=False.
  assert [r['checkpointed'] for r in rows[0] + rows[1]] == [False] * len(rows[0] + rows[1])


@pytest.mark.parametrize('held', ['metrics.jsonl', 'checkpoints', 'replaced'])
def test_plain_dp_refuses_a_workdir_holding_a_main_job_run(tmp_path, held):
  """Its summary.json would mark a main-job start over's new run finished,
  and the next main-job run would then remove the old one (replaced/)."""
  from experiments import elastic, plain_dp  # noqa: PLC0415
  workdir = tmp_path / 'w'
  workdir.mkdir()
  if held == 'metrics.jsonl':
    (workdir / held).write_text('')
  else:
    (workdir / held).mkdir()
  with pytest.raises(elastic.ConfigError, match=rf'already holds a run \({held}\)'):
    plain_dp.run(_tiny_config(), str(workdir))
  assert sorted(os.listdir(workdir)) == sorted([held, elastic.LOCK_FILE])


def test_plain_dp_evaluates_the_samples_the_main_job_does_with_a_growing_batch(tmp_path):
  """With batch_mode=per_pipeline the main job's evaluation batch is 4 × its
  starting global batch, B·R₀ (R₀ = 8/4 here), and a train.max_steps_per_epoch
  cap also caps evaluation: plain_dp takes the same batch, so that both count
  the same samples (it took 4·B: half as many)."""
  from experiments import plain_dp  # noqa: PLC0415
  config = _tiny_config(**{'freeze.policy': 'none', 'cache.enabled': False,
                           'train.batch_mode': 'per_pipeline', 'train.epochs': 1,
                           'train.max_steps_per_epoch': 1})
  replicas = config.pipeline.devices // config.pipeline.initial_length
  summary = plain_dp.run(config, str(tmp_path / 'dp'))
  assert summary['eval_batch_size'] == 4 * config.train.batch_size * replicas


def test_the_benchmarks_refuse_a_bad_workdir_or_setting_before_any_training(tmp_path):
  """A workdir that is a file, or where an output's path is a folder, or a
  setting the command cannot follow: one line, exit 2, before the data and
  model load (not a traceback after training)."""
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  (tmp_path / 'afile').write_text('x')
  (tmp_path / 'busy' / 'summary.json').mkdir(parents=True)
  (tmp_path / 'busy' / 'bench_plans.json').mkdir()
  cases = [('plain_dp', 'afile', 'cannot use --workdir='),
           ('bench_plans', 'afile', 'cannot use --workdir='),
           ('plain_dp', 'busy', 'summary.json is a directory, where the run writes its file'),
           # bench_plans writes no summary.json: only its own file is checked.
           ('bench_plans', 'busy', 'bench_plans.json is a directory, where the run writes its'),
           ('bench_plans', 'fresh',
            "data.name must be 'auto', 'imagenet2012', 'digits' or 'synthetic'"),
           ('plain_dp', 'fresh', "plain_dp runs in one process; drop "
                                 "--config.distributed.coordinator='localhost:1'"),
           ('reproduce_microbatches', 'fresh', 'train.epochs must be >= 1, got 0'),
           ('reproduce_microbatches', 'fresh',
            "data.name must be 'auto', 'imagenet2012', 'digits' or 'synthetic'")]
  for module, workdir, message in cases:
    args = ['--config.train.epochs=1', '--config.train.max_steps_per_epoch=1']
    if 'data.name' in message:  # a config error: one line too
      args.append('--config.data.name=bogus')
    if 'coordinator' in message:
      args.append('--config.distributed.coordinator=localhost:1')
    if 'train.epochs' in message:
      args.append('--config.train.epochs=0')
    out = subprocess.run([sys.executable, '-m', f'experiments.{module}',
                          f'--workdir={tmp_path / workdir}', *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, (module, out.stderr[-2000:])
    assert out.stderr.count('\n') == 1 and message in out.stderr, (module, out.stderr)
    assert not os.path.exists(tmp_path / workdir / 'metrics.jsonl')


@pytest.mark.parametrize('mode', ['warm', 'shared', 'cold'])
def test_every_cache_a_run_reads_is_the_workdir_s_never_the_user_s(tmp_path, monkeypatch, mode):
  """A run's compilation cache, program store, initialisation cache and
  M-profile lie in DIR (``cold``: beside the run's own workdir), so what a
  run pays does not depend on what the user's ``~/.cache/pipejax`` holds."""
  home = str(tmp_path / 'home')
  monkeypatch.setenv('HOME', home)
  for name in ('PIPEJAX_COMPILATION_CACHE', 'PIPEJAX_PROGRAM_STORE', 'PIPEJAX_INIT_CACHE'):
    monkeypatch.setenv(name, os.path.join(home, name))  # what a user may have set
  seen = []

  def child(cmd, env):
    seen.append((cmd, env))
    return subprocess.CompletedProcess(cmd, 0, '', ''), {}

  monkeypatch.setattr(reproduce, 'run_measured', child)
  runner = reproduce.Runner(str(tmp_path / 'dir'), [], mode)
  runner._process('full', reproduce.MAIN, [])
  (cmd, env), = seen
  own = [env['PIPEJAX_COMPILATION_CACHE'], env['PIPEJAX_PROGRAM_STORE'],
         env['PIPEJAX_INIT_CACHE'],
         next(a.split('=', 1)[1] for a in cmd if a.startswith('--config.pipeline.profile_path='))]
  assert len(set(own)) == 4
  for path in own:
    assert path.startswith(str(tmp_path / 'dir') + os.sep), (mode, path)
    assert (os.path.join('runs', 'full.') in path) == (mode == 'cold'), (mode, path)
  # The micro-batch sweep, a child of its own, reads the same caches.
  swept = []

  def sweep(cmd, capture=True, env=None):
    swept.append(env)
    with open(tmp_path / 'dir' / 'microbatches.json', 'w') as f:
      json.dump({}, f)
    return subprocess.CompletedProcess(cmd, 0, '', '')

  monkeypatch.setattr(reproduce, 'run_child', sweep)
  os.makedirs(tmp_path / 'dir', exist_ok=True)
  reproduce.microbatches(runner, str(tmp_path / 'dir'))
  (env,) = swept
  for name in ('PIPEJAX_COMPILATION_CACHE', 'PIPEJAX_PROGRAM_STORE', 'PIPEJAX_INIT_CACHE'):
    assert env[name].startswith(str(tmp_path / 'dir') + os.sep), (mode, env[name])
    assert (os.path.join('runs', 'microbatches.') in env[name]) == (mode == 'cold')
