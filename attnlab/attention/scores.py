"""Attention score (alignment) functions.

Every function maps queries `[..., q_len, d_q]` and keys `[..., k_len, d_k]` to
logits `[..., q_len, k_len]`; leading (batch, head) dims broadcast like numpy.

Registry convention: every entry of `SCORE_FNS` is callable as
`fn(q, k, **params)` with `params = init_score_params(name, ...)`. The
`location` entry takes k only for its length (`k.shape[-2]`).

Per-head parameters: a parameter may carry extra leading dims that broadcast
against the leading dims of q, e.g. `general` w `[heads, d_q, d_k]` with
q `[batch, heads, q_len, d_q]`; additive v `[heads, d_attn]`; cosine beta
`[heads, 1, 1]` (beta broadcasts against the logits).

Scoring the same keys many times (an RNN decoder's steps): `precompute_keys(name, params, k)`
does the part that depends on the keys alone once (additive: W_k k) and returns the keys and
params to score with.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array
ScoreFn = Callable[..., Array]


def _check_rank(name: str, x: Array, expected: str) -> None:
  if x.ndim < 2:
    raise ValueError(f"{name} must have shape {expected} (at least 2 dims); got shape {x.shape}")


def _lead_shape(*named: tuple[str, tuple[int, ...]]) -> tuple[int, ...]:
  """Broadcasts the leading dims of several arrays, or raises a ValueError naming them."""
  try:
    return tuple(jnp.broadcast_shapes(*(s for _, s in named)))
  except ValueError:
    desc = ", ".join(f"{n} {s}" for n, s in named)
    raise ValueError(f"leading (batch/head) dims do not broadcast: {desc}; "
                     "expected equal or size-1 leading dims") from None


def _check_qk(q: Array, k: Array, same_dim: bool) -> None:
  _check_rank("queries", q, "[..., q_len, d_q]")
  _check_rank("keys", k, "[..., k_len, d_k]")
  if same_dim and q.shape[-1] != k.shape[-1]:
    raise ValueError(f"queries and keys must have the same feature size d for this score; got "
                     f"q {q.shape} (d_q={q.shape[-1]}) and k {k.shape} (d_k={k.shape[-1]}); "
                     "use the 'general' or 'additive' score for d_q != d_k")
  _lead_shape(("queries", q.shape[:-2]), ("keys", k.shape[:-2]))


def _check_param(name: str, w: Array, trailing: tuple[int, ...], x: Array, x_name: str,
                 what: str) -> None:
  """Checks a parameter's trailing shape and that its leading dims broadcast with x's."""
  w_shape = tuple(jnp.shape(w))
  n = len(trailing)
  if len(w_shape) < n or w_shape[len(w_shape) - n:] != trailing:
    raise ValueError(f"{name} must have shape {what} = [..., {', '.join(map(str, trailing))}]"
                     f" for {x_name} {x.shape}; got {w_shape}")
  _lead_shape((x_name, x.shape[:-2]), (name, w_shape[:len(w_shape) - n]))


def _keys_t(k: Array) -> Array:
  return jnp.swapaxes(k, -1, -2)  # [..., d, k_len]


def dot(q: Array, k: Array) -> Array:
  """Dot-product score q·k (Luong et al., 2015). Needs d_q == d_k."""
  _check_qk(q, k, same_dim=True)
  return jnp.matmul(q, _keys_t(k))  # [..., q_len, k_len]


def _float_dtype(q: Array, k: Array) -> Any:
  """The dtype of the logits: the inputs' float dtype (float32 for integer inputs)."""
  dtype = jnp.result_type(q, k)
  return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.dtype(jnp.float32)


def scaled_dot(q: Array, k: Array) -> Array:
  """Scaled dot-product score q·k / sqrt(d) (Vaswani et al., 2017). Needs d_q == d_k.

  Returned in the inputs' float dtype (float32 for integer inputs); float16 inputs are summed
  and scaled in float32, so their logits overflow only where q·k / sqrt(d) does, not where q·k
  does.
  """
  _check_qk(q, k, same_dim=True)
  out_dtype = _float_dtype(q, k)
  # float32 products for float16 (whose range ends at 65504); bfloat16 has float32's range and
  # the mixed-precision policy keeps its matmuls in bfloat16
  ct = jnp.dtype(jnp.float32) if out_dtype == jnp.float16 else out_dtype
  q, k = jnp.asarray(q, out_dtype), jnp.asarray(k, out_dtype)
  logits = jnp.matmul(q, _keys_t(k), preferred_element_type=ct)  # [..., q_len, k_len]
  return (logits * (1.0 / math.sqrt(q.shape[-1]))).astype(out_dtype)


