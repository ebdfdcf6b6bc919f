"""AutoCache inside the trainer: the same losses as running the frozen
prefix, and no sample through a frozen layer twice."""
import json
import types
from typing import NamedTuple

import jax
import numpy as np
import pytest

from pipejax import autocache_policy
from pipejax.autocache import ActivationCache, CacheMismatchError
from pipejax.data import ArraySource, Loader
from pipejax.frozen_prefix import FrozenPrefix, make_cache
from pipejax.trainer import Trainer

from tests import fixtures
from tests.test_trainer import _Bar, _config, _trainer


class _Run(NamedTuple):
  trainer: Trainer
  losses: np.ndarray  # per epoch
  used: list  # whether the cache served each epoch
  fed: list  # see _record_feeds
  data: dict


def _run(cache: str, dtype: str = 'float32', epochs: int = 4, **cache_config) -> _Run:
  """Per-epoch train losses of an elastic run (schedule α=0.5 on 4 blocks:
  F = 0, 2, 3, 3) with the cache off, or on from the first frozen block,
  and what its pipeline was fed."""
  config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4,
                   epochs=epochs)
  with config.unlocked():
    config.cache.update(enabled=cache != 'off', policy='always', dtype=dtype, **cache_config)
  trainer, data = _trainer(config)
  fed = _record_feeds(trainer)
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  losses, used = [], []
  for epoch in range(epochs):
    losses.append(trainer.train_epoch(epoch, _Bar())['train_loss'])
    used.append(trainer.prefix.use_cache)
    if epoch + 1 < epochs:
      trainer.maybe_transition(epoch, sample)
  return _Run(trainer, np.array(losses), used, fed, data)


def _record_feeds(trainer) -> list:
  """Spies on what ``trainer`` feeds its pipeline: returns a list that
  collects ``(sample_ids, depth, feed)`` of every step fed by the frozen
  prefix (F = depth > 0), the feed copied to the host."""
  fed, feed = [], trainer._feed  # noqa: SLF001

  def spy(sample_ids, batch, plan):
    out = feed(sample_ids, batch, plan)
    if not plan.partition.has_embed:
      fed.append((np.array(sample_ids), plan.partition.num_frozen_layers,
                  {k: np.asarray(v) for k, v in out.items()}))
    return out

  trainer._feed = spy  # noqa: SLF001
  return fed


def _check_rows_as_computed(trainer, data, ids, hidden, depth, tolerance=1e-6):
  """Row ``i`` of ``hidden [batch, seq, hidden]`` is sample ``ids[i]``'s:
  a fresh sequential forward of ``data``'s row ``ids[i]`` through embed and
  the first ``depth`` blocks, with the trainer's parameters (frozen ones
  never change), within ``tolerance`` times the row's largest value (one
  float32 rounding is 6e-8 of it; a neighbour's row was off by 0.6 to 0.97
  in test_a_neighbour_s_entry_fails_the_row_check_not_the_losses)."""
  model = trainer.model
  expected = np.asarray(model.hidden_states(
      trainer.canonical_params(), {k: data[k][ids] for k in model.input_keys},
      upto_layer=depth)).reshape(len(ids), -1)
  hidden = np.asarray(hidden, np.float32)
  assert hidden.shape[0] == len(ids) and hidden.size == expected.size
  error = np.abs(hidden.reshape(len(ids), -1) - expected).max(1) / np.abs(expected).max(1)
  wrong = ~(error <= tolerance)  # NaN is wrong
  assert not wrong.any(), (
      f'F={depth}: the rows of samples {np.asarray(ids)[wrong].tolist()} are not their '
      f'forward (off by up to {error.max():.3g} of their largest value)')


def _check_fed_as_computed(trainer, data, fed, tolerance=1e-6) -> list[int]:
  """Every step ``fed`` (:func:`_record_feeds`) carried, row by row, its
  samples' own prefix output and labels; returns the depths seen, a step
  each."""
  for ids, depth, feed in fed:
    np.testing.assert_array_equal(feed['labels'], data['labels'][ids])
    _check_rows_as_computed(trainer, data, ids, feed['hidden'], depth, tolerance)
  return [depth for _, depth, _ in fed]


def _serve_a_neighbour(monkeypatch, labels):
  """Poisons the cache's reads: in every batch read, two samples of the same
  label get each other's entry. The summed loss and gradient of the batch
  are unchanged (a permutation of the same terms); only the rows are
  wrong."""
  fetch = ActivationCache.fetch

  def swapped(self, ids, *args, **kwargs):
    hidden = np.array(fetch(self, ids, *args, **kwargs))
    same = np.nonzero(labels[ids][1:] == labels[ids][0])[0]
    assert len(same), 'no pair of the same label in the batch'
    hidden[[0, same[0] + 1]] = hidden[[same[0] + 1, 0]]
    return hidden

  monkeypatch.setattr(ActivationCache, 'fetch', swapped)


@pytest.fixture(scope='module')
def uncached():
  return _run('off')


