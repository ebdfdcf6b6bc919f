"""A disk cache of HF random initialisations, keyed by everything they depend on.

Initialising an HF Flax model eagerly runs (and compiles) hundreds of small
random ops: 2.2 s of every start of the embedded default on a 2-core CPU, as
long as its checkpoints, evaluation and transitions together. The result is a
pure function of the model class, its config, the seed, the library versions
and JAX's PRNG settings, so it is kept, bit for bit, in
``<dir>/init-<digest>.npz`` and read back (milliseconds) by the next run with
the same key. Entries are written atomically; an unreadable one is reported in
one line, removed and initialised afresh; the least recently used entries
beyond ``max_bytes`` are removed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from pipejax import diskcache

DEFAULT_MAX_BYTES = 2 << 30
_LIBRARIES = ('jax', 'jaxlib', 'flax', 'transformers', 'numpy')
_SEPARATOR = '\x1f'  # not in any parameter name

#: This cache's own file names (:func:`cached_init`): all that trimming it
#: may remove.
ENTRY_NAME = re.compile(r'init-[0-9a-f]{40}\.npz')


def key(hf_class: type, hf_config, seed: int) -> str:
  """The digest that names an initialisation."""
  prng = {name: str(getattr(jax.config, name, None))
          for name in ('jax_default_prng_impl', 'jax_threefry_partitionable', 'jax_enable_x64')}
  payload = {'class': f'{hf_class.__module__}.{hf_class.__qualname__}',
             'config': hf_config.to_dict(), 'seed': int(seed),
             'versions': diskcache.versions(_LIBRARIES), 'prng': prng}
  return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def cached_init(directory: str | None, digest: str, init: Callable[[], Any],
                log: Callable[[str], None] = print, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
  """``init()``'s parameter tree, from ``directory`` when it holds ``digest``
  (``directory`` None: always ``init()``)."""
  if not directory:
    return init()
  directory = os.path.expanduser(directory)
  path = os.path.join(directory, f'init-{digest[:40]}.npz')
  if os.path.exists(path):
    try:
      with open(path, 'rb') as f:  # np.load takes any other bytes for a pickle
        if f.read(4) != b'PK\x03\x04':
          raise ValueError('not an .npz archive')
      with np.load(path, allow_pickle=False) as entry:
        flat = {tuple(name.split(_SEPARATOR)): jnp.asarray(entry[name]) for name in entry.files}
      diskcache.touch(path)  # recently used: kept by diskcache.trim
      return traverse_util.unflatten_dict(flat)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
      log(f'initialisation cache: {path} is unreadable ({type(e).__name__}: {str(e)[:120]}); '
          f'removed and initialised afresh')
      diskcache.remove(path)
  params = init()
  try:
    os.makedirs(directory, exist_ok=True)
    flat = traverse_util.flatten_dict(params)
    arrays = {_SEPARATOR.join(k): np.asarray(v) for k, v in flat.items()}
    diskcache.write_atomic(path, lambda f: np.savez(f, **arrays), binary=True, sync=False)
    diskcache.trim(directory, ENTRY_NAME, max_bytes)
  except OSError as e:
    log(f'initialisation cache {directory} is unusable ({e}); initialising every run')
  return params
