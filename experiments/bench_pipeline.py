"""Benchmark: pipeline step time against plain data parallelism, side by side.

    python -m experiments.bench_pipeline --workdir DIR [--layers 8 --hidden 64 ...]

For every (pipeline length K, schedule, micro-batches M) row, the pipelined
loss-and-gradient step of a ViT runs on the ('data', 'stage') mesh of all
devices, interleaved with a plain ``jax.jit`` data-parallel loss-and-gradient
step of the same model on the same devices and batch; ``ratio_to_plain_dp`` is
the ratio of their median times (so machine noise hits both alike). Prints a
table and writes ``DIR/bench_pipeline.json`` with a list ``rows``.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from experiments.bench_cache import check_positive, check_workdir_flag
from pipejax import diskcache, runtime, schedule

OUTPUT = 'bench_pipeline.json'


def _parse(argv):
  p = runtime.ArgumentParser(prog='python -m experiments.bench_pipeline',
                              description=__doc__.split('\n\n')[0])
  p.add_argument('--workdir', required=True, type=os.path.expanduser,
                 help='where bench_pipeline.json goes')
  p.add_argument('--layers', type=int, default=8, help='ViT blocks')
  p.add_argument('--hidden', type=int, default=64, help='ViT hidden size')
  p.add_argument('--image-size', type=int, default=32)
  p.add_argument('--patch-size', type=int, default=4)
  p.add_argument('--batch', type=int, default=128, help='global batch size')
  p.add_argument('--lengths', default='1,2,4,8', help='pipeline lengths K to measure')
  p.add_argument('--schedules', default=','.join(schedule.SCHEDULES),
                 help='comma-separated schedules to measure (default: %(default)s)')
  p.add_argument('--micro-batches', default='1,2',
                 help='M as multiples of K (K=1 uses M=1 as well)')
  p.add_argument('--repeats', type=int, default=7, help='timed steps per row (median)')
  p.add_argument('--devices', type=int, default=8, help='fake CPU devices when on CPU')
  return p.parse_args(argv)


def _ints(flag: str, text: str) -> list[int]:
  """``text`` as a comma-separated list of positive integers."""
  try:
    values = [int(x) for x in text.split(',')]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise ValueError(f'{flag} must be a comma-separated list of positive integers, got {text!r}')
  return values


def _check(args) -> None:
  """Bad flags as one ``ValueError`` line, before anything is built."""
  check_positive(args, ('layers', 'hidden', 'image_size', 'patch_size', 'batch', 'repeats',
                        'devices'))
  if args.image_size % args.patch_size:
    raise ValueError(f'--patch-size {args.patch_size} must divide --image-size '
                     f'{args.image_size}')
  heads = max(1, args.hidden // 32)
  if args.hidden % heads:
    raise ValueError(f'--hidden {args.hidden} must be a multiple of its {heads} attention '
                     f'heads (one per 32)')
  args.lengths = _ints('--lengths', args.lengths)
  args.micro_batches = _ints('--micro-batches', args.micro_batches)
  args.schedules = args.schedules.split(',')
  for name in args.schedules:
    if name not in schedule.SCHEDULES:
      raise ValueError(f'--schedules: unknown schedule {name!r}; expected some of '
                       f'{",".join(sorted(schedule.SCHEDULES))}')
  check_workdir_flag(args.workdir, (OUTPUT,))


def main(argv=None) -> int:
  args = _parse(argv)
  try:
    _check(args)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  runtime.setup(args.devices)
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415

  import models  # noqa: PLC0415
  from pipejax import partition as part, pipeline  # noqa: PLC0415

  cfg = models.config_for('vit', hidden_size=args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=max(1, args.hidden // 32),
                          intermediate_size=4 * args.hidden, image_size=args.image_size,
                          patch_size=args.patch_size, num_labels=10)
  created = models.create('vit', cfg, seed=0)
  model, params = created.model, created.params
  devices = jax.devices()
  n = len(devices)
  if devices[0].platform == 'cpu' and n != args.devices:
    print(f'note: {n} CPU devices, as XLA_FLAGS sets them (--devices {args.devices} applies '
          f'only where XLA_FLAGS does not)', file=sys.stderr)
  rng = np.random.default_rng(0)
  batch = {'pixel_values': rng.normal(size=(args.batch, args.image_size, args.image_size, 3)
                                      ).astype(np.float32),
           'labels': rng.integers(0, 10, args.batch).astype(np.int32)}

  dp_mesh = Mesh(np.array(devices), ('data',))
  dp_params = jax.device_put(params, NamedSharding(dp_mesh, P()))
  dp_batch = jax.device_put(batch, NamedSharding(dp_mesh, P('data')))
  plain = jax.jit(jax.value_and_grad(lambda p, b: model.loss(p, b)[0]))
  key = jax.random.PRNGKey(0)

  def timed(fn):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t

  timed(lambda: plain(dp_params, dp_batch))
  rows = []
  print(f'ViT L={args.layers} d={args.hidden} tokens={(args.image_size // args.patch_size) ** 2 + 1}'
        f' batch={args.batch} on {n} {devices[0].platform} devices', flush=True)
  header = f'{"K":>3} {"R":>3} {"M":>3} {"schedule":>10} {"step s":>9} {"plain s":>9} {"ratio":>7} {"bubble":>7}'
  print(header)
  for k in args.lengths:
    if n % k:
      print(f'skip K={k}: does not divide {n} devices', file=sys.stderr)
      continue
    if k > 2 * args.layers + 2:
      print(f'skip K={k}: more stages than the model\'s {2 * args.layers + 2} units '
            f'(2 per block, the embedding and the head)', file=sys.stderr)
      continue
    r = n // k
    for name in args.schedules:
      ms = sorted({max(1, k * f) for f in args.micro_batches})
      for m in ms:
        if args.batch % (r * m):
          print(f'skip K={k} M={m} {name}: --batch {args.batch} is not divisible by '
                f'{r} replicas x {m} micro-batches', file=sys.stderr)
          continue
        partition = part.even(model.num_layers, k)
        plan = pipeline.Plan(partition, r, m, name)
        pipe = pipeline.Pipeline(model, devices=devices)
        mesh = pipe.mesh(plan)
        stage_params = pipeline.shard_stage_params(params, partition, mesh)
        pipe_batch = jax.device_put(batch, pipeline.batch_sharding(mesh))
        step = pipe.grad_fn(plan, stage_params, train=False)
        compile_s = timed(lambda: step(stage_params, pipe_batch, key))
        step_times, plain_times = [], []
        for _ in range(args.repeats):
          step_times.append(timed(lambda: step(stage_params, pipe_batch, key)))
          plain_times.append(timed(lambda: plain(dp_params, dp_batch)))
        step_s, plain_s = statistics.median(step_times), statistics.median(plain_times)
        bubble = schedule.simulate(schedule.make(name, k, m)).bubble_fraction
        row = dict(pipeline_length=k, replicas=r, micro_batches=m, schedule=name,
                   step_seconds=step_s, plain_dp_seconds=plain_s,
                   ratio_to_plain_dp=step_s / plain_s, bubble_fraction=bubble,
                   first_call_seconds=compile_s, stage_sizes=list(partition.stage_sizes))
        rows.append(row)
        print(f'{k:>3} {r:>3} {m:>3} {name:>10} {step_s:>9.4f} {plain_s:>9.4f} '
              f'{row["ratio_to_plain_dp"]:>7.3f} {bubble:>7.3f}', flush=True)
  if not rows:
    print('error: no row could run: see the lines above', file=sys.stderr)
    return 2
  out = os.path.join(args.workdir, OUTPUT)
  meta = dict(model='vit', layers=args.layers, hidden=args.hidden, batch=args.batch,
              devices=n, platform=devices[0].platform, repeats=args.repeats,
              measured='loss and gradients of one global batch (no optimizer update)')
  diskcache.write_atomic(out, lambda f: json.dump({'meta': meta, 'rows': rows}, f, indent=2))
  print(f'wrote {out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
