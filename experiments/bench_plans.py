"""Train-step time of every plan an elastic run goes through, against the
baseline's, side by side in one process: ``python -m experiments.bench_plans
--workdir DIR [--perf] [--timed-model] [--model-only] [--config.KEY=VALUE ...]``.

The plans are those of the main job's config (``experiments.vit_imagenet``,
embedded default unless overridden): the frozen counts that the α bound of the
freeze schedule gives per epoch (paper Fig. 4, the upper bound of Eq. 1), each
partitioned and compressed by AutoPipe as the trainer does; M is the config's
or K. Each plan's train step (frozen prefix forward + pipelined step) is timed
on real batches, interleaved with the baseline (no freezing, the starting
pipeline) so that machine noise hits both, and the run's train-time ratio is
predicted from the per-epoch plans. Beside it: the limit the freeze schedule
allows (frozen blocks forward-only = 1 unit, trained blocks forward +
recomputed forward + backward = 4 units). Prints a table, writes
``DIR/bench_plans.json``. What this leaves out on purpose — compilation,
transitions, evaluation, checkpoints — is what separates it from a run's wall
time.

A plan that keeps the previous plan's K runs at its own, narrower slot width
(the trainer's default); with ``freeze.keep_slot_width=True`` the trainer
pads it to the width of the previous plan's step instead. Each such plan is
timed both ways in the same interleaved rounds (column ``padded ms``).

Beside each step's wall time, per step: the CPU time the process used (all its
threads) and its threads' context switches (``getrusage``), both of the
fastest pass of each round and the median over the rounds, as the step time.
With ``--perf`` each plan's steps also run for a few seconds under ``perf
record`` (Linux ``perf``, allowed to attach to the process), and a second
table splits the samples by what the CPU was doing: the compiled program's
kernels (the arithmetic), the OS kernel's scheduler, futex and system-call
paths (XLA:CPU runs each fake device on a thread of its own, and every
collective is a rendezvous of those threads), the rest of the OS kernel,
memory allocation and copies, the rest of XLA's runtime, and the rest. A perf
that may sample user space only (``kernel.perf_event_paranoid`` above 1) reads
0 in the OS columns, with a warning; a perf that fails leaves the step times
written, and exits 2. ``DIR/perf-F<F>.data`` stay for ``perf report`` (with
call chains).

Beside the measurement, a model of the same plans on ideal devices (column
``model``): every device computes its stage at its FLOPs (:class:`StageFlops`:
XLA's cost analysis of the stage's forward, and of its recomputed forward and
backward), devices run in parallel, a stage ends each tick in an exchange with
its neighbours (``ppermute``, what the executor uses on accelerators; with
``--config.pipeline.exchange=all_gather`` with every stage:
:func:`pipejax.schedule.step_cost`), communication, dispatch and the optimizer
update are free, and the frozen prefix runs data-parallel over the plan's
devices. It estimates what the freeze schedule and the executor allow where
the devices really are parallel, which this machine's shared cores are not;
it is a model under those assumptions, not a measurement. The run's
train-time ratio is predicted from it too, with the frozen prefix computed
(as measured here) and with it read from the cache at every depth.

``--timed-model`` prices the same plans a second time with each stage's
programs timed on one device, the default backend's first
(:class:`StageTimes`: on each plan's micro-batch, less the cost of calling
an empty program), column ``timed``: what FLOPs leave out, a small stage's
fixed costs (a kernel launch per op on a GPU), is then in. ``--model-only``
leaves the measurement out: only the plans and the model(s). On a machine
with fewer devices than ``pipeline.devices`` (one accelerator), the plans
are then built over as many CPU devices and the stages timed on the
accelerator: an estimate of what the pipeline would reach on
``pipeline.devices`` of it, communication left out. ``bench_plans`` takes
the constant batch (``train.batch_mode=constant``) only: its per-epoch
figures weigh every epoch alike.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable

from pipejax import runtime

runtime.setup(8)

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import command_line, elastic, vit_imagenet  # noqa: E402
from experiments.bench_cache import cpu_and_switches  # noqa: E402
from models.layered import LayeredModel  # noqa: E402
from pipejax import diskcache, freeze, schedule  # noqa: E402
from pipejax.partition import unit_block  # noqa: E402
from pipejax.data import Loader  # noqa: E402
from pipejax.trainer import Trainer  # noqa: E402


def main(argv=None) -> int:
  argv = list(sys.argv if argv is None else argv)
  own = {flag: flag in argv[1:] for flag, _ in OWN_FLAGS}
  argv = [a for i, a in enumerate(argv) if i == 0 or a not in own]
  perf, timed, model_only = own['--perf'], own['--timed-model'], own['--model-only']
  if perf and model_only:
    print('error: --perf profiles the measured steps, which --model-only leaves out',
          file=sys.stderr)
    return 2
  if perf and shutil.which('perf') is None:
    print('error: --perf needs Linux perf on the PATH (e.g. the linux-perf package)',
          file=sys.stderr)
    return 2
  # The main job's own config file and flags: the same keys, types and checks.
  parsed = command_line.parse_command_line(vit_imagenet.__file__, argv, require_workdir=True,
                                           extra_flags=OWN_FLAGS)
  if parsed is None:
    return 2
  config, workdir = parsed
  try:
    return _bench(config, workdir, perf, timed=timed, model_only=model_only)
  except (elastic.KNOWN_ERRORS + (OSError, PerfError)) as e:  # bad input, the machine: one line
    print(f'error: {e}', file=sys.stderr)
    return 2


def _plan_devices(config, model_only: bool) -> list:
  """The devices the plans are built over: the default backend's; for the
  model alone on a machine with fewer (one accelerator), as many CPU
  devices (``runtime.setup`` made 8)."""
  devices = jax.devices()
  if model_only and len(devices) < config.pipeline.devices and devices[0].platform != 'cpu':
    devices = jax.devices('cpu')
  return devices


def _bench(config, workdir: str, perf: bool = False, timed: bool = False,
           model_only: bool = False) -> int:
  with config.unlocked():
    config.checkpoint.enabled = False
    config.cache.enabled = False
  plan_devices = _plan_devices(config, model_only)
  elastic.check_config(config, len(plan_devices))
  if config.train.batch_mode != 'constant':
    raise elastic.ConfigError(
        'bench_plans takes train.batch_mode=constant only: with per_pipeline a plan\'s batch '
        'and an epoch\'s steps change with R, which its per-epoch figures do not weigh')
  elastic.check_workdir(workdir, checkpoints_enabled=False, files=('bench_plans.json',))
  data = elastic.resolve_data(config)
  created = elastic.resolve_model(config, data)
  model = created.model
  epochs = config.train.epochs
  policy = freeze.FreezePolicy('schedule', model.num_layers, config.freeze.alpha,
                               config.freeze.min_active_layers)
  frozen = [0]
  for _ in range(epochs - 1):
    frozen.append(policy.decide(None).result)
  loader = Loader(data.train, config.train.batch_size, seed=config.seed)
  # Plans over CPU devices beside an accelerator: whatever the trainer places
  # without naming a device goes to the CPU too.
  beside = plan_devices[0].platform != jax.devices()[0].platform
  with jax.default_device(plan_devices[0]) if beside else contextlib.nullcontext():
    trainer = Trainer(model, created.params, config, workdir, loader, loader,
                      devices=plan_devices[:config.pipeline.devices], log=lambda _: None)
    plans = _plans(trainer, frozen, keep_slot_width=False)
  first = list(itertools.islice(loader.epoch(0), 6))  # an epoch can be ImageNet's
  ids, batches = [i for i, _ in first], [b for _, b in first]
  flops = StageFlops(model, created.params, batches[0])
  # The model's exchange: the config's, or with 'auto' an accelerator's.
  exchange = 'ppermute' if config.pipeline.exchange == 'auto' else config.pipeline.exchange
  batch_sizes = {f: (p, trainer.batch_size(p)) for f, p in plans.items()}
  modeled = model_figures(batch_sizes, flops, frozen, exchange)
  times = StageTimes(model, created.params, batches[0]) if timed else None
  timed_model = timed_model_figures(batch_sizes, times, frozen, exchange) if timed else None
  if model_only:
    return _report_model(config, workdir, frozen, plans, trainer, flops, exchange, modeled,
                         times, timed_model)
  # The plans that keeping the width pads (wider slots than their own):
  padded = {f: p for f, p in _plans(trainer, frozen, keep_slot_width=True).items()
            if p.partition.tables.num_slots != plans[f].partition.tables.num_slots}
  # Baseline and every plan: state laid out for it, the step compiled and warmed.
  variants = [(f, False) for f in plans] + [(f, True) for f in padded]
  states, steps = {}, {}
  for f, pad in variants:
    plan = (padded if pad else plans)[f]
    trainer.plan = plan
    trainer.state = trainer._init_state(created.params, plan)  # noqa: SLF001
    feeds = [trainer._feed(i, b, plan) for i, b in zip(ids, batches)]  # noqa: SLF001
    fn = trainer._train_step(plan, feeds[0])  # noqa: SLF001
    for feed in feeds[:2]:
      trainer._run_step(fn, feed)  # noqa: SLF001
    jax.block_until_ready(trainer.state)
    states[f, pad], steps[f, pad] = trainer.state, fn

  def run_steps(f, pad):
    """One pass over the batches with ``(f, pad)``'s step, to its end."""
    plan = (padded if pad else plans)[f]
    trainer.plan, trainer.state = plan, states[f, pad]
    jax.block_until_ready(trainer.state)
    for i, b in zip(ids, batches):
      trainer._run_step(steps[f, pad], trainer._feed(i, b, plan))  # noqa: SLF001
    jax.block_until_ready(trainer.state)
    states[f, pad] = trainer.state

  usage = {v: [] for v in variants}  # (CPU seconds, switches) a step, per round

  def time_plan(f, pad, rounds=3):
    """The best of ``rounds`` passes, seconds a step; records the CPU and
    switches of the best pass."""
    best, best_usage = float('inf'), None
    for _ in range(rounds):
      before, start = cpu_and_switches(), time.perf_counter()
      run_steps(f, pad)
      wall, after = time.perf_counter() - start, cpu_and_switches()
      if wall < best:
        best, best_usage = wall, tuple((a - b) / len(batches) for a, b in zip(after, before))
    usage[f, pad].append(best_usage)
    return best / len(batches)

  seconds = {v: [] for v in variants}
  for _ in range(3):  # interleaved with the baseline (F=0)
    for v in variants:
      seconds[v].append(time_plan(0, False) if v == (0, False) else time_plan(*v))
  step = {f: float(np.median(seconds[f, False])) for f in plans}
  padded_step = {f: float(np.median(seconds[f, True])) for f in padded}
  cpu, switches = ({f: float(np.median([u[i] for u in usage[f, False]])) for f in plans}
                   for i in (0, 1))
  profiles, perf_error = (profile_plans(list(plans), lambda f: run_steps(f, False), workdir)
                          if perf else ({}, None))
  figures = ratios(step, padded_step, frozen, model.num_layers)
  rows = []
  for f, plan in plans.items():
    rows.append({'frozen_layers': f, 'pipeline_length': plan.pipeline_length,
                 'replicas': plan.replicas, 'micro_batches': plan.micro_batches,
                 'slot_width': plan.partition.tables.num_slots,
                 'step_seconds': step[f], 'ratio_to_baseline': figures['ratio_to_baseline'][f],
                 'padded_slot_width': (padded[f].partition.tables.num_slots
                                       if f in padded else None),
                 'padded_step_seconds': padded_step.get(f),
                 'flop_ratio': figures['flop_ratio'][f],
                 'cpu_seconds_per_step': cpu[f], 'context_switches_per_step': switches[f],
                 'cpu_profile_percent': profiles.get(f),
                 **_model_row(f, modeled, timed_model)})
  predicted, predicted_padded, limit = (figures[k] for k in (
      'predicted', 'predicted_padded', 'limit'))
  print(f'{"F":>3} {"K":>3} {"R":>3} {"M":>3} {"slots":>5} {"step ms":>8} {"ratio":>6} '
        f'{"FLOP ratio":>10} {"padded ms":>14} {"CPU ms":>7} {"switches":>8} {"model":>6}'
        + (f' {"timed":>6}' if timed else ''))
  for r in rows:
    pad = (f'{r["padded_step_seconds"] * 1e3:.1f} ({r["padded_slot_width"]})'
           if r['padded_step_seconds'] is not None else '-')
    cpu_ms = f'{r["cpu_seconds_per_step"] * 1e3:.1f}'
    switched = f'{r["context_switches_per_step"]:.0f}'
    print(f'{r["frozen_layers"]:3d} {r["pipeline_length"]:3d} {r["replicas"]:3d} '
          f'{r["micro_batches"]:3d} {r["slot_width"]:5d} {r["step_seconds"] * 1e3:8.1f} '
          f'{r["ratio_to_baseline"]:6.2f} {r["flop_ratio"]:10.2f} {pad:>14} {cpu_ms:>7} '
          f'{switched:>8} {r["model_ratio"]:6.2f}'
          + (f' {r["timed_model_ratio"]:6.2f}' if timed else ''))
  if profiles:
    print('CPU profile (perf record, % of the samples while the plan\'s steps ran):')
    print(f'{"F":>3} {"K":>3} ' + ' '.join(f'{c:>{len(c)}}' for c in PERF_CATEGORIES))
    for r in rows:
      shares = r['cpu_profile_percent']
      print(f'{r["frozen_layers"]:3d} {r["pipeline_length"]:3d} ' + ' '.join(
          f'{shares[c]:>{len(c)}.1f}' for c in PERF_CATEGORIES))
  print(f'frozen layers per epoch {frozen}: predicted train-time ratio {predicted:.3f} '
        f'({predicted_padded:.3f} with freeze.keep_slot_width; FLOP limit {limit:.3f})')
  _print_model(exchange, modeled, times, timed_model)
  out = {'command': ' '.join(sys.argv), 'frozen_per_epoch': frozen, 'rows': rows,
         'predicted_train_ratio': predicted,
         'predicted_train_ratio_keep_slot_width': predicted_padded, 'flop_limit_ratio': limit,
         **_model_json(exchange, flops, modeled, times, timed_model)}
  diskcache.write_atomic(os.path.join(workdir, 'bench_plans.json'),
                         lambda f: json.dump(out, f, indent=2))
  print(f'wrote {workdir}/bench_plans.json')
  if perf_error:
    print(f'error: {perf_error} (the step times are written; no CPU profile)', file=sys.stderr)
    return 2
  return 0


