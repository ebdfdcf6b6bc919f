"""The main job: default config smoke run, the ImageNet path on mocked TFDS
data, and one-line errors for bad input."""
import os
import re
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from experiments import config_keys, datasets, elastic, vit_imagenet
from pipejax import autopipe, resume
from pipejax.data import default_workers
from tests import fixtures


def _config(tmp_path, **overrides):
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.train.epochs = 2
    config.train.max_steps_per_epoch = 5  # M profiling: 3 candidates x 3 rounds
    config.pipeline.profile_path = str(tmp_path / 'profile.json')
    config.freeze.policy = 'schedule'
    config.freeze.alpha = 0.5
    fixtures.override(config, overrides)
  return config


def test_default_config_smoke(tmp_path, monkeypatch):
  workdir = str(tmp_path / 'run')
  summary = elastic.run(_config(tmp_path, **{'data.name': 'digits'}), workdir, task='vit')
  rows, saved = fixtures.check_run_outputs(workdir, 2)
  assert rows[0]['pipeline_length'] == 8 and rows[0]['frozen_layers'] == 0
  # α = 0.5 on 12 layers freezes 6 after the first epoch.
  assert rows[1]['frozen_layers'] == 6
  assert saved['transitions'] and saved['transitions'][0]['frozen_layers'] == 6
  # The α bound predicted that plan, so it was compiled while epoch 0 trained.
  assert saved['transitions'][0]['compiled_ahead'] is True
  assert summary['mode'] == 'elastic'
  # Every plan's micro-batch count was profiled and remembered, with what the
  # run was (so that `pipejax.plan --profile` finds it).
  assert set(saved['micro_batch_timings']) == {'8'}
  (about, choices), = autopipe.profiled_choices(
      str(tmp_path / 'profile.json'), {'model_type': 'vit', 'num_hidden_layers': 12}, 8)
  assert about['batch'] == 32 and choices == {8: rows[1]['micro_batches']}  # after profiling

  # The default config itself (Eq. 1, α = 1/3), a second run with the same
  # profile: nothing is profiled again, the remembered M is used. Its paths
  # start with '~' (the shell leaves `--workdir=~/x` as it is): the user's home.
  monkeypatch.setenv('HOME', str(tmp_path))
  (tmp_path / 'cwd').mkdir()
  monkeypatch.chdir(tmp_path / 'cwd')
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.train.epochs, config.train.max_steps_per_epoch = 2, 5
    config.pipeline.profile_path = '~/profile.json'
    config.cache.directory = '~/cache-again'
    config.cache.disk_mb = 1.0  # a disk tier, so that the run uses the directory
    config.data.name = 'digits'
  again = elastic.run(config, '~/again', task='vit')
  assert os.listdir(tmp_path / 'cwd') == []  # no folder named '~'
  assert os.path.isdir(tmp_path / 'cache-again')
  rows_again, _ = fixtures.check_run_outputs(str(tmp_path / 'again'), 2)
  assert again['micro_batch_timings'] == {}
  assert [r['micro_batches'] for r in rows_again] == [choices[8]] * 2
  assert [r['pipeline_length'] for r in rows_again] == [8, 8]
  decision = again['freeze_decisions'][0]
  assert decision['alpha_bound'] == pytest.approx(4.0)  # 12 / 3
  assert rows_again[1]['frozen_layers'] == decision['result'] == min(4, decision['argmin'] + 1)


def test_digits_are_read_as_scikit_learn_loads_them():
  """The embedded default reads the digits file that scikit-learn ships
  without importing ``sklearn.datasets``; it must give load_digits' arrays."""
  from sklearn.datasets import load_digits  # noqa: PLC0415
  reference = load_digits()
  images, labels = datasets.digits_arrays()
  assert images.dtype == reference.images.dtype and labels.dtype == reference.target.dtype
  np.testing.assert_array_equal(images, reference.images)
  np.testing.assert_array_equal(labels, reference.target)
  data = datasets.digits(seed=3)
  assert len(data.train) + len(data.eval) == len(reference.target) == 1797


_PROBE = """
import sys
from experiments import elastic, vit_imagenet
config = vit_imagenet.get_config()
with config.unlocked():
  config.data.data_dir = sys.argv[1]
data = elastic.resolve_data(config)
print(data.name, 'tensorflow_datasets' in sys.modules)
"""


def test_auto_data_skips_tfds_when_no_imagenet_is_prepared(tmp_path):
  """``data.name=auto`` without a prepared ImageNet falls back to digits
  without importing TFDS (0.5 s); a directory that looks prepared goes
  through TFDS, and one that TFDS cannot read is an error (a broken data
  set, not an absent one), as is a ``data.data_dir`` that does not exist."""
  empty = tmp_path / 'empty'
  empty.mkdir()
  out = subprocess.run([sys.executable, '-c', _PROBE, str(empty)], capture_output=True,
                       text=True, timeout=300, check=True)
  assert out.stdout.splitlines()[-1].split() == ['digits', 'False']
  assert f'ImageNet not found (no prepared imagenet2012 in {empty})' in out.stdout + out.stderr
  # The rest goes through TFDS.
  looks_prepared = tmp_path / 'tfds' / 'imagenet2012' / '5.1.0'
  looks_prepared.mkdir(parents=True)
  (looks_prepared / 'dataset_info.json').write_text('{}')
  assert datasets.imagenet_missing(str(tmp_path / 'tfds')) is None
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.data.data_dir = str(tmp_path / 'tfds')
  with pytest.raises(datasets.DatasetMissing, match='imagenet2012 is not prepared for TFDS in '):
    elastic.resolve_data(config)
  with config.unlocked():
    config.data.data_dir = str(tmp_path / 'nowhere')
  with pytest.raises(elastic.ConfigError, match='nowhere is not a directory'):
    elastic.resolve_data(config)
  with config.unlocked():  # named, not 'auto': the same line, not TFDS's missing file format
    config.data.name = 'imagenet2012'
  with pytest.raises(elastic.ConfigError, match=r'^data.data_dir=\S*nowhere is not a directory$'):
    elastic.resolve_data(config)
  with config.unlocked():
    config.data.name = 'auto'
  assert datasets.imagenet_missing('gs://bucket/tfds') is None  # only TFDS can look there
  odd = tmp_path / 'data [1]' / 'imagenet2012' / '5.1.0'  # glob characters in the path
  odd.mkdir(parents=True)
  (odd / 'dataset_info.json').write_text('{}')
  assert datasets.imagenet_missing(str(tmp_path / 'data [1]')) is None
  assert datasets.imagenet_missing(str(tmp_path / 'data 1')) is not None


def test_a_missing_tensorflow_datasets_is_one_data_set_error(tmp_path, monkeypatch):
  """ImageNet and the GLUE/SQuAD sources say the same one line when the
  ``tensorflow_datasets`` package is absent (``None`` in ``sys.modules``
  makes its import fail)."""
  from experiments import text_data  # noqa: PLC0415
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)
  for read, name in ((lambda: datasets.imagenet(str(tmp_path), 32), 'imagenet2012'),
                     (lambda: text_data.glue('sst2', None, 16, str(tmp_path)), 'glue/sst2')):
    with pytest.raises(datasets.DatasetMissing) as e:
      read()
    assert str(e.value).startswith(f'{name} needs tensorflow-datasets, which is not installed')
    assert str(e.value).endswith('pip install -r requirements.txt')
    assert '\n' not in str(e.value)


