"""experiments.bench_cache: the frozen-forward time the cache saved, and its
argument checks (the real runs are the main job's own tests)."""
import os
import signal
import subprocess
import sys

import pytest

from experiments import bench_cache, bench_elastic


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
