"""Paper Fig. 10(b): train-step throughput against the micro-batch count M at
every pipeline length K the freeze schedule reaches. Part ``microbatches`` of
``python -m experiments.reproduce``; also on its own:
``python -m experiments.reproduce_microbatches --workdir DIR [--config...]``.

The (F, K) pairs are those of the main job's config: the frozen counts that
the α bound gives per epoch (the upper bound of Eq. 1), partitioned and
compressed by AutoPipe as the trainer does, each at the first F that reaches
its K. For each, every M ∈ {K, 2K, …, 6K} that divides a replica's batch runs
real train steps (frozen prefix computed, no cache), round-robin over the M
so that machine noise hits all of them; a step's time is the best of
``ROUNDS`` rounds. Writes ``DIR/microbatches.json`` and ``.png``.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time

from pipejax import runtime

runtime.setup(8)

# pylint: disable=wrong-import-position
import jax  # noqa: E402

from experiments import command_line, elastic, reproduce, vit_imagenet  # noqa: E402
from pipejax import autopipe, freeze  # noqa: E402
from pipejax.data import Loader  # noqa: E402
from pipejax.trainer import Trainer  # noqa: E402

ROUNDS, STEPS = 3, 4  # timed rounds, steps per round


def pipeline_lengths(trainer: Trainer, config, num_layers: int) -> dict:
  """``{K: (F, partition)}``: the first F that reaches each K under the α
  bound, partitioned as the trainer's AutoPipe does (from the current K)."""
  policy = freeze.FreezePolicy('schedule', num_layers, config.freeze.alpha,
                               config.freeze.min_active_layers)
  initial = trainer.plan
  out = {initial.pipeline_length: (0, initial.partition)}
  for _ in range(config.train.epochs - 1):
    f = policy.decide(None).result
    partition = trainer._partition_after(f)  # noqa: SLF001 - the trainer's own AutoPipe
    trainer.plan = trainer._plan(partition, partition.pipeline_length)  # noqa: SLF001
    out.setdefault(partition.pipeline_length, (f, partition))
  trainer.plan = initial
  return out


def main(argv=None) -> int:
  parsed = command_line.parse_command_line(vit_imagenet.__file__, argv, require_workdir=True)
  if parsed is None:
    return 2
  try:
    elastic.check_config(parsed[0], len(jax.devices()))
    sweep(*parsed)
  except (elastic.KNOWN_ERRORS + (OSError,)) as e:  # bad input, a missing data set: one line
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


def sweep(config, workdir: str) -> dict:
  """Runs the sweep for ``config`` (the main job's); writes and returns
  ``microbatches.json``'s content."""
  with config.unlocked():
    config.checkpoint.enabled = False
    config.cache.enabled = False
    config.pipeline.profile_path = ''
  os.makedirs(workdir, exist_ok=True)
  data = elastic.resolve_data(config)
  created = elastic.resolve_model(config, data)
  loader = Loader(data.train, config.train.batch_size, seed=config.seed)
  trainer = Trainer(created.model, created.params, config, workdir, loader, loader,
                    devices=jax.devices()[:config.pipeline.devices], log=lambda _: None)
  lengths = pipeline_lengths(trainer, config, created.model.num_layers)
  rows, skipped_by_k = [], {}
  for k, (f, partition) in sorted(lengths.items(), reverse=True):
    base = trainer._plan(partition, k)  # noqa: SLF001
    trainer.plan = base
    # The plan's global batch (per_pipeline: it grows with R), as training feeds it.
    batches = list(itertools.islice(trainer._train_loader().epoch(0), STEPS))  # noqa: SLF001
    trainer.state = trainer._init_state(created.params, base)  # noqa: SLF001
    per_replica = trainer.batch_size(base) // base.replicas
    candidates = autopipe.micro_batch_candidates(k, per_replica)  # what training profiles
    skipped = [m * k for m in range(1, 7) if m * k not in candidates]
    skipped_by_k[str(k)] = skipped  # M that do not divide a replica's batch
    plans = {m: dataclasses.replace(base, micro_batches=m) for m in candidates}
    ids0, batch0 = batches[0]
    fns = {m: trainer._train_step(p, trainer._feed(ids0, batch0, p))  # noqa: SLF001
           for m, p in plans.items()}
    best = {m: float('inf') for m in candidates}
    for round_ in range(ROUNDS + 1):  # round 0 compiles and warms up
      for m, plan in plans.items():
        trainer.plan = plan
        jax.block_until_ready(trainer.state)
        t0 = time.perf_counter()
        for ids, batch in batches:
          trainer._run_step(fns[m], trainer._feed(ids, batch, plan))  # noqa: SLF001
        jax.block_until_ready(trainer.state)
        if round_:
          best[m] = min(best[m], (time.perf_counter() - t0) / len(batches))
    batch = len(batches[0][0])  # samples per step
    for m in candidates:
      rows.append({'pipeline_length': k, 'frozen_layers': f, 'replicas': base.replicas,
                   'micro_batches': m, 'm_over_k': m / k, 'step_seconds': best[m],
                   'samples_per_second': batch / best[m]})
    fastest = min(candidates, key=best.__getitem__)
    print(f'K={k} F={f} R={base.replicas}: ' + ', '.join(
        f'M={m} {batch / best[m]:.0f}/s' for m in candidates) + f' -> fastest M={fastest}'
        + (f' (M={skipped} do not divide the {per_replica} samples per replica)'
           if skipped else ''), flush=True)
  out = {'command': ' '.join(sys.argv), 'machine': reproduce.machine(), 'rounds': ROUNDS,
         'steps_per_round': STEPS, 'lengths': {str(k): f for k, (f, _) in lengths.items()},
         'skipped': skipped_by_k, 'rows': rows}
  with open(os.path.join(workdir, 'microbatches.json'), 'w') as fh:
    json.dump(out, fh, indent=2)
  _plot(workdir, rows)
  return out


def _plot(workdir: str, rows: list[dict]) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6.4, 3.4))
  for k in sorted({r['pipeline_length'] for r in rows}, reverse=True):
    mine = [r for r in rows if r['pipeline_length'] == k]
    ax.plot([r['m_over_k'] for r in mine], [r['samples_per_second'] for r in mine], 'o-',
            label=f'K={k} (F={mine[0]["frozen_layers"]}, R={mine[0]["replicas"]})')
  ax.set_xlabel('M / K')
  ax.set_ylabel('train samples / s')
  ax.set_title('throughput against micro-batches', fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'microbatches.png'), dpi=80)
  plt.close(fig)


if __name__ == '__main__':
  sys.exit(main())
