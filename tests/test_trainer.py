"""Trainer: frozen weights stay bit-identical, transitions keep training state,
per-layer gradient norms, and the elastic run end to end."""
import concurrent.futures
import contextlib
import dataclasses
import gc
import math
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import vit_imagenet
from models.layered import unit_rng
from pipejax import autodp, autopipe
from pipejax import optimizer as optimizer_lib
from pipejax import pipeline
from pipejax import resume
from pipejax import trainer as trainer_lib
from pipejax import partition as part
from pipejax.data import ArraySource, Loader
from pipejax.trainer import Trainer, layer_grad_norms
from tests import fixtures


def _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4, epochs=2):
  """The main job's config with small, deterministic settings."""
  c = vit_imagenet.get_config()
  with c.unlocked():
    c.train.update(epochs=epochs, batch_size=16, learning_rate=1e-2, weight_decay=0.1,
                   warmup_epochs=0.0)
    c.pipeline.update(initial_length=initial_length, micro_batches=micro_batches,
                      profile_path='')
    c.freeze.update(policy=policy, alpha=alpha, compile_ahead=False)
  return c


def _trainer(config, num_layers=4, samples=64, *, batch=None, workdir='/nonexistent',
             devices=None, data=None, dropout=0.0, initializer_range=0.02, kind='vit',
             max_steps=0):
  """A trainer of the tiny ``kind`` (ViT) on ``samples`` fixed samples (or
  ``data``), its loaders taking ``batch`` (default ``train.batch_size``) a
  step, the train loader at most ``max_steps`` an epoch (0: all)
  (``dropout``, ``initializer_range``: the model's, see ``fixtures.tiny``)."""
  created = fixtures.tiny(kind, num_layers=num_layers, dropout=dropout,
                          initializer_range=initializer_range)
  data = fixtures.batch(kind, created.model, samples, seed=4) if data is None else data
  batch = batch or config.train.batch_size
  loader = Loader(ArraySource(data), batch, seed=0, max_steps=max_steps)
  evals = Loader(ArraySource(data), batch, shuffle=False, drop_remainder=False)
  return Trainer(created.model, created.params, config, workdir, loader, evals,
                 devices=devices, log=lambda _: None), data


class _Bar:
  def update(self, n):
    pass

  def set_postfix(self, **_):
    pass


def _bits(tree):
  return [np.asarray(x).view(np.uint32).copy() for x in jax.tree.leaves(tree)]


def test_frozen_parameters_bit_identical_after_adamw_steps():
  trainer, data = _trainer(_config())
  trainer.train_epoch(0, _Bar())
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  # Force a freeze of 2 blocks (schedule policy, α=0.5, L=4 → F=2).
  trainer.maybe_transition(0, sample)
  assert trainer.plan.partition.num_frozen_layers == 2
  frozen_before = _bits(trainer.state['frozen'])
  active_before = _bits(trainer.state['active'])
  canonical_before = trainer.canonical_params()
  for epoch in (1, 2, 3):
    trainer.train_epoch(epoch, _Bar())
  assert _bits(trainer.state['frozen']) != [] and all(
      np.array_equal(a, b)
      for a, b in zip(_bits(trainer.state['frozen']), frozen_before, strict=True))
  assert not all(np.array_equal(a, b) for a, b in zip(_bits(trainer.state['active']),
                                                      active_before, strict=True))
  after = trainer.canonical_params()
  for key in ('attention', 'mlp'):
    for a, b in zip(jax.tree.leaves(after[key]), jax.tree.leaves(canonical_before[key]),
                    strict=True):
      np.testing.assert_array_equal(np.asarray(a)[:2], np.asarray(b)[:2])
      assert not np.array_equal(np.asarray(a)[2:], np.asarray(b)[2:])
  np.testing.assert_array_equal(after['embed']['cls_token'], canonical_before['embed']['cls_token'])


def _canonical_moments(trainer):
  adam = trainer.state['opt'][0]
  zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), trainer.state['frozen'])
  partition = trainer.plan.partition
  # Host copies: the transition donates (and so deletes) the device arrays.
  mu, nu = (jax.tree.map(np.array, m) for m in (adam.mu, adam.nu))
  return (jax.tree.map(np.array, part.from_stage_params(mu, partition, zeros)),
          jax.tree.map(np.array, part.from_stage_params(nu, partition, zeros)),
          int(adam.count))


def test_transition_keeps_moments_step_rng_and_head():
  trainer, _ = _trainer(_config(alpha=0.75, initial_length=8, micro_batches=8))
  trainer.train_epoch(0, _Bar())
  mu, nu, count = _canonical_moments(trainer)
  params = jax.tree.map(np.array, trainer.canonical_params())
  step, rng = int(trainer.state['step']), np.asarray(trainer.state['rng'])
  old_plan = trainer.plan
  # AutoPipe split an MLP between two stages (L = 4 on 8 stages: 1,696
  # parameters on the largest stage instead of 2,000): its halves' moments
  # come from two stages.
  assert old_plan.partition.split_mlp == (5,)
  trainer.maybe_transition(0, next(iter(trainer.train_loader.epoch(0)))[1])
  new_plan = trainer.plan
  assert new_plan.partition.num_frozen_layers == 3 and new_plan.pipeline_length < 8
  assert new_plan.replicas == 8 // new_plan.pipeline_length
  assert old_plan.partition != new_plan.partition
  mu2, nu2, count2 = _canonical_moments(trainer)
  assert int(count2) == int(count) and int(trainer.state['step']) == step
  np.testing.assert_array_equal(np.asarray(trainer.state['rng']), rng)
  for new, old in ((mu2, mu), (nu2, nu)):
    for key in ('attention', 'mlp'):
      for a, b in zip(jax.tree.leaves(new[key]), jax.tree.leaves(old[key]), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[3:], np.asarray(b)[3:])
    for a, b in zip(jax.tree.leaves(new['head']), jax.tree.leaves(old['head']), strict=True):
      np.testing.assert_array_equal(a, b)
  assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(mu2['head']))
  after = trainer.canonical_params()
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(a, b)  # the move itself changes no weight
  # The state now lives on the new mesh.
  leaf = jax.tree.leaves(trainer.state['active']['attention'])[0]
  assert leaf.sharding.mesh.shape == {'data': new_plan.replicas,
                                      'stage': new_plan.pipeline_length}
  # The AdamW moments are split over the stages as their parameters are (each
  # device holds its stage's, not K copies of the whole).
  staged = lambda tree: sum('stage' in str(x.sharding.spec)  # noqa: E731
                            for x in jax.tree.leaves(tree))
  assert staged(trainer.state['active']) > 0
  assert staged(trainer.state['opt']) == 2 * staged(trainer.state['active'])  # mu and nu
  trainer.train_epoch(1, _Bar())  # and training goes on


def _after_prefix_reference(model, params, batch, rng, num_frozen, micro_batches,
                            frozen_dropout=False):
  """The step's loss, summed metrics and gradients, sequentially: micro-batch
  i (rows ``[i·b, (i+1)·b)``, the pipeline's ``r·M + m``) gets the key
  ``fold_in(rng, i)`` and unit u its ``unit_rng(key, u)``; embed and the
  first ``num_frozen`` blocks run without dropout behind ``stop_gradient``
  (``frozen_dropout``: with their dropout, what must not happen), the rest
  and the head with it."""
  size = len(batch['labels']) // micro_batches
  units = model.num_units

  def loss(p):
    losses, metrics = [], []
    for i in range(micro_batches):
      mb = jax.tree.map(lambda a, i=i: a[i * size:(i + 1) * size], batch)
      key = jax.random.fold_in(rng, i)
      hidden = jax.lax.stop_gradient(model.hidden_states(
          p, mb, upto_layer=num_frozen, rng=key if frozen_dropout else None,
          train=frozen_dropout))
      for unit in range(2 * num_frozen + 1, units - 1):
        hidden = model.sublayer(p, unit, hidden, mb, unit_rng(key, unit), True)
      value, m = model.loss_fn(p['head'], hidden, mb, unit_rng(key, units - 1), True)
      losses.append(value)
      metrics.append(m)
    return sum(losses) / micro_batches, jax.tree.map(lambda *x: sum(x), *metrics)

  (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
  return float(value), metrics, grads


def _relative_err(a, b):
  """The largest difference of a leaf of ``a`` from ``b``'s relative to the
  largest entry of ``b``'s leaf (plus 1e-3 of the largest of all, for leaves
  0 but for rounding); 0-leaves of ``b`` (frozen) must be 0 in ``a`` too."""
  floor = 1e-3 * max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))
  return max(jax.tree.leaves(jax.tree.map(
      lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + floor)), a, b)))


