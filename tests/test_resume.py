"""Resuming: an interrupted run continued with the same command equals an
uninterrupted one bitwise; a checkpoint of another config is refused; a
failed or corrupt checkpoint leaves the previous one usable; signals."""
import errno
import json
import pathlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments import elastic, vit_imagenet
from pipejax import checkpoints, reporting, resume
from pipejax import trainer as trainer_lib
from pipejax.trainer import Trainer, TrainingInterrupted
from tests import fixtures

# Two stages keep the compiles short; 4 layers freeze 0 -> 1 -> 2 (α = 1/3).
SMALL = {'data.name': 'digits', 'model.num_layers': 4, 'model.hidden_size': 16,
         'model.intermediate_size': 32, 'model.num_heads': 2, 'pipeline.initial_length': 2}
EXACT = ('epoch', 'train_loss', 'train_accuracy', 'eval_accuracy', 'frozen_layers',
         'pipeline_length', 'replicas', 'micro_batches', 'step', 'stage_sizes')


def _config(profile: str, **overrides):
  config = vit_imagenet.get_config()
  with config.unlocked():
    fixtures.override(config, {**SMALL, 'train.epochs': 3, 'train.max_steps_per_epoch': 3,
                               'pipeline.profile_path': profile, 'cache.enabled': False,
                               **overrides})
  return config


def _rows(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _stop_at(poll: int):
  """``stop_requested`` that says yes at its ``poll``-th call."""
  calls = []

  def stop():
    calls.append(1)
    return len(calls) >= poll
  return stop


def test_interrupted_runs_resume_exactly(tmp_path, capsys):
  """Stopped mid-epoch, then at an epoch end before its freeze decision, then
  finished: every per-epoch row equals the uninterrupted run's bitwise. M is
  being profiled all along (9 steps: 3 candidates x 3 rounds) so the saved
  profiling queue must continue. (No AutoCache here: its entries advanced
  through newly frozen blocks may differ from a fresh forward in the last
  bit, see the next test.)"""
  reference = str(tmp_path / 'reference')
  reference_summary = elastic.run(_config(str(tmp_path / 'p-ref.json')), reference, task='vit')
  expected = _rows(reference)
  assert [r['frozen_layers'] for r in expected] == [0, 1, 2]

  workdir = str(tmp_path / 'run')
  config = lambda **o: _config(str(tmp_path / 'p-run.json'), **o)  # noqa: E731
  # Polls: after steps 1, 2 of each epoch (not its last) and at its end.
  with pytest.raises(TrainingInterrupted) as stopped:
    elastic.run(config(), workdir, task='vit', stop_requested=_stop_at(4))
  assert (stopped.value.epoch, stopped.value.step) == (1, 4)
  assert stopped.value.checkpoint.endswith(os.path.join('checkpoints', '4'))
  assert [r['epoch'] for r in _rows(workdir)] == [0]
  with pytest.raises(TrainingInterrupted) as stopped:  # the resumed epoch's end
    elastic.run(config(), workdir, task='vit', stop_requested=_stop_at(2))
  assert (stopped.value.epoch, stopped.value.step) == (1, 6)
  # Epoch 1's row is this process's: its 2 steps (not the epoch's 3) over its seconds.
  resumed = _rows(workdir)[1]
  assert resumed['epoch'] == 1 and resumed['transition_seconds'] == 0
  assert resumed['samples_per_second'] * resumed['epoch_seconds'] == pytest.approx(
      2 * config().train.batch_size)
  fewer = str(tmp_path / 'fewer-devices')
  shutil.copytree(workdir, fewer)
  summary = elastic.run(config(), workdir, task='vit')
  out = capsys.readouterr().out
  assert 'resuming from' in out and 'resumed at step 6 (epoch 1, 3/3 batches)' in out
  rows = _rows(workdir)
  assert len(rows) == 3
  for got, want in zip(rows, expected, strict=True):
    assert {k: got[k] for k in EXACT} == {k: want[k] for k in EXACT}
  assert summary['final_eval_accuracy'] == expected[-1]['eval_accuracy']
  assert len(summary['freeze_decisions']) == 2 and len(summary['transitions']) == 2
  # Its times go on from the earlier processes' (as the rows' wall_seconds do),
  # not from this process's start alone.
  assert reference_summary['total_seconds'] == reference_summary['process_seconds']
  assert summary['total_seconds'] >= rows[-1]['wall_seconds'] > rows[0]['wall_seconds']
  assert summary['total_seconds'] - summary['process_seconds'] >= rows[0]['wall_seconds']
  assert summary['train_seconds'] > summary['total_seconds'] - summary['process_seconds']
  # Eq. 1's gradient-norm sums, restored mid-epoch, give the same decisions' inputs.
  assert [d['norms'] for d in summary['freeze_decisions']] == [
      d['norms'] for d in reference_summary['freeze_decisions']]
  assert all(d['norms'] and min(d['norms'][d['previous']:]) > 0
             for d in summary['freeze_decisions'])

  # Saved on 8 devices (K=2, R=4), resumed on 4: the plan is recomputed for
  # F=1 on them (R=2); the maths is the same, only the reduction order differs:
  # docs/guide.md promises the losses "equal to about 1e-6" (measured: 9.3e-8 relative
  # in epoch 2, 0 before). An accuracy is a count over the samples, which
  # such a difference leaves as it is (measured: all equal).
  fewer_summary = elastic.run(config(**{'pipeline.devices': 4}), fewer, task='vit')
  rows = _rows(fewer)
  assert 'resuming on 4 devices (saved on 8)' in capsys.readouterr().out
  assert [r['frozen_layers'] for r in rows] == [0, 1, 2]
  assert [r['replicas'] for r in rows] == [4, 4, 2]
  np.testing.assert_allclose([r['train_loss'] for r in rows],
                             [r['train_loss'] for r in expected], rtol=1e-6)
  same = ('epoch', 'step', 'train_accuracy', 'eval_accuracy')
  assert [{k: r[k] for k in same} for r in rows] == [{k: r[k] for k in same} for r in expected]
  assert fewer_summary['final_eval_accuracy'] == expected[-1]['eval_accuracy']

  # A checkpoint from another model is refused in one line before training.
  code = elastic.main(config(**{'model.hidden_size': 32}), workdir, task='vit')
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1
  assert "model.hidden_size: 16 in the checkpoint, 32 now" in err[0]


def _tiny_state(value: float) -> dict:
  return {'params': {'w': jnp.full((4, 3), value)}, 'step': jnp.int32(value)}


def test_only_the_newest_checkpoints_are_kept_and_the_newest_is_read(tmp_path):
  ckpt = checkpoints.Checkpoints(str(tmp_path), keep=2)
  for step in (1, 2, 3):
    ckpt.save(step, _tiny_state(float(step)), {'n': step}, wait=True)
  assert ckpt.latest_meta() == ({'n': 3}, ckpt.path(3))
  ckpt.close()
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '3']


def _abstract(_meta):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tiny_state(0.0))


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
  """A full disk while writing checkpoint 2: one line naming the intact
  checkpoint 1, which still restores. No writer thread is left behind: with
  orbax's asynchronous directory creation, the failed save's threads waited
  300 s for a signal that never came, and held up the process's exit."""
  before = set(threading.enumerate())
  ckpt = checkpoints.Checkpoints(str(tmp_path))
  ckpt.save(1, _tiny_state(1.0), {'n': 1}, wait=True)

  def full_disk(self, item, directory):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(ocp.JsonCheckpointHandler, '_save_fn', full_disk)
  with pytest.raises(checkpoints.CheckpointError) as e:
    ckpt.save(2, _tiny_state(2.0), {'n': 2}, wait=True)
  assert '\n' not in str(e.value)
  assert 'No space left on device' in str(e.value)
  assert str(e.value).endswith(f'the previous checkpoint is intact: {ckpt.path(1)}')
  monkeypatch.undo()
  ckpt.close()

  def left():
    return [t.name for t in set(threading.enumerate()) - before if t.is_alive() and not t.daemon]

  deadline = time.monotonic() + 60  # the failed save's threads, given their chance to end
  while left() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert left() == []
  state, meta, path = checkpoints.Checkpoints(str(tmp_path)).restore(_abstract)
  assert path == ckpt.path(1) and meta == {'n': 1}
  np.testing.assert_array_equal(state['params']['w'], np.full((4, 3), 1.0))


@pytest.mark.parametrize('wait', [True, False])
def test_with_one_checkpoint_kept_a_failed_save_names_the_one_still_intact(tmp_path, monkeypatch,
                                                                          wait):
  """With ``keep=1`` orbax drops checkpoint 1 from its list when the save of
  2 starts (it deletes it once 2 is written): a failed save of 2 said that
  no checkpoint was intact, and ``latest()`` (a divergence's "last good
  checkpoint") answered None, while 1 was on disk. A later good save
  replaces 1, as keep=1 asks."""
  ckpt = checkpoints.Checkpoints(str(tmp_path), keep=1)
  ckpt.save(1, _tiny_state(1.0), {'n': 1}, wait=True)

  async def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(ocp.type_handlers.NumpyHandler, '_open_and_write', full_disk)
  with pytest.raises(checkpoints.CheckpointError) as e:
    ckpt.save(2, _tiny_state(2.0), {'n': 2}, wait=wait)
    ckpt.close()  # the asynchronous save's error
  assert str(e.value).endswith(f'the previous checkpoint is intact: {ckpt.path(1)}'), e.value
  assert ckpt.latest() == ckpt.path(1)
  monkeypatch.undo()
  ckpt = checkpoints.Checkpoints(str(tmp_path), keep=1) if not wait else ckpt
  ckpt.save(3, _tiny_state(3.0), {'n': 3}, wait=True)
  ckpt.close()
  assert [n for n in os.listdir(tmp_path / 'checkpoints') if n.isdigit()] == ['3']


