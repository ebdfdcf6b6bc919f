"""The developer benchmarks `bench_autocache` and `bench_pipeline`: a tiny run
of each writes the rows it prints, and bad flags are one line, exit 2, before
anything is built or written; `bench_plans`' figures from its step times."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import bench_plans
from pipejax import schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module, *args):
  return subprocess.run([sys.executable, '-m', f'experiments.{module}', *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def test_bench_autocache_serves_every_read_from_the_cache(tmp_path):
  out = _run('bench_autocache', f'--workdir={tmp_path}', '--batch=4', '--seq=3',
             '--hidden=5', '--batches=3')
  assert out.returncode == 0, out.stderr[-2000:]
  rows = json.loads((tmp_path / 'bench_autocache.json').read_text())['rows']
  assert [(r['dtype'], r['tier']) for r in rows] == [
      (d, t) for d in ('float32', 'bfloat16') for t in ('memory', 'disk', 'disk+prefetch')]
  for r in rows:
    # Two read epochs of 12 samples after the write epoch, every read a hit.
    assert r['hits'] == 2 * 12, r
    # How far the reader thread gets ahead depends on the machine's load.
    assert 0 <= r['prefetched'] <= (2 * 12 if r['tier'] == 'disk+prefetch' else 0), r
  assert sorted(os.listdir(tmp_path)) == ['bench_autocache.json']  # its caches removed


def test_bench_pipeline_measures_each_plan_that_fits(tmp_path):
  out = _run('bench_pipeline', f'--workdir={tmp_path}', '--layers=2', '--hidden=32',
             '--image-size=8', '--patch-size=4', '--batch=8', '--lengths=1,2,3',
             '--schedules=gpipe,1f1b', '--micro-batches=1', '--repeats=1')
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'skip K=3: does not divide 8 devices' in out.stderr
  rows = json.loads((tmp_path / 'bench_pipeline.json').read_text())['rows']
  assert [(r['pipeline_length'], r['replicas'], r['micro_batches'], r['schedule'])
          for r in rows] == [(1, 8, 1, 'gpipe'), (1, 8, 1, '1f1b'),
                             (2, 4, 2, 'gpipe'), (2, 4, 2, '1f1b')]
  for r in rows:
    sim = schedule.simulate(schedule.make(r['schedule'], r['pipeline_length'],
                                          r['micro_batches']))
    assert r['bubble_fraction'] == sim.bubble_fraction
    assert sum(r['stage_sizes']) == 2 * 2 + 2  # two sub-layers a block, embedding, head
    assert np.isfinite(r['ratio_to_plain_dp']) and r['ratio_to_plain_dp'] > 0


def test_developer_benchmarks_refuse_bad_flags_in_one_line(tmp_path):
  (tmp_path / 'afile').write_text('x')
  cases = [('bench_autocache', ['--batch=0'], '--batch must be at least 1, got 0'),
           ('bench_autocache', [f'--workdir={tmp_path / "afile"}'], 'cannot use --workdir='),
           ('bench_pipeline', ['--lengths=1,x'], '--lengths must be a comma-separated list'),
           ('bench_pipeline', ['--schedules=gpipe,bogus'], "unknown schedule 'bogus'"),
           ('bench_pipeline', ['--patch-size=3'], '--patch-size 3 must divide --image-size 32'),
           ('bench_pipeline', ['--hidden=65'], 'must be a multiple of its 2 attention heads'),
           ('bench_pipeline', ['--micro-batches=0'], '--micro-batches must be'),
           ('bench_pipeline', ['--repeats=0'], '--repeats must be at least 1, got 0'),
           ('bench_pipeline', [f'--workdir={tmp_path / "afile"}'], 'cannot use --workdir='),
           ('bench_pipeline', ['--lengths=3'], 'no row could run')]
  for module, args, message in cases:
    workdir = tmp_path / f'{module}-{len(args[0])}'
    out = _run(module, f'--workdir={workdir}', *args)
    assert out.returncode == 2, (module, args, out.stderr[-2000:])
    last = out.stderr.strip().splitlines()[-1]
    assert 'Traceback' not in out.stderr and message in last, (module, args, out.stderr)
    assert not os.path.exists(workdir / f'{module}.json')


def test_bench_plans_figures_from_the_step_times():
  """4 blocks, epochs at depths 0, 2, 2, 3 (a depth repeated: its step
  counts once per epoch). FLOPs: 16 units at F = 0, 10 at F = 2, 7 at F = 3.
  F = 2 is padded (slower) with a kept slot width."""
  figures = bench_plans.ratios({0: 1.0, 2: 0.6, 3: 0.5}, {2: 0.8}, [0, 2, 2, 3], blocks=4)
  assert figures['ratio_to_baseline'] == pytest.approx({0: 1.0, 2: 0.6, 3: 0.5})
  assert figures['flop_ratio'] == pytest.approx({0: 1.0, 2: 10 / 16, 3: 7 / 16})
  assert figures['predicted'] == pytest.approx((1.0 + 0.6 + 0.6 + 0.5) / 4)
  assert figures['predicted_padded'] == pytest.approx((1.0 + 0.8 + 0.8 + 0.5) / 4)
  assert figures['limit'] == pytest.approx((16 + 10 + 10 + 7) / (4 * 16))
  # Twice the baseline's step: every ratio halves.
  assert bench_plans.ratios({0: 2.0, 2: 0.6, 3: 0.5}, {}, [0, 2, 2, 3], blocks=4)[
      'predicted'] == pytest.approx((2.0 + 0.6 + 0.6 + 0.5) / 8)
