"""The paper's performance analysis, side by side on this machine:
``python -m experiments.reproduce --workdir DIR [--only NAME[,NAME]]
[--variants NAME[,NAME]] [--config FILE] [--config.KEY=VALUE ...]``
(``--variants``: the breakdown's variants to run; ``baseline`` always runs).

Parts (each writes ``DIR/<part>.json`` and ``DIR/<part>.png``):

* ``breakdown`` (paper Fig. 9) — ``baseline`` (no freezing, static pipeline
  of the starting length), ``freeze`` (freezing; the pipeline keeps its
  length, AutoPipe only rebalances the active layers over it, and at least
  ⌈(K−1)/2⌉ blocks keep training so that every stage has a unit), ``freeze+autopipe``
  (+ compression K → K/2; the freed devices idle), ``freeze+autopipe+autodp``
  (+ replicas on the freed devices), ``full`` (+ AutoCache), and ``plain_dp``
  (the same HF Flax ViT with plain ``jax.jit`` data parallelism,
  ``experiments.plain_dp``).
* ``alpha`` (Fig. 10a) — ``full`` at α ∈ {0.1, 0.2, 1/3, 0.5}: speed-up over
  ``baseline`` and accuracy.
* ``microbatches`` (Fig. 10b) — train-step throughput for M ∈ {K, …, 6K}
  (those that divide a replica's batch) at every pipeline length the freeze
  schedule reaches.
* ``transitions`` (Table 4) — the ``full`` run's transitions: compile wait,
  reshard, cache and total seconds (the transition itself), and beside them
  the next epoch's first-step warm-up and micro-batch search.
* ``table1`` (Table 1) — ``baseline`` and ``full`` over seeds 0, 1, 2:
  accuracy and time, mean ± std.

The main job's own checks of the ``--config`` arguments run first (in a
child), so a value the runs would refuse is refused before DIR is written.
Every run is a fresh process on the same machine, one after the other, with
the main job's config (``experiments.vit_imagenet``: the embedded default
unless ``--config``/overrides say otherwise, passed to every run; an override
of what a part varies, ``freeze.alpha`` with ``alpha`` or ``seed`` with
``table1``, is refused; a ``--config`` file's own seed, or an α that is
another point of ``alpha``, is never run twice: ``table1`` takes the next
seeds, the file's run serves its α's point and ``alpha`` runs 1/3 itself; an
α that is no point is one more row of ``alpha``) and
checkpoints off (``plain_dp`` writes none). Runs that parts share (e.g. the
seed-0 ``full`` run) run once. ``--compile-cache warm`` (default) gives the
runs a persistent compilation cache, program store, initialisation cache and
M-profile in DIR, filled by one unreported run of each configuration first (a
user's second run);
``shared`` the same caches without the unreported runs (cheaper; a run may
find programs an earlier one compiled); ``cold`` gives every run empty ones (a
first run: compiling and profiling are paid in full).

Reported times are end to end inside the process (``total_seconds``: data,
model, compiling, training, transitions, evaluation after every epoch; not
the Python imports). ``flop_limit_speedup`` is what the run's freeze schedule
allows: per sample, a trained block costs 4 units (forward, recomputed
forward, backward; 3 in ``plain_dp``, which does not recompute), a frozen
block 1 (its forward), a frozen block served by the cache 0 (the cache's own
layer passes are counted); the baseline trains all blocks. ``efficiency`` =
measured speed-up / that limit (the speed-up per sample: the same as end to
end unless ``train.batch_mode=per_pipeline`` made a run train more samples,
``samples_trained``). Beside each time: the process's CPU seconds
(all its threads, from start to exit) and context switches (``getrusage``),
which show where a run's time is not its arithmetic (``docs/results.md``).
"""
from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

from experiments.bench_cache import (claim_checked_workdir, cpu_and_switches, fail,
                                     freezes_nothing, run_child, stop_children_on_sigterm)
from pipejax import runtime