def test_a_state_is_written_packed_and_restores_exactly(tmp_path):
  """In one process a state is written as one flat array per dtype (orbax's
  cost is per array: the default run's 78 small arrays took 4x the CPU of one)
  and restores bit for bit onto the target's shardings, sharded leaves
  included. A checkpoint written unpacked (several processes, or pipejax
  before packing) restores as before, and a layout that does not fit the
  target is refused, not silently reshaped."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415
  mesh = Mesh(np.array(jax.devices()), ('batch',))
  rng = np.random.default_rng(0)
  host = {'params': {'w': rng.standard_normal((16, 24)).astype(np.float32),
                     'rows': rng.standard_normal((8, 5)).astype(np.float32),
                     'half': rng.standard_normal((3,)).astype(jnp.bfloat16)},
          'rng': np.array([7, 2**32 - 1], np.uint32), 'step': np.int32(7)}
  specs = {'params': {'w': P(), 'rows': P('batch'), 'half': P()}, 'rng': P(), 'step': P()}
  state = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), host, specs)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  ckpt = checkpoints.Checkpoints(str(tmp_path / 'packed'))
  assert ckpt.packed
  ckpt.save(3, state, {'n': 3}, wait=True)
  ckpt.close()
  # One array per dtype on disk, the layout in the meta (and not handed back).
  written = ocp.CheckpointManager(str(tmp_path / 'packed' / 'checkpoints')).restore(
      3, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  assert [(name, path) for name, _, _, path in written[checkpoints.PACKED]] == [
      ('bfloat16', "['params']['half']"), ('float32', "['params']['rows']"),
      ('float32', "['params']['w']"), ('uint32', "['rng']"), ('int32', "['step']")]
  on_disk = ocp.CheckpointManager(str(tmp_path / 'packed' / 'checkpoints')).restore(
      3, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
  assert sorted(on_disk) == ['bfloat16', 'float32', 'int32', 'uint32']  # one array each
  unpacked = checkpoints.Checkpoints(str(tmp_path / 'unpacked'))
  unpacked.packed = False  # as several processes write it
  unpacked.save(3, state, {'n': 3}, wait=True)
  unpacked.close()
  for folder in ('packed', 'unpacked'):
    restored, meta, _ = checkpoints.Checkpoints(str(tmp_path / folder)).restore(
        lambda _: abstract)
    assert meta == {'n': 3}
    for got, want, target in zip(jax.tree.leaves(restored), jax.tree.leaves(host),
                                 jax.tree.leaves(abstract), strict=True):
      assert got.dtype == want.dtype and got.sharding == target.sharding
      np.testing.assert_array_equal(np.asarray(got), want)
  packed, layout = checkpoints.pack(state)
  assert sorted(packed) == ['bfloat16', 'float32', 'int32', 'uint32']
  assert packed['float32'].shape == (16 * 24 + 8 * 5,)
  wrong = dict(abstract, step=jax.ShapeDtypeStruct((2,), np.int32))
  with pytest.raises(ValueError, match=r"\['step'\] int32\[\] where the state has \['step'\] "
                                       r"int32\[2\]"):
    checkpoints.unpack(packed, layout, wrong)
  # The same dtypes and shapes in another tree: refused by the key paths.
  renamed = {'params': dict(abstract['params']), 'rng': abstract['rng'], 'steps': abstract['step']}
  assert "['step'] int32[] where the state has ['steps'] int32[]" in (
      checkpoints.layout_problem(layout, renamed))
  with pytest.raises(ValueError, match='end before'):
    checkpoints.unpack(dict(packed, float32=packed['float32'][:10]), layout, abstract)
  # An int32 scalar where the state has a float32 one (the learning-rate
  # schedule's count before per_pipeline batches made it fractional) is cast;
  # the other way round, or an array, is still another state.
  counted = dict(abstract, step=jax.ShapeDtypeStruct((), np.float32,
                                                    sharding=state['step'].sharding))
  assert checkpoints.layout_problem(layout, counted) is None
  cast = checkpoints.unpack(packed, layout, counted)['step']
  assert cast.dtype == np.float32 and float(cast) == 7.0
  _, float_layout = checkpoints.pack({'c': np.float32(7)})
  assert checkpoints.layout_problem(float_layout, {'c': jax.ShapeDtypeStruct((), np.int32)})
  _, rows_layout = checkpoints.pack({'c': np.arange(2, dtype=np.int32)})
  assert checkpoints.layout_problem(rows_layout, {'c': jax.ShapeDtypeStruct((2,), np.float32)})
  # A readable checkpoint of another state is refused, not set aside as corrupt.
  with pytest.raises(checkpoints.CheckpointError, match=r"holds another state than this run has "
                                                        r"\(\['step'\] int32\[\] where"):
    checkpoints.Checkpoints(str(tmp_path / 'packed')).restore(lambda _: wrong)
  assert sorted(os.listdir(tmp_path / 'packed' / 'checkpoints')) == ['3']


def test_corrupt_checkpoint_falls_back_to_the_one_before(tmp_path):
  ckpt = checkpoints.Checkpoints(str(tmp_path))
  ckpt.save(1, _tiny_state(1.0), {'n': 1}, wait=True)
  ckpt.save(2, _tiny_state(2.0), {'n': 2}, wait=True)
  ckpt.close()
  state_dir = os.path.join(ckpt.path(2), 'state')
  for root, _, files in os.walk(state_dir):  # truncate every file of the state
    for name in files:
      open(os.path.join(root, name), 'w').close()
  messages = []
  state, meta, path = checkpoints.Checkpoints(str(tmp_path)).restore(_abstract, messages.append)
  assert path == ckpt.path(1) and int(state['step']) == 1
  assert len(messages) == 1 and 'is unreadable' in messages[0]
  assert os.path.isdir(ckpt.path(2) + '.corrupt')
  # Nothing readable left: one clear error.
  shutil.rmtree(os.path.join(ckpt.path(1), 'state'))
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'no readable checkpoint in .* \(tried steps \[1\], set aside as '
                           r'<step>.corrupt: rename one back to try it again\); use another '
                           r"--workdir, or --config.resume=False to start over here \(this run's "
                           r"outputs are removed at its first checkpoint\)$"):
    checkpoints.Checkpoints(str(tmp_path)).restore(_abstract, messages.append)
  # A step set aside again keeps the one set aside before.
  again = checkpoints.Checkpoints(str(tmp_path))
  again.save(2, _tiny_state(3.0), {'n': 3}, wait=True)
  again.close()
  shutil.rmtree(os.path.join(ckpt.path(2), 'state'))
  with pytest.raises(checkpoints.CheckpointError):
    checkpoints.Checkpoints(str(tmp_path)).restore(_abstract, messages.append)
  assert checkpoints.set_aside(str(tmp_path)) == ['1.corrupt', '2.corrupt', '2.corrupt.2']
  assert os.path.isdir(os.path.join(ckpt.path(2) + '.corrupt', 'state'))  # the first one
  # The same command again finds no checkpoint: the earlier run's metrics rows
  # are not dropped for a fresh start, it refuses in one line.
  log = reporting.MetricsLog(str(tmp_path))
  for epoch in range(2):
    log.append({'epoch': epoch, 'train_loss': 1.0})
  before = open(log.path).read()
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'holds 2 metrics rows of an earlier run but no readable checkpoint '
                           r'\(set aside as unreadable: 1.corrupt, 2.corrupt, 2.corrupt.2\); '
                           r'use another --workdir, or --config.resume=False'):
    elastic._resume(str(tmp_path), None, checkpoints.Checkpoints(str(tmp_path)), {})
  assert open(log.path).read() == before


def test_a_checkpoint_whose_meta_lacks_what_a_resume_reads_is_set_aside(tmp_path, capsys):
  """A meta that reads (whole JSON) but lacks a key the trainer reads, or
  holds it with another type (hand-edited, or of another pipejax): set aside
  as unreadable, in one line, and the run resumes from the one before (it
  was a KeyError traceback)."""
  workdir = str(tmp_path / 'run')
  config = _config(str(tmp_path / 'p.json'), **{'train.epochs': 2})
  elastic.run(config, workdir, task='vit')
  folder = os.path.join(workdir, 'checkpoints')
  newest = max(int(n) for n in os.listdir(folder) if n.isdigit())
  path = os.path.join(folder, str(newest), 'meta', 'metadata')
  with open(path) as f:
    meta = json.load(f)
  assert trainer_lib.meta_problem(meta) is None  # as written
  for key, value, problem in (
      ('plan', 'K=2', "its 'plan' is a str, not an object"),
      ('epoch_done', 1, "its 'epoch_done' is 1, not a bool"),
      ('step', True, "its 'step' is True, not an int"),
      ('wall_seconds', 3, None),  # an int is a JSON number too
      ('freeze_state', {**meta['freeze_state'], 'bound': None},
       "its 'freeze_state.bound' is None, not a float"),
      ('cache', {k: v for k, v in meta['cache'].items() if k != 'depth'},
       "it has no 'cache.depth'")):
    assert trainer_lib.meta_problem({**meta, key: value}) == problem, key
  del meta['plan']
  with open(path, 'w') as f:
    json.dump(meta, f)
  capsys.readouterr()
  with config.unlocked():
    config.train.epochs = 3
  elastic.run(config, workdir, task='vit')
  out = capsys.readouterr().out
  assert (f"checkpoint {folder}/{newest} is unreadable (its meta is unusable: it has no 'plan'); "
          f"moved to {folder}/{newest}.corrupt") in out, out
  assert 'resumed at step 3 (epoch 0, 3/3 batches)' in out
  assert [r['epoch'] for r in _rows(workdir)] == [0, 1, 2]
  assert os.path.isfile(os.path.join(folder, f'{newest}.corrupt', 'meta', 'metadata'))
  # metrics.jsonl emptied by hand: the epochs' rows are gone before the run,
  # which says so and goes on (the checkpoint's copy gives the last one back).
  open(os.path.join(workdir, 'metrics.jsonl'), 'w').close()
  with config.unlocked():
    config.train.epochs = 4
  elastic.run(config, workdir, task='vit')
  out = capsys.readouterr().out
  assert (f"note: {workdir}/metrics.jsonl lacks the rows of 2 epochs the checkpoint has trained "
          f"(0, 1): the rows and the summary go on without them") in out, out
  assert [r['epoch'] for r in _rows(workdir)] == [2, 3]


def test_a_checkpoint_whose_meta_changed_on_disk_is_set_aside_not_trained_from(tmp_path):
  """A value of the meta changed after the write that still parses, and has
  the type the trainer reads (a flipped digit): its crc32 finds it, and the
  one before is restored. A meta written before the checksum restores."""
  ckpt = checkpoints.Checkpoints(str(tmp_path))
  for step in (1, 2, 3):
    ckpt.save(step, _tiny_state(float(step)), {'n': step, 'plan': {'frozen_layers': 4}},
              wait=True)
  ckpt.close()

  def edit(step, change):
    path = pathlib.Path(ckpt.path(step)) / 'meta' / 'metadata'
    meta = json.loads(path.read_text())
    assert meta[checkpoints.META_CHECKSUM] == checkpoints.meta_checksum(
        {k: v for k, v in meta.items() if k != checkpoints.META_CHECKSUM})  # as written
    change(meta)
    path.write_text(json.dumps(meta))

  edit(3, lambda meta: meta['plan'].update(frozen_layers=40))
  edit(2, lambda meta: meta.pop(checkpoints.META_CHECKSUM))  # as pipejax wrote it before
  lines = []
  state, meta, path = checkpoints.Checkpoints(str(tmp_path)).restore(_abstract, lines.append)
  assert (path, meta) == (ckpt.path(2), {'n': 2, 'plan': {'frozen_layers': 4}})
  np.testing.assert_array_equal(state['params']['w'], np.full((4, 3), 2.0))
  assert len(lines) == 1 and lines[0].startswith(
      f'checkpoint {ckpt.path(3)} is unreadable (its meta differs from what was written '
      f'(crc32 ') and f'moved to {ckpt.path(3)}.corrupt' in lines[0], lines


def test_a_checkpoint_whose_bytes_changed_on_disk_is_set_aside_not_trained_from(tmp_path):
  """Orbax reads a packed state's bytes changed after the write (a failing
  disk) as values; the crc32 saved with them finds it: the checkpoint is set
  aside as unreadable and the one before is restored. One written before the
  checksums restores unchecked."""
  # Random bits: incompressible, so stored as they are (zstd keeps raw blocks raw).
  values = np.random.default_rng(0).integers(0, 2 ** 32, (64, 64), dtype=np.uint32)

  def tree(step):
    return {'params': {'w': jnp.asarray(values)}, 'step': jnp.int32(step)}

  def abstract(_meta):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree(0))

  ckpt = checkpoints.Checkpoints(str(tmp_path))
  ckpt.save(1, tree(1), {'n': 1}, wait=True)
  state = tree(2)
  ckpt.save(2, state, {'n': 2}, wait=True)
  marker = values[17, 5]
  ckpt.close()
  meta = ocp.CheckpointManager(str(tmp_path / 'checkpoints')).restore(
      2, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  assert meta[checkpoints.CHECKSUMS] == checkpoints.checksums(
      checkpoints.pack(jax.device_get(state))[0])
  pattern, flipped = marker.tobytes(), (marker ^ np.uint32(1)).tobytes()  # one bit
  changed = 0
  for root, _, files in os.walk(os.path.join(ckpt.path(2), 'state')):
    for name in files:
      path = os.path.join(root, name)
      data = open(path, 'rb').read()
      if pattern in data:
        with open(path, 'wb') as f:  # one value changed, the file as long as before
          f.write(data.replace(pattern, flipped, 1))
        changed += 1
  assert changed == 1  # stored uncompressed: a read gives the changed value
  unchecked = checkpoints.Checkpoints(str(tmp_path))
  unchecked._saved_meta = lambda step: {  # noqa: SLF001 - as written before the checksums
      k: v for k, v in checkpoints.Checkpoints._saved_meta(unchecked, step).items()  # noqa: SLF001
      if k != checkpoints.CHECKSUMS}
  state_read, _, _ = unchecked.restore(abstract)
  read = np.asarray(state_read['params']['w'])
  assert read[17, 5] == marker ^ 1 and (read != values).sum() == 1  # what orbax alone gives
  messages = []
  restored, meta, path = checkpoints.Checkpoints(str(tmp_path)).restore(
      abstract, messages.append)
  assert path == ckpt.path(1) and meta == {'n': 1} and int(restored['step']) == 1
  assert messages == [f'checkpoint {ckpt.path(2)} is unreadable (its uint32 arrays differ from '
                      f'what was written (checksum); the files changed on disk); moved to '
                      f'{ckpt.path(2)}.corrupt (rename it back to try it again), trying the one '
                      f'before']


def test_late_reads_of_a_failed_restore_print_no_traceback():
  """A restore that fails on one array ends orbax's event loop while
  tensorstore still reads others; each late read posts to the closed loop
  and tensorstore reports the ``RuntimeError`` as unraisable. The hook that
  ``runtime.setup`` installs drops exactly those; any other unraisable error
  reaches the previous hook."""
  import asyncio  # noqa: PLC0415
  import types  # noqa: PLC0415
  from pipejax import runtime  # noqa: PLC0415
  assert getattr(sys.unraisablehook, 'pipejax', False)  # installed by the entry points' setup
  seen = []
  hook = runtime._quiet_closed_loop_hook(seen.append)  # noqa: SLF001
  loop = asyncio.new_event_loop()
  loop.close()
  with pytest.raises(RuntimeError, match='Event loop is closed') as late:
    loop.call_soon_threadsafe(print)  # what tensorstore's reader thread does

  def unraisable(error):
    return types.SimpleNamespace(exc_type=type(error), exc_value=error,
                                 exc_traceback=error.__traceback__, err_msg=None, object=None)

  hook(unraisable(late.value))
  assert seen == []
  try:
    raise RuntimeError('Event loop is closed')  # the same words from elsewhere: reported
  except RuntimeError as e:
    other = unraisable(e)
  hook(other)
  hook(unraisable(ValueError('a real problem')))
  assert [u.exc_value for u in seen][0] is other.exc_value and len(seen) == 2


def test_another_programs_checkpoint_folder_is_refused_never_set_aside_or_removed(tmp_path):
  """A step folder (an integer name) that holds something other than a
  pipejax checkpoint is refused in one line, resuming or starting over,
  before anything is renamed or removed; once it is gone, starting over
  removes the run's own checkpoints and leaves the user's other files."""
  workdir = str(tmp_path)
  ckpt = checkpoints.Checkpoints(workdir)
  ckpt.save(1, _tiny_state(1.0), {'n': 1}, wait=True)
  ckpt.close()
  folder = os.path.join(workdir, 'checkpoints')
  for name in ('1.corrupt', '3.orbax-checkpoint-tmp-1700000000', '9',
               '200/default', 'backup/2'):
    os.makedirs(os.path.join(folder, name))
  # Another program's orbax checkpoint: orbax's files, not pipejax's items.
  for name in ('200/default/array.bin', '200/_CHECKPOINT_METADATA', '200/commit_success.txt',
               'notes.txt', '42'):
    with open(os.path.join(folder, name), 'w') as f:
      f.write('mine')
  # A step of ours that orbax was deleting when killed: only its own file left.
  os.makedirs(os.path.join(folder, '7'))
  with open(os.path.join(folder, '7', '_CHECKPOINT_METADATA'), 'w') as f:
    f.write('{}')
  reporting.MetricsLog(workdir).append({'epoch': 0, 'train_loss': 1.0})

  def tree():
    return sorted(os.path.relpath(os.path.join(root, n), workdir)
                  for root, dirs, files in os.walk(workdir) for n in dirs + files)
  before = tree()
  # A file named as a step (a save of step 42 replaced it) is refused first,
  # then the other program's folder.
  messages = [rf'^{re.escape(folder)}/42 is not a pipejax checkpoint \(a file, not a folder\): '
              rf'move it out of {re.escape(folder)}, or use another --workdir$',
              rf'^{re.escape(folder)}/200 is not a pipejax checkpoint \(it holds '
              rf'_CHECKPOINT_METADATA, commit_success.txt, default, not meta and state\): move '
              rf'it out of {re.escape(folder)}, or use another --workdir$']
  for message, name in zip(messages, ('42', '200')):
    for attempt in (lambda: checkpoints.Checkpoints(workdir), lambda: checkpoints.clear(workdir),
                    lambda: elastic._start_over(workdir)):
      with pytest.raises(checkpoints.CheckpointError, match=message):
        attempt()
      assert tree() == before
    shutil.move(os.path.join(folder, name), os.path.join(workdir, f'theirs{name}'))
    before = tree()
  checkpoints.Checkpoints(workdir).close()  # an empty step folder is not another program's
  checkpoints.clear(workdir)
  assert sorted(os.listdir(folder)) == ['backup', 'notes.txt']
  assert os.path.isfile(os.path.join(workdir, 'theirs200', 'default', 'array.bin'))
  assert open(os.path.join(workdir, 'theirs42')).read() == 'mine'
  os.symlink(os.path.join(workdir, 'theirs200'), os.path.join(folder, '300'))
  with pytest.raises(checkpoints.CheckpointError, match=r'/300 is not a pipejax checkpoint '
                                                        r'\(a link\)'):
    checkpoints.Checkpoints(workdir)


def test_a_finished_run_without_checkpoints_is_not_restarted_over_its_results(tmp_path):
  workdir = str(tmp_path / 'run')
  # Temporaries that killed writes of the run's files left: removed at the start
  # once stale; a live writer's (younger) and the user's own files stay.
  os.makedirs(workdir)
  from pipejax import diskcache  # noqa: PLC0415
  stale = time.time() - diskcache.STALE_TMP_SECONDS - 10
  left = [f'{name}.{i}.tmp' for i, name in enumerate(elastic.RUN_FILES)] + ['mine.txt.tmp']
  for name in left + ['summary.png.young.tmp']:
    with open(os.path.join(workdir, name), 'w') as f:
      f.write('')
  for name in left:
    os.utime(os.path.join(workdir, name), (stale, stale))
  config = _config(str(tmp_path / 'p.json'), **{'checkpoint.enabled': False,
                                                 'train.epochs': 1})
  elastic.run(config, workdir, task='vit')
  assert sorted(n for n in os.listdir(workdir) if n.endswith('.tmp')) == [
      'mine.txt.tmp', 'summary.png.young.tmp']
  before = {name: open(os.path.join(workdir, name), 'rb').read()
            for name in ('metrics.jsonl', 'summary.json')}
  with pytest.raises(elastic.ConfigError, match='checkpoint.enabled=False cannot resume'):
    elastic.run(config, workdir, task='vit')
  with config.unlocked():
    config.checkpoint.enabled = True  # the same command, checkpoints on: nothing to resume
  with pytest.raises(checkpoints.CheckpointError,
                     match='that run finished without checkpoints'):
    elastic.run(config, workdir, task='vit')
  assert {name: open(os.path.join(workdir, name), 'rb').read() for name in before} == before
  with config.unlocked():
    config.resume = False  # starting over is asked for
  elastic.run(config, workdir, task='vit')
  assert len(_rows(workdir)) == 1
  # That run, finished with checkpoints, whose checkpoints were then removed.
  steps = os.path.join(workdir, 'checkpoints')
  assert [r['checkpointed'] for r in _rows(workdir)] == [True] and os.listdir(steps)
  for name in os.listdir(steps):
    shutil.rmtree(os.path.join(steps, name))
  before = {name: open(os.path.join(workdir, name), 'rb').read() for name in before}
  with config.unlocked():
    config.resume = True
  with pytest.raises(checkpoints.CheckpointError, match=r'no readable checkpoint \(its '
                                                        r'checkpoints are gone\)'):
    elastic.run(config, workdir, task='vit')
  assert {name: open(os.path.join(workdir, name), 'rb').read() for name in before} == before


def test_rows_of_a_stopped_run_without_checkpoints_are_not_dropped(tmp_path):
  """A run with checkpoints off, stopped before its end (no summary), run again
  with them on: its rows are no crash's before a first checkpoint (those the
  same command redoes), so they are refused in one line, never dropped. Rows
  that pipejax wrote before saying whether they were checkpointed still are."""
  workdir = str(tmp_path / 'run')
  off = _config(str(tmp_path / 'p.json'), **{'checkpoint.enabled': False, 'train.epochs': 2})
  with pytest.raises(TrainingInterrupted):
    elastic.run(off, workdir, task='vit', stop_requested=_stop_at(4))  # in the second epoch
  rows = open(os.path.join(workdir, 'metrics.jsonl')).read()
  assert [r['checkpointed'] for r in _rows(workdir)] == [False]
  on = _config(str(tmp_path / 'p.json'), **{'train.epochs': 2})
  with pytest.raises(checkpoints.CheckpointError,
                     match='holds 1 metrics rows of an earlier run but no readable checkpoint '
                           r'\(that run wrote none: checkpoint.enabled=False, or plain_dp\)'):
    elastic.run(on, workdir, task='vit')
  assert open(os.path.join(workdir, 'metrics.jsonl')).read() == rows
  # The same rows without the key (an older pipejax's): a crash's, redone.
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    for row in _rows_of(rows):
      row.pop('checkpointed')
      f.write(json.dumps(row) + '\n')
  summary = elastic.run(on, workdir, task='vit')
  assert [r['epoch'] for r in _rows(workdir)] == [0, 1]
  assert all(r['checkpointed'] for r in _rows(workdir)) and summary['final_eval_accuracy'] > 0


def _rows_of(text: str) -> list[dict]:
  return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_mid_epoch_checkpoint_resumes_only_over_its_data_shards(tmp_path):
  """Saved in the middle of an epoch with the samples drawn over 2 data
  shards (one process reading both): resumed over 1, that epoch would repeat
  and skip samples, so it is refused in one line saying what resumes it;
  with the same shards it finishes."""
  profile = str(tmp_path / 'p.json')
  sharded = _config(profile, **{'train.epochs': 1, 'distributed.data_shards': 2})
  workdir = str(tmp_path / 'run')
  with pytest.raises(TrainingInterrupted) as stopped:
    elastic.run(sharded, workdir, task='vit', stop_requested=_stop_at(2))
  assert (stopped.value.epoch, stopped.value.step) == (0, 2)
  with pytest.raises(resume.CheckpointMismatch) as refused:
    elastic.run(_config(profile, **{'train.epochs': 1}), workdir, task='vit')
  assert str(refused.value) == (
      'the checkpoint was saved in the middle of epoch 0 with the samples drawn over 2 data '
      'shard(s), this run draws them over 1: the rest of that epoch would repeat some samples '
      'and skip others; resume with --config.distributed.data_shards=2 on a number of '
      'processes that divides 2 (one process always does: it reads every shard)')
  summary = elastic.run(_config(profile, **{'train.epochs': 1, 'distributed.data_shards': 2}),
                        workdir, task='vit')
  assert [r['epoch'] for r in _rows(workdir)] == [0] and summary['final_eval_accuracy'] > 0


def test_a_summary_of_the_run_before_it_was_extended_is_not_taken_for_its_end(tmp_path):
  """A 1-epoch run extended to 2 that stopped after its second epoch's
  checkpoint, before writing its summary: the old summary is not the end of
  the 2-epoch run; the same command writes the right one, training nothing."""
  workdir = str(tmp_path / 'run')
  profile = str(tmp_path / 'p.json')
  first = elastic.run(_config(profile, **{'train.epochs': 1}), workdir, task='vit')
  old = open(os.path.join(workdir, 'summary.json')).read()
  elastic.run(_config(profile, **{'train.epochs': 2}), workdir, task='vit')
  rows = _rows(workdir)
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    f.write(old)  # as if stopped before the extended run wrote its own
  again = elastic.run(_config(profile, **{'train.epochs': 2}), workdir, task='vit')
  assert first['config']['train']['epochs'] == 1
  assert again['config']['train']['epochs'] == 2
  assert json.load(open(os.path.join(workdir, 'summary.json')))['config']['train']['epochs'] == 2
  assert _rows(workdir) == rows  # nothing trained again
  assert again['final_eval_accuracy'] == rows[-1]['eval_accuracy']


def _tree(root):
  return sorted(os.path.relpath(os.path.join(folder, n), root)
                for folder, dirs, files in os.walk(root) for n in dirs + files)


class _Killed(BaseException):
  """A kill, as far as the code under test can tell: nothing catches it."""


def _files(root):
  """Every path under ``root`` with its bytes (None: a folder), but the
  workdir's lock (it names the process that holds it)."""
  return {name: (open(os.path.join(root, name), 'rb').read()
                 if os.path.isfile(os.path.join(root, name)) else None) for name in _tree(root)
          if name != elastic.LOCK_FILE}


