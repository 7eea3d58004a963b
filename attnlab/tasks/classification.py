"""Sentence (or sentence-pair) classification with a BERT encoder and a [CLS] classifier (task
"classification"): SST-2 sentiment, or the user's own labelled CSV/TSV file.

Data (`data.name`):
- "sst2": GLUE SST-2, two classes (negative, positive); evaluation over the whole validation
  split (872 sentences).
- "csv": the file `data.path` (attnlab/data/labeled_csv.py: the format and every check), its
  columns `data.text_column`, `data.text_pair_column` ("" = single sentences) and
  `data.label_column`. The classes are the distinct labels of the file, sorted as strings; they
  are kept in the run (RUN_DIR/assets/labels.json: `task.labels`, `predict`), and their number is
  the classifier's width. Validation: the file `data.valid_path`, else `data.valid_fraction` of
  the training rows held out by a permutation seeded with `data.valid_seed`.
`data.num_train` / `data.num_eval` keep the first N training / validation examples (0 = all).

Input `[CLS] sentence [SEP]`, or `[CLS] a [SEP] b [SEP]` with segment ids 0 for `[CLS] a [SEP]`
and 1 for `b [SEP]` (`masked_lm.make_pair`, the pairs of pretraining), cut to `data.max_len`
(a pair loses tokens from the end of its longer side), padded with 0. The logits come from a
Dense layer on the pooled [CLS] vector (`attnlab.models.bert.BertForClassification`). Loss:
cross-entropy; metrics: accuracy (the argmax over all classes), counted per example.

Initialisation:
- `config.init_from = ""`: every parameter random (fine-tuning from scratch).
- `config.init_from = WORKDIR` of a "masked_lm" run: the encoder (embeddings, blocks, pooler)
  is that run's latest checkpoint; the classifier is new. The run's encoder hyperparameters and
  tokenizer options must equal this config's (checked, with the differing keys named). `init`
  stays a pure function of the key; the trainer calls `load_pretrained` eagerly on every
  replica's step-0 parameters of a new run (whatever `num_seeds` or the device mesh).

The tokenizer is the pretraining run's (kept in its assets folder; without one,
`masked_lm.bert_tokenizer` of the same data options), so the from-scratch SST-2 baseline sees
exactly the same vocabulary as the pretrained model. A from-scratch run on a CSV file learns a
subword vocabulary of at most `data.vocab_size` pieces on the text of its training rows
(`csv_tokenizer`).
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attnlab import data as data_lib
from attnlab import losses
from attnlab import models as models_lib
from attnlab.config_utils import check_choice
from attnlab.data import assets as assets_lib
from attnlab.data import labeled_csv
from attnlab.data import pipeline
from attnlab.data import tokenizers
from attnlab.errors import ConfigError
from attnlab.models import bert
from attnlab.tasks import masked_lm
from attnlab.tasks import register_task
from attnlab.tasks.base import Task
from attnlab.tasks.base import data_location
from attnlab.tasks.base import ratios

# Model fields that must agree between a pretraining run and the fine-tuning model (model.attention
# must agree too, but for its implementation: how it runs, not what it computes).
ENCODER_KEYS = ("num_layers", "d_model", "num_heads", "mlp_dim", "max_len", "activation",
                "norm_position", "layer_norm_epsilon", "type_vocab_size", "position")
# Defaults of the encoder keys that older configs lack (a run imported from Hugging Face has them).
ENCODER_DEFAULTS = {"layer_norm_epsilon": 1e-12, "type_vocab_size": bert.NUM_SEGMENTS,
                    "position": "learned"}
# Values of data.name (module docstring).
DATASETS = ("sst2", "csv")
# SST-2's classes, in the order of its labels 0 and 1.
SST2_LABELS = ("negative", "positive")
NUM_CLASSES = len(SST2_LABELS)


def encode_texts(tokenizer, texts: Sequence[str], pairs: Sequence[str] | None,
                 max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 `[n, max_len]` of `[CLS] a [SEP]`, or `[CLS] a [SEP] b [SEP]` with b from
  `pairs`, padded with 0; segment ids int32 `[n, max_len]`: 1 on `b [SEP]`, else 0)."""
  ids = np.zeros((len(texts), max_len), np.int32)  # [n, max_len]
  segments = np.zeros((len(texts), max_len), np.int32)  # [n, max_len]
  for i, text in enumerate(texts):
    b = None if pairs is None else tokenizer.encode(pairs[i])
    seq, seg = masked_lm.make_pair(tokenizer.encode(text), b, max_len, None,
                                   cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id)
    ids[i, :len(seq)] = seq
    segments[i, :len(seg)] = seg
  return ids, segments


