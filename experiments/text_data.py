"""Text data sets of the BERT experiments: GLUE and SQuAD v1.1 from TFDS
(array_record, read with ``tfds.data_source``, no TensorFlow), tokenized once
with the model's own HF tokenizer into in-memory arrays served by
:class:`pipejax.data.ArraySource`.

Every batch holds ``input_ids``, ``attention_mask`` and ``token_type_ids``
``[batch, max_seq_length]`` (int32) plus the labels: ``labels [batch]`` for
GLUE (int32 classes; float32 similarity scores in [0, 5] for the regression
task STS-B), ``start_positions`` and ``end_positions [batch]`` for SQuAD
training. SQuAD evaluation features keep their example and character offsets
on the host (:class:`SquadFeatures`), never in the batch fed to the model.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Callable

import numpy as np

from experiments.datasets import DatasetMissing, import_tfds, tfds_data_source
from pipejax import distributed
from pipejax.data import ArraySource


class TextConfigError(ValueError):
  """A text task, tokenizer or sequence setting the run cannot use."""


@dataclasses.dataclass(frozen=True)
class GlueTask:
  """One GLUE task: its text features, classes (1: a regression, STS-B), eval
  split, and further validation splits evaluated beside it (MNLI's
  mismatched genres), each reported under its own suffix."""
  features: tuple[str, ...]
  num_classes: int
  eval_split: str = 'validation'
  more_eval_splits: tuple[tuple[str, str], ...] = ()  # (split, metric suffix)

  @property
  def regression(self) -> bool:
    """One output: float labels and a mean-squared-error loss."""
    return self.num_classes == 1


#: GLUE tasks (the test splits have no labels: -1). STS-B is a regression
#: (similarity in [0, 5]): a one-output head.
GLUE_TASKS = {
    'cola': GlueTask(('sentence',), 2),
    'sst2': GlueTask(('sentence',), 2),
    'mrpc': GlueTask(('sentence1', 'sentence2'), 2),
    'stsb': GlueTask(('sentence1', 'sentence2'), 1),
    'qqp': GlueTask(('question1', 'question2'), 2),
    'mnli': GlueTask(('premise', 'hypothesis'), 3, 'validation_matched',
                     (('validation_mismatched', '_mismatched'),)),
    'qnli': GlueTask(('question', 'sentence'), 2),
    'rte': GlueTask(('sentence1', 'sentence2'), 2),
    'wnli': GlueTask(('sentence1', 'sentence2'), 2),
}


@dataclasses.dataclass
class TextDataset:
  """A tokenized text data set.

  Attributes:
    name: the TFDS name, e.g. ``'glue/sst2'``.
    train, eval: sources of model inputs and labels (eval of SQuAD: inputs only).
    num_classes: classifier outputs (1 for STS-B's regression, 2 for SQuAD:
      start and end logits).
    max_seq_length: the padded sequence length.
    evaluator: ``(trainer, canonical_params) -> dict`` for the trainer, or None.
    more_eval: further evaluation sources by metric suffix (MNLI's
      ``'_mismatched'``: ``validation_mismatched``); the evaluator reports
      their metrics beside ``eval``'s, e.g. ``eval_accuracy_mismatched``.
    label_names: the class names in label order (TFDS's), () where unknown
      or a regression; a pretrained head that names its labels is matched to
      them.
  """
  name: str
  train: Any
  eval: Any
  num_classes: int
  max_seq_length: int
  evaluator: Callable | None = None
  more_eval: dict[str, Any] = dataclasses.field(default_factory=dict)
  label_names: tuple[str, ...] = ()


def glue_task(name: str) -> tuple[str, GlueTask]:
  """``'glue/sst2'`` or ``'sst2'`` → ``('sst2', GlueTask)``; one-line errors."""
  task = name[len('glue/'):] if name.startswith('glue/') else name
  if task not in GLUE_TASKS:
    raise TextConfigError(f'unknown GLUE task {name!r}; expected glue/<task> with task one of '
                          f'{sorted(GLUE_TASKS)}')
  return task, GLUE_TASKS[task]


#: The files of which a model directory or HF cache entry holds at least one
#: where it has a tokenizer.
TOKENIZER_FILES = ('tokenizer.json', 'vocab.txt', 'tokenizer_config.json')


def load_tokenizer(path: str):
  """The fast HF tokenizer of a model directory or HF cache name."""
  if not path:
    raise TextConfigError('a BERT run needs a tokenizer: set --config.model.pretrained=<local '
                          'dir or HF cache name> (weights and tokenizer), or '
                          '--config.model.tokenizer=<dir> for a randomly initialised preset')
  from transformers import AutoTokenizer  # noqa: PLC0415 - heavy import kept local
  if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, name))
                                     for name in TOKENIZER_FILES):
    # transformers would fail with "'NoneType' object has no attribute 'endswith'"
    raise TextConfigError(f'{path!r} holds no tokenizer (tokenizer.json or vocab.txt); '
                          f'--config.model.tokenizer=<dir> names a folder that does')
  try:
    tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
  except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise bare Exceptions too
    if path.startswith(('/', '.', '~')) and not os.path.exists(os.path.expanduser(path)):
      raise TextConfigError(f'cannot load a tokenizer from {path!r}: no such directory') from e
    if os.path.exists(path) and not os.path.isdir(path):
      raise TextConfigError(f'cannot load a tokenizer from {path!r}: it is a file; give the '
                            f'directory that holds the model') from e
    import models  # noqa: PLC0415 - heavy import kept local
    if not os.path.isdir(path) and not models.in_hf_cache(path, TOKENIZER_FILES):
      raise TextConfigError(
          f'cannot load a tokenizer from {path!r}: it is no local directory, and the local HF '
          f'cache holds no tokenizer of that name ({type(e).__name__}); download the model '
          f'into the HF cache where the Hub can be reached (huggingface-cli download {path}) '
          f'or give a local directory') from e
    detail = distributed.first_line(str(e)) or type(e).__name__
    raise TextConfigError(f'cannot load a tokenizer from {path!r}: {detail} (a model '
                          f'without one needs --config.model.tokenizer=<dir>)') from e
  if not tokenizer.is_fast:
    raise TextConfigError(f'the tokenizer of {path!r} is not a fast tokenizer (offsets needed)')
  missing = [name for name in ('pad_token', 'cls_token', 'sep_token')
             if getattr(tokenizer, f'{name}_id') is None]
  if missing:
    raise TextConfigError(f'the tokenizer of {path!r} has no {", ".join(missing)} (BERT inputs '
                          f'need [CLS] ... [SEP] padded with [PAD])')
  if tokenizer.padding_side != 'right':
    raise TextConfigError(f'the tokenizer of {path!r} pads on the {tokenizer.padding_side}; '
                          f'BERT tasks read [CLS] at position 0 (right padding)')
  return tokenizer


def _data_source(name: str, split: str, data_dir: str, builder_module: str):
  """``tfds.data_source(name, split)`` without downloading; DatasetMissing if absent."""
  tfds = import_tfds(name)
  # Without TensorFlow tfds imports its builder packages lazily; the builder
  # class registers itself (and its config names) only once imported.
  importlib.import_module(builder_module)
  return tfds_data_source(tfds, name, split, data_dir)


def _text(value) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def _examples(source, name: str, chunk: int = 4096) -> list[dict]:
  """Every example of a data source, read in chunks (random access);
  :class:`DatasetMissing` (one line) when its files cannot be read."""
  out = []
  batched = hasattr(source, '__getitems__')
  try:
    for start in range(0, len(source), chunk):
      ids = list(range(start, min(start + chunk, len(source))))
      if batched:
        try:
          out.extend(source.__getitems__(ids))
          continue
        except TypeError:  # tfds.testing.mock_data's sources read one record at a time
          batched = False
      out.extend(source[i] for i in ids)
  except Exception as e:  # array_record raises RuntimeError, OSError, ValueError, …
    raise DatasetMissing(f'cannot read the prepared {name} ({type(e).__name__}: '
                         f'{str(e)[:160]}): its files are damaged; prepare it again with: '
                         f'tfds build {name} --file_format=array_record') from e
  return out


def _encode(tokenizer, columns: list[list[str]], max_seq_length: int) -> dict[str, np.ndarray]:
  enc = tokenizer(*columns, padding='max_length', truncation=True, max_length=max_seq_length,
                  return_token_type_ids=True, return_attention_mask=True)
  return {k: np.asarray(enc[k], np.int32)
          for k in ('input_ids', 'attention_mask', 'token_type_ids')}


def check_lengths(max_seq_length: int, doc_stride: int | None = None) -> None:
  """One-line errors for sequence settings no tokenizer can honour."""
  if max_seq_length < 8:
    raise TextConfigError(f'data.max_seq_length must be >= 8, got {max_seq_length}')
  if doc_stride is not None and not 0 < doc_stride < max_seq_length:
    raise TextConfigError(f'data.doc_stride must be in (0, max_seq_length={max_seq_length}), '
                          f'got {doc_stride}')


def glue(name: str, tokenizer, max_seq_length: int, data_dir: str = '') -> TextDataset:
  """A GLUE task (train, and validation for evaluation; MNLI's
  ``validation_mismatched`` too, in ``more_eval['_mismatched']``).

  ``tokenizer`` is an HF fast tokenizer, or the path to load one from once
  the data set is found (so a missing data set is reported first). Pair
  tasks encode ``[CLS] a [SEP] b [SEP]`` with ``token_type_ids`` 0/1; pairs
  longer than ``max_seq_length`` are truncated longest-first. Examples
  without a label (-1) are dropped. Labels are int32 classes, or float32
  scores for STS-B (``num_classes == 1``).
  """
  task, spec = glue_task(name)
  check_lengths(max_seq_length)
  tfds_name = f'glue/{task}'
  more = dict(spec.more_eval_splits)
  sources = {split: _data_source(tfds_name, split, data_dir, 'tensorflow_datasets.text.glue')
             for split in ('train', spec.eval_split, *more)}
  tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
  out = {}
  for split, source in sources.items():
    examples = [e for e in _examples(source, tfds_name) if float(e['label']) >= 0]
    if not examples:
      raise DatasetMissing(f'{tfds_name} split {split!r} has no labelled examples')
    columns = [[_text(e[f]) for e in examples] for f in spec.features]
    arrays = _encode(tokenizer, columns, max_seq_length)
    labels = [e['label'] for e in examples]
    arrays['labels'] = (np.asarray(labels, np.float32) if spec.regression
                        else np.asarray([int(v) for v in labels], np.int32))
    out[split] = ArraySource(arrays)
  return TextDataset(tfds_name, out['train'], out[spec.eval_split], spec.num_classes,
                     max_seq_length,
                     more_eval={suffix: out[split] for split, suffix in more.items()},
                     label_names=() if spec.regression else _label_names(sources['train']))


def _label_names(source) -> tuple[str, ...]:
  """The class names of a TFDS source's ``label`` feature, () if it has none."""
  features = getattr(getattr(source, 'dataset_info', None), 'features', None)
  try:
    return tuple(str(name) for name in features['label'].names)
  except (TypeError, KeyError, AttributeError):
    return ()


@dataclasses.dataclass
class SquadFeatures:
  """Host-side view of SQuAD evaluation features (several per long context).

  Attributes:
    example_index: ``[features]`` the example each feature comes from.
    offsets: ``[features, seq, 2]`` character span of each token in the
      context; ``-1`` for question, special and padding tokens.
    contexts: the context of every example.
    answers: the gold answer texts of every example.
    ids: the SQuAD question IDs.
  """
  example_index: np.ndarray
  offsets: np.ndarray
  contexts: list[str]
  answers: list[list[str]]
  ids: list[str]


def _tokenize_squad(tokenizer, examples, max_seq_length: int, doc_stride: int):
  questions = [_text(e['question']).lstrip() for e in examples]
  contexts = [_text(e['context']) for e in examples]
  pad_right = tokenizer.padding_side == 'right'
  if not pad_right:
    raise TextConfigError('SQuAD features need a right-padding tokenizer (question first)')
  try:
    enc = tokenizer(questions, contexts, truncation='only_second', max_length=max_seq_length,
                    stride=doc_stride, return_overflowing_tokens=True,
                    return_offsets_mapping=True, padding='max_length',
                    return_token_type_ids=True, return_attention_mask=True)
  except BaseException as e:  # noqa: BLE001 - tokenizers raises bare Exceptions, and panics
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
      raise
    # A window holds [CLS] question [SEP] context [SEP]: where a context must
    # be cut, its part must exceed the overlap, or the tokenizer cannot advance.
    longest = max((len(ids) for ids in
                   tokenizer(questions, add_special_tokens=False)['input_ids']), default=0)
    room = max_seq_length - tokenizer.num_special_tokens_to_add(pair=True) - longest
    if doc_stride >= room:
      raise TextConfigError(f'data.doc_stride={doc_stride} must be below the context room of a '
                            f'window, max_seq_length={max_seq_length} - special tokens - the '
                            f'longest question ({longest} tokens) = {room}; raise '
                            f'data.max_seq_length' + (' or lower data.doc_stride' if room > 1
                                                      else '')) from e
    raise TextConfigError(f'cannot split SQuAD contexts with max_seq_length={max_seq_length}, '
                          f'doc_stride={doc_stride}: '
                          f'{distributed.first_line(str(e)) or type(e).__name__}') from e
  return enc, contexts


def _answer(example) -> tuple[list[str], list[int]]:
  answers = example['answers']
  texts = [_text(t) for t in np.atleast_1d(answers['text'])]
  starts = [int(s) for s in np.atleast_1d(answers['answer_start'])]
  return texts, starts


def squad_train_features(tokenizer, examples, max_seq_length: int,
                         doc_stride: int) -> dict[str, np.ndarray]:
  """Training features (HF ``run_qa`` style): each context split into windows
  of ``max_seq_length`` tokens overlapping by ``doc_stride``; the answer's
  token span is the label, or ``[CLS]`` (0, 0) when the window misses it."""
  enc, _ = _tokenize_squad(tokenizer, examples, max_seq_length, doc_stride)
  starts, ends = [], []
  for i, offsets in enumerate(enc['offset_mapping']):
    cls = enc['input_ids'][i].index(tokenizer.cls_token_id)
    sequence_ids = enc.sequence_ids(i)
    texts, answer_starts = _answer(examples[enc['overflow_to_sample_mapping'][i]])
    context = [t for t, s in enumerate(sequence_ids) if s == 1]
    start = end = cls
    if texts and answer_starts and context:
      start_char = answer_starts[0]
      end_char = start_char + len(texts[0])
      first, last = context[0], context[-1]
      if offsets[first][0] <= start_char and offsets[last][1] >= end_char:
        start = first
        while start <= last and offsets[start][0] <= start_char:
          start += 1
        start -= 1
        end = last
        while end >= first and offsets[end][1] >= end_char:
          end -= 1
        end += 1
    starts.append(start)
    ends.append(end)
  arrays = {k: np.asarray(enc[k], np.int32)
            for k in ('input_ids', 'attention_mask', 'token_type_ids')}
  arrays['start_positions'] = np.asarray(starts, np.int32)
  arrays['end_positions'] = np.asarray(ends, np.int32)
  return arrays


def squad_eval_features(tokenizer, examples, max_seq_length: int,
                        doc_stride: int) -> tuple[dict[str, np.ndarray], SquadFeatures]:
  """Evaluation features: model inputs, and on the host each feature's
  example and the context character offsets of its tokens."""
  enc, contexts = _tokenize_squad(tokenizer, examples, max_seq_length, doc_stride)
  offsets = np.full((len(enc['input_ids']), max_seq_length, 2), -1, np.int32)
  for i, pairs in enumerate(enc['offset_mapping']):
    in_context = np.asarray([s == 1 for s in enc.sequence_ids(i)])
    offsets[i][in_context] = np.asarray(pairs, np.int32)[in_context]
  arrays = {k: np.asarray(enc[k], np.int32)
            for k in ('input_ids', 'attention_mask', 'token_type_ids')}
  host = SquadFeatures(np.asarray(enc['overflow_to_sample_mapping'], np.int64), offsets, contexts,
                       [_answer(e)[0] for e in examples], [_text(e['id']) for e in examples])
  return arrays, host


def squad(tokenizer, max_seq_length: int, doc_stride: int,
          data_dir: str = '') -> tuple[TextDataset, SquadFeatures]:
  """SQuAD v1.1: training features and evaluation features (validation).

  ``tokenizer`` as in :func:`glue`."""
  check_lengths(max_seq_length, doc_stride)
  name = 'squad/v1.1'
  module = 'tensorflow_datasets.question_answering.squad'
  train_source = _data_source(name, 'train', data_dir, module)
  eval_source = _data_source(name, 'validation', data_dir, module)
  tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
  train = squad_train_features(tokenizer, _examples(train_source, name), max_seq_length,
                               doc_stride)
  eval_arrays, host = squad_eval_features(tokenizer, _examples(eval_source, name),
                                          max_seq_length, doc_stride)
  return (TextDataset(name, ArraySource(train), ArraySource(eval_arrays), 2, max_seq_length),
          host)