def test_dropout_after_a_freeze_spares_the_frozen_prefix_computed_or_cached():
  """With dropout 0.3 and 2 of 4 blocks frozen, one step computing the
  frozen prefix and one reading it from AutoCache each give the loss, the
  accuracy and (read from AdamW's first moment, ``(1 − b1)·g`` after a
  fresh state) the gradients of a sequential reference written here: frozen
  blocks without dropout, active blocks and the head with the keys the
  pipeline folds per micro-batch and unit (measured: loss 1.2e-7 and 0 off,
  gradients 3.3e-7 and 4.9e-7). The same reference with dropout in the
  frozen blocks is far off (loss 9.4e-3 and 3.4e-4, gradients 0.8 and 1.3)."""
  loss_tolerance, grad_tolerance = 1e-6, 1e-5
  config = _config(alpha=0.5, micro_batches=4, epochs=3)
  with config.unlocked():
    config.cache.update(enabled=True, policy='always')
  trainer, _ = _trainer(config, samples=16, dropout=0.3, initializer_range=0.2)
  model, b1 = trainer.model, 0.9  # optax.scale_by_adam's default
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  trainer.maybe_transition(0, sample)  # schedule policy, α = 0.5, L = 4: F = 2
  assert trainer.plan.partition.num_frozen_layers == 2 and trainer.prefix.use_cache
  previous_mu = None
  for epoch, source in ((1, 'misses'), (2, 'hits')):  # one step an epoch (16 samples)
    params = jax.tree.map(np.asarray, trainer.canonical_params())
    _, step_rng = jax.random.split(trainer.state['rng'])  # as the step splits it
    plan = trainer.plan
    batch = next(iter(trainer.train_loader.epoch(epoch)))[1]
    before = trainer.prefix.stats()[f'cache_{source}']
    row = trainer.train_epoch(epoch, _Bar())
    assert row['steps'] == 1
    assert trainer.prefix.stats()[f'cache_{source}'] == before + 16  # computed, then read
    ref_loss, ref_metrics, ref_grads = _after_prefix_reference(
        model, params, batch, step_rng, 2, plan.replicas * plan.micro_batches)
    assert abs(row['train_loss'] - ref_loss) <= loss_tolerance, (epoch, row['train_loss'],
                                                                 ref_loss)
    assert row['train_accuracy'] == float(ref_metrics['correct']) / 16
    mu = _canonical_moments(trainer)[0]
    grads = (mu if previous_mu is None else jax.tree.map(lambda m, p: m - b1 * p, mu,
                                                         previous_mu))
    grads = jax.tree.map(lambda g: g / (1 - b1), grads)
    assert _relative_err(grads, ref_grads) <= grad_tolerance, epoch
    previous_mu = mu
    poisoned = _after_prefix_reference(model, params, batch, step_rng, 2,
                                       plan.replicas * plan.micro_batches, frozen_dropout=True)
    assert abs(poisoned[0] - ref_loss) > 100 * loss_tolerance  # dropout in frozen blocks shows
    assert _relative_err(poisoned[2], ref_grads) > 1e4 * grad_tolerance
    # and the active blocks' dropout was on
    assert abs(float(model.loss(params, batch)[0]) - ref_loss) > 100 * loss_tolerance


def _collectives(compiled) -> list[str]:
  return re.findall(r'(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)'
                    r'(?:-start)?\(', compiled.as_text())


def test_relayout_and_portable_state_gather_the_stages_in_one_collective():
  # Left to the partitioner, the default model's relayout took 498
  # collective-permutes (a rendezvous of all devices each, 0.2-0.9 s a move).
  trainer, _ = _trainer(_config(alpha=0.75, initial_length=8, micro_batches=8))
  old = trainer.plan.partition
  new = trainer._partition_after(3)
  assert new.pipeline_length < 8 and new != old
  mesh = trainer.mesh(trainer._candidate_plans(new)[0])
  shapes = autodp.on_mesh(trainer._state_spec(), mesh)
  move = autodp.relayout_fn(shapes, old, new, mesh, trainer.optimizer.init)
  assert _collectives(move.lower(shapes).compile()) == ['all-gather']
  portable = trainer._portable_compiled_for(trainer.plan, trainer._state_spec())
  assert _collectives(portable) == ['all-gather']
  # Blocks never unfreeze: a move back is refused before anything is traced.
  with pytest.raises(ValueError, match='^cannot unfreeze: 3 -> 0$'):
    autodp.relayout_fn(shapes, new, old, mesh, trainer.optimizer.init)


def test_a_freeze_event_that_keeps_k_narrows_the_slots_unless_asked_to_keep_them():
  """Without compression K stays 8; the stages of the deeper partition are
  narrower, and its own step program runs them (``freeze.keep_slot_width``
  pads them to the old width to reuse the compiled step)."""
  def after(keep):
    config = _config(alpha=0.75, initial_length=8, micro_batches=8)
    with config.unlocked():
      config.freeze.compress = False
      config.freeze.keep_slot_width = keep
    trainer, _ = _trainer(config, num_layers=12)
    trainer.plan = trainer._plan(trainer._partition_after(1), 8)
    old, new = trainer.plan.partition, trainer._partition_after(8)
    same_program = (pipeline.program_key(trainer._plan(new, 8))
                    == pipeline.program_key(trainer.plan))
    return old, new, same_program

  old, narrow, reused = after(False)
  _, padded, padded_reused = after(True)
  assert narrow.pipeline_length == padded.pipeline_length == 8 and not old.has_embed
  assert narrow.stage_sizes == padded.stage_sizes
  assert narrow.tables.num_slots < padded.tables.num_slots == old.tables.num_slots
  assert not reused and padded_reused


def test_bench_plans_makes_the_plans_the_trainer_makes_padded_and_narrow():
  """``experiments.bench_plans`` times each plan at its own slot width and,
  beside it, padded as ``freeze.keep_slot_width`` pads it: its plans are the
  trainer's, chained from the starting plan, and it leaves the trainer's plan
  and the user's setting as they were."""
  from experiments import bench_plans  # noqa: PLC0415
  config = _config(alpha=0.75, initial_length=8, micro_batches=8)
  with config.unlocked():
    config.freeze.compress = False
  trainer, _ = _trainer(config, num_layers=12)
  start = trainer.plan
  frozen = [0, 1, 8, 8]
  narrow = bench_plans._plans(trainer, frozen, keep_slot_width=False)
  padded = bench_plans._plans(trainer, frozen, keep_slot_width=True)
  assert trainer.plan == start and config.freeze.keep_slot_width is False
  assert sorted(narrow) == sorted(padded) == [0, 1, 8]
  assert narrow[0] == padded[0] == start and narrow[1] == padded[1]  # F = 1 leaves the embed
  # As a trainer run makes them: each event from the plan before it.
  for keep, plans in ((False, narrow), (True, padded)):
    with config.unlocked():
      config.freeze.keep_slot_width = keep
    trainer.plan = trainer._plan(trainer._partition_after(1), 8)
    assert plans[8].partition == trainer._partition_after(8)
  assert narrow[8].partition.tables.num_slots < padded[8].partition.tables.num_slots
  assert padded[8].partition.tables.num_slots == narrow[1].partition.tables.num_slots


@pytest.mark.parametrize('split', [(), (0, 1)])
def test_layer_grad_norms_match_canonical_reference(split):
  """Per-block norms from the stage layout, a split MLP's halves (on two
  stages) added up."""
  created = fixtures.tiny('bert-classification', num_layers=4)
  model, params = created.model, created.params
  partition = part.Partition(4, 0, (3, 2, 3, 2), split_mlp=split,
                             mlp_in_keys=model.mlp_in_keys if split else ())
  batch = fixtures.batch('bert-classification', model, 8)
  grads = jax.grad(lambda p: model.loss(p, batch)[0])(params)
  staged = part.to_stage_params(grads, partition)
  got = np.asarray(layer_grad_norms(staged, partition))
  ref = [np.sqrt(sum(float(jnp.sum(g[i] ** 2)) for g in jax.tree.leaves(grads['attention']))
                 + sum(float(jnp.sum(g[i] ** 2)) for g in jax.tree.leaves(grads['mlp'])))
         for i in range(4)]
  np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_the_step_sums_every_blocks_gradient_norm_over_the_timestep():
  """Eq. 1's input: after the epoch's steps, each block's accumulated norm is
  the sum over the steps of its gradient's norm, against autodiff of the
  whole model at the parameters each step started from."""
  trainer, _ = _trainer(_config(policy='pipetransformer', initial_length=4, micro_batches=4))
  model = trainer.model
  seen = [jax.device_get(trainer.portable_state()['params'])]
  trainer.train_epoch(0, _Bar(), after_step=lambda epoch, steps: seen.append(
      jax.device_get(trainer.portable_state()['params'])))
  batches = [b for _, b in trainer.train_loader.epoch(0)]
  assert len(batches) == len(seen) == 4
  ref = np.zeros(model.num_layers)
  for params, batch in zip(seen, batches):
    grads = jax.grad(lambda p, b=batch: model.loss(p, b)[0])(params)
    ref += [np.sqrt(sum(float(jnp.sum(g[i] ** 2)) for key in ('attention', 'mlp')
                        for g in jax.tree.leaves(grads[key])))
            for i in range(model.num_layers)]
  np.testing.assert_allclose(np.asarray(trainer.state['layer_norms']), ref, rtol=1e-4)


def test_a_checkpoint_restores_a_split_mlp_partition():
  trainer, _ = _trainer(_config(initial_length=4))
  assert trainer.plan.partition.split_mlp == (0,)  # (3, 2, 2, 3): mlp.0 split
  meta = trainer.checkpoint_meta(0, 0, False)
  assert meta['plan']['split_mlp'] == [0]
  assert trainer._restored_partition(meta) == trainer.plan.partition
  # Without the split (split_mlp_min_gain = 1) the same stage sizes run whole.
  config = _config(initial_length=4)
  with config.unlocked():
    config.pipeline.split_mlp_min_gain = 1.0
  whole, _ = _trainer(config)
  assert whole.plan.partition.split_mlp == ()
  assert whole.plan.partition.stage_sizes == trainer.plan.partition.stage_sizes