def _finished_run(workdir):
  """A run's outputs (rows, sample IDs, a checkpoint) beside the user's files."""
  os.makedirs(workdir)
  reporting.MetricsLog(workdir).append({'epoch': 0, 'train_loss': 1.0})
  os.makedirs(os.path.join(workdir, 'sample_ids'))
  for name in ('process_0.json', 'process_1.json', 'mine.txt'):
    with open(os.path.join(workdir, 'sample_ids', name), 'w') as f:
      f.write('{}')
  with open(os.path.join(workdir, 'notes.txt'), 'w') as f:
    f.write('mine')
  ckpt = checkpoints.Checkpoints(workdir)
  ckpt.save(1, _tiny_state(1.0), {'n': 1}, wait=True)
  ckpt.close()


def _leftovers(workdir):
  """What a start over's run left before its first checkpoint finished."""
  reporting.MetricsLog(workdir).append({'epoch': 0, 'train_loss': 9.0})
  os.makedirs(os.path.join(workdir, 'checkpoints', '5.orbax-checkpoint-tmp-1'))


def test_starting_over_moves_the_runs_outputs_aside_and_back(tmp_path):
  """--config.resume=False: the run files, the processes' sample-ID records and
  the checkpoints move to ``replaced/``; a file of the user's, in the workdir
  or beside the records, stays. Put back (the new run ended before its first
  checkpoint), the workdir is as it was, its later run's leftovers gone.
  Started over again while ``replaced/`` holds them (a kill), they stay and
  the leftovers go. With a finished checkpoint of the later run, they are
  dropped instead. A ``replaced`` of another program's is refused, untouched."""
  workdir = str(tmp_path / 'run')
  _finished_run(workdir)
  original = _files(workdir)
  rows = open(os.path.join(workdir, 'metrics.jsonl')).read()
  assert elastic._start_over(workdir) is True
  assert sorted(os.listdir(workdir)) == ['notes.txt', 'replaced', 'sample_ids']
  assert os.listdir(os.path.join(workdir, 'sample_ids')) == ['mine.txt']
  replaced = os.path.join(workdir, 'replaced')
  assert sorted(os.listdir(replaced)) == ['.pipejax-replaced', 'checkpoints', 'metrics.jsonl',
                                          'sample_ids']
  assert elastic._replaced(workdir) == (replaced, 'replaced')
  _, meta, _ = checkpoints.Checkpoints(replaced).restore(_abstract)  # readable where it went
  assert meta == {'n': 1}
  _leftovers(workdir)
  elastic._recover(workdir, False)  # starting over again: settled by _start_over
  assert elastic._replaced(workdir) == (replaced, 'replaced')
  elastic._recover(workdir)
  assert _files(workdir) == original
  # Started over again while replaced/ holds a run: it stays, the later run's leftovers go.
  elastic._start_over(workdir)
  _leftovers(workdir)
  assert elastic._start_over(workdir) is True
  assert sorted(os.listdir(workdir)) == ['checkpoints', 'notes.txt', 'replaced', 'sample_ids']
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == []
  assert open(os.path.join(replaced, 'metrics.jsonl')).read() == rows
  # The later run finished a checkpoint (its removal of replaced/ was killed): dropped.
  later = checkpoints.Checkpoints(workdir)
  later.save(2, _tiny_state(2.0), {'n': 2}, wait=True)
  later.close()
  os.makedirs(os.path.join(workdir, '.replaced.removing-7'))  # a removal killed halfway
  elastic._recover(workdir)
  assert sorted(os.listdir(workdir)) == ['checkpoints', 'notes.txt', 'sample_ids']
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == ['2']
  # Another program's replaced/ (no mark): refused before anything moves, never removed.
  os.makedirs(replaced)
  with open(os.path.join(replaced, 'theirs.txt'), 'w') as f:
    f.write('theirs')
  before = _files(workdir)
  with pytest.raises(elastic.ConfigError, match=r"replaced is not pipejax's .*: move it out of"):
    elastic._start_over(workdir)
  elastic._drop_replaced(workdir)
  elastic._recover(workdir)
  assert _files(workdir) == before


