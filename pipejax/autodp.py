"""AutoDP (paper §3.3): when the pipeline shrinks from K to K', the device mesh
is rebuilt as (R' = N / K', K'), the training state is moved onto it, and the
data is re-split over R' replicas.

The move is one jitted relayout from the old stage layout to the new one with
the new mesh's shardings as ``out_shardings``: arrays go device to device, the
whole model never visits the host. Parameters of newly frozen blocks move to
the replicated frozen prefix; the optimizer moments of blocks that stay active
(and of the head) move with them, those of newly frozen blocks are dropped;
step counters (hence the learning-rate schedule) are kept.
"""
from __future__ import annotations

import math

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipejax import partition as part
from pipejax import pipeline

Params = Any


def replicas_for(num_devices: int, pipeline_length: int, autodp: bool = True) -> int:
  """R = N / K, checking that K divides N; without ``autodp`` (an ablation)
  1, one pipeline on K devices while the rest idle."""
  if not autodp:
    return 1
  if pipeline_length < 1 or num_devices % pipeline_length:
    raise pipeline.PlanError(f'pipeline length {pipeline_length} does not divide the '
                             f'{num_devices} devices')
  return num_devices // pipeline_length


def global_batch_size(batch_size: int, replicas: int, mode: str) -> int:
  """The global batch for R replicas.

  ``mode='constant'`` (``train.batch_mode``'s default) keeps ``batch_size`` whatever R is, which
  preserves the optimisation semantics; ``'per_pipeline'`` is the paper's
  behaviour, ``batch_size`` per pipeline, so the global batch grows with R.
  """
  if mode == 'constant':
    return batch_size
  if mode == 'per_pipeline':
    return batch_size * replicas
  raise ValueError(f"unknown batch mode {mode!r}; expected 'constant' or 'per_pipeline'")


def check_frozen_batches(batch_size: int, mode: str, num_devices: int,
                         pipeline_lengths: list[int], autodp: bool = True) -> None:
  """Raises :class:`pipejax.pipeline.PlanError` unless the global batch of
  every plan with one of ``pipeline_lengths`` splits over its R·K devices,
  where the frozen blocks' forward runs data-parallel (R = N / K with
  ``autodp``, else 1). Otherwise the first freeze, after a whole epoch of
  training, would fail inside JAX."""
  needs = []  # (K, R, what train.batch_size must be a multiple of)
  for k in pipeline_lengths:
    replicas = replicas_for(num_devices, k, autodp)
    # per_pipeline: batch_size·R samples over R·K devices needs K | batch_size.
    needs.append((k, replicas, k if mode == 'per_pipeline' else replicas * k))
  for k, replicas, divisor in needs:
    if batch_size % divisor:
      raise pipeline.PlanError(
          f'train.batch_size={batch_size} gives a global batch of '
          f'{global_batch_size(batch_size, replicas, mode)} at pipeline length {k} (R = '
          f'{replicas}), which its {replicas * k} devices cannot split: frozen blocks run '
          f'data-parallel over them; use a train.batch_size that is a multiple of '
          f'{math.lcm(*(d for _, _, d in needs))}')


def is_param_tree(x) -> bool:
  """Whether ``x`` is a tree in the stage layout (parameters or a moment)."""
  return isinstance(x, dict) and 'attention' in x and 'mlp' in x and 'head' in x


def map_param_trees(fn, tree, template=None):
  """Applies ``fn`` to every stage-layout subtree of an optimizer state.

  With ``template`` (e.g. ``jax.eval_shape(optimizer.init, new_params)``) the
  result takes the template's container types; other leaves are copied.
  """
  template = tree if template is None else template
  if is_param_tree(template):
    return fn(tree)
  if isinstance(template, tuple) and hasattr(template, '_fields'):
    return type(template)(*[map_param_trees(fn, a, b) for a, b in zip(tree, template)])
  if isinstance(template, (tuple, list)):
    return type(template)(map_param_trees(fn, a, b) for a, b in zip(tree, template))
  if isinstance(template, dict):
    return {k: map_param_trees(fn, tree[k], v) for k, v in template.items()}
  return tree


def state_specs(state_shapes: dict) -> dict:
  """PartitionSpecs of a trainer state: stage-layout trees over
  ``'stage'``, everything else replicated."""
  def is_spec(x):
    return isinstance(x, P)

  out = {}
  for key, value in state_shapes.items():
    if key == 'active':
      out[key] = pipeline.stage_param_specs(value)
    elif key == 'opt':
      out[key] = map_param_trees(pipeline.stage_param_specs, value)
      out[key] = jax.tree.map(lambda x: x if is_spec(x) else P(), out[key], is_leaf=is_spec)
    else:
      out[key] = jax.tree.map(lambda _: P(), value)
  return out