def test_restore_brings_back_rng_norm_accumulators_and_sums_and_a_decision_resets_them():
  """A checkpoint's portable state restored into a fresh trainer is the saved
  one bit for bit: the dropout RNG, the gradient-norm accumulators of Eq. 1 and
  the running sums too (all three feed what comes after the resume). A freeze
  decision starts the next timestep's accumulators from zero."""
  config = _config(policy='pipetransformer', alpha=0.25, initial_length=2, micro_batches=2)
  trainer, _ = _trainer(config)
  trainer.train_epoch(0, _Bar())
  saved = trainer.portable_state()
  assert float(np.abs(np.asarray(saved['layer_norms'])).min()) > 0
  meta = trainer.checkpoint_meta(0, 4, True)
  fresh, _ = _trainer(config)
  as_bytes = lambda tree: [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]  # noqa: E731
  assert as_bytes(fresh.portable_state()['rng']) != as_bytes(saved['rng'])
  fresh.restore(saved, meta)
  assert as_bytes(fresh.portable_state()) == as_bytes(saved)
  # The decision takes this timestep's norms, then zeroes them.
  norms = np.asarray(saved['layer_norms'])
  trainer.maybe_transition(0, next(iter(trainer.train_loader.epoch(0)))[1])
  np.testing.assert_array_equal(trainer.policy.state.history[-1].norms, norms)
  assert not np.asarray(trainer.state['layer_norms']).any()
  # And the restored trainer decides the same from the same accumulators.
  fresh.maybe_transition(0, next(iter(fresh.train_loader.epoch(0)))[1])
  assert fresh.policy.state.history[-1] == trainer.policy.state.history[-1]


def test_micro_batches_are_profiled_round_robin_after_an_untimed_round_fastest_wins(tmp_path):
  """Profiling M: each candidate once untimed (its compile and first run),
  then ``PROFILE_ROUNDS`` timed rounds, in turns; the candidate whose fastest
  timed step is the fastest is chosen, remembered and no longer profiled."""
  config = _config(initial_length=2, micro_batches=0)
  with config.unlocked():
    config.pipeline.profile_path = str(tmp_path / 'profile.json')
    config.train.batch_size = 32
  trainer, _ = _trainer(config)
  plan = trainer.plan
  candidates = trainer.micro_batch_candidates(plan)
  assert candidates == [2, 4, 8]  # K=2, R=4: 8 samples per replica
  rounds = trainer_lib.PROFILE_ROUNDS
  # Timings made up: M=4 has the fastest single step (a slow spell hit its
  # other one), M=2 the fastest mean; the minimum counts.
  made_up = {2: [0.30, 0.30], 4: [0.90, 0.20], 8: [0.25, 0.25]}
  turns, timed_so_far = [], {m: 0 for m in candidates}
  for _ in range(len(candidates) * (rounds + 1)):  # as the training loop does
    m, timed = trainer._next_micro_batches(plan)  # noqa: SLF001
    turns.append((m, timed))
    if timed:
      assert trainer.profile.get(2) is None  # not chosen before every timing is in
      trainer._record_timing(dataclasses.replace(plan, micro_batches=m),  # noqa: SLF001
                             made_up[m][timed_so_far[m]])
      timed_so_far[m] += 1
  assert turns == [(m, r > 0) for r in range(rounds + 1) for m in candidates]
  assert trainer.profile.get(2) == 4
  assert trainer.micro_batch_timings[2] == {2: 0.30, 4: 0.20, 8: 0.25}
  assert trainer._next_micro_batches(plan) == (4, False)  # noqa: SLF001
  with open(tmp_path / 'profile.json') as f:
    assert '"micro_batches": 4' in f.read()


def test_without_compression_k_stays_and_enough_blocks_stay_trainable_for_it():
  """``freeze.compress=False`` (the breakdown's ``freeze`` variant): K never
  changes, so at least ⌈(K − 1)/2⌉ blocks stay trainable (2·active + head ≥ K
  units), which the run says at its start."""
  config = _config(alpha=0.75, initial_length=4, micro_batches=4)
  with config.unlocked():
    config.freeze.compress = False
  created = fixtures.tiny('vit', num_layers=4)
  data = fixtures.batch('vit', created.model, 64, seed=4)
  loader = Loader(ArraySource(data), 16, seed=0)
  lines = []
  trainer = Trainer(created.model, created.params, config, '/nonexistent', loader, loader,
                    log=lines.append)
  assert ('freeze: at least 2 blocks stay trainable (freeze.min_active_layers=1): with '
          'freeze.compress=False the 4 stages need a unit each') in lines
  sample = next(iter(loader.epoch(0)))[1]
  for epoch in range(2):  # the α bound alone: 3, then 3.75; capped at L − 2 = 2
    trainer.train_epoch(epoch, _Bar())
    trainer.maybe_transition(epoch, sample)
    assert trainer.plan.partition.num_frozen_layers == 2
    assert (trainer.plan.pipeline_length, trainer.plan.replicas) == (4, 2)
    assert len(trainer.plan.partition.active_units) == 2 * 2 + 1


def test_policy_none_is_a_static_pipeline():
  trainer, _ = _trainer(_config(policy='none', initial_length=8, micro_batches=8))
  plan = trainer.plan
  trainer.train_epoch(0, _Bar())
  trainer.maybe_transition(0, next(iter(trainer.train_loader.epoch(0)))[1])
  assert trainer.plan == plan and trainer.transitions == []


def test_a_per_pipeline_checkpoint_is_refused_where_the_starting_batch_differs(tmp_path):
  """``per_pipeline`` on 4 devices instead of 8: the starting global batch
  halves, and the saved step count, schedule and epoch position are in units
  of the old one; resuming would put them in the wrong place."""
  config = _config(initial_length=4, micro_batches=2)
  with config.unlocked():
    config.train.batch_mode = 'per_pipeline'
    config.train.batch_size = 8
  created = fixtures.tiny('vit', num_layers=4)
  data = fixtures.batch('vit', created.model, 64, seed=4)

  def trainer(batch, devices):
    return Trainer(created.model, created.params, config, str(tmp_path),
                   Loader(ArraySource(data), batch, seed=0),
                   Loader(ArraySource(data), batch, shuffle=False, drop_remainder=False),
                   devices=devices, log=lambda _: None)

  saved = trainer(16, jax.devices())
  meta = saved.checkpoint_meta(0, 0, True)
  assert meta['starting_batch_size'] == 16
  with pytest.raises(resume.CheckpointMismatch,
                     match='started with a global batch of 16 samples, this one with 8'):
    trainer(8, jax.devices()[:4]).restore(saved.portable_state(), meta)
  same = trainer(16, jax.devices())
  same.restore(saved.portable_state(), meta)  # the same devices: resumes
  assert same.plan == saved.plan


def test_per_pipeline_without_autodp_counts_the_schedule_in_its_own_steps(tmp_path):
  """``per_pipeline`` with AutoDP off: one pipeline, R = 1, so every step is
  one starting batch (train.batch_size), not the R0 = N/K0 pipelines' batch
  it never runs: the learning-rate schedule moves a place a step (it stood at
  0, a warm-up's zero rate, for the whole run)."""
  config = _config(initial_length=4, micro_batches=2, epochs=2)
  with config.unlocked():
    config.train.update(batch_mode='per_pipeline', batch_size=8, warmup_epochs=0.5)
    config.pipeline.autodp = False
  trainer, _ = _trainer(config, workdir=str(tmp_path))
  assert (trainer.plan.replicas, trainer.starting_batch_size, trainer.steps_per_epoch) == (1, 8, 8)
  before = jax.device_get(trainer.portable_state()['params'])
  trainer.train_epoch(0, _Bar())
  assert int(trainer.state['step']) == trainer.base_steps_done() == 8
  assert float(trainer.lr(trainer.base_steps_done())) > 0.0  # past the warm-up of 4 steps
  after = jax.device_get(trainer.portable_state()['params'])
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                      jax.tree.leaves(after), strict=True))


def test_a_mid_epoch_per_pipeline_checkpoint_is_refused_where_the_plans_batch_differs(tmp_path):
  """Saved on 8 devices after compressing to K = 2 (R = 4: batches of 32),
  resumed on 4 (K = 2, R = 2: batches of 16) with the same starting batch:
  its position in the epoch counts batches of 32, so the rest of the epoch
  would repeat samples. At an epoch's end the next epoch starts afresh."""
  config = _config(alpha=0.5, initial_length=4, micro_batches=2, epochs=3)
  with config.unlocked():
    config.train.update(batch_mode='per_pipeline', batch_size=8)

  def trainer(batch, devices, initial_length):
    with config.unlocked():
      config.pipeline.initial_length = initial_length
    return _trainer(config, batch=batch, workdir=str(tmp_path), devices=devices)[0]

  saved = trainer(16, jax.devices(), 4)
  sample = next(iter(saved.train_loader.epoch(0)))[1]
  for epoch in range(2):
    saved.train_epoch(epoch, _Bar())
    saved.maybe_transition(epoch, sample)
  assert (saved.plan.pipeline_length, saved.plan.replicas) == (2, 4)
  mid = saved.checkpoint_meta(2, 1, False)
  with pytest.raises(resume.CheckpointMismatch,
                     match=r'saved in the middle of epoch 2, 1 batches of 32 samples in; on 4 '
                           r'devices its plan takes batches of 16'):
    trainer(16, jax.devices()[:4], 2).restore(saved.portable_state(), mid)
  resumed = trainer(16, jax.devices()[:4], 2)
  resumed.restore(jax.device_get(saved.portable_state()), saved.checkpoint_meta(1, 0, True))
  assert (resumed.plan.pipeline_length, resumed.plan.replicas) == (2, 2)


