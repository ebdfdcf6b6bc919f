"""AutoCache benchmark: ``python -m experiments.bench_cache --workdir DIR``.

Runs the main job (``experiments.vit_imagenet``, the embedded default unless
overrides say otherwise) three ways, one after the other on this machine, each
in a fresh process:

* ``always``  — caching from the first frozen layer on (``cache.policy=always``);
* ``profile`` — caching when the profiler measures that it wins (the default);
* ``off``     — no cache (``cache.enabled=False``).

With ``--repeats N`` each variant runs N times, interleaved, and the run with
the median total time represents it (of an even N, the faster of the middle
two; all totals are in the JSON).

A first, unreported run of each variant warms JAX's persistent compilation
cache and the program store (its key includes the configuration), so no
variant pays for tracing or compiling what a user's second run would not.
Prints a table, writes ``DIR/bench_cache.json`` (per-epoch throughput, total
seconds, accuracy, the cache's counters at the end of the run: its last
metrics row's ``cache_*`` keys, and the frozen-forward time the cache saved)
and ``DIR/bench_cache.png``.

Extra arguments are passed to every run, e.g. ``--config.train.epochs=5``.
The main job's own checks of them run first, in a child, so a value the runs
would refuse is refused in one line before DIR is written.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

from pipejax import diskcache, runtime

VARIANTS = {
    'always': ['--config.cache.policy=always'],
    'profile': ['--config.cache.policy=profile'],
    'off': ['--config.cache.enabled=False'],
}


def claim_workdir(path: str) -> str | None:
  """Creates the benchmark's ``--workdir``; a one-line error (to print, exit
  2) when it is not a fresh, empty directory or cannot be made."""
  if not path.strip():  # --workdir=$DIR with DIR unset
    return 'error: --workdir is empty'
  if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
    return f'error: {path} is not an empty directory; choose a fresh --workdir'
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    return f'error: cannot create --workdir={path}: {e.strerror or e}'
  return None


_CHECK = """
import sys
from experiments import vit_imagenet  # first: it sets up JAX's devices
from experiments import command_line, elastic
parsed = command_line.parse_command_line(vit_imagenet.__file__, ['check', *sys.argv[1:]])
if parsed is None:
  sys.exit(2)
if parsed[0].distributed.coordinator:
  sys.exit(0)  # a job's devices are its hosts': the runs check them once they join
import jax
try:
  elastic.check_config(parsed[0], len(jax.devices()))
  elastic.check_settings_without_data(parsed[0], 'vit')
except elastic.ConfigError as e:
  print(f'error: {e}', file=sys.stderr)
  sys.exit(2)
