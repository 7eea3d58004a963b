"""The fused CPU attention kernel (attnlab.backends.cpu.fused_kernel) against NumPy, and its
dispatch.

Values and gradients are checked against a float64 NumPy softmax attention written here (the
backward from its textbook formulas), on shapes that exercise the kernel's edges: lengths that are
not multiples of its 16-float vectors or its query blocks, d != d_v, a single row (query blocks
split over threads), q_len above and below k_len with the causal mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import backends
from attnlab.attention import blocked
from attnlab.attention import core
from attnlab.backends.cpu import fused_kernel

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu",
                       reason="the fused kernel is CPU code (no GPU/TPU handler)"),
    pytest.mark.skipif(fused_kernel.unavailable_reason() is not None,
                       reason=f"fused CPU kernel: {fused_kernel.unavailable_reason()}")]

# (rows, q_len, k_len, d, d_v)
SHAPES = [(3, 5, 7, 8, 8), (2, 70, 70, 64, 64), (4, 130, 200, 33, 20), (1, 1, 1, 4, 4),
          (2, 150, 40, 16, 48), (1, 300, 300, 64, 64)]


def _visible(q_len: int, k_len: int, causal: bool) -> np.ndarray:
  if not causal:
    return np.ones((q_len, k_len), bool)
  return np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + max(k_len - q_len, 0)


def _reference(q, k, v, causal, key_mask=None):
  """(out, probabilities) in float64; key_mask: bool [rows, k_len] or None. A query with no
  visible key gets zero probabilities."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = q @ np.swapaxes(k, -1, -2)
  visible = _visible(q.shape[1], k.shape[1], causal)[None]
  if key_mask is not None:
    visible = visible & key_mask[:, None, :]
  s = np.where(visible, s, -np.inf)
  top = s.max(-1, keepdims=True)
  p = np.where(visible, np.exp(s - np.where(np.isfinite(top), top, 0)), 0.0)
  p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
  return p @ v, p


def _reference_grads(q, k, v, g, causal, key_mask=None):
  """d(sum(out * g)) / d(q, k, v) from dV = Pᵀ G, dP = G Vᵀ, dS = P (dP - rowsum(P dP)),
  dQ = dS K, dK = dSᵀ Q."""
  _, p = _reference(q, k, v, causal, key_mask)
  q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
  dv = np.swapaxes(p, -1, -2) @ g
  dp = g @ np.swapaxes(v, -1, -2)
  ds = p * (dp - (p * dp).sum(-1, keepdims=True))
  return ds @ k, np.swapaxes(ds, -1, -2) @ q, dv