def test_putting_a_replaced_run_back_never_removes_another_programs_step_folder(tmp_path):
  """A start over ended before its first checkpoint (replaced/ keeps the old
  run); then a step folder of another program's appears in checkpoints/.
  Putting the old run back clears the later run's outputs: it refuses in one
  line instead, resuming or starting over, and removes nothing."""
  workdir = str(tmp_path / 'run')
  _finished_run(workdir)
  elastic._start_over(workdir)
  _leftovers(workdir)
  theirs = os.path.join(workdir, 'checkpoints', '200')
  os.makedirs(os.path.join(theirs, 'default'))
  with open(os.path.join(theirs, 'default', 'array.bin'), 'w') as f:
    f.write('theirs')
  before = _files(workdir)
  for resume_ in (True, False):
    with pytest.raises(elastic.ConfigError, match=(
        rf"^{re.escape(theirs)} is not a pipejax checkpoint .*; {re.escape(workdir)}/replaced "
        rf"keeps the outputs of the run that a start over replaced$")):
      elastic._recover(workdir, resume_)
    assert _files(workdir) == before
  shutil.move(theirs, str(tmp_path / 'theirs'))
  elastic._recover(workdir)  # now it goes back
  assert not os.path.exists(os.path.join(workdir, 'replaced'))
  assert open(os.path.join(workdir, 'metrics.jsonl')).read().count('"train_loss": 1.0') == 1


def test_a_start_over_across_file_systems_is_one_line_and_moves_nothing(tmp_path, monkeypatch):
  """checkpoints/ linked to another file system: the move into replaced/
  fails (EXDEV); one line says why, and what moved is put back."""
  workdir = str(tmp_path / 'run')
  _finished_run(workdir)
  before = _files(workdir)
  real = os.replace

  def across(src, dst):
    if os.sep + 'checkpoints' in src:
      raise OSError(errno.EXDEV, 'Invalid cross-device link', src, dst)
    return real(src, dst)

  monkeypatch.setattr(elastic.os, 'replace', across)
  with pytest.raises(elastic.ConfigError, match=(
      rf"^cannot start over in {re.escape(workdir)}: {re.escape(workdir)}/checkpoints/1 is on "
      rf"another file system than {re.escape(workdir)}/replaced \(a link\?\)")):
    try:
      elastic._start_over(workdir)
    except BaseException:
      elastic._recover(workdir)  # as the run does
      raise
  monkeypatch.undo()
  assert _files(workdir) == before


def test_a_file_named_sample_ids_is_refused_before_training(tmp_path):
  """A run over data shards writes sample_ids/ at its end: a file by that name
  failed it there, after training, every time."""
  import contextlib  # noqa: PLC0415
  (tmp_path / 'sample_ids').write_text('mine')
  with contextlib.ExitStack() as held, pytest.raises(elastic.ConfigError, match=(
      rf'^cannot use --workdir={re.escape(str(tmp_path))}: .*sample_ids is a file, where a run '
      rf'over data shards writes its folder sample_ids$')):
    elastic._claim_workdir(str(tmp_path), True, held)
  assert (tmp_path / 'sample_ids').read_text() == 'mine'


def test_rows_whose_checkpoints_are_gone_are_refused_not_dropped(tmp_path):
  """Without a checkpoint, rows are dropped only as a crash's before its
  first checkpoint: a checkpointed row before the last proves one existed
  (each save waits for the one before), so the rows are refused, kept."""
  workdir = str(tmp_path)
  log = reporting.MetricsLog(workdir)
  for epoch in range(3):
    log.append({'epoch': epoch, 'train_loss': 1.0, 'checkpointed': True})
  before = open(log.path).read()
  with pytest.raises(checkpoints.CheckpointError, match=(
      r'holds 3 metrics rows of an earlier run but no readable checkpoint \(its checkpoints '
      r'are gone\); use another --workdir, or --config.resume=False')):
    elastic._resume(workdir, None, checkpoints.Checkpoints(workdir), {})
  assert open(log.path).read() == before
  # One row, its save cut short: the same command redoes it.
  os.remove(log.path)
  log.append({'epoch': 0, 'train_loss': 1.0, 'checkpointed': True})
  elastic._resume(workdir, None, checkpoints.Checkpoints(workdir), {})
  assert reporting.read_rows(workdir) == []


