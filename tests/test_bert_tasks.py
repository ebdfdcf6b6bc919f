"""BERT on GLUE and SQuAD: STS-B's Pearson and Spearman correlation and the
official SQuAD metric and post-processing on hand-computed cases, the SQuAD
window labels, the real TFDS loading path on ``tfds.testing.mock_data``
through the CLI's run, and one-line errors.

``tfds.testing.mock_data`` works without TensorFlow with
``policy=MockPolicy.USE_CODE`` once the builder module is imported (tfds
imports its builder packages lazily without TensorFlow, so ``glue`` and
``squad`` are unknown names until then; :mod:`experiments.text_data` imports
them). Its sources do not support batched reads (``__getitems__`` fails) and
its SQuAD answers are random strings with ``answer_start`` beyond the
context, so most SQuAD windows are labelled with ``[CLS]``.
"""
import collections
import os
import re
import string
import subprocess
import sys

import numpy as np
import pytest

from experiments import bert_glue, bert_squad, elastic, text_data, text_eval
from tests import fixtures

_real_tfds_data_source = text_data.tfds_data_source  # the real one, for spies

# -- STS-B correlations ----------------------------------------------------------------------

def test_pearson_and_spearman_hand_computed():
  assert text_eval.pearson_correlation([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
  assert text_eval.pearson_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
  # dx = dy·perm = (-1.5, -.5, .5, 1.5): Σdx·dy = 4, Σdx² = Σdy² = 5 -> 0.8.
  assert text_eval.pearson_correlation([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
  assert text_eval.spearman_correlation([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
  # Monotone but not linear: Spearman 1, Pearson below.
  assert text_eval.spearman_correlation([1, 2, 3, 4], [1, 4, 9, 100]) == pytest.approx(1.0)
  assert text_eval.pearson_correlation([1, 2, 3, 4], [1, 4, 9, 100]) < 0.9
  # Undefined (a constant sample, or one value): 0.0.
  assert text_eval.pearson_correlation([1, 1, 1], [1, 2, 3]) == 0.0
  assert text_eval.spearman_correlation([2.5, 2.5], [1, 2]) == 0.0
  assert text_eval.pearson_correlation([1], [2]) == 0.0


def test_spearman_ties_take_average_ranks():
  np.testing.assert_array_equal(text_eval.average_ranks([10, 20, 20, 30]), [1, 2.5, 2.5, 4])
  np.testing.assert_array_equal(text_eval.average_ranks([3, 1, 3, 3]), [3, 1, 3, 3])
  np.testing.assert_array_equal(text_eval.average_ranks([0.5, 0.1, 0.9]), [2, 1, 3])
  # Ranks (1, 2.5, 2.5, 4) vs (1, 2, 3, 4): Σd·d = 4.5, Σ = 4.5 and 5 -> sqrt(0.9).
  assert text_eval.spearman_correlation([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(
      np.sqrt(0.9))


def test_correlations_match_scipy_with_ties():
  from scipy import stats  # noqa: PLC0415 - scikit-learn's dependency
  rng = np.random.default_rng(0)
  x = np.round(rng.uniform(0, 5, 200), 1)  # many ties, like STS-B's gold scores
  y = x + rng.normal(0, 1.5, 200).astype(np.float32)
  np.testing.assert_allclose(text_eval.average_ranks(x), stats.rankdata(x))
  assert text_eval.pearson_correlation(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-9)
  assert text_eval.spearman_correlation(x, y) == pytest.approx(stats.spearmanr(x, y)[0],
                                                                 abs=1e-9)


def test_stsb_eval_accuracy_is_the_mean_of_pearson_and_spearman():
  metrics = text_eval.GlueEvaluator.regression_metrics(np.array([1., 2., 3., 4.]),
                                                       np.array([1., 3., 2., 4.]))
  assert metrics['eval_pearson'] == pytest.approx(0.8)
  assert metrics['eval_spearmanr'] == pytest.approx(0.8)
  assert metrics['eval_accuracy'] == pytest.approx(0.8)
  assert metrics['eval_mse'] == pytest.approx(0.5)  # errors 0, 1, 1, 0
  metrics = text_eval.GlueEvaluator.regression_metrics(np.array([1., 2., 2., 3.]),
                                                       np.array([1., 2., 3., 40.]))
  assert metrics['eval_spearmanr'] == pytest.approx(np.sqrt(0.9))
  assert metrics['eval_accuracy'] == pytest.approx(
      (metrics['eval_pearson'] + np.sqrt(0.9)) / 2)


# -- SQuAD metric and post-processing --------------------------------------------------------

def test_normalize_answer_official_rules():
  assert text_eval.normalize_answer('The  Eiffel Tower!') == 'eiffel tower'
  assert text_eval.normalize_answer('an apple, a pear and THE plum.') == 'apple pear and plum'
  assert text_eval.normalize_answer("Theatre's") == 'theatres'  # 'the' only as a word
  assert text_eval.normalize_answer('  ') == ''


def test_exact_match_and_f1_hand_computed():
  assert text_eval.exact_match('the Denver Broncos', 'Denver Broncos!') == 1.0
  assert text_eval.exact_match('Denver', 'Denver Broncos') == 0.0
  # prediction 'denver broncos win', gold 'broncos': common 1, P = 1/3, R = 1 -> F1 = 0.5.
  assert text_eval.f1_score('Denver Broncos win', 'the Broncos') == pytest.approx(0.5)
  # common {a:..} after normalisation: 'x y y' vs 'y y z': common y×2, P = R = 2/3.
  assert text_eval.f1_score('x y y', 'y y z') == pytest.approx(2 / 3)
  assert text_eval.f1_score('nothing', 'else') == 0.0
  scores = text_eval.squad_scores(
      {'q1': 'Denver Broncos', 'q2': 'Broncos win', 'q3': ''},
      {'q1': ['Carolina', 'the Denver Broncos'], 'q2': ['Broncos', 'they win'], 'q3': ['x']})
  # q1: EM 1, F1 1; q2: EM 0, F1 max(2/3, 0.5) = 2/3; q3: 0, 0.
  assert scores['exact_match'] == pytest.approx(100 / 3)
  assert scores['f1'] == pytest.approx(100 * (1 + 2 / 3) / 3)


def test_glue_metrics_hand_computed():
  # tp = 2 (0, 4), fp = 1 (1), tn = 2 (2, 3), fn = 1 (5).
  p, y = np.array([1, 1, 0, 0, 1, 0]), np.array([1, 0, 0, 0, 1, 1])
  assert text_eval.matthews_correlation(p, y) == pytest.approx((2 * 2 - 1 * 1) / 3 ** 2)
  assert text_eval.binary_f1(p, y) == pytest.approx(2 * 2 / (3 + 3))
  logits = np.eye(2)[p]
  expected = {'mrpc': {'eval_f1': 2 / 3}, 'qqp': {'eval_f1': 2 / 3},
              'cola': {'eval_matthews': 1 / 3}, 'sst2': {}}
  for task, extra in expected.items():
    evaluator = text_eval.GlueEvaluator(task, y)
    evaluator.predict = lambda trainer, params: (np.arange(6), logits)
    assert evaluator(None, None) == pytest.approx({'eval_accuracy': 4 / 6, **extra}), task
  # STS-B's MSE is squared: errors 0, 2, 1, 0 → (0 + 4 + 1 + 0) / 4.
  mse = text_eval.GlueEvaluator.regression_metrics(np.array([1., 2., 3., 4.]),
                                                   np.array([1., 4., 2., 4.]))['eval_mse']
  assert mse == pytest.approx(1.25)
  # STS-B through the evaluator: the one logit of each predicted ID (in the
  # order predicted, not the ID order) against that ID's gold score.
  # Pearson: cov 3.5 / sqrt(5 * 6.75); Spearman on ranks [1, 2, 3, 4] against
  # the tied ranks [1, 3.5, 2, 3.5]: 3 / sqrt(5 * 4.5).
  gold = np.array([4., 9., 1., 4., 2.])  # by ID; ID 1 is never predicted
  ids, scores = np.array([2, 0, 4, 3]), np.array([[1.], [2.], [3.], [4.]])
  evaluator = text_eval.GlueEvaluator('stsb', gold)
  evaluator.predict = lambda trainer, params: (ids, scores)
  pearson, spearman = 3.5 / np.sqrt(5 * 6.75), 3 / np.sqrt(5 * 4.5)
  assert evaluator(None, None) == pytest.approx({
      'eval_pearson': pearson, 'eval_spearmanr': spearman,
      'eval_accuracy': (pearson + spearman) / 2, 'eval_mse': (0 + 4 + 1 + 0) / 4})


def test_squad_scores_average_over_the_questions_predicted():
  # An evaluation of part of the questions averages over those, not over all.
  assert text_eval.squad_scores({'q1': 'x'}, {'q1': ['x'], 'q2': ['y']}) == {
      'exact_match': 100.0, 'f1': 100.0}
  # A question without gold answers counts the empty answer as its gold.
  assert text_eval.squad_scores({'q': ''}, {'q': []}) == {'exact_match': 100.0, 'f1': 0.0}


def _offsets(seq, context_from):
  """Token t >= context_from covers characters [2(t-c), 2(t-c)+1); others -1."""
  out = np.full((seq, 2), -1, np.int32)
  for t in range(context_from, seq):
    out[t] = (2 * (t - context_from), 2 * (t - context_from) + 1)
  return out


def test_best_span_respects_context_order_and_length():
  seq = 8
  offsets = _offsets(seq, 3)  # tokens 0-2: [CLS] question [SEP]; 3-7: context
  start, end = np.zeros(seq), np.zeros(seq)
  start[1], end[1] = 10.0, 10.0  # spans from the question are invalid
  start[5], end[6], end[5] = 4.0, 4.0, 1.0
  # Best valid: tokens 5..6, score 8, characters [4, 7).
  assert text_eval.best_span(start, end, offsets) == (8.0, 4, 7)
  # At most one token: (5, 5) scores 5, (6, 6) only 4.
  assert text_eval.best_span(start, end, offsets, max_answer_length=1) == (5.0, 4, 5)
  start, end = np.zeros(seq), np.zeros(seq)
  start[6], end[4], start[3] = 6.0, 6.0, 1.0
  # (6, 4) ends before it starts; (3, 4) scores 7 > (6, 6) at 6.
  assert text_eval.best_span(start, end, offsets) == (7.0, 0, 3)
  # n_best=1 pairs only the top start (6) with the top end (4): nothing valid.
  assert text_eval.best_span(start, end, offsets, n_best=1) is None
  # An end on the closing [SEP] (token 7, outside the context) is not an answer.
  offsets = _offsets(seq, 3)
  offsets[7] = -1
  start, end = np.zeros(seq), np.zeros(seq)
  start[5], end[7], end[6] = 4.0, 9.0, 1.0
  assert text_eval.best_span(start, end, offsets) == (5.0, 4, 7)


def test_squad_predictions_take_the_best_feature_of_each_example():
  seq = 6
  features = text_data.SquadFeatures(
      example_index=np.array([0, 0, 1]), offsets=np.stack([_offsets(seq, 2)] * 3),
      contexts=['abcdefgh', 'ABCDEFGH'], answers=[['cd'], ['zz']], ids=['a', 'b'])
  start = np.zeros((3, seq))
  end = np.zeros((3, seq))
  start[0, 2], end[0, 2] = 1.0, 1.0  # example 0, feature 0: 'a' (score 2)
  start[1, 3], end[1, 4] = 2.0, 2.0  # example 0, feature 1: 'cde' (score 4) wins
  # Example 1: the top start (5) and top end (4) are reversed, and (5, 5) has
  # end logit -20, so the best valid span is token 4 alone: 1 + 9.
  start[2, 5], end[2, 4], end[2, 5], start[2, 4] = 9.0, 9.0, -20.0, 1.0
  predictions = text_eval.squad_predictions(features, np.array([0, 1, 2]), start, end)
  assert predictions == {'a': 'cde', 'b': 'E'}
  # Rows follow feature_ids: only feature 2 served -> only example 1.
  assert text_eval.squad_predictions(features, np.array([2]), start[2:], end[2:]) == {'b': 'E'}
  # An evaluation capped inside example 0 (its first window only, whose own
  # best span 'a' is wrong): example 0 is left out, not answered from it.
  assert text_eval.squad_predictions(features, np.array([2, 0]), start[[2, 0]],
                                     end[[2, 0]]) == {'b': 'E'}
  assert text_eval.squad_predictions(features, np.array([0]), start[:1], end[:1]) == {}


def test_squad_windows_label_the_answer_tokens():
  tokenizer = text_data.load_tokenizer(fixtures.minilm_dir())
  context = ('Paris is the capital of France. ' * 6 + 'The Eiffel Tower was built in 1889 '
             'by Gustave Eiffel. ' + 'Lyon is a city. ' * 6)
  answer = 'Gustave Eiffel'
  example = {'id': 'q', 'question': ' Who built the tower?', 'context': context,
             'answers': {'text': np.array([answer]),
                         'answer_start': np.array([context.index(answer)])}}
  train = text_data.squad_train_features(tokenizer, [example], 48, 16)
  assert len(train['input_ids']) > 2  # the context needs several windows
  hits = 0
  for ids, s, e in zip(train['input_ids'], train['start_positions'], train['end_positions'],
                       strict=True):
    if s == 0:
      assert e == 0  # [CLS]: this window misses the answer
      continue
    hits += 1
    assert tokenizer.decode(ids[s:e + 1]) == answer.lower()
  assert hits >= 1
  inputs, host = text_data.squad_eval_features(tokenizer, [example], 48, 16)
  assert inputs['input_ids'].shape == (len(host.example_index), 48)
  assert set(inputs) == {'input_ids', 'attention_mask', 'token_type_ids'}  # no host data
  for f, ids in enumerate(inputs['input_ids']):
    in_context = host.offsets[f, :, 0] >= 0
    assert np.all(inputs['token_type_ids'][f][in_context] == 1)
    assert tokenizer.cls_token_id not in ids[in_context]


def _official_squad(predictions, answers):
  """EM and F1 (percent) of the official SQuAD v1.1 script, written out here
  apart from :mod:`experiments.text_eval`."""
  def normalise(text):
    text = ''.join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return ' '.join(re.sub(r'\b(a|an|the)\b', ' ', text).split())

  def f1(prediction, truth):
    predicted, gold = normalise(prediction).split(), normalise(truth).split()
    same = sum((collections.Counter(predicted) & collections.Counter(gold)).values())
    if not same:
      return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)

  em = [max(float(normalise(p) == normalise(g)) for g in answers[q])
        for q, p in predictions.items()]
  f1s = [max(f1(p, g) for g in answers[q]) for q, p in predictions.items()]
  return 100 * np.mean(em), 100 * np.mean(f1s)


def _squad_qa_examples():
  """Five questions: a context long enough for several windows, several gold
  answers, an article and punctuation around answers."""
  long = ('Paris is the capital of France. ' * 6 + 'The Eiffel Tower was built in 1889 by '
          'Gustave Eiffel. ' + 'Lyon is a city. ' * 6)
  rows = [
      ('q-built', 'When was the tower built?', long, ['1889']),
      ('q-tall', 'What is the tallest structure in Paris?',
       'The Eiffel Tower is the tallest structure in Paris.', ['Eiffel Tower']),
      ('q-port', 'Which city is a port?',
       'Lyon is a city in France. Marseille is a port on the Mediterranean Sea.', ['Marseille']),
      ('q-moon', 'Who was aboard Apollo 11?',
       'Apollo 11 landed on the Moon on July 20, 1969, with Neil Armstrong aboard.',
       ['Neil Armstrong', 'Armstrong']),
      ('q-boil', 'At what temperature does water boil?',
       'Water boils at 100 degrees Celsius at sea level.', ['100 degrees Celsius']),
  ]
  return [{'id': qid, 'question': question, 'context': context,
           'answers': {'text': np.array(golds),
                       'answer_start': np.array([context.index(g) for g in golds])}}
          for qid, question, context, golds in rows]


def test_squad_evaluator_scores_an_oracle_model_against_the_official_metric():
  """The real QA evaluation path (eval loader, :class:`text_eval.Predictor`,
  post-processing, metric) on MiniLM's tokenized windows, with a model whose
  logits peak on a chosen character span in every window that holds it (and
  lower, on a decoy, in the others). Peaks on the gold spans: EM = F1 = 100.
  Peaks moved (a word more, an article more, a wrong city, the second gold
  answer): EM and F1 equal the official SQuAD v1.1 metric of those spans,
  computed here, and EM is below 100. The model finds each row's logits by
  its input IDs, so rows mixed up by the predictor would score wrong."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from pipejax.data import ArraySource, Loader, ShardedLoader  # noqa: PLC0415
  tokenizer = text_data.load_tokenizer(fixtures.minilm_dir())
  examples = _squad_qa_examples()
  inputs, host = text_data.squad_eval_features(tokenizer, examples, 48, 24)
  features = len(host.example_index)
  assert features > 8 and features % 8  # several batches, the last one padded
  assert len({tuple(ids) for ids in inputs['input_ids']}) == features  # rows told apart
  answers = {e['id']: [str(t) for t in e['answers']['text']] for e in examples}

  def oracle(spans):
    """Logits ``[features, seq]`` peaking (10) on ``spans[example]`` = (first
    char, end char) in the windows that hold it, on a decoy elsewhere (5 on
    the first context token); and the windows that hold it."""
    start = np.zeros(inputs['input_ids'].shape, np.float32)
    end = np.zeros_like(start)
    holding = []
    for f, example in enumerate(host.example_index):
      first, stop = spans[example]
      offsets = host.offsets[f]
      s = np.flatnonzero(offsets[:, 0] == first)
      e = np.flatnonzero(offsets[:, 1] == stop)
      if len(s) and len(e):
        start[f, s[0]] = end[f, e[0]] = 10.0
        holding.append((f, s[0], e[0]))
      else:
        decoy = np.flatnonzero(offsets[:, 0] >= 0)[0]
        start[f, decoy] = end[f, decoy] = 5.0
    assert {host.example_index[f] for f, _, _ in holding} == set(range(len(examples)))
    return {'input_ids': inputs['input_ids'], 'start': start, 'end': end}, holding

  class Oracle:  # what the predictor reads of a pipejax model
    input_keys = ('input_ids',)

    @staticmethod
    def logits(params, batch):
      match = jnp.all(batch['input_ids'][:, None, :] == params['input_ids'][None], -1)
      match = match.astype(jnp.float32)
      return match @ params['start'], match @ params['end']

  class Trainer:  # what the evaluator reads of a pipejax Trainer
    devices = jax.devices()[:8]
    model = Oracle

    def __init__(self, eval_loader):
      self.eval_loader = eval_loader

    def eval_batch_size(self):
      return 8

  gold = {i: (int(e['answers']['answer_start'][0]),
              int(e['answers']['answer_start'][0]) + len(e['answers']['text'][0]))
          for i, e in enumerate(examples)}
  params, holding = oracle(gold)
  # The gold windows are the training labels' too, and the long context's
  # answer lies in the overlap of two windows.
  train = text_data.squad_train_features(tokenizer, examples, 48, 24)
  np.testing.assert_array_equal(train['input_ids'], inputs['input_ids'])
  labelled = {(f, s, e) for f, (s, e) in enumerate(zip(train['start_positions'],
                                                       train['end_positions'], strict=True))
              if s != 0}
  assert labelled == {(f, int(s), int(e)) for f, s, e in holding}
  assert np.sum(host.example_index[[f for f, _, _ in holding]] == 0) >= 2
  source = ArraySource(inputs)
  for loader in (Loader(source, 8, shuffle=False, drop_remainder=False),
                 ShardedLoader(source, 8, 2, (0, 1), shuffle=False, drop_remainder=False)):
    evaluator = text_eval.SquadEvaluator(host)
    assert evaluator(Trainer(loader), params) == {
        'eval_accuracy': 1.0, 'eval_exact_match': 100.0, 'eval_f1': 100.0,
        'eval_questions': len(examples)}
  contexts = [e['context'] for e in examples]
  moved = dict(gold)
  moved[0] = (gold[0][0], contexts[0].index('1889 by') + len('1889 by'))  # a word more
  moved[1] = (contexts[1].index('The Eiffel'), gold[1][1])  # an article more: still exact
  moved[2] = (0, len('Lyon'))  # the wrong city
  moved[3] = (contexts[3].index('Armstrong'), gold[3][1])  # the second gold answer
  params, _ = oracle(moved)
  predicted = {e['id']: contexts[i][slice(*moved[i])] for i, e in enumerate(examples)}
  assert predicted['q-built'] == '1889 by' and predicted['q-tall'] == 'The Eiffel Tower'
  em, f1 = _official_squad(predicted, answers)
  assert em == pytest.approx(60.0) and f1 < 100.0  # q-built and q-port are not exact
  metrics = evaluator(Trainer(Loader(source, 8, shuffle=False, drop_remainder=False)), params)
  assert metrics['eval_exact_match'] == pytest.approx(em, abs=1e-9)
  assert metrics['eval_f1'] == pytest.approx(f1, abs=1e-9)
  assert metrics['eval_accuracy'] == pytest.approx(f1 / 100, abs=1e-12)
  assert metrics['eval_questions'] == len(examples)


def test_a_stride_a_long_question_leaves_no_room_for_is_one_clear_error():
  """The tokenizer panics (a BaseException, not an error) when a question
  leaves the context no more room than the overlap; refused before that."""
  tokenizer = text_data.load_tokenizer(fixtures.minilm_dir())
  question = ' '.join(['which'] * 17)
  example = {'id': 'q', 'question': question, 'context': 'Paris is in France. ' * 20,
             'answers': {'text': np.array(['Paris']), 'answer_start': np.array([0])}}
  with pytest.raises(text_data.TextConfigError,
                     match=r'data.doc_stride=13 must be below the context room of a window, '
                           r'max_seq_length=32 - special tokens - the longest question '
                           r'\(17 tokens\) = 12'):
    text_data.squad_train_features(tokenizer, [example], 32, 13)
  with pytest.raises(text_data.TextConfigError, match='doc_stride=13 must be below'):
    text_data.squad_eval_features(tokenizer, [example], 32, 13)
  # No room at all (a question longer than the window): only a longer window helps.
  with pytest.raises(text_data.TextConfigError,
                     match=r'longest question \(17 tokens\) = -2; raise data.max_seq_length$'):
    text_data.squad_train_features(tokenizer, [example], 18, 1)
  assert len(text_data.squad_train_features(tokenizer, [example], 32, 11)['input_ids']) > 1
  # A long question whose context needs no cut is no problem at that stride.
  short = dict(example, context='Paris.', answers={'text': np.array(['Paris']),
                                                   'answer_start': np.array([0])})
  assert len(text_data.squad_train_features(tokenizer, [short], 32, 13)['input_ids']) == 1


def test_a_prepared_data_set_with_damaged_files_is_one_clear_error():
  """array_record raises RuntimeError for a damaged shard: read whole (the
  text tasks) or batch by batch (ImageNet), it is one line naming the data."""
  from experiments.datasets import DatasetMissing  # noqa: PLC0415
  from pipejax.data import DataReadError, TfdsSource  # noqa: PLC0415

  class Damaged:
    def __len__(self):
      return 3

    def __getitem__(self, i):
      if i == 2:
        raise RuntimeError('Corrupted Riegeli/records file')
      return {'label': 0}

  with pytest.raises(DatasetMissing, match=r'cannot read the prepared glue/sst2 \(RuntimeError: '
                                           r'Corrupted.*tfds build glue/sst2'):
    text_data._examples(Damaged(), 'glue/sst2')  # noqa: SLF001
  source = TfdsSource(Damaged(), lambda e: {'x': np.zeros(1)})
  assert source[np.array([0, 1])]['x'].shape == (2, 1)
  with pytest.raises(DataReadError, match=r'RuntimeError: Corrupted.*its files are damaged'):
    source[np.array([1, 2])]
  assert DataReadError in elastic.KNOWN_ERRORS and DatasetMissing in elastic.KNOWN_ERRORS


def test_a_tokenizer_that_cannot_serve_the_model_is_one_clear_error(tmp_path):
  """More tokens than the model embeds (their embeddings would be NaN), no
  [PAD], or left padding ([CLS] is read at position 0)."""
  import types  # noqa: PLC0415
  from transformers import AutoTokenizer  # noqa: PLC0415

  class ArraySourceLike:
    def __init__(self, token_type_ids):
      self.arrays = {'token_type_ids': token_type_ids}

  base = AutoTokenizer.from_pretrained(fixtures.minilm_dir())
  grown = AutoTokenizer.from_pretrained(fixtures.minilm_dir())
  grown.add_tokens(['zzz-new-token'])
  grown.save_pretrained(str(tmp_path / 'grown'))
  config = _tiny(bert_glue.get_config(), tmp_path, **{
      'model.pretrained': fixtures.minilm_dir(), 'model.tokenizer': str(tmp_path / 'grown')})
  with pytest.raises(elastic.ConfigError, match=f'has {len(base) + 1} tokens, the model '):
    elastic.check_tokenizer_fits(config)
  with config.unlocked():
    config.model.tokenizer = ''
  elastic.check_tokenizer_fits(config)  # the model's own
  one_type = types.SimpleNamespace(num_classes=2, max_seq_length=16, train=ArraySourceLike(
      np.array([[0, 1]])), eval=ArraySourceLike(np.array([[0, 0]])))
  from models import create, config_for  # noqa: PLC0415
  flat = config_for('bert-classification', vocab_size=len(base), hidden_size=16,
                    num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                    type_vocab_size=1, num_labels=2)
  create('bert-classification', flat).hf_class(flat, seed=0).save_pretrained(
      str(tmp_path / 'flat'))
  with config.unlocked():
    config.model.pretrained = str(tmp_path / 'flat')
  with pytest.raises(elastic.ConfigError, match="has 1 token type\\(s\\); the data use 2"):
    elastic.resolve_model(config, one_type, 'bert_glue')
  left = AutoTokenizer.from_pretrained(fixtures.minilm_dir(), padding_side='left')
  left.save_pretrained(str(tmp_path / 'left'))
  with pytest.raises(text_data.TextConfigError, match='pads on the left'):
    text_data.load_tokenizer(str(tmp_path / 'left'))
  base.pad_token = None
  base.save_pretrained(str(tmp_path / 'nopad'))
  with pytest.raises(text_data.TextConfigError, match='has no pad_token'):
    text_data.load_tokenizer(str(tmp_path / 'nopad'))


# -- the real loading path on mocked TFDS -----------------------------------------------------

def _tiny(config, tmp_path, **overrides):
  with config.unlocked():
    config.model.update(pretrained='', tokenizer=fixtures.minilm_dir(), preset='custom',
                        hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64,
                        dropout=0.0)
    config.train.update(epochs=2, batch_size=16, max_steps_per_epoch=2, learning_rate=1e-3)
    config.pipeline.update(initial_length=4, micro_batches=4,
                           profile_path=str(tmp_path / 'profile.json'))
    config.freeze.update(policy='schedule', alpha=0.5)
    fixtures.override(config, overrides)
  return config


def _check_outputs(workdir, epochs):
  return fixtures.check_run_outputs(workdir, epochs, summary_keys=('final_eval',))


def _run_on_mock(config, workdir, task, num_examples):
  """``elastic.run`` of ``task`` on ``tfds.testing.mock_data``; its summary."""
  import tensorflow_datasets as tfds  # noqa: PLC0415 - slow to import
  with tfds.testing.mock_data(num_examples=num_examples,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    return elastic.run(config, workdir, task=task)

def test_glue_pair_task_tokenized_from_mock_tfds(monkeypatch):
  import tensorflow_datasets as tfds  # noqa: PLC0415 - slow to import
  tokenizer = text_data.load_tokenizer(fixtures.minilm_dir())
  read = []
  monkeypatch.setattr(text_data, 'tfds_data_source', lambda tfds, name, split, data_dir: (
      read.append(split), _real_tfds_data_source(tfds, name, split, data_dir))[1])
  with tfds.testing.mock_data(num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE):
    data = text_data.glue('glue/mnli', tokenizer, 24)
  assert read == ['train', 'validation_matched', 'validation_mismatched']
  assert data.num_classes == 3 and len(data.train) == len(data.eval) == 12
  arrays = data.train.arrays
  assert set(arrays) == {'input_ids', 'attention_mask', 'token_type_ids', 'labels'}
  assert all(v.dtype == np.int32 and len(v) == 12 for v in arrays.values())
  assert arrays['input_ids'].shape == (12, 24)
  # Premise then hypothesis: segment 1 follows segment 0 in every row.
  assert np.all(arrays['token_type_ids'].max(axis=1) == 1)
  assert set(np.unique(arrays['labels'])) <= {0, 1, 2}
  # MNLI's mismatched genres are evaluated too, from their own split.
  assert list(data.more_eval) == ['_mismatched']
  mismatched = data.more_eval['_mismatched'].arrays
  assert set(mismatched) == set(arrays) and len(mismatched['labels']) == 12


def test_mnli_reports_the_mismatched_split_beside_the_matched_one():
  """The GLUE evaluator runs each further split through the eval loader's
  settings (plain or sharded, padding dropped) and reports its metrics with
  the split's suffix; ``eval_accuracy`` stays the matched split's. Checked
  against the model's own logits on each split."""
  import jax  # noqa: PLC0415
  from pipejax.data import ArraySource, Loader, ShardedLoader  # noqa: PLC0415
  created = fixtures.tiny('bert-classification')
  model, params = created.model, created.params
  matched = fixtures.batch('bert-classification', model, 21, seed=1)
  mismatched = fixtures.batch('bert-classification', model, 13, seed=2)

  def accuracy(arrays):
    logits = np.asarray(jax.jit(model.logits)(params, {k: arrays[k] for k in model.input_keys}))
    return float(np.mean(np.argmax(logits, -1) == arrays['labels']))

  class Trainer:  # what the evaluator reads of a pipejax Trainer
    devices = jax.devices()[:8]

    def __init__(self, eval_loader):
      self.model, self.eval_loader = model, eval_loader

    def eval_batch_size(self):
      return 16

  for loader in (Loader(ArraySource(matched), 8, shuffle=False, drop_remainder=False),
                 ShardedLoader(ArraySource(matched), 8, 2, (0, 1), shuffle=False,
                               drop_remainder=False)):
    evaluator = text_eval.GlueEvaluator('mnli', matched['labels'],
                                        {'_mismatched': ArraySource(mismatched)})
    metrics = evaluator(Trainer(loader), params)
    assert set(metrics) == {'eval_accuracy', 'eval_accuracy_mismatched'}
    assert metrics['eval_accuracy'] == pytest.approx(accuracy(matched))
    assert metrics['eval_accuracy_mismatched'] == pytest.approx(accuracy(mismatched))
    assert metrics['eval_accuracy'] != metrics['eval_accuracy_mismatched']
    if isinstance(loader, ShardedLoader):  # the eval loader's record is the matched split's
      assert loader.served <= set(range(21))


def test_glue_stsb_has_float_labels_from_mock_tfds():
  import tensorflow_datasets as tfds  # noqa: PLC0415 - slow to import
  tokenizer = text_data.load_tokenizer(fixtures.minilm_dir())
  with tfds.testing.mock_data(num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE):
    data = text_data.glue('glue/stsb', tokenizer, 24)
  assert data.num_classes == 1 and len(data.train) == len(data.eval) == 12
  labels = data.train.arrays['labels']
  assert labels.dtype == np.float32 and labels.shape == (12,)
  assert np.all(labels >= 0) and len(np.unique(labels)) > 1  # scores, not class ids
  assert np.all(data.train.arrays['token_type_ids'].max(axis=1) == 1)  # sentence pairs


def test_bert_glue_stsb_regression_on_mock_tfds(tmp_path):
  """STS-B through the real run: a one-output head trained with MSE (also
  with a frozen prefix in epoch 1), evaluated by Pearson and Spearman."""
  config = _tiny(bert_glue.get_config(), tmp_path,
                 **{'data.max_seq_length': 16, 'data.name': 'glue/stsb'})
  workdir = str(tmp_path / 'stsb')
  summary = _run_on_mock(config, workdir, 'bert_glue', num_examples=48)
  assert summary['data'] == 'glue/stsb'
  rows, saved = _check_outputs(workdir, 2)
  assert rows[0]['frozen_layers'] == 0 and rows[1]['frozen_layers'] == 2
  for row in rows:
    assert -1.0 <= row['eval_pearson'] <= 1.0 and -1.0 <= row['eval_spearmanr'] <= 1.0
    assert row['eval_accuracy'] == pytest.approx((row['eval_pearson'] + row['eval_spearmanr'])
                                                 / 2)
    assert row['eval_mse'] >= 0.0
    assert row['train_accuracy'] is None  # a regression has no accuracy
  assert set(saved['final_eval']) >= {'eval_accuracy', 'eval_pearson', 'eval_spearmanr'}


def test_bert_glue_sst2_on_mock_tfds(tmp_path):
  config = _tiny(bert_glue.get_config(), tmp_path, **{'data.max_seq_length': 16})
  workdir = str(tmp_path / 'glue')
  summary = _run_on_mock(config, workdir, 'bert_glue', num_examples=48)
  assert summary['data'] == 'glue/sst2'
  rows, _ = _check_outputs(workdir, 2)
  assert rows[0]['frozen_layers'] == 0 and rows[1]['frozen_layers'] == 2
  for row in rows:  # a count over the 48 mock validation sentences, the padding not counted
    correct = row['eval_accuracy'] * 48
    assert 0 <= round(correct) <= 48 and correct == pytest.approx(round(correct), abs=1e-6)


def test_bert_squad_on_mock_tfds(tmp_path):
  config = _tiny(bert_squad.get_config(), tmp_path,
                 **{'data.max_seq_length': 32, 'data.doc_stride': 8})
  workdir = str(tmp_path / 'squad')
  summary = _run_on_mock(config, workdir, 'bert_squad', num_examples=32)
  assert summary['data'] == 'squad/v1.1'
  rows, saved = _check_outputs(workdir, 2)
  for row in rows:
    assert 0.0 <= row['eval_exact_match'] <= row['eval_f1'] <= 100.0
    assert row['eval_accuracy'] == pytest.approx(row['eval_f1'] / 100)
    assert row['eval_questions'] >= 1
  assert set(saved['final_eval']) >= {'eval_accuracy', 'eval_exact_match', 'eval_f1'}
  assert rows[1]['frozen_layers'] == 2


# -- bad input: one line, exit code 2 ---------------------------------------------------------

@pytest.mark.parametrize('module,args,message', [
    ('bert_glue', ['--config.data.name=glue/nope'], "unknown GLUE task 'glue/nope'"),
    ('bert_glue', ['--config.data.name=glue/stsb'],
     'glue/stsb is not prepared for TFDS in $TFDS_DATA_DIR='),  # a known task now
    ('bert_glue', [], 'glue/sst2 is not prepared for TFDS in $TFDS_DATA_DIR='),
    ('bert_glue', ['--config.data.data_dir=/nonexistent'],
     'error: data.data_dir=/nonexistent is not a directory'),
    ('bert_squad', [], 'prepare it with: tfds build squad/v1.1 --file_format=array_record'),
    ('bert_squad', ['--config.data.data_dir=/nonexistent'],
     'error: data.data_dir=/nonexistent is not a directory'),
    ('bert_squad', ['--config.data.doc_stride=400'], 'data.doc_stride must be in (0, '),
    ('bert_squad', ['--config.data.name=squad/v2.0'], "data.name must be 'squad/v1.1'"),
    ('bert_squad', ['--config.data.n_best_size=0'], 'data.n_best_size must be >= 1, got 0'),
    ('bert_glue', ['--config.model.pretrained=', '--config.model.preset=bert-large',
                   f'--config.model.tokenizer={fixtures.minilm_dir()}',
                   '--config.freeze.min_active_layers=20'],
     'glue/sst2 is not prepared'),  # 20 of bert-large's 24 blocks: not refused as > 12
    ('bert_glue', ['--config.model.no_such_key=1'], 'no_such_key'),
])
def test_bad_input_is_one_line(tmp_path, module, args, message):
  # An empty default TFDS data dir: the commands with no arguments find no data set.
  env = {**os.environ, 'TFDS_DATA_DIR': str(tmp_path / 'tfds')}
  out = subprocess.run([sys.executable, '-m', f'experiments.{module}',
                        f'--workdir={tmp_path / "w"}', *args],
                       capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 2
  assert message in out.stderr
  assert len(out.stderr.strip().splitlines()) == 1
  assert 'Traceback' not in out.stderr + out.stdout


@pytest.mark.parametrize('overrides,message', [
    ({'model.pretrained': '', 'model.tokenizer': ''}, 'a BERT run needs a tokenizer'),
    ({'model.pretrained': '', 'model.tokenizer': '/nonexistent/tok'},
     "cannot load a tokenizer from '/nonexistent/tok': no such directory"),
    ({'model.pretrained': '/nonexistent/bert', 'model.tokenizer': ''},
     "cannot load a tokenizer from '/nonexistent/bert': no such directory"),
    # A hub name the local HF cache does not hold (the Hub cannot be reached here).
    ({'model.pretrained': 'pipejax-test/no-such-model', 'model.tokenizer': ''},
     "cannot load a tokenizer from 'pipejax-test/no-such-model': it is no local directory, and "
     "the local HF cache holds no tokenizer of that name ("),
    ({'model.pretrained': '/nonexistent/bert'}, "cannot load pretrained model from '/nonexistent"),
    ({'model.pretrained': '', 'model.tokenizer': os.path.dirname(os.path.abspath(__file__))},
     "holds no tokenizer (tokenizer.json or vocab.txt)"),
    ({'model.pretrained': os.path.abspath(__file__), 'model.tokenizer': ''},
     f"cannot load a tokenizer from {os.path.abspath(__file__)!r}: it is a file; give the "
     f"directory that holds the model"),
    ({'model.preset': 'bert-huge'}, "model.preset must be 'custom' or one of"),
    ({'data.max_seq_length': 600, 'model.pretrained': fixtures.minilm_dir()},
     "data.max_seq_length=600 exceeds the model's 512 position embeddings (model.pretrained="),
])
def test_bad_model_input_is_one_line(tmp_path, capsys, overrides, message):
  """With the data set present (mocked), model and tokenizer errors are one line too."""
  import tensorflow_datasets as tfds  # noqa: PLC0415 - slow to import
  config = _tiny(bert_glue.get_config(), tmp_path, **{'data.max_seq_length': 16, **overrides})
  with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
    code = elastic.main(config, str(tmp_path / 'w'), task='bert_glue')
  err = capsys.readouterr().err
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_pretrained_head_is_reordered_to_the_data_sets_class_names(tmp_path, capsys):
  """A checkpoint whose classifier names MNLI's classes in its own order
  (``id2label``) gets its outputs in TFDS's order, as HF's ``run_glue`` maps
  them; names that are not the data's are kept, with a warning; unnamed
  classes are left alone."""
  import jax  # noqa: PLC0415
  import models  # noqa: PLC0415
  from transformers import FlaxBertForSequenceClassification  # noqa: PLC0415
  tfds_names = ('entailment', 'neutral', 'contradiction')
  config = models.config_for('bert-classification', **{**fixtures.TINY['bert'], 'num_labels': 3},
                             id2label={0: 'CONTRADICTION', 1: 'Neutral', 2: 'entailment'})
  FlaxBertForSequenceClassification(config, seed=5).save_pretrained(str(tmp_path / 'mnli'))
  created = elastic._pretrained('bert-classification', str(tmp_path / 'mnli'), 3, 0)
  batch = fixtures.batch('bert-classification', created.model, 4, seed=1)
  before = np.asarray(jax.jit(created.model.logits)(created.params, batch))
  matched = elastic.match_head_labels(created, tfds_names, 'glue/mnli')
  after = np.asarray(jax.jit(matched.model.logits)(matched.params, batch))
  np.testing.assert_array_equal(after, before[:, [2, 1, 0]])
  assert matched.model.hf_config.id2label == {0: 'entailment', 1: 'Neutral', 2: 'CONTRADICTION'}
  assert created.model.hf_config.id2label[0] == 'CONTRADICTION'  # the caller's is untouched
  assert "reordered to glue/mnli's order ['entailment', 'neutral', 'contradiction']" in (
      capsys.readouterr().out)
  # Now in the data's order: nothing more to do.
  assert elastic.match_head_labels(matched, tfds_names, 'glue/mnli') is matched
  other = elastic._pretrained('bert-classification', str(tmp_path / 'mnli'), 3, 0)
  assert elastic.match_head_labels(other, ('a', 'b', 'c'), 'glue/x') is other
  assert 'warning: the pretrained head names its classes' in capsys.readouterr().out
  unnamed = fixtures.tiny('bert-classification')  # LABEL_0, LABEL_1
  assert elastic.match_head_labels(unnamed, ('negative', 'positive'), 'glue/sst2') is unnamed
  # The GLUE job's model loading matches the head to its data.
  from pipejax.data import ArraySource  # noqa: PLC0415
  arrays = ArraySource(fixtures.batch('bert-classification', created.model, 4, seed=2))
  data = text_data.TextDataset('glue/mnli', arrays, arrays, 3, 8, label_names=tfds_names)
  config = bert_glue.get_config()
  with config.unlocked():
    config.model.pretrained = str(tmp_path / 'mnli')
  loaded = elastic._bert_model(config, data, 'bert-classification')
  np.testing.assert_array_equal(loaded.params['head']['classifier']['kernel'],
                                matched.params['head']['classifier']['kernel'])


def test_glue_label_names_come_from_tfds():
  import tensorflow_datasets as tfds  # noqa: PLC0415 - slow to import
  tokenizer = text_data.load_tokenizer(fixtures.minilm_dir())
  with tfds.testing.mock_data(num_examples=4, policy=tfds.testing.MockPolicy.USE_CODE):
    assert text_data.glue('glue/mnli', tokenizer, 24).label_names == (
        'entailment', 'neutral', 'contradiction')
    assert text_data.glue('glue/stsb', tokenizer, 24).label_names == ()
