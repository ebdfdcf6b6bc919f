"""Elastic BERT fine-tuning on GLUE: ``python -m experiments.bert_glue``.

SST-2 by default (paper §4: BERT-base on SST-2); any GLUE task, single
sentence or pair, with ``--config.data.name=glue/<task>`` (cola, sst2, mrpc,
stsb, qqp, mnli, qnli, rte, wnli). STS-B is a regression: the head has one
output trained with mean squared error on the [0, 5] similarity scores (as
HF's BERT does with ``num_labels=1``). Data come from TFDS (array_record,
``tfds.data_source``, no TensorFlow): prepare it with ``tfds build glue/sst2
--file_format=array_record``; without it the command says so in one line and
exits with code 2. Evaluation is on the validation split (MNLI: both,
``validation_matched`` as ``eval_accuracy`` and ``validation_mismatched`` as
``eval_accuracy_mismatched``): accuracy, plus F1 (MRPC, QQP) or Matthews
correlation (CoLA); for STS-B Pearson and Spearman correlation
(``eval_pearson``, ``eval_spearmanr``) with ``eval_accuracy`` their mean,
GLUE's combined score.

The model is HF ``FlaxBertForSequenceClassification`` from
``--config.model.pretrained`` (a local directory or HF cache name; its own
tokenizer tokenizes the data; the classifier is new unless the checkpoint holds
one of the task's size, and a kept one whose ``id2label`` orders the classes
otherwise than TFDS is reordered to TFDS's order). With
``--config.model.pretrained=''`` a randomly initialised ``model.preset``
(``bert-base``, ``bert-large`` or ``custom``) is trained instead, tokenized
with ``--config.model.tokenizer=<dir>``.

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

from experiments import command_line, vit_imagenet  # noqa: E402


def get_config() -> ml_collections.ConfigDict:
  """The default configuration (locked: unknown keys are errors)."""
  c = vit_imagenet.get_config()
  c.unlock()
  c.data = ml_collections.ConfigDict()
  c.data.name = 'glue/sst2'  # glue/<task>
  c.data.data_dir = ''  # the TFDS data dir ('': TFDS's default)
  c.data.max_seq_length = 128
  c.model = ml_collections.ConfigDict()
  c.model.kind = 'bert-classification'
  c.model.pretrained = 'bert-base-uncased'  # a local directory or HF cache name; '': preset
  c.model.tokenizer = ''  # '': the pretrained model's own tokenizer
  c.model.preset = 'bert-base'  # without pretrained: 'bert-base', 'bert-large' or 'custom'
  c.model.hidden_size = 128  # 'custom' only, as are the next four
  c.model.num_layers = 12
  c.model.num_heads = 2
  c.model.intermediate_size = 512
  c.model.dropout = 0.1
  c.train.epochs = 3
  c.train.batch_size = 32
  c.train.learning_rate = 2e-5
  c.train.weight_decay = 0.01
  c.train.decay_biases_and_norms = False  # BERT's recipe (and HF's Trainer)
  c.train.max_grad_norm = 1.0
  c.train.warmup_epochs = 0.1
  c.lock()
  return c


if __name__ == '__main__':
  runtime.exit_now(command_line.cli(__file__, task='bert_glue'))