def _model_row(f: int, modeled: dict, timed_model: dict | None) -> dict:
  """A plan's row's model figures (and the timed model's, or None)."""
  row = {'model_ratio': modeled['ratio'][f], 'model_ratio_cached': modeled['ratio_cached'][f],
         'model_utilization': modeled['utilization'][f]}
  for key in ('ratio', 'ratio_cached', 'utilization'):
    row[f'timed_model_{key}'] = timed_model[key][f] if timed_model else None
  return row


def _print_model(exchange: str, modeled: dict, times, timed_model: dict | None) -> None:
  print(f'model (ideal parallel devices, {exchange} exchanges, free communication): '
        f'train-time ratio {modeled["predicted"]:.3f}, {modeled["predicted_cached"]:.3f} with '
        f'the frozen prefix cached; the baseline\'s devices busy '
        f'{modeled["utilization"][0]:.0%} of its step')
  if timed_model:
    device = times.device
    print(f'timed model (stage times on {device.platform} device {device.id}, less a '
          f'{times.floor * 1e6:.0f} us call): train-time ratio {timed_model["predicted"]:.3f}, '
          f'{timed_model["predicted_cached"]:.3f} with the frozen prefix cached; the '
          f'baseline\'s devices busy {timed_model["utilization"][0]:.0%} of its step')


