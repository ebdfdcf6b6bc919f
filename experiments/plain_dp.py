"""The strong baseline without pipejax: ``python -m experiments.plain_dp --workdir DIR``.

The same HF Flax ViT (``FlaxViTForImageClassification``, same initial
weights), data, batches, optimizer, schedule and epochs as the main job
(``experiments.vit_imagenet``, whose config and flags it takes), trained the
way a user would without pipejax: one ``jax.jit`` step, parameters replicated
on every device, the batch split over them (plain data parallelism), no
freezing. Evaluates after every epoch like the main job; writes
``metrics.jsonl`` and ``summary.json`` (same keys as the main job's where they
apply) into ``--workdir``.

Every step takes ``train.batch_size`` samples in the order of the main job's
plain loader (one process). Settings of the main job that have no meaning
here are not followed: ``train.batch_mode=per_pipeline`` (the main job's
batch grows with its replicas; this one's stays ``train.batch_size``, with as
many steps as its samples need), ``distributed.data_shards`` (the main job
then draws its order per shard), and ``checkpoint.*`` and ``resume``: it
writes no checkpoints, so a stopped run cannot be resumed, and a workdir that
already holds a run (``metrics.jsonl``) is refused. It runs in one process:
``distributed.coordinator`` is refused.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

from pipejax import runtime

if __name__ == '__main__':
  runtime.quiet_interrupt()  # a Ctrl-C while it starts: one line
runtime.setup(8)

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from experiments import command_line, elastic, vit_imagenet  # noqa: E402
from pipejax import autodp, reporting  # noqa: E402
from pipejax.data import Loader  # noqa: E402
from pipejax.optimizer import optimizer_for  # noqa: E402
from pipejax.trainer import EVAL_BATCH_FACTOR  # noqa: E402


def run(config, workdir: str) -> dict:
  """Trains ``config``'s ViT with plain data parallelism; returns the summary.
  The workdir is claimed for the run, as the main job's is."""
  with contextlib.ExitStack() as held:
    return _run(config, workdir, held)


