"""masked_softmax, attend (every implementation), hard, local and multi-head attention
against NumPy references; properties, jit/vmap, gradients, errors."""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.test_util import check_grads

from attnlab.attention import core
from attnlab.attention import masks
from attnlab.attention import scores

B, H, Q, K, D, DV, D_ATTN, MAX_LEN = 2, 3, 3, 5, 4, 6, 5, 8
TOL = dict(rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- NumPy references


def np_softmax(x, m=None):
  m = np.ones(x.shape, bool) if m is None else np.broadcast_to(m, x.shape)
  x = np.where(m, x, -np.inf)
  mx = np.max(x, -1, keepdims=True)
  e = np.where(m, np.exp(x - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
  s = e.sum(-1, keepdims=True)
  return np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)


def np_logits(name, q, k, p):
  if name == "dot":
    return q @ np.swapaxes(k, -1, -2)
  if name == "scaled_dot":
    return q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
  if name == "cosine":
    qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    return (1.0 if p is None else p["beta"]) * (qn @ np.swapaxes(kn, -1, -2))
  if name == "general":
    return q @ p["w"] @ np.swapaxes(k, -1, -2)
  if name == "additive":
    hidden = np.tanh((q @ p["w_q"])[..., :, None, :] + (k @ p["w_k"])[..., None, :, :])
    return hidden @ p["v"]
  return (q @ p["w"])[..., :k.shape[-2]]


def np_causal(q_len, k_len):
  off = max(k_len - q_len, 0)
  return np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + off


def np_attend(q, k, v, name="scaled_dot", p=None, mask=None):
  w = np_softmax(np_logits(name, q, k, p), mask)
  return w @ v, w


# Jitted entry points: one compile per call pattern is much cheaper than eager op-by-op
# dispatch on this CPU; they also exercise every function under jit.
STATIC = ("score", "causal", "implementation", "return_weights")
attend_jit = jax.jit(core.attend, static_argnames=STATIC)
hard_jit = jax.jit(core.hard_attend, static_argnames=("score", "causal", "straight_through"))


def rand(r, *shape):
  return r.normal(size=shape).astype(np.float32)


@pytest.fixture(scope="module")
def qkv():
  r = np.random.default_rng(0)
  return rand(r, B, Q, D), rand(r, B, K, D), rand(r, B, K, DV)


@pytest.fixture(scope="module")
def all_params():
  r = np.random.default_rng(9)
  return {"dot": None, "scaled_dot": None, "cosine": {"beta": np.float32(2.0)},
          "general": {"w": rand(r, D, D)},
          "additive": {"w_q": rand(r, D, D_ATTN), "w_k": rand(r, D, D_ATTN), "v": rand(r, D_ATTN)},
          "location": {"w": rand(r, D, MAX_LEN)}}


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


# ----------------------------------------------------------------------------- masked softmax


def test_masked_softmax_matches_numpy():
  r = np.random.default_rng(1)
  x = rand(r, 2, 3, 5)
  m = r.random((2, 3, 5)) > 0.4
  m[0, 1] = False  # one fully masked row

  @jax.jit
  def variants(x, m):
    return (core.masked_softmax(x, m), core.masked_softmax(x), core.masked_softmax(x, m[:, :1]),
            core.masked_softmax(jnp.swapaxes(x, -1, -2), jnp.swapaxes(m, -1, -2), axis=-2))

  full, plain, row_mask, transposed = variants(x, m)
  np.testing.assert_allclose(full, np_softmax(x, m), **TOL)
  np.testing.assert_allclose(plain, np_softmax(x), **TOL)
  np.testing.assert_allclose(row_mask, np_softmax(x, m[:, :1]), **TOL)
  np.testing.assert_allclose(transposed, np.swapaxes(np_softmax(x, m), -1, -2), **TOL)
  assert core.masked_softmax(x.astype(jnp.bfloat16), m).dtype == jnp.bfloat16


_softmax_and_grad = jax.jit(lambda x, m, c: (
    core.masked_softmax(x, m),
    jax.grad(lambda y: jnp.sum(core.masked_softmax(y, m) * c))(x)))


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, (4, 5), elements=st.floats(-30, 30, width=32)),
       hnp.arrays(np.bool_, (4, 5)),
       hnp.arrays(np.float32, (4, 5), elements=st.floats(-1, 1, width=32)))
