"""An RNN text classifier: the first step of the story of attention (task "rnn_classification").

tokens `[batch, len]` (0 = padding, right-padded) -> embedding -> 1..n GRU or LSTM layers
(optionally bidirectional, the two directions' states concatenated: `attnlab.models.seq2seq.Encoder`,
the encoder of the RNN seq2seq family) -> pooling -> dropout -> Dense(num_classes).

Pooling (`pooling`), over the top layer's states h_1..h_T of the T real tokens:
- `last`: the final state, h_T (for a bidirectional encoder, [forward h_T; backward h_1]: each
  direction's state after reading the whole sentence). Padding never changes it: the recurrence
  stops at each row's length.
- `mean`: (1/T) sum_t h_t.
- `attention`: Yang et al. (2016)'s word attention with a learned context vector u_w
  (`attnlab.layers.pooling.AttentionPooling`): alpha_t = softmax_t(tanh(W h_t + b) . u_w),
  pooled = sum_t alpha_t h_t; padded positions get weight 0. The weights are sown as
  `intermediates/pooling/attention_weights` `[batch, 1, len]`, the one attention of the model.

`pool(tokens)` (a method for `apply(..., method=RNNClassifier.pool)`) gives the states, the mask
and the pooled vector, so that tests and analysis can see what the classifier reads.

Hook sites (attnlab.layers.hooks; public names and shapes: attnlab.analysis.hooks.SITES): the
encoder's "embedded" and "states" (seq2seq.Encoder's own), attention pooling's "pattern", and
"pooled", what the classifier reads.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab import models as models_lib
from attnlab import precision
from attnlab.attention import pooling as pooling_lib
from attnlab.errors import ConfigError
from attnlab.layers import hooks
from attnlab.layers.pooling import AttentionPooling
from attnlab.models import seq2seq

PAD_ID = 0
# Values of model.pooling.
POOLINGS = ("last", "mean", "attention")
CELLS = seq2seq.CELLS


class RNNClassifier(nn.Module):
  """tokens `[batch, len]` -> class logits `[batch, num_classes]` (module docstring)."""
  vocab_size: int
  num_classes: int
  # Size of the token embeddings.
  embed_dim: int = 64
  # Size of each recurrent layer (per direction).
  hidden_dim: int = 64
  # Recurrent cell: gru or lstm.
  cell: str = "gru"
  # Stacked recurrent layers.
  num_layers: int = 1
  # Whether a second RNN reads the sentence right to left (states concatenated).
  bidirectional: bool = True
  # last | mean | attention.
  pooling: str = "attention"
  # Size of u_t and of the context vector u_w of attention pooling (0: the states' size).
  attn_dim: int = 0
  # Dropout on the embeddings, between layers and on the pooled vector.
  dropout_rate: float = 0.0

  def setup(self):
    if self.pooling not in POOLINGS:
      raise ValueError(f"unknown pooling {self.pooling!r}; valid: {', '.join(POOLINGS)}")
    self.encoder = seq2seq.Encoder(self.vocab_size, self.embed_dim, self.hidden_dim, self.cell,
                                   self.num_layers, self.bidirectional, self.dropout_rate,
                                   name="encoder")
    if self.pooling == "attention":
      self.pooler = AttentionPooling(self.attn_dim, name="pooling")
    self.dropout = nn.Dropout(self.dropout_rate)
    self.classifier = nn.Dense(self.num_classes, name="classifier")

  def pool(self, tokens: jax.Array, *, deterministic: bool = True) -> dict[str, jax.Array]:
    """{"states" `[batch, len, enc_dim]` (the top layer's; rubbish at padded positions), "mask"
    bool `[batch, len]`, "pooled" `[batch, enc_dim]`}; enc_dim = hidden_dim (x 2 when
    bidirectional)."""
    mask = tokens != PAD_ID  # [batch, len]
    lengths = mask.sum(-1).astype(jnp.int32)  # [batch]: rows are right-padded
    states, finals = self.encoder(tokens, lengths, deterministic=deterministic)  # [b, len, enc]
    if self.pooling == "last":
      pooled = seq2seq.hidden_state(finals[-1])  # [batch, enc_dim]
    elif self.pooling == "mean":
      pooled = pooling_lib.masked_mean(states, mask)  # [batch, enc_dim]
    else:
      pooled = self.pooler(states, mask)  # [batch, enc_dim]
    pooled = hooks.hook(self, "pooled", pooled, positions_axis=None)  # [batch, enc_dim]
    return {"states": states, "mask": mask, "pooled": pooled}

  def __call__(self, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
    """Class logits `[batch, num_classes]` (float32); `tokens` int `[batch, len]`."""
    pooled = self.pool(tokens, deterministic=deterministic)["pooled"]
    return self.classifier(self.dropout(pooled, deterministic=deterministic))


def from_config(model_config: Any, vocab_size: int, num_classes: int) -> RNNClassifier:
  """The RNNClassifier of a `config.model` group (configs/classify.py); ConfigError naming the
  valid choices for an unknown cell or pooling, or a size below 1."""
  models_lib.check_choices(model_config, {"cell": CELLS, "pooling": POOLINGS})
  precision.compute_dtype(model_config, "rnn_classifier")  # float32 only: ConfigError otherwise
  for key in ("embed_dim", "hidden_dim", "num_layers"):
    if model_config[key] < 1:
      raise ConfigError(f"model.{key} must be >= 1, got {model_config[key]}")
  if model_config.attn_dim < 0:
    raise ConfigError(f"model.attn_dim must be >= 0 (0: the states' size), got "
                                 f"{model_config.attn_dim}")
  fields = ("embed_dim", "hidden_dim", "cell", "num_layers", "bidirectional", "pooling",
            "attn_dim", "dropout_rate")
  return RNNClassifier(vocab_size, num_classes, **{key: model_config[key] for key in fields})
