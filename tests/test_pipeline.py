"""The SPMD pipeline equals a plain sequential model, for every (K, R)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipejax import partition as part
from pipejax import pipeline
from pipejax import schedule as schedule_lib
from tests import fixtures

NAN = float('nan')
# The tiny models' initial standard deviation: at HF's 0.02 attention is
# almost uniform, and its query and key gradients (about 1e-6) would pass any
# absolute tolerance left at 0 (see _grad_err).
INIT = 0.2

# (model, K, schedule, stage sizes or None for even). Tiny models have L=4
# blocks = 10 units (L=3: 8 units, so K=8 can be even).
CASES = [
    ('vit', 1, 'gpipe', None),
    ('vit', 2, '1f1b', None),
    ('vit', 4, 'gpipe', (2, 2, 2, 2)),
    ('vit', 8, '1f1b', (1,) * 8),
    ('vit', 2, 'gpipe', (1, 9)),
    ('vit', 4, '1f1b', (4, 1, 3, 2)),
    ('vit', 8, 'gpipe', (2, 1, 1, 1, 2, 1, 1, 1)),
    ('vit', 1, '1f1b', None),
    ('bert-classification', 1, '1f1b', None),
    ('bert-classification', 2, 'gpipe', (5, 5)),
    ('bert-classification', 4, '1f1b', (3, 2, 2, 3)),
    ('bert-classification', 8, 'gpipe', (1,) * 8),
    ('bert-regression', 4, '1f1b', (3, 2, 2, 3)),  # STS-B's one-output MSE head
    ('bert-question_answering', 4, 'gpipe', (1, 2, 4, 3)),
    ('bert-question_answering', 8, '1f1b', (2, 1, 1, 1, 1, 2, 1, 1)),
    # A forward and a backward in one tick (schedule.one_f_one_b_fused).
    ('vit', 1, '1f1b-fused', None),
    ('vit', 4, '1f1b-fused', (4, 1, 3, 2)),
    ('vit', 8, '1f1b-fused', (1,) * 8),
    ('bert-classification', 2, '1f1b-fused', (5, 5)),
]


def _layers(sizes):
  return (sum(sizes) - 1) // 2 if sizes else 4  # active units = 2L+2, or 2(L-F)+1


def _case(kind, k, sizes, frozen=0):
  num_layers = _layers(sizes) + frozen
  created = fixtures.tiny(kind, num_layers=num_layers, initializer_range=INIT)
  partition = (part.Partition(num_layers, frozen, sizes) if sizes else
               part.even(num_layers, k, frozen))
  return created, partition


def _canonical(stage_tree, partition, params):
  """Stage layout → canonical tree, frozen rows taken from ``params``."""
  frozen = part.frozen_prefix(params, partition.num_frozen_layers)
  # On host copies: gathered here, not by eager ops over the sharded arrays.
  return part.from_stage_params(jax.tree.map(np.asarray, stage_tree), partition,
                                jax.tree.map(np.asarray, frozen))


def _run_after_prefix(pipe, model, params, batch, partition, replicas, micro_batches):
  """``pipe``'s evaluation-mode loss and gradients of ``partition`` on
  ``batch``, fed the frozen prefix's hidden states (as the trainer does)."""
  hidden = model.hidden_states(params, batch, upto_layer=partition.num_frozen_layers)
  feed = {'hidden': np.asarray(hidden), 'labels': batch['labels']}
  stage_params = part.to_stage_params(params, partition)
  return pipe.grad_fn(pipeline.Plan(partition, replicas, micro_batches), stage_params,
                      train=False)(stage_params, feed, jax.random.PRNGKey(0))


def _beside_sequential(created, partition, plan, batch, reference, devices=None):
  """The pipeline's train-step loss, metrics and gradients on ``batch``
  (NaN in every bubble and unwritten buffer: nothing may leak), and the
  sequential model's on ``reference``: ``(pipe, stage_params, (loss,
  metrics, grads), ((ref_loss, ref_metrics), ref_grads))``."""
  pipe = pipeline.Pipeline(created.model, devices=devices, fill=NAN)
  stage_params = part.to_stage_params(created.params, partition)
  mine = pipe.grad_fn(plan, stage_params, train=False)(stage_params, batch,
                                                        jax.random.PRNGKey(0))
  ref = jax.value_and_grad(lambda p: created.model.loss(p, reference), has_aux=True)(
      created.params)
  return pipe, stage_params, mine, ref


def _grad_err(a, b):
  """The largest difference of a leaf of ``a`` from ``b``'s, relative to the
  leaf's size in ``b`` plus a thousandth of the largest leaf's (for leaves
  that are 0 but for rounding, such as a key bias's gradient): a leaf left
  at 0, or another leaf's, gives about 1."""
  floor = 1e-3 * max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))
  return max(jax.tree.leaves(jax.tree.map(
      lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + floor)), a, b)))


