"""Attention itself: masked softmax, `attend`, hard (sampled) attention, local attention, heads.

Shapes: q `[..., q_len, d_q]`, k `[..., k_len, d_k]`, v `[..., k_len, d_v]`; leading
(batch, head) dims broadcast. Masks are bool, True = may attend (see masks.py).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from attnlab.attention import masks as masks_lib
from attnlab.attention import scores as scores_lib

Array = jax.Array

# implementation names accepted by attend(); "auto" picks one of the others
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "reference", "xla", "blocked", "cudnn")
# scores the fused implementations (xla, blocked, cudnn) can compute
FAST_SCORES: tuple[str, ...] = ("dot", "scaled_dot")
# auto on CPU: the blocked kernel from this many score entries per head (q_len * k_len) up,
# the reference path below it (one tile: same work, fewer loops; measured in
# experiments/benchmarks/README.md)
AUTO_BLOCKED_MIN_SCORES = 256 * 256


# ----------------------------------------------------------------------------- softmax


def _compute_dtype(dtype: Any) -> Any:
  return jnp.promote_types(dtype, jnp.float32)


def _large_negative(dtype: Any) -> Array:
  return jnp.asarray(-0.7 * jnp.finfo(dtype).max, dtype)


def row_shift(x: Array, axis: int = -1) -> Array:
  """The max of x along `axis` (kept as a size-1 axis, no gradient), 0 where it is not finite
  (a row of -inf, or no entries): the shift that keeps exp(x - shift) and cumulative sums in
  range, for normalisers that do not change when a row is shifted."""
  x_max = jnp.max(x, axis=axis, keepdims=True, initial=-jnp.inf)
  return jax.lax.stop_gradient(jnp.where(jnp.isfinite(x_max), x_max, 0.0))


def masked_softmax(logits: Array, mask: Array | None = None, axis: int = -1) -> Array:
  """Softmax over `axis` restricted to allowed entries (mask True).

  Masked entries get exactly 0; a row with no allowed entry (k_len 0 included), or whose
  allowed logits are all -inf, gets all zeros (never NaN) and finite (zero) gradients.
  Computed in at least float32, returned in the logits' float dtype.
  """
  logits = jnp.asarray(logits)
  ct = _compute_dtype(logits.dtype)
  out_dtype = logits.dtype if jnp.issubdtype(logits.dtype, jnp.floating) else ct
  x = logits.astype(ct)
  if mask is not None:
    mask = masks_lib.check_mask(mask, logits.shape)
    x = jnp.where(mask, x, _large_negative(ct))  # finite fill: no inf - inf anywhere
  e = jnp.exp(x - row_shift(x, axis))  # all -inf row (with or without a mask): exp(-inf) = 0
  if mask is not None:
    e = jnp.where(mask, e, 0.0)
  denom = jnp.sum(e, axis=axis, keepdims=True)
  weights = e / jnp.where(denom > 0, denom, 1.0)  # empty rows: 0 / 1
  return weights.astype(out_dtype)


# ----------------------------------------------------------------------------- helpers


def check_qkv(q: Array, k: Array, v: Array) -> tuple[int, ...]:
  """Validates q/k/v ranks and lengths; returns the broadcast leading dims of q and k."""
  for name, x, want in (("q", q, "[..., q_len, d_q]"), ("k", k, "[..., k_len, d_k]"),
                        ("v", v, "[..., k_len, d_v]")):
    if jnp.ndim(x) < 2:
      raise ValueError(f"{name} must have shape {want}; got {jnp.shape(x)}")
  if k.shape[-2] != v.shape[-2]:
    raise ValueError(f"keys and values must have the same length k_len: k {k.shape}, v {v.shape}")
  try:
    jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
  except ValueError:
    raise ValueError(f"leading (batch/head) dims of q {q.shape}, k {k.shape}, v {v.shape} do "
                     "not broadcast; expected equal or size-1 leading dims") from None
  return tuple(jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2]))


def _score_logits(q: Array, k: Array, score: str | Callable, params: Any) -> Array:
  """Logits `[..., q_len, k_len]` from a registry name or a callable fn(q, k, **params)."""
  params = {} if params is None else params
  if isinstance(score, str):
    fn = scores_lib.get_score_fn(score)
    missing = [p for p in scores_lib.SCORE_PARAM_NAMES[score] if p not in params]
    if missing:
      raise ValueError(f"score {score!r} needs params {missing}; make them with "
                       f"init_score_params({score!r}, rng, d_q, d_k, ...)")
  elif callable(score):
    fn = score
  else:
    raise ValueError(f"score must be a registry name ({', '.join(sorted(scores_lib.SCORE_FNS))})"
                     f" or a callable fn(q, k, **params); got {score!r}")
  return fn(q, k, **params)


def _attention_mask(mask: Any, causal: bool, logits_shape: tuple[int, ...]) -> Array | None:
  """User mask (validated against the logits) AND the end-aligned causal mask."""
  if mask is not None:
    mask = masks_lib.check_mask(mask, logits_shape)
  if causal:
    q_len, k_len = logits_shape[-2:]
    mask = masks_lib.combine(mask, masks_lib.causal_mask(q_len, k_len, offset=None)[0, 0])
  return mask


def _zero_empty_rows(context: Array, mask: Array | None, causal: bool = False,
                     k_len: int = 0) -> Array:
  """Zeroes the context of queries with no allowed key (matches the reference path): no key
  under `mask` AND, with `causal`, the end-aligned causal mask that the fused kernel applied as
  a flag (query i sees keys j <= i + max(k_len - q_len, 0)); computed without a q_len x k_len
  causal mask."""
  if mask is None:
    return context  # causal alone leaves every query at least one key
  if not causal:
    row_ok = jnp.any(mask, axis=-1, keepdims=True)  # [..., q_len|1, 1]
    return jnp.where(row_ok, context, 0.0).astype(context.dtype)
  q_len = context.shape[-2]
  mask = mask.reshape((1,) * max(2 - mask.ndim, 0) + mask.shape)
  mask = jnp.broadcast_to(mask, mask.shape[:-1] + (k_len,))  # [..., q_len|1, k_len]
  last = jnp.minimum(jnp.arange(q_len) + max(k_len - q_len, 0), k_len - 1)  # [q_len]
  # seen[..., i, j]: some key <= j is allowed under the mask.
  seen = jax.lax.cummax(mask.astype(jnp.int32), axis=mask.ndim - 1) > 0  # [..., q_len|1, k_len]
  if mask.shape[-2] == 1:
    row_ok = jnp.take(seen[..., 0, :], last, axis=-1)[..., None]  # [..., q_len, 1]
  else:
    row_ok = jnp.take_along_axis(
        seen, jnp.broadcast_to(last[:, None], seen.shape[:-1] + (1,)), axis=-1)  # [..., q_len, 1]
  return jnp.where(row_ok, context, 0.0).astype(context.dtype)


@functools.lru_cache(maxsize=None)
def _blocked_available() -> bool:
  try:
    importlib.import_module("attnlab.attention.blocked")
  except ImportError:
    return False
  return True


def choose_implementation(score: str | Callable, return_weights: bool,
                          implementation: str = "auto", *,
                          blocked_available: bool | None = None,
                          q_len: int | None = None, k_len: int | None = None,
                          backend: str | None = None, dtype: Any = None,
                          head_dim: int | None = None, has_mask: bool = False,
                          bias: Any = None, normalizer: str = "softmax") -> str:
  """Resolves `implementation` to "reference", "xla", "blocked" or "cudnn".

  auto picks per backend and shape (attend passes the shape; without it the CPU row with a
  large shape applies):

  | case | auto picks |
  | --- | --- |
  | weights wanted, or a score other than dot/scaled_dot, or a normalizer other than softmax | reference |
  | a bias array (not a lazy positions.AlibiBias/T5Bias) on CPU | reference |
  | GPU, float16/bfloat16, head_dim <= 128 and a multiple of 8, no mask, no bias | cudnn (jax.nn.dot_product_attention(implementation="cudnn")) |
  | GPU, float16/bfloat16 otherwise (a mask, a bias, another head_dim) | reference |
  | GPU, float32; TPU | xla (jax.nn.dot_product_attention(implementation="xla")) |

  The GPU rows follow experiments/benchmarks/README.md's GPU table (an H200, causal bfloat16
  forward+backward, H = 12, D = 64, S = 1K-8K): cudnn was the fastest attnlab path (0.8-0.9x
  torch SDPA), and the reference path was 1.7-1.9x faster than xla at every length, so half
  precision falls back to reference, not xla; float32 on a GPU was not measured.
  | CPU, q_len * k_len < AUTO_BLOCKED_MIN_SCORES (256 x 256; e.g. nano GPT's 64, decoding) | reference |
  | CPU, larger | blocked (attnlab.attention.blocked), else reference if it does not import |

  `backend` defaults to jax.default_backend(); `blocked_available` overrides the import probe
  of the blocked module (for tests).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown implementation {implementation!r}; valid implementations: "
                     f"{', '.join(IMPLEMENTATIONS)}")
  fast_ok = isinstance(score, str) and score in FAST_SCORES
  lazy_bias = bias is not None and type(bias).__name__ in ("AlibiBias", "T5Bias")
  if implementation in ("xla", "blocked", "cudnn"):
    if not fast_ok:
      got = score if isinstance(score, str) else "a callable"
      raise ValueError(f"implementation {implementation!r} supports only the scores "
                       f"{', '.join(FAST_SCORES)}; got {got!r}. Use implementation='reference' "
                       "(or 'auto') for other scores")
    if normalizer != "softmax":
      raise ValueError(f"implementation {implementation!r} supports only the softmax normalizer;"
                       f" got {normalizer!r}. Use implementation='reference' (or 'auto')")
    if bias is not None and implementation == "cudnn":
      raise ValueError("implementation 'cudnn' takes no bias; use 'xla' or 'auto'")
    if bias is not None and implementation == "blocked" and not lazy_bias:
      raise ValueError("implementation 'blocked' takes a bias only as a positions.AlibiBias or "
                       "positions.T5Bias (recomputed per tile); use 'reference' or 'auto' for a "
                       "bias array")
    return implementation
  if (implementation == "reference" or return_weights or not fast_ok
      or normalizer != "softmax"):
    return "reference"
  backend = jax.default_backend() if backend is None else backend
  if backend in ("gpu", "cuda", "rocm"):
    half = dtype is not None and jnp.dtype(dtype) in (jnp.float16, jnp.bfloat16)
    head_ok = head_dim is not None and head_dim <= 128 and head_dim % 8 == 0
    if backend != "rocm" and half and head_ok and not has_mask and bias is None:
      return "cudnn"
    return "reference" if half else "xla"
  if backend == "tpu":
    return "xla"
  if q_len is not None and k_len is not None and q_len * k_len < AUTO_BLOCKED_MIN_SCORES:
    return "reference"
  if bias is not None and not lazy_bias:
    return "reference"
  available = _blocked_available() if blocked_available is None else blocked_available
  return "blocked" if available else "reference"