def state_shardings(state_shapes: dict, mesh: Mesh) -> dict:
  """Shardings of a trainer state on ``mesh`` (see :func:`state_specs`)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(state_shapes),
                      is_leaf=lambda x: isinstance(x, P))


def on_mesh(tree, mesh: Mesh):
  """``tree`` (arrays, or ``ShapeDtypeStruct``\\ s with shardings) with the
  same partition specs on ``mesh``: a copy where it lives on other devices
  (a run without AutoDP uses K devices, fewer after compression), else
  ``tree`` itself."""
  def move(x):
    if set(x.sharding.device_set) == set(mesh.devices.flat):
      return x
    sharding = NamedSharding(mesh, x.sharding.spec)
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.device_put(x, sharding)
  return jax.tree.map(move, tree)


def relayout_fn(state_shapes: dict, old: part.Partition, new: part.Partition, mesh: Mesh,
                optimizer_init):
  """The jitted move of a trainer state from partition ``old`` to ``new``.

  Args:
    state_shapes: the state (or its ``jax.eval_shape``): ``{'frozen',
      'active', 'opt', ...}``; ``frozen`` is the frozen prefix
      (:func:`pipejax.partition.frozen_prefix`), ``active`` the stage layout of
      ``old``, ``opt`` the optimizer state of ``active``.
    old, new: the partitions; ``new`` may freeze more blocks, never fewer.
    mesh: the new mesh.
    optimizer_init: the optimizer's ``init`` (gives the new state's structure).

  Returns:
    ``move``, a ``jax.jit`` of it: ``move(state)`` returns the state laid
    out for ``new`` and sharded on ``mesh``. It is not compiled yet; compiled
    (by the trainer's :class:`pipejax.programs.ProgramStore`), its
    ``out_info`` describes the new state, to compile the next step ahead.
  """
  if new.num_frozen_layers < old.num_frozen_layers:
    raise ValueError(f'cannot unfreeze: {old.num_frozen_layers} -> {new.num_frozen_layers}')

  replicated = NamedSharding(mesh, P())

  def move(state):
    state = gathered_stages(state, replicated)
    canonical = part.from_stage_params(state['active'], old, state['frozen'])
    out = dict(state)
    out['frozen'] = part.frozen_prefix(canonical, new.num_frozen_layers)
    out['active'] = part.to_stage_params(canonical, new)
    zero_prefix = jax.tree.map(jnp.zeros_like, state['frozen'])

    def moment(tree):
      full = part.from_stage_params(tree, old, zero_prefix)
      return part.to_stage_params(full, new)

    template = jax.eval_shape(optimizer_init, out['active'])
    out['opt'] = map_param_trees(moment, state['opt'], template)
    return out

  shardings = state_shardings(jax.eval_shape(move, state_shapes), mesh)
  # Donated: the old layout is dead after the move, so it never coexists with the new one.
  return jax.jit(move, out_shardings=shardings, donate_argnums=0)


def gathered_stages(state: dict, replicated: NamedSharding) -> dict:
  """``state`` (traced inside ``jax.jit``) with every stage-sharded leaf (the
  ``'attention'``/``'mlp'`` stacks of ``active`` and of the optimizer's
  moments) replicated with ``replicated``, in one all-gather per dtype.

  Left to itself, the partitioner moves each leaf's slots between stages with
  their own collectives (498 collective-permutes for the default model's
  relayout, each a rendezvous of every device); packing the stacks of each
  stage into one row ``[K, n]`` first needs no communication (they all split
  their first axis over ``'stage'``), and the gathered row is sliced back into
  the leaves. The relayout then runs on replicated values and hands each
  device its part of the new layout without further communication. Exact: a
  gather copies bits. Costs, for the duration of the move, the whole
  stage-layout state on every device.
  """
  leaves, treedef = jax.tree.flatten(state)
  staged = [i for i, spec in enumerate(treedef.flatten_up_to(state_specs(state)))
            if spec != P()]
  out = list(leaves)
  for dtype in sorted({leaves[i].dtype for i in staged}, key=str):
    group = [i for i in staged if leaves[i].dtype == dtype]
    k = leaves[group[0]].shape[0]
    row = jnp.concatenate([leaves[i].reshape(k, -1) for i in group], axis=1)
    row = jax.lax.with_sharding_constraint(row, replicated)
    offset = 0
    for i in group:
      size = math.prod(leaves[i].shape[1:])
      out[i] = row[:, offset:offset + size].reshape(leaves[i].shape)
      offset += size
  return jax.tree.unflatten(treedef, out)