@pytest.mark.parametrize('kind,k,schedule,sizes', CASES)
def test_loss_and_grads_equal_sequential(kind, k, schedule, sizes):
  created, partition = _case(kind, k, sizes)
  model, params = created.model, created.params
  replicas, micro = 8 // k, 2
  batch = fixtures.batch(kind, model, replicas * micro * 2, seed=k)
  plan = pipeline.Plan(partition, replicas, micro, schedule)
  pipe, stage_params, (loss, metrics, grads), ((ref_loss, ref_metrics), ref_grads) = (
      _beside_sequential(created, partition, plan, batch, batch))
  assert abs(float(loss) - float(ref_loss)) <= 1e-5
  assert float(metrics['count']) == len(batch['labels' if 'labels' in batch else
                                              'start_positions'])
  assert set(metrics) == set(ref_metrics)
  for key, value in ref_metrics.items():  # correct, or a regression's squared_error
    assert float(metrics[key]) == pytest.approx(float(value), rel=1e-5), key
  got = _canonical(grads, partition, params)
  assert _grad_err(got, ref_grads) <= 1e-3
  # Grads come back in the layout and sharding of the parameters.
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(stage_params), strict=True):
    assert g.shape == p.shape
  # Not a match of two zero trees: every attention kernel has a gradient on
  # every stage that holds a block (a key bias's is zero analytically).
  kernels = [g for path, g in jax.tree_util.tree_leaves_with_path(grads['attention'])
             if 'kernel' in jax.tree_util.keystr(path)]
  last = 2 * partition.num_layers + 1  # units: embed 0, attention 2i+1, MLP 2i+2, head
  holding = [s for s, units in enumerate(partition.stage_units())
             if any(u % 2 == 1 and u != last for u in units)]
  assert kernels and all(float(jnp.max(jnp.abs(g[s]))) > 0 for g in kernels for s in holding)
  assert pipe.trace_count == 1


@pytest.mark.parametrize('kind,k,sizes,micro', [
    ('vit', 1, None, 4),  # one stage: its micro-batches run as a loop
    ('vit', 2, None, 4),
    ('vit', 4, (4, 1, 3, 2), 8),
    ('bert-classification', 8, (1,) * 8, 16),
])
def test_fused_1f1b_with_both_ops_in_a_tick_equals_sequential(kind, k, sizes, micro):
  """M ≥ 2K: the first stages too run a real FWD and a BWD in one tick (with
  M = 2 only the last stage does, whose FWD is empty). NaN bubbles."""
  sched = schedule_lib.make('1f1b-fused', k, micro)
  assert (sched.ops[:, 0] == schedule_lib.BOTH).any()
  _assert_equals_sequential(kind, k, sizes, micro, '1f1b-fused')


