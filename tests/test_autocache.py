"""AutoCache: exact values, one pass per frozen layer, budgets, disk safety,
prefetch, the caching decision, and the multi-host sampler it relies on."""
import dataclasses
import errno
import json
import os
import time

import jax
import ml_dtypes
import numpy as np
import pytest

from pipejax import autocache_disk, diskcache
from pipejax.autocache import ActivationCache, CacheMismatchError, storage_error_bound
from pipejax.autocache_policy import (CachingDecision, caching_allowed, decide_caching,
                                      keep_caching)
from pipejax.data import ArraySource, Loader, ShardedLoader, host_subset
from pipejax.frozen_prefix import combine_decision_inputs
from tests import fixtures

SEQ, HIDDEN, LAYERS = 5, 8, 9
ENTRY = SEQ * HIDDEN * 4  # float32 bytes of one entry


class FakePrefix:
  """A numpy stand-in for the frozen prefix: input → embedding → LAYERS
  blocks, each a fixed nonlinear map. It counts every (sample, block) pass
  itself: the independent reference for the cache's own counter."""

  def __init__(self, num_samples, seed=0):
    rng = np.random.default_rng(seed)
    self.inputs = rng.normal(size=(num_samples, SEQ, HIDDEN)).astype(np.float32)
    # Elementwise maps (no BLAS): a row's result never depends on the batch.
    self.scale = rng.normal(size=(LAYERS, 1, HIDDEN)).astype(np.float32)
    self.passes = np.zeros((num_samples, LAYERS), np.int64)
    self.computed = []  # the IDs each compute call got

  def blocks(self, ids, hidden, from_depth, to_depth):
    hidden = np.array(hidden, np.float32)
    for layer in range(from_depth, to_depth):
      hidden = self.block(layer, hidden)
      np.add.at(self.passes[:, layer], ids, 1)
    return hidden

  def direct(self, ids, depth):
    """The reference: the prefix recomputed from the input (not counted)."""
    hidden = self.inputs[ids]
    for layer in range(depth):
      hidden = self.block(layer, hidden)
    return hidden

  def block(self, layer, hidden):
    return hidden + np.tanh(hidden * self.scale[layer] + np.roll(hidden, 1, axis=-1))

  def compute_fn(self, batch_ids, depth):
    def compute(rows):
      ids = batch_ids[rows]
      self.computed.append(ids)
      return self.blocks(ids, self.inputs[ids], 0, depth)
    return compute

  def advance_fn(self, ids, hidden, from_depth, to_depth):
    return self.blocks(ids, hidden, from_depth, to_depth)


def make_cache(tmp_path=None, num_samples=32, **kw):
  kw.setdefault('memory_bytes', 1 << 20)
  if tmp_path is not None:
    kw.setdefault('directory', str(tmp_path / 'cache'))
  return ActivationCache(identity=kw.pop('identity', 'run-a'), num_samples=num_samples,
                         entry_shape=(SEQ, HIDDEN), log=kw.pop('log', lambda s: None), **kw)


def run_epoch(cache, fake, batches, advance=True):
  """Fetches every batch; returns the values in batch order."""
  return [cache.fetch(ids, fake.compute_fn(ids, cache.depth),
                      fake.advance_fn if advance else None) for ids in batches]


def epoch_batches(num_samples, batch_size, epoch):
  order = np.random.default_rng([7, epoch]).permutation(num_samples)
  return [order[i:i + batch_size] for i in range(0, num_samples, batch_size)]


# -- values ------------------------------------------------------------------------
def test_fp32_entries_are_exact_and_hit_the_second_epoch(tmp_path):
  fake = FakePrefix(32)
  cache = make_cache(tmp_path, memory_bytes=10 * ENTRY, disk_bytes=1 << 20, prefetch_bytes=0)
  cache.advance(3)
  first = run_epoch(cache, fake, epoch_batches(32, 8, 0))
  fake.computed.clear()
  batches = epoch_batches(32, 8, 1)
  second = run_epoch(cache, fake, batches)
  assert fake.computed == []  # every sample served from memory or disk
  for ids, got in zip(batches, second, strict=True):
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, fake.direct(ids, 3))
  stats = cache.stats()
  assert (stats['hits'], stats['misses'], stats['memory_entries'], stats['disk_entries']) == (
      32, 32, 10, 22)
  assert len(first) == 4


def test_a_fetched_batch_is_the_caller_s_own_array(tmp_path):
  """A batch comes back in its own order, with or without repeated IDs,
  from memory and from disk; poisoning what a fetch returned (after a miss
  and after a hit) leaves the cached entries as they were."""
  fake = FakePrefix(16)
  cache = make_cache(tmp_path, num_samples=16, memory_bytes=6 * ENTRY, disk_bytes=1 << 20,
                     prefetch_bytes=0)
  cache.advance(2)
  batches = [np.array([9, 2, 14, 0, 7, 3, 11, 5]), np.array([8, 8, 9, 15, 9, 4, 6, 8]),
             np.array([13, 12, 10, 0, 9, 2, 14, 7])]
  for _ in range(2):  # misses, then hits
    for ids in batches:
      got = cache.fetch(ids, fake.compute_fn(ids, 2), fake.advance_fn)
      np.testing.assert_array_equal(got, fake.direct(ids, 2))
      got[:] = np.nan
  assert cache.stats()['disk_entries'] > 0  # both tiers served (9, repeated, from memory)
  for ids in batches:
    np.testing.assert_array_equal(cache.fetch(ids, fake.compute_fn(ids, 2)),
                                  fake.direct(ids, 2))


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_half_precision_storage_bound(tmp_path, dtype):
  """Each stored value is the round-to-nearest of the float32 value:
  |stored − x| ≤ storage_error_bound(dtype)·|x| on both tiers."""
  fake = FakePrefix(16)
  cache = make_cache(tmp_path, num_samples=16, dtype=dtype, memory_bytes=4 * ENTRY // 2,
                     disk_bytes=1 << 20, prefetch_bytes=0)
  cache.advance(2)
  ids = np.arange(16)
  cache.fetch(ids, fake.compute_fn(ids, 2))
  got = cache.fetch(ids, fake.compute_fn(ids, 2))
  assert cache.stats()['hits'] == 16 and cache.stats()['disk_entries'] == 12
  exact = fake.direct(ids, 2)
  bound = storage_error_bound(dtype)
  assert np.all(np.abs(got - exact) <= bound * np.abs(exact))
  np.testing.assert_array_equal(got, exact.astype(np.dtype(dtype) if dtype == 'float16' else
                                                  ml_dtypes.bfloat16).astype(np.float32))
  assert not np.array_equal(got, exact)  # it did round


def test_repeated_ids_are_computed_once():
  fake = FakePrefix(8)
  cache = make_cache(num_samples=8)
  cache.advance(4)
  ids = np.array([3, 1, 3, 5, 1, 3])  # a padded batch repeats IDs
  got = cache.fetch(ids, fake.compute_fn(ids, 4))
  np.testing.assert_array_equal(got, fake.direct(ids, 4))
  assert sorted(np.concatenate(fake.computed).tolist()) == [1, 3, 5]
  assert fake.passes.sum() == 3 * 4


