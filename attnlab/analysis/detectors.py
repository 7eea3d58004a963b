"""Head detectors: previous-token, duplicate-token and induction scores per layer x head.

  scores = detect_heads(run)   # {"previous_token", "duplicate_token", "induction": [layers, heads]}
  tokens = repeated_random_tokens(vocab, seq_len=20, batch=8, seed=0)   # [batch, 2 * seq_len]
  induction_score(pattern, seq_len)          # pattern [batch, heads, 2T, 2T] -> [heads]

The standard input is random tokens repeated twice, t_0 .. t_{T-1} t_0 .. t_{T-1} (Olsson et al.
2022). A query at position q in the second half (q >= T) reads token t_{q-T}, whose previous
occurrence is at q - T: a duplicate-token head attends to that occurrence, an induction head to
the token after it, key q - T + 1. Scores:
  induction        mean over the batch and the queries q in [T, 2T) of w[q, q - T + 1]
  duplicate_token  mean over the batch and the queries q in [T, 2T) of w[q, q - T]
  previous_token   mean over the batch and the queries q in [1, 2T) of w[q, q - 1]
A perfect head scores 1. A head spreading its weight uniformly over the keys it may see scores
the mean of 1 / (q + 1) over those queries (`chance_scores`).

Normalisers whose rows do not sum to 1: each row of weights is divided by its sum before
scoring (rows summing to 0 score 0), so a score is the share of the row's attention on the
target key, whatever the normaliser. Softmax and sparsemax rows already sum to 1 (no change);
sigmoid rows sum to anything; softmax_sink rows sum to less than 1, the rest going to the learned
sink, so the score is the share of the attention that reaches a real token. The captured weights
are the model's own (`blocks.{i}.attn.pattern`, attnlab.analysis.hooks): mechanisms without
explicit weights (linear, Performer, ...) form them when asked.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.analysis import hooks as hooks_lib

__all__ = ["chance_scores", "detect_heads", "duplicate_token_score", "induction_score",
           "previous_token_score", "repeated_random_tokens"]

Array = jax.Array


def repeated_random_tokens(vocab_size: int, seq_len: int, batch: int = 8, seed: int = 0,
                           low: int = 1) -> np.ndarray:
  """int32 `[batch, 2 * seq_len]`: `seq_len` uniform random ids in [low, vocab_size), twice."""
  rng = np.random.default_rng(seed)
  half = rng.integers(low, vocab_size, (batch, seq_len), dtype=np.int32)
  return np.concatenate([half, half], axis=1)


def _row_normalised(pattern: Array) -> Array:
  """`[..., q, k]` weights with each row divided by its sum (0 where the sum is 0)."""
  pattern = jnp.asarray(pattern, jnp.float32)
  total = jnp.sum(pattern, axis=-1, keepdims=True)  # [..., q, 1]
  return jnp.where(total > 0, pattern / jnp.where(total > 0, total, 1.0), 0.0)


def _diagonal_score(pattern: Array, offset: int, first: int) -> Array:
  """Mean over the leading batch axis and the queries q >= first of w[q, q - offset] (rows
  normalised): `[batch, heads, q, k]` -> `[heads]`."""
  w = _row_normalised(pattern)  # [batch, heads, q, k]
  q_len = w.shape[-2]
  q = jnp.arange(first, q_len)
  on_target = w[..., q, q - offset]  # [batch, heads, n]
  return jnp.mean(on_target, axis=(0, -1))  # [heads]


def previous_token_score(pattern: Any) -> Array:
  """`[batch, heads, len, len]` weights -> `[heads]`: the mean (row-normalised) weight of each
  query q >= 1 on key q - 1."""
  return _diagonal_score(pattern, 1, 1)


def induction_score(pattern: Any, seq_len: int) -> Array:
  """`[batch, heads, 2 * seq_len, 2 * seq_len]` weights on repeated tokens -> `[heads]`: the mean
  (row-normalised) weight of each query q >= seq_len on key q - seq_len + 1."""
  if pattern.shape[-2] != 2 * seq_len:
    raise ValueError(f"induction_score needs weights of 2 * seq_len = {2 * seq_len} queries "
                     f"(random tokens repeated twice); got shape {tuple(pattern.shape)}")
  return _diagonal_score(pattern, seq_len - 1, seq_len)


def duplicate_token_score(pattern: Any, seq_len: int) -> Array:
  """`[batch, heads, 2 * seq_len, 2 * seq_len]` weights on repeated tokens -> `[heads]`: the mean
  (row-normalised) weight of each query q >= seq_len on key q - seq_len (the same token's
  previous occurrence)."""
  if pattern.shape[-2] != 2 * seq_len:
    raise ValueError(f"duplicate_token_score needs weights of 2 * seq_len = {2 * seq_len} "
                     f"queries (random tokens repeated twice); got shape {tuple(pattern.shape)}")
  return _diagonal_score(pattern, seq_len, seq_len)


def chance_scores(seq_len: int) -> dict[str, float]:
  """The scores of a head that spreads each causal row uniformly (query q: 1 / (q + 1))."""
  q = np.arange(2 * seq_len)
  second_half = float(np.mean(1.0 / (q[seq_len:] + 1)))
  return {"previous_token": float(np.mean(1.0 / (q[1:] + 1))),
          "duplicate_token": second_half, "induction": second_half}


def detect_heads(run: Any, *, seq_len: int | None = None, batch: int = 8, seed: int = 0,
                 tokens: Any = None, interventions: Any = ()) -> dict[str, np.ndarray]:
  """{"previous_token", "duplicate_token", "induction": `[layers, heads]`} of a GPT run (or (model, params)) on
  random tokens repeated twice (seq_len: default half the block size, at most 50), or on
  `tokens` `[batch, 2 * seq_len]` of that form; with `interventions` (attnlab.analysis.hooks)
  applied, e.g. a head ablated."""
  model, _ = hooks_lib._unpack(run)  # pylint: disable=protected-access
  if hooks_lib.family(model) != "gpt":
    raise ValueError(f"detect_heads reads a causal language model (GPT); got a "
                     f"{type(model).__name__}")
  if tokens is None:
    seq_len = seq_len or min(model.block_size // 2, 50)
    if 2 * seq_len > model.block_size and model.position in ("learned", "sinusoidal"):
      raise ValueError(f"2 * seq_len = {2 * seq_len} tokens exceed block_size="
                       f"{model.block_size}")
    tokens = repeated_random_tokens(model.vocab_size, seq_len, batch, seed)
  tokens = np.asarray(tokens)
  seq_len = tokens.shape[1] // 2
  names = [f"blocks.{l}.attn.pattern" for l in range(model.num_layers)]
  _, cache = hooks_lib.run_with_cache(run, tokens, names, interventions=interventions)
  return {"previous_token": np.stack([np.asarray(previous_token_score(cache[n]))
                                      for n in names]),
          "duplicate_token": np.stack([np.asarray(duplicate_token_score(cache[n], seq_len))
                                       for n in names]),
          "induction": np.stack([np.asarray(induction_score(cache[n], seq_len))
                                 for n in names])}