def _model_json(exchange: str, flops, modeled: dict, times, timed_model: dict | None) -> dict:
  out = {'model_exchange': exchange, 'model_train_ratio': modeled['predicted'],
         'model_train_ratio_cached': modeled['predicted_cached'],
         'stage_flops_per_sample': flops.table()}
  if timed_model:
    out.update({'timed_model_device': f'{times.device.platform}:{times.device.id} '
                                      f'({times.device.device_kind})',
                'timed_model_call_floor_seconds': times.floor,
                'timed_model_train_ratio': timed_model['predicted'],
                'timed_model_train_ratio_cached': timed_model['predicted_cached'],
                'stage_seconds': times.table()})
  return out


def _report_model(config, workdir: str, frozen: list[int], plans: dict, trainer, flops,
                  exchange: str, modeled: dict, times, timed_model: dict | None) -> int:
  """``--model-only``: the plans, their FLOP ratios and the model(s), no
  step timed."""
  blocks = trainer.model.num_layers
  rows = [{'frozen_layers': f, 'pipeline_length': p.pipeline_length, 'replicas': p.replicas,
           'micro_batches': p.micro_batches, 'flop_ratio': flop_ratio(f, blocks),
           **_model_row(f, modeled, timed_model)} for f, p in plans.items()]
  print(f'{"F":>3} {"K":>3} {"R":>3} {"M":>3} {"FLOP ratio":>10} {"model":>6} {"cached":>6}'
        + (f' {"timed":>6} {"cached":>6}' if timed_model else ''))
  for r in rows:
    print(f'{r["frozen_layers"]:3d} {r["pipeline_length"]:3d} {r["replicas"]:3d} '
          f'{r["micro_batches"]:3d} {r["flop_ratio"]:10.2f} {r["model_ratio"]:6.2f} '
          f'{r["model_ratio_cached"]:6.2f}' + (
              f' {r["timed_model_ratio"]:6.2f} {r["timed_model_ratio_cached"]:6.2f}'
              if timed_model else ''))
  _print_model(exchange, modeled, times, timed_model)
  limit = sum(flop_ratio(f, blocks) for f in frozen) / len(frozen)
  out = {'command': ' '.join(sys.argv), 'model_only': True, 'frozen_per_epoch': frozen,
         'plan_devices': f'{len(trainer.devices)} {trainer.devices[0].platform}',
         'rows': rows, 'flop_limit_ratio': limit,
         **_model_json(exchange, flops, modeled, times, timed_model)}
  diskcache.write_atomic(os.path.join(workdir, 'bench_plans.json'),
                         lambda f: json.dump(out, f, indent=2))
  print(f'wrote {workdir}/bench_plans.json')
  return 0