def _assert_equals_sequential(kind, k, sizes, micro, schedule):
  """The ``schedule``'s pipeline on 8 // k replicas of ``micro`` micro-batches
  (NaN in every bubble) gives the sequential model's loss, correct count
  and gradients."""
  created, partition = _case(kind, k, sizes)
  model, params = created.model, created.params
  batch = fixtures.batch(kind, model, (8 // k) * micro, seed=k)
  pipe = pipeline.Pipeline(model, fill=NAN)
  stage_params = part.to_stage_params(params, partition)
  loss, metrics, grads = pipe.grad_fn(pipeline.Plan(partition, 8 // k, micro, schedule),
                                      stage_params, train=False)(
      stage_params, batch, jax.random.PRNGKey(0))
  (ref_loss, ref_metrics), ref_grads = jax.value_and_grad(
      lambda p: model.loss(p, batch), has_aux=True)(params)
  assert abs(float(loss) - float(ref_loss)) <= 1e-5
  assert float(metrics['count']) == len(batch['labels'])
  assert float(metrics['correct']) == float(ref_metrics['correct'])
  assert _grad_err(_canonical(grads, partition, params), ref_grads) <= 1e-3


def _gpipe_backwards_in_forward_order(num_stages, num_micro_batches):
  """GPipe with each stage's backwards in forward order (micro-batch 0 first):
  its BWD cells name their micro-batches in ``backward_micro_batch``, with no
  BOTH cell (not a fused table)."""
  g = schedule_lib.gpipe(num_stages, num_micro_batches)
  backward = np.where(g.ops == schedule_lib.BWD, num_micro_batches - 1 - g.micro_batch, -1)
  return schedule_lib.Schedule('gpipe-fifo', g.ops, g.micro_batch,
                               backward_micro_batch=backward.astype(np.int32))


@pytest.mark.parametrize('k,sizes', [(2, (5, 5)), (4, (4, 1, 3, 2))])
def test_backwards_of_their_own_micro_batches_without_fused_cells(monkeypatch, k, sizes):
  """A table's ``backward_micro_batch`` overrides ``micro_batch`` in its BWD
  cells whether or not any tick runs both ops: each BWD takes its own
  micro-batch's labels and stashed input (reading ``micro_batch`` there
  pairs one micro-batch's input with another's labels)."""
  sched = _gpipe_backwards_in_forward_order(k, 3)
  schedule_lib.validate(sched)
  assert not sched.fused
  bwd = sched.ops == schedule_lib.BWD
  assert (sched.micro_batch_of_backward()[bwd] != sched.micro_batch[bwd]).any()
  monkeypatch.setitem(schedule_lib.SCHEDULES, 'gpipe-fifo', _gpipe_backwards_in_forward_order)
  _assert_equals_sequential('vit', k, sizes, 3, 'gpipe-fifo')


@pytest.mark.parametrize('name,make,message', [
    ('short', lambda k, m: schedule_lib.gpipe(k, m - 1), 'micro-batch 3 never runs on stage 0'),
    # One too many: micro-batch M's index would be clamped to M-1 (trained twice).
    ('long', lambda k, m: schedule_lib.gpipe(k, m + 1), 'is outside [0, 4)'),
    ('narrow', lambda k, m: schedule_lib.gpipe(1, m),
     "schedule 'narrow' made a table of 1 stages for a pipeline of length 2")])
def test_a_registered_schedule_that_does_not_fit_the_plan_is_refused(monkeypatch, name, make,
                                                                     message):
  """A schedule of one's own (``SCHEDULES`` is open to registration) that
  leaves out a micro-batch, or is made for another pipeline length, is
  refused when the step is built; it ran, on part of the batch, without a
  word."""
  monkeypatch.setitem(schedule_lib.SCHEDULES, name, make)
  created = fixtures.tiny('vit', num_layers=4)
  partition = part.even(4, 2)
  pipe = pipeline.Pipeline(created.model, devices=jax.devices()[:2])
  stage_params = part.to_stage_params(created.params, partition)
  with pytest.raises(schedule_lib.ScheduleError, match=re.escape(message)):
    pipe.grad_fn(pipeline.Plan(partition, 1, 4, name), stage_params, train=False)


def test_padded_slots_are_skipped_and_get_exactly_zero_grad():
  kind, sizes = 'vit', (1, 4, 1, 4)  # slots: stage 1 holds 3 block halves-pairs, stage 2 one
  created, partition = _case(kind, 4, sizes)
  model, params = created.model, created.params
  stage_params = part.to_stage_params(params, partition)
  t = partition.tables
  unused_a = ~t.has_attention
  unused_m = ~t.has_mlp
  assert unused_a.any() and unused_m.any()
  # The layout leaves unused slots zero (the poison below then overrides them).
  for stack, unused in ((stage_params['attention'], unused_a), (stage_params['mlp'], unused_m)):
    for leaf in jax.tree.leaves(stack):
      assert not np.asarray(leaf)[unused].any()

  def poison(stack, unused):
    mask = unused.reshape(unused.shape + (1,) * (stack.ndim - 2))
    return jnp.where(mask, jnp.nan, stack)

  poisoned = dict(stage_params,
                  attention=jax.tree.map(lambda x: poison(x, unused_a), stage_params['attention']),
                  mlp=jax.tree.map(lambda x: poison(x, unused_m), stage_params['mlp']))
  batch = fixtures.batch(kind, model, 8, seed=3)
  pipe = pipeline.Pipeline(model, fill=NAN)
  plan = pipeline.Plan(partition, 2, 2, '1f1b')
  loss, _, grads = pipe.grad_fn(plan, poisoned, train=False)(poisoned, batch,
                                                               jax.random.PRNGKey(0))
  ref_loss = model.loss(params, batch)[0]
  assert abs(float(loss) - float(ref_loss)) <= 1e-5
  for stack, unused in ((grads['attention'], unused_a), (grads['mlp'], unused_m)):
    for g in jax.tree.leaves(stack):
      g = np.asarray(g)
      assert np.all(g[unused] == 0.0)  # exactly zero, and not NaN
      assert np.all(np.isfinite(g))


def test_frozen_prefix_input_equals_sequential_on_active_layers():
  """With F frozen blocks the pipeline starts from the prefix's hidden states."""
  kind, frozen = 'bert-classification', 1
  created, partition = _case(kind, 4, (2, 2, 1, 2), frozen=frozen)
  model, params = created.model, created.params
  batch = fixtures.batch(kind, model, 8, seed=5)
  hidden = model.hidden_states(params, batch, upto_layer=frozen)

  def active_loss(p):
    h = hidden
    for unit in range(2 * frozen + 1, 2 * model.num_layers + 1):
      h = model.sublayer(p, unit, h, batch)
    return model.loss_fn(p['head'], h, batch, None, False)[0]

  ref_loss, ref_grads = jax.value_and_grad(active_loss)(params)
  stage_params = part.to_stage_params(params, partition)
  assert 'embed' not in stage_params
  pipe = pipeline.Pipeline(model, fill=NAN)
  plan = pipeline.Plan(partition, 2, 2, 'gpipe')
  feed = {'hidden': np.asarray(hidden), 'attention_mask': batch['attention_mask'],
          'labels': batch['labels']}
  loss, _, grads = pipe.grad_fn(plan, stage_params, train=False)(stage_params, feed,
                                                                   jax.random.PRNGKey(0))
  assert abs(float(loss) - float(ref_loss)) <= 1e-5
  got = _canonical(grads, partition, params)
  for key in ('attention', 'mlp'):
    err = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a[frozen:] - b[frozen:]))),
                       got[key], ref_grads[key])
    assert max(jax.tree.leaves(err)) <= 1e-5
  assert _grad_err(got['head'], ref_grads['head']) <= 1e-3