# -- one pass per frozen layer --------------------------------------------------------
@pytest.mark.parametrize('eager', [True, False])
def test_each_sample_passes_each_frozen_layer_once(tmp_path, eager):
  """F 0→4→6→9 over memory and disk: the cache's counter, the fake's own
  count and samples × depth agree; values equal recomputation exactly."""
  n, batch = 24, 6
  fake = FakePrefix(n)
  cache = make_cache(tmp_path, num_samples=n, memory_bytes=9 * ENTRY, disk_bytes=1 << 20,
                     prefetch_bytes=0)
  for epoch, depth in enumerate([0, 4, 4, 6, 9]):
    cache.advance(depth, fake.advance_fn if eager else None, batch_size=5)
    batches = epoch_batches(n, batch, epoch)
    for ids, got in zip(batches, run_epoch(cache, fake, batches), strict=True):
      np.testing.assert_array_equal(got, fake.direct(ids, depth))
  assert cache.stats()['layer_passes'] == n * 9 == fake.passes.sum()
  np.testing.assert_array_equal(fake.passes, np.ones((n, LAYERS)))
  np.testing.assert_array_equal(cache.layer_passes_per_sample(), np.full(n, 9))
  assert cache.stats()['repeated_layer_passes'] == 0 and len(cache.repeated_samples()) == 0
  assert cache.stats()['advanced'] == 3 * n  # 0→4, 4→6, 6→9
  np.testing.assert_array_equal(cache.depths(np.arange(n)), np.full(n, 9))


def test_a_deferred_first_pass_is_stored_at_the_next_use_and_counted_once(tmp_path):
  """The trainer's first pass over new samples: the batch is used as
  computed and its host copy is stored at the cache's next use. Over depth
  changes, memory and disk, values, counters and the fake's own pass count
  match fetching everything."""
  n, batch = 24, 6
  fake = FakePrefix(n)
  cache = make_cache(tmp_path, num_samples=n, memory_bytes=9 * ENTRY, disk_bytes=1 << 20,
                     prefetch_bytes=0)
  copies = []
  for epoch, depth in enumerate([3, 3, 5, 5]):
    cache.advance(depth, fake.advance_fn, batch_size=5)
    for ids in epoch_batches(n, batch, epoch):
      if cache.is_new(ids):
        computed = fake.compute_fn(ids, depth)(np.arange(len(ids)))
        cache.defer(ids, lambda c=computed: copies.append(1) or c)
        pending = len(copies)
        got = computed
        assert cache.depths(ids).min() == depth  # any query stores it first
        assert len(copies) == pending + 1
      else:
        got = cache.fetch(ids, fake.compute_fn(ids, depth), fake.advance_fn)
      np.testing.assert_array_equal(got, fake.direct(ids, depth))
  stats = cache.stats()
  assert len(copies) == n // batch  # the first epoch only, each batch once
  assert (stats['misses'], stats['hits']) == (n, 3 * n)
  assert stats['layer_passes'] == n * 5 == fake.passes.sum() and stats['repeated_layer_passes'] == 0
  assert stats['disk_entries'] == n - 9
  with pytest.raises(ValueError, match='new, distinct sample IDs'):
    cache.defer(np.arange(batch), lambda: None)  # cached already
  assert not cache.is_new(np.array([0, 0]))


def test_a_deferred_batch_is_stored_before_a_depth_change():
  fake = FakePrefix(8)
  cache = make_cache(num_samples=8)
  cache.advance(2)
  ids = np.arange(8)
  cache.defer(ids, lambda: fake.compute_fn(ids, 2)(np.arange(8)))
  cache.advance(4, fake.advance_fn)  # the deferred entries are advanced, not lost
  np.testing.assert_array_equal(cache.fetch(ids, fake.compute_fn(ids, 4), fake.advance_fn),
                                fake.direct(ids, 4))
  stats = cache.stats()
  assert (stats['misses'], stats['advanced'], stats['hits']) == (8, 8, 8)
  assert stats['repeated_layer_passes'] == 0


def test_holds_every_sample_counts_owned_entries_at_any_depth_not_pending_ones():
  n = 12
  fake = FakePrefix(n)
  cache = make_cache(num_samples=n, depth=2)
  assert not cache.holds_every_sample()
  cache.fetch(np.arange(8), fake.compute_fn(np.arange(8), 2))
  rest = np.arange(8, n)
  cache.defer(rest, lambda: fake.compute_fn(rest, 2)(np.arange(len(rest))))
  assert not cache.holds_every_sample()  # written only when the cache is next used
  cache.advance(3, fake.advance_fn)
  assert cache.holds_every_sample()  # advanced entries count
  cache.clear()
  assert not cache.holds_every_sample()
  mine = np.array([0, 1, 2, 3])
  owned = make_cache(num_samples=n, depth=2, own_ids=mine)
  owned.fetch(mine, fake.compute_fn(mine, 2))
  assert owned.holds_every_sample()  # another host's samples are not this cache's


def test_without_advance_fn_stale_entries_are_recomputed_and_counted():
  fake = FakePrefix(8)
  cache = make_cache(num_samples=8)
  ids = np.arange(8)
  cache.advance(2)
  cache.fetch(ids, fake.compute_fn(ids, 2))
  cache.advance(5)
  assert (cache.stats()['hits'], cache.stats()['misses']) == (0, 8)
  got = cache.fetch(ids, fake.compute_fn(ids, 5))  # no advance_fn
  np.testing.assert_array_equal(got, fake.direct(ids, 5))
  # The stale entries were computed again: misses, not hits.
  assert (cache.stats()['hits'], cache.stats()['misses']) == (0, 16)
  cache.fetch(ids, fake.compute_fn(ids, 5))
  assert (cache.stats()['hits'], cache.stats()['misses']) == (8, 16)
  assert cache.stats()['layer_passes'] == fake.passes.sum() == 8 * 7
  assert cache.stats()['repeated_layer_passes'] == 8 * 2
  np.testing.assert_array_equal(cache.repeated_samples(), ids)
  # With an advance_fn the stale entries are advanced: neither hits nor misses.
  cache.advance(6)
  cache.fetch(ids[:5], fake.compute_fn(ids[:5], 6), fake.advance_fn)
  stats = cache.stats()
  assert (stats['hits'], stats['misses'], stats['advanced']) == (8, 16, 5)


def test_real_vit_prefix_through_the_cache(tmp_path):
  """With the tiny ViT's own prefix and blocks, jitted: served entries equal
  what the functions computed bit for bit, and the advanced chain equals one
  direct forward to XLA's fusion differences (float32 rounding)."""
  created = fixtures.tiny('vit', num_layers=6)
  model, params = created.model, created.params
  data = fixtures.batch('vit', model, 16, seed=3)['pixel_values']
  prefix = jax.jit(lambda x, d: model.hidden_states(params, {'pixel_values': x}, upto_layer=d),
                   static_argnums=1)

  def blocks(h, d0, d1):
    for unit in range(2 * d0 + 1, 2 * d1 + 1):
      h = model.sublayer(params, unit, h, {})
    return h
  blocks = jax.jit(blocks, static_argnums=(1, 2))
  entry_shape = prefix(data[:1], 0).shape[1:]
  cache = ActivationCache(identity='vit', num_samples=16, entry_shape=entry_shape,
                          memory_bytes=6 * int(np.prod(entry_shape)) * 4, disk_bytes=1 << 20,
                          directory=str(tmp_path), prefetch_bytes=0, log=lambda s: None)
  computed = {}

  def compute_fn(batch_ids, depth):
    def compute(rows):
      out = np.asarray(prefix(data[batch_ids[rows]], depth))
      computed.update(zip(batch_ids[rows].tolist(), out, strict=True))
      return out
    return compute
  advance = lambda ids, h, d0, d1: np.asarray(blocks(h, d0, d1))  # noqa: E731
  batches = [np.arange(8), np.arange(8, 16)]
  for depth in (2, 2, 5):
    cache.advance(depth, advance, batch_size=8)
    got = [cache.fetch(ids, compute_fn(ids, depth), advance) for ids in batches]
    if depth == 2 and computed:
      for ids, g in zip(batches, got, strict=True):
        np.testing.assert_array_equal(g, np.stack([computed[i] for i in ids.tolist()]))
  np.testing.assert_allclose(np.concatenate(got), prefix(data, 5), rtol=0, atol=1e-5)
  assert cache.stats()['layer_passes'] == 16 * 5 and cache.stats()['repeated_layer_passes'] == 0


