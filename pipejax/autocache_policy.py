"""When AutoCache should serve the frozen prefix (paper §3.4 "timing of
caching", §4.3.5), and when it must not (random augmentation).

Caching costs a write the first epoch at a depth and a read every epoch after;
running the prefix costs its forward every epoch, growing with the depth. The
paper measured that caching pays from 3 frozen layers for ViT-B and 5 for
BERT-large on its hardware; here the decision comes from timings measured on
the machine at hand, and is taken again at every depth change — measured,
unless :func:`keep_caching` proves the answer: a filled cache that beat the
forward at depth F beats it at every deeper F' (its entries have the same shape
at every depth, so a read costs the same; the forward through F' blocks costs
at least the forward through F).

The trainer (:meth:`pipejax.frozen_prefix.FrozenPrefix.change_depth`), at the
first freeze and at every freeze event, for the new depth F: unless
:func:`keep_caching` settles it, it times the frozen prefix's forward on the
devices for one batch, the cache's write and read of that batch
(``ActivationCache.measure_io``) plus its copies between host and devices, and
decides with :func:`decide_caching` (one log line with the inputs). The
augmentation guard, :func:`caching_allowed`, runs once, when the cache is made.
"""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class CachingDecision:
  """Whether caching beats recomputing the frozen prefix, with its inputs.

  Costs are seconds per batch summed over ``epochs_ahead`` epochs at this
  depth: ``seconds_without = epochs_ahead · forward``; with the cache, the
  entries that are not there yet (all, unless ``filled``) cost ``forward +
  write`` once, then ``read`` each remaining epoch — plus, when the budgets
  hold only part of the samples, a ``forward`` for every batch that is not
  all hits (its missing rows are computed as a whole batch): a fraction
  ``1 − fits ** batch_size`` of them, ``fits`` the fraction of the
  process's samples the budgets hold.
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
  # The depth whose forward was timed: ``num_frozen_layers``, or a smaller
  # depth for a decision kept by :func:`keep_caching` (whose forward and
  # ``seconds_without`` are then lower bounds).
  measured_at: int | None = None
  # The fraction of the samples the budgets hold (1 when every sample fits;
  # checkpoints from before these fields restore as such), and the samples
  # of a batch on this process.
  fits: float = 1.0
  batch_size: int = 1

  @property
  def all_hit_batches(self) -> float:
    """The fraction of the batches whose every sample hits."""
    return self.fits ** self.batch_size

  def describe(self) -> str:
    verdict = 'use the cache' if self.use_cache else 'run the prefix'
    if self.fits < 1:
      verdict += (f'; the budgets hold {self.fits:.1%} of the samples, so '
                  f'{1 - self.all_hit_batches:.1%} of the batches still run the forward')
    if self.measured_at is not None and self.measured_at != self.num_frozen_layers:
      return (f'autocache: F={self.num_frozen_layers}: {verdict} (not re-measured: at '
              f'F={self.measured_at} the filled cache read {self.read_seconds:.4f}s per batch '
              f'against a {self.forward_seconds:.4f}s forward, and a deeper prefix only costs '
              f'more; over {self.epochs_ahead} epochs: cache {self.seconds_with:.4f}s vs forward '
              f'>= {self.seconds_without:.4f}s)')
    return (f'autocache: F={self.num_frozen_layers}: {verdict} (per batch over '
            f'{self.epochs_ahead} epochs: cache {self.seconds_with:.4f}s vs forward '
            f'{self.seconds_without:.4f}s; forward {self.forward_seconds:.4f}s, read '
            f'{self.read_seconds:.4f}s, write {self.write_seconds:.4f}s, '
            f'{"filled" if self.filled else "empty"})')


def decide_caching(num_frozen_layers: int, forward_seconds: float, read_seconds: float,
                   write_seconds: float, epochs_ahead: int, filled: bool = False,
                   fits: float = 1.0, batch_size: int = 1) -> CachingDecision:
  """Compares caching with recomputation for one depth (pure).

  Args:
    num_frozen_layers: the depth F (0 never caches: there is no frozen prefix).
    forward_seconds: the frozen prefix's forward for one batch at depth F.
    read_seconds / write_seconds: reading / writing one batch of entries,
      with its copy to / from the devices (the prefix run on the devices
      needs neither).
    epochs_ahead: epochs expected at this depth (the freeze timestep, or the
      epochs left); with 1 and an empty cache, caching cannot pay.
    filled: the entries already exist at this depth (advanced or reopened).
    fits: the fraction of the process's samples the budgets hold (1: all).
    batch_size: the samples of a batch on this process (with ``fits``, how
      many batches are all hits).
  """
  if epochs_ahead < 1:
    raise ValueError(f'epochs_ahead must be >= 1, got {epochs_ahead}')
  fits, batch_size = min(max(float(fits), 0.0), 1.0), max(int(batch_size), 1)
  served = read_seconds + (1 - fits ** batch_size) * forward_seconds  # an epoch after the fill
  without = epochs_ahead * forward_seconds
  if filled:
    with_cache = epochs_ahead * served
  else:
    with_cache = forward_seconds + write_seconds + (epochs_ahead - 1) * served
  use = num_frozen_layers > 0 and with_cache < without
  return CachingDecision(num_frozen_layers, use, forward_seconds, read_seconds, write_seconds,
                         epochs_ahead, filled, without, with_cache, num_frozen_layers,
                         fits, batch_size)


def keep_caching(previous: CachingDecision | None, num_frozen_layers: int,
                 epochs_ahead: int) -> CachingDecision | None:
  """The decision at depth ``num_frozen_layers`` without timing anything,
  when ``previous`` settles it; else None (measure).

  It does when ``previous`` chose the cache with its entries filled (so its
  read time is that of the entries as they are stored, in whichever tier) at
  a smaller depth: the entries keep their shape and tier when advanced, and
  the forward through more blocks takes longer, so the cache wins again. A
  decision taken on an empty cache is not enough (its read time was measured
  before the tiers filled).
  """
  if (previous is None or not previous.use_cache or not previous.filled
      or num_frozen_layers <= previous.num_frozen_layers):
    return None
  # The shallower depth's timings: the comparison (read < forward times the
  # share of all-hit batches) comes out as it did there. The budgets and the
  # entries' size are the same at every depth: so is the fit.
  decision = decide_caching(num_frozen_layers, previous.forward_seconds, previous.read_seconds,
                            previous.write_seconds, epochs_ahead, filled=True,
                            fits=previous.fits, batch_size=previous.batch_size)
  measured_at = (previous.num_frozen_layers if previous.measured_at is None
                 else previous.measured_at)
  return dataclasses.replace(decision, measured_at=measured_at)


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