def test_same_plan_compiles_once_and_new_plan_compiles_again():
  created, partition = _case('vit', 2, None)
  model, params = created.model, created.params
  pipe = pipeline.Pipeline(model)
  stage_params = part.to_stage_params(params, partition)
  plan = pipeline.Plan(partition, 4, 2, '1f1b')
  batch = fixtures.batch('vit', model, 16)
  rng = jax.random.PRNGKey(0)
  for seed in range(3):
    step = pipe.grad_fn(pipeline.Plan(partition, 4, 2, '1f1b'), stage_params)
    step(stage_params, fixtures.batch('vit', model, 16, seed=seed), rng)
  assert pipe.trace_count == 1
  assert step.jitted._cache_size() == 1
  pipe.grad_fn(pipeline.Plan(partition, 4, 4, '1f1b'), stage_params)(stage_params, batch, rng)
  assert pipe.trace_count == 2
  assert pipe.grad_fn(plan, stage_params) is step


def test_plans_whose_slots_hold_half_blocks_do_not_share_a_program():
  """F=1 as (2, 2, 3) holds whole blocks; F=2 as (1, 1, 3) gives stage 0 an
  attention alone and stage 1 an MLP alone. Everything else in their program
  key is the same: the second must be traced for its half blocks, not run
  by the first's program (which runs both halves in every slot)."""
  created = fixtures.tiny('vit', num_layers=4, initializer_range=INIT)
  model, params = created.model, created.params
  whole, halves = part.Partition(4, 1, (2, 2, 3)), part.Partition(4, 2, (1, 1, 3))
  assert whole.tables.num_slots == halves.tables.num_slots == 1
  batch = fixtures.batch('vit', model, 6, seed=3)
  shared = pipeline.Pipeline(model, fill=NAN)
  _run_after_prefix(shared, model, params, batch, whole, 1, 3)
  loss = _run_after_prefix(shared, model, params, batch, halves, 1, 3)[0]
  assert shared.trace_count == 2
  hidden = model.hidden_states(params, batch, upto_layer=2)
  for unit in range(2 * 2 + 1, 2 * 4 + 1):
    hidden = model.sublayer(params, unit, hidden, batch)
  reference = model.loss_fn(params['head'], hidden, batch, None, False)[0]
  assert abs(float(loss) - float(reference)) <= 1e-5


def test_eval_forward_only_matches_sequential():
  created, partition = _case('vit', 4, (3, 2, 2, 3))
  model, params = created.model, created.params
  pipe = pipeline.Pipeline(model, fill=NAN)
  stage_params = part.to_stage_params(params, partition)
  batch = fixtures.batch('vit', model, 16, seed=9)
  loss, metrics = pipe.eval_fn(pipeline.Plan(partition, 2, 4), stage_params)(
      stage_params, batch, jax.random.PRNGKey(0))
  ref_loss, ref_metrics = model.loss(params, batch)
  assert abs(float(loss) - float(ref_loss)) <= 1e-5
  assert float(metrics['correct']) == float(ref_metrics['correct'])


def _poisoned_targets(batch):
  """``batch`` with targets no real row has: class labels and answer
  positions out of range, regression targets of 1e6 (each moves the loss,
  if it is not NaN, far beyond any tolerance if a padded row counted)."""
  out = dict(batch)
  if 'labels' in out:
    labels = out['labels']
    out['labels'] = (np.full_like(labels, 1e6) if labels.dtype.kind == 'f'
                     else labels + 1000)
  for key in ('start_positions', 'end_positions'):
    if key in out:
      out[key] = out[key] + 1000
  return out


