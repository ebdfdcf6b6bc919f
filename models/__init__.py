"""Adapters from HuggingFace Flax transformers to :class:`LayeredModel`.

Use :func:`create` to get a model and its canonical parameters, either randomly
initialised from a config or loaded with ``from_pretrained`` from a local
directory or HF cache entry.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import logging
import types
from typing import Any

import jax
from transformers import BertConfig, ViTConfig

from models import bert, vit
from models import init_cache as init_cache_lib
from models.layered import LayeredModel, num_units

#: Named architectures (HF configs of the published models).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    'vit-b16': ('vit', dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                            intermediate_size=3072, image_size=224, patch_size=16,
                            num_labels=1000)),
    'vit-l16': ('vit', dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, image_size=224, patch_size=16,
                            num_labels=1000)),
    'bert-base': ('bert-classification', dict(hidden_size=768, num_hidden_layers=12,
                                              num_attention_heads=12, intermediate_size=3072,
                                              num_labels=2)),
    'bert-large': ('bert-question_answering', dict(hidden_size=1024, num_hidden_layers=24,
                                                   num_attention_heads=16,
                                                   intermediate_size=4096, num_labels=2)),
}

#: Model kinds: the HF Flax class and the HF config class of each.
KINDS = ('vit', 'bert-classification', 'bert-question_answering', 'bert-encoder')


@dataclasses.dataclass(frozen=True)
class Created:
  """A model with its canonical parameters and the HF class it mirrors."""
  model: LayeredModel
  params: Any
  hf_class: type


def _hf_class(kind: str):
  import transformers  # noqa: PLC0415 - heavy import kept local
  return {
      'vit': transformers.FlaxViTForImageClassification,
      'bert-classification': transformers.FlaxBertForSequenceClassification,
      'bert-question_answering': transformers.FlaxBertForQuestionAnswering,
      'bert-encoder': transformers.FlaxBertModel,
  }[kind]


def build(kind: str, hf_config) -> LayeredModel:
  """The :class:`LayeredModel` of model ``kind`` for an HF config."""
  if kind == 'vit':
    return vit.build(hf_config)
  if kind.startswith('bert-') and kind in KINDS:
    return bert.build(hf_config, head=kind[len('bert-'):])
  raise ValueError(f'unknown model kind {kind!r}; expected one of {KINDS}')


def config_for(kind: str, **overrides):
  """An HF config for ``kind`` (ViTConfig or BertConfig) with ``overrides``."""
  if kind not in KINDS:
    raise ValueError(f'unknown model kind {kind!r}; expected one of {KINDS}')
  return (ViTConfig if kind == 'vit' else BertConfig)(**overrides)


def create(kind: str, hf_config=None, *, pretrained: str | None = None, seed: int = 0,
           abstract: bool = False, num_labels: int | None = None,
           init_cache: str | None = None, log=print) -> Created:
  """Creates a layered model and its canonical parameters.

  Args:
    kind: one of :data:`KINDS`.
    hf_config: the HF config for random initialisation (ignored when
      ``pretrained`` is given, whose own config is used).
    pretrained: a local directory or HF hub name (resolved from the local HF
      cache) for ``from_pretrained``; PyTorch/safetensors weights are converted
      with ``from_pt=True`` when no Flax weights are present.
    seed: PRNG seed of the random initialisation (with ``pretrained``: of a
      new head's).
    num_labels: with ``pretrained``, a classifier size to use instead of the
      checkpoint's (a head of another size, or none, is then freshly
      initialised; one of this size is kept).
    abstract: return ``jax.ShapeDtypeStruct`` leaves instead of arrays (for
      planning without allocating the model).
    init_cache: a directory that keeps random initialisations (see
      :mod:`models.init_cache`: the same bits, read instead of recomputed);
      None initialises every time.
    log: where a cache problem, or a new head of a pretrained model
      (initialised from ``seed``), is reported (one line).

  Raises:
    ValueError: ``pretrained`` cannot be loaded, or would leave weights of
      the model other than a new head's at random (one line).
  """
  hf_class = _hf_class(kind)
  if pretrained is not None:
    hf = _from_pretrained(hf_class, pretrained, num_labels, seed, log)
    hf_config, hf_params = hf.config, hf.params
  else:
    if hf_config is None:
      raise ValueError('create() needs hf_config or pretrained')

    def init():  # the HF wrapper alone traces the whole init (1 s): built only when needed
      hf = hf_class(hf_config, seed=seed, _do_init=False)
      return hf.init_weights(jax.random.PRNGKey(seed), hf.input_shape)

    if abstract:
      model = build(kind, hf_config)
      return Created(model, jax.eval_shape(lambda: model.from_hf(init())), hf_class)
    hf_params = init_cache_lib.cached_init(
        init_cache, init_cache_lib.key(hf_class, hf_config, seed), init, log)
  model = build(kind, hf_config)
  params = model.from_hf(hf_params)
  return Created(model=model, params=params, hf_class=hf_class)


#: Flax weights as ``save_pretrained`` writes them: one file, or shards and their index.
FLAX_WEIGHTS = ('flax_model.msgpack', 'flax_model.msgpack.index.json')
#: PyTorch weights (``from_pt`` converts them), the same way.
PT_WEIGHTS = ('model.safetensors', 'model.safetensors.index.json', 'pytorch_model.bin',
              'pytorch_model.bin.index.json')


def has_flax_weights(path: str) -> bool | None:
  """Whether ``path`` holds Flax weights: a directory, or a hub name looked
  up in the local HF cache; None for a name whose cached entry holds no
  weights of either kind (or that the cache does not know)."""
  import os  # noqa: PLC0415
  if os.path.isdir(path):
    return any(os.path.exists(os.path.join(path, name)) for name in FLAX_WEIGHTS)
  if in_hf_cache(path, FLAX_WEIGHTS):
    return True
  # Not a valid repository name either: from_pretrained says what it is.
  return False if in_hf_cache(path, PT_WEIGHTS) else None


def in_hf_cache(name: str, files: tuple[str, ...]) -> bool:
  """Whether the local HF cache holds one of ``files`` of the hub name
  ``name`` (False for a name that is no valid repository name)."""
  from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415
  try:
    return any(isinstance(try_to_load_from_cache(name, file), str) for file in files)
  except ValueError:  # not a valid repository name
    return False


def _not_found_offline(path: str) -> bool:
  """Whether ``path`` names no folder and a hub model that the local HF cache
  lacks, while the Hub is offline (``HF_HUB_OFFLINE``: pipejax's default)."""
  import os  # noqa: PLC0415
  from huggingface_hub import constants  # noqa: PLC0415
  return (bool(constants.HF_HUB_OFFLINE) and not os.path.exists(os.path.expanduser(path))
          and not path.startswith(('/', '.', '~')) and not in_hf_cache(path, ('config.json',)))


#: Weights a checkpoint may lack, freshly initialised from the seed: the task
#: heads (a classifier of another size or none, a new QA head) and the
#: pooler (absent from masked-LM checkpoints), as HF initialises them.
NEW_WEIGHTS = ('classifier', 'qa_outputs', 'pooler')


class _LoadReport(logging.Handler):
  """Collects the warnings of HF's Flax loader (with the run's verbosity at
  ``error`` they would not be shown): they alone say which weights the
  checkpoint did not provide and HF initialised at random."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    self.messages.append(record.getMessage())


@contextlib.contextmanager
def _loader_warnings():
  """The warnings ``transformers.modeling_flax_utils`` gives inside the
  block, taken instead of printed."""
  logger = logging.getLogger('transformers.modeling_flax_utils')
  report = _LoadReport()
  level, propagate = logger.level, logger.propagate
  logger.setLevel(logging.WARNING)
  logger.propagate = False
  logger.addHandler(report)
  try:
    yield report.messages
  finally:
    logger.removeHandler(report)
    logger.setLevel(level)
    logger.propagate = propagate


def initialised_at_random(messages: list[str]) -> list[tuple[str, ...]]:
  """The weights that HF's loader said it initialised at random (missing
  from the checkpoint, or of another shape there), as key paths; raises
  ValueError where it said so in words this cannot read."""
  keys = []
  for message in messages:
    if 'newly initialized' not in message:
      continue
    first = message.splitlines()[0]
    if first.endswith('because the shapes did not match:'):
      found = [line[2:].split(': found shape')[0] for line in message.splitlines()[1:]
               if line.startswith('- ') and ': found shape' in line]
    else:
      found = [first.split('are newly initialized: ', 1)[-1]]
    try:
      for text in found:
        value = ast.literal_eval(text)
        keys.extend(value if isinstance(value, (set, list)) else [value])
    except (ValueError, SyntaxError):
      raise ValueError(f'transformers initialised weights at random: {first}') from None
    if not found:
      raise ValueError(f'transformers initialised weights at random: {first}')
  return sorted({tuple(str(part) for part in key) for key in keys})


def _new_head(hf_class, hf, num_labels: int, seed: int):
  """``(config, params)`` of ``hf`` with ``num_labels`` outputs, and the keys
  whose weights are new: those of the new config's model that ``hf`` lacks
  or holds in another shape, taken from its initialisation with ``seed`` (as
  HF's Flax loader takes a head of another size)."""
  from flax.core import unfreeze  # noqa: PLC0415
  from flax.traverse_util import flatten_dict, unflatten_dict  # noqa: PLC0415
  config = copy.deepcopy(hf.config)
  config.num_labels = num_labels  # its label names too
  model = hf_class(config, seed=seed, _do_init=False)
  initialised = flatten_dict(unfreeze(model.init_weights(jax.random.PRNGKey(seed),
                                                         model.input_shape)))
  params = flatten_dict(unfreeze(hf.params))
  new = [key for key, value in initialised.items()
         if key not in params or params[key].shape != value.shape]
  params = {key: params[key] if key not in new else initialised[key] for key in initialised}
  return types.SimpleNamespace(config=config, params=unflatten_dict(params)), new


def _from_pretrained(hf_class, path: str, num_labels: int | None = None, seed: int = 0,
                     log=print):
  """``hf_class.from_pretrained(path)``: Flax weights where the directory or
  the cached hub entry has them, else PyTorch/safetensors ones converted
  (``from_pt``); a name the cache does not know tries Flax weights first. A
  new head (see :data:`NEW_WEIGHTS`) is initialised from ``seed`` (said in one
  line); any other weight the checkpoint lacks or holds in another shape is
  refused (HF would initialise it at random with a warning)."""
  flax = has_flax_weights(path)
  extra = {} if num_labels is None else {'num_labels': num_labels,
                                         'ignore_mismatched_sizes': True}
  want = hf_class.config_class.model_type
  try:
    found = hf_class.config_class.get_config_dict(path)[0].get('model_type')
    if found not in (None, want):  # HF would only warn, then fail on the first batch
      raise ValueError(f'it holds a {found!r} model, not a {want!r} one')
    with _loader_warnings() as messages:
      hf = None
      if flax is None:
        try:
          hf = hf_class.from_pretrained(path, seed=seed, **extra)
        except OSError:  # no Flax weights there: the PyTorch ones, or HF's own error for them
          messages.clear()
      if hf is None:
        # HF's PyTorch converter refuses a head of another size (ignore_mismatched_sizes
        # reaches only its Flax loader): the checkpoint's head, then a new one.
        hf = hf_class.from_pretrained(path, from_pt=True, seed=seed) if not flax else \
            hf_class.from_pretrained(path, seed=seed, **extra)
    fresh = initialised_at_random(messages)
    if num_labels is not None and hf.config.num_labels != num_labels:
      hf, more = _new_head(hf_class, hf, num_labels, seed)
      fresh = sorted(set(fresh) | set(more))
  except MemoryError:
    raise
  except Exception as e:  # noqa: BLE001 - transformers, safetensors, msgpack, a missing torch
    if _not_found_offline(path):  # HF would say it could not connect, which it did not try
      raise ValueError(
          f'cannot load pretrained model from {path!r}: it is no local directory, and the local '
          f'HF cache holds no model of that name; download it into the HF cache where the Hub '
          f'can be reached (huggingface-cli download {path}) or give a local directory '
          f'(pipejax reads the Hub offline unless HF_HUB_OFFLINE=0)') from e
    text = str(e).strip()
    detail = text.splitlines()[0] if text else type(e).__name__
    raise ValueError(f'cannot load pretrained model from {path!r}: {detail}') from e
  lacking = ['/'.join(key) for key in fresh if not set(key) & set(NEW_WEIGHTS)]
  if lacking:
    raise ValueError(
        f'cannot load pretrained model from {path!r}: its weights do not fit a '
        f'{hf_class.__name__} of its config: {len(lacking)} would be random ('
        f'{", ".join(lacking[:3])}{", ..." if len(lacking) > 3 else ""})')
  if fresh:
    parts = sorted({next(p for p in key if p in NEW_WEIGHTS) for key in fresh})
    log(f'pretrained {path}: {" and ".join(parts)} initialised from seed {seed} (not in the '
        f'checkpoint, or of another size)')
  return hf


__all__ = ['Created', 'KINDS', 'LayeredModel', 'PRESETS', 'build', 'config_for', 'create',
           'num_units']
