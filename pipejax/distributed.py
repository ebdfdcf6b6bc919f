"""Several processes (hosts) in one job: JAX's multi-controller runtime.

Every process runs the same command; :func:`initialize` joins it to the job
(``jax.distributed.initialize``, gloo collectives on the CPU) before any JAX
computation. The job's devices are then ordered process by process
(:func:`ordered_devices`), so that each row of the ``('data', 'stage')`` mesh,
one replica's K stages, lies inside one process: the stage axis (activations
every tick) stays on a host, only the data axis (a gradient mean per step)
crosses hosts. A plan whose pipeline is longer than a process's devices is
refused (:func:`check_pipeline_length`).

Data: the global batch of every step is the concatenation, in shard order, of
the local batches of ``data_shards`` disjoint shards of the sample IDs
(:class:`pipejax.data.ShardedLoader`); each process reads only its own shards
and hands its part to JAX with :func:`put_batch`. A single process can read
all shards itself, which gives the same global batches, hence the same
losses, as the multi-process job.

Failure: when a process dies, JAX's coordination service notices (a closed
connection at once, a silent host after ``heartbeat_timeout_seconds``) and
aborts every other process from C++ with a stack trace. :func:`supervise` runs
the training in a child process and turns that into one line naming the last
checkpoint, so that relaunching the same command resumes the job. A process
that stops with an error of its own (bad input on its host, a full disk, a
bug) tells the others through the coordination service before it exits
(:func:`tell_job_of_error`); they stop within seconds, in one line that
names that process and its error (:func:`watch_for_failures`), instead of
waiting in their next collective until the heartbeat times out.
"""
from __future__ import annotations

import atexit
import collections
import ctypes
import hashlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # annotations only: functions import numpy and JAX where they use them
  import numpy as np

SUPERVISED_ENV = 'PIPEJAX_SUPERVISED'  # set in the child that trains
# What the C++ runtime logs when a peer (or the coordinator) is gone.
_PEER_LOST = re.compile(r'heartbeat timeout|detected fatal errors|Polled an error from coordination'
                        r'|coordination service|Socket closed|Connection reset|Gloo')
_ABSL_LINE = re.compile(r'^[EFW]\d{4} \d\d:\d\d:\d\d')
_LEFT_FOR_PEER = re.compile(r'error: process \d+ stopped: process \d+ failed: ')  # _leave's line
# A key in the coordination service's key-value store (it lives as long as the
# job): a failed process's one-line error.
_FAILED = 'pipejax/failed/'  # + the failed process's index
_failing = threading.Event()  # set once this process ends with its own error
_leaving = threading.Event()  # set once another process's error ends this one
_leave_lock = threading.Lock()  # held by whichever thread ends this process for that


class DistributedError(ValueError):
  """A multi-process set-up that cannot work (bad flags, a pipeline longer
  than a process's devices, ...)."""


def is_multi_process(config) -> bool:
  """Whether ``config.distributed`` asks to join a job of several processes."""
  c = config.distributed
  return bool(c.coordinator) and (c.coordinator == 'auto' or c.num_processes > 1)


def check_config(config) -> None:
  """Validates ``config.distributed`` (before anything starts)."""
  c = config.distributed
  if c.coordinator and c.coordinator != 'auto':
    if not re.fullmatch(r'[^\s:]+:\d+', c.coordinator):
      raise DistributedError(f"distributed.coordinator must be 'host:port' or 'auto', got "
                             f'{c.coordinator!r}')
    port = int(c.coordinator.rsplit(':', 1)[1])
    if not 1 <= port <= 65535:  # else every process waits out the timeout to fail
      raise DistributedError(f'distributed.coordinator={c.coordinator!r}: the port must be in '
                             f'[1, 65535], got {port}')
    if c.num_processes < 1 or not 0 <= c.process_id < c.num_processes:
      raise DistributedError(f'distributed.process_id={c.process_id} must be in [0, '
                             f'num_processes={c.num_processes})')
  if not c.coordinator and (c.num_processes != 1 or c.process_id != 0):
    raise DistributedError(f'distributed.num_processes={c.num_processes} and process_id='
                           f'{c.process_id} need distributed.coordinator (host:port, or auto); '
                           f'without it every process would run the whole job alone')
  if c.data_shards < 0:
    raise DistributedError(f'distributed.data_shards must be >= 0, got {c.data_shards}')
  if c.initialization_timeout_seconds < 1:
    raise DistributedError(f'distributed.initialization_timeout_seconds must be >= 1, got '
                           f'{c.initialization_timeout_seconds}')
  if c.heartbeat_timeout_seconds < 1:
    raise DistributedError(f'distributed.heartbeat_timeout_seconds must be >= 1, got '
                           f'{c.heartbeat_timeout_seconds}')


