"""Long Range Arena classification (task "long_range"): ListOps, byte-level IMDB, Pathfinder-32.

One task for the three data sets (`config.data.name`); configs/lra.py builds its configs. The
model is `attnlab.models.sequence_classifier.SequenceClassifier` (the BERT encoder + pooling + an
MLP head); loss: cross-entropy; metric: accuracy, over the whole `data.eval_split`.

Inputs (ids: 0 padding, 1 [CLS], symbols from 2; `data.max_len` symbols, plus [CLS] in front
when `model.pooling` is cls):
- listops: one id per token of `attnlab.data.builders.listops.VOCAB` (digits, MIN, MAX, MED, SM,
  brackets); an expression longer than data.max_len is refused (raise data.max_len, or lower the
  generated lengths `data.listops_lengths`): a cut expression has no value.
- imdb_bytes: the review's UTF-8 bytes, cut to data.max_len (LRA: 4,096), padded with 0.
- pathfinder: the 32 x 32 pixels row by row (1,024 ids, pixel value + 2).

Data sizes: `data.size` picks the builder config (runlocal, cpu, paper; imdb_bytes has one set of
reviews for cpu and paper, "full"). `data.num_train` / `data.num_eval` use only the first N
examples (0 = all).

Mechanism: `model.attention.mechanism` ("full" = softmax attention over all pairs; the others from
attnlab.attention.registry) with its options (`model.attention.<mechanism>.*`) goes to the
encoder whole, as in every family (models.attention_config).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attnlab import data as data_lib
from attnlab import losses
from attnlab import models as models_lib
from attnlab.data import pipeline
from attnlab.data.builders import listops as listops_lib
from attnlab.data.builders import pathfinder as pathfinder_lib
from attnlab.errors import ConfigError
from attnlab.models import sequence_classifier as classifier_lib
from attnlab.tasks import register_task
from attnlab.tasks.base import Task
from attnlab.tasks.base import data_location
from attnlab.tasks.base import ratios

# The three data sets: classes and number of symbol ids (besides padding and [CLS]).
DATASETS = {
    "listops": {"classes": listops_lib.NUM_CLASSES, "symbols": len(listops_lib.VOCAB)},
    "imdb_bytes": {"classes": 2, "symbols": 256},
    "pathfinder": {"classes": 2, "symbols": 256},
}
# data.size -> builder config name, per data set (imdb_bytes has one set of reviews for both
# scales).
SIZES = ("runlocal", "cpu", "paper")
_BUILDER_CONFIG = {"imdb_bytes": {"runlocal": "runlocal", "cpu": "full", "paper": "full"}}
# Encoder fields set from config.model (the mechanism's are added where the encoder has them).
ENCODER_KEYS = ("num_layers", "d_model", "num_heads", "mlp_dim", "dropout_rate",
                "attention_dropout_rate", "activation", "norm_position", "position")
_LISTOPS_IDS = {token: i + classifier_lib.FIRST_ID for i, token in enumerate(listops_lib.VOCAB)}


def builder_config(data: ml_collections.ConfigDict) -> Any:
  """The builder config (name or object) of `data.name` at `data.size` with the data fields."""
  if data.size not in SIZES:
    raise ConfigError(f"unknown data.size {data.size!r}; valid sizes: {', '.join(SIZES)}")
  if data.name == "listops":
    low, high = (int(x) for x in data.listops_lengths)
    return listops_lib.Listops.custom_config(data.size, min_len=low, max_len=high)
  return _BUILDER_CONFIG.get(data.name, {}).get(data.size, data.size)


def encode(name: str, examples: Any, max_len: int, cls: bool) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 `[n, max_len + cls]`, labels int32 `[n]`) of examples of data set `name`."""
  offset = int(cls)
  ids = np.zeros((len(examples), max_len + offset), np.int32)
  labels = np.zeros((len(examples),), np.int32)
  if cls:
    ids[:, 0] = classifier_lib.CLS_ID
  for i, ex in enumerate(examples):
    if name == "listops":
      tokens = ex["expression"].split()
      if len(tokens) > max_len:
        raise ConfigError(f"listops: an expression has {len(tokens)} tokens, more than "
                          f"data.max_len={max_len}; raise data.max_len or lower "
                          f"data.listops_lengths")
      seq = np.asarray([_LISTOPS_IDS[t] for t in tokens], np.int32)
    elif name == "imdb_bytes":
      seq = np.frombuffer(ex["text"].encode("utf-8")[:max_len], np.uint8).astype(np.int32)
      seq = seq + classifier_lib.FIRST_ID
    else:
      seq = np.asarray(ex["image"], np.int32).reshape(-1) + classifier_lib.FIRST_ID
      if len(seq) != max_len:
        raise ConfigError(f"pathfinder: an image has {len(seq)} pixels; set data.max_len="
                          f"{len(seq)}")
    ids[i, offset:offset + len(seq)] = seq
    labels[i] = ex["label"]
  return ids, labels


