"""The optimizer of a training run: AdamW with a linear warm-up and cosine
decay to 0 (:func:`optimizer_for`), whose learning-rate schedule counts *base
steps*, so that a run whose replicas change keeps the schedule of its
starting batch (:func:`schedule_count`, :func:`with_schedule_count`)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


#: The parameters that ``train.decay_biases_and_norms=False`` spares from
#: weight decay, by their leaf's name: biases, and LayerNorm scales.
UNDECAYED = ('bias', 'scale')


def decay_mask(params) -> Any:
  """``params``' tree of bools: True where a leaf is not named in
  :data:`UNDECAYED` (the leaves weight decay applies to)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], 'key', None) not in UNDECAYED, params)


def optimizer_for(train, steps_per_epoch: int):
  """``(learning-rate schedule, optimizer)`` of a ``config.train`` section:
  AdamW with a linear warm-up of ``warmup_epochs`` and cosine decay to 0,
  its decay sparing biases and LayerNorm scales unless
  ``decay_biases_and_norms``, after clipping the gradient to the global norm
  ``max_grad_norm`` where that is > 0.

  The schedule counts *base steps*, ``steps_per_epoch`` of them an epoch:
  ``update(..., base_steps=n)`` advances it by ``n`` (default 1). With
  ``train.batch_mode='constant'`` every step is one, and the optimizer is
  ``optax.adamw(schedule)`` exactly (the same state tree and arithmetic).
  With ``'per_pipeline'`` an epoch at R replicas has fewer, larger steps;
  each advances the schedule by ``steps_per_epoch`` over that epoch's steps,
  a fraction (the schedule's count is then a float32, set to the epoch's
  exact end by :func:`with_schedule_count` after each epoch), so the decay
  ends with the last epoch whatever the replicas, ``drop_remainder`` or
  ``train.max_steps_per_epoch`` made of the epochs.
  """
  total = max(2, train.epochs * steps_per_epoch)
  # optax needs the decay to outlast the warm-up; 0 steps: the first step at the peak.
  warmup = min(int(train.warmup_epochs * steps_per_epoch), total - 1)
  lr = optax.warmup_cosine_decay_schedule(0.0, train.learning_rate, warmup, total,
                                          end_value=0.0)
  count_dtype = jnp.float32 if train.batch_mode == 'per_pipeline' else jnp.int32
  clip = train.max_grad_norm
  mask = None if train.decay_biases_and_norms else decay_mask
  return lr, optax.chain(*([optax.clip_by_global_norm(clip)] if clip > 0 else []),
                         optax.scale_by_adam(),
                         optax.add_decayed_weights(train.weight_decay, mask=mask),
                         _scale_by_schedule_in_base_steps(lambda count: -1 * lr(count),
                                                          count_dtype))


def _scale_by_schedule_in_base_steps(step_size_fn, count_dtype=jnp.int32
                                     ) -> optax.GradientTransformationExtraArgs:
  """``optax.scale_by_schedule`` whose count (of ``count_dtype``) advances by
  the update's ``base_steps`` instead of 1 (Adam's own count, for its bias
  correction, still counts updates)."""

  def init(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], count_dtype))

  def update(updates, state, params=None, *, base_steps=1, **extra_args):
    del params, extra_args
    step_size = step_size_fn(state.count)
    updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
    return updates, optax.ScaleByScheduleState(
        count=state.count + jnp.asarray(base_steps, state.count.dtype))

  return optax.GradientTransformationExtraArgs(init, update)


def schedule_count(opt_state) -> jax.Array:
  """Base steps done: the learning-rate schedule's position in an
  :func:`optimizer_for` state."""
  return opt_state[-1].count


def with_schedule_count(opt_state, count: int):
  """``opt_state`` (of :func:`optimizer_for`) with the schedule at base step
  ``count``, on the sharding and dtype its count has."""
  old = opt_state[-1].count
  new = jax.device_put(jnp.asarray(count, old.dtype), old.sharding)
  return (*opt_state[:-1], opt_state[-1]._replace(count=new))
