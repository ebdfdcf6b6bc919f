"""Benchmark: ImageNet batch loading, one thread against one per core.

    python -m experiments.bench_loading --workdir DIR [--images 256 --batch 64 --rounds 3]

ImageNet itself is not needed: ``--images`` photographs' stand-ins (smooth
random colour fields of ImageNet's typical sizes, 500x375 and around it) are
JPEG-encoded in memory once, and a data source decodes them with PIL on every
read, as ``tfds.data_source`` decodes its image feature. The experiments'
:class:`pipejax.data.TfdsSource` then serves batches of ``--batch`` through
each ImageNet preparation (the centre crop, and a ViT checkpoint's
``ViTImageProcessor``) at 224x224, with 1 worker thread and with
``TfdsSource``'s default, one per core the process may use. Each variant
reads every image once a round, the variants interleaved round by round; the
best round counts. Prints a table and writes ``DIR/bench_loading.json`` with
a list ``rows`` (images per second, and the speed-up over one worker), the
default thread count, and ``same_batches``: whether the threads served the
batches one thread serves, bit for bit (exit status 1 when not).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time

import numpy as np

from experiments import datasets
from experiments.bench_cache import check_positive, check_workdir_flag
from pipejax import runtime
from pipejax.data import TfdsSource, default_workers

SIZE = 224


class JpegSource:
  """Encoded images decoded on each read, as TFDS's image feature is."""

  def __init__(self, count: int, seed: int = 0):
    from PIL import Image  # noqa: PLC0415
    rng = np.random.default_rng(seed)
    self.encoded = []
    for i in range(count):
      height, width = 375 + 25 * (i % 5), 500 - 20 * (i % 7)
      coarse = rng.integers(0, 256, (height // 25 + 1, width // 25 + 1, 3), np.uint8)
      image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)  # photo-like
      buffer = io.BytesIO()
      image.save(buffer, format='JPEG', quality=90)
      self.encoded.append(buffer.getvalue())

  def __len__(self) -> int:
    return len(self.encoded)

  def __getitem__(self, i: int) -> dict:
    from PIL import Image  # noqa: PLC0415
    with Image.open(io.BytesIO(self.encoded[i])) as image:
      return {'image': np.asarray(image.convert('RGB')), 'label': np.int64(i % 1000)}


def _parse(argv):
  p = runtime.ArgumentParser(prog='python -m experiments.bench_loading',
                              description=__doc__.split('\n\n')[0])
  p.add_argument('--workdir', required=True, type=os.path.expanduser,
                 help='where bench_loading.json goes')
  p.add_argument('--images', type=int, default=256, help='images read per round')
  p.add_argument('--batch', type=int, default=64, help='images per batch')
  p.add_argument('--rounds', type=int, default=3)
  return p.parse_args(argv)


def _digest(batch: dict) -> str:
  """A batch's arrays, bit for bit (with their keys, dtypes and shapes)."""
  digest = hashlib.sha256()
  for key in sorted(batch):
    value = np.ascontiguousarray(batch[key])
    digest.update(f'{key} {value.dtype.str} {value.shape}'.encode())
    digest.update(value.tobytes())
  return digest.hexdigest()


def _check(args) -> None:
  """Bad flags as one ``ValueError`` line, before anything is built or written."""
  check_positive(args, ('images', 'batch', 'rounds'))
  check_workdir_flag(args.workdir, ('bench_loading.json',))


def main(argv=None) -> int:
  args = _parse(argv)
  try:
    _check(args)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  from transformers import ViTImageProcessor  # noqa: PLC0415 - heavy import kept local
  threads = default_workers()  # what TfdsSource uses by default
  source = JpegSource(args.images)
  preparations = {'centre crop': datasets._imagenet_transform(SIZE),  # noqa: SLF001
                  'ViT processor': datasets._imagenet_transform(  # noqa: SLF001
                      SIZE, ViTImageProcessor(size={'height': SIZE, 'width': SIZE}))}
  variants = [(name, workers) for name in preparations for workers in sorted({1, threads})]
  sources = {(name, workers): TfdsSource(source, preparations[name], workers=workers)
             for name, workers in variants}
  batches = [np.arange(start, min(start + args.batch, args.images))
             for start in range(0, args.images, args.batch)]
  best, same = {}, True
  for _ in range(args.rounds):
    served = {}  # each batch's digest (a round's batches would take GBs)
    for variant in variants:
      seconds, served[variant] = 0.0, []
      for ids in batches:
        start = time.perf_counter()
        batch = sources[variant][ids]
        seconds += time.perf_counter() - start  # the digest is not the loading's time
        served[variant].append(_digest(batch))
      best[variant] = min(best.get(variant, seconds), seconds)
    # The threads must serve what one thread serves, bit for bit: every batch.
    same = same and all(served[(name, workers)] == served[(name, 1)]
                        for name, workers in variants)
  rows = [{'preparation': name, 'workers': workers,
           'images_per_second': args.images / best[(name, workers)],
           'speedup': best[(name, 1)] / best[(name, workers)]} for name, workers in variants]
  print(f'ImageNet batches of {args.batch} at {SIZE}x{SIZE} ({args.images} JPEGs decoded per '
        f'round, best of {args.rounds}; {threads} worker threads by default)')
  print(f'{"preparation":<14} {"workers":>7} {"images/s":>9} {"speed-up":>9}')
  for r in rows:
    print(f'{r["preparation"]:<14} {r["workers"]:>7} {r["images_per_second"]:>9.0f} '
          f'{r["speedup"]:>8.2f}x')
  os.makedirs(args.workdir, exist_ok=True)
  path = os.path.join(args.workdir, 'bench_loading.json')
  with open(path, 'w', encoding='utf-8') as f:
    json.dump({'default_workers': threads, 'images': args.images, 'batch': args.batch,
               'rounds': args.rounds, 'same_batches': same, 'rows': rows}, f, indent=1)
  print(f'wrote {path}')
  if not same:
    print('error: the worker threads served other batches than one thread', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