def test_a_tfds_data_dir_with_a_tilde_is_the_user_s_home(monkeypatch, tmp_path):
  """Called as a library (the command line expands paths itself), a
  ``data_dir`` of ``~/...`` reaches TFDS as the home's folder, as
  :func:`datasets.imagenet_missing` reads it; none stays none."""
  monkeypatch.setenv('HOME', str(tmp_path))
  asked = []
  tfds = types.SimpleNamespace(data_source=lambda name, split, data_dir, download: asked.append(
      data_dir))
  for data_dir in ('~/tfds', '', None):
    datasets.tfds_data_source(tfds, 'imagenet2012', 'train', data_dir)
  assert asked == [str(tmp_path / 'tfds'), None, None]


def test_a_data_set_tfds_cannot_read_names_where_it_looked(monkeypatch, tmp_path):
  """The one line names the folder TFDS read (data_dir, else $TFDS_DATA_DIR,
  else its default) and the command that prepares the data set there."""
  def refuse(name, split, data_dir, download):
    raise FileNotFoundError(f'no {name} in {data_dir}\nmore')

  tfds = types.SimpleNamespace(data_source=refuse)
  monkeypatch.delenv('TFDS_DATA_DIR', raising=False)
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  for home in (False, True):  # the default data dir: ~/tensorflow_datasets
    for data_dir, where in ((str(tmp_path), str(tmp_path)), ('', 'the default data dir')):
      with pytest.raises(datasets.DatasetMissing) as err:
        datasets.tfds_data_source(tfds, 'imagenet2012', 'train', data_dir)
      # Where no dataset_info.json is, TFDS's error (about file formats) is left out.
      why = ('or its files cannot be read (FileNotFoundError: no imagenet2012 in '
             f'{data_dir or None})' if home else '(no imagenet2012/<version>/dataset_info.json)')
      assert str(err.value) == (
          f'imagenet2012 is not prepared for TFDS in {where}{"," * home} {why}; prepare it with: '
          f'tfds build imagenet2012 --file_format=array_record'
          f'{" --data_dir=" + data_dir if data_dir else ""}')
    for root in (tmp_path, tmp_path / 'home' / 'tensorflow_datasets'):  # a copy TFDS cannot read
      (root / 'imagenet2012' / '5.1.0').mkdir(parents=True, exist_ok=True)
      (root / 'imagenet2012' / '5.1.0' / 'dataset_info.json').write_text('{}')
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path / 'tfds'))
  with pytest.raises(datasets.DatasetMissing, match=re.escape(
      f'imagenet2012 is not prepared for TFDS in $TFDS_DATA_DIR={tmp_path / "tfds"} (no ')):
    datasets.tfds_data_source(tfds, 'imagenet2012', 'train', '')


def test_imagenet_path_on_mock_tfds(tmp_path):
  import tensorflow_datasets as tfds  # noqa: PLC0415 - slow to import
  (tmp_path / 'tfds').mkdir()  # a data dir (the mock reads nothing from it)
  config = _config(tmp_path, **{'data.name': 'imagenet2012', 'data.image_size': 16,
                                'data.data_dir': str(tmp_path / 'tfds'),
                                'model.preset': 'custom', 'model.num_layers': 4,
                                'model.hidden_size': 32, 'model.intermediate_size': 64,
                                'pipeline.initial_length': 4, 'train.batch_size': 16,
                                'pipeline.micro_batches': 4})
  workdir = str(tmp_path / 'imagenet')
  with tfds.testing.mock_data(num_examples=40, policy=tfds.testing.MockPolicy.USE_CODE):
    # data.workers: the threads that read a batch (0: one per core the process may use)
    data = elastic.resolve_data(config)
    assert (data.train.workers, data.eval.workers) == (default_workers(),) * 2
    with config.unlocked():
      config.data.workers = 3
    data = elastic.resolve_data(config)
    assert (data.train.workers, data.eval.workers) == (3, 3)
    summary = elastic.run(config, workdir, task='vit')
  assert summary['data'] == 'imagenet2012'
  rows, _ = fixtures.check_run_outputs(workdir, 2)
  assert rows[1]['frozen_layers'] == 2


def test_synthetic_data_are_the_same_at_every_read_and_run_the_main_job(tmp_path):
  """``data.name=synthetic``: ImageNet's sizes and classes, a sample the same
  at every read (in any batch), labels spread over the classes, IDs out of
  range refused; 'auto' picks ViT-B/16 for it; a run trains on it."""
  data = datasets.synthetic(16, seed=3)
  assert (len(data.train), len(data.eval)) == datasets.IMAGENET_SIZES
  assert (data.num_classes, data.image_size, data.channels) == (1000, 16, 3)
  ids = np.array([5, 1_281_166, 5, 70, 6])
  batch = data.train[ids]
  assert batch['pixel_values'].shape == (5, 16, 16, 3)
  assert batch['pixel_values'].dtype == np.float32 and batch['labels'].dtype == np.int32
  np.testing.assert_array_equal(batch['pixel_values'][0], batch['pixel_values'][2])
  assert batch['labels'][0] == batch['labels'][2]
  again = datasets.synthetic(16, seed=3).train[ids[::-1]]  # another instance, another order
  np.testing.assert_array_equal(again['pixel_values'], batch['pixel_values'][::-1])
  np.testing.assert_array_equal(again['labels'], batch['labels'][::-1])
  assert not np.array_equal(batch['pixel_values'][0], batch['pixel_values'][4])
  assert np.abs(batch['pixel_values']).max() <= 1.0
  labels = data.train[np.arange(20_000)]['labels']
  counts = np.bincount(labels, minlength=1000)
  assert labels.min() >= 0 and labels.max() < 1000 and counts.min() >= 5  # about 20 each
  evaluation = data.eval[np.arange(1000)]['labels']
  assert np.mean(labels[:1000] == evaluation) < 0.01  # another set, not the same one shifted
  assert np.mean(labels[1:1001] == evaluation) < 0.01
  assert len(np.unique(np.diff(labels[:1000]))) > 500  # no step pattern along the IDs
  with pytest.raises(TypeError, match='sample IDs must be integers, got float64'):
    data.train[np.array([1.7])]
  for bad in ([-1], [1_281_167]):
    with pytest.raises(IndexError, match='sample IDs must lie in'):
      data.train[np.array(bad)]
  # 'auto' takes ViT-B/16, whose 16-pixel patches do not divide 8x8 images.
  small = _config(tmp_path, **{'data.name': 'synthetic', 'data.image_size': 8})
  with pytest.raises(elastic.ConfigError, match=r'the patch size 16 \(model.preset=vit-b16\) '
                     r'must divide the 8x8 images of synthetic'):
    elastic.resolve_model(small, elastic.resolve_data(small))
  config = _config(tmp_path, **{'data.name': 'synthetic', 'data.image_size': 8,
                                'model.preset': 'custom', 'model.num_layers': 4,
                                'model.hidden_size': 16, 'model.intermediate_size': 32,
                                'pipeline.initial_length': 4, 'train.max_steps_per_epoch': 2,
                                'pipeline.micro_batches': 4})
  workdir = str(tmp_path / 'synthetic')
  summary = elastic.run(config, workdir, task='vit')
  assert summary['data'] == 'synthetic'
  rows, _ = fixtures.check_run_outputs(workdir, 2)
  assert rows[1]['frozen_layers'] == 2 and rows[0]['pipeline_length'] == 4