# -- budgets --------------------------------------------------------------------------
def test_budgets_hold_when_everything_does_not_fit(tmp_path):
  n, in_memory, on_disk = 40, 7, 11
  fake = FakePrefix(n)
  record = autocache_disk.HEADER.itemsize + ENTRY
  cache = make_cache(tmp_path, num_samples=n, memory_bytes=in_memory * ENTRY + ENTRY - 1,
                     disk_bytes=on_disk * record + record - 1, prefetch_bytes=0)
  cache.advance(3, fake.advance_fn)
  assert cache.room() == in_memory + on_disk
  assert cache.fits() == pytest.approx((in_memory + on_disk) / n)
  batches = epoch_batches(n, 8, 0)
  run_epoch(cache, fake, batches)
  assert cache.room() == 0
  stats = cache.stats()
  assert (stats['memory_entries'], stats['disk_entries'], stats['uncached']) == (
      in_memory, on_disk, n - in_memory - on_disk)
  assert stats['bytes_in_memory'] == in_memory * ENTRY <= cache.memory_bytes
  assert stats['bytes_on_disk'] == on_disk * record
  assert os.path.getsize(tmp_path / 'cache' / 'entries.bin') <= cache.disk_bytes
  uncached = set(range(n)) - set(np.nonzero(cache.contains(np.arange(n)))[0].tolist())
  fake.computed.clear()
  for ids, got in zip(batches, run_epoch(cache, fake, batches), strict=True):
    np.testing.assert_array_equal(got, fake.direct(ids, 3))
  assert set(np.concatenate(fake.computed).tolist()) == uncached  # recomputed, nothing else
  assert set(cache.repeated_samples().tolist()) == uncached
  # A freeze event advances what is cached; the rest is recomputed at the new depth.
  cache.advance(5, fake.advance_fn)
  assert cache.stats()['disk_file_bytes'] <= cache.disk_bytes
  assert cache.stats()['peak_bytes_in_memory'] <= cache.memory_bytes


def test_evict_stale_and_clear(tmp_path):
  fake = FakePrefix(10)
  cache = make_cache(tmp_path, num_samples=10, memory_bytes=4 * ENTRY, disk_bytes=1 << 20,
                     prefetch_bytes=0)
  ids = np.arange(10)
  cache.advance(2)
  cache.fetch(ids, fake.compute_fn(ids, 2))
  cache.advance(4)
  assert cache.evict_stale() == 10
  reopened = make_cache(tmp_path, num_samples=10, disk_bytes=1 << 20, depth=4)
  assert reopened.stats()['disk_entries'] == 0  # evicted records do not come back
  reopened.close()
  stats = cache.stats()
  assert stats['memory_entries'] == stats['disk_entries'] == stats['bytes_in_memory'] == 0
  cache.fetch(ids, fake.compute_fn(ids, 4))
  cache.clear()
  assert not cache.contains(ids).any() and cache.stats()['disk_file_bytes'] == 0


def test_a_cache_that_does_not_reuse_starts_empty_without_reading_the_file(tmp_path,
                                                                          monkeypatch):
  """``reuse=False`` (the trainer's cache): a directory of the same identity
  is emptied in one truncation, never scanned record by record."""
  fake = FakePrefix(10)
  cache = make_cache(tmp_path, num_samples=10, memory_bytes=0, disk_bytes=1 << 20, depth=2)
  ids = np.arange(10)
  cache.fetch(ids, fake.compute_fn(ids, 2))
  cache.close()
  assert os.path.getsize(tmp_path / 'cache' / 'entries.bin') > 0

  def scan(self):
    raise AssertionError('the file was scanned')

  monkeypatch.setattr(autocache_disk.DiskTier, 'scan', scan)
  fresh = make_cache(tmp_path, num_samples=10, memory_bytes=0, disk_bytes=1 << 20, depth=2,
                     reuse=False)
  assert fresh.stats()['disk_entries'] == 0 and not fresh.contains(ids).any()
  assert os.path.getsize(tmp_path / 'cache' / 'entries.bin') == 0
  got = fresh.fetch(ids, fake.compute_fn(ids, 2))  # the whole disk budget is free again
  np.testing.assert_array_equal(got, fake.direct(ids, 2))
  assert fresh.stats()['disk_entries'] == 10
  fresh.close()


# -- disk safety ----------------------------------------------------------------------
def _disk_cache(tmp_path, fake, n=12, **kw):
  cache = make_cache(tmp_path, num_samples=n, memory_bytes=kw.pop('memory_bytes', 0),
                     disk_bytes=1 << 20, prefetch_bytes=0, **kw)
  cache.advance(3)
  ids = np.arange(n)
  cache.fetch(ids, fake.compute_fn(ids, 3))
  fake.computed.clear()
  return cache, ids


@pytest.mark.parametrize('where', ['payload', 'header', 'truncate'])
def test_corrupt_disk_entries_are_detected_and_recomputed(tmp_path, where):
  fake = FakePrefix(12)
  lines = []
  cache, ids = _disk_cache(tmp_path, fake, log=lines.append)
  record = cache._disk.record_bytes  # noqa: SLF001
  slot = int(cache._slot[5])  # noqa: SLF001
  path = tmp_path / 'cache' / 'entries.bin'
  if where == 'truncate':
    os.truncate(path, record * 11 + 100)  # the last slot's record is cut short
    bad = {int(np.nonzero(cache._slot == 11)[0][0])}  # noqa: SLF001
  else:
    offset = slot * record + (autocache_disk.HEADER.itemsize + 17 if where == 'payload' else 12)
    with open(path, 'r+b') as f:
      f.seek(offset)
      byte = f.read(1)
      f.seek(offset)
      f.write(bytes([byte[0] ^ 0x10]))
    bad = {5}
  got = cache.fetch(ids, fake.compute_fn(ids, 3))
  np.testing.assert_array_equal(got, fake.direct(ids, 3))  # never the corrupt value
  assert set(np.concatenate(fake.computed).tolist()) == bad
  assert cache.stats()['corrupt'] == 1
  assert any('corrupt' in line for line in lines)
  fake.computed.clear()
  cache.fetch(ids, fake.compute_fn(ids, 3))  # the recomputed entry was stored again
  assert fake.computed == []


def test_float16_storage_leaves_out_entries_beyond_its_range():
  """float16 holds nothing beyond ±65504: a row with such a value is served
  as computed and not cached (one line, counted ``uncached``), so no hit is
  ever inf; the other rows of its batch are cached and read back within the
  dtype's rounding."""
  lines = []
  cache = make_cache(num_samples=4, dtype='float16', log=lines.append)
  ids = np.arange(4)
  values = np.random.default_rng(0).normal(size=(4, SEQ, HIDDEN)).astype(np.float32)
  values[1, 2, 3] = 7e4  # beyond float16's largest, 65504
  got = cache.fetch(ids, lambda rows: values[rows])
  np.testing.assert_array_equal(got, values)
  assert cache.contains(ids).tolist() == [True, False, True, True]
  assert cache.stats()['uncached'] == 1
  assert [line for line in lines if 'float16' in line] == [
      "autocache: 1 entries hold values beyond float16's range (±65504) and are not cached "
      "(they are recomputed, and so are later ones like them); cache.dtype=bfloat16 keeps "
      "float32's range"]
  again = cache.fetch(ids, lambda rows: values[rows])
  assert np.isfinite(again).all() and again[1, 2, 3] == 7e4
  np.testing.assert_allclose(again, values, rtol=storage_error_bound('float16'), atol=2.0 ** -25)
  assert len([line for line in lines if 'float16' in line]) == 1


