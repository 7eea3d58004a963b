"""blocked_attention against NumPy (values) and jnp einsum+softmax under jax.grad (gradients).

Shapes are small but cut into several tiles (block sizes 8-16) with lengths that are not a
multiple of the tile, so every loop bound, padding path and mask path runs.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.attention import blocked
from attnlab.attention.blocked import blocked_attention

TOL = dict(rtol=2e-5, atol=2e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- references


def np_allowed(shape, mask, causal):
  """bool [..., q_len, k_len]: user mask AND end-aligned causal mask."""
  q_len, k_len = shape[-2:]
  allowed = np.ones(shape, bool)
  if mask is not None:
    allowed &= np.asarray(mask, bool)
  if causal:
    off = max(k_len - q_len, 0)
    allowed &= np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + off
  return allowed


def np_attention(q, k, v, mask=None, causal=False, scale=None):
  """Plain softmax attention in float64; rows with no allowed key give zeros."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = scale * q @ np.swapaxes(k, -1, -2)  # [..., q_len, k_len]
  allowed = np_allowed(s.shape, mask, causal)
  s = np.where(allowed, s, -np.inf)
  mx = np.max(s, -1, keepdims=True)
  e = np.where(allowed, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
  den = e.sum(-1, keepdims=True)
  return (e / np.where(den > 0, den, 1.0)) @ v


def jnp_attention(q, k, v, mask=None, causal=False, scale=None):
  """einsum + softmax in jnp, differentiable; rows with no allowed key give zeros."""
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = scale * jnp.einsum("...qd,...kd->...qk", q, k)  # [..., q_len, k_len]
  allowed = jnp.asarray(np_allowed(s.shape, None if mask is None else np.asarray(mask), causal))
  s = jnp.where(allowed, s, -1e30)
  e = jnp.where(allowed, jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True))), 0.0)
  den = e.sum(-1, keepdims=True)
  return jnp.einsum("...qk,...kd->...qd", e / jnp.where(den > 0, den, 1.0), v)


def value_and_grads(fn, q, k, v, ct):
  """(out, (dq, dk, dv)) of fn at (q, k, v) with output cotangent ct."""
  out, vjp = jax.vjp(fn, q, k, v)
  return out, vjp(ct)


def make_mask(kind, rng, lead, q_len, k_len):
  """Masks in the layouts the attention layers pass; all make some rows fully masked."""
  b, heads = lead[0], (1,) * (len(lead) - 1)  # the mask is shared by the heads
  if kind is None:
    return None
  if kind == "padding":  # [batch, 1, 1, k_len] from lengths (one sequence has length 0)
    lengths = rng.integers(1, k_len + 1, size=b)
    lengths[-1] = 0
    keys = np.arange(k_len)[None, :] < lengths[:, None]  # [batch, k_len]
    return keys.reshape((b,) + heads + (1, k_len))
  if kind == "query_padding":  # [batch, 1, q_len, k_len]: padded queries see nothing
    keys = np.arange(k_len)[None, :] < rng.integers(1, k_len + 1, size=b)[:, None]
    queries = np.arange(q_len)[None, :] < rng.integers(1, q_len + 1, size=b)[:, None]
    return (queries[:, :, None] & keys[:, None, :]).reshape((b,) + heads + (q_len, k_len))
  if kind == "dense":  # per-head random mask [*lead, q_len, k_len] with empty rows
    m = rng.random(lead + (q_len, k_len)) < 0.4
    m[..., ::5, :] = False
    return m
  raise ValueError(kind)


# (lead, q_len, k_len, d, d_v, causal, mask kind, tuning kwargs)
CASES = {
    "ragged": ((2, 3), 37, 45, 8, 5, False, None, dict(block_q=16, block_k=8, head_group=2)),
    "causal_ragged": ((2, 2), 35, 35, 8, 6, True, None, dict(block_q=8, block_k=16,
                                                             head_group=2)),
    "causal_keys_longer": ((2,), 13, 29, 8, 4, True, None, dict(block_q=8, block_k=8)),
    "causal_queries_longer": ((2,), 29, 13, 8, 4, True, None, dict(block_q=8, block_k=8)),
    "padding": ((3, 2), 21, 21, 8, 8, False, "padding", dict(block_q=8, block_k=8,
                                                               head_group=2)),
    "padding_causal": ((3, 2), 26, 26, 8, 8, True, "padding", dict(block_q=8, block_k=8)),
    "query_padding": ((2, 2), 19, 23, 8, 8, False, "query_padding", dict(block_q=8,
                                                                        block_k=8)),
    "dense_per_head": ((2, 3), 19, 17, 8, 8, True, "dense", dict(block_q=8, block_k=8,
                                                                 head_group=3)),
    "defaults_causal": ((2, 2), 24, 24, 16, 16, True, "padding", dict()),
    # row chunks with their own tile loops (run concurrently on XLA:CPU's thread pool)
    "parallel_dense_per_head": ((2, 3), 19, 17, 8, 8, True, "dense", dict(
        block_q=8, block_k=8, head_group=3, parallel=2)),
    "parallel_padding": ((4, 2), 21, 26, 8, 5, False, "padding", dict(
        block_q=8, block_k=8, head_group=1, parallel=4)),
    "parallel_ragged_causal": ((2, 3), 35, 35, 8, 6, True, None, dict(
        block_q=8, block_k=16, head_group=2, parallel=3)),
    "parallel_not_divisor": ((5,), 20, 20, 8, 8, True, "query_padding", dict(
        block_q=8, block_k=8, parallel=2)),
    "no_parallel": ((2, 2), 24, 24, 16, 16, True, "padding", dict(parallel=1)),
}


