"""The developer benchmarks `bench_autocache`, `bench_loading` and
`bench_pipeline`: a tiny run of each writes the rows it prints, and bad flags
are one line, exit 2, before anything is built or written; `bench_plans`'
figures from its step times."""
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import models
from experiments import bench_cache, bench_plans
from pipejax import schedule
from pipejax.partition import Partition
from pipejax.pipeline import Plan
from tests import fixtures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module, *args, env=None):
  return subprocess.run([sys.executable, '-m', f'experiments.{module}', *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)


def test_bench_autocache_serves_every_read_from_the_cache(tmp_path):
  mine = tmp_path / 'cache-float32-disk'  # a folder of the user's, named as its caches were
  mine.mkdir()
  (mine / 'important.txt').write_text('mine')
  out = _run('bench_autocache', f'--workdir={tmp_path}', '--batch=4', '--seq=3',
             '--hidden=5', '--batches=3')
  assert out.returncode == 0, out.stderr[-2000:]
  assert (mine / 'important.txt').read_text() == 'mine'
  shutil.rmtree(mine)
  rows = json.loads((tmp_path / 'bench_autocache.json').read_text())['rows']
  assert [(r['dtype'], r['tier']) for r in rows] == [
      (d, t) for d in ('float32', 'bfloat16') for t in ('memory', 'disk', 'disk+prefetch')]
  for r in rows:
    # Two read epochs of 12 samples after the write epoch, every read a hit.
    assert r['hits'] == 2 * 12, r
    # How far the reader thread gets ahead depends on the machine's load.
    assert 0 <= r['prefetched'] <= (2 * 12 if r['tier'] == 'disk+prefetch' else 0), r
  assert sorted(os.listdir(tmp_path)) == ['bench_autocache.json']  # its caches removed


@pytest.mark.parametrize('module,args', [
    ('bench_autocache', ['--batches=2']),
    ('bench_loading', ['--images=4', '--batch=2', '--rounds=1']),
    ('bench_pipeline', ['--layers=2', '--hidden=32'])])
def test_a_benchmark_whose_output_path_is_a_folder_is_refused_before_it_runs(tmp_path, module,
                                                                            args):
  (tmp_path / f'{module}.json').mkdir()
  out = _run(module, f'--workdir={tmp_path}', *args)
  assert out.returncode == 2 and out.stderr == (
      f'error: cannot use --workdir={tmp_path}: {tmp_path / f"{module}.json"} is a directory, '
      f'where the run writes its file {module}.json\n')
  assert os.listdir(tmp_path) == [f'{module}.json']


def test_bench_loading_measures_each_preparation_with_one_and_all_workers(tmp_path):
  out = _run('bench_loading', f'--workdir={tmp_path}', '--images=6', '--batch=4',
             '--rounds=1')
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads((tmp_path / 'bench_loading.json').read_text())
  threads = min(32, len(os.sched_getaffinity(0)))
  assert result['default_workers'] == threads and result['same_batches'] is True
  assert [(r['preparation'], r['workers']) for r in result['rows']] == [
      (p, w) for p in ('centre crop', 'ViT processor') for w in sorted({1, threads})]
  for r in result['rows']:
    speed = 6 / r['images_per_second']  # seconds a round, per row
    alone = 6 / next(a['images_per_second'] for a in result['rows']
                     if a['preparation'] == r['preparation'] and a['workers'] == 1)
    assert r['speedup'] == pytest.approx(alone / speed)


def test_bench_loading_compares_every_batch_the_threads_serve(tmp_path, monkeypatch, capsys):
  """Threads that scramble a batch's rows fail the benchmark (exit 1), even
  where the last batch, one image read on the calling thread, is right:
  only that batch was compared."""
  from experiments import bench_loading  # noqa: PLC0415
  from pipejax import data  # noqa: PLC0415
  served = data.TfdsSource.__getitem__

  def scrambled(self, ids):
    out = served(self, ids)
    return {k: v[::-1] for k, v in out.items()} if self.workers > 1 and len(ids) > 1 else out

  monkeypatch.setattr(data.TfdsSource, '__getitem__', scrambled)
  monkeypatch.setattr(bench_loading, 'default_workers', lambda: 2)
  assert bench_loading.main([f'--workdir={tmp_path}', '--images=5', '--batch=4',
                             '--rounds=1']) == 1
  assert json.loads((tmp_path / 'bench_loading.json').read_text())['same_batches'] is False
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      'error: the worker threads served other batches than one thread')