PARTS = ('breakdown', 'alpha', 'microbatches', 'transitions', 'table1')
MAIN, PLAIN = 'experiments.vit_imagenet', 'experiments.plain_dp'
NO_CACHE = ['--config.cache.enabled=False']
BREAKDOWN = {
    'baseline': (MAIN, ['--config.freeze.policy=none'] + NO_CACHE),
    'freeze': (MAIN, ['--config.freeze.compress=False', '--config.pipeline.autodp=False']
               + NO_CACHE),
    'freeze+autopipe': (MAIN, ['--config.pipeline.autodp=False'] + NO_CACHE),
    'freeze+autopipe+autodp': (MAIN, NO_CACHE),
    'full': (MAIN, []),
    'plain_dp': (PLAIN, []),
}
ALPHAS = (0.1, 0.2, 1 / 3, 0.5)
SEEDS = (0, 1, 2)
TARGETS = {'full_vs_baseline': 2.5, 'full_vs_plain_dp': 1.3, 'accuracy_points': 1.0}


# -- running ---------------------------------------------------------------------
class Runner:
  """Runs the main job (or ``plain_dp``) in fresh processes; each distinct
  command once per invocation."""

  def __init__(self, workdir: str, passthrough: list[str], compile_cache: str,
               variants: tuple[str, ...] = tuple(BREAKDOWN)):
    self.workdir, self.passthrough, self.compile_cache = workdir, passthrough, compile_cache
    self.variants = variants  # those the breakdown runs
    self.results: dict[tuple, dict] = {}

  def caches(self, workdir: str) -> tuple[dict, str]:
    """``(environment, micro-batch profile path)`` of a child run in
    ``workdir``: every cache a run reads is DIR's (or the run's own, cold),
    never the user's ~/.cache/pipejax: what a run pays must not depend on
    their history."""
    env = dict(os.environ)
    if self.compile_cache in ('warm', 'shared'):
      env['PIPEJAX_COMPILATION_CACHE'] = os.path.join(self.workdir, 'jax-cache')
      env['PIPEJAX_PROGRAM_STORE'] = os.path.join(self.workdir, 'programs')
      env['PIPEJAX_INIT_CACHE'] = os.path.join(self.workdir, 'init')
      return env, os.path.join(self.workdir, 'micro_batches.json')
    env['PIPEJAX_COMPILATION_CACHE'] = workdir + '.jax-cache'
    env['PIPEJAX_PROGRAM_STORE'] = workdir + '.programs'
    env['PIPEJAX_INIT_CACHE'] = workdir + '.init'
    return env, workdir + '.micro_batches.json'

  def _process(self, name: str, module: str, args: list[str]) -> tuple[str, float, dict]:
    workdir = os.path.join(self.workdir, 'runs', name)
    env, profile = self.caches(workdir)
    cmd = [sys.executable, '-m', module, f'--workdir={workdir}', *self.passthrough, *args,
           '--config.checkpoint.enabled=False', f'--config.pipeline.profile_path={profile}']
    start = time.perf_counter()
    proc, usage = run_measured(cmd, env)
    if proc.returncode:
      tail = (proc.stderr.strip().splitlines() or ['(no output)'])[-1]
      fail(f'error: run {name!r} failed ({" ".join(cmd)}): {tail}')
    return workdir, time.perf_counter() - start, usage

  def run(self, name: str, module: str, args: list[str]) -> dict:
    """The summary and rows of ``module`` with ``args`` (run now or earlier)."""
    key = (module, tuple(args))
    if key not in self.results:
      self.results[key] = self._execute(name, module, args)
    return self.results[key]

  def _execute(self, name: str, module: str, args: list[str]) -> dict:
    if self.compile_cache == 'warm':
      print(f'  {name}: warm-up run (not reported) ...', flush=True)
      self._process(f'warmup-{name}', module, args)
    print(f'  {name} ...', flush=True)
    workdir, seconds, usage = self._process(name, module, args)
    with open(os.path.join(workdir, 'summary.json')) as f:
      summary = json.load(f)
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      rows = [json.loads(line) for line in f]
    print(f'  {name}: {summary["total_seconds"]:.1f}s, accuracy '
          f'{summary["final_eval_accuracy"]:.4f}', flush=True)
    return {'name': name, 'summary': summary, 'rows': rows, 'process_seconds': seconds,
            'process_cpu_seconds': usage['cpu_seconds'],
            'process_context_switches': usage['context_switches']}

  def variant(self, name: str, extra: list[str] = ()) -> dict:
    module, args = BREAKDOWN[name]
    return self.run(name, module, args + list(extra))