@register_task("long_range")
class LongRangeTask(Task):
  """LRA sequence classification (module docstring)."""

  def __init__(self, config: ml_collections.ConfigDict, assets=None):
    super().__init__(config, assets)
    data, model = config.data, config.model
    if data.name not in DATASETS:
      raise ConfigError(f"unknown data.name {data.name!r} for task long_range; valid: "
                        f"{', '.join(DATASETS)}")
    if model.pooling not in classifier_lib.POOLINGS:
      raise ConfigError(f"unknown model.pooling {model.pooling!r}; valid: "
                        f"{', '.join(classifier_lib.POOLINGS)}")
    if data.max_len < 1:
      raise ConfigError(f"data.max_len must be >= 1 (symbols per example), got {data.max_len}")
    lengths = data.listops_lengths
    if data.name == "listops" and not (
        isinstance(lengths, (list, tuple)) and len(lengths) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in lengths)):
      raise ConfigError(f"data.listops_lengths must be two ints (fewest, most tokens), e.g. "
                        f"(50, 250); got {lengths!r:.80}")
    if data.name == "pathfinder" and data.max_len != pathfinder_lib.PathfinderConfig.size ** 2:
      raise ConfigError(f"pathfinder images have {pathfinder_lib.PathfinderConfig.size ** 2} "
                        f"pixels; set data.max_len={pathfinder_lib.PathfinderConfig.size ** 2}")
    if data.name == "listops" and data.listops_lengths[1] > data.max_len:
      raise ConfigError(f"data.listops_lengths={tuple(data.listops_lengths)} makes expressions "
                        f"longer than data.max_len={data.max_len}; raise data.max_len or lower "
                        f"the lengths")
    self.builder_config = builder_config(data)
    spec = DATASETS[data.name]
    self.num_classes = spec["classes"]
    self.vocab_size = spec["symbols"] + classifier_lib.FIRST_ID
    self.cls = model.pooling == "cls"
    self.seq_len = data.max_len + int(self.cls)
    kwargs = {key: model[key] for key in ENCODER_KEYS}
    self.model = classifier_lib.SequenceClassifier(
        vocab_size=self.vocab_size, max_len=self.seq_len, num_classes=self.num_classes,
        pooling=model.pooling, **kwargs, attention=models_lib.attention_config(model))
    self._train: dict[str, np.ndarray] | None = None
    self._eval: list[dict[str, np.ndarray]] | None = None

  # ---- data
  def examples(self, split: str, limit: int = 0) -> Any:
    """The examples of `split` (the first `limit`; 0 = all)."""
    data = self.config.data
    if limit > 0:
      split = f"{split}[:{limit}]"
    return data_lib.get_dataset(data.name, split, config=self.builder_config,
                                **data_location(data))

  def arrays(self, split: str, limit: int = 0) -> dict[str, np.ndarray]:
    """{"tokens", "labels", "weights"} of `split` as model inputs."""
    data = self.config.data
    ids, labels = encode(data.name, self.examples(split, limit), data.max_len, self.cls)
    return {"tokens": ids, "labels": labels, "weights": np.ones((len(labels),), np.float32)}

  def train_iterator(self) -> pipeline.IndexedBatches:
    if self._train is None:
      self._train = self.arrays("train", self.config.data.num_train)
    return pipeline.permuted_batches(self._train, self.config.batch_size, self.config.seed)

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """`data.eval_split` in batches of data.eval_batch_size."""
    if self._eval is None:
      data = self.config.data
      self._eval = pipeline.ordered_batches(self.arrays(data.eval_split, data.num_eval),
                                            data.eval_batch_size)
    return self._eval

  # ---- parameters and loss
  def init(self, rng: jax.Array) -> Any:
    tokens = jnp.full((1, self.seq_len), classifier_lib.FIRST_ID, jnp.int32)
    return self.model.init(rng, tokens)["params"]

  def logits(self, params: Any, tokens: jax.Array, rng: jax.Array | None = None) -> jax.Array:
    """Class logits `[batch, classes]`; rng None = deterministic (no dropout)."""
    deterministic = rng is None
    return self.model.apply({"params": params}, tokens, deterministic=deterministic,
                            rngs=None if deterministic else {"dropout": rng})

  def metric_sums(self, params, batch, rng=None):
    logits = self.logits(params, batch["tokens"], rng)  # [batch, classes]
    loss, correct, count = losses.weighted_cross_entropy(logits, batch["labels"], batch["weights"])
    return {"loss": (loss, count), "accuracy": (correct, count)}

  def loss_fn(self, params, batch, rng):
    metrics = ratios(self.metric_sums(params, batch, rng))
    return metrics["loss"], {"accuracy": metrics["accuracy"]}

  def write_plots(self, params, workdir: pathlib.Path) -> None:
    """No figures: the study (experiments/long_range) draws the tables' plot."""
