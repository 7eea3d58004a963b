"""Attention pooling (Nadaraya-Watson) against NumPy references; learnable kernel gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from attnlab.attention import pooling

TOL = dict(rtol=1e-5, atol=1e-5)


def np_nw(xq, xk, yk, w=1.0, mask=None):
  logits = -((xq[:, None] - xk[None, :]) * w) ** 2 / 2
  m = np.ones(logits.shape, bool) if mask is None else np.broadcast_to(mask, logits.shape)
  e = np.where(m, np.exp(logits - np.max(np.where(m, logits, -np.inf), -1, keepdims=True)), 0.0)
  weights = e / e.sum(-1, keepdims=True)
  return weights @ yk, weights


@pytest.fixture(scope="module")
def data():
  r = np.random.default_rng(0)
  keys = np.sort(r.uniform(0, 5, 8)).astype(np.float32)  # [n_k]
  values = (2 * np.sin(keys) + keys ** 0.8).astype(np.float32)  # [n_k]
  queries = np.linspace(0, 5, 6).astype(np.float32)  # [n_q]
  return queries, keys, values


def test_average_pooling(data):
  queries, keys, values = data
  pred, w = pooling.average_pooling(queries, keys, values)
  assert pred.shape == (6,) and w.shape == (6, 8)
  np.testing.assert_allclose(pred, np.full(6, values.mean()), **TOL)
  mask = np.arange(8) < 3
  pred, w = pooling.average_pooling(queries, keys, values, mask=mask)
  np.testing.assert_allclose(pred, np.full(6, values[:3].mean()), **TOL)
  np.testing.assert_allclose(w[0], np.where(mask, 1 / 3, 0.0), **TOL)


def test_nadaraya_watson_fixed_and_scaled(data):
  queries, keys, values = data
  for w in (1.0, 2.5):
    pred, weights = pooling.nadaraya_watson(queries, keys, values, w=w)
    want_pred, want_w = np_nw(queries, keys, values, w)
    np.testing.assert_allclose(weights, want_w, **TOL)
    np.testing.assert_allclose(pred, want_pred, **TOL)


def test_vector_values_and_leave_one_out(data):
  _, keys, values = data
  vec = np.stack([values, -values], -1)  # [n_k, 2]
  loo = pooling.leave_one_out_mask(8)
  np.testing.assert_array_equal(loo, ~np.eye(8, dtype=bool))
  pred, weights = pooling.nadaraya_watson(keys, keys, vec, mask=loo)
  want_pred, want_w = np_nw(keys, keys, values, mask=~np.eye(8, dtype=bool))
  assert pred.shape == (8, 2)
  np.testing.assert_array_equal(np.diag(np.asarray(weights)), 0.0)
  np.testing.assert_allclose(weights, want_w, **TOL)
  np.testing.assert_allclose(pred, np.stack([want_pred, -want_pred], -1), **TOL)


def test_learned_kernel_gradient_flows(data):
  queries, keys, values = data
  params = pooling.init_kernel_params(1.5)
  assert params["w"].dtype == jnp.float32 and params["w"].shape == ()
  targets = np.cos(queries).astype(np.float32)

  def loss(p):
    pred, _ = pooling.learned_kernel_pooling(p, queries, keys, values)
    return jnp.mean((pred - targets) ** 2)

  grad = jax.jit(jax.grad(loss))(params)["w"]
  eps = 1e-3

  def np_loss(w):
    return np.mean((np_nw(queries.astype(np.float64), keys, values, w)[0] - targets) ** 2)

  fd = (np_loss(1.5 + eps) - np_loss(1.5 - eps)) / (2 * eps)
  np.testing.assert_allclose(grad, fd, rtol=1e-3, atol=1e-4)
  with jax.enable_x64(True):
    check_grads(lambda w: pooling.nadaraya_watson(jnp.asarray(queries, jnp.float64),
                                                  jnp.asarray(keys, jnp.float64),
                                                  jnp.asarray(values, jnp.float64), w=w)[0],
                (jnp.float64(1.5),), order=1, modes=["rev"], atol=1e-5, rtol=1e-5)


def test_jit_and_vmap_match_eager(data):
  queries, keys, values = data
  params = pooling.init_kernel_params(2.0)
  batch_k = np.stack([keys, keys + 0.5])  # [2, n_k]
  batch_v = np.stack([values, 2 * values])  # [2, n_k]
  fn = lambda k, v: pooling.learned_kernel_pooling(params, queries, k, v)
  eager = fn(batch_k, batch_v)  # leading batch dims broadcast
  jitted = jax.jit(fn)(batch_k, batch_v)
  vmapped = jax.jit(jax.vmap(fn))(batch_k, batch_v)
  for i in range(2):
    want_pred, want_w = np_nw(queries, batch_k[i], batch_v[i], 2.0)
    np.testing.assert_allclose(eager[0][i], want_pred, **TOL)
    np.testing.assert_allclose(eager[1][i], want_w, **TOL)
  for got in (jitted, vmapped):
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], eager[1], rtol=1e-5, atol=1e-6)


def test_errors(data):
  queries, keys, values = data
  with pytest.raises(ValueError, match=r"values must have shape \[..., n_k\] or \[..., n_k, d_v\]"
                                       r" with n_k=8"):
    pooling.nadaraya_watson(queries, keys, values[:5])
  with pytest.raises(ValueError, match=r"needs params \{'w': scalar\}"):
    pooling.learned_kernel_pooling({"bandwidth": 1.0}, queries, keys, values)
  with pytest.raises(ValueError, match=r"mask of shape \(5,\) does not broadcast"):
    pooling.average_pooling(queries, keys, values, mask=np.ones(5, bool))
