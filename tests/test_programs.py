"""The program store: a stored program is compiled without tracing, gives the
same bits as the traced one, keeps donation and shardings, from its
executable or its program, in this process or another; only an executable
this process compiled is kept; unusable entries are reported and traced
afresh; the key follows what the trace depends on; an elastic run that loads
every transition program trains bit for bit like one that traces them."""
import contextlib
import os
import pickle
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipejax import programs
from pipejax.programs import EXECUTABLE_SUFFIX, POINTER_SUFFIX, PROGRAM_SUFFIX, ProgramStore
from tests import fixtures
from tests.test_trainer import _Bar, _config, _trainer


def _mesh(half: bool = False):
  """All 8 devices, or (``half``, as a run without AutoDP after K shrank)
  the last 4 in reverse order."""
  if half:
    return Mesh(np.array(jax.devices()[4:][::-1]).reshape(2, 2), ('data', 'stage'))
  return Mesh(np.array(jax.devices()).reshape(2, 4), ('data', 'stage'))


def _args(half: bool = False):
  """A state with an optax tree (not serializable by jax.export itself),
  sharded over 'stage', and a batch split over 'data'."""
  mesh = _mesh(half)
  params = {'w': jnp.arange(32.0).reshape(4, 8), 'b': jnp.ones(8)}
  opt = optax.adamw(0.1).init(params)
  state = jax.device_put({'params': params, 'opt': opt, 'step': jnp.zeros((), jnp.int32)},
                         NamedSharding(mesh, P()))
  state['params']['w'] = jax.device_put(state['params']['w'], NamedSharding(mesh, P('stage')))
  batch = jax.device_put(jnp.linspace(-1.0, 1.0, 16).reshape(2, 8), NamedSharding(mesh, P('data')))
  return state, batch


def _salt() -> float:
  """A constant no earlier compile had: a program built with it is compiled
  by XLA, not read from JAX's persistent cache (kept across test sessions)."""
  return float(np.random.default_rng().integers(1, 1 << 20))


def _build(calls, salt: float = 0.0, half: bool = False):
  mesh = _mesh(half)
  tx = optax.adamw(0.1)

  def step(state, batch):
    calls.append(1)
    loss, grads = jax.value_and_grad(
        lambda p: jnp.sum((batch @ p['w'].T) ** 2) + jnp.sum(p['b']) + salt)(state['params'])
    updates, opt = tx.update(grads, state['opt'], state['params'])
    return {'params': optax.apply_updates(state['params'], updates), 'opt': opt,
            'step': state['step'] + 1}, loss

  def shardings(state):
    return jax.tree.map(lambda x: x.sharding, state)

  return lambda: jax.jit(step, donate_argnums=0,
                         out_shardings=(shardings(_args(half)[0]), NamedSharding(mesh, P())))


def _spec(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _bits(tree):
  """Every leaf's bytes (exact comparison, NaN-safe)."""
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _files(directory, suffix):
  return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(suffix))


@contextlib.contextmanager
def _jax_cache(min_seconds: float):
  """JAX's persistent cache keeps programs that compiled in ``min_seconds``
  or more inside the block (the test session's cache)."""
  before = (jax.config.jax_persistent_cache_min_compile_time_secs,
            jax.config.jax_persistent_cache_min_entry_size_bytes)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', min_seconds)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  try:
    yield
  finally:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', before[0])
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', before[1])


@pytest.mark.parametrize('kept', ['executable', 'program'])
def test_a_stored_program_is_compiled_without_tracing_and_gives_the_same_bits(tmp_path, kept):
  """From its executable, or (the executable gone) from its program."""
  traced = []
  first = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
  state, batch = _args()
  # A new program, compiled here (not read from JAX's cache): its executable is kept.
  compiled = first.compile('step', ('k',), _spec((state, batch)), _build(traced, _salt()),
                           donate_argnums=(0,))
  want = compiled(state, batch)
  assert first.stats()['programs_traced'] == 1 and traced
  assert len(_files(tmp_path, PROGRAM_SUFFIX)) == len(_files(tmp_path, EXECUTABLE_SUFFIX)) == 1
  if kept == 'program':
    os.remove(_files(tmp_path, EXECUTABLE_SUFFIX)[0])

  def poisoned():
    raise AssertionError('a stored program must not be traced again')

  second = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
  state, batch = _args()
  loaded = second.compile('step', ('k',), _spec((state, batch)), poisoned, donate_argnums=(0,))
  got = loaded(state, batch)
  assert second.stats()['programs_loaded'] == 1 and second.stats()['programs_traced'] == 0
  assert second.stats()['executables_loaded'] == (kept == 'executable')
  assert _bits(got) == _bits(want)
  assert jax.tree.structure(got) == jax.tree.structure(want)  # the optax tree comes back
  assert state['params']['w'].is_deleted()  # still donated
  assert got[0]['params']['w'].sharding == NamedSharding(_mesh(), P('stage'))
  # Chained: the loaded program's output is a valid input of itself.
  again = loaded(got[0], batch)
  assert int(again[0]['step']) == 2