def test_a_compressed_run_resumed_on_fewer_devices_keeps_its_shorter_pipeline(tmp_path):
  """Saved at K = 2 (compressed from K0 = 4, R = 4 on 8 devices), resumed on
  4 devices with the same starting length: K stays 2 (R = 2); the pipeline
  never grows back to K0 for the frozen blocks it shed."""
  config = _config(alpha=0.5, initial_length=4, micro_batches=2, epochs=3)

  def trainer(devices):
    return _trainer(config, workdir=str(tmp_path), devices=devices)[0]

  saved = trainer(jax.devices())
  sample = next(iter(saved.train_loader.epoch(0)))[1]
  for epoch in range(2):
    saved.train_epoch(epoch, _Bar())
    saved.maybe_transition(epoch, sample)
  assert (saved.plan.pipeline_length, saved.plan.replicas) == (2, 4)
  resumed = trainer(jax.devices()[:4])
  resumed.restore(jax.device_get(saved.portable_state()), saved.checkpoint_meta(1, 0, True))
  assert (resumed.plan.pipeline_length, resumed.plan.replicas) == (2, 2)
  assert resumed.plan.partition.num_frozen_layers == saved.plan.partition.num_frozen_layers


def test_a_mid_epoch_checkpoint_is_refused_where_the_data_shards_differ(tmp_path):
  """Two shards (two hosts' order) saved mid-epoch, resumed with the plain
  loader: the rest of the epoch would repeat and skip samples. At an epoch's
  end the next epoch's order is the run's own: accepted."""
  from pipejax.data import ShardedLoader  # noqa: PLC0415
  config = _config(initial_length=4, micro_batches=4)
  created = fixtures.tiny('vit', num_layers=4)
  data = fixtures.batch('vit', created.model, 64, seed=4)

  def trainer(loader):
    return Trainer(created.model, created.params, config, str(tmp_path), loader,
                   Loader(ArraySource(data), 16, shuffle=False, drop_remainder=False),
                   log=lambda _: None)

  sharded = trainer(ShardedLoader(ArraySource(data), 16, 2, (0, 1), seed=0))
  plain = trainer(Loader(ArraySource(data), 16, seed=0))
  mid = sharded.checkpoint_meta(0, 2, False)
  assert mid['data_shards'] == 2
  with pytest.raises(resume.CheckpointMismatch,
                     match=r'over 2 data shard\(s\), this run draws them over 1.*'
                           r'--config.distributed.data_shards=2'):
    plain.check_resumable(mid)
  plain.check_resumable(sharded.checkpoint_meta(0, 4, True))
  sharded.check_resumable(mid)


def test_a_fixed_micro_batch_count_survives_transitions_whatever_the_profile_remembers(
    tmp_path):
  """``pipeline.micro_batches`` set: every plan runs that M, even where the
  shared profile file remembers another M for the new K (what a profiling
  run of the same model wrote); the file is neither read nor written."""
  config = _config(alpha=0.5, initial_length=4, micro_batches=4)
  notes = tmp_path / 'notes.txt'
  notes.write_text('{my notes')  # what a damaged profile looks like: never moved here
  with config.unlocked():
    config.pipeline.profile_path = str(notes)
  trainer, _ = _trainer(config)
  assert trainer.profile.path is None and os.listdir(tmp_path) == ['notes.txt']
  trainer.profile.entries = {str(k): {'micro_batches': 2, 'seconds': {}} for k in (1, 2, 4)}
  assert trainer.plan.micro_batches == 4
  trainer.train_epoch(0, _Bar())
  trainer.maybe_transition(0, next(iter(trainer.train_loader.epoch(0)))[1])
  assert trainer.transitions and trainer.plan.partition.num_frozen_layers == 2
  assert trainer.plan.micro_batches == 4
  assert trainer._candidate_plans(trainer.plan.partition) == [trainer.plan]


def test_a_transition_to_a_pipeline_length_still_to_profile_names_its_candidates():
  """With no M remembered for the new K, the steps after the transition time
  each candidate in turn: the transition's line and record list them, not
  the first candidate as if it were the M chosen."""
  config = _config(alpha=0.5, initial_length=4, micro_batches=0)
  trainer, _ = _trainer(config)
  lines = []
  trainer.log = lines.append
  trainer.train_epoch(0, _Bar())
  trainer.maybe_transition(0, next(iter(trainer.train_loader.epoch(0)))[1])
  [transition] = trainer.transitions
  candidates = trainer.micro_batch_candidates(trainer.plan)
  assert (trainer.plan.pipeline_length, trainer.plan.replicas, candidates) == (4, 2, [4, 8])
  assert transition.new.startswith('K=4 R=2 M=profiled among [4, 8] 1f1b ')
  assert sum(f'-> {transition.new} (' in line for line in lines) == 1
  # A remembered M (or a fixed one) is the plan's M.
  assert trainer.plan.describe([4]) == trainer.plan.describe()
  assert trainer.plan.describe().startswith(f'K=4 R=2 M={trainer.plan.micro_batches} 1f1b ')


def test_a_fixed_m_refitted_to_a_larger_r_is_said_once():
  """A fixed M that no longer divides a replica's batch once R grows is
  refitted where the plan is made: compiled ahead, then moved to, it was
  said twice."""
  config = _config(alpha=0.75, initial_length=4, micro_batches=8)  # K = 4, R = 2, then 2, 4
  with config.unlocked():
    config.freeze.compile_ahead = True
  trainer, _ = _trainer(config)
  lines = []
  trainer.log = lines.append
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  trainer.train_epoch(0, _Bar())
  trainer.prepare_next(sample)
  trainer.maybe_transition(0, sample)
  assert trainer.transitions[0].compiled_ahead
  assert (trainer.plan.replicas, trainer.plan.micro_batches) == (4, 4)
  assert [line for line in lines if 'does not divide' in line] == [
      '  micro-batches: M=8 does not divide the 4 samples per replica at R=4; using M=4']


def test_an_infinite_or_nan_loss_stops_training():
  for bad in (float('inf'), float('-inf'), float('nan')):
    with pytest.raises(trainer_lib.LossNotFinite, match=f'the training loss is {bad} at step 7'):
      Trainer._check_finite(bad, 1, 7)
  Trainer._check_finite(1e30, 1, 7)  # large is not diverged


def test_a_nan_loss_stops_the_epoch_at_the_next_tenth_step():
  """The loss is read every 10 steps: an epoch of 12 steps on NaN inputs
  stops at step 10, not at its end."""
  created = fixtures.tiny('vit', num_layers=4)
  data = dict(fixtures.batch('vit', created.model, 192, seed=4))
  data['pixel_values'] = np.full_like(data['pixel_values'], np.nan)
  config = _config(policy='none')
  trainer, _ = _trainer(config, data=data)
  assert trainer.train_loader.steps_per_epoch() == 12
  with pytest.raises(trainer_lib.LossNotFinite, match=r'^the training loss is nan at step 10 '):
    trainer.train_epoch(0, _Bar())
  assert int(trainer.state['step']) == 10


def test_a_nan_loss_in_a_later_epoch_names_the_run_s_step():
  """The step a NaN loss names is the run's (as checkpoints and the other
  checks name them), not the batch within the epoch: weights poisoned after
  epoch 0 stop epoch 1 at its tenth step."""
  created = fixtures.tiny('vit', num_layers=4)
  trainer, _ = _trainer(_config(policy='none'),
                        data=dict(fixtures.batch('vit', created.model, 192, seed=4)))
  steps = trainer.train_loader.steps_per_epoch()
  assert steps == 12
  trainer.train_epoch(0, _Bar())
  trainer.state = {**trainer.state,
                   'active': jax.tree.map(lambda x: x * np.nan, trainer.state['active'])}
  with pytest.raises(trainer_lib.LossNotFinite,
                     match=rf'^the training loss is nan at step {steps + 10} \(epoch 1\)'):
    trainer.train_epoch(1, _Bar())
  assert int(trainer.state['step']) == steps + 10


@pytest.mark.parametrize('every_steps', [1, 0])
def test_a_non_finite_gradient_with_a_finite_loss_is_never_checkpointed(monkeypatch,
                                                                        every_steps):
  """A step whose loss is finite but whose gradients are not (its update
  poisons the weights; only the next step's loss would show it) stops the
  run before any save, mid-epoch or at the epoch's end, naming the block."""
  real = trainer_lib.layer_grad_norms
  monkeypatch.setattr(trainer_lib, 'layer_grad_norms',
                      lambda *a, **k: real(*a, **k).at[2].set(jnp.inf))
  trainer, _ = _trainer(_config(policy='none'))
  saved = []
  with pytest.raises(trainer_lib.LossNotFinite,
                     match=r'the gradient norm of block 2 is inf at step (\d+)') as raised:
    trainer.run(1, lambda epoch, steps: contextlib.nullcontext(_Bar()),
                save=lambda *args: saved.append(args), save_every_steps=every_steps)
  assert saved == []
  assert raised.value.step == (1 if every_steps else trainer.steps_per_epoch)
  assert math.isfinite(float(np.asarray(trainer.state['sums'])[0]))  # the loss alone was fine