def _safe_normalize(x: Array) -> Array:
  """x / ||x|| over the last axis; zero vectors map to zero with zero (finite) gradient."""
  sq = jnp.sum(x * x, axis=-1, keepdims=True)  # [..., len, 1]
  ok = sq > jnp.finfo(sq.dtype).tiny
  inv = jnp.where(ok, jax.lax.rsqrt(jnp.where(ok, sq, 1.0)), 0.0)  # [..., len, 1]
  return x * inv


def cosine(q: Array, k: Array, beta: Any = 1.0) -> Array:
  """Content-based score beta·cos(q, k) (Graves et al., 2014); beta is the key strength.

  A zero query or key has cosine 0 with everything (finite values and gradients).
  beta is a scalar or an array broadcastable to the logits (e.g. `[heads, 1, 1]`). The norms
  are taken in at least float32 (a float16 squared norm under- or overflows from |x| < 8e-3 or
  |x| > 256); the logits come back in the inputs' float dtype (float32 for integer inputs).
  """
  _check_qk(q, k, same_dim=True)
  out_dtype = _float_dtype(q, k)
  ct = jnp.promote_types(out_dtype, jnp.float32)
  # unit vectors (entries in [-1, 1]) back in the inputs' dtype: the matmul stays in it
  qn = _safe_normalize(jnp.asarray(q, ct)).astype(out_dtype)
  kn = _safe_normalize(jnp.asarray(k, ct)).astype(out_dtype)
  logits = jnp.matmul(qn, _keys_t(kn))  # [..., q_len, k_len]
  return jnp.asarray(beta, out_dtype) * logits


def general(q: Array, k: Array, w: Array) -> Array:
  """Bilinear ("general") score q W kᵀ (Luong et al., 2015); w `[..., d_q, d_k]`."""
  _check_qk(q, k, same_dim=False)
  _check_param("w", w, (q.shape[-1], k.shape[-1]), q, "queries",
               "[d_q, d_k] or [heads, d_q, d_k]")
  qw = jnp.matmul(q, w)  # [..., q_len, d_k]
  return jnp.matmul(qw, _keys_t(k))  # [..., q_len, k_len]


def additive(q: Array, k: Array, w_q: Array, w_k: Array | None, v: Array) -> Array:
  """Additive (concat/MLP) score vᵀ tanh(W_q q + W_k k) (Bahdanau et al., 2015).

  w_q `[..., d_q, d_attn]`, w_k `[..., d_k, d_attn]`, v `[..., d_attn]`. Queries and keys
  are projected once; the largest intermediate is `[..., q_len, k_len, d_attn]`. w_k None: `k`
  is already W_k k `[..., k_len, d_attn]` (`precompute_keys`).
  """
  _check_qk(q, k, same_dim=False)
  d_attn = jnp.shape(w_q)[-1] if jnp.ndim(w_q) else None
  _check_param("w_q", w_q, (q.shape[-1], d_attn), q, "queries",
               "[d_q, d_attn] or [heads, d_q, d_attn]")
  if w_k is None:
    if k.shape[-1] != d_attn:
      raise ValueError(f"with w_k=None the keys must be projected already, [..., k_len, "
                       f"d_attn={d_attn}]; got {k.shape}")
  else:
    _check_param("w_k", w_k, (k.shape[-1], d_attn), k, "keys",
                 "[d_k, d_attn] or [heads, d_k, d_attn]")
  _check_param("v", v, (d_attn,), q, "queries", "[d_attn] or [heads, d_attn]")
  qp = jnp.matmul(q, w_q)  # [..., q_len, d_attn]
  kp = k if w_k is None else jnp.matmul(k, w_k)  # [..., k_len, d_attn]
  hidden = jnp.tanh(qp[..., :, None, :] + kp[..., None, :, :])  # [..., q_len, k_len, d_attn]
  v = jnp.asarray(v)
  v = v.reshape(v.shape[:-1] + (1, 1, v.shape[-1]))  # [..., 1, 1, d_attn]
  return jnp.sum(hidden * v, axis=-1)  # [..., q_len, k_len]


def location(q: Array, w: Array, k_len: int) -> Array:
  """Location-based score W q (Luong et al., 2015): depends on the query only.

  w `[..., d_q, max_len]`; returns the first k_len columns `[..., q_len, k_len]`.
  """
  _check_rank("queries", q, "[..., q_len, d_q]")
  w_shape = tuple(jnp.shape(w))
  if len(w_shape) < 2 or w_shape[-2] != q.shape[-1]:
    raise ValueError(f"w must have shape [d_q, max_len] or [heads, d_q, max_len] with "
                     f"d_q={q.shape[-1]} for queries {q.shape}; got {w_shape}")
  _lead_shape(("queries", q.shape[:-2]), ("w", w_shape[:-2]))
  max_len = w_shape[-1]
  if k_len > max_len:
    raise ValueError(f"location score: k_len={k_len} exceeds max_len={max_len} of w "
                     f"{w_shape}; make the params with init_score_params('location', ..., "
                     f"max_len>={k_len})")
  return jnp.matmul(q, w)[..., :k_len]  # [..., q_len, k_len]