@pytest.mark.parametrize('kind,k,schedule,sizes,replicas,micro', [
    ('vit', 2, '1f1b', None, 4, 2),
    ('bert-question_answering', 4, 'gpipe', (1, 2, 4, 3), 2, 2),
    ('bert-regression', 8, '1f1b-fused', (1,) * 8, 1, 4),
])
def test_a_padded_batch_trains_on_its_real_rows_only(kind, k, schedule, sizes, replicas, micro):
  """A last batch padded to size (``example_mask`` 0, as a Loader without
  ``drop_remainder`` pads it) gives the loss and gradients of its real rows
  alone, in the train step and in evaluation: micro-batches are weighted by
  their real rows, so one that is all padding, or a replica's whole share,
  counts for nothing, and what the padding holds does not matter."""
  created, partition = _case(kind, k, sizes)
  model, params = created.model, created.params
  size, count = 16, 11  # replica shares of 16 // R rows: the later ones hold the padding
  real = fixtures.batch(kind, model, count, seed=k)
  junk = _poisoned_targets(fixtures.batch(kind, model, size - count, seed=k + 100))
  padded = {key: np.concatenate([real[key], junk[key]]) for key in real}
  padded['example_mask'] = (np.arange(size) < count).astype(np.float32)
  plan = pipeline.Plan(partition, replicas, micro, schedule)
  pipe, stage_params, (loss, metrics, grads), ((ref_loss, _), ref_grads) = _beside_sequential(
      created, partition, plan, padded, real, devices=jax.devices()[:k * replicas])
  assert abs(float(loss) - float(ref_loss)) <= 1e-5
  assert float(metrics['count']) == count
  assert _grad_err(_canonical(grads, partition, params), ref_grads) <= 1e-3
  eval_loss, eval_metrics = pipe.eval_fn(plan, stage_params)(stage_params, padded,
                                                             jax.random.PRNGKey(0))
  assert abs(float(eval_loss) - float(ref_loss)) <= 1e-5
  assert float(eval_metrics['count']) == count


def test_a_padded_batch_after_the_frozen_prefix_trains_on_its_real_rows_only():
  """What the trainer feeds past a frozen prefix (the prefix's hidden states,
  the labels and ``example_mask``) weighs the real rows only, as the batch
  itself does: the loss is the real rows' (a replica of 4 holds 1 real row)."""
  created, partition = _case('vit', 2, None, frozen=2)
  model, params = created.model, created.params
  real = fixtures.batch('vit', model, 9, seed=6)
  junk = _poisoned_targets(fixtures.batch('vit', model, 7, seed=7))
  padded = {key: np.concatenate([real[key], junk[key]]) for key in real}
  feed = {'hidden': np.asarray(model.hidden_states(params, padded, upto_layer=2)),
          'labels': padded['labels'], 'example_mask': (np.arange(16) < 9).astype(np.float32)}
  stage_params = part.to_stage_params(params, partition)
  pipe = pipeline.Pipeline(model, fill=NAN)
  loss, metrics, _ = pipe.grad_fn(pipeline.Plan(partition, 4, 2), stage_params, train=False)(
      stage_params, feed, jax.random.PRNGKey(0))
  assert abs(float(loss) - float(model.loss(params, real)[0])) <= 1e-5
  assert float(metrics['count']) == 9


@pytest.mark.parametrize('replicas,micro', [(4, 1), (2, 2), (1, 4)])
def test_dropout_is_reproducible_between_forward_and_recompute(replicas, micro):
  """With dropout, FWD and the BWD recompute must draw the same masks, and
  every micro-batch of every replica masks of its own (key ``fold_in(rng,
  r·M + m)``): the pipeline's gradient equals autodiff of those masks."""
  created = fixtures.tiny('vit', num_layers=4, dropout=0.3, initializer_range=INIT)
  model, params = created.model, created.params
  partition = part.even(4, 2)
  pipe = pipeline.Pipeline(model, devices=jax.devices()[:2 * replicas])
  stage_params = part.to_stage_params(params, partition)
  batch = fixtures.batch('vit', model, 8, seed=1)
  rng = jax.random.PRNGKey(42)
  plan = pipeline.Plan(partition, replicas, micro, '1f1b')
  loss, _, grads = pipe.grad_fn(plan, stage_params, train=True)(stage_params, batch, rng)

  def ref(p):  # micro-batch i = r·M + m holds rows [2i, 2i + 2), its key fold_in(rng, i)
    losses = [model.loss(p, jax.tree.map(lambda a: a[2 * i:2 * i + 2], batch),
                         rng=jax.random.fold_in(rng, i), train=True)[0] for i in range(4)]
    return sum(losses) / 4

  ref_loss, ref_grads = jax.value_and_grad(ref)(params)
  assert abs(float(loss) - float(ref_loss)) <= 1e-5
  assert _grad_err(_canonical(grads, partition, params), ref_grads) <= 1e-3
  no_dropout = model.loss(params, batch)[0]
  assert abs(float(loss) - float(no_dropout)) > 1e-4  # dropout really was on