def run_measured(cmd: list[str], env: dict | None = None
                 ) -> tuple[subprocess.CompletedProcess, dict]:
  """:func:`run_child`, and the CPU seconds and context switches the child
  used: all its threads, and any process of its own that it waited for
  (``getrusage`` of this process's reaped children, so run one child at a
  time)."""
  cpu, switches = cpu_and_switches(resource.RUSAGE_CHILDREN)
  proc = run_child(cmd, env=env)
  cpu_after, switches_after = cpu_and_switches(resource.RUSAGE_CHILDREN)
  return proc, {'cpu_seconds': cpu_after - cpu, 'context_switches': switches_after - switches}


# -- figures of merit ---------------------------------------------------------------
def samples_trained(summary: dict, rows: list[dict]) -> list[int]:
  """Samples trained in each epoch (steps × global batch; ``plain_dp``'s global
  batch is ``train.batch_size`` in either batch mode)."""
  train = summary['config']['train']
  per_pipeline = train['batch_mode'] == 'per_pipeline' and summary.get('mode') != 'plain_dp'
  out, step = [], 0
  for row in rows:
    per_step = train['batch_size'] * (row['replicas'] if per_pipeline else 1)
    out.append((row['step'] - step) * per_step)
    step = row['step']
  return out


def flop_limit_speedup(summary: dict, rows: list[dict], cache_free: bool = False) -> float:
  """Baseline block work / this run's (see the module docstring). Each
  stretch of steps is priced at the depth and cache it ran with, from the
  transitions' steps (a freeze event may end an epoch before its row is
  written, or fall inside one with ``freeze.timestep_steps``); a summary
  without transitions prices each epoch at its row's. ``cache_free``: as if
  no depth were served by the cache (frozen blocks cost their forward)."""
  blocks = summary['num_layers']
  trained = 3 if summary.get('mode') == 'plain_dp' else 4  # plain_dp does not recompute
  samples = samples_trained(summary, rows)
  events = sorted((t['step'], t['frozen_layers'], t.get('cache'))
                  for t in summary.get('transitions', []))
  passes_before = step_before = 0
  baseline = work = 0.0
  for row, n in zip(rows, samples, strict=True):
    row_cache = bool(row.get('cache')) and not cache_free
    steps = row['step'] - step_before
    if events:  # (steps, depth, cached) stretches of this epoch, from the events
      depth, cached, start, stretches = 0, False, step_before, []
      for at, new_depth, new_cache in events:
        if at >= row['step']:
          break  # from the end of this epoch on: the next epoch's
        if at > step_before:
          stretches.append((at - start, depth, cached))
          start = at
        depth = new_depth
        cached = not cache_free and (row_cache if new_cache is None else new_cache)
      stretches.append((row['step'] - start, depth, cached))
    else:
      stretches = [(steps, row['frozen_layers'], row_cache)]
    passes = row.get('cache_layer_passes', 0)
    per_step = n / steps if steps else 0.0
    for count, depth, cached in stretches:
      work += trained * (blocks - depth) * count * per_step
      if not cached:
        work += depth * count * per_step  # the frozen prefix, computed
    if any(cached for _, _, cached in stretches):
      work += passes - passes_before  # the cache's own layer passes
    baseline += 4 * blocks * n
    passes_before, step_before = passes, row['step']
  return baseline / work if work else 1.0