def test_cached_training_equals_uncached(uncached):
  plain_trainer, plain, plain_used, plain_fed, data = uncached
  trainer, cached, used, fed, _ = _run('on')
  assert plain_used == [False] * 4 and used == [False, True, True, True]
  assert [t.frozen_layers for t in trainer.transitions] == [2, 3]
  assert [t.cache for t in trainer.transitions] == [True, True]
  assert [t.cache for t in plain_trainer.transitions] == [False, False]
  # fp32 entries are the prefix's own output, and advanced entries went through
  # the same blocks: the losses agree to float rounding (measured: equal).
  np.testing.assert_allclose(cached, plain, rtol=1e-6)
  assert cached[-1] < cached[0]
  # The losses alone would not see a neighbour's entry served (see
  # test_a_neighbour_s_entry_fails_the_row_check_not_the_losses): every row
  # fed is its sample's own prefix output (measured: within 2.2e-7 of each
  # row's largest value; entries advanced from F = 2 to 3 as close as
  # computed ones).
  steps = trainer.train_loader.steps_per_epoch()
  assert _check_fed_as_computed(trainer, data, fed) == [2] * steps + [3] * 2 * steps
  assert _check_fed_as_computed(plain_trainer, data, plain_fed) == [2] * steps + [3] * 2 * steps
  stats = trainer.prefix.cache.stats()
  samples = 64
  # Every sample entered at depth 2 (epoch 1) and was advanced to 3 once:
  # exactly 3 frozen-block passes each, none repeated; epochs 2-3 were all hits.
  assert stats['layer_passes'] == samples * 3
  assert stats['repeated_layer_passes'] == 0
  assert stats['misses'] == samples and stats['advanced'] == samples
  assert stats['hits'] == 2 * samples
  np.testing.assert_array_equal(trainer.prefix.cache.layer_passes_per_sample(), 3)


def test_freeze_events_inside_epochs_train_the_same_from_the_cache():
  """``freeze.timestep_steps``: the frozen prefix deepens every two steps,
  inside epochs, while the cache fills and advances. The losses equal the
  uncached run's; every row fed is its sample's prefix output at the depth
  the uncached run fed it; no sample goes through a frozen block twice."""
  def run(cache):
    config = _config(alpha=0.5, initial_length=4, micro_batches=4, epochs=3)
    with config.unlocked():
      config.freeze.timestep_steps = 2
      config.cache.update(enabled=cache, policy='always')
    trainer, data = _trainer(config)
    fed = _record_feeds(trainer)
    losses = [trainer.train_epoch(epoch, _Bar())['train_loss'] for epoch in range(3)]
    return trainer, data, fed, np.array(losses)

  plain, _, plain_fed, plain_losses = run(False)
  cached, data, fed, losses = run(True)
  depths = _check_fed_as_computed(cached, data, fed)
  assert depths == _check_fed_as_computed(plain, data, plain_fed)
  assert len(set(depths)) > 1 and depths == sorted(depths)  # it deepened inside the run
  assert any(t.step % cached.train_loader.steps_per_epoch() for t in cached.transitions)
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
  stats = cached.prefix.cache.stats()
  assert stats['repeated_layer_passes'] == 0 and stats['hits'] > 0
  np.testing.assert_array_equal(cached.prefix.cache.layer_passes_per_sample(),
                                cached.prefix.cache.depth)


def test_a_padded_last_batch_trains_the_same_from_the_cache():
  """A train loader that pads its last batch (57 samples in batches of 16:
  the last holds 9, one micro-batch of a replica half padding): the cached
  prefix feeds ``example_mask`` as the computed one does, so the losses
  agree, a padded (repeated) sample is cached and advanced once, and every
  row fed, padding too, is its sample's prefix output."""
  def run(cache):
    config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4,
                     epochs=3)
    with config.unlocked():
      config.cache.update(enabled=cache, policy='always')
    created = fixtures.tiny('vit', num_layers=4)
    data = ArraySource(fixtures.batch('vit', created.model, 57, seed=4))
    loader = Loader(data, 16, seed=0, drop_remainder=False)
    trainer = Trainer(created.model, created.params, config, '/nonexistent', loader,
                      Loader(data, 16, shuffle=False, drop_remainder=False),
                      log=lambda _: None)
    fed = _record_feeds(trainer)
    sample = next(iter(loader.epoch(0)))[1]
    losses = []
    for epoch in range(3):
      losses.append(trainer.train_epoch(epoch, _Bar())['train_loss'])
      if epoch < 2:
        trainer.maybe_transition(epoch, sample)
    return trainer, np.array(losses), fed, data.arrays

  _, plain, _, _ = run(False)
  trainer, cached, fed, data = run(True)
  assert trainer.prefix.use_cache and trainer.plan.partition.num_frozen_layers == 3
  np.testing.assert_allclose(cached, plain, rtol=1e-6)
  assert _check_fed_as_computed(trainer, data, fed) == [2] * 4 + [3] * 4
  stats = trainer.prefix.cache.stats()
  assert stats['repeated_layer_passes'] == 0 and stats['misses'] == 57
  ids, last = list(trainer.train_loader.epoch(3))[-1]  # both paths feed the mask
  fed = trainer.prefix.feed(ids, last, trainer.plan, trainer.state['frozen'])
  np.testing.assert_array_equal(np.asarray(fed['example_mask']), last['example_mask'])
  assert np.asarray(last['example_mask']).sum() == 9


