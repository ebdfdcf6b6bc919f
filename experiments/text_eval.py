"""Evaluation of the BERT experiments from the model's logits.

:class:`GlueEvaluator` and :class:`SquadEvaluator` are ``evaluator``\\ s for
:class:`pipejax.trainer.Trainer`: ``(trainer, canonical_params) -> dict``
with ``eval_accuracy`` (the metric the trainer tracks: accuracy, STS-B's mean
of Pearson and Spearman correlation, SQuAD's F1 / 100; GLUE's own headline for
CoLA, MRPC and QQP is among the task metrics) and task metrics. Logits
come from the canonical parameters run data-parallel over all the trainer's
devices (compiled once per run, whatever the pipeline plan).

SQuAD answers follow the standard post-processing (BERT / HF ``run_qa``):
for each feature the ``n_best`` highest start and end logits give candidate
spans inside the context, at most ``max_answer_length`` tokens, scored by
start + end logit; an example's answer is its best span over all its
features. Exact match and F1 are the official SQuAD v1.1 script's.
"""
from __future__ import annotations

import collections
import dataclasses
import re
import string
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from experiments.text_data import SquadFeatures


class Predictor:
  """Host logits of every example the trainer's eval loader serves."""

  def __init__(self):
    self._fn = None

  def __call__(self, trainer, params, source=None) -> tuple[np.ndarray, Any]:
    """Returns ``(ids [n], outputs)``: the sample IDs in served order (the
    loader's padding dropped) and the model's logits for them on the host
    (a tuple of arrays for question answering). ``source``: another
    evaluation source, served as the trainer's eval loader serves its own."""
    mesh = Mesh(np.array(trainer.devices), ('batch',))
    batch_sharding = NamedSharding(mesh, P('batch'))
    if self._fn is None:
      model = trainer.model
      self._fn = jax.jit(lambda p, b: model.logits(p, b),
                         in_shardings=(NamedSharding(mesh, P()), batch_sharding))
    # train.eval_batch_size (default: 4 x the starting batch), whatever the
    # plan: one compiled forward for the run.
    loader = dataclasses.replace(trainer.eval_loader, batch_size=trainer.eval_batch_size())
    if source is not None:
      loader = over_source(loader, source)
    keys = trainer.model.input_keys
    ids, outputs = [], []
    for batch_ids, batch in loader.epoch(0):
      keep = (np.asarray(batch['example_mask']) > 0 if 'example_mask' in batch
              else np.ones(len(batch_ids), bool))
      out = self._fn(params, jax.device_put({k: batch[k] for k in keys}, batch_sharding))
      outputs.append(jax.tree.map(lambda x, keep=keep: np.asarray(x)[keep], out))
      ids.append(np.asarray(batch_ids)[keep])
    return np.concatenate(ids), jax.tree.map(lambda *xs: np.concatenate(xs), *outputs)


def over_source(loader, source):
  """``loader``'s settings (batch, shards, step cap) over another ``source``:
  all of its IDs (a plain loader's ``ids`` subset is not carried over), and a
  fresh record of served IDs for a sharded loader."""
  if hasattr(loader, 'served'):  # a ShardedLoader: the shards are recomputed for the source
    return dataclasses.replace(loader, source=source, served=set())
  return dataclasses.replace(loader, source=source, ids=None)


def matthews_correlation(predictions: np.ndarray, labels: np.ndarray) -> float:
  """Matthews correlation coefficient of binary predictions (CoLA's metric)."""
  tp = float(np.sum((predictions == 1) & (labels == 1)))
  tn = float(np.sum((predictions == 0) & (labels == 0)))
  fp = float(np.sum((predictions == 1) & (labels == 0)))
  fn = float(np.sum((predictions == 0) & (labels == 1)))
  denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
  return 0.0 if denominator == 0 else (tp * tn - fp * fn) / denominator


def pearson_correlation(x: np.ndarray, y: np.ndarray) -> float:
  """Pearson's correlation coefficient of two samples (0.0 where it is
  undefined: fewer than two values, or either sample constant)."""
  x, y = np.asarray(x, np.float64).reshape(-1), np.asarray(y, np.float64).reshape(-1)
  if len(x) < 2:
    return 0.0
  dx, dy = x - x.mean(), y - y.mean()
  denominator = np.sqrt(np.sum(dx * dx) * np.sum(dy * dy))
  return 0.0 if denominator == 0 else float(np.sum(dx * dy) / denominator)