def test_a_start_over_without_checkpoints_keeps_the_old_run_until_its_summary(tmp_path,
                                                                               monkeypatch):
  """checkpoint.enabled=False: the new run is finished once its summary is
  written; a failure before (a full disk while drawing) puts the old run back
  at the next start, instead of leaving neither."""
  workdir = str(tmp_path / 'run')
  profile = str(tmp_path / 'p.json')
  off = {'train.epochs': 1, 'train.max_steps_per_epoch': 2, 'checkpoint.enabled': False}
  elastic.run(_config(profile, **off), workdir, task='vit')
  first = open(os.path.join(workdir, 'summary.json')).read()

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(reporting, 'plot_summary', full)
  with pytest.raises(OSError, match='No space left'):
    elastic.run(_config(profile, **off, resume=False), workdir, task='vit')
  assert os.path.isdir(os.path.join(workdir, 'replaced'))  # kept
  monkeypatch.undo()
  with pytest.raises(elastic.ConfigError, match='checkpoint.enabled=False cannot resume'):
    elastic.run(_config(profile, **off), workdir, task='vit')  # the old run is back: finished
  assert open(os.path.join(workdir, 'summary.json')).read() == first
  assert not os.path.exists(os.path.join(workdir, 'replaced'))


def test_a_start_over_or_its_undoing_killed_at_any_move_loses_nothing(tmp_path, monkeypatch):
  """The moves are journaled: a kill after any one of them, starting over or
  putting back, leaves what the next run's recovery puts together again."""
  workdir = str(tmp_path / 'run')
  _finished_run(workdir)
  original = _files(workdir)
  real = {'replace': os.replace, 'rename': os.rename}

  def killed_at(k, step):
    """``step(workdir)``, its k-th rename or replace (files, folders, the
    phase's atomic write) a kill."""
    calls = []

    def wrapped(name):
      def call(*args):
        calls.append(args)
        if len(calls) == k:
          raise _Killed()
        return real[name](*args)
      return call
    with monkeypatch.context() as patched:
      for name in real:
        patched.setattr(os, name, wrapped(name))
      try:
        step(workdir)
      except _Killed:
        return True
    return False

  k, kills = 0, {'start over': 0, 'put back': 0}
  while True:  # every move of both, until neither has a k-th
    k += 1
    assert k < 100, 'the moves never end'
    fired = killed_at(k, elastic._start_over)
    kills['start over'] += fired
    if elastic._replaced(workdir) == (os.path.join(workdir, 'replaced'), 'replaced'):
      _leftovers(workdir)  # it completed: its run began
    elastic._recover(workdir)
    assert _files(workdir) == original, k
    elastic._start_over(workdir)
    _leftovers(workdir)
    fired_back = killed_at(k, elastic._recover)  # killed while putting back
    kills['put back'] += fired_back
    elastic._recover(workdir)
    assert _files(workdir) == original, k
    if not fired and not fired_back:
      break
  assert min(kills.values()) >= 3, kills  # each has moves to be killed at


def test_a_start_over_that_fails_before_its_first_checkpoint_loses_nothing(tmp_path,
                                                                          monkeypatch):
  """A finished run, started over with a setting that no check refuses
  (its first loss NaN), or whose first checkpoint cannot be written, or that
  is killed or stopped before it: the finished run's outputs come back, and the same
  command without --config.resume=False finds it finished. A start over that
  trains removes them once its first checkpoint is on disk, not before; a
  first checkpoint on disk whose save then raised keeps the new run."""
  workdir = str(tmp_path / 'run')
  profile = str(tmp_path / 'p.json')
  elastic.run(_config(profile, **{'train.epochs': 1}), workdir, task='vit')
  original = _files(workdir)

  def diverges(self, *args, **kwargs):
    raise trainer_lib.LossNotFinite(float('nan'), 0, 1)

  with monkeypatch.context() as patched:
    patched.setattr(trainer_lib.Trainer, 'run', diverges)
    with pytest.raises(elastic.TrainingDiverged, match='Last good checkpoint: none'):
      elastic.run(_config(profile, **{'train.epochs': 1, 'resume': False}), workdir, task='vit')
  assert _files(workdir) == original
  seen = []

  def full_disk(self, step, state, meta, wait=False):
    seen.append((os.path.isdir(os.path.join(workdir, 'replaced')), wait))
    raise checkpoints.CheckpointError(f'writing the checkpoint of step {step} failed '
                                      f'([Errno 28] No space left on device)')

  with monkeypatch.context() as patched:
    patched.setattr(checkpoints.Checkpoints, 'save', full_disk)
    with pytest.raises(checkpoints.CheckpointError, match='No space left'):
      elastic.run(_config(profile, **{'train.epochs': 1, 'resume': False}), workdir, task='vit')
  assert seen == [(True, True)] and _files(workdir) == original  # the first save waits
  # The full disk stops the move back too: the cause comes first, and the next
  # run (the disk freed) puts the outputs back.
  real_phase = elastic._set_phase

  def no_mark(replaced, phase):
    if phase == 'clearing':  # the first mark of putting back
      raise OSError(errno.ENOSPC, 'No space left on device')
    real_phase(replaced, phase)

  with monkeypatch.context() as patched:
    patched.setattr(checkpoints.Checkpoints, 'save', full_disk)
    patched.setattr(elastic, '_set_phase', no_mark)
    with pytest.raises(elastic.ConfigError) as failed:
      elastic.run(_config(profile, **{'train.epochs': 1, 'resume': False}), workdir, task='vit')
  assert str(failed.value).startswith('writing the checkpoint of step 3 failed ([Errno 28] No '
                                      'space left on device); then cannot put the outputs in ')
  assert ('they are safe there: once the cause is fixed (e.g. disk space freed), the same '
          'command without --config.resume=False puts them back before it starts'
          ) in str(failed.value)
  assert os.path.isdir(os.path.join(workdir, 'replaced'))
  elastic.run(_config(profile, **{'train.epochs': 1}), workdir, task='vit')  # nothing to train
  assert _files(workdir) == original
  # Killed before its first checkpoint: the next run puts the replaced one back.
  assert elastic._start_over(workdir) is True
  _leftovers(workdir)
  finished = elastic.run(_config(profile, **{'train.epochs': 1}), workdir, task='vit')
  assert finished['final_eval_accuracy'] == json.loads(original['summary.json'])[
      'final_eval_accuracy'] and _files(workdir) == original
  # Stopped (Ctrl-C, a preemption) before its first checkpoint: the start over
  # is cancelled, saving nothing; the replaced run is back, and the line says so.
  config = _config(profile, **{'train.epochs': 1, 'resume': False})
  with pytest.raises(TrainingInterrupted) as stopped:
    elastic.run(config, workdir, task='vit', stop_requested=_stop_at(1))
  assert stopped.value.checkpoint is None and _files(workdir) == original
  assert elastic._how_to_resume(config, stopped.value) == (
      'it was a start over (--config.resume=False) stopped before its first checkpoint: '
      'nothing of it was saved, and the outputs of the run it replaced are back')
  # A first checkpoint on disk whose save raised after: the new run's, kept.
  real_save = checkpoints.Checkpoints.save

  def saved_then_failed(self, step, state, meta, wait=False):
    real_save(self, step, state, meta, wait=True)
    raise checkpoints.CheckpointError('failed after the write')

  with monkeypatch.context() as patched:
    patched.setattr(checkpoints.Checkpoints, 'save', saved_then_failed)
    with pytest.raises(checkpoints.CheckpointError, match='after the write'):
      elastic.run(_config(profile, **{'train.epochs': 1, 'resume': False}), workdir, task='vit')
  assert not os.path.exists(os.path.join(workdir, 'replaced'))
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == ['3']
  assert not os.path.exists(os.path.join(workdir, 'summary.json'))  # the old run's: gone
  # The removal happens once, with the new run's checkpoint on disk.
  drops = []
  real_drop = elastic._drop_replaced
  with monkeypatch.context() as patched:
    patched.setattr(elastic, '_drop_replaced', lambda w: drops.append(
        sorted(os.listdir(os.path.join(w, 'checkpoints')))) or real_drop(w))
    elastic.run(_config(profile, **{'train.epochs': 1, 'resume': False}), workdir, task='vit')
  assert drops == [['3']]
  assert not os.path.exists(os.path.join(workdir, 'replaced')) and len(_rows(workdir)) == 1
  # Its removal killed: the next run drops it, keeping the run that replaced it.
  with monkeypatch.context() as patched:
    patched.setattr(elastic, '_drop_replaced', lambda w: None)
    elastic.run(_config(profile, **{'train.epochs': 1, 'resume': False}), workdir, task='vit')
  newest = _files(workdir)
  assert os.path.isdir(os.path.join(workdir, 'replaced'))
  elastic.run(_config(profile, **{'train.epochs': 1}), workdir, task='vit')  # nothing to train
  assert _files(workdir) == {k: v for k, v in newest.items() if not k.startswith('replaced')}
  # Without checkpoints, the replaced run goes once the new one has finished.
  before = _files(workdir)
  off = {'train.epochs': 1, 'resume': False, 'checkpoint.enabled': False}
  with monkeypatch.context() as patched:
    patched.setattr(trainer_lib.Trainer, 'run', diverges)
    with pytest.raises(elastic.TrainingDiverged):
      elastic.run(_config(profile, **off), workdir, task='vit')
  assert _files(workdir) == before  # put back
  elastic.run(_config(profile, **off), workdir, task='vit')
  assert not os.path.exists(os.path.join(workdir, 'replaced'))
  assert not os.path.exists(os.path.join(workdir, 'checkpoints'))
  # Its removal killed: the finished run's summary keeps it; replaced/ goes.
  with monkeypatch.context() as patched:
    patched.setattr(elastic, '_drop_replaced', lambda w: None)
    elastic.run(_config(profile, **off), workdir, task='vit')
  newest = _files(workdir)
  assert os.path.isdir(os.path.join(workdir, 'replaced'))
  with pytest.raises(elastic.ConfigError, match='checkpoint.enabled=False cannot resume'):
    elastic.run(_config(profile, **dict(off, resume=True)), workdir, task='vit')
  assert _files(workdir) == {k: v for k, v in newest.items() if not k.startswith('replaced')}


def test_the_interrupted_line_says_what_resumes_the_run():
  """The same command resumes, unless it starts over (--config.resume=False,
  which would remove the checkpoint just saved) or nothing was saved (a start
  over stopped before its first checkpoint, or checkpoints off)."""
  config = vit_imagenet.get_config()
  saved = TrainingInterrupted(1, 10, '/w/checkpoints/10')
  assert elastic._how_to_resume(config, saved, '/w') == 'run the same command to resume'
  # A command without --workdir would start a new run in a new folder: this one's is named.
  assert elastic._how_to_resume(config, saved) == (
      'run the same command with --workdir /w to resume')
  spaced = TrainingInterrupted(1, 10, 'runs/vit 1/checkpoints/10')
  assert elastic._how_to_resume(config, spaced) == (
      "run the same command with --workdir 'runs/vit 1' to resume")
  with config.unlocked():
    config.resume = False
  assert elastic._how_to_resume(config, saved, '/w').startswith(
      'run the command again without --config.resume=False to resume')
  assert elastic._how_to_resume(config, saved).startswith(
      'run the command again with --workdir /w without --config.resume=False to resume')
  assert elastic._how_to_resume(config, TrainingInterrupted(1, 10, None)).startswith(
      'it was a start over (--config.resume=False) stopped before its first checkpoint')
  with config.unlocked():
    config.checkpoint.enabled = False
  assert elastic._how_to_resume(config, TrainingInterrupted(1, 10, None)) == (
      'nothing was saved (checkpoint.enabled=False): the run cannot be resumed')