_CHILD = """
import os, sys, pickle
import jax  # the test's XLA_FLAGS (part of the store's key) come with its environment
jax.config.update('jax_compilation_cache_dir', sys.argv[2])
sys.path.insert(0, sys.argv[3])
import pytest
from pipejax.programs import ProgramStore
from tests.test_programs import _args, _bits, _spec
store = ProgramStore(sys.argv[1], {'run': 1}, log=pytest.fail)
state, batch = _args(sys.argv[4] == 'half')
loaded = store.compile('step', ('k',), _spec((state, batch)), pytest.fail, donate_argnums=(0,))
out = loaded(state, batch)
out = loaded(out[0], batch)
sys.stdout.buffer.write(pickle.dumps((store.stats(), _bits(out))))
"""


@pytest.mark.parametrize('devices', ['all', 'half'])
def test_another_process_runs_the_stored_executable(tmp_path, devices):
  """XLA:CPU's executables are loaded by a fresh process (where a re-serialised
  cache entry would miss its kernels) and give the traced program's bits;
  one on 4 of the 8 devices, in reverse order, is loaded onto those (XLA
  aborts the process when they do not match)."""
  half = devices == 'half'
  store = ProgramStore(str(tmp_path / 'store'), {'run': 1}, log=pytest.fail)
  state, batch = _args(half)
  with _jax_cache(0.0):  # as in a run: JAX's cache keeps the compile too
    compiled = store.compile('step', ('k',), _spec((state, batch)), _build([], _salt(), half),
                             donate_argnums=(0,))
  first = compiled(state, batch)
  want = _bits(compiled(first[0], batch))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  child = subprocess.run([sys.executable, '-c', _CHILD, str(tmp_path / 'store'),
                          str(tmp_path / 'jax'), root, devices], capture_output=True,
                         check=False, timeout=300)
  assert child.returncode == 0, child.stderr.decode()[-2000:]
  stats, got = pickle.loads(child.stdout)
  assert stats['executables_loaded'] == 1 and stats['programs_traced'] == 0
  assert got == want


def test_a_compile_answered_by_jax_cache_is_not_fresh():
  salt = _salt()
  replicated = NamedSharding(_mesh(), P())
  x = jax.device_put(jnp.ones((8, 8)), replicated)
  with _jax_cache(0.0):
    first = programs.compile_fresh(jax.jit(lambda x: jnp.tanh(x) + salt).lower(x))
    again = programs.compile_fresh(jax.jit(lambda x: jnp.tanh(x) + salt).lower(x))
  assert first[1] and not again[1]
  np.testing.assert_array_equal(again[0](x), first[0](x))


def test_an_executable_that_is_not_fresh_is_not_kept(tmp_path, monkeypatch):
  """Read from JAX's cache, serialised again, an executable would miss its
  kernels: only the program is kept, and it is counted."""
  monkeypatch.setattr(programs, 'compile_fresh',
                      lambda lowered, options=None: (lowered.compile(), False))
  store = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
  state, batch = _args()
  compiled = store.compile('step', ('k',), _spec((state, batch)), _build([], _salt()),
                           donate_argnums=(0,))
  assert int(compiled(state, batch)[0]['step']) == 1
  assert len(_files(tmp_path, PROGRAM_SUFFIX)) == 1 and _files(tmp_path, EXECUTABLE_SUFFIX) == []
  assert store.stats()['executables_not_kept'] == 1


def test_entries_of_the_same_program_share_its_executable(tmp_path):
  """A second entry of the same program (here another identity; in a run, a
  changed configuration whose programs did not change) is answered by JAX's
  cache, and points to the executable the first entry kept. An executable
  lost while JAX's cache holds its program is compiled and kept again."""
  state, batch = _args()
  salt = _salt()
  with _jax_cache(0.0):
    for run in (1, 2):
      store = ProgramStore(str(tmp_path), {'run': run}, log=pytest.fail)
      store.compile('step', ('k',), _spec((state, batch)), _build([], salt),
                    donate_argnums=(0,))
      assert store.stats()['executables_not_kept'] == 0
    assert len(_files(tmp_path, PROGRAM_SUFFIX)) == len(_files(tmp_path, POINTER_SUFFIX)) == 2
    (executable,) = _files(tmp_path, EXECUTABLE_SUFFIX)
    second = ProgramStore(str(tmp_path), {'run': 2}, log=pytest.fail)
    state, batch = _args()
    got = second.compile('step', ('k',), _spec((state, batch)), pytest.fail,
                         donate_argnums=(0,))(state, batch)
    assert second.stats()['executables_loaded'] == 1
    assert int(got[0]['step']) == 1
    os.remove(executable)
    again = ProgramStore(str(tmp_path), {'run': 2}, log=pytest.fail)
    again.compile('step', ('k',), _spec(_args()), pytest.fail, donate_argnums=(0,))
  assert again.stats()['programs_loaded'] == 1 and again.stats()['executables_loaded'] == 0
  assert again.stats()['executables_not_kept'] == 0 and _files(tmp_path, EXECUTABLE_SUFFIX) == [
      executable]
  last = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
  state, batch = _args()
  got = last.compile('step', ('k',), _spec((state, batch)), pytest.fail,
                     donate_argnums=(0,))(state, batch)
  assert last.stats()['executables_loaded'] == 1 and int(got[0]['step']) == 1


