"""Attention with linear or sub-quadratic cost.

Kernelised attention never forms the `[q_len, k_len]` score matrix: with a feature map phi,
  out_i = phi(q_i)ᵀ (sum_j phi(k_j) v_jᵀ) / (phi(q_i)ᵀ sum_j phi(k_j))
costs O(len · r · d) for r features. Causal attention restricts the sums to j <= i (prefix
sums, computed chunk by chunk: a quadratic block inside each chunk plus the running state of
the chunks before).
- linear attention (Katharopoulos et al. 2020): phi(x) = elu(x) + 1.
- Performer FAVOR+ (Choromanski et al. 2021): phi(x) = exp(wᵀx - |x|²/2) / sqrt(m) with m
  positive orthogonal random features w, x = q / d^(1/4), so that E[phi(q)ᵀphi(k)] =
  exp(qᵀk / sqrt(d)): an unbiased estimate of softmax attention's kernel.
- Linformer (Wang et al. 2020): projects the length axis of keys and values to r rows,
  softmax(Q (Eᵀ K)ᵀ / sqrt(d)) (Fᵀ V), with learned E, F `[max_len, r]` (non-causal).
- Block-sparse patterns (sliding window; BigBird's window + global + random blocks) are masks
  that the blocked kernel executes tile by tile, skipping the tiles they hide, so the work
  grows linearly with the length.

The *_weights functions materialise the implicit attention matrix (for analysis only).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.attention import core
from attnlab.attention import masks as masks_lib

Array = jax.Array

# default chunk length of the causal prefix-sum scan
DEFAULT_CHUNK = 64
# Chunks per step of the causal scan: longer inputs loop over groups of this many chunks, so the
# arrays of one step stay the same size (and in cache) whatever the length. Vectorising all the
# chunks at once made XLA:CPU's batched matmuls slower per chunk as the length grew (time
# 1024 -> 4096 tokens 7.7x for 4x the work, experiments/benchmarks/README.md).
CHUNK_GROUP = 8
# The causal scan makes the features inside its steps (recomputed in the backward pass) once the
# whole feature arrays `[..., len, r]` would reach this many bytes and the scan has several steps;
# smaller ones stay in cache, where making them once is faster. Measured on XLA:CPU (Performer,
# 4 heads, 256 features, forward+backward): 1.3x slower inside the scan at 1024 tokens (4 MiB of
# features), 1.2x faster at 2048 (8 MiB), 1.1x at 4096, with 2.5x less memory there.
FUSED_FEATURE_BYTES = 8 << 20


# ----------------------------------------------------------------------------- kernelised core


def elu_feature_map(x: Array) -> Array:
  """Linear attention's feature map phi(x) = elu(x) + 1 (> 0)."""
  return jax.nn.elu(x) + 1.0


def _key_mask(mask: Any, k_len: int, ndim: int = 4) -> Array | None:
  """A key padding mask as bool `[..., 1, k_len]` (broadcast over the queries), or None.

  Accepts `[batch, k_len]` or a mask broadcastable to `[batch, heads, 1, k_len]` whose query
  axis is 1 (kernelised attention cannot take a per-query mask, except the causal one).
  ndim is the rank of the inputs `[batch, ..., len, d]`: a `[batch, k_len]` mask gets its batch
  axis in front of ndim - 2 singleton axes (`[batch, 1, k_len]` for 3-D inputs).
  """
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if jnp.issubdtype(mask.dtype, jnp.floating):
    raise ValueError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")
  mask = mask.astype(bool)
  if mask.ndim == 2:
    mask = mask.reshape(mask.shape[:1] + (1,) * max(ndim - 2, 1) + mask.shape[1:])
  if mask.ndim < 2 or mask.shape[-1] not in (1, k_len) or mask.shape[-2] != 1:
    raise ValueError(f"kernelised attention takes a key padding mask [batch, k_len] or "
                     f"[batch, 1|heads, 1, k_len]; got {mask.shape} (no per-query masks: use "
                     "causal=True for the look-ahead mask)")
  return mask