def describe_run(result: dict, reference: dict | None) -> dict:
  """One table row: time, accuracy, throughput, limits, and where the time went.

  ``speedup`` is end to end (the reference's total time over this run's);
  ``efficiency`` divides the speed-up per sample by the FLOP limit, which is
  per sample: the two differ where the runs trained different numbers of
  samples (``train.batch_mode=per_pipeline``, whose batch grows with R)."""
  s, rows = result['summary'], result['rows']
  total = s['total_seconds']
  limit = flop_limit_speedup(s, rows)
  samples = sum(samples_trained(s, rows))
  speedup = reference['summary']['total_seconds'] / total if reference else None
  epochs = sum(r['epoch_seconds'] for r in rows)
  train_speedup = (sum(r['epoch_seconds'] for r in reference['rows']) / epochs
                   if reference else None)
  # This run's samples per sample of the reference's (1 for the same schedule of batches).
  more = samples / sum(samples_trained(reference['summary'], reference['rows'])) \
      if reference else None
  return {
      'total_seconds': total, 'final_eval_accuracy': s['final_eval_accuracy'],
      'samples_trained': samples, 'samples_per_second': samples / total,
      'flop_limit_speedup': limit, 'speedup': speedup,
      'efficiency': speedup * more / limit if speedup else None,
      'train_speedup': train_speedup,
      'train_efficiency': train_speedup * more / limit if train_speedup else None,
      # Where the time went (seconds).
      'epochs_seconds': epochs,
      'transition_seconds': sum(r['transition_seconds'] for r in rows),
      'eval_seconds': sum(r.get('eval_seconds', 0.0) for r in rows),
      'startup_seconds': total - s['train_seconds'],
      'frozen_layers': [r['frozen_layers'] for r in rows],
      'pipeline_length': [r['pipeline_length'] for r in rows],
      'replicas': [r['replicas'] for r in rows],
      'cache': [bool(r.get('cache')) for r in rows],
      'process_seconds': result['process_seconds'],
      'process_cpu_seconds': result['process_cpu_seconds'],
      'process_context_switches': result['process_context_switches'],
  }


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
  """Prints ``rows`` with ``(key, header, format)`` columns."""
  print('  '.join(f'{h:>{max(len(h), 8)}}' for _, h, _ in columns))
  for r in rows:
    cells = []
    for key, h, fmt in columns:
      v = r.get(key)
      cells.append(f'{("-" if v is None else format(v, fmt)):>{max(len(h), 8)}}')
    print('  '.join(cells))


def _write(workdir: str, name: str, payload: dict) -> None:
  with open(os.path.join(workdir, f'{name}.json'), 'w') as f:
    json.dump({'command': ' '.join(sys.argv), 'machine': machine(), **payload}, f, indent=2)


def machine() -> str:
  import platform  # noqa: PLC0415
  return f'{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}'


def _figure(workdir: str, name: str, draw) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6.4, 3.4))
  draw(ax)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, f'{name}.png'), dpi=80)
  plt.close(fig)


# -- parts ------------------------------------------------------------------------
#: Why accuracy means nothing on ``data.name=synthetic`` (random labels).
CHANCE = 'synthetic data: random labels, accuracy stays at chance'


def _synthetic(result: dict) -> bool:
  """Whether ``result`` (a run) trained on synthetic data (see :data:`CHANCE`)."""
  return result['summary'].get('data') == 'synthetic'


def _say_chance(payload: dict, result: dict) -> None:
  """A part whose accuracies are at chance says so beside them, printed and in
  its JSON (``accuracy_not_measured``)."""
  if _synthetic(result):
    payload['accuracy_not_measured'] = CHANCE
    print(f'  accuracy: not measured ({CHANCE})')


