"""Normalisers: how attention scores (logits) become weights, mask-aware.

Every normaliser takes logits `[..., heads, q_len, k_len]` and an optional bool mask
broadcastable to them (True = may attend) and returns weights of the logits' shape; masked
entries get exactly 0 and a row with no allowed key is all zeros, with zero (never NaN)
gradients. Computed in at least float32, returned in the logits' float dtype.

| name | weights w_ij of row i over its allowed keys j | sums to |
| --- | --- | --- |
| softmax | exp(x_ij) / sum_k exp(x_ik) | 1 |
| softmax_sink | exp(x_ij) / (exp(s_h) + sum_k exp(x_ik)), learned sink logit s_h per head (s_h = 0: softmax-plus-one) | < 1 |
| sigmoid | sigmoid(x_ij + b), b = -log(n_i), n_i = allowed keys of row i (Ramapuram et al. 2024) | any |
| sparsemax | max(x_ij - tau_i, 0), tau_i such that the row sums to 1 (Martins & Astudillo 2016) | 1 |
| topk | softmax over the k largest allowed x_ij of the row, 0 elsewhere (Zhao et al. 2019) | 1 |
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from attnlab import errors
from attnlab.attention import core
from attnlab.attention import masks as masks_lib

Array = jax.Array

# top-k softmax's default k (keys kept per query)
DEFAULT_TOPK = 8


def _prepare(logits: Array, mask: Any) -> tuple[Array, Array | None, Any]:
  """(logits in the compute dtype, validated mask or None, output dtype)."""
  logits = jnp.asarray(logits)
  ct = core._compute_dtype(logits.dtype)  # pylint: disable=protected-access
  out_dtype = logits.dtype if jnp.issubdtype(logits.dtype, jnp.floating) else ct
  if mask is not None:
    mask = jnp.broadcast_to(masks_lib.check_mask(mask, logits.shape), logits.shape)
  return logits.astype(ct), mask, out_dtype


def softmax(logits: Array, mask: Any = None) -> Array:
  """w_ij = exp(x_ij) / sum_{k allowed} exp(x_ik) (core.masked_softmax)."""
  return core.masked_softmax(logits, mask)


def _head_param(p: Any, logits: Array) -> Array:
  """A per-head parameter `[heads]` (or a scalar) shaped to broadcast over `[..., heads, q, k]`."""
  p = jnp.asarray(p, logits.dtype)
  if p.ndim == 0:
    return p
  if p.ndim != 1 or logits.ndim < 3 or p.shape[0] not in (1, logits.shape[-3]):
    raise ValueError(f"a per-head normaliser parameter must have shape [heads] matching the "
                     f"logits [..., heads, q_len, k_len] {logits.shape}; got {p.shape}")
  return p[:, None, None]  # [heads, 1, 1]


def softmax_sink(logits: Array, mask: Any = None, *, sink: Any = None) -> Array:
  """w_ij = exp(x_ij) / (exp(s_h) + sum_{k allowed} exp(x_ik)).

  The sink logit s_h `[heads]` (learned, one per head; default 0 = "softmax plus one") is an
  extra, value-less key every query may attend to, so the weights of a row sum to
  1 - exp(s_h) / (...) < 1 and a head can attend to nothing. A fully masked row is all zeros.
  """
  x, mask, out_dtype = _prepare(logits, mask)
  s = jnp.zeros((), x.dtype) if sink is None else _head_param(sink, x)
  if mask is not None:
    x = jnp.where(mask, x, core._large_negative(x.dtype))  # pylint: disable=protected-access
  m = jnp.maximum(jnp.max(x, axis=-1, keepdims=True, initial=-jnp.inf), s)  # [..., q_len, 1]
  m = jax.lax.stop_gradient(m)
  e = jnp.exp(x - m)  # [..., q_len, k_len]
  if mask is not None:
    e = jnp.where(mask, e, 0.0)
  denom = jnp.exp(s - m) + jnp.sum(e, axis=-1, keepdims=True)  # > 0 always
  return (e / denom).astype(out_dtype)


def sigmoid(logits: Array, mask: Any = None, *, bias: Any = None) -> Array:
  """w_ij = sigmoid(x_ij + b) on allowed keys, 0 elsewhere (Ramapuram et al. 2024).

  b defaults to -log(n_i) with n_i the number of keys row i may attend to (k_len without a
  mask), which keeps the row sums near 1 at initialisation; pass a float to fix it.
  """
  x, mask, out_dtype = _prepare(logits, mask)
  if bias is None:
    if mask is None:
      n = jnp.asarray(x.shape[-1], x.dtype)
    else:
      n = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1).astype(x.dtype)  # [..., q, 1]
    bias = -jnp.log(n)
  w = jax.nn.sigmoid(x + bias)
  if mask is not None:
    w = jnp.where(mask, w, 0.0)
  return w.astype(out_dtype)


def sparsemax(logits: Array, mask: Any = None) -> Array:
  """Euclidean projection of each row onto the simplex (Martins & Astudillo 2016, Alg. 1).

  Sort the allowed z descending; k(z) = max{k : 1 + k z_(k) > sum_{j<=k} z_(j)};
  tau = (sum_{j<=k(z)} z_(j) - 1) / k(z); w_j = max(z_j - tau, 0). Masked keys are left out.
  Gradients are the paper's (diag(s) - s sᵀ / |S|) on the support S.
  """
  x, mask, out_dtype = _prepare(logits, mask)
  if mask is not None:
    # masked entries sorted last (below every allowed one), and never counted in the support:
    # min - 1, or -inf when an allowed logit is -inf (a finite fill would sort above it and
    # enter the support), or -1 for a row with no allowed key
    low = jnp.min(jnp.where(mask, x, jnp.inf), axis=-1, keepdims=True, initial=jnp.inf)
    low = jax.lax.stop_gradient(
        jnp.where(jnp.isfinite(low), low - 1.0, jnp.where(low < 0, low, -1.0)))
    x = jnp.where(mask, x, low)
  # shifted by the row max (sparsemax(z + c) = sparsemax(z)), so the cumulative sums below stay
  # accurate for large logits
  x = x - core.row_shift(x)
  z = -jnp.sort(-x, axis=-1)  # [..., q_len, k_len] descending
  ks = jnp.arange(1, x.shape[-1] + 1, dtype=x.dtype)  # [k_len]
  cums = jnp.cumsum(z, axis=-1)
  support = 1.0 + ks * z > cums  # [..., q_len, k_len]
  if mask is not None:
    n_allowed = jnp.sum(mask, axis=-1, keepdims=True)
    support = support & (ks <= n_allowed)
  k_z = jnp.sum(support, axis=-1, keepdims=True)  # [..., q_len, 1]
  k_safe = jnp.maximum(k_z, 1)
  sum_support = jnp.take_along_axis(cums, k_safe.astype(jnp.int32) - 1, axis=-1)
  tau = (sum_support - 1.0) / k_safe.astype(x.dtype)  # [..., q_len, 1]
  tau = jnp.where(jnp.isfinite(tau), tau, 0.0)  # no finite allowed logit (all -inf): zeros
  w = jnp.maximum(x - tau, 0.0)
  if mask is not None:
    w = jnp.where(mask, w, 0.0)
  return w.astype(out_dtype)


def topk_softmax(logits: Array, mask: Any = None, *, k: int = DEFAULT_TOPK) -> Array:
  """Softmax over the k largest allowed logits of each row, 0 elsewhere (Zhao et al. 2019).

  Rows with fewer than k allowed keys keep them all; ties with the k-th value are all kept.
  """
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"topk normaliser needs an int k >= 1 (keys kept per query); got {k!r}")
  x, mask, _ = _prepare(logits, mask)
  if k >= x.shape[-1]:
    return core.masked_softmax(logits, mask)
  filled = x if mask is None else jnp.where(mask, x, -jnp.inf)
  kth = jax.lax.stop_gradient(jax.lax.top_k(filled, k)[0][..., -1:])  # [..., q_len, 1]
  keep = filled >= kth
  keep = keep if mask is None else keep & mask
  return core.masked_softmax(logits, keep)


def _softmax_n(logits, mask, params, topk):
  del params, topk
  return softmax(logits, mask)


def _softmax_sink_n(logits, mask, params, topk):
  del topk
  return softmax_sink(logits, mask, sink=None if params is None else params["sink"])


def _sigmoid_n(logits, mask, params, topk):
  del topk
  return sigmoid(logits, mask, bias=None if params is None else params.get("bias"))


def _sparsemax_n(logits, mask, params, topk):
  del params, topk
  return sparsemax(logits, mask)


def _topk_n(logits, mask, params, topk):
  del params
  return topk_softmax(logits, mask, k=topk)


# name -> fn(logits, mask, params, topk) -> weights
NORMALIZERS: dict[str, Callable[..., Array]] = {
    "softmax": _softmax_n,
    "softmax_sink": _softmax_sink_n,
    "sigmoid": _sigmoid_n,
    "sparsemax": _sparsemax_n,
    "topk": _topk_n,
}


def check_normalizer(name: Any) -> str:
  """Returns `name` if it is a NORMALIZERS name, else raises one clear ValueError."""
  if not isinstance(name, str) or name not in NORMALIZERS:
    raise errors.ConfigError(f"unknown normalizer {name!r}; valid normalizers: "
                     f"{', '.join(NORMALIZERS)}")
  return name


def normalize(name: str, logits: Array, mask: Any = None, *, params: Any = None,
              topk: int = DEFAULT_TOPK) -> Array:
  """Weights `[..., q_len, k_len]` from logits with the normaliser `name` (see NORMALIZERS).

  params: softmax_sink {"sink": [heads]} (None = sink 0, softmax-plus-one); sigmoid optional
  {"bias": float}; None for the others. topk: keys kept per query by "topk".
  """
  return NORMALIZERS[check_normalizer(name)](logits, mask, params, topk)


def init_normalizer_params(name: str, rng: Array, num_heads: int) -> dict[str, Array] | None:
  """Learned parameters of a normaliser: softmax_sink {"sink": zeros [heads]}; else None."""
  del rng
  if check_normalizer(name) == "softmax_sink":
    return {"sink": jnp.zeros((num_heads,), jnp.float32)}
  return None
