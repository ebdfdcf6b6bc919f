"""AutoCache's disk tier: checksummed fixed-size records in one file.

A cache directory holds two files that this module owns, and while the disk
is timed a scratch ``probe-<random>.bin`` of its own (nothing else in the
directory is read, written or removed):

``autocache.json``  the manifest: format, run identity, entry shape and dtype,
                    record size and slot count; written atomically.
``entries.bin``     ``slots`` records of ``record_bytes`` each: a 32-byte header
                    and the payload (one sample's ``[seq, hidden]`` in the
                    storage dtype). Slots never written are holes (sparse).

Header (little-endian, packed): magic ``b'PJAC'``, sample id ``int64``, depth
``int32``, crc32 ``uint32``, identity hash ``uint64`` (blake2b of the run
identity), payload size ``uint32``. The crc covers every other header field
and the payload, so a record is valid only if all of it was written by the
same write: a crash mid-write, a torn page, a truncated file or a flipped byte
reads as invalid (the chance that corruption passes crc32 is 2⁻³²), and a
record of another run or sample never matches the expected identity and id.
Freed slots get their header zeroed so a reopened directory does not resurrect
evicted entries.

Reads and writes use ``os.pread`` / ``os.pwrite`` rather than ``np.memmap``: a
memmap of a file that something truncated kills the process with SIGBUS,
while a short ``pread`` is just an invalid record.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import uuid
import zlib
from typing import Callable, Sequence

import ml_dtypes
import numpy as np

from pipejax import diskcache

FORMAT = 'pipejax-autocache-1'
# A lock of its own name: a cache directory may be the run's workdir, whose
# '.lock' the run itself holds (experiments.elastic.lock_workdir).
MANIFEST, ENTRIES, LOCK = 'autocache.json', 'entries.bin', '.autocache.lock'
MAGIC = b'PJAC'
# The directories this process has claimed (DiskTier._claim): real path of
# the lock file -> [its lock, the tiers holding it].
_CLAIMS: dict[str, list] = {}
_CLAIMS_LOCK = threading.Lock()
HEADER = np.dtype([('magic', 'S4'), ('sample_id', '<i8'), ('depth', '<i4'), ('crc', '<u4'),
                   ('identity', '<u8'), ('payload_bytes', '<u4')])
assert HEADER.itemsize == 32
STORAGE_DTYPES = {'float32': np.dtype(np.float32), 'bfloat16': np.dtype(ml_dtypes.bfloat16),
                  'float16': np.dtype(np.float16)}


class CacheMismatchError(ValueError):
  """A cache directory holds entries of another run or configuration, or
  cannot be used at all."""


def storage_dtype(name: str) -> np.dtype:
  """The numpy dtype of a storage dtype name (``float32|bfloat16|float16``)."""
  if name not in STORAGE_DTYPES:
    raise ValueError(f'cache dtype {name!r} is not one of {sorted(STORAGE_DTYPES)}')
  return STORAGE_DTYPES[name]


def identity_hash(identity: str) -> int:
  """The 64-bit hash of a run identity written into every record."""
  return int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), 'little')


def _runs(slots: np.ndarray) -> list[tuple[int, int]]:
  """``(start index, length)`` of the runs of consecutive values in sorted ``slots``."""
  if len(slots) == 0:
    return []
  breaks = np.nonzero(np.diff(slots) != 1)[0] + 1
  starts = np.concatenate([[0], breaks])
  ends = np.concatenate([breaks, [len(slots)]])
  return [(int(s), int(e - s)) for s, e in zip(starts, ends)]


def _record_crc(row: np.ndarray) -> int:
  """crc32 of one record ``[record_bytes] uint8`` without its crc field."""
  return zlib.crc32(row[20:], zlib.crc32(row[:16]))


class DiskTier:
  """One run's records on disk; the slot allocation belongs to the caller.

  Args:
    directory: the cache directory (created if missing).
    identity: the run/config identity; a directory written under another
      identity, entry shape or dtype is refused or cleared.
    entry_shape: one sample's activation shape, e.g. ``(seq, hidden)``.
    dtype: storage dtype name.
    max_bytes: the size ``entries.bin`` may reach; ``max_bytes //
      record_bytes`` slots (capped at ``max_slots``).
    max_slots: no more slots than this (the number of samples).
    on_mismatch: ``'refuse'`` (raise :class:`CacheMismatchError`) or
      ``'clear'`` (delete this module's two files and start empty).
    log: one-line messages.
  """

  def __init__(self, directory: str, identity: str, entry_shape: Sequence[int], dtype: str,
               max_bytes: int, max_slots: int, on_mismatch: str = 'refuse',
               log: Callable[[str], None] = print):
    if on_mismatch not in ('refuse', 'clear'):
      raise ValueError(f"cache on_mismatch must be 'refuse' or 'clear', got {on_mismatch!r}")
    self.directory, self.log = directory, log
    self.entry_shape = tuple(int(d) for d in entry_shape)
    self.dtype = storage_dtype(dtype)
    self.identity = identity_hash(identity)
    self.payload_bytes = int(np.prod(self.entry_shape)) * self.dtype.itemsize
    self.record_bytes = HEADER.itemsize + self.payload_bytes
    self.slots = int(min(max_bytes // self.record_bytes, max_slots))
    problem = diskcache.folder_problem(directory)  # 'a file, not a folder', not 'File exists'
    if problem:
      raise CacheMismatchError(f'cannot use the cache directory {directory}: {problem}')
    self.path = os.path.join(directory, ENTRIES)
    self._lock_path, self._lock, self.fd = os.path.join(directory, LOCK), None, -1
    self._claim()
    manifest_path = os.path.join(directory, MANIFEST)
    expected = {'format': FORMAT, 'identity': identity, 'entry_shape': list(self.entry_shape),
                'dtype': dtype}
    found = self._manifest(manifest_path)
    leftover = found is not None or os.path.exists(self.path)
    if leftover and (found is None or {k: found.get(k) for k in expected} != expected):
      if found is not None and found.get('identity') == identity:
        # This run's own entries in another dtype or shape (a resume may change
        # cache.*) or written by another version of this module: only a
        # speed-up, and a resume starts the cache empty anyway.
        if found.get('format') != FORMAT:
          log(f'autocache: clearing {directory}: its entries are this run\'s in cache format '
              f'{found.get("format")!r}; this version reads {FORMAT!r}')
        else:
          log(f'autocache: clearing {directory}: its entries are this run\'s in dtype '
              f'{found.get("dtype")}, shape {found.get("entry_shape")}; now {dtype}, '
              f'{list(self.entry_shape)}')
      else:
        if found is None:
          what = f'{ENTRIES} without a readable {MANIFEST}: whose they are is unknown'
        else:
          what = (f'identity {found.get("identity")!r}, shape {found.get("entry_shape")}, '
                  f'dtype {found.get("dtype")}')
          if found.get('format') != FORMAT:
            what += f', cache format {found.get("format")!r} (this version reads {FORMAT!r})'
        if on_mismatch == 'refuse':
          self.close()
          raise CacheMismatchError(
              f'cache directory {directory} holds activations this run cannot trust ({what}; '
              f'this run: identity {identity!r}, shape {list(self.entry_shape)}, dtype '
              f'{dtype}); use a fresh directory (--config.cache.directory) or '
              f'--config.cache.on_mismatch=clear')
        log(f'autocache: clearing {directory}: it held another run\'s activations ({what})')
      try:
        for name in (ENTRIES, MANIFEST):
          if os.path.lexists(os.path.join(directory, name)):
            os.remove(os.path.join(directory, name))
      except OSError as e:  # a directory in their place, no permission
        self.close()
        raise CacheMismatchError(f'cannot clear the cache directory {directory}: '
                                 f'{e.strerror or e} ({e.filename}); remove it, or give this '
                                 f'run another --config.cache.directory') from e
    created = not os.path.exists(self.path)
    try:
      self.open()
      if os.fstat(self.fd).st_size > self.slots * self.record_bytes:
        os.ftruncate(self.fd, self.slots * self.record_bytes)  # a smaller budget than last time
      manifest = dict(expected, record_bytes=self.record_bytes, slots=self.slots)
      diskcache.write_atomic(manifest_path, lambda f: json.dump(manifest, f))
    except OSError as e:
      self.close()
      if created:  # an entries file with no manifest would make the next run refuse it
        with contextlib.suppress(OSError):
          os.remove(self.path)
      raise CacheMismatchError(f'cannot use the cache directory {directory}: '
                               f'{e.strerror or e} ({e.filename})') from e

  def _claim(self) -> None:
    """Locks the directory while this tier uses it: two runs on one
    directory would truncate each other's file and, their identities equal
    (runs that differ in ``pipeline.*`` only), read each other's records as
    valid. The claim is the process's (a run is one): tiers of one process
    share it. Where the file system cannot lock, nothing keeps runs apart."""
    if self._lock is not None:
      return
    key = os.path.realpath(self._lock_path)
    try:
      with _CLAIMS_LOCK:
        if key not in _CLAIMS:
          _CLAIMS[key] = [diskcache.FolderLock(self._lock_path), 0]
        _CLAIMS[key][1] += 1
        self._lock = key
    except diskcache.InUseError as e:
      raise CacheMismatchError(f'cache directory {self.directory} is in use by another run '
                               f'({e}); give this run another --config.cache.directory') from None
    except OSError as e:
      self.log(f'warning: cannot lock {self._lock_path} ({e.strerror or e}): nothing keeps '
               f'another run from using {self.directory} at the same time')

  @staticmethod
  def _manifest(path: str) -> dict | None:
    try:
      with open(path) as f:
        found = json.load(f)
      return found if isinstance(found, dict) else None
    except (OSError, ValueError):
      return None

  def open(self) -> None:
    """Opens the entries file again after :meth:`close` (no-op while open)."""
    if self.fd < 0:
      self._claim()
      self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

  def close(self) -> None:
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1
    if self._lock is not None:
      with _CLAIMS_LOCK:
        claim = _CLAIMS[self._lock]
        claim[1] -= 1
        if not claim[1]:
          claim[0].release()
          del _CLAIMS[self._lock]
      self._lock = None

  @property
  def file_bytes(self) -> int:
    """Apparent size of ``entries.bin`` (≤ ``slots · record_bytes``), also
    after :meth:`close` (a run's summary reads the counters after training)."""
    return os.fstat(self.fd).st_size if self.fd >= 0 else os.path.getsize(self.path)

  # -- records -------------------------------------------------------------------
  def encode(self, sample_ids: np.ndarray, depths: np.ndarray,
             payload: np.ndarray) -> np.ndarray:
    """Records ``[n, record_bytes] uint8`` of ``payload [n, *entry_shape]``
    (storage dtype) for ``sample_ids [n]`` at ``depths [n]``."""
    n = len(sample_ids)
    records = np.empty((n, self.record_bytes), np.uint8)
    header = np.zeros(n, HEADER)
    header['magic'], header['sample_id'], header['depth'] = MAGIC, sample_ids, depths
    header['identity'], header['payload_bytes'] = self.identity, self.payload_bytes
    records[:, :HEADER.itemsize] = header.view(np.uint8).reshape(n, HEADER.itemsize)
    records[:, HEADER.itemsize:] = np.ascontiguousarray(
        payload, self.dtype).reshape(n, -1).view(np.uint8)
    crcs = np.array([_record_crc(row) for row in records], '<u4')
    records[:, 16:20] = crcs.view(np.uint8).reshape(n, 4)
    return records

  def decode(self, records: np.ndarray, sample_ids: np.ndarray,
             depths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Checks ``records [n, record_bytes]`` against the expected ``sample_ids``
    and ``depths``; returns ``(payload [n, *entry_shape] storage dtype, valid [n])``.
    Invalid rows' payload is garbage and must not be used."""
    n = len(records)
    header = np.ascontiguousarray(records[:, :HEADER.itemsize]).view(HEADER).reshape(n)
    valid = ((header['magic'] == MAGIC) & (header['sample_id'] == sample_ids)
             & (header['depth'] == depths) & (header['identity'] == self.identity)
             & (header['payload_bytes'] == self.payload_bytes))
    for i in np.nonzero(valid)[0]:
      valid[i] = _record_crc(records[i]) == header['crc'][i]
    payload = np.ascontiguousarray(records[:, HEADER.itemsize:]).view(self.dtype)
    return payload.reshape((n,) + self.entry_shape), valid

  def write(self, slots: np.ndarray, sample_ids: np.ndarray, depths: np.ndarray,
            payload: np.ndarray) -> None:
    """Writes one record per slot (runs of consecutive slots in one call)."""
    order = np.argsort(slots, kind='stable')
    slots = np.asarray(slots)[order]
    records = self.encode(np.asarray(sample_ids)[order], np.asarray(depths)[order],
                          np.asarray(payload)[order])
    for start, length in _runs(slots):
      os.pwrite(self.fd, records[start:start + length].tobytes(),
                int(slots[start]) * self.record_bytes)

  def read(self, slots: np.ndarray, sample_ids: np.ndarray,
           depths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reads the records in ``slots [n]`` expected to hold ``sample_ids`` at
    ``depths``; returns ``(payload [n, *entry_shape] storage dtype, valid [n])``.
    A short read (truncated file) leaves zeros, which never validate."""
    slots = np.asarray(slots)
    order = np.argsort(slots, kind='stable')
    records = np.zeros((len(slots), self.record_bytes), np.uint8)
    sorted_slots = slots[order]
    for start, length in _runs(sorted_slots):
      data = os.pread(self.fd, length * self.record_bytes,
                      int(sorted_slots[start]) * self.record_bytes)
      got = np.frombuffer(data, np.uint8)
      full = len(got) // self.record_bytes
      rows = order[start:start + length]
      records[rows[:full]] = got[:full * self.record_bytes].reshape(full, self.record_bytes)
    return self.decode(records, np.asarray(sample_ids), np.asarray(depths))

  def invalidate(self, slots: np.ndarray) -> None:
    """Zeroes the headers of ``slots`` (freed slots must not validate again)."""
    size = self.file_bytes
    zeros = bytes(HEADER.itemsize)
    for slot in np.asarray(slots):
      offset = int(slot) * self.record_bytes
      if offset < size:
        os.pwrite(self.fd, zeros, offset)

  def clear(self) -> None:
    """Drops every record."""
    os.ftruncate(self.fd, 0)

  def scan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Headers in the file that name this identity: ``(slots, sample_ids,
    depths)``, each ``[n]``. Payloads are checked when read, not here."""
    found = []
    for slot in range(min(self.file_bytes // self.record_bytes, self.slots)):
      data = os.pread(self.fd, HEADER.itemsize, slot * self.record_bytes)
      header = np.frombuffer(data, HEADER)[0]
      if (header['magic'] == MAGIC and header['identity'] == self.identity
          and header['payload_bytes'] == self.payload_bytes):
        found.append((slot, int(header['sample_id']), int(header['depth'])))
    arrays = np.array(found, np.int64).reshape(-1, 3)
    return arrays[:, 0], arrays[:, 1], arrays[:, 2]

  def measure(self, payload: np.ndarray) -> tuple[float, float]:
    """Seconds to write and to read back ``payload [n, *entry_shape]`` as
    records, through a scratch file beside the entries (removed after)."""
    path = os.path.join(self.directory, f'probe-{uuid.uuid4().hex}.bin')  # a new file, ours
    ids = np.arange(len(payload))
    depths = np.zeros(len(payload), np.int32)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
      start = time.perf_counter()
      os.pwrite(fd, self.encode(ids, depths, payload).tobytes(), 0)
      write = time.perf_counter() - start
      start = time.perf_counter()
      data = np.frombuffer(os.pread(fd, len(payload) * self.record_bytes, 0), np.uint8)
      _, valid = self.decode(data.reshape(len(payload), self.record_bytes), ids, depths)
      read = time.perf_counter() - start
    finally:
      os.close(fd)
      os.remove(path)
    if not valid.all():
      raise OSError(f'cache directory {self.directory} does not read back what was written')
    return write, read
