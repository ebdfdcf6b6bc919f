"""The main job's acceptance, measured: ``python -m experiments.bench_elastic --workdir DIR``.

Runs the default run (``python -m experiments.vit_imagenet``) and the baseline
(the same with ``--config.freeze.policy=none``: no freezing, the static
pipeline of the starting length) as a user runs them — checkpoints on, each
in a fresh process, with the user's compilation cache and program store —
in pairs, one after the other on this machine. ``--repeats N`` pairs (default
3) alternate which of the two runs first, so a slow spell of the machine hits
both; a first, unreported run of each warms the caches (a user's second run;
``--no-warmup`` skips it).

Prints every pair and a verdict on the acceptance criteria of the elastic
training issue: frozen layers rise, K shrinks from its starting length and R
grows; final eval accuracy >= 0.95 and within 1 point of the baseline's; the
default run's total wall time <= 0.70 x the baseline's, taken over all pairs
(sum against sum, each run's ``total_seconds``; the median pair, and the
ratio of the processes' wall times, start-up of Python and the imports
included, are printed beside it); the other criteria must hold in every
pair. Beside it, the limits
that the run's freeze schedule implies: frozen layers forward-only (a
trained block costs 4 units per sample: forward, recomputed forward,
backward; a frozen one 1), and with cached blocks free (the cache's own
layer passes, filling it and advancing it, still counted). Writes
``DIR/bench_elastic.json`` and ``DIR/bench_elastic.png``; ``--strict`` exits
with status 1 when a criterion is not met.

Extra arguments go to every run, e.g. ``--config.train.epochs=5``. The main
job's own checks of them run first, in a child, so a value the runs would
refuse is refused in one line before DIR is written.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

from experiments.bench_cache import _run, start_error, stop_children_on_sigterm
from experiments.reproduce import flop_limit_speedup
from pipejax import runtime

VARIANTS = {'elastic': [], 'baseline': ['--config.freeze.policy=none']}
TARGET_RATIO = 0.70
MIN_ACCURACY = 0.95
MAX_ACCURACY_GAP_POINTS = 1.0


def where_time_went(summary: dict, rows: list[dict]) -> dict:
  """Seconds of one run by phase: the epochs at the starting pipeline length,
  the later epochs, transitions, evaluation, checkpoints and the rest
  (start-up: data, model, first programs)."""
  first_k = rows[0]['pipeline_length']
  parts = {
      'epochs_at_starting_k': sum(r['epoch_seconds'] for r in rows
                                  if r['pipeline_length'] == first_k),
      'epochs_after': sum(r['epoch_seconds'] for r in rows if r['pipeline_length'] != first_k),
      'transitions': sum(r['transition_seconds'] for r in rows),
      'evaluation': sum(r.get('eval_seconds', 0.0) for r in rows),
      'checkpoints': sum(r.get('checkpoint_seconds', 0.0) for r in rows),
  }
  parts['startup_and_rest'] = summary['total_seconds'] - sum(parts.values())
  return parts


def forward_only_limit(summary: dict, rows: list[dict]) -> float:
  """The speed-up the freeze schedule allows with frozen blocks costing
  their forward (no cache)."""
  return flop_limit_speedup(summary, rows, cache_free=True)


def verdict(elastic: dict, baseline: dict, ratio: float) -> list[dict]:
  """The acceptance criteria of one pair, each with what was measured and
  whether it holds (``ratio``: the wall-time ratio to judge)."""
  rows = elastic['rows']
  frozen = [r['frozen_layers'] for r in rows]
  k = [r['pipeline_length'] for r in rows]
  replicas = [r['replicas'] for r in rows]
  acc, base_acc = (elastic['summary']['final_eval_accuracy'],
                   baseline['summary']['final_eval_accuracy'])
  gap = round(100 * (base_acc - acc), 9)  # 1.0000000000000009 points is 1 point
  return [
      {'criterion': 'frozen layers rise', 'measured': ' '.join(map(str, frozen)),
       'met': frozen[-1] > frozen[0] and all(a <= b for a, b in zip(frozen, frozen[1:]))},
      {'criterion': 'K shrinks from its starting length', 'measured': ' '.join(map(str, k)),
       'met': k[-1] < k[0]},
      {'criterion': 'R grows', 'measured': ' '.join(map(str, replicas)),
       'met': replicas[-1] > replicas[0]},
      {'criterion': f'final eval accuracy >= {MIN_ACCURACY}', 'measured': f'{acc:.4f}',
       'met': acc >= MIN_ACCURACY},
      {'criterion': f'within {MAX_ACCURACY_GAP_POINTS:g} point of the baseline',
       'measured': f'{acc:.4f} vs {base_acc:.4f} ({-gap:+.2f} points)',
       'met': gap <= MAX_ACCURACY_GAP_POINTS},
      {'criterion': f'wall time <= {TARGET_RATIO:.2f} x the baseline', 'measured': f'{ratio:.3f}',
       'met': ratio <= TARGET_RATIO},
  ]


def verdict_over_pairs(pairs: list[dict], ratio: float) -> list[dict]:
  """Each criterion met only if it holds in every pair (the wall time: the
  ratio of the sums); ``measured`` is pair 1's, with the pairs that differ
  from it appended."""
  per_pair = [verdict(p['elastic'], p['baseline'], ratio) for p in pairs]
  out = []
  for i, first in enumerate(per_pair[0]):
    others = {f'pair {n + 1}: {v[i]["measured"]}' for n, v in enumerate(per_pair[1:], 1)
              if v[i]['measured'] != first['measured']}
    out.append({'criterion': first['criterion'],
                'measured': first['measured'] + ''.join(f'; {o}' for o in sorted(others)),
                'met': all(v[i]['met'] for v in per_pair)})
  return out


def main(argv=None) -> int:
  parser = runtime.ArgumentParser(prog='python -m experiments.bench_elastic',
                                   description=__doc__.split('\n\n')[0],
                                   epilog='Other arguments (--config.KEY=VALUE) go to every run.')
  parser.add_argument('--workdir', required=True, type=os.path.expanduser)
  parser.add_argument('--repeats', type=int, default=3, help='pairs of runs (default 3)')
  parser.add_argument('--no-warmup', action='store_true',
                      help='skip the unreported warm-up run of each')
  parser.add_argument('--strict', action='store_true',
                      help='exit with status 1 when a criterion is not met')
  args, passthrough = parser.parse_known_args(argv)
  error = start_error(args.workdir, args.repeats, passthrough,
                      'would make the elastic run a second baseline')
  if error:
    print(error, file=sys.stderr)
    return 2
  if not args.no_warmup:
    for name, extra in VARIANTS.items():
      print(f'warm-up run of {name} (not reported) ...', flush=True)
      _run(os.path.join(args.workdir, f'warmup-{name}'), extra + passthrough)
  pairs = []
  for repeat in range(args.repeats):
    order = list(VARIANTS) if repeat % 2 == 0 else list(VARIANTS)[::-1]
    pair = {}
    for name in order:
      print(f'{name} (pair {repeat + 1}/{args.repeats}) ...', flush=True)
      pair[name] = _run(os.path.join(args.workdir, f'{name}-{repeat}'),
                        VARIANTS[name] + passthrough)
    pairs.append({'first': order[0], **pair})

  totals = {name: [p[name]['summary']['total_seconds'] for p in pairs] for name in VARIANTS}
  process = {name: [p[name]['process_seconds'] for p in pairs] for name in VARIANTS}
  ratios = [e / b for e, b in zip(totals['elastic'], totals['baseline'])]
  ratio = sum(totals['elastic']) / sum(totals['baseline'])
  process_ratio = sum(process['elastic']) / sum(process['baseline'])
  elastic = pairs[0]['elastic']
  limits = {'frozen_forward_only': forward_only_limit(elastic['summary'], elastic['rows']),
            'cached_blocks_free': flop_limit_speedup(elastic['summary'], elastic['rows'])}
  checks = verdict_over_pairs(pairs, ratio)
  phases = {name: {k: statistics.mean(where_time_went(p[name]['summary'], p[name]['rows'])[k]
                                      for p in pairs)
                   for k in where_time_went(elastic['summary'], elastic['rows'])}
            for name in VARIANTS}

  print(f'{"pair":>4} {"first":>8} {"elastic s":>9} {"baseline s":>10} {"ratio":>6}')
  for i, (p, r) in enumerate(zip(pairs, ratios)):
    print(f'{i + 1:4d} {p["first"]:>8} {totals["elastic"][i]:9.1f} '
          f'{totals["baseline"][i]:10.1f} {r:6.3f}')
  print(f' all {"":>8} {sum(totals["elastic"]):9.1f} {sum(totals["baseline"]):10.1f} '
        f'{ratio:6.3f}   (median pair {statistics.median(ratios):.3f})')
  print(f'as processes (interpreter start, imports and exit included): '
        f'{sum(process["elastic"]):.1f} / {sum(process["baseline"]):.1f} s, {process_ratio:.3f}')
  print(f'limit implied by the freeze schedule: {1 / limits["frozen_forward_only"]:.3f} x the '
        f'baseline with frozen layers forward-only ({limits["frozen_forward_only"]:.2f}x), '
        f'{1 / limits["cached_blocks_free"]:.3f} with cached blocks free but the cache\'s own '
        f'layer passes '
        f'({limits["cached_blocks_free"]:.2f}x)')
  print('mean seconds by phase: ' + '; '.join(
      f'{name}: ' + ', '.join(f'{k} {v:.1f}' for k, v in phases[name].items())
      for name in VARIANTS))
  for c in checks:
    print(f'  [{"met" if c["met"] else "NOT met"}] {c["criterion"]}: {c["measured"]}')
  argv = sys.argv[1:] if argv is None else list(argv)
  out = {'command': ' '.join(['python -m experiments.bench_elastic', *argv]),
         'passthrough': passthrough,
         'pairs': [{'first': p['first'], 'elastic_seconds': e, 'baseline_seconds': b,
                    'ratio': r, 'elastic_process_seconds': p['elastic']['process_seconds'],
                    'baseline_process_seconds': p['baseline']['process_seconds']}
                   for p, e, b, r in zip(pairs, totals['elastic'], totals['baseline'], ratios)],
         'ratio_of_sums': ratio, 'median_ratio': statistics.median(ratios),
         'process_ratio_of_sums': process_ratio,
         'final_eval_accuracy': {n: pairs[0][n]['summary']['final_eval_accuracy']
                                 for n in VARIANTS},
         'limits': limits, 'seconds_by_phase': phases, 'criteria': checks,
         'elastic_plan': {k: [r[k] for r in elastic['rows']]
                          for k in ('frozen_layers', 'pipeline_length', 'replicas')}}
  with open(os.path.join(args.workdir, 'bench_elastic.json'), 'w') as f:
    json.dump(out, f, indent=2)
  _plot(args.workdir, pairs)
  print(f'wrote {args.workdir}/bench_elastic.json and bench_elastic.png')
  return 1 if args.strict and not all(c['met'] for c in checks) else 0


def _plot(workdir: str, pairs: list[dict]) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
  for name, style in (('elastic', 'o-'), ('baseline', 's--')):
    rows = pairs[0][name]['rows']
    ax.plot([r['wall_seconds'] for r in rows], [r['eval_accuracy'] for r in rows], style,
            label=f'{name} ({pairs[0][name]["summary"]["total_seconds"]:.0f}s)')
  ax.set_xlabel('wall-clock seconds (pair 1)')
  ax.set_ylabel('eval accuracy')
  ax.set_title('default run vs baseline')
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'bench_elastic.png'))
  plt.close(fig)


if __name__ == '__main__':
  stop_children_on_sigterm()  # here, not in main(): a caller keeps its own handlers
  sys.exit(main())
