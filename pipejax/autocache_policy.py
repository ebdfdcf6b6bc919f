"""When AutoCache should serve the frozen prefix (paper §3.4 "timing of
caching", §4.3.5), and when it must not (random augmentation).

Caching costs a write the first epoch at a depth and a read every epoch after;
running the prefix costs its forward every epoch, growing with the depth. The
paper measured that caching pays from 3 frozen layers for ViT-B and 5 for
BERT-large on its hardware; here the decision comes from timings measured on
the machine at hand, and is taken again at every depth change.

The trainer, per depth F (after a freeze event, or at the start)::

  profiler.reset()
  # a few steps with the prefix run directly: time it (block_until_ready)
  profiler.record(forward_seconds=...)
  write_s, read_s = cache.measure_io(hidden_of_one_batch)
  profiler.record(read_seconds=read_s, write_seconds=write_s)
  decision = profiler.decide(F, filled=...)   # logs one line with its inputs
  use_cache = decision.use_cache and caching_allowed(...)
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable


@dataclasses.dataclass(frozen=True)
class CachingDecision:
  """Whether caching beats recomputing the frozen prefix, with its inputs.

  Costs are seconds per batch summed over ``epochs_ahead`` epochs at this
  depth: ``seconds_without = epochs_ahead · forward``; with the cache, the
  entries that are not there yet (all, unless ``filled``) cost ``forward +
  write`` once, then ``read`` each remaining epoch.
  """
  num_frozen_layers: int
  use_cache: bool
  forward_seconds: float
  read_seconds: float
  write_seconds: float
  epochs_ahead: int
  filled: bool
  seconds_without: float
  seconds_with: float

  def describe(self) -> str:
    verdict = 'use the cache' if self.use_cache else 'run the prefix'
    return (f'autocache: F={self.num_frozen_layers}: {verdict} (per batch over '
            f'{self.epochs_ahead} epochs: cache {self.seconds_with:.4f}s vs forward '
            f'{self.seconds_without:.4f}s; forward {self.forward_seconds:.4f}s, read '
            f'{self.read_seconds:.4f}s, write {self.write_seconds:.4f}s, '
            f'{"filled" if self.filled else "empty"})')


def decide_caching(num_frozen_layers: int, forward_seconds: float, read_seconds: float,
                   write_seconds: float, epochs_ahead: int, filled: bool = False
                   ) -> CachingDecision:
  """Compares caching with recomputation for one depth (pure).

  Args:
    num_frozen_layers: the depth F (0 never caches: there is no frozen prefix).
    forward_seconds: the frozen prefix's forward for one batch at depth F.
    read_seconds / write_seconds: reading / writing one batch of entries.
    epochs_ahead: epochs expected at this depth (the freeze timestep, or the
      epochs left); with 1 and an empty cache, caching cannot pay.
    filled: the entries already exist at this depth (advanced or reopened).
  """
  if epochs_ahead < 1:
    raise ValueError(f'epochs_ahead must be >= 1, got {epochs_ahead}')
  without = epochs_ahead * forward_seconds
  if filled:
    with_cache = epochs_ahead * read_seconds
  else:
    with_cache = forward_seconds + write_seconds + (epochs_ahead - 1) * read_seconds
  use = num_frozen_layers > 0 and with_cache < without
  return CachingDecision(num_frozen_layers, use, forward_seconds, read_seconds, write_seconds,
                         epochs_ahead, filled, without, with_cache)


class CachingProfiler:
  """Collects per-batch timings at one depth and decides from their medians.

  Args:
    epochs_ahead: see :func:`decide_caching`.
    log: where each decision's one line goes.
  """

  def __init__(self, epochs_ahead: int, log: Callable[[str], None] = print):
    self.epochs_ahead, self.log = epochs_ahead, log
    self.decisions: list[CachingDecision] = []
    self.reset()

  def reset(self) -> None:
    """Forgets the timings (at a depth change: the forward got longer)."""
    self.timings: dict[str, list[float]] = {'forward': [], 'read': [], 'write': []}

  def record(self, forward_seconds: float | None = None, read_seconds: float | None = None,
             write_seconds: float | None = None) -> None:
    """Adds one batch's measurements (any subset)."""
    for name, value in (('forward', forward_seconds), ('read', read_seconds),
                        ('write', write_seconds)):
      if value is not None:
        self.timings[name].append(float(value))

  def ready(self) -> bool:
    """Whether forward, read and write have each been measured."""
    return all(self.timings.values())

  def decide(self, num_frozen_layers: int, filled: bool = False) -> CachingDecision:
    """Decides with the medians recorded since :meth:`reset` and logs it."""
    if not self.ready():
      missing = [k for k, v in self.timings.items() if not v]
      raise ValueError(f'caching decision at F={num_frozen_layers} lacks timings of {missing}')
    decision = decide_caching(num_frozen_layers,
                              *(statistics.median(self.timings[k])
                                for k in ('forward', 'read', 'write')),
                              epochs_ahead=self.epochs_ahead, filled=filled)
    self.decisions.append(decision)
    self.log(decision.describe())
    return decision


def caching_allowed(randomly_augmented: bool, accept_reused_augmentation: bool,
                    log: Callable[[str], None] = print) -> bool:
  """The augmentation guard: a cache serves one augmentation draw of each
  sample forever, so a randomly augmented prefix input is cached only when
  the config accepts that explicitly. Returns whether caching may be used;
  a refusal (and an acceptance) is logged in one line."""
  if not randomly_augmented:
    return True
  if accept_reused_augmentation:
    log('autocache: the prefix input is randomly augmented; caching reuses one augmentation '
        'per sample, as the config accepts')
    return True
  log('autocache: disabled: the prefix input is randomly augmented and caching would reuse '
      'one augmentation per sample forever (set accept_reused_augmentation to allow it)')
  return False