def test_a_batch_the_frozen_prefix_cannot_split_is_refused_before_training(tmp_path):
  """R·M = 2 x 2 divides 12 but R·K = 2 x 4 does not: the frozen blocks'
  forward, data-parallel over the plan's 8 devices, would fail after a whole
  epoch of training (inside JAX). Without freezing the batch is fine."""
  config = _config(micro_batches=2)
  with config.unlocked():
    config.train.batch_size = 12
  with pytest.raises(pipeline.PlanError, match=r'^train.batch_size=12 gives a global batch of '
                     r'12 at pipeline length 4 \(R = 2\), which its 8 devices cannot split: .* '
                     r'multiple of 8$'):
    _trainer(config, workdir=str(tmp_path))
  with config.unlocked():
    config.freeze.policy = 'none'
  trainer, _ = _trainer(config, workdir=str(tmp_path))
  assert (trainer.plan.replicas, trainer.plan.pipeline_length) == (2, 4)


def test_a_train_loader_that_pads_its_last_batch_trains_on_the_real_samples_only():
  """A train loader without ``drop_remainder`` pads its last batch with
  repeated samples (``example_mask`` 0); the trainer's epoch then equals
  AdamW on the real samples of each batch, computed without the pipeline."""
  config = _config(policy='none', initial_length=4, micro_batches=2, epochs=1)
  created = fixtures.tiny('vit', num_layers=4)
  # Batches of 16, 16, and 10 + 6 padding: a micro-batch of 4 (R = 2, M = 2)
  # holds 2 real samples and 2 padded, and one holds only padding.
  data = fixtures.batch('vit', created.model, 42, seed=4)
  loader = Loader(ArraySource(data), 16, seed=0, drop_remainder=False)
  trainer = Trainer(created.model, created.params, config, '/nonexistent', loader,
                    Loader(ArraySource(data), 16, shuffle=False, drop_remainder=False),
                    log=lambda _: None)
  assert trainer.plan.replicas == 2 and loader.steps_per_epoch() == 3
  trainer.train_epoch(0, _Bar())
  _, tx = optimizer_lib.optimizer_for(config.train, steps_per_epoch=3)
  params, state = created.params, tx.init(created.params)
  step = jax.jit(jax.value_and_grad(lambda p, b: created.model.loss(p, b)[0]))
  batches = list(loader.epoch(0))
  assert batches[-1][1]['example_mask'].tolist() == [1.0] * 10 + [0.0] * 6
  for _, batch in batches:
    real = batch.pop('example_mask', np.ones(16)) > 0
    _, grads = step(params, {k: v[real] for k, v in batch.items()})
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  ours = trainer.canonical_params()
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)


@pytest.mark.parametrize('kind', ['vit', 'bert-classification'])
def test_clipping_and_sparing_biases_and_norms_equal_optax_on_the_sequential_model(kind):
  """``train.max_grad_norm`` and ``train.decay_biases_and_norms=False``: an
  epoch of the pipeline (4 stages, 2 replicas) equals optax's own
  ``clip_by_global_norm`` and masked ``adamw`` on the sequential model's
  gradients, the decay applied to the matrices and embeddings only (listed
  here by name). Without the clip, or with every leaf decayed, it differs."""
  config = _config(policy='none', initial_length=4, micro_batches=2, epochs=1)
  with config.unlocked():
    config.train.update(max_grad_norm=0.5, decay_biases_and_norms=False, weight_decay=0.5)
  trainer, _ = _trainer(config, samples=48, batch=16, initializer_range=0.2, kind=kind)
  created, loader = fixtures.tiny(kind, num_layers=4, initializer_range=0.2), trainer.train_loader
  trainer.train_epoch(0, _Bar())
  ours = trainer.canonical_params()

  def decayed(path, _):
    return getattr(path[-1], 'key') in ('kernel', 'embedding', 'cls_token',
                                        'position_embeddings')

  mask = jax.tree_util.tree_map_with_path(decayed, created.params)
  assert 0 < sum(jax.tree.leaves(mask)) < len(jax.tree.leaves(mask))
  lr, _ = optimizer_lib.optimizer_for(config.train, steps_per_epoch=3)
  step = jax.jit(jax.value_and_grad(lambda p, b: created.model.loss(p, b)[0]))
  norms = []

  def reference(clip, mask):
    tx = optax.chain(*([optax.clip_by_global_norm(clip)] if clip else []),
                     optax.adamw(lr, weight_decay=config.train.weight_decay, mask=mask))
    params, state = created.params, tx.init(created.params)
    for _, batch in loader.epoch(0):
      _, grads = step(params, batch)
      norms.append(float(optax.global_norm(grads)))
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params

  def err(params):
    # But the key bias: softmax ignores it, so its gradient is 0 but for
    # rounding, which Adam scales up to steps of the learning rate's size.
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ours)[0],
                                       jax.tree.leaves(params), strict=True)
               if "['key']['bias']" not in jax.tree_util.keystr(path))

  assert err(reference(0.5, mask)) <= 5e-5
  assert max(norms) > 0.5  # the clip took part
  assert err(reference(None, mask)) > 1e-3
  assert err(reference(0.5, None)) > 1e-3


def test_global_batch_modes():
  assert autodp.global_batch_size(64, 4, 'constant') == 64
  assert autodp.global_batch_size(64, 4, 'per_pipeline') == 256
  with pytest.raises(ValueError, match="unknown batch mode 'x'"):
    autodp.global_batch_size(64, 4, 'x')


def test_freeze_timestep_in_steps():
  config = _config(alpha=0.5, initial_length=4, micro_batches=4, epochs=3)
  with config.unlocked():
    config.freeze.timestep_steps = 2
  trainer, _ = _trainer(config)  # 64 samples / 16 = 4 steps per epoch
  prefetched, prefetch = [], trainer.prefix.prefetch

  def spy(batches, plan, frozen):
    prefetched.append(([ids.tolist() for ids in batches], plan.partition.num_frozen_layers))
    return prefetch(batches, plan, frozen)

  trainer.prefix.prefetch = spy
  stats = trainer.train_epoch(0, _Bar())
  # Two timesteps inside the epoch: F = 2 (bound 2.0), then 3 (bound 3.0).
  assert [d.result for d in trainer.policy.state.history] == [2, 3]
  assert [t.step for t in trainer.transitions] == [2, 4]
  # The cache reads ahead for the epoch's rest at each new depth.
  loader = trainer._train_loader()  # noqa: SLF001
  assert prefetched == [([ids.tolist() for ids in loader.batch_ids(0, start)], depth)
                        for start, depth in ((0, 0), (2, 2), (4, 3))]
  assert stats['steps'] == 4 and stats['transition_seconds'] > 0
  assert trainer.plan.partition.num_frozen_layers == 3


def test_without_autodp_one_pipeline_on_k_devices_same_losses():
  """The AutoDP ablation: compression frees devices that stay idle (R = 1);
  the maths are unchanged, so the losses match the AutoDP run's, and each
  run's pipeline is fed, row by row, its samples' own prefix output (the
  cache's entries: computed at F = 2, advanced to 3)."""
  from tests.test_cache_training import _check_fed_as_computed, _record_feeds  # noqa: PLC0415

  def run(autodp_on):
    config = _config(alpha=0.5, initial_length=4, micro_batches=2, epochs=3)
    with config.unlocked():
      config.pipeline.autodp = autodp_on
      config.cache.policy = 'always'
    trainer, data = _trainer(config)
    fed = _record_feeds(trainer)
    sample = next(iter(trainer.train_loader.epoch(0)))[1]
    losses, plans = [], []
    for epoch in range(3):
      losses.append(trainer.train_epoch(epoch, _Bar())['train_loss'])
      plans.append((trainer.plan.pipeline_length, trainer.plan.replicas))
      trainer.maybe_transition(epoch, sample)
    accuracy = trainer.evaluate()['eval_accuracy']
    steps = trainer.train_loader.steps_per_epoch()
    assert _check_fed_as_computed(trainer, data, fed) == [2] * steps + [3] * steps
    assert trainer.prefix.cache.stats()['hits'] == 64  # epoch 2 was read from the cache
    return losses, plans, accuracy, trainer

  losses, plans, accuracy, trainer = run(False)
  ref_losses, ref_plans, ref_accuracy, _ = run(True)
  assert [k for k, _ in plans] == [k for k, _ in ref_plans]
  assert plans[-1][0] < 4, plans  # compressed
  assert all(r == 1 for _, r in plans) and ref_plans[-1][1] == 8 // ref_plans[-1][0]
  # Measured: 7.4e-8 relative in epoch 0, equal after.
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  assert accuracy == pytest.approx(ref_accuracy, abs=1e-6)
  k = trainer.plan.pipeline_length  # the state lives on the first K devices only
  used = {d for leaf in jax.tree.leaves(trainer.state) for d in leaf.sharding.device_set}
  assert used == set(trainer.devices[:k])


class _Holder:
  """What ``Trainer._compiled_once`` reads of a trainer: its compile-ahead pool."""

  def __init__(self, pool):
    self._pool = pool


