"""The layered view of each HF model equals the HF model itself."""
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests import fixtures


@pytest.mark.parametrize('kind', ['vit', 'bert-classification', 'bert-regression',
                                  'bert-question_answering'])
def test_layered_logits_equal_hf(kind):
  created = fixtures.tiny(kind)
  batch = fixtures.batch(kind, created.model, 4, seed=1)
  hf_model = created.hf_class(created.model.hf_config, _do_init=False)
  hf_params = created.model.to_hf(created.params)
  if kind == 'vit':
    # The HF wrapper takes NCHW and transposes; the module takes NHWC.
    ref = hf_model(np.transpose(batch['pixel_values'], (0, 3, 1, 2)), params=hf_params).logits
  else:
    out = hf_model(batch['input_ids'], batch['attention_mask'], batch['token_type_ids'],
                   params=hf_params)
    ref = (out.start_logits, out.end_logits) if kind == 'bert-question_answering' else out.logits
  ours = jax.jit(created.model.logits)(created.params, batch)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_bert_decoder_attends_causally_as_hf_does():
  """``is_decoder=True``: HF's layers mask attention to later tokens, and so
  do the layered model's (the last token reaches no earlier output)."""
  from transformers import FlaxBertModel  # noqa: PLC0415
  kind = 'bert-classification'
  config = models.config_for(kind, **fixtures.TINY['bert'], is_decoder=True)
  created = models.create(kind, config, seed=0)
  batch = fixtures.batch(kind, created.model, 2, seed=1)
  batch = dict(batch, attention_mask=np.ones_like(batch['attention_mask']))
  hidden = np.asarray(created.model.hidden_states(created.params, batch, upto_layer=4))
  ref = FlaxBertModel(config, _do_init=False)(
      batch['input_ids'], batch['attention_mask'], batch['token_type_ids'],
      params=created.model.to_hf(created.params)['bert']).last_hidden_state
  np.testing.assert_allclose(hidden, ref, atol=1e-5, rtol=0)
  ids = np.array(batch['input_ids'])
  ids[:, -1] = (ids[:, -1] + 1) % fixtures.TINY['bert']['vocab_size']
  later = np.asarray(created.model.hidden_states(created.params, dict(batch, input_ids=ids),
                                                 upto_layer=4))
  np.testing.assert_allclose(later[:, :-1], hidden[:, :-1], atol=1e-6, rtol=0)
  assert not np.allclose(later[:, -1], hidden[:, -1])