def test_an_image_size_the_digits_cannot_take_is_said_in_one_line(tmp_path, capsys):
  """The digits are 8x8 whatever data.image_size says: a size other than the
  default is named, once, and the data are the digits as ever."""
  for size, said in ((32, True), (datasets.DEFAULT_IMAGE_SIZE, False)):
    data = elastic.resolve_data(_config(tmp_path, **{'data.name': 'digits',
                                                     'data.image_size': size}))
    assert (data.name, data.image_size) == ('digits', 8)
    out = capsys.readouterr().out
    assert (f'note: data.image_size={size} applies to ImageNet and synthetic data; the '
            f'digits stay 8x8' in out) is said
    assert out.count('\n') == int(said)


def test_an_imagenet_batch_is_read_by_worker_threads_row_for_row():
  """``TfdsSource`` reads, decodes and prepares a batch's images on worker
  threads; the batch is the one a single thread gives, in the IDs' order
  (repeats included), and a damaged record read by a worker is the same one
  line as read alone."""
  import threading  # noqa: PLC0415
  from experiments.bench_loading import JpegSource  # noqa: PLC0415
  from pipejax.data import DataReadError, TfdsSource  # noqa: PLC0415
  jpegs = JpegSource(10)
  transform = datasets._imagenet_transform(16)  # noqa: SLF001
  ids = np.array([7, 2, 9, 2, 0, 5, 3])
  alone = TfdsSource(jpegs, transform, workers=1)[ids]
  names = []

  def watched(example):
    names.append(threading.current_thread().name)
    return transform(example)

  threaded = TfdsSource(jpegs, watched, workers=3)
  together = threaded[ids]
  assert together.keys() == alone.keys() and together['labels'].tolist() == ids.tolist()
  for key in alone:
    np.testing.assert_array_equal(together[key], alone[key])
  assert len(names) == len(ids) and all(n.startswith('pipejax-data') for n in names)

  class Damaged(JpegSource):
    def __getitem__(self, i):
      if i == 9:
        raise RuntimeError('Corrupted Riegeli/records file')
      return super().__getitem__(i)

  damaged = Damaged.__new__(Damaged)
  damaged.encoded = jpegs.encoded
  for workers in (1, 3):
    with pytest.raises(DataReadError, match=r'RuntimeError: Corrupted.*its files are damaged'):
      TfdsSource(damaged, transform, workers=workers)[ids]
  for workers in (0, -1):
    with pytest.raises(ValueError, match='workers must be >= 1'):
      TfdsSource(jpegs, transform, workers=workers)
  assert TfdsSource(jpegs, transform).workers == min(32, len(os.sched_getaffinity(0)))


def test_imagenet_images_are_prepared_by_the_pretrained_checkpoints_processor(tmp_path, capsys):
  """With ``model.pretrained`` saved with an HF image processor, ImageNet
  images are what that processor makes (ViT's: the whole image resized, then
  its mean and std), checked against PIL and numpy; without one, the largest
  centred square, scaled to [-1, 1], and one line says so; a processor of
  another size than ``data.image_size`` is one config error."""
  import tensorflow_datasets as tfds  # noqa: PLC0415 - slow to import
  from PIL import Image  # noqa: PLC0415
  from transformers import ViTImageProcessor  # noqa: PLC0415
  mean, std = np.array([0.2, 0.4, 0.6]), np.array([0.5, 0.25, 0.125])
  with_processor, without = tmp_path / 'vit', tmp_path / 'bare'
  for folder in (with_processor, without, tmp_path / 'tfds'):  # tfds: the mock's data dir
    folder.mkdir()
  ViTImageProcessor(size={'height': 16, 'width': 16}, image_mean=mean.tolist(),
                    image_std=std.tolist()).save_pretrained(str(with_processor))
  (without / 'config.json').write_text('{"model_type": "vit"}')  # a checkpoint, no processor
  config = _config(tmp_path, **{'data.name': 'imagenet2012', 'data.image_size': 16,
                                'data.data_dir': str(tmp_path / 'tfds'),
                                'model.pretrained': str(with_processor)})
  with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
    raw = tfds.data_source('imagenet2012', split='train')[1]['image']
    assert raw.shape[0] != raw.shape[1] or raw.shape[0] != 16  # a resize that changes something
    data = elastic.resolve_data(config)
    got = data.train[np.array([1])]['pixel_values'][0]
    whole = np.asarray(Image.fromarray(raw).resize((16, 16), Image.BILINEAR), np.float64) / 255
    np.testing.assert_allclose(got, (whole - mean) / std, atol=1e-4)
    # The processor joins the run's identity (checkpoints, AutoCache's disk): a run
    # whose images were prepared otherwise is refused, naming what differs.
    prepared = resume.identity(config, {}, inputs=data.train.preparation)
    assert prepared['inputs.image_processor.image_mean'] == mean.tolist()
    cropped = resume.identity(config, {}, inputs=None)
    assert not any(key.startswith('inputs') for key in cropped)
    meta = {'identity': cropped, 'fingerprint': resume.fingerprint(cropped)}
    with pytest.raises(resume.CheckpointMismatch, match=r'inputs\.image_processor\.'):
      resume.check_identity(meta, prepared, 'ckpt')
    with config.unlocked():
      config.model.pretrained = str(without)
    cropped_data = elastic.resolve_data(config)
    assert cropped_data.train.preparation is None
    got = cropped_data.train[np.array([1])]['pixel_values'][0]
    assert "has no image processor" in capsys.readouterr().out
    side = min(raw.shape[:2])
    top, left = (raw.shape[0] - side) // 2, (raw.shape[1] - side) // 2
    square = Image.fromarray(raw[top:top + side, left:left + side])
    np.testing.assert_allclose(
        got, np.asarray(square.resize((16, 16), Image.BILINEAR), np.float32) / 127.5 - 1.0,
        atol=1e-6)
    with config.unlocked():
      config.model.pretrained, config.data.image_size = str(with_processor), 32
    with pytest.raises(elastic.ConfigError, match='makes images of 16x16, not the 32x32'):
      elastic.resolve_data(config)
    (with_processor / 'preprocessor_config.json').write_text('{"image_processor_type": 7')
    with pytest.raises(elastic.ConfigError, match='cannot use the image processor of'):
      elastic.resolve_data(config)
    with config.unlocked():  # no such checkpoint: loading the model will say so, not this
      config.model.pretrained = str(tmp_path / 'typo')
    assert datasets.image_processor(config.model.pretrained, 16, log=pytest.fail) is None