def test_bench_pipeline_measures_each_plan_that_fits(tmp_path):
  out = _run('bench_pipeline', f'--workdir={tmp_path}', '--layers=2', '--hidden=32',
             '--image-size=8', '--patch-size=4', '--batch=8', '--lengths=1,2,3,8',
             '--micro-batches=1', '--repeats=1')  # every schedule, the default
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'skip K=3: does not divide 8 devices' in out.stderr
  assert "skip K=8: more stages than the model's 6 units" in out.stderr
  rows = json.loads((tmp_path / 'bench_pipeline.json').read_text())['rows']
  assert [(r['pipeline_length'], r['replicas'], r['micro_batches'], r['schedule'])
          for r in rows] == [(k, 8 // k, k, name) for k in (1, 2)
                             for name in ('gpipe', '1f1b', '1f1b-fused')]
  for r in rows:
    sim = schedule.simulate(schedule.make(r['schedule'], r['pipeline_length'],
                                          r['micro_batches']))
    assert r['bubble_fraction'] == sim.bubble_fraction
    assert sum(r['stage_sizes']) == 2 * 2 + 2  # two sub-layers a block, embedding, head
    assert np.isfinite(r['ratio_to_plain_dp']) and r['ratio_to_plain_dp'] > 0


def test_developer_benchmarks_refuse_bad_flags_in_one_line(tmp_path):
  (tmp_path / 'afile').write_text('x')
  cases = [('bench_loading', ['--rounds=0'], '--rounds must be at least 1, got 0'),
           ('bench_loading', [f'--workdir={tmp_path / "afile"}'], 'cannot use --workdir='),
           ('bench_autocache', ['--batch=0'], '--batch must be at least 1, got 0'),
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


@pytest.mark.parametrize('module,args,message', [
    ('experiments.bench_elastic', ['--workdir=w', '--repeats=abc'],
     "argument --repeats: invalid int value: 'abc'"),
    ('experiments.bench_cache', ['--repeats=2'], 'the following arguments are required: '
                                                 '--workdir'),
    ('experiments.reproduce', ['--workdir=w', '--only'], 'argument --only: expected one '
                                                         'argument'),
    ('experiments.bench_autocache', ['--workdir=w', '--batch=x'],
     "argument --batch: invalid int value: 'x'"),
    ('experiments.bench_loading', ['--workdir=w', '--images=x'],
     "argument --images: invalid int value: 'x'"),
    ('experiments.bench_pipeline', ['--workdir=w', '--repeats=x'],
     "argument --repeats: invalid int value: 'x'"),
    ('pipejax.plan', ['--model', 'vit-b16', '--devices=x'],
     "argument --devices: invalid int value: 'x'")])
def test_a_flag_argparse_refuses_is_one_line(tmp_path, module, args, message):
  out = subprocess.run([sys.executable, '-m', module, *args], cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 2 and out.stderr == f'error: {message} (--help lists the flags)\n'
  assert os.listdir(tmp_path) == []


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


class _MadeUpFlops:
  """Per-sample FLOPs in which a stage costs the sum of its units'."""
  UNITS = {'embed': (1, 2), 'attention': (10, 30), 'mlp': (20, 50), 'head': (3, 9),
           'mlp_in': (12, 33), 'mlp_out': (8, 17)}

  def forward(self, kinds, samples=1):
    return samples * sum(self.UNITS[k][0] for k in kinds)

  def backward(self, kinds, samples=1):
    return samples * sum(self.UNITS[k][1] for k in kinds)


def _plan(num_layers, frozen, sizes, replicas, micro_batches, name, split=()):
  partition = Partition(num_layers, frozen, sizes, split_mlp=split,
                        mlp_in_keys=('in',) if split else ())
  return Plan(partition, replicas, micro_batches, name)


def test_modeled_step_by_hand():
  """Two plans priced tick by tick by hand (4 samples a micro-batch; with two
  stages each exchange waits for both)."""
  flops = _MadeUpFlops()
  # L = 2, nothing frozen, 1F1B, K = 2: stage 0 = embed, attention 0, MLP 0;
  # stage 1 = attention 1, MLP 1, head. FWD: 4·31 = 124 and 0 (the last
  # stage fuses it); BWD: 4·82 = 328 and 4·89 = 356. The table:
  #   stage 0: F0 F1 .  B0 .  B1      ticks: 124 124 356 328 356 328
  #   stage 1: .  F0 B0 F1 B1 .
  base = _plan(2, 0, (3, 3), 2, 2, '1f1b')
  assert bench_plans.stage_kinds(base.partition) == [('embed', 'attention', 'mlp'),
                                                     ('attention', 'mlp', 'head')]
  cost, prefix = bench_plans.modeled_step(base, flops, 16)
  assert (cost.time, prefix) == (124 + 124 + 356 + 328 + 356 + 328, 0)
  assert cost.work == 2 * (124 + 328) + 2 * (0 + 356)
  assert cost.utilization == pytest.approx(0.5)
  # L = 3, 1 block frozen, GPipe, K = 2, MLP 1 split: stage 0 = attention 1,
  # MLP 1's first half; stage 1 = its second half, attention 2, MLP 2, head.
  # FWD 4·22 = 88 and 0, BWD 4·63 = 252 and 4·106 = 424. The table:
  #   stage 0: F0 F1 .  .  B1 B0      ticks: 88 88 0 424 424 252
  #   stage 1: .  F0 F1 B1 B0 .
  # The frozen prefix (embed and block 0, forward: 31 a sample) computed
  # data-parallel: 16 samples over the plan's R·K = 4 devices.
  frozen = _plan(3, 1, (2, 3), 2, 2, 'gpipe', split=(0,))
  assert bench_plans.stage_kinds(frozen.partition) == [
      ('attention', 'mlp_in'), ('mlp_out', 'attention', 'mlp', 'head')]
  cost, prefix = bench_plans.modeled_step(frozen, flops, 16)
  assert (cost.time, prefix) == (88 + 88 + 0 + 424 + 424 + 252, 31 * 16 / 4)
  cost, prefix = bench_plans.modeled_step(frozen, flops, 16, exchange='all_gather')
  assert (cost.time, prefix) == (1276, 31 * 16 / 4)
  # The run: depths 0, 1, 1.
  figures = bench_plans.model_figures({0: (base, 16), 1: (frozen, 16)}, flops, [0, 1, 1])
  assert figures['ratio'] == pytest.approx({0: 1.0, 1: 1400 / 1616})
  assert figures['ratio_cached'] == pytest.approx({0: 1.0, 1: 1276 / 1616})
  assert figures['predicted'] == pytest.approx((1 + 2 * 1400 / 1616) / 3)
  assert figures['predicted_cached'] == pytest.approx((1 + 2 * 1276 / 1616) / 3)
  assert figures['utilization'][0] == pytest.approx(0.5)
  with pytest.raises(ValueError, match='needs the baseline'):
    bench_plans.model_figures({1: (frozen, 16)}, flops, [1])


def test_model_figures_follow_the_exchange():
  """Three stages, where the exchanges differ (with two they agree), priced
  tick by tick by hand: GPipe, M = 2, 4 samples a micro-batch, R = 1. Under
  ``all_gather`` a tick lasts its slowest op; under ``ppermute`` a stage ends
  tick t at max(its own, its neighbours' ends of tick t − 1) + its op."""
  flops = _MadeUpFlops()
  # L = 3, nothing frozen: stages embed+block 0, block 1, block 2+head.
  # FWD 124, 120, 0; BWD 328, 320, 356. The table (F, B, .):
  #   stage 0: F0 F1 .  .  .  .  B1 B0
  #   stage 1: .  F0 F1 .  .  B1 B0 .
  #   stage 2: .  .  F0 F1 B1 B0 .  .
  # all_gather: 124 124 120 0 356 356 328 328 = 1736. ppermute, each stage's
  # ends per tick: stage 0 124 248 248 368 368 368 1372 1728; stage 1 0 244
  # 368 368 368 1044 1400 1400; stage 2 0 0 244 368 724 1080 1080 1400.
  base = _plan(3, 0, (3, 2, 3), 1, 2, 'gpipe')
  # 1 block frozen: stages block 1, attention 2, MLP 2+head. FWD 120, 40, 0;
  # BWD 320, 120, 236. all_gather: 120 120 40 0 236 236 320 320 = 1392.
  # ppermute: stage 0 ends 120 240 240 280 280 280 956 1276. The prefix
  # (embed and block 0, 31 a sample): 8 samples over 3 devices.
  frozen = _plan(3, 1, (2, 1, 2), 1, 2, 'gpipe')
  assert bench_plans.stage_kinds(frozen.partition) == [('attention', 'mlp'), ('attention',),
                                                       ('mlp', 'head')]
  plans, prefix = {0: (base, 8), 1: (frozen, 8)}, 31 * 8 / 3
  work = {0: 2 * (124 + 328 + 120 + 320 + 356), 1: 2 * (120 + 320 + 40 + 120 + 236)}
  for exchange, times in (('ppermute', {0: 1728, 1: 1276}),
                          ('all_gather', {0: 1736, 1: 1392})):
    figures = bench_plans.model_figures(plans, flops, [0, 1], exchange)
    assert figures['ratio'] == pytest.approx({0: 1.0, 1: (times[1] + prefix) / times[0]})
    assert figures['ratio_cached'] == pytest.approx({0: 1.0, 1: times[1] / times[0]})
    assert figures['utilization'] == pytest.approx({f: work[f] / (3 * times[f]) for f in (0, 1)})
    assert figures['predicted_cached'] == pytest.approx((1 + times[1] / times[0]) / 2)


@pytest.mark.parametrize('kind,tokens,mlp_backward', [('vit', 5, 2.5),
                                                      ('bert-classification', 8, 3.0)])
def test_stage_flops_count_the_dense_layers(kind, tokens, mlp_backward):
  """Against the dense layers' FLOPs by hand (2 per multiply-add, per token;
  a model wide enough for them to dominate): a unit's forward at least them.
  The MLP's backward, with the recomputed forward, in halves of its dense
  FLOPs (each dense layer is one half): the first layer recomputed, the
  gradients of both weights, of the inner activation and of the input, 2.5;
  BERT normalises after the residual, so its second layer is recomputed too,
  3.0. A stage's forward is about its units', an MLP's its halves'. The
  embedding's backward (its parameters only) is not folded away."""
  overrides = dict(fixtures.TINY['vit' if kind == 'vit' else 'bert'], hidden_size=64,
                   intermediate_size=256, num_hidden_layers=1)
  created = models.create(kind, models.config_for(kind, **overrides), seed=0)
  d, inner = 64, 256
  flops = bench_plans.StageFlops(created.model, created.params,
                                 fixtures.batch(kind, created.model, 2, seq_len=tokens))
  attention = tokens * 2 * (4 * d * d) + 2 * (2 * tokens * tokens * d)  # q, k, v, out; scores
  mlp = tokens * 2 * (2 * d * inner)
  assert attention <= flops.forward(('attention',)) < 1.5 * attention
  assert 2 * attention <= flops.backward(('attention',)) < 4 * attention
  assert mlp <= flops.forward(('mlp',)) < 1.5 * mlp
  assert mlp_backward * mlp <= flops.backward(('mlp',)) < 4.5 * mlp
  one = {k: flops.forward((k,)) for k in ('embed', 'attention', 'mlp', 'mlp_in', 'mlp_out')}
  # XLA may fuse a cheap op into two consumers and run it twice: a stage costs
  # its units' sum or somewhat more.
  parts = one['embed'] + one['attention'] + one['mlp']
  assert parts <= flops.forward(('embed', 'attention', 'mlp')) < 1.25 * parts
  assert one['mlp'] == pytest.approx(one['mlp_in'] + one['mlp_out'], rel=0.01)
  assert flops.backward(('embed',)) > 0
  assert flops.backward(('head',)) > flops.forward(('head',)) > 0
  assert set(flops.table()['embed+attention+mlp']) == {'forward'}


def test_stage_times_time_the_programs_the_flops_count_on_each_micro_batch():
  """``StageTimes`` runs the programs whose FLOPs ``StageFlops`` counts (on
  one sample, the same count), on the micro-batch's samples (XLA's count
  grows with them about in proportion: a few ops are per batch); the
  timed model times every stage of every plan once, together, and prices
  the plans with those seconds."""
  created = fixtures.tiny('vit', num_layers=3)
  batch = fixtures.batch('vit', created.model, 4, seed=0)
  flops = bench_plans.StageFlops(created.model, created.params, batch)
  times = bench_plans.StageTimes(created.model, created.params, batch, repeats=2, rounds=2)
  for kinds in (('embed', 'attention', 'mlp'), ('attention', 'mlp', 'head')):
    for backward in (False, True):
      if kinds[-1] == 'head' and not backward:
        continue
      def counted(samples):
        run, args = times.program(kinds, backward, samples)
        return run.lower(*args).compile().cost_analysis()['flops']
      per_sample = (flops.backward if backward else flops.forward)(kinds)
      assert counted(1) == per_sample, (kinds, backward)
      assert 5.5 * per_sample < counted(6) < 6.5 * per_sample  # more than the batch: repeated
  base = Plan(Partition(3, 0, (3, 2, 3)), 1, 2, 'gpipe')
  frozen = Plan(Partition(3, 1, (2, 1, 2)), 1, 2, 'gpipe')
  figures = bench_plans.timed_model_figures({0: (base, 8), 1: (frozen, 8)}, times, [0, 1])
  assert set(times.table()) == {
      'embed+attention+mlp x4', 'attention+mlp x4', 'attention+mlp+head x4', 'attention x4',
      'mlp+head x4', 'embed+attention+mlp x3'}  # the prefix: 8 samples over 3 devices
  assert times.table()['attention+mlp+head x4'] == {'backward': pytest.approx(
      times.backward(('attention', 'mlp', 'head'), 4))}
  assert times.floor > 0 and all(v >= 0 for c in times.table().values() for v in c.values())
  assert figures['ratio'][0] == 1.0 and figures['ratio'][1] > figures['ratio_cached'][1] > 0
  assert 0 < figures['utilization'][0] <= 1


def test_fastest_seconds_is_the_shortest_call():
  ticks = iter([0.0, 0.5, 1.0, 1.2, 2.0, 2.9])  # calls of 0.5, 0.2 and 0.9 s
  assert bench_plans.fastest_seconds(lambda: None, 3, clock=lambda: next(ticks)) == \
      pytest.approx(0.2)


def test_stage_flops_refuse_a_backend_without_cost_analysis(monkeypatch):
  created = fixtures.tiny('vit')
  flops = bench_plans.StageFlops(created.model, created.params,
                                 fixtures.batch('vit', created.model, 2))
  assert flops.device == jax.devices('cpu')[0]
  monkeypatch.setattr(jax.stages.Compiled, 'cost_analysis', lambda self: {})
  with pytest.raises(ValueError, match=r'^XLA reports no FLOPs for a stage of attention\+mlp '
                                       r'on cpu: the model needs its cost analysis$'):
    flops.backward(('attention', 'mlp'))


def test_stage_flops_are_counted_on_a_cpu_device_where_there_is_one(monkeypatch):
  """XLA's GPU cost analysis misses the matrix products cuBLAS runs, so the
  FLOPs come from a CPU device; a process without one (JAX_PLATFORMS) uses
  its default backend's first device."""
  created = fixtures.tiny('vit')
  batch = fixtures.batch('vit', created.model, 2)
  second = jax.devices('cpu')[1]
  assert bench_plans.StageFlops(created.model, created.params, batch,
                                device=second).device == second
  devices = jax.devices

  def no_cpu(backend=None):
    if backend == 'cpu':
      raise RuntimeError('Unknown backend cpu')
    return devices(backend)
  monkeypatch.setattr(jax, 'devices', no_cpu)
  flops = bench_plans.StageFlops(created.model, created.params, batch)
  assert flops.device == devices()[0] and flops.forward(('attention',)) > 0


_REPORT = """\
# Samples: 1K of event 'cpu-clock:ppp'
#
# Overhead  Shared Object      Symbol
# ........  .................  ......
#
    30.00%  [kernel.kallsyms]  [k] finish_task_switch.isra.0
     5.00%  [kernel.kallsyms]  [k] futex_wake
     2.50%  [kernel.kallsyms]  [k] irqentry_exit_to_user_mode
    12.00%  [JIT] tid 4242     [.] 0x00007f10aa00beef
     8.00%  libjax_common.so   [.] ynn::dot_fp32_5x64x1_1x16x1_avx512
     4.00%  libjax_common.so   [.] Eigen::internal::gemm_pack_colmajor_block<float, long>
     6.00%  libc.so.6          [.] __memmove_avx512_unaligned_erms
     3.00%  libc.so.6          [.] _int_malloc
     9.00%  libjax_common.so   [.] xla::cpu::ThunkExecutor::Execute<Fifo>
     7.00%  libjax_common.so   [.] absl::Mutex::lock
     1.50%  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault
     0.50%  [vdso]             [.] __vdso_clock_gettime
# a comment line: 99.00%  libc.so.6  [.] malloc
"""


def test_perf_categories_split_a_report_by_what_the_cpu_did():
  shares = bench_plans.perf_categories(_REPORT)
  assert list(shares) == list(bench_plans.PERF_CATEGORIES)
  assert shares == pytest.approx({'kernels': 12 + 8 + 4, 'OS scheduling': 30 + 5,
                                  'OS other': 2.5, 'memory': 6 + 3, 'XLA runtime': 9 + 7,
                                  'other': 1.5 + 0.5})
  assert bench_plans.perf_categories('# nothing sampled\n') == dict.fromkeys(
      bench_plans.PERF_CATEGORIES, 0.0)


def test_cpu_and_switches_count_every_thread_of_this_process():
  """Another thread sleeps 100 times (a switch each) while this one waits
  once: the process's count grows by about 100 more than this thread's own."""
  import threading  # noqa: PLC0415

  def own_switches():
    with open('/proc/thread-self/status', encoding='ascii') as f:
      return sum(int(line.split()[1]) for line in f if 'ctxt_switches:' in line)

  done, release = threading.Event(), threading.Event()

  def partner():
    for _ in range(100):
      time.sleep(0.001)
    done.set()
    release.wait()  # alive at the second reading: its switches still count

  thread = threading.Thread(target=partner)
  mine, (cpu, switches) = own_switches(), bench_cache.cpu_and_switches()
  thread.start()
  done.wait()
  busy = sum(range(3_000_000))  # CPU time of this thread
  after, mine_after = bench_cache.cpu_and_switches(), own_switches()
  release.set()
  thread.join()
  assert busy > 0 and after[0] > cpu
  # At least half of the partner's switches (a loaded machine merged a few,
  # 99 of 100 once); this thread's own count alone would give none.
  assert (after[1] - switches) - (mine_after - mine) >= 50


def _fake_perf(tmp_path, record_fails=False, report_fails=False, fail_from=0, report=_REPORT):
  """A ``perf`` that records its arguments until SIGINT and reports
  ``report``, or fails as told (``fail_from``: its records from that one on,
  counting from 1). It is a Python script, not a shell one: a shell cannot
  trap a SIGINT that it inherited ignored, as every command started in the
  background by a shell without job control (``cmd &`` in a script) does,
  while Python, like the real perf, installs its handler regardless."""
  script = tmp_path / 'perf'
  count = tmp_path / 'perf-records'
  # -IS: the standard library alone, which starts in about 10 ms (bench_plans
  # signals it half a second after starting it).
  script.write_text(f"""#!{sys.executable} -IS
import os, signal, sys, time
args = sys.argv[1:]
if args[0] == 'record':
  with open({str(count)!r}, 'a') as f:
    f.write('\\n')
  with open({str(count)!r}) as f:
    records = len(f.readlines())
  if {record_fails!r} or 0 < {fail_from!r} <= records:
    print('Error: no access to perf events (kernel.perf_event_paranoid=4)', file=sys.stderr)
    sys.exit(255)
  out = args[args.index('-o') + 1]
  def stop(signum, frame):
    with open(out, 'w') as f:
      f.write(' '.join(args) + '\\n')
    os._exit(0)
  signal.signal(signal.SIGINT, stop)
  while True:
    time.sleep(0.02)
if {report_fails!r}:
  print(f'failed to open {{args[2]}}: No such file', file=sys.stderr)
  sys.exit(1)
sys.stdout.write({report!r})
""")
  script.chmod(0o755)
  return str(script)


def test_perf_profile_samples_this_process_while_the_steps_run(tmp_path):
  calls = []
  path = str(tmp_path / 'perf-F0.data')
  shares = bench_plans.perf_profile(lambda: calls.append(time.sleep(0.01)), 0.3, path,
                                    perf=_fake_perf(tmp_path))
  assert shares == bench_plans.perf_categories(_REPORT)
  assert 1 <= len(calls) <= 31  # run until 0.3 s had passed, each call 10 ms or more
  recorded = open(path).read().split()  # what `perf record` was asked
  assert recorded[recorded.index('-p') + 1] == str(os.getpid())
  assert recorded[recorded.index('-o') + 1] == path


def test_perf_profile_says_in_one_line_why_perf_failed(tmp_path):
  calls = []
  with pytest.raises(bench_plans.PerfError, match=r'^perf record failed: Error: no access '
                     r'to perf events \(kernel.perf_event_paranoid=4\)$'):
    bench_plans.perf_profile(lambda: calls.append(1), 0.1, str(tmp_path / 'a.data'),
                             perf=_fake_perf(tmp_path, record_fails=True))
  assert not calls  # no step ran unsampled
  with pytest.raises(bench_plans.PerfError, match=r'^perf report failed: failed to open '):
    bench_plans.perf_profile(lambda: None, 0.1, str(tmp_path / 'b.data'),
                             perf=_fake_perf(tmp_path, report_fails=True))


def test_each_plan_is_profiled_alone_and_a_perf_failure_keeps_no_part(tmp_path, capsys):
  ran = []
  profiles, error = bench_plans.profile_plans([0, 4], ran.append, str(tmp_path),
                                              perf=_fake_perf(tmp_path), seconds=0.05)
  assert error is None and list(profiles) == [0, 4] and set(ran) == {0, 4}
  assert ran == sorted(ran)  # depth 0's steps all ran before depth 4's
  assert profiles[4] == bench_plans.perf_categories(_REPORT)
  assert os.path.exists(tmp_path / 'perf-F4.data') and 'warning' not in capsys.readouterr().err
  # The second record fails: no profile is half-reported.
  (tmp_path / 'perf-records').unlink()
  profiles, error = bench_plans.profile_plans([0, 4, 6], ran.append, str(tmp_path),
                                              perf=_fake_perf(tmp_path, fail_from=2),
                                              seconds=0.05)
  assert profiles == {} and error.startswith('perf record failed: Error: no access')


def test_a_profile_without_os_samples_is_flagged(tmp_path, capsys):
  user_only = ''.join(line + '\n' for line in _REPORT.splitlines() if '[k]' not in line)
  profiles, error = bench_plans.profile_plans(
      [0], lambda f: None, str(tmp_path), perf=_fake_perf(tmp_path, report=user_only),
      seconds=0.05)
  assert error is None and profiles[0]['OS scheduling'] == profiles[0]['OS other'] == 0
  assert profiles[0]['kernels'] == 24
  assert capsys.readouterr().err.strip() == (
      'warning: perf sampled no OS kernel code (kernel.perf_event_paranoid above 1 allows '
      'user space only): the OS columns read 0')


def test_bench_plans_perf_needs_perf_before_anything_is_built(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(bench_plans.shutil, 'which', lambda name: None)
  assert bench_plans.main(['bench_plans', f'--workdir={tmp_path / "w"}', '--perf']) == 2
  assert capsys.readouterr().err.strip() == (
      'error: --perf needs Linux perf on the PATH (e.g. the linux-perf package)')
  assert not os.path.exists(tmp_path / 'w')


def test_bench_plans_reports_cpu_switches_and_the_perf_profile(tmp_path):
  """A 3-epoch schedule (3 plans) with a fake ``perf`` first on the PATH:
  each row has its CPU time and switches a step, and the fake's profile;
  then with a ``perf`` that fails."""
  _fake_perf(tmp_path)
  env = {**os.environ, 'PATH': f'{tmp_path}{os.pathsep}{os.environ["PATH"]}'}
  workdir = tmp_path / 'w'
  out = _run('bench_plans', f'--workdir={workdir}', '--perf', '--config.train.epochs=3',
             env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads((workdir / 'bench_plans.json').read_text())
  rows = result['rows']
  assert [r['frozen_layers'] for r in rows] == result['frozen_per_epoch'] == [0, 4, 6]
  for r in rows:
    # 8 device threads on the machine's cores: more CPU than nothing, and
    # every step's collectives block and wake threads.
    assert r['cpu_seconds_per_step'] > 0 and r['context_switches_per_step'] > 8, r
    assert r['cpu_profile_percent'] == bench_plans.perf_categories(_REPORT)
    assert (workdir / f'perf-F{r["frozen_layers"]}.data').exists()
  assert 'CPU profile (perf record' in out.stdout
  # The ideal-device model beside the measurement: every stage of every plan
  # priced, forward and backward, and the frozen prefixes forward.
  flops = result['stage_flops_per_sample']
  assert result['model_exchange'] == 'ppermute'
  assert {'embed+' + '+'.join(['attention', 'mlp'] * f) for f in (4, 6)} <= set(flops)
  assert all(v > 0 for costs in flops.values() for v in costs.values()), flops
  stages = [k for k, costs in flops.items() if 'backward' in costs]
  assert any(k.startswith('embed+') for k in stages) and any(k.endswith('+head') for k in stages)
  assert rows[0]['model_ratio'] == rows[0]['model_ratio_cached'] == 1.0
  for r in rows[1:]:  # a cached prefix only saves
    assert 0 < r['model_ratio_cached'] < r['model_ratio'] < 1, r
  assert result['model_train_ratio'] == pytest.approx(np.mean([r['model_ratio'] for r in rows]))
  assert result['model_train_ratio_cached'] == pytest.approx(
      np.mean([r['model_ratio_cached'] for r in rows]))
  assert 'model (ideal parallel devices, ppermute exchanges' in out.stdout
  # perf failing at the third plan: the step times are still written, no
  # profile is, and the run ends with one line and exit 2.
  (tmp_path / 'perf-records').unlink()
  _fake_perf(tmp_path, fail_from=3)
  again = tmp_path / 'again'
  out = _run('bench_plans', f'--workdir={again}', '--perf', '--config.train.epochs=3', env=env)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == (
      'error: perf record failed: Error: no access to perf events '
      '(kernel.perf_event_paranoid=4) (the step times are written; no CPU profile)')
  rows = json.loads((again / 'bench_plans.json').read_text())['rows']
  assert [r['frozen_layers'] for r in rows] == [0, 4, 6]
  assert all(r['cpu_profile_percent'] is None and r['step_seconds'] > 0 for r in rows)
  assert 'CPU profile (perf record' not in out.stdout


def test_bench_plans_help_names_its_flags():
  out = _run('bench_plans', '--help')
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.startswith('usage: python -m experiments.bench_plans --workdir=DIR [--perf] '
                               '[--timed-model] [--model-only] [--config=FILE]')
  for flag, what in bench_plans.OWN_FLAGS:
    assert f'  {flag:<15} {what}' in out.stdout.splitlines()


def test_bench_plans_model_only_with_stage_times(tmp_path, capsys):
  """``--model-only --timed-model``: the plans of a 3-epoch schedule, each
  priced by the FLOP model and by the timed one, no step timed; ``--perf``
  beside ``--model-only`` is refused before anything is built."""
  workdir = tmp_path / 'w'
  out = _run('bench_plans', f'--workdir={workdir}', '--model-only', '--timed-model',
             '--config.train.epochs=3')
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads((workdir / 'bench_plans.json').read_text())
  assert result['model_only'] is True and result['plan_devices'] == '8 cpu'
  rows = result['rows']
  assert [r['frozen_layers'] for r in rows] == result['frozen_per_epoch'] == [0, 4, 6]
  assert all('step_seconds' not in r for r in rows)
  assert rows[0]['timed_model_ratio'] == rows[0]['model_ratio'] == 1.0
  for r in rows[1:]:
    assert r['timed_model_ratio'] > r['timed_model_ratio_cached'] > 0, r
    assert r['flop_ratio'] == (4 * (12 - r['frozen_layers']) + r['frozen_layers']) / 48
  assert result['timed_model_train_ratio'] == pytest.approx(
      np.mean([r['timed_model_ratio'] for r in rows]))
  assert result['timed_model_device'].startswith('cpu:0 ')
  timed = result['stage_seconds']
  assert {'embed+' + '+'.join(['attention', 'mlp'] * f) + ' x4' for f in (4, 6)} <= set(timed)
  assert 'timed model (stage times on cpu device 0' in out.stdout
  assert bench_plans.main(['bench_plans', f'--workdir={tmp_path / "v"}', '--perf',
                           '--model-only']) == 2
  assert capsys.readouterr().err.strip() == (
      'error: --perf profiles the measured steps, which --model-only leaves out')
  assert not os.path.exists(tmp_path / 'v')
  out = _run('bench_plans', f'--workdir={tmp_path / "v"}', '--model-only',
             '--config.train.batch_mode=per_pipeline')
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
      'error: bench_plans takes train.batch_mode=constant only'), out.stderr[-2000:]
  assert not os.path.exists(tmp_path / 'v')
