"""Resuming runs: which checkpoints a config may continue from, and stopping
cleanly on SIGTERM / SIGINT.

*Identity.* A checkpoint records the config keys that give its state a
meaning — the seed, the data (but ``data.workers``: the threads that read a
batch give the same batch), the model (and the HF model config), every
``train`` key but ``train.epochs`` and ``train.eval_batch_size``, every ``freeze`` key but
``freeze.compile_ahead`` and ``freeze.keep_slot_width`` (they choose which programs run the
same computation), and how the data source prepares its examples where the
config alone does not say it (``inputs.*``: a pretrained checkpoint's image
processor) — and a run refuses a checkpoint whose identity differs, naming
the keys. Left out on purpose: ``train.epochs`` (a run may be
extended; the learning-rate schedule then follows the new total from the
resumed step on), ``train.eval_batch_size`` (evaluation only reads the
state), ``pipeline.*`` (the plan is recomputed for the devices at
hand; with ``train.batch_mode=per_pipeline`` the starting global batch must
stay the same, see :meth:`pipejax.trainer.Trainer.check_resumable`),
``cache.*``, ``checkpoint.*`` and ``resume``; and a key added later
(:data:`ADDED_LATER`) at the value that does what runs before it did.

*Exit codes* of the entry points: 0 done, 2 bad input or a refused
checkpoint (one line), :data:`EXIT_INTERRUPTED` = 75 (``EX_TEMPFAIL``)
stopped on a signal after saving — run the same command to continue —,
:data:`EXIT_ABORTED` = 130 aborted by a second signal (nothing saved beyond
the last checkpoint).
"""
from __future__ import annotations

import hashlib
import json
import logging
import signal
import threading
import time
from typing import Any, Callable

_clock = time.monotonic  # when a signal is handled (a test's clock replaces it)
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: try again (the same command resumes)
EXIT_ABORTED = 130  # 128 + SIGINT, the shell's convention for an interrupt

#: ``freeze`` keys that choose which programs run the same computation.
PROGRAM_CHOICES = ('compile_ahead', 'keep_slot_width')
_EXCLUDED = {'data': ('workers',), 'train': ('epochs', 'eval_batch_size'),
             'freeze': PROGRAM_CHOICES}
_SECTIONS = ('seed', 'data', 'model', 'train', 'freeze')
#: Keys added after checkpoints were written without them, and the value
#: that does what those checkpoints' runs did: at it, a key is left out of
#: the identity (so such a checkpoint still resumes); at any other, it counts.
ADDED_LATER = {'train.decay_biases_and_norms': True, 'train.max_grad_norm': 0.0}
# HF config keys that say which library wrote the config or where it came
# from, not what the model computes: an upgraded transformers (its
# ``transformers_version``, ``torch_dtype`` renamed ``dtype``) or a moved
# checkpoint (``_name_or_path``) must not refuse a resume.
_HF_BOOKKEEPING = ('transformers_version', 'torch_dtype', 'dtype')


def _meaningful(ident: dict[str, Any]) -> dict[str, Any]:
  """``ident`` less the HF config's bookkeeping keys (see
  :data:`_HF_BOOKKEEPING`, and those starting with ``_``)."""
  return {k: v for k, v in ident.items()
          if not (k.startswith('hf.') and (k[3:].startswith('_') or k[3:] in _HF_BOOKKEEPING))}


class CheckpointMismatch(ValueError):
  """A checkpoint written by another model or config."""


def _flatten(tree: Any, prefix: str = '') -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flatten(v, f'{prefix}.{k}' if prefix else str(k)))
  return out


def identity(config, hf_config: dict, bookkeeping: bool = False,
             inputs: dict | None = None) -> dict[str, Any]:
  """The flattened config keys (and HF model config, under ``hf.``) that
  give a checkpoint's state its meaning (see module docstring); with
  ``bookkeeping`` the HF config's bookkeeping keys too (AutoCache's disk
  identity has always held them: left out, every cache written before
  would be refused). ``inputs``: how the data source prepares its examples
  where the config does not say it alone (a pretrained checkpoint's image
  processor, under ``inputs.``; a source's ``preparation``)."""
  c = config.to_dict()
  picked = {}
  for section in _SECTIONS:
    value = c[section]
    if isinstance(value, dict):
      value = {k: v for k, v in value.items() if k not in _EXCLUDED.get(section, ())}
    picked[section] = value
  picked['hf'] = hf_config
  if inputs:
    picked['inputs'] = inputs
  flat = json.loads(json.dumps(_flatten(picked), sort_keys=True, default=str))
  for key, value in ADDED_LATER.items():
    if key in flat and flat[key] == value:
      del flat[key]
  return flat if bookkeeping else _meaningful(flat)


