"""Text classification with an RNN and last, mean or attention pooling (task "rnn_classification").

configs/classify.py builds its configs. Model: `attnlab.models.rnn_classifier.RNNClassifier`
(embedding -> GRU/LSTM layers -> `model.pooling` last|mean|attention -> Dense); loss:
cross-entropy; metric: accuracy over the whole evaluation split (counted per example).

Data: `attnlab.data.labelled.read(config.data, split, limit)`, by `data.name` (sst2, the
synthetic cue_word, or any reader registered there), split "train" (the first `data.num_train`)
and "validation" (the first `data.num_eval`). The texts are tokenized with a word or character
tokenizer (`data.tokenizer`; words: lower-cased, punctuation split off, seen at least
`data.min_count` times in training, else <unk>) trained on the training texts and cut to
`data.max_len` tokens. Training batches are padded with 0 to the smallest of `data.buckets` (and
data.max_len) that holds their longest text, grouped by that length (SST-2's training phrases
have a median of 7 tokens); evaluation batches to data.max_len. The tokenizer and the number of
classes are the run's assets: a run reloads, evaluates and is viewed without its data.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attnlab import losses
from attnlab.config_utils import check_choice
from attnlab.data import labelled
from attnlab.data import pipeline
from attnlab.data import tokenizers
from attnlab.errors import ConfigError
from attnlab.models import rnn_classifier
from attnlab.tasks import register_task
from attnlab.tasks.base import Task
from attnlab.tasks.base import ratios

# Values of data.tokenizer.
TOKENIZERS = ("word", "char")


@register_task("rnn_classification")
class RNNClassificationTask(Task):
  """An RNN text classifier (module docstring)."""

  def __init__(self, config: ml_collections.ConfigDict, assets=None):
    super().__init__(config, assets)
    data = config.data
    check_choice("data.name", data.name, labelled.reader_names(), "datasets")
    check_choice("data.tokenizer", data.tokenizer, TOKENIZERS, "tokenizers")
    for key in ("max_len", "min_count", "eval_batch_size"):
      if data[key] < 1:
        raise ConfigError(f"data.{key} must be >= 1, got {data[key]}")
    if not all(isinstance(b, int) and b >= 1 for b in data.buckets):
      raise ConfigError(f"data.buckets must be padded lengths >= 1, e.g. (16, 32), got "
                        f"{tuple(data.buckets)!r:.60}")
    if data.name == "cue_word" and data.cue_word.max_len > data.max_len:
      raise ConfigError(f"data.cue_word.max_len={data.cue_word.max_len} makes sentences longer "
                        f"than data.max_len={data.max_len}: the cue word could be cut off; raise "
                        f"data.max_len or lower data.cue_word.max_len")
    self._train_texts: labelled.LabelledTexts | None = None
    self.tokenizer = self.asset_tokenizer("tokenizer", self._train_tokenizer)
    self.num_classes = self.asset_size("num_classes", lambda: self._training().num_classes)
    # The class names, where the data name them (csv: assets/labels.json; a reloaded run maps
    # class ids back without the file); () otherwise.
    self.labels = (self.asset_labels("labels", lambda: self._training().names)
                   if data.name == "csv" else ())
    self.model = rnn_classifier.from_config(config.model, len(self.tokenizer), self.num_classes)
    self._train: list[dict[str, Any]] | None = None
    self._eval: list[dict[str, np.ndarray]] | None = None

  # ---- data
  def _training(self) -> labelled.LabelledTexts:
    if self._train_texts is None:
      self._train_texts = labelled.read(self.config.data, "train", self.config.data.num_train)
    return self._train_texts

  def _train_tokenizer(self) -> tokenizers.Vocab:
    data, texts = self.config.data, self._training().texts
    if data.tokenizer == "char":
      return tokenizers.CharTokenizer.train(texts, min_count=data.min_count)
    return tokenizers.WordTokenizer.train(texts, lower=True, split_punct=True,
                                          min_count=data.min_count)

  def encode(self, text: str) -> np.ndarray:
    """int32 ids `[n]` of `text` (cut to data.max_len tokens); ValueError when there are none."""
    ids = self.tokenizer.encode(text)[:self.config.data.max_len]
    if not ids:
      raise ValueError(f"{text[:40]!r} has no tokens; give a text with at least one")
    return np.asarray(ids, np.int32)

  def _ids(self, examples: labelled.LabelledTexts) -> list[list[int]]:
    if examples.num_classes > self.num_classes:
      raise ConfigError(f"the data have {examples.num_classes} classes but this model "
                        f"{self.num_classes}")
    return [self.tokenizer.encode(text)[:self.config.data.max_len] for text in examples.texts]

  def arrays(self, examples: labelled.LabelledTexts) -> dict[str, np.ndarray]:
    """{"tokens" int32 `[n, data.max_len]` (0-padded), "labels" int32 `[n]`, "example_mask"
    bool `[n]`}: the evaluation arrays."""
    ids = self._ids(examples)
    tokens = np.zeros((len(ids), self.config.data.max_len), np.int32)
    for i, row in enumerate(ids):
      tokens[i, :len(row)] = row
    return {"tokens": tokens, "labels": examples.labels.astype(np.int32),
            pipeline.EXAMPLE_MASK: np.ones((len(ids),), bool)}

  def buckets(self) -> list[int]:
    """The padded lengths of training batches: data.buckets below data.max_len, then max_len."""
    max_len = self.config.data.max_len
    return sorted({int(b) for b in self.config.data.buckets if b < max_len} | {max_len})

  def train_iterator(self) -> pipeline.Batcher:
    """Training batches {"tokens", "labels", "example_mask", ...} (pipeline.Batcher): a fresh
    permutation per epoch, grouped by padded length (`buckets`; one compile per length)."""
    if self._train is None:
      texts = self._training()
      self._train = [{"tokens": ids, "labels": int(label)}
                     for ids, label in zip(self._ids(texts), texts.labels)]
    return pipeline.Batcher(self._train, self.config.batch_size, seed=self.config.seed,
                            buckets=self.buckets())

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """The validation split (its first data.num_eval) in batches of data.eval_batch_size, padded
    to data.max_len."""
    if self._eval is None:
      data = self.config.data
      self._eval = pipeline.ordered_batches(
          self.arrays(labelled.read(data, "validation", data.num_eval)), data.eval_batch_size)
    return self._eval

  # ---- parameters and loss
  def init(self, rng: jax.Array) -> Any:
    tokens = jnp.full((1, self.config.data.max_len), tokenizers.UNK_ID, jnp.int32)
    return self.model.init(rng, tokens)["params"]

  def logits(self, params: Any, tokens: jax.Array, rng: jax.Array | None = None) -> jax.Array:
    """Class logits `[batch, classes]`; rng None = deterministic (no dropout)."""
    deterministic = rng is None
    return self.model.apply({"params": params}, tokens, deterministic=deterministic,
                            rngs=None if deterministic else {"dropout": rng})

  def metric_sums(self, params, batch, rng=None):
    logits = self.logits(params, batch["tokens"], rng)  # [batch, classes]
    weights = batch[pipeline.EXAMPLE_MASK].astype(jnp.float32)  # [batch]: 0 for padding rows
    loss, correct, count = losses.weighted_cross_entropy(logits, batch["labels"], weights)
    return {"loss": (loss, count), "accuracy": (correct, count)}

  def loss_fn(self, params, batch, rng):
    metrics = ratios(self.metric_sums(params, batch, rng))
    return metrics["loss"], {"accuracy": metrics["accuracy"]}

  def write_plots(self, params, workdir: pathlib.Path) -> None:
    """No figures: `attnlab view --workdir=DIR --text=...` shows attention pooling's weights."""
