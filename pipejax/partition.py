"""Partitions of a layered model into pipeline stages, and the stage layout.

The pipeline runs the *active* units of a :class:`models.LayeredModel`: the
embedding (only while no layer is frozen), the sub-layers of the blocks that
are not frozen, and the head. A :class:`Partition` assigns them, contiguously
and in order, to ``pipeline_length`` stages; each stage gets at least one unit.

On the devices every stage holds a padded stack of *block slots*: slot j of a
stage is one transformer block of which the stage may own the attention
half, the MLP half, or both (a stage boundary may fall between the two
halves). A partition may also *split* an MLP sub-layer between its two dense
layers (:attr:`Partition.split_mlp`): the stage before the boundary runs its
first half (norm, first dense layer, activation) and sends the
``[.., intermediate]`` activation on with the residual stream; the stage
after runs its second half. The MLP's parameters are then divided by their
top-level keys (:attr:`Partition.mlp_in_keys`) between the two stages.

``stage_params['attention']`` and ``stage_params['mlp']`` are
``[pipeline_length, slots, ...]`` stacks sharded over the mesh axis
``'stage'``; unused halves (a split MLP's other half too) and padded slots are
zero and are skipped at run time (see :mod:`pipejax.pipeline`). The stacks
are dense: every device stores ``slots`` whole blocks, whatever its stage
owns. Embedding and head parameters are
replicated and used only by the first and last stage.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = Any


class PartitionError(ValueError):
  """A partition that does not cover the model's active units."""


@dataclasses.dataclass(frozen=True)
class Partition:
  """Contiguous assignment of the active units to pipeline stages.

  Attributes:
    num_layers: L, the model's transformer blocks.
    num_frozen_layers: leading blocks that are frozen and outside the pipeline
      (with them the embedding); 0 means the embedding is the first unit.
    stage_sizes: units per stage, in order; they sum to :attr:`num_active_units`.
    min_slots: pad every stage to at least this many block slots. Partitions
      of the same length padded to the same width share one compiled step
      (the slot tables are runtime data), so a freeze event that keeps K
      reuses the step it already has; padding costs a skipped branch per slot.
    split_mlp: the stages whose last unit, an MLP sub-layer, is split with
      the next stage: the stage runs the MLP's first half (and counts the
      unit in its size), the next stage its second half (not counted in its
      size). Empty: every unit runs whole on one stage.
    mlp_in_keys: with ``split_mlp``, the top-level keys of the MLP parameter
      tree that the first half reads (:attr:`models.LayeredModel.mlp_in_keys`).
  """

  num_layers: int
  num_frozen_layers: int
  stage_sizes: tuple[int, ...]
  min_slots: int = 0
  split_mlp: tuple[int, ...] = ()
  mlp_in_keys: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, 'stage_sizes', tuple(int(s) for s in self.stage_sizes))
    object.__setattr__(self, 'split_mlp', tuple(sorted({int(s) for s in self.split_mlp})))
    object.__setattr__(self, 'mlp_in_keys', tuple(self.mlp_in_keys))
    if not 0 <= self.num_frozen_layers < self.num_layers:
      raise PartitionError(f'frozen layers must be in [0, {self.num_layers}), got '
                           f'{self.num_frozen_layers}')
    if not self.stage_sizes or min(self.stage_sizes) < 1:
      raise PartitionError(f'every stage needs at least one unit; got stage sizes '
                           f'{list(self.stage_sizes)}')
    if sum(self.stage_sizes) != self.num_active_units:
      raise PartitionError(
          f'partition {list(self.stage_sizes)} covers {sum(self.stage_sizes)} units but the '
          f'model has {self.num_active_units} active units (L={self.num_layers}, '
          f'{self.num_frozen_layers} frozen); stage sizes must sum to that')
    if self.split_mlp:
      if not self.mlp_in_keys:
        raise PartitionError('a partition that splits an MLP sub-layer needs mlp_in_keys '
                             '(the MLP parameters of its first half)')
      units = self.stage_units()
      for s in self.split_mlp:
        last = units[s][-1] if 0 <= s < self.pipeline_length - 1 else None
        if last is None or unit_block(last, self.num_layers) is None or last % 2:
          raise PartitionError(
              f'split_mlp {list(self.split_mlp)}: stage {s} must be followed by another and '
              f'end with an MLP sub-layer (stage sizes {list(self.stage_sizes)})')

  @property
  def pipeline_length(self) -> int:
    return len(self.stage_sizes)

  @property
  def has_embed(self) -> bool:
    """Whether the embedding is in the pipeline (nothing frozen)."""
    return self.num_frozen_layers == 0

  @property
  def active_units(self) -> tuple[int, ...]:
    """Global unit ids in pipeline order (0 = embed, 2L+1 = head)."""
    first = 0 if self.has_embed else 2 * self.num_frozen_layers + 1
    sub = range(max(first, 1), 2 * self.num_layers + 1)
    return ((0,) if self.has_embed else ()) + tuple(sub) + (2 * self.num_layers + 1,)

  @property
  def num_active_units(self) -> int:
    return 2 * (self.num_layers - self.num_frozen_layers) + 1 + int(self.has_embed)

  def stage_units(self) -> list[tuple[int, ...]]:
    """The units of each stage."""
    units, out, start = self.active_units, [], 0
    for size in self.stage_sizes:
      out.append(units[start:start + size])
      start += size
    return out

  @functools.cached_property
  def tables(self) -> 'SlotTables':
    return _slot_tables(self)


