"""Traced programs kept on disk, so a later run compiles them without tracing.

JAX's persistent compilation cache skips XLA's compiler but not the tracing
and lowering that produce the program it is keyed by; for an elastic run's
transition programs (the new step, the move of the state, the frozen
prefix, the cache's advance) that Python work is most of the cost (about
1 s per program on a CPU), and it runs on the training's cores while the
next plan is compiled ahead. :class:`ProgramStore` keeps each program
as a ``jax.export`` artifact (its StableHLO, shardings and trees), and the
executable XLA compiled from it, keyed by what its trace depends on, so a
later run of the same configuration loads the executable instead of tracing
Python (the default run's 27 programs: 1.5 s of CPU from their executables,
2.2 s lowering the stored modules and reading JAX's persistent cache). A
program is keyed by

* the source of ``pipejax`` and ``models`` (a hash of every ``.py`` file),
  the versions of JAX and the libraries that shape a program, ``XLA_FLAGS``
  and the backend;
* the run's identity given by the caller (the trainer passes its whole
  configuration, the model's configuration and the steps per epoch, which
  fix the learning-rate schedule baked into a step);
* the program's name and key (plan, partitions, depths);
* every argument's tree structure, shape, dtype and sharding (mesh axes,
  device ids, partition spec).

Every program and executable the store writes is sealed: a header and a CRC-32 of the rest,
checked before anything in it is read, so that a damaged file is never
deserialised (a flipped bit in an exported module can crash XLA or, worse,
still verify as another program). An entry that cannot be read back
(truncated, damaged, written by another build) is reported in one line,
removed and traced afresh, never used; a program just traced whose stored
form does not load back is compiled as traced and not kept. Memory running
out while an entry loads (the host's, or a device's) is raised as it is:
the entry stays.
With several processes the store is off.

Beside a program the store keeps its compiled XLA executable
(``jax.experimental.serialize_executable``): an ``exec-*.xla`` file named by
what XLA compiled (the lowered module without locations, the options, the
arguments' device ids, the backend's version and the host's CPU), and a
``*.ref`` file per entry and machine that names it. A later run loads the
executable directly, skipping the lowering and the cache lookup (what is
left is XLA's deserialisation). Only an executable that this process
compiled itself is kept: on the CPU, one that was read from JAX's cache
loses its kernels when serialised again ("Function ... not found" at its
first call). A compile that JAX's cache answered (seen through
``jax.monitoring``'s cache events in the compiling thread) points to the
executable another entry kept for the same lowered program (a changed
configuration whose programs did not change); when there is none (it was
trimmed or lost), the program is compiled once more under a module name used
once (JAX's cache key begins with it), so that XLA compiles it. Where JAX's
events are not as expected only the program is kept (counted as
``executables_not_kept``). An executable that cannot be loaded (damaged, or
not for this machine) is reported, removed, and the program is compiled from
its stored form instead.

On the CPU, XLA hands dots and elementwise chains to the YNNPACK library
("library fusions"), and each such fusion sets itself up at the first
execution of its program: 50-250 ms per program for the default model
(measured: the evaluation's first call 190-275 ms with them, 22-32 ms
without; a frozen prefix's 54-190 ms against 15-28 ms), while a later call
gains at most a millisecond from them. A program compiled with
``library_fusions=False`` is compiled without them: the trainer's moves,
portable-state programs, evaluation and cache advances, which run a few
times, and the frozen prefix (a few times with the cache; every step
without it, where it costs up to ~1 ms a step more). The train step keeps
XLA's default.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import platform
import re
import threading
import time
import uuid
import zlib
from typing import Any, Callable

import jax
import numpy as np
from jax import export as jax_export
from jax.experimental import serialize_executable
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipejax import diskcache, runtime

DEFAULT_MAX_BYTES = 1 << 30
# XLA:CPU's option for the library fusions (an empty list turns them all off).
WITHOUT_LIBRARY_FUSIONS = {'xla_cpu_experimental_ynn_fusion_type': ''}
_LIBRARIES = ('jax', 'jaxlib', 'flax', 'optax', 'transformers', 'numpy')
PROGRAM_SUFFIX = '.jaxexport'
EXECUTABLE_SUFFIX = '.xla'  # an executable, named by what XLA compiled
POINTER_SUFFIX = '.ref'  # an entry's executable on this machine: its name
#: The store's own file names (:meth:`ProgramStore.path`, ``pointer_path``,
#: ``executable_path``): all that trimming it may remove.
ENTRY_NAME = re.compile(r'\w+-[0-9a-f]{40}(\.jaxexport|\.[0-9a-f]{12}\.ref)'
                        r'|exec-[0-9a-f]{40}\.xla'
                        r'|\w+-[0-9a-f]{40}\.[0-9a-f]{12}\.xla')  # an older store's executables
# The layout of an executable's file, part of its name: a file written by an
# earlier layout is never pointed to (it would be found unusable at every load).
EXECUTABLE_FORMAT = 3
# The header of every sealed file (program or executable), then a CRC-32 of the rest.
_SEAL = b'pipejax-store-1\n'
# JAX's events around a compile that may read its persistent cache: a request
# to it, and a hit (both recorded in the compiling thread).
_CACHE_REQUEST_EVENT = '/jax/compilation_cache/compile_requests_use_cache'
_CACHE_HIT_EVENT = '/jax/compilation_cache/cache_hits'


def seal(body: bytes) -> bytes:
  """``body`` with the store's header and its CRC-32 in front."""
  return _SEAL + zlib.crc32(body).to_bytes(4, 'little') + body


