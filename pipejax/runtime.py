"""Process set-up shared by the entry points: fake CPU devices, compilation
cache, quiet third-party warnings. Call :func:`setup` before importing JAX."""
from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import sys
import warnings
from typing import Iterator, NoReturn


def quiet_interrupt() -> None:
  """A Ctrl-C that none of the command's handlers catches (while it starts:
  its imports, reading its flags) ends it with one line, ``interrupted``,
  and exit code 130, instead of a traceback. For an entry point run as
  ``__main__``, before its heavy imports."""
  previous = sys.excepthook

  def hook(kind, value, traceback):
    if issubclass(kind, KeyboardInterrupt):
      print('interrupted', file=sys.stderr, flush=True)
      return  # Python then ends the process by SIGINT: exit code 130
    previous(kind, value, traceback)

  sys.excepthook = hook


class ArgumentParser(argparse.ArgumentParser):
  """``argparse``'s parser whose errors (an unknown flag, a bad value, a
  missing required flag) are one line on stderr, exit code 2, without the
  usage text before it (``--help`` prints that)."""

  def error(self, message: str) -> NoReturn:
    print(f'error: {message} (--help lists the flags)', file=sys.stderr, flush=True)
    raise SystemExit(2)


def setup(cpu_devices: int = 8) -> None:
  """Prepares the process for JAX; must run before ``import jax``.

  Args:
    cpu_devices: fake CPU devices to expose when no accelerator is used
      (``--xla_force_host_platform_device_count``); an explicit setting in
      ``XLA_FLAGS`` wins.
  """
  flags = os.environ.get('XLA_FLAGS', '')
  if 'xla_force_host_platform_device_count' not in flags:
    os.environ['XLA_FLAGS'] = f'{flags} --xla_force_host_platform_device_count={cpu_devices}'.strip()
  os.environ.setdefault('HF_HUB_OFFLINE', '1')
  os.environ.setdefault('TRANSFORMERS_VERBOSITY', 'error')
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  warnings.filterwarnings('ignore', message='.*TensorFlow and JAX classes are deprecated.*')
  # A transition's move donates the old layout, whose buffers rarely fit the
  # new one; JAX warns about every such buffer (harmless: they are freed).
  warnings.filterwarnings('ignore', message='Some donated buffers were not usable')
  from absl import logging as absl_logging  # noqa: PLC0415
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every file at INFO
  absl_logging.get_absl_logger().addFilter(_quiet_orbax_tmp_metadata)
  absl_logging.get_absl_logger().addFilter(_quiet_orbax_failed_save)
  if not getattr(sys.unraisablehook, 'pipejax', False):
    sys.unraisablehook = _quiet_closed_loop_hook(sys.unraisablehook)
  import jax  # noqa: PLC0415 - must follow the environment set-up above
  cache = os.environ.get('PIPEJAX_COMPILATION_CACHE',
                         os.path.join(os.path.expanduser('~'), '.cache', 'pipejax', 'jax'))
  # A process that configured JAX's cache itself (a test session, a notebook
  # that imports an entry point) keeps its own settings.
  if cache and not jax.config.jax_compilation_cache_dir:
    if '://' not in cache:
      cache = os.path.expanduser(cache)  # JAX would make a folder named '~'
    jax.config.update('jax_compilation_cache_dir', cache)
    # Every program, however fast it compiles: an elastic run has a handful
    # per transition (step, move, prefix, advance, portable state) that each
    # compile in 0.2-0.8 s on a CPU, and reading one back takes ~0.1 s.
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    _bound_compilation_cache(jax, cache)


#: The default bound of JAX's persistent cache (``PIPEJAX_COMPILATION_CACHE_MB``).
COMPILATION_CACHE_MB = 2048.0