def even(num_layers: int, pipeline_length: int, num_frozen_layers: int = 0) -> Partition:
  """The partition with unit counts as equal as possible (larger stages first)."""
  n = 2 * (num_layers - num_frozen_layers) + 1 + int(num_frozen_layers == 0)
  if pipeline_length > n:
    raise PartitionError(f'pipeline length {pipeline_length} exceeds the {n} active units')
  base, extra = divmod(n, pipeline_length)
  return Partition(num_layers, num_frozen_layers,
                   tuple(base + (i < extra) for i in range(pipeline_length)))


@dataclasses.dataclass(frozen=True, eq=False)
class SlotTables:
  """Static per-stage tables of block slots (numpy, ``[stages, slots]``).

  Attributes:
    layer: global block index of each slot (0 where padded).
    has_attention: whether the stage runs the block's attention sub-layer.
    has_mlp_in / has_mlp_out: whether it runs the first / second half of the
      block's MLP sub-layer (both: the whole MLP; one: a split MLP).
  """
  layer: np.ndarray
  has_attention: np.ndarray
  has_mlp_in: np.ndarray
  has_mlp_out: np.ndarray

  @property
  def num_slots(self) -> int:
    return int(self.layer.shape[1])

  @property
  def has_mlp(self) -> np.ndarray:
    """Whether the stage runs any of the block's MLP sub-layer."""
    return self.has_mlp_in | self.has_mlp_out

  def arrays(self) -> tuple[np.ndarray, ...]:
    """``(layer, has_attention, has_mlp_in, has_mlp_out)``: what a compiled
    step takes at run time."""
    return self.layer, self.has_attention, self.has_mlp_in, self.has_mlp_out


def unit_block(unit: int, num_layers: int) -> int | None:
  """The block whose attention (odd id) or MLP (even id) half a unit is;
  None for the embedding (0) and the head (2L+1)."""
  return None if unit in (0, 2 * num_layers + 1) else (unit - 1) // 2


def _slot_tables(partition: Partition) -> SlotTables:
  per_stage = []
  stage_units = partition.stage_units()
  for s, units in enumerate(stage_units):
    slots: list[list] = []  # [layer, has_attention, has_mlp_in, has_mlp_out]
    if s - 1 in partition.split_mlp:  # the second half of the previous stage's MLP
      slots.append([unit_block(stage_units[s - 1][-1], partition.num_layers),
                    False, False, True])
    for u in units:
      layer = unit_block(u, partition.num_layers)
      if layer is None:
        continue
      if not slots or slots[-1][0] != layer:
        slots.append([layer, False, False, False])
      if u % 2:
        slots[-1][1] = True
      else:
        slots[-1][2] = True
        slots[-1][3] = not (s in partition.split_mlp and u == units[-1])
    per_stage.append(slots)
  width = max(1, partition.min_slots, max(len(s) for s in per_stage))
  k = partition.pipeline_length
  layer = np.zeros((k, width), np.int32)
  flags = np.zeros((3, k, width), bool)
  for s, slots in enumerate(per_stage):
    for j, (l, *f) in enumerate(slots):
      layer[s, j] = l
      flags[:, s, j] = f
  return SlotTables(layer, *flags)