def test_a_failed_disk_write_turns_the_disk_tier_off_not_the_run(tmp_path, monkeypatch):
  """A full disk (ENOSPC from the entries file's write) is one line, not an
  error: the batch is served right and not cached, nothing more is written
  (the free slots are given up, the caching decision times memory), and the
  entries written before are still read."""
  fake, lines = FakePrefix(12), []
  cache = make_cache(tmp_path, num_samples=12, memory_bytes=0, disk_bytes=1 << 20,
                     prefetch_bytes=0, log=lines.append)
  cache.advance(3)
  first, rest = np.arange(6), np.arange(6, 12)
  cache.fetch(first, fake.compute_fn(first, 3))  # on disk
  writes = []

  def full(*args):
    writes.append(args)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(cache._disk, 'write', full)  # noqa: SLF001
  monkeypatch.setattr(cache._disk, 'measure', full)  # noqa: SLF001
  got = cache.fetch(rest, fake.compute_fn(rest, 3))
  np.testing.assert_array_equal(got, fake.direct(rest, 3))
  assert len(writes) == 1 and cache.stats()['uncached'] == 6
  assert [line for line in lines if 'failed' in line] == [
      f'autocache: writing {tmp_path / "cache" / "entries.bin"} failed (No space left on '
      f'device); no more entries go to disk in this run (what memory does not hold is '
      f'recomputed)']
  assert cache.room() == 0 and cache.fits() == 0.5  # the six entries on disk, no memory
  fake.computed.clear()
  ids = np.arange(12)
  np.testing.assert_array_equal(cache.fetch(ids, fake.compute_fn(ids, 3)), fake.direct(ids, 3))
  assert np.concatenate(fake.computed).tolist() == rest.tolist()  # the first six: from disk
  cache.measure_io(fake.direct(first, 3))
  assert len(writes) == 1  # neither a store nor the caching decision tried the disk again
  cache.close()


def test_a_cache_directory_another_run_uses_is_refused_and_left_alone(tmp_path):
  """Two runs on one cache directory would truncate each other's entries
  and, of equal identity, read each other's records as valid: while another
  process holds the directory, a tier is refused in one line naming it, and
  the other run's file is untouched; in one process tiers share the claim,
  and a closed tier's claim is given back."""
  fake = FakePrefix(8)
  ids = np.arange(8)
  first = make_cache(tmp_path, num_samples=8, memory_bytes=0, disk_bytes=1 << 20, prefetch_bytes=0)
  first.fetch(ids, fake.compute_fn(ids, 0))
  first.close()
  entries = tmp_path / 'cache' / 'entries.bin'
  before = entries.read_bytes()
  assert len(before) == 8 * first._disk.record_bytes  # noqa: SLF001
  with fixtures.lock_held_elsewhere(tmp_path / 'cache' / autocache_disk.LOCK) as pid:
    with pytest.raises(CacheMismatchError, match=rf'cache directory {tmp_path / "cache"} is in '
                                                 rf'use by another run \(pid {pid} on '):
      make_cache(tmp_path, num_samples=8, memory_bytes=0, disk_bytes=1 << 20, reuse=False)
    assert entries.read_bytes() == before
  # Once the other run is gone: this process's tiers, two at once, then none.
  one = make_cache(tmp_path, num_samples=8, memory_bytes=0, disk_bytes=1 << 20)
  two = make_cache(tmp_path, num_samples=8, memory_bytes=0, disk_bytes=1 << 20)
  claim = os.path.realpath(tmp_path / 'cache' / autocache_disk.LOCK)
  assert autocache_disk._CLAIMS[claim][1] == 2  # noqa: SLF001
  one.close()
  two.close()
  assert claim not in autocache_disk._CLAIMS  # noqa: SLF001


def test_a_cache_directory_that_cannot_be_cleared_is_refused_in_one_line(tmp_path):
  """With ``on_mismatch='clear'`` an ``entries.bin`` that is a directory (or
  cannot be removed) gave a bare IsADirectoryError and kept the directory's
  claim until the process ended: now one line, the claim given back, and the
  user's files in that directory untouched."""
  directory = tmp_path / 'cache'
  (directory / autocache_disk.ENTRIES / 'mine').mkdir(parents=True)
  (directory / autocache_disk.ENTRIES / 'mine' / 'notes.txt').write_text('mine')
  claim = os.path.realpath(directory / autocache_disk.LOCK)
  with pytest.raises(CacheMismatchError, match=(
      rf'^cannot clear the cache directory {directory}: Is a directory '
      rf'\({directory / autocache_disk.ENTRIES}\); remove it, or give this run another '
      rf'--config.cache.directory$')):
    make_cache(tmp_path, num_samples=8, memory_bytes=0, disk_bytes=1 << 20,
               on_mismatch='clear', reuse=False)
  assert claim not in autocache_disk._CLAIMS  # noqa: SLF001
  assert (directory / autocache_disk.ENTRIES / 'mine' / 'notes.txt').read_text() == 'mine'


def test_a_cache_directory_that_is_the_run_s_own_workdir_is_not_taken_for_another_run(tmp_path):
  """``cache.directory`` set to the run's workdir, whose lock the run holds
  itself: the disk tier claims a lock of its own name, so it is neither
  refused as in use (by its own process) nor rewrites the workdir's lock."""
  from experiments import elastic  # noqa: PLC0415
  workdir = tmp_path / 'cache'
  workdir.mkdir()
  held = diskcache.FolderLock(str(workdir / elastic.LOCK_FILE))
  try:
    before = (workdir / elastic.LOCK_FILE).read_bytes()
    fake = FakePrefix(8)
    ids = np.arange(8)
    cache = make_cache(tmp_path, num_samples=8, memory_bytes=0, disk_bytes=1 << 20,
                       prefetch_bytes=0)
    cache.advance(2)
    np.testing.assert_array_equal(cache.fetch(ids, fake.compute_fn(ids, 2)), fake.direct(ids, 2))
    assert cache.stats()['disk_entries'] == 8
    cache.close()
    assert (workdir / elastic.LOCK_FILE).read_bytes() == before
  finally:
    held.release()


def test_torn_write_never_reads_as_valid(tmp_path):
  """A crash mid-write leaves a record mixing the new and the old bytes (or
  a prefix of the new one); none of them validates as either entry."""
  tier = autocache_disk.DiskTier(str(tmp_path), 'run', (SEQ, HIDDEN), 'float32', 1 << 20, 8)
  rng = np.random.default_rng(0)
  old, new = rng.normal(size=(2, 1, SEQ, HIDDEN)).astype(np.float32)
  tier.write(np.array([2]), np.array([7]), np.array([3]), old)
  record = tier.encode(np.array([9]), np.array([4]), new)[0].tobytes()
  for cut in (8, autocache_disk.HEADER.itemsize, autocache_disk.HEADER.itemsize + 40,
              len(record) - 1):
    tier.write(np.array([2]), np.array([7]), np.array([3]), old)
    os.pwrite(tier.fd, record[:cut], 2 * tier.record_bytes)  # the write stopped at `cut`
    for sample_id, depth in ((7, 3), (9, 4)):
      _, valid = tier.read(np.array([2]), np.array([sample_id]), np.array([depth]))
      assert not valid[0], (cut, sample_id)
  os.pwrite(tier.fd, record, 2 * tier.record_bytes)
  payload, valid = tier.read(np.array([2]), np.array([9]), np.array([4]))
  assert valid[0] and np.array_equal(payload, new)
  for sample_id, depth in ((9, 5), (8, 4)):  # whole, but not the entry asked for
    assert not tier.read(np.array([2]), np.array([sample_id]), np.array([depth]))[1][0]
  tier.close()


