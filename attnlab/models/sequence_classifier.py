"""A sequence classifier on the BERT encoder: the Long Range Arena's model (task "long_range").

tokens `[batch, len]` -> `BertEncoder` (any score, learned or sinusoidal positions, and the
attention mechanism of the encoder where it has one) -> pooling -> Dense(d_model) + ReLU +
dropout -> Dense(num_classes) (LRA's classifier head: an MLP on the pooled vector).

Pooling: "mean" (the mean of the final vectors over the real tokens; LRA's image tasks) or "cls"
(the final vector of position 0, where the task puts `CLS_ID`; LRA's ListOps and Text). The
encoder's own [CLS] pooler (Dense + tanh) is not used by this head.

Token ids: 0 is padding (never attended to, never pooled), 1 is [CLS], and a task's symbols
start at `FIRST_ID` (bytes and pixel values v -> v + FIRST_ID, so byte 0 and black pixels are
real tokens).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab import models as models_lib
from attnlab.layers import Dense
from attnlab.models import bert

Array = jax.Array

PAD_ID = 0
CLS_ID = 1
# Id of a task's first symbol.
FIRST_ID = 2
# Pooling modes of the classifier.
POOLINGS = ("mean", "cls")


class SequenceClassifier(bert.BertHyperparameters):
  """tokens `[batch, len]` -> class logits `[batch, num_classes]` (module docstring)."""
  # Number of classes.
  num_classes: int = 2
  # mean (over real tokens) or cls (position 0).
  pooling: str = "mean"

  def setup(self):
    if self.pooling not in POOLINGS:
      raise ValueError(f"unknown pooling {self.pooling!r}; valid: {', '.join(POOLINGS)}")
    self.encoder = bert.BertEncoder(**models_lib.shared_fields(self, bert.BertHyperparameters),
                                    name="encoder")
    self.head = Dense(self.d_model, dtype=self.dtype)
    self.head_dropout = nn.Dropout(self.dropout_rate)
    self.classifier = Dense(self.num_classes, dtype=self.dtype)

  def __call__(self, tokens: Array, *, deterministic: bool = True,
               sow_weights: bool | None = None) -> Array:
    """Class logits `[batch, num_classes]` (float32); `tokens` int `[batch, len]` (0 = padding)."""
    valid = tokens != PAD_ID  # [batch, len]
    x, _ = self.encoder(tokens, None, valid, deterministic=deterministic,
                        sow_weights=sow_weights)  # [batch, len, d]
    if self.pooling == "cls":
      pooled = x[:, 0]  # [batch, d]
    else:
      weights = valid[..., None].astype(x.dtype)  # [batch, len, 1]
      pooled = (x * weights).sum(1) / jnp.maximum(weights.sum(1), 1.0)  # [batch, d]
    h = nn.relu(self.head(pooled))  # [batch, d]
    h = self.head_dropout(h, deterministic=deterministic)
    return self.classifier(h).astype(jnp.float32)  # [batch, num_classes]
