"""AutoPipe (paper §3.2, Algorithm 1): balanced partitions of the active
layers, pipeline compression K → K/2 (Eq. 2), and micro-batch choice.

Costs are per unit (embed, each attention / MLP sub-layer, head), by default
the parameter count as in the paper. Frozen layers are costed
as in Algorithm 1: ``λ_frozen · S_frozen`` (λ_frozen = 1/6 by default: no
gradients, optimizer state or stashed activations, paper §3.2.1) is charged to
the first stage, and the partition balances around it. The memory proxy is::

  M_GPU = max_k S_k        with S_0 including λ_frozen · S_frozen        (Eq. 2)

and the pipeline is halved while ``M_GPU(T) ≤ M_GPU(0)``, each candidate
balanced around that charge. The partition a run then trains with at the
chosen K balances the active units alone: pipejax runs the frozen prefix
outside the pipeline, so its first stage does none of the frozen layers'
work, and a partition balanced around their charge would leave that stage
light and load the others (the embedded default at F = 4 on 8 stages: 41.9k
parameters on its largest stage, and one MLP split, against 34.2k). Two readings of a
paper that is not consistent with itself: a tie halves, as Eq. 2's ≤ says
(Algorithm 1's line 30 compares with <; ViT-B/16 with its 1000-class head on 8
devices ties at F = 7, 12.58M parameters on whole sub-layers either way, and
halves there rather than at F = 8); and the frozen
layers add ``λ_frozen · S_frozen`` to the first stage, as §3.2.1's prose
says, where Algorithm 1's lines 19 and 28 subtract ``(1 − λ_frozen) ·
S_frozen`` from a first stage that never held ``S_frozen``.

(pipejax runs the frozen prefix outside the pipeline, forward-only and
data-parallel over all devices, with its parameters replicated; the plan's
memory estimate in :mod:`pipejax.plan` reports that actual per-device cost
beside the paper's proxy.)

Partitioning is exact, not greedy: the contiguous partition minimising the
largest stage cost (dynamic programming over the ≤ 2L+2 units). Many
partitions often reach that optimum (in Algorithm 1's, the first stage's
frozen charge leaves the others slack); among them the one whose stages touch the fewest blocks
is taken, since every stage runs as many block slots as the widest one
(:mod:`pipejax.partition`) and each slot costs a branch at every pipeline
tick. The balance, Eq. 2's proxy and so compression are unchanged by that
choice.

A stage boundary may also fall inside an MLP sub-layer, between its two dense
layers (``split_mlp_min_gain``, default :data:`SPLIT_MLP_MIN_GAIN`; the models
of :mod:`models` say which MLP parameters each half holds). The partition is then balanced over the finer
pieces; it is taken when it lowers the largest stage's cost by at least that
fraction of the whole-sub-layer optimum, since every pipeline tick then
carries the MLP's inner activation (``intermediate / hidden`` times the
residual stream's bytes) besides the residual stream. Of the split partitions
that reach the optimum, the one with the fewest splits, then the narrowest, is
taken. ViT-B/16 on 8 stages: 12.58M parameters on the largest stage with
whole sub-layers, 11.82M with split MLPs. A split changes what a stage owns
and runs, not what its device stores (the stage layout is dense); Eq. 2's
halving is therefore decided on whole sub-layers (the T = 0 reference and the
candidates), and only the chosen K's partition may split.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import re
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from pipejax import diskcache
from pipejax.partition import Partition, PartitionError, unit_block


#: Split an MLP between stages when that lowers the largest stage's cost by at
#: least this fraction (training's ``pipeline.split_mlp_min_gain``, and
#: ``python -m pipejax.plan``'s ``--split-mlp-min-gain``).
SPLIT_MLP_MIN_GAIN = 0.05


@dataclasses.dataclass(frozen=True)
class UnitCosts:
  """Cost of every unit of a model (index = global unit id, 2L+2 entries).

  Attributes:
    num_layers: L.
    costs: per unit.
    mlp_in_costs: per block, the cost of its MLP's first half (the
      parameters under ``mlp_in_keys``); empty where MLPs cannot be split.
    mlp_in_keys: the MLP parameter keys of the first half
      (:attr:`models.LayeredModel.mlp_in_keys`).
    split_mlp_min_gain: split MLP sub-layers between stages when that lowers
      the largest stage's cost by at least this fraction (1: never).
  """
  num_layers: int
  costs: tuple[float, ...]
  mlp_in_costs: tuple[float, ...] = ()
  mlp_in_keys: tuple[str, ...] = ()
  split_mlp_min_gain: float = 1.0

  @property
  def can_split(self) -> bool:
    return bool(self.mlp_in_costs) and self.split_mlp_min_gain < 1.0

  def active(self, num_frozen_layers: int) -> list[float]:
    return [self.costs[u] for u in self._active_units(num_frozen_layers)]

  def active_blocks(self, num_frozen_layers: int) -> list[int | None]:
    """The block of each active unit (None: the embedding and the head)."""
    return [unit_block(u, self.num_layers) for u in self._active_units(num_frozen_layers)]

  def _active_units(self, num_frozen_layers: int) -> tuple[int, ...]:
    return Partition(self.num_layers, num_frozen_layers,
                     (2 * (self.num_layers - num_frozen_layers) + 1
                      + int(num_frozen_layers == 0),)).active_units

  def frozen(self, num_frozen_layers: int) -> float:
    """S_frozen: the embedding and the frozen blocks (0 when nothing is frozen)."""
    if num_frozen_layers == 0:
      return 0.0
    return float(sum(self.costs[:2 * num_frozen_layers + 1]))


def parameter_costs(params: Any, mlp_in_keys: Sequence[str] = (),
                    split_mlp_min_gain: float = 1.0) -> UnitCosts:
  """Parameter counts per unit from canonical ``params`` (arrays or shapes);
  with ``mlp_in_keys`` (a model's :attr:`models.LayeredModel.mlp_in_keys`)
  also of each MLP's first half, for partitions that split MLPs when that
  lowers the largest stage by ``split_mlp_min_gain`` (see the module doc)."""
  def size(tree):
    return float(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))
  num_layers = int(jax.tree.leaves(params['attention'])[0].shape[0])
  attn = size(params['attention']) / num_layers
  mlp = size(params['mlp']) / num_layers
  mlp_in = size({k: params['mlp'][k] for k in mlp_in_keys}) / num_layers
  return UnitCosts(num_layers, (size(params['embed']),) + (attn, mlp) * num_layers
                   + (size(params['head']),),
                   (mlp_in,) * num_layers if mlp_in_keys else (), tuple(mlp_in_keys),
                   float(split_mlp_min_gain))


def balance(costs: Sequence[float], num_stages: int, first_stage_offset: float = 0.0,
            blocks: Sequence[int | None] | None = None) -> tuple[int, ...]:
  """Contiguous split of ``costs`` into ``num_stages`` non-empty stages that
  minimises the largest stage sum, the first stage charged
  ``first_stage_offset`` on top (the λ-costed frozen layers).

  With ``blocks`` (the block of each unit, None for one in no block), of the
  splits that reach that minimum the one whose widest stage touches the
  fewest blocks (the one found first when it is no narrower).

  Returns the stage sizes (units per stage).
  """
  n = len(costs)
  if not 1 <= num_stages <= n:
    raise PartitionError(f'cannot split {n} units into {num_stages} non-empty stages')
  prefix = np.concatenate([[0.0], np.cumsum(costs)])

  @functools.lru_cache(maxsize=None)
  def best(start: int, stages: int) -> tuple[float, tuple[int, ...]]:
    if stages == 1:
      return (prefix[n] - prefix[start] + (first_stage_offset if start == 0 else 0.0),
              (n - start,))
    choice = None
    for end in range(start + 1, n - stages + 2):
      head = prefix[end] - prefix[start] + (first_stage_offset if start == 0 else 0.0)
      rest, sizes = best(end, stages - 1)
      cand = (max(head, rest), (end - start,) + sizes)
      if choice is None or cand[0] < choice[0] - 1e-9:
        choice = cand
    return choice

  largest, sizes = best(0, num_stages)
  if blocks is None:
    return sizes
  return _narrowest(prefix, num_stages, first_stage_offset, blocks, largest, sizes)


def _narrowest(prefix: np.ndarray, num_stages: int, first_stage_offset: float,
               blocks: Sequence[int | None], largest: float,
               sizes: tuple[int, ...]) -> tuple[int, ...]:
  """Of the splits whose every stage costs at most ``largest`` (the optimum
  :func:`balance` found as ``sizes``; ``prefix``: the units' cost prefix
  sums), the one with the fewest blocks in its widest stage; ``sizes``
  unless another is strictly narrower."""
  n = len(prefix) - 1
  if len(blocks) != n:
    raise ValueError(f'{len(blocks)} block indices for {n} units')
  limit = largest + 1e-9 * max(1.0, abs(largest))

  def touched(start: int, end: int) -> int:
    return len({b for b in blocks[start:end] if b is not None})

  def width(split: tuple[int, ...]) -> int:
    bounds = np.cumsum((0,) + split)
    return max(touched(a, b) for a, b in zip(bounds, bounds[1:]))

  @functools.lru_cache(maxsize=None)
  def narrow(start: int, stages: int) -> tuple[int, tuple[int, ...]] | None:
    offset = first_stage_offset if start == 0 else 0.0
    if stages == 1:
      if prefix[n] - prefix[start] + offset > limit:
        return None
      return touched(start, n), (n - start,)
    choice = None
    for end in range(start + 1, n - stages + 2):
      if prefix[end] - prefix[start] + offset > limit:
        break  # costs are non-negative: a longer stage costs more
      rest = narrow(end, stages - 1)
      if rest is None:
        continue
      cand = (max(touched(start, end), rest[0]), (end - start,) + rest[1])
      if choice is None or cand[0] < choice[0]:
        choice = cand
    return choice

  found = narrow(0, num_stages)
  return found[1] if found is not None and found[0] < width(sizes) else sizes


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """A partition with its per-stage costs (active units only), the frozen
  prefix's cost S_frozen and the memory proxy of Eq. 2."""
  partition: Partition
  stage_costs: tuple[float, ...]
  frozen_cost: float
  memory_proxy: float


def partition_for(costs: UnitCosts, num_frozen_layers: int, pipeline_length: int,
                  lambda_frozen: float, *, charge_first_stage: bool = False) -> StagePlan:
  """The balanced partition of the active units into ``pipeline_length``
  stages (splitting MLP sub-layers where ``costs`` allow it and it pays: see
  the module doc).

  By default the stages balance the active units alone: the partition a run
  trains with, since pipejax runs the frozen prefix outside the pipeline, on
  every device, so that no stage carries it. With ``charge_first_stage`` they
  balance around ``λ_frozen · S_frozen`` charged to the first stage, as
  Algorithm 1 does: the partition whose proxy :func:`compress` compares. Either
  way ``memory_proxy`` is Eq. 2's for the partition returned."""
  active = costs.active(num_frozen_layers)
  frozen = costs.frozen(num_frozen_layers)
  offset = lambda_frozen * frozen
  charged = offset if charge_first_stage else 0.0  # what the balance sees on stage 0
  sizes = balance(active, pipeline_length, charged,
                  blocks=costs.active_blocks(num_frozen_layers))
  stage_costs, start = [], 0
  for size in sizes:
    stage_costs.append(float(sum(active[start:start + size])))
    start += size
  plan = _stage_plan(Partition(costs.num_layers, num_frozen_layers, sizes), stage_costs,
                     frozen, offset)
  if costs.can_split and pipeline_length > 1:
    split = _split_partition(costs, num_frozen_layers, pipeline_length, charged, offset)
    keep = 1.0 - costs.split_mlp_min_gain
    if split is not None and (_largest(split.stage_costs, charged)
                              <= keep * _largest(plan.stage_costs, charged)):
      return split
  return plan


def _largest(stage_costs, first_stage_charge: float) -> float:
  """The largest of ``stage_costs``, the first stage charged
  ``first_stage_charge``: what :func:`balance` minimises, and Eq. 2's proxy."""
  return max([stage_costs[0] + first_stage_charge, *stage_costs[1:]])


def _stage_plan(partition: Partition, stage_costs, frozen: float, offset: float) -> StagePlan:
  """A :class:`StagePlan`, its memory proxy (Eq. 2) charging ``offset``
  (λ_frozen · S_frozen) to the first stage."""
  stage_costs = tuple(float(c) for c in stage_costs)
  return StagePlan(partition, stage_costs, frozen, _largest(stage_costs, offset))


def _split_partition(costs: UnitCosts, num_frozen_layers: int, pipeline_length: int,
                     charged: float, offset: float) -> StagePlan | None:
  """The balanced partition over *pieces*: the active units with every MLP
  sub-layer in its two halves, a boundary between the halves splitting it;
  of the optimal ones the one with the fewest splits, then the narrowest. A
  stage holds at least one piece besides a received MLP half. None when no
  split lowers the largest stage. The balance charges ``charged`` to the
  first stage, the memory proxy ``offset`` (:func:`partition_for`)."""
  units = costs._active_units(num_frozen_layers)  # noqa: SLF001 - its own module
  pieces, owner, second = [], [], []  # cost, unit index, whether an MLP's second half
  for i, u in enumerate(units):
    block = unit_block(u, costs.num_layers)
    if block is not None and u % 2 == 0:
      first = costs.mlp_in_costs[block]
      pieces += [first, costs.costs[u] - first]
      owner += [i, i]
      second += [False, True]
    else:
      pieces.append(costs.costs[u])
      owner.append(i)
      second.append(False)
  n, k = len(pieces), pipeline_length
  prefix = np.concatenate([[0.0], np.cumsum(pieces)])
  blocks = [unit_block(units[o], costs.num_layers) for o in owner]

  def cost(a, b):
    return prefix[b] - prefix[a] + (charged if a == 0 else 0.0)

  def allowed(a, b):  # not only the second half of the previous stage's MLP
    return b - a > 1 or not second[a]

  @functools.lru_cache(maxsize=None)
  def best(a: int, stages: int) -> float:
    if stages == 1:
      return cost(a, n) if allowed(a, n) else math.inf
    return min((max(cost(a, b), best(b, stages - 1)) for b in range(a + 1, n - stages + 2)
                if allowed(a, b)), default=math.inf)

  largest = best(0, k)
  if not largest < math.inf:
    return None
  limit = largest + 1e-9 * max(1.0, abs(largest))

  @functools.lru_cache(maxsize=None)
  def fewest(a: int, stages: int):
    """(splits, widest stage's blocks, ends) of the best split of pieces a:."""
    if stages == 1:
      if not allowed(a, n) or cost(a, n) > limit:
        return None
      return 0, len({x for x in blocks[a:] if x is not None}), (n,)
    choice = None
    for b in range(a + 1, n - stages + 2):
      if cost(a, b) > limit:
        break
      rest = fewest(b, stages - 1) if allowed(a, b) else None
      if rest is None:
        continue
      cand = (rest[0] + int(second[b]), max(rest[1], len({x for x in blocks[a:b]
                                                            if x is not None})), (b,) + rest[2])
      if choice is None or cand[:2] < choice[:2]:
        choice = cand
    return choice

  found = fewest(0, k)
  if found is None or found[0] == 0:
    return None  # the optimum needs no split: the whole-unit partition has it
  ends = found[2]
  starts = (0,) + ends[:-1]
  sizes, split = [], []
  for s, (a, b) in enumerate(zip(starts, ends)):
    # A stage counts the units that start in it (a received second half does not).
    sizes.append(len({owner[j] for j in range(a, b) if not second[j]}))
    if b < n and second[b]:
      split.append(s)
  partition = Partition(costs.num_layers, num_frozen_layers, tuple(sizes),
                        split_mlp=tuple(split), mlp_in_keys=costs.mlp_in_keys)
  return _stage_plan(partition, (prefix[b] - prefix[a] for a, b in zip(starts, ends)),
                     costs.frozen(num_frozen_layers), offset)


def eq2_proxy(costs: UnitCosts, num_frozen_layers: int, pipeline_length: int,
              lambda_frozen: float) -> float:
  """Eq. 2's ``M_GPU`` at ``pipeline_length``: the largest stage of Algorithm
  1's partition, on whole sub-layers and balanced around ``λ_frozen ·
  S_frozen`` charged to the first stage; :func:`compress` compares it with
  its value at T = 0."""
  whole = dataclasses.replace(costs, split_mlp_min_gain=1.0)
  return partition_for(whole, num_frozen_layers, pipeline_length, lambda_frozen,
                       charge_first_stage=True).memory_proxy


def compress(costs: UnitCosts, num_frozen_layers: int, pipeline_length: int,
             initial_pipeline_length: int, lambda_frozen: float,
             num_devices: int | None = None) -> StagePlan:
  """Algorithm 1 lines 25-33: halve K while the memory proxy stays within the
  largest stage at T = 0 (Eq. 2). Starts from the current ``pipeline_length``
  and never grows it; a length above the number of active units is halved
  first, whatever the memory. With ``num_devices``, a length that does not
  divide them (an odd length halved because of too few units: 5 → 2 on 5
  devices) becomes the largest one below it that does, so that R = N / K
  replicas take every device.

  Returns the run's partition at that K (:func:`partition_for`'s default,
  balanced without the frozen charge); its ``memory_proxy`` is Eq. 2's for
  that partition, which may exceed the value compared (:func:`eq2_proxy`)."""
  # K is decided on whole sub-layers, the reference and the candidates alike:
  # a split MLP lowers the parameters a stage owns, not what its device
  # stores (the stage layout is dense; see pipejax.partition), so it must
  # neither make compression stricter nor let it go further. The partition
  # of the chosen K may then split.
  reference = eq2_proxy(costs, 0, initial_pipeline_length, lambda_frozen)
  k = pipeline_length
  # More stages than active units cannot run: halve regardless of memory.
  while k > len(costs.active(num_frozen_layers)):
    k //= 2
  while k >= 2 and k % 2 == 0:
    if eq2_proxy(costs, num_frozen_layers, k // 2, lambda_frozen) > reference + 1e-6:
      break
    k //= 2
  if num_devices is not None:
    k = largest_divisor(num_devices, k)
  return partition_for(costs, num_frozen_layers, k, lambda_frozen)


def reachable_lengths(initial_pipeline_length: int, num_devices: int) -> list[int]:
  """Every pipeline length :func:`compress` can reach from
  ``initial_pipeline_length`` on ``num_devices``, largest first: its halvings
  (one or more at a time), each rounded down to a divisor of the devices."""
  reached, todo = set(), [initial_pipeline_length]
  while todo:
    k = todo.pop()
    if k in reached:
      continue
    reached.add(k)
    while k >= 2:
      k //= 2
      todo.append(largest_divisor(num_devices, k))
  return sorted(reached, reverse=True)


def micro_batch_candidates(pipeline_length: int, batch_per_replica: int,
                           max_factor: int = 6) -> list[int]:
  """M ∈ {K, 2K, …, 6K} that divide the per-replica batch. The paper
  (§3.2.3) enumerates M "ranging from K to 6K"; pipejax profiles the
  multiples of K in that range only (each candidate is a compiled step and
  live profiling steps of the run). When none divides: the divisors of the batch between K and 6K, else the
  largest one below K (a batch smaller than K: one sample a micro-batch),
  never a needlessly serial pipeline.

  Raises:
    ValueError: K or the batch below 1.
  """
  k, batch = pipeline_length, batch_per_replica
  if k < 1 or batch < 1:
    raise ValueError(f'a pipeline of length {k} cannot split a per-replica batch of {batch}: '
                     'both must be >= 1')
  out = [f * k for f in range(1, max_factor + 1) if batch % (f * k) == 0]
  if not out:
    out = [m for m in range(k, max_factor * k + 1) if batch % m == 0]
  return out or [largest_divisor(batch, k)]


def largest_divisor(number: int, limit: int) -> int:
  """The largest divisor of ``number`` (≥ 1) not above ``limit`` (≥ 1)."""
  return max(d for d in range(1, min(limit, number) + 1) if number % d == 0)


class MicroBatchProfile:
  """Chosen micro-batch counts per pipeline length, remembered for the run and
  in a JSON file shared by runs of the same configuration.

  The file maps a hash of ``key`` to ``{K: {"micro_batches": M, ...}}``, and
  under ``"about"`` each hash to a description of its run, so that the file
  can be read without the run's key (``python -m pipejax.plan --profile``
  reads it with :func:`described_runs` and :func:`profile_differences`;
  :func:`profiled_choices` gives the runs that match) and older pipejax
  versions still read it.

  Args:
    path: the JSON file (None keeps it in memory only); ``~`` is the user's
      home, as in the default ``pipeline.profile_path``.
    key: identity of the configuration (model, batch, devices, …); hashed.
    about: a JSON description of the configuration saved beside the choices
      (by the trainer: :func:`profile_about`).
    log: where a problem with the file is said, in one line (default: a
      ``UserWarning``).

  A file that cannot be read, or that is not a profile (a path given by
  mistake: a file that does not start as a JSON object does, or a JSON
  object of other keys), is left as it is: the choices are kept for this run
  only. A damaged profile (a JSON object cut short, an empty file) is moved
  to ``<path>.corrupt`` and written anew.
  """

  def __init__(self, path: str | None, key: dict[str, Any], about: dict[str, Any] | None = None,
               log: Callable[[str], None] | None = None):
    self.path = os.path.expanduser(path) if path else None
    self.key = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    self.about = about or {}
    self._say = log or (lambda text: warnings.warn(text, stacklevel=3))
    try:
      with _locked(self.path):
        data = _read_keeping(self.path, self._say) if self.path else {}
    except (OSError, ValueError) as e:  # unreadable, not a profile, or cannot be moved aside
      self._say(f'{e}; the micro-batch counts are kept for this run only')
      self.path, data = None, {}
    self.entries: dict[str, Any] = _choices(data.get(self.key))  # corrupt: re-measured
    described = data.get(ABOUT)
    if self.entries and self.about and (
        not isinstance(described, dict) or described.get(self.key) != self.about):
      self._save()  # choices remembered before their run was described

  def get(self, pipeline_length: int) -> int | None:
    entry = self.entries.get(str(pipeline_length))
    return None if entry is None else int(entry['micro_batches'])

  def choose(self, pipeline_length: int, candidates: Sequence[int],
             measure: Callable[[int], float]) -> tuple[int, dict[int, float]]:
    """Returns the remembered M for K, or measures each candidate (seconds
    per step) and remembers the fastest."""
    known = self.get(pipeline_length)
    if known is not None and known in candidates:
      return known, {}
    timings = {m: float(measure(m)) for m in candidates}
    best = min(timings, key=timings.get)
    self.entries[str(pipeline_length)] = {'micro_batches': best,
                                          'seconds': {str(k): v for k, v in timings.items()}}
    self._save()
    return best, timings

  def _save(self) -> None:
    """Writes the profile; an unwritable location keeps the choice in memory
    (with a warning) rather than stopping training."""
    if not self.path:
      return
    try:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      # Runs of other configurations share the file: read, merge and write
      # under a lock, through a temporary file of this process's own.
      with _locked(self.path):
        data = _read_keeping(self.path, self._say)
        data[self.key] = self.entries
        if self.about:
          if not isinstance(data.get(ABOUT), dict):
            data[ABOUT] = {}
          data[ABOUT][self.key] = self.about
        diskcache.write_atomic(self.path, lambda f: json.dump(data, f, indent=1))
    except (OSError, ValueError) as e:
      self._say(f'cannot write the micro-batch profile {self.path}: {e}; '
                f'keeping it for this run only')
      self.path = None  # said once


ABOUT = 'about'  # the profile file's key of the runs' descriptions


def _load(path: str) -> dict[str, Any]:
  """The profile file as a dict.

  Raises:
    ValueError: it cannot be read or is not a JSON object.
  """
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except OSError as e:
    raise ValueError(f'cannot read the micro-batch profile {path}: {e}') from e
  if raw.strip() and not raw.lstrip().startswith(b'{'):
    # A profile is a JSON object, written whole (write_atomic): a file that
    # does not even start as one is another (a path given by mistake).
    raise NotAProfile(f'{path} is not a micro-batch profile (it does not start as a JSON '
                      f'object does); it is left as it is')
  try:
    text = raw.decode('utf-8').strip()
    data, end = json.JSONDecoder().raw_decode(text)
  except ValueError as e:  # UnicodeDecodeError too
    raise ValueError(f'cannot read the micro-batch profile {path}: {e}') from e
  if text[end:].strip():
    # A whole object and more after it: JSON lines (a run's metrics.jsonl),
    # which no torn write of ours leaves.
    raise NotAProfile(f'{path} is not a micro-batch profile (more follows its first JSON '
                      f'object: JSON lines?); it is left as it is')
  if not isinstance(data, dict):
    raise ValueError(f'{path} is not a micro-batch profile (expected a JSON object)')
  for key, value in data.items():  # a record per configuration digest, and descriptions
    # A record maps pipeline lengths (digits) to choices; another program's
    # object of objects (a tsconfig.json) is not ours to rewrite either.
    record = isinstance(value, dict) and all(str(k).isdecimal() for k in value)
    if key != ABOUT and not re.fullmatch(r'[0-9a-f]{16}', key) and not record:
      held = 'no micro-batch record' if isinstance(value, dict) else type(value).__name__
      raise NotAProfile(f'{path} is not a micro-batch profile (its key {key[:40]!r} is no '
                        f'configuration digest and holds {held}); it is left as it is')
  return data  # a damaged record of a digest: re-measured (_choices)


class NotAProfile(ValueError):
  """A readable JSON object that is no micro-batch profile: not ours to
  move or rewrite."""


@contextlib.contextmanager
def _locked(path: str | None):
  """Holds ``<path>.lock`` exclusively while runs of other configurations,
  which share the file, could merge into it. Best effort: nothing for an
  in-memory profile, and unlocked where no lock file can be made or locked
  (a read-only directory, a file system without locks) — writes still
  replace the file atomically, a concurrent write may then lose a record."""
  lock = None
  if path:
    try:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      lock = open(f'{path}.lock', 'a')  # noqa: SIM115 - closed below
      fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError:
      if lock is not None:
        lock.close()
      lock = None
  try:
    yield
  finally:
    if lock is not None:
      lock.close()


def _read_keeping(path: str, say: Callable[[str], None]) -> dict[str, Any]:
  """:func:`_load`, with ``{}`` for a missing file; a damaged one (not
  JSON, or not an object) is first moved to ``<path>.corrupt`` (said with
  ``say``), so that rewriting it loses nothing. Call it under :func:`_locked`.

  Raises:
    ValueError: a file that cannot be read (permissions, a directory) or
      moved, or a JSON object that is not a profile (:class:`NotAProfile`):
      it must not be overwritten either.
  """
  try:
    return _load(path)
  except ValueError as e:
    if isinstance(e.__cause__, FileNotFoundError):
      return {}
    if isinstance(e.__cause__, OSError) or isinstance(e, NotAProfile):
      raise
    aside = diskcache.aside_name(path)
    try:
      os.replace(path, aside)
    except OSError as moved:
      raise ValueError(f'{e}; it cannot be moved aside either ({moved})') from moved
    say(f'{e}; moved to {aside}, the micro-batch counts are profiled again')
    return {}


def _choices(record: Any) -> dict[str, Any]:
  """The valid ``{K: {"micro_batches": M, ...}}`` entries of one record."""
  if not isinstance(record, dict):
    return {}
  return {k: v for k, v in record.items()
          if isinstance(k, str) and k.isdecimal() and isinstance(v, dict)
          and isinstance(v.get('micro_batches'), int) and v['micro_batches'] > 0}


def profile_about(hf_config: Any, *, devices: int, batch: int, batch_mode: str,
                  platform: str, schedule: str, exchange: str,
                  autodp: bool = True) -> dict[str, Any]:
  """What a profile record says of its run (JSON): the model's HF config
  and the figures that decide a micro-batch count (``autodp``: whether R
  grows as K shrinks, which sets a replica's batch)."""
  config = json.loads(json.dumps(hf_config.to_dict(), sort_keys=True, default=str))
  config['num_labels'] = hf_config.num_labels  # to_dict() has only the labels' names
  return {'hf_config': config, 'devices': devices, 'batch': batch, 'batch_mode': batch_mode,
          'platform': platform, 'schedule': schedule, 'exchange': exchange, 'autodp': autodp}


def profile_differences(about: dict[str, Any], model: dict[str, Any], devices: int,
                        batch: int | None = None) -> list[str]:
  """How a described run (``about``) differs from ``model``'s fields, the
  device count and, when given, ``train.batch_size``, e.g. ``['num_labels 10
  (not 1000)']``; empty when it matches. A run without AutoDP (R stayed 1)
  differs too: a plan's replicas are N/K; so does one recorded before runs
  noted ``autodp`` (its M may be a run's with R = 1)."""
  config = about.get('hf_config')
  config = config if isinstance(config, dict) else {}
  run = {k: config.get(k) for k in model} | {'devices': about.get('devices'),
                                               'autodp': about.get('autodp')}
  wanted = dict(model, devices=devices, autodp=True)
  if batch is not None:
    run['batch'], wanted['batch'] = about.get('batch'), batch
  return [('autodp not recorded (a run from before runs noted it)' if k == 'autodp'
           and 'autodp' not in about else f'{k} {run[k]!r} (not {v!r})')
          for k, v in wanted.items() if run[k] != v]


def profiled_choices(path: str, model: dict[str, Any], devices: int,
                     batch: int | None = None) -> list[tuple[dict[str, Any], dict[int, int]]]:
  """The described runs in the profile at ``path`` whose model has every
  field of ``model`` (e.g. a preset's ``model_type``, sizes and classes) and
  that ran on ``devices`` devices (with ``train.batch_size`` = ``batch``, when
  given): a list of ``(about, {K: M})``. :func:`described_runs` gives them all.

  Raises:
    ValueError: the file cannot be read or is not a profile.
  """
  return [(about, choices) for about, choices in described_runs(path)
          if not profile_differences(about, model, devices, batch)]


def described_runs(path: str) -> list[tuple[dict[str, Any], dict[int, int]]]:
  """Every described run in the profile at ``path``: ``(about, {K: M})``.

  Raises:
    ValueError: the file cannot be read or is not a profile.
  """
  data = _load(path)
  described = data.get(ABOUT)
  if not isinstance(described, dict):
    return []  # none described yet: a training run describes its record when it opens it
  return [(about, {int(k): v['micro_batches'] for k, v in _choices(data.get(key)).items()})
          for key, about in described.items()
          if isinstance(about, dict) and isinstance(about.get('hf_config'), dict)]