def test_masked_softmax_properties(x, m, c):
  w, g = _softmax_and_grad(x, m, c)
  w, g = np.asarray(w), np.asarray(g)
  assert np.all((w >= 0) & (w <= 1))
  assert np.all(w[~m] == 0.0)
  has_key = m.any(-1)
  np.testing.assert_allclose(w.sum(-1)[has_key], 1.0, rtol=1e-5)
  assert np.all(w[~has_key] == 0.0)
  assert np.all(np.isfinite(g))
  assert np.all(g[~has_key] == 0.0)


def test_masked_softmax_rows_of_minus_inf_logits_and_no_keys_give_zeros():
  # A row whose allowed logits are all -inf has no key to weight, as a fully masked row: zeros
  # and zero gradients whether or not the row also holds masked entries.
  x = np.array([[-np.inf, -np.inf, -np.inf], [-np.inf, 0.0, 1.0]], np.float32)
  for m in (np.ones((2, 3), bool), np.array([[True, True, False], [True, True, True]])):
    w, g = _softmax_and_grad(x, m, np.ones((2, 3), np.float32))
    np.testing.assert_allclose(w, np_softmax(x, m), **TOL)
    assert np.all(np.asarray(w)[0] == 0.0) and np.all(np.isfinite(g))
  # no keys at all (k_len 0): attend with a padding mask gives the zero context that it gives
  # without one (and that the fused implementations give)
  q, k, v = np.ones((2, 3, 4), np.float32), np.ones((2, 0, 4), np.float32), np.ones((2, 0, 5))
  for mask in (None, masks.padding_mask(np.array([0, 0]), 0)):
    ctx, w = core.attend(q, k, v, mask=mask, implementation="reference")
    assert ctx.shape == (2, 3, 5) and w.shape == (2, 3, 0)
    np.testing.assert_array_equal(ctx, 0.0)
  with pytest.raises(ValueError, match=r"hard attention .* needs k_len >= 1"):
    core.hard_attend(jax.random.PRNGKey(0), q, k, v)


# ----------------------------------------------------------------------------- attend


def test_attend_all_scores_with_masks_key_value(qkv, all_params):
  q, k, v = qkv
  lengths = np.array([3, 5])
  pad_np = (np.arange(K)[None, :] < lengths[:, None])[:, None, :]  # [B, 1, K]

  @jax.jit
  def every_score(q, k, v, params, lengths):  # one compile for all scores
    pad = masks.padding_mask(lengths, K)  # [B, 1, 1, K]
    return {(name, causal): core.attend(q, k, v, score=name, params=p, mask=pad, causal=causal)
            for name, p in params.items() for causal in (False, True)}

  for (name, causal), (ctx, w) in every_score(q, k, v, all_params, lengths).items():
    m = pad_np & np_causal(Q, K) if causal else pad_np
    want_ctx, want_w = np_attend(q, k, v, name, all_params[name], m)
    assert ctx.shape == (B, Q, DV) and w.shape == (B, Q, K)
    np.testing.assert_allclose(w, want_w, err_msg=f"{name} causal={causal}", **TOL)
    np.testing.assert_allclose(ctx, want_ctx, err_msg=f"{name} causal={causal}", **TOL)


def test_attend_same_array_and_callable_score(qkv):
  q, k, _ = qkv
  ctx, w = core.attend(q, k, k)  # eager; self-contained key-value: k is also v
  want_ctx, want_w = np_attend(q, k, k)
  np.testing.assert_allclose(ctx, want_ctx, **TOL)
  ctx2, w2 = attend_jit(q, k, k, score=lambda a, b, temp: scores.dot(a, b) / temp,
                         params={"temp": 2.0})
  np.testing.assert_allclose(w2, np_softmax(np_logits("dot", q, k, None) / 2.0), **TOL)
  ctx3, w3 = attend_jit(q, k, k, return_weights=False, implementation="reference")
  assert w3 is None
  np.testing.assert_allclose(ctx3, want_ctx, **TOL)


