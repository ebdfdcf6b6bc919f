"""Several processes: data shards, the stage axis inside a process, a job of
2 processes x 4 fake CPU devices on loopback (gloo) against the single-process
8-device run (without and with AutoCache), and a dead process stopping the job
in one line."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import jax
import numpy as np
import pytest

from experiments import datasets, elastic, vit_imagenet
from pipejax import checkpoints, distributed, frozen_prefix
from pipejax.data import ArraySource, ShardedLoader, host_subset
from pipejax.pipeline import PlanError
from pipejax.trainer import Trainer
from tests import fixtures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A tiny ViT on digits; K0 = 4 (one process's devices), α = 0.75 freezes 3 of
# 4 blocks after epoch 0 and AutoPipe shrinks the pipeline to K = 2, R = 4.
SMALL = {'data.name': 'digits', 'model.num_layers': 4, 'model.hidden_size': 16,
         'model.num_heads': 2, 'model.intermediate_size': 32, 'train.epochs': 2,
         'train.batch_size': 16, 'train.max_steps_per_epoch': 2,
         'pipeline.initial_length': 4, 'pipeline.micro_batches': 2, 'pipeline.profile_path': '',
         'freeze.policy': 'schedule', 'freeze.alpha': 0.75, 'freeze.compile_ahead': False}


# -- data shards and meshes (one process) ------------------------------------------------
def _source(n=70):
  return ArraySource({'x': np.arange(n, dtype=np.float32)[:, None], 'y': np.arange(n)})


def test_shards_read_by_one_process_equal_the_processes_parts_in_order():
  source = _source()
  whole = ShardedLoader(source, 8, shards=2, local_shards=(0, 1), seed=3)
  parts = [ShardedLoader(source, 8, shards=2, local_shards=(p,), seed=3) for p in (0, 1)]
  assert whole.steps_per_epoch() == parts[0].steps_per_epoch() == 35 // 4
  for epoch in (0, 1):
    for (ids, batch), (i0, b0), (i1, b1) in zip(whole.epoch(epoch), parts[0].epoch(epoch),
                                                parts[1].epoch(epoch), strict=True):
      np.testing.assert_array_equal(ids, np.concatenate([i0, i1]))
      np.testing.assert_array_equal(batch['y'], np.concatenate([b0['y'], b1['y']]))
  assert parts[0].served and not parts[0].served & parts[1].served
  assert parts[0].served <= set(host_subset(70, 0, 2, 3).tolist())
  assert whole.served == parts[0].served | parts[1].served
  # Epochs reshuffle within a shard.
  assert not np.array_equal(parts[0].batch_ids(0)[0], parts[0].batch_ids(1)[0])


def test_an_empty_evaluation_shard_pads_with_its_process_s_own_samples():
  """Fewer samples than shards: an empty shard's padding reads a sample of
  its own process (not another process's, unless it holds none), masked, and
  is not recorded as served."""
  source = _source(3)
  loaders = [ShardedLoader(source, 8, shards=4, local_shards=(2 * p, 2 * p + 1), seed=0,
                           shuffle=False, drop_remainder=False) for p in (0, 1)]
  for loader in loaders:
    own = set(loader.ids.tolist())
    for ids, batch in loader.epoch(0):
      assert set(ids.tolist()) <= own, (ids, own)
      assert set(ids[batch['example_mask'] > 0].tolist()) == loader.served
  assert sorted(loaders[0].served | loaders[1].served) == [0, 1, 2]
  assert not loaders[0].served & loaders[1].served


def test_sharded_evaluation_counts_every_sample_once():
  source = _source(37)  # shards of 19 and 18: the short one is padded
  parts = [ShardedLoader(source, 8, shards=2, local_shards=(p,), shuffle=False,
                         drop_remainder=False) for p in (0, 1)]
  assert parts[0].steps_per_epoch() == parts[1].steps_per_epoch() == 5
  counted = []
  for part in parts:
    for ids, batch in part.epoch(0):
      counted += list(ids[batch['example_mask'] > 0])
  assert sorted(counted) == list(range(37))


def _devices(processes, per_process):
  return [types.SimpleNamespace(id=p * 100 + i, process_index=p)
          for p in range(processes) for i in range(per_process)]


def test_a_pipeline_never_crosses_processes():
  devices = _devices(2, 4)
  for k in (1, 2, 4):
    distributed.check_pipeline_length(k, devices)
  with pytest.raises(PlanError, match=r'pipeline length 8 does not fit in one process '
                                      r'\(4 devices per process.*use one of \[1, 2, 4\]'):
    distributed.check_pipeline_length(8, devices)
  distributed.check_pipeline_length(8, _devices(1, 8))  # one process: anything that divides
  shuffled = _devices(2, 4)[::-1]
  assert [d.process_index for d in distributed.ordered_devices(shuffled)] == [0] * 4 + [1] * 4


def test_a_pipeline_spans_the_devices_every_process_has():
  assert distributed.pipeline_span(_devices(1, 8)) == 8
  assert distributed.pipeline_span(_devices(2, 4)) == 4
  assert distributed.pipeline_span(_devices(4, 2)) == 2
  uneven = _devices(1, 6) + [types.SimpleNamespace(id=100 + i, process_index=1)
                             for i in range(4)]
  assert distributed.pipeline_span(uneven) == 2
  for devices in (_devices(2, 4), _devices(4, 2), uneven):  # what it allows fits
    span = distributed.pipeline_span(devices)
    distributed.check_pipeline_length(span, devices)
    if 2 * span <= len(devices) and len(devices) % (2 * span) == 0:
      with pytest.raises(PlanError):
        distributed.check_pipeline_length(2 * span, devices)


def test_a_checkpoint_s_pipeline_is_shortened_to_fit_a_process():
  """Saved on one process of 8 devices at K=8 (or K=4), resumed by a job of
  2 × 4 or 4 × 2 devices: the same device count, but a pipeline must stay in
  one process (it was refused, with advice naming lengths the run already had)."""
  def restored(processes, per_process, saved_k, frozen, initial):
    trainer = types.SimpleNamespace(devices=_devices(processes, per_process),
                                    num_devices=processes * per_process,
                                    initial_length=initial)
    meta = {'devices': 8, 'plan': {'pipeline_length': saved_k, 'frozen_layers': frozen}}
    return Trainer._restored_length(trainer, meta)

  assert restored(1, 8, 8, 0, 8) == 8  # the same devices: the saved plan
  assert restored(1, 8, 4, 3, 8) == 4
  assert restored(2, 4, 8, 0, 4) == 4
  assert restored(2, 4, 8, 0, 8) == 4
  assert restored(4, 2, 8, 3, 8) == 2
  assert restored(2, 4, 4, 3, 8) == 4  # fits: kept
  assert restored(2, 4, 2, 5, 8) == 2  # compressed: never grows back


def test_multi_process_limits_are_one_line(monkeypatch):
  import jax  # noqa: PLC0415
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(jax, 'local_device_count', lambda: 4)
  config = vit_imagenet.get_config()
  with config.unlocked():
    fixtures.override(config, {**SMALL, 'pipeline.initial_length': 8})
  with pytest.raises(elastic.ConfigError, match=r'initial_length=8 does not fit in one process '
                                                r'\(4 devices each.*use one of \[1, 2, 4\]'):
    elastic.check_config(config, 8)
  with config.unlocked():
    fixtures.override(config, {'pipeline.initial_length': 4, 'pipeline.micro_batches': 0})
  with pytest.raises(elastic.ConfigError, match='micro_batches=0 .* not supported with several'):
    elastic.check_config(config, 8)
  with config.unlocked():
    fixtures.override(config, {'pipeline.micro_batches': 4, 'pipeline.autodp': False})
  with pytest.raises(elastic.ConfigError, match=r"pipeline.autodp=False is not supported with "
                                                r"several processes \(its one pipeline would run "
                                                r"on process 0's devices alone"):
    elastic.check_config(config, 8)
  with config.unlocked():
    config.pipeline.autodp = True
  elastic.check_config(config, 8)


def test_processes_that_found_different_data_sets_are_refused(monkeypatch):
  """``data.name='auto'`` looks on each host's disk: one host with ImageNet
  and one without would train different models into the same collectives."""
  import jax  # noqa: PLC0415
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.distributed.update(coordinator='localhost:1234', num_processes=2)
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  gathered = []

  def gather(values):  # process 1 reports what it found: here the same, then not
    gathered.append(values[0])
    return np.array([[values[0]], [values[0] if len(gathered) == 1 else values[0] + 1]])

  monkeypatch.setattr(distributed, 'gather_exact', gather)
  distributed.check_same_data(config, 'digits, 1437 training and 360 evaluation samples')
  with pytest.raises(distributed.DistributedError,
                     match=r'^process 1 found another data set than process 0 \(this process: '
                           r'digits, 1437 training and 360 evaluation samples\)'):
    distributed.check_same_data(config, 'digits, 1437 training and 360 evaluation samples')
  assert gathered[0] == gathered[1]  # the same description, the same digest


def test_one_data_shard_for_several_processes_is_refused(monkeypatch):
  """Each process would read the whole data set and feed it as its part of
  the global batch: every sample twice."""
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.distributed.data_shards = 1
  monkeypatch.setattr(elastic.jax, 'process_count', lambda: 2)
  data = elastic.datasets.digits()
  with pytest.raises(elastic.ConfigError, match=r'^distributed.data_shards=1 must be a multiple '
                                                r'of the 2 processes'):
    elastic._loaders(config, data)


def test_data_shards_are_checked_before_the_data_load(monkeypatch, tmp_path):
  """By the main job (the benchmarks that read no shards leave them be)."""
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.distributed.data_shards = 3
  monkeypatch.setattr(elastic, 'resolve_data', lambda *a: pytest.fail('the data were loaded'))
  with pytest.raises(elastic.ConfigError, match=r'^distributed.data_shards=3 must be a multiple '
                                                r'of the 1 processes and divide '
                                                r'train.batch_size=32 '):
    elastic.run(config, str(tmp_path / 'w'), task='vit')
  assert not (tmp_path / 'w').exists()
  elastic.check_config(config, 8)  # plain_dp's and the benchmarks' own check
  with config.unlocked():
    config.distributed.data_shards, config.train.batch_mode = 2, 'per_pipeline'
    config.train.batch_size = 8
  with pytest.raises(elastic.ConfigError, match=r'^distributed.data_shards > 1 needs '
                                                r'train.batch_mode=constant$'):
    elastic.run(config, str(tmp_path / 'w'), task='vit')
  with config.unlocked():
    config.distributed.data_shards = 0  # one shard, this process's: the plain loaders
  assert elastic._data_shards(config, 1) == 1


@pytest.mark.parametrize('key,value,message', [
    ('coordinator', 'localhost', "must be 'host:port' or 'auto'"),
    ('coordinator', 'localhost:99999', r"coordinator='localhost:99999': the port must be in "
                                       r'\[1, 65535\], got 99999'),
    ('coordinator', 'localhost:0', r'the port must be in \[1, 65535\], got 0'),
    ('process_id', 2, r'process_id=2 must be in \[0, num_processes=2\)'),
    ('data_shards', -1, 'data_shards must be >= 0'),
])
def test_bad_distributed_config_is_one_line(key, value, message):
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.distributed.update(coordinator='localhost:1234', num_processes=2)
    config.distributed[key] = value
  with pytest.raises(distributed.DistributedError, match=message):
    distributed.check_config(config)


@pytest.mark.parametrize('settings,message', [
    ({'num_processes': 2, 'process_id': 1},
     'num_processes=2 and process_id=1 need distributed.coordinator'),
    ({'initialization_timeout_seconds': 0}, 'initialization_timeout_seconds must be >= 1'),
])
def test_a_job_of_several_processes_needs_its_coordinator(settings, message):
  """Without a coordinator each host would run the whole job alone, into the
  same workdir."""
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.distributed.update(settings)
  with pytest.raises(distributed.DistributedError, match=message):
    distributed.check_config(config)


def test_auto_outside_a_cluster_is_one_line(tmp_path):
  out = subprocess.run([sys.executable, '-m', 'experiments.vit_imagenet',
                        f'--workdir={tmp_path / "w"}', '--config.distributed.coordinator=auto'],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.startswith("error: cannot join the job (distributed.coordinator='auto')")
  assert 'Traceback' not in out.stderr + out.stdout


def test_a_stop_is_agreed_at_every_tenth_poll_when_any_process_asked(monkeypatch):
  """``agreed_stop`` with two processes (the process count and the gather
  faked; the job tests below only see a combine that happens to agree):
  between its tenth polls it answers False without asking, and at them it
  stops every process when any one was asked, this one or its peer."""
  import jax  # noqa: PLC0415
  from jax.experimental import multihost_utils  # noqa: PLC0415
  local, peer, gathered, asked = {'asks': True}, {'asks': False}, [], []

  def allgather(values):
    gathered.append(int(values[0]))
    return np.stack([values, np.array([int(peer['asks'])], np.int32)])

  def stop_requested():
    asked.append(1)
    return local['asks']

  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(multihost_utils, 'process_allgather', allgather)
  assert distributed.agreed_stop(None) is None
  poll = distributed.agreed_stop(stop_requested)
  assert [poll() for _ in range(9)] == [False] * 9 and not asked and not gathered
  assert poll() is True and gathered == [1]
  local['asks'], peer['asks'] = False, True
  assert [poll() for _ in range(9)] == [False] * 9 and gathered == [1]
  assert poll() is True and gathered == [1, 0]  # only the peer was asked
  peer['asks'] = False
  assert [poll() for _ in range(10)] == [False] * 10 and gathered == [1, 0, 0]
  assert len(asked) == 3
  monkeypatch.setattr(jax, 'process_count', lambda: 1)
  assert distributed.agreed_stop(stop_requested) is stop_requested  # one process: every poll


# -- a job of two processes ------------------------------------------------------------------
# One job at a time (see pyproject's addopts): on a starved CPU a process can
# fall more than gloo's fixed 30 s behind its peer at a new collective.
JOBS = pytest.mark.xdist_group('multi_process_jobs')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _job_env(devices: int) -> dict:
  """The environment of a job's process: this repository on the path, and
  this session's XLA flags with ``devices`` CPU devices."""
  return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
              XLA_FLAGS=fixtures.xla_flags(devices))