def initialize(config, log: Callable[[str], None] = print) -> None:
  """Joins the job described by ``config.distributed`` (a no-op for a single
  process). Must run before any JAX computation (before ``jax.devices()``).

  ``coordinator='host:port'`` with ``num_processes`` and ``process_id`` names
  the job explicitly (the same coordinator on every process, process 0
  serves it); ``'auto'`` lets JAX detect the cluster (SLURM, Open MPI, TPU
  pods, ...).
  """
  check_config(config)
  if not is_multi_process(config):
    return
  import jax  # noqa: PLC0415 - callers set up the environment first
  c = config.distributed
  if (os.environ.get('JAX_PLATFORMS', '') or 'cpu').startswith('cpu'):
    # CPU devices of different processes talk through gloo (TCP).
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # JAX's preemption service installs its own SIGTERM handler over the run's
  # (pipejax.resume.StopOnSignal): a SIGTERM to one process was then ignored.
  # The run agrees on a stop itself (agreed_stop).
  jax.config.update('jax_enable_preemption_service', False)
  kwargs = {} if c.coordinator == 'auto' else dict(
      coordinator_address=c.coordinator, num_processes=c.num_processes,
      process_id=c.process_id)
  if kwargs and c.process_id == 0:
    check_coordinator_port(c.coordinator)
  try:
    jax.distributed.initialize(**kwargs,
                               initialization_timeout=c.initialization_timeout_seconds,
                               heartbeat_timeout_seconds=c.heartbeat_timeout_seconds,
                               shutdown_timeout_seconds=c.heartbeat_timeout_seconds)
  except ValueError as e:  # e.g. 'auto' outside a cluster JAX recognises
    detail = first_line(str(e)) or type(e).__name__
    raise DistributedError(f'cannot join the job (distributed.coordinator={c.coordinator!r}): '
                           f'{detail}') from e
  log(f'process {jax.process_index()} of {jax.process_count()} joined the job '
      f'({jax.local_device_count()} local devices, {jax.device_count()} in all)')


def check_coordinator_port(coordinator: str) -> None:
  """Raises :class:`DistributedError` unless process 0 can serve the job's
  coordinator on the port of ``coordinator`` ('host:port'), on every
  interface as JAX does: a port held by another program (or by an earlier
  run of the job still alive) failed inside JAX with a traceback, or with a
  crash that printed nothing."""
  port = int(coordinator.rsplit(':', 1)[1])
  try:
    if socket.has_dualstack_ipv6():
      probe = socket.create_server(('', port), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
      probe = socket.create_server(('', port))
  except OSError as e:
    raise DistributedError(
        f'process 0 cannot serve the job\'s coordinator on port {port} '
        f'(distributed.coordinator={coordinator!r}): {e.strerror or e}; stop what holds the '
        f'port (an earlier run of this job?) or give every process another port') from e
  probe.close()


def config_digest(config, workdir: str | None) -> float:
  """What must be the same on every process, as one float64 (48 bits of a
  SHA-256): the whole configuration but ``distributed.process_id`` and
  ``pipeline.profile_path`` (a job of several processes needs
  ``pipeline.micro_batches`` and never reads the profile; its default is
  under each host's own home), and the workdir."""
  flat = config.to_dict()
  flat.get('distributed', {}).pop('process_id', None)
  flat.get('pipeline', {}).pop('profile_path', None)
  # No workdir is '' on every process (not each one's current directory).
  return _digest(json.dumps(flat, sort_keys=True, default=str) + '\0' + (
      os.path.abspath(workdir) if workdir else ''))


def _digest(text: str) -> float:
  """48 bits of ``text``'s SHA-256, as a float64 (exact through
  :func:`gather_exact`)."""
  return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], 'little'))