def test_bfloat16_entries_bound(uncached):
  plain = uncached.losses
  trainer, cached, _, fed, data = _run('on', dtype='bfloat16')
  # bf16 rounds each stored value by ≤ 2^-8 relative; through the remaining
  # blocks and a few steps the epoch losses moved by 4.7e-6 relative
  # (measured); swapping two samples' entries in every batch moved them by
  # 6.8e-5, so the bound sits between the two.
  np.testing.assert_allclose(cached, plain, rtol=2e-5)
  assert not np.array_equal(cached[1:], plain[1:])  # the rounding is real
  # Row by row: the fill epoch (F = 2) feeds the prefix's fp32 output, the
  # next two the bf16 entries advanced to F = 3, rounded twice: measured
  # within 5.3e-3 of each row's largest value.
  steps = trainer.train_loader.steps_per_epoch()
  assert _check_fed_as_computed(trainer, data, fed[:steps]) == [2] * steps
  assert _check_fed_as_computed(trainer, data, fed[steps:], tolerance=1e-2) == (
      [3] * 2 * steps)
  with pytest.raises(AssertionError, match='are not their forward'):
    _check_fed_as_computed(trainer, data, fed[steps:])  # bf16 is not fp32


def test_disk_tier_with_prefetch_equals_uncached(uncached, tmp_path):
  plain = uncached.losses
  # 64 entries of 5x16 float32 (320 bytes): ~20 fit in memory, the rest go to
  # the disk file, read ahead each epoch.
  trainer, cached, _, fed, data = _run('on', memory_mb=8000 / 2**20, disk_mb=1.0,
                                       directory=str(tmp_path / 'cache'))
  stats = trainer.prefix.cache.stats()
  assert stats['disk_entries'] > 30 and stats['prefetched'] > 0 and stats['corrupt'] == 0
  assert stats['peak_bytes_in_memory'] <= 8000
  np.testing.assert_allclose(cached, plain, rtol=1e-6)
  assert stats['repeated_layer_passes'] == 0
  steps = trainer.train_loader.steps_per_epoch()  # read back from disk, row by row
  assert _check_fed_as_computed(trainer, data, fed) == [2] * steps + [3] * 2 * steps


def test_a_neighbour_s_entry_fails_the_row_check_not_the_losses(uncached, monkeypatch):
  """The row check above can fail where the losses cannot: a cache read that
  serves two samples of the same label each other's entry trains to the
  same losses (measured: equal), and the row check names them."""
  plain = uncached.losses
  _serve_a_neighbour(monkeypatch, uncached.data['labels'])
  trainer, cached, used, fed, data = _run('on')
  assert used == [False, True, True, True]
  np.testing.assert_allclose(cached, plain, rtol=1e-6)
  steps = trainer.train_loader.steps_per_epoch()
  assert _check_fed_as_computed(trainer, data, fed[:steps]) == [2] * steps  # fill: not read
  for one in fed[steps:]:  # every step read from the cache was poisoned
    with pytest.raises(AssertionError, match='are not their forward'):
      _check_fed_as_computed(trainer, data, [one])


def test_randomly_augmented_input_is_not_cached_unless_accepted():
  class Augmented(ArraySource):
    randomly_augmented = True

  for accept in (False, True):
    config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4)
    with config.unlocked():
      config.cache.update(policy='always', accept_reused_augmentation=accept)
    trainer, data = _trainer(config)
    messages = []
    trainer.train_loader.source = Augmented(data)
    cache = make_cache(config, trainer.model, trainer.train_loader.source,
                       trainer.canonical_params(), '/nonexistent', messages.append)
    assert (cache is not None) == accept
    assert len(messages) == 1 and 'randomly augmented' in messages[0]