def ratios(step: dict[int, float], padded_step: dict[int, float], frozen: list[int],
           blocks: int) -> dict:
  """The table's figures from each depth's step seconds (``step[0]``: the
  baseline's; ``padded_step``: the depths a kept slot width pads): each
  step's ratio to the baseline's and its FLOP ratio (a trained block 4 units,
  a computed frozen one 1), and over the epochs' depths ``frozen`` the
  predicted train-time ratio, with padding, and the FLOP limit's."""
  baseline = len(frozen) * step[0]
  return {'ratio_to_baseline': {f: s / step[0] for f, s in step.items()},
          'flop_ratio': {f: flop_ratio(f, blocks) for f in step},
          'predicted': sum(step[f] for f in frozen) / baseline,
          'predicted_padded': sum(padded_step.get(f, step[f]) for f in frozen) / baseline,
          'limit': sum(flop_ratio(f, blocks) for f in frozen) / len(frozen)}


def flop_ratio(frozen: int, blocks: int) -> float:
  """A step's FLOPs with ``frozen`` of ``blocks`` blocks frozen, to the
  baseline's: a trained block 4 units, a computed frozen one 1."""
  return (4 * (blocks - frozen) + frozen) / (4 * blocks)


class _StagePrograms:
  """The programs of pipeline stages: a stage's units run in a row on
  ``samples`` samples of ``batch`` (repeated when it has fewer), forward, or
  their ``jax.vjp`` with respect to the parameters and input activations, as
  the executor's BWD runs it: the forward is recomputed as far as the
  backward needs it (XLA drops, for one, the output of the stage's last dense
  layer). Units run with ``train=False``: dropout is left out.

  ``kinds`` names a stage's units in order: ``embed``, ``attention``,
  ``mlp``, ``mlp_in`` (a split MLP's first half, last in its stage),
  ``mlp_out`` (its second half, first in the next stage) and ``head`` (with
  the loss).
  """

  def __init__(self, model: LayeredModel, params, batch, device=None):
    self.model = model
    self.device = device
    self.batch = batch
    first = functools.partial(jax.tree.map, lambda x: x[0])
    self.params = {'embed': params['embed'], 'attention': first(params['attention']),
                   'mlp': first(params['mlp']), 'head': params['head']}

  def _samples(self, samples: int):
    """``samples`` samples of the batch (its first ones, repeated as needed)."""
    def take(x):
      x = np.asarray(x)
      return np.resize(x, (samples,) + x.shape[1:]) if len(x) < samples else x[:samples]
    return jax.tree.map(take, self.batch)

  def program(self, kinds: tuple[str, ...], backward: bool, samples: int):
    """``(jitted function, its arguments)`` of the stage's forward or backward
    on ``samples`` samples. Every input, the cotangent too, is an argument:
    XLA would fold a constant one, and simplify a product with a constant
    cotangent."""
    m = self.model
    batch = self._samples(samples)
    # The stage's input activations (a stage that embeds reads the batch).
    hidden = None if kinds[0] == 'embed' else m.embed_fn(self.params['embed'], batch, None,
                                                         False)
    inner = (m.mlp_in_fn(self.params['mlp'], hidden, batch, None, False)
             if kinds[0] == 'mlp_out' else None)

    def fn(ps, activations, b):
      inner, h = (None, None) if kinds[0] == 'embed' else (
          activations if kinds[0] == 'mlp_out' else (None, activations[0]))
      for kind, p in zip(kinds, ps):
        if kind == 'embed':
          h = m.embed_fn(p, b, None, False)
        elif kind == 'attention':
          h = m.attention_fn(p, h, b, None, False)
        elif kind == 'mlp':
          h = m.mlp_fn(p, h, b, None, False)
        elif kind == 'mlp_in':
          return m.mlp_in_fn(p, h, b, None, False), h
        elif kind == 'mlp_out':
          h = m.mlp_out_fn(p, inner, h, b, None, False)
        else:
          return m.loss_fn(p, h, b, None, False)[0]
      return h
    ps = tuple(self.params['mlp' if k in ('mlp_in', 'mlp_out') else k] for k in kinds)
    activations = (() if kinds[0] == 'embed' else (inner, hidden)
                   if kinds[0] == 'mlp_out' else (hidden,))
    if backward:
      cotangent = jax.tree.map(lambda s: jnp.full(s.shape, 0.5, s.dtype),
                               jax.eval_shape(fn, ps, activations, batch))

      def vjp(ps, activations, cotangent, b):
        return jax.vjp(lambda ps, xs: fn(ps, xs, b), ps, activations)[1](cotangent)
      run, args = vjp, (ps, activations, cotangent, batch)
    else:
      run, args = fn, (ps, activations, batch)
    if self.device is not None:
      args = jax.device_put(args, self.device)
    return jax.jit(run), args