def _bound_compilation_cache(jax, directory: str) -> None:
  """Keeps JAX's persistent cache ``directory`` within
  ``$PIPEJAX_COMPILATION_CACHE_MB`` megabytes (default
  :data:`COMPILATION_CACHE_MB`): JAX then removes the least recently used
  programs when it writes one (``jax_compilation_cache_max_size``), as the
  program store trims itself. A bound set with JAX's own
  ``JAX_COMPILATION_CACHE_MAX_SIZE`` wins; a remote directory stays
  unbounded. JAX's eviction reads each program's access time from a
  ``<key>-atime`` file beside its ``<key>-cache``, which an unbounded cache
  (pipejax before the bound, or another tool) did not write: those programs
  get one, their file's modification time, or every later write would fail
  with a warning. A bad value is a one-line error (exit 2)."""
  if '://' in directory:
    return
  if 'JAX_COMPILATION_CACHE_MAX_SIZE' in os.environ:
    if jax.config.jax_compilation_cache_max_size != -1:
      _backfill_access_times(directory)  # JAX's bound needs them as much as ours
    return
  text = os.environ.get('PIPEJAX_COMPILATION_CACHE_MB', '')
  try:
    megabytes = float(text) if text.strip() else COMPILATION_CACHE_MB
  except ValueError:
    megabytes = float('nan')
  if not 0 < megabytes < float('inf'):  # also refuses NaN
    print(f'error: PIPEJAX_COMPILATION_CACHE_MB={text!r} must be a number of megabytes > 0 '
          f'(to turn the cache off: PIPEJAX_COMPILATION_CACHE=)', file=sys.stderr, flush=True)
    raise SystemExit(2)
  if importlib.util.find_spec('filelock') is None:  # JAX's eviction locks the folder with it
    print(f'pipejax: the compilation cache {directory} stays unbounded: the filelock '
          f'package is missing (pip install -r requirements.txt)', file=sys.stderr, flush=True)
    return
  if _backfill_access_times(directory):
    jax.config.update('jax_compilation_cache_max_size', int(megabytes * 2 ** 20))


def _backfill_access_times(directory: str) -> bool:
  """Writes the ``<key>-atime`` file that JAX's eviction reads beside each
  ``<key>-cache`` of ``directory`` that has none (the file's modification
  time); False where the folder cannot be made or listed (JAX says so itself
  when it writes there). An entry that goes meanwhile (another process's
  eviction) is skipped."""
  try:
    os.makedirs(directory, exist_ok=True)
    names = os.listdir(directory)
  except OSError:
    return False
  for name in names:
    if not name.endswith('-cache'):
      continue
    atime = os.path.join(directory, name[:-len('-cache')] + '-atime')
    try:
      if not os.path.exists(atime):
        stamp = os.stat(os.path.join(directory, name)).st_mtime_ns
        with open(atime, 'wb') as f:
          f.write(stamp.to_bytes(8, 'little'))
    except OSError:
      continue
  return True


#: What orbax logs, with a traceback, from each thread of a background save
#: that failed (a full disk: four records, about 300 lines).
_ORBAX_FAILED_SAVE = ('_SignalingThread.run() raised an exception', 'in background save thread',
                      'Save Finalize thread')


def _quiet_orbax_failed_save(record) -> bool:
  """Drops orbax's logs of a background save that failed: pipejax raises the
  same error itself, in one line naming the step and the checkpoint that is
  intact (:class:`pipejax.checkpoints.CheckpointError`), at once in a single
  process. A job of several processes raises it only at its next save, so
  there the logs stay: they are the first sign."""
  if record.exc_info is None or 'jax' not in sys.modules:
    return True
  message = record.getMessage()
  # Read last: process_count() starts JAX's backends, never before a save has.
  return not (any(part in message for part in _ORBAX_FAILED_SAVE)
              and sys.modules['jax'].process_count() == 1)


def _quiet_orbax_tmp_metadata(record) -> bool:
  """Drops orbax's warning that a checkpoint still being written has no
  metadata file yet (its metadata update reads the file first; seen once when
  a stop request's save raced it). The save completes; nothing is wrong."""
  message = record.getMessage()
  return not (message.startswith('Metadata file does not exist:')
              and '.orbax-checkpoint-tmp' in message)