def _launch(workdir, overrides: dict, heartbeat=10, only: dict | None = None,
            env_of: dict | None = None):
  """Starts the main job as 2 processes x 4 fake CPU devices; returns them.
  ``only``: ``{process: [arguments]}`` given to that process alone;
  ``env_of``: ``{process: {variable: value}}`` likewise."""
  port = _free_port()
  env = _job_env(4)
  args = [f'--config.{k}={v}' for k, v in overrides.items()] + [
      f'--config.distributed.coordinator=localhost:{port}',
      '--config.distributed.num_processes=2',
      f'--config.distributed.heartbeat_timeout_seconds={heartbeat}', f'--workdir={workdir}']
  return [subprocess.Popen([sys.executable, '-m', 'experiments.vit_imagenet', *args,
                            *(only or {}).get(p, []),
                            f'--config.distributed.process_id={p}'], cwd=ROOT,
                          env={**env, **(env_of or {}).get(p, {})},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True) for p in (0, 1)]


def _finish(processes, timeout):
  """``[(returncode, stdout, stderr)]``; kills the job if it outlives ``timeout``."""
  out = []
  deadline = time.monotonic() + timeout
  for p in processes:
    try:
      stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      for q in processes:
        if q.poll() is None:
          os.killpg(q.pid, signal.SIGKILL)
      stdout, stderr = p.communicate()
      pytest.fail(f'the job did not finish in {timeout}s:\n{stderr[-3000:]}')
    out.append((p.returncode, stdout, stderr))
  return out