def test_attend_jit_and_vmap(qkv, all_params):
  q, k, v = qkv
  p = all_params["additive"]
  lengths = np.array([2, 4])
  mask = masks.padding_mask(jnp.asarray(lengths), K)  # [B, 1, 1, K]
  fn = lambda q, k, v, p, m: core.attend(q, k, v, score="additive", params=p, mask=m,
                                          causal=True)
  jitted = jax.jit(fn)(q, k, v, p, mask)
  vmapped = jax.jit(jax.vmap(fn, in_axes=(0, 0, 0, None, 0)))(q, k, v, p, mask)
  m = (np.arange(K)[None, :] < lengths[:, None])[:, None, :] & np_causal(Q, K)
  want_ctx, want_w = np_attend(q, k, v, "additive", p, m)
  for got in (jitted, vmapped):
    np.testing.assert_allclose(got[0], want_ctx, **TOL)
    np.testing.assert_allclose(got[1], want_w, **TOL)
  np.testing.assert_allclose(vmapped[0], jitted[0], rtol=1e-6, atol=1e-6)


XLA_CASES = {
    "plain": dict(q=(B, Q, D), k=(B, K, D), v=(B, K, D), causal=False, lengths=None),
    "causal": dict(q=(B, K, D), k=(B, K, D), v=(B, K, DV), causal=True, lengths=None),
    "padding": dict(q=(B, Q, D), k=(B, K, D), v=(B, K, DV), causal=False, lengths=(2, 5)),
    "causal_padding_decode": dict(q=(B, Q, D), k=(B, K, D), v=(B, K, DV), causal=True,
                                  lengths=(4, 5)),
    "heads_empty_row": dict(q=(B, H, Q, D), k=(B, H, K, D), v=(B, H, K, 2), causal=False,
                            lengths=(0, 3)),
}


@pytest.mark.parametrize("case", sorted(XLA_CASES))
def test_xla_matches_reference(case):
  c = XLA_CASES[case]
  r = np.random.default_rng(2)
  q, k, v = rand(r, *c["q"]), rand(r, *c["k"]), rand(r, *c["v"])
  mask = None
  if c["lengths"] is not None:
    mask = masks.padding_mask(jnp.asarray(c["lengths"]), K)  # [B, 1, 1, K]
    if len(c["q"]) == 3:
      mask = mask[:, 0]  # [B, 1, K] for single-head logits
  both = jax.jit(lambda q, k, v, m: [core.attend(q, k, v, mask=m, causal=c["causal"],
                                                  implementation=impl)
                                      for impl in ("reference", "xla")])
  (ref, _), (xla, w) = both(q, k, v, mask)
  assert w is None
  np.testing.assert_allclose(xla, ref, rtol=1e-5, atol=1e-5)
  np_mask = None if mask is None else np.asarray(mask)
  if c["causal"]:
    np_mask = np_causal(c["q"][-2], K) if np_mask is None else np_mask & np_causal(c["q"][-2], K)
  np.testing.assert_allclose(xla, np_attend(q, k, v, mask=np_mask)[0], rtol=1e-5, atol=1e-5)


def test_xla_dot_score(qkv):
  q, k, v = qkv
  xla, _ = attend_jit(q, k, v, score="dot", implementation="xla")
  np.testing.assert_allclose(xla, np_attend(q, k, v, "dot")[0], rtol=1e-5, atol=1e-5)


def test_choose_implementation():
  choose = functools.partial(core.choose_implementation, backend="cpu")  # the CPU rows
  assert choose("scaled_dot", True) == "reference"
  assert choose("additive", False) == "reference"
  assert choose(scores.dot, False, blocked_available=True) == "reference"
  assert choose("dot", False, blocked_available=True) == "blocked"
  assert choose("scaled_dot", False, blocked_available=False) == "reference"
  assert choose("scaled_dot", True, "xla") == "xla"
  assert choose("dot", False, "blocked") == "blocked"
  with pytest.raises(ValueError) as err:
    choose("dot", True, "flash")
  assert str(err.value) == ("unknown implementation 'flash'; valid implementations: auto, "
                            "reference, xla, blocked, cudnn")
  with pytest.raises(ValueError, match="'xla' supports only the scores dot, scaled_dot; "
                                       "got 'additive'"):
    choose("additive", False, "xla")
  with pytest.raises(ValueError, match="'blocked' supports only .* got 'a callable'"):
    choose(scores.dot, False, "blocked")