@pytest.mark.parametrize('args,message', [
    (['--config.freeze.alpha=1.5'], 'alpha must be in (0, 1), got 1.5'),
    (['--config.freeze.policy=eq1'], "unknown freeze policy 'eq1'"),
    (['--config.pipeline.exchange=broadcast'], "pipeline.exchange must be 'auto' or one of"),
    (['--config.pipeline.initial_length=3'], 'initial_length=3 does not divide the 8 devices'),
    (['--config.train.batch_size=60'], 'batch_size=60 must be a multiple of the 8 devices'),
    (['--config.pipeline.micro_batches=24'],
     'the global batch 32 (train.batch_size=32) is not divisible by replicas x micro-batches = '
     '1 x 24 at pipeline.initial_length=8'),
    (['--config.train.batch_size=4096'], 'training samples; lower train.batch_size'),
    (['--config.train.eval_batch_size=12'],
     'train.eval_batch_size=12 must be 0 (4 x the global batch) or a multiple of the 8 devices'),
    (['--config.data.name=imagenet2012', '--config.data.data_dir=/nonexistent'],
     'data.data_dir=/nonexistent is not a directory'),
    (['--config.data.name=imagenet2012', '--config.data.data_dir={tmp}'],
     'imagenet2012 is not prepared'),
    (['--config.data.data_dir={tmp}/nowhere'], 'data.data_dir={tmp}/nowhere is not a directory'),
    (['--config.train.no_such_key=1'], "unknown config key 'train.no_such_key'"),
    (['--config.no_such_group.key=1'], "unknown config key 'no_such_group.key'"),
    (['--config.cache.enabled=True', '--config.pipeline.enabled=False'],
     "unknown config key 'pipeline.enabled'"),  # not cache.enabled, which exists
    (['--config.train.batch_size=abc'], 'invalid literal for int()'),
    (['--config={tmp}/missing.py'], 'cannot load the --config file: [Errno 2] No such file'),
    (['--config={tmp}'], 'cannot load the --config file: [Errno 21] Is a directory'),
    (['--config={tmp}/missing.py', '--config.train.epochs=2'],
     'cannot load the --config file: [Errno 2] No such file'),
    (['--config.train.epochs=2', '--config.x={tmp}/missing.py'],
     "unknown config key 'x'"),
    (['--config.train.learning_rate=-1'], 'train.learning_rate must be > 0, got -1.0'),
    (['--config.train.weight_decay=-0.5'], 'train.weight_decay must be >= 0, got -0.5'),
    (['--config.train.max_steps_per_epoch=-1'], 'train.max_steps_per_epoch must be >= 0'),
    (['--config.freeze.lambda_frozen=nan'], 'freeze.lambda_frozen (a frozen layer'),
    (['--config.pipeline.split_mlp_min_gain=1.5'],
     'pipeline.split_mlp_min_gain must be in [0, 1] (1: never split an MLP between stages), '
     'got 1.5'),
    (['--config.model.pretrained=/nonexistent/vit'],
     "model.pretrained: cannot load pretrained model from '/nonexistent/vit'"),
    (['--config.model.hidden_size=30'], 'model.hidden_size=30 must be a multiple of '
                                        'model.num_heads=4'),
    (['--config.model.num_layers=0'], 'model.num_layers must be >= 1, got 0'),
    (['--config.model.kind=bert-classification'], "model.kind names the model of this entry "
                                                  "point, 'vit'"),
    (['--config.train.batch_mode=per_pipeline', '--config.train.batch_size=6',
      '--config.pipeline.initial_length=4'],
     'train.batch_size=6 must be a multiple of pipeline.initial_length=4 with '
     'train.batch_mode=per_pipeline'),
    (['--config.checkpoint.keep=-1'], 'checkpoint.keep must be >= 1, got -1'),
    (['--config.data.name=synthetic', '--config.data.image_size=0'],
     'data.image_size must be >= 1, got 0'),
    (['--config.data.name=synthetic', '--config.data.image_size=1000000'],
     'data.image_size=1000000: the synthetic images do not fit in memory; use a smaller one'),
    (['--workdir='], '--workdir is empty (leave it out for a fresh folder under ./runs)'),
    (['--workdir', '--config.train.epochs=1'],
     "--workdir took '--config.train.epochs=1' as its folder, which looks like a flag"),
    (['--config.seed=-1'], 'seed must be in [0, 2**32), got -1'),
    (['--config.model.dropout=2'], 'model.dropout must be in [0, 1), got 2'),
    (['--config.model.patch_size=3'], 'the patch size 3 (model.patch_size) must divide the '
                                      '8x8 images of digits'),
    (['--config.model.preset=vit-b16'], 'the patch size 16 (model.preset=vit-b16) must divide '
                                        'the 8x8 images of digits; use model.preset=custom'),
    (['--config.train.epochz=3'], "unknown config key 'train.epochz' (did you mean "
                                  "'train.epochs'?"),
    # Where ml_collections suggests nothing, the nearest of the command's keys.
    (['--config.freeze.alfa=0.5'], "unknown config key 'freeze.alfa' (did you mean "
                                   "'freeze.alpha'? --help lists the keys)"),
    (['--config.train.epochs=1', '--config.train.warmup_epochs=2'],
     'train.warmup_epochs=2.0 must be >= 0 and below train.epochs=1'),
    (['--workdir={tmp}/afile/run'], 'cannot use --workdir={tmp}/afile/run: Not a directory'),
    (['--config.cache.disk_mb=5', '--config.cache.directory={tmp}/afile'],
     'cache.directory={tmp}/afile is not a folder (the disk tier, cache.disk_mb=5.0, keeps its '
     'entries in one)'),
    (['--workdir={tmp}/afile'], 'cannot use --workdir={tmp}/afile: it is a file, not a folder'),
    (['--workdir={tmp}/busy'], '{tmp}/busy/checkpoints is a file, where the run writes its '
                               'folder checkpoints'),
])
def test_bad_input_is_one_line(tmp_path, args, message):
  (tmp_path / 'afile').write_text('not a directory')
  (tmp_path / 'busy').mkdir()
  (tmp_path / 'busy' / 'checkpoints').write_text('not a directory')
  args = [a.format(tmp=tmp_path) for a in args]
  message = message.format(tmp=tmp_path)
  files = [a for a in args if a.startswith('--config=')]  # a file goes before its overrides
  out = subprocess.run([sys.executable, '-m', 'experiments.vit_imagenet',
                        f'--workdir={tmp_path / "w"}', *files,
                        f'--config.pipeline.profile_path={tmp_path / "p.json"}',
                        *[a for a in args if a not in files]],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2
  # One line on stderr (progress and log lines go to stdout), naming the problem.
  assert out.stderr.endswith('\n') and out.stderr.count('\n') == 1, out.stderr
  assert out.stderr.startswith('error: ') and message in out.stderr
  assert 'Traceback' not in out.stderr + out.stdout


def test_a_pretrained_directory_that_cannot_serve_the_data_is_one_clear_error(tmp_path):
  """Another model type (a BERT), damaged weights, or a ViT for other images:
  a ConfigError naming the problem (one line from the entry point), not a
  traceback from HF or the first batch."""
  from models import create, config_for  # noqa: PLC0415
  data = datasets.digits(seed=0)

  def resolve(path):
    config = _config(tmp_path, **{'data.name': 'digits', 'model.pretrained': str(path)})
    with pytest.raises(elastic.ConfigError) as e:
      elastic.resolve_model(config, data)
    assert '\n' not in str(e.value)
    return str(e.value)

  assert "holds a 'bert' model, not a 'vit' one" in resolve(fixtures.minilm_dir())
  rgb = config_for('vit', hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=32, image_size=8, num_channels=3, patch_size=4,
                   num_labels=data.num_classes)
  saved = create('vit', rgb, seed=0)
  saved.hf_class(rgb, seed=0).save_pretrained(str(tmp_path / 'rgb'))
  assert ('takes 8x8 images of 3 channels, the data digits has 8x8 of 1'
          in resolve(tmp_path / 'rgb'))
  damaged = tmp_path / 'damaged'
  damaged.mkdir()
  (damaged / 'config.json').write_text((tmp_path / 'rgb' / 'config.json').read_text())
  (damaged / 'model.safetensors').write_bytes(b'\xff' * 64)
  assert resolve(damaged).startswith(f"model.pretrained: cannot load pretrained model from "
                                     f"'{damaged}'")


def test_help_lists_every_config_key_with_this_command_line_s_values():
  out = subprocess.run([sys.executable, '-m', 'experiments.vit_imagenet', '--help',
                        '--config.train.epochs=3'], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stderr == ''
  assert out.stdout.startswith('usage: python -m experiments.vit_imagenet [--workdir=DIR]')
  lines = set(out.stdout.splitlines())
  assert {'  --config.train.epochs=3', '  --config.freeze.policy=\'pipetransformer\'',
          f'  --config.freeze.alpha={1 / 3}'} <= lines
  listed = {line.split('=')[0].strip()[len('--config.'):] for line in lines
            if line.startswith('  --config.')}
  from ml_collections import config_dict  # noqa: PLC0415
  flat = config_dict.ConfigDict(vit_imagenet.get_config()).to_dict()

  def keys(d, prefix=''):
    for k, v in d.items():
      yield from keys(v, f'{prefix}{k}.') if isinstance(v, dict) else [prefix + k]
  assert listed == set(keys(flat))
  # Each key's meaning follows it, indented.
  out_lines = out.stdout.splitlines()
  at = out_lines.index('  --config.train.epochs=3')
  end = next(i for i in range(at + 1, len(out_lines)) if not out_lines[i].startswith('      '))
  assert out_lines[end].startswith('  --config.') and end > at + 1
  assert ' '.join(line.strip() for line in out_lines[at + 1:end]) == \
      config_keys.MEANINGS['train.epochs']
  assert out_lines[-1] == 'every key, its defaults and meaning: docs/config.md'


def test_every_config_key_has_its_meaning_and_docs_config_md_is_current():
  """``--help`` and ``docs/config.md`` take each key's meaning from
  ``experiments.config_keys``: every key of every entry point has one, none
  is left over, and the page shows the defaults of the code as it is."""
  defaults = config_keys.flat_defaults()
  assert set(defaults) == set(config_keys.MEANINGS)
  assert defaults['data.workers'] == {'vit_imagenet': '0'}
  assert defaults['train.epochs'] == {'vit_imagenet': '10', 'bert_glue': '3', 'bert_squad': '2'}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'docs', 'config.md'), encoding='utf-8') as f:
    page = f.read()
  assert page == config_keys.markdown(), (
      'docs/config.md is stale: python -m experiments.config_keys > docs/config.md')
  assert "| `train.epochs` | `10` | `3` | `2` | epochs to train" in page


