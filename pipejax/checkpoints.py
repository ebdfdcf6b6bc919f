"""Orbax checkpoints of the trainer state and its plan, under ``workdir/checkpoints``.

A checkpoint is a layout-free state tree (see
:meth:`pipejax.trainer.Trainer.portable_state`) and a JSON ``meta`` (plan,
freeze policy and its history, position in the data, micro-batch choices,
cache metadata; see :meth:`pipejax.trainer.Trainer.checkpoint_meta`). Orbax
writes each one into a temporary directory and renames it when complete, so a
failure while writing (a full disk, a killed process) never touches the
previous checkpoint. Saves are collective: in a multi-process run every
process calls :meth:`Checkpoints.save` and :meth:`Checkpoints.restore`.

In a single process the state is written *packed*: its leaves concatenated
into one flat array per dtype, their order, shapes and offsets in the meta
(key :data:`PACKED`). Orbax's cost is per array: the default run's portable
state is 78 small arrays, and writing them one by one took 4x the CPU of one
flat array (measured: 1.20 against 0.30 s of CPU for 10 saves), CPU that the
asynchronous writes take from the training steps beside them. Restoring
checks the layout against the target and the arrays against the crc32 saved
with them (key :data:`CHECKSUMS`: orbax keeps none, and reads changed bytes
as values), then unpacks; a checkpoint that fails the check is set aside like
an unreadable one. A checkpoint written unpacked (by several processes, or by
pipejax before packing) restores as before, unchecked. The meta carries a
crc32 of its own (key :data:`META_CHECKSUM`), checked on every restore.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from pipejax import diskcache, distributed, runtime


#: The meta key of a packed state's layout: ``[dtype name, shape, offset, key
#: path]`` per leaf, in the order of ``jax.tree.leaves`` (see :func:`pack`).
PACKED = 'packed_state'
#: The meta key of a packed state's checksums: ``{dtype name: crc32 of its
#: flat array's bytes}`` (see :func:`checksums`).
CHECKSUMS = 'packed_state_crc32'
#: The meta key of the meta's own checksum: the crc32 of the rest of it as
#: canonical JSON (see :func:`meta_checksum`). A value changed on disk that
#: still parses (a flipped digit) would otherwise be trained from.
META_CHECKSUM = 'meta_crc32'


#: The items of a pipejax checkpoint (:meth:`Checkpoints.save`).
ITEMS = ('meta', 'state')
# What orbax writes into every step beside them: a step left with only these
# (a kill while orbax deleted an old step) is a damaged one of ours.
_ORBAX_FILES = ('_CHECKPOINT_METADATA', 'commit_success.txt')
# What pipejax and orbax write under checkpoints/: a step, one set aside, a
# save in progress (orbax's ``<step>.orbax-checkpoint-tmp-<n>``).
_OWN = re.compile(r'\d+(\.corrupt(\.\d+)?|\.orbax-checkpoint-tmp.*)?')


class CheckpointError(RuntimeError):
  """A checkpoint that could not be written or read (one-line message)."""


def check_own(workdir: str) -> None:
  """Refuses a ``workdir/checkpoints`` holding an entry that orbax would take
  for a step (an integer name) but that is no pipejax checkpoint: a file or a
  link, or a folder that is non-empty, with neither of :data:`ITEMS`, and
  more than orbax's own marker files (another program's, an orbax checkpoint
  of another project included).
  Resuming would set it aside as damaged and keeping the newest checkpoints
  would delete it. A step of ours left with nothing but orbax's files (a
  kill while orbax deleted it) is accepted, as damaged.

  Raises:
    CheckpointError: naming the first such folder.
  """
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  try:
    names = sorted(os.listdir(directory), key=lambda n: (len(n), n))
  except OSError:
    return
  for name in names:
    path = os.path.join(directory, name)
    if not name.isdigit():
      continue
    if os.path.islink(path) or not os.path.isdir(path):
      # orbax would take it for a step (and a save of that step replaced it).
      what = 'a link' if os.path.islink(path) else 'a file, not a folder'
      raise CheckpointError(f'{path} is not a pipejax checkpoint ({what}): move it out of '
                            f'{directory}, or use another --workdir')
    try:
      items = sorted(os.listdir(path))
    except OSError:
      continue
    if items and not set(ITEMS) & set(items) and not set(items) <= set(_ORBAX_FILES):
      shown = ', '.join(items[:4]) + (', ...' if len(items) > 4 else '')
      raise CheckpointError(f'{path} is not a pipejax checkpoint (it holds {shown}, not '
                            f'{" and ".join(ITEMS)}): move it out of {directory}, or use '
                            f'another --workdir')


def pack(state: Any) -> tuple[dict[str, np.ndarray], list]:
  """``state``'s leaves on the host, concatenated into one flat array per
  dtype (``{dtype name: array}``), and the layout :func:`unpack` needs:
  ``[dtype name, shape, offset, key path]`` per leaf, in tree order."""
  groups: dict[str, list[np.ndarray]] = {}
  sizes: dict[str, int] = {}
  layout = []
  with_paths, _ = jax.tree_util.tree_flatten_with_path(state)
  values = jax.device_get([leaf for _, leaf in with_paths])
  for (path, _), leaf in zip(with_paths, values):
    leaf = np.asarray(leaf)
    name = leaf.dtype.name
    layout.append([name, list(leaf.shape), sizes.get(name, 0), jax.tree_util.keystr(path)])
    groups.setdefault(name, []).append(leaf.ravel())
    sizes[name] = sizes.get(name, 0) + leaf.size
  return {name: np.concatenate(parts) for name, parts in groups.items()}, layout


def checksums(packed: dict[str, np.ndarray]) -> dict[str, int]:
  """crc32 of each of :func:`pack`'s flat arrays (4 GB/s on one core):
  the restore of a packed checkpoint compares them, so that bytes changed on
  disk after the write (a failing disk, a stray write) are found, where
  orbax would read them as values."""
  return {name: zlib.crc32(np.ascontiguousarray(flat).reshape(-1).view(np.uint8))
          for name, flat in packed.items()}


#: ``(saved, wanted)`` dtypes of a scalar that restores cast: the
#: learning-rate schedule's count, an int32 until per_pipeline batches made it
#: a float32 (:func:`pipejax.optimizer.optimizer_for`).
CASTS = {('int32', 'float32')}


def meta_checksum(meta: dict[str, Any]) -> int:
  """The crc32 of ``meta`` as canonical JSON (as read back, keys sorted): the
  same for the dict saved and the one read back."""
  return zlib.crc32(json.dumps(json.loads(json.dumps(meta)), sort_keys=True).encode())


def layout_problem(layout: list, target: Any) -> str | None:
  """How a packed state's ``layout`` differs from ``target``'s tree, or None
  (a scalar of :data:`CASTS` is no difference)."""
  with_paths, _ = jax.tree_util.tree_flatten_with_path(target)
  if len(layout) != len(with_paths):
    return f'{len(layout)} arrays where the state has {len(with_paths)}'
  for (name, shape, _, saved_path), (path, want) in zip(layout, with_paths):
    here = jax.tree_util.keystr(path)
    wanted = f'{np.dtype(want.dtype).name}{list(want.shape)}'
    cast = not shape and not want.shape and (name, np.dtype(want.dtype).name) in CASTS
    if saved_path != here or (f'{name}{list(shape)}' != wanted and not cast):
      return f'{saved_path} {name}{list(shape)} where the state has {here} {wanted}'
  return None


def unpack(packed: dict[str, np.ndarray], layout: list, target: Any) -> Any:
  """The tree of ``target`` (``ShapeDtypeStruct`` leaves, with or without
  shardings) filled from :func:`pack`'s output, each leaf put on its
  sharding's devices (the default device without one).

  Raises:
    ValueError: the layout does not fit ``target`` or the arrays.
  """
  problem = layout_problem(layout, target)
  if problem:
    raise ValueError(f'the checkpoint holds {problem}')
  leaves, treedef = jax.tree.flatten(target)
  out = []
  for (name, shape, offset, _), want in zip(layout, leaves):
    flat = packed.get(name)
    size = int(np.prod(shape, dtype=np.int64))
    if flat is None or offset < 0 or offset + size > flat.size:
      raise ValueError(f'the checkpoint\'s {name} arrays end before the state\'s do')
    value = flat[offset:offset + size].reshape(shape).astype(want.dtype, copy=False)
    sharding = getattr(want, 'sharding', None)
    if sharding is not None and jax.process_count() > 1:
      # device_put onto several processes' devices compares the value across
      # them, a collective that a peer whose read failed never joins.
      out.append(jax.make_array_from_callback(value.shape, sharding,
                                              lambda index, v=value: v[index]))
    else:
      out.append(jax.device_put(value, sharding))
  return treedef.unflatten(out)


#: How long a step set aside may still be listed on another host of a job
#: (a shared folder's listing lags) before the job is refused.
LISTING_WAIT_SECONDS = 10.0


class Checkpoints:
  """Saves the trainer state (asynchronously) with JSON metadata.

  Args:
    workdir: the run's directory; checkpoints go to ``workdir/checkpoints``.
    keep: how many recent checkpoints to keep.
  """

  def __init__(self, workdir: str, keep: int = 2,
               meta_problem: Callable[[dict], str | None] | None = None):
    check_own(workdir)
    # What makes a meta that reads unusable to its owner (a key it lacks):
    # such a step is unreadable, as a damaged one is.
    self._meta_problem = meta_problem
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    # Directories are created before save() returns: created asynchronously,
    # a save that failed (a full disk) left its writer threads waiting 300 s
    # for a signal that never came, holding up the process's exit.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=True,
        async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False))
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    # Several processes each hold only their shards: orbax writes the tree.
    self.packed = jax.process_count() == 1
    self._pending: int | None = None  # the step of an asynchronous save not yet settled

  def path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: Any, meta: dict[str, Any], wait: bool = False) -> None:
    """Starts saving ``state`` (a layout-free tree) and ``meta`` as
    checkpoint ``step`` (``wait``: return once it is on disk).

    Raises:
      CheckpointError: this save, or the previous asynchronous one, failed
        (e.g. ``[Errno 28] No space left on device``); the message names the
        step that failed and the newest finished checkpoint, untouched.
    """
    if step in self.manager.all_steps():
      return  # already saved (an epoch end right after a step-count save)
    self._settle()  # orbax waits for it too, and would blame its error on this step
    if self.packed:
      state, layout = pack(state)
      meta = {**meta, PACKED: layout, CHECKSUMS: checksums(state)}
    meta = {**meta, META_CHECKSUM: meta_checksum(meta)}
    try:
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)))
      if wait:
        self.manager.wait_until_finished()
    except (OSError, ValueError, RuntimeError) as e:
      raise self._write_error(step, e) from e
    if not wait:
      self._pending = step

  def check(self) -> None:
    """Raises :class:`CheckpointError` if the pending asynchronous save has
    failed (a full disk), as soon as it has ended rather than at the next
    save, which can be an epoch of training later. Cheap: call it after
    every step. One process only (several would each wait in orbax's
    barriers at a different step): elsewhere it does nothing."""
    if (self._pending is not None and jax.process_count() == 1
        and not self.manager.is_saving_in_progress()):
      self._settle()

  def _settle(self) -> None:
    """Waits for the pending asynchronous save; its error names its step."""
    step, self._pending = self._pending, None
    if step is None:
      return
    try:
      self.manager.wait_until_finished()
    except (OSError, ValueError, RuntimeError) as e:
      raise self._write_error(step, e) from e

  def _reload(self) -> None:
    """Re-reads the finished steps from the folder after a failed save: orbax
    drops those beyond ``keep`` from its list when a save starts and deletes
    them once it succeeds, so after a failure its list can miss the very
    checkpoint that stayed intact (and never delete it later). A local
    listing, no collective."""
    try:
      self.manager.reload()
    except (OSError, ValueError):
      pass  # the list as it was: the message may then miss a step, nothing more

  def _write_error(self, step: int, error: Exception) -> CheckpointError:
    self._reload()
    steps = [s for s in self.manager.all_steps() if s != step]
    previous = self.path(max(steps)) if steps else 'none'
    return CheckpointError(f'writing the checkpoint of step {step} failed ({error}); the '
                           f'previous checkpoint is intact: {previous}')

  def latest(self) -> str | None:
    """The directory of the newest finished checkpoint, or None."""
    self._pending = None  # settled here, its error (if any) of no interest
    try:
      self.manager.wait_until_finished()
    except (OSError, ValueError, RuntimeError):
      self._reload()  # a failed pending save: the newest finished one is still the answer
    step = self.manager.latest_step()
    return None if step is None else self.path(step)

  def _read(self, step: int, args: ocp.args.Composite) -> Any:
    """``args``' items of checkpoint ``step``. With several processes, read
    by the checkpoint handler itself, without the barrier that orbax's
    checkpointer holds after a read: a process whose read failed never
    reaches it, and the others would wait in it for a collective that no
    longer matches. :meth:`restore` agrees on every step itself."""
    if jax.process_count() == 1:
      return self.manager.restore(step, args=args)
    from etils import epath  # noqa: PLC0415 - orbax's own path type
    return ocp.CompositeCheckpointHandler().restore(epath.Path(self.path(step)), args=args)

  def _saved_meta(self, step: int) -> dict:
    """The meta saved with ``step``, the packed state's layout included.

    Raises:
      ValueError: it reads, but is no object, ``meta_problem`` finds it
        unusable, or it fails its checksum (:data:`META_CHECKSUM`).
    """
    meta = self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
    if not isinstance(meta, dict):
      raise ValueError(f'its meta is a {type(meta).__name__}, not an object')
    meta = dict(meta)
    saved = meta.pop(META_CHECKSUM, None)  # None: written before pipejax kept it
    problem = self._meta_problem(meta) if self._meta_problem else None
    if problem:
      raise ValueError(f'its meta is unusable: {problem}')
    if saved is not None and saved != meta_checksum(meta):
      raise ValueError(f'its meta differs from what was written (crc32 {meta_checksum(meta)}, '
                       f'saved {saved})')
    return meta

  def _meta(self, step: int) -> dict:
    """The meta saved with ``step``, without the packed state's layout."""
    meta = self._saved_meta(step)
    meta.pop(PACKED, None)
    meta.pop(CHECKSUMS, None)
    return meta

  def _restore_state(self, step: int, target: Any, layout: list | None,
                     sums: dict[str, int] | None = None) -> Any:
    """The state of ``step`` on ``target``'s shardings; a packed one is
    checked against its checksums ``sums`` (None: written before pipejax
    kept them) and raises :class:`ValueError` where it differs."""
    if layout is None:  # written unpacked
      return self._read(step, ocp.args.Composite(state=ocp.args.StandardRestore(target)))['state']
    sizes: dict[str, int] = {}
    for name, shape, offset, _ in layout:
      sizes[name] = max(sizes.get(name, 0), offset + int(np.prod(shape, dtype=np.int64)))
    flat = {name: np.zeros((size,), np.dtype(name)) for name, size in sizes.items()}
    packed = self._read(step, ocp.args.Composite(state=ocp.args.StandardRestore(flat)))['state']
    packed = {k: np.asarray(v) for k, v in packed.items()}
    if sums is not None:
      found = checksums(packed)
      changed = sorted(name for name in set(found) | set(sums) if found.get(name) != sums.get(name))
      if changed:
        raise ValueError(f'its {", ".join(changed)} arrays differ from what was written '
                         f'(checksum); the files changed on disk')
    return unpack(packed, layout, target)

  def latest_meta(self) -> tuple[dict, str] | None:
    """``(meta, directory)`` of the newest checkpoint whose meta reads, or None."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        return self._meta(step), self.path(step)
      except Exception:  # noqa: BLE001 - restore() says what is wrong with it
        continue
    return None

  def restore(self, abstract_state: Callable[[dict], Any], log: Callable[[str], None] = print
              ) -> tuple[Any, dict, str] | None:
    """The newest readable checkpoint: ``(state, meta, directory)``, or None
    when there is none. An unreadable checkpoint (truncated, corrupt) is
    renamed ``<step>.corrupt`` with a one-line message, and the one before it
    is tried. With several processes (collective) a step is used only where
    every process read it, so all resume from the same one; processes that
    list different steps are refused (:class:`distributed.DistributedError`).

    Args:
      abstract_state: ``meta -> target`` (the state's ``ShapeDtypeStruct``
        tree with shardings, which may depend on the saved plan).
      log: one-line messages.

    Raises:
      CheckpointError: checkpoints exist but none is readable.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    self._check_same_steps(steps)
    for step in steps:
      error = None
      try:
        meta = self._saved_meta(step)
      except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types
        error = e
      if error is None:
        layout = meta.pop(PACKED, None)
        sums = meta.pop(CHECKSUMS, None)
        target = abstract_state(meta)  # may raise a ConfigError-like refusal: not corrupt
        problem = None if layout is None else layout_problem(layout, target)
        if problem:  # readable, but of another state: not set aside
          raise CheckpointError(f'checkpoint {self.path(step)} holds another state than this '
                                f'run has ({problem}); use the pipejax that wrote it, or start '
                                f'over with --config.resume=False')
        try:
          state = self._restore_state(step, target, layout, sums)
        except Exception as e:  # noqa: BLE001
          error = e
      failed = self._failed_on(error)
      if failed:
        self._set_aside(step, error, log, failed)
        continue
      return state, meta, self.path(step)
    if steps:
      raise CheckpointError(f'no readable checkpoint in {self.directory} (tried steps {steps}, '
                            f'set aside as <step>.corrupt: rename one back to try it again); '
                            f'use another --workdir, or --config.resume=False to start over '
                            f'here (this run\'s outputs are removed at its first checkpoint)')
    return None

  def _check_same_steps(self, steps: list[int]) -> None:
    """With several processes, refuses on every process at once checkpoints
    listed differently by them (a shared folder that some hosts see late):
    each would resume from another step. Collective."""
    if jax.process_count() == 1:
      return
    listed = distributed.gather_exact([float(len(steps)), float(steps[0] if steps else -1),
                                       float(zlib.crc32(repr(sorted(steps)).encode()))])
    if (listed != listed[0]).any():
      seen = ', '.join(f'process {i}: {int(n)} (newest {"none" if top < 0 else int(top)})'
                       for i, (n, top, _) in enumerate(listed.tolist()))
      raise distributed.DistributedError(
          f'the processes list different checkpoints in {self.directory} ({seen}): every '
          f'process must see the same folder; relaunch the same command on every host once '
          f'they do')

  @staticmethod
  def _failed_on(error: Exception | None) -> list[int]:
    """The processes whose read of this step failed (``error``: this one's):
    with several processes every process reads every step, and a step is
    used only where all read it (each reads its own shards). Collective."""
    if error is not None and (runtime.out_of_memory(error) or (
        jax.process_count() > 1 and any(isinstance(c, jax.errors.JaxRuntimeError)
                                         for c in runtime.causes(error)))):
      # The memory, or a computation across processes (a lost peer): not the checkpoint.
      raise error
    return distributed.processes_where(error is not None)

  def _set_aside(self, step: int, error: Exception | None, log: Callable[[str], None],
                 failed: list[int]) -> None:
    """Moves unreadable ``step`` to ``<step>.corrupt`` (process 0 alone, the
    others waiting for the move) and says why: ``error`` where this process
    failed, else the processes that did (``failed``)."""
    aside = diskcache.aside_name(self.path(step))  # an earlier one set aside is kept too
    if error is not None:
      detail = distributed.first_line(str(error), 200) or type(error).__name__
      where = f' on process {jax.process_index()}' if jax.process_count() > 1 else ''
      why = f'is unreadable{where} ({detail})'
    else:
      why = (f'is unreadable on {distributed.name_processes(failed)} '
             f'({"their lines say" if len(failed) > 1 else "its line says"} why)')
    log(f'checkpoint {self.path(step)} {why}; moved to {aside} (rename it back to try it '
        f'again), trying the one before')
    if jax.process_count() > 1:
      distributed.gather_exact([0.0])  # every process has named the aside before it moves
    if jax.process_index() == 0:
      os.replace(self.path(step), aside)
    if jax.process_count() > 1:
      distributed.gather_exact([0.0])  # the others list the steps once it has moved
    self.manager.reload()
    # A shared folder may list the moved step a while longer on another host.
    deadline = time.monotonic() + LISTING_WAIT_SECONDS
    while step in self.manager.all_steps() and time.monotonic() < deadline:
      time.sleep(0.2)
      self.manager.reload()
    if jax.process_count() > 1:
      # One that still lists it would skip, alone, every save up to that step
      # (orbax saves no step at or below the newest it lists): the others would
      # wait in the save's barrier for it, a hang or mismatched collectives.
      late = distributed.processes_where(step in self.manager.all_steps())
      if late:
        raise distributed.DistributedError(
            f'checkpoint {self.path(step)} was moved to {aside}, but '
            f'{distributed.name_processes(late)} still list{"s" * (len(late) == 1)} it after '
            f'{LISTING_WAIT_SECONDS:g} s: every process must see the same folder; relaunch the '
            f'same command on every host once they do')

  def close(self) -> None:
    """Waits for pending saves.

    Raises:
      CheckpointError: the last asynchronous save failed.
    """
    try:
      self._settle()
      try:
        self.manager.wait_until_finished()
      except (OSError, ValueError, RuntimeError) as e:
        self._reload()
        step = self.manager.latest_step()
        raise CheckpointError(f'writing a checkpoint failed ({e}); the newest intact one is '
                              f'{self.path(step) if step is not None else "none"}') from e
    finally:
      self.manager.close()