def unseal(data: bytes) -> bytes:
  """The body of a sealed file, checked first.

  Raises:
    ValueError: not a sealed file, or damaged (a checksum mismatch).
  """
  head = len(_SEAL) + 4
  if len(data) < head or not data.startswith(_SEAL):
    raise ValueError('not a program-store file of this version')
  body = data[head:]
  if zlib.crc32(body) != int.from_bytes(data[len(_SEAL):head], 'little'):
    raise ValueError('damaged: checksum mismatch')
  return body


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
  """A hash of the source of the packages whose functions are traced."""
  import models  # noqa: PLC0415 - the sibling package of the model code
  import pipejax  # noqa: PLC0415
  digest = hashlib.sha256()
  for package in (pipejax, models):
    root = os.path.dirname(os.path.abspath(package.__file__))
    for name in sorted(os.listdir(root)):
      if name.endswith('.py'):
        digest.update(name.encode())
        with open(os.path.join(root, name), 'rb') as f:
          digest.update(f.read())
  return digest.hexdigest()


def _sharding_signature(sharding) -> Any:
  return _describe(sharding) if isinstance(sharding, NamedSharding) else repr(sharding)


def _tree_text(tree) -> str:
  """``tree`` (a PyTreeDef) as text that is the same in every process: its
  ``str`` without the memory addresses of a default ``repr``."""
  return re.sub(r' at 0x[0-9a-fA-F]+', '', str(tree))


def arguments_signature(args: tuple) -> str:
  """Tree structure, shapes, dtypes and shardings of ``args`` (arrays or
  ``jax.ShapeDtypeStruct``\\ s) as text."""
  leaves, treedef = jax.tree.flatten(args)
  return json.dumps([str(treedef)] + [
      [list(x.shape), str(x.dtype), bool(getattr(x, 'weak_type', False)),
       _sharding_signature(getattr(x, 'sharding', None))] for x in leaves], default=str)