def _quiet_closed_loop_hook(previous):
  """``sys.unraisablehook`` less tensorstore's late callbacks: a restore
  that fails on one array (a damaged checkpoint) ends orbax's event loop
  while tensorstore still reads the others, and each read that ends later
  posts its result to the closed loop (asyncio's ``RuntimeError: Event loop
  is closed``), which tensorstore reports as unraisable: a traceback between
  the run's one-line messages, about nothing the run still waits for. Every
  other unraisable error goes to ``previous``."""
  def hook(unraisable):
    error, tb = unraisable.exc_value, unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
      tb = tb.tb_next
    if (isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'
        and tb is not None and tb.tb_frame.f_code.co_name == '_check_closed'):
      return
    previous(unraisable)
  hook.pipejax = True
  return hook


@contextlib.contextmanager
def absl_errors_only():
  """absl's warnings off inside the block: for library calls that log an
  expected condition as a warning (orbax re-registering a type handler, TFDS
  probing a data set that is not prepared), which would otherwise precede a
  run's own one-line message."""
  from absl import logging as absl_logging  # noqa: PLC0415
  before = absl_logging.get_verbosity()
  absl_logging.set_verbosity(min(before, absl_logging.ERROR))  # lower: quieter
  try:
    yield
  finally:
    absl_logging.set_verbosity(before)


def program_store_dir() -> str | None:
  """Where :class:`pipejax.programs.ProgramStore` keeps traced
  programs: ``$PIPEJAX_PROGRAM_STORE`` (empty: off), by default
  ``~/.cache/pipejax/programs``."""
  path = os.environ.get('PIPEJAX_PROGRAM_STORE',
                        os.path.join(os.path.expanduser('~'), '.cache', 'pipejax', 'programs'))
  return path or None


def init_cache_dir() -> str | None:
  """Where :mod:`models.init_cache` keeps random initialisations:
  ``$PIPEJAX_INIT_CACHE`` (empty: off), by default ``~/.cache/pipejax/init``."""
  path = os.environ.get('PIPEJAX_INIT_CACHE',
                        os.path.join(os.path.expanduser('~'), '.cache', 'pipejax', 'init'))
  return path or None


def causes(error: BaseException | None) -> Iterator[BaseException]:
  """``error``, then the error that caused it (``__cause__``, else
  ``__context__``), and so on: what a library that wraps errors hides."""
  seen = set()
  while error is not None and id(error) not in seen:
    yield error
    seen.add(id(error))
    error = error.__cause__ or error.__context__


def out_of_memory(error: BaseException | None) -> bool:
  """Whether ``error``, or an error that caused it (a library may wrap one),
  is the host's memory (``MemoryError``) or a device's (XLA's
  ``RESOURCE_EXHAUSTED``) running out: never a damaged file, a lost peer or
  a bug, so nothing is removed or blamed for it."""
  return any(isinstance(e, MemoryError) or str(e).lstrip().startswith('RESOURCE_EXHAUSTED')
             for e in causes(error))


def exit_now(code: int) -> NoReturn:
  """``sys.exit(code)`` for an entry point's last line, without the
  interpreter's final teardown.

  After the ``atexit`` handlers (JAX's own among them: it releases the
  backend and shuts a multi-process job's distributed client down), Python
  still collects every module and runs the native libraries' destructors:
  0.5-1.5 s on a CPU after a run that loaded a few dozen XLA programs, for
  nothing the run needs. This runs the handlers, flushes the standard
  streams and ends the process. Call it only when every output file is
  closed (the entry points' ``main`` returns after that); threads still
  working (a compile-ahead nobody will use) are dropped.
  """
  atexit._run_exitfuncs()  # noqa: SLF001 - what interpreter exit runs first
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
      pass
  os._exit(code)