def test_a_pretrained_vit_from_a_local_directory_trains(tmp_path):
  """``--config.model.pretrained=DIR``: the run starts from the saved weights
  (every array, the head included when the class count matches) and trains."""
  from models import create, config_for  # noqa: PLC0415
  data = datasets.digits(seed=0)
  hf_config = config_for('vit', hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                         intermediate_size=32, image_size=data.image_size,
                         num_channels=data.channels, patch_size=4,
                         num_labels=data.num_classes)
  saved = create('vit', hf_config, seed=0)
  hf = saved.hf_class(hf_config, seed=11)
  hf.save_pretrained(str(tmp_path / 'vit'))
  config = _config(tmp_path, **{'data.name': 'digits', 'model.pretrained': str(tmp_path / 'vit'),
                                'pipeline.initial_length': 4, 'train.epochs': 1,
                                'train.max_steps_per_epoch': 3, 'pipeline.micro_batches': 4})
  resolved = elastic.resolve_model(config, data)
  got = jax.tree.leaves(resolved.model.to_hf(resolved.params))
  want = jax.tree.leaves(hf.params)
  assert len(got) == len(want)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)
  workdir = str(tmp_path / 'run')
  summary = elastic.run(config, workdir, task='vit')
  rows, _ = fixtures.check_run_outputs(workdir, 1)
  assert rows[0]['pipeline_length'] == 4 and summary['num_layers'] == 4


def test_entry_points_exit_with_their_code_after_the_exit_handlers_and_output(tmp_path):
  """``runtime.exit_now`` (the training commands' last line) skips only the
  interpreter's teardown: the exit handlers run, buffered output is written,
  the exit code is kept."""
  marker = tmp_path / 'handler_ran'
  script = (f'import atexit, sys\n'
            f'from pipejax import runtime\n'
            f'atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))\n'
            f'sys.stdout.write("buffered, no newline")\n'
            f'sys.stderr.write("error line")\n'
            f'runtime.exit_now(3)\n'
            f'print("not reached")\n')
  out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 3
  assert out.stdout == 'buffered, no newline'
  assert out.stderr == 'error line'
  assert marker.read_text() == 'ran'


@pytest.mark.parametrize('every_steps,seen_at', [(0, 5), (2, 2)])
def test_nan_loss_stops_the_run_naming_step_and_checkpoint(tmp_path, monkeypatch, capsys,
                                                           every_steps, seen_at):
  """A NaN loss is a one-line error with the step; no diverged state is saved,
  at an epoch's end or mid-epoch (``checkpoint.every_steps``: the loss is
  read before the save, not only every 10 steps)."""
  real = elastic.datasets.digits

  def poisoned(seed=0):
    data = real(seed=seed)
    data.train.arrays['pixel_values'] = np.full_like(data.train.arrays['pixel_values'], np.nan)
    return data

  monkeypatch.setattr(elastic.datasets, 'digits', poisoned)
  config = _config(tmp_path, **{'data.name': 'digits', 'checkpoint.every_steps': every_steps})
  code = elastic.main(config, str(tmp_path / 'run'), task='vit')
  err = [line for line in capsys.readouterr().err.splitlines() if 'error' in line]
  assert code == 2 and len(err) == 1 and err[0].startswith('error: ')  # (besides tqdm's bar)
  assert f'the training loss is nan at step {seen_at} (epoch 0)' in err[0]
  assert 'Last good checkpoint: none' in err[0]
  assert not os.listdir(tmp_path / 'run' / 'checkpoints')


def test_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
  """An OSError of the machine's files (here: writing the summary on a full
  disk) is one line and exit 2; the rows written before it stay."""
  def full(workdir, summary):
    raise OSError(28, 'No space left on device', os.path.join(workdir, 'summary.json'))

  monkeypatch.setattr(elastic.reporting, 'write_summary', full)
  config = _config(tmp_path, **{'data.name': 'digits', 'train.epochs': 1})
  code = elastic.main(config, str(tmp_path / 'run'), task='vit')
  err = [line for line in capsys.readouterr().err.splitlines() if 'error' in line]
  assert code == 2 and err == [f"error: [Errno 28] No space left on device: "
                               f"'{tmp_path / 'run' / 'summary.json'}'"]
  assert [r['epoch'] for r in elastic.reporting.read_rows(str(tmp_path / 'run'))] == [0]