def average_ranks(x: np.ndarray) -> np.ndarray:
  """Ranks 1..n of ``x``, ties sharing the mean of their ranks
  (``scipy.stats.rankdata(method='average')``)."""
  x = np.asarray(x).reshape(-1)
  order = np.argsort(x, kind='stable')
  ranks = np.empty(len(x), np.float64)
  ranks[order] = np.arange(1, len(x) + 1)
  values, inverse = np.unique(x, return_inverse=True)
  sums = np.bincount(inverse.reshape(-1), weights=ranks, minlength=len(values))
  counts = np.bincount(inverse.reshape(-1), minlength=len(values))
  return (sums / counts)[inverse.reshape(-1)]


def spearman_correlation(x: np.ndarray, y: np.ndarray) -> float:
  """Spearman's rank correlation: Pearson's of the average ranks (STS-B's
  second metric, ``scipy.stats.spearmanr``)."""
  return pearson_correlation(average_ranks(x), average_ranks(y))


def binary_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
  """F1 of the positive class (MRPC's and QQP's second metric)."""
  tp = float(np.sum((predictions == 1) & (labels == 1)))
  predicted, actual = float(np.sum(predictions == 1)), float(np.sum(labels == 1))
  return 0.0 if tp == 0 else 2 * tp / (predicted + actual)


class GlueEvaluator:
  """The GLUE metrics on a validation split.

  Classification tasks: accuracy, plus F1 (MRPC, QQP) or Matthews
  correlation (CoLA): ``eval_accuracy``, ``eval_f1`` / ``eval_matthews``.
  STS-B (regression, the one logit is the predicted score): Pearson and
  Spearman correlation with the gold scores, ``eval_pearson``,
  ``eval_spearmanr``, and ``eval_accuracy`` their mean (GLUE's combined
  score for STS-B; the headline metric the trainer tracks).

  ``more``: further validation sources by suffix (MNLI's ``'_mismatched'``),
  evaluated after the main one; their metrics carry the suffix
  (``eval_accuracy_mismatched``), and the trainer still tracks the main
  ``eval_accuracy``.
  """

  def __init__(self, task: str, labels: np.ndarray, more: dict | None = None):
    self.task, self.labels = task, np.asarray(labels)
    self.more = dict(more or {})
    self.predict = Predictor()

  def __call__(self, trainer, params) -> dict[str, float]:
    metrics = self._metrics(*self.predict(trainer, params), self.labels)
    for suffix, source in self.more.items():
      ids, logits = self.predict(trainer, params, source)
      more = self._metrics(ids, logits, np.asarray(source.arrays['labels']))
      metrics.update({key + suffix: value for key, value in more.items()})
    return metrics

  def _metrics(self, ids, logits, all_labels) -> dict[str, float]:
    if self.task == 'stsb':
      return self.regression_metrics(np.asarray(logits).reshape(-1), all_labels[ids])
    predictions, labels = np.argmax(logits, axis=-1), all_labels[ids]
    metrics = {'eval_accuracy': float(np.mean(predictions == labels)) if len(ids) else 0.0}
    if self.task in ('mrpc', 'qqp'):
      metrics['eval_f1'] = binary_f1(predictions, labels)
    if self.task == 'cola':
      metrics['eval_matthews'] = matthews_correlation(predictions, labels)
    return metrics

  @staticmethod
  def regression_metrics(predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """STS-B's ``eval_pearson``, ``eval_spearmanr``, their mean
    ``eval_accuracy`` and the ``eval_mse`` of ``predictions [n]``."""
    pearson = pearson_correlation(predictions, labels)
    spearman = spearman_correlation(predictions, labels)
    mse = float(np.mean(np.square(predictions - labels))) if len(labels) else 0.0
    return {'eval_accuracy': 0.5 * (pearson + spearman), 'eval_pearson': pearson,
            'eval_spearmanr': spearman, 'eval_mse': mse}


# -- SQuAD v1.1 ---------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
  """The official SQuAD v1.1 normalisation: lower case, no punctuation, no
  articles (a, an, the), single spaces."""
  text = text.lower()
  text = ''.join(ch for ch in text if ch not in set(string.punctuation))
  text = re.sub(r'\b(a|an|the)\b', ' ', text)
  return ' '.join(text.split())


def exact_match(prediction: str, truth: str) -> float:
  """1.0 when the normalised strings are equal."""
  return float(normalize_answer(prediction) == normalize_answer(truth))


def f1_score(prediction: str, truth: str) -> float:
  """Token-overlap F1 of the normalised strings (official SQuAD v1.1)."""
  predicted, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
  common = collections.Counter(predicted) & collections.Counter(gold)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(predicted), same / len(gold)
  return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], answers: dict[str, list[str]]) -> dict[str, float]:
  """``exact_match`` and ``f1`` in percent over the questions of
  ``predictions``, each the maximum over the question's gold ``answers``."""
  em = f1 = 0.0
  for qid, prediction in predictions.items():
    golds = answers[qid] or ['']
    em += max(exact_match(prediction, g) for g in golds)
    f1 += max(f1_score(prediction, g) for g in golds)
  n = max(len(predictions), 1)
  return {'exact_match': 100.0 * em / n, 'f1': 100.0 * f1 / n}