class StageFlops(_StagePrograms):
  """FLOPs of pipeline stages (see :class:`_StagePrograms` for ``kinds`` and
  the programs), from XLA's cost analysis of the stage's program on the first
  sample of ``batch``, times the samples. Counted on a CPU device (where
  the process has one; ``device`` otherwise): XLA's GPU cost analysis leaves
  out most of the matrix products that it hands to cuBLAS (seen on an H200
  with JAX 0.11.2: ViT-B/16's MLP forward, 1.9 GFLOP a sample, counted as 41
  MFLOP), and FLOPs do not depend on where they run.

  Raises:
    ValueError: XLA reports no FLOPs for a stage (a backend without cost
      analysis).
  """

  def __init__(self, model: LayeredModel, params, batch, device=None):
    if device is None:
      try:
        device = jax.devices('cpu')[0]
      except RuntimeError:  # JAX_PLATFORMS leaves the CPU out: the default backend
        device = jax.devices()[0]
    super().__init__(model, params, jax.tree.map(lambda x: x[:1], batch), device)
    self._costs: dict[tuple, float] = {}

  def forward(self, kinds: tuple[str, ...], samples: float = 1) -> float:
    return samples * self._cost(tuple(kinds), backward=False)

  def backward(self, kinds: tuple[str, ...], samples: float = 1) -> float:
    return samples * self._cost(tuple(kinds), backward=True)

  def _cost(self, kinds: tuple[str, ...], backward: bool) -> float:
    if (kinds, backward) not in self._costs:
      run, args = self.program(kinds, backward, 1)
      flops = run.lower(*args).compile().cost_analysis().get('flops')
      if not flops or flops <= 0:
        raise ValueError(f'XLA reports no FLOPs for a stage of {"+".join(kinds)} '
                         f'on {self.device.platform}: the model needs its cost analysis')
      self._costs[kinds, backward] = float(flops)
    return self._costs[kinds, backward]

  def table(self) -> dict[str, dict[str, float]]:
    """Every cost computed so far, by the stage's kinds joined with ``+``."""
    out: dict[str, dict[str, float]] = {}
    for (kinds, backward), flops in sorted(self._costs.items()):
      out.setdefault('+'.join(kinds), {})['backward' if backward else 'forward'] = flops
    return out