def set_aside(workdir: str) -> list[str]:
  """The checkpoints of ``workdir`` set aside as unreadable (``<step>.corrupt``)."""
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  if not os.path.isdir(directory):
    return []
  return sorted(name for name in os.listdir(directory) if '.corrupt' in name)


def own_entries(workdir: str) -> list[str]:
  """The names in ``workdir/checkpoints`` that are a run's own: its steps,
  those set aside and unfinished saves (none where there is no folder)."""
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted(name for name in names if _OWN.fullmatch(name)
                and os.path.isdir(os.path.join(directory, name))
                and not os.path.islink(os.path.join(directory, name)))


def has_finished(workdir: str) -> bool:
  """Whether ``workdir`` holds a finished checkpoint: a step (of
  :func:`own_entries`) with both :data:`ITEMS`, read from the folder alone."""
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  return any(name.isdigit() and all(os.path.isdir(os.path.join(directory, name, item))
                                    for item in ITEMS)
             for name in own_entries(workdir))


def clear(workdir: str) -> None:
  """Removes a run's checkpoints: its steps, those set aside and unfinished
  saves (:func:`own_entries`); anything else in ``workdir/checkpoints`` stays
  (and the folder with it).

  Raises:
    CheckpointError: a step folder that is no pipejax checkpoint
      (:func:`check_own`); nothing is removed then.
  """
  check_own(workdir)
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  if not os.path.isdir(directory):
    return
  for name in own_entries(workdir):
    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
  try:
    os.rmdir(directory)
  except OSError:
    pass  # other files stay