def _run(config, workdir: str, held: contextlib.ExitStack) -> dict:
  start = time.perf_counter()
  if config.distributed.coordinator:
    raise elastic.ConfigError(f'plain_dp runs in one process; drop --config.distributed.'
                              f'coordinator={config.distributed.coordinator!r}')
  elastic.check_config(config, len(jax.devices()))
  devices = jax.devices()[:config.pipeline.devices]
  data = elastic.resolve_data(config, 'vit')
  created = elastic.resolve_model(config, data, 'vit')
  # A folder whose outputs' paths are free (before training, not after it).
  elastic.check_workdir(workdir, checkpoints_enabled=False)
  elastic.lock_workdir(workdir, held)
  for name in ('metrics.jsonl', 'checkpoints', elastic.REPLACED):
    # replaced/: a main-job start over's, which plain_dp's summary.json would
    # make the next main-job run take for finished (and remove).
    if os.path.lexists(os.path.join(workdir, name)):
      raise elastic.ConfigError(f'{workdir} already holds a run ({name}); choose another '
                                f'--workdir')
  if config.train.batch_size % len(devices):
    raise elastic.ConfigError(f'train.batch_size={config.train.batch_size} does not split over '
                              f'the {len(devices)} devices')
  # Evaluation batches as the main job's: train.eval_batch_size, or 4 x its starting global
  # batch (B x R0 with batch_mode=per_pipeline), so that a train.max_steps_per_epoch cap
  # evaluates the same samples. Both split over the devices: check_config and the batch
  # check above see to it.
  starting = autodp.global_batch_size(
      config.train.batch_size,
      autodp.replicas_for(len(devices), config.pipeline.initial_length, config.pipeline.autodp),
      config.train.batch_mode)
  eval_batch = config.train.eval_batch_size or EVAL_BATCH_FACTOR * starting
  cap = config.train.max_steps_per_epoch
  train = Loader(data.train, config.train.batch_size, seed=config.seed, max_steps=cap)
  evals = Loader(data.eval, eval_batch, shuffle=False, drop_remainder=False, max_steps=cap)
  module = created.hf_class(created.model.hf_config, _do_init=False).module
  mesh = Mesh(np.array(devices), ('batch',))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P('batch'))
  _, optimizer = optimizer_for(config.train, train.steps_per_epoch())
  dropout = config.model.dropout > 0

  def logits_of(params, batch, rng=None):
    rngs = {'dropout': rng} if rng is not None else {}
    return module.apply({'params': params}, batch['pixel_values'], deterministic=rng is None,
                        rngs=rngs).logits

  def train_step(params, opt, batch, rng):
    def loss_fn(p):
      logits = logits_of(p, batch, rng if dropout else None)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch['labels']).mean()
      return loss, jnp.sum(jnp.argmax(logits, -1) == batch['labels'])
    (loss, correct), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt = optimizer.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss, correct

  def eval_step(params, batch):
    hit = jnp.argmax(logits_of(params, batch), -1) == batch['labels']
    return jnp.sum(hit * batch['example_mask']), jnp.sum(batch['example_mask'])

  step = jax.jit(train_step, donate_argnums=(0, 1),
                 out_shardings=(replicated, replicated, replicated, replicated))
  evaluate = jax.jit(eval_step, in_shardings=(replicated, split))
  params = jax.device_put(created.model.to_hf(created.params), replicated)
  opt = jax.jit(optimizer.init, out_shardings=replicated)(params)
  rng = jax.random.PRNGKey(config.seed + 1)
  metrics_log = reporting.MetricsLog(workdir)
  run_start = time.perf_counter()
  for epoch in range(config.train.epochs):
    t0 = time.perf_counter()
    loss_sum = correct_sum = 0.0
    steps = 0
    for _, batch in train.epoch(epoch):
      rng, step_rng = jax.random.split(rng)
      params, opt, loss, correct = step(params, opt, jax.device_put(batch, split), step_rng)
      loss_sum, correct_sum, steps = loss_sum + loss, correct_sum + correct, steps + 1
    loss_sum = float(loss_sum)
    if not np.isfinite(loss_sum):
      raise elastic.TrainingDiverged(f'training loss is {loss_sum} in epoch {epoch}')
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    hits = count = 0.0
    for _, batch in evals.epoch(0):
      h, c = evaluate(params, jax.device_put(batch, split))
      hits, count = hits + float(h), count + float(c)
    row = {'epoch': epoch, 'frozen_layers': 0, 'pipeline_length': 1, 'replicas': len(devices),
           'micro_batches': 1, 'cache': False, 'train_loss': loss_sum / steps,
           'train_accuracy': float(correct_sum) / (steps * train.batch_size),
           'eval_accuracy': hits / max(count, 1.0), 'epoch_seconds': seconds,
           'samples_per_second': steps * train.batch_size / seconds,
           'transition_seconds': 0.0, 'eval_seconds': time.perf_counter() - t0,
           'step': (epoch + 1) * steps, 'checkpointed': False,
           'wall_seconds': time.perf_counter() - run_start}
    metrics_log.append(row)
    print(f'epoch {epoch}: loss {row["train_loss"]:.4f} eval acc {row["eval_accuracy"]:.4f} '
          f'{seconds:.1f}s ({row["samples_per_second"]:.0f} samples/s)', flush=True)
  rows = metrics_log.rows
  summary = {'mode': 'plain_dp', 'task': 'vit', 'data': data.name, 'config': config.to_dict(),
             'devices': len(devices), 'platform': devices[0].platform,
             'num_layers': created.model.num_layers, 'eval_batch_size': eval_batch,
             'total_seconds': time.perf_counter() - start,
             'train_seconds': time.perf_counter() - run_start,
             'final_eval_accuracy': rows[-1]['eval_accuracy'],
             'best_eval_accuracy': max(r['eval_accuracy'] for r in rows),
             'final_train_loss': rows[-1]['train_loss'], 'transitions': [],
             'freeze_decisions': []}
  reporting.write_summary(workdir, summary)
  print(f'done in {summary["total_seconds"]:.1f}s: final eval accuracy '
        f'{summary["final_eval_accuracy"]:.4f}; outputs in {workdir}', flush=True)
  return summary


def main(argv=None) -> int:
  parsed = command_line.parse_command_line(vit_imagenet.__file__, argv, require_workdir=True)
  if parsed is None:
    return 2
  config, workdir = parsed
  try:
    run(config, workdir)
  except (elastic.KNOWN_ERRORS + (OSError,)) as e:  # OSError: the machine's files, a full disk
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  runtime.exit_now(main())