def _counting(results):
  """A compile function that returns (or raises) the next of ``results``
  and records the thread each call ran on."""
  calls = []

  def compile_it():
    calls.append(threading.current_thread() is threading.main_thread())
    outcome = results[len(calls) - 1]
    if isinstance(outcome, Exception):
      raise outcome
    return outcome
  return compile_it, calls


def test_a_caller_that_needs_a_compile_still_queued_runs_it_itself():
  """A background compile queued behind other work (the next plan's) is
  taken over by a caller that needs it now: cancelled in the queue, run once
  on the caller's thread, and kept for the next caller."""
  pool = concurrent.futures.ThreadPoolExecutor(1)
  release = threading.Event()
  try:
    busy = pool.submit(release.wait, 60)  # the pool is busy with the next plan
    held, holder = {}, _Holder(pool)
    compile_it, calls = _counting(['compiled'])
    queued = trainer_lib.Trainer._compiled_once(holder, held, 'k', compile_it, background=True)
    assert not queued.done() and calls == []
    now = trainer_lib.Trainer._compiled_once(holder, held, 'k', compile_it, background=False)
    assert now.result() == 'compiled' and calls == [True]  # on the caller's thread
    assert queued.cancelled() and held['k'] is now
    again = trainer_lib.Trainer._compiled_once(holder, held, 'k', compile_it, background=True)
    assert again is now and calls == [True]  # kept: not compiled again
  finally:
    release.set()
    pool.shutdown(wait=True)
  assert busy.result() is True


def test_a_failed_or_cancelled_background_compile_is_compiled_afresh():
  """A background compile that raised is not re-raised forever: the next
  call, in the background or now, compiles afresh; a future cancelled by the
  pool's shutdown is compiled afresh too; a compile that fails on the
  caller's thread raises and is not kept."""
  pool = concurrent.futures.ThreadPoolExecutor(1)
  held, holder = {}, _Holder(pool)
  compile_it, calls = _counting([RuntimeError('out of memory'), 'second', RuntimeError('again'),
                                 'fourth'])
  try:
    failed = trainer_lib.Trainer._compiled_once(holder, held, 'k', compile_it, background=True)
    assert isinstance(failed.exception(timeout=60), RuntimeError)
    retried = trainer_lib.Trainer._compiled_once(holder, held, 'k', compile_it, background=True)
    assert retried is not failed and retried.result(timeout=60) == 'second'
    assert calls == [False, False]
    assert trainer_lib.Trainer._compiled_once(holder, held, 'k', compile_it,
                                              background=False) is retried  # kept once it worked
    with pytest.raises(RuntimeError, match='again'):
      trainer_lib.Trainer._compiled_once(holder, held, 'other', compile_it, background=False)
    assert 'other' not in held
    assert trainer_lib.Trainer._compiled_once(
        holder, held, 'other', compile_it, background=False).result() == 'fourth'
  finally:
    pool.shutdown(wait=True)
  cancelled = concurrent.futures.Future()
  assert cancelled.cancel()
  held['k'] = cancelled  # e.g. the run ended before the pool started it
  compile_it, calls = _counting(['fresh'])
  assert trainer_lib.Trainer._compiled_once(holder, held, 'k', compile_it,
                                            background=False).result() == 'fresh'
  assert calls == [True]


def test_a_plan_whose_preparation_ahead_failed_is_prepared_at_the_transition():
  """The background preparation of the predicted plan raised (or was
  cancelled): the transition prepares it on its own thread, says so in one
  line, and records it as not compiled ahead."""
  config = _config(alpha=0.5, initial_length=4, micro_batches=4)
  with config.unlocked():
    config.freeze.compile_ahead = True
  trainer, _ = _trainer(config)
  messages = []
  trainer.log = messages.append
  batch = next(iter(trainer.train_loader.epoch(0)))[1]
  trainer.prepare_next(batch)
  ahead = trainer._ahead  # noqa: SLF001
  ahead.future.result(timeout=600)
  failed = concurrent.futures.Future()
  failed.set_exception(RuntimeError('RESOURCE_EXHAUSTED: out of memory\nmore detail'))
  trainer._ahead = ahead._replace(future=failed)  # noqa: SLF001
  trainer.prepare_next(batch)  # the same prediction: a failed job is not kept, but started again
  again = trainer._ahead  # noqa: SLF001
  assert again.move == ahead.move and again.future is not failed
  again.future.result(timeout=600)
  trainer._ahead = again._replace(future=failed)  # noqa: SLF001
  new = ahead.move[1]
  trainer.train_epoch(0, _Bar())
  trainer.maybe_transition(0, batch)
  assert trainer.plan.partition == new and trainer.plan.partition.num_frozen_layers == 2
  assert ('  preparing the next plan ahead failed (RuntimeError: RESOURCE_EXHAUSTED: out of '
          'memory); preparing it now') in messages
  assert trainer.transitions[-1].compiled_ahead is False
  trainer.train_epoch(1, _Bar())  # and the prepared plan trains


def test_a_prediction_not_taken_stops_its_background_preparation(monkeypatch):
  """The argmin of Eq. 1 froze fewer blocks than the α bound predicted: the
  background job for the predicted plan stops before its next compile (it
  would compete with the transition's own), and a repeated prediction keeps
  its job running."""
  config = _config(policy='pipetransformer', alpha=0.5, initial_length=4, micro_batches=0)
  with config.unlocked():
    config.freeze.compile_ahead = True
  trainer, _ = _trainer(config)
  batch = next(iter(trainer.train_loader.epoch(0)))[1]
  release, compiled = threading.Event(), []
  compile_step = trainer._compile_step  # noqa: SLF001

  def slow_compile(plan, state_shapes, feed):  # the background job's step compiles
    if threading.current_thread() is not threading.main_thread():
      release.wait(timeout=600)
      compiled.append(plan.partition.num_frozen_layers)
    return compile_step(plan, state_shapes, feed)

  trainer._compile_step = slow_compile  # noqa: SLF001
  trainer.prepare_next(batch)
  ahead = trainer._ahead  # noqa: SLF001
  assert ahead.move[1].num_frozen_layers == 2  # the α bound: 0 + 0.5 * 4
  trainer.prepare_next(batch)  # the same prediction: the same job
  assert trainer._ahead is ahead  # noqa: SLF001
  trainer.train_epoch(0, _Bar())
  # Block 0's gradient norm the smallest: Eq. 1 freezes 1 block, not the predicted 2.
  norms = np.asarray(trainer.state['layer_norms']).copy()
  norms[0] = 0.0
  trainer.state['layer_norms'] = jax.device_put(norms, trainer.state['layer_norms'].sharding)
  trainer.maybe_transition(0, batch)
  assert trainer.plan.partition.num_frozen_layers == 1
  assert trainer._ahead is None and ahead.stale.is_set()  # noqa: SLF001
  release.set()
  with pytest.raises(concurrent.futures.CancelledError):
    ahead.future.result(timeout=600)
  assert len(compiled) <= 1 < len(trainer.micro_batch_candidates(  # stopped after one compile
      trainer._plan(ahead.move[1], None)))  # noqa: SLF001
  assert trainer.transitions[-1].compiled_ahead is False


@pytest.mark.parametrize('timestep_steps', [0, 2, 8])
def test_no_preparation_runs_on_after_the_last_freeze_timestep(monkeypatch, tmp_path,
                                                               timestep_steps):
  """After the last timestep that can end (epochs: the one before the last
  epoch; steps: the last multiple of ``freeze.timestep_steps`` before the
  end), no job prepares a plan that nothing would use: a kept one stops and
  none starts (with 8 steps in all and ``timestep_steps=8``, none ever)."""
  config = _config(epochs=2)
  with config.unlocked():
    config.freeze.update(compile_ahead=True, timestep_steps=timestep_steps)
  trainer, _ = _trainer(config)  # 4 steps per epoch, 8 in all
  trainer.workdir = str(tmp_path)  # metrics.jsonl
  prepared, at_start, at_end = [], [], []
  prepare_next, train_epoch = trainer.prepare_next, trainer.train_epoch

  def counted(batch):
    prepared.append(int(trainer.state['step']))
    prepare_next(batch)

  def epoch(number, *args, **kwargs):
    at_start.append(trainer._ahead)  # noqa: SLF001
    stats = train_epoch(number, *args, **kwargs)
    at_end.append(trainer._ahead)  # noqa: SLF001
    return stats

  monkeypatch.setattr(trainer, 'prepare_next', counted)
  monkeypatch.setattr(trainer, 'train_epoch', epoch)
  # Every timestep keeps F (the decision is the current depth), so a job
  # predicted for the next one would be kept.
  monkeypatch.setattr(trainer, 'maybe_transition', lambda *args: 0.0)
  trainer.run(2, lambda epoch, steps: contextlib.nullcontext(_Bar()))
  # Timesteps end after epoch 0 (epochs), at steps 2, 4 and 6 (2), or never (8).
  assert prepared == {0: [0], 2: [0, 2, 4], 8: []}[timestep_steps]
  if timestep_steps == 8:
    assert at_start == at_end == [None, None]
    return
  job = at_start[0]
  assert job is not None and at_end[0] is job  # kept: the next decision keeps F
  # Stopped before the last epoch (epochs) or at step 6, inside it (steps).
  assert at_start[1] is (job if timestep_steps else None) and at_end[1] is None
  assert job.stale.is_set()


