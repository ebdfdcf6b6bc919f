"""Benchmark: AutoCache read / write throughput per tier and storage dtype.

    python -m experiments.bench_autocache --workdir DIR [--batch 64 --seq 65 --hidden 64]

For the storage dtypes float32 and bfloat16 (float16 stores as many bytes
as bfloat16) and each tier (memory only; disk only; disk with prefetch),
one epoch of ``--batches`` batches of ``[batch, seq, hidden]`` float32
activations is written through :meth:`ActivationCache.fetch` (all misses), then
read back twice (all hits); then each batch of the second read is copied
from an in-memory array (the floor: gathering the rows, nothing else). Every
figure is the median over the batches. Disk reads mostly hit the OS page
cache, as they would during training when the file fits in RAM. Prints a table
and writes ``DIR/bench_autocache.json`` with a list ``rows``.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from experiments.bench_cache import check_positive, check_workdir_flag
from pipejax import diskcache, runtime
from pipejax.autocache import ActivationCache


def _parse(argv):
  p = runtime.ArgumentParser(prog='python -m experiments.bench_autocache',
                              description=__doc__.split('\n\n')[0])
  p.add_argument('--workdir', required=True, type=os.path.expanduser,
                 help='where bench_autocache.json goes')
  p.add_argument('--batch', type=int, default=64)
  p.add_argument('--seq', type=int, default=65)
  p.add_argument('--hidden', type=int, default=64)
  p.add_argument('--batches', type=int, default=32, help='batches per epoch')
  return p.parse_args(argv)


def _epoch(cache, batches, values, work_seconds=0.0):
  """Median seconds per batch of fetching every batch (``work_seconds`` of
  simulated training between fetches, excluded)."""
  times = []
  for ids in batches:
    if work_seconds:
      time.sleep(work_seconds)
    start = time.perf_counter()
    cache.fetch(ids, lambda rows, ids=ids: values[ids[rows]])
    times.append(time.perf_counter() - start)
  return statistics.median(times)


OUTPUT = 'bench_autocache.json'


def _check(args) -> None:
  """Bad flags as one ``ValueError`` line, before anything is written."""
  check_positive(args, ('batch', 'seq', 'hidden', 'batches'))
  check_workdir_flag(args.workdir, (OUTPUT,))


def main(argv=None) -> int:
  args = _parse(argv)
  try:
    _check(args)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  batch_mb = args.batch * args.seq * args.hidden * 4 / 2**20
  # The caches live in a folder of this run's own, never one of the user's.
  scratch = tempfile.mkdtemp(prefix='.bench-autocache-', dir=args.workdir)
  try:
    rows = _measure(args, batch_mb, scratch)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  print(f'[{args.batch}, {args.seq}, {args.hidden}] float32 batch = {batch_mb:.2f} MiB; '
        f'{args.batches} batches; median ms per batch')
  print(f'{"dtype":9} {"tier":14} {"write ms":>9} {"read ms":>8} {"floor ms":>9} '
        f'{"write MB/s":>11} {"read MB/s":>10} {"prefetched":>10}')
  for r in rows:
    print(f'{r["dtype"]:9} {r["tier"]:14} {r["write_ms"]:9.3f} {r["read_ms"]:8.3f} '
          f'{r["gather_in_memory_ms"]:9.3f} {r["write_mb_s"]:11.0f} {r["read_mb_s"]:10.0f} '
          f'{r["prefetched"]:10d}')
  out = os.path.join(args.workdir, OUTPUT)
  diskcache.write_atomic(out, lambda f: json.dump({'meta': vars(args), 'rows': rows}, f,
                                                  indent=2))
  print(f'wrote {out}')
  return 0


def _measure(args, batch_mb: float, scratch: str) -> list[dict]:
  """A row per dtype and tier, their caches under ``scratch``."""
  n = args.batch * args.batches
  shape = (args.seq, args.hidden)
  values = np.random.default_rng(0).normal(size=(n,) + shape).astype(np.float32)
  rows = []
  for dtype in ('float32', 'bfloat16'):
    entry = int(np.prod(shape)) * np.dtype(np.float32).itemsize // (2 if dtype == 'bfloat16' else 1)
    for tier in ('memory', 'disk', 'disk+prefetch'):
      directory = os.path.join(scratch, f'cache-{dtype}-{tier}')
      prefetch = 4 * args.batch * entry if tier == 'disk+prefetch' else 0
      memory = 2 * n * entry if tier == 'memory' else prefetch
      disk = 0 if tier == 'memory' else 2 * n * (entry + 32)
      cache = ActivationCache(identity='bench', num_samples=n, entry_shape=shape, dtype=dtype,
                              memory_bytes=memory, disk_bytes=disk, directory=directory,
                              prefetch_bytes=prefetch, depth=1, log=lambda s: None)
      order = np.random.default_rng(1).permutation(n)
      batches = [order[i:i + args.batch] for i in range(0, n, args.batch)]
      write = _epoch(cache, batches, values)
      reads = []
      for epoch in (2, 3):
        order = np.random.default_rng(epoch).permutation(n)
        batches = [order[i:i + args.batch] for i in range(0, n, args.batch)]
        if tier == 'disk+prefetch':
          cache.prefetch(batches)
        # With prefetch, a 5 ms "training step" between fetches lets the reads overlap it.
        reads.append(_epoch(cache, batches, values, 0.005 if tier == 'disk+prefetch' else 0.0))
      copies = []
      for ids in batches:
        start = time.perf_counter()
        values[ids].copy()
        copies.append(time.perf_counter() - start)
      floor = statistics.median(copies)
      stats = cache.stats()
      cache.close()
      shutil.rmtree(directory, ignore_errors=True)
      rows.append({'dtype': dtype, 'tier': tier, 'write_ms': 1e3 * write,
                   'read_ms': 1e3 * reads[-1], 'gather_in_memory_ms': 1e3 * floor,
                   'write_mb_s': batch_mb / write, 'read_mb_s': batch_mb / reads[-1],
                   'prefetched': stats['prefetched'], 'hits': stats['hits']})
  return rows


if __name__ == '__main__':
  sys.exit(main())