def fastest_seconds(run: Callable[[], Any], repeats: int,
                    clock: Callable[[], float] = time.perf_counter) -> float:
  """The shortest wall time of ``repeats`` calls of ``run``, each waited
  for (``jax.block_until_ready`` of what it returns): on a shared machine
  interference only adds time."""
  times = []
  for _ in range(repeats):
    start = clock()
    jax.block_until_ready(run())
    times.append(clock() - start)
  return float(min(times))


class StageTimes(_StagePrograms):
  """Seconds of pipeline stages on one ``device`` (the default backend's
  first): the programs of :class:`StageFlops` on a micro-batch of
  ``samples`` samples, compiled, run :data:`TIMED_WARMUP` times, then the
  fastest of their timed calls, less ``floor``: the fastest call of a
  program that does nothing but add 1 to a scalar (the dispatch and
  synchronisation a standalone call pays, which a stage inside the
  executor's step does not). Never below 0.

  :meth:`measure` times many programs in interleaved rounds (``rounds`` of
  ``repeats`` calls each, round-robin), so that a slow spell of a shared
  machine hits them all; a cost asked for that it did not time is timed
  on its own.

  Small stages are where the FLOP model is most optimistic: their kernels are
  short and their fixed costs (a kernel launch each on a GPU) are not in the
  FLOPs; these times keep them.
  """

  def __init__(self, model: LayeredModel, params, batch, device=None, repeats: int = 10,
               rounds: int = 5, clock: Callable[[], float] = time.perf_counter):
    device = device if device is not None else jax.devices()[0]
    super().__init__(model, params, batch, device)
    self.repeats, self.rounds, self.clock = repeats, rounds, clock
    self._fastest: dict[tuple, float] = {}  # before the floor is taken off
    one = jax.device_put(np.float32(0.0), device)
    add = jax.jit(lambda x: x + 1)
    for _ in range(TIMED_WARMUP):
      jax.block_until_ready(add(one))
    self._floor_call = lambda: add(one)
    self.floor = fastest_seconds(self._floor_call, repeats * rounds, clock)

  def measure(self, requests) -> None:
    """Times every ``(kinds, backward, samples)`` of ``requests`` (and the
    floor again) in interleaved rounds."""
    keys = sorted({(tuple(k), bool(b), max(1, math.ceil(s - 1e-9))) for k, b, s in requests}
                  - set(self._fastest))
    calls = {}
    for key in keys:
      run, args = self.program(*key)
      for _ in range(TIMED_WARMUP):
        jax.block_until_ready(run(*args))
      calls[key] = functools.partial(run, *args)
    best = dict.fromkeys(keys, float('inf'))
    floor = self.floor
    for _ in range(self.rounds):
      floor = min(floor, fastest_seconds(self._floor_call, self.repeats, self.clock))
      for key in keys:
        best[key] = min(best[key], fastest_seconds(calls[key], self.repeats, self.clock))
    self.floor = floor
    self._fastest.update(best)

  def forward(self, kinds: tuple[str, ...], samples: float) -> float:
    return self._time(tuple(kinds), False, samples)

  def backward(self, kinds: tuple[str, ...], samples: float) -> float:
    return self._time(tuple(kinds), True, samples)

  def _time(self, kinds: tuple[str, ...], backward: bool, samples: float) -> float:
    key = (kinds, backward, max(1, math.ceil(samples - 1e-9)))
    if key not in self._fastest:
      self.measure([key])
    return max(0.0, self._fastest[key] - self.floor)

  def table(self) -> dict[str, dict[str, float]]:
    """Every time measured so far, by the stage's kinds joined with ``+``
    and the samples (``<kinds> x<samples>``)."""
    out: dict[str, dict[str, float]] = {}
    for (kinds, backward, samples), seconds in sorted(self._fastest.items()):
      out.setdefault(f'{"+".join(kinds)} x{samples}', {})[
          'backward' if backward else 'forward'] = max(0.0, seconds - self.floor)
    return out


class _Requests:
  """Stands in for :class:`StageTimes` in a first pass of the model: notes
  the costs asked for (so that they are timed together), each 1."""

  def __init__(self):
    self.requests: list[tuple] = []

  def forward(self, kinds, samples=1):
    self.requests.append((kinds, False, samples))
    return 1.0

  def backward(self, kinds, samples=1):
    self.requests.append((kinds, True, samples))
    return 1.0


def timed_model_figures(plans: dict, times: 'StageTimes', frozen: list[int],
                        exchange: str = 'ppermute') -> dict:
  """:func:`model_figures` with stage times: every stage program of every plan
  timed first, together (:meth:`StageTimes.measure`)."""
  requests = _Requests()
  model_figures(plans, requests, frozen, exchange)
  times.measure(requests.requests)
  return model_figures(plans, times, frozen, exchange)