def _differing_processes(config, digest: float) -> list[int]:
  """The processes whose ``digest`` differs from process 0's (none in a
  job of one process). Collective with several processes: every process
  calls it at the same point."""
  import jax  # noqa: PLC0415
  if not is_multi_process(config) or jax.process_count() == 1:  # the job initialize joined
    return []
  digests = gather_exact([digest])[:, 0]
  return [i for i, d in enumerate(digests.tolist()) if d != digests[0]]


def name_processes(indices: list[int]) -> str:
  """``'process 1'``, ``'processes 0, 2'``: the processes of a one-line error."""
  return f'process{"es" * (len(indices) > 1)} {", ".join(map(str, indices))}'


def processes_where(flag: bool) -> list[int]:
  """The processes whose ``flag`` is set, in order (one process: ``[0]`` or
  ``[]``). Collective with several processes: every process calls it at the
  same point."""
  import jax  # noqa: PLC0415
  if jax.process_count() == 1:
    return [0] if flag else []
  flags = gather_exact([float(bool(flag))])[:, 0]
  return [i for i, f in enumerate(flags.tolist()) if f]


def check_same_config(config, workdir: str | None) -> None:
  """Refuses, on every process at once, a job whose processes were started
  with different configurations or workdirs (each would train its replica
  its own way, or the collectives would stop matching later). Collective
  with several processes: every process calls it at the same point.

  Raises:
    DistributedError: the processes that differ from process 0.
  """
  _refuse_differences(config, config_digest(config, None), lambda were: (
      f'{were} started with another configuration than process 0: start every process with '
      f'the same command line (but distributed.process_id; a path key starting with ~ is '
      f'each host\'s home)'))
  here = os.path.abspath(workdir) if workdir else ''
  _refuse_differences(config, _digest(here), lambda were: (
      f'{were} started with another --workdir than process 0 (this process: '
      f'{here or "none"}): give every process the same absolute path (a relative one is '
      f'resolved in each process\'s own current directory)'))


def check_same_data(config, description: str) -> None:
  """Refuses, on every process at once, a job whose processes resolved
  different data sets (``description``: the data set's name and sizes as
  this process found it; ``data.name='auto'`` looks for ImageNet on each
  host's own disk). Collective with several processes, as
  :func:`check_same_config`.

  Raises:
    DistributedError: the processes that differ from process 0.
  """
  _refuse_differences(config, _digest(description), lambda _: (
      f'found another data set than process 0 (this process: {description}): give every '
      f'host the same data (data.name, data.data_dir or TFDS_DATA_DIR)'))


def _refuse_differences(config, digest: float, why: Callable[[str], str]) -> None:
  """Raises :class:`DistributedError`, on every process at once, where a
  process's ``digest`` differs from process 0's: the processes named, then
  ``why(were)`` (``were``: 'was' or 'were', as many as they are).
  Collective with several processes, as :func:`_differing_processes`."""
  differ = _differing_processes(config, digest)
  if differ:
    raise DistributedError(
        f'{name_processes(differ)} {why("were" if len(differ) > 1 else "was")}')


SHARED_MARK = '.shared.process_{}'  # a process's mark in a folder every process must share


def check_shared_folder(folder: str, flag: str = '--workdir',
                        wait_seconds: float = 10.0) -> None:
  """Refuses, on every process at once, a ``folder`` that is not one folder
  for the whole job: the same path on hosts that do not share it, which a
  job's checkpoints cannot live in (it would train until its first save).
  Each process writes a mark with a random token into ``folder``; each must
  then read every other process's token there, within ``wait_seconds`` (a
  network file system may show a new file late). The marks are removed once
  every process has looked. Collective with several processes, as
  :func:`check_same_config`; nothing with one.

  Raises:
    DistributedError: the processes that did not find the others' marks.
  """
  import jax  # noqa: PLC0415
  if jax.process_count() <= 1:
    return
  import secrets  # noqa: PLC0415
  import time  # noqa: PLC0415
  from pipejax import diskcache  # noqa: PLC0415
  index = jax.process_index()
  own = os.path.join(folder, SHARED_MARK.format(index))
  token = secrets.randbits(52) | 1  # exact in float64; 0 stands for "wrote no mark"
  try:
    diskcache.write_atomic(own, lambda f: f.write(str(token)))
  except OSError:  # an unwritable folder is refused where it is written first
    token = 0

  def read(j: int) -> int:
    try:
      with open(os.path.join(folder, SHARED_MARK.format(j)), encoding='ascii') as f:
        return int(f.read().strip() or 0)
    except (OSError, ValueError):
      return 0

  try:
    tokens = gather_exact([float(token)])[:, 0]
    others = {j: int(t) for j, t in enumerate(tokens.tolist()) if j != index and t}
    deadline = time.monotonic() + wait_seconds
    unseen = [j for j, t in others.items() if read(j) != t]
    while unseen and time.monotonic() < deadline:
      time.sleep(0.2)
      unseen = [j for j in unseen if read(j) != others[j]]
    blind = processes_where(bool(unseen))
  finally:  # every process has looked by now (or the job is ending)
    if token:
      try:
        os.remove(own)
      except OSError:
        pass
  if blind:
    raise DistributedError(
        f'{flag}={folder} is not one folder shared by every process: {name_processes(blind)} '
        f'did not find in it what the other processes wrote; give every process the same '
        f'folder on a file system that every host mounts')