def test_programs_that_differ_only_in_their_output_s_container_keep_their_own(tmp_path):
  """A tuple and a list of the same arrays lower to the same module text: the
  second entry's executable replaced the first's, whose program then
  returned a list. Each keeps its own container, also when loaded again."""
  sharding = NamedSharding(_mesh(), P())
  x = jax.device_put(jnp.arange(8.0) + _salt(), sharding)
  builds = {'tuple': lambda: jax.jit(lambda v: (v * 2, v + 1), out_shardings=sharding),
            'list': lambda: jax.jit(lambda v: [v * 2, v + 1], out_shardings=sharding)}
  with _jax_cache(0.0):
    store = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
    for name, build in builds.items():
      assert type(store.compile('p', (name,), (x,), build)(x)).__name__ == name
    assert len(_files(tmp_path, EXECUTABLE_SUFFIX)) == 2
    again = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
    for name in builds:
      got = again.compile('p', (name,), (x,), pytest.fail)(x)
      assert type(got).__name__ == name
      np.testing.assert_array_equal(got[1], np.asarray(x) + 1)
  assert again.stats()['executables_loaded'] == 2


def test_an_executable_of_an_earlier_layout_is_not_shared(tmp_path, monkeypatch):
  """An executable file written by an earlier layout of the store is not
  pointed to by a new entry of the same program (it would be unusable at
  every load): the new entry compiles and keeps its own."""
  state, batch = _args()
  salt = _salt()
  with _jax_cache(0.0):
    ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail).compile(
        'step', ('k',), _spec((state, batch)), _build([], salt), donate_argnums=(0,))
    monkeypatch.setattr(programs, 'EXECUTABLE_FORMAT', programs.EXECUTABLE_FORMAT + 1)
    ProgramStore(str(tmp_path), {'run': 2}, log=pytest.fail).compile(
        'step', ('k',), _spec((state, batch)), _build([], salt), donate_argnums=(0,))
    assert len(_files(tmp_path, EXECUTABLE_SUFFIX)) == 2
    store = ProgramStore(str(tmp_path), {'run': 2}, log=pytest.fail)
    store.compile('step', ('k',), _spec(_args()), pytest.fail, donate_argnums=(0,))
  assert store.stats()['executables_loaded'] == 1


def test_the_program_written_nowhere_is_reported_once(tmp_path, monkeypatch):
  """An unwritable store: one line for the program, no executable attempted."""
  def refuse(src, dst):
    raise OSError('read-only file system')

  monkeypatch.setattr(programs.os, 'replace', refuse)
  messages = []
  store = ProgramStore(str(tmp_path), {'run': 1}, log=messages.append)
  state, batch = _args()
  compiled = store.compile('step', ('k',), _spec((state, batch)), _build([], _salt()),
                           donate_argnums=(0,))
  assert int(compiled(state, batch)[0]['step']) == 1
  assert len(messages) == 1 and 'cannot write' in messages[0], messages
  assert os.listdir(tmp_path) == []
  # A second program of the run: not said again (a run has dozens).
  store.compile('step', ('k2',), _spec((state, batch)), _build([], _salt()),
                donate_argnums=(0,))
  assert len(messages) == 1 and 'said once' in messages[0], messages


