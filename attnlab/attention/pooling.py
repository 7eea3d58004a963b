"""Attention pooling: Nadaraya-Watson kernel regression over scalars, and the pooling of a
sequence of states into one vector (the RNN text classifier's, attnlab/models/rnn_classifier.py).

Nadaraya-Watson: queries `[..., n_q]`, keys `[..., n_k]`, values `[..., n_k]` (scalar values) or
`[..., n_k, d_v]`. Every function returns (prediction `[..., n_q]` or `[..., n_q, d_v]`,
weights `[..., n_q, n_k]`) and takes an optional bool mask broadcastable to the weights
(e.g. `leave_one_out_mask(n)` to exclude each training point from its own estimate).

Sequence pooling: states `[..., len, d]` with a bool mask `[..., len]` (True = real token):
- `masked_mean`: the mean of the real tokens' states;
- `context_attention_pooling`: word-level attention of Yang et al. (2016), "Hierarchical
  Attention Networks for Document Classification":
      u_t = tanh(W h_t + b),   alpha_t = softmax_t(u_t . u_w),   pooled = sum_t alpha_t h_t
  with a learned context vector u_w (one query that is no token); padded positions get weight 0.
A row without a real token pools to zeros (weights all 0), never NaN.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attnlab.attention.core import masked_softmax

Array = jax.Array


def _check(queries: Array, keys: Array, values: Array) -> tuple[Array, Array, Array]:
  queries, keys, values = jnp.asarray(queries), jnp.asarray(keys), jnp.asarray(values)
  if queries.ndim < 1 or keys.ndim < 1:
    raise ValueError(f"queries [..., n_q] and keys [..., n_k] must be at least 1-D; got "
                     f"{queries.shape} and {keys.shape}")
  if values.ndim not in (keys.ndim, keys.ndim + 1) or values.shape[keys.ndim - 1] != keys.shape[-1]:
    raise ValueError(f"values must have shape [..., n_k] or [..., n_k, d_v] with n_k="
                     f"{keys.shape[-1]} matching keys {keys.shape}; got {values.shape}")
  return queries, keys, values


def _pool(weights: Array, values: Array, keys: Array) -> Array:
  if values.ndim == keys.ndim:
    return jnp.einsum("...qk,...k->...q", weights, values)  # [..., n_q]
  return jnp.matmul(weights, values)  # [..., n_q, d_v]


def average_pooling(queries: Array, keys: Array, values: Array,
                    mask: Any = None) -> tuple[Array, Array]:
  """Uniform weights over the allowed keys (the query is ignored apart from its shape)."""
  queries, keys, values = _check(queries, keys, values)
  diff = queries[..., :, None] - keys[..., None, :]  # [..., n_q, n_k]
  weights = masked_softmax(jnp.zeros_like(diff, dtype=jnp.result_type(diff, jnp.float32)), mask)
  return _pool(weights, values, keys), weights


def nadaraya_watson(queries: Array, keys: Array, values: Array, *, w: Any = 1.0,
                    mask: Any = None) -> tuple[Array, Array]:
  """Gaussian-kernel regression: weights = softmax(-((x - x_i) · w)² / 2) over the keys.

  w = 1 is the fixed kernel; w may be a traced scalar (a trainable inverse bandwidth).
  """
  queries, keys, values = _check(queries, keys, values)
  diff = queries[..., :, None] - keys[..., None, :]  # [..., n_q, n_k]
  logits = -jnp.square(diff * w) / 2.0  # [..., n_q, n_k]
  weights = masked_softmax(logits, mask)  # [..., n_q, n_k]
  return _pool(weights, values, keys), weights


def init_kernel_params(w: float = 1.0) -> dict:
  """Parameters of learned_kernel_pooling: {"w": float32 scalar} (inverse bandwidth)."""
  return {"w": jnp.asarray(w, jnp.float32)}


def learned_kernel_pooling(params: dict, queries: Array, keys: Array, values: Array,
                           mask: Any = None) -> tuple[Array, Array]:
  """Nadaraya-Watson with a learnable w = params["w"] (gradients flow into it)."""
  if "w" not in params:
    raise ValueError(f"learned_kernel_pooling needs params {{'w': scalar}} from "
                     f"init_kernel_params(); got keys {sorted(params)}")
  return nadaraya_watson(queries, keys, values, w=params["w"], mask=mask)


def leave_one_out_mask(n: int) -> Array:
  """`[n, n]` mask that stops point i from attending to itself (training-set estimates)."""
  return ~jnp.eye(n, dtype=bool)


# ---------------------------------------------------------------------------------------------
# Pooling a sequence of states into one vector


def _check_states(states: Array, mask: Any) -> tuple[Array, Array]:
  states, mask = jnp.asarray(states), jnp.asarray(mask)
  if states.ndim < 2 or mask.shape != states.shape[:-1] or mask.dtype != jnp.bool_:
    raise ValueError(f"states [..., len, d] need a bool mask [..., len] of the same leading "
                     f"shape; got states {states.shape} and mask {mask.shape} {mask.dtype}")
  return states, mask


def masked_mean(states: Array, mask: Any) -> Array:
  """The mean of the states of the real tokens `[..., d]` (zeros for a row with none)."""
  states, mask = _check_states(states, mask)
  weights = mask.astype(states.dtype)[..., None]  # [..., len, 1]
  return (states * weights).sum(-2) / jnp.maximum(weights.sum(-2), 1.0)  # [..., d]


def init_context_pooling_params(rng: jax.Array, d: int, d_attn: int) -> dict:
  """Parameters of context_attention_pooling: {"w": [d, d_attn] (Lecun normal), "b": [d_attn]
  (zeros), "context": [d_attn] (u_w, normal with std 1/sqrt(d_attn))}."""
  k_w, k_u = jax.random.split(rng)
  return {"w": jax.random.normal(k_w, (d, d_attn), jnp.float32) / jnp.sqrt(d),
          "b": jnp.zeros((d_attn,), jnp.float32),
          "context": jax.random.normal(k_u, (d_attn,), jnp.float32) / jnp.sqrt(d_attn)}


def context_attention_pooling(params: dict, states: Array, mask: Any) -> tuple[Array, Array]:
  """Yang et al. (2016) word attention (module docstring): (pooled `[..., d]`, weights
  `[..., len]`); `params` {"w" [d, d_attn], "b" [d_attn], "context" [d_attn]}."""
  states, mask = _check_states(states, mask)
  u = jnp.tanh(jnp.matmul(states, params["w"]) + params["b"])  # [..., len, d_attn]
  scores = jnp.matmul(u, params["context"])  # [..., len]
  weights = masked_softmax(scores, mask)  # [..., len]
  pooled = jnp.einsum("...t,...td->...d", weights, states)  # [..., d]
  return pooled, weights