def ordered_devices(devices: Sequence | None = None) -> list:
  """``devices`` (default: all) ordered by process, then by ID: consecutive
  devices share a process, so every mesh row built from them stays in one."""
  import jax  # noqa: PLC0415
  devices = list(jax.devices() if devices is None else devices)
  return sorted(devices, key=lambda d: (d.process_index, d.id))


def pipeline_span(devices: Sequence) -> int:
  """The devices a pipeline may span: all of them in one process, else the
  greatest common divisor of the processes' device counts (a pipeline
  length fits every process, :func:`check_pipeline_length`, where it
  divides this, for ``devices`` ordered by process)."""
  per_process = _devices_per_process(devices)
  return len(devices) if len(per_process) == 1 else math.gcd(*per_process.values())


def _devices_per_process(devices: Sequence) -> dict[int, int]:
  """How many of ``devices`` each process has, by process index."""
  return dict(collections.Counter(d.process_index for d in devices))


def check_pipeline_length(pipeline_length: int, devices: Sequence) -> None:
  """Raises :class:`pipejax.pipeline.PlanError` unless every group of
  ``pipeline_length`` consecutive ``devices`` (one replica's stages) lies in
  one process."""
  from pipejax.pipeline import PlanError  # noqa: PLC0415 - pipeline imports this module
  per_process = _devices_per_process(devices)
  if len(per_process) == 1:
    return
  local = min(per_process.values())
  rows = [devices[i:i + pipeline_length] for i in range(0, len(devices), pipeline_length)]
  if any(len({d.process_index for d in row}) > 1 for row in rows):
    span = math.gcd(*per_process.values())  # as pipeline_span: what divides every count
    fitting = [k for k in range(1, span + 1) if span % k == 0]
    raise PlanError(f'pipeline length {pipeline_length} does not fit in one process '
                    f'({local} devices per process; the stage axis must stay inside a host); '
                    f'use one of {fitting}')


def put_batch(tree, sharding):
  """Places a batch on ``sharding`` (split along axis 0).

  With one process ``tree`` is the whole batch. With several it is this
  process's part, and the global batch is the parts concatenated in process
  order (``sharding``'s devices must be ordered by process, see
  :func:`ordered_devices`).
  """
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  count = jax.process_count()
  if count == 1:
    return jax.device_put(tree, sharding)
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(
          sharding, np.asarray(x), (np.shape(x)[0] * count,) + np.shape(x)[1:]), tree)


def gather_exact(values) -> np.ndarray:
  """Every process's ``values [n]`` (float64), stacked in process order as
  ``[processes, n]``, bit for bit; one process: ``values[None]``.

  Collective with several processes: every process must call it at the same
  point of the run (like a train step). ``process_allgather`` goes through JAX
  arrays, 32-bit unless ``jax_enable_x64``; the values travel as their bytes so
  that large counters and timings arrive unrounded, and every process combines
  the very same numbers (the same decision everywhere).
  """
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  values = np.ascontiguousarray(np.asarray(values, np.float64).reshape(-1))
  count = jax.process_count()
  if count == 1:
    return values[None]
  from jax.experimental import multihost_utils  # noqa: PLC0415
  raw = np.frombuffer(values.tobytes(), np.uint8).astype(np.int32)
  gathered = np.asarray(multihost_utils.process_allgather(raw)).astype(np.uint8)
  return np.frombuffer(gathered.tobytes(), np.float64).reshape(count, len(values))


