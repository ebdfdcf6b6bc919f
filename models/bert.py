"""HuggingFace Flax BERT (sequence classification, question answering, bare
encoder) as a :class:`LayeredModel`.

The BERT block is post-LN (``modeling_flax_bert.FlaxBertLayer``)::

  attention sub-layer:  LN(h + SelfOutput(SelfAttention(h, attention_mask)))
  mlp sub-layer:        LN(h + Output(Intermediate(h)))

Both sub-layers include their residual. ``attention_mask [batch, seq]`` is read
by every attention sub-layer from the batch, and ``token_type_ids`` by the
embedding, so both reach every stage of a pipeline.
"""
from __future__ import annotations

import jax.numpy as jnp
import flax.linen as nn
from transformers import BertConfig
from transformers.models.bert import modeling_flax_bert as hf_bert

from models import layered

#: The heads this adapter knows: HF top-level key of the encoder, head keys.
HEADS = ('classification', 'question_answering', 'encoder')


def build(config: BertConfig, head: str = 'classification') -> layered.LayeredModel:
  """Builds the layered view of a Flax BERT model.

  Args:
    config: the HF ``BertConfig``.
    head: ``'classification'`` (``FlaxBertForSequenceClassification``; labels
      ``labels [batch]``: integer classes, or with ``config.num_labels == 1``
      float targets of a regression trained with mean squared error, as HF's
      PyTorch BERT does), ``'question_answering'``
      (``FlaxBertForQuestionAnswering``; labels ``start_positions``,
      ``end_positions [batch]``) or ``'encoder'`` (``FlaxBertModel``; the
      "logits" are the last hidden states and the pooled output, no loss).
  """
  if head not in HEADS:
    raise ValueError(f'unknown BERT head {head!r}; expected one of {HEADS}')
  embeddings = hf_bert.FlaxBertEmbeddings(config)
  # As HF's FlaxBertLayer builds it: a decoder's self-attention is causal.
  attention = hf_bert.FlaxBertAttention(config, causal=bool(config.is_decoder))
  intermediate = hf_bert.FlaxBertIntermediate(config)
  output = hf_bert.FlaxBertOutput(config)
  pooler = hf_bert.FlaxBertPooler(config)
  dropout_rate = (config.classifier_dropout if getattr(config, 'classifier_dropout', None)
                  is not None else config.hidden_dropout_prob)
  dropout = nn.Dropout(rate=dropout_rate)
  dense = nn.Dense(config.num_labels)
  encoder_key = None if head == 'encoder' else 'bert'

  def embed_fn(params, batch, rng, train):
    input_ids = batch['input_ids']
    position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
    return embeddings.apply({'params': params}, input_ids, batch['token_type_ids'],
                            position_ids, batch['attention_mask'],
                            deterministic=not train, rngs=layered.dropout_rngs(rng, train))

  def attention_fn(params, hidden, batch, rng, train):
    return attention.apply({'params': params}, hidden, batch['attention_mask'], None,
                           deterministic=not train, rngs=layered.dropout_rngs(rng, train))[0]

  def mlp_in_fn(params, hidden, batch, rng, train):
    del batch, rng, train  # no dropout before the output layer
    return intermediate.apply({'params': params['intermediate']}, hidden)

  def mlp_out_fn(params, inner, hidden, batch, rng, train):
    del batch
    return output.apply({'params': params['output']}, inner, hidden,
                        deterministic=not train, rngs=layered.dropout_rngs(rng, train))

  def logits_fn(params, hidden, batch, rng, train):
    del batch
    if head == 'encoder':
      return hidden, pooler.apply({'params': params['pooler']}, hidden)
    if head == 'question_answering':
      logits = dense.apply({'params': params['qa_outputs']}, hidden)
      start, end = jnp.split(logits, config.num_labels, axis=-1)
      return start.squeeze(-1), end.squeeze(-1)
    pooled = pooler.apply({'params': params['pooler']}, hidden)
    pooled = dropout.apply({}, pooled, deterministic=not train,
                           rngs=layered.dropout_rngs(rng, train))
    return dense.apply({'params': params['classifier']}, pooled)

  def loss_fn(params, hidden, batch, rng, train):
    if head == 'encoder':
      raise ValueError("the 'encoder' head has no loss; use 'classification' or "
                       "'question_answering' to train")
    outputs = logits_fn(params, hidden, batch, rng, train)
    if head == 'classification':
      labels = batch['labels']
      mask = batch.get('example_mask')
      if config.num_labels == 1:
        return (layered.mean_squared_error(outputs, labels, mask),
                layered.regression_metrics(outputs, labels, mask))
      return (layered.softmax_cross_entropy(outputs, labels, mask),
              layered.classification_metrics(outputs, labels, mask))
    start_logits, end_logits = outputs
    mask = batch.get('example_mask')
    mask = (jnp.ones(start_logits.shape[0], jnp.float32) if mask is None
            else mask.astype(jnp.float32))
    # As HF's BertForQuestionAnswering: a position outside the sequence is
    # clamped to its length, and that position's loss is left out (the mean
    # is over the others); it can never be predicted exactly. The pipeline
    # weighs micro-batches by their real examples, so with such positions its
    # loss is that of gradient accumulation over the micro-batches, not
    # exactly this function's over the whole batch.
    length = start_logits.shape[-1]
    start = jnp.clip(batch['start_positions'], 0, length)
    end = jnp.clip(batch['end_positions'], 0, length)

    def position_loss(logits, position):
      inside = (position < length).astype(jnp.float32)
      return layered.softmax_cross_entropy(logits, jnp.minimum(position, length - 1),
                                           mask * inside)

    loss = 0.5 * (position_loss(start_logits, start) + position_loss(end_logits, end))
    both = (jnp.argmax(start_logits, -1) == start) & (jnp.argmax(end_logits, -1) == end)
    return loss, {'correct': jnp.sum(both * mask), 'count': jnp.sum(mask)}

  def _encoder(hf):
    return hf if encoder_key is None else hf[encoder_key]

  def hf_to_canonical(hf):
    enc = _encoder(hf)
    layers = enc['encoder']['layer']
    blocks = [layers[str(i)] for i in range(config.num_hidden_layers)]
    if head == 'question_answering':
      head_params = {'qa_outputs': hf['qa_outputs']}
    elif head == 'classification':
      head_params = {'pooler': enc['pooler'], 'classifier': hf['classifier']}
    else:
      head_params = {'pooler': enc['pooler']}
    return {
        'embed': enc['embeddings'],
        'attention': layered.stack_trees([b['attention'] for b in blocks]),
        'mlp': layered.stack_trees([{'intermediate': b['intermediate'], 'output': b['output']}
                                    for b in blocks]),
        'head': head_params,
    }

  def canonical_to_hf(params):
    n = config.num_hidden_layers
    attn = layered.unstack_tree(params['attention'], n)
    mlp = layered.unstack_tree(params['mlp'], n)
    enc = {'embeddings': params['embed'],
           'encoder': {'layer': {str(i): {'attention': attn[i], **mlp[i]} for i in range(n)}}}
    if 'pooler' in params['head']:
      enc['pooler'] = params['head']['pooler']
    if encoder_key is None:
      return enc
    out = {encoder_key: enc}
    for key in ('classifier', 'qa_outputs'):
      if key in params['head']:
        out[key] = params['head'][key]
    return out

  return layered.LayeredModel(
      name=f'bert-{head}', hf_config=config, num_layers=config.num_hidden_layers,
      input_keys=('input_ids', 'attention_mask', 'token_type_ids'),
      label_keys={'classification': ('labels',),
                  'question_answering': ('start_positions', 'end_positions'),
                  'encoder': ()}[head],
      block_keys=('attention_mask',), embed_fn=layered.unit(embed_fn, 3),
      attention_fn=layered.unit(attention_fn, 4),
      mlp_fn=layered.unit(layered.mlp_of_halves(mlp_in_fn, mlp_out_fn), 4),
      logits_fn=layered.unit(logits_fn, 4), loss_fn=layered.unit(loss_fn, 4),
      hf_to_canonical=hf_to_canonical, canonical_to_hf=canonical_to_hf,
      mlp_in_fn=layered.unit(mlp_in_fn, 4), mlp_out_fn=layered.unit(mlp_out_fn, 5),
      mlp_in_keys=('intermediate',))