def _location_registry(q: Array, k: Array, w: Array) -> Array:
  """`location` in the registry convention fn(q, k, **params): k supplies k_len."""
  _check_rank("keys", k, "[..., k_len, d_k]")
  lead = _lead_shape(("queries", q.shape[:-2]), ("keys", k.shape[:-2]))
  logits = location(q, w, k.shape[-2])  # [..., q_len, k_len]
  return jnp.broadcast_to(logits, jnp.broadcast_shapes(logits.shape, lead + logits.shape[-2:]))


# name -> score function fn(q, k, **params)
SCORE_FNS: dict[str, ScoreFn] = {
    "dot": dot,
    "scaled_dot": scaled_dot,
    "cosine": cosine,
    "general": general,
    "additive": additive,
    "location": _location_registry,
}

# names of the parameters each score needs (cosine's beta is optional, see init_score_params)
SCORE_PARAM_NAMES: dict[str, tuple[str, ...]] = {
    "dot": (),
    "scaled_dot": (),
    "cosine": (),
    "general": ("w",),
    "additive": ("w_q", "w_k", "v"),
    "location": ("w",),
}

# scores that cannot run without parameters
PARAMETRIC_SCORES: frozenset[str] = frozenset(n for n, p in SCORE_PARAM_NAMES.items() if p)


def precompute_keys(name: str, params: dict | None, k: Array) -> tuple[Array, dict | None]:
  """(keys, params) that score any queries against `k` as `name` with `params` does, with the
  part that depends on the keys alone computed here, once: for a decoder that scores the same
  keys at every step. additive: W_k k, and params without w_k; other scores: unchanged.
  """
  if name == "additive" and params["w_k"] is not None:
    return jnp.matmul(k, params["w_k"]), precomputed_key_params(name, params)
  return k, params


def precomputed_key_params(name: str, params: dict | None) -> dict | None:
  """The params that go with keys from `precompute_keys` (additive: w_k None)."""
  return {**params, "w_k": None} if name == "additive" else params


def get_score_fn(name: str) -> ScoreFn:
  """Looks a score function up by name; raises ValueError listing the valid names."""
  if name not in SCORE_FNS:
    raise ValueError(f"unknown score {name!r}; valid scores: {', '.join(sorted(SCORE_FNS))}")
  return SCORE_FNS[name]


def init_score_params(name: str, rng: Array, d_q: int, d_k: int, *, d_attn: int | None = None,
                      max_len: int | None = None, dtype: Any = jnp.float32,
                      num_heads: int | None = None, beta: float | None = None) -> dict:
  """Makes the parameter dict for score `name`, to pass as `fn(q, k, **params)`.

  Weights are normal with std 1/sqrt(fan_in). Parameter-free scores give `{}`; `cosine` gives
  `{}` unless `beta` is given, then `{"beta": scalar}` (a trainable key strength).
  `num_heads` adds a leading per-head axis to every weight (e.g. general w `[heads, d_q, d_k]`).
  `d_attn` (additive) defaults to d_k; `max_len` (location) is required.
  """
  get_score_fn(name)
  heads = () if num_heads is None else (num_heads,)

  def normal(shapes: dict[str, tuple[tuple[int, ...], int]]) -> dict:
    """{name: (shape, fan_in)} -> weights; one random draw for all (one RNG kernel to compile)."""
    sizes = [math.prod(heads + shape) for shape, _ in shapes.values()]
    flat = jax.random.normal(rng, (sum(sizes),), dtype)  # [total]
    out, start = {}, 0
    for (pname, (shape, fan_in)), size in zip(shapes.items(), sizes):
      out[pname] = flat[start:start + size].reshape(heads + shape) / math.sqrt(fan_in)
      start += size
    return out

  if name == "cosine":
    return {} if beta is None else {"beta": jnp.asarray(beta, dtype)}
  if name == "general":
    return normal({"w": ((d_q, d_k), d_q)})
  if name == "additive":
    d_attn = d_k if d_attn is None else d_attn
    return normal({"w_q": ((d_q, d_attn), d_q), "w_k": ((d_k, d_attn), d_k),
                   "v": ((d_attn,), d_attn)})
  if name == "location":
    if max_len is None:
      raise ValueError("the 'location' score needs max_len (the longest key sequence): "
                       "init_score_params('location', rng, d_q, d_k, max_len=...)")
    return normal({"w": ((d_q, max_len), d_q)})
  return {}