def best_span(start_logits: np.ndarray, end_logits: np.ndarray, offsets: np.ndarray,
              n_best: int = 20, max_answer_length: int = 30) -> tuple[float, int, int] | None:
  """The best answer span of one feature.

  Args:
    start_logits, end_logits: ``[seq]``.
    offsets: ``[seq, 2]`` context character offsets, ``-1`` outside the context.
    n_best: how many top start and top end positions to pair.
    max_answer_length: longest span in tokens.

  Returns:
    ``(score, start_char, end_char)`` of the highest start + end logit among
    valid spans (inside the context, end ≥ start, short enough), or None.
  """
  starts = np.argsort(start_logits)[::-1][:n_best]
  ends = np.argsort(end_logits)[::-1][:n_best]
  s, e = starts[:, None], ends[None, :]
  valid = ((offsets[s, 0] >= 0) & (offsets[e, 0] >= 0) & (e >= s)
           & (e - s + 1 <= max_answer_length))
  if not valid.any():
    return None
  scores = np.where(valid, start_logits[s] + end_logits[e], -np.inf)
  i, j = np.unravel_index(np.argmax(scores), scores.shape)
  return float(scores[i, j]), int(offsets[starts[i], 0]), int(offsets[ends[j], 1])


def squad_predictions(features: SquadFeatures, feature_ids: np.ndarray,
                      start_logits: np.ndarray, end_logits: np.ndarray, n_best: int = 20,
                      max_answer_length: int = 30) -> dict[str, str]:
  """Answer text of every example whose features are all in ``feature_ids``:
  its best span over all its features ('' when none is valid). An example
  that ``feature_ids`` holds only some windows of (an evaluation capped by
  ``train.max_steps_per_epoch`` ends inside one) is left out, not answered
  from the windows it has."""
  best: dict[int, tuple[float, int, int]] = {}
  windows = np.bincount(features.example_index, minlength=len(features.ids))
  served = np.bincount(features.example_index[np.unique(np.asarray(feature_ids, np.int64))],
                       minlength=len(features.ids))
  seen = set(np.flatnonzero((served > 0) & (served == windows)).tolist())
  for row, feature in enumerate(feature_ids):
    example = int(features.example_index[feature])
    if example not in seen:
      continue
    span = best_span(start_logits[row], end_logits[row], features.offsets[feature], n_best,
                     max_answer_length)
    if span is not None and (example not in best or span[0] > best[example][0]):
      best[example] = span
  out = {}
  for example in sorted(seen):
    text = ''
    if example in best:
      _, start, end = best[example]
      text = features.contexts[example][start:end]
    out[features.ids[example]] = text
  return out


class SquadEvaluator:
  """SQuAD v1.1 exact match and F1 from start/end logits: ``eval_exact_match``,
  ``eval_f1`` (percent) and ``eval_accuracy`` = F1 / 100."""

  def __init__(self, features: SquadFeatures, n_best: int = 20, max_answer_length: int = 30):
    self.features, self.n_best, self.max_answer_length = features, n_best, max_answer_length
    self.predict = Predictor()

  def __call__(self, trainer, params) -> dict[str, float]:
    ids, (start, end) = self.predict(trainer, params)
    predictions = squad_predictions(self.features, ids, start, end, self.n_best,
                                    self.max_answer_length)
    answers = dict(zip(self.features.ids, self.features.answers))
    scores = squad_scores(predictions, answers)
    return {'eval_accuracy': scores['f1'] / 100.0, 'eval_exact_match': scores['exact_match'],
            'eval_f1': scores['f1'], 'eval_questions': len(predictions)}