def encode_sst2(tokenizer, examples, max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 `[n, max_len]` of `[CLS] sentence [SEP]` padded with 0, labels int32 `[n]`)."""
  ids, _ = encode_texts(tokenizer, [ex["sentence"] for ex in examples], None, max_len)
  labels = np.asarray([ex["label"] for ex in examples], np.int32).reshape(-1)  # [n]
  return ids, labels


def csv_tokenizer(data: ml_collections.ConfigDict,
                  train: labeled_csv.LabeledRows) -> tokenizers.SubwordTokenizer:
  """The subword vocabulary (at most data.vocab_size pieces) learned on the texts of the
  training rows `train` of data.path, cached under data.tokenizer_dir by the file's content, its
  columns and the split."""
  split = ({"valid_path": "yes"} if data.get("valid_path", "") else
           {"valid_fraction": float(data.valid_fraction), "valid_seed": int(data.valid_seed)})
  options = {"vocab_size": int(data.vocab_size),
             "sha256": hashlib.sha256(train.path.read_bytes()).hexdigest(),
             "delimiter": labeled_csv.delimiter_of(train.path, data.get("delimiter", "")),
             "columns": [data.text_column, data.get("text_pair_column", "")], **split}
  texts = lambda: list(train.texts) + list(train.pairs or [])
  return tokenizers.cached_subword("bert_csv", options, texts, data.tokenizer_dir,
                                   hard_vocab_limit=False)


def pretraining_mismatch(pretrain: ml_collections.ConfigDict,
                         config: ml_collections.ConfigDict) -> list[str]:
  """Keys whose values differ between a pretraining config and a fine-tuning config."""
  if pretrain.get("task") != "masked_lm":  # another task's config lacks the fields compared below
    return [f"task: {pretrain.get('task')!r} (a 'masked_lm' run is needed)"]
  diffs = []
  for key in ENCODER_KEYS:
    default = ENCODER_DEFAULTS.get(key)
    a, b = pretrain.model.get(key, default), config.model.get(key, default)
    if a != b:
      diffs.append(f"model.{key}: {a!r} in the pretraining run, {b!r} here")
  diffs += models_lib.attention_mismatch(pretrain.model, config.model)
  a, b = masked_lm.tokenizer_options(pretrain.data), masked_lm.tokenizer_options(config.data)
  for key in sorted(a):
    if a[key] != b[key]:
      diffs.append(f"data.{key}: {a[key]!r} in the pretraining run, {b[key]!r} here")
  return diffs


@register_task("classification")
class ClassificationTask(Task):
  """[CLS] fine-tuning on SST-2 or a labelled CSV/TSV file (module docstring)."""

  def __init__(self, config: ml_collections.ConfigDict, assets=None):
    super().__init__(config, assets)
    if "init_from" not in config:
      raise ConfigError("config.init_from is missing; build the config with configs/bert.py "
                        "(mode=finetune)")
    self.dataset = check_choice("data.name", config.data.get("name", "sst2"), DATASETS,
                                "datasets")
    self._csv: tuple[labeled_csv.LabeledRows, ...] | None = None
    self.tokenizer = self.asset_tokenizer("tokenizer", self._pretraining_tokenizer)
    self.vocab_size = masked_lm.model_vocab_size(config.data, self.tokenizer)
    # The class names, in the order of the classifier's outputs.
    self.labels: tuple[str, ...] = SST2_LABELS
    if self.dataset == "csv":
      self.labels = self.asset_labels("labels", lambda: labeled_csv.label_set(self._csv_rows()[0]))
    self.model = bert.from_config(config, self.vocab_size, num_classes=len(self.labels))
    self._train: dict[str, np.ndarray] | None = None
    self._eval: list[dict[str, np.ndarray]] | None = None
    if self.dataset == "csv" and self.assets is None:
      # A new run: a validation label outside the training labels is refused before training.
      labeled_csv.label_ids(self._csv_rows()[2], self.labels, config.data.path)

  def _pretraining_tokenizer(self) -> Any:
    """The vocabulary kept by the pretraining run (config.init_from), else the one the data
    options build (for a CSV file from scratch: `csv_tokenizer`)."""
    data = self.config.data
    if self.config.init_from:
      kept = pathlib.Path(self.config.init_from).expanduser() / assets_lib.DIRNAME
      tokenizer = assets_lib.load_tokenizer(kept, "tokenizer") if kept.is_dir() else None
      if tokenizer is not None:
        return tokenizer
    elif self.dataset == "csv" and data.get("tokenizer", "subword") == "subword":
      return csv_tokenizer(data, self._csv_rows()[1])
    return masked_lm.bert_tokenizer(data)

  # ---- data
  def _csv_rows(self) -> tuple[labeled_csv.LabeledRows, ...]:
    """`labeled_csv.read_splits` of the config, read once."""
    if self._csv is None:
      self._csv = labeled_csv.read_splits(self.config.data)
    return self._csv

  def _split(self, split: str, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """`encode_sst2` of the first `limit` sentences of an SST-2 split (all for limit <= 0)."""
    data = self.config.data
    examples = data_lib.get_dataset("sst2", masked_lm.sst2_split(split, limit),
                                    **data_location(data))
    return encode_sst2(self.tokenizer, examples, data.max_len)

  def _csv_split(self, split: str, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, segment ids, label ids) of the first `limit` training or validation rows of the
    CSV data (all for limit <= 0); DataError naming the line of a label outside `labels`."""
    _, train, valid = self._csv_rows()
    rows = train if split == "train" else valid
    if limit > 0:
      rows = rows.select(range(min(limit, len(rows))))
    labels = labeled_csv.label_ids(rows, self.labels, self.config.data.path)
    ids, segments = encode_texts(self.tokenizer, rows.texts, rows.pairs, self.config.data.max_len)
    return ids, segments, labels

  def _arrays(self, split: str, limit: int) -> dict[str, np.ndarray]:
    if self.dataset == "csv":
      ids, segments, labels = self._csv_split(split, limit)
    else:
      ids, labels = self._split(split, limit)
      segments = np.zeros_like(ids)
    return {"tokens": ids, "segments": segments, "labels": labels,
            "weights": np.ones((len(labels),), np.float32)}

  def train_iterator(self) -> pipeline.IndexedBatches:
    if self._train is None:
      self._train = self._arrays("train", self.config.data.num_train)
    return pipeline.permuted_batches(self._train, self.config.batch_size, self.config.seed)

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """The validation split in batches of data.eval_batch_size (weights 1)."""
    if self._eval is None:
      data = self.config.data
      self._eval = pipeline.ordered_batches(self._arrays("validation", data.num_eval),
                                            data.eval_batch_size)
    return self._eval

  # ---- parameters
  def init(self, rng: jax.Array) -> Any:
    tokens = jnp.zeros((1, self.config.data.max_len), jnp.int32)
    return self.model.init(rng, tokens)["params"]

  @classmethod
  def check_pretrained(cls, config: ml_collections.ConfigDict,
                       pretrained_config: ml_collections.ConfigDict) -> None:
    """A masked_lm run with this model's encoder and tokenizer options, else ConfigError."""
    task = pretrained_config.get("task")
    if task != "masked_lm":
      raise ConfigError(f"config.init_from={config.init_from} is a {task!r} run; a masked_lm "
                        f"run is needed (BERT pretraining, configs/bert.py:mode=pretrain, or a "
                        f"BERT checkpoint imported with attnlab import-hf)")
    diffs = pretraining_mismatch(pretrained_config, config)
    if diffs:
      raise ConfigError(f"config.init_from={config.init_from} does not fit this model: "
                        f"{'; '.join(diffs)}; set the same values here (e.g. the same size= and "
                        f"score= in configs/bert.py)")

  def load_pretrained(self, params: Any, pretrained_config: ml_collections.ConfigDict,
                      pretrained_params: Any) -> Any:
    """`params` with the encoder of the pretraining run `config.init_from`."""
    ClassificationTask.check_pretrained(self.config, pretrained_config)
    return bert.transfer_encoder(pretrained_params, params)

  # ---- loss (evaluation: Task.evaluate over every validation sentence)
  def metric_sums(self, params, batch, rng=None):
    deterministic = rng is None
    logits = self.model.apply({"params": params}, batch["tokens"], batch.get("segments"),
                              deterministic=deterministic,
                              rngs=None if deterministic else {"dropout": rng})  # [b, classes]
    loss, correct, count = losses.weighted_cross_entropy(logits, batch["labels"], batch["weights"])
    return {"loss": (loss, count), "accuracy": (correct, count)}

  def loss_fn(self, params, batch, rng):
    metrics = ratios(self.metric_sums(params, batch, rng))
    return metrics["loss"], {"accuracy": metrics["accuracy"]}

  def predict(self, params, texts: Sequence[str],
              pairs: Sequence[str] | None = None) -> list[str]:
    """The predicted label name of each text (each `[CLS] text [SEP] pair [SEP]` with `pairs`)."""
    ids, segments = encode_texts(self.tokenizer, texts, pairs, self.config.data.max_len)
    logits = self.model.apply({"params": params}, jnp.asarray(ids),
                              jnp.asarray(segments))  # [n, classes]
    return [self.labels[i] for i in np.asarray(jnp.argmax(logits, -1))]

  def write_plots(self, params, workdir: pathlib.Path) -> None:
    masked_lm.plot_head_views(self, params, workdir, "fine-tuned BERT" if self.config.init_from
                              else "BERT trained from scratch")

