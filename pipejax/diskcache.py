"""Housekeeping shared by the on-disk caches (the program store, the
initialisation cache) and the run's files: writing a file whole or not at
all, a folder claimed by one run at a time, the library versions in their
keys, least-recently-used trimming, quiet touching and removal, the name a
damaged file is set aside under."""
from __future__ import annotations

import datetime
import fcntl
import importlib.metadata
import os
import re
import socket
import stat
import time
import uuid
from typing import IO, Callable

STALE_TMP_SECONDS = 3600  # a writer's temporary file older than this was left by a killed process


def write_atomic(path: str, write: Callable[[IO], None], *, binary: bool = False,
                 sync: bool = True) -> None:
  """Writes ``path`` whole or not at all: ``write(f)`` fills a temporary file
  of this writer's own beside it (``*.tmp``, which :func:`trim` also clears
  when a killed writer left it), which then replaces ``path`` in one rename.
  Readers see the old file or the new one, never a part; concurrent writers
  never share a temporary file. ``sync`` flushes the data to disk before the
  rename, so that a crash of the machine cannot leave an empty file either
  (the caches, which are rebuilt when lost, skip it).

  Raises:
    Whatever ``write`` or the file system raises (an ``OSError`` that names
    no file, or the temporary one, names ``path``); the temporary file is
    removed first and ``path`` is left as it was.
  """
  tmp = f'{path}.{uuid.uuid4().hex}.tmp'
  try:
    with open(tmp, 'wb' if binary else 'w') as f:
      write(f)
      if sync:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException as e:
    remove(tmp)
    if isinstance(e, OSError) and e.errno is not None and e.filename in (None, tmp):
      # e.g. a full disk: name the file (an OSError of the same subclass, by errno)
      raise OSError(e.errno, e.strerror, path) from e
    raise


def folder_problem(path: str) -> str | None:
  """Creates the folder ``path`` if needed; why a run cannot write into it
  (one phrase), else None."""
  if os.path.lexists(path) and not os.path.isdir(path):
    # makedirs would say only 'File exists'
    return 'it is a file, not a folder' if os.path.isfile(path) else 'it is not a folder'
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    return str(e.strerror or e)
  if not os.access(path, os.W_OK | os.X_OK):
    return 'not writable'
  return None


def outputs_problem(folder: str, files: tuple[str, ...] = (),
                    folders: tuple[str, ...] = ()) -> str | None:
  """:func:`folder_problem`, or which of the ``files`` and ``folders`` a run
  writes into ``folder`` is there as the other kind (one phrase), else None."""
  problem = folder_problem(folder)
  if problem:
    return problem
  for name, is_dir in [(n, False) for n in files] + [(n, True) for n in folders]:
    path = os.path.join(folder, name)
    if os.path.exists(path) and os.path.isdir(path) != is_dir:
      return (f'{path} is a {"file" if is_dir else "directory"}, where the run writes its '
              f'{"folder" if is_dir else "file"} {name}')
  return None


class InUseError(Exception):
  """Another live process holds the lock (the message names it)."""


class FolderLock:
  """An exclusive claim on a folder while a run writes into it: ``flock`` on
  the file ``path``, which names the holder (pid, host, start). The kernel
  drops the claim when the process ends, however it ends, so no stale lock
  outlives a killed run; the file itself stays (removing it would let a
  third process lock a new file while a second still holds the old one).

  Raises:
    InUseError: another process holds it.
    OSError: the file cannot be made or the file system cannot lock it.
  """

  def __init__(self, path: str):
    self.path = path
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:  # another user's lock file: flock needs no write access
      fd = os.open(path, os.O_RDONLY)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      try:
        holder = os.pread(fd, 512, 0).decode(errors='replace').strip()
      except OSError:
        holder = ''
      # The holder's line; a file of the user's by that name is not shown.
      holder = holder.splitlines()[0] if holder.startswith('pid ') else ''
      os.close(fd)
      raise InUseError(holder or 'a process that is starting') from None
    except BaseException:
      os.close(fd)
      raise
    try:  # who holds it, for the message of a refused run: a courtesy only
      held = os.pread(fd, 4, 0)
      if held in (b'', b'pid '):  # a file of the user's by that name is locked, not rewritten
        os.ftruncate(fd, 0)
        os.pwrite(fd, f'pid {os.getpid()} on {socket.gethostname()}, since '
                      f'{datetime.datetime.now():%Y-%m-%d %H:%M:%S}\n'.encode(), 0)
    except OSError:  # a full disk, a read-only file: the lock holds all the same
      pass
    self._fd: int | None = fd

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the only descriptor drops the flock
      self._fd = None


def versions(libraries: tuple[str, ...]) -> dict[str, str]:
  """Each installed library's version (``'absent'`` when it is not)."""
  out = {}
  for lib in libraries:
    try:
      out[lib] = importlib.metadata.version(lib)
    except importlib.metadata.PackageNotFoundError:
      out[lib] = 'absent'
  return out


def aside_name(path: str) -> str:
  """The first free ``<path>.corrupt``, ``<path>.corrupt.2``, … : where a
  damaged file or directory is moved, keeping any set aside before."""
  aside, n = f'{path}.corrupt', 1
  while os.path.exists(aside):
    n += 1
    aside = f'{path}.corrupt.{n}'
  return aside


def touch(path: str) -> None:
  """Marks ``path`` recently used (kept by :func:`trim`); quiet if it cannot."""
  try:
    os.utime(path)
  except OSError:
    pass


def remove(path: str) -> None:
  """Removes ``path`` if it is there (another process may have removed it)."""
  try:
    os.remove(path)
  except OSError:
    pass


def remove_stale_tmp(directory: str, of: tuple[str, ...] | re.Pattern) -> None:
  """Removes the ``<target>.<id>.tmp`` files of :func:`write_atomic` that a
  killed writer left in ``directory`` (older than :data:`STALE_TMP_SECONDS`:
  a live writer's file is younger), of the targets named in ``of``, or whose
  names ``of`` (a pattern) matches whole: a folder may hold other people's
  files, which stay. Quiet if it cannot."""
  try:
    names = os.listdir(directory)
  except OSError:
    return
  for name in names:
    target = name[:-len('.tmp')].rpartition('.')[0] if name.endswith('.tmp') else ''
    if not target or not (of.fullmatch(target) if isinstance(of, re.Pattern)
                          else target in of):
      continue
    full = os.path.join(directory, name)
    try:
      if time.time() - os.stat(full).st_mtime > STALE_TMP_SECONDS:
        remove(full)
    except OSError:
      continue


def trim(directory: str, entries: re.Pattern, max_bytes: int) -> None:
  """Removes the least recently used files of ``directory`` whose names
  ``entries`` matches whole (a cache's own entries) beyond ``max_bytes``,
  and the ``*.tmp`` files that killed writers left of such entries; any
  other file stays (a cache may be pointed at a shared folder)."""
  remove_stale_tmp(directory, entries)
  owned = []
  for name in os.listdir(directory):
    full = os.path.join(directory, name)
    try:
      st = os.stat(full)
    except OSError:
      continue
    if entries.fullmatch(name) and stat.S_ISREG(st.st_mode):
      owned.append((st.st_mtime, st.st_size, full))
  total = sum(size for _, size, _ in owned)
  for _, size, full in sorted(owned):
    if total <= max_bytes:
      break
    remove(full)
    total -= size