def fingerprint(ident: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def check_identity(meta: dict, ident: dict[str, Any], path: str) -> None:
  """Raises :class:`CheckpointMismatch` (naming up to three differing keys)
  unless checkpoint ``meta`` was written under identity ``ident``."""
  saved = meta.get('identity')
  if saved is None or meta.get('fingerprint') != fingerprint(saved):
    raise CheckpointMismatch(f'checkpoint {path} has no valid identity (not written by this '
                             f'version of pipejax); use another --workdir or '
                             f'--config.resume=False to start over')
  # Checkpoints written before the bookkeeping keys were left out still have them.
  saved, ident = _meaningful(saved), _meaningful(ident)
  if saved == ident:
    return
  keys = sorted(k for k in set(saved) | set(ident) if saved.get(k) != ident.get(k))
  # Config keys before the HF model config they imply.
  keys.sort(key=lambda k: k.startswith('hf.'))
  diff = ', '.join(f'{k}: {saved.get(k, "<absent>")!r} in the checkpoint, '
                   f'{ident.get(k, "<absent>")!r} now' for k in keys[:3])
  more = f' (and {len(keys) - 3} more)' if len(keys) > 3 else ''
  raise CheckpointMismatch(f'checkpoint {path} is from another model or config ({diff}{more}); '
                           f'use another --workdir, or --config.resume=False to start over')


class SecondSignal(KeyboardInterrupt):
  """What :class:`StopOnSignal` raises on a second signal."""


def _not_a_second_signal(record: logging.LogRecord) -> bool:
  """A logging filter: False for a record of a :class:`SecondSignal` (orbax
  logs an exception in the checkpoint wait it interrupts as a failed save,
  with a traceback, although the save goes on and the abort is one line)."""
  return not (record.exc_info and isinstance(record.exc_info[1], SecondSignal))


class StopOnSignal:
  """While active, the first SIGTERM or SIGINT asks training to stop after
  the current step (:attr:`requested`, polled by the trainer, which then
  saves and raises :class:`pipejax.trainer.TrainingInterrupted`); a second
  one raises :class:`SecondSignal`, a ``KeyboardInterrupt``, at once (absl's
  log, orbax's, leaves it out while active). One repeat of the first signal
  counts as a copy of it when it comes before the trainer has polled the
  request, or within :attr:`SAME_DELIVERY_SECONDS`: a tool that signals both
  the process and its group (GNU ``timeout``; a job scheduler that signals
  every process of a job, :func:`pipejax.distributed.supervise`'s child
  among them, while the supervisor forwards its own copy) delivers it twice
  at once, which must not abort the save. (Python runs handlers
  between bytecodes, so a copy that arrived during a long step is handled
  only after it: the poll, not a clock, tells the copies apart.) Outside the
  main thread it does nothing (Python delivers signals to the main thread
  only).

  Args:
    log: one-line messages.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)
  SAME_DELIVERY_SECONDS = 0.1  # far below a person's two presses of Ctrl-C

  def __init__(self, log: Callable[[str], None] = print):
    self.log = log
    self.requested = False
    self._first: tuple[int, float] | None = None  # the first signal and when it was handled
    self._polled = False  # the trainer has seen the request
    self._copy_taken = False  # one copy of the first signal is allowed for
    self._previous: dict[int, Any] = {}

  def __call__(self) -> bool:
    if self.requested:
      self._polled = True
    return self.requested

  def _handle(self, signum, frame) -> None:  # noqa: ARG002
    name = signal.Signals(signum).name
    now = _clock()
    if (self._first is not None and self._first[0] == signum and not self._copy_taken
        and (not self._polled or now - self._first[1] < self.SAME_DELIVERY_SECONDS)):
      self._copy_taken = True
      return  # the first signal delivered twice, not a second one
    if self.requested:
      for s in self.SIGNALS:  # a third signal gets the default behaviour
        signal.signal(s, signal.SIG_DFL)
      raise SecondSignal(f'second signal ({name})')
    self.requested, self._first = True, (signum, now)
    self.log(f'{name}: finishing the current step, saving a checkpoint, then exiting with code '
             f'{EXIT_INTERRUPTED} (another signal aborts at once; until this step has '
             f'ended, one more {name} may be this one delivered twice, so it takes two)')

  def __enter__(self) -> 'StopOnSignal':
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
      logging.getLogger('absl').addFilter(_not_a_second_signal)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous.clear()
    logging.getLogger('absl').removeFilter(_not_a_second_signal)