def test_auto_choice_table_per_backend_and_shape():
  def choose(backend, q_len=1024, k_len=1024, dtype=jnp.float32, head_dim=64, has_mask=False):
    return core.choose_implementation("scaled_dot", False, backend=backend, q_len=q_len,
                                      k_len=k_len, dtype=dtype, head_dim=head_dim,
                                      has_mask=has_mask, blocked_available=True)
  assert choose("cpu") == "blocked"
  assert choose("cpu", 256, 256) == "blocked"
  assert choose("cpu", 64, 64) == "reference"  # nano GPT: one tile, the reference is as fast
  assert choose("cpu", 1, 4096) == "reference"  # one decoding step
  assert choose("gpu", dtype=jnp.bfloat16) == "cudnn"
  assert choose("gpu", dtype=jnp.float16, head_dim=128) == "cudnn"
  assert choose("gpu") == "xla"  # float32
  # half precision off cudnn's ground: the reference path (measured faster than xla on a GPU)
  assert choose("gpu", dtype=jnp.bfloat16, head_dim=36) == "reference"
  assert choose("gpu", dtype=jnp.bfloat16, head_dim=256) == "reference"
  assert choose("gpu", dtype=jnp.bfloat16, has_mask=True) == "reference"
  assert choose("gpu", dtype=jnp.float32, has_mask=True) == "xla"
  assert choose("rocm", dtype=jnp.bfloat16) == "reference"
  assert choose("tpu") == "xla"
  assert core.choose_implementation("scaled_dot", True, backend="gpu") == "reference"


def test_blocked_is_called_lazily_with_scale_mask_and_causal(monkeypatch, qkv):
  q, k, v = qkv
  calls = []

  def fake_blocked(q, k, v, *, scale=None, mask=None, causal=False):
    calls.append(dict(scale=scale, mask=mask, causal=causal))
    logits = np.asarray(q) @ np.swapaxes(np.asarray(k), -1, -2) * scale
    m = None if mask is None else np.asarray(mask)
    if causal:
      m = np_causal(q.shape[-2], k.shape[-2]) if m is None else m & np_causal(q.shape[-2],
                                                                              k.shape[-2])
    return jnp.asarray(np_softmax(logits, m) @ np.asarray(v), jnp.float32)

  fake = types.ModuleType("attnlab.attention.blocked")
  fake.blocked_attention = fake_blocked
  monkeypatch.setitem(sys.modules, "attnlab.attention.blocked", fake)
  mask = masks.padding_mask(jnp.array([3, 4]), K)[:, 0]  # [B, 1, K]
  ctx, w = core.attend(q, k, v, mask=mask, causal=True, implementation="blocked",
                       return_weights=False)
  assert w is None
  np.testing.assert_allclose(calls[0]["scale"], 1 / np.sqrt(D))
  # blocked shares the end-aligned causal rule: the flag goes through even when q_len != k_len
  assert calls[0]["causal"] is True
  np.testing.assert_array_equal(calls[0]["mask"], np.asarray(mask))
  np.testing.assert_allclose(ctx, np_attend(q, k, v, mask=np.asarray(mask) & np_causal(Q, K))[0],
                             **TOL)
  core.attend(k, k, v, score="dot", causal=True, implementation="blocked")
  assert calls[1]["causal"] is True and calls[1]["mask"] is None and calls[1]["scale"] == 1.0