def _key_vector(mask: Any, k_len: int, ndim: int = 4) -> Array | None:
  """A key padding mask as bool `[..., k_len]` (see `_key_mask`), or None."""
  key_mask = _key_mask(mask, k_len, ndim)
  return None if key_mask is None else key_mask[..., 0, :]


def _fuse_features(q: Array, k: Array, num_features: int, chunk_size: Any) -> bool:
  """Whether causal attention of q and k makes its features inside the scan (see
  FUSED_FEATURE_BYTES): self-attention whose scan has several steps and whose `[..., len, r]`
  feature arrays (float32) would reach FUSED_FEATURE_BYTES."""
  length = q.shape[-2]
  if length != k.shape[-2] or not isinstance(chunk_size, int) or chunk_size < 1:
    return False  # decoding, or a bad chunk_size that kernel_attention reports
  rows = math.prod(jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
  return (length > CHUNK_GROUP * chunk_size
          and rows * length * num_features * 4 >= FUSED_FEATURE_BYTES)


def _causal_offset(q_len: int, k_len: int) -> int:
  return max(k_len - q_len, 0)


def kernel_weights(phi_q: Array, phi_k: Array, *, causal: bool = False,
                   mask: Any = None) -> Array:
  """The implicit attention matrix `[..., q_len, k_len]` of kernelised attention.

  A_ij = phi(q_i)ᵀ phi(k_j) / sum_{l allowed} phi(q_i)ᵀ phi(k_l) over the allowed keys j (end-
  aligned causal when causal=True); rows with no allowed key are zeros.
  """
  q_len, k_len = phi_q.shape[-2], phi_k.shape[-2]
  a = jnp.einsum("...qr,...kr->...qk", phi_q, phi_k)  # [..., q_len, k_len]
  allowed = _key_mask(mask, k_len, max(phi_q.ndim, phi_k.ndim))
  if causal:
    allowed = masks_lib.combine(allowed, masks_lib.causal_mask(q_len, k_len, offset=None)[0, 0])
  if allowed is not None:
    a = jnp.where(allowed, a, 0.0)
  den = jnp.sum(a, axis=-1, keepdims=True)
  return a / jnp.where(den > 0, den, 1.0)


def _safe_div(num: Array, den: Array) -> Array:
  """num / den with 0 where den == 0 (rows with no allowed key), zero gradients there."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def kernel_attention(phi_q: Array, phi_k: Array, v: Array, *, causal: bool = False,
                     mask: Any = None, chunk_size: int = DEFAULT_CHUNK) -> Array:
  """out_i = sum_j A_ij v_j for the kernelised A of `kernel_weights`, in linear time.

  phi_q `[..., q_len, r]`, phi_k `[..., k_len, r]` (non-negative features), v `[..., k_len,
  d_v]`. Non-causal: one pass, S = sum_j phi(k_j) v_jᵀ `[r, d_v]`, z = sum_j phi(k_j).
  Causal with q_len == k_len: `causal_chunked` (chunks of chunk_size and prefix sums).
  Causal with q_len < k_len (decoding): the quadratic form (the queries are few).
  """
  q_len, k_len = phi_q.shape[-2], phi_k.shape[-2]
  key_mask = _key_mask(mask, k_len, max(phi_q.ndim, phi_k.ndim))
  if key_mask is not None:
    phi_k = jnp.where(jnp.swapaxes(key_mask, -1, -2), phi_k, 0.0)  # [..., k_len, r]
  if not causal:
    s = jnp.einsum("...kr,...kd->...rd", phi_k, v)  # [..., r, d_v]
    z = jnp.sum(phi_k, axis=-2)  # [..., r]
    num = jnp.einsum("...qr,...rd->...qd", phi_q, s)  # [..., q_len, d_v]
    den = jnp.einsum("...qr,...r->...q", phi_q, z)[..., None]  # [..., q_len, 1]
    return _safe_div(num, den)
  if q_len != k_len:
    a = kernel_weights(phi_q, phi_k, causal=True)
    return jnp.matmul(a, v)
  return causal_chunked(phi_q, phi_k, v, chunk_size=chunk_size)


def causal_chunked(q: Array, k: Array, v: Array, *, chunk_size: int = DEFAULT_CHUNK,
                   feature_q: Callable[[Array], Array] | None = None,
                   feature_k: Callable[[Array], Array] | None = None,
                   key_mask: Array | None = None) -> Array:
  """Causal kernelised attention for q_len == k_len by chunks -> `[..., len, d_v]`.

  Inside a chunk the masked quadratic form, plus the exclusive prefix sums S = sum phi(k_j)
  v_jᵀ and z = sum phi(k_j) of the earlier chunks (the same values as the quadratic form,
  O(len · chunk · r + len · r · d_v) work), as a scan over groups of CHUNK_GROUP chunks.
  feature_q / feature_k (default: identity, q and k are the features) map one group of raw
  queries / keys `[..., g, chunk, d]` to features inside the scan step, and the step is
  recomputed in the backward pass (`jax.checkpoint`): the `[len, r]` feature arrays never
  exist whole, so the working set stays one group's whatever the length (measured: Performer's
  forward+backward at 4096 tokens 1.4x faster, experiments/benchmarks/README.md). key_mask:
  bool `[..., len]` (False: the key is dropped).
  """
  if not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
  length = q.shape[-2]
  lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
  q, k, v = (jnp.broadcast_to(x, lead + x.shape[-2:]) for x in (q, k, v))
  keep = None if key_mask is None else jnp.broadcast_to(key_mask, lead + (length,))[..., None]
  c = min(chunk_size, length)
  n = -(-length // c)
  g = min(n, CHUNK_GROUP)  # chunks per scan step
  m = -(-n // g)  # scan steps
  pad = m * g * c - length

  def groups(x: Array) -> Array:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)])
    x = x.reshape(lead + (m, g, c, x.shape[-1]))  # [..., m, g, c, feat]
    return jnp.moveaxis(x, -4, 0)  # [m, ..., g, c, feat]

  tril = jnp.tril(jnp.ones((c, c), bool))  # [c, c]
  fused = feature_q is not None or feature_k is not None
  feature_q = feature_q or (lambda x: x)
  feature_k = feature_k or (lambda x: x)

  def step(state, group):
    s_before, z_before = state  # sums over all earlier groups: [..., r, d_v], [..., r]
    qc, kc, vc = feature_q(group[0]), feature_k(group[1]), group[2]  # [..., g, c, feat]
    if keep is not None:
      kc = jnp.where(group[3], kc, 0.0)
    s = jnp.einsum("...ncr,...ncd->...nrd", kc, vc)  # [..., g, r, d_v]
    z = jnp.sum(kc, axis=-2)  # [..., g, r]
    # exclusive prefix sums over the chunks of this group, plus the earlier groups' sums
    s_prev = jnp.cumsum(s, axis=-3) - s + s_before[..., None, :, :]  # [..., g, r, d_v]
    z_prev = jnp.cumsum(z, axis=-2) - z + z_before[..., None, :]  # [..., g, r]
    a = jnp.where(tril, jnp.einsum("...nqr,...nkr->...nqk", qc, kc), 0.0)  # [..., g, c, c]
    num = (jnp.einsum("...nqk,...nkd->...nqd", a, vc)
           + jnp.einsum("...nqr,...nrd->...nqd", qc, s_prev))  # [..., g, c, d_v]
    den = (jnp.sum(a, axis=-1)
           + jnp.einsum("...nqr,...nr->...nq", qc, z_prev))[..., None]  # [..., g, c, 1]
    return (s_before + jnp.sum(s, axis=-3), z_before + jnp.sum(z, axis=-2)), _safe_div(num, den)

  inputs = (groups(q), groups(k), groups(v)) + (() if keep is None else (groups(keep),))
  features = jax.eval_shape(feature_k, jax.ShapeDtypeStruct(inputs[1].shape[1:], k.dtype))
  dtype, r = jnp.result_type(features.dtype, v.dtype), features.shape[-1]
  state = (jnp.zeros(lead + (r, v.shape[-1]), dtype), jnp.zeros(lead + (r,), dtype))
  if fused:
    step = jax.checkpoint(step)
  if m == 1:  # one group: no loop
    _, out = step(state, tuple(x[0] for x in inputs))
    out = out[None]
  else:  # a scan over groups of chunks keeps each step's work (and memory) the same size
    _, out = jax.lax.scan(step, state, inputs)  # [m, ..., g, c, d_v]
  out = jnp.moveaxis(out, 0, -4).reshape(lead + (m * g * c, v.shape[-1]))
  return out[..., :length, :]  # [..., len, d_v]


# ----------------------------------------------------------------------------- linear attention


def linear_attention(q: Array, k: Array, v: Array, *, causal: bool = False, mask: Any = None,
                     chunk_size: int = DEFAULT_CHUNK) -> Array:
  """Linear attention (Katharopoulos et al. 2020, eq. 5-6, phi = elu + 1) -> `[..., q_len, d_v]`.

  out_i = phi(q_i)ᵀ sum_j phi(k_j) v_jᵀ / phi(q_i)ᵀ sum_j phi(k_j), the sums over the allowed
  keys (j <= i when causal, by chunked prefix sums). mask: key padding `[batch, k_len]` or
  `[batch, 1|heads, 1, k_len]`.
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  core.check_qkv(q, k, v)
  if causal and _fuse_features(q, k, k.shape[-1], chunk_size):  # features inside the scan
    return causal_chunked(q, k, v, chunk_size=chunk_size, feature_q=elu_feature_map,
                          feature_k=elu_feature_map,
                          key_mask=_key_vector(mask, k.shape[-2], max(q.ndim, k.ndim)))
  return kernel_attention(elu_feature_map(q), elu_feature_map(k), v, causal=causal, mask=mask,
                          chunk_size=chunk_size)