#: Untimed calls of a program before :class:`StageTimes` times it.
TIMED_WARMUP = 3


def stage_kinds(partition) -> list[tuple[str, ...]]:
  """The kinds (:class:`StageFlops`) of each stage's units, in order."""
  out, stage_units = [], partition.stage_units()
  for s, units in enumerate(stage_units):
    kinds = ['mlp_out'] if s - 1 in partition.split_mlp else []  # the received second half
    for u in units:
      block = unit_block(u, partition.num_layers)
      kind = ('embed' if u == 0 else 'head') if block is None else (
          'attention' if u % 2 else 'mlp')
      kinds.append('mlp_in' if s in partition.split_mlp and u == units[-1] else kind)
    out.append(tuple(kinds))
  return out


def modeled_step(plan, flops, batch_size: int,
                 exchange: str = 'ppermute') -> tuple[schedule.StepCost, float]:
  """One train step of ``plan`` on ideal devices (the module docstring's
  model), in the unit of ``flops`` (a :class:`StageFlops`: FLOPs, or a
  :class:`StageTimes`: seconds): the pipelined part's
  :func:`pipejax.schedule.step_cost` with ``exchange``, and the frozen
  prefix's forward when it is computed (the step's length is their sum; 0
  when nothing is frozen). Each stage's FWD costs ``flops.forward(units,
  samples)`` (none on the last stage, which fuses it into its BWD), its BWD
  ``flops.backward(units, samples)``, for ``batch_size / (R · M)`` samples; the
  prefix runs ``batch_size`` samples over the plan's ``R · K`` devices."""
  part = plan.partition
  k, samples = part.pipeline_length, batch_size / (plan.replicas * plan.micro_batches)
  kinds = stage_kinds(part)
  forward = [0.0 if s == k - 1 else flops.forward(c, samples) for s, c in enumerate(kinds)]
  backward = [flops.backward(c, samples) for c in kinds]
  cost = schedule.step_cost(schedule.make(plan.schedule, k, plan.micro_batches), forward,
                            backward, exchange)
  f, prefix = part.num_frozen_layers, 0.0
  if f:
    prefix = flops.forward(('embed',) + ('attention', 'mlp') * f, batch_size / plan.num_devices)
  return cost, prefix


def model_figures(plans: dict, flops, frozen: list[int], exchange: str = 'ppermute') -> dict:
  """:func:`modeled_step` of every depth's ``(plan, global batch)`` in
  ``plans`` (depth 0, the baseline's, is required), as ratios to the
  baseline's step, with the frozen prefix computed and cached; the devices'
  utilization in the pipelined part; and over the epochs' depths ``frozen``
  (not empty) the predicted train-time ratios."""
  if 0 not in plans or not frozen:
    raise ValueError('the model needs the baseline (depth 0) and at least one epoch')
  steps = {f: modeled_step(p, flops, b, exchange) for f, (p, b) in plans.items()}
  base = steps[0][0].time  # the baseline freezes nothing: no prefix
  ratio = {f: (c.time + prefix) / base for f, (c, prefix) in steps.items()}
  ratio_cached = {f: c.time / base for f, (c, _) in steps.items()}
  return {'ratio': ratio, 'ratio_cached': ratio_cached,
          'utilization': {f: c.utilization for f, (c, _) in steps.items()},
          'predicted': sum(ratio[f] for f in frozen) / len(frozen),
          'predicted_cached': sum(ratio_cached[f] for f in frozen) / len(frozen)}


#: What :func:`perf_categories` splits the samples into.
PERF_CATEGORIES = ('kernels', 'OS scheduling', 'OS other', 'memory',
                   'XLA runtime', 'other')
#: ``--perf`` in ``--help``.
PERF_FLAG = ('--perf', "also profile each plan's steps with Linux perf (where the CPU time goes)")
#: The command's own flags, for ``--help``.
OWN_FLAGS = (PERF_FLAG,
             ('--timed-model', 'also model the plans with stage times measured on one device '
                               '(the default backend\'s first), beside the FLOPs'),
             ('--model-only', 'the model alone, without timing the plans\' steps (on a machine '
                              'with fewer devices than pipeline.devices, the plans are built '
                              'over as many CPU devices)'))
#: Seconds each plan's steps run under ``perf record``.
PERF_SECONDS = 3.0
# The compiled programs' kernels: XLA's JIT code and the matrix libraries it calls.
_KERNELS = re.compile(r'ynn::|xnn_|ynn_|gemm|TensorContraction|slinky|dnnl|onednn', re.I)
_SWITCHING = re.compile(r'task_switch|schedule|futex|wake|spin_unlock|syscall|rseq|switch_to'
                        r'|finish_task|idle|pick_next|enqueue_task|dequeue_task|try_to_wake')
_MEMORY = re.compile(r'malloc|free|memmove|memcpy|memset|memalign|unlink_chunk|consolidate'
                     r'|^operator (new|delete)|madvise|page_fault|mm_fault|clear_page', re.I)
_REPORT_LINE = re.compile(r'^\s*([\d.]+)%\s+(.+?)\s+\[([k.])\]\s+(.*?)\s*$')