def _inputs(shape, seed=0):
  rows, q_len, k_len, d, d_v = shape
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(rows, q_len, d)).astype(np.float32) / np.sqrt(d),
          rng.normal(size=(rows, k_len, d)).astype(np.float32),
          rng.normal(size=(rows, k_len, d_v)).astype(np.float32),
          rng.normal(size=(rows, q_len, d_v)).astype(np.float32))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_and_gradients_match_numpy(shape, causal):
  q, k, v, g = _inputs(shape)
  out = jax.jit(fused_kernel.attention, static_argnums=3)(q, k, v, causal)
  np.testing.assert_allclose(out, _reference(q, k, v, causal)[0], rtol=1e-4, atol=1e-5)
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fused_kernel.attention(q, k, v, causal) * g),
                           argnums=(0, 1, 2)))(q, k, v)
  for got, want in zip(grads, _reference_grads(q, k, v, g, causal)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_key_mask_values_and_gradients(causal):
  """A padding mask per batch element shared by its heads (mask rows 2, rows 6), with one batch
  element whose keys are all hidden: zero context and zero gradients there."""
  q, k, v, g = _inputs((6, 37, 45, 16, 24), seed=5)
  lengths = np.array([45, 20, 0])
  mask = np.arange(45)[None, :] < lengths[:, None]  # [3 batch elements, k_len]
  rows_mask = np.repeat(mask, 2, axis=0)  # each shared by 2 rows (heads)
  out = jax.jit(lambda q, k, v, m: fused_kernel.attention(q, k, v, causal, None, m))(q, k, v, mask)
  np.testing.assert_allclose(out, _reference(q, k, v, causal, rows_mask)[0], rtol=1e-4,
                             atol=1e-5)
  assert not np.asarray(out[4:]).any()
  loss = lambda q, k, v: jnp.sum(fused_kernel.attention(q, k, v, causal, None, mask) * g)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for got, want in zip(grads, _reference_grads(q, k, v, g, causal, rows_mask)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.isfinite(np.asarray(got)).all()


def test_large_scores_stay_finite():
  """Scores in the hundreds: the softmax subtracts the row maximum (no overflow)."""
  q, k, v, _ = _inputs((2, 40, 50, 16, 16), seed=1)
  q = q * 300.0
  out = fused_kernel.attention(q, k, v, False)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out, _reference(q, k, v, False)[0], rtol=1e-4, atol=1e-4)


def test_vmap_over_a_batch_axis():
  q, k, v, _ = _inputs((2, 20, 30, 8, 8), seed=2)
  stack = lambda x: np.stack([x, x[::-1]])  # [2, rows, len, d]
  out = jax.vmap(lambda q, k, v: fused_kernel.attention(q, k, v, True))(stack(q), stack(k),
                                                                       stack(v))
  for i in range(2):
    want = _reference(stack(q)[i], stack(k)[i], stack(v)[i], True)[0]
    np.testing.assert_allclose(out[i], want, rtol=1e-4, atol=1e-5)


def test_gradients_under_vmap():
  """vmap of the gradient (how the trainer's vmapped seeds differentiate the model)."""
  q, k, v, g = _inputs((2, 24, 36, 16, 8), seed=4)
  stack = lambda x: np.stack([x, 2 * x])
  loss = lambda q, k, v, g: jnp.sum(fused_kernel.attention(q, k, v, True) * g)
  grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(*map(stack, (q, k, v, g)))
  for i in range(2):
    want = _reference_grads(*(stack(x)[i] for x in (q, k, v, g)), True)
    for got, w in zip(grads, want):
      np.testing.assert_allclose(got[i], w, rtol=1e-4, atol=1e-4)


def _targets(fn, *args) -> str:
  return str(jax.make_jaxpr(fn)(*args))


def test_attend_dispatches_plain_float32_calls_to_the_kernel():
  """auto -> blocked -> the fused kernel for plain, causal and padded attention; other masks and
  explicit tiles keep the pure-JAX tile loops (and both agree with NumPy)."""
  rng = np.random.default_rng(3)
  q, k, v = (rng.normal(size=(2, 3, 300, 32)).astype(np.float32) for _ in range(3))
  plain = lambda q, k, v: core.attend(q, k, v, causal=True, return_weights=False)[0]
  assert fused_kernel.FORWARD in _targets(plain, q, k, v)
  mask = np.arange(300)[None, None, None, :] < np.array([300, 170])[:, None, None, None]
  padded = lambda q, k, v: core.attend(q, k, v, mask=mask, return_weights=False)[0]
  assert fused_kernel.FORWARD in _targets(padded, q, k, v)  # a key (padding) mask
  per_query = np.tril(np.ones((300, 300), bool))  # hides keys per query: the tile loops
  masked = lambda q, k, v: core.attend(q, k, v, mask=per_query, return_weights=False)[0]
  assert fused_kernel.FORWARD not in _targets(masked, q, k, v)
  per_head = np.ones((1, 3, 1, 300), bool)  # a mask row per head, shared over the batch
  assert fused_kernel.FORWARD not in _targets(
      lambda q, k, v: core.attend(q, k, v, mask=per_head, return_weights=False)[0], q, k, v)
  tiled = lambda q, k, v: blocked.blocked_attention(q, k, v, block_q=64, block_k=64)
  assert fused_kernel.FORWARD not in _targets(tiled, q, k, v)
  scale = 1 / np.sqrt(32)
  flat = lambda x: x.reshape(6, 300, -1)
  want = _reference(flat(q) * scale, flat(k), flat(v), True)[0].reshape(q.shape)
  np.testing.assert_allclose(jax.jit(plain)(q, k, v), want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(jax.jit(masked)(q, k, v), want, rtol=1e-4, atol=1e-5)
  rows_mask = np.repeat(mask[:, 0, 0, :], 3, axis=0)  # [batch * heads, k_len]
  want = _reference(flat(q) * scale, flat(k), flat(v), False, rows_mask)[0].reshape(q.shape)
  np.testing.assert_allclose(jax.jit(padded)(q, k, v), want, rtol=1e-4, atol=1e-5)


def test_the_kernel_is_the_backends_default_and_can_be_turned_off():
  """blocked_attention finds the kernel through attnlab.backends ("fused_attention"), with no
  setup; with that kernel set to None the same call traces the pure-JAX tile loops."""
  q, k, v = (np.random.default_rng(4).normal(size=(1, 2, 256, 16)).astype(np.float32)
             for _ in range(3))
  # a new function for each trace: JAX caches a traced program per function
  plain = lambda: lambda q, k, v: core.attend(q, k, v, causal=True, return_weights=False)[0]
  assert backends.kernel("fused_attention") is fused_kernel
  assert fused_kernel.FORWARD in _targets(plain(), q, k, v)
  on = jax.jit(plain())(q, k, v)
  previous = backends.use_kernel("fused_attention", None)
  try:
    assert fused_kernel.FORWARD not in _targets(plain(), q, k, v)
    off = jax.jit(plain())(q, k, v)
  finally:
    assert backends.use_kernel("fused_attention", previous) is None
  assert backends.kernel("fused_attention") is fused_kernel
  np.testing.assert_allclose(off, on, rtol=1e-4, atol=1e-5)