def gather_max(values) -> np.ndarray:
  """The elementwise maximum over the processes of the integers ``values
  [n]`` (each in [0, 2**31)), as int64; one process: ``values``. Collective
  with several processes, like :func:`gather_exact`."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  values = np.asarray(values, np.int64).reshape(-1)
  if jax.process_count() == 1:
    return values
  from jax.experimental import multihost_utils  # noqa: PLC0415
  gathered = multihost_utils.process_allgather(values.astype(np.int32))
  return np.asarray(gathered).reshape(jax.process_count(), len(values)).max(axis=0).astype(
      np.int64)


def is_main_process() -> bool:
  """Whether this process writes the run's files (metrics, summary, plots)."""
  import jax  # noqa: PLC0415
  return jax.process_index() == 0


# -- failure handling ------------------------------------------------------------------
def _child_setup() -> None:
  """In the child: its own process group (a terminal's Ctrl-C reaches only
  the supervisor, which forwards it once), and SIGKILL when the supervisor
  dies (Linux), so a killed host takes its training with it."""
  os.setpgid(0, 0)
  try:
    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except OSError:
    pass


def supervise(argv: Sequence[str], settings, checkpoint_dir: str | None) -> int:
  """Runs ``argv`` (this very command) as a child and returns its exit code.

  ``settings`` is the run's ``config.distributed``.

  The child's output passes through, except the C++ runtime's crash report
  when a peer is lost: from the first such line on, stderr is kept in
  ``<checkpoint_dir>/../process_<id>.crash.log`` and replaced by one line
  (exit code 3) naming the last checkpoint, or saying that the job could not
  be joined. A child that stopped with its own one-line error (bad input,
  exit code 2; another process's error, exit code 3) keeps it, without the
  runtime's report.
  """
  env = dict(os.environ, **{SUPERVISED_ENV: '1'})
  child = subprocess.Popen(list(argv), env=env, stderr=subprocess.PIPE,
                           preexec_fn=_child_setup if sys.platform == 'linux' else None)

  def forward(signum, _frame):
    child.send_signal(signum)

  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, forward)
  swallowed: list[bytes] = []
  lost = own_error = for_peer = False
  for line in iter(child.stderr.readline, b''):
    # A progress bar before a line ends its own with '\r', not '\n'.
    text = line.decode(errors='replace').rsplit('\r', 1)[-1]
    # The child's own one-line error passes; after the runtime's report, only
    # the line that names another process's error (watch_for_failures).
    peer = bool(_LEFT_FOR_PEER.match(text))
    own = text.startswith('error: ') and (peer or not lost)
    own_error, for_peer = own_error or own, for_peer or peer
    lost = lost or bool(_ABSL_LINE.match(text) and _PEER_LOST.search(text))
    if lost and not own:
      swallowed.append(line)
    else:
      sys.stderr.buffer.write(line)
      sys.stderr.flush()
  code = child.wait()
  auto = settings.coordinator == 'auto'  # the rank is JAX's guess, not known here
  process_id = None if auto else settings.process_id
  if for_peer:  # the child named another process's error; the runtime's report is kept
    _keep_crash_log(swallowed, checkpoint_dir, process_id)
    return code if code > 0 else 3
  if own_error:  # the child said what went wrong; the runtime's exit report adds nothing
    return code if code > 0 else 2
  if code == 0 or not lost:
    return code if code >= 0 else 128 - code
  crash_log = _keep_crash_log(swallowed, checkpoint_dir, process_id)
  who = f'process {process_id}' if process_id is not None else 'this process'
  log = f' (runtime log: {crash_log})' if crash_log else ''
  if any(b'RegisterTask' in line for line in swallowed):  # never joined
    ranks = ('' if auto else f', each with its own distributed.process_id in '
             f'0..{settings.num_processes - 1}')
    print(f'error: {who} could not join the job at {settings.coordinator} within '
          f'{settings.initialization_timeout_seconds}s: start the same command on every '
          f'host{ranks} (process 0 serves the coordinator; check its address and port){log}',
          file=sys.stderr, flush=True)
    return 3
  print(f'error: {who} stopped: another process of the job died or stopped '
        f'responding (detected by the JAX coordination service, heartbeat timeout '
        f'{settings.heartbeat_timeout_seconds}s); last checkpoint: '
        f'{_latest_checkpoint(checkpoint_dir)}; relaunch the same command on every host to '
        f'resume{log}', file=sys.stderr, flush=True)
  return 3


