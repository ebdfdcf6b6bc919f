"""Freeze algorithm (paper §3.1, Eq. 1) and its policies.

At the end of each timestep T (an epoch by default, or a fixed number of
steps) the number of frozen leading blocks becomes::

  F_T = min( F_{T-1} + α (L − F_{T-1}),  argmin_{i ∈ active} ‖g_i‖ + 1 )      (Eq. 1)

capped at ``L − min_active_layers`` and never lower than ``F_{T-1}``.

*Which layer count the argmin maps to.* Blocks are numbered 0..L−1 and the
active ones are ``F_{T-1}..L−1``. ``‖g_i‖`` is block i's gradient norm (attention
and MLP sub-layers together) accumulated — summed over the steps — during
timestep T. If block i* has the smallest norm, it has converged first, and since
only a prefix can be frozen, blocks 0..i* freeze: the candidate count is
``i* + 1``. The α term bounds how far one timestep may go. (The paper's
App. B words it "freeze all layers preceding the layer with the smallest
gradient norm", which would leave block i* itself trainable and let the
argmin term freeze nothing at all; pipejax follows Eq. 1's intuition that
the smallest-norm block has converged, so the argmin term always freezes at
least one more block when the α bound allows one.)

*Real-valued bound.* The first term is kept as a real number between
timesteps (``bound``, which takes the place of ``F_{T-1}`` in it:
``bound_T = bound_{T-1} + α (L − bound_{T-1})``) and the applied count is its
floor; this makes the
``schedule`` policy exactly the paper's geometric sequence
``F_T = L (1 − (1 − α)^T)`` (its Figure 4). When the argmin term is the smaller
one, ``bound`` is reset to that integer count.

Policies: ``pipetransformer`` (Eq. 1), ``schedule`` (the α bound alone, which
is what the authors' code did), ``none`` (never freeze).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

POLICIES = ('pipetransformer', 'schedule', 'none')


class FreezeConfigError(ValueError):
  """A freeze configuration outside what the algorithm accepts."""


def check_config(policy: str, alpha: float, num_layers: int, min_active_layers: int) -> None:
  """Raises :class:`FreezeConfigError` naming a bad value."""
  if policy not in POLICIES:
    raise FreezeConfigError(f'unknown freeze policy {policy!r}; expected one of {POLICIES}')
  if not 0.0 < alpha < 1.0:
    raise FreezeConfigError(f'freeze.alpha must be in (0, 1), got {alpha}')
  if not 1 <= min_active_layers <= num_layers:
    raise FreezeConfigError(f'freeze.min_active_layers must be in [1, {num_layers}], got '
                            f'{min_active_layers}')


@dataclasses.dataclass
class Decision:
  """One freeze decision with all its inputs (logged and checkpointed).

  Attributes:
    alpha_bound: the α term compared this timestep, ``b + α (L − b)`` with
      ``b`` the bound carried from the timestep before (real-valued; see the
      module docstring); None in decisions saved before it was recorded.
    bound: Eq. 1's value after the min with the argmin term and the cap,
      carried to the next timestep (see the module docstring).
    argmin: the active block with the smallest accumulated norm (it maps to
      ``argmin + 1`` frozen blocks); None for the policies without norms.
  """
  timestep: int
  step: int
  previous: int
  bound: float
  argmin: int | None
  norms: list[float] | None
  result: int
  alpha_bound: float | None = None

  def describe(self) -> str:
    argmin = '-' if self.argmin is None else f'{self.argmin} (→{self.argmin + 1})'
    alpha = '' if self.alpha_bound is None else f'α bound {self.alpha_bound:.2f}, '
    return (f'freeze T={self.timestep}: F {self.previous} -> {self.result} '
            f'({alpha}argmin {argmin}, Eq. 1 bound {self.bound:.2f})')


@dataclasses.dataclass
class FreezeState:
  """What the policy carries between timesteps.

  Attributes:
    num_frozen_layers: F, the applied count.
    bound: the real-valued α bound (see module docstring).
    timestep: timesteps completed.
    history: every :class:`Decision`, oldest first.
  """
  num_frozen_layers: int = 0
  bound: float = 0.0
  timestep: int = 0
  history: list[Decision] = dataclasses.field(default_factory=list)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> 'FreezeState':
    return cls(d['num_frozen_layers'], d['bound'], d['timestep'],
               [Decision(**h) for h in d['history']])


class FreezePolicy:
  """Decides F at the end of each timestep (see module docstring).

  Args:
    policy: one of :data:`POLICIES`.
    num_layers: L.
    alpha: α ∈ (0, 1).
    min_active_layers: blocks that always stay trainable (≥ 1).
  """

  def __init__(self, policy: str, num_layers: int, alpha: float, min_active_layers: int = 1):
    check_config(policy, alpha, num_layers, min_active_layers)
    self.policy, self.num_layers = policy, num_layers
    self.alpha, self.min_active_layers = alpha, min_active_layers
    self.state = FreezeState()

  @property
  def num_frozen_layers(self) -> int:
    return self.state.num_frozen_layers

  @property
  def cap(self) -> int:
    return self.num_layers - self.min_active_layers

  def bound_result(self) -> tuple[float, int]:
    """The α term of Eq. 1 for the timestep now running: the real-valued
    bound and the count it alone would freeze (capped, never lower than F).
    The argmin term can only make the decision smaller."""
    s = self.state
    if self.policy == 'none':
      return float(s.num_frozen_layers), s.num_frozen_layers
    bound = s.bound + self.alpha * (self.num_layers - s.bound)
    return bound, min(max(math.floor(bound + 1e-9), s.num_frozen_layers), self.cap)

  def decide(self, layer_grad_norms: np.ndarray | None, step: int = 0) -> Decision:
    """Ends a timestep and returns the decision (``result`` is the new F).

    Args:
      layer_grad_norms: ``[L]`` accumulated gradient norm of every block over
        the timestep (entries of frozen blocks are ignored). Required by the
        ``pipetransformer`` policy.
      step: the global step, for the log.
    """
    s = self.state
    previous = s.num_frozen_layers
    argmin, norms = None, None
    bound, result = self.bound_result()
    alpha_bound = None if self.policy == 'none' else bound
    if self.policy == 'pipetransformer':
      if layer_grad_norms is None:
        raise ValueError('the pipetransformer policy needs per-layer gradient norms')
      norms = [float(x) for x in np.asarray(layer_grad_norms)]
      if len(norms) != self.num_layers:
        raise ValueError(f'expected {self.num_layers} layer norms, got {len(norms)}')
      argmin = previous + int(np.argmin(norms[previous:]))
      if argmin + 1 < result:  # argmin ≥ F, so this still freezes at least one more
        result, bound = argmin + 1, float(argmin + 1)
    bound = min(bound, float(self.cap))
    s.bound = bound
    s.timestep += 1
    s.num_frozen_layers = result
    decision = Decision(s.timestep, step, previous, bound, argmin, norms, result, alpha_bound)
    s.history.append(decision)
    return decision


def schedule_curve(num_layers: int, alpha: float, timesteps: int) -> list[int]:
  """Frozen layers per timestep of the ``schedule`` policy (paper Fig. 4),
  from the closed form ``floor(L (1 − (1 − α)^T))`` — an independent reference."""
  return [math.floor(num_layers * (1 - (1 - alpha) ** t) + 1e-9) for t in range(timesteps + 1)]