def _damaged(data: bytes, damage: str) -> bytes:
  if damage == 'truncate':
    return data[:len(data) // 2]
  if damage == 'garbage':
    return b'\x00not a program' * 50
  flipped = bytearray(data)  # one bit, in the middle of the machine code or module
  flipped[len(flipped) // 2] ^= 0x10
  return bytes(flipped)


@pytest.mark.parametrize('damage', ['truncate', 'garbage', 'bit'])
def test_an_unusable_executable_is_reported_and_compiled_from_its_program(tmp_path, damage):
  state, batch = _args()
  store = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
  with _jax_cache(0.0):  # as in a run: JAX's cache keeps every compile
    want = store.compile('step', ('k',), _spec((state, batch)), _build([], _salt()),
                         donate_argnums=(0,))(state, batch)
    (path,) = _files(tmp_path, EXECUTABLE_SUFFIX)
    data = open(path, 'rb').read()
    with open(path, 'wb') as f:
      f.write(_damaged(data, damage))
    messages = []
    store = ProgramStore(str(tmp_path), {'run': 1}, log=messages.append)
    state, batch = _args()
    got = store.compile('step', ('k',), _spec((state, batch)), pytest.fail,
                        donate_argnums=(0,))(state, batch)
  assert _bits(got) == _bits(want)
  assert store.stats()['executables_unusable'] == 1 and store.stats()['programs_loaded'] == 1
  assert len(messages) == 1 and 'unusable' in messages[0] and 'from its program' in messages[0]
  if damage == 'bit':  # found by the seal, before anything of it is deserialised
    assert 'checksum mismatch' in messages[0]
  # Compiled here from the program, the executable was written again; it loads.
  assert open(path, 'rb').read() != _damaged(data, damage)
  store = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
  store.compile('step', ('k',), _spec(_args()), pytest.fail, donate_argnums=(0,))
  assert store.stats()['executables_loaded'] == 1


def test_a_traced_program_whose_stored_form_does_not_load_back_is_compiled_as_traced(
    tmp_path, monkeypatch):
  """A program just traced is compiled from its exported form, so that the
  executable kept is a later run's; where that form does not load back, the
  traced program is compiled instead (the same results), nothing is kept,
  and one line says so."""
  state, batch = _args()
  want = ProgramStore(str(tmp_path / 'plain'), {'run': 1}, log=pytest.fail).compile(
      'step', ('k',), _spec((state, batch)), _build([]), donate_argnums=(0,))(state, batch)

  def refuse(*args, **kwargs):
    raise ValueError('cannot deserialize the module')

  monkeypatch.setattr(ProgramStore, '_from_entry', refuse)
  messages = []
  store = ProgramStore(str(tmp_path / 'store'), {'run': 1}, log=messages.append)
  state, batch = _args()
  got = store.compile('step', ('k',), _spec((state, batch)), _build([]),
                      donate_argnums=(0,))(state, batch)
  assert _bits(got) == _bits(want)
  assert len(messages) == 1 and 'does not load back (ValueError: cannot deserialize the ' \
      'module); compiled as traced, not kept' in messages[0], messages
  assert not _files(tmp_path / 'store', PROGRAM_SUFFIX)
  assert not _files(tmp_path / 'store', EXECUTABLE_SUFFIX)


@pytest.mark.parametrize('error', [MemoryError(), RuntimeError(
    'RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB')])
def test_memory_running_out_while_loading_removes_nothing(tmp_path, monkeypatch, error):
  """Memory that runs out while an entry loads (the host's, or a device's)
  is no damage: the error is raised and the executable and program stay,
  where damage would remove them."""
  state, batch = _args()
  with _jax_cache(0.0):
    ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail).compile(
        'step', ('k',), _spec((state, batch)), _build([], _salt()), donate_argnums=(0,))
  kept = sorted(os.listdir(tmp_path))
  assert _files(tmp_path, EXECUTABLE_SUFFIX) and _files(tmp_path, PROGRAM_SUFFIX)

  def fail(*args, **kwargs):
    raise error

  for target, name in ((programs.serialize_executable, 'deserialize_and_load'),
                       (ProgramStore, '_load')):
    with monkeypatch.context() as patch:
      if name == '_load':  # the program, once no executable is read
        patch.setattr(ProgramStore, '_load_executable', lambda self, path: None)
      patch.setattr(target, name, fail)
      store = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
      with pytest.raises(type(error)):
        store.compile('step', ('k',), _spec(_args()), pytest.fail, donate_argnums=(0,))
    assert sorted(os.listdir(tmp_path)) == kept


@pytest.mark.parametrize('damage', ['truncate', 'garbage', 'bit'])
def test_an_unusable_entry_is_reported_removed_and_traced_afresh(tmp_path, damage):
  state, batch = _args()
  store = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
  want = store.compile('step', ('k',), _spec((state, batch)), _build([]),
                       donate_argnums=(0,))(state, batch)
  for executable in _files(tmp_path, EXECUTABLE_SUFFIX):  # the program is what is read
    os.remove(executable)
  (path,) = _files(tmp_path, PROGRAM_SUFFIX)
  data = open(path, 'rb').read()
  with open(path, 'wb') as f:
    f.write(_damaged(data, damage))
  messages, traced = [], []
  store = ProgramStore(str(tmp_path), {'run': 1}, log=messages.append)
  state, batch = _args()
  got = store.compile('step', ('k',), _spec((state, batch)), _build(traced),
                      donate_argnums=(0,))(state, batch)
  assert traced and _bits(got) == _bits(want)
  assert store.stats()['programs_unusable'] == 1
  assert len(messages) == 1 and 'unusable' in messages[0] and 'traced afresh' in messages[0]
  if damage == 'bit':  # a flipped bit can crash XLA's deserialisation, or verify as
    assert 'checksum mismatch' in messages[0]  # another program: never read at all
  assert open(path, 'rb').read() != _damaged(data, damage)  # rewritten, whole again
  store = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
  store.compile('step', ('k',), _spec(_args()), lambda: pytest.fail('traced'),
                donate_argnums=(0,))
  assert store.stats()['programs_loaded'] == 1


def test_the_key_follows_identity_name_key_and_arguments(tmp_path):
  state, batch = _args()
  args = _spec((state, batch))
  store = ProgramStore(str(tmp_path), {'run': 1})
  base = store.path('step', ('k',), args)
  assert base == ProgramStore(str(tmp_path), {'run': 1}).path('step', ('k',), args)
  assert ProgramStore(str(tmp_path), {'run': 2}).path('step', ('k',), args) != base
  assert store.path('move', ('k',), args) != base
  assert store.path('step', ('j',), args) != base
  wider = _spec((state, jnp.zeros((2, 9))))
  assert store.path('step', ('k',), wider) != base
  mesh = _mesh()
  moved = _spec((jax.device_put(state, NamedSharding(mesh, P())), batch))
  assert store.path('step', ('k',), moved) != base  # another sharding of 'w'
  other_devices = Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ('data', 'stage'))
  flipped = _spec((state, jax.device_put(batch, NamedSharding(other_devices, P('data')))))
  assert store.path('step', ('k',), flipped) != base
  assert store.path('step', ('k',), args, {'xla_cpu_experimental_ynn_fusion_type': ''}) != base
  assert store.path('step', ('k',), args, donate_argnums=(0,)) != base
  # The arguments' dtypes, tree structure and weak types are in the key.
  assert store.path('step', ('k',), _spec((state, batch.astype(jnp.bfloat16)))) != base
  assert store.path('step', ('k',), _spec((state, {'x': batch}))) != base
  weak = jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=batch.sharding, weak_type=True)
  assert store.path('step', ('k',), (args[0], weak)) != base