def test_bad_inputs_name_the_value():
  created, partition = _case('vit', 2, None)
  model, params = created.model, created.params
  with pytest.raises(pipeline.PlanError, match='pipeline length 3 does not divide the 8'):
    pipeline.make_mesh(3)
  pipe = pipeline.Pipeline(model)
  stage_params = part.to_stage_params(params, partition)
  step = pipe.grad_fn(pipeline.Plan(partition, 4, 2), stage_params)
  with pytest.raises(pipeline.PlanError, match='batch size 12 is not divisible by .* = 8'):
    step(stage_params, fixtures.batch('vit', model, 12), jax.random.PRNGKey(0))
  with pytest.raises(pipeline.PlanError, match=r"^batch arrays disagree on the batch size: "
                                               r"\{'pixel_values': 8, 'labels': 16\}$"):
    step(stage_params, {**fixtures.batch('vit', model, 8),
                        'labels': np.zeros(16, np.int32)}, jax.random.PRNGKey(0))
  with pytest.raises(pipeline.PlanError, match=r"batch lacks \['labels'\]"):
    step(stage_params, {'pixel_values': np.zeros((8, 8, 8, 3), np.float32)},
         jax.random.PRNGKey(0))
  # A plan may use the first R x K devices (the AutoDP ablation), never more.
  small = pipeline.Pipeline(model, devices=jax.devices()[:2])
  with pytest.raises(pipeline.PlanError, match='needs R x K = 2 x 2 = 4 devices but only 2'):
    small.grad_fn(pipeline.Plan(partition, 2, 2), stage_params)
  assert pipe.mesh(pipeline.Plan(partition, 1, 2)).devices.size == 2
  with pytest.raises(part.PartitionError, match=r'covers 9 units but the model has 10'):
    part.Partition(4, 0, (4, 5))
  with pytest.raises(part.PartitionError, match='at least one unit'):
    part.Partition(4, 0, (10, 0))


def test_freeze_event_at_the_same_length_reuses_the_program_exactly():
  """Partitions of one K padded to one slot width share a compiled program
  (the slot tables are runtime data); each gives bit for bit what its own
  unpadded program gives, and padded slots get exactly zero gradient."""
  kind, num_layers = 'vit', 6
  created = fixtures.tiny(kind, num_layers=num_layers, initializer_range=INIT)
  model, params = created.model, created.params
  wide = part.Partition(num_layers, 1, (3, 3, 2, 3))   # 2 blocks on some stages
  narrow = part.Partition(num_layers, 3, (2, 2, 1, 2))  # 1 block per stage
  padded = part.Partition(num_layers, 3, (2, 2, 1, 2), min_slots=wide.tables.num_slots)
  assert narrow.tables.num_slots < padded.tables.num_slots == wide.tables.num_slots
  assert pipeline.program_key(pipeline.Plan(padded, 2, 2)) == pipeline.program_key(
      pipeline.Plan(wide, 2, 2))
  batch = fixtures.batch(kind, model, 8, seed=3)

  def run(pipe, partition):
    return _run_after_prefix(pipe, model, params, batch, partition, 2, 2)

  shared = pipeline.Pipeline(model, fill=NAN)
  run(shared, wide)
  loss, _, grads = run(shared, padded)
  assert shared.trace_count == 1  # the freeze event traced nothing new
  own_loss, _, own_grads = run(pipeline.Pipeline(model, fill=NAN), narrow)
  assert float(loss) == float(own_loss)
  width = narrow.tables.num_slots
  for key in ('attention', 'mlp'):
    for g, own in zip(jax.tree.leaves(grads[key]), jax.tree.leaves(own_grads[key]), strict=True):
      g = np.asarray(g)
      np.testing.assert_array_equal(g[:, :width], np.asarray(own))
      assert np.all(g[:, width:] == 0.0)  # padding: exactly zero, and not NaN