def breakdown(runner: Runner, workdir: str) -> dict:
  results = {name: runner.variant(name) for name in BREAKDOWN if name in runner.variants}
  base = results['baseline']
  rows = [{'variant': name, **describe_run(r, base)} for name, r in results.items()]
  by = {r['variant']: r for r in rows}
  targets, met, skipped = {}, {}, {}
  if 'full' in by:
    full = by['full']
    targets['full_vs_baseline'] = full['speedup']
    if _synthetic(base):
      skipped['accuracy_points'] = CHANCE
    else:
      # Rounded as bench_elastic does: 1.0000000000000009 points is 1 point.
      targets['accuracy_points'] = round(100 * (by['baseline']['final_eval_accuracy'] -
                                                full['final_eval_accuracy']), 9)
    if 'plain_dp' in by:
      targets['full_vs_plain_dp'] = by['plain_dp']['total_seconds'] / full['total_seconds']
  for key in TARGETS:  # a --variants without full or plain_dp says what it left out
    if key not in targets and key not in skipped:
      skipped[key] = ('full not run (--variants)' if 'full' not in by else
                      'plain_dp not run (--variants)')
  for key, value in targets.items():
    met[key] = (value <= TARGETS[key]) if key == 'accuracy_points' else (value >= TARGETS[key])
  print('\nbreakdown (paper Fig. 9)')
  _table(rows, [('variant', 'variant', '>22'), ('total_seconds', 'total s', '.1f'),
                ('speedup', 'speed-up', '.2f'), ('flop_limit_speedup', 'FLOP limit', '.2f'),
                ('efficiency', 'efficiency', '.2f'), ('train_speedup', 'train x', '.2f'),
                ('final_eval_accuracy', 'accuracy', '.4f'),
                ('samples_per_second', 'samples/s', '.0f'), ('epochs_seconds', 'epochs s', '.1f'),
                ('transition_seconds', 'trans s', '.1f'), ('eval_seconds', 'eval s', '.1f'),
                ('startup_seconds', 'startup s', '.1f'), ('process_cpu_seconds', 'CPU s', '.1f'),
                ('process_context_switches', 'switches', '.0f')])
  for key, value in targets.items():
    print(f'  target {key}: {value:.2f} (target {"<=" if key == "accuracy_points" else ">="} '
          f'{TARGETS[key]}) {"met" if met[key] else "NOT met"}')
  for key, why in skipped.items():
    print(f'  target {key}: not measured ({why})')
  payload = {'rows': rows, 'targets': targets, 'target_values': TARGETS, 'targets_met': met,
             'targets_not_measured': skipped, 'compile_cache': runner.compile_cache}
  _write(workdir, 'breakdown', payload)

  def draw(ax):
    names = [r['variant'] for r in rows]
    x = range(len(rows))
    ax.bar(x, [r['speedup'] for r in rows], color='tab:blue', label='measured speed-up')
    ax.scatter(x, [r['flop_limit_speedup'] for r in rows], color='tab:red', marker='_', s=400,
               label='FLOP limit', zorder=3)
    for i, r in enumerate(rows):
      ax.text(i, r['speedup'], f'{r["final_eval_accuracy"]:.3f}', ha='center', va='bottom',
              fontsize=7)
    ax.set_xticks(list(x), [n.replace('+', '+\n') for n in names], fontsize=7)
    ax.set_ylabel('speed-up over baseline')
    ax.set_ylim(0, 1.25 * max([r['flop_limit_speedup'] for r in rows] +
                              [r['speedup'] for r in rows]))
    ax.set_title('breakdown (labels: final accuracy)', fontsize=9)
    ax.legend(fontsize=7, loc='upper left')
  _figure(workdir, 'breakdown', draw)
  return payload


