"""Token + position embeddings, with `attend` for an output layer tied to the token table.

Positions: "learned" (a trained table `[max_len, d]`, GPT-2/BERT), "sinusoidal" (fixed,
attnlab.attention.positions.sinusoidal, Vaswani et al.), "rotary" (nothing is added here: the
attention layers rotate queries and keys, MultiHeadAttention(rotary=True)) or "none". With `decode=True` the
positions continue from a counter kept in the "cache" collection (`cache/position` `[batch]`
int32), so a KV-cache decoder feeds one token at a time and still gets the right positions.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab.attention import positions as positions_lib
from attnlab.layers.dense import default_kernel_init
from attnlab.layers.dense import matmul

Array = jax.Array
Initializer = Callable[..., Array]

# Position encodings an Embeddings module accepts.
POSITIONS: tuple[str, ...] = positions_lib.EMBEDDING_POSITIONS


class Embeddings(nn.Module):
  """tokens `[batch, len]` -> token embedding + position encoding, then dropout."""
  # Number of token ids.
  vocab_size: int
  # Embedding size d_model.
  features: int
  # Longest sequence (size of the position table).
  max_len: int
  # Position encoding: learned, sinusoidal, rotary (added in attention) or none.
  position: str = "learned"
  # Dropout on the sum.
  dropout_rate: float = 0.0
  # Initialiser of the token table (and of the learned position table).
  embedding_init: Initializer = default_kernel_init
  # Compute dtype (None: float32).
  dtype: Any = None

  def setup(self):
    if self.position not in POSITIONS:
      raise ValueError(f"unknown position encoding {self.position!r}; valid: "
                       f"{', '.join(POSITIONS)}")
    self.token = nn.Embed(self.vocab_size, self.features, embedding_init=self.embedding_init,
                          dtype=self.dtype, name="token")
    if self.position == "learned":
      self.position_table = self.param("position", self.embedding_init,
                                       (self.max_len, self.features))  # [max_len, d]

  @nn.compact
  def __call__(self, tokens: Array, *, positions: Array | None = None, deterministic: bool = True,
               decode: bool = False) -> Array:
    """Embeds `tokens` `[batch, len]` -> `[batch, len, d]`.

    positions: explicit positions `[batch, len]` (default 0..len-1, or the decode counter).
    decode: positions continue from `cache/position`, which advances by len.
    """
    batch, length = tokens.shape
    in_order = positions is None and not decode  # 0..len-1 in every row
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
      if decode:
        initialized = self.has_variable("cache", "position")
        counter = self.variable("cache", "position", jnp.zeros, (batch,), jnp.int32)
        if initialized:
          positions = positions + counter.value[:, None]  # [batch, len]
          counter.value = counter.value + length
    if not decode and length > self.max_len and self.position in ("learned", "sinusoidal"):
      raise ValueError(f"sequence of {length} tokens is longer than max_len={self.max_len} "
                       "positions; crop the input or raise max_len")
    x = self.token(tokens)  # [batch, len, d]
    if self.position in ("learned", "sinusoidal"):
      table = (self.position_table if self.position == "learned"
               else positions_lib.sinusoidal(self.max_len, self.features))  # [max_len, d]
      if in_order:  # the first rows: a slice, whose gradient is a sum over the batch (no scatter)
        x = x + table[:length].astype(x.dtype)
      else:
        x = x + jnp.take(table, positions, axis=0, mode="clip").astype(x.dtype)
    return nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)

  def attend(self, x: Array) -> Array:
    """Logits over the vocabulary from the tied token table: x `[..., d]` -> `[..., vocab]`."""
    table = self.token.embedding.astype(x.dtype)  # [vocab, d]
    return matmul(x, table.T)  # [..., vocab]
