"""Score functions against NumPy references; registry, params, errors, jit/vmap, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from attnlab.attention import scores

D_Q, D_K, D_ATTN, MAX_LEN, Q_LEN, K_LEN = 4, 3, 5, 7, 3, 4


# ----------------------------------------------------------------------------- NumPy references


def np_dot(q, k):
  return np.einsum("...qd,...kd->...qk", q, k)


def np_scaled_dot(q, k):
  return np_dot(q, k) / np.sqrt(q.shape[-1])


def np_cosine(q, k, beta=1.0):
  out = np.zeros(np.broadcast_shapes(q.shape[:-2], k.shape[:-2]) + (q.shape[-2], k.shape[-2]))
  for idx in np.ndindex(out.shape):
    a = np.broadcast_to(q, out.shape[:-2] + q.shape[-2:])[idx[:-2]][idx[-2]]
    b = np.broadcast_to(k, out.shape[:-2] + k.shape[-2:])[idx[:-2]][idx[-1]]
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    out[idx] = 0.0 if na == 0 or nb == 0 else a @ b / (na * nb)
  return beta * out


def np_general(q, k, w):
  return np.einsum("...qd,de,...ke->...qk", q, w, k)


def np_additive(q, k, w_q, w_k, v):
  out = np.zeros(q.shape[:-2] + (q.shape[-2], k.shape[-2]))
  for idx in np.ndindex(out.shape):
    qi = q[idx[:-2]][idx[-2]]
    kj = k[idx[:-2]][idx[-1]]
    out[idx] = v @ np.tanh(qi @ w_q + kj @ w_k)
  return out


def np_location(q, w, k_len):
  return (q @ w)[..., :k_len]


@pytest.fixture(scope="module")
def data():
  r = np.random.default_rng(0)
  q = r.normal(size=(2, Q_LEN, D_Q)).astype(np.float32)
  k = r.normal(size=(2, K_LEN, D_K)).astype(np.float32)
  k_same = r.normal(size=(2, K_LEN, D_Q)).astype(np.float32)
  params = {
      "general": {"w": r.normal(size=(D_Q, D_K)).astype(np.float32)},
      "additive": {"w_q": r.normal(size=(D_Q, D_ATTN)).astype(np.float32),
                   "w_k": r.normal(size=(D_K, D_ATTN)).astype(np.float32),
                   "v": r.normal(size=(D_ATTN,)).astype(np.float32)},
      "location": {"w": r.normal(size=(D_Q, MAX_LEN)).astype(np.float32)},
  }
  return q, k, k_same, params


def np_reference(name, q, k, k_same, params):
  if name == "dot":
    return np_dot(q, k_same)
  if name == "scaled_dot":
    return np_scaled_dot(q, k_same)
  if name == "cosine":
    return np_cosine(q, k_same)
  if name == "general":
    return np_general(q, k, **params["general"])
  if name == "additive":
    return np_additive(q, k, **params["additive"])
  return np_location(q, params["location"]["w"], K_LEN)


def call_all(q, k, k_same, params):
  """Every registry score in the registry convention fn(q, k, **params)."""
  out = {}
  for name, fn in scores.SCORE_FNS.items():
    keys = k_same if name in ("dot", "scaled_dot", "cosine") else k
    out[name] = fn(q, keys, **params.get(name, {}))
  return out


def test_registry_scores_match_numpy(data):
  q, k, k_same, params = data
  got = call_all(q, k, k_same, params)
  for name, logits in got.items():
    assert logits.shape == (2, Q_LEN, K_LEN), name
    np.testing.assert_allclose(logits, np_reference(name, q, k, k_same, params),
                               rtol=1e-5, atol=1e-5, err_msg=name)


def test_direct_signatures(data):
  q, k, k_same, params = data
  np.testing.assert_allclose(scores.location(q, params["location"]["w"], 2),
                             np_location(q, params["location"]["w"], 2), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(scores.cosine(q, k_same, beta=3.0), np_cosine(q, k_same, 3.0),
                             rtol=1e-5, atol=1e-5)


def test_jit_and_vmap_match_eager(data):
  q, k, k_same, params = data
  eager = call_all(q, k, k_same, params)
  jitted = jax.jit(call_all)(q, k, k_same, params)
  vmapped = jax.jit(jax.vmap(call_all, in_axes=(0, 0, 0, None)))(q, k, k_same, params)
  for name in eager:
    np.testing.assert_allclose(jitted[name], eager[name], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(vmapped[name], eager[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_leading_dims_broadcast_and_per_head_params():
  r = np.random.default_rng(1)
  q = r.normal(size=(2, 1, Q_LEN, D_Q)).astype(np.float32)  # [batch, 1, q_len, d]
  k = r.normal(size=(1, 3, K_LEN, D_Q)).astype(np.float32)  # [1, heads, k_len, d]
  np.testing.assert_allclose(scores.dot(q, k), np_dot(q, k), rtol=1e-5, atol=1e-5)
  # per-head general weights [heads, d, d] against q [batch, heads, q_len, d]
  qh = r.normal(size=(2, 3, Q_LEN, D_Q)).astype(np.float32)
  w = r.normal(size=(3, D_Q, D_Q)).astype(np.float32)
  want = np.einsum("bhqd,hde,bhke->bhqk", qh, w, np.broadcast_to(k, (2, 3, K_LEN, D_Q)))
  np.testing.assert_allclose(scores.general(qh, k, w), want, rtol=1e-4, atol=1e-4)
  # per-head additive params, checked head by head against the shared-parameter reference
  wq = r.normal(size=(3, D_Q, D_ATTN)).astype(np.float32)
  wk = r.normal(size=(3, D_Q, D_ATTN)).astype(np.float32)
  v = r.normal(size=(3, D_ATTN)).astype(np.float32)
  got = scores.additive(qh, k, wq, wk, v)
  kb = np.broadcast_to(k, (2, 3, K_LEN, D_Q))
  for h in range(3):
    np.testing.assert_allclose(got[:, h], np_additive(qh[:, h], kb[:, h], wq[h], wk[h], v[h]),
                               rtol=1e-4, atol=1e-4)


def test_keys_projected_once_score_the_same(data):
  # A decoder scores the same keys at every step: precompute_keys does the key-only part once
  # (additive: W_k k) and the score with its params gives the NumPy additive score.
  q, k, _, all_params = data
  p = all_params["additive"]
  keys, params = scores.precompute_keys("additive", p, k)
  assert keys.shape == (2, K_LEN, D_ATTN) and params["w_k"] is None
  np.testing.assert_allclose(scores.additive(q, keys, **params), np_additive(q, k, **p),
                             rtol=1e-4, atol=1e-5)
  for name in ("dot", "general"):  # nothing to precompute: keys and params as given
    given = all_params.get(name, {})
    keys, params = scores.precompute_keys(name, given, k)
    assert keys is k and params is given
  with pytest.raises(ValueError, match="projected already"):
    scores.additive(q, k, p["w_q"], None, p["v"])  # d_k != d_attn: keys not projected


def test_cosine_zero_vectors_finite_values_and_gradients():
  q = jnp.array([[0.0, 0.0, 0.0], [1.0, 2.0, 2.0]])  # [q_len, d]: first query is zero
  k = jnp.array([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])  # [k_len, d]: first key is zero
  logits = scores.cosine(q, k, beta=2.0)
  np.testing.assert_allclose(logits, np_cosine(np.asarray(q), np.asarray(k), 2.0), atol=1e-6)
  loss = lambda a, b: jnp.sum(scores.cosine(a, b) ** 2 + scores.cosine(a, b))
  gq, gk = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, k)
  assert np.all(np.isfinite(gq)) and np.all(np.isfinite(gk))


def test_scaled_dot_of_integer_inputs_is_scaled_in_float():
  # The scale 1/sqrt(d) must not be cast to the integer dtype (it would be 0).
  q = np.array([[1, 0], [0, 3]], np.int32)
  k = np.array([[2, 0], [0, 1], [1, 1]], np.int32)
  logits = scores.scaled_dot(q, k)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, np_scaled_dot(q.astype(np.float64), k), rtol=1e-6)


def test_float16_scaled_dot_does_not_overflow_before_the_scale():
  # q·k = 64 * 40 * 41 overflows float16 (max 65504); q·k / sqrt(64) does not.
  r = np.random.default_rng(3)
  q = (40.0 + r.uniform(size=(2, 3, 64))).astype(np.float16)
  k = (40.0 + r.uniform(size=(2, 4, 64))).astype(np.float16)
  logits = scores.scaled_dot(q, k)
  assert logits.dtype == jnp.float16
  np.testing.assert_allclose(np.asarray(logits, np.float64),
                             np_scaled_dot(q.astype(np.float64), k.astype(np.float64)), rtol=1e-3)


def test_half_precision_cosine_matches_float64():
  # A float16 squared norm under- or overflows for |x| < 8e-3 or |x| > 256, where the cosine
  # is still defined.
  z = np.random.default_rng(4).normal(size=(2, 3, 8))
  for scale in (1e-3, 1.0, 1e3):
    for dtype in (np.float16, jnp.bfloat16):
      a = np.asarray(z * scale, dtype)
      b = np.asarray(z[:, ::-1] * scale, dtype)
      got = scores.cosine(a, b, beta=2.0)
      assert got.dtype == dtype
      np.testing.assert_allclose(np.asarray(got, np.float64),
                                 np_cosine(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                           2.0), atol=2e-2, err_msg=f"{dtype} x{scale}")


def test_init_score_params_shapes_and_parametric_set():
  rng = jax.random.PRNGKey(0)
  init = jax.jit(scores.init_score_params, static_argnums=(0, 2, 3),
                 static_argnames=("d_attn", "max_len", "dtype", "num_heads"))
  assert scores.PARAMETRIC_SCORES == {"general", "additive", "location"}
  for name in ("dot", "scaled_dot", "cosine"):
    assert scores.init_score_params(name, rng, D_Q, D_Q) == {}
  cos = init("cosine", rng, D_Q, D_Q, beta=5.0)
  assert float(cos["beta"]) == 5.0
  gen = init("general", rng, D_Q, D_K)
  assert gen["w"].shape == (D_Q, D_K) and gen["w"].dtype == jnp.float32
  add = init("additive", rng, D_Q, D_K, d_attn=D_ATTN)
  assert {n: p.shape for n, p in add.items()} == {
      "w_q": (D_Q, D_ATTN), "w_k": (D_K, D_ATTN), "v": (D_ATTN,)}
  loc = init("location", rng, D_Q, D_K, max_len=MAX_LEN, dtype=jnp.bfloat16, num_heads=2)
  assert loc["w"].shape == (2, D_Q, MAX_LEN) and loc["w"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="needs max_len"):
    scores.init_score_params("location", rng, D_Q, D_K)


def test_unknown_score_lists_valid_names():
  with pytest.raises(ValueError) as err:
    scores.get_score_fn("bilinear")
  assert str(err.value) == ("unknown score 'bilinear'; valid scores: additive, cosine, dot, "
                            "general, location, scaled_dot")
  with pytest.raises(ValueError, match="unknown score 'x'"):
    scores.init_score_params("x", jax.random.PRNGKey(0), 2, 2)


def test_mismatched_shapes_raise(data):
  q, k, k_same, params = data
  for fn in (scores.dot, scores.scaled_dot, scores.cosine):
    with pytest.raises(ValueError, match=r"same feature size d .*d_q=4.*d_k=3"):
      fn(q, k)
  with pytest.raises(ValueError, match=r"w must have shape \[d_q, d_k\].*got \(3, 4\)"):
    scores.general(q, k, params["general"]["w"].T)
  add = dict(params["additive"], v=np.ones(D_ATTN + 1, np.float32))
  with pytest.raises(ValueError, match=r"v must have shape \[d_attn\].*got \(6,\)"):
    scores.additive(q, k, **add)
  with pytest.raises(ValueError, match=r"leading \(batch/head\) dims do not broadcast"):
    scores.dot(q, np.ones((3, K_LEN, D_Q), np.float32))
  with pytest.raises(ValueError, match=r"k_len=9 exceeds max_len=7"):
    scores.location(q, params["location"]["w"], 9)
  with pytest.raises(ValueError, match=r"queries must have shape \[..., q_len, d_q\]"):
    scores.dot(np.ones(4, np.float32), k_same)


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def test_gradients(x64):
  r = np.random.default_rng(2)
  q = jnp.asarray(r.normal(size=(Q_LEN, D_Q)))
  k = jnp.asarray(r.normal(size=(K_LEN, D_Q)))
  w = jnp.asarray(r.normal(size=(D_Q, D_Q)))
  wq, wk = jnp.asarray(r.normal(size=(D_Q, D_ATTN))), jnp.asarray(r.normal(size=(D_Q, D_ATTN)))
  v = jnp.asarray(r.normal(size=(D_ATTN,)))

  def all_scores(q, k, w, wq, wk, v, beta):
    return (scores.scaled_dot(q, k), scores.cosine(q, k, beta=beta), scores.general(q, k, w),
            scores.additive(q, k, wq, wk, v))

  check_grads(jax.jit(all_scores), (q, k, w, wq, wk, v, 2.0), order=1, modes=["rev"],
              atol=1e-5, rtol=1e-5)
