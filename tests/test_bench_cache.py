"""experiments.bench_cache: the frozen-forward time the cache saved, and its
argument checks (the real runs are the main job's own tests)."""
import json
import os
import signal
import subprocess
import sys

import pytest

from experiments import bench_cache, bench_elastic

CHECK_SETTINGS = bench_cache.check_settings


@pytest.fixture(autouse=True)
def _settings_pass(monkeypatch):
  """The runs are fakes here: the settings check (a child process) passes,
  except where a test puts the real one back."""
  monkeypatch.setattr(bench_cache, 'check_settings', lambda passthrough: None)


def _summary(mode):
  return {'config': {'train': {'batch_size': 8, 'batch_mode': mode}},
          'cache_decisions': [{'num_frozen_layers': 2, 'forward_seconds': 0.4},
                              {'num_frozen_layers': 3, 'forward_seconds': 0.6}]}


@pytest.mark.parametrize('mode, batches', [('constant', (8, 8, 8)),
                                           ('per_pipeline', (8, 16, 32))])
def test_forward_saved_prices_each_hit_at_its_depths_batch_forward(mode, batches):
  """Each epoch's new hits save their share of the forward of the batch the
  profiler timed (the plan's: with per_pipeline it grows with R), less the
  cache's own reads and writes; a depth never measured saves nothing."""
  rows = [{'frozen_layers': 2, 'replicas': 1, 'cache_hits': 0},
          {'frozen_layers': 2, 'replicas': 2, 'cache_hits': 32},
          {'frozen_layers': 3, 'replicas': 4, 'cache_hits': 96,
           'cache_read_seconds': 0.5, 'cache_write_seconds': 0.25}]
  expected = 32 / batches[1] * 0.4 + 64 / batches[2] * 0.6 - 0.75
  assert bench_cache._forward_saved(_summary(mode), rows) == pytest.approx(expected)  # noqa: SLF001
  rows[1]['frozen_layers'] = 1  # no decision at F=1: its hits are not priced
  assert bench_cache._forward_saved(_summary(mode), rows) == pytest.approx(  # noqa: SLF001
      expected - 32 / batches[1] * 0.4)


def test_each_variant_is_its_median_run_and_is_compared_with_the_uncached_median(
    tmp_path, monkeypatch):
  """Three interleaved repeats (after the warm-ups): each variant's row is its
  run with the median total, its speed-up is over `off`'s median run, and
  only the cached variants are credited with the forward the cache saved."""
  totals = {'always': [30.0, 10.0, 20.0], 'profile': [25.0, 26.0, 24.0],
            'off': [40.0, 60.0, 50.0]}
  calls = []

  def run(workdir, args):
    name = os.path.basename(workdir)
    calls.append((name, list(args)))
    variant, repeat = name.rsplit('-', 1)
    total = 99.0 if variant == 'warmup' else totals[variant][int(repeat)]
    cached = variant != 'off' and not name.startswith('warmup-off')
    rows = [{'epoch': e, 'frozen_layers': 2 * e, 'replicas': 1, 'cache': cached and e > 0,
             'cache_hits': 16 * e if cached else 0, 'epoch_seconds': total / 4,
             'samples_per_second': 100.0} for e in range(3)]
    summary = {'total_seconds': total, 'final_eval_accuracy': 0.9,
               'config': {'train': {'batch_size': 8, 'batch_mode': 'constant'}},
               'cache_decisions': [{'num_frozen_layers': 2, 'forward_seconds': total / 100},
                                   {'num_frozen_layers': 4, 'forward_seconds': total / 50}]}
    return {'summary': summary, 'rows': rows, 'process_seconds': total + 1}

  monkeypatch.setattr(bench_cache, '_run', run)
  assert bench_cache.main(['--workdir', str(tmp_path / 'b'), '--repeats', '3']) == 0
  args = dict(calls)
  assert args['off-0'] == ['--config.cache.enabled=False']
  assert args['always-0'] == ['--config.cache.policy=always']
  assert args['profile-0'] == ['--config.cache.policy=profile']
  with open(tmp_path / 'b' / 'bench_cache.json') as f:
    rows = {r['variant']: r for r in json.load(f)['rows']}
  assert {v: r['total_seconds'] for v, r in rows.items()} == {
      'always': 20.0, 'profile': 25.0, 'off': 50.0}
  assert {v: r['all_total_seconds'] for v, r in rows.items()} == totals
  assert {v: r['speedup_vs_off'] for v, r in rows.items()} == pytest.approx(
      {'always': 2.5, 'profile': 2.0, 'off': 1.0})
  assert rows['off']['train_seconds'] == pytest.approx(3 * 50.0 / 4)
  # 16 hits at F=2 and 16 more at F=4, batches of 8, at the median run's forwards.
  for variant, total in (('always', 20.0), ('profile', 25.0)):
    assert rows[variant]['forward_seconds_saved'] == pytest.approx(
        2 * total / 100 + 2 * total / 50)
  assert rows['off']['forward_seconds_saved'] == 0.0
  assert rows['always']['cache_counters'] == {'cache_hits': 32}  # the last row's
  assert rows['off']['cache_counters'] == {'cache_hits': 0}
  # With an even count the faster of the two middle runs stands for the variant.
  assert bench_cache.main(['--workdir', str(tmp_path / 'c'), '--repeats', '2',
                           '--no-warmup']) == 0
  with open(tmp_path / 'c' / 'bench_cache.json') as f:
    assert {r['variant']: r['total_seconds'] for r in json.load(f)['rows']} == {
        'always': 10.0, 'profile': 25.0, 'off': 40.0}