def _keep_crash_log(lines: list[bytes], checkpoint_dir: str | None,
                    process_id: int | None) -> str | None:
  """Writes the runtime's swallowed report to ``<workdir>/process_<id>.crash.log``
  (``<host>_pid_<pid>`` without a known rank: containers on several hosts
  often give their processes the same pid); returns its path, or None when
  there is nothing to keep or no workdir."""
  if not lines or not checkpoint_dir:
    return None
  host = re.sub(r'[^A-Za-z0-9._-]', '_', socket.gethostname()) or 'host'
  name = f'process_{process_id}' if process_id is not None else f'{host}_pid_{os.getpid()}'
  crash_log = os.path.join(os.path.dirname(checkpoint_dir), f'{name}.crash.log')
  os.makedirs(os.path.dirname(crash_log), exist_ok=True)
  with open(crash_log, 'wb') as f:
    f.writelines(lines)
  return crash_log


def exit_if_peer_lost(error: Exception, checkpoint_dir: str | None = None) -> None:
  """With several processes, a failed computation (a collective whose peer
  is gone) ends this process in one line naming the newest checkpoint in
  ``checkpoint_dir``, with exit code 3, without the exit handlers
  (``jax.distributed.shutdown`` would wait for the lost peer). Where the
  process that failed first said why (:func:`tell_job_of_error`), the line
  names it and its error, as :func:`watch_for_failures` does."""
  import jax  # noqa: PLC0415
  if jax.process_count() == 1:
    return
  wait_if_leaving()
  me = jax.process_index()
  failures = _peer_failures(_client(), me)
  if failures:
    _leave(me, failures, checkpoint_dir)
  detail = first_line(str(error), 200) or type(error).__name__
  _print_flushed(f'error: process {me} stopped: a computation across processes failed '
                 f'({detail}); another process probably died; last checkpoint: '
                 f'{_latest_checkpoint(checkpoint_dir)}; relaunch the same command on every '
                 f'host to resume')
  os._exit(3)  # noqa: SLF001 - see the docstring


def first_line(text: str, limit: int | None = None) -> str:
  """The first line of ``text`` (stripped; '' when it is empty), cut at
  ``limit`` characters: an error in one line."""
  lines = text.strip().splitlines()
  return lines[0][:limit] if lines else ''


def _print_flushed(line: str) -> None:
  print(line, file=sys.stderr, flush=True)
  sys.stdout.flush()


def _client():
  """The job's client of JAX's coordination service; None in a single
  process (or before :func:`initialize` joined a job)."""
  try:
    from jax._src import distributed as jax_distributed  # noqa: PLC0415
  except ImportError:
    return None
  client = getattr(getattr(jax_distributed, 'global_state', None), 'client', None)
  if client is None:
    return None
  import jax  # noqa: PLC0415
  return client if jax.process_count() > 1 else None


def _peer_failures(client, me: int) -> list[tuple[int, str]]:
  """``[(process, its error)]`` of the other processes that said they end
  with an error of their own; empty where the coordination service cannot be
  asked."""
  if client is None:
    return []
  try:
    entries = client.key_value_dir_get(_FAILED)
  except Exception:  # noqa: BLE001 - the service is gone with its process: nothing known
    return []
  failures = []
  for key, message in entries:
    index = key.rsplit('/', 1)[-1]
    if index.isdigit() and int(index) != me:
      failures.append((int(index), message))
  return sorted(failures)


def tell_job_of_error(message: str) -> None:
  """Tells the other processes of a job that this one ends with an error of
  its own (``message``: the error, already printed here; its first line is
  sent); a no-op with one process.

  They would otherwise wait for this process in their next collective until
  the heartbeat timed out, then blame a lost peer. Their
  :func:`watch_for_failures` reads the message from the coordination service
  and ends them; this process then exits as usual, and JAX's shutdown at exit
  waits for them to leave the job with it.
  """
  client = _client()
  if client is None:
    return
  import jax  # noqa: PLC0415
  _failing.set()
  first = first_line(message, 500)
  try:
    client.key_value_set(f'{_FAILED}{jax.process_index()}', first)
  except Exception:  # noqa: BLE001 - no service (its process died): nobody to tell
    pass