def test_a_failure_before_the_first_epoch_still_shuts_the_background_thread(monkeypatch):
  """What run() starts before its epochs (the evaluation's compile ahead) is
  inside its clean-up: an error there still shuts the compile-ahead pool
  (cancelling its queue) and unfreezes the garbage collector."""
  trainer, _ = _trainer(_config(epochs=1))

  def fail():
    trainer._pool.submit(lambda: None)
    raise OSError('eval set unreadable')

  monkeypatch.setattr(trainer, '_compile_eval_ahead', fail)
  with pytest.raises(OSError, match='unreadable'):
    trainer.run(1, lambda epoch, steps: contextlib.nullcontext(_Bar()))
  assert trainer._pool._shutdown and gc.get_freeze_count() == 0


def test_evaluation_is_compiled_ahead_kept_in_the_store_and_counts_every_sample(tmp_path,
                                                                               monkeypatch):
  """run() compiles the evaluation forward (and the portable-state program
  it reads) in the background thread while the first epoch trains; a later
  trainer of the same run loads it from the program store without tracing the
  model; the accuracy is the model's own count over the whole eval set (40
  samples: one batch of 4 x 16, padded), and the same in batches of 8
  (train.eval_batch_size)."""
  from pipejax import programs as programs_lib  # noqa: PLC0415
  config = _config(epochs=1)
  created = fixtures.tiny('vit', num_layers=4)
  data = fixtures.batch('vit', created.model, 40, seed=4)
  compiled_on, portable_on, traced = [], [], []
  real_compile, real_loss_fn = programs_lib.ProgramStore.compile, created.model.loss_fn

  def compile_(self, name, *args, **kwargs):
    on_main = threading.current_thread() is threading.main_thread()
    {'eval': compiled_on, 'portable': portable_on}.get(name, []).append(on_main)
    return real_compile(self, name, *args, **kwargs)

  def loss_fn(*args, **kwargs):
    traced.append(1)
    return real_loss_fn(*args, **kwargs)

  monkeypatch.setattr(programs_lib.ProgramStore, 'compile', compile_)
  model = dataclasses.replace(created.model, loss_fn=loss_fn)

  def make(workdir):
    os.makedirs(workdir)
    loader = Loader(ArraySource(data), 16, seed=0)
    evals = Loader(ArraySource(data), 16, shuffle=False, drop_remainder=False)
    return Trainer(model, created.params, config, workdir, loader, evals,
                   log=lambda _: None, program_store=str(tmp_path / 'store'))

  first = make(str(tmp_path / 'a'))
  rows = first.run(1, lambda epoch, steps: contextlib.nullcontext(_Bar()))['rows']
  assert compiled_on == [False]  # ahead, in the background thread; evaluate() reused it
  assert portable_on == [False]  # the portable state evaluation read: the same
  second = make(str(tmp_path / 'b'))
  traced.clear()  # (building the trainer traced its initial state)
  accuracy = second.evaluate(first.canonical_params())['eval_accuracy']
  assert compiled_on == [False, True] and not traced  # loaded, not traced
  assert accuracy == rows[0]['eval_accuracy']
  metrics = created.model.loss(jax.device_get(first.canonical_params()),
                      {k: jnp.asarray(v) for k, v in data.items()})[1]
  assert float(metrics['count']) == 40
  assert accuracy == float(metrics['correct']) / 40
  assert second.eval_batch_size() == 64
  with second.config.unlocked():
    second.config.train.eval_batch_size = 8  # 5 batches
  assert second.evaluate(first.canonical_params())['eval_accuracy'] == accuracy


class _CountingSource(ArraySource):
  """An ArraySource that records how many IDs each read asked for."""

  def __init__(self, data):
    super().__init__(data)
    self.reads = []

  def __getitem__(self, ids):
    self.reads.append(len(np.atleast_1d(ids)))
    return super().__getitem__(ids)


def test_evaluation_compiled_ahead_from_one_sample_and_for_the_starting_batch(tmp_path):
  """Compiling evaluation ahead reads one sample, not an eval batch; in
  per_pipeline mode (the batch grows with R) evaluation keeps the starting
  batch, so a transition that changes R compiles no second evaluation; an
  empty eval set compiles nothing and does not fail."""
  config = _config(alpha=0.5, initial_length=4, micro_batches=2, epochs=2)
  with config.unlocked():
    config.train.batch_mode = 'per_pipeline'
    config.train.batch_size = 8  # 16 at R = 2, then 32 at R = 4 (K = 2 after a freeze)
  created = fixtures.tiny('vit', num_layers=4)
  data = fixtures.batch('vit', created.model, 64, seed=4)
  evals_source = _CountingSource(data)
  trainer = Trainer(created.model, created.params, config, str(tmp_path),
                    Loader(ArraySource(data), 16, seed=0),
                    Loader(evals_source, 16, shuffle=False, drop_remainder=False),
                    log=lambda _: None)
  trainer._compile_eval_ahead()  # noqa: SLF001
  assert evals_source.reads == [1]
  [ahead] = trainer._eval.values()  # noqa: SLF001
  ahead.result()
  first = trainer.evaluate()['eval_accuracy']
  assert len(trainer._eval) == 1  # noqa: SLF001 - evaluate() ran what was compiled ahead
  replicas = trainer.plan.replicas
  for epoch in range(3):  # schedule policy, α = 0.5: F = 2, 3 (compressed to K = 2), 3
    trainer.maybe_transition(epoch, next(iter(trainer.train_loader.epoch(0)))[1])
  assert trainer.plan.replicas > replicas  # the train batch grew
  assert trainer.evaluate()['eval_accuracy'] == first  # nothing trained in between
  assert len(trainer._eval) == 1  # noqa: SLF001
  empty = Trainer(created.model, created.params, config, str(tmp_path / 'e'),
                  Loader(ArraySource(data), 16, seed=0),
                  Loader(ArraySource(data), 16, shuffle=False, drop_remainder=False,
                         ids=np.arange(0)), log=lambda _: None)
  empty._compile_eval_ahead()  # noqa: SLF001
  assert empty._eval == {}  # noqa: SLF001


@pytest.mark.parametrize('cache_policy', ['profile', 'always'])
def test_per_pipeline_batch_mode_runs_through_compression(tmp_path, cache_policy):
  """The paper's batch mode end to end: the global batch grows with R at the
  compression (8 per pipeline: 16 at R = 2, 32 at R = 4), the cache decision
  and the programs compiled ahead take the new batch, evaluation keeps one
  program for the run."""
  config = _config(alpha=0.5, initial_length=4, micro_batches=2, epochs=3)
  with config.unlocked():
    config.train.batch_mode = 'per_pipeline'
    config.train.batch_size = 8
    config.freeze.compile_ahead = True
    config.cache.policy = cache_policy
  trainer, _ = _trainer(config, batch=16, workdir=str(tmp_path))
  bars, frozen_objects, compiled, depths = [], [], [], []
  compile_step, change_depth = trainer._compile_step, trainer.prefix.change_depth  # noqa: SLF001

  def spy_compile(plan, state_shapes, feed):  # ahead (background thread) or at a transition
    compiled.append((plan.partition.pipeline_length,
                     {x.shape[0] for x in jax.tree.leaves(feed)}))
    return compile_step(plan, state_shapes, feed)

  def spy_depth(plan, frozen, sample_batch, batch_size, epochs_ahead):
    depths.append((plan.partition.num_frozen_layers, batch_size))
    return change_depth(plan, frozen, sample_batch, batch_size, epochs_ahead)

  trainer._compile_step, trainer.prefix.change_depth = spy_compile, spy_depth  # noqa: SLF001

  def progress(epoch, steps):
    bars.append(steps)
    frozen_objects.append(gc.get_freeze_count())
    return contextlib.nullcontext(_Bar())

  rows = trainer.run(3, progress)['rows']
  # What existed before the run was out of the collector's sight during it, and back after.
  assert all(n > 1000 for n in frozen_objects) and gc.get_freeze_count() == 0
  assert [(r['frozen_layers'], r['pipeline_length'], r['replicas']) for r in rows] == [
      (0, 4, 2), (2, 4, 2), (3, 2, 4)]
  assert [r['step'] for r in rows] == [4, 8, 10]  # 64 samples in batches of 16, then 32
  assert bars == [4, 4, 2]  # the progress bars' totals
  # The learning-rate schedule follows the samples seen, not the steps taken:
  # a step of R = 4 holds two starting batches, so the 10 steps are 12 base
  # steps, the schedule's whole length (3 epochs of 4), and the decay ends.
  steps = np.diff([0] + [r['step'] for r in rows])
  base = sum(int(n) * r['replicas'] // rows[0]['replicas']
             for n, r in zip(steps, rows, strict=True))
  assert trainer.steps_per_epoch == 4 and base == 12
  assert trainer.base_steps_done() == base
  assert float(trainer.lr(trainer.base_steps_done())) == 0.0
  assert float(trainer.lr(int(trainer.state['step']))) > 0.0  # where counting steps stopped
  assert all(np.isfinite(r['train_loss']) for r in rows)
  assert len(trainer._eval) == 1  # noqa: SLF001
  # Each depth's cache decision, and every step program, sized for its plan's batch.
  assert depths == [(2, 16), (3, 32)] and trainer.prefix.local_batch_size == 32
  assert [d.num_frozen_layers for d in trainer.prefix.decisions] == [2, 3]
  assert {k for k, _ in compiled} == {4, 2}
  assert all(sizes == ({16} if k == 4 else {32}) for k, sizes in compiled), compiled