def test_a_runs_programs_are_keyed_by_its_config_less_what_never_enters_them(tmp_path):
  """The trainer's store key holds the config but ``checkpoint``,
  ``resume`` and ``data.workers``: changing those reuses the stored
  programs; changing a traced key (the learning rate) does not."""
  from experiments import vit_imagenet  # noqa: PLC0415
  from pipejax.trainer import traced_config  # noqa: PLC0415
  args = _spec(_args())

  def key(**overrides):
    config = vit_imagenet.get_config()
    with config.unlocked():
      fixtures.override(config, overrides)
    return ProgramStore(str(tmp_path), {'config': traced_config(config)}).path('step', ('k',), args)

  base = key()
  assert key(**{'data.workers': 3, 'checkpoint.keep': 5, 'resume': False}) == base
  assert key(**{'train.learning_rate': 0.5}) != base
  assert key(**{'data.image_size': 32}) != base


def test_the_key_follows_the_code_and_xla_flags(tmp_path, monkeypatch):
  """A program traced by other code, or compiled under other XLA flags, is
  another program."""
  args = _spec(_args())
  base = ProgramStore(str(tmp_path), {'run': 1}).path('step', ('k',), args)
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_enable_fast_math=false')
  assert ProgramStore(str(tmp_path), {'run': 1}).path('step', ('k',), args) != base
  monkeypatch.undo()
  monkeypatch.setattr(programs, 'code_fingerprint', lambda: 'other code')
  assert ProgramStore(str(tmp_path), {'run': 1}).path('step', ('k',), args) != base
  monkeypatch.undo()
  # A setting that tracing bakes in (here the matmul precision) too.
  with jax.default_matmul_precision('highest'):
    assert ProgramStore(str(tmp_path), {'run': 1}).path('step', ('k',), args) != base
  assert ProgramStore(str(tmp_path), {'run': 1}).path('step', ('k',), args) == base


def test_executables_of_other_flags_or_versions_are_kept_apart(monkeypatch):
  """The machine fingerprint (an executable's name and its pointer) follows
  XLA_FLAGS and jax's versions, which the backend's version does not name on
  the CPU: a store shared by two such set-ups never serves one's executable
  to the other."""
  programs.machine_fingerprint.cache_clear()
  base = programs.machine_fingerprint()
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_enable_fast_math=true')
  programs.machine_fingerprint.cache_clear()
  assert programs.machine_fingerprint() != base
  monkeypatch.undo()
  monkeypatch.setattr(programs.diskcache, 'versions', lambda libs: {lib: '0.0' for lib in libs})
  programs.machine_fingerprint.cache_clear()
  assert programs.machine_fingerprint() != base
  monkeypatch.undo()
  programs.machine_fingerprint.cache_clear()
  assert programs.machine_fingerprint() == base


@pytest.mark.parametrize('damage', [b'\xff\xfe not text', b'\x00' * 40, b'../../etc/passwd'])
def test_a_damaged_pointer_is_said_removed_and_the_program_compiled(tmp_path, damage):
  state, batch = _args()
  salt = _salt()
  with _jax_cache(0.0):
    ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail).compile(
        'step', ('k',), _spec((state, batch)), _build([], salt), donate_argnums=(0,))
  [pointer] = _files(tmp_path, POINTER_SUFFIX)
  with open(pointer, 'wb') as f:
    f.write(damage)
  lines = []
  store = ProgramStore(str(tmp_path), {'run': 1}, log=lines.append)
  state, batch = _args()
  with _jax_cache(0.0):
    got = store.compile('step', ('k',), _spec((state, batch)), pytest.fail,
                        donate_argnums=(0,))(state, batch)
  assert int(got[0]['step']) == 1
  assert len(lines) == 1 and os.path.basename(pointer) in lines[0] and '\n' not in lines[0]
  assert store.stats()['executables_unusable'] == 1
  assert open(pointer).read().strip() != damage.decode('latin-1')  # written anew


