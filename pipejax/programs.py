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

An entry that cannot be read back (truncated, corrupt, written by another
build) is reported in one line, removed and traced afresh, never used.
With several processes the store is off.

Beside a program the store keeps its compiled XLA executable
(``jax.experimental.serialize_executable``), keyed also by the backend's
version and the host's CPU: a later run loads that directly, skipping the
lowering and the cache lookup (what is left is XLA's deserialisation). Only
an executable that this process compiled itself is kept: on the CPU, one
that was read from JAX's cache loses its kernels when serialised again
("Function ... not found" at its first call), so a compile that JAX's cache
answered (seen through ``jax.monitoring``'s cache-hit event in the compiling
thread) keeps only the program. Each entry's module is named after the
entry, so that JAX's cache, whose key begins with that name, does not
answer a new entry's first compile. An executable that cannot be loaded is
reported, removed, and the program is compiled from its stored form instead.

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
import threading
import time
import uuid
from typing import Any, Callable

import jax
import numpy as np
from jax import export as jax_export
from jax.experimental import serialize_executable
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipejax import diskcache

DEFAULT_MAX_BYTES = 1 << 30
# XLA:CPU's option for the library fusions (an empty list turns them all off).
WITHOUT_LIBRARY_FUSIONS = {'xla_cpu_experimental_ynn_fusion_type': ''}
_LIBRARIES = ('jax', 'jaxlib', 'flax', 'optax', 'transformers', 'numpy')
PROGRAM_SUFFIX = '.jaxexport'
EXECUTABLE_SUFFIX = '.xla'
_CACHE_HIT_EVENT = '/jax/compilation_cache/cache_hits'


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
    self.executables_loaded = self.executables_unusable = 0
    self._identity = hashlib.sha256(json.dumps(
        {'code': code_fingerprint(), 'versions': diskcache.versions(_LIBRARIES),
         'xla_flags': os.environ.get('XLA_FLAGS', ''), 'platform': backend.platform,
         'device_kind': backend.device_kind, 'devices': jax.device_count(),
         'caller': identity}, sort_keys=True, default=str).encode()).hexdigest()
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

  def path(self, name: str, key: Any, args: tuple, options: dict | None = None) -> str:
    digest = hashlib.sha256('\0'.join(
        (self._identity, name, repr(key), arguments_signature(args),
         json.dumps(options or {}, sort_keys=True))).encode()).hexdigest()
    return os.path.join(self.directory, f'{name}-{digest[:40]}{PROGRAM_SUFFIX}')

  def executable_path(self, path: str) -> str:
    """Where the compiled executable of the program at ``path`` goes (the
    same key, and this backend's version and host CPU)."""
    return f'{path[:-len(PROGRAM_SUFFIX)]}.{self._machine}{EXECUTABLE_SUFFIX}'

  def compile(self, name: str, key: Any, args: tuple, build: Callable[[], Any],
              donate_argnums: tuple[int, ...] = (), library_fusions: bool = True):
    """The compiled ``build()`` (a ``jax.jit``-wrapped function, donating
    ``donate_argnums``) for ``args``: from the stored program when there,
    else traced and compiled (and stored, with the store on). ``build`` runs
    only then. ``library_fusions=False``: a program that runs a few times,
    compiled without XLA:CPU's library fusions (see the module's doc; no
    effect on other platforms)."""
    options = compiler_options(library_fusions)
    path = self.path(name, key, args, options) if self.enabled else None
    if path is not None and os.path.exists(path):
      t0 = time.perf_counter()
      compiled = self._load_executable(path)
      if compiled is None:
        try:
          compiled, fresh = self._load(path, args, donate_argnums, options)
        except Exception as e:  # noqa: BLE001 - any unusable entry is traced afresh
          self._count('corrupt')
          self.log(f'program store: {os.path.basename(path)} is unusable '
                   f'({type(e).__name__}: {str(e)[:160]}); removed and traced afresh')
          diskcache.remove(path)
          compiled = None
        else:
          if fresh:
            self._write_executable(path, compiled)
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
      # Compiled from the stored form even now, so that JAX's compilation
      # cache holds the very program later runs compile.
      compiled, fresh = self._from_entry(entry, args, donate_argnums, options, path)
      self._write(path, entry)
      if fresh:
        self._write_executable(path, compiled)
    self._count('misses', 'compile_seconds', time.perf_counter() - t0)
    return compiled

  def _load_executable(self, path: str):
    """The stored executable of the program at ``path``; None when there is
    none or it cannot be loaded (then reported and removed)."""
    executable = self.executable_path(path)
    if not os.path.exists(executable):
      return None
    try:
      with open(executable, 'rb') as f:
        payload, in_tree, out_tree = pickle.load(f)
      compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as e:  # noqa: BLE001 - any unusable executable is compiled afresh
      self._count('executables_unusable')
      self.log(f'program store: {os.path.basename(executable)} is unusable '
               f'({type(e).__name__}: {str(e)[:160]}); removed, compiled from its program')
      diskcache.remove(executable)
      return None
    self._count('executables_loaded')
    diskcache.touch(executable)
    return compiled

  def _write_executable(self, path: str, compiled) -> None:
    """Keeps ``compiled`` (compiled by this process, not read from JAX's
    cache) beside the program at ``path``; quietly nothing when XLA cannot
    serialise it (the program alone is kept)."""
    try:
      payload = pickle.dumps(serialize_executable.serialize(compiled))
    except Exception:  # noqa: BLE001 - e.g. a program with constants: not serialisable
      return
    self._write(self.executable_path(path), payload,
                'it is compiled from its program next time')

  def _count(self, counter: str, seconds: str | None = None, dt: float = 0.0) -> None:
    with self._lock:
      setattr(self, counter, getattr(self, counter) + 1)
      if seconds:
        setattr(self, seconds, getattr(self, seconds) + dt)

  @classmethod
  def _load(cls, path: str, args: tuple, donate_argnums: tuple[int, ...],
            options: dict | None = None) -> tuple[Any, bool]:
    with open(path, 'rb') as f:
      entry = f.read()
    return cls._from_entry(entry, args, donate_argnums, options, path)

  @staticmethod
  def _from_entry(entry: bytes, args: tuple, donate_argnums: tuple[int, ...],
                  options: dict | None, path: str) -> tuple[Any, bool]:
    """Compiles a stored program (the entry at ``path``) for ``args``: the
    exported module takes and gives flat lists; the trees around it are the
    arguments' and the stored output tree. Also says whether XLA compiled it
    here (see :func:`compile_fresh`).

    The module is named after the entry: JAX's cache key begins with the
    module's name, so the same program under a new entry (the code or the
    configuration changed, the trace did not) is compiled afresh once, and
    its executable kept, instead of being read from JAX's cache for ever."""
    blob, out_tree, out_shardings = pickle.loads(entry)
    exported = jax_export.deserialize(bytearray(blob))

    def call(*call_args):
      return out_tree.unflatten(exported.call(*jax.tree.leaves(call_args)))

    call.__name__ = call.__qualname__ = (
        'pipejax_' + os.path.basename(path)[:-len(PROGRAM_SUFFIX)].replace('-', '_'))

    shardings = out_tree.unflatten([_rebuild(d) for d in out_shardings])
    return compile_fresh(jax.jit(call, donate_argnums=donate_argnums,
                                 out_shardings=shardings).lower(*args), options)

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
      return pickle.dumps((bytes(exported.serialize()), out_tree, out_shardings))
    except Exception as e:  # noqa: BLE001 - not storable: traced again next time
      self.log(f'program store: cannot keep {os.path.basename(path)} '
               f'({type(e).__name__}: {str(e)[:160]}); it is traced again next time')
      return None

  def _write(self, path: str, entry: bytes,
             consequence: str = 'it is traced again next time') -> None:
    tmp = f'{path}.{uuid.uuid4().hex}.tmp'
    try:
      with open(tmp, 'wb') as f:
        f.write(entry)
      os.replace(tmp, path)
    except OSError as e:
      diskcache.remove(tmp)
      self.log(f'program store: cannot write {path} ({e}); {consequence}')

  def _trim(self, max_bytes: int) -> None:
    diskcache.trim(self.directory, (PROGRAM_SUFFIX, EXECUTABLE_SUFFIX), max_bytes)

  def stats(self) -> dict:
    return {'programs_loaded': self.hits, 'programs_traced': self.misses,
            'programs_unusable': self.corrupt, 'program_load_seconds': self.load_seconds,
            'program_trace_compile_seconds': self.compile_seconds,
            'executables_loaded': self.executables_loaded,
            'executables_unusable': self.executables_unusable}


_compiles = threading.local()  # per thread: the cache hits JAX reported
_listening = False
_listening_lock = threading.Lock()


def _count_cache_hit(event: str, **kwargs) -> None:
  del kwargs
  if event == _CACHE_HIT_EVENT:
    _compiles.cache_hits = getattr(_compiles, 'cache_hits', 0) + 1


def compile_fresh(lowered, options: dict | None = None) -> tuple[Any, bool]:
  """``lowered.compile(compiler_options=options)``, and whether XLA compiled
  it in this call: False when JAX's persistent cache answered (JAX reports
  the hit, synchronously, in the compiling thread)."""
  global _listening
  with _listening_lock:
    if not _listening:
      jax.monitoring.register_event_listener(_count_cache_hit)
      _listening = True
  before = getattr(_compiles, 'cache_hits', 0)
  compiled = lowered.compile(compiler_options=options)
  return compiled, getattr(_compiles, 'cache_hits', 0) == before


@functools.lru_cache(maxsize=None)
def machine_fingerprint() -> str:
  """A hash of what a compiled executable depends on beyond the program:
  the backend's platform and version and the host CPU's model and features
  (XLA:CPU compiles for the CPU it runs on)."""
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
  cpu.setdefault('processor', platform.processor() or platform.machine())
  return hashlib.sha256(json.dumps(
      {'platform': client.platform, 'version': client.platform_version, 'cpu': cpu},
      sort_keys=True).encode()).hexdigest()


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