@pytest.mark.parametrize('kind', ['vit', 'bert-classification', 'bert-question_answering'])
def test_hf_tree_round_trip_is_exact(kind):
  created = fixtures.tiny(kind)
  hf_params = created.hf_class(created.model.hf_config, seed=3).params
  back = created.model.to_hf(created.model.from_hf(hf_params))
  assert jax.tree.structure(back) == jax.tree.structure(hf_params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(hf_params), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('kind', ['vit', 'bert-classification'])
def test_mlp_halves_compose_to_the_mlp_sub_layer(kind):
  """What a stage boundary inside an MLP runs: the second half on the first
  half's inner activation is the whole sub-layer, with dropout's mask too;
  each half reads only its own keys (the other's are NaN here)."""
  created = fixtures.tiny(kind, dropout=0.3)
  model = created.model
  assert model.can_split_mlp
  mlp = jax.tree.map(lambda x: x[1], created.params['mlp'])
  hidden = jax.random.normal(jax.random.PRNGKey(0), (2, 5, model.hf_config.hidden_size))
  batch = {'attention_mask': np.ones((2, 5), np.int32)}
  rng = jax.random.PRNGKey(3)
  only = lambda keep: {k: (v if k in keep else jax.tree.map(lambda x: x * np.nan, v))  # noqa: E731
                       for k, v in mlp.items()}
  first = only(model.mlp_in_keys)
  second = only(set(mlp) - set(model.mlp_in_keys))
  for train in (False, True):
    inner = model.mlp_in_fn(first, hidden, batch, rng, train)
    assert inner.shape == (2, 5, model.hf_config.intermediate_size)
    got = model.mlp_out_fn(second, inner, hidden, batch, rng, train)
    want = model.mlp_fn(mlp, hidden, batch, rng, train)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  dropped = model.mlp_fn(mlp, hidden, batch, rng, True)
  assert not np.allclose(dropped, model.mlp_fn(mlp, hidden, batch, rng, False))


def test_regression_head_loss_is_mse_of_the_hf_logits():
  """STS-B's head (one output): the loss is the mean squared error of HF's
  own logit against the float labels, computed independently in numpy; the
  metrics are sums (no accuracy) that honour ``example_mask``."""
  created = fixtures.tiny('bert-regression')
  model = created.model
  assert model.hf_config.num_labels == 1
  batch = fixtures.batch('bert-regression', model, 6, seed=4)
  assert batch['labels'].dtype == np.float32
  hf_model = created.hf_class(model.hf_config, _do_init=False)
  logits = np.asarray(hf_model(batch['input_ids'], batch['attention_mask'],
                               batch['token_type_ids'], params=model.to_hf(created.params)).logits,
                      np.float64)
  assert logits.shape == (6, 1)
  error = logits[:, 0] - batch['labels'].astype(np.float64)
  loss, metrics = jax.jit(model.loss)(created.params, batch)
  assert set(metrics) == {'squared_error', 'count'}
  np.testing.assert_allclose(float(loss), np.mean(error ** 2), rtol=1e-5)
  np.testing.assert_allclose(float(metrics['squared_error']), np.sum(error ** 2), rtol=1e-5)
  assert float(metrics['count']) == 6
  mask = np.array([1, 1, 0, 1, 0, 1], np.float32)
  _, masked = jax.jit(model.loss)(created.params, {**batch, 'example_mask': mask})
  np.testing.assert_allclose(float(masked['squared_error']), np.sum(mask * error ** 2),
                             rtol=1e-5)
  assert float(masked['count']) == 4
  # The gradient of the head's bias is the mean of 2·error (d/db of the MSE).
  grads = jax.grad(lambda p: model.loss(p, batch)[0])(created.params)
  np.testing.assert_allclose(np.asarray(grads['head']['classifier']['bias']),
                             [2 * np.mean(error)], rtol=1e-4)


@pytest.mark.parametrize('kind', ['vit', 'bert-classification'])
def test_classification_loss_is_cross_entropy_of_the_hf_logits(kind):
  """The classifier's loss is the softmax cross-entropy of HF's own logits
  (a float64 numpy log-softmax) over the rows ``example_mask`` keeps, whose
  masked rows hold labels the head lacks (NaN if they leaked); ``correct``
  counts the kept rows whose label is the argmax, never a masked one, even a
  masked row labelled right. The head bias's gradient is the mean of
  softmax - one-hot over the kept rows."""
  created = fixtures.tiny(kind)
  model = created.model
  classes = model.hf_config.num_labels
  batch = fixtures.batch(kind, model, 8, seed=6)
  hf_model = created.hf_class(model.hf_config, _do_init=False)
  hf_params = model.to_hf(created.params)
  if kind == 'vit':  # the HF wrapper takes NCHW
    out = hf_model(np.transpose(batch['pixel_values'], (0, 3, 1, 2)), params=hf_params)
  else:
    out = hf_model(batch['input_ids'], batch['attention_mask'], batch['token_type_ids'],
                   params=hf_params)
  logits = np.asarray(out.logits, np.float64)
  assert logits.shape == (8, classes)
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.sum(np.exp(logits - top), -1, keepdims=True))
  probs = np.exp(logp)
  predicted = np.argmax(logits, -1)
  # Rows 0, 3, 6 labelled right, the others wrong (a class other than the argmax).
  labels = np.where(np.isin(np.arange(8), [0, 3, 6]), predicted,
                    (predicted + 1 + np.arange(8) % (classes - 1)) % classes).astype(np.int32)
  assert np.sum(labels == predicted) == 3
  rows = np.arange(8)

  def reference(keep):
    loss = -np.mean(logp[rows[keep], labels[keep]])
    bias_grad = np.mean(probs[keep] - np.eye(classes)[labels[keep]], axis=0)
    return loss, float(np.sum(labels[keep] == predicted[keep])), bias_grad

  loss_fn = jax.jit(jax.value_and_grad(lambda p, b: model.loss(p, b), has_aux=True))
  (loss, metrics), grads = loss_fn(created.params, {**batch, 'labels': labels})
  want_loss, want_correct, want_grad = reference(np.ones(8, bool))
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  assert (float(metrics['correct']), float(metrics['count'])) == (want_correct, 8.0)
  np.testing.assert_allclose(np.asarray(grads['head']['classifier']['bias']), want_grad,
                             atol=1e-6, rtol=1e-4)
  # Masked rows 2, 5 (wrong) and 6 (right): labels out of range, then right.
  mask = np.array([1, 1, 0, 1, 1, 0, 0, 1], np.float32)
  keep = mask > 0
  want_loss, want_correct, want_grad = reference(keep)
  assert want_correct == 2.0  # rows 0 and 3; row 6 is masked
  for poison in (classes + 7, predicted):
    poisoned = np.where(keep, labels, poison).astype(np.int32)
    (loss, metrics), grads = loss_fn(created.params,
                                     {**batch, 'labels': poisoned, 'example_mask': mask})
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    assert (float(metrics['correct']), float(metrics['count'])) == (want_correct, 5.0)
    np.testing.assert_allclose(np.asarray(grads['head']['classifier']['bias']), want_grad,
                               atol=1e-6, rtol=1e-4)