@pytest.mark.parametrize('samples, cap', [(88, 0), (64, 2)])
def test_per_pipeline_schedule_ends_with_the_last_epoch(tmp_path, samples, cap):
  """With per_pipeline batches the learning-rate schedule counts epochs, not
  samples: each epoch is ``steps_per_epoch`` base steps however few steps its
  larger batch makes. 88 samples: 5 steps of 16, then 2 of 32 (2.5 base steps
  each, not R/R₀ = 2, which never finished the decay); a cap of 2 steps an
  epoch: 2 steps at every R (1 base step each, not 2, which ended the decay
  an epoch early and trained the rest at a rate of 0)."""
  config = _config(alpha=0.5, initial_length=4, micro_batches=2, epochs=4)
  with config.unlocked():
    config.train.update(batch_mode='per_pipeline', batch_size=8, max_steps_per_epoch=cap,
                        warmup_epochs=0.5)
  trainer, _ = _trainer(config, samples=samples, batch=16, workdir=str(tmp_path),
                        max_steps=cap)
  epochs, counts = [], []  # the schedule's position whenever a stop is polled

  def progress(epoch, steps):
    epochs.append(epoch)
    return contextlib.nullcontext(_Bar())

  def spy():
    counts.append((epochs[-1], float(optimizer_lib.schedule_count(trainer.state['opt']))))
    return False

  store_keys, compile_program = [], trainer.programs.compile

  def spy_compile(name, key, *args, **kwargs):  # what the program store files a step under
    if name == 'step':
      store_keys.append(key)
    return compile_program(name, key, *args, **kwargs)

  trainer.programs.compile = spy_compile
  rows = trainer.run(4, progress, stop_requested=spy)['rows']
  spe = trainer.steps_per_epoch
  # The store's key names each step's move (per_pipeline: it depends on the data's size).
  assert sorted({key[-1] for key in store_keys}) == ([1.0, 2.5] if cap == 0 else [1.0])
  steps = np.diff([0] + [r['step'] for r in rows])
  assert spe == (5 if cap == 0 else 2) and [r['replicas'] for r in rows][-1] == 4
  assert sorted(set(steps.tolist())) == ([2, 5] if cap == 0 else [2])
  # The reference: after step j of epoch e (n_e steps), e + j / n_e epochs
  # (polled after every step but an epoch's last, and after every epoch but the last).
  expected = [(e, e * spe + j * spe / n) for e, n in enumerate(steps)
              for j in [*range(1, n), *([n] if e < 3 else [])]]
  assert [e for e, _ in counts] == [e for e, _ in expected]
  np.testing.assert_allclose([c for _, c in counts], [c for _, c in expected], rtol=1e-6)
  assert trainer.base_steps_done() == 4 * spe
  assert float(trainer.lr(trainer.base_steps_done())) == 0.0
  # Every step trained: the last step's rate (at its position before it) is not 0.
  assert float(trainer.lr(counts[-1][1])) > 0.0


def test_optimizer_is_adamw_and_its_schedule_counts_base_steps():
  """``optimizer_for`` is ``optax.adamw`` with the schedule bit for bit when
  every step is one base step; ``base_steps=n`` moves the schedule n places
  (per_pipeline batches) while Adam's bias correction counts updates."""
  config = _config()
  lr, tx = optimizer_lib.optimizer_for(config.train, steps_per_epoch=5)
  reference = optax.adamw(lr, weight_decay=config.train.weight_decay)
  rng = np.random.default_rng(0)
  params = {'w': jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), 'b': jnp.ones(3)}
  state, ref_state, ref_params, ours = tx.init(params), reference.init(params), params, params
  for _ in range(4):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    updates, state = tx.update(grads, state, ours)
    ref_updates, ref_state = reference.update(grads, ref_state, ref_params)
    ours, ref_params = optax.apply_updates(ours, updates), optax.apply_updates(ref_params,
                                                                              ref_updates)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref_params), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jax.tree.structure(state) == jax.tree.structure(ref_state)
  assert int(optimizer_lib.schedule_count(state)) == 4
  # Two base steps per update: the schedule at 4, then 6; Adam's count 5.
  grads = jax.tree.map(jnp.ones_like, params)
  updates, doubled = tx.update(grads, state, ours, base_steps=2)
  assert int(optimizer_lib.schedule_count(doubled)) == 6
  assert int(doubled[0].count) == 5
  adam, _ = optax.scale_by_adam().update(grads, state[0], ours)
  expected = jax.tree.map(lambda a, p: -lr(4) * (a + config.train.weight_decay * p), adam, ours)
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  # per_pipeline: fractional base steps, counted in float32; the epoch-end set.
  with config.unlocked():
    config.train.batch_mode = 'per_pipeline'
  lr, tx = optimizer_lib.optimizer_for(config.train, steps_per_epoch=5)
  state = tx.init(params)
  for _ in range(2):
    _, state = tx.update(grads, state, params, base_steps=5 / 2)
  assert optimizer_lib.schedule_count(state).dtype == jnp.float32
  assert float(optimizer_lib.schedule_count(state)) == 5.0 and int(state[0].count) == 2
  state = optimizer_lib.with_schedule_count(state, 7)
  assert float(optimizer_lib.schedule_count(state)) == 7.0 and int(state[0].count) == 2


def test_learning_rate_schedule_is_linear_warmup_then_cosine_to_zero():
  """The schedule against its formula, written out here: linear from 0 to the
  peak over ``warmup_epochs`` of base steps, then a half cosine to 0 at the
  last step of the last epoch."""
  config = _config(epochs=3)
  with config.unlocked():
    config.train.update(warmup_epochs=1.0, learning_rate=0.5)
  lr, _ = optimizer_lib.optimizer_for(config.train, steps_per_epoch=5)
  peak, warmup, total = 0.5, 5, 15
  for k in range(total + 1):
    if k <= warmup:
      expected = peak * k / warmup
    else:
      expected = peak * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))
    assert float(lr(k)) == pytest.approx(expected, rel=1e-6, abs=1e-7), k
  # No warm-up: the first step at the peak (a step at 0 would only move Adam's moments).
  with config.unlocked():
    config.train.warmup_epochs = 0.0
  lr, _ = optimizer_lib.optimizer_for(config.train, steps_per_epoch=5)
  for k in range(total + 1):
    assert float(lr(k)) == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * k / total)),
                                         rel=1e-6, abs=1e-7), k


def test_a_failed_evaluation_compile_is_raised_again_not_left_pending(monkeypatch):
  """A compile error in evaluate() must not leave a future that never
  completes behind (the next evaluate() would wait for ever)."""
  from pipejax import programs as programs_lib  # noqa: PLC0415
  trainer, _ = _trainer(_config())
  real_compile, calls = programs_lib.ProgramStore.compile, []

  def compile_(self, name, *args, **kwargs):
    if name == 'eval':
      calls.append(name)
      if len(calls) == 1:
        raise RuntimeError('out of memory while compiling')
    return real_compile(self, name, *args, **kwargs)

  clean, _ = _trainer(_config())  # the same parameters, evaluated without a failure
  want = clean.evaluate()
  monkeypatch.setattr(programs_lib.ProgramStore, 'compile', compile_)
  with pytest.raises(RuntimeError, match='out of memory'):
    trainer.evaluate()
  assert all(f.done() for f in trainer._eval.values())  # noqa: SLF001
  got = trainer.evaluate()
  assert got == want
  assert len(calls) == 2


@pytest.mark.skipif(not hasattr(os, 'setpriority'), reason='per-thread priority is Linux only')
def test_the_next_plan_is_prepared_at_the_lowest_cpu_priority():
  """Compile-ahead must fill idle cores, not slow the steps: its thread runs at
  nice 19 while the training thread keeps its own priority."""
  def mine():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

  before = mine()
  assert before < 19, 'run the test below nice 19: it could not tell the threads apart'
  trainer, _ = _trainer(_config())
  theirs = trainer._pool.submit(mine).result()  # noqa: SLF001
  assert theirs == 19 and mine() == before  # the training thread's own priority is unchanged


def test_runs_with_and_without_autodp_keep_apart_micro_batch_choices(tmp_path):
  """R sets a replica's batch and so the best M: a run with
  ``pipeline.autodp=False`` (R stays 1) must not reuse the M that an AutoDP
  run profiled for the same K (the breakdown's variants share one profile
  file), and ``pipejax.plan`` (which plans R = N/K) reads only AutoDP runs."""
  path = str(tmp_path / 'profile.json')
  profiles = {}
  for autodp_on, m in ((True, 4), (False, 8)):
    config = _config()
    with config.unlocked():
      config.pipeline.update(profile_path=path, autodp=autodp_on, micro_batches=0)
    trainer, _ = _trainer(config)
    assert trainer.profile.get(2) is None  # the other run's choice is not this run's
    assert trainer.profile.choose(2, [2, m], lambda x, m=m: 0.0 if x == m else 1.0)[0] == m
    profiles[autodp_on] = trainer.profile
  runs = autopipe.described_runs(path)
  assert sorted((about['autodp'], choices) for about, choices in runs) == [
      (False, {2: 8}), (True, {2: 4})]
  model = {'model_type': runs[0][0]['hf_config']['model_type']}
  assert [choices for about, choices in autopipe.profiled_choices(path, model, 8)] == [{2: 4}]