def test_a_smaller_disk_budget_truncates_the_entries_file(tmp_path):
  """Reopened with a smaller budget, the file is cut to it: no disk beyond
  the budget stays taken, and only the slots within it are found."""
  rng = np.random.default_rng(0)
  tier = autocache_disk.DiskTier(str(tmp_path), 'run', (SEQ, HIDDEN), 'float32', 1 << 20, 12)
  tier.write(np.arange(12), np.arange(100, 112), np.full(12, 3),
             rng.normal(size=(12, SEQ, HIDDEN)).astype(np.float32))
  assert tier.file_bytes == 12 * tier.record_bytes
  tier.close()
  smaller = autocache_disk.DiskTier(str(tmp_path), 'run', (SEQ, HIDDEN), 'float32',
                                    4 * tier.record_bytes, 12)
  assert smaller.slots == 4 and smaller.file_bytes == 4 * tier.record_bytes
  assert os.path.getsize(smaller.path) == 4 * tier.record_bytes
  slots, ids, depths = smaller.scan()
  assert list(slots) == [0, 1, 2, 3] and list(ids) == [100, 101, 102, 103]
  smaller.close()


def test_directory_of_another_run_is_refused_or_cleared(tmp_path):
  fake = FakePrefix(12)
  cache, ids = _disk_cache(tmp_path, fake)
  cache.close()
  for other in (dict(identity='run-b'), dict(identity='run-b', dtype='bfloat16')):
    with pytest.raises(CacheMismatchError, match="identity 'run-a'.*this run cannot trust|"
                                                 "this run cannot trust.*'run-a'") as err:
      make_cache(tmp_path, num_samples=12, disk_bytes=1 << 20, **other)
    assert '\n' not in str(err.value)
    assert str(err.value).endswith('--config.cache.on_mismatch=clear')
  # The same run in another dtype (a resume may change cache.dtype): its own
  # entries, cleared with a line, not refused.
  lines = []
  recast = make_cache(tmp_path, num_samples=12, disk_bytes=1 << 20, dtype='bfloat16',
                      log=lines.append, depth=3)
  assert "its entries are this run's in dtype float32" in lines[0]
  assert not recast.contains(ids).any()
  recast.close()
  cache, ids = _disk_cache(tmp_path, fake)  # run-a in float32 again, for what follows
  cache.close()
  manifest = tmp_path / 'cache' / autocache_disk.MANIFEST
  good = manifest.read_text()
  manifest.write_text('{garbled')  # its own entries, but nothing says whose they are
  with pytest.raises(CacheMismatchError, match='entries.bin without a readable autocache.json'):
    make_cache(tmp_path, num_samples=12, disk_bytes=1 << 20)
  manifest.write_text(good)
  blocked = tmp_path / 'blocked'
  blocked.write_text('a file where the cache directory would be')
  with pytest.raises(CacheMismatchError,
                     match=f'^cannot use the cache directory {blocked}: it is a file, not a '
                           f'folder$'):
    make_cache(tmp_path, num_samples=12, disk_bytes=1 << 20, directory=str(blocked))
  lines = []
  cache = make_cache(tmp_path, num_samples=12, disk_bytes=1 << 20, identity='run-b',
                     on_mismatch='clear', log=lines.append, depth=3)
  assert 'clearing' in lines[0] and not cache.contains(ids).any()
  got = cache.fetch(ids, fake.compute_fn(ids, 3))
  assert len(np.concatenate(fake.computed)) == 12  # nothing of run-a was read
  np.testing.assert_array_equal(got, fake.direct(ids, 3))
  cache.close()


def test_a_directory_in_another_cache_format_is_named_as_such(tmp_path):
  """A manifest written by another version of the disk format: this run's
  own entries are cleared with a line that names the format (not a dtype or
  shape change, which the fields would not show), and another run's are
  refused naming it too."""
  fake = FakePrefix(12)
  cache, ids = _disk_cache(tmp_path, fake)
  cache.close()
  manifest = tmp_path / 'cache' / autocache_disk.MANIFEST
  older = dict(json.loads(manifest.read_text()), format='pipejax-autocache-0')
  manifest.write_text(json.dumps(older))
  with pytest.raises(CacheMismatchError,
                     match="cache format 'pipejax-autocache-0' \\(this version reads "
                           f"'{autocache_disk.FORMAT}'\\)"):
    make_cache(tmp_path, num_samples=12, disk_bytes=1 << 20, identity='run-b')
  lines = []
  again = make_cache(tmp_path, num_samples=12, disk_bytes=1 << 20, log=lines.append, depth=3)
  assert lines == [f"autocache: clearing {tmp_path / 'cache'}: its entries are this run's in "
                   f"cache format 'pipejax-autocache-0'; this version reads "
                   f"'{autocache_disk.FORMAT}'"]
  assert not again.contains(ids).any()  # nothing of the older format is served
  assert json.loads(manifest.read_text())['format'] == autocache_disk.FORMAT
  again.close()


def test_a_failed_first_manifest_write_leaves_no_entries_file(tmp_path, monkeypatch):
  """The first run on a directory that cannot take the manifest (disk full,
  say) is refused in one line and leaves nothing behind: an entries file
  without its manifest would make the next run refuse the directory as
  holding activations of unknown origin."""
  def full(path, write):
    raise OSError(errno.ENOSPC, 'No space left on device', path)

  monkeypatch.setattr(autocache_disk.diskcache, 'write_atomic', full)
  with pytest.raises(CacheMismatchError, match='cannot use the cache directory .*No space left'):
    make_cache(tmp_path, num_samples=12, disk_bytes=1 << 20)
  assert sorted(os.listdir(tmp_path / 'cache')) in ([], [autocache_disk.LOCK])
  monkeypatch.undo()
  fake = FakePrefix(12)
  cache, ids = _disk_cache(tmp_path, fake)  # the next run takes the directory as new
  cache.close()
  again = make_cache(tmp_path, num_samples=12, memory_bytes=0, disk_bytes=1 << 20, depth=3)
  np.testing.assert_array_equal(again.fetch(ids, fake.compute_fn(ids, 3)), fake.direct(ids, 3))
  assert fake.computed == []  # and its entries are served back to the run after it
  again.close()


def test_a_closed_cache_opens_again_with_its_entries(tmp_path):
  """A trainer's second run() reopens the disk file its first run closed."""
  fake = FakePrefix(12)
  cache, ids = _disk_cache(tmp_path, fake)
  cache.close()
  with pytest.raises(OSError):
    cache.fetch(ids, fake.compute_fn(ids, 3))
  cache.open()
  cache.open()  # idempotent
  got = cache.fetch(ids, fake.compute_fn(ids, 3))
  assert fake.computed == []  # every entry read back from the disk file
  np.testing.assert_array_equal(got, fake.direct(ids, 3))
  cache.close()


def test_counters_stay_readable_after_close(tmp_path):
  # A run's summary reads them after the trainer closed the cache.
  fake = FakePrefix(12)
  cache, _ = _disk_cache(tmp_path, fake)
  before = cache.stats()
  cache.close()
  assert cache.stats() == before and before['disk_file_bytes'] > 0


def test_same_run_reopens_its_entries_and_drops_deeper_ones(tmp_path):
  fake = FakePrefix(12)
  cache, ids = _disk_cache(tmp_path, fake)
  cache.close()
  again = make_cache(tmp_path, num_samples=12, memory_bytes=0, disk_bytes=1 << 20, depth=3)
  got = again.fetch(ids, fake.compute_fn(ids, 3))
  assert fake.computed == [] and again.stats()['hits'] == 12
  np.testing.assert_array_equal(got, fake.direct(ids, 3))
  again.close()
  # Resumed from an earlier checkpoint (depth 2): depth-3 entries are not usable.
  earlier = make_cache(tmp_path, num_samples=12, memory_bytes=0, disk_bytes=1 << 20, depth=2)
  assert not earlier.contains(ids).any() and earlier.stats()['disk_entries'] == 0
  earlier.close()
  # ... and they stay dropped: the resumed run may freeze different values.
  later = make_cache(tmp_path, num_samples=12, memory_bytes=0, disk_bytes=1 << 20, depth=3)
  assert not later.contains(ids).any()
  later.close()