def test_question_answering_counts_an_example_right_only_unmasked():
  """SQuAD's head: an example is right when both its start and its end are
  the argmax of HF's own logits; padding (``example_mask`` 0) is never
  counted, right or not."""
  created = fixtures.tiny('bert-question_answering')
  model = created.model
  batch = fixtures.batch('bert-question_answering', model, 6, seed=4)
  hf_model = created.hf_class(model.hf_config, _do_init=False)
  out = hf_model(batch['input_ids'], batch['attention_mask'], batch['token_type_ids'],
                 params=model.to_hf(created.params))
  start = np.argmax(np.asarray(out.start_logits), -1).astype(np.int32)
  end = np.argmax(np.asarray(out.end_logits), -1).astype(np.int32)
  seq = batch['input_ids'].shape[1]
  end[1] = (end[1] + 1) % seq  # example 1: only its start is right
  right = {**batch, 'start_positions': start, 'end_positions': end}
  _, metrics = jax.jit(model.loss)(created.params, right)
  assert (float(metrics['correct']), float(metrics['count'])) == (5.0, 6.0)
  mask = np.array([1, 1, 0, 1, 0, 1], np.float32)  # examples 2 and 4 are padding
  _, masked = jax.jit(model.loss)(created.params, {**right, 'example_mask': mask})
  assert (float(masked['correct']), float(masked['count'])) == (3.0, 4.0)


def test_attention_mask_reaches_every_block():
  """Padding tokens must not influence other positions in any block."""
  created = fixtures.tiny('bert-classification')
  batch = fixtures.batch('bert-classification', created.model, 2, seed=2)
  mask = np.ones_like(batch['attention_mask'])
  mask[:, -3:] = 0
  batch = {**batch, 'attention_mask': mask}
  changed = dict(batch)
  ids = np.array(batch['input_ids'])
  ids[:, -3:] = (ids[:, -3:] + 7) % created.model.hf_config.vocab_size
  changed['input_ids'] = ids
  h1 = created.model.hidden_states(created.params, batch)
  h2 = created.model.hidden_states(created.params, changed)
  np.testing.assert_allclose(h1[:, :-3], h2[:, :-3], atol=1e-5)
  assert not np.allclose(h1[:, -3:], h2[:, -3:])
  # token_type_ids reach the embedding.
  typed = {**batch, 'token_type_ids': 1 - batch['token_type_ids']}
  assert not np.allclose(created.model.hidden_states(created.params, typed), h1)