def test_a_filled_cache_that_won_is_kept_at_deeper_depths_without_timing(monkeypatch):
  timed = []
  decide = FrozenPrefix._decide

  def counted(self, plan, *args):
    depth = plan.partition.num_frozen_layers
    # Poison: only the first depth (empty cache) and the first filled one may be timed.
    assert len(timed) < 2, f'depth {depth} was timed again'
    timed.append(depth)
    return decide(self, plan, *args)

  monkeypatch.setattr(FrozenPrefix, '_decide', counted)
  # The cache's reads and writes (with their copies) count as free, so the
  # first timed decision chooses the cache whatever this machine's load does
  # to timings; the forward stays measured.
  decide_caching = autocache_policy.decide_caching
  monkeypatch.setattr(autocache_policy, 'decide_caching',
                      lambda depth, forward, read, write, *args, **kwargs: decide_caching(
                          depth, forward, 0.0, 0.0, *args, **kwargs))
  config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4, epochs=4)
  with config.unlocked():
    config.cache.update(policy='profile')
  lines = []
  trainer, _ = _trainer(config, num_layers=6)
  trainer.prefix.log = lines.append
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  for epoch in range(3):
    trainer.train_epoch(epoch, _Bar())
    trainer.maybe_transition(epoch, sample)
  decisions = trainer.prefix.decisions
  assert [t.frozen_layers for t in trainer.transitions] == [3, 4, 5] and timed == [3, 4]
  assert [t.cache for t in trainer.transitions] == [True, True, True]  # recorded per transition
  assert [(d.num_frozen_layers, d.measured_at, d.filled, d.use_cache) for d in decisions] == [
      (3, 3, False, True), (4, 4, True, True), (5, 4, True, True)]
  # Each decision prices the epochs left (4 epochs, decided after epochs 0, 1, 2) in
  # the batches this process trains.
  assert [d.epochs_ahead for d in decisions] == [3, 2, 1]
  assert [d.batch_size for d in decisions] == [config.train.batch_size] * 3
  kept = decisions[-1]
  assert (kept.read_seconds, kept.forward_seconds) == (decisions[1].read_seconds,
                                                       decisions[1].forward_seconds)
  assert any('F=5: use the cache (not re-measured: at F=4' in line for line in lines), lines
  # The kept depth is served from the advanced entries: every sample passed
  # each of the 5 frozen blocks once.
  trainer.train_epoch(3, _Bar())
  stats = trainer.prefix.cache.stats()
  assert stats['repeated_layer_passes'] == 0 and stats['layer_passes'] == 64 * 5
  np.testing.assert_array_equal(trainer.prefix.cache.layer_passes_per_sample(), 5)


def test_policy_always_caches_where_the_decision_says_no_on_the_fastest_rounds(monkeypatch):
  """``cache.policy=always`` caches although the decision (still taken and
  logged) finds the forward cheaper; the decision's read and write are each
  the fastest of its timing rounds, so one round slowed by the machine does
  not decide (here the first round's take a second each), and it is told
  the fraction of the samples the budgets hold."""
  rounds = []

  def measure_io(self, hidden):
    rounds.append(len(hidden))
    return (1.0, 1.0) if len(rounds) == 1 else (0.0, 0.0)  # (write, read)

  monkeypatch.setattr(ActivationCache, 'measure_io', measure_io)
  monkeypatch.setattr(ActivationCache, 'fits', lambda self: 0.25)  # budgets for a quarter
  decide_caching = autocache_policy.decide_caching
  monkeypatch.setattr(autocache_policy, 'decide_caching',  # a free forward: the cache loses
                      lambda depth, forward, read, write, *args, **kwargs: decide_caching(
                          depth, 0.0, read, write, *args, **kwargs))
  config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4, epochs=2)
  with config.unlocked():
    config.cache.update(policy='always')
  lines = []
  trainer, _ = _trainer(config)
  trainer.prefix.log = lines.append
  trainer.train_epoch(0, _Bar())
  trainer.maybe_transition(0, next(iter(trainer.train_loader.epoch(0)))[1])
  [decision] = trainer.prefix.decisions
  assert len(rounds) > 1 and not decision.use_cache and trainer.prefix.use_cache
  assert decision.read_seconds < 1 and decision.write_seconds < 1
  assert decision.fits == 0.25
  assert any('policy always: caching' in line for line in lines), lines


def test_the_fill_epoch_defers_its_writes_and_a_cache_that_stops_paying_is_emptied(
    monkeypatch):
  """The epoch that fills an empty cache feeds every batch from the devices
  and stores its host copy later (no fetch in the step stream); when the next
  decision finds the forward cheaper, the entries are dropped, not kept at a
  depth nothing reads."""
  decide_caching, decided = autocache_policy.decide_caching, []

  def decide(depth, forward, read, write, *args, **kwargs):
    decided.append(depth)  # first the cache wins (free reads and writes), then
    # it loses (a free forward)
    if len(decided) == 1:
      return decide_caching(depth, forward, 0.0, 0.0, *args, **kwargs)
    return decide_caching(depth, 0.0, max(read, 1e-6), write, *args, **kwargs)

  monkeypatch.setattr(autocache_policy, 'decide_caching', decide)
  config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4, epochs=3)
  with config.unlocked():
    config.cache.update(policy='profile')
  trainer, _ = _trainer(config, num_layers=6)
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  trainer.train_epoch(0, _Bar())
  trainer.maybe_transition(0, sample)
  assert trainer.prefix.use_cache
  calls = []

  def spy(name):
    real = getattr(ActivationCache, name)

    def called(self, *args, **kwargs):
      calls.append(name)
      return real(self, *args, **kwargs)
    return called

  for name in ('defer', 'fetch'):
    monkeypatch.setattr(ActivationCache, name, spy(name))
  trainer.train_epoch(1, _Bar())
  assert calls == ['defer'] * trainer.train_loader.steps_per_epoch()
  cache = trainer.prefix.cache
  assert cache.stats()['memory_entries'] + cache.stats()['disk_entries'] > 0
  trainer.maybe_transition(1, sample)
  assert [d.use_cache for d in trainer.prefix.decisions] == [True, False]
  assert not trainer.prefix.use_cache
  assert cache.stats()['memory_entries'] + cache.stats()['disk_entries'] == 0