def watch_for_failures(checkpoint_dir: str | None, interval_seconds: float = 0.5,
                       settle_seconds: float = 2.0) -> Callable[[], None] | None:
  """With several processes, starts a daemon thread that ends this process
  (exit code 3) in one line as soon as another process says that it ends with
  an error of its own (:func:`tell_job_of_error`): the line names that
  process, its error and the newest checkpoint in ``checkpoint_dir``. Returns
  the function that stops the thread, which runs at this process's exit (an
  exit that began first wins); None with one process, where nothing starts.

  The thread asks the coordination service every ``interval_seconds``. It
  gives this process ``settle_seconds`` to fail as well before it acts: a
  refusal that every process reaches together (a collective check) ends each
  one with its own line. (A refusal that processes reach more than that apart
  ends the later ones with the first one's line, exit code 3.) It leaves the
  job with JAX's shutdown, which the failed process waits for at its exit,
  while this process's main thread may wait in a collective that never ends.
  """
  client = _client()
  if client is None:
    return None
  import jax  # noqa: PLC0415
  me = jax.process_index()
  stopped = threading.Event()

  def stop() -> None:  # blocks for good where the thread is leaving already
    with _leave_lock:
      stopped.set()

  atexit.register(stop)  # runs before JAX's shutdown (registered at its import)

  def watch() -> None:
    while not stopped.wait(interval_seconds) and not _failing.is_set():
      failures = _peer_failures(client, me)
      if failures and not _failing.wait(settle_seconds):  # else: its own error ends it
        _leave(me, failures, checkpoint_dir, unless=stopped)

  threading.Thread(target=watch, name='pipejax-peer-failures', daemon=True).start()
  return stop


def _leave(me: int, failures: list[tuple[int, str]], checkpoint_dir: str | None,
           unless: threading.Event | None = None) -> None:
  """Ends this process (exit code 3) in one line naming the ``failures`` of
  other processes, once, from whichever thread comes first; returns only if
  ``unless`` was set (this process is exiting already)."""
  with _leave_lock:
    if unless is not None and unless.is_set():
      return
    _leaving.set()
    try:
      # On a line of its own, after any progress bar.
      causes = '; '.join(f'process {p} failed: {m}' for p, m in failures)
      _print_flushed(f'\nerror: process {me} stopped: {causes}; last checkpoint: '
                     f'{_latest_checkpoint(checkpoint_dir)}; relaunch the same command on '
                     f'every host to resume once that is fixed')
      import jax  # noqa: PLC0415
      jax.distributed.shutdown()  # what the failed process waits for at its exit
    except BaseException:  # noqa: BLE001 - the job is gone already; leave all the same
      pass
    finally:
      os._exit(3)  # noqa: SLF001 - the main thread may wait in a collective forever


def wait_if_leaving() -> None:
  """Blocks for good if another process's error is ending this one
  (:func:`_leave` exits the process): the errors that leaving the job raises
  in this thread must not print over the line that says why."""
  if _leaving.is_set():
    threading.Event().wait()


def _latest_checkpoint(checkpoint_dir: str | None) -> str:
  """The newest finished orbax step directory (read from the file system: the
  job's runtime is gone)."""
  try:
    steps = [int(n) for n in os.listdir(checkpoint_dir) if n.isdigit()] if checkpoint_dir else []
  except OSError:  # none, or unreadable: nothing to name
    return 'none'
  return os.path.join(checkpoint_dir, str(max(steps))) if steps else 'none'


def agreed_stop(stop_requested: Callable[[], bool] | None,
                every: int = 10) -> Callable[[], bool] | None:
  """``stop_requested`` made safe for several processes.

  A checkpoint save is collective, so every process must decide to stop at
  the same step. With several processes the returned poll combines the
  local requests across processes (stop when any process was asked) at
  every ``every``-th poll and answers False in between; every process polls
  the same sequence (after each step and at each epoch's end), so they agree.
  One process: ``stop_requested`` itself.
  """
  import jax  # noqa: PLC0415
  if stop_requested is None or jax.process_count() == 1:
    return stop_requested
  from jax.experimental import multihost_utils  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  polls = 0

  def poll() -> bool:
    nonlocal polls
    polls += 1
    if polls % every:
      return False
    local = np.array([1 if stop_requested() else 0], np.int32)
    return bool(np.any(multihost_utils.process_allgather(local)))

  return poll