def _wait_until_quiet(directory: str, timeout: float = 30.0) -> None:
  """Waits until nothing under ``directory`` changes for 0.5 s. Orbax reports
  a save's first failed item while its other items may still be writing into
  the temporary directory; a process that exits stops them, but a second run
  in this same process could find files appearing under its clean-up."""
  def snapshot():
    out = []
    for root, _, files in os.walk(directory):
      for name in files:
        try:
          out.append((root, name, os.path.getsize(os.path.join(root, name))))
        except OSError:
          pass
    return sorted(out)
  deadline, last = time.time() + timeout, None
  while time.time() < deadline:
    now = snapshot()
    if now == last:
      return
    last = now
    time.sleep(0.5)


def test_a_failed_asynchronous_save_stops_the_run_at_once_naming_its_step(tmp_path, monkeypatch,
                                                                          capsys, caplog):
  """The first epoch's checkpoint fails in orbax's background threads (a full
  disk): the run stops after the next step, not an epoch later at the next
  save; its one line names the step that failed, and orbax's logs of the
  failure (a traceback from each thread) are left out."""
  config = _config(str(tmp_path / 'p.json'), **{
      'train.epochs': 3, 'train.max_steps_per_epoch': 2, 'pipeline.micro_batches': 4})
  real = checkpoints.Checkpoints.save
  steps = []

  async def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, 'No space left on device')

  def save(self, step, state, meta, wait=False):
    steps.append(step)
    if step == 2:  # the packed arrays' write, in a background thread
      monkeypatch.setattr(ocp.type_handlers.NumpyHandler, '_open_and_write', full_disk)
    return real(self, step, state, meta, wait)

  monkeypatch.setattr(checkpoints.Checkpoints, 'save', save)
  polled = []
  check = checkpoints.Checkpoints.check
  monkeypatch.setattr(checkpoints.Checkpoints, 'check',
                      lambda self: polled.append(1) or check(self))
  workdir = str(tmp_path / 'run')
  assert elastic.main(config, workdir, task='vit') == 2
  err = [line for line in capsys.readouterr().err.splitlines() if 'error' in line]
  assert len(err) == 1, err
  assert err[0].startswith('error: writing the checkpoint of step 2 failed ('), err
  assert 'No space left on device' in err[0] and err[0].endswith(
      'the previous checkpoint is intact: none')
  assert steps == [2]  # stopped before the next save
  assert len(polled) <= 2 + 1 + 2  # the first epoch's steps and end, then the next two steps
  assert [r['epoch'] for r in _rows(workdir)] == [0]
  assert not [r for r in caplog.records if r.name == 'absl' and r.exc_info], [
      r.getMessage()[:200] for r in caplog.records]


def test_failed_checkpoint_stops_the_run_and_the_same_command_resumes(tmp_path, monkeypatch,
                                                                       capsys):
  """A run whose second checkpoint hits a full disk stops in one line; the
  same command resumes from the first checkpoint and finishes."""
  config = lambda: _config(str(tmp_path / 'p.json'), **{  # noqa: E731
      'train.epochs': 2, 'train.max_steps_per_epoch': 2, 'pipeline.micro_batches': 4})
  real = checkpoints.Checkpoints.save

  def save(self, step, state, meta, wait=False):
    if meta['epoch'] == 1:
      monkeypatch.setattr(ocp.JsonCheckpointHandler, '_save_fn', lambda *a: (_ for _ in ()).throw(
          OSError(errno.ENOSPC, 'No space left on device')))
    return real(self, step, state, meta, wait)

  monkeypatch.setattr(checkpoints.Checkpoints, 'save', save)
  workdir = str(tmp_path / 'run')
  assert elastic.main(config(), workdir, task='vit') == 2
  err = [line for line in capsys.readouterr().err.splitlines() if 'error' in line]
  assert len(err) == 1 and 'No space left on device' in err[0]
  assert os.path.join('checkpoints', '2') in err[0]
  monkeypatch.undo()
  _wait_until_quiet(os.path.join(workdir, 'checkpoints'))
  assert elastic.main(config(), workdir, task='vit') == 0
  assert f'resuming from {os.path.join(os.path.abspath(workdir), "checkpoints", "2")}' in (
      capsys.readouterr().out)
  assert [r['epoch'] for r in _rows(workdir)] == [0, 1]
  # A finished run: the same command trains nothing more and keeps its
  # summary (not the figures of a run that trained nothing); resume=False starts over.
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = f.read()
  capsys.readouterr()
  closed, close = [], Trainer.close
  monkeypatch.setattr(Trainer, 'close', lambda self: closed.append(self) or close(self))
  assert elastic.main(config(), workdir, task='vit') == 0
  assert 'holds a finished run of 2 epochs: nothing to train' in capsys.readouterr().out
  assert len(closed) == 1  # its background thread and cache closed all the same
  assert [r['epoch'] for r in _rows(workdir)] == [0, 1]
  with open(os.path.join(workdir, 'summary.json')) as f:
    assert f.read() == summary
  # A finished run whose plot is missing (killed between the two writes by an
  # earlier version, or deleted): drawn again from the metrics, nothing trained.
  png = os.path.join(workdir, 'summary.png')
  drawn = open(png, 'rb').read()
  os.remove(png)
  assert elastic.main(config(), workdir, task='vit') == 0
  assert 'summary.png was missing: drawn again' in capsys.readouterr().out
  assert open(png, 'rb').read()[:8] == drawn[:8] == b'\x89PNG\r\n\x1a\n'
  with open(os.path.join(workdir, 'summary.json')) as f:
    assert f.read() == summary
  # A damaged summary of a finished run is set aside and written again from
  # its checkpoint and metrics rows; nothing is trained.
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    f.write('{"mode": "elastic", "final_ev')
  assert elastic.main(config(), workdir, task='vit') == 0
  assert 'summary.json is unreadable (JSONDecodeError' in capsys.readouterr().out
  with open(os.path.join(workdir, 'summary.json.corrupt')) as f:
    assert f.read() == '{"mode": "elastic", "final_ev'
  with open(os.path.join(workdir, 'summary.json')) as f:
    again = json.load(f)
  assert again['final_eval_accuracy'] == json.loads(summary)['final_eval_accuracy']
  assert [r['epoch'] for r in _rows(workdir)] == [0, 1]
  # An unfinished run (no summary) already past a lowered train.epochs: one
  # line, nothing trained or written.
  os.rename(os.path.join(workdir, 'summary.json'), os.path.join(workdir, 'kept.json'))
  fewer = config()
  with fewer.unlocked():
    fewer.train.epochs = 1
  assert elastic.main(fewer, workdir, task='vit') == 2
  err = [line for line in capsys.readouterr().err.splitlines() if 'error' in line]
  assert len(err) == 1 and 'holds a run 2 epochs in, past train.epochs=1' in err[0], err
  assert not os.path.exists(os.path.join(workdir, 'summary.json'))
  assert [r['epoch'] for r in _rows(workdir)] == [0, 1]
  # The same with a damaged summary: refused as well, the file left as it is.
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    f.write('{"mode"')
  assert elastic.main(fewer, workdir, task='vit') == 2
  assert 'past train.epochs=1' in capsys.readouterr().err
  with open(os.path.join(workdir, 'summary.json')) as f:
    assert f.read() == '{"mode"'
  assert not os.path.exists(os.path.join(workdir, 'summary.json.corrupt.2'))
  os.replace(os.path.join(workdir, 'kept.json'), os.path.join(workdir, 'summary.json'))
  # Starting over with a config that is refused only once the plan is built
  # (M = 3 divides no batch of 32) removes nothing: the old run stays whole.
  def contents():
    out = {}
    for root, _, files in os.walk(workdir):
      for name in files:
        if name == elastic.LOCK_FILE:  # who holds the workdir, not the run's data
          continue
        with open(os.path.join(root, name), 'rb') as f:
          out[os.path.relpath(os.path.join(root, name), workdir)] = f.read()
    return out
  kept = contents()
  assert any(name.startswith('checkpoints') for name in kept)
  bad = config()
  with bad.unlocked():
    bad.resume, bad.pipeline.micro_batches = False, 3
  capsys.readouterr()
  assert elastic.main(bad, workdir, task='vit') == 2
  err = [line for line in capsys.readouterr().err.splitlines() if 'error' in line]
  assert len(err) == 1 and 'not divisible' in err[0], err
  assert contents() == kept
  again = config()
  with again.unlocked():
    again.resume, again.train.epochs = False, 1
  assert elastic.main(again, workdir, task='vit') == 0
  assert 'starting over' in capsys.readouterr().out
  assert [r['epoch'] for r in _rows(workdir)] == [0]


def test_a_last_row_torn_by_a_crash_comes_back_from_the_checkpoint_with_its_timings(tmp_path):
  """Killed while writing the last epoch's row, before the summary: the same
  command restores the row from the checkpoint (its wall-clock time too, which
  the summary plot needs), trains nothing more and writes the outputs."""
  config = _config(str(tmp_path / 'p.json'), **{'train.epochs': 2,
                                                'pipeline.micro_batches': 4})
  workdir = str(tmp_path / 'run')
  elastic.run(config, workdir, task='vit')
  rows = _rows(workdir)
  path = os.path.join(workdir, 'metrics.jsonl')
  with open(path, 'rb+') as f:
    f.truncate(os.path.getsize(path) - 50)  # the last row torn
  os.remove(os.path.join(workdir, 'summary.json'))  # the crash came before it
  os.remove(os.path.join(workdir, 'summary.png'))
  summary = elastic.run(_config(str(tmp_path / 'p.json'), **{
      'train.epochs': 2, 'pipeline.micro_batches': 4}), workdir, task='vit')
  restored = _rows(workdir)
  assert [{k: r[k] for k in EXACT} for r in restored] == [{k: r[k] for k in EXACT} for r in rows]
  # The copy was saved before its own save: its wall time is the save's start.
  assert rows[0]['wall_seconds'] < restored[1]['wall_seconds'] <= rows[1]['wall_seconds']
  assert restored[1]['checkpoint_seconds'] == 0.0
  assert summary['final_eval_accuracy'] == rows[1]['eval_accuracy']
  assert os.path.getsize(os.path.join(workdir, 'summary.png')) > 1000