def _never_computed(rows):
  raise AssertionError(f'{len(rows)} entries were computed, not read from the cache')


def _cached_at_depth_3():
  """72 samples in batches of 16, the cache always on: after two epochs and
  their freeze events (F = 2 after epoch 0, the cache on and empty; F = 3
  after epoch 1), the cache holds epoch 1's samples at depth 3. Returns the
  trainer and the data."""
  config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4, epochs=3)
  with config.unlocked():
    config.cache.update(policy='always')
  trainer, data = _trainer(config, samples=72)
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  for epoch in range(2):
    trainer.train_epoch(epoch, _Bar())
    trainer.maybe_transition(epoch, sample)
  return trainer, data


_REAL_FETCH = ActivationCache.fetch  # the tests below spy on it


def _check_read_as_computed(trainer, data, ids):
  """The cache's entries for ``ids``, read (never computed), equal a fresh
  forward through the 3 frozen blocks."""
  _check_rows_as_computed(trainer, data, ids,
                          _REAL_FETCH(trainer.prefix.cache, ids, _never_computed), 3)


def test_samples_an_epoch_dropped_are_computed_together_before_the_next(monkeypatch):
  """72 samples in batches of 16: every epoch drops 8, so the epoch after the
  cache was filled meets samples it lacks, scattered over batches of hits.
  They are computed before that epoch, together (one call per batch of them),
  not one blocking prefix per batch in the step stream; their entries are the
  prefix's output, each sample passed the frozen blocks once."""
  trainer, data = _cached_at_depth_3()
  cache, loader = trainer.prefix.cache, trainer.train_loader
  assert cache.depth == 3 and trainer.prefix.use_cache
  batches = loader.batch_ids(2)
  lacking = np.setdiff1d(np.concatenate(batches), np.concatenate(loader.batch_ids(1)))
  assert 0 < len(lacking) <= 8 and np.all(cache.depths(lacking) == -1)
  # The entries filled at F = 2 went to F = 3 in one call of 80 rows (72 samples
  # round up to 5 whole batches of 16) whose padding rows were dropped.
  assert trainer.prefix.advance_size(trainer.config.train.batch_size) == 80
  _check_read_as_computed(trainer, data, np.concatenate(loader.batch_ids(1)))
  misses = cache.stats()['misses']
  fetched = []

  def spy(self, ids, *args, **kwargs):
    fetched.append(len(ids))
    return _REAL_FETCH(self, ids, *args, **kwargs)

  monkeypatch.setattr(type(cache), 'fetch', spy)
  assert trainer.prefix.prefetch(batches, trainer.plan, trainer.state['frozen']) == len(lacking)
  assert fetched == [len(lacking)]  # one computation for all of them
  assert np.all(cache.depths(np.concatenate(batches)) == 3)
  assert cache.stats()['misses'] == misses + len(lacking)
  _check_read_as_computed(trainer, data, lacking)  # stored by the prefetch, not computed again
  # The epoch itself then finds nothing missing: no miss, no pass repeated.
  fetched.clear()
  trainer.train_epoch(2, _Bar())
  stats = cache.stats()
  assert stats['misses'] == misses + len(lacking)
  assert stats['repeated_layer_passes'] == 0
  assert len(fetched) == loader.steps_per_epoch()  # every batch served by the cache