# -- prefetch -------------------------------------------------------------------------
def _filled(tmp_path, fake, n, **kw):
  cache = make_cache(tmp_path, num_samples=n, **kw)
  cache.advance(4, fake.advance_fn)
  run_epoch(cache, fake, epoch_batches(n, 8, 0))
  fake.computed.clear()
  return cache


def wait_staged(cache, ids, seconds=60.0):
  """Waits until the prefetcher staged every disk entry of ``ids`` (or gives
  up: a guard against a hang, not a time limit)."""
  want = set(ids[cache._tier[ids] == 2].tolist())  # noqa: SLF001
  deadline = time.monotonic() + seconds
  while not want <= set(cache._staged) and time.monotonic() < deadline:  # noqa: SLF001
    time.sleep(0.005)
  assert want <= set(cache._staged), f'not staged within {seconds}s'  # noqa: SLF001


def wait_full(cache, seconds=60.0):
  """Waits until the prefetcher filled its budget (or gives up: a guard
  against a hang, not a time limit)."""
  deadline = time.monotonic() + seconds
  while cache._staged_bytes < cache.prefetch_bytes and time.monotonic() < deadline:  # noqa: SLF001
    time.sleep(0.005)
  assert cache._staged_bytes == cache.prefetch_bytes, f'not full within {seconds}s'  # noqa: SLF001


def test_prefetch_serves_the_same_values_within_the_memory_budget(tmp_path):
  n = 64
  fake = FakePrefix(n)
  budget = 20 * ENTRY
  cache = _filled(tmp_path / 'a', fake, n, memory_bytes=budget, disk_bytes=1 << 20,
                  prefetch_bytes=12 * ENTRY)
  plain = _filled(tmp_path / 'b', fake, n, memory_bytes=budget, disk_bytes=1 << 20,
                  prefetch_bytes=0)
  batches = epoch_batches(n, 8, 1)
  cache.prefetch(batches)
  peaks = []
  for ids in batches:
    wait_staged(cache, ids)  # a slow step: the prefetcher fills its budget meanwhile
    time.sleep(0.01)
    peaks.append(cache.stats()['bytes_in_memory'])
    got = cache.fetch(ids, fake.compute_fn(ids, 4), fake.advance_fn)
    np.testing.assert_array_equal(got, plain.fetch(ids, fake.compute_fn(ids, 4)))
  stats = cache.stats()
  assert fake.computed == []
  assert stats['prefetched'] > 0.5 * stats['disk_entries']
  assert max(peaks) <= budget and stats['peak_bytes_in_memory'] <= budget
  assert max(peaks) > stats['memory_entries'] * ENTRY  # it did stage something
  cache.close()
  plain.close()


def test_prefetch_finds_corruption_and_skips_unplanned_batches(tmp_path):
  n = 32
  fake = FakePrefix(n)
  cache = _filled(tmp_path, fake, n, memory_bytes=8 * ENTRY, disk_bytes=1 << 20,
                  prefetch_bytes=8 * ENTRY)
  victim = int(np.nonzero(cache._tier == 2)[0][3])  # noqa: SLF001
  path = tmp_path / 'cache' / 'entries.bin'
  with open(path, 'r+b') as f:
    f.seek(int(cache._slot[victim]) * cache._disk.record_bytes + 40)  # noqa: SLF001
    f.write(b'\xff\xff')
  batches = epoch_batches(n, 8, 1)
  cache.prefetch(batches)
  prefetcher = cache._thread  # noqa: SLF001
  wait_full(cache)  # batch 0 (and 1) staged
  cache.fetch(batches[2], fake.compute_fn(batches[2], 4))  # jumps ahead: 0 and 1 released
  ahead = np.concatenate(batches[3:])
  on_disk = int(np.sum((cache._tier[ahead] == 2) & (ahead != victim)))  # noqa: SLF001
  before = cache.stats()['prefetched']
  for ids in batches[3:]:
    wait_staged(cache, ids[ids != victim])
    got = cache.fetch(ids, fake.compute_fn(ids, 4))
    np.testing.assert_array_equal(got, fake.direct(ids, 4))
  assert cache.stats()['prefetched'] - before == on_disk  # read ahead, not stuck behind 0 and 1
  for ids in batches[:2]:  # not in the plan any more: read directly
    np.testing.assert_array_equal(cache.fetch(ids, fake.compute_fn(ids, 4)), fake.direct(ids, 4))
  assert np.concatenate(fake.computed).tolist() == [victim]
  assert cache.stats()['corrupt'] == 1
  assert cache.stats()['peak_bytes_in_memory'] <= 8 * ENTRY
  cache.close()
  assert not prefetcher.is_alive()  # the prefetcher's thread ended with close()


def test_close_ends_a_prefetcher_that_waits_for_room(tmp_path):
  n = 32
  fake = FakePrefix(n)
  cache = _filled(tmp_path, fake, n, memory_bytes=8 * ENTRY, disk_bytes=1 << 20,
                  prefetch_bytes=8 * ENTRY)
  batches = epoch_batches(n, 8, 1)
  cache.prefetch(batches)
  prefetcher = cache._thread  # noqa: SLF001
  wait_staged(cache, batches[0])
  wait_full(cache)  # it waits for room now
  assert prefetcher.is_alive()
  cache.close()
  assert not prefetcher.is_alive() and cache._staged_bytes == 0  # noqa: SLF001


# -- errors ---------------------------------------------------------------------------
def test_bad_input_is_one_line_errors(tmp_path):
  fake = FakePrefix(4)
  cache = make_cache(num_samples=4)
  cache.advance(2)
  for call, match in [
      (lambda: cache.fetch(np.array([4]), fake.compute_fn(np.array([4]), 2)), r'in \[0, 4\)'),
      (lambda: cache.advance(1), 'cannot go back'),
      (lambda: cache.fetch(np.array([1]), lambda rows: np.zeros((1, SEQ))), 'expected'),
      (lambda: make_cache(dtype='int8'), 'not one of'),
      (lambda: make_cache(disk_bytes=10), 'needs a cache directory'),
      (lambda: make_cache(tmp_path, disk_bytes=10, on_mismatch='keep'), 'refuse'),
      (lambda: make_cache(memory_bytes=10, prefetch_bytes=11), 'prefetch_bytes')]:
    with pytest.raises(ValueError, match=match) as err:
      call()
    assert '\n' not in str(err.value)


# -- the caching decision ----------------------------------------------------------------
def test_decide_caching():
  # Reading beats the forward: caching pays from the second epoch on.
  assert decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=2).use_cache
  assert not decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=1).use_cache  # never reused
  assert decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=1, filled=True).use_cache
  assert not decide_caching(1, 0.02, 0.03, 0.01, epochs_ahead=10).use_cache  # read is slower
  assert not decide_caching(0, 1.0, 0.0, 0.0, epochs_ahead=10).use_cache  # nothing frozen
  d = decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=3)
  assert d.seconds_without == pytest.approx(0.30) and d.seconds_with == pytest.approx(0.19)