def test_identity_names_the_keys_that_differ():
  config = vit_imagenet.get_config()
  ident = resume.identity(config, {'hidden_size': 64})
  meta = {'identity': ident, 'fingerprint': resume.fingerprint(ident)}
  resume.check_identity(meta, dict(ident), 'ck')
  with config.unlocked():
    config.train.epochs = 99  # extending a run is allowed
    config.pipeline.devices = 4  # so is another device count
    config.cache.enabled = False
    config.freeze.compile_ahead = False  # which programs run, not what they compute
    config.freeze.keep_slot_width = True
    config.data.workers = 3  # the threads that read a batch: the same batches
  resume.check_identity(meta, resume.identity(config, {'hidden_size': 64}), 'ck')
  with config.unlocked():
    config.train.learning_rate = 0.5
    config.seed = 3
  with pytest.raises(resume.CheckpointMismatch, match=r'seed: 0 in the checkpoint, 3 now, '
                                                      r'train.learning_rate'):
    resume.check_identity(meta, resume.identity(config, {'hidden_size': 64}), 'ck')
  with pytest.raises(resume.CheckpointMismatch, match='no valid identity'):
    resume.check_identity({'identity': ident, 'fingerprint': 'x'}, ident, 'ck')
  # Another data set, or another HF model config, is another run.
  config = vit_imagenet.get_config()
  with config.unlocked():
    config.data.name = 'digits'
  with pytest.raises(resume.CheckpointMismatch,
                     match=r"data.name: 'auto' in the checkpoint, 'digits' now"):
    resume.check_identity(meta, resume.identity(config, {'hidden_size': 64}), 'ck')
  with pytest.raises(resume.CheckpointMismatch, match=r'hf.hidden_size: 64 in the checkpoint, '
                                                      r'128 now'):
    resume.check_identity(meta, resume.identity(vit_imagenet.get_config(),
                                                {'hidden_size': 128}), 'ck')
  # Another transformers version, or a moved model directory, is the same run,
  # also against a checkpoint written when the identity still held them.
  old_hf = {'hidden_size': 64, 'transformers_version': '4.57.6', 'torch_dtype': 'float32',
            '_name_or_path': '/models/vit'}
  old = {**ident, **{f'hf.{k}': v for k, v in old_hf.items()}}
  old_meta = {'identity': old, 'fingerprint': resume.fingerprint(old)}
  new_hf = {'hidden_size': 64, 'transformers_version': '4.58.0', 'dtype': 'float32',
            '_name_or_path': '/elsewhere/vit'}
  resume.check_identity(old_meta, resume.identity(vit_imagenet.get_config(), new_hf), 'ck')
  assert resume.identity(vit_imagenet.get_config(), new_hf) == ident


def test_keys_added_later_count_only_away_from_what_runs_before_them_did():
  """A checkpoint written before ``train.max_grad_norm`` and
  ``train.decay_biases_and_norms`` existed (its identity without them)
  resumes with their defaults, which do what it did; other values are
  another run. The BERT entry points' defaults (BERT's recipe) are too."""
  config = vit_imagenet.get_config()
  assert {k: config.train[k.split('.')[1]] for k in resume.ADDED_LATER} == resume.ADDED_LATER
  ident = resume.identity(config, {'hidden_size': 64})
  with config.unlocked():
    del config.train['max_grad_norm'], config.train['decay_biases_and_norms']
  before = resume.identity(config, {'hidden_size': 64})
  assert before == ident
  meta = {'identity': before, 'fingerprint': resume.fingerprint(before)}
  for key, value in (('max_grad_norm', 1.0), ('decay_biases_and_norms', False)):
    config = vit_imagenet.get_config()
    with config.unlocked():
      config.train[key] = value
    with pytest.raises(resume.CheckpointMismatch,
                       match=rf"train.{key}: '<absent>' in the checkpoint, {value!r} now"):
      resume.check_identity(meta, resume.identity(config, {'hidden_size': 64}), 'ck')
  from experiments import bert_glue  # noqa: PLC0415
  glue = resume.identity(bert_glue.get_config(), {})
  assert (glue['train.max_grad_norm'], glue['train.decay_biases_and_norms']) == (1.0, False)


def test_a_damaged_metrics_line_before_the_last_is_an_error_and_the_file_is_kept(tmp_path):
  log = reporting.MetricsLog(str(tmp_path))
  for epoch in range(3):
    log.append({'epoch': epoch, 'train_loss': float(epoch)})
  text = open(log.path).read()
  damaged = '#####' + text[5:]
  with open(log.path, 'w') as f:
    f.write(damaged)
  with pytest.raises(reporting.MetricsError, match=r'metrics.jsonl line 1 is not a metrics row'):
    reporting.keep_rows(str(tmp_path), 2)
  with pytest.raises(reporting.MetricsError):
    reporting.MetricsLog(str(tmp_path))
  assert open(log.path).read() == damaged
  with open(log.path, 'w') as f:  # a row that is JSON but no row, even last
    f.write(text + '[1, 2]\n')
  with pytest.raises(reporting.MetricsError, match='line 4'):
    reporting.read_rows(str(tmp_path))
  # Blank lines (an editor's save) are no rows, and no damage; a torn row
  # before them is still the crash's last line.
  lines = text.splitlines()
  for blank in (lines[0] + '\n\n  \n' + '\n'.join(lines[1:]) + '\n\n\n',
                text + '{"epoch": 3, "trai\n\n', text + '{"epoch": 3, "trai\n'):
    with open(log.path, 'w') as f:
      f.write(blank)
    assert [r['epoch'] for r in reporting.read_rows(str(tmp_path))] == [0, 1, 2]
    reporting.MetricsLog(str(tmp_path)).append({'epoch': 3})  # resumed: rows go on after them
    assert open(log.path).read() == text + '{"epoch": 3}\n'


def test_metrics_rows_of_a_crash_are_kept_up_to_the_checkpoint(tmp_path):
  log = reporting.MetricsLog(str(tmp_path))
  for epoch in range(3):
    log.append({'epoch': epoch, 'train_loss': float(epoch), 'wall_seconds': 1.0 + epoch})
  with open(log.path, 'a') as f:
    f.write('{"epoch": 3, "trai')  # torn by a crash
  assert [r['epoch'] for r in reporting.read_rows(str(tmp_path))] == [0, 1, 2]
  assert reporting.keep_rows(str(tmp_path), 2) == 1
  assert [r['epoch'] for r in reporting.MetricsLog(str(tmp_path)).rows] == [0, 1]
  # A checkpoint's own copy fills in a row the crash kept from the file; one
  # saved before copies had timings gets the row before's wall time plus its epoch's.
  assert reporting.keep_rows(str(tmp_path), 3, {  # a row filled in, none dropped
      'epoch': 2, 'train_loss': 2.0, 'epoch_seconds': 0.5, 'transition_seconds': 0.125,
      'eval_seconds': 0.25}) == 0
  assert [r['epoch'] for r in reporting.read_rows(str(tmp_path))] == [0, 1, 2]
  filled = reporting.read_rows(str(tmp_path))[2]
  assert (filled['wall_seconds'], filled['checkpoint_seconds']) == (2.0 + 0.875, 0.0)
  # A torn row with nothing to drop (resumed from the checkpoint of the epoch
  # before it): the tear goes, so the rows appended next are not glued to it.
  with open(log.path, 'a') as f:
    f.write('{"epoch": 3, "trai')
  assert reporting.keep_rows(str(tmp_path), 3) == 0
  log = reporting.MetricsLog(str(tmp_path))
  for epoch in (3, 4):
    log.append({'epoch': epoch, 'train_loss': float(epoch)})
  assert [r['epoch'] for r in reporting.read_rows(str(tmp_path))] == [0, 1, 2, 3, 4]
  with open(log.path, 'a') as f:  # and MetricsLog alone (no resume) heals it too
    f.write('{"epo')
  reporting.MetricsLog(str(tmp_path)).append({'epoch': 5, 'train_loss': 5.0})
  assert [r['epoch'] for r in reporting.read_rows(str(tmp_path))] == [0, 1, 2, 3, 4, 5]


def test_first_signal_asks_to_stop_second_aborts():
  messages = []
  before = signal.getsignal(signal.SIGTERM)
  with resume.StopOnSignal(messages.append) as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop() and messages == [
        'SIGTERM: finishing the current step, saving a checkpoint, then exiting with code 75 '
        '(another signal aborts at once; until this step has ended, one more SIGTERM may be '
        'this one delivered twice, so it takes two)']
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)  # the handler runs between bytecodes; never reached
  assert signal.getsignal(signal.SIGTERM) is before  # restored


def test_one_signal_delivered_twice_at_once_is_one_request(monkeypatch):
  """GNU ``timeout`` signals the run and its process group: the same SIGTERM
  arrives twice. One repeat of it, handled before the trainer polled the
  request (a long step delays the handler) or within 0.1 s, is that copy (the
  save goes on); a repeat after both, a third, or another signal aborts."""
  clock = [100.0]
  monkeypatch.setattr(resume, '_clock', lambda: clock[0])
  window = resume.StopOnSignal.SAME_DELIVERY_SECONDS

  def abort(stop, signum):
    with pytest.raises(KeyboardInterrupt, match='second signal'):
      os.kill(os.getpid(), signum)
      time.sleep(1)  # the handler runs between bytecodes; never reached

  messages = []
  with resume.StopOnSignal(messages.append) as stop:  # the copy, seconds later, before the poll
    os.kill(os.getpid(), signal.SIGTERM)
    clock[0] += 5.0
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop() and len(messages) == 1
    abort(stop, signal.SIGTERM)  # a third
  with resume.StopOnSignal(messages.append) as stop:  # after the poll, within the window
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop()
    clock[0] += window / 2
    os.kill(os.getpid(), signal.SIGTERM)
    abort(stop, signal.SIGTERM)  # a third, even at once
  with resume.StopOnSignal(messages.append) as stop:  # after the poll and the window
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop()
    clock[0] += 2 * window
    abort(stop, signal.SIGTERM)
  with resume.StopOnSignal(messages.append):  # another signal at once
    os.kill(os.getpid(), signal.SIGINT)
    abort(None, signal.SIGTERM)


def _cli(workdir, profile, log, script=None, **env):
  """The real CLI in a subprocess (this worktree first on the path, the
  tests' compilation cache); ``script``: Python that runs it in its place,
  with the same flags and ``env`` added to the environment."""
  args = [f'--config.{k}={v}' for k, v in {**SMALL, 'train.epochs': 3,
                                            'train.max_steps_per_epoch': 4,
                                            'pipeline.micro_batches': 4,
                                            'cache.policy': 'always',
                                            'pipeline.profile_path': profile}.items()]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, 'PYTHONPATH': root, 'PIPEJAX_COMPILATION_CACHE':
         jax.config.jax_compilation_cache_dir or '', **env}
  command = ['-m', 'experiments.vit_imagenet'] if script is None else ['-c', script]
  return subprocess.Popen([sys.executable, *command, f'--workdir={workdir}', *args], cwd=root,
                          env=env, stdout=subprocess.PIPE, stderr=log, text=True)


def _wait_for(proc, prefix: str, timeout: float = 300) -> str:
  deadline = time.time() + timeout
  for line in proc.stdout:
    if line.startswith(prefix):
      return line
    assert time.time() < deadline, f'no line starting with {prefix!r}'
  raise AssertionError(f'the run ended (code {proc.wait()}) before {prefix!r}')