class PerfError(RuntimeError):
  """``perf`` could not record or report this process."""


def perf_categories(report: str) -> dict[str, float]:
  """The shares (% of the samples) of :data:`PERF_CATEGORIES` in the text of
  ``perf report --stdio --no-children --sort dso,sym``: the compiled
  program's kernels (XLA's JIT code, and the matrix libraries it calls,
  their set-up included), the OS kernel's scheduler, futex and system-call
  paths (where threads wait and are switched), the rest of the OS kernel,
  memory allocation and copies, the rest of XLA's library, and the rest."""
  shares = dict.fromkeys(PERF_CATEGORIES, 0.0)
  for line in report.splitlines():
    m = _REPORT_LINE.match(line)
    if not m or line.lstrip().startswith('#'):
      continue
    percent, dso, mode, symbol = float(m[1]), m[2], m[3], m[4]
    if mode == 'k':
      category = 'OS scheduling' if _SWITCHING.search(symbol) else 'OS other'
    elif dso.startswith('[JIT]') or _KERNELS.search(symbol):
      category = 'kernels'
    elif _MEMORY.search(symbol):
      category = 'memory'
    elif 'jax' in dso or 'xla' in dso or 'xla::' in symbol:
      category = 'XLA runtime'
    else:
      category = 'other'
    shares[category] += percent
  return shares


def perf_profile(run, seconds: float, path: str, perf: str = 'perf') -> dict[str, float]:
  """Calls ``run()`` until ``seconds`` have passed with ``perf record``
  sampling this process into ``path``; returns :func:`perf_categories` of
  its report.

  Raises:
    PerfError: perf failed to attach, record or report (its last line says why).
  """
  record = subprocess.Popen([perf, 'record', '-q', '-g', '-F', '999', '-p', str(os.getpid()),
                             '-o', path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
  try:
    time.sleep(0.5)  # attached before the steps start
    if record.poll() is not None:
      raise PerfError(f'perf record failed: {_last_line(record.stderr.read())}')
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
      run()
  finally:
    if record.poll() is None:
      record.send_signal(signal.SIGINT)
    try:
      _, err = record.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      record.kill()
      _, err = record.communicate()
  if record.returncode not in (0, -signal.SIGINT):
    raise PerfError(f'perf record failed: {_last_line(err)}')
  try:
    report = subprocess.run([perf, 'report', '-i', path, '--stdio', '--no-children', '-g',
                             'none', '--sort', 'dso,sym'], capture_output=True, text=True,
                            timeout=600, check=False)
  except subprocess.TimeoutExpired as e:
    raise PerfError(f'perf report of {path} took over {e.timeout:.0f}s') from None
  if report.returncode:
    raise PerfError(f'perf report failed: {_last_line(report.stderr)}')
  shares = perf_categories(report.stdout)
  if not sum(shares.values()):
    raise PerfError(f'perf recorded no samples into {path}')
  return shares


def profile_plans(depths: list[int], run_steps, workdir: str, perf: str = 'perf',
                  seconds: float = PERF_SECONDS) -> tuple[dict[int, dict], str | None]:
  """:func:`perf_profile` of ``run_steps(f)`` for each depth ``f``, one after
  another (perf's samples are that plan's), into ``workdir/perf-F<f>.data``.
  Returns the profiles and None, or ``({}, why)`` when perf failed (the
  caller still writes its timings). Warns when no sample is of the OS kernel
  (a perf allowed user space only reads 0 there)."""
  profiles = {}
  try:
    for f in depths:
      print(f'perf record: F={f} ...', flush=True)
      profiles[f] = perf_profile(lambda f=f: run_steps(f), seconds,
                                 os.path.join(workdir, f'perf-F{f}.data'), perf)
  except PerfError as e:
    return {}, str(e)
  if not any(p['OS scheduling'] + p['OS other'] for p in profiles.values()):
    print('warning: perf sampled no OS kernel code (kernel.perf_event_paranoid above 1 allows '
          'user space only): the OS columns read 0', file=sys.stderr)
  return profiles, None


def _last_line(text: str) -> str:
  lines = [line for line in (text or '').strip().splitlines() if line.strip()]
  return lines[-1].strip() if lines else '(no message)'


def _plans(trainer: Trainer, frozen: list[int], keep_slot_width: bool) -> dict:
  """The plan of every frozen count in ``frozen``, in order as the trainer
  makes them (compression starts from the current K; a kept K keeps the slot
  width with ``keep_slot_width``); M is the config's or K."""
  config, start = trainer.config, trainer.plan
  chosen = config.freeze.keep_slot_width
  plans = {}
  with config.unlocked():
    config.freeze.keep_slot_width = keep_slot_width
  try:
    for f in sorted(set(frozen)):
      partition = trainer._partition_after(f) if f else start.partition  # noqa: SLF001
      plans[f] = trainer.plan = trainer._plan(  # noqa: SLF001
          partition, config.pipeline.micro_batches or partition.pipeline_length)
  finally:
    trainer.plan = start
    with config.unlocked():
      config.freeze.keep_slot_width = chosen
  return plans


if __name__ == '__main__':
  sys.exit(main())