def _random_case(seed):
  """A shape drawn at random (fixed seed): lengths 1-40, tiles 8 or 16, any head group."""
  r = np.random.default_rng(seed)
  lead = tuple(int(x) for x in r.integers(1, 4, size=int(r.integers(1, 3))))
  q_len, k_len = (int(x) for x in r.integers(1, 41, size=2))
  tuning = dict(block_q=int(r.choice([8, 16])), block_k=int(r.choice([8, 16])),
                head_group=int(r.integers(1, 4)))
  return (lead, q_len, k_len, 8, int(r.integers(1, 9)), bool(r.integers(2)),
          str(r.choice(["padding", "query_padding", "dense"])), tuning)


CASES["random"] = _random_case(20261121)
# The default tiles (no tuning): one device's large tiles (ONE_DEVICE_TILES) and the per-device
# ones, at lengths that take several ragged tiles of each.
CASES["default_tiles_causal"] = ((1, 2), 1100, 1100, 8, 4, True, None, {})
CASES["default_tiles_padding"] = ((2, 1), 1100, 1030, 8, 4, False, "padding", {})
CASES["per_device_tiles_causal_padding"] = ((2,), 600, 600, 8, 4, True, "padding",
                                            dict(tiles=blocked.PER_DEVICE_TILES))


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_match_references(name):
  lead, q_len, k_len, d, d_v, causal, kind, tuning = CASES[name]
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  q = rng.standard_normal(lead + (q_len, d)).astype(np.float32)
  k = rng.standard_normal(lead + (k_len, d)).astype(np.float32)
  v = rng.standard_normal(lead + (k_len, d_v)).astype(np.float32)
  ct = rng.standard_normal(lead + (q_len, d_v)).astype(np.float32)
  mask = make_mask(kind, rng, lead, q_len, k_len)

  fn = lambda q, k, v: blocked_attention(q, k, v, mask=mask, causal=causal, **tuning)
  out, grads = jax.jit(lambda *a: value_and_grads(fn, *a))(q, k, v, ct)
  np.testing.assert_allclose(out, np_attention(q, k, v, mask, causal), **TOL)

  ref = lambda q, k, v: jnp_attention(q, k, v, mask, causal)
  _, ref_grads = value_and_grads(ref, q, k, v, ct)
  for got, want, which in zip(grads, ref_grads, "qkv"):
    assert np.all(np.isfinite(got)), f"d{which} has non-finite entries"
    np.testing.assert_allclose(got, want, err_msg=f"d{which}", **GRAD_TOL)

  if kind is not None or causal:
    # queries with no visible key: zero context and zero query gradient
    empty = ~np_allowed(lead + (q_len, k_len), mask, causal).any(-1)  # [..., q_len]
    assert np.all(np.asarray(out)[empty] == 0.0)
    assert np.all(np.asarray(grads[0])[empty] == 0.0)


def test_dot_score_and_explicit_scale():
  rng = np.random.default_rng(1)
  q, k, v = (rng.standard_normal((2, 11, 4)).astype(np.float32) for _ in range(3))
  f = jax.jit(lambda q, k, v: [blocked_attention(q, k, v, scale=s, block_q=8, block_k=8)
                               for s in (1.0, 0.3)])
  dot, scaled = f(q, k, v)
  np.testing.assert_allclose(dot, np_attention(q, k, v, scale=1.0), **TOL)
  np.testing.assert_allclose(scaled, np_attention(q, k, v, scale=0.3), **TOL)


def test_vmap_matches_per_example_loop():
  rng = np.random.default_rng(2)
  n, heads, length, d = 3, 2, 21, 8
  q, k, v, ct = (rng.standard_normal((n, heads, length, d)).astype(np.float32)
                 for _ in range(4))
  lengths = np.array([21, 9, 0])
  mask = (np.arange(length)[None, :] < lengths[:, None])[:, None, None, :]  # [n, 1, 1, k]

  def one(q, k, v, m, ct):  # one example: q [heads, len, d], mask [1, 1, len]
    fn = lambda q, k, v: blocked_attention(q, k, v, mask=m, causal=True, block_q=8, block_k=8)
    return value_and_grads(fn, q, k, v, ct)

  out, grads = jax.jit(jax.vmap(one))(q, k, v, mask, ct)
  for i in range(n):
    np.testing.assert_allclose(out[i], np_attention(q[i], k[i], v[i], mask[i], True), **TOL)
    ref = lambda q, k, v: jnp_attention(q, k, v, mask[i], True)
    _, ref_grads = value_and_grads(ref, q[i], k[i], v[i], ct[i])
    for got, want in zip(grads, ref_grads):
      np.testing.assert_allclose(got[i], want, **GRAD_TOL)


