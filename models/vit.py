"""HuggingFace ``FlaxViTForImageClassification`` as a :class:`LayeredModel`.

The ViT block is pre-LN (``modeling_flax_vit.FlaxViTLayer``)::

  attention sub-layer:  h + Attention(LN_before(h))
  mlp sub-layer:        h + Output(Intermediate(LN_after(h)))

The head is the final LayerNorm and the classifier on the CLS token. Inputs are
``pixel_values [batch, height, width, channels]`` (NHWC, as the Flax module
takes them; the HF wrapper transposes from NCHW) and ``labels [batch]``.
"""
from __future__ import annotations

import flax.linen as nn
from transformers import ViTConfig
from transformers.models.vit import modeling_flax_vit as hf_vit

from models import layered

_ATTENTION_KEYS = ('attention', 'layernorm_before')
_MLP_KEYS = ('intermediate', 'output', 'layernorm_after')


def build(config: ViTConfig) -> layered.LayeredModel:
  """Builds the layered view of ``FlaxViTForImageClassification(config)``."""
  layer_norm = nn.LayerNorm(epsilon=config.layer_norm_eps)
  embeddings = hf_vit.FlaxViTEmbeddings(config)
  attention = hf_vit.FlaxViTAttention(config)
  intermediate = hf_vit.FlaxViTIntermediate(config)
  output = hf_vit.FlaxViTOutput(config)
  classifier = nn.Dense(config.num_labels)

  def embed_fn(params, batch, rng, train):
    return embeddings.apply({'params': params}, batch['pixel_values'],
                            deterministic=not train, rngs=layered.dropout_rngs(rng, train))

  def attention_fn(params, hidden, batch, rng, train):
    del batch
    normed = layer_norm.apply({'params': params['layernorm_before']}, hidden)
    out = attention.apply({'params': params['attention']}, normed,
                          deterministic=not train, rngs=layered.dropout_rngs(rng, train))[0]
    return out + hidden

  def mlp_in_fn(params, hidden, batch, rng, train):
    del batch, rng, train  # no dropout before the output layer
    normed = layer_norm.apply({'params': params['layernorm_after']}, hidden)
    return intermediate.apply({'params': params['intermediate']}, normed)

  def mlp_out_fn(params, inner, hidden, batch, rng, train):
    del batch
    return output.apply({'params': params['output']}, inner, hidden,
                        deterministic=not train, rngs=layered.dropout_rngs(rng, train))

  def logits_fn(params, hidden, batch, rng, train):
    del batch, rng, train
    normed = layer_norm.apply({'params': params['layernorm']}, hidden)
    return classifier.apply({'params': params['classifier']}, normed[:, 0, :])

  def loss_fn(params, hidden, batch, rng, train):
    logits = logits_fn(params, hidden, batch, rng, train)
    labels, mask = batch['labels'], batch.get('example_mask')
    return (layered.softmax_cross_entropy(logits, labels, mask),
            layered.classification_metrics(logits, labels, mask))

  def hf_to_canonical(hf):
    layers = hf['vit']['encoder']['layer']
    blocks = [layers[str(i)] for i in range(config.num_hidden_layers)]
    return {
        'embed': hf['vit']['embeddings'],
        'attention': layered.stack_trees([{k: b[k] for k in _ATTENTION_KEYS} for b in blocks]),
        'mlp': layered.stack_trees([{k: b[k] for k in _MLP_KEYS} for b in blocks]),
        'head': {'layernorm': hf['vit']['layernorm'], 'classifier': hf['classifier']},
    }

  def canonical_to_hf(params):
    n = config.num_hidden_layers
    attn = layered.unstack_tree(params['attention'], n)
    mlp = layered.unstack_tree(params['mlp'], n)
    return {
        'vit': {
            'embeddings': params['embed'],
            'encoder': {'layer': {str(i): {**attn[i], **mlp[i]} for i in range(n)}},
            'layernorm': params['head']['layernorm'],
        },
        'classifier': params['head']['classifier'],
    }

  return layered.LayeredModel(
      name='vit', hf_config=config, num_layers=config.num_hidden_layers,
      input_keys=('pixel_values',), label_keys=('labels',),
      block_keys=(), embed_fn=layered.unit(embed_fn, 3),
      attention_fn=layered.unit(attention_fn, 4),
      mlp_fn=layered.unit(layered.mlp_of_halves(mlp_in_fn, mlp_out_fn), 4),
      logits_fn=layered.unit(logits_fn, 4), loss_fn=layered.unit(loss_fn, 4),
      hf_to_canonical=hf_to_canonical, canonical_to_hf=canonical_to_hf,
      mlp_in_fn=layered.unit(mlp_in_fn, 4), mlp_out_fn=layered.unit(mlp_out_fn, 5),
      mlp_in_keys=('layernorm_after', 'intermediate'))