def test_more_stragglers_than_a_batch_are_computed_a_batch_at_a_time(monkeypatch):
  """Entries dropped from every batch of the next epoch (each batch keeps
  some): more stragglers than the prefix's compiled batch of 16. They are
  computed in calls of 16 rows, the last one padded, and every one is stored
  as the prefix computes it."""
  trainer, data = _cached_at_depth_3()
  cache, loader = trainer.prefix.cache, trainer.train_loader
  batches = loader.batch_ids(2)
  with cache._lock:  # noqa: SLF001 - 5 entries of every batch gone
    for ids in batches:
      for sample_id in ids[cache.depths(ids) >= 0][:5]:
        cache._drop_if_current(int(sample_id), cache._version[sample_id])  # noqa: SLF001
  missing = cache.depths(np.concatenate(batches)) < 0
  lacking = np.unique(np.concatenate(batches)[missing])
  assert len(lacking) > 16 and len(lacking) % 16  # the last call padded
  assert all(np.any(cache.depths(ids) >= 0) for ids in batches)
  assert trainer.prefix.local_batch_size == 16
  real_forward = FrozenPrefix._forward
  fetched, forwarded = [], []

  def fetch(self, ids, *args, **kwargs):
    fetched.append(len(ids))
    return _REAL_FETCH(self, ids, *args, **kwargs)

  def forward(self, plan, frozen, batch):
    forwarded.append(len(next(iter(batch.values()))))
    return real_forward(self, plan, frozen, batch)

  monkeypatch.setattr(type(cache), 'fetch', fetch)
  monkeypatch.setattr(FrozenPrefix, '_forward', forward)
  assert trainer.prefix.prefetch(batches, trainer.plan, trainer.state['frozen']) == len(lacking)
  n = len(lacking)
  assert fetched == [16] * (n // 16) + ([n % 16] if n % 16 else [])
  assert forwarded == [16] * len(fetched)  # the compiled size, the last call padded
  _check_read_as_computed(trainer, data, lacking)


def test_stragglers_the_cache_cannot_store_are_left_to_their_batches(monkeypatch):
  """With budgets below the data set, a straggler the cache would refuse is
  not computed before the epoch (it would be computed again in its batch)."""
  trainer, _ = _cached_at_depth_3()
  cache, loader = trainer.prefix.cache, trainer.train_loader
  batches = loader.batch_ids(2)
  lacking = np.setdiff1d(np.concatenate(batches), np.concatenate(loader.batch_ids(1)))
  assert len(lacking) > 2
  monkeypatch.setattr(type(cache), 'room', lambda self: 2)  # the budgets hold 2 more
  before = cache.stats()
  assert trainer.prefix.prefetch(batches, trainer.plan, trainer.state['frozen']) == 2
  after = cache.stats()
  assert after['misses'] == before['misses'] + 2
  assert after['uncached'] == before['uncached']  # nothing computed only to be refused
  assert int((cache.depths(lacking) == 3).sum()) == 2


def test_entries_are_advanced_in_as_few_calls_as_the_byte_budget_allows(monkeypatch):
  """Each advance call is a round trip that waits for the devices: a freeze
  event moves all 64 entries in one call, unless ADVANCE_BYTES says less (and
  never less than a batch)."""
  from pipejax import frozen_prefix  # noqa: PLC0415
  config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4, epochs=3)
  with config.unlocked():
    config.cache.update(policy='always')
  trainer, _ = _trainer(config)
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  calls = []
  real = FrozenPrefix._advance_host

  def counted(self, plan, frozen, ids, hidden, from_depth):
    calls.append(len(ids))
    return real(self, plan, frozen, ids, hidden, from_depth)

  monkeypatch.setattr(FrozenPrefix, '_advance_host', counted)
  for epoch in range(2):  # the cache fills at depth 2 in epoch 1, then moves to 3
    trainer.train_epoch(epoch, _Bar())
    trainer.maybe_transition(epoch, sample)
  assert trainer.prefix.cache.depth == 3 and calls == [64]
  entry = int(np.prod(trainer.prefix.cache.entry_shape)) * 4
  assert trainer.prefix.advance_size(16) == 64
  monkeypatch.setattr(frozen_prefix, 'ADVANCE_BYTES', 2 * 16 * entry)
  assert trainer.prefix.advance_size(16) == 32
  monkeypatch.setattr(frozen_prefix, 'ADVANCE_BYTES', 1)
  assert trainer.prefix.advance_size(16) == 16


def _cached_run(tmp_path, skip: bool, monkeypatch):
  """Per-epoch losses, final parameters and the trainer of a 6-block run
  (F = 0, 3, 4, 5, the cache always on, plans compiled ahead from a program
  store); ``skip=False`` compiles every prefix ahead as before."""
  from pipejax.programs import ProgramStore  # noqa: PLC0415
  from tests.test_trainer import _bits  # noqa: PLC0415
  if not skip:
    monkeypatch.setattr(FrozenPrefix, '_serves_every_sample', lambda self: False)
  config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4, epochs=4)
  with config.unlocked():
    config.cache.update(policy='always')
    config.freeze.compile_ahead = True
  trainer, _ = _trainer(config, num_layers=6)
  trainer.programs = ProgramStore(str(tmp_path), {'test': 'lazy prefix'}, log=pytest.fail)
  trainer.prefix.programs = trainer.programs
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  losses = []
  for epoch in range(4):
    trainer.prepare_next(sample)
    losses.append(trainer.train_epoch(epoch, _Bar())['train_loss'])
    if epoch < 3:
      trainer.maybe_transition(epoch, sample)
  monkeypatch.undo()
  return losses, _bits(trainer.portable_state()), trainer


def test_a_prefix_the_filled_cache_serves_is_not_loaded_ahead_but_on_a_call(tmp_path,
                                                                            monkeypatch):
  """Once the cache holds every sample, the next depth's steps are all fed
  from advanced entries: its prefix is not compiled ahead, training is bit
  for bit the same, and a call that needs it after all gets it from the
  program store (the same program as one compiled ahead)."""
  want_losses, want_bits, eager = _cached_run(tmp_path, False, monkeypatch)
  losses, bits, trainer = _cached_run(tmp_path, True, monkeypatch)  # loads eager's programs
  assert [t.frozen_layers for t in trainer.transitions] == [3, 4, 5]
  assert losses == want_losses and len(bits) == len(want_bits)
  for got, want in zip(bits, want_bits, strict=True):
    np.testing.assert_array_equal(got, want)
  ahead = {key[1][0] for key in eager.prefix._compiled if key[0] == 'prefix'}
  lazy = {key[1][0] for key in trainer.prefix._compiled if key[0] == 'prefix'}
  # F = 3's was compiled while the cache was empty, F = 4's before the fill
  # epoch's entries were in; at F = 5 every sample was cached.
  assert ahead == {3, 4, 5} and lazy == {3, 4}
  assert trainer.prefix.cache.stats()['misses'] == 64  # F = 5 needed no prefix
  plan, frozen = trainer.plan, trainer.state['frozen']
  batch = next(iter(trainer.train_loader.epoch(0)))[1]
  loaded = trainer.programs.stats()['programs_loaded']
  got = np.asarray(trainer.prefix._forward(plan, frozen, batch))
  assert trainer.programs.stats()['programs_loaded'] == loaded + 1  # eager's entry, same key
  np.testing.assert_array_equal(got, np.asarray(eager.prefix._forward(plan, frozen, batch)))