class ProgramStore:
  """Exported programs under ``directory``, keyed as the module says.

  Args:
    directory: where entries go; None turns the store off (every program
      is traced, lowered and compiled as usual).
    identity: what the caller's programs depend on besides the code and the
      arguments (JSON-serialisable; ``str`` is applied to anything else).
    log: one-line messages (a corrupt entry).
    max_bytes: the directory is trimmed to this size (least recently used
      entries first) when the store opens.
  """

  def __init__(self, directory: str | None, identity: dict,
               log: Callable[[str], None] = print, max_bytes: int = DEFAULT_MAX_BYTES):
    if directory and jax.process_count() > 1:
      directory = None
    self.directory = os.path.expanduser(directory) if directory else None
    self.log = log
    self.hits = self.misses = self.corrupt = 0
    self.load_seconds = self.compile_seconds = 0.0
    self._lock = threading.Lock()  # the counters: the main and the compile-ahead thread
    backend = jax.devices()[0]
    self.executables_loaded = self.executables_unusable = self.executables_not_kept = 0
    self._write_failed = False  # said once: a read-only store fails every write alike
    self._identity = hashlib.sha256(json.dumps(
        {'code': code_fingerprint(), 'versions': diskcache.versions(_LIBRARIES),
         'xla_flags': os.environ.get('XLA_FLAGS', ''), 'platform': backend.platform,
         'device_kind': backend.device_kind, 'devices': jax.device_count(),
         'jax_config': traced_settings(), 'caller': identity},
        sort_keys=True, default=str).encode()).hexdigest()
    self._machine = machine_fingerprint()[:12]
    if self.directory:
      try:
        os.makedirs(self.directory, exist_ok=True)
        self._trim(max_bytes)
      except OSError as e:
        log(f'program store {self.directory} is unusable ({e}); tracing every program')
        self.directory = None

  @property
  def enabled(self) -> bool:
    return self.directory is not None

  def path(self, name: str, key: Any, args: tuple, options: dict | None = None,
           donate_argnums: tuple[int, ...] = ()) -> str:
    digest = hashlib.sha256('\0'.join(
        (self._identity, name, repr(key), arguments_signature(args),
         json.dumps(options or {}, sort_keys=True),
         repr(tuple(donate_argnums)))).encode()).hexdigest()
    return os.path.join(self.directory, f'{name}-{digest[:40]}{PROGRAM_SUFFIX}')

  def pointer_path(self, path: str) -> str:
    """Where the name of the executable of the program at ``path`` goes (the
    same key, and this backend's version and host CPU)."""
    return f'{path[:-len(PROGRAM_SUFFIX)]}.{self._machine}{POINTER_SUFFIX}'

  def executable_path(self, content: str) -> str:
    """Where the executable of the lowered program ``content`` (see
    :meth:`_from_entry`) goes."""
    return os.path.join(self.directory, f'exec-{content[:40]}{EXECUTABLE_SUFFIX}')

  def compile(self, name: str, key: Any, args: tuple, build: Callable[[], Any],
              donate_argnums: tuple[int, ...] = (), library_fusions: bool = True):
    """The compiled ``build()`` (a ``jax.jit``-wrapped function, donating
    ``donate_argnums``) for ``args``: from the stored program when there,
    else traced and compiled (and stored, with the store on). ``build`` runs
    only then. ``library_fusions=False``: a program that runs a few times,
    compiled without XLA:CPU's library fusions (see the module's doc; no
    effect on other platforms)."""
    options = compiler_options(library_fusions)
    path = self.path(name, key, args, options, donate_argnums) if self.enabled else None
    if path is not None and os.path.exists(path):
      t0 = time.perf_counter()
      compiled = self._load_executable(path)
      if compiled is None:
        try:
          compiled, fresh, content = self._load(path, args, donate_argnums, options)
        except Exception as e:  # noqa: BLE001 - any unusable entry is traced afresh
          self._discard(path, e, 'corrupt', 'removed and traced afresh')
          compiled = None
        else:
          self._keep_executable(path, compiled, fresh, content)
      if compiled is not None:
        self._count('hits', 'load_seconds', time.perf_counter() - t0)
        diskcache.touch(path)  # recently used: kept by _trim
        return compiled
    t0 = time.perf_counter()
    jitted = build()
    entry = None if path is None else self._export(path, jitted, args)
    if entry is None:  # store off, or not storable: compiled as traced
      compiled = jitted.lower(*args).compile(compiler_options=options)
    else:
      # Compiled from the stored form even now: the executable kept is the one
      # a later run without it would compile.
      try:
        compiled, fresh, content = self._from_entry(entry, args, donate_argnums, options, path)
      except Exception as e:  # noqa: BLE001 - the traced program is still at hand
        if runtime.out_of_memory(e):
          raise
        self.log(f'program store: {os.path.basename(path)} does not load back '
                 f'({type(e).__name__}: {str(e)[:160]}); compiled as traced, not kept')
        compiled = jitted.lower(*args).compile(compiler_options=options)
      else:
        if self._write(path, entry):
          self._keep_executable(path, compiled, fresh, content)
    self._count('misses', 'compile_seconds', time.perf_counter() - t0)
    return compiled

  def _discard(self, path: str, error: Exception, counter: str, then: str) -> None:
    """Counts (``counter``), reports and removes the stored file ``path``
    that ``error`` made unusable; ``then`` says what happens instead. An
    out-of-memory ``error`` is raised again: the memory, not the file, failed,
    and the file stays."""
    if runtime.out_of_memory(error):
      raise error
    self._count(counter)
    self.log(f'program store: {os.path.basename(path)} is unusable '
             f'({type(error).__name__}: {str(error)[:160]}); {then}')
    diskcache.remove(path)

  def _load_executable(self, path: str):
    """The stored executable of the program at ``path``; None when there is
    none (quietly) or it cannot be loaded (then reported and removed)."""
    pointer = self.pointer_path(path)
    try:
      with open(pointer, encoding='ascii') as f:
        name = f.read().strip()
    except OSError:  # none kept (or trimmed): compiled from the program
      return None
    except ValueError:  # not text: damaged, as a name that is not hex below
      name = ''
    if not re.fullmatch(r'[0-9a-f]{40,64}', name):
      self._count('executables_unusable')
      self.log(f'program store: {os.path.basename(pointer)} does not name an executable '
               f'(damaged); removed, compiled from its program')
      diskcache.remove(pointer)
      return None
    executable = self.executable_path(name)
    try:
      with open(executable, 'rb') as f:
        data = f.read()
    except OSError:  # none kept (or trimmed): compiled from the program
      return None
    try:
      payload, in_tree, out_tree, device_ids = pickle.loads(unseal(data))
      by_id = {d.id: d for d in jax.devices()}
      # The executable's own devices, in its order: XLA aborts the process
      # (not an exception) when they do not match its shardings.
      compiled = serialize_executable.deserialize_and_load(
          payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
    except Exception as e:  # noqa: BLE001 - any unusable executable is compiled afresh
      self._discard(executable, e, 'executables_unusable', 'removed, compiled from its program')
      return None
    self._count('executables_loaded')
    diskcache.touch(pointer)
    diskcache.touch(executable)
    return compiled

  def _keep_executable(self, path: str, compiled, fresh: bool, content: str) -> None:
    """Keeps the executable of the program at ``path`` for later runs: its
    name in the entry's pointer and, when XLA compiled it in this process
    (``fresh``), the executable itself. A compile that JAX's cache answered
    points to the executable of the same lowered program when another entry
    kept one; otherwise (or when XLA cannot serialise it) only the program
    is kept, counted in ``executables_not_kept``."""
    executable = self.executable_path(content)
    consequence = 'it is compiled from its program next time'
    if fresh:
      try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
      except Exception:  # noqa: BLE001 - e.g. a program with constants: not serialisable
        self._count('executables_not_kept')
        return
      data = seal(pickle.dumps((payload, in_tree, out_tree, device_ids)))
      if not self._write(executable, data, consequence):
        return
    elif not os.path.exists(executable):  # read from JAX's cache, and no entry kept it
      self._count('executables_not_kept')
      return
    self._write(self.pointer_path(path), content.encode(), consequence)

  def _count(self, counter: str, seconds: str | None = None, dt: float = 0.0) -> None:
    with self._lock:
      setattr(self, counter, getattr(self, counter) + 1)
      if seconds:
        setattr(self, seconds, getattr(self, seconds) + dt)

  def _load(self, path: str, args: tuple, donate_argnums: tuple[int, ...],
            options: dict | None = None) -> tuple[Any, bool, str]:
    with open(path, 'rb') as f:
      entry = f.read()
    return self._from_entry(entry, args, donate_argnums, options, path)

  def _from_entry(self, entry: bytes, args: tuple, donate_argnums: tuple[int, ...],
                  options: dict | None, path: str) -> tuple[Any, bool, str]:
    """Compiles a stored program (the entry at ``path``) for ``args``: the
    exported module takes and gives flat lists; the trees around it are the
    arguments' and the stored output tree. Also says whether XLA compiled it
    here (see :func:`compile_fresh`), and names what it compiled: a hash of
    the lowered module (without locations), the options, the arguments'
    shardings (device ids) and this machine. Entries whose traces differ
    only in where they ran (locations) share it: JAX's cache answers one
    after the other compiled it, and the first one's executable serves both."""
    blob, out_tree, out_shardings = pickle.loads(unseal(entry))
    exported = jax_export.deserialize(bytearray(blob))

    def call(*call_args):
      return out_tree.unflatten(exported.call(*jax.tree.leaves(call_args)))

    shardings = out_tree.unflatten([_rebuild(d) for d in out_shardings])

    def lower(name: str):
      call.__name__ = call.__qualname__ = name
      return jax.jit(call, donate_argnums=donate_argnums, out_shardings=shardings).lower(*args)

    lowered = lower(f'pipejax_{os.path.basename(path).split("-")[0]}')
    compiled, fresh = compile_fresh(lowered, options)
    # The output's tree too: the module's text names a dict's keys, not a
    # tuple from a list, nor one NamedTuple class from another.
    content = hashlib.sha256('\0'.join(
        (lowered.as_text(), json.dumps(options or {}, sort_keys=True),
         arguments_signature(args), repr(out_shardings), _tree_text(out_tree), self._machine,
         str(EXECUTABLE_FORMAT))).encode()).hexdigest()
    if not fresh and not os.path.exists(self.executable_path(content)):
      # JAX's cache answered, and no entry kept the executable (it was lost):
      # compiled once more under a name used once, which JAX's cache key
      # begins with, so that XLA compiles it and it can be kept.
      compiled, fresh = compile_fresh(lower(f'pipejax_once_{uuid.uuid4().hex[:12]}'), options)
    return compiled, fresh, content

  def _export(self, path: str, jitted, args: tuple) -> bytes | None:
    """The store's entry for ``jitted`` at ``args`` (None, with one line, if
    it cannot be exported)."""
    in_tree = jax.tree.structure(args)

    def flat(*leaves):  # jax.export serializes only plain containers
      return jax.tree.leaves(jitted(*in_tree.unflatten(leaves)))

    try:
      out_info = jitted.trace(*args).lower().out_info
      out_tree = jax.tree.structure(out_info)
      out_shardings = [_describe(o.sharding) for o in jax.tree.leaves(out_info)]
      exported = jax_export.export(jax.jit(flat))(*jax.tree.leaves(args))
      return seal(pickle.dumps((bytes(exported.serialize()), out_tree, out_shardings)))
    except Exception as e:  # noqa: BLE001 - not storable: traced again next time
      self.log(f'program store: cannot keep {os.path.basename(path)} '
               f'({type(e).__name__}: {str(e)[:160]}); it is traced again next time')
      return None

  def _write(self, path: str, entry: bytes,
             consequence: str = 'it is traced again next time') -> bool:
    """Writes ``entry`` to ``path`` whole or not at all; False (with one line)
    when it cannot."""
    try:
      diskcache.write_atomic(path, lambda f: f.write(entry), binary=True, sync=False)
    except OSError as e:
      if not self._write_failed:
        self._write_failed = True
        self.log(f'program store: cannot write {path} ({e}); {consequence} (said once: '
                 f'the other programs of this run are not kept either)')
      return False
    return True

  def _trim(self, max_bytes: int) -> None:
    diskcache.trim(self.directory, ENTRY_NAME, max_bytes)

  def stats(self) -> dict:
    return {'programs_loaded': self.hits, 'programs_traced': self.misses,
            'programs_unusable': self.corrupt, 'program_load_seconds': self.load_seconds,
            'program_trace_compile_seconds': self.compile_seconds,
            'executables_loaded': self.executables_loaded,
            'executables_unusable': self.executables_unusable,
            'executables_not_kept': self.executables_not_kept}


_compiles = threading.local()  # per thread: JAX's cache requests and hits, counted
_listening = False
_listening_lock = threading.Lock()


def _count_cache_events(event: str, **kwargs) -> None:
  del kwargs
  if event in (_CACHE_REQUEST_EVENT, _CACHE_HIT_EVENT):
    setattr(_compiles, event, getattr(_compiles, event, 0) + 1)


def compile_fresh(lowered, options: dict | None = None) -> tuple[Any, bool]:
  """``lowered.compile(compiler_options=options)``, and whether XLA compiled
  it in this call. JAX records its cache events synchronously in the
  compiling thread: fresh means JAX's persistent cache is off, or it was
  asked and did not answer. Anything else (a hit, or no request seen: JAX's
  events changed) counts as not fresh."""
  global _listening
  with _listening_lock:
    if not _listening:
      jax.monitoring.register_event_listener(_count_cache_events)
      _listening = True
  before = {e: getattr(_compiles, e, 0) for e in (_CACHE_REQUEST_EVENT, _CACHE_HIT_EVENT)}
  compiled = lowered.compile(compiler_options=options)
  seen = {e: getattr(_compiles, e, 0) - n for e, n in before.items()}
  cache_off = not (jax.config.jax_compilation_cache_dir and
                   jax.config.jax_enable_compilation_cache)
  return compiled, seen[_CACHE_HIT_EVENT] == 0 and (seen[_CACHE_REQUEST_EVENT] > 0 or cache_off)


#: JAX settings that tracing bakes into a program (precision, the PRNG's
#: bits, dtypes, the partitioner): part of a stored program's key.
TRACED_SETTINGS = ('jax_default_matmul_precision', 'jax_enable_x64', 'jax_default_prng_impl',
                   'jax_threefry_partitionable', 'jax_use_shardy_partitioner')


def traced_settings() -> dict[str, str]:
  return {name: str(getattr(jax.config, name, None)) for name in TRACED_SETTINGS}


@functools.lru_cache(maxsize=None)
def machine_fingerprint() -> str:
  """A hash of what a compiled executable depends on beyond the program:
  the backend's platform and version, the device kind, jax and jaxlib's
  versions, ``XLA_FLAGS``, and the host CPU's model and features (XLA:CPU
  compiles for the CPU it runs on). Executables of other versions, flags or
  devices (sharing a store's folder) are kept apart."""
  client = jax.devices()[0].client
  cpu = {}
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        name, _, value = line.partition(':')
        name = name.strip()
        if name in ('model name', 'flags', 'Features', 'CPU part') and name not in cpu:
          cpu[name] = value.strip()
  except OSError:
    pass
  cpu['machine'] = [platform.system(), platform.machine(), platform.processor()]
  return hashlib.sha256(json.dumps(
      {'platform': client.platform, 'version': client.platform_version, 'cpu': cpu,
       'device_kind': jax.devices()[0].device_kind,
       'versions': diskcache.versions(('jax', 'jaxlib')),
       'xla_flags': os.environ.get('XLA_FLAGS', '')}, sort_keys=True).encode()).hexdigest()


def compiler_options(library_fusions: bool = True) -> dict | None:
  """XLA options for a program (None: XLA's defaults); ``library_fusions=False``
  turns XLA:CPU's library fusions off on the CPU backend."""
  if library_fusions or jax.default_backend() != 'cpu':
    return None
  return dict(WITHOUT_LIBRARY_FUSIONS)


def _describe(sharding) -> tuple:
  """A NamedSharding as plain data (its mesh by device ids)."""
  if not isinstance(sharding, NamedSharding):
    raise TypeError(f'output sharding {sharding!r} is not a NamedSharding')
  mesh = sharding.mesh
  return (tuple(mesh.axis_names), tuple(mesh.devices.shape),
          tuple(int(d.id) for d in mesh.devices.flat), tuple(sharding.spec),
          sharding.memory_kind)


def _rebuild(description: tuple) -> NamedSharding:
  axis_names, shape, ids, spec, memory_kind = description
  by_id = {d.id: d for d in jax.devices()}
  devices = np.array([by_id[i] for i in ids], dtype=object).reshape(shape)
  return NamedSharding(Mesh(devices, axis_names), P(*spec), memory_kind=memory_kind)