def _rows(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@JOBS
def test_two_processes_match_one_process(tmp_path):
  workdir = str(tmp_path / 'job')
  # AutoCache off in both: the plain paths (the prefix run every step); the
  # cached job is compared below.
  overrides = {**SMALL, 'checkpoint.enabled': False, 'cache.enabled': False}
  results = _finish(_launch(workdir, overrides), timeout=240)
  # The reference: one process, 8 devices, the same 2 data shards (run after
  # the job, not beside it: 2 CPU cores would starve the job's processes).
  config = vit_imagenet.get_config()
  with config.unlocked():
    fixtures.override(config, {**overrides, 'distributed.data_shards': 2})
  elastic.run(config, str(tmp_path / 'single'), task='vit')
  for p, (code, stdout, stderr) in enumerate(results):
    assert code == 0, f'process {p}: {stderr[-3000:]}'
    assert f'process {p} of 2 joined the job (4 local devices, 8 in all)' in stdout
  rows, reference = _rows(workdir), _rows(str(tmp_path / 'single'))
  assert len(rows) == 2  # process 0 alone wrote the metrics
  assert [(r['pipeline_length'], r['replicas'], r['frozen_layers']) for r in rows] == [
      (4, 2, 0), (2, 4, 3)]
  assert [r['pipeline_length'] for r in reference] == [4, 2]
  # The same global batches through the same programs; only the gradient
  # mean over 'data' crosses processes (gloo). Measured: bitwise equal with
  # one replica per process (R=2); ~1e-7 relative at R=4, where two replicas
  # per process are summed in another order than in one process.
  losses = [r['train_loss'] for r in rows], [r['train_loss'] for r in reference]
  print(f'train losses, 2 processes x 4 devices: {losses[0]}; 1 process x 8: {losses[1]}')
  np.testing.assert_allclose(*losses, rtol=1e-6)
  assert [r['eval_accuracy'] for r in rows] == [r['eval_accuracy'] for r in reference]
  read = []
  for p in (0, 1):
    with open(os.path.join(workdir, 'sample_ids', f'process_{p}.json')) as f:
      read.append(json.load(f))
    assert read[p]['shards'] == [p]
  train = [set(r['train']) for r in read]
  assert train[0] and train[1] and not train[0] & train[1]
  assert not set(read[0]['eval']) & set(read[1]['eval'])
  with open(os.path.join(tmp_path, 'single', 'sample_ids', 'process_0.json')) as f:
    assert set(json.load(f)['train']) == train[0] | train[1]
  assert os.path.exists(os.path.join(workdir, 'summary.json'))


# AutoCache in a job: α = 0.5 freezes 2, then 3 of the 4 blocks (F = 0, 2, 3;
# K = 4, 4, 2), so the entries each process fills at depth 2 in epoch 1 are
# advanced to depth 3 and reused in epoch 2. Whole epochs of 256 samples (5
# steps over a process's 719) make samples come back; a 0.1 MB memory budget
# sends most entries to each process's disk file.
CACHED = {**SMALL, 'train.epochs': 3, 'train.batch_size': 256, 'train.max_steps_per_epoch': 0,
          'freeze.alpha': 0.5, 'checkpoint.enabled': False, 'cache.policy': 'always',
          'cache.memory_mb': 0.1, 'cache.disk_mb': 1.0}
COUNTERS = ('hits', 'misses', 'advanced', 'layer_passes', 'repeated_layer_passes')


@JOBS
def test_two_processes_with_autocache_match_one_process(tmp_path, monkeypatch):
  from pipejax.trainer import Trainer  # noqa: PLC0415
  from tests.test_cache_training import _check_fed_as_computed, _record_feeds  # noqa: PLC0415
  workdir = str(tmp_path / 'job')
  # Checkpoints on for the job: they carry each sample's counters, the max of
  # the processes' (each counts only its own samples).
  results = _finish(_launch(workdir, {**CACHED, 'checkpoint.enabled': True}), timeout=480)
  # References, one process x 8 devices over the same 2 shards: cache on and off.
  init, recorded = Trainer.__init__, []

  def recording(self, *args, **kwargs):
    init(self, *args, **kwargs)
    recorded.append((self, _record_feeds(self)))

  for name, enabled in (('cached', True), ('plain', False)):
    config = vit_imagenet.get_config()
    with config.unlocked():
      fixtures.override(config, {**CACHED, 'cache.enabled': enabled,
                                 'distributed.data_shards': 2})
    with monkeypatch.context() as patch:
      if enabled:  # what the one-process cached run fed its pipeline
        patch.setattr(Trainer, '__init__', recording)
      elastic.run(config, str(tmp_path / name), task='vit')
  # Row by row its sample's own prefix output, looked up by ID in the source
  # (entries in memory and on disk; computed at F = 2, advanced to 3):
  # measured within 5.6e-7 (F = 2) and 8.1e-7 (F = 3) of each row's largest
  # value (up to 5; batches of 256), rounding that the tiny fixtures' rows
  # (under 1, batches of 16) keep under 3e-7.
  [(trainer, fed)] = recorded
  ids = np.unique(np.concatenate([i for i, _, _ in fed]))
  looked_up = trainer.train_loader.source[ids]
  data = {k: np.zeros((ids.max() + 1,) + np.shape(v)[1:], np.asarray(v).dtype)
          for k, v in looked_up.items()}
  for k, v in looked_up.items():
    data[k][ids] = v
  steps = trainer.train_loader.steps_per_epoch()
  assert _check_fed_as_computed(trainer, data, fed, 2e-6) == [2] * steps + [3] * steps
  for p, (code, stdout, stderr) in enumerate(results):
    assert code == 0, f'process {p}: {stderr[-3000:]}'
  rows, cached, plain = (_rows(str(d)) for d in (workdir, tmp_path / 'cached',
                                                 tmp_path / 'plain'))
  for run in (rows, cached, plain):
    assert [(r['pipeline_length'], r['replicas'], r['frozen_layers']) for r in run] == [
        (4, 2, 0), (4, 2, 2), (2, 4, 3)]
  assert [r['cache'] for r in rows] == [r['cache'] for r in cached] == [False, True, True]
  losses = [[r['train_loss'] for r in run] for run in (rows, cached, plain)]
  print(f'train losses, 2 processes x 4 devices, cache on: {losses[0]}; 1 process x 8, cache '
        f'on: {losses[1]}; cache off: {losses[2]}')
  # Measured: the three equal.
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
  np.testing.assert_allclose(losses[0], losses[2], rtol=1e-6)
  assert [r['eval_accuracy'] for r in rows] == [r['eval_accuracy'] for r in cached]
  # The same decision on both processes, taken from both processes' timings.
  decisions = [[line for line in out.splitlines() if 'autocache: F=' in line]
               for _, out, _ in results]
  assert len(decisions[0]) == 2 and decisions[0] == decisions[1], decisions
  assert all('the slowest of 2 processes' in line for line in decisions[0])
  # The metrics sum both processes' counters: the same samples went through
  # the same cache steps as in one process, none through a frozen block twice.
  total = {k: rows[-1][f'cache_{k}'] for k in COUNTERS}
  print(f'cache counters of the job (summed): {total}')
  assert total == {k: cached[-1][f'cache_{k}'] for k in COUNTERS}
  assert total['repeated_layer_passes'] == 0 and rows[1]['cache_hits'] == 0
  assert rows[2]['cache_hits'] > 0 and total['advanced'] == rows[1]['cache_misses']
  # Each process cached only samples of its own shard, and reused them.
  sides, samples = [], len(datasets.digits().train)
  for p in (0, 1):
    with open(os.path.join(workdir, 'sample_ids', f'process_{p}.json')) as f:
      sides.append(json.load(f))
    own = set(host_subset(samples, p, 2, seed=0).tolist())
    held = set(sides[p]['cache']['cached_ids'])
    assert held and held <= own and held <= set(sides[p]['train'])
    assert sides[p]['cache']['cache_hits'] > 0 and sides[p]['cache']['cache_disk_entries'] > 0
    assert os.path.getsize(os.path.join(workdir, 'cache', f'process_{p}', 'entries.bin')) > 0
  assert not set(sides[0]['cache']['cached_ids']) & set(sides[1]['cache']['cached_ids'])
  for k in COUNTERS:
    assert sides[0]['cache'][f'cache_{k}'] + sides[1]['cache'][f'cache_{k}'] == total[k]
  # The last checkpoint's per-sample counters: both processes' samples, as
  # the one process counted them.
  meta, _ = checkpoints.Checkpoints(workdir).latest_meta()
  assert meta['step'] == rows[-1]['step']
  saved = {k: frozen_prefix._unpack(meta['cache']['samples'][k]) for k in ('passes', 'reached')}
  np.testing.assert_array_equal(saved['passes'], trainer.prefix.cache.layer_passes_per_sample())
  assert saved['passes'].sum() == total['layer_passes'] and saved['reached'].max() == 3


@JOBS
def test_the_job_refuses_a_pipeline_longer_than_a_process(tmp_path):
  job = _launch(str(tmp_path / 'job'), {**SMALL, 'pipeline.initial_length': 8})
  for p, (code, _, stderr) in enumerate(_finish(job, timeout=120)):
    assert code == 2, f'process {p}: {stderr[-3000:]}'
    assert stderr.strip().splitlines()[-1] == (
        'error: pipeline.initial_length=8 does not fit in one process (4 devices each; the '
        'stage axis stays inside a host); use one of [1, 2, 4]'), stderr[-3000:]


@JOBS
def test_a_job_on_a_workdir_in_use_is_refused_on_every_process(tmp_path):
  """A one-process run holds the workdir (its ``.lock``, which a job's
  process 0 takes too): the job stops on both processes in one line, before
  it trains or writes anything, and before it reads its data (here a data set
  that is not there, whose error would come first otherwise)."""
  workdir = tmp_path / 'job'
  workdir.mkdir()
  unloadable = {**SMALL, 'data.name': 'imagenet2012', 'data.data_dir': str(tmp_path / 'none')}
  with fixtures.lock_held_elsewhere(workdir / elastic.LOCK_FILE) as pid:
    results = _finish(_launch(str(workdir), unloadable), timeout=240)
  lines = [stderr.strip().splitlines()[-1] for _, _, stderr in results]
  assert [code for code, _, _ in results] == [2, 2], lines
  assert lines[0].startswith(f'error: --workdir={workdir} is in use by another run (pid '
                             f'{pid} on '), lines
  assert lines[1] == (f'error: --workdir={workdir} is in use by another run (refused on '
                      f'process 0): wait for it to end or stop it, or use another --workdir')
  assert sorted(os.listdir(workdir)) == ['.lock', '.lock.process_1']


@JOBS
def test_a_job_with_a_bad_data_name_is_refused_before_it_claims_the_workdir(tmp_path):
  """A job claims its workdir before its data loads, but after the settings
  that need no data: an unknown data set creates no folder."""
  workdir = tmp_path / 'job'
  results = _finish(_launch(str(workdir), {**SMALL, 'data.name': 'mnist'}), timeout=240)
  lines = [stderr.strip().splitlines()[-1] for _, _, stderr in results]
  assert [code for code, _, _ in results] == [2, 2], lines
  assert lines == ["error: data.name must be 'auto', 'imagenet2012', 'digits' or 'synthetic', "
                   "got 'mnist'"] * 2
  assert not workdir.exists()


@JOBS
def test_a_process_that_cannot_join_says_so_in_one_line(tmp_path):
  env = _job_env(4)
  port = _free_port()  # nobody serves it: process 0 never started
  done = subprocess.run(
      [sys.executable, '-m', 'experiments.vit_imagenet', '--config.data.name=digits',
       f'--config.distributed.coordinator=localhost:{port}', '--config.distributed.num_processes=2',
       '--config.distributed.process_id=1', '--config.distributed.initialization_timeout_seconds=3',
       f'--workdir={tmp_path / "job"}'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=120)
  assert done.returncode == 3
  assert done.stderr.strip().splitlines()[-1].startswith(
      f'error: process 1 could not join the job at localhost:{port} within 3s: start the same '
      'command on every host, each with its own distributed.process_id in 0..1 '), done.stderr
  assert 'Check failure stack trace' not in done.stderr


def test_a_coordinator_port_in_use_is_one_line(tmp_path):
  """Process 0 cannot serve the coordinator on a port another program holds:
  JAX failed with a traceback, or crashed printing nothing (exit 139)."""
  holder = socket.create_server(('', 0))
  port = holder.getsockname()[1]
  try:
    with pytest.raises(distributed.DistributedError, match=(
        rf"^process 0 cannot serve the job's coordinator on port {port} "
        rf"\(distributed.coordinator='localhost:{port}'\): .*in use.*; stop what holds")):
      distributed.check_coordinator_port(f'localhost:{port}')
    env = _job_env(4)
    done = subprocess.run(
        [sys.executable, '-m', 'experiments.vit_imagenet', '--config.data.name=digits',
         f'--config.distributed.coordinator=localhost:{port}',
         '--config.distributed.num_processes=2', '--config.distributed.process_id=0',
         f'--workdir={tmp_path / "job"}'], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120)
  finally:
    holder.close()
  assert done.returncode == 2, done.stderr[-2000:]
  assert done.stderr.strip().splitlines()[-1].startswith(
      f"error: process 0 cannot serve the job's coordinator on port {port} "), done.stderr
  assert 'Traceback' not in done.stderr
  distributed.check_coordinator_port(f'localhost:{port}')  # free again


def _wait_for_checkpoint(workdir, processes, timeout):
  directory = os.path.join(workdir, 'checkpoints')
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if any(p.poll() is not None for p in processes):
      return None
    if os.path.isdir(directory) and any(n.isdigit() for n in os.listdir(directory)):
      time.sleep(1.0)  # let the collective save finish on both processes
      return directory
    time.sleep(0.5)
  return None


@JOBS
@pytest.mark.parametrize('victim', [1, 0])
def test_a_dead_process_stops_the_job_in_one_line(tmp_path, victim):
  """Kills one process (its supervisor and, with it, its training) after the
  first checkpoint; the other must stop in one line (exit 3) naming the newest
  checkpoint, whether a collective failed first or the coordination service
  noticed (which of the two is a race), and the same command resumes."""
  survivor = 1 - victim
  workdir = str(tmp_path / 'job')
  heartbeat = 10
  job = _launch(workdir, {**SMALL, 'train.epochs': 50}, heartbeat=heartbeat)
  try:
    directory = _wait_for_checkpoint(workdir, job, timeout=180)
    if directory is None:
      codes = [p.poll() for p in job]
      pytest.fail(f'no checkpoint appeared (exit codes {codes}): '
                  f'{job[0].stderr.read()[-3000:] if codes[0] is not None else ""}')
    os.killpg(job[victim].pid, signal.SIGKILL)  # the whole "host" of the victim
    killed = time.monotonic()
    code, _, stderr = _finish([job[survivor]], timeout=heartbeat + 50)[0]
    detected = time.monotonic() - killed
  finally:
    for p in job:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      p.communicate()
  lines = stderr.strip().splitlines()
  print(f'process {survivor} stopped {detected:.1f}s after process {victim} was killed: '
        f'{lines[-1]}')
  assert code == 3, stderr[-3000:]
  assert lines[-1].startswith(f'error: process {survivor} stopped: ')
  assert 'another process' in lines[-1] and 'relaunch the same command' in lines[-1]
  assert 'Check failure stack trace' not in stderr and 'Traceback' not in stderr
  steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
  assert steps and f'last checkpoint: {os.path.join(directory, str(steps[-1]))};' in lines[-1]
  if victim == 0:
    return  # one relaunch (below) is enough
  # The same command on both processes resumes from the last checkpoint.
  job = _launch(workdir, {**SMALL, 'train.epochs': 3}, heartbeat=heartbeat)
  results = _finish(job, timeout=240)
  for p, (code, _, stderr) in enumerate(results):
    assert code == 0, f'process {p}: {stderr[-3000:]}'
  assert f'resuming from {os.path.join(directory, str(steps[-1]))}' in results[0][1]
  assert [r['epoch'] for r in _rows(workdir)] == [0, 1, 2]


# On the path of one process only: its training (the supervised child) stops
# at epoch 1 with a full disk, the kind of error one host meets alone.
FULL_DISK_AT_EPOCH_1 = """
import os
if os.environ.get('PIPEJAX_SUPERVISED'):
  import pipejax.trainer
  train_epoch = pipejax.trainer.Trainer.train_epoch

  def failing(self, epoch, *args, **kwargs):
    if epoch == 1:
      raise OSError(28, 'No space left on device', '/injected/full-disk')
    return train_epoch(self, epoch, *args, **kwargs)

  pipejax.trainer.Trainer.train_epoch = failing
"""


@JOBS
@pytest.mark.parametrize('failing', [1, 0])
def test_an_error_on_one_process_stops_the_others_in_one_line_naming_it(tmp_path, failing):
  """One process stops with an error of its own at epoch 1. It must tell
  the others: they stop in one line that names it and its error, where they
  used to wait in their next collective until the heartbeat timed out (600 s
  here, beyond this test's limit) and then blame a lost peer. The failed
  process keeps its own one-line error (exit 2; a progress bar on stderr hid
  it from the supervisor, which replaced it with a lost-peer line)."""
  inject = tmp_path / 'inject'
  inject.mkdir()
  (inject / 'sitecustomize.py').write_text(FULL_DISK_AT_EPOCH_1)
  workdir = str(tmp_path / 'job')
  job = _launch(workdir, {**SMALL, 'train.epochs': 5}, heartbeat=600,
                env_of={failing: {'PYTHONPATH': f'{inject}{os.pathsep}{ROOT}'}})
  results = _finish(job, timeout=240)
  error = "[Errno 28] No space left on device: '/injected/full-disk'"
  for code, _, stderr in results:
    assert 'Traceback' not in stderr and 'Check failure stack trace' not in stderr, stderr[-3000:]
  code, _, stderr = results[failing]
  assert (code, stderr.strip().splitlines()[-1]) == (2, f'error: {error}'), stderr[-3000:]
  other = 1 - failing
  code, _, stderr = results[other]
  directory = os.path.join(workdir, 'checkpoints')
  newest = max(int(n) for n in os.listdir(directory) if n.isdigit())
  assert (code, stderr.strip().splitlines()[-1]) == (3, (
      f'error: process {other} stopped: process {failing} failed: {error}; last checkpoint: '
      f'{os.path.join(directory, str(newest))}; relaunch the same command on every host to '
      f'resume once that is fixed')), stderr[-3000:]
  assert [r['epoch'] for r in _rows(workdir)] == [0]


class _Store:
  """The coordination service's key-value store, as the watcher uses it."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite or key not in self.values
    self.values[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


@pytest.fixture
def watched_job(monkeypatch, capfd):
  """Process 0 of a 2-process job, with a fake coordination service; JAX's
  shutdown and ``os._exit`` are recorded (the latter stops the calling thread
  for good)."""
  import jax
  store, events = _Store(), []
  monkeypatch.setattr(distributed, '_client', lambda: store)
  monkeypatch.setattr(jax, 'process_index', lambda: 0)
  for name in ('_failing', '_leaving'):
    monkeypatch.setattr(distributed, name, threading.Event())
  monkeypatch.setattr(distributed, '_leave_lock', threading.Lock())
  monkeypatch.setattr(jax.distributed, 'shutdown', lambda: events.append('shutdown'))

  def exit_(code):
    events.append(('exit', code))
    threading.Event().wait()  # as the thread would never come back (a daemon: it stays)

  monkeypatch.setattr(distributed.os, '_exit', exit_)
  monkeypatch.setattr(distributed, 'atexit', types.SimpleNamespace(register=lambda fn: None))
  return store, events, capfd


def _until(condition, seconds=10.0):
  deadline = time.monotonic() + seconds
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.01)
  return condition()


def test_another_process_s_error_ends_this_one_in_one_line(watched_job, tmp_path):
  store, events, capfd = watched_job
  (tmp_path / 'checkpoints' / '8').mkdir(parents=True)
  (tmp_path / 'checkpoints' / '16').mkdir()
  distributed.watch_for_failures(str(tmp_path / 'checkpoints'), interval_seconds=0.01,
                                 settle_seconds=0.05)
  time.sleep(0.1)
  assert events == []  # nothing said: it keeps watching
  store.key_value_set('pipejax/failed/1', '[Errno 28] No space left on device')
  assert _until(lambda: ('exit', 3) in events)
  assert events == ['shutdown', ('exit', 3)]  # it leaves the job, which the failed one waits for
  assert capfd.readouterr().err.strip().splitlines()[-1] == (
      f'error: process 0 stopped: process 1 failed: [Errno 28] No space left on device; last '
      f'checkpoint: {tmp_path / "checkpoints" / "16"}; relaunch the same command on every host '
      f'to resume once that is fixed')
  assert distributed._leaving.is_set()


def _started_watcher(monkeypatch, settle_seconds):
  """Starts the watcher; returns its thread and an Event set once it has seen
  a peer's failure (it then settles, waiting for this process's own error)."""
  seen, real = threading.Event(), distributed._peer_failures

  def peer_failures(client, me):
    failures = real(client, me)
    if failures:
      seen.set()
    return failures

  monkeypatch.setattr(distributed, '_peer_failures', peer_failures)
  before = set(threading.enumerate())
  stop = distributed.watch_for_failures(None, interval_seconds=0.01,
                                        settle_seconds=settle_seconds)
  (thread,) = [t for t in threading.enumerate()
               if t.name == 'pipejax-peer-failures' and t not in before]
  return thread, seen, stop


def test_a_process_that_fails_too_keeps_its_own_error(watched_job, monkeypatch):
  """A refusal that every process reaches together: this one's own error,
  coming within the settling time, ends it, not the peer's."""
  store, events, capfd = watched_job
  watcher, seen, _ = _started_watcher(monkeypatch, settle_seconds=5.0)
  store.key_value_set('pipejax/failed/1', 'a refusal')
  assert seen.wait(60)  # it settles now, waiting for this process's own error
  distributed.tell_job_of_error('a refusal\nits second line')
  watcher.join(60)  # a guard against a hang; had it left, it would never end (watched_job)
  assert not watcher.is_alive()  # it stopped watching: this process's own error ends it
  assert events == [] and 'process 1 failed' not in capfd.readouterr().err
  assert store.values['pipejax/failed/0'] == 'a refusal'  # told in one line


def test_a_process_already_exiting_is_not_ended_by_the_watcher(watched_job, monkeypatch):
  store, events, _ = watched_job
  watcher, seen, stop = _started_watcher(monkeypatch, settle_seconds=0.3)
  store.key_value_set('pipejax/failed/1', 'late')
  assert seen.wait(60)  # seen, settling
  stop()  # this process's exit began (atexit): its own ending wins
  watcher.join(60)  # a guard against a hang; had it left, it would never end (watched_job)
  assert not watcher.is_alive()
  assert events == [] and not distributed._leaving.is_set()


def test_a_checkpoint_error_from_a_broken_collective_is_a_lost_peer():
  """orbax reports a collective broken by a lost peer as a checkpoint error:
  the CLI looks behind it (with several processes it then ends as a lost
  peer, naming the peer's own error where one was told)."""
  from pipejax.checkpoints import CheckpointError
  broken = jax.errors.JaxRuntimeError('UNKNOWN: Gloo AllGather failed')
  try:
    try:
      raise broken
    except jax.errors.JaxRuntimeError as e:
      raise CheckpointError('writing the checkpoint of step 8 failed') from e
  except CheckpointError as e:
    assert elastic._runtime_cause(e) is broken
  try:
    try:
      raise broken
    except jax.errors.JaxRuntimeError:
      raise OSError(28, 'No space left on device')  # implicitly chained
  except OSError as e:
    assert elastic._runtime_cause(e) is broken
  assert elastic._runtime_cause(CheckpointError('no readable checkpoint')) is None


def test_running_out_of_device_memory_is_one_line_told_to_the_job(watched_job, monkeypatch):
  """A process's own out-of-memory error (XLA's RESOURCE_EXHAUSTED) is no
  bug and no lost peer: one line with what holds less memory, exit code 2,
  and the job is told; behind a checkpoint error too. Another runtime error
  is still raised."""
  store, _, capfd = watched_job
  oom = jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate '
                                   '1.50GiB\nsecond line')
  from pipejax.checkpoints import CheckpointError

  def behind_a_checkpoint():
    try:
      raise oom
    except jax.errors.JaxRuntimeError as e:
      raise CheckpointError('writing the checkpoint of step 8 failed') from e

  config = vit_imagenet.get_config()
  lost = []  # what was taken for a lost peer
  monkeypatch.setattr(distributed, 'exit_if_peer_lost', lambda error, _: lost.append(error))
  for raised, expected in ((oom, 'error: out of device memory (RESOURCE_EXHAUSTED: Out of '
                                 'memory while trying to allocate 1.50GiB); a fixed, larger '
                                 'pipeline.micro_batches'),
                           (behind_a_checkpoint, 'error: writing the checkpoint of step 8 '
                                                 'failed')):
    def run(*args, raised=raised, **kwargs):
      raise raised() if callable(raised) else raised
    monkeypatch.setattr(elastic, 'run', run)
    monkeypatch.setattr(distributed, '_failing', threading.Event())
    store.values.clear()
    assert elastic.main(config, None, 'vit') == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(expected), err
    assert store.values['pipejax/failed/0'] == err[0][len('error: '):]
  assert lost == []
  # Memory is found behind a wrapper, and only at the start of an error.
  from pipejax import runtime
  try:
    try:
      raise MemoryError()
    except MemoryError as e:
      raise CheckpointError('restoring step 8 failed') from e
  except CheckpointError as e:
    assert runtime.out_of_memory(e)
  assert not runtime.out_of_memory(jax.errors.JaxRuntimeError(
      'UNAVAILABLE: peer said: RESOURCE_EXHAUSTED: too many open streams'))
  other = jax.errors.JaxRuntimeError('INTERNAL: something else')
  monkeypatch.setattr(elastic, 'run', lambda *a, **k: (_ for _ in ()).throw(other))
  with pytest.raises(jax.errors.JaxRuntimeError, match='something else'):
    elastic.main(config, None, 'vit')
  assert lost == [other]