def test_broadcast_leading_dims_and_bfloat16():
  rng = np.random.default_rng(3)
  q = rng.standard_normal((2, 3, 10, 8)).astype(np.float32)
  k = rng.standard_normal((2, 1, 12, 8)).astype(np.float32)  # shared across the 3 heads
  v = rng.standard_normal((1, 1, 12, 8)).astype(np.float32)
  want = np_attention(q, np.broadcast_to(k, (2, 3, 12, 8)), np.broadcast_to(v, (2, 3, 12, 8)))
  f = jax.jit(blocked_attention)  # default tiling: one tile
  np.testing.assert_allclose(f(q, k, v), want, **TOL)
  out = f(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=0, atol=5e-2)


def test_matches_attend_reference_path():
  core = pytest.importorskip("attnlab.attention.core")
  rng = np.random.default_rng(4)
  q, k, v = (rng.standard_normal((2, 2, 19, 8)).astype(np.float32) for _ in range(3))
  mask = (np.arange(19)[None, :] < np.array([19, 6])[:, None])[:, None, None, :]

  @jax.jit
  def both(q, k, v):  # {score: (blocked, reference)}
    return {score: [core.attend(q, k, v, score=score, mask=mask, causal=True,
                                implementation=impl, return_weights=False)[0]
                    for impl in ("blocked", "reference")]
            for score in blocked.SUPPORTED_SCORES}

  for score, (got, want) in both(q, k, v).items():
    np.testing.assert_allclose(got, want, err_msg=score, **TOL)


def test_supported_scores():
  assert blocked.SUPPORTED_SCORES == ("dot", "scaled_dot")


def test_peak_memory_grows_linearly():
  """Compiled forward+backward temporaries: doubling S about doubles them (no S² buffer)."""

  def temp_bytes(length):
    spec = jax.ShapeDtypeStruct((1, 2, length, 16), jnp.float32)
    fn = lambda q, k, v: blocked_attention(q, k, v, causal=True)
    fwd_bwd = jax.jit(lambda q, k, v, ct: value_and_grads(fn, q, k, v, ct))
    return fwd_bwd.lower(spec, spec, spec, spec).compile().memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(2048), temp_bytes(4096)
  assert large < 2.5 * small, (small, large)
  assert large < 4096 * 4096 * 4  # far below one float32 score matrix of one head


def test_lowers_for_gpu_and_tpu():
  """Pure JAX: the forward+backward exports for CUDA and TPU without such a device here."""
  spec = jax.ShapeDtypeStruct((2, 2, 40, 8), jnp.float32)
  mask = jax.ShapeDtypeStruct((2, 1, 1, 40), jnp.bool_)

  def fwd_bwd(q, k, v, mask):
    fn = lambda q, k, v: blocked_attention(q, k, v, mask=mask, causal=True, block_q=16,
                                           block_k=16)
    return value_and_grads(fn, q, k, v, q)

  exported = jax.export.export(jax.jit(fwd_bwd), platforms=("cuda", "tpu"))(
      spec, spec, spec, mask)
  assert exported.platforms == ("cuda", "tpu")


def test_empty_lengths():
  q = np.zeros((2, 0, 4), np.float32)
  k = np.zeros((2, 5, 4), np.float32)
  assert blocked_attention(q, k, k).shape == (2, 0, 4)
  out = blocked_attention(np.ones((2, 3, 4), np.float32), k[:, :0], k[:, :0])
  assert out.shape == (2, 3, 4) and not np.any(np.asarray(out))


@pytest.mark.parametrize("kwargs, match", [
    (dict(q=np.ones((4,))), "q must have shape"),
    (dict(k=np.ones((2, 5, 3))), "share the feature dim"),
    (dict(v=np.ones((2, 6, 4))), "same length k_len"),
    (dict(k=np.ones((3, 5, 4)), v=np.ones((3, 5, 4))), "do not broadcast"),
    (dict(mask=np.ones((2, 3, 4), bool)), "does not broadcast"),
    (dict(mask=np.ones((2, 3, 5), np.float32)), "must be boolean"),
    (dict(block_q=0), "block_q must be a positive int"),
    (dict(block_k=2.5), "block_k must be a positive int"),
    (dict(head_group=-1), "head_group must be a positive int"),
    (dict(parallel=0), "parallel must be a positive int"),
])
def test_bad_input_raises_clear_error(kwargs, match):
  args = dict(q=np.ones((2, 3, 4)), k=np.ones((2, 5, 4)), v=np.ones((2, 5, 4)))
  args.update(kwargs)
  q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
  with pytest.raises(ValueError, match=match):
    blocked_attention(q, k, v, **args)