def _xla_attention(q: Array, k: Array, v: Array, *, scale: float, mask: Array | None,
                   causal: bool, implementation: str = "xla", bias: Array | None = None) -> Array:
  """jax.nn.dot_product_attention on `[..., len, d]` inputs.

  The last leading dim becomes the heads axis N of its [B, T, N, H] layout, the others are
  flattened into B. When d_k != d_v the smaller side is zero-padded (dot products unchanged,
  the scale passed explicitly) and the context sliced back to d_v.
  """
  dtype = jnp.result_type(q, k, v)
  dtype = dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
  lead = tuple(jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
  q_len, k_len, d_k, d_v = q.shape[-2], k.shape[-2], k.shape[-1], v.shape[-1]
  d = max(d_k, d_v)
  if 0 in lead + (q_len, k_len):
    return jnp.zeros(lead + (q_len, d_v), dtype)

  def prep(x: Array) -> Array:
    x = x.astype(dtype)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - x.shape[-1])])  # [..., len, d]
    return jnp.broadcast_to(x, lead + x.shape[-2:])

  n = lead[-1] if len(lead) >= 2 else 1
  b = math.prod(lead) // n if lead else 1

  def to_btnh(x: Array) -> Array:
    return jnp.swapaxes(x.reshape(b, n, x.shape[-2], d), 1, 2)  # [B, T, N, H]

  mask4 = None
  if mask is not None:
    mask4 = jnp.broadcast_to(mask, lead + (q_len, k_len)).reshape(b, n, q_len, k_len)
  bias4 = None
  if bias is not None:  # additive score bias, broadcast like the mask
    bias4 = jnp.broadcast_to(bias.astype(dtype), lead + (q_len, k_len)).reshape(
        b, n, q_len, k_len)  # [B, N, q_len, k_len]
  out = jax.nn.dot_product_attention(
      to_btnh(prep(q)), to_btnh(prep(k)), to_btnh(prep(v)), mask=mask4, bias=bias4, scale=scale,
      is_causal=causal, implementation=implementation)  # [B, T, N, H]
  out = jnp.swapaxes(out, 1, 2).reshape(lead + (q_len, d))  # [..., q_len, d]
  return out[..., :d_v]  # [..., q_len, d_v]