def test_the_caching_decision_charges_the_copies_to_the_cache(monkeypatch):
  """The prefix without the cache stays on the devices; a hit copies its
  entries to them (a miss its output to the host): the decision's read
  carries that copy, its forward does not. The prefix's clock moves only when
  entries are copied to the devices (one second a copy), to see where that
  copy lands."""
  from pipejax import frozen_prefix  # noqa: PLC0415
  put, now = jax.device_put, [0.0]

  def slow_put(x, *args, **kwargs):
    if isinstance(x, np.ndarray) and x.ndim == 3:  # [batch, seq, hidden]: entries
      now[0] += 1.0
    return put(x, *args, **kwargs)

  monkeypatch.setattr(frozen_prefix.jax, 'device_put', slow_put)
  monkeypatch.setattr(frozen_prefix, 'time', types.SimpleNamespace(perf_counter=lambda: now[0]))
  monkeypatch.setattr(ActivationCache, 'measure_io', lambda self, hidden: (0.0, 0.0))
  config = _config(policy='schedule', alpha=0.5, epochs=2)
  with config.unlocked():
    config.cache.policy = 'profile'
  trainer, _ = _trainer(config)
  sample = next(iter(trainer.train_loader.epoch(0)))[1]
  trainer.train_epoch(0, _Bar())
  trainer.maybe_transition(0, sample)
  decision = trainer.prefix.decisions[-1]
  assert decision.num_frozen_layers == 2 and decision.measured_at == 2
  assert (decision.forward_seconds, decision.read_seconds, decision.write_seconds) == (0, 1, 0)


def test_the_run_s_cache_starts_empty_in_a_directory_it_filled_before(tmp_path, monkeypatch):
  """A rerun in the same workdir (or a resume) does not take over the
  entries left on disk (it starts with nothing frozen, or empty at the
  checkpoint's depth), and does not read them one by one to drop them."""
  from pipejax import autocache_disk  # noqa: PLC0415
  config = _config()
  with config.unlocked():
    config.cache.update(memory_mb=0.0, disk_mb=1.0)
  # The trainer's own cache in a folder of this test's (its default workdir
  # is '/nonexistent', which a root user can create: a leftover of another
  # version of the code would be refused there).
  own = _config()
  with own.unlocked():
    own.cache.update(memory_mb=0.0, disk_mb=1.0, directory=str(tmp_path / 'trainer'))
  trainer, _ = _trainer(own)

  def cache():
    return make_cache(config, trainer.model, trainer.train_loader.source,
                      trainer.canonical_params(), str(tmp_path), lambda _: None)

  first = cache()
  first.advance(1)
  ids = np.arange(8)
  first.fetch(ids, lambda rows: np.ones((len(rows),) + first.entry_shape, np.float32))
  assert first.stats()['disk_entries'] == 8
  first.close()
  monkeypatch.setattr(autocache_disk.DiskTier, 'scan', lambda self: pytest.fail('scanned'))
  again = cache()
  assert again.stats()['disk_entries'] == 0 and not again.contains(ids).any()
  again.close()


def test_the_workdir_s_own_cache_of_another_identity_is_cleared_a_chosen_one_refused(tmp_path):
  """``<workdir>/cache`` is the workdir's runs' alone: one an earlier run
  there left under another identity (a newer transformers, another process
  count, a start over with another config) is cleared in one line; a
  ``cache.directory`` the user chose is refused, as ``cache.on_mismatch``
  says."""
  own = _config()
  with own.unlocked():
    own.cache.update(memory_mb=0.0, disk_mb=1.0, directory=str(tmp_path / 'trainer'))
  trainer, _ = _trainer(own)
  for directory in ('', str(tmp_path / 'chosen')):
    workdir = tmp_path / ('run' if not directory else 'other')
    folder = workdir / 'cache' if not directory else tmp_path / 'chosen'
    lines = []

    def cache(seed, directory=directory, workdir=workdir, lines=lines):
      config = _config()
      with config.unlocked():
        config.cache.update(memory_mb=0.0, disk_mb=1.0, directory=directory)
        config.seed = seed  # another checkpoint identity
      return make_cache(config, trainer.model, trainer.train_loader.source,
                        trainer.canonical_params(), str(workdir), lines.append)

    cache(0).close()
    assert (folder / 'autocache.json').exists()
    if directory:
      with pytest.raises(CacheMismatchError, match='holds activations this run cannot trust'):
        cache(1)
    else:
      cache(1).close()
      cleared = [line for line in lines if 'clearing' in line]
      assert len(cleared) == 1 and cleared[0].startswith(
          f"  autocache: clearing {folder}: it held another run's activations (identity ")