def test_processes_agree_on_the_slowest_timings_and_the_least_cached():
  """With several processes the decision's inputs are combined so that
  caching must pay on every process: each timing is the slowest process's,
  the cache is filled only if every process's is, and the fraction that fits
  is the smallest. Each column's extreme sits on a different process."""
  everyone = np.array([[0.10, 0.02, 0.07, 1.0, 0.50],
                       [0.30, 0.01, 0.05, 0.0, 1.00],
                       [0.20, 0.04, 0.06, 1.0, 0.75]])
  assert combine_decision_inputs(everyone) == (0.30, 0.04, 0.07, False, 0.50)
  assert combine_decision_inputs(everyone[[0, 2]]) == (0.20, 0.04, 0.07, True, 0.50)


def test_a_cache_that_holds_part_of_the_samples_pays_a_forward_for_every_batch_with_a_miss():
  """A batch is served from the cache only when all its samples hit; the
  others compute their missing rows as a whole batch. With budgets for
  a fraction f of the samples, batches of b: f ** b are all hits."""
  fits_all = decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=3)
  same = decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=3, fits=1.0, batch_size=32)
  assert (same.use_cache, same.seconds_with) == (fits_all.use_cache, fits_all.seconds_with)
  # ImageNet's default budget: 0.3 % of the samples, batches of 32: never worth it.
  tiny = decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=3, fits=0.003, batch_size=32)
  assert not tiny.use_cache
  assert tiny.seconds_with == pytest.approx(0.10 + 0.05 + 2 * (0.02 + 0.10))
  assert 'the budgets hold 0.3% of the samples, so 100.0% of the batches' in tiny.describe()
  # Nearly everything fits, small batches: 0.99 ** 4 = 0.96 all hits; still pays.
  most = decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=3, fits=0.99, batch_size=4)
  assert most.all_hit_batches == pytest.approx(0.99 ** 4)
  assert most.use_cache and most.seconds_with == pytest.approx(
      0.15 + 2 * (0.02 + (1 - 0.99 ** 4) * 0.10))
  kept = keep_caching(decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=3, filled=True,
                                     fits=0.99, batch_size=4), 5, epochs_ahead=2)
  assert (kept.fits, kept.batch_size, kept.all_hit_batches) == (0.99, 4, most.all_hit_batches)
  # A filled cache too pays the forward of every batch with a miss: half fits,
  # batches of 4 → 1/16 all hits; 3 × (0.02 + 15/16 · 0.10) > 3 × 0.10.
  half = decide_caching(3, 0.10, 0.02, 0.05, epochs_ahead=3, filled=True, fits=0.5,
                        batch_size=4)
  assert not half.use_cache and half.seconds_with == pytest.approx(3 * (0.02 + 15 / 16 * 0.10))
  kept = keep_caching(decide_caching(3, 0.10, 0.002, 0.05, epochs_ahead=3, filled=True,
                                     fits=0.9, batch_size=8), 5, epochs_ahead=2)
  assert kept.seconds_with == pytest.approx(2 * (0.002 + (1 - 0.9 ** 8) * 0.10))


def test_a_decision_s_line_names_its_inputs_and_verdict():
  shallow = decide_caching(1, 0.011, 0.02, 0.02, epochs_ahead=3)  # 0.033 s against 0.071 s
  assert not shallow.use_cache
  assert 'F=1: run the prefix' in shallow.describe() and 'read 0.0200s' in shallow.describe()
  deep = decide_caching(4, 0.04, 0.02, 0.02, epochs_ahead=3)  # 0.12 s against 0.10 s
  assert deep.use_cache and 'F=4: use the cache' in deep.describe()


def test_augmentation_guard():
  lines = []
  assert caching_allowed(False, False, lines.append) and lines == []
  assert not caching_allowed(True, False, lines.append)
  assert 'disabled' in lines[-1] and '\n' not in lines[-1]
  assert caching_allowed(True, True, lines.append) and 'accepts' in lines[-1]


def test_measure_io_reports_both_tiers(tmp_path):
  hidden = np.random.default_rng(0).normal(size=(8, SEQ, HIDDEN))
  memory = make_cache(memory_bytes=1 << 20)
  disk = make_cache(tmp_path, memory_bytes=0, disk_bytes=1 << 20)
  mine = tmp_path / 'cache' / 'probe.bin'  # a file of the user's: never touched
  mine.write_text('mine')
  both = make_cache(tmp_path / 'both', memory_bytes=1 << 20, disk_bytes=1 << 20)
  before = sorted(os.listdir(tmp_path / 'cache'))
  timed = []  # (cache, payload) of each disk round trip

  def spy(cache):
    real = cache._disk.measure
    def measure(payload):
      timed.append((cache, payload.copy()))
      return real(payload)
    cache._disk.measure = measure
  spy(disk), spy(both)
  for cache in (memory, both, disk):
    write, read = cache.measure_io(hidden)
    assert write > 0 and read > 0
  # Only the cache whose new entries go to disk times the disk, with this batch.
  assert [c for c, _ in timed] == [disk]
  np.testing.assert_array_equal(timed[0][1], hidden.astype(disk.dtype))
  assert sorted(os.listdir(tmp_path / 'cache')) == before  # its scratch file removed
  assert mine.read_text() == 'mine'
  assert disk.stats()['disk_entries'] == 0


# -- the multi-host sampler ------------------------------------------------------------------
def test_host_subsets_are_fixed_disjoint_and_shuffled_within():
  parts = [host_subset(103, i, 4, seed=1) for i in range(4)]
  assert all(len(p) == 25 for p in parts)
  joined = np.concatenate(parts)
  assert len(np.unique(joined)) == 100 and joined.max() < 103
  np.testing.assert_array_equal(parts[2], host_subset(103, 2, 4, seed=1))  # fixed
  source = ArraySource({'x': np.arange(103)})
  loader = Loader(source, 5, seed=3, ids=parts[1])
  orders = [np.concatenate(loader.batch_ids(e)) for e in range(3)]
  for order in orders:
    assert set(order.tolist()) == set(parts[1].tolist())  # never leaves the host
  assert not np.array_equal(orders[0], orders[1])  # reshuffled every epoch
  for bad in [(10, 4, 4), (10, -1, 2), (3, 0, 4)]:
    with pytest.raises(ValueError):
      host_subset(*bad)


