"""Print AutoPipe's plan for a model as JSON, without running the model.

    python -m pipejax.plan --model vit-b16 --devices 8 --frozen-layers 0

``stages`` lists each stage's sub-layers (``embed``, ``attn.i``, ``mlp.i``,
``head``; an MLP split between two stages is ``mlp.i.in`` at the end of the
first, ``mlp.i.out`` at the start of the second: ``split_mlp`` lists the
stages that end with one, ``--split-mlp-min-gain`` as in training) and
parameter count: the partition a run trains with, which balances the active
sub-layers alone (the frozen prefix runs outside the pipeline);
``pipeline_length`` is after compression (Eq. 2) from
``--initial-pipeline-length`` (default: the device count), and
``memory_proxy_eq2`` Eq. 2's proxy at that length, what compression compares
with its value at T = 0 (the largest stage of Algorithm 1's partition,
balanced around ``--lambda-frozen`` times the frozen parameters charged to its
first stage);
``micro_batches`` is the choice that a training run of the same model (the
``--model`` preset: a run of a custom model, such as the embedded default's,
is never read) on as many devices (and ``--batch-size``, when given)
profiled and remembered in the file ``--profile`` (its
``pipeline.profile_path``), else the smallest candidate training would
try (K; with ``--batch-size``, the smallest M that splits each replica's
share of that batch, never more micro-batches than samples; the batch is
the global one, or with ``--batch-mode per_pipeline`` a pipeline's);
``micro_batches_source`` says which. Memory is
estimated per device for float32 training with AdamW, per stage:
``stage_layout_bytes``, the trainable state a device holds (as many block
slots as the widest stage, and the replicated embedding and head:
parameters, gradients and two moments, 16 bytes each), of which
``trainable_parameter_bytes`` are the stage's own parameters;
``frozen_prefix_bytes``, the replicated frozen prefix (4 bytes each); and
``total_bytes``, the two parts a device holds: layout and prefix.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable

from pipejax import runtime

#: The names of :data:`models.PRESETS` (for ``--help``, which imports no JAX).
PRESETS = ('bert-base', 'bert-large', 'vit-b16', 'vit-l16')
#: ``train.batch_mode``'s values (see :func:`pipejax.autodp.global_batch_size`).
BATCH_MODES = ('constant', 'per_pipeline')


def _unit_name(unit: int, num_layers: int) -> str:
  from pipejax.partition import unit_block  # noqa: PLC0415 - imports JAX (after setup)
  layer = unit_block(unit, num_layers)
  if layer is None:
    return 'embed' if unit == 0 else 'head'
  return f'{"mlp" if unit % 2 == 0 else "attn"}.{layer}'


def _profiled(profile: str | None, model_name: str, model: dict, devices: int,
              batch_size: int | None, k: int, default: Callable[[], int]) -> tuple[int, str]:
  """M for K from a training run's profile (``pipeline.profile_path``) of
  this model on this many devices, and where it came from; ``default()``
  (the smallest candidate) without one."""
  def fallback(why: str) -> tuple[int, str]:
    m = default()
    smallest = 'K' if m == k else 'the smallest M that splits the batch per replica'
    return m, f'default ({smallest}; {why})'

  if not profile:
    return fallback('profiling happens at training time')
  from pipejax import autopipe  # noqa: PLC0415
  profile = os.path.expanduser(profile)
  described = autopipe.described_runs(profile)
  differences = [autopipe.profile_differences(about, model, devices, batch_size)
                 for about, _ in described]
  matching = [run for run, differ in zip(described, differences) if not differ]
  runs = [(about, choices) for about, choices in matching if k in choices]
  batch = '' if batch_size is None else f', train.batch_size {batch_size}'
  chosen = {choices[k] for _, choices in runs}
  if not chosen:
    why = _nearest(matching, differences)
    return fallback(f'{profile} holds no described choice for K={k} of {model_name} on '
                    f'{devices} devices{batch}: {why}')
  if len(chosen) > 1:
    values = {f: sorted({str(about.get(f)) for about, _ in runs})
              for f in ('batch', 'batch_mode', 'platform', 'schedule', 'exchange')}
    varying = {f: v for f, v in values.items() if len(v) > 1}
    differ = ', '.join(f'{f} {v}' for f, v in varying.items()) or 'nothing listed'
    hint = '; pass --batch-size' if 'batch' in varying else ''
    raise ValueError(f'{profile} holds runs of {model_name} on {devices} devices that chose '
                     f'different M for K={k} (they differ in: {differ}){hint}')
  return chosen.pop(), f'profile {profile} ({len(runs)} run{"s" * (len(runs) > 1)}{batch})'


def _nearest(matching: list, differences: list[list[str]]) -> str:
  """Why no described run gives M: what the ``matching`` runs chose, or how
  the closest other run differs (``differences``: one list per described run)."""
  if matching:
    ks = sorted({k for _, choices in matching for k in choices})
    return (f'its matching runs chose M for K in {ks} only' if ks else
            'its matching runs have chosen no M yet')
  if not differences:
    return ('no run is described yet; a training run describes the choices it finds when it '
            'opens the file')
  runs = 'its one described run' if len(differences) == 1 else (
      f'the closest of its {len(differences)} described runs')
  return f'{runs} differs in {", ".join(min(differences, key=len))}'


def build_plan(model_name: str, devices: int, frozen_layers: int, *, lambda_frozen: float = 1 / 6,
               initial_pipeline_length: int | None = None, batch_size: int | None = None,
               batch_mode: str = 'constant', profile: str | None = None,
               split_mlp_min_gain: float | None = None) -> dict:
  """The plan of ``model_name`` (a key of :data:`models.PRESETS`) as a dict."""
  import models  # noqa: PLC0415
  from pipejax import autodp, autopipe  # noqa: PLC0415

  if model_name not in models.PRESETS:
    raise ValueError(f'unknown model {model_name!r}; expected one of {sorted(models.PRESETS)}')
  kind, overrides = models.PRESETS[model_name]
  created = models.create(kind, models.config_for(kind, **overrides), abstract=True)
  params = created.params
  num_layers = created.model.num_layers
  if not 0 <= frozen_layers < num_layers:
    raise ValueError(f'--frozen-layers must be in [0, {num_layers - 1}], got {frozen_layers}')
  if devices < 1:
    raise ValueError(f'--devices must be >= 1, got {devices}')
  if not 0 <= lambda_frozen <= 1:  # also refuses NaN
    raise ValueError(f'--lambda-frozen must be in [0, 1], got {lambda_frozen}')
  if batch_size is not None and batch_size < 1:
    raise ValueError(f'--batch-size must be >= 1, got {batch_size}')
  if batch_mode not in BATCH_MODES:
    raise ValueError(f'--batch-mode must be one of {list(BATCH_MODES)}, got {batch_mode!r}')
  if initial_pipeline_length is not None and initial_pipeline_length < 1:
    raise ValueError(f'--initial-pipeline-length must be >= 1, got {initial_pipeline_length}')
  if split_mlp_min_gain is None:
    split_mlp_min_gain = autopipe.SPLIT_MLP_MIN_GAIN
  if not 0 <= split_mlp_min_gain <= 1:  # also refuses NaN
    raise ValueError(f'--split-mlp-min-gain must be in [0, 1] (1: never), got '
                     f'{split_mlp_min_gain}')
  initial = initial_pipeline_length or devices
  if devices % initial:
    raise ValueError(f'initial pipeline length {initial} does not divide {devices} devices')
  costs = autopipe.parameter_costs(
      params, created.model.mlp_in_keys if created.model.can_split_mlp else (),
      split_mlp_min_gain)
  units = len(costs.costs)  # embedding, attention and MLP of every block, head
  if initial > units:
    fits = max(k for k in range(1, units + 1) if devices % k == 0)
    raise ValueError(f'a pipeline of {initial} stages needs as many units; {model_name} has '
                     f'{units} (embedding, 2 per block, head): pass --initial-pipeline-length '
                     f'{fits} or less (replicas take the other devices)')
  stage_plan = autopipe.compress(costs, frozen_layers, initial, initial, lambda_frozen,
                                 num_devices=devices)
  partition = stage_plan.partition
  k = partition.pipeline_length
  replicas = devices // k

  def default() -> int:  # the smallest M training would try for train.batch_size
    if batch_size is None:
      return k
    if batch_mode == 'constant' and batch_size % replicas:
      raise ValueError(f'--batch-size {batch_size} does not split over the {replicas} replicas '
                       f'of this plan (K={k} on {devices} devices; with batch_mode '
                       f'constant it is the global batch)')
    per_replica = autodp.global_batch_size(batch_size, replicas, batch_mode) // replicas
    return autopipe.micro_batch_candidates(k, per_replica)[0]
  micro, source = _profiled(profile, model_name, dict(
      overrides, model_type=created.model.hf_config.model_type), devices, batch_size, k,
      default)
  unit_costs = costs.costs
  slots = partition.tables.num_slots
  attn, mlp = unit_costs[1], unit_costs[2]
  shared = unit_costs[0] * partition.has_embed + unit_costs[-1]
  stages = []
  all_units = partition.stage_units()
  for s, (units, cost) in enumerate(zip(all_units, stage_plan.stage_costs)):
    names = [_unit_name(u, num_layers) for u in units]
    if s in partition.split_mlp:
      names[-1] += '.in'
    if s - 1 in partition.split_mlp:
      names.insert(0, _unit_name(all_units[s - 1][-1], num_layers) + '.out')
    stages.append({'sublayers': names, 'parameters': int(cost)})
  frozen = costs.frozen(frozen_layers)
  padded_stack = slots * (attn + mlp)  # every device holds the padded block slots
  memory = []
  for stage in stages:
    memory.append({
        'trainable_parameter_bytes': int(16 * stage['parameters']),
        'stage_layout_bytes': int(16 * (padded_stack + shared)),
        'frozen_prefix_bytes': int(4 * frozen),
        'total_bytes': int(16 * (padded_stack + shared) + 4 * frozen),
    })
  return {
      'model': model_name, 'devices': devices, 'frozen_layers': frozen_layers,
      'lambda_frozen': lambda_frozen, 'pipeline_length': k, 'replicas': replicas,
      'micro_batches': micro, 'micro_batches_source': source,
      'stage_sizes': list(partition.stage_sizes), 'split_mlp': list(partition.split_mlp),
      'stages': stages,
      'max_stage_parameters': max(s['parameters'] for s in stages),
      'memory_proxy_eq2': int(autopipe.eq2_proxy(costs, frozen_layers, k, lambda_frozen)),
      'estimated_memory_per_stage': memory,
  }


def main(argv=None) -> int:
  p = runtime.ArgumentParser(prog='python -m pipejax.plan',
                              description="Print AutoPipe's plan of a model as JSON, without "
                                          'running it.')
  p.add_argument('--model', required=True, help=f'a preset: {", ".join(PRESETS)}')
  p.add_argument('--devices', type=int, required=True, help='the devices the run has')
  p.add_argument('--frozen-layers', type=int, default=0,
                 help='blocks frozen so far, F (default 0)')
  p.add_argument('--lambda-frozen', type=float, default=1 / 6,
                 help="the frozen prefix's weight in Eq. 2's memory cost (training's "
                      'freeze.lambda_frozen; default 1/6)')
  p.add_argument('--initial-pipeline-length', type=int, default=None,
                 help='the pipeline length before compression, K0 (default: --devices)')
  p.add_argument('--batch-size', type=int, default=None,
                 help="the run's train.batch_size: picks a profiled run (with --profile), and "
                      'else the smallest M that splits it')
  p.add_argument('--batch-mode', default='constant', choices=BATCH_MODES,
                 help="the run's train.batch_mode: constant (--batch-size is the global batch) "
                      "or per_pipeline (a pipeline's), for the default M; a profile's runs are "
                      'picked by --batch-size alone')
  p.add_argument('--split-mlp-min-gain', type=float, default=None,
                 help='split an MLP between stages when that lowers the largest stage by at '
                      "least this fraction (1: never; training's pipeline.split_mlp_min_gain)")
  p.add_argument('--profile', default=None,
                 help="a training run's micro-batch profile (its pipeline.profile_path)")
  args = p.parse_args(argv)
  runtime.setup(1)
  try:
    plan = build_plan(args.model, args.devices, args.frozen_layers,
                      lambda_frozen=args.lambda_frozen,
                      initial_pipeline_length=args.initial_pipeline_length,
                      batch_size=args.batch_size, batch_mode=args.batch_mode,
                      profile=args.profile,
                      split_mlp_min_gain=args.split_mlp_min_gain)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(json.dumps(plan, indent=2))
  return 0


if __name__ == '__main__':
  sys.exit(main())
