"""Data sets of the experiments: ImageNet from TFDS (array_record, read with
``tfds.data_source``, no TensorFlow), the embedded default, scikit-learn's
handwritten digits (1,797 real 8x8 images shipped with the package), and
synthetic ImageNet-shaped data for measuring speed without a data set."""
from __future__ import annotations

import dataclasses
import glob
import gzip
import importlib.util
import json
import os
from typing import Callable

import numpy as np

from pipejax import distributed, runtime
from pipejax.data import ArraySource, TfdsSource


class DatasetMissing(RuntimeError):
  """A requested data set is not prepared."""


@dataclasses.dataclass
class Dataset:
  name: str
  train: object
  eval: object
  num_classes: int
  image_size: int
  channels: int
  evaluator: Callable | None = None  # a Trainer evaluator; None: the built-in accuracy


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's digits as ``(images [1797, 8, 8] float64 in 0..16,
  labels [1797] int)``, exactly what ``sklearn.datasets.load_digits`` gives.

  Read straight from the file scikit-learn ships (``load_digits`` parses the
  same file): importing ``sklearn.datasets`` costs ~1.2 s of every run's
  start-up here, the file 0.03 s."""
  spec = importlib.util.find_spec('sklearn')  # locates the package without importing it
  if spec is None or not spec.submodule_search_locations:
    raise DatasetMissing('the embedded default needs scikit-learn, which is not installed; '
                         'pip install -r requirements.txt')
  path = os.path.join(list(spec.submodule_search_locations)[0], 'datasets', 'data',
                      'digits.csv.gz')
  if not os.path.exists(path):  # a layout we do not know: ask scikit-learn itself
    from sklearn.datasets import load_digits  # noqa: PLC0415
    d = load_digits()
    return d.images, d.target
  with gzip.open(path, 'rt') as f:
    data = np.loadtxt(f, delimiter=',')
  return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int, copy=False)


def digits(eval_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """scikit-learn's digits: 8x8 grey images scaled to [0, 1], a fixed split."""
  raw_images, raw_labels = digits_arrays()
  images = (raw_images / 16.0).astype(np.float32)[..., None]
  labels = raw_labels.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(images))
  n_eval = int(round(len(images) * eval_fraction))
  ev, tr = order[:n_eval], order[n_eval:]
  return Dataset('digits', ArraySource({'pixel_values': images[tr], 'labels': labels[tr]}),
                 ArraySource({'pixel_values': images[ev], 'labels': labels[ev]}),
                 num_classes=10, image_size=8, channels=1)


#: ``data.image_size`` of the main job's config: ViT-B/16's 224x224.
DEFAULT_IMAGE_SIZE = 224
#: ImageNet's (ILSVRC 2012) training and validation images, and its classes.
IMAGENET_SIZES = (1_281_167, 50_000)
IMAGENET_CLASSES = 1000


class SyntheticSource:
  """ImageNet-shaped synthetic samples for speed measurements: sample ``i``'s
  image is one of ``pool`` fixed random images (``i % pool``) and its label a
  hash of ``i``, both the same at every read, so a batch costs a copy and
  runs need no data set. The labels are random: a model learns nothing from
  them, and accuracy stays at chance (1/classes)."""

  randomly_augmented = False

  def __init__(self, size: int, image_size: int, classes: int = IMAGENET_CLASSES,
               seed: int = 0, pool: int = 64):
    if size < 1 or image_size < 1 or classes < 1 or pool < 1:
      raise ValueError(f'synthetic data needs positive sizes, got size={size}, '
                       f'image_size={image_size}, classes={classes}, pool={pool}')
    self.size, self.classes, self.seed = int(size), int(classes), int(seed)
    self.preparation = {'synthetic': {'image_size': int(image_size), 'pool': int(pool)}}
    rng = np.random.default_rng([self.seed, image_size, pool])
    # In [-1, 1], as the centre crop of a real image is scaled.
    self.pool = rng.uniform(-1.0, 1.0, (pool, image_size, image_size, 3)).astype(np.float32)

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    ids = np.asarray(ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise TypeError(f'sample IDs must be integers, got {ids.dtype}')
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= self.size):
      raise IndexError(f'sample IDs must lie in [0, {self.size}), got '
                       f'{int(ids.min())}..{int(ids.max())}')
    return {'pixel_values': self.pool[ids % len(self.pool)], 'labels': self._labels(ids)}

  def _labels(self, ids: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of (seed, ID), modulo the classes: labels with
    no pattern along the IDs, another set for another seed."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over='ignore'):  # arithmetic modulo 2**64, as meant
      x = ids.astype(np.uint64) + np.uint64(self.seed + 1) * golden
      x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
      x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
      x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(self.classes)).astype(np.int32)