def test_one_process_neither_watches_nor_tells(monkeypatch):
  monkeypatch.setattr(distributed, '_failing', threading.Event())
  assert distributed.watch_for_failures(None) is None
  distributed.tell_job_of_error('nothing to tell')
  assert not distributed._failing.is_set()


RUNTIME_REPORT = 'E1129 10:00:00.000000 1 agent.cc:1] Polled an error from coordination service\n'


def _supervised(tmp_path, stderr: str, end: str):
  """Runs the supervisor (in a process of its own, without JAX's threads,
  since it forks) over a child that writes ``stderr`` then runs ``end``;
  returns the supervisor's ``(exit code, stderr)``."""
  child = f'import os, signal, sys; sys.stderr.write({stderr!r}); sys.stderr.flush(); {end}'
  supervisor = (
      'import sys, types\n'
      'from pipejax import distributed\n'
      'settings = types.SimpleNamespace(coordinator="localhost:1", process_id=1,\n'
      '    num_processes=2, heartbeat_timeout_seconds=100, initialization_timeout_seconds=300)\n'
      f'sys.exit(distributed.supervise([sys.executable, "-c", {child!r}], settings,\n'
      f'                               {str(tmp_path / "checkpoints")!r}))\n')
  done = subprocess.run([sys.executable, '-c', supervisor], cwd=ROOT, capture_output=True,
                        text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
  return done.returncode, done.stderr


def test_the_supervisor_keeps_a_child_s_own_error_printed_after_a_progress_bar(tmp_path):
  """A child that printed its own one-line error after a progress bar (whose
  line ends in '\\r', not '\\n'), then the runtime's report of a lost peer:
  the supervisor keeps the error and the child's exit code, and says nothing
  of a lost peer."""
  code, stderr = _supervised(
      tmp_path, 'epoch 1:   0%|  | 0/2\r          \rerror: [Errno 28] No space left on '
      'device\n' + RUNTIME_REPORT, 'sys.exit(2)')
  assert code == 2, stderr
  assert stderr.strip().splitlines()[-1] == 'error: [Errno 28] No space left on device', stderr
  assert 'another process' not in stderr
  assert not os.path.exists(tmp_path / 'process_1.crash.log')


def test_the_supervisor_keeps_the_line_naming_another_process_s_error(tmp_path):
  """After the runtime's report, the child's line naming another process's
  error still passes (the report goes to the crash log), and a child that
  dies on a signal after it counts as ended by that error: exit code 3."""
  line = ('error: process 1 stopped: process 0 failed: [Errno 28] No space left on device; last '
          'checkpoint: none; relaunch the same command on every host to resume once that is '
          'fixed')
  code, stderr = _supervised(tmp_path, RUNTIME_REPORT + '\n' + line + '\n',
                             'os.kill(os.getpid(), signal.SIGABRT)')
  assert code == 3, stderr
  assert stderr.strip().splitlines()[-1] == line, stderr
  assert 'died or stopped responding' not in stderr
  with open(tmp_path / 'process_1.crash.log') as f:
    assert f.read().strip() == RUNTIME_REPORT.strip()
  # Other lines after the report are the runtime's: the lost-peer line replaces them.
  code, stderr = _supervised(tmp_path, RUNTIME_REPORT + 'error: a runtime line\n',
                             'os.kill(os.getpid(), signal.SIGABRT)')
  assert code == 3 and 'a runtime line' not in stderr, stderr
  assert 'another process of the job died or stopped responding' in stderr.splitlines()[-1]


@JOBS
def test_processes_started_with_different_configs_are_refused_in_one_line(tmp_path):
  """Each process would train its replica its own way (or the collectives
  would stop matching later): refused on both before anything is built."""
  job = _launch(str(tmp_path / 'job'), SMALL, only={1: ['--config.train.learning_rate=0.1']})
  for p, (code, _, stderr) in enumerate(_finish(job, timeout=180)):
    assert code == 2, f'process {p}: {stderr[-3000:]}'
    assert stderr.strip().splitlines()[-1] == (
        'error: process 1 was started with another configuration than process 0: start every '
        'process with the same command line (but distributed.process_id; a path key starting '
        "with ~ is each host's home)")
  assert not os.path.exists(tmp_path / 'job' / 'metrics.jsonl')
  # The same configuration in another folder (a relative --workdir started
  # elsewhere): that is what the line says.
  other_dir = tmp_path / 'elsewhere'
  job = _launch(str(tmp_path / 'job'), SMALL, only={1: [f'--workdir={other_dir}']})
  for p, (code, _, stderr) in enumerate(_finish(job, timeout=180)):
    assert code == 2, f'process {p}: {stderr[-3000:]}'
    here = tmp_path / ('job', 'elsewhere')[p]
    assert stderr.strip().splitlines()[-1] == (
        f'error: process 1 was started with another --workdir than process 0 (this process: '
        f'{here}): give every process the same absolute path (a relative one is resolved in '
        f"each process's own current directory)")
  assert not os.path.exists(other_dir / 'metrics.jsonl')
  # The configuration but the process's own rank: the same digest.
  base = vit_imagenet.get_config()
  other = vit_imagenet.get_config()
  with other.unlocked():
    other.distributed.process_id = 1
  assert distributed.config_digest(base, 'w') == distributed.config_digest(other, 'w')
  assert distributed.config_digest(base, 'w') != distributed.config_digest(base, 'elsewhere')
  # Nor the profile's path, which several processes never read (its default
  # is under each host's home); any other key counts.
  with other.unlocked():
    other.pipeline.profile_path = '/users/alice/.cache/pipejax/profile.json'
  assert distributed.config_digest(base, 'w') == distributed.config_digest(other, 'w')
  with other.unlocked():
    other.pipeline.micro_batches = 3
  assert distributed.config_digest(base, 'w') != distributed.config_digest(other, 'w')
  # No --workdir: the same on every process, wherever each was started.
  here, cwd = distributed.config_digest(base, None), os.getcwd()
  os.chdir(os.path.dirname(cwd) or '/')
  try:
    assert distributed.config_digest(base, None) == here != distributed.config_digest(base, 'w')
  finally:
    os.chdir(cwd)


def test_a_run_checks_its_workdir_is_shared_before_writing_there(tmp_path, monkeypatch):
  """The run calls :func:`distributed.check_shared_folder` on its workdir
  once it holds it, before it writes anything else there (the check itself
  is a no-op for one process: it is faked here to stop the run)."""
  class Checked(Exception):
    pass

  def check(folder, *args, **kwargs):
    raise Checked(folder, sorted(os.listdir(folder)))

  monkeypatch.setattr(distributed, 'check_shared_folder', check)
  config = vit_imagenet.get_config()
  with config.unlocked():
    fixtures.override(config, SMALL)
  workdir = str(tmp_path / 'job')
  with pytest.raises(Checked) as checked:
    elastic.run(config, workdir, task='vit')
  assert checked.value.args == (workdir, [elastic.LOCK_FILE])


_SHARED_CHECK = """
import sys
from experiments import vit_imagenet
from pipejax import distributed
port, index, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
config = vit_imagenet.get_config()
config.distributed.update(coordinator=f'localhost:{port}', num_processes=2, process_id=index)
distributed.initialize(config, lambda line: None)
try:
  distributed.check_shared_folder(folder, wait_seconds=1.0)
  print('shared')
except distributed.DistributedError as e:
  print(f'refused: {e}')
"""


@JOBS
@pytest.mark.parametrize('shared', [True, False])
def test_a_folder_that_is_not_one_for_every_process_is_refused_on_all(tmp_path, shared):
  """``check_shared_folder`` on two real processes: one folder for both
  passes; a folder of each (what one path gives on hosts that do not share
  it) is refused on both, naming both, before a job would train towards a
  first checkpoint that it could not write. No mark stays behind."""
  folders = [tmp_path / 'job'] * 2 if shared else [tmp_path / 'host0', tmp_path / 'host1']
  for folder in folders:
    folder.mkdir(exist_ok=True)
  port = _free_port()
  env = _job_env(1)
  job = [subprocess.Popen([sys.executable, '-c', _SHARED_CHECK, str(port), str(p),
                           str(folders[p])], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
         for p in (0, 1)]
  results = _finish(job, timeout=180)
  assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
  said = [out.strip().splitlines()[-1] for _, out, _ in results]
  if shared:
    assert said == ['shared', 'shared']
  else:
    assert said == [f'refused: --workdir={folders[p]} is not one folder shared by every '
                    f'process: processes 0, 1 did not find in it what the other processes '
                    f'wrote; give every process the same folder on a file system that every '
                    f'host mounts' for p in (0, 1)]
  for folder in set(folders):
    assert not [name for name in os.listdir(folder) if not name.endswith('.tmp')]


_RESTORE = """
import sys
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from experiments import vit_imagenet
from pipejax import checkpoints, distributed, frozen_prefix
port, index, workdir, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
config = vit_imagenet.get_config()
config.distributed.update(coordinator=f'localhost:{port}', num_processes=2, process_id=index)
distributed.initialize(config, lambda line: None)
rows = NamedSharding(Mesh(np.array(jax.devices()), ('x',)), P('x'))  # a row per process
if index == 1 and 'unreadable here' in mode:  # step 2's meta, or its state, fails
  read = checkpoints.Checkpoints._read  # the files, as orbax reads them
  item = 'meta' if mode.startswith('meta') else 'state'
  def failing(self, step, args):
    if step == 2 and item in args:
      raise ValueError(f'{mode.split()[0]} unreadable here')
    return read(self, step, args)
  checkpoints.Checkpoints._read = failing
ckpt = checkpoints.Checkpoints(workdir)
if index == 1 and mode == 'listed late':  # its listing lacks the newest step
  ckpt.manager.all_steps = lambda: [1]
if mode.endswith('listed after its move'):
  checkpoints.LISTING_WAIT_SECONDS = 0.5
  if index == 1:  # its listing lags the move
    ckpt.manager.all_steps = lambda: [1, 2]
    ckpt.manager.reload = lambda: None
try:
  state, meta, path = ckpt.restore(
      lambda meta: {'w': jax.ShapeDtypeStruct((2, 3), np.float32, sharding=rows)},
      lambda line: print('said:', line, flush=True))
  local = [np.asarray(s.data).tolist() for s in state['w'].addressable_shards]
  print('restored:', path, meta['n'], local, flush=True)
except distributed.DistributedError as e:
  print('refused:', e, flush=True)
ckpt.close()
"""


@JOBS
@pytest.mark.parametrize('mode', ['readable', 'meta unreadable here', 'shard unreadable here',
                                  'packed unreadable here', 'listed late',
                                  'meta unreadable here, listed after its move'])
def test_processes_resume_from_one_checkpoint_that_all_of_them_read(tmp_path, mode):
  """Two real processes restore the checkpoints a job wrote (each its own
  shard). A step unreadable on one process only is left by both, set aside
  by process 0 once, and both resume from the one before: the replicas
  never go on from different weights, and no process waits in a collective
  that the other skipped (orbax's barrier after a read, which a failed read
  never reaches, or device_put's comparison of a packed checkpoint's values
  across processes). Processes that list different steps are refused on both,
  and so are they where one still lists the step set aside (it would skip,
  alone, every later save up to that step)."""
  workdir = tmp_path / 'job'
  writer = checkpoints.Checkpoints(str(workdir))
  # As a job of several processes writes them; packed: a one-process run's,
  # which a job may resume (another device count).
  writer.packed = mode.startswith('packed')
  for step in (1, 2):
    writer.save(step, {'w': np.full((2, 3), float(step), np.float32)}, {'n': step}, wait=True)
  writer.close()
  port = _free_port()
  env = _job_env(1)
  job = [subprocess.Popen([sys.executable, '-c', _RESTORE, str(port), str(p), str(workdir),
                           mode], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
         for p in (0, 1)]
  results = _finish(job, timeout=180)
  assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
  said = [[line for line in out.splitlines() if line.startswith(('said:', 'restored:',
                                                                   'refused:'))]
          for _, out, _ in results]
  folder = workdir / 'checkpoints'
  if mode == 'readable':
    assert said == [[f"restored: {folder / '2'} 2 [[[2.0, 2.0, 2.0]]]"]] * 2
    assert sorted(os.listdir(folder)) == ['1', '2']
  elif mode.endswith('unreadable here'):
    moved = (f"checkpoint {folder / '2'} is unreadable{{}}; moved to {folder / '2.corrupt'} "
             f"(rename it back to try it again), trying the one before")
    assert said == [
        ['said: ' + moved.format(' on process 1 (its line says why)'),
         f"restored: {folder / '1'} 1 [[[1.0, 1.0, 1.0]]]"],
        ['said: ' + moved.format(f' on process 1 ({mode})'),
         f"restored: {folder / '1'} 1 [[[1.0, 1.0, 1.0]]]"]]
    assert sorted(os.listdir(folder)) == ['1', '2.corrupt']
  elif mode.endswith('listed after its move'):
    refused = (f"refused: checkpoint {folder / '2'} was moved to {folder / '2.corrupt'}, but "
               f"process 1 still lists it after {{}} s: every process must see the same "
               f"folder; relaunch the same command on every host once they do")
    assert [lines[-1] for lines in said] == [refused.format(0.5)] * 2
    assert sorted(os.listdir(folder)) == ['1', '2.corrupt']
  else:
    assert said == [[f'refused: the processes list different checkpoints in {folder} (process '
                     f'0: 2 (newest 2), process 1: 1 (newest 1)): every process must see the '
                     f'same folder; relaunch the same command on every host once they do']] * 2
    assert sorted(os.listdir(folder)) == ['1', '2']


@JOBS
def test_sigterm_to_one_process_stops_the_whole_job_with_a_checkpoint(tmp_path):
  """JAX's preemption service would put its own SIGTERM handler in place of
  the run's: a SIGTERM to one process was ignored. Both stop at the same
  step, save, and exit 75; the same command resumes."""
  workdir = str(tmp_path / 'job')
  job = _launch(workdir, {**SMALL, 'train.epochs': 200})
  try:
    directory = _wait_for_checkpoint(workdir, job, timeout=180)
    assert directory is not None, 'no checkpoint appeared'
    job[1].send_signal(signal.SIGTERM)
    results = _finish(job, timeout=120)
  finally:
    for p in job:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  lines = [stderr.strip().splitlines()[-1] for _, _, stderr in results]
  assert [code for code, _, _ in results] == [75, 75], lines
  assert lines[0] == lines[1] and lines[0].startswith('interrupted: stopped on request after step')
  step = int(lines[0].split('after step ')[1].split()[0])
  assert os.path.isdir(os.path.join(directory, str(step)))


def test_a_crash_log_without_a_rank_is_named_by_host_and_pid(tmp_path):
  """Without a known rank (``distributed.coordinator=auto``) the report is
  kept under the host's name and the pid: containers on several hosts often
  share a pid, and the workdir is shared, so a pid alone would let one
  host's report overwrite another's."""
  checkpoints_dir = str(tmp_path / 'checkpoints')
  ranked = distributed._keep_crash_log([b'one\n'], checkpoints_dir, 1)
  unranked = distributed._keep_crash_log([b'two\n'], checkpoints_dir, None)
  assert ranked == str(tmp_path / 'process_1.crash.log')
  host = re.sub(r'[^A-Za-z0-9._-]', '_', socket.gethostname())
  assert unranked == str(tmp_path / f'{host}_pid_{os.getpid()}.crash.log')
  assert open(ranked).read() == 'one\n' and open(unranked).read() == 'two\n'
  assert distributed._keep_crash_log([], checkpoints_dir, None) is None