def alpha(runner: Runner, workdir: str) -> dict:
  base = runner.variant('baseline')
  shared = runner.variant('full')  # α = 1/3 unless a --config file sets another
  taken = shared['summary']['config']['freeze']['alpha']
  # The shared run serves the point of its own α; an α that is no point is
  # one more row, and every point still runs (1/3, the issue's, above all).
  serves = next((a for a in ALPHAS if math.isclose(a, taken)), taken)
  rows = []
  for a in sorted(set(ALPHAS) | {serves}):
    r = shared if a == serves else runner.run(
        f'full-alpha{a:g}', MAIN, BREAKDOWN['full'][1] + [f'--config.freeze.alpha={a}'])
    # The α the run had (a --config file may set another than the label).
    rows.append({'alpha': r['summary']['config']['freeze']['alpha'], **describe_run(r, base)})
  print('\nalpha (paper Fig. 10a)')
  _table(rows, [('alpha', 'alpha', '.3f'), ('total_seconds', 'total s', '.1f'),
                ('speedup', 'speed-up', '.2f'), ('flop_limit_speedup', 'FLOP limit', '.2f'),
                ('efficiency', 'efficiency', '.2f'), ('final_eval_accuracy', 'accuracy', '.4f')])
  payload = {'baseline': describe_run(base, None), 'rows': rows}
  _say_chance(payload, base)
  _write(workdir, 'alpha', payload)

  def draw(ax):
    xs = [r['alpha'] for r in rows]
    ax.plot(xs, [r['speedup'] for r in rows], 'o-', label='speed-up')
    ax.plot(xs, [r['flop_limit_speedup'] for r in rows], 'x--', label='FLOP limit')
    ax.set_xlabel('α')
    ax.set_ylabel('speed-up over baseline')
    ax2 = ax.twinx()
    ax2.plot(xs, [r['final_eval_accuracy'] for r in rows], 's-', color='tab:green',
             label='accuracy')
    ax2.axhline(base['summary']['final_eval_accuracy'], color='tab:green', ls=':', lw=1)
    ax2.set_ylabel('final accuracy (dotted: baseline)')
    ax.legend(fontsize=7, loc='upper left')
    ax.set_title('α: speed-up and accuracy', fontsize=9)
  _figure(workdir, 'alpha', draw)
  return payload


def transitions(runner: Runner, workdir: str) -> dict:
  full = runner.variant('full')
  s = full['summary']
  timings = {int(k): v for k, v in s.get('micro_batch_timings', {}).items()}
  rounds = s['micro_batch_rounds']

  def search_seconds(k):
    """Steps spent on slower M candidates, paid once per K (the first time)."""
    candidates = timings.pop(k, {})
    if len(candidates) < 2:
      return 0.0
    best = min(candidates.values())
    return rounds * sum(v - best for v in candidates.values())

  # The starting K's search ran in epoch 0, before any transition.
  initial_search = search_seconds(int(full['rows'][0]['pipeline_length']))
  rows = []
  for t in s['transitions']:
    search = search_seconds(int(t['new'].split()[0][2:]))
    rows.append({'epoch': t['epoch'], 'frozen_layers': t['frozen_layers'],
                 'old': t['old'], 'new': t['new'], 'compile_seconds': t['compile_seconds'],
                 'compiled_ahead': t['compiled_ahead'], 'reshard_seconds': t['reshard_seconds'],
                 'cache_seconds': t['cache_seconds'], 'warmup_seconds': t['warmup_seconds'],
                 'micro_batch_search_seconds': search, 'total_seconds': t['total_seconds']})
  print('\ntransitions (paper Table 4): seconds')
  _table(rows, [('epoch', 'epoch', 'd'), ('frozen_layers', 'F', 'd'),
                ('compile_seconds', 'compile', '.2f'), ('reshard_seconds', 'reshard', '.2f'),
                ('cache_seconds', 'cache', '.2f'), ('warmup_seconds', 'warm-up', '.2f'),
                ('micro_batch_search_seconds', 'M search', '.2f'),
                ('total_seconds', 'total', '.2f')])
  print(f'  and in epoch 0, before any transition: M search {initial_search:.2f} s '
        f'(the starting K)')
  payload = {'rows': rows, 'run_total_seconds': s['total_seconds'],
             'initial_micro_batch_search_seconds': initial_search,
             'compile_cache': runner.compile_cache}
  _write(workdir, 'transitions', payload)

  def draw(ax):
    parts = [('compile_seconds', 'compile wait'), ('reshard_seconds', 'reshard'),
             ('cache_seconds', 'cache'), ('warmup_seconds', 'first-step warm-up'),
             ('micro_batch_search_seconds', 'M search')]
    bottom = [0.0] * len(rows)
    labels = [f'F={r["frozen_layers"]}\n{r["new"].split()[0]}' for r in rows]
    for key, label in parts:
      values = [r[key] for r in rows]
      ax.bar(range(len(rows)), values, bottom=bottom, label=label)
      bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel('seconds')
    ax.set_title('transitions of the full run', fontsize=9)
    ax.legend(fontsize=7)
  _figure(workdir, 'transitions', draw)
  return payload