def test_a_host_caches_only_its_own_samples(tmp_path):
  n = 40
  mine, theirs = host_subset(n, 0, 2, seed=5), host_subset(n, 1, 2, seed=5)
  fake = FakePrefix(n)
  # Another run's process left entries for every ID in the directory it now gets.
  everyone = make_cache(tmp_path, num_samples=n, memory_bytes=0, disk_bytes=1 << 20, depth=3)
  everyone.fetch(np.arange(n), fake.compute_fn(np.arange(n), 3))
  everyone.close()
  fake.computed.clear()
  cache = make_cache(tmp_path, num_samples=n, memory_bytes=0, disk_bytes=1 << 20, depth=3,
                     own_ids=mine)
  np.testing.assert_array_equal(cache.cached_ids(), mine)  # the other host's records dropped
  # What fits is counted over the host's own samples: a budget of exactly
  # len(mine) entries holds them all (over all n it would be half).
  exact = make_cache(tmp_path / 'exact', num_samples=n, memory_bytes=len(mine) * ENTRY,
                     own_ids=mine)
  assert exact.fits() == 1.0 and exact.room() == len(mine)
  half = make_cache(tmp_path / 'half', num_samples=n, memory_bytes=len(mine) // 2 * ENTRY,
                    own_ids=mine)
  assert half.fits() == pytest.approx((len(mine) // 2) / len(mine))
  exact.close()
  half.close()
  loader = Loader(ArraySource({'x': np.arange(n)}), 5, seed=1, ids=mine)
  for epoch in range(2):
    cache.prefetch(loader.batch_ids(epoch))
    run_epoch(cache, fake, loader.batch_ids(epoch))
  assert cache.stats()['hits'] == 2 * len(mine) and fake.computed == []
  poisoned = np.concatenate([mine[:4], theirs[:1]])
  with pytest.raises(ValueError, match=rf'sample IDs \[{theirs[0]}\] are not among the IDs '
                                       r"this cache may hold \(another host's samples\)"):
    cache.fetch(poisoned, fake.compute_fn(poisoned, 3))
  with pytest.raises(ValueError, match='another host'):
    cache.prefetch([poisoned])
  assert fake.computed == [] and not cache.contains(theirs).any()
  np.testing.assert_array_equal(cache.cached_ids(), mine)
  cache.close()


def test_sharded_batch_ids_match_its_epochs():
  """What a ShardedLoader plans (the cache's prefetch reads those IDs ahead)
  is what its epochs serve: from a mid-epoch start, shards joined in order."""
  source = ArraySource({'x': np.arange(45) * 10})
  for local in ((0,), (1,), (0, 1)):
    for shuffle in (True, False):
      for drop in (True, False):
        loader = ShardedLoader(source, 8, shards=2, local_shards=local, seed=3,
                               shuffle=shuffle, drop_remainder=drop)
        for start in (0, 2):
          served = list(loader.epoch(1, start))
          planned = loader.batch_ids(1, start)
          assert len(served) == len(planned) == loader.steps_per_epoch() - start
          for (ids, batch), want in zip(served, planned, strict=True):
            np.testing.assert_array_equal(ids, want)
            np.testing.assert_array_equal(batch['x'], want * 10)
  both = ShardedLoader(source, 8, shards=2, local_shards=(0, 1), seed=3)
  alone = [ShardedLoader(source, 8, shards=2, local_shards=(s,), seed=3) for s in (0, 1)]
  for ids, a, b in zip(both.batch_ids(0), alone[0].batch_ids(0), alone[1].batch_ids(0),
                       strict=True):
    np.testing.assert_array_equal(ids, np.concatenate([a, b]))  # shard 0's part first


def test_local_shards_out_of_range_are_refused():
  source = ArraySource({'x': np.arange(20)})
  for local in ((2,), (-1,), ()):
    with pytest.raises(ValueError, match=r'local shards .* are not in \[0, 2\)'):
      ShardedLoader(source, 8, shards=2, local_shards=local, drop_remainder=False)


def test_every_seed_and_epoch_draws_its_own_order():
  """Seeds are independent: seed s at epoch e + 1 is not seed s + 1 at epoch
  e (a seed + epoch stream would make them shifted copies), and host subsets
  follow the seed."""
  source = ArraySource({'x': np.arange(50)})
  orders = {tuple(Loader(source, 5, seed=seed).order(epoch)) for seed in range(4)
            for epoch in range(4)}
  assert len(orders) == 16
  assert sorted(orders.pop()) == list(range(50))
  subsets = [tuple(host_subset(50, 0, 2, seed)) for seed in range(4)]
  assert len(set(subsets)) == 4


def test_loader_batch_ids_match_its_epochs():
  source = ArraySource({'x': np.arange(23) * 10})
  for loader in (Loader(source, 5, seed=2), Loader(source, 5, shuffle=False,
                                                   drop_remainder=False)):
    for start in (0, 2):
      served = list(loader.epoch(1, start))
      planned = loader.batch_ids(1, start)
      assert len(served) == len(planned)
      for (ids, batch), want in zip(served, planned, strict=True):
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(batch['x'], want * 10)
  last_ids, last = list(Loader(source, 5, shuffle=False, drop_remainder=False).epoch(0))[-1]
  np.testing.assert_array_equal(last_ids, [20, 21, 22, 20, 21])
  np.testing.assert_array_equal(last['example_mask'], [1, 1, 1, 0, 0])
  # The same padding when the epoch resumes mid-way (the mask counts from the start).
  resumed = list(Loader(source, 5, shuffle=False, drop_remainder=False).epoch(0, 2))
  assert len(resumed) == 3
  np.testing.assert_array_equal(resumed[-1][1]['example_mask'], [1, 1, 1, 0, 0])
  assert all(b['example_mask'].all() for _, b in resumed[:-1])
  # max_steps caps an epoch, never lengthens it.
  assert Loader(source, 5, max_steps=10).steps_per_epoch() == 4
  assert Loader(source, 5, max_steps=10, drop_remainder=False).steps_per_epoch() == 5
  assert Loader(source, 5, max_steps=2).steps_per_epoch() == 2
  assert len(list(Loader(source, 5, max_steps=10).epoch(0))) == 4
  sharded = ShardedLoader(source, 10, shards=2, local_shards=(0, 1), max_steps=10)
  assert sharded.steps_per_epoch() == 2 and len(list(sharded.epoch(0))) == 2  # 11 per shard
  assert ShardedLoader(source, 10, shards=2, local_shards=(0,), max_steps=1).steps_per_epoch() == 1
  # A training batch larger than the data is refused, not an empty epoch.
  with pytest.raises(ValueError, match='batch size 5 exceeds the 3 samples'):
    Loader(ArraySource({'x': np.arange(3)}), 5)


def test_keep_caching_only_after_a_filled_cache_won():
  filled = decide_caching(4, 0.10, 0.002, 0.003, epochs_ahead=3, filled=True)
  empty = decide_caching(4, 0.10, 0.002, 0.003, epochs_ahead=3)
  lost = decide_caching(4, 0.001, 0.002, 0.003, epochs_ahead=3, filled=True)
  assert filled.use_cache and empty.use_cache and not lost.use_cache
  # Not settled: nothing before, an empty cache, a lost comparison, not deeper.
  for previous, depth in ((None, 6), (empty, 6), (lost, 6), (filled, 4), (filled, 3)):
    assert keep_caching(previous, depth, epochs_ahead=2) is None
  kept = keep_caching(filled, 6, epochs_ahead=2)
  assert (kept.num_frozen_layers, kept.use_cache, kept.filled, kept.measured_at) == (
      6, True, True, 4)
  assert kept.seconds_with == pytest.approx(0.004) and kept.seconds_without == pytest.approx(0.2)
  assert 'F=6: use the cache (not re-measured: at F=4' in kept.describe()
  # A chain keeps the depth that was measured.
  assert keep_caching(kept, 7, epochs_ahead=1).measured_at == 4
  with pytest.raises(ValueError, match='epochs_ahead'):
    keep_caching(filled, 6, epochs_ahead=0)
  # Decisions saved before measured_at existed restore (checkpoint meta).
  old = {k: v for k, v in dataclasses.asdict(filled).items() if k != 'measured_at'}
  restored = CachingDecision(**old)
  assert restored.measured_at is None and keep_caching(restored, 6, 1).measured_at == 4
  assert 'F=4: use the cache (per batch' in restored.describe()


def test_data_and_decision_edges():
  """Edges found by mutating the code: a host's share when there are as many
  samples as hosts, a batch the shards cannot split, padding never counted as served,
  and a tie between caching and recomputing (recompute: caching must win)."""
  assert [len(host_subset(4, i, 4)) for i in range(4)] == [1, 1, 1, 1]
  source = ArraySource({'x': np.arange(1)})
  with pytest.raises(ValueError, match='batch size 9 is not divisible by the 2 data shards'):
    ShardedLoader(source, 9, shards=2, local_shards=(0,))
  # One sample over 4 shards: shard 0 holds it, the others only padding.
  served = []
  for local in ((0, 1), (2, 3)):
    loader = ShardedLoader(source, 4, shards=4, local_shards=local, drop_remainder=False)
    for _ in loader.epoch(0):
      pass
    served.append(loader.served)
  assert served == [{0}, set()]
  tie = decide_caching(3, 0.1, 0.1, 0.0, epochs_ahead=2)  # 0.2 s either way
  assert tie.seconds_without == tie.seconds_with and not tie.use_cache