# ----------------------------------------------------------------------------- attend


def attend(q: Array, k: Array, v: Array, *, score: str | Callable = "scaled_dot",
           params: Any = None, mask: Any = None, causal: bool = False,
           implementation: str = "auto",
           return_weights: bool = True, bias: Any = None, normalizer: str = "softmax",
           normalizer_params: Any = None,
           topk: int = 8) -> tuple[Array, Array | None]:
  """Soft attention: normalizer(score(q, k) + bias) @ v (softmax by default).

  Args:
    q, k, v: `[..., q_len, d_q]`, `[..., k_len, d_k]`, `[..., k_len, d_v]` (k and v may be
      the same array or differ, e.g. key-value attention with d_v != d_k).
    score: registry name (see scores.SCORE_FNS) or a callable fn(q, k, **params).
    params: dict of score parameters (scores.init_score_params); None for parameter-free.
    mask: bool, broadcastable to the logits `[..., q_len, k_len]`, True = may attend.
    causal: AND in the look-ahead mask, queries aligned to the end of the keys
      (key j visible to query i iff j <= i + max(k_len - q_len, 0)).
    implementation: "reference" (score -> masked_softmax -> weights @ v), "xla"
      (jax.nn.dot_product_attention), "blocked" (attnlab.attention.blocked), "cudnn"
      (jax.nn.dot_product_attention's cuDNN kernel, GPU only), or "auto" (per backend and
      shape, see choose_implementation). Only the reference path returns weights.
    return_weights: whether weights are wanted (also steers "auto").
    bias: additive score bias broadcastable to the logits `[..., q_len, k_len]` (e.g.
      positions.alibi_bias / t5_bias), or a lazy positions.AlibiBias / positions.T5Bias that
      the blocked kernel recomputes per tile (the xla path gets it materialised). None = none.
    normalizer: a normalizers.NORMALIZERS name (softmax, softmax_sink, sigmoid, sparsemax,
      topk); anything but softmax runs on the reference path.
    normalizer_params: the normaliser's parameters (normalizers.init_normalizer_params).
    topk: keys kept per query by the "topk" normaliser.

  Returns:
    (context `[..., q_len, d_v]`, weights `[..., q_len, k_len]` or None). Queries with no
    allowed key get a zero context and zero weights.
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  lead = check_qkv(q, k, v)
  if isinstance(score, str):
    scores_lib.get_score_fn(score)
  q_len, k_len = q.shape[-2], k.shape[-2]
  positions = importlib.import_module("attnlab.attention.positions")
  normalizers = importlib.import_module("attnlab.attention.normalizers")
  normalizers.check_normalizer(normalizer)
  impl = choose_implementation(score, return_weights, implementation, q_len=q_len, k_len=k_len,
                               dtype=jnp.result_type(q, k, v), head_dim=q.shape[-1],
                               has_mask=mask is not None or (causal and q_len != k_len),
                               bias=bias, normalizer=normalizer)

  if impl == "reference":
    logits = _score_logits(q, k, score, params)  # [..., q_len, k_len]
    if bias is not None:
      logits = logits + positions.materialize(bias, q_len, k_len)  # [..., q_len, k_len]
    full_mask = _attention_mask(mask, causal, logits.shape)
    if normalizer == "softmax":
      weights = masked_softmax(logits, full_mask)  # [..., q_len, k_len]
    else:
      weights = normalizers.normalize(normalizer, logits, full_mask, params=normalizer_params,
                                      topk=topk)  # [..., q_len, k_len]
    context = jnp.matmul(weights, v)  # [..., q_len, d_v]
    return context, (weights if return_weights else None)

  if params:
    raise ValueError(f"score {score!r} takes no params; got {sorted(params)}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"score {score!r} needs d_q == d_k; got q {q.shape} and k {k.shape}")
  scale = 1.0 / math.sqrt(q.shape[-1]) if score == "scaled_dot" else 1.0
  logits_shape = lead + (q_len, k_len)
  # Causal goes to the fused kernel as a flag, so it can skip hidden tiles: always for blocked
  # (same end-aligned rule), for xla only when q_len == k_len (its alignment is not ours
  # otherwise); else the end-aligned causal mask is folded into the mask.
  flag_causal = causal and (impl == "blocked" or q_len == k_len)
  full_mask = _attention_mask(mask, causal and not flag_causal, logits_shape)
  if impl in ("xla", "cudnn"):
    context = _xla_attention(q, k, v, scale=scale, mask=full_mask, causal=flag_causal,
                             implementation=impl,
                             bias=positions.materialize(bias, q_len, k_len))
  else:
    blocked = importlib.import_module("attnlab.attention.blocked")
    all_lead = tuple(jnp.broadcast_shapes(lead, v.shape[:-2]))
    q, k, v = (jnp.broadcast_to(x, all_lead + x.shape[-2:]) for x in (q, k, v))
    extra = {} if bias is None else {"bias": bias}  # a lazy positions bias, per tile
    context = blocked.blocked_attention(q, k, v, scale=scale, mask=full_mask,
                                        causal=flag_causal, **extra)  # [..., q_len, d_v]
  return _zero_empty_rows(context, full_mask, causal=flag_causal, k_len=k_len), None


# ----------------------------------------------------------------------------- hard attention


class HardAttention(NamedTuple):
  """Result of hard_attend."""
  # [..., q_len, d_v] context of the sampled key (straight-through: soft gradient)
  context: Array
  # [..., q_len, k_len] soft weights the index was sampled from
  weights: Array
  # [..., q_len] sampled key index per query
  index: Array
  # [..., q_len] log-probability of the sampled index (0 for queries with no allowed key)
  log_prob: Array


def hard_attend(rng: Array, q: Array, k: Array, v: Array, *, score: str | Callable = "scaled_dot",
                params: Any = None, mask: Any = None, causal: bool = False,
                straight_through: bool = False) -> HardAttention:
  """Hard (stochastic) attention: sample one key per query from the soft weights.

  context = v[index]. With straight_through=True the forward value is the same but the
  gradient reaching the scores (q, k, score params) is that of the soft context
  (one_hot + w - stop_gradient(w)); v still gets the gradient of the hard selection.
  Otherwise the context gives no gradient to the scores: train them with
  `reinforce_loss(log_prob, reward)`. Queries with no allowed key get a zero
  context and log_prob 0. No keys at all (k_len 0) is a ValueError: there is no index to return.
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  check_qkv(q, k, v)
  if k.shape[-2] == 0:
    raise ValueError(f"hard attention samples one key per query and needs k_len >= 1; got keys "
                     f"{k.shape}")
  logits = _score_logits(q, k, score, params)  # [..., q_len, k_len]
  full_mask = _attention_mask(mask, causal, logits.shape)
  weights = masked_softmax(logits, full_mask)  # [..., q_len, k_len]
  x = logits.astype(_compute_dtype(logits.dtype))
  if full_mask is not None:
    x = jnp.where(full_mask, x, _large_negative(x.dtype))
  # a row with a key to pick: an allowed key with a finite logit (a row of -inf logits has none)
  row_ok = jnp.any(weights > 0, axis=-1)  # [..., q_len]
  index = jax.random.categorical(rng, jax.lax.stop_gradient(x), axis=-1)  # [..., q_len]
  log_probs = jax.nn.log_softmax(x, axis=-1)  # [..., q_len, k_len]
  log_prob = jnp.take_along_axis(log_probs, index[..., None], axis=-1)[..., 0]  # [..., q_len]
  log_prob = jnp.where(row_ok, log_prob, 0.0).astype(weights.dtype)
  one_hot = jax.nn.one_hot(index, logits.shape[-1], dtype=weights.dtype)  # [..., q_len, k_len]
  one_hot = one_hot * row_ok[..., None]
  select = one_hot + weights - jax.lax.stop_gradient(weights) if straight_through else one_hot
  context = jnp.matmul(select, v)  # [..., q_len, d_v]
  return HardAttention(context=context, weights=weights, index=index, log_prob=log_prob)