def table1(runner: Runner, workdir: str) -> dict:
  def seed_run(name, seed):
    module, args = BREAKDOWN[name]
    return runner.run(f'{name}-seed{seed}', module, args + [f'--config.seed={seed}'])

  runs = {}
  for name in ('baseline', 'full'):
    first = runner.variant(name)  # seed 0 unless a --config file sets another; shared
    # The others: SEEDS after 0 (1, 2), or the next one when the first run had one of them.
    taken = first['summary']['config']['seed']
    others = [seed for seed in range(1, len(SEEDS) + 1) if seed != taken][:len(SEEDS) - 1]
    runs[name] = [first] + [seed_run(name, seed) for seed in others]

  def stats(values):
    return {'mean': statistics.mean(values),
            'std': statistics.stdev(values) if len(values) > 1 else 0.0, 'values': values}

  rows = []
  for name, results in runs.items():
    acc = stats([r['summary']['final_eval_accuracy'] for r in results])
    secs = stats([r['summary']['total_seconds'] for r in results])
    seeds = [r['summary']['config']['seed'] for r in results]  # those the runs had
    rows.append({'variant': name, 'seeds': seeds, 'accuracy': acc, 'total_seconds': secs})
  speedups = [b['summary']['total_seconds'] / f['summary']['total_seconds']
              for b, f in zip(runs['baseline'], runs['full'])]
  seeds = rows[-1]['seeds']  # the seed-0 runs have the config's seed
  print('\ntable1 (paper Table 1): mean ± std over seeds', seeds)
  for r in rows:
    print(f'  {r["variant"]:>8}: accuracy {r["accuracy"]["mean"]:.4f} ± '
          f'{r["accuracy"]["std"]:.4f}, time {r["total_seconds"]["mean"]:.1f} ± '
          f'{r["total_seconds"]["std"]:.1f} s')
  print(f'  speed-up {statistics.mean(speedups):.2f}x (per seed '
        f'{", ".join(f"{x:.2f}" for x in speedups)})')
  payload = {'rows': rows, 'speedup': stats(speedups)}
  _say_chance(payload, runs['baseline'][0])
  _write(workdir, 'table1', payload)

  def draw(ax):
    names = [r['variant'] for r in rows]
    ax.bar(names, [r['total_seconds']['mean'] for r in rows],
           yerr=[r['total_seconds']['std'] for r in rows], color='tab:blue', capsize=4)
    ax.set_ylabel('total seconds (mean ± std)')
    for i, r in enumerate(rows):
      ax.text(i, r['total_seconds']['mean'] / 2,
              f'acc {r["accuracy"]["mean"]:.3f}\n± {r["accuracy"]["std"]:.3f}',
              ha='center', fontsize=8, color='white')
    ax.set_title(f'baseline vs pipejax over seeds {seeds}', fontsize=9)
  _figure(workdir, 'table1', draw)
  return payload