def linear_attention_weights(q: Array, k: Array, *, causal: bool = False,
                             mask: Any = None) -> Array:
  """Linear attention's implicit matrix `[..., q_len, k_len]` (for analysis)."""
  return kernel_weights(elu_feature_map(jnp.asarray(q)), elu_feature_map(jnp.asarray(k)),
                        causal=causal, mask=mask)


# ----------------------------------------------------------------------------- Performer


def performer_features(rng: Array, num_features: int, head_dim: int) -> Array:
  """Positive orthogonal random features `[num_features, head_dim]` (FAVOR+, section 2.4).

  Blocks of head_dim rows are orthogonal (Haar: the Q of a Gaussian matrix's QR with R's
  diagonal positive); each row is rescaled to the norm of an independent Gaussian vector, so
  every row is marginally N(0, I) and the estimate stays unbiased. Redraw by calling again with
  another rng.
  """
  if num_features < 1 or head_dim < 1:
    raise ValueError(f"performer_features needs num_features >= 1 and head_dim >= 1; got "
                     f"{num_features}, {head_dim}")
  n_blocks = -(-num_features // head_dim)
  rng_q, rng_n = jax.random.split(rng)
  g = jax.random.normal(rng_q, (n_blocks, head_dim, head_dim), jnp.float32)
  qs = _orthonormal_columns(g)  # [n_blocks, d, d]
  w = jnp.swapaxes(qs, -1, -2).reshape(n_blocks * head_dim, head_dim)[:num_features]
  norms = jnp.linalg.norm(jax.random.normal(rng_n, (num_features, head_dim)), axis=-1)
  return w * norms[:, None]  # [num_features, head_dim]


def _orthonormal_columns(g: Array) -> Array:
  """Q of g = QR with R's diagonal positive, `[..., d, d]`, by Gram-Schmidt with a second pass
  per column (orthogonal to float32 rounding for any invertible g).

  Plain matmuls instead of `jnp.linalg.qr`: XLA:CPU runs a batched QR as LAPACK calls that
  wait on the same thread pool as the program that calls them, and two CPU devices drawing
  Performer features at once blocked every thread of the pool (a train step that never ended).
  The positive diagonal makes Q Haar-distributed for a Gaussian g (a QR routine's own signs
  would bias it), and Gram-Schmidt gives that Q by construction.
  """
  d = g.shape[-1]
  cols = jnp.arange(d)

  def one_column(j, q):
    v = g[..., :, j]  # [..., d]; q's columns from j on are still zero
    for _ in range(2):  # project out the earlier columns twice (classical Gram-Schmidt, twice)
      v = v - jnp.einsum("...ij,...j->...i", q, jnp.einsum("...ij,...i->...j", q, v))
    v = v / jnp.linalg.norm(v, axis=-1, keepdims=True)
    return jnp.where(cols == j, v[..., :, None], q)

  return jax.lax.fori_loop(0, d, one_column, jnp.zeros_like(g))


def _performer_projection(x: Array, features: Array) -> tuple[Array, Array]:
  """(wᵀx' `[..., len, m]`, |x'|²/2 `[..., len, 1]`) for x' = x / d^(1/4)."""
  d = x.shape[-1]
  x = x.astype(core._compute_dtype(x.dtype)) * d ** -0.25  # pylint: disable=protected-access
  return (jnp.einsum("...ld,md->...lm", x, features),
          0.5 * jnp.sum(x * x, axis=-1, keepdims=True))


def performer_key_max(k: Array, features: Array, mask: Any = None, ndim: int = 4) -> Array:
  """The keys' stabiliser of `performer_feature_map`, max over the keys and features of wᵀk'
  `[..., 1, 1]` (no gradient). mask: a key padding mask (see `_key_mask`, ndim the inputs' rank);
  padded keys are left out of the max, so they cannot change the real keys' features (the
  feature floor does not scale with the stabiliser). 0 where no key is allowed."""
  proj = _performer_projection(k, features)[0]  # [..., k_len, m]
  key_mask = _key_mask(mask, k.shape[-2], ndim)
  if key_mask is not None:
    proj = jnp.where(jnp.swapaxes(key_mask, -1, -2), proj, -jnp.inf)  # [..., k_len, m]
  c = jnp.max(proj, axis=(-1, -2), keepdims=True)
  return jax.lax.stop_gradient(jnp.where(jnp.isfinite(c), c, 0.0))


def performer_feature_map(x: Array, features: Array, *, is_query: bool,
                          key_max: Array | None = None) -> Array:
  """phi(x) = exp(wᵀx' - |x'|²/2 - c) / sqrt(m), x' = x / d^(1/4), for the m rows w of features.

  c is a stabiliser: the row max for queries, the max over all keys (and features) for keys
  (one constant per head; key_max passes it in, `performer_key_max`, e.g. the max over the
  unpadded keys only, or when x is a part of the keys). A floor of 1e-6 keeps the
  denominators positive; it does not scale with exp(-c), so c cancels only up to the floor's
  share: keys in the max that a query cannot see (future keys under causal) still shift its
  output slightly.
  """
  proj, sq = _performer_projection(x, features)  # [..., len, m], [..., len, 1]
  if is_query:
    c = jnp.max(proj, axis=-1, keepdims=True)
  elif key_max is None:
    c = jnp.max(proj, axis=(-1, -2), keepdims=True)
  else:
    c = key_max
  c = jax.lax.stop_gradient(c)
  # + a tiny floor keeps every denominator positive when a feature underflows (FAVOR+'s code
  # adds one too); its bias is far below the estimator's error (measured: no change at m=4096)
  return jnp.exp(proj - sq - c) / math.sqrt(features.shape[0]) + 1e-6


def performer_attention(q: Array, k: Array, v: Array, *, features: Array, causal: bool = False,
                        mask: Any = None, chunk_size: int = DEFAULT_CHUNK) -> Array:
  """Performer FAVOR+ attention (Choromanski et al. 2021): softmax attention estimated with
  positive random features, in linear time (causal by chunked prefix sums)."""
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  core.check_qkv(q, k, v)
  ndim = max(q.ndim, k.ndim)
  key_max = performer_key_max(k, features, mask, ndim)  # [..., 1, 1]: padded keys left out
  if causal and _fuse_features(q, k, features.shape[0], chunk_size):  # features inside the scan
    group_max = key_max[..., None, :, :]  # [..., 1, 1, 1]: per group
    return causal_chunked(
        q, k, v, chunk_size=chunk_size,
        feature_q=lambda x: performer_feature_map(x, features, is_query=True),
        feature_k=lambda x: performer_feature_map(x, features, is_query=False, key_max=group_max),
        key_mask=_key_vector(mask, k.shape[-2], ndim))
  return kernel_attention(performer_feature_map(q, features, is_query=True),
                          performer_feature_map(k, features, is_query=False, key_max=key_max), v,
                          causal=causal, mask=mask, chunk_size=chunk_size)


def performer_weights(q: Array, k: Array, *, features: Array, causal: bool = False,
                      mask: Any = None) -> Array:
  """Performer's implicit attention matrix `[..., q_len, k_len]` (for analysis)."""
  q, k = jnp.asarray(q), jnp.asarray(k)
  key_max = performer_key_max(k, features, mask, max(q.ndim, k.ndim))
  return kernel_weights(performer_feature_map(q, features, is_query=True),
                        performer_feature_map(k, features, is_query=False, key_max=key_max),
                        causal=causal, mask=mask)


# ----------------------------------------------------------------------------- Linformer


def init_linformer_projections(rng: Array, max_len: int, rank: int) -> dict[str, Array]:
  """Linformer's E and F `[max_len, rank]`, normal(0, 1/max_len) (learned)."""
  rng_k, rng_v = jax.random.split(rng)
  std = 1.0 / math.sqrt(max_len)
  return {"proj_k": std * jax.random.normal(rng_k, (max_len, rank), jnp.float32),
          "proj_v": std * jax.random.normal(rng_v, (max_len, rank), jnp.float32)}


def _linformer_project(k: Array, v: Array, proj_k: Array, proj_v: Array,
                       mask: Any) -> tuple[Array, Array]:
  k_len = k.shape[-2]
  if proj_k.ndim != 2 or proj_k.shape != proj_v.shape or proj_k.shape[0] < k_len:
    raise ValueError(f"linformer projections must be [max_len >= k_len={k_len}, r], the same "
                     f"for keys and values; got proj_k {proj_k.shape}, proj_v {proj_v.shape}")
  key_mask = _key_mask(mask, k_len, k.ndim)
  if key_mask is not None:  # padded keys/values contribute nothing to the projection
    keep = jnp.swapaxes(key_mask, -1, -2)  # [..., k_len, 1]
    k, v = jnp.where(keep, k, 0.0), jnp.where(keep, v, 0.0)
  k_proj = jnp.einsum("...kd,kr->...rd", k, proj_k[:k_len])  # [..., r, d]
  v_proj = jnp.einsum("...kd,kr->...rd", v, proj_v[:k_len])  # [..., r, d_v]
  return k_proj, v_proj


def linformer_attention(q: Array, k: Array, v: Array, *, proj_k: Array, proj_v: Array,
                        mask: Any = None) -> Array:
  """Linformer (Wang et al. 2020, eq. 7): softmax(Q (Eᵀ K)ᵀ / sqrt(d)) (Fᵀ V).

  proj_k = E, proj_v = F `[max_len, r]` (their first k_len rows are used: any k_len <=
  max_len). Non-causal only (the projection mixes all positions). mask: key padding.
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  core.check_qkv(q, k, v)
  k_proj, v_proj = _linformer_project(k, v, proj_k, proj_v, mask)
  logits = jnp.einsum("...qd,...rd->...qr", q, k_proj) / math.sqrt(q.shape[-1])  # [.., q, r]
  return jnp.matmul(jax.nn.softmax(logits, axis=-1), v_proj)  # [..., q_len, d_v]


def linformer_weights(q: Array, k: Array, *, proj_k: Array, proj_v: Array,
                      mask: Any = None) -> Array:
  """Linformer's implicit matrix `[..., q_len, k_len]`: softmax(Q (EᵀK)ᵀ/sqrt(d)) Fᵀ, so that
  context = weights @ V (rows need not sum to 1)."""
  q, k = jnp.asarray(q), jnp.asarray(k)
  k_proj, _ = _linformer_project(k, k, proj_k, proj_v, mask)
  logits = jnp.einsum("...qd,...rd->...qr", q, k_proj) / math.sqrt(q.shape[-1])
  w = jnp.einsum("...qr,kr->...qk", jax.nn.softmax(logits, axis=-1), proj_v[:k.shape[-2]])
  key_mask = _key_mask(mask, k.shape[-2], max(q.ndim, k.ndim))
  return w if key_mask is None else jnp.where(key_mask, w, 0.0)


# ----------------------------------------------------------------------------- block-sparse


def sliding_window_mask(q_len: int, k_len: int, window: int, *, causal: bool) -> Array:
  """Sliding-window mask `[1, 1, q_len, k_len]` (queries end-aligned to the keys).

  Query i (at key position p = i + max(k_len - q_len, 0)) sees keys |p - j| <= window, and
  only p - window <= j <= p when causal (Longformer's local attention; Beltagy et al. 2020).
  """
  if window < 0:
    raise ValueError(f"window must be >= 0 (keys within distance window); got {window}")
  off = _causal_offset(q_len, k_len)
  # built from iotas (no [q_len, k_len] constant in the compiled program)
  dist = jnp.arange(k_len)[None, :] - (jnp.arange(q_len)[:, None] + off)  # [q_len, k_len]
  ok = jnp.abs(dist) <= window
  if causal:
    ok = ok & (dist <= 0)
  return ok[None, None]


def bigbird_mask(q_len: int, k_len: int, *, block: int, num_global: int = 1,
                 num_random: int = 1, rng_seed: int = 0, causal: bool = False,
                 window_blocks: int = 1) -> Array:
  """BigBird's block-sparse mask `[1, 1, q_len, k_len]` (Zaheer et al. 2020, ITC variant).

  Positions are cut into blocks of `block`. Query block a sees key block b when
  |a - b| <= window_blocks (window), a < num_global or b < num_global (global blocks that
  see and are seen by every block), or b is one of num_random key blocks drawn for a among
  those outside its window and the global blocks (all of them where fewer are free) with
  numpy's generator seeded rng_seed (fixed for a given seed). causal ANDs the end-aligned
  look-ahead mask (and draws the random blocks among the earlier ones).
  """
  blocks = bigbird_blocks(q_len, k_len, block=block, num_global=num_global,
                          num_random=num_random, rng_seed=rng_seed, causal=causal,
                          window_blocks=window_blocks)
  # only the [q_blocks, k_blocks] table is a constant; the expansion happens on the device
  ok = jnp.repeat(jnp.repeat(jnp.asarray(blocks), block, 0), block, 1)[:q_len, :k_len]
  if causal:
    ok = ok & (jnp.arange(k_len)[None, :]
               <= jnp.arange(q_len)[:, None] + _causal_offset(q_len, k_len))
  return ok[None, None]


def block_sparse_attention(q: Array, k: Array, v: Array, pattern: Array, *,
                           causal: bool = False, mask: Any = None, block: int = 64,
                           bias: Any = None, scale: float | None = None) -> Array:
  """Softmax attention restricted to a block-sparse `pattern` (bool `[.., q_len, k_len]`),
  run by the blocked kernel with tiles of `block` x `block`; tiles the pattern (AND mask)
  hides are skipped, so a pattern with O(len) visible tiles costs O(len)."""
  from attnlab.attention import blocked  # pylint: disable=g-import-not-at-top
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  core.check_qkv(q, k, v)
  full = masks_lib.combine(pattern, mask)
  lead = tuple(jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
  q, k, v = (jnp.broadcast_to(x, lead + x.shape[-2:]) for x in (q, k, v))
  # rows with no visible key get a zero context from the kernel itself
  return blocked.blocked_attention(q, k, v, scale=scale, mask=full, causal=causal, block_q=block,
                                   block_k=block, bias=bias, block_sparse=True)


def _blocked_pattern(q: Array, k: Array, v: Array, pattern: Any, *, causal: bool, mask: Any,
                     block: int, bias: Any, scale: float | None) -> Array:
  from attnlab.attention import blocked  # pylint: disable=g-import-not-at-top
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  core.check_qkv(q, k, v)
  lead = tuple(jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
  q, k, v = (jnp.broadcast_to(x, lead + x.shape[-2:]) for x in (q, k, v))
  return blocked.blocked_attention(q, k, v, scale=scale, mask=mask, causal=causal,
                                   block_q=block, block_k=block, bias=bias, pattern=pattern)


def sliding_window_attention(q: Array, k: Array, v: Array, *, window: int, causal: bool = False,
                             mask: Any = None, block: int | None = None, bias: Any = None,
                             scale: float | None = None) -> Array:
  """Softmax attention within a sliding window (the sliding_window_mask pattern) on the
  blocked kernel, which computes the window per tile (no [q_len, k_len] mask) and skips the
  tiles outside it: O(len · window). Tiles of `block` (default: the window rounded up to a
  multiple of 8, at least 32); mask: an extra user mask (e.g. key padding)."""
  from attnlab.attention import blocked  # pylint: disable=g-import-not-at-top
  if window < 0:
    raise ValueError(f"window must be >= 0 (keys within distance window); got {window}")
  if block is None:
    block = max(32, -(-window // 8) * 8)
  pattern = blocked.WindowPattern(int(window), _causal_offset(q.shape[-2], k.shape[-2]))
  return _blocked_pattern(q, k, v, pattern, causal=causal, mask=mask, block=block, bias=bias,
                          scale=scale)


def bigbird_blocks(q_len: int, k_len: int, *, block: int, num_global: int = 1,
                   num_random: int = 1, rng_seed: int = 0, causal: bool = False,
                   window_blocks: int = 1) -> np.ndarray:
  """BigBird's block table `[q_blocks, k_blocks]` (see bigbird_mask), as NumPy bool."""
  if block < 1 or num_global < 0 or num_random < 0 or window_blocks < 0:
    raise ValueError(f"bigbird needs block >= 1 and num_global, num_random, window_blocks "
                     f">= 0; got block={block}, num_global={num_global}, "
                     f"num_random={num_random}, window_blocks={window_blocks}")
  nq, nk = -(-q_len // block), -(-k_len // block)
  off = _causal_offset(q_len, k_len) // block
  a = np.arange(nq)[:, None] + off  # query block positions among the key blocks
  b = np.arange(nk)[None, :]
  blocks = (np.abs(a - b) <= window_blocks) | (a < num_global) | (b < num_global)
  rng = np.random.default_rng(rng_seed)
  for row in range(nq):
    # drawn among the key blocks this row does not see yet (outside its window and the global
    # blocks, as BigBird's bigbird_block_rand_mask does), before it when causal: num_random of
    # them wherever that many are free, all of them where fewer are
    hi = min(row + off + 1, nk) if causal else nk
    free = np.flatnonzero(~blocks[row, :hi])  # [free key blocks]
    if num_random and free.size:
      picks = rng.choice(free, size=min(num_random, free.size), replace=False)
      blocks[row, picks] = True
  return blocks


def bigbird_attention(q: Array, k: Array, v: Array, *, block: int = 64, num_global: int = 1,
                      num_random: int = 1, rng_seed: int = 0, causal: bool = False,
                      mask: Any = None, window_blocks: int = 1, bias: Any = None,
                      scale: float | None = None) -> Array:
  """BigBird attention (the bigbird_mask pattern) on the blocked kernel with `block` x `block`
  tiles, visiting only the visible blocks: O(len · block · (2 window_blocks + 1 + num_random)
  + len · num_global · block)."""
  from attnlab.attention import blocked  # pylint: disable=g-import-not-at-top
  table = bigbird_blocks(q.shape[-2], k.shape[-2], block=block, num_global=num_global,
                         num_random=num_random, rng_seed=rng_seed, causal=causal,
                         window_blocks=window_blocks)
  pattern = blocked.BlockPattern(tuple(map(tuple, table.tolist())), int(block))
  return _blocked_pattern(q, k, v, pattern, causal=causal, mask=mask, block=block, bias=bias,
                          scale=scale)