def test_runs_without_a_workdir_get_a_folder_each_even_in_the_same_second(tmp_path, monkeypatch):
  import datetime  # noqa: PLC0415
  import types  # noqa: PLC0415
  fixed = datetime.datetime(2026, 11, 27, 12, 0, 0)
  monkeypatch.setattr(elastic, 'datetime', types.SimpleNamespace(
      datetime=types.SimpleNamespace(now=lambda: fixed)))
  monkeypatch.chdir(tmp_path)
  first, second, third = (elastic._fresh_workdir('vit') for _ in range(3))
  assert first == os.path.join('runs', 'vit-20261127-120000')
  assert (second, third) == (first + '-2', first + '-3')
  assert all(os.path.isdir(p) and not os.listdir(p) for p in (first, second, third))


def test_several_processes_without_a_workdir_stop_before_the_data_loads(tmp_path, monkeypatch):
  """Each process would make its own ``runs/`` folder: the config error comes
  before the data set and the model are read (both poisoned here)."""
  config = _config(tmp_path, **{'pipeline.micro_batches': 8})
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(jax, 'process_count', lambda: 2)

  def poisoned(*args, **kwargs):
    raise AssertionError('loaded before the workdir check')
  monkeypatch.setattr(elastic, 'resolve_data', poisoned)
  monkeypatch.setattr(elastic, 'resolve_model', poisoned)
  with pytest.raises(elastic.ConfigError, match='several processes needs --workdir'):
    elastic.run(config, None, 'vit')
  assert not os.path.exists(tmp_path / 'runs')


def test_summary_plot_draws_each_epochs_plan_over_that_epoch(tmp_path, monkeypatch):
  """A row's F, K and R held while its epoch ran: from the previous row's
  wall-clock time (the run's start for the first) to its own."""
  import matplotlib.axes  # noqa: PLC0415
  from pipejax import reporting  # noqa: PLC0415
  drawn = []
  step = matplotlib.axes.Axes.step

  def recorded(self, x, y, *args, where='pre', **kwargs):
    drawn.append((list(x), list(y), where))
    return step(self, x, y, *args, where=where, **kwargs)

  monkeypatch.setattr(matplotlib.axes.Axes, 'step', recorded)
  rows = [{'wall_seconds': t, 'frozen_layers': f, 'pipeline_length': k, 'replicas': r,
           'train_loss': 1.0, 'eval_accuracy': 0.5}
          for t, f, k, r in ((2.0, 0, 8, 1), (3.0, 4, 8, 1), (3.5, 9, 4, 2))]
  reporting.plot_summary(str(tmp_path), rows, 'test')
  frozen, k, r = drawn
  # (0, 2]: F=0, (2, 3]: F=4, (3, 3.5]: F=9 — 'pre' takes each segment's value from its right end.
  assert frozen == ([0.0, 2.0, 3.0, 3.5], [0, 0, 4, 9], 'pre')
  assert k[1:] == ([8, 8, 8, 4], 'pre') and r[1:] == ([1, 1, 1, 2], 'pre')
  assert os.path.getsize(tmp_path / 'summary.png') > 1000


def test_importing_an_entry_point_keeps_the_callers_compilation_cache():
  """The test session set JAX's persistent cache (conftest: its own folder, 0.5 s
  threshold); importing an entry point (which runs ``runtime.setup``) keeps it."""
  from pipejax import runtime  # noqa: PLC0415
  before = (jax.config.jax_compilation_cache_dir,
            jax.config.jax_persistent_cache_min_compile_time_secs)
  assert before[0].endswith('jax-tests') and before[1] == 0.5
  runtime.setup(8)
  assert (jax.config.jax_compilation_cache_dir,
          jax.config.jax_persistent_cache_min_compile_time_secs) == before


_BOUNDED_CACHE = """
import os, sys, warnings
warnings.simplefilter('error')  # JAX only warns when it cannot write an entry
from pipejax import runtime
runtime.setup(1)
import jax, jax.numpy as jnp
print(jax.config.jax_compilation_cache_max_size)
jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(4)).block_until_ready()
print(sorted(os.listdir(sys.argv[1])))
"""


def test_the_compilation_cache_is_bounded_and_keeps_earlier_entries_usable(tmp_path):
  """``runtime.setup`` bounds JAX's persistent cache by
  ``PIPEJAX_COMPILATION_CACHE_MB``: a program JAX writes then removes the
  least recently used ones beyond it. An entry of the cache written without
  the bound (no access-time file) gets one, so that write succeeds; a bad
  bound is one line, exit 2; JAX's own setting wins."""
  cache = tmp_path / 'jax'
  cache.mkdir()
  (cache / 'old-cache').write_bytes(b'x' * 2 ** 19)  # 0.5 MB, written by an unbounded cache
  os.utime(cache / 'old-cache', (1e9, 1e9))  # long ago
  env = {**os.environ, 'PYTHONPATH': os.getcwd(), 'PIPEJAX_COMPILATION_CACHE': str(cache),
         'PIPEJAX_COMPILATION_CACHE_MB': '0.5', 'XLA_FLAGS': ''}

  def run(**more):
    return subprocess.run([sys.executable, '-c', _BOUNDED_CACHE, str(cache)], env={**env, **more},
                          capture_output=True, text=True, timeout=300, check=False,
                          cwd=str(tmp_path))

  done = run()
  assert done.returncode == 0, done.stderr[-2000:]
  limit, names = done.stdout.strip().splitlines()
  assert int(limit) == 2 ** 19
  names = eval(names)  # noqa: S307 - the list the child printed
  # The new program is in, with its access time; the old one was the least recent: out.
  assert 'old-cache' not in names and 'old-atime' not in names, names
  written = [n for n in names if n.endswith('-cache')]
  assert any(n.startswith('jit__lambda-') for n in written), names
  assert all(n[:-len('cache')] + 'atime' in names for n in written), names
  assert run(PIPEJAX_COMPILATION_CACHE_MB='1024').stdout.splitlines()[0] == str(2 ** 30)
  assert run(PIPEJAX_COMPILATION_CACHE_MB='').stdout.splitlines()[0] == str(2 ** 31)
  assert run(JAX_COMPILATION_CACHE_MAX_SIZE='-1').stdout.splitlines()[0] == '-1'
  # JAX's own bound needs the access times as much: an old entry gets one too.
  for name in os.listdir(cache):
    os.remove(cache / name)
  (cache / 'older-cache').write_bytes(b'x' * 2 ** 19)
  os.utime(cache / 'older-cache', (1e9, 1e9))
  theirs = run(JAX_COMPILATION_CACHE_MAX_SIZE=str(2 ** 19 + 1000))
  assert theirs.returncode == 0, theirs.stderr[-2000:]
  assert theirs.stdout.splitlines()[0] == str(2 ** 19 + 1000)
  assert 'older-cache' not in os.listdir(cache)
  # A '~' in the folder is the home folder, not a folder named '~'.
  home = tmp_path / 'home'
  tilde = run(PIPEJAX_COMPILATION_CACHE='~/jaxc', HOME=str(home))
  assert tilde.returncode == 0, tilde.stderr[-2000:]
  assert any(n.endswith('-cache') for n in os.listdir(home / 'jaxc'))
  for bad in ('0', 'lots', 'nan'):
    refused = run(PIPEJAX_COMPILATION_CACHE_MB=bad)
    assert refused.returncode == 2 and refused.stdout == ''
    assert refused.stderr.strip() == (
        f"error: PIPEJAX_COMPILATION_CACHE_MB='{bad}' must be a number of megabytes > 0 "
        f"(to turn the cache off: PIPEJAX_COMPILATION_CACHE=)")