def test_the_cache_identity_is_the_checkpoint_s(monkeypatch):
  """A disk cache is refused for another config; not for one that only
  compiles ahead or pads stages differently (the same values), nor for a
  change a resumed run may make (the same checkpoint identity; a resume
  starts the cache empty at the checkpoint's depth)."""
  from pipejax import frozen_prefix  # noqa: PLC0415
  monkeypatch.setattr(frozen_prefix, 'ActivationCache', lambda **kw: kw['identity'])
  config = _config()
  trainer, _ = _trainer(config)

  def identity(**overrides):
    c = _config()
    with c.unlocked():
      fixtures.override(c, overrides)
    return make_cache(c, trainer.model, trainer.train_loader.source,
                      trainer.canonical_params(), '/nonexistent', lambda _: None)

  base = identity()
  assert identity(**{'freeze.compile_ahead': True, 'freeze.keep_slot_width': True}) == base
  assert identity(**{'train.epochs': 7, 'pipeline.initial_length': 2, 'cache.memory_mb': 1.0,
                     'checkpoint.every_steps': 3, 'train.eval_batch_size': 64,
                     'data.workers': 3}) == base
  for changed in ({'freeze.alpha': 0.25}, {'train.learning_rate': 0.5}, {'seed': 3}):
    assert identity(**changed) != base, changed


def test_the_disk_caches_identity_holds_how_the_source_prepares_its_examples(monkeypatch):
  """Cached activations depend on how the inputs were prepared: a source's
  ``preparation`` (a checkpoint's image processor) joins the identity of
  AutoCache's disk entries, so another preparation never reads them."""
  from pipejax import frozen_prefix  # noqa: PLC0415
  config = _config()
  with config.unlocked():
    config.cache.update(memory_mb=1.0)
  created = fixtures.tiny('vit', num_layers=4)
  data = fixtures.batch('vit', created.model, 8, seed=1)
  monkeypatch.setattr(frozen_prefix, 'ActivationCache', lambda **kw: kw['identity'])

  def identity(preparation):
    source = ArraySource(data)
    source.preparation = preparation
    return make_cache(config, created.model, source, created.params, '/nonexistent',
                      lambda _: None)

  plain = identity(None)
  assert identity(None) == plain
  assert identity({'image_processor': {'image_mean': [0.5] * 3}}) != plain
  assert identity({'image_processor': {'image_mean': [0.4] * 3}}) != identity(
      {'image_processor': {'image_mean': [0.5] * 3}})


def test_a_resume_carries_the_cache_counters_on():
  """The cache's counters are cumulative in the metrics rows (and
  ``reproduce`` prices the cache's work by their growth): a resumed run goes
  on from the checkpoint's. Its cache starts empty, so refilling it passes
  every sample through the frozen blocks again: repeated passes, counted as
  such."""
  config = _config(policy='schedule', alpha=0.5, initial_length=4, micro_batches=4, epochs=4)
  with config.unlocked():
    config.cache.update(enabled=True, policy='always')
  first, _ = _trainer(config)
  sample = next(iter(first.train_loader.epoch(0)))[1]
  for epoch in range(3):
    first.train_epoch(epoch, _Bar())
    if epoch < 2:
      first.maybe_transition(epoch, sample)
  steps = first.train_loader.steps_per_epoch()
  meta = json.loads(json.dumps(first.checkpoint_meta(2, steps, True)))  # as saved
  saved, passes = first.prefix.stats(), first.prefix.cache.layer_passes_per_sample()
  resumed, _ = _trainer(config)
  resumed.restore(first.portable_state(), meta)
  cumulative = [f'cache_{k}' for k in (*first.prefix.cache.counters()['counts'],
                                       'read_seconds', 'write_seconds', 'prefetch_seconds')]
  assert {k: resumed.prefix.stats()[k] for k in cumulative} == {k: saved[k] for k in cumulative}
  assert saved['cache_layer_passes'] > 0 and saved['cache_hits'] > 0
  np.testing.assert_array_equal(resumed.prefix.cache.layer_passes_per_sample(), passes)
  for trainer in (first, resumed):
    trainer.train_epoch(3, _Bar())
  went_on, refilled = first.prefix.stats(), resumed.prefix.stats()
  depth, n = first.plan.partition.num_frozen_layers, len(first.train_loader.source)
  assert depth == resumed.plan.partition.num_frozen_layers > 0
  # The run that went on served epoch 3 from its entries; the resumed one
  # computed every sample's prefix once more (and its hits became misses).
  assert went_on['cache_layer_passes'] == saved['cache_layer_passes']
  assert went_on['cache_repeated_layer_passes'] == saved['cache_repeated_layer_passes'] == 0
  assert refilled['cache_layer_passes'] == saved['cache_layer_passes'] + depth * n
  assert refilled['cache_repeated_layer_passes'] == depth * n
  assert refilled['cache_misses'] - saved['cache_misses'] == n
  assert refilled['cache_hits'] == saved['cache_hits']