def to_stage_params(params: Params, partition: Partition) -> Params:
  """Canonical parameters → stage layout (see module docstring).

  Args:
    params: canonical tree ``{'embed', 'attention' [L, ...], 'mlp' [L, ...], 'head'}``.
    partition: the partition to lay out for.

  Returns:
    ``{'attention': [K, slots, ...], 'mlp': [K, slots, ...], 'head', ('embed')}``
    with unused halves and padded slots zero. Traceable (use under ``jax.jit``
    with ``out_shardings`` to build it directly on the mesh).
  """
  t = partition.tables

  def gather(stack, mask):
    taken = stack[t.layer]
    m = mask.reshape(mask.shape + (1,) * (taken.ndim - 2))
    return jnp.where(m, taken, jnp.zeros((), taken.dtype))

  out = {'attention': jax.tree.map(lambda x: gather(x, t.has_attention), params['attention']),
         'mlp': _map_mlp_halves(partition, (params['mlp'],), lambda trees, half: jax.tree.map(
             lambda x: gather(x, half), *trees), t.has_mlp_in, t.has_mlp_out),
         'head': params['head']}
  if partition.has_embed:
    out['embed'] = params['embed']
  return out


def from_stage_params(stage_params: Params, partition: Partition, frozen: Params) -> Params:
  """Stage layout (+ frozen prefix) → canonical parameters; the exact inverse
  of :func:`to_stage_params` on the active units.

  Args:
    stage_params: parameters in the stage layout of ``partition``.
    partition: their partition.
    frozen: the frozen prefix as from :func:`frozen_prefix` (its ``embed`` and
      its ``attention`` / ``mlp`` stacks of length F); ignored entries when
      nothing is frozen.
  """
  t = partition.tables
  num_frozen = partition.num_frozen_layers

  def where(mask):
    return {int(t.layer[s, j]): (s, j) for s, j in zip(*np.nonzero(mask))}

  where_a = where(t.has_attention)

  def scatter(prefix, staged, where):
    rows = [prefix[l] if l < num_frozen else staged[where[l]]
            for l in range(partition.num_layers)]
    return jnp.stack(rows)

  return {
      'embed': stage_params['embed'] if partition.has_embed else frozen['embed'],
      'attention': jax.tree.map(lambda f, s: scatter(f, s, where_a), frozen['attention'],
                                stage_params['attention']),
      'mlp': _map_mlp_halves(
          partition, (frozen['mlp'], stage_params['mlp']),
          lambda trees, half: jax.tree.map(lambda f, s: scatter(f, s, half), *trees),
          where(t.has_mlp_in), where(t.has_mlp_out)),
      'head': stage_params['head'],
  }


def _map_mlp_halves(partition: Partition, trees: tuple, fn, first, second):
  """``fn(parts, half)`` for the MLP parameters of each half, ``parts`` the
  same keys of every tree in ``trees`` (MLP trees mapped together): ``first``
  for the keys of :attr:`Partition.mlp_in_keys`, ``second`` for the others.
  Without a split MLP the halves are on the same stages: ``fn(trees, first)``."""
  if not partition.split_mlp:
    return fn(trees, first)
  keys = trees[-1].keys()
  unknown = set(partition.mlp_in_keys) - set(keys)
  if unknown:
    raise PartitionError(f'mlp_in_keys {sorted(unknown)} are not MLP parameters (it has '
                         f'{sorted(keys)})')
  return {k: fn(tuple(t[k] for t in trees), first if k in partition.mlp_in_keys else second)
          for k in keys}


def frozen_prefix(params: Params, num_frozen_layers: int) -> Params:
  """The frozen part of canonical ``params``: the embedding and the first
  ``num_frozen_layers`` blocks (stacks of that length)."""
  return {'embed': params['embed'],
          'attention': jax.tree.map(lambda x: x[:num_frozen_layers], params['attention']),
          'mlp': jax.tree.map(lambda x: x[:num_frozen_layers], params['mlp'])}