def test_an_executable_is_kept_per_machine_and_per_compile_options(tmp_path, monkeypatch):
  """Another host CPU (or backend version) shares the stored program but not
  its executable: it compiles and keeps its own. The same program compiled
  with other options has an executable of its own too."""
  state, batch = _args()
  salt = _salt()
  with _jax_cache(0.0):
    here = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
    here.compile('step', ('k',), _spec((state, batch)), _build([], salt), donate_argnums=(0,))
    monkeypatch.setattr(programs, 'machine_fingerprint', lambda: 'f' * 64)
    there = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
    state, batch = _args()
    got = there.compile('step', ('k',), _spec((state, batch)), pytest.fail,
                        donate_argnums=(0,))(state, batch)
  assert int(got[0]['step']) == 1
  assert there.stats()['programs_loaded'] == 1 and there.stats()['executables_loaded'] == 0
  assert len(_files(tmp_path, PROGRAM_SUFFIX)) == 1
  assert len(_files(tmp_path, POINTER_SUFFIX)) == len(_files(tmp_path, EXECUTABLE_SUFFIX)) == 2
  # Options: the one-off programs' compile without library fusions.
  other = tmp_path / 'options'
  store = ProgramStore(str(other), {'run': 1}, log=pytest.fail)
  replicated = NamedSharding(_mesh(), P())
  x = jax.device_put(jnp.linspace(-1.0, 1.0, 32 * 64).reshape(32, 64) + salt, replicated)
  build = lambda: jax.jit(lambda x: jnp.tanh(x @ x.T) + salt, out_shardings=replicated)  # noqa: E731
  with _jax_cache(0.0):
    store.compile('f', (), _spec((x,)), build)
    store.compile('f', (), _spec((x,)), build, library_fusions=False)
  assert len(_files(str(other), EXECUTABLE_SUFFIX)) == 2


@pytest.mark.parametrize('directory', [True, False])
def test_a_one_off_program_is_compiled_without_library_fusions(tmp_path, directory):
  """``library_fusions=False`` (stored or not, loaded or traced) compiles
  the dots without XLA:CPU's YNNPACK fusions and computes the same values;
  the default keeps them."""
  store = ProgramStore(str(tmp_path) if directory else None, {'run': 1}, log=pytest.fail)
  replicated = NamedSharding(_mesh(), P())
  x = jax.device_put(jnp.linspace(-1.0, 1.0, 32 * 64).reshape(32, 64), replicated)
  w = jax.device_put(jnp.linspace(0.5, -0.5, 64 * 64).reshape(64, 64), replicated)
  build = lambda: jax.jit(lambda x, w: jnp.tanh(x @ w) * 2.0,  # noqa: E731
                          out_shardings=replicated)
  with_fusions = store.compile('f', (), _spec((x, w)), build)
  without = store.compile('f', (), _spec((x, w)), build, library_fusions=False)
  assert 'ynn_fusion' in with_fusions.as_text()
  assert 'ynn_fusion' not in without.as_text()
  np.testing.assert_allclose(without(x, w), with_fusions(x, w), rtol=1e-5, atol=1e-5)
  if directory:  # both stored, under different keys, and loaded as they were compiled
    assert store.stats()['programs_traced'] == 2
    again = ProgramStore(str(tmp_path), {'run': 1}, log=pytest.fail)
    loaded = again.compile('f', (), _spec((x, w)), pytest.fail, library_fusions=False)
    assert again.stats()['programs_loaded'] == 1
    assert 'ynn_fusion' not in loaded.as_text()
    np.testing.assert_array_equal(loaded(x, w), without(x, w))


