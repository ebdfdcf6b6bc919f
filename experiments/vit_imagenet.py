"""Elastic ViT training, PipeTransformer-style: ``python -m experiments.vit_imagenet``.

With ImageNet prepared for TFDS (array_record) it trains ViT-B/16 on it;
otherwise it says so in one line and runs the embedded default: a 12-block ViT
on scikit-learn's digits, 8 fake CPU devices, starting at pipeline length 8.
``--config.data.name=synthetic`` measures speed on ImageNet-shaped random data
without a data set.

Flags: ``--config`` (this file by default; overrides such as
``--config.freeze.alpha=0.5``) and ``--workdir`` (default: a fresh folder
under ``./runs/``). ``--config.freeze.policy=none`` is the baseline: no
freezing, the static pipeline of the starting length. Run again with the same
``--workdir`` to resume from its newest checkpoint (``--config.resume=False``
starts over); SIGTERM/SIGINT saves after the current step and exits with code
75, a second signal aborts (130).
"""
from __future__ import annotations

from pipejax import runtime

if __name__ == '__main__':
  runtime.quiet_interrupt()  # a Ctrl-C while it starts: one line
runtime.setup(8)

# pylint: disable=wrong-import-position
import ml_collections  # noqa: E402

from experiments import command_line, datasets  # noqa: E402
from pipejax import autopipe  # noqa: E402


def get_config() -> ml_collections.ConfigDict:
  """The default configuration (locked: unknown keys are errors)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.data = ml_collections.ConfigDict()
  c.data.name = 'auto'  # 'auto': imagenet2012 if prepared, else digits; or 'synthetic'
  c.data.data_dir = ''
  c.data.image_size = datasets.DEFAULT_IMAGE_SIZE  # 224: ImageNet and synthetic; digits are 8x8
  c.data.workers = 0  # ImageNet: threads that read a batch (0: one per CPU core, at most 32)
  c.model = ml_collections.ConfigDict()
  c.model.kind = 'vit'
  c.model.preset = 'auto'  # 'auto': vit-b16 on ImageNet/synthetic, 'custom' (below) on digits
  c.model.pretrained = ''  # a local directory or HF cache name for from_pretrained
  c.model.hidden_size = 64
  c.model.num_layers = 12
  c.model.num_heads = 4
  c.model.intermediate_size = 128
  c.model.patch_size = 4
  c.model.dropout = 0.0
  # LeCun-scale init (HF's 0.02 is tuned for long pre-training, too small here).
  c.model.initializer_range = 1.0
  c.train = ml_collections.ConfigDict()
  c.train.epochs = 10
  c.train.batch_size = 32
  c.train.batch_mode = 'constant'  # or 'per_pipeline' (the paper: grows with R)
  c.train.learning_rate = 1e-3
  c.train.weight_decay = 0.05
  c.train.decay_biases_and_norms = True  # False: AdamW's decay spares biases and LayerNorms
  c.train.max_grad_norm = 0.0  # > 0: clip the trained parameters' gradient to this norm
  c.train.warmup_epochs = 0.25  # short: the first freeze decision comes after epoch 0
  c.train.max_steps_per_epoch = 0  # 0: whole epochs; > 0 caps them and evaluation (smoke runs)
  c.train.eval_batch_size = 0  # 0: 4 x the starting global batch (forward only)
  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.initial_length = 8
  c.pipeline.schedule = '1f1b'  # 'gpipe', or '1f1b-fused' (a forward and a backward a tick)
  c.pipeline.exchange = 'auto'  # a tick's messages: 'ppermute' or 'all_gather' (auto: by platform)
  c.pipeline.micro_batches = 0  # 0: profile M in {K, ..., 6K} once per K
  c.pipeline.profile_path = '~/.cache/pipejax/micro_batches.json'
  c.pipeline.devices = 8  # fake CPU devices when running on the CPU
  c.pipeline.autodp = True  # False (ablation): R stays 1, devices freed by compression idle
  # Let a stage boundary fall inside an MLP (between its dense layers) when
  # that lowers the largest stage's parameters by at least this fraction
  # (1: never). Ticks then also carry the MLP's inner activation.
  c.pipeline.split_mlp_min_gain = autopipe.SPLIT_MLP_MIN_GAIN
  c.freeze = ml_collections.ConfigDict()
  c.freeze.policy = 'pipetransformer'  # or 'schedule', 'none'
  c.freeze.alpha = 1 / 3
  c.freeze.timestep_steps = 0  # 0: a freeze timestep is an epoch; N > 0: every N steps
  c.freeze.min_active_layers = 1
  c.freeze.lambda_frozen = 1 / 6
  c.freeze.compress = True
  c.freeze.compile_ahead = True  # compile the predicted next plan while training
  # True: a freeze event that keeps K keeps the stages' slot width and reuses the
  # compiled step (fewer programs, but padded slots: K=8, F=8 steps 1.26x as long)
  c.freeze.keep_slot_width = False
  c.cache = ml_collections.ConfigDict()  # AutoCache of frozen-prefix activations
  c.cache.enabled = True
  c.cache.policy = 'profile'  # 'profile': cache a depth when measured faster; 'always'
  c.cache.dtype = 'float32'  # or 'bfloat16' / 'float16' (half the bytes, rounded)
  c.cache.memory_mb = 2048.0  # host memory for entries
  c.cache.disk_mb = 0.0  # then a disk file of up to this size (0: no disk tier)
  c.cache.directory = ''  # default: <workdir>/cache
  c.cache.on_mismatch = 'refuse'  # a cache directory of another run: 'refuse' or 'clear'
  c.cache.accept_reused_augmentation = False  # cache a randomly augmented prefix input anyway
  c.distributed = ml_collections.ConfigDict()  # several processes / hosts (docs/guide.md)
  c.distributed.coordinator = ''  # 'host:port' of process 0, 'auto' (SLURM, ...), '': one process
  c.distributed.num_processes = 1
  c.distributed.process_id = 0
  c.distributed.heartbeat_timeout_seconds = 100  # a silent process counts as dead after this
  c.distributed.initialization_timeout_seconds = 300
  c.distributed.data_shards = 0  # disjoint data shards (0: one per process)
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.enabled = True
  c.checkpoint.keep = 2
  c.checkpoint.every_steps = 0  # > 0: also save every N steps inside an epoch
  # Continue from workdir's newest checkpoint; False starts over (its outputs wait in
  # <workdir>/replaced until the new run's first checkpoint; back if it fails before).
  c.resume = True
  c.lock()
  return c


if __name__ == '__main__':
  runtime.exit_now(command_line.cli(__file__, task='vit'))