def microbatches(runner: Runner, workdir: str) -> dict:
  """In a fresh process: :mod:`experiments.reproduce_microbatches`."""
  out = os.path.join(workdir, 'microbatches.json')
  cmd = [sys.executable, '-m', 'experiments.reproduce_microbatches', f'--workdir={workdir}',
         *runner.passthrough]
  print('  microbatches ...', flush=True)
  env, _ = runner.caches(os.path.join(workdir, 'runs', 'microbatches'))
  proc = run_child(cmd, capture=False, env=env)
  if proc.returncode:
    fail(f'error: the micro-batch sweep failed ({" ".join(cmd)})')
  with open(out) as f:
    return json.load(f)


def main(argv=None) -> int:
  parser = runtime.ArgumentParser(
      prog='python -m experiments.reproduce', description=__doc__.split('\n\n')[0],
      epilog='Other arguments (--config FILE or --config=FILE, --config.KEY=VALUE) go to '
             'every run.')
  parser.add_argument('--workdir', required=True, type=os.path.expanduser)
  parser.add_argument('--only', default=','.join(PARTS),
                      help=f'comma-separated parts to run, of {", ".join(PARTS)}')
  parser.add_argument('--compile-cache', choices=('warm', 'shared', 'cold'), default='warm',
                      help='warm: shared caches filled by an unreported run of each '
                           'configuration; shared: the same without those runs; cold: none')
  parser.add_argument('--variants', default=','.join(BREAKDOWN),
                      help='comma-separated breakdown variants (baseline is always run)')
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[-1] == '--config':
    print('error: --config needs a FILE', file=sys.stderr)
    return 2
  for i, arg in enumerate(argv[:-1]):  # --config FILE, as the main job takes it
    if arg == '--config':
      argv[i:i + 2] = [f'--config={argv[i + 1]}']
      break
  args, passthrough = parser.parse_known_args(argv)
  only = [p.strip() for p in args.only.split(',') if p.strip()]
  unknown = [p for p in only if p not in PARTS]
  if unknown or not only:
    print(f'error: {f"unknown part(s) {unknown}" if unknown else "--only names no part"}; '
          f'choose from {", ".join(PARTS)}', file=sys.stderr)
    return 2
  variants = [v.strip() for v in args.variants.split(',') if v.strip()]
  unknown = [v for v in variants if v not in BREAKDOWN]
  if unknown:
    print(f'error: unknown variant(s) {unknown}; choose from {", ".join(BREAKDOWN)}',
          file=sys.stderr)
    return 2
  bad = [a for a in passthrough if not a.startswith('--config')]
  if bad:
    print(f'error: unexpected arguments {bad} (only --config and --config.KEY=VALUE pass '
          f'through)', file=sys.stderr)
    return 2
  if freezes_nothing(passthrough):
    print('error: --config.freeze.policy=none would turn every variant into the baseline; '
          'leave it out', file=sys.stderr)
    return 2
  varied = {'alpha': '--config.freeze.alpha', 'table1': '--config.seed'}
  clash = [f'{flag} (the {part} part sets it)' for part, flag in varied.items()
           if part in only and any(a.split('=')[0] == flag for a in passthrough)]
  if clash:
    print(f'error: {", ".join(clash)}; leave it out or run the other parts alone',
          file=sys.stderr)
    return 2
  error = claim_checked_workdir(args.workdir, passthrough)
  if error:
    print(error, file=sys.stderr)
    return 2
  runner = Runner(args.workdir, passthrough, args.compile_cache,
                  tuple(dict.fromkeys(['baseline', *variants])))
  start = time.perf_counter()
  done = {}
  for part in PARTS:  # a fixed order: later parts reuse earlier runs
    if part in only:
      print(f'{part}:', flush=True)
      done[part] = globals()[part](runner, args.workdir)
  print(f'\nwrote {", ".join(f"{p}.json/.png" for p in done)} in {args.workdir} '
        f'({time.perf_counter() - start:.0f}s)')
  return 0


if __name__ == '__main__':
  stop_children_on_sigterm()  # here, not in main(): a caller keeps its own handlers
  sys.exit(main())