def test_sigkill_then_sigterm_then_same_command_equals_uninterrupted(tmp_path):
  """The CLI killed with SIGKILL after epoch 1, rerun and stopped with
  SIGTERM (saves, exit 75), rerun to the end: the rows equal an uninterrupted
  run's; metrics rows survive the SIGKILL. AutoCache is on: the reference
  serves entries advanced through newly frozen blocks, the resumed run
  rebuilt ones, equal up to the last bit: the README promises the losses within
  2e-7 relative and the final accuracy equal (measured: every loss and
  accuracy bitwise equal)."""
  config = _config(str(tmp_path / 'p-ref.json'), **{'train.max_steps_per_epoch': 4,
                                                     'pipeline.micro_batches': 4,
                                                     'cache.enabled': True,
                                                     'cache.policy': 'always'})
  reference = str(tmp_path / 'reference')
  reference_summary = elastic.run(config, reference, task='vit')
  expected = _rows(reference)

  workdir, profile = str(tmp_path / 'run'), str(tmp_path / 'p.json')
  with open(tmp_path / 'stderr.txt', 'w') as log:
    proc = _cli(workdir, profile, log)
    _wait_for(proc, 'epoch 1:')
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    assert [r['epoch'] for r in _rows(workdir)] == [0, 1]  # flushed before the kill

    proc = _cli(workdir, profile, log)
    _wait_for(proc, 'elastic run')  # the signal comes while it resumes or trains
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=300)[0]
    assert proc.returncode == resume.EXIT_INTERRUPTED, rest
    assert 'SIGTERM: finishing the current step' in rest

    proc = _cli(workdir, profile, log)
    rest = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, rest
  err = (tmp_path / 'stderr.txt').read_text()
  assert 'interrupted: stopped on request after step' in err and 'Traceback' not in err
  rows = _rows(workdir)
  assert len(rows) == len(expected) == 3
  close = ('train_loss', 'train_accuracy', 'eval_accuracy')
  for got, want in zip(rows, expected, strict=True):
    assert ({k: got[k] for k in EXACT if k not in close} ==
            {k: want[k] for k in EXACT if k not in close})
    np.testing.assert_allclose([got[k] for k in close], [want[k] for k in close], rtol=2e-7)
  for key in ('train_accuracy', 'eval_accuracy'):  # the final accuracy: equal
    assert rows[-1][key] == expected[-1][key], key
  with open(os.path.join(workdir, 'summary.json')) as f:
    assert json.load(f)['final_eval_accuracy'] == reference_summary['final_eval_accuracy']
  assert all(r['cache'] for r in rows[1:])


# The CLI, its stop's save held in flight until a signal interrupts the wait for it
# (orbax's own wait, in which a second signal lands in a real run), for as long as a
# test needs: orbax finalises the save only then. A file says when the wait begins.
_HELD_STOP_SAVE = """
import os, threading
from experiments import command_line, vit_imagenet
from pipejax import checkpoints, runtime
started = checkpoints.Checkpoints.save
interrupted = threading.Event()


def save(self, step, state, meta, wait=False):
  if not wait:  # not the save of a stop
    return started(self, step, state, meta)
  finalize = self.manager._finalize_checkpoint
  self.manager._finalize_checkpoint = lambda s: (interrupted.wait(300), finalize(s))
  started(self, step, state, meta)
  open(os.environ['SAVE_STARTED'], 'w').close()
  try:
    self.manager.wait_until_finished()
  except KeyboardInterrupt:
    interrupted.set()
    raise

checkpoints.Checkpoints.save = save
runtime.exit_now(command_line.cli(vit_imagenet.__file__, task='vit'))
"""


def test_a_second_sigterm_during_the_stop_save_aborts_with_130_keeping_the_checkpoint(tmp_path):
  """The CLI, resumed from the checkpoint of epoch 0, gets SIGTERM, then a
  second one (after the trainer took the first up and 0.1 s later: not a
  copy of it) while the stop's checkpoint is being written: exit 130 and one
  line, no traceback; the previous checkpoint is there byte for byte, the
  one in flight is finished on the way out (no partial one is left), and
  the same command resumes from it and finishes."""
  workdir, profile = str(tmp_path / 'run'), str(tmp_path / 'p.json')
  config = _config(profile, **{'train.max_steps_per_epoch': 4, 'pipeline.micro_batches': 4,
                               'cache.enabled': True, 'cache.policy': 'always'})  # as _cli's
  with pytest.raises(TrainingInterrupted):  # at epoch 0's end
    elastic.run(config, workdir, task='vit', stop_requested=_stop_at(4))
  previous = os.path.join(workdir, 'checkpoints', '4')
  before = _files(previous)
  started = tmp_path / 'save-started'
  with open(tmp_path / 'stderr.txt', 'w') as log:
    proc = _cli(workdir, profile, log, _HELD_STOP_SAVE, SAVE_STARTED=str(started))
    try:
      # Its handlers are set; the first poll comes after step 5, past the transition.
      _wait_for(proc, 'resuming from')
      proc.send_signal(signal.SIGTERM)
      deadline = time.time() + 300
      while not started.exists():  # polled after step 5: the stop's save waits
        assert proc.poll() is None and time.time() < deadline, 'the stop was never saved'
        time.sleep(0.02)
      time.sleep(2 * resume.StopOnSignal.SAME_DELIVERY_SECONDS)
      proc.send_signal(signal.SIGTERM)
      out = proc.communicate(timeout=120)[0]
    finally:
      if proc.poll() is None:  # a failed check: no run left behind
        proc.kill()
        proc.wait()
    assert proc.returncode == resume.EXIT_ABORTED, out
    assert 'SIGTERM: finishing the current step' in out
    aborted = (tmp_path / 'stderr.txt').read_text()
    assert 'aborted (nothing saved after the last checkpoint)' in aborted
    assert _files(previous) == before
    # Closing the checkpoints waited for the save in flight: no partial one is left.
    assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['4', '5']
    assert [r['epoch'] for r in _rows(workdir)] == [0]

    proc = _cli(workdir, profile, log)
    out = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, out
  assert f'resuming from {os.path.join(workdir, "checkpoints", "5")}' in out
  assert 'unreadable' not in out and checkpoints.set_aside(workdir) == []
  rows = _rows(workdir)
  assert [r['epoch'] for r in rows] == [0, 1, 2] and rows[-1]['step'] == 12
  assert os.path.exists(os.path.join(workdir, 'summary.json'))
  assert 'Traceback' not in aborted, aborted[-3000:]  # the abort is one line


def test_a_stop_requested_after_the_last_epoch_lets_the_run_finish(tmp_path):
  """A signal during the last epoch's evaluation, after its last step: nothing
  is left to train, so the run finishes and writes its summary (the CLI then
  says that the signal came after the last step, exit 0). It used to stop
  with exit 75 and no summary until the command ran again."""
  workdir = str(tmp_path / 'run')
  config = _config(str(tmp_path / 'profile.json'))

  def late():  # asked from the moment the last epoch's row is written
    return (os.path.exists(os.path.join(workdir, 'metrics.jsonl'))
            and len(_rows(workdir)) == config.train.epochs)

  summary = elastic.run(config, workdir, task='vit', stop_requested=late)
  rows = _rows(workdir)
  assert [r['epoch'] for r in rows] == [0, 1, 2]
  assert summary['final_eval_accuracy'] == rows[-1]['eval_accuracy']
  with open(os.path.join(workdir, 'summary.json')) as f:
    assert json.load(f)['final_eval_accuracy'] == rows[-1]['eval_accuracy']


def test_a_signal_after_the_last_step_says_the_run_finished(monkeypatch, capsys):
  """SIGTERM while the summary is written: the run is complete and exits 0;
  the line printed at the signal (saving, exit 75) is corrected."""
  def finishing(config, workdir, task, stop_requested):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives after the last step
    assert stop_requested()
    return {}

  monkeypatch.setattr(elastic, 'run', finishing)
  assert elastic.main(None, None, task='vit') == 0
  out = capsys.readouterr().out
  assert 'SIGTERM: finishing the current step' in out
  assert 'the signal came after the last step: the run finished' in out
  monkeypatch.undo()
  monkeypatch.setattr(elastic, 'run', lambda *a, **k: {})
  assert elastic.main(None, None, task='vit') == 0  # no signal: no such line
  assert 'the signal came' not in capsys.readouterr().out


def test_orbax_warning_about_a_checkpoint_still_being_written_is_dropped_only():
  """The entry points' set-up drops orbax's "Metadata file does not exist" for
  a checkpoint's temporary folder (a save still in progress), no other warning."""
  script = ('from pipejax import runtime; runtime.setup()\n'
            'from absl import logging\n'
            "logging.warning('Metadata file does not exist: %s', "
            "'/w/checkpoints/64.orbax-checkpoint-tmp/_CHECKPOINT_METADATA')\n"
            "logging.warning('Metadata file does not exist: %s', '/w/checkpoints/64/_METADATA')\n"
            "logging.warning('another warning')\n")
  out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.returncode == 0, out.stderr
  assert 'orbax-checkpoint-tmp' not in out.stderr
  assert 'Metadata file does not exist: /w/checkpoints/64/_METADATA' in out.stderr
  assert 'another warning' in out.stderr


def test_a_workdir_in_use_by_a_live_run_is_refused_and_freed_when_it_dies(tmp_path, capsys):
  """Two runs writing one workdir would mix their rows and checkpoints: the
  second is refused in one line naming the first; the claim dies with its
  process (here SIGKILLed), so a rerun is never locked out by a dead one."""
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  config = _config(str(tmp_path / 'p.json'), **{'train.epochs': 1})
  with fixtures.lock_held_elsewhere(os.path.join(workdir, elastic.LOCK_FILE)) as pid:
    assert elastic.main(config, workdir, task='vit') == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f'error: --workdir={workdir} is in use by another run (pid {pid} on '), err
    assert not os.path.exists(os.path.join(workdir, 'metrics.jsonl'))
  assert elastic.main(config, workdir, task='vit') == 0
  assert [r['epoch'] for r in _rows(workdir)] == [0]
  # Released at the end of a run: the same process runs on it again.
  with config.unlocked():
    config.train.epochs = 2
  assert elastic.main(config, workdir, task='vit') == 0
  assert [r['epoch'] for r in _rows(workdir)] == [0, 1]


def test_a_ctrl_c_while_an_entry_point_starts_is_one_line():
  """Before training (its own handlers) an entry point's imports and flags
  run unguarded: a Ctrl-C there ends it with one line and exit code 130, not
  a traceback; other errors keep theirs."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for module in ('vit_imagenet', 'bert_glue', 'bert_squad', 'plain_dp'):
    source = open(os.path.join(root, 'experiments', f'{module}.py')).read()
    assert source.index('runtime.quiet_interrupt()') < source.index('runtime.setup(8)'), module
  code = ('import signal, sys\nfrom pipejax import runtime\nruntime.quiet_interrupt()\n'
          'if sys.argv[1] == "ctrl-c":\n  signal.raise_signal(signal.SIGINT)\n'
          'raise ValueError("a bug")\n')
  for what in ('ctrl-c', 'bug'):
    done = subprocess.run([sys.executable, '-c', code, what], cwd=root, capture_output=True,
                          text=True, timeout=60)
    if what == 'ctrl-c':
      assert done.returncode in (130, -signal.SIGINT) and done.stderr == 'interrupted\n'
    else:
      assert done.returncode == 1 and 'Traceback' in done.stderr and 'a bug' in done.stderr