@pytest.mark.parametrize('overrides, message', [
    ({'train.epochs': 0}, 'train.epochs must be >= 1, got 0'),
    ({'train.batch_size': 0}, 'train.batch_size must be >= 1, got 0'),
    ({'seed': 2 ** 32}, 'seed must be in [0, 2**32)'),
    ({'train.batch_mode': 'growing'}, "train.batch_mode must be 'constant' or 'per_pipeline'"),
    ({'pipeline.schedule': 'zb'}, 'pipeline.schedule must be one of'),
    ({'pipeline.exchange': 'mail'}, "pipeline.exchange must be 'auto' or one of"),
    ({'pipeline.devices': 9}, 'pipeline.devices=9 must be in [1, 8]: 8 devices are available'),
    ({'pipeline.devices': 0}, 'pipeline.devices=0 must be in [1, 8]'),
    ({'model.initializer_range': float('nan')},
     'model.initializer_range must be > 0 and finite, got nan'),
    ({'model.initializer_range': 0.0}, 'model.initializer_range must be > 0 and finite, got 0.0'),
    ({'pipeline.initial_length': 3}, 'pipeline.initial_length=3 does not divide'),
    ({'checkpoint.every_steps': -1}, 'checkpoint.every_steps must be >= 0, got -1'),
    ({'checkpoint.keep': 0}, 'checkpoint.keep must be >= 1, got 0'),
    ({'data.workers': -1}, 'data.workers must be >= 0 (0: one thread per CPU core), got -1'),
    ({'model.preset': 'custom', 'model.num_heads': 3},
     'model.hidden_size=64 must be a multiple of model.num_heads=3'),
    ({'pipeline.split_mlp_min_gain': 1.5}, 'pipeline.split_mlp_min_gain must be in [0, 1]'),
    ({'pipeline.micro_batches': -1}, 'pipeline.micro_batches must be >= 0'),
    ({'train.warmup_epochs': 10.0}, 'train.warmup_epochs=10.0 must be >= 0 and below'),
    ({'freeze.timestep_steps': -1}, 'freeze.timestep_steps must be >= 0, got -1'),
    ({'train.learning_rate': float('inf')}, 'train.learning_rate must be > 0, got inf'),
    ({'train.learning_rate': float('nan')}, 'train.learning_rate must be > 0, got nan'),
    ({'train.weight_decay': -0.1}, 'train.weight_decay must be >= 0'),
    ({'train.max_grad_norm': -1.0}, 'train.max_grad_norm must be >= 0 (0: no clipping), got -1.0'),
    ({'train.max_grad_norm': float('nan')}, 'train.max_grad_norm must be >= 0'),
    ({'train.max_steps_per_epoch': -1}, 'train.max_steps_per_epoch must be >= 0'),
    ({'freeze.lambda_frozen': 2.0}, 'freeze.lambda_frozen'),
    ({'freeze.timestep_steps': 5, 'train.batch_mode': 'per_pipeline'},
     'freeze.timestep_steps needs train.batch_mode=constant'),
    ({'train.batch_mode': 'per_pipeline', 'train.batch_size': 12},
     'train.batch_size=12 must be a multiple of'),
    ({'train.batch_size': 36}, 'train.batch_size=36 must be a multiple of the 8'),
    ({'train.eval_batch_size': 12}, 'train.eval_batch_size=12 must be 0'),
    ({'cache.policy': 'never'}, 'cache.policy must be one of'),
    ({'cache.dtype': 'int8'}, "cache.dtype must be 'float32', 'bfloat16' or 'float16'"),
    ({'cache.memory_mb': float('nan')}, 'cache.memory_mb and cache.disk_mb must be finite'),
    ({'cache.on_mismatch': 'ignore'}, "cache.on_mismatch must be 'refuse' or 'clear'"),
    ({'freeze.alpha': 1.0}, 'freeze.alpha must be in (0, 1), got 1.0'),
])
def test_check_config_refuses_each_bad_value(overrides, message):
  """Every value the library would reject late (or not at all: a negative
  checkpoint.every_steps saved every step) is refused up front, naming it."""
  config = vit_imagenet.get_config()
  with config.unlocked():
    fixtures.override(config, overrides)
  with pytest.raises(elastic.KNOWN_ERRORS) as err:  # each a one-line error of the CLI
    elastic.check_config(config, 8)
  assert message in str(err.value), str(err.value)
  elastic.check_config(vit_imagenet.get_config(), 8)  # the default passes


def test_too_few_devices_name_the_pipeline_length_that_must_change_too():
  """The default (8 devices, K = 8) on a machine with 4: both keys change."""
  with pytest.raises(elastic.ConfigError) as err:
    elastic.check_config(vit_imagenet.get_config(), 4)
  assert str(err.value) == (
      'pipeline.devices=8 must be in [1, 4]: 4 devices are available; on all of them, '
      'pipeline.initial_length=8 must become one of [1, 2, 4] too')


def test_check_config_refuses_a_batch_a_compressed_pipeline_cannot_split():
  """10 devices, K = 5, 5 samples a pipeline: K = 5 splits them, but the K = 2
  that compression can reach gives 5 replicas x 5 = 25 samples over 10
  devices, which the frozen blocks' data-parallel forward cannot split."""
  config = vit_imagenet.get_config()
  with config.unlocked():
    fixtures.override(config, {'train.batch_mode': 'per_pipeline', 'train.batch_size': 5,
                               'pipeline.initial_length': 5, 'pipeline.devices': 10,
                               'train.eval_batch_size': 0})
  with pytest.raises(elastic.KNOWN_ERRORS, match=r'^train.batch_size=5 gives a global batch '
                     r'of 25 at pipeline length 2 \(R = 5\), which its 10 devices cannot '
                     r'split: .* a multiple of 10$'):
    elastic.check_config(config, 10)
  with config.unlocked():
    config.train.batch_size = 10
  elastic.check_config(config, 10)
  with config.unlocked():
    config.train.batch_size, config.freeze.policy = 5, 'none'
  elastic.check_config(config, 10)  # nothing freezes: no frozen forward to split


def test_check_config_refuses_micro_batches_the_first_plan_cannot_split():
  """A fixed M is held against the first plan's R x M before anything loads
  (the later plans fit M to their batch themselves)."""
  config = vit_imagenet.get_config()
  with config.unlocked():
    fixtures.override(config, {'pipeline.initial_length': 4, 'pipeline.micro_batches': 32})
  with pytest.raises(elastic.ConfigError, match=r'^the global batch 32 \(train.batch_size=32\) '
                     r'is not divisible by replicas x micro-batches = 2 x 32 at '
                     r'pipeline.initial_length=4; '):
    elastic.check_config(config, 8)
  with config.unlocked():
    config.pipeline.micro_batches = 16
  elastic.check_config(config, 8)
  with config.unlocked():  # per pipeline: 32 a replica, 64 in all
    fixtures.override(config, {'train.batch_mode': 'per_pipeline',
                               'pipeline.micro_batches': 32, 'freeze.policy': 'none'})
  elastic.check_config(config, 8)
  with config.unlocked():  # one pipeline, the other devices idle
    fixtures.override(config, {'train.batch_mode': 'constant', 'pipeline.autodp': False})
  elastic.check_config(config, 8)


