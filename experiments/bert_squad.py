"""Elastic BERT fine-tuning on SQuAD v1.1: ``python -m experiments.bert_squad``.

Paper §4: BERT-large on SQuAD v1.1. Contexts are split into windows of
``data.max_seq_length`` tokens overlapping by ``data.doc_stride`` (HF
``run_qa`` preprocessing); evaluation runs the start/end logits through the
standard post-processing (best of ``data.n_best_size`` starts × ends, at most
``data.max_answer_length`` tokens, best span per question over its windows)
and the official exact-match / F1; ``eval_accuracy`` is F1 / 100. Data come
from TFDS (array_record, no TensorFlow): prepare it with
``tfds build squad/v1.1 --file_format=array_record``; without it the command
says so in one line and exits with code 2.

The model is HF ``FlaxBertForQuestionAnswering`` from
``--config.model.pretrained`` (local directory or HF cache name, tokenized
with its own tokenizer; the QA head is new unless the checkpoint holds one), or with
``--config.model.pretrained=''`` a randomly initialised ``model.preset``
tokenized with ``--config.model.tokenizer=<dir>``.

Flags, outputs and the baseline (``--config.freeze.policy=none``) are those of
``experiments.vit_imagenet``.
"""
from __future__ import annotations

from pipejax import runtime

if __name__ == '__main__':
  runtime.quiet_interrupt()  # a Ctrl-C while it starts: one line
runtime.setup(8)

# pylint: disable=wrong-import-position
import ml_collections  # noqa: E402

from experiments import bert_glue, command_line  # noqa: E402


def get_config() -> ml_collections.ConfigDict:
  """The default configuration (locked: unknown keys are errors)."""
  c = bert_glue.get_config()
  c.unlock()
  c.data = ml_collections.ConfigDict()
  c.data.name = 'squad/v1.1'
  c.data.data_dir = ''  # the TFDS data dir ('': TFDS's default)
  c.data.max_seq_length = 384
  c.data.doc_stride = 128
  c.data.n_best_size = 20
  c.data.max_answer_length = 30
  c.model.kind = 'bert-question_answering'
  c.model.pretrained = 'bert-large-uncased'
  c.model.preset = 'bert-large'
  c.model.num_layers = 24
  c.train.epochs = 2
  c.train.batch_size = 24
  c.train.learning_rate = 3e-5
  c.lock()
  return c


if __name__ == '__main__':
  runtime.exit_now(command_line.cli(__file__, task='bert_squad'))