def test_trimming_removes_the_least_recently_used_files_of_the_store_only(tmp_path,
                                                                         monkeypatch):
  """A store opened past ``max_bytes`` removes its own files, least recently
  used first, down to that size (and a killed writer's temporary file): the
  oldest entry whole; the program and pointer of an entry whose executable a
  recently used entry shares (that stays and still serves it); an
  executable older than its program and pointer, which is then compiled
  again from the program, quietly (not damage), to the same bits. A user's
  files, older and larger than all, stay and count for nothing. Opened
  without ``max_bytes``, the store keeps 1 GiB (the bound docs/guide.md states)."""
  salts = {1: _salt(), 2: _salt(), 4: _salt()}
  salts[3] = salts[2]  # runs 2 and 3: one program, one executable
  want, entry = {}, {}
  with _jax_cache(0.0):  # as in a run: JAX's cache answers run 3 (and run 4 below)
    for run in (1, 2, 3, 4):
      store = ProgramStore(str(tmp_path), {'run': run}, log=pytest.fail)
      state, batch = _args()
      args = _spec((state, batch))
      want[run] = _bits(store.compile('step', ('k',), args, _build([], salts[run]),
                                      donate_argnums=(0,))(state, batch))
      program = store.path('step', ('k',), args, None, (0,))
      pointer = store.pointer_path(program)
      entry[run] = (program, pointer, store.executable_path(open(pointer).read().strip()))
  assert entry[2][2] == entry[3][2] and len(_files(tmp_path, EXECUTABLE_SUFFIX)) == 3
  user = [tmp_path / 'notes.txt', tmp_path / 'exec-mine.xla', tmp_path / 'draft.xla.tmp',
          tmp_path / f'{os.path.basename(entry[1][0])}.orig']
  for path in user:
    path.write_bytes(b'u' * 300_000)  # together past everything the store holds
  killed = f'{entry[1][2]}.{"1" * 32}.tmp'  # a writer killed hours ago
  with open(killed, 'wb') as f:
    f.write(b'x' * 1000)
  # Last used, oldest first (a file's time is all trimming reads).
  used = {**{str(p): 1000 for p in user}, killed: 1000,
          entry[1][0]: 2000, entry[1][1]: 2001, entry[1][2]: 2002,
          entry[2][0]: 3000, entry[2][1]: 3001, entry[4][2]: 4000,
          entry[3][0]: 5000, entry[3][1]: 5001, entry[3][2]: 5002,
          entry[4][0]: 6000, entry[4][1]: 6001}
  assert sorted(used) == sorted(str(p) for p in tmp_path.iterdir())
  for path, when in used.items():
    os.utime(path, (when, when))
  kept = [entry[3][0], entry[3][1], entry[3][2], entry[4][0], entry[4][1]]
  ProgramStore(str(tmp_path), {'run': 0}, log=pytest.fail,
               max_bytes=sum(os.path.getsize(p) for p in kept))
  assert sorted(str(p) for p in tmp_path.iterdir()) == sorted(kept + [str(p) for p in user])
  assert all(p.read_bytes() == b'u' * 300_000 for p in user)

  def load(run, build=pytest.fail):
    store = ProgramStore(str(tmp_path), {'run': run}, log=pytest.fail)
    state, batch = _args()
    with _jax_cache(0.0):
      got = store.compile('step', ('k',), _spec((state, batch)), build,
                          donate_argnums=(0,))(state, batch)
    assert _bits(got) == want[run]
    return store.stats()

  assert load(3)['executables_loaded'] == 1  # the shared executable stayed
  stats = load(4)  # its executable trimmed: compiled from its program, kept again
  assert stats['programs_loaded'] == 1 and stats['executables_loaded'] == 0
  assert stats['executables_unusable'] == stats['programs_unusable'] == 0
  assert stats['executables_not_kept'] == 0 and os.path.exists(entry[4][2])
  assert load(4)['executables_loaded'] == 1
  assert load(1, _build([], salts[1]))['programs_traced'] == 1  # gone whole: traced again
  limits = []
  monkeypatch.setattr(programs.diskcache, 'trim', lambda d, names, limit: limits.append(limit))
  ProgramStore(str(tmp_path), {'run': 0}, log=pytest.fail)
  assert limits == [1 << 30]


def test_off_without_a_directory(tmp_path):
  traced = []
  store = ProgramStore(None, {})
  state, batch = _args()
  store.compile('step', ('k',), _spec((state, batch)), _build(traced), donate_argnums=(0,))
  store.compile('step', ('k',), _spec((state, batch)), _build(traced), donate_argnums=(0,))
  assert len(traced) == 2 and not store.enabled and os.listdir(tmp_path) == []


def test_an_elastic_run_from_stored_programs_trains_bit_for_bit(tmp_path):
  """Freeze events with compression (K 4 -> 2), the cache on: the run that
  loads its steps, moves, prefixes and portable programs from the store has
  the per-epoch losses, state and plans of the run that traces them."""
  def run(directory):
    config = _config(alpha=0.5, initial_length=4, micro_batches=2, epochs=3)
    with config.unlocked():
      config.cache.policy = 'always'
      config.freeze.compile_ahead = True
    trainer, _ = _trainer(config)
    if directory is not None:
      trainer.programs = ProgramStore(str(directory), {'test': 'elastic'}, log=pytest.fail)
      trainer.prefix.programs = trainer.programs
    sample = next(iter(trainer.train_loader.epoch(0)))[1]
    losses, plans = [], []
    for epoch in range(3):
      trainer.prepare_next(sample)
      losses.append(trainer.train_epoch(epoch, _Bar())['train_loss'])
      plans.append(trainer.plan.describe())
      trainer.maybe_transition(epoch, sample)
    return losses, plans, _bits(trainer.portable_state()), trainer.programs.stats()

  want = run(None)
  traced = run(tmp_path)
  loaded = run(tmp_path)
  assert traced[3]['programs_traced'] > 0 and traced[3]['programs_loaded'] == 0
  assert loaded[3]['programs_loaded'] == traced[3]['programs_traced']
  assert loaded[3]['programs_traced'] == 0
  assert loaded[3]['executables_loaded'] == loaded[3]['programs_loaded']
  assert traced[3]['executables_not_kept'] == 0
  kinds = {n.split('-')[0] for n in os.listdir(tmp_path)}
  assert kinds == {'step', 'move', 'prefix', 'advance', 'portable', 'exec'}, kinds
  # Every file is the store's own by the names its trimming may remove.
  assert all(programs.ENTRY_NAME.fullmatch(n) for n in os.listdir(tmp_path)), os.listdir(tmp_path)
  assert 'K=4' in want[1][0] and 'K=4' not in want[1][-1], want[1]  # compressed
  for got in (traced, loaded):
    assert got[0] == want[0] and got[1] == want[1]
    assert got[2] == want[2]