def test_bad_repeats_is_refused_before_any_run_or_directory(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(bench_cache, '_run', lambda *a: pytest.fail('a run started'))
  workdir = tmp_path / 'w'
  assert bench_cache.main(['--workdir', str(workdir), '--repeats', '0']) == 2
  assert capsys.readouterr().err.strip() == 'error: --repeats must be >= 1, got 0'
  assert not os.path.exists(workdir)


@pytest.mark.parametrize('module', [bench_cache, bench_elastic])
def test_a_workdir_under_home_is_the_users_home(module, tmp_path, monkeypatch):
  # The shell leaves `--workdir=~/w` as it is.
  started = []

  def first_run(workdir, *args):
    started.append(workdir)
    raise KeyboardInterrupt  # stop at the first run

  monkeypatch.setattr(module, '_run', first_run)
  monkeypatch.setenv('HOME', str(tmp_path))
  (tmp_path / 'cwd').mkdir()
  monkeypatch.chdir(tmp_path / 'cwd')
  with pytest.raises(KeyboardInterrupt):
    module.main(['--workdir=~/w', '--repeats', '1'])
  assert os.path.dirname(started[0]) == str(tmp_path / 'w')
  assert os.listdir(tmp_path / 'cwd') == []


def test_a_policy_that_freezes_nothing_is_refused(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(bench_cache, '_run', lambda *a: pytest.fail('a run started'))
  assert bench_cache.main(['--workdir', str(tmp_path / 'w'), '--config.freeze.policy=none']) == 2
  assert 'freezes nothing' in capsys.readouterr().err
  assert not os.path.exists(tmp_path / 'w')


def test_a_stopped_benchmark_takes_its_running_run_with_it():
  """SIGTERM (e.g. from ``timeout``) to a benchmark kills the run in progress
  too, instead of leaving it training on, orphaned."""
  parent = subprocess.Popen(
      [sys.executable, '-c', 'import sys\n'
       'from experiments.bench_cache import run_child, stop_children_on_sigterm\n'
       'stop_children_on_sigterm()\n'
       'run_child([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); '
       'time.sleep(120)"], capture=False)\n'],
      stdout=subprocess.PIPE, text=True)
  child = int(parent.stdout.readline())
  parent.send_signal(signal.SIGTERM)
  assert parent.wait(60) == 128 + signal.SIGTERM
  with pytest.raises(ProcessLookupError):
    os.kill(child, 0)  # killed and reaped


@pytest.mark.parametrize('passthrough, none', [
    (['--config.freeze.policy=none'], True), (['--config.freeze.policy', 'none'], True),
    (['--config.freeze.policy=none', '--config.freeze.policy=schedule'], False),
    (['--config.freeze.policy=schedule', '--config.freeze.policy', 'none'], True),
    (['--config.freeze.alpha=0.5'], False)])
def test_freezes_nothing_reads_the_policy_the_runs_get(passthrough, none):
  assert bench_cache.freezes_nothing(passthrough) is none


@pytest.mark.parametrize('module', [bench_cache, bench_elastic])
def test_settings_the_runs_would_refuse_are_refused_before_dir_is_written(
    module, tmp_path, capsys, monkeypatch):
  """The main job's own checks run first, in a child: a bad value is one line,
  before any run, and leaves no DIR behind (a DIR the user made stays)."""
  monkeypatch.setattr(bench_cache, 'check_settings', CHECK_SETTINGS)
  monkeypatch.setattr(module, '_run', lambda *a: pytest.fail('a run started'))
  workdir = tmp_path / 'w'
  assert module.main(['--workdir', str(workdir), '--config.train.batch_size=-1']) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: train.batch_size must be >= 1, got -1') and err.count('\n') == 1
  assert not os.path.exists(workdir)
  workdir.mkdir()
  assert module.main(['--workdir', str(workdir), '--config.train.bacth_size=8']) == 2
  assert "unknown config key 'train.bacth_size'" in capsys.readouterr().err
  assert os.path.isdir(workdir) and not os.listdir(workdir)
