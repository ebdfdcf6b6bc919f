"""experiments.bench_cache: the frozen-forward time the cache saved, and its
argument checks (the real runs are the main job's own tests)."""
import os

import pytest

from experiments import bench_cache


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
