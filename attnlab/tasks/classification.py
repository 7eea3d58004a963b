"""SST-2 sentiment classification with a BERT encoder and a [CLS] classifier (task "classification").

Input `[CLS] sentence [SEP]` (cut to `data.max_len`), padded with 0; the logits come from a
Dense layer on the pooled [CLS] vector (`attnlab.models.bert.BertForClassification`). Loss:
cross-entropy; metrics: accuracy; evaluation: accuracy over the whole SST-2 validation split
(872 sentences, counted per sentence).

Initialisation:
- `config.init_from = ""`: every parameter random (fine-tuning from scratch).
- `config.init_from = WORKDIR` of a "masked_lm" run: the encoder (embeddings, blocks, pooler)
  is that run's latest checkpoint; the classifier is new. The run's encoder hyperparameters and
  tokenizer options must equal this config's (checked, with the differing keys named). `init`
  stays a pure function of the key; the trainer calls `load_pretrained` eagerly on every
  replica's step-0 parameters of a new run (whatever `num_seeds` or the device mesh).

The tokenizer is the pretraining run's (kept in its assets folder; without one,
`masked_lm.bert_tokenizer` of the same data options), so the from-scratch baseline sees exactly
the same vocabulary as the pretrained model.
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
from attnlab.data import assets as assets_lib
from attnlab.data import pipeline
from attnlab.errors import ConfigError
from attnlab.models import bert
from attnlab.tasks import masked_lm
from attnlab.tasks import register_task
from attnlab.tasks.base import Task
from attnlab.tasks.base import data_location
from attnlab.tasks.base import ratios

# Model fields that must agree between a pretraining run and the fine-tuning model.
ENCODER_KEYS = ("num_layers", "d_model", "num_heads", "mlp_dim", "max_len", "activation",
                "norm_position", "layer_norm_epsilon", "type_vocab_size", "position")
# Defaults of the encoder keys that older configs lack (a run imported from Hugging Face has them).
ENCODER_DEFAULTS = {"layer_norm_epsilon": 1e-12, "type_vocab_size": bert.NUM_SEGMENTS,
                    "position": "learned"}
# model.attention must agree too, but for its implementation (how it runs, not what it computes).
NUM_CLASSES = 2


def encode_sst2(tokenizer, examples, max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 `[n, max_len]` of `[CLS] sentence [SEP]` padded with 0, labels int32 `[n]`)."""
  ids = np.zeros((len(examples), max_len), np.int32)
  labels = np.zeros((len(examples),), np.int32)
  for i, ex in enumerate(examples):
    seq, _ = masked_lm.make_pair(tokenizer.encode(ex["sentence"]), None, max_len, None,
                                 cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id)
    ids[i, :len(seq)] = seq
    labels[i] = ex["label"]
  return ids, labels


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
  """[CLS] fine-tuning on SST-2 (module docstring)."""

  def __init__(self, config: ml_collections.ConfigDict, assets=None):
    super().__init__(config, assets)
    if "init_from" not in config:
      raise ConfigError("config.init_from is missing; build the config with configs/bert.py "
                        "(mode=finetune)")
    self.tokenizer = self.asset_tokenizer("tokenizer", self._pretraining_tokenizer)
    self.vocab_size = masked_lm.model_vocab_size(config.data, self.tokenizer)
    self.model = bert.from_config(config, self.vocab_size, num_classes=NUM_CLASSES)
    self._train: dict[str, np.ndarray] | None = None
    self._eval: list[dict[str, np.ndarray]] | None = None

  def _pretraining_tokenizer(self) -> Any:
    """The vocabulary kept by the pretraining run (config.init_from), else the one the data
    options build."""
    if self.config.init_from:
      kept = pathlib.Path(self.config.init_from) / assets_lib.DIRNAME
      tokenizer = assets_lib.load_tokenizer(kept, "tokenizer") if kept.is_dir() else None
      if tokenizer is not None:
        return tokenizer
    return masked_lm.bert_tokenizer(self.config.data)

  # ---- data
  def _split(self, split: str, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """`encode_sst2` of the first `limit` sentences of an SST-2 split (all for limit <= 0)."""
    data = self.config.data
    examples = data_lib.get_dataset("sst2", masked_lm.sst2_split(split, limit),
                                    **data_location(data))
    return encode_sst2(self.tokenizer, examples, data.max_len)

  def _arrays(self, split: str, limit: int) -> dict[str, np.ndarray]:
    ids, labels = self._split(split, limit)
    return {"tokens": ids, "labels": labels, "weights": np.ones((len(labels),), np.float32)}

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
    logits = self.model.apply({"params": params}, batch["tokens"], deterministic=deterministic,
                              rngs=None if deterministic else {"dropout": rng})  # [b, classes]
    loss, correct, count = losses.weighted_cross_entropy(logits, batch["labels"], batch["weights"])
    return {"loss": (loss, count), "accuracy": (correct, count)}

  def loss_fn(self, params, batch, rng):
    metrics = ratios(self.metric_sums(params, batch, rng))
    return metrics["loss"], {"accuracy": metrics["accuracy"]}

  def write_plots(self, params, workdir: pathlib.Path) -> None:
    masked_lm.plot_head_views(self, params, workdir, "fine-tuned BERT" if self.config.init_from
                              else "BERT trained from scratch")

