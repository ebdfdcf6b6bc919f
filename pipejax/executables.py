"""Compiled train steps kept on disk across runs, so a run skips tracing and
lowering the programs an earlier run of the same configuration compiled.

JAX's persistent compilation cache (``runtime.setup``) saves the XLA
compilation, but a run still traces and lowers every program to find it
there: seconds per pipeline plan, paid at every transition (or in a
background thread that competes with training for the GIL). This store keeps
the *loaded executable* (``jax.experimental.serialize_executable``) under a
key of everything that decides the program:

* the plan (partition, R, M, schedule) and the shapes, dtypes and shardings
  of the state and the feed;
* the run's config, except keys that cannot change a program (seed,
  checkpointing, the M-profile path, the cache directory);
* the model's HF config, the device platform, count and order, JAX and
  jaxlib versions, and a hash of pipejax's and the models' source files.

An entry that cannot be read (corrupt, other JAX) is recompiled and
replaced, with one log line. Entries are written atomically.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
from typing import Any, Callable

import jax
from jax.experimental import serialize_executable

_NOT_PROGRAM = ('seed', 'checkpoint', 'pipeline.profile_path', 'cache.directory',
                'cache.on_mismatch')


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
  """sha256 of the sources that build the programs (pipejax/, models/)."""
  h = hashlib.sha256()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for package in ('pipejax', 'models'):
    folder = os.path.join(root, package)
    for name in sorted(os.listdir(folder)):
      if name.endswith('.py'):
        with open(os.path.join(folder, name), 'rb') as f:
          h.update(name.encode() + f.read())
  return h.hexdigest()


def _describe(tree) -> list[str]:
  """Shapes, dtypes and shardings of a tree of arrays or ShapeDtypeStructs."""
  def one(x):
    sharding = getattr(x, 'sharding', None)
    where = (f'{sharding.spec}@{[d.id for d in sharding.mesh.devices.flat]}'
             if hasattr(sharding, 'spec') else repr(sharding))
    return f'{tuple(x.shape)}:{x.dtype}:{where}'
  return [f'{jax.tree_util.keystr(k)}={one(v)}'
          for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def program_config(config) -> dict:
  """``config`` as a dict without the keys that cannot change a program."""
  out = config.to_dict()
  for key in _NOT_PROGRAM:
    node, *path = key.split('.')
    if not path:
      out.pop(node, None)
    elif node in out:
      out[node] = {k: v for k, v in out[node].items() if k != path[0]}
  return out


class ExecutableStore:
  """Loaded executables on disk, keyed by what decides them.

  Args:
    directory: where entries live (None: nothing is stored, everything is
      compiled).
    context: what every key shares (config, model, ...), JSON-serialisable.
    log: a ``print``-like function for the one-line notices.
  """

  def __init__(self, directory: str | None, context: dict, log: Callable[[str], None] = print):
    self.directory = directory
    self.log = log
    self._context = json.dumps(
        {**context, 'jax': jax.__version__, 'jaxlib': jax.lib.__version__,
         'source': source_hash()}, sort_keys=True, default=str)
    self.loaded = self.compiled = 0  # counters (tests, logs)
    if directory:
      os.makedirs(directory, exist_ok=True)

  def key(self, name: str, *trees) -> str:
    return hashlib.sha256(json.dumps([self._context, name] + [_describe(t) for t in trees],
                                     default=str).encode()).hexdigest()[:32]

  def compile(self, name: str, lower: Callable[[], Any], *trees) -> Any:
    """The executable ``lower().compile()`` for ``name`` with arguments like
    ``trees`` (abstract or concrete): loaded from disk when stored, else
    compiled and stored."""
    if not self.directory:
      self.compiled += 1
      return lower().compile()
    path = os.path.join(self.directory, f'{self.key(name, *trees)}.exe')
    if os.path.exists(path):
      try:
        with open(path, 'rb') as f:
          payload, in_tree, out_tree = pickle.load(f)
        executable = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        self.loaded += 1
        return executable
      except Exception as e:  # noqa: BLE001 - any unreadable entry is recompiled
        self.log(f'  executable store: {os.path.basename(path)} unreadable '
                 f'({type(e).__name__}); compiling again')
    executable = lower().compile()
    self.compiled += 1
    try:
      payload, in_tree, out_tree = serialize_executable.serialize(executable)
      tmp = f'{path}.{os.getpid()}.tmp'
      with open(tmp, 'wb') as f:
        pickle.dump((payload, in_tree, out_tree), f)
      os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - storing is an optimisation only
      self.log(f'  executable store: not stored ({type(e).__name__}: {e})')
    return executable


def default_directory() -> str | None:
  """``<JAX compilation cache>/executables``, or None without that cache."""
  cache = jax.config.jax_compilation_cache_dir
  return os.path.join(cache, 'executables') if cache else None