def test_pretrained_minilm_matches_flax_bert_model():
  from transformers import AutoTokenizer, FlaxBertModel
  path = fixtures.minilm_dir()
  created = models.create('bert-encoder', pretrained=path)
  assert created.model.num_layers == 6
  tok = AutoTokenizer.from_pretrained(path)
  enc = tok(['pipelines freeze converged layers', 'a short one'], padding='max_length',
            max_length=16, return_tensors='np')
  batch = {k: enc[k] for k in ('input_ids', 'attention_mask', 'token_type_ids')}
  reference = FlaxBertModel.from_pretrained(path, from_pt=True)
  ref = reference(**batch)
  hidden, pooled = created.model.logits(created.params, batch)
  # Two implementations in float32 through 6 blocks round apart (at -O0 a
  # hidden value near 1.5 by 1.07e-5, about 90 units in its last place); a
  # wrong mask or segments move hidden values by more than 4.
  np.testing.assert_allclose(hidden, ref.last_hidden_state, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(pooled, ref.pooler_output, atol=1e-5, rtol=1e-5)
  # The pretrained weights really arrived (not a random init).
  np.testing.assert_array_equal(created.params['embed']['word_embeddings']['embedding'],
                                reference.params['embeddings']['word_embeddings']['embedding'])
  assert os.path.exists(os.path.join(path, 'model.safetensors'))
  assert jnp.all(jnp.isfinite(hidden))
  # Independently of HF's loader: a deep block's weights are the file's.
  from safetensors.numpy import load_file  # noqa: PLC0415
  weights = load_file(os.path.join(path, 'model.safetensors'))
  np.testing.assert_array_equal(created.params['attention']['self']['query']['kernel'][5],
                                weights['encoder.layer.5.attention.self.query.weight'].T)
  np.testing.assert_array_equal(created.params['mlp']['output']['dense']['bias'][3],
                                weights['encoder.layer.3.output.dense.bias'])


def test_a_checkpoint_that_lacks_weights_of_the_model_is_refused(tmp_path, capsys):
  """HF initialises the weights a checkpoint lacks (or holds in another
  shape) at random, with a warning that the run's verbosity hides: any but a
  new head's is refused in one line; a new head is said in one."""
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  source = fixtures.minilm_dir()
  weights = load_file(os.path.join(source, 'model.safetensors'))
  broken = tmp_path / 'no-block-3'
  broken.mkdir()
  shutil.copy(os.path.join(source, 'config.json'), broken)
  save_file({k: v for k, v in weights.items() if not k.startswith('encoder.layer.3.')},
            str(broken / 'model.safetensors'), metadata={'format': 'pt'})
  with pytest.raises(ValueError, match=re.escape(
      f"cannot load pretrained model from '{broken}': its weights do not fit a FlaxBertModel "
      f"of its config: 16 would be random (encoder/layer/3/attention/output/LayerNorm/bias, "
      f"encoder/layer/3/attention/output/LayerNorm/scale, encoder/layer/3/attention/output/"
      f"dense/bias, ...)")):
    models.create('bert-encoder', pretrained=str(broken))
  # Flax weights whose config says a wider MLP: with a new head HF ignores
  # mismatched sizes, every MLP weight's too.
  created = fixtures.tiny('vit')
  hf = created.hf_class(created.model.hf_config, seed=7)
  hf.save_pretrained(str(tmp_path / 'vit'))
  hf.save_pretrained(str(tmp_path / 'wider'))
  config = json.loads((tmp_path / 'wider' / 'config.json').read_text())
  config['intermediate_size'] *= 2
  (tmp_path / 'wider' / 'config.json').write_text(json.dumps(config))
  wider = 3 * created.model.num_layers  # a block's first dense kernel and bias, second kernel
  with pytest.raises(ValueError, match=rf"its weights do not fit a FlaxViTForImageClassification "
                                       rf"of its config: {wider} would be random \(vit/encoder/"
                                       rf"layer/0/intermediate/dense/bias, "):
    models.create('vit', pretrained=str(tmp_path / 'wider'), num_labels=3)
  # A head of another size: a new one, said.
  assert created.model.hf_config.num_labels != 3
  capsys.readouterr()
  models.create('vit', pretrained=str(tmp_path / 'vit'), num_labels=3, seed=2)
  assert capsys.readouterr().out.splitlines() == [
      f'pretrained {tmp_path / "vit"}: classifier initialised from seed 2 (not in the '
      f'checkpoint, or of another size)']
  models.create('vit', pretrained=str(tmp_path / 'vit'))  # the checkpoint's own head: silent
  assert capsys.readouterr().out == ''


def test_a_pytorch_checkpoint_with_a_head_of_another_size_gets_a_new_head(tmp_path, capsys):
  """A fine-tuned PyTorch checkpoint (2 labels) for a task of 3: HF's
  PyTorch converter refuses the head's shape (``ignore_mismatched_sizes``
  reaches only its Flax loader), so the checkpoint loads with its own head,
  which a new one from the seed replaces: the very head HF's Flax loader
  makes from the same checkpoint saved as Flax weights."""
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  source = fixtures.minilm_dir()
  weights = {f'bert.{k}': v for k, v in load_file(
      os.path.join(source, 'model.safetensors')).items()}
  rng = np.random.default_rng(0)
  weights['classifier.weight'] = rng.normal(size=(2, 384)).astype(np.float32)
  weights['classifier.bias'] = rng.normal(size=(2,)).astype(np.float32)
  tuned = tmp_path / 'pt'
  tuned.mkdir()
  config = json.loads(open(os.path.join(source, 'config.json')).read())
  config.update(num_labels=2, architectures=['BertForSequenceClassification'])
  (tuned / 'config.json').write_text(json.dumps(config))
  save_file(weights, str(tuned / 'model.safetensors'), metadata={'format': 'pt'})
  own = models.create('bert-classification', pretrained=str(tuned))  # its own head, kept
  np.testing.assert_array_equal(own.params['head']['classifier']['kernel'],
                                weights['classifier.weight'].T)
  capsys.readouterr()
  created = models.create('bert-classification', pretrained=str(tuned), num_labels=3, seed=1)
  assert capsys.readouterr().out.splitlines() == [
      f'pretrained {tuned}: classifier initialised from seed 1 (not in the checkpoint, or of '
      f'another size)']
  assert created.model.hf_config.num_labels == 3
  np.testing.assert_array_equal(created.params['attention']['self']['query']['kernel'][2],
                                weights['bert.encoder.layer.2.attention.self.query.weight'].T)
  flax_copy = tmp_path / 'flax'
  own.hf_class.from_pretrained(str(tuned), from_pt=True).save_pretrained(str(flax_copy))
  reference = models.create('bert-classification', pretrained=str(flax_copy), num_labels=3,
                            seed=1)
  for a, b in zip(jax.tree.leaves(created.params), jax.tree.leaves(reference.params),
                  strict=True):
    np.testing.assert_array_equal(a, b)


def test_pretrained_vit_from_local_directory(tmp_path):
  """``from_pretrained`` of a saved HF ViT, with the checkpoint's head or a new one."""
  created = fixtures.tiny('vit')
  hf = created.hf_class(created.model.hf_config, seed=7)
  hf.save_pretrained(str(tmp_path))
  loaded = models.create('vit', pretrained=str(tmp_path))
  for a, b in zip(jax.tree.leaves(loaded.model.to_hf(loaded.params)), jax.tree.leaves(hf.params),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  relabelled = models.create('vit', pretrained=str(tmp_path), num_labels=3)
  assert relabelled.params['head']['classifier']['kernel'].shape[-1] == 3
  np.testing.assert_array_equal(relabelled.params['embed']['cls_token'],
                                hf.params['vit']['embeddings']['cls_token'])
  with pytest.raises(ValueError, match='cannot load pretrained model'):
    models.create('vit', pretrained=str(tmp_path / 'missing'))


def test_pretrained_new_head_follows_the_seed(tmp_path):
  """``seed`` initialises a pretrained model's new head (HF's own default is
  the same key every time): two seeds, two heads; one seed, one head; the
  body is the checkpoint's whatever the seed."""
  created = fixtures.tiny('vit')
  hf = created.hf_class(created.model.hf_config, seed=7)
  hf.save_pretrained(str(tmp_path))
  loaded = [models.create('vit', pretrained=str(tmp_path), num_labels=3, seed=s)
            for s in (0, 1, 1)]
  kernels = [np.asarray(c.params['head']['classifier']['kernel']) for c in loaded]
  assert not np.array_equal(kernels[0], kernels[1])
  np.testing.assert_array_equal(kernels[1], kernels[2])
  for c in loaded:
    np.testing.assert_array_equal(c.params['embed']['cls_token'],
                                  hf.params['vit']['embeddings']['cls_token'])


_LOAD = """
import sys
import jax, numpy as np
import models
created = models.create(sys.argv[1], pretrained=sys.argv[2])
leaves = jax.tree_util.tree_flatten_with_path(created.model.to_hf(created.params))[0]
np.savez(sys.argv[3], **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})
"""


def _hub_entry(hub, name, files):
  """An entry ``name`` of an HF hub cache at ``hub`` (its layout: a snapshot
  and ``refs/main`` naming it) holding ``files`` (name -> source path)."""
  entry = hub / ('models--' + name.replace('/', '--'))
  snapshot = entry / 'snapshots' / ('0' * 40)
  snapshot.mkdir(parents=True)
  (entry / 'refs').mkdir()
  (entry / 'refs' / 'main').write_text('0' * 40)
  for file, source in files.items():
    shutil.copy(source, snapshot / file)


def test_pretrained_hub_names_load_from_the_cache_with_flax_or_pytorch_weights(tmp_path):
  """A hub name resolves in the local HF cache, offline: an entry with only
  Flax weights loads them (not a refusal for want of PyTorch ones), an entry
  with only safetensors converts those; each equals its weights as HF loads
  them here."""
  saved = tmp_path / 'saved'
  created = fixtures.tiny('vit')
  hf_vit = created.hf_class(created.model.hf_config, seed=7)
  hf_vit.save_pretrained(str(saved))
  minilm = fixtures.minilm_dir()
  hub = tmp_path / 'hub'
  _hub_entry(hub, 'local/flax-vit', {f: saved / f for f in ('config.json', 'flax_model.msgpack')})
  _hub_entry(hub, 'local/minilm', {f: os.path.join(minilm, f)
                                   for f in ('config.json', 'model.safetensors')})
  assert not (saved / 'model.safetensors').exists()
  from transformers import FlaxBertModel  # noqa: PLC0415
  references = {'local/flax-vit': ('vit', hf_vit.params),
                'local/minilm': ('bert-encoder',
                                 FlaxBertModel.from_pretrained(minilm, from_pt=True).params)}
  env = {**os.environ, 'HF_HUB_CACHE': str(hub), 'HF_HUB_OFFLINE': '1',
         'PYTHONPATH': os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
  for name, (kind, reference) in references.items():
    out = tmp_path / (name.replace('/', '-') + '.npz')
    result = subprocess.run([sys.executable, '-c', _LOAD, kind, name, str(out)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (name, result.stderr[-2000:])
    loaded = dict(np.load(out))
    expected = {jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_flatten_with_path(reference)[0]}
    assert loaded.keys() == expected.keys(), name
    for key, value in expected.items():
      np.testing.assert_array_equal(loaded[key], value, err_msg=f'{name} {key}')


def test_a_hub_name_the_offline_cache_lacks_says_how_to_get_it(tmp_path):
  """With the Hub offline (the tests', as pipejax's default), a hub name that
  the local HF cache lacks is said as such, with the command that fetches it,
  not as HF's "couldn't connect", which it never tried; a path that names no
  folder keeps HF's own message."""
  from huggingface_hub import constants  # noqa: PLC0415
  assert constants.HF_HUB_OFFLINE
  name = 'pipejax-test/no-such-model'
  with pytest.raises(ValueError) as missing:
    models.create('vit', pretrained=name, num_labels=10)
  assert str(missing.value) == (
      f"cannot load pretrained model from '{name}': it is no local directory, and the local HF "
      f"cache holds no model of that name; download it into the HF cache where the Hub can be "
      f"reached (huggingface-cli download {name}) or give a local directory (pipejax reads the "
      f"Hub offline unless HF_HUB_OFFLINE=0)")
  folder = str(tmp_path / 'no-such-folder')
  with pytest.raises(ValueError) as absent:
    models.create('vit', pretrained=folder, num_labels=10)
  assert str(absent.value).startswith(f"cannot load pretrained model from '{folder}': ")
  assert 'huggingface-cli' not in str(absent.value)


def _vit_config(**overrides):
  return models.config_for('vit', **dict(fixtures.TINY['vit'], num_hidden_layers=2, **overrides))


def _bits(tree):
  """Every leaf's bytes, by path (comparable with ==)."""
  return {jax.tree_util.keystr(k): np.asarray(v).tobytes()
          for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_random_initialisation_is_cached_bit_for_bit(tmp_path, monkeypatch):
  """The second create() of the same model, config and seed reads the
  parameters (bit for bit those of a fresh initialisation) without running
  HF's init; another seed or config is another entry."""
  import transformers  # noqa: PLC0415
  cache = str(tmp_path / 'init')
  fresh = models.create('vit', _vit_config(), seed=3)
  first = models.create('vit', _vit_config(), seed=3, init_cache=cache)
  assert len(os.listdir(cache)) == 1
  calls = []
  real = transformers.FlaxViTForImageClassification.init_weights

  def counted(self, *args, **kwargs):
    calls.append(1)
    return real(self, *args, **kwargs)

  monkeypatch.setattr(transformers.FlaxViTForImageClassification, 'init_weights', counted)
  again = models.create('vit', _vit_config(), seed=3, init_cache=cache)
  assert calls == []  # read, not initialised
  assert _bits(fresh.params) == _bits(first.params) == _bits(again.params)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(again.params))
  other_seed = models.create('vit', _vit_config(), seed=4, init_cache=cache)
  other_config = models.create('vit', _vit_config(initializer_range=0.05), seed=3,
                               init_cache=cache)
  assert calls and len(os.listdir(cache)) == 3  # initialised (HF calls init_weights twice)
  assert _bits(other_seed.params) != _bits(fresh.params) != _bits(other_config.params)


@pytest.mark.parametrize('damage', ['truncate', 'garbage', 'empty'])
def test_an_unreadable_initialisation_entry_is_replaced_in_one_line(tmp_path, damage):
  cache = tmp_path / 'init'
  fresh = models.create('vit', _vit_config(), seed=0, init_cache=str(cache))
  [entry] = list(cache.iterdir())
  data = entry.read_bytes()
  entry.write_bytes({'truncate': data[:len(data) // 2], 'garbage': b'not a zip file' * 10,
                     'empty': b''}[damage])
  lines = []
  again = models.create('vit', _vit_config(), seed=0, init_cache=str(cache), log=lines.append)
  assert len(lines) == 1 and 'is unreadable' in lines[0] and 'initialised afresh' in lines[0]
  assert '\n' not in lines[0] and 'pickle' not in lines[0]  # numpy's guess for other bytes
  if damage != 'truncate':
    assert '(ValueError: not an .npz archive)' in lines[0]
  assert _bits(again.params) == _bits(fresh.params)
  assert entry.read_bytes() == data  # rewritten whole


def test_initialisation_cache_keeps_the_most_recent_entries_within_its_size(tmp_path):
  from models import init_cache  # noqa: PLC0415
  cache = tmp_path / 'init'
  cache.mkdir()
  killed, writing = (cache / f'init-{"a" * 40}.npz.{"1" * 32}.tmp',
                     cache / f'init-{"b" * 40}.npz.{"2" * 32}.tmp')
  # A folder shared with other files: trimming removes none of them.
  others = [cache / 'notes.npz', cache / 'draft.tmp', cache / f'init-{"c" * 40}.npz.bak',
            cache / f'init-{"d" * 39}.npz']
  for path in [killed, writing] + others:
    path.write_bytes(b'x' * 20000)
    os.utime(path, (0, os.path.getmtime(path) - 7200))  # as if left by a writer killed 2 h ago
  os.utime(writing)  # a live writer's
  for seed in range(3):
    init_cache.cached_init(str(cache), f'{seed:040d}',
                           lambda: {'w': np.zeros(1000, np.float32)}, max_bytes=2500 * 4)
  assert sorted(os.listdir(cache)) == sorted([f'init-{s:040d}.npz' for s in (1, 2)]
                                             + [writing.name] + [p.name for p in others])


@pytest.mark.parametrize('kind', ['vit', 'bert-classification', 'bert-regression',
                                  'bert-question_answering'])
def test_padded_rows_leave_the_loss_and_its_gradient(kind):
  """Rows with ``example_mask`` 0 (a last batch's padding) are no part of the
  loss: the loss and gradients of a padded batch are those of its real rows
  alone, whatever the padding holds."""
  created = fixtures.tiny(kind)
  model, params = created.model, created.params
  real = fixtures.batch(kind, model, 5, seed=3)
  junk = fixtures.batch(kind, model, 3, seed=4)  # other inputs and labels in the padding
  if kind in ('vit', 'bert-classification'):  # a class the head does not have: NaN unmasked
    junk['labels'] = np.full(3, model.hf_config.num_labels + 7, np.int32)
  padded = {k: np.concatenate([real[k], junk[k]]) for k in real}
  padded['example_mask'] = np.array([1] * 5 + [0] * 3, np.float32)
  loss_and_grads = jax.jit(jax.value_and_grad(lambda p, b: model.loss(p, b)[0]))
  loss, grads = loss_and_grads(params, padded)
  ref_loss, ref_grads = loss_and_grads(params, real)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)
  # And the padding does count without the mask: the check can fail.
  unmasked = float(loss_and_grads(params, {k: v for k, v in padded.items()
                                           if k != 'example_mask'})[0])
  assert not abs(unmasked - float(ref_loss)) <= 1e-4  # NaN for the classes the head lacks


def test_question_answering_ignores_positions_outside_the_sequence_as_hf():
  """As HF's ``BertForQuestionAnswering``: positions are clamped to
  ``[0, seq_len]``, and a position at ``seq_len`` (or past it) is left out of
  its half of the loss (cross-entropy with ``ignore_index=seq_len``); a
  negative one counts as position 0. Computed here from HF's own logits."""
  created = fixtures.tiny('bert-question_answering')
  model = created.model
  batch = fixtures.batch('bert-question_answering', model, 6, seed=5)
  seq = batch['input_ids'].shape[1]
  start, end = batch['start_positions'].copy(), batch['end_positions'].copy()
  start[1], start[4], end[2], end[4], start[5] = seq, seq + 7, seq + 1, seq, -3
  batch = {**batch, 'start_positions': start, 'end_positions': end}
  hf_model = created.hf_class(model.hf_config, _do_init=False)
  out = hf_model(batch['input_ids'], batch['attention_mask'], batch['token_type_ids'],
                 params=model.to_hf(created.params))

  def ignoring(logits, positions):
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                  keepdims=True)) - logits.max(-1, keepdims=True)
    positions = np.clip(positions, 0, seq)
    keep = positions < seq
    return -np.mean(logp[np.arange(len(positions))[keep], positions[keep]])

  reference = 0.5 * (ignoring(out.start_logits, start) + ignoring(out.end_logits, end))
  loss, metrics = jax.jit(model.loss)(created.params, batch)
  assert np.isfinite(float(loss))
  np.testing.assert_allclose(float(loss), reference, rtol=1e-5)
  assert float(metrics['count']) == 6.0