"""


def check_settings(passthrough: list[str]) -> str | None:
  """The error line (None: none) of the main job's own checks of the
  ``--config`` arguments every run gets, in a child process (the main
  job's flags and devices), before DIR is written: a bad value refused by
  the first run left a DIR that the same command, corrected, refused."""
  # No persistent compilation cache: nothing is compiled, and the user's stays untouched.
  env = {**os.environ, 'PIPEJAX_COMPILATION_CACHE': ''}
  proc = run_child([sys.executable, '-c', _CHECK, *passthrough], env=env)
  if proc.returncode == 0:
    return None
  lines = proc.stderr.strip().splitlines()
  last = lines[-1] if lines else f'the settings check failed ({proc.returncode})'
  return last if last.startswith('error:') else f'error: {last}'


def claim_checked_workdir(workdir: str, passthrough: list[str]) -> str | None:
  """:func:`claim_workdir`, then :func:`check_settings`: the one-line error
  (None: the workdir is claimed and the runs' settings pass). A workdir this
  made is removed again on an error, so the corrected command runs in it."""
  existed = os.path.exists(workdir)
  error = claim_workdir(workdir) or check_settings(passthrough)
  if error and not existed and os.path.isdir(workdir) and not os.listdir(workdir):
    os.rmdir(workdir)
  return error


def check_positive(args, flags: tuple[str, ...]) -> None:
  """A benchmark's count flags (argparse names): each at least 1.

  Raises:
    ValueError: the first that is not, in one line.
  """
  for flag in flags:
    if getattr(args, flag) < 1:
      raise ValueError(f'--{flag.replace("_", "-")} must be at least 1, '
                       f'got {getattr(args, flag)}')


def check_workdir_flag(workdir: str, files: tuple[str, ...]) -> None:
  """A benchmark's ``--workdir`` can hold its output ``files``
  (:func:`pipejax.diskcache.outputs_problem`, the check the main job's
  ``elastic.check_workdir`` makes, without importing JAX); else
  :class:`ValueError`, one line."""
  problem = diskcache.outputs_problem(workdir, files)
  if problem:
    raise ValueError(f'cannot use --workdir={workdir}: {problem}')


def freezes_nothing(passthrough: list[str]) -> bool:
  """Whether the arguments passed to every run set ``freeze.policy=none``
  (``--config.freeze.policy=none`` or ``--config.freeze.policy none``; the
  last one given counts, as for the runs)."""
  policy = None
  for i, arg in enumerate(passthrough):
    if arg.startswith('--config.freeze.policy='):
      policy = arg.split('=', 1)[1]
    elif arg == '--config.freeze.policy' and i + 1 < len(passthrough):
      policy = passthrough[i + 1]
  return policy == 'none'


def start_error(workdir: str, repeats: int, passthrough: list[str],
                without_freezing: str) -> str | None:
  """A benchmark's argument checks, then :func:`claim_checked_workdir`: the
  one-line error to print (exit 2), or None with the workdir claimed.
  ``without_freezing`` says why ``--config.freeze.policy=none`` is refused."""
  if repeats < 1:
    return f'error: --repeats must be >= 1, got {repeats}'
  if freezes_nothing(passthrough):
    return f'error: --config.freeze.policy=none {without_freezing}; leave it out'
  return claim_checked_workdir(workdir, passthrough)


def cpu_and_switches(who: int = resource.RUSAGE_SELF) -> tuple[float, int]:
  """CPU seconds and context switches (voluntary and not) so far, from
  ``getrusage``: of this process, all its threads, ended ones included
  (``RUSAGE_SELF``), or of its reaped children (``RUSAGE_CHILDREN``)."""
  u = resource.getrusage(who)
  return u.ru_utime + u.ru_stime, u.ru_nvcsw + u.ru_nivcsw


def run_child(cmd: list[str], capture: bool = True, env: dict | None = None
              ) -> subprocess.CompletedProcess:
  """``subprocess.run`` of one benchmark run that does not outlive this
  process: a stop of the benchmark (Ctrl-C, or SIGTERM, see
  :func:`stop_children_on_sigterm`) kills the run too."""
  proc = subprocess.Popen(cmd, text=True, env=env, stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.PIPE if capture else None)
  try:
    out, err = proc.communicate()
  except BaseException:
    proc.kill()
    proc.communicate()
    raise
  return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_children_on_sigterm() -> None:
  """SIGTERM ends the benchmark as Ctrl-C does (an exception, so that the run
  in progress is killed with it, not left running)."""
  def stop(signum, frame):
    raise SystemExit(128 + signum)
  signal.signal(signal.SIGTERM, stop)


def fail(message: str):
  """Ends the benchmark with ``message`` on one line and exit status 2."""
  print(message, file=sys.stderr, flush=True)
  raise SystemExit(2)


def _run(workdir: str, args: list[str]) -> dict:
  """One run of the main job in a fresh process; returns its summary, rows
  and ``process_seconds`` (the process's wall time: the run's
  ``total_seconds`` plus the interpreter's start, the imports and the exit)."""
  cmd = [sys.executable, '-m', 'experiments.vit_imagenet', f'--workdir={workdir}', *args]
  start = time.perf_counter()
  proc = run_child(cmd)
  process_seconds = time.perf_counter() - start
  if proc.returncode:
    tail = (proc.stderr.strip().splitlines() or ['(no output)'])[-1]
    fail(f'error: {" ".join(cmd)} failed: {tail}')
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return {'summary': summary, 'rows': rows, 'process_seconds': process_seconds}


def _forward_saved(summary: dict, rows: list[dict]) -> float:
  """Seconds of frozen-prefix forward the cache replaced: every hit (an entry
  read instead of computed) saved its share of a batch forward at the depth
  measured by the profiler, less the time spent reading and writing entries.
  The profiler times the forward of the plan's batch (with
  ``train.batch_mode=per_pipeline`` it grows with R). A depth the profiler did
  not re-measure (a filled cache kept, ``measured_at`` below the depth)
  counts the forward of the shallower depth it was measured at, so the figure
  is a lower bound."""
  train = summary['config']['train']
  forward = {d['num_frozen_layers']: d['forward_seconds'] for d in summary['cache_decisions']}
  saved, hits_before = 0.0, 0
  for row in rows:
    hits = row.get('cache_hits', 0)
    depth = row['frozen_layers']
    batch = train['batch_size'] * (row['replicas'] if train['batch_mode'] == 'per_pipeline'
                                   else 1)
    if depth in forward:
      saved += (hits - hits_before) / batch * forward[depth]
    hits_before = hits
  last = rows[-1]
  return saved - last.get('cache_read_seconds', 0.0) - last.get('cache_write_seconds', 0.0)


def main(argv=None) -> int:
  parser = runtime.ArgumentParser(prog='python -m experiments.bench_cache',
                                   description=__doc__.split('\n\n')[0],
                                   epilog='Other arguments (--config.KEY=VALUE) go to every run.')
  parser.add_argument('--workdir', required=True, type=os.path.expanduser)
  parser.add_argument('--no-warmup', action='store_true',
                      help='skip the unreported warm-up runs')
  parser.add_argument('--repeats', type=int, default=1,
                      help='runs per variant, interleaved; the run with the median total is '
                           'reported (of an even count, the faster of the middle two)')
  args, passthrough = parser.parse_known_args(argv)
  error = start_error(args.workdir, args.repeats, passthrough,
                      'freezes nothing, so no variant would cache')
  if error:
    print(error, file=sys.stderr)
    return 2
  if not args.no_warmup:
    for name, variant in VARIANTS.items():  # each has its own stored programs
      print(f'warm-up run of {name} (not reported) ...', flush=True)
      _run(os.path.join(args.workdir, f'warmup-{name}'), variant + passthrough)
  runs = {name: [] for name in VARIANTS}
  for repeat in range(args.repeats):  # interleaved: a slow spell hits every variant
    for name, extra in VARIANTS.items():
      print(f'{name} (run {repeat + 1}/{args.repeats}) ...', flush=True)
      runs[name].append(_run(os.path.join(args.workdir, f'{name}-{repeat}'),
                             extra + passthrough))
  # Each variant is represented by its run with the median total time (of an
  # even count, the faster of the middle two: a run, not an average of two).
  results = {name: sorted(r, key=lambda x: x['summary']['total_seconds'])[(len(r) - 1) // 2]
             for name, r in runs.items()}
  off_total = results['off']['summary']['total_seconds']
  table = []
  for name, r in results.items():
    s, rows = r['summary'], r['rows']
    table.append({
        'variant': name, 'total_seconds': s['total_seconds'],
        'all_total_seconds': [x['summary']['total_seconds'] for x in runs[name]],
        'speedup_vs_off': off_total / s['total_seconds'],
        'final_eval_accuracy': s['final_eval_accuracy'],
        'train_seconds': sum(row['epoch_seconds'] for row in rows),
        'samples_per_second': [row['samples_per_second'] for row in rows],
        'cache_used': [row['cache'] for row in rows],
        'frozen_layers': [row['frozen_layers'] for row in rows],
        'forward_seconds_saved': _forward_saved(s, rows) if name != 'off' else 0.0,
        'repeated_layer_passes': rows[-1].get('cache_repeated_layer_passes', 0),
        # the run's cache counters at its end (hits, misses, layer passes, ...)
        'cache_counters': {k: v for k, v in rows[-1].items() if k.startswith('cache_')},
        'cache_decisions': s['cache_decisions'],
    })
  print(f'{"variant":8} {"total s":>8} {"vs off":>7} {"train s":>8} {"accuracy":>8} '
        f'{"fwd saved s":>11}  cache per epoch')
  for t in table:
    print(f'{t["variant"]:8} {t["total_seconds"]:8.1f} {t["speedup_vs_off"]:6.2f}x '
          f'{t["train_seconds"]:8.1f} {t["final_eval_accuracy"]:8.4f} '
          f'{t["forward_seconds_saved"]:11.2f}  '
          f'{"".join("C" if u else "." for u in t["cache_used"])}')
  out = {'command': ' '.join(sys.argv), 'passthrough': passthrough, 'rows': table}
  with open(os.path.join(args.workdir, 'bench_cache.json'), 'w') as f:
    json.dump(out, f, indent=2)
  _plot(args.workdir, results)
  print(f'wrote {args.workdir}/bench_cache.json and bench_cache.png')
  return 0


def _plot(workdir: str, results: dict) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
  for name, r in results.items():
    rows = r['rows']
    ax.plot([row['epoch'] for row in rows], [row['samples_per_second'] for row in rows],
            marker='o', label=f'{name} ({r["summary"]["total_seconds"]:.0f}s)')
  ax.set_xlabel('epoch')
  ax.set_ylabel('samples / s')
  ax.set_title('AutoCache: training throughput per epoch')
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'bench_cache.png'))
  plt.close(fig)


if __name__ == '__main__':
  stop_children_on_sigterm()  # here, not in main(): a caller keeps its own handlers
  sys.exit(main())
