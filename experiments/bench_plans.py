"""Train-step time of every plan an elastic run goes through, against the
baseline's, side by side in one process: ``python -m experiments.bench_plans
--workdir DIR [--config.KEY=VALUE ...]``.

The plans are those of the main job's config (``experiments.vit_imagenet``,
embedded default unless overridden): the frozen counts that the α bound of the
freeze schedule gives per epoch (paper Fig. 4, the upper bound of Eq. 1), each
partitioned and compressed by AutoPipe as the trainer does; M is the config's
or K. Each plan's train step (frozen prefix forward + pipelined step) is timed
on real batches, interleaved with the baseline (no freezing, the starting
pipeline) so that machine noise hits both, and the run's train-time ratio is
predicted from the per-epoch plans. Beside it: the limit the freeze schedule
allows (frozen blocks forward-only = 1 unit, trained blocks forward +
recomputed forward + backward = 4 units). Prints a table, writes
``DIR/bench_plans.json``. What this leaves out on purpose — compilation,
transitions, evaluation, checkpoints — is what separates it from a run's wall
time.

A plan that keeps the previous plan's K runs at its own, narrower slot width
(the trainer's default); with ``freeze.keep_slot_width=True`` the trainer
pads it to the width of the previous plan's step instead. Each such plan is
timed both ways in the same interleaved rounds (column ``padded ms``).
"""
from __future__ import annotations

import json
import os
import sys
import time

from pipejax import runtime

runtime.setup(8)

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import elastic, vit_imagenet  # noqa: E402
from pipejax import diskcache, freeze  # noqa: E402
from pipejax.data import Loader  # noqa: E402
from pipejax.trainer import Trainer  # noqa: E402


def main(argv=None) -> int:
  # The main job's own config file and flags: the same keys, types and checks.
  parsed = elastic.parse_command_line(vit_imagenet.__file__, argv, require_workdir=True)
  if parsed is None:
    return 2
  config, workdir = parsed
  try:
    return _bench(config, workdir)
  except (elastic.KNOWN_ERRORS + (OSError,)) as e:  # bad input, the machine's files: one line
    print(f'error: {e}', file=sys.stderr)
    return 2