def test_a_cache_directory_without_a_disk_tier_is_said_unused(monkeypatch, tmp_path, capsys):
  class Loaded(Exception):
    pass

  def loaded(*args):
    raise Loaded()

  monkeypatch.setattr(elastic, 'resolve_data', loaded)  # the checks before it are what counts
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.cache.directory = str(tmp_path / 'c')
  for disk_mb, said in ((0.0, True), (5.0, False)):
    with config.unlocked():
      config.cache.disk_mb = disk_mb
    with pytest.raises(Loaded):
      elastic.run(config, str(tmp_path / 'w'), task='vit')
    note = (f'note: cache.directory={tmp_path / "c"} is not used: cache.disk_mb=0 keeps the '
            f'cache in memory only')
    assert (note in capsys.readouterr().out) == said, disk_mb


def test_a_config_file_is_held_against_the_command_s_keys(tmp_path):
  """A ``--config`` file written for an earlier pipejax (a key and a whole
  group missing) runs with the command's defaults for them, said in one
  line, and an override may name them; a helper that other keys reference
  is named in one line and still followed; a key the command does not read
  (a typo, which would be ignored) is refused in one line, naming the near
  key; and so is a file that does not load."""
  source = open(vit_imagenet.__file__).read()
  older = source.replace("  c.train.max_grad_norm = 0.0", "  pass  # c.train.max_grad_norm")
  older = re.sub(r'\n  c\.distributed\b[^\n]*', '', older)
  assert older.count('max_grad_norm') == 1 and 'c.distributed' not in older
  head, tail = older.rsplit('\n  c.lock()\n', 1)
  older = (head + "\n  c.base = 0.5\n  c.freeze.alpha = c.get_ref('base') * 0.5\n"
           "  c.lock()\n" + tail)
  (tmp_path / 'older.py').write_text(older)

  def keys(*args):
    out = subprocess.run([sys.executable, '-m', 'experiments.vit_imagenet',
                          f'--config={tmp_path / "older.py"}', *args, '--help'],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stdout.splitlines() if line.startswith('note: the --config')]
    return notes, out.stdout.split('config keys (--config.KEY=VALUE)')[1]

  notes, listed = keys('--config.train.epochs=3')
  assert len(notes) == 2 and notes[0] == (
      f"note: the --config file {tmp_path / 'older.py'} sets 1 reference that this command "
      f"does not read itself: 'base'")
  prefix = (f"note: the --config file {tmp_path / 'older.py'} lacks 7 keys (written for an "
            f"earlier pipejax?); the defaults are used: ")
  assert notes[1].startswith(prefix)
  assert sorted(notes[1][len(prefix):].split(', ')) == [
      "distributed.coordinator=''", 'distributed.data_shards=0',
      'distributed.heartbeat_timeout_seconds=100',
      'distributed.initialization_timeout_seconds=300', 'distributed.num_processes=1',
      'distributed.process_id=0', 'train.max_grad_norm=0.0']
  for line in ('--config.train.max_grad_norm=0.0', "--config.distributed.coordinator=''",
               '--config.distributed.num_processes=1', '--config.train.epochs=3',
               '--config.freeze.alpha=0.25'):
    assert f'\n  {line}\n' in listed, line
  # Overrides of a key the file lacks, and of the helper another key follows;
  # the file named -config F, as absl takes it too.
  notes, listed = keys('--config.train.max_grad_norm=1.5', '--config.base=0.4')
  for line in ('--config.train.max_grad_norm=1.5', '--config.freeze.alpha=0.2'):
    assert f'\n  {line}\n' in listed, line
  assert notes[1].startswith(prefix) and notes[1].endswith(
      "distributed.process_id=0; the command line sets train.max_grad_norm=1.5")  # in force

  def refused(name, text):
    (tmp_path / name).write_text(text)
    out = subprocess.run([sys.executable, '-m', 'experiments.vit_imagenet',
                          f'--workdir={tmp_path / "w"}', '-config', str(tmp_path / name)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count('\n') == 1, out.stderr
    assert not os.path.exists(tmp_path / 'w')
    return out.stderr

  typo = source.replace("  c.train.max_grad_norm = 0.0", "  c.train.max_grad_norm = 0.0\n"
                        "  c.train.learning_rte = 1e-3")
  assert refused('typo.py', typo) == (
      f"error: the --config file {tmp_path / 'typo.py'} sets 'train.learning_rte' (did you "
      f"mean 'train.learning_rate'?), which this command does not have (--help lists the "
      f"keys)\n")
  group = ('import ml_collections\n\n\ndef get_config():\n'
           '  return ml_collections.ConfigDict({"train": 5})\n')
  assert refused('group.py', group) == (
      f"error: the --config file {tmp_path / 'group.py'} sets 'train' to a value, where this "
      f"command has a group of keys (train.batch_mode among them)\n")
  assert refused('broken.py', 'def get_config():\n  return 1 / 0\n') == (
      f"error: cannot load the --config file {tmp_path / 'broken.py'}: ZeroDivisionError: "
      f"division by zero\n")
  # get_config() copied alone, without the module's imports.
  assert refused('alone.py', 'def get_config():\n  return datasets.digits()\n') == (
      f"error: cannot load the --config file {tmp_path / 'alone.py'}: NameError: name "
      f"'datasets' is not defined; a copy of an entry point's get_config() needs its imports "
      f"too\n")
  assert refused('none.py', 'def get_config():\n  return None\n') == (
      f"error: get_config() of the --config file {tmp_path / 'none.py'} returned a NoneType, "
      f"not an ml_collections.ConfigDict\n")
  # A value of another type than the command's key has (a traceback from the
  # range checks before); an int where a float is the default is one.
  wrong = (source.replace("  c.train.max_grad_norm = 0.0", "  c.train.max_grad_norm = 1")
           .replace("  c.train.batch_size = 32", "  c.train.batch_size = 'big'")
           .replace("  c.pipeline.micro_batches = 0", "  c.pipeline.micro_batches = None")
           .replace("  c.cache.enabled = True", "  c.cache.enabled = 1"))
  assert wrong.count("'big'") == 1 and 'micro_batches = None' in wrong and 'enabled = 1' in wrong
  assert refused('types.py', wrong) == (
      f"error: the --config file {tmp_path / 'types.py'} sets cache.enabled to 1 (an int), "
      f"where this command takes a bool (default: True) (and 2 more such keys)\n")
  wrong = wrong.replace("  c.cache.enabled = 1", "  c.cache.enabled = True")
  assert refused('types.py', wrong) == (
      f"error: the --config file {tmp_path / 'types.py'} sets pipeline.micro_batches to None (a "
      f"NoneType), where this command takes an int (default: 0) (and 1 more such key)\n")
  # A placeholder the command line fills is the type it is filled with.
  held = source.replace("  c.pipeline.micro_batches = 0",
                        "  c.pipeline.micro_batches = ml_collections.config_dict.placeholder(int)")
  assert 'placeholder(int)' in held
  (tmp_path / 'held.py').write_text(held)
  out = subprocess.run([sys.executable, '-m', 'experiments.vit_imagenet',
                        f'--config={tmp_path / "held.py"}', '--config.pipeline.micro_batches=4',
                        '--help'], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and '\n  --config.pipeline.micro_batches=4\n' in out.stdout, out.stderr
  assert refused('held.py', held) == (
      f"error: the --config file {tmp_path / 'held.py'} sets pipeline.micro_batches to None (a "
      f"NoneType), where this command takes an int (default: 0)\n")