def test_attend_errors(qkv, all_params):
  q, k, v = qkv
  with pytest.raises(ValueError, match="unknown score 'nope'; valid scores: additive, cosine"):
    core.attend(q, k, v, score="nope")
  with pytest.raises(ValueError, match=r"score 'general' needs params \['w'\]"):
    core.attend(q, k, v, score="general")
  with pytest.raises(ValueError, match=r"mask of shape \(4, 5\) does not broadcast to the "
                                       r"logits' shape \(2, 3, 5\)"):
    core.attend(q, k, v, mask=jnp.ones((4, K), bool))
  with pytest.raises(ValueError, match=r"keys and values must have the same length k_len"):
    core.attend(q, k, v[:, :2])
  with pytest.raises(ValueError, match=r"same feature size d"):
    core.attend(q, v, v)
  with pytest.raises(ValueError, match="unknown implementation 'fast'"):
    core.attend(q, k, v, implementation="fast")
  with pytest.raises(ValueError, match="'xla' supports only the scores dot, scaled_dot"):
    core.attend(q, k, v, score="general", params=all_params["general"], implementation="xla")


# ----------------------------------------------------------------------------- hard attention


def test_hard_attention_samples_follow_the_weights():
  n = 4000
  r = np.random.default_rng(3)
  q1, k, v = rand(r, 1, D), rand(r, K, D), rand(r, K, DV)
  q = np.broadcast_to(q1, (n, 1, D))  # n identical queries, sampled independently
  mask = np.array([True, True, False, True, True])  # key 2 may never be drawn
  out = hard_jit(jax.random.PRNGKey(0), q, k, v, mask=mask)
  w = np_softmax(np_logits("scaled_dot", q1, k, None), mask)[0]  # [K]
  np.testing.assert_allclose(out.weights[0, 0], w, **TOL)
  index = np.asarray(out.index)[:, 0]
  freq = np.bincount(index, minlength=K) / n
  assert freq[2] == 0.0
  np.testing.assert_allclose(freq, w, atol=4 * np.sqrt(0.25 / n))
  np.testing.assert_allclose(out.log_prob[:, 0], np.log(w[index]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out.context[:, 0], v[index], **TOL)


def test_hard_attention_straight_through_gradient_equals_soft(qkv):
  q, k, v = qkv
  rng = jax.random.PRNGKey(1)
  g = np.random.default_rng(4).normal(size=(B, Q, DV)).astype(np.float32)

  @jax.jit
  def run(q, k):  # one compile for every quantity compared below
    def hard(q, k, straight_through):
      out = core.hard_attend(rng, q, k, v, straight_through=straight_through)
      return jnp.sum(out.context * g), out

    (_, out), g_hard = jax.value_and_grad(lambda q, k: hard(q, k, True), (0, 1),
                                          has_aux=True)(q, k)
    g_soft = jax.grad(lambda q, k: jnp.sum(core.attend(q, k, v)[0] * g), (0, 1))(q, k)
    g_no_st = jax.grad(lambda q: hard(q, k, False)[0])(q)
    return out, g_hard, g_soft, g_no_st

  out, g_hard, g_soft, g_no_st = run(q, k)
  np.testing.assert_allclose(out.context, np.take_along_axis(
      v, np.asarray(out.index)[..., None], axis=1), **TOL)
  for got, want in zip(g_hard, g_soft):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # without straight-through the context carries no gradient to the scores
  np.testing.assert_array_equal(g_no_st, 0.0)


def test_hard_attention_fully_masked_rows_and_reinforce(qkv):
  q, k, v = qkv
  q_valid = np.array([[True, False, True], [True, True, True]])
  mask = masks.padding_mask(jnp.array([2, 5]), K, q_valid=q_valid)[:, 0]  # [B, Q, K]
  reward, baseline = np.array([1.0, -2.0], np.float32), 0.5

  @jax.jit
  def run(q):
    def loss(q):
      out = core.hard_attend(jax.random.PRNGKey(2), q, k, v, mask=mask)
      return core.reinforce_loss(out.log_prob, reward), out

    (_, out), gq = jax.value_and_grad(loss, has_aux=True)(q)
    return out, gq

  out, gq = run(q)
  assert np.all(np.asarray(out.index)[0] < 2)
  np.testing.assert_array_equal(out.context[0, 1], 0.0)
  assert out.log_prob[0, 1] == 0.0
  # the REINFORCE gradient reaches the queries through log_prob
  assert np.all(np.isfinite(gq)) and np.any(gq != 0)

  @jax.jit
  def losses(lp, reward):
    value, grads = jax.value_and_grad(core.reinforce_loss, (0, 1))(lp, reward, baseline)
    return value, grads, core.reinforce_loss(lp, reward, valid=q_valid)

  lp = np.asarray(out.log_prob)
  loss, (g_lp, g_r), valid_loss = losses(lp, reward)
  adv = (reward - baseline)[:, None]
  np.testing.assert_allclose(loss, -np.mean(adv * lp), **TOL)
  np.testing.assert_allclose(g_lp, -np.broadcast_to(adv, (B, Q)) / (B * Q), **TOL)
  np.testing.assert_array_equal(g_r, 0.0)
  np.testing.assert_allclose(valid_loss, -np.sum((reward[:, None] * lp)[q_valid]) / 5, **TOL)


# ----------------------------------------------------------------------------- local attention


def np_local_weights(w, center, d):
  s = np.arange(w.shape[-1])[None, :]
  dist = s - np.asarray(center)[..., None]
  gauss = np.exp(-dist ** 2 / (2 * (d / 2) ** 2))
  return np.where(np.abs(dist) <= d, w * gauss, 0.0)


def test_predict_position():
  r = np.random.default_rng(5)
  h, w_p, v_p = rand(r, B, Q, D), rand(r, D, 7), rand(r, 7)
  want = 10.0 / (1.0 + np.exp(-(np.tanh(h @ w_p) @ v_p)))
  np.testing.assert_allclose(core.predict_position(h, w_p, v_p, 10), want, **TOL)
  lengths = np.array([4.0, 9.0], np.float32)
  got = core.predict_position(h, w_p, v_p, lengths)
  np.testing.assert_allclose(got, want / 10.0 * lengths[:, None], **TOL)
  assert np.all((np.asarray(got) >= 0) & (np.asarray(got) < lengths[:, None]))


def test_local_window_and_local_attend(qkv):
  q, k, v = qkv
  center = np.array([[0.0, 2.3, 4.0], [1.5, 3.0, 0.7]], np.float32)
  r = np.random.default_rng(6)
  w = np_softmax(rand(r, B, Q, K))
  pad = np.arange(K)[None, None, :] < np.array([4, 5])[:, None, None]  # [B, 1, K]
  dist = np.arange(K)[None, None, :] - center[..., None]
  logits = np_logits("scaled_dot", q, k, None)

  @jax.jit
  def local_variants(q, k, v, center, pad, w):
    return ([core.local_attend(q, k, v, center=center, half_width=2, mask=pad,
                               window_softmax=window_softmax) for window_softmax in (True, False)]
            + [core.local_attend(q, k, v, center=core.monotonic_centers(Q, K), half_width=1),
               core.local_attend(q, k, v, center=core.monotonic_centers(Q, K), half_width=1,
                                 gaussian=False),
               core.local_attend(q, k, v, center=core.monotonic_centers(Q, K), half_width=1,
                                 gaussian=False, window_softmax=False),
               core.local_window_weights(w, center, 2)])

  *windowed, (_, wm), (ctx_m, plain_m), (_, cut_m), scaled = local_variants(q, k, v, center, pad,
                                                                             w)
  np.testing.assert_allclose(scaled, np_local_weights(w, center, 2), **TOL)
  for window_softmax, (ctx, got_w) in zip((True, False), windowed):
    m = pad & (np.abs(dist) <= 2) if window_softmax else pad
    want_w = np_local_weights(np_softmax(logits, m), center, 2)
    np.testing.assert_allclose(got_w, want_w, **TOL)
    np.testing.assert_allclose(ctx, want_w @ v, **TOL)
  # local-m: centres at the query positions
  np.testing.assert_array_equal(core.monotonic_centers(3), [0.0, 1.0, 2.0])
  np.testing.assert_array_equal(core.monotonic_centers(4, 2), [0.0, 1.0, 1.0, 1.0])
  m = np.abs(np.arange(K)[None, :] - np.arange(Q)[:, None]) <= 1
  np.testing.assert_allclose(wm, np_local_weights(np_softmax(logits, m), np.arange(Q), 1),
                             **TOL)
  # Luong's local-m proper: the softmax over the window [t - D, t + D], no Gaussian
  np.testing.assert_allclose(plain_m, np_softmax(logits, m), **TOL)
  np.testing.assert_allclose(ctx_m, np_softmax(logits, m) @ v, **TOL)
  # no Gaussian, softmax over every key: the weights outside the window are cut (not renormalised)
  np.testing.assert_allclose(cut_m, np.where(m, np_softmax(logits, np.ones_like(m)), 0.0), **TOL)
  with pytest.raises(ValueError, match="half_width D must be > 0"):
    core.local_window_weights(w, center, 0)
  with pytest.raises(ValueError, match=r"center of shape \(4,\) does not broadcast to the "
                                       r"queries' shape \(2, 3\)"):
    core.local_window_weights(w, np.zeros(4), 2)


# ----------------------------------------------------------------------------- multi-head


def test_split_merge_heads():
  x = np.arange(2 * 3 * 6, dtype=np.float32).reshape(2, 3, 6)  # [batch, len, heads*d]
  s = core.split_heads(x, 2)
  np.testing.assert_array_equal(s, x.reshape(2, 3, 2, 3).transpose(0, 2, 1, 3))
  np.testing.assert_array_equal(core.merge_heads(s), x)
  with pytest.raises(ValueError, match="divisible by num_heads=4"):
    core.split_heads(x, 4)


def np_multi_head(q, k, v, h, name="scaled_dot", p_per_head=None, mask=None):
  """Loops over heads with plain NumPy; mask [batch, heads|1, q|1, k]."""
  d, dv = q.shape[-1] // h, v.shape[-1] // h
  ctxs, ws = [], []
  for i in range(h):
    m = None if mask is None else mask[:, min(i, mask.shape[1] - 1)]
    c, w = np_attend(q[..., i * d:(i + 1) * d], k[..., i * d:(i + 1) * d],
                     v[..., i * dv:(i + 1) * dv], name, p_per_head and p_per_head[i], m)
    ctxs.append(c)
    ws.append(w)
  return np.concatenate(ctxs, -1), np.stack(ws, 1)


def _multi_head_attend(q, k, v, num_heads, *, mask=None, **kw):
  """Multi-head attention on projected q/k/v `[..., len, heads*d]` from split_heads, attend and
  merge_heads; mask `[batch, 1|heads, q|1, k]` or `[batch, q|1, k]` (the same for every head)."""
  if mask is not None and mask.ndim == q.ndim:
    mask = mask[..., None, :, :]  # [batch, 1, q_len|1, k_len]
  context, weights = core.attend(core.split_heads(q, num_heads), core.split_heads(k, num_heads),
                                 core.split_heads(v, num_heads), mask=mask, **kw)
  return core.merge_heads(context), weights  # [..., q_len, heads*d_v]


def test_multi_head_attend():
  r = np.random.default_rng(7)
  q, k, v = rand(r, B, Q, H * D), rand(r, B, K, H * D), rand(r, B, K, H * 2)
  pad = np.asarray(masks.padding_mask(jnp.array([2, 5]), K))  # [B, 1, 1, K]
  full = r.random((B, H, Q, K)) > 0.3  # [B, H, Q, K]
  per_example = r.random((B, Q, K)) > 0.3  # [B, Q, K], same for every head
  w_heads = rand(r, H, D, D)

  @jax.jit
  def variants(q, k, v, pad, full, per_example, w_heads):  # one compile for every variant
    masked = [_multi_head_attend(q, k, v, H, mask=m, causal=True)
              for m in (pad, full, per_example)]
    xla = _multi_head_attend(q, k, v, H, mask=pad, implementation="xla")[0]
    # general score: per-head weights [heads, d, d] and shared weights [d, d]
    general = [_multi_head_attend(q, k, v, H, score="general", params={"w": w})[0]
               for w in (w_heads, w_heads[0])]
    return masked, xla, general

  masked, xla, (general_heads, general_shared) = variants(q, k, v, pad, full, per_example,
                                                          w_heads)
  for (ctx, w), np_mask in zip(masked, (pad, full, per_example[:, None])):
    want_ctx, want_w = np_multi_head(q, k, v, H, mask=np_mask & np_causal(Q, K))
    assert ctx.shape == (B, Q, H * 2) and w.shape == (B, H, Q, K)
    np.testing.assert_allclose(w, want_w, **TOL)
    np.testing.assert_allclose(ctx, want_ctx, **TOL)
  np.testing.assert_allclose(xla, np_multi_head(q, k, v, H, mask=pad)[0], **TOL)
  want = np_multi_head(q, k, v, H, "general", [{"w": w_heads[i]} for i in range(H)])[0]
  np.testing.assert_allclose(general_heads, want, rtol=1e-4, atol=1e-4)
  want = np_multi_head(q, k, v, H, "general", [{"w": w_heads[0]}] * H)[0]
  np.testing.assert_allclose(general_shared, want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- gradients


def test_gradients(x64):
  r = np.random.default_rng(8)
  q, k, v = (jnp.asarray(r.normal(size=s)) for s in ((Q, D), (K, D), (K, DV)))
  p = {"w_q": r.normal(size=(D, D_ATTN)), "w_k": r.normal(size=(D, D_ATTN)),
       "v": r.normal(size=(D_ATTN,))}
  mask = jnp.asarray(np.array([[1, 1, 0, 1, 0]] * (Q - 1) + [[0] * K], bool))  # last row empty
  center = jnp.array([0.4, 2.2, 3.6])

  def all_differentiable(q, k, v, p, c):
    return (core.masked_softmax(q @ k.T, mask),
            core.attend(q, k, v, score="additive", params=p, mask=mask, causal=True),
            core.local_attend(q, k, v, center=c, half_width=2.0))

  # one jitted function: one compile of the forward and one of the backward pass
  check_grads(jax.jit(all_differentiable), (q, k, v, p, center), order=1, modes=["rev"],
              atol=1e-5, rtol=1e-5)


def test_auto_uses_the_real_blocked_module_when_present(qkv):
  pytest.importorskip("attnlab.attention.blocked")
  if jax.default_backend() != "cpu":
    pytest.skip("auto picks blocked on a CPU only")
  q, k, v = qkv
  assert core.choose_implementation("scaled_dot", False) == "blocked"
  mask = masks.padding_mask(jnp.array([4, 0]), K)  # [B, 1, 1, K]; example 1 has no keys
  ctx, w = attend_jit(q, k, v, mask=mask, causal=True, return_weights=False)
  assert w is None
  want = np_attend(q, k, v, mask=np.asarray(mask)[:, 0] & np_causal(Q, K))[0]
  np.testing.assert_allclose(ctx, want, **TOL)


def test_hard_attention_row_of_minus_inf_logits_picks_nothing():
  # Row 0's allowed keys (the first two) all score -inf; its other keys are masked out: no key
  # to pick, so a zero context and log_prob 0, as for a fully masked row (never a masked key).
  def score(q, k):
    logits = jnp.matmul(q, jnp.swapaxes(k, -1, -2))  # [q_len, k_len]
    return logits.at[0].set(-jnp.inf)

  r = np.random.default_rng(9)
  q, k, v = r.normal(size=(2, 3)), r.normal(size=(4, 3)), 1.0 + r.uniform(size=(4, 2))
  mask = np.array([[True, True, False, False]] * 2)
  for seed in range(4):
    out = core.hard_attend(jax.random.PRNGKey(seed), q, k, v, score=score, mask=mask)
    np.testing.assert_array_equal(out.context[0], 0.0)
    assert out.log_prob[0] == 0.0 and np.all(np.asarray(out.weights)[0] == 0.0)
    assert out.index[1] < 2 and np.all(np.asarray(out.context)[1] > 0)