@pytest.mark.parametrize('sync', [True, False])
def test_write_atomic_replaces_whole_or_leaves_the_old_file(tmp_path, sync):
  """The one writer every run file and cache entry goes through: a write
  that fails part-way leaves the old file and no temporary one."""
  from pipejax import diskcache
  path = str(tmp_path / 'state.json')
  diskcache.write_atomic(path, lambda f: f.write('old'), sync=sync)
  assert open(path).read() == 'old'

  def fails(f):
    f.write('half of the new')
    raise OSError(28, 'No space left on device')

  with pytest.raises(OSError, match='No space') as e:
    diskcache.write_atomic(path, fails, sync=sync)
  assert str(e.value) == f"[Errno 28] No space left on device: '{path}'"  # the file, named
  assert open(path).read() == 'old'
  with pytest.raises(FileNotFoundError, match=str(tmp_path / 'gone')):  # errno's subclass
    diskcache.write_atomic(str(tmp_path / 'gone' / 'state.json'), fails, sync=sync)
  assert sorted(os.listdir(tmp_path)) == ['state.json']
  diskcache.write_atomic(path, lambda f: f.write(b'\x00new'), binary=True, sync=sync)
  assert open(path, 'rb').read() == b'\x00new'
  assert sorted(os.listdir(tmp_path)) == ['state.json']


@pytest.mark.parametrize('sync', [True, False])
def test_write_atomic_syncs_the_data_before_the_rename_when_asked(tmp_path, monkeypatch, sync):
  """With ``sync`` the new file's data reach the disk before it replaces the
  old one (else a machine crash can leave an empty file under the name)."""
  from pipejax import diskcache
  calls = []
  real_fsync, real_replace = os.fsync, os.replace

  def fsync(fd):
    calls.append(('fsync', os.readlink(f'/proc/self/fd/{fd}')))
    real_fsync(fd)

  def replace(src, dst):
    calls.append(('replace', str(src)))
    real_replace(src, dst)

  monkeypatch.setattr(diskcache.os, 'fsync', fsync)
  monkeypatch.setattr(diskcache.os, 'replace', replace)
  diskcache.write_atomic(str(tmp_path / 'state.json'), lambda f: f.write('new'), sync=sync)
  tmp = calls[-1][1]
  assert calls == ([('fsync', tmp), ('replace', tmp)] if sync else [('replace', tmp)])
  assert tmp.endswith('.tmp') and open(tmp_path / 'state.json').read() == 'new'


def test_stale_temporary_files_of_the_named_files_only_are_removed(tmp_path):
  """A killed writer's ``*.tmp`` goes once it is stale; a live writer's, and
  in a user's folder (``of``) every file not of the run's, stay."""
  from pipejax import diskcache
  old = time.time() - diskcache.STALE_TMP_SECONDS - 10
  names = ['metrics.jsonl.ab12.tmp', 'summary.json.cd34.tmp', 'notes.txt.tmp', 'metrics.jsonl']
  for name in names + ['summary.json.young.tmp']:
    (tmp_path / name).write_text('x')
  for name in names:
    os.utime(tmp_path / name, (old, old))
  diskcache.remove_stale_tmp(str(tmp_path), of=('metrics.jsonl', 'summary.json'))
  assert sorted(os.listdir(tmp_path)) == ['metrics.jsonl', 'notes.txt.tmp',
                                          'summary.json.young.tmp']
  # A cache's entries, by a pattern of their names.
  diskcache.remove_stale_tmp(str(tmp_path), re.compile(r'notes\.\w+'))
  assert sorted(os.listdir(tmp_path)) == ['metrics.jsonl', 'notes.txt.tmp',
                                          'summary.json.young.tmp']
  (tmp_path / 'notes.txt.ef56.tmp').write_text('x')
  os.utime(tmp_path / 'notes.txt.ef56.tmp', (old, old))
  diskcache.remove_stale_tmp(str(tmp_path), re.compile(r'notes\.\w+'))
  assert sorted(os.listdir(tmp_path)) == ['metrics.jsonl', 'notes.txt.tmp',
                                          'summary.json.young.tmp']


def test_a_folder_lock_excludes_a_second_holder_and_survives_a_failed_name_write(tmp_path,
                                                                                monkeypatch):
  """The claim is the flock, not the holder's name in the file: a full disk
  while writing the name keeps the lock (and leaks no descriptor); a second
  claim is refused until the first is released."""
  from pipejax import diskcache
  path = str(tmp_path / '.lock')
  first = diskcache.FolderLock(path)
  assert f'pid {os.getpid()} on ' in open(path).read()
  with pytest.raises(diskcache.InUseError, match=f'pid {os.getpid()} on '):
    diskcache.FolderLock(path)
  first.release()

  def full(*args):
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(diskcache.os, 'pwrite', full)
  second = diskcache.FolderLock(path)
  with pytest.raises(diskcache.InUseError):
    diskcache.FolderLock(path)
  second.release()
  diskcache.FolderLock(path).release()  # nothing kept it: no descriptor left holding it
  monkeypatch.undo()
  # A file of the user's by that name is locked as it is, never rewritten.
  mine = tmp_path / 'notes.lock'
  mine.write_text('my notes\n')
  third = diskcache.FolderLock(str(mine))
  with pytest.raises(diskcache.InUseError) as refused:
    diskcache.FolderLock(str(mine))
  assert str(refused.value) == 'a process that is starting'  # not the file's lines
  third.release()
  assert mine.read_text() == 'my notes\n'
