"""A layered view of a transformer: embed, 2·L residual sub-layers, head.

Every adapter in :mod:`models` turns a HuggingFace Flax model into a
:class:`LayeredModel`. The model is a chain of *units*:

``unit 0``            the embedding (patches / tokens → ``[batch, seq, hidden]``)
``unit 1 + 2·i``      the attention sub-layer of block ``i`` (with its residual)
``unit 2 + 2·i``      the MLP sub-layer of block ``i`` (with its residual)
``unit 2·L + 1``      the head (final norm / pooler, classifier, loss, metrics)

Because each sub-layer carries its own residual, a stage boundary between two
units never cuts a skip connection (paper §3.2.1, Algorithm 1 lines 6-9).

Parameters live in a *canonical* tree ``{'embed', 'attention', 'mlp', 'head'}``
where ``attention`` and ``mlp`` are the per-block trees stacked on a leading
axis of length L. :meth:`LayeredModel.from_hf` / :meth:`LayeredModel.to_hf`
convert to and from the HF parameter tree exactly (no copies are changed), so
HF checkpoints load and save unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

Params = Any
Batch = Mapping[str, jax.Array]


def num_units(num_layers: int) -> int:
  """Number of pipeline units of a model with ``num_layers`` blocks (2L + 2)."""
  return 2 * num_layers + 2


def stack_trees(trees: list[Params]) -> Params:
  """Stacks identically-structured trees on a new leading axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack_tree(tree: Params, n: int) -> list[Params]:
  """Inverse of :func:`stack_trees` for a leading axis of length ``n``."""
  return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class LayeredModel:
  """Functional, layer-by-layer view of a transformer.

  Attributes:
    name: short model identifier, e.g. ``'vit'``, ``'bert-cls'``.
    hf_config: the HF config the model was built from.
    num_layers: L, the number of transformer blocks.
    input_keys: batch keys the embedding and every block may read (model
      inputs, e.g. ``('pixel_values',)`` or ``('input_ids', 'attention_mask',
      'token_type_ids')``).
    label_keys: batch keys the head reads for the loss.
    block_keys: the input keys the blocks (not only the embedding) read, e.g.
      BERT's ``attention_mask``; they travel with activations through the
      pipeline and the frozen-prefix cache.
    embed_fn: ``(embed_params, batch, rng, train) -> hidden [b, seq, d]``.
    attention_fn: ``(attn_params, hidden, batch, rng, train) -> hidden``,
      one attention sub-layer including its residual.
    mlp_fn: ``(mlp_params, hidden, batch, rng, train) -> hidden``, one MLP
      sub-layer including its residual.
    logits_fn: ``(head_params, hidden, batch, rng, train) -> outputs``, what the
      HF model returns as logits (a tuple for QA: start and end logits).
    loss_fn: ``(head_params, hidden, batch, rng, train) -> (loss, metrics)``;
      ``loss`` is the mean over the batch's real examples (rows whose
      ``example_mask`` is 0, the padding of a last batch, left out: see
      :func:`masked_mean`), ``metrics`` a dict of *sums* over them (e.g.
      ``correct``, ``count``), so they add over micro-batches. The pipeline
      weights each micro-batch's loss by its real examples, so its loss and
      gradients are those of the mean over the whole batch's real examples.
      Every head reports ``count``; classifiers report ``correct``, a
      regression head (BERT with one output) ``squared_error`` instead.
    hf_to_canonical / canonical_to_hf: exact parameter-tree conversions.
    mlp_in_fn / mlp_out_fn / mlp_in_keys: the MLP sub-layer in two halves, so
      that a stage boundary may fall between its two dense layers (AutoPipe's
      ``split_mlp``): ``mlp_in_fn(mlp_params, hidden, batch, rng, train) ->
      inner [b, seq, intermediate]`` (norm, first dense layer, activation),
      ``mlp_out_fn(mlp_params, inner, hidden, batch, rng, train) -> hidden``
      (second dense layer, dropout, residual), and ``mlp_out_fn(p, mlp_in_fn(p,
      h, ...), h, ...)`` is exactly ``mlp_fn(p, h, ...)``. ``mlp_in_keys``
      names the top-level keys of the MLP tree that the first half reads; the
      others belong to the second. None / () where a model has no split.
  """

  name: str
  hf_config: Any
  num_layers: int
  input_keys: tuple[str, ...]
  label_keys: tuple[str, ...]
  block_keys: tuple[str, ...]
  embed_fn: Callable[..., jax.Array]
  attention_fn: Callable[..., jax.Array]
  mlp_fn: Callable[..., jax.Array]
  logits_fn: Callable[..., Any]
  loss_fn: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
  hf_to_canonical: Callable[[Params], Params]
  canonical_to_hf: Callable[[Params], Params]
  mlp_in_fn: Callable[..., jax.Array] | None = None
  mlp_out_fn: Callable[..., jax.Array] | None = None
  mlp_in_keys: tuple[str, ...] = ()

  @property
  def can_split_mlp(self) -> bool:
    """Whether a stage boundary may fall inside an MLP sub-layer."""
    return bool(self.mlp_in_fn and self.mlp_out_fn and self.mlp_in_keys)

  @property
  def num_units(self) -> int:
    """Units in the chain: embed + 2·L sub-layers + head."""
    return num_units(self.num_layers)

  def from_hf(self, hf_params: Params) -> Params:
    """HF parameter tree → canonical tree (blocks stacked on axis 0)."""
    return self.hf_to_canonical(hf_params)

  def to_hf(self, params: Params) -> Params:
    """Canonical tree → HF parameter tree, exactly inverting :meth:`from_hf`."""
    return self.canonical_to_hf(params)

  def sublayer(self, params: Params, unit: int, hidden: jax.Array, batch: Batch,
               rng: jax.Array | None = None, train: bool = False) -> jax.Array:
    """Applies sub-layer ``unit`` (1 ≤ unit ≤ 2L) with canonical ``params``."""
    layer, kind = divmod(unit - 1, 2)
    stack = params['attention'] if kind == 0 else params['mlp']
    fn = self.attention_fn if kind == 0 else self.mlp_fn
    return fn(jax.tree.map(lambda x: x[layer], stack), hidden, batch, rng, train)

  def hidden_states(self, params: Params, batch: Batch, *, upto_layer: int | None = None,
                    rng: jax.Array | None = None, train: bool = False) -> jax.Array:
    """Plain sequential forward through embed and the first ``upto_layer`` blocks.

    Returns ``[batch, seq, hidden]``. ``upto_layer=None`` runs all L blocks.
    """
    upto_layer = self.num_layers if upto_layer is None else upto_layer
    hidden = self.embed_fn(params['embed'], batch, unit_rng(rng, 0), train)
    for unit in range(1, 2 * upto_layer + 1):
      hidden = self.sublayer(params, unit, hidden, batch, unit_rng(rng, unit), train)
    return hidden

  def logits(self, params: Params, batch: Batch) -> Any:
    """Sequential inference forward; equals the HF model's logits."""
    hidden = self.hidden_states(params, batch)
    return self.logits_fn(params['head'], hidden, batch, None, False)

  def loss(self, params: Params, batch: Batch, rng: jax.Array | None = None,
           train: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sequential reference loss (mean over the batch's real examples) and
    summed metrics."""
    hidden = self.hidden_states(params, batch, rng=rng, train=train)
    return self.loss_fn(params['head'], hidden, batch, unit_rng(rng, self.num_units - 1), train)


def unit(fn: Callable, train_argnum: int) -> Callable:
  """``fn`` as its own jitted function (``train`` static).

  Every program that calls a unit (a pipelined step of any plan, the frozen
  prefix, the cache advance, evaluation) then reuses one trace of it per input
  shape instead of tracing the HF Flax modules again, and lowers it once per
  program however many slots call it. XLA inlines the call: the compiled
  arithmetic is the same.
  """
  return jax.jit(fn, static_argnums=(train_argnum,))


def dropout_rngs(rng: jax.Array | None, train: bool) -> dict[str, jax.Array]:
  """The ``rngs`` of a Flax module's ``apply``: ``rng`` for dropout while
  training, none otherwise."""
  return {'dropout': rng} if (train and rng is not None) else {}


def mlp_of_halves(mlp_in_fn: Callable, mlp_out_fn: Callable) -> Callable:
  """The whole MLP sub-layer from its two halves:
  ``mlp_out(mlp_in(hidden), hidden)``, as :class:`LayeredModel` requires."""
  def mlp_fn(params, hidden, batch, rng, train):
    inner = mlp_in_fn(params, hidden, batch, rng, train)
    return mlp_out_fn(params, inner, hidden, batch, rng, train)
  return mlp_fn


def unit_rng(rng: jax.Array | None, unit: int) -> jax.Array | None:
  """The dropout key of one unit: the same wherever the unit runs."""
  return None if rng is None else jax.random.fold_in(rng, unit)


def masked_mean(values: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Mean of ``values [b]`` over the rows where ``mask [b]`` is 1 (all rows
  without a mask); 0 when no row counts. Padded rows (``example_mask`` 0) are
  left out, whatever they hold (a NaN of an out-of-range label too)."""
  if mask is None:
    return jnp.mean(values)
  keep = mask > 0
  return (jnp.sum(jnp.where(keep, values, 0.0))
          / jnp.maximum(jnp.sum(keep.astype(values.dtype)), 1.0))


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array,
                          mask: jax.Array | None = None) -> jax.Array:
  """Mean cross-entropy of ``logits [b, classes]`` against integer ``labels [b]``
  over the rows ``mask [b]`` keeps (see :func:`masked_mean`)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, labels[:, None].astype(jnp.int32), axis=-1)[:, 0]
  return -masked_mean(picked, mask)


def classification_metrics(logits: jax.Array, labels: jax.Array,
                           mask: jax.Array | None = None) -> dict[str, jax.Array]:
  """Summed ``correct`` predictions and example ``count`` (add over
  micro-batches); ``mask [batch]`` (1 = real example) drops padding."""
  mask = jnp.ones(labels.shape[0], jnp.float32) if mask is None else mask.astype(jnp.float32)
  correct = jnp.sum((jnp.argmax(logits, axis=-1) == labels) * mask)
  return {'correct': correct, 'count': jnp.sum(mask)}


def mean_squared_error(predictions: jax.Array, targets: jax.Array,
                       mask: jax.Array | None = None) -> jax.Array:
  """Mean squared error of ``predictions [b, 1]`` (or ``[b]``) against float
  ``targets [b]`` (HF's regression loss for a one-output classifier), over the
  rows ``mask [b]`` keeps (see :func:`masked_mean`)."""
  predictions = predictions.astype(jnp.float32).reshape(targets.shape)
  return masked_mean(jnp.square(predictions - targets.astype(jnp.float32)), mask)


def regression_metrics(predictions: jax.Array, targets: jax.Array,
                       mask: jax.Array | None = None) -> dict[str, jax.Array]:
  """Summed ``squared_error`` and example ``count`` (add over micro-batches);
  ``mask [batch]`` (1 = real example) drops padding. No ``correct``: a
  regression has no accuracy."""
  mask = jnp.ones(targets.shape[0], jnp.float32) if mask is None else mask.astype(jnp.float32)
  error = predictions.astype(jnp.float32).reshape(targets.shape) - targets.astype(jnp.float32)
  return {'squared_error': jnp.sum(jnp.square(error) * mask), 'count': jnp.sum(mask)}