def reinforce_loss(log_prob: Array, reward: Any, baseline: Any = None, *,
                   valid: Any = None) -> Array:
  """Surrogate loss whose gradient is the REINFORCE estimator: -mean((R - b) · log p).

  reward (and baseline) are per query `[..., q_len]` or per sample `[...]` (broadcast over
  the queries). (R - b) is held constant; train a learned baseline with its own loss.
  `valid` (bool `[..., q_len]`) restricts the mean to real queries.
  """
  log_prob = jnp.asarray(log_prob)
  adv = jnp.asarray(reward, log_prob.dtype)
  if baseline is not None:
    adv = adv - jnp.asarray(baseline, log_prob.dtype)
  adv = jax.lax.stop_gradient(adv)
  if 0 < adv.ndim < log_prob.ndim:
    adv = adv.reshape(adv.shape + (1,) * (log_prob.ndim - adv.ndim))
  try:
    jnp.broadcast_shapes(adv.shape, log_prob.shape)
  except ValueError:
    raise ValueError(f"reward/baseline of shape {adv.shape} do not fit log_prob {log_prob.shape};"
                     " expected per-sample [...] or per-query [..., q_len]") from None
  terms = adv * log_prob  # [..., q_len]
  if valid is None:
    return -jnp.mean(terms)
  valid = jnp.broadcast_to(jnp.asarray(valid, bool), terms.shape)
  return -jnp.sum(jnp.where(valid, terms, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


# ----------------------------------------------------------------------------- local attention


def predict_position(h: Array, w_p: Array, v_p: Array, src_len: Any) -> Array:
  """Luong local-p aligned position p_t = S · sigmoid(v_pᵀ tanh(W_p h)), in [0, S].

  The float32 sigmoid reaches 1 from about 17 on, so p_t = S occurs; a window of half-width
  D >= 1 around it still holds the last key.

  h `[..., q_len, d]`, w_p `[d, d_p]`, v_p `[d_p]`; src_len S is a scalar or per-example
  lengths `[batch]` (broadcast over q_len) or `[..., q_len]`. Returns `[..., q_len]`.
  """
  h = jnp.asarray(h)
  if jnp.shape(w_p)[-2:-1] != (h.shape[-1],) or jnp.shape(v_p)[-1:] != jnp.shape(w_p)[-1:]:
    raise ValueError(f"predict_position expects w_p [d={h.shape[-1]}, d_p] and v_p [d_p]; got "
                     f"w_p {jnp.shape(w_p)}, v_p {jnp.shape(v_p)}")
  hidden = jnp.tanh(jnp.matmul(h, w_p))  # [..., q_len, d_p]
  s = jnp.sum(hidden * v_p, axis=-1)  # [..., q_len]
  src = jnp.asarray(src_len, s.dtype)
  if src.ndim and src.ndim == s.ndim - 1:
    src = src[..., None]  # [batch, 1]
  return src * jax.nn.sigmoid(s)  # [..., q_len]


def _check_half_width(half_width: Any) -> None:
  if isinstance(half_width, (int, float)) and half_width <= 0:
    raise ValueError(f"half_width D must be > 0 (window [p - D, p + D], sigma = D/2); "
                     f"got {half_width}")


def _center_distance(center: Any, lead_shape: tuple[int, ...], k_len: int, dtype: Any) -> Array:
  """s - p_t for key positions s = 0..k_len-1: `[..., q_len, k_len]`."""
  center = jnp.asarray(center, dtype)
  try:
    ok = jnp.broadcast_shapes(center.shape, lead_shape) == tuple(lead_shape)
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(f"center of shape {center.shape} does not broadcast to the queries' "
                     f"shape {tuple(lead_shape)}; expected [..., q_len]")
  return jnp.arange(k_len, dtype=dtype) - center[..., None]  # [..., q_len, k_len]


def local_window_weights(weights: Array, center: Any, half_width: Any) -> Array:
  """Multiplies weights by exp(-(s - p_t)² / (2σ²)), σ = D/2, and zeroes |s - p_t| > D.

  weights `[..., q_len, k_len]`, center p_t `[..., q_len]` (real-valued; gradients flow
  through the Gaussian), half_width D. The result no longer sums to 1 (as in Luong 2015).
  """
  _check_half_width(half_width)
  weights = jnp.asarray(weights)
  ct = _compute_dtype(weights.dtype)
  dist = _center_distance(center, weights.shape[:-1], weights.shape[-1], ct)
  sigma = jnp.asarray(half_width, ct) / 2.0
  gauss = jnp.exp(-jnp.square(dist) / (2.0 * jnp.square(sigma)))  # [..., q_len, k_len]
  inside = jnp.abs(dist) <= half_width
  return jnp.where(inside, weights * gauss, 0.0).astype(weights.dtype)


def local_attend(q: Array, k: Array, v: Array, *, center: Any, half_width: Any,
                 score: str | Callable = "scaled_dot", params: Any = None, mask: Any = None,
                 causal: bool = False, window_softmax: bool = True,
                 gaussian: bool = True) -> tuple[Array, Array]:
  """Luong local-p attention: soft attention inside [p_t - D, p_t + D] times a Gaussian.

  window_softmax=True (default, as in the paper) normalises the softmax over the keys inside
  the window; False takes the softmax over all allowed keys first. Either way the Gaussian-
  scaled weights no longer sum to 1. gaussian=False leaves the Gaussian out (the window's
  softmax alone). Luong et al. 2015's local-m is `center=monotonic_centers(q_len, k_len),
  gaussian=False` (p_t = t, the plain softmax over the window); local-p is a predicted centre
  with the Gaussian. Returns (context `[..., q_len, d_v]`, weights `[..., q_len, k_len]`).
  """
  _check_half_width(half_width)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  check_qkv(q, k, v)
  logits = _score_logits(q, k, score, params)  # [..., q_len, k_len]
  full_mask = _attention_mask(mask, causal, logits.shape)
  in_window = jnp.abs(_center_distance(center, logits.shape[:-1], logits.shape[-1],
                                       _compute_dtype(logits.dtype))) <= half_width
  if window_softmax:
    full_mask = masks_lib.combine(full_mask, in_window)
  weights = masked_softmax(logits, full_mask)  # [..., q_len, k_len]
  if gaussian:
    weights = local_window_weights(weights, center, half_width)  # [..., q_len, k_len]
  elif not window_softmax:  # no Gaussian and no window yet: the window still bounds the keys
    weights = jnp.where(in_window, weights, 0.0).astype(weights.dtype)
  return jnp.matmul(weights, v), weights  # [..., q_len, d_v]


def monotonic_centers(q_len: int, k_len: int | None = None, *, dtype: Any = jnp.float32) -> Array:
  """Luong local-m centres p_t = t, clipped to the last key: `[q_len]`."""
  k_len = q_len if k_len is None else k_len
  return jnp.minimum(jnp.arange(q_len), k_len - 1).astype(dtype)


# ----------------------------------------------------------------------------- multi-head


def split_heads(x: Array, num_heads: int) -> Array:
  """`[..., len, heads * d]` -> `[..., heads, len, d]`."""
  x = jnp.asarray(x)
  if x.ndim < 2 or x.shape[-1] % num_heads:
    raise ValueError(f"split_heads expects [..., len, heads*d] with the last dim divisible by "
                     f"num_heads={num_heads}; got {x.shape}")
  x = x.reshape(x.shape[:-1] + (num_heads, x.shape[-1] // num_heads))  # [..., len, heads, d]
  return jnp.swapaxes(x, -2, -3)  # [..., heads, len, d]


def merge_heads(x: Array) -> Array:
  """`[..., heads, len, d]` -> `[..., len, heads * d]` (inverse of split_heads)."""
  x = jnp.asarray(x)
  if x.ndim < 3:
    raise ValueError(f"merge_heads expects [..., heads, len, d]; got {x.shape}")
  x = jnp.swapaxes(x, -2, -3)  # [..., len, heads, d]
  return x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))  # [..., len, heads*d]