def _bench(config, workdir: str) -> int:
  with config.unlocked():
    config.checkpoint.enabled = False
    config.cache.enabled = False
  elastic.check_config(config, len(jax.devices()))
  elastic.check_workdir(workdir, checkpoints_enabled=False, files=('bench_plans.json',))
  data = elastic.resolve_data(config)
  created = elastic.resolve_model(config, data)
  model = created.model
  epochs = config.train.epochs
  policy = freeze.FreezePolicy('schedule', model.num_layers, config.freeze.alpha,
                               config.freeze.min_active_layers)
  frozen = [0]
  for _ in range(epochs - 1):
    frozen.append(policy.decide(None).result)
  loader = Loader(data.train, config.train.batch_size, seed=config.seed)
  trainer = Trainer(model, created.params, config, workdir, loader, loader,
                    log=lambda _: None)
  batches = [b for _, b in loader.epoch(0)][:6]
  ids = [i for i, _ in loader.epoch(0)][:6]
  plans = _plans(trainer, frozen, keep_slot_width=False)
  # The plans that keeping the width pads (wider slots than their own):
  padded = {f: p for f, p in _plans(trainer, frozen, keep_slot_width=True).items()
            if p.partition.tables.num_slots != plans[f].partition.tables.num_slots}
  # Baseline and every plan: state laid out for it, the step compiled and warmed.
  variants = [(f, False) for f in plans] + [(f, True) for f in padded]
  states, steps = {}, {}
  for f, pad in variants:
    plan = (padded if pad else plans)[f]
    trainer.plan = plan
    trainer.state = trainer._init_state(created.params, plan)  # noqa: SLF001
    feeds = [trainer._feed(i, b, plan) for i, b in zip(ids, batches)]  # noqa: SLF001
    fn = trainer._train_step(plan, feeds[0])  # noqa: SLF001
    for feed in feeds[:2]:
      trainer._run_step(fn, feed)  # noqa: SLF001
    jax.block_until_ready(trainer.state)
    states[f, pad], steps[f, pad] = trainer.state, fn

  def time_plan(f, pad, rounds=3):
    plan = (padded if pad else plans)[f]
    trainer.plan, trainer.state = plan, states[f, pad]
    best = float('inf')
    for _ in range(rounds):
      jax.block_until_ready(trainer.state)
      start = time.perf_counter()
      for i, b in zip(ids, batches):
        trainer._run_step(steps[f, pad], trainer._feed(i, b, plan))  # noqa: SLF001
      jax.block_until_ready(trainer.state)
      best = min(best, (time.perf_counter() - start) / len(batches))
    states[f, pad] = trainer.state
    return best

  seconds = {v: [] for v in variants}
  for _ in range(3):  # interleaved with the baseline (F=0)
    for v in variants:
      seconds[v].append(time_plan(0, False) if v == (0, False) else time_plan(*v))
  step = {f: float(np.median(seconds[f, False])) for f in plans}
  padded_step = {f: float(np.median(seconds[f, True])) for f in padded}
  figures = ratios(step, padded_step, frozen, model.num_layers)
  rows = []
  for f, plan in plans.items():
    rows.append({'frozen_layers': f, 'pipeline_length': plan.pipeline_length,
                 'replicas': plan.replicas, 'micro_batches': plan.micro_batches,
                 'slot_width': plan.partition.tables.num_slots,
                 'step_seconds': step[f], 'ratio_to_baseline': figures['ratio_to_baseline'][f],
                 'padded_slot_width': (padded[f].partition.tables.num_slots
                                       if f in padded else None),
                 'padded_step_seconds': padded_step.get(f),
                 'flop_ratio': figures['flop_ratio'][f]})
  predicted, predicted_padded, limit = (figures[k] for k in (
      'predicted', 'predicted_padded', 'limit'))
  print(f'{"F":>3} {"K":>3} {"R":>3} {"M":>3} {"slots":>5} {"step ms":>8} {"ratio":>6} '
        f'{"FLOP ratio":>10} {"padded ms":>14}')
  for r in rows:
    pad = (f'{r["padded_step_seconds"] * 1e3:.1f} ({r["padded_slot_width"]})'
           if r['padded_step_seconds'] is not None else '-')
    print(f'{r["frozen_layers"]:3d} {r["pipeline_length"]:3d} {r["replicas"]:3d} '
          f'{r["micro_batches"]:3d} {r["slot_width"]:5d} {r["step_seconds"] * 1e3:8.1f} '
          f'{r["ratio_to_baseline"]:6.2f} {r["flop_ratio"]:10.2f} {pad:>14}')
  print(f'frozen layers per epoch {frozen}: predicted train-time ratio {predicted:.3f} '
        f'({predicted_padded:.3f} with freeze.keep_slot_width; FLOP limit {limit:.3f})')
  out = {'command': ' '.join(sys.argv), 'frozen_per_epoch': frozen, 'rows': rows,
         'predicted_train_ratio': predicted,
         'predicted_train_ratio_keep_slot_width': predicted_padded, 'flop_limit_ratio': limit}
  diskcache.write_atomic(os.path.join(workdir, 'bench_plans.json'),
                         lambda f: json.dump(out, f, indent=2))
  print(f'wrote {workdir}/bench_plans.json')
  return 0


def ratios(step: dict[int, float], padded_step: dict[int, float], frozen: list[int],
           blocks: int) -> dict:
  """The table's figures from each depth's step seconds (``step[0]``: the
  baseline's; ``padded_step``: the depths a kept slot width pads): each
  step's ratio to the baseline's and its FLOP ratio (a trained block 4 units,
  a computed frozen one 1), and over the epochs' depths ``frozen`` the
  predicted train-time ratio, with padding, and the FLOP limit's."""
  def flops(f):
    return 4 * (blocks - f) + f
  baseline = len(frozen) * step[0]
  return {'ratio_to_baseline': {f: s / step[0] for f, s in step.items()},
          'flop_ratio': {f: flops(f) / flops(0) for f in step},
          'predicted': sum(step[f] for f in frozen) / baseline,
          'predicted_padded': sum(padded_step.get(f, step[f]) for f in frozen) / baseline,
          'limit': sum(flops(f) for f in frozen) / (len(frozen) * flops(0))}


def _plans(trainer: Trainer, frozen: list[int], keep_slot_width: bool) -> dict:
  """The plan of every frozen count in ``frozen``, in order as the trainer
  makes them (compression starts from the current K; a kept K keeps the slot
  width with ``keep_slot_width``); M is the config's or K."""
  config, start = trainer.config, trainer.plan
  chosen = config.freeze.keep_slot_width
  plans = {}
  with config.unlocked():
    config.freeze.keep_slot_width = keep_slot_width
  try:
    for f in sorted(set(frozen)):
      partition = trainer._partition_after(f) if f else start.partition  # noqa: SLF001
      plans[f] = trainer.plan = trainer._plan(  # noqa: SLF001
          partition, config.pipeline.micro_batches or partition.pipeline_length)
  finally:
    trainer.plan = start
    with config.unlocked():
      config.freeze.keep_slot_width = chosen
  return plans


if __name__ == '__main__':
  sys.exit(main())