def synthetic(image_size: int, seed: int = 0) -> Dataset:
  """ImageNet-shaped synthetic data (:class:`SyntheticSource`): as many
  training and evaluation samples as ImageNet, ``image_size`` square RGB
  images, 1000 classes. For speed: its accuracy is chance."""
  train, evaluation = (SyntheticSource(n, image_size, seed=seed + i)
                       for i, n in enumerate(IMAGENET_SIZES))
  return Dataset('synthetic', train, evaluation, num_classes=IMAGENET_CLASSES,
                 image_size=image_size, channels=3)


def _imagenet_transform(image_size: int, processor=None):
  """An example's ``pixel_values [size, size, 3]`` and label: by the HF
  ``processor`` of a pretrained checkpoint when given (its own resizing and
  normalisation: ViT's resizes the whole image and scales to [-1, 1]),
  otherwise the largest centred square resized and scaled to [-1, 1]."""
  from PIL import Image  # noqa: PLC0415

  def transform(example):
    img = Image.fromarray(np.asarray(example['image'])).convert('RGB')
    if processor is not None:
      pixels = processor(images=img, return_tensors='np')['pixel_values'][0]  # [3, h, w]
      return {'pixel_values': np.transpose(pixels, (1, 2, 0)).astype(np.float32),
              'labels': np.int32(example['label'])}
    w, h = img.size
    side = min(w, h)  # centre crop, then resize (deterministic: no augmentation)
    img = img.crop(((w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2))
    img = img.resize((image_size, image_size), Image.BILINEAR)
    pixels = (np.asarray(img, np.float32) / 127.5) - 1.0
    return {'pixel_values': pixels, 'labels': np.int32(example['label'])}
  return transform


def imagenet_missing(data_dir: str | None, name: str = 'imagenet2012') -> str | None:
  """Why ``name`` is certainly not prepared in ``data_dir`` (by default TFDS's:
  ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``), found without importing
  TFDS (0.5 s of every embedded-default run); None when it may be, and TFDS
  decides. A prepared data set has ``<dir>/<name>/[<config>/]<version>/dataset_info.json``."""
  root = data_dir or os.environ.get('TFDS_DATA_DIR', os.path.join('~', 'tensorflow_datasets'))
  if '://' in root:
    return None  # a remote file system: only TFDS can look
  root = os.path.expanduser(root)
  for pattern in ('*', os.path.join('*', '*')):
    if glob.glob(os.path.join(glob.escape(root), glob.escape(name), pattern,
                              'dataset_info.json')):
      return None
  return f'no prepared {name} in {root}'


def import_tfds(name: str):
  """The ``tensorflow_datasets`` module; :class:`DatasetMissing` (one line)
  when it is not installed, since ``name`` cannot be read without it."""
  try:
    import tensorflow_datasets as tfds  # noqa: PLC0415
  except ImportError as e:
    raise DatasetMissing(f'{name} needs tensorflow-datasets, which is not installed '
                         f'({e}); pip install -r requirements.txt') from e
  return tfds


def tfds_data_source(tfds, name: str, split: str, data_dir: str | None):
  """``tfds.data_source`` of a prepared data set; :class:`DatasetMissing`
  (one line, with the command that prepares it) when it is not prepared.
  ``~`` in ``data_dir`` is the user's home, as on the command line."""
  data_dir = os.path.expanduser(data_dir) if data_dir else None
  try:
    with runtime.absl_errors_only():  # TFDS warns about each folder it probes
      return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
  except Exception as e:  # tfds raises several types for "not prepared"
    where = data_dir or (f'$TFDS_DATA_DIR={os.environ["TFDS_DATA_DIR"]}'
                         if os.environ.get('TFDS_DATA_DIR') else 'the default data dir')
    if imagenet_missing(data_dir, name):  # certainly absent: TFDS's guess about formats is noise
      why = f'{name} is not prepared for TFDS in {where} (no {name}/<version>/dataset_info.json)'
    else:
      text = distributed.first_line(str(e), 160)
      detail = f': {text}' if text else ''
      why = (f'{name} is not prepared for TFDS in {where}, or its files cannot be read '
             f'({type(e).__name__}{detail})')
    raise DatasetMissing(
        f'{why}; prepare it with: tfds build {name} '
        f'--file_format=array_record{" --data_dir=" + data_dir if data_dir else ""}') from e


def imagenet(data_dir: str | None, image_size: int, name: str = 'imagenet2012',
             make_processor: Callable[[], object] | None = None,
             workers: int | None = None) -> Dataset:
  """ImageNet via ``tfds.data_source``; raises :class:`DatasetMissing`.
  ``make_processor``: called once the data are found, gives a pretrained
  checkpoint's HF image processor to prepare the images, or None (see
  :func:`image_processor`). ``workers``: threads that read a batch (None:
  :func:`pipejax.data.default_workers`)."""
  tfds = import_tfds(name)
  train = tfds_data_source(tfds, name, 'train', data_dir)
  evaluation = tfds_data_source(tfds, name, 'validation', data_dir)
  processor = make_processor() if make_processor else None
  transform = _imagenet_transform(image_size, processor)
  # What the config alone does not say: a run resumed, or a disk cache read,
  # with images prepared otherwise is refused (the centre crop adds nothing).
  preparation = None if processor is None else {'image_processor': {
      k: v for k, v in json.loads(processor.to_json_string()).items() if not k.startswith('_')}}
  return Dataset(name, TfdsSource(train, transform, workers=workers, preparation=preparation),
                 TfdsSource(evaluation, transform, workers=workers, preparation=preparation),
                 num_classes=1000, image_size=image_size, channels=3)


def image_processor(path: str, image_size: int, log=print):
  """The HF image processor saved with the pretrained checkpoint ``path``
  (its ``preprocessor_config.json``, in the folder or the local HF cache),
  checked to give ``image_size`` square images. None where the checkpoint
  has none (said in one line: the images are then centre-cropped and scaled
  to [-1, 1]) or cannot be found (loading the model then says why).
  :class:`ValueError` (one line) where it cannot be loaded or gives another
  size."""
  from huggingface_hub import constants  # noqa: PLC0415
  from transformers.utils import cached_file  # noqa: PLC0415 - heavy import kept local

  def find(name):
    try:  # from the hub too where it may be reached (HF_HUB_OFFLINE=0), as the model is
      return cached_file(path, name, local_files_only=constants.HF_HUB_OFFLINE,
                         _raise_exceptions_for_missing_entries=False)
    except Exception:  # noqa: BLE001 - not a folder nor a cached model name
      return None

  if find('preprocessor_config.json') is None:
    if find('config.json') is not None:  # a checkpoint, saved without a processor
      log(f'{path!r} has no image processor (preprocessor_config.json); ImageNet images are '
          f'centre-cropped and scaled to [-1, 1]')
    return None
  try:
    from PIL import Image  # noqa: PLC0415
    from transformers import AutoImageProcessor  # noqa: PLC0415
    processor = AutoImageProcessor.from_pretrained(path, use_fast=False)
    shape = processor(images=Image.new('RGB', (300, 200)),
                      return_tensors='np')['pixel_values'].shape
  except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad config
    raise ValueError(f'cannot use the image processor of {path!r}: '
                     f'{distributed.first_line(str(e), 160) or type(e).__name__}') from e
  if tuple(shape[1:]) != (3, image_size, image_size):
    raise ValueError(f'the image processor of {path!r} makes images of {shape[2]}x{shape[3]}, '
                     f'not the {image_size}x{image_size} of data.image_size')
  return processor