@pytest.mark.parametrize('kind,k,schedule,sizes', [
    ('vit', 8, '1f1b', (1,) * 8),
    ('vit', 4, '1f1b', (4, 1, 3, 2)),
    ('vit', 2, 'gpipe', (1, 9)),
    ('bert-question_answering', 8, '1f1b', (2, 1, 1, 1, 1, 2, 1, 1)),
    ('vit', 4, '1f1b-fused', (4, 1, 3, 2)),
])
def test_both_exchanges_give_the_same_step_bit_for_bit(kind, k, schedule, sizes):
  """One all-gather per tick (CPU's default) delivers exactly what the two
  ppermutes do, bubbles' NaN kept out; and each compiles to what it says."""
  created, partition = _case(kind, k, sizes)
  model, params = created.model, created.params
  batch = fixtures.batch(kind, model, (8 // k) * 2 * 2, seed=k)
  plan = pipeline.Plan(partition, 8 // k, 2, schedule)
  stage_params = part.to_stage_params(params, partition)
  out, texts = {}, {}
  for exchange in pipeline.EXCHANGES:
    pipe = pipeline.Pipeline(model, fill=NAN, exchange=exchange)
    step = pipe.grad_fn(plan, stage_params, train=False)
    out[exchange] = jax.device_get(step(stage_params, batch, jax.random.PRNGKey(0)))
    texts[exchange] = step.jitted.lower(stage_params, batch, jax.random.PRNGKey(0),
                                        step.tables).as_text()
  for a, b in zip(jax.tree.leaves(out['ppermute']), jax.tree.leaves(out['all_gather']),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
  assert np.isfinite(float(out['all_gather'][0]))
  ops = {e: re.findall(r'stablehlo\.(collective_permute|all_gather)\b', t)
         for e, t in texts.items()}
  assert sorted(ops['ppermute']) == ['collective_permute'] * 2  # inside the tick loop
  assert ops['all_gather'] == ['all_gather']


def test_exchange_defaults_to_one_collective_on_cpu_and_refuses_unknown_names():
  created, _ = _case('vit', 4, None)
  assert pipeline.default_exchange(jax.devices()) == 'all_gather'
  assert pipeline.Pipeline(created.model).exchange == 'all_gather'
  with pytest.raises(pipeline.PlanError, match="exchange must be 'auto' or one of"):
    pipeline.Pipeline(created.model, exchange='broadcast')


# (model, K, schedule, stage sizes, stages ending with a split MLP). L = 4:
# units 0 embed, 1 + 2i attn.i, 2 + 2i mlp.i, 9 head.
SPLIT_CASES = [
    ('vit', 4, '1f1b', (3, 2, 2, 3), (0, 2)),
    ('bert-classification', 2, 'gpipe', (5, 5), (0,)),
    # Stage 3 runs only mlp.1's first half; stage 4 its second half, then attn.2.
    ('vit', 8, '1f1b', (1, 2, 1, 1, 1, 1, 2, 1), (1, 3, 5)),
    ('bert-question_answering', 8, 'gpipe', (1, 2, 1, 1, 1, 1, 2, 1), (1, 3, 5)),
    ('vit', 8, '1f1b-fused', (1, 2, 1, 1, 1, 1, 2, 1), (1, 3, 5)),
]


@pytest.mark.parametrize('kind,k,schedule,sizes,split', SPLIT_CASES)
def test_a_split_mlp_equals_sequential_and_its_halves_stay_apart(kind, k, schedule, sizes, split):
  """An MLP split between two stages (its inner activation travels with the
  residual stream) gives the sequential model's loss and gradients; each
  stage holds and updates only its half: the other half's parameters are
  poisoned with NaN on it and get exactly zero gradient there."""
  created = fixtures.tiny(kind, num_layers=4, initializer_range=INIT)
  model, params = created.model, created.params
  partition = part.Partition(4, 0, sizes, split_mlp=split, mlp_in_keys=model.mlp_in_keys)
  t = partition.tables
  assert (t.has_mlp_in != t.has_mlp_out).sum() == 2 * len(split)
  stage_params = part.to_stage_params(params, partition)
  # Laying out and back is exact, the halves coming from their own stages.
  back = part.from_stage_params(stage_params, partition, part.frozen_prefix(params, 0))
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  owned = {key: (t.has_mlp_in if key in model.mlp_in_keys else t.has_mlp_out)
           for key in stage_params['mlp']}

  def poison(stack, mask):
    return jnp.where(mask.reshape(mask.shape + (1,) * (stack.ndim - 2)), stack, jnp.nan)

  poisoned = dict(stage_params, mlp={key: jax.tree.map(lambda x, m=owned[key]: poison(x, m), v)
                                     for key, v in stage_params['mlp'].items()})
  batch = fixtures.batch(kind, model, (8 // k) * 2 * 2, seed=k)
  pipe = pipeline.Pipeline(model, fill=NAN)
  plan = pipeline.Plan(partition, 8 // k, 2, schedule)
  loss, metrics, grads = pipe.grad_fn(plan, poisoned, train=False)(
      poisoned, batch, jax.random.PRNGKey(0))
  (ref_loss, ref_metrics), ref_grads = jax.value_and_grad(
      lambda p: model.loss(p, batch), has_aux=True)(params)
  assert abs(float(loss) - float(ref_loss)) <= 1e-5
  assert float(metrics['count']) == float(ref_metrics['count'])
  for key, stack in grads['mlp'].items():
    for g in jax.tree.leaves(stack):
      g = np.asarray(g)
      assert np.all(g[~owned[key]] == 0.0)  # exactly zero, and not NaN
      assert np.all(np.isfinite(g))
  assert _grad_err(_canonical(grads, partition, params), ref_grads) <= 1e-3
  # The forward-only program (evaluation) runs the same split.
  eval_loss, _ = pipe.eval_fn(plan, stage_params)(stage_params, batch, jax.random.PRNGKey(0))
  assert abs(float(eval_loss) - float(ref_loss)) <= 1e-5
  # Both exchanges deliver the pair bit for bit.
  other = pipeline.Pipeline(model, fill=NAN, exchange='ppermute')
  again = other.grad_fn(plan, stage_params, train=False)(stage_params, batch,
                                                         jax.random.PRNGKey(0))
  mine = pipe.grad_fn(plan, stage_params, train=False)(stage_params, batch, jax.random.PRNGKey(0))
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(mine), strict=True):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_a_split_mlp_with_dropout_draws_the_unsplit_masks():
  """Dropout in a split MLP draws the masks the whole MLP draws: the same
  training step, split or not, gives the same loss and gradients, those of
  the sequential model under each micro-batch's key (as in
  test_dropout_is_reproducible_between_forward_and_recompute)."""
  created = fixtures.tiny('vit', num_layers=4, dropout=0.3, initializer_range=INIT)
  model, params = created.model, created.params
  whole = part.Partition(4, 0, (3, 2, 2, 3))
  split = part.Partition(4, 0, (3, 2, 2, 3), split_mlp=(0, 2), mlp_in_keys=model.mlp_in_keys)
  batch = fixtures.batch('vit', model, 8, seed=2)
  rng = jax.random.PRNGKey(7)
  out = []
  for partition in (whole, split):
    stage_params = part.to_stage_params(params, partition)
    loss, _, grads = pipeline.Pipeline(model).grad_fn(pipeline.Plan(partition, 2, 2),
                                                      stage_params)(stage_params, batch, rng)
    out.append((float(loss), _canonical(grads, partition, params)))

  def ref(p):  # micro-batch i = r·M + m holds rows [2i, 2i + 2), its key fold_in(rng, i)
    losses = [model.loss(p, jax.tree.map(lambda a: a[2 * i:2 * i + 2], batch),
                         rng=jax.random.fold_in(rng, i), train=True)[0] for i in range(4)]
    return sum(losses) / 4

  ref_loss, ref_grads = jax.value_and_grad(ref)(params)
  for loss, grads in out:  # whole, then split
    assert abs(loss - float(ref_loss)) <= 1e-5
    assert _grad_err(grads, ref_grads) <= 1e-3
  assert out[0][0] == pytest.approx(out[1][0], abs=1e-6)
  assert _grad_err(out[0][1], out[1][1]) <= 1e-3
  assert abs(out[0][0] - float(model.loss(params, batch)[0])) > 1e-4  # dropout was on


def test_a_split_mlp_partition_is_checked():
  keys = fixtures.tiny('vit', num_layers=4, initializer_range=INIT).model.mlp_in_keys
  with pytest.raises(part.PartitionError, match='stage 0 must be followed by another and end '
                                                'with an MLP sub-layer'):
    part.Partition(4, 0, (2, 3, 2, 3), split_mlp=(0,), mlp_in_keys=keys)  # ends with attn.0
  with pytest.raises(part.PartitionError, match='stage 3 must be followed by another'):
    part.Partition(4, 0, (3, 2, 2, 3), split_mlp=(3,), mlp_in_keys=keys)  # the last stage
  with pytest.raises(part.PartitionError, match='needs mlp_in_keys'):
    part.Partition(4, 0, (3, 2, 2, 3), split_mlp=(0,))
  created = fixtures.tiny('vit', num_layers=4, initializer_range=INIT)
  wrong = part.Partition(4, 0, (3, 2, 2, 3), split_mlp=(0,), mlp_in_keys=('dense_1',))
  with pytest.raises(part.PartitionError, match=r"mlp_in_keys \['dense_1'\] are not MLP"):
    part.to_stage_params(created.params, wrong)
  # Split and unsplit partitions of the same sizes compile apart.
  whole = part.Partition(4, 0, (3, 2, 2, 3))
  split = part.Partition(4, 0, (3, 2, 2, 3), split_mlp=(0,), mlp_in_keys=keys)
  assert pipeline.program_key(pipeline.Plan(whole, 2, 2)) != pipeline.program_key(
      pipeline.Plan(split, 2, 2))
