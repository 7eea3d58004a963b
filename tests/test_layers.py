"""Tests for attnlab.layers against small NumPy references written here."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import layers
from attnlab.attention import registry
from attnlab.attention.config import AttentionConfig
from attnlab.layers import Dense
from attnlab.layers import Embeddings
from attnlab.layers import MultiHeadAttention
from attnlab.layers import TransformerBlock

RNG = np.random.default_rng(0)
B, T, D, H = 2, 5, 8, 2


def _x(*shape):
  return jnp.asarray(RNG.normal(size=shape), jnp.float32)


# ----------------------------------------------------------------------------- NumPy references


def np_softmax(z, mask=None):
  z = np.asarray(z, np.float64)
  if mask is not None:
    z = np.where(mask, z, -np.inf)
  z = z - z.max(axis=-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=-1, keepdims=True)


def np_layer_norm(x, scale, bias=None, eps=1e-5):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  y = (x - mu) / np.sqrt(var + eps) * np.asarray(scale)
  return y if bias is None else y + np.asarray(bias)


def np_gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def np_mha(p, xq, xkv, num_heads, mask=None, score="scaled_dot"):
  """Multi-head attention from the module's parameters; returns (out, weights)."""
  xq, xkv = np.asarray(xq, np.float64), np.asarray(xkv, np.float64)
  def proj(x, name):
    y = x @ np.asarray(p[f"{name}_kernel"])
    return y + np.asarray(p[f"{name}_bias"]) if f"{name}_bias" in p else y
  def heads(y):  # [b, t, h*d] -> [b, h, t, d]
    b, t, f = y.shape
    return y.reshape(b, t, num_heads, f // num_heads).transpose(0, 2, 1, 3)
  q, k, v = heads(proj(xq, "query")), heads(proj(xkv, "key")), heads(proj(xkv, "value"))
  hd = q.shape[-1]
  if score == "scaled_dot":
    logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
  elif score == "dot":
    logits = q @ k.transpose(0, 1, 3, 2)
  elif score == "general":
    w = np.asarray(p["score_params"]["w"])  # [h, d, d]
    logits = np.einsum("bhqd,hde,bhke->bhqk", q, w, k)
  elif score == "cosine":
    beta = np.asarray(p["score_params"]["beta"])  # [h, 1, 1]
    qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    logits = beta * (qn @ kn.transpose(0, 1, 3, 2))
  elif score == "additive":
    sp = {n: np.asarray(a) for n, a in p["score_params"].items()}
    qp = np.einsum("bhqd,hda->bhqa", q, sp["w_q"])
    kp = np.einsum("bhkd,hda->bhka", k, sp["w_k"])
    logits = np.einsum("bhqka,ha->bhqk", np.tanh(qp[:, :, :, None] + kp[:, :, None]), sp["v"])
  elif score == "location":
    w = np.asarray(p["score_params"]["w"])  # [h, d, max_len]
    logits = np.einsum("bhqd,hdm->bhqm", q, w)[..., :k.shape[2]]
  else:
    raise AssertionError(score)
  weights = np_softmax(logits, mask)  # [b, h, q, k]
  ctx = (weights @ v).transpose(0, 2, 1, 3).reshape(xq.shape[0], xq.shape[1], -1)
  out = ctx @ np.asarray(p["out"]["kernel"])
  if "bias" in p["out"]:
    out = out + np.asarray(p["out"]["bias"])
  return out, weights


def np_block(p, x, num_heads, norm_position, mask=None):
  """Pre- or post-LN Transformer block (self-attention + GELU-tanh MLP)."""
  x = np.asarray(x, np.float64)
  ln = lambda name, y: np_layer_norm(y, p[name]["scale"], p[name].get("bias"))
  def mlp(y):
    h = np_gelu_tanh(y @ np.asarray(p["mlp"]["fc"]["kernel"]) + np.asarray(p["mlp"]["fc"]["bias"]))
    return h @ np.asarray(p["mlp"]["proj"]["kernel"]) + np.asarray(p["mlp"]["proj"]["bias"])
  attn = lambda y: np_mha(p["self_attention"], y, y, num_heads, mask)[0]
  if norm_position == "pre":
    x = x + attn(ln("ln_1", x))
    return x + mlp(ln("ln_2", x))
  x = ln("ln_1", x + attn(x))
  return ln("ln_2", x + mlp(x))


def np_causal(t, k=None):
  k = t if k is None else k
  return np.tril(np.ones((t, k), bool), k - t)


def _random_params(params, scale=0.5, seed=1):
  """Replaces every leaf with N(0, scale²) so that tests do not pass on near-zero weights."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [scale * jax.random.normal(k, l.shape, l.dtype)
                                   for k, l in zip(keys, leaves)])


# ----------------------------------------------------------------------------- Dense


@pytest.mark.parametrize("d_in,d_out", [(4, 6), (6, 3)])
def test_matmul_value_and_gradients_match_numpy(d_in, d_out):
  x = _x(3, 5, d_in)
  w = _x(d_in, d_out)
  g = _x(3, 5, d_out)  # cotangent
  loss = lambda x, w: jnp.sum(layers.matmul(x, w) * g)
  (val, (dx, dw)) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
  xn, wn, gn = (np.asarray(a, np.float64) for a in (x, w, g))
  np.testing.assert_allclose(val, np.sum((xn @ wn) * gn), rtol=1e-5)
  np.testing.assert_allclose(dx, gn @ wn.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, np.einsum("btd,bte->de", xn, gn), rtol=1e-5, atol=1e-5)


def test_dense_matches_numpy_and_flax_names():
  x = _x(2, 3, 4)
  layer = Dense(5)
  params = _random_params(layer.init(jax.random.key(0), x)["params"])
  assert set(params) == {"kernel", "bias"} and params["kernel"].shape == (4, 5)
  y = layer.apply({"params": params}, x)
  want = np.asarray(x) @ np.asarray(params["kernel"]) + np.asarray(params["bias"])
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_bias", [False, True])
def test_layer_norm_value_and_gradients_match_numpy(use_bias):
  x = _x(3, 4, 6) * 2.0 + 1.0
  ln = layers.LayerNorm(use_bias=use_bias)
  params = _random_params(ln.init(jax.random.key(0), x)["params"])
  g = _x(3, 4, 6)  # cotangent
  loss = lambda p, x: jnp.sum(ln.apply({"params": p}, x) * g)
  (val, (dp, dx)) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
  xn, gn, s = np.asarray(x, np.float64), np.asarray(g, np.float64), np.asarray(params["scale"])
  x_hat = np_layer_norm(xn, np.ones(6))
  y = x_hat * s + (np.asarray(params["bias"]) if use_bias else 0.0)
  np.testing.assert_allclose(val, np.sum(y * gn), rtol=1e-4)
  # d/dx by central differences of the NumPy reference (float64).
  eps, num = 1e-6, np.zeros_like(xn)
  for idx in np.ndindex(xn.shape):
    hi, lo = xn.copy(), xn.copy()
    hi[idx] += eps
    lo[idx] -= eps
    num[idx] = (np.sum(np_layer_norm(hi, s) * gn) - np.sum(np_layer_norm(lo, s) * gn)) / (2 * eps)
  np.testing.assert_allclose(dx, num, rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(dp["scale"], np.sum(gn * x_hat, axis=(0, 1)), rtol=1e-4, atol=1e-5)
  if use_bias:
    np.testing.assert_allclose(dp["bias"], np.sum(gn, axis=(0, 1)), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- attention


@pytest.fixture(scope="module")
def self_attn():
  """A self-attention module with random parameters and a jitted apply."""
  mod = MultiHeadAttention(num_heads=H, causal=True)
  x = _x(B, T, D)
  params = _random_params(mod.init(jax.random.key(0), x)["params"])
  return mod, params, x


@pytest.mark.parametrize("implementation", ["reference", "xla", "blocked", "auto"])
def test_causal_self_attention_matches_numpy(self_attn, implementation):
  mod, params, x = self_attn
  mod = mod.clone(attention=AttentionConfig(implementation=implementation))
  valid = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)  # second row padded after 3
  mask = valid[:, None, None, :]  # [b, 1, 1, k]
  out = jax.jit(lambda p, x, m: mod.apply({"params": p}, x, mask=m))(params, x, mask)
  want, _ = np_mha(params, x, x, H, mask=np_causal(T)[None, None] & mask)
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_sown_weights_are_the_softmax_and_force_the_reference_path(self_attn):
  mod, params, x = self_attn
  out, state = mod.apply({"params": params}, x, mutable=["intermediates"])
  (weights,) = state["intermediates"]["attention_weights"]
  want_out, want_w = np_mha(params, x, x, H, mask=np_causal(T)[None, None])
  assert weights.shape == (B, H, T, T)
  np.testing.assert_allclose(weights, want_w, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)
  # Not mutable and not asked: nothing sown.
  _, state = mod.apply({"params": params}, x, mutable=["intermediates"], sow_weights=False)
  assert "intermediates" not in state or not state["intermediates"]


def test_cross_attention_with_other_length_and_width():
  mod = MultiHeadAttention(num_heads=H, qkv_features=12, out_features=6, use_bias=False)
  xq, xkv = _x(B, 3, D), _x(B, 7, 10)
  params = _random_params(mod.init(jax.random.key(0), xq, xkv)["params"])
  assert params["key_kernel"].shape == (10, 12) and "query_bias" not in params
  valid = np.arange(7)[None, :] < np.array([7, 4])[:, None]  # [b, k]
  out = mod.apply({"params": params}, xq, xkv, mask=valid[:, None, None, :])
  want, _ = np_mha(params, xq, xkv, H, mask=valid[:, None, None, :])
  assert out.shape == (B, 3, 6)
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("score", ["dot", "general", "cosine", "additive", "location"])
def test_every_score_matches_numpy(score):
  mod = MultiHeadAttention(num_heads=H, attention=AttentionConfig(score=score), max_len=T,
                           causal=True)
  x = _x(B, T, D)
  params = _random_params(mod.init(jax.random.key(0), x)["params"])
  if score == "cosine":
    assert params["score_params"]["beta"].shape == (H, 1, 1)
  out, state = mod.apply({"params": params}, x, mutable=["intermediates"])
  want, want_w = np_mha(params, x, x, H, mask=np_causal(T)[None, None], score=score)
  np.testing.assert_allclose(state["intermediates"]["attention_weights"][0], want_w,
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_kv_cache_chunks_match_full_causal_attention(self_attn):
  mod, params, x = self_attn
  full = mod.apply({"params": params}, x)  # [b, t, d]
  cache = jax.eval_shape(lambda: mod.init(jax.random.key(0), x, decode=True))["cache"]
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
  assert cache["cached_key"].shape == (B, H, T, D // H) and cache["cache_index"].shape == (B,)
  step = jax.jit(lambda p, c, x: mod.apply({"params": p, "cache": c}, x, decode=True,
                                           mutable=["cache"]))
  outs = []
  for lo, hi in [(0, 2), (2, 3), (3, 4), (4, 5)]:  # a 2-token prefill, then one at a time
    y, variables = step(params, cache, x[:, lo:hi])
    cache = variables["cache"]
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(cache["cache_index"], [T, T])


def np_cached_causal_attention(mechanism, q, k, v, *, window=None, features=None):
  """What cached decoding computes, float64: query p against the keys 0..p the cache holds then
  (q, k, v `[b, h, t, d]`): softmax of q·k/sqrt(d) (sliding_window: keys p - window..p only),
  linear (phi = elu + 1, Katharopoulos et al. 2020) or Performer (FAVOR+: phi(x) =
  exp(wᵀx' - |x'|²/2 - c) / sqrt(m) + 1e-6, x' = x / d^(1/4); c the row max for a query, the max
  over the cached keys and features for the keys)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  d = q.shape[-1]
  elu1 = lambda x: np.where(x > 0, x + 1.0, np.exp(x))
  def favor(x, c):
    x = x / d ** 0.25
    proj = x @ np.asarray(features, np.float64).T  # [b, h, len, m]
    return np.exp(proj - 0.5 * (x * x).sum(-1, keepdims=True) - c(proj)) / np.sqrt(
        features.shape[0]) + 1e-6
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  for p in range(q.shape[2]):
    qp, kp, vp = q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1]  # [b, h, 1 | p + 1, d]
    if mechanism in ("full", "sliding_window"):
      s = qp @ np.swapaxes(kp, -1, -2) / np.sqrt(d)  # [b, h, 1, p + 1]
      if mechanism == "sliding_window":
        s = np.where(np.arange(p + 1) >= p - window, s, -np.inf)
      a = np.exp(s - s.max(-1, keepdims=True))
    elif mechanism == "linear":
      a = elu1(qp) @ np.swapaxes(elu1(kp), -1, -2)
    elif mechanism == "performer":
      a = favor(qp, lambda x: x.max(-1, keepdims=True)) @ np.swapaxes(
          favor(kp, lambda x: x.max(axis=(-1, -2), keepdims=True)), -1, -2)
    else:
      raise AssertionError(f"no NumPy reference for mechanism {mechanism!r}")
    out[:, :, p] = ((a / a.sum(-1, keepdims=True)) @ vp)[:, :, 0]
  return out


@pytest.mark.parametrize(
    "mechanism", [n for n, m in registry.MECHANISMS.items() if m.supports.cache])
def test_kv_cache_decoding_under_x64_matches_numpy(mechanism):
  """Cached decoding with JAX's 64-bit mode on (a float32 model): the cache write used to mix
  the int32 cache index with int64 zeros in dynamic_update_slice (TypeError, #47). x64 is on only
  inside this test."""
  window, m = 2, 8
  options = {"sliding_window": {"window": window}, "performer": {"num_features": m}}
  mod = MultiHeadAttention(num_heads=H, causal=True, attention=AttentionConfig(
      mechanism=mechanism, options=options.get(mechanism)))
  with jax.enable_x64(True):
    x = _x(B, T, D)
    cache = mod.init(jax.random.key(0), x, decode=True)["cache"]
    params = _random_params(mod.init(jax.random.key(0), x)["params"])
    step = jax.jit(lambda p, c, x: mod.apply({"params": p, "cache": c}, x, decode=True,
                                             mutable=["cache"]))
    outs = []
    for lo, hi in [(0, 2), (2, 3), (3, 4), (4, 5)]:  # a 2-token prefill, then one at a time
      y, variables = step(params, cache, x[:, lo:hi])
      cache = variables["cache"]
      outs.append(np.asarray(y))
    # the layer's fixed Performer features: this draw from its mechanism_seed (0), under x64
    features = (registry.get_mechanism(mechanism).init(jax.random.key(0), H, D // H, T,
                                                       num_features=m)["features"]
                if mechanism == "performer" else None)
  np.testing.assert_array_equal(cache["cache_index"], [T, T])
  proj = lambda x, n: (np.asarray(x, np.float64) @ np.asarray(params[f"{n}_kernel"])
                       + np.asarray(params[f"{n}_bias"]))  # [b, t, h*d]
  heads = lambda y: y.reshape(B, T, H, D // H).transpose(0, 2, 1, 3)  # [b, h, t, d]
  ctx = np_cached_causal_attention(mechanism, heads(proj(x, "query")), heads(proj(x, "key")),
                                   heads(proj(x, "value")), window=window, features=features)
  want = (ctx.transpose(0, 2, 1, 3).reshape(B, T, D) @ np.asarray(params["out"]["kernel"])
          + np.asarray(params["out"]["bias"]))  # [b, t, d]
  np.testing.assert_allclose(np.concatenate(outs, axis=1), want, rtol=1e-4, atol=1e-5)


def test_attention_dropout_only_when_training(self_attn):
  mod, params, x = self_attn
  mod = mod.clone(dropout_rate=0.5)
  plain = mod.clone(dropout_rate=0.0).apply({"params": params}, x)
  eval_out = mod.apply({"params": params}, x, deterministic=True)
  train_out = mod.apply({"params": params}, x, deterministic=False,
                        rngs={"dropout": jax.random.key(3)})
  np.testing.assert_allclose(eval_out, plain, rtol=1e-5, atol=1e-6)
  assert not np.allclose(train_out, plain, atol=1e-3)


def test_bad_names_raise_listing_valid_ones():
  x = _x(1, 3, D)
  with pytest.raises(ValueError, match="valid scores: .*scaled_dot"):
    MultiHeadAttention(num_heads=H, attention=AttentionConfig(score="nope")).init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="valid implementations: .*reference"):
    MultiHeadAttention(num_heads=H, attention=AttentionConfig(implementation="fast")).init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="supports only the scores"):
    MultiHeadAttention(num_heads=H, attention=AttentionConfig(score="cosine",
                                                         implementation="xla")).init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="max_len"):
    MultiHeadAttention(num_heads=H, attention=AttentionConfig(score="location")).init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="valid activations"):
    layers.get_activation("swish")


# ----------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_transformer_block_matches_numpy(norm_position):
  block = TransformerBlock(num_heads=H, mlp_dim=16, norm_position=norm_position)
  x = _x(B, T, D)
  params = _random_params(block.init(jax.random.key(0), x)["params"], scale=0.3)
  valid = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], bool)[:, None, None, :]
  out = block.apply({"params": params}, x, mask=valid)
  np.testing.assert_allclose(out, np_block(params, x, H, norm_position, mask=valid),
                             rtol=1e-4, atol=1e-4)


def test_decoder_block_with_cross_attention():
  block = TransformerBlock(num_heads=H, mlp_dim=16, causal=True, cross_attention=True)
  x, enc = _x(B, T, D), _x(B, 4, D)
  variables = block.init(jax.random.key(0), x, encoded=enc)
  assert {"self_attention", "cross_attention", "ln_cross", "mlp"} <= set(variables["params"])
  out, state = block.apply(variables, x, encoded=enc, mutable=["intermediates"])
  maps = state["intermediates"]
  assert maps["self_attention"]["attention_weights"][0].shape == (B, H, T, T)
  assert maps["cross_attention"]["attention_weights"][0].shape == (B, H, T, 4)
  assert out.shape == (B, T, D)
  with pytest.raises(ValueError, match="encoded"):
    block.apply(variables, x)


# ----------------------------------------------------------------------------- embeddings


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "none"])
def test_embeddings_match_numpy(position):
  emb = Embeddings(vocab_size=11, features=6, max_len=8, position=position)
  tokens = jnp.asarray(RNG.integers(0, 11, (2, 5)), jnp.int32)
  params = emb.init(jax.random.key(0), tokens)["params"]
  out = emb.apply({"params": params}, tokens)
  table = np.asarray(params["token"]["embedding"])
  want = table[np.asarray(tokens)]
  if position == "learned":
    want = want + np.asarray(params["position"])[:5]
  elif position == "sinusoidal":
    pos, col = np.arange(5)[:, None], np.arange(6)[None, :]
    angle = pos / np.power(10000.0, 2 * (col // 2) / 6)
    want = want + np.where(col % 2 == 0, np.sin(angle), np.cos(angle))
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  h = _x(2, 5, 6)
  np.testing.assert_allclose(emb.apply({"params": params}, h, method=Embeddings.attend),
                             np.asarray(h) @ table.T, rtol=1e-5, atol=1e-5)


def test_embeddings_decode_counter_continues_positions():
  emb = Embeddings(vocab_size=11, features=6, max_len=8)
  tokens = jnp.asarray(RNG.integers(0, 11, (2, 5)), jnp.int32)
  variables = emb.init(jax.random.key(0), tokens, decode=True)
  full = emb.apply({"params": variables["params"]}, tokens)
  cache, parts = variables["cache"], []
  for lo, hi in [(0, 3), (3, 4), (4, 5)]:
    y, new = emb.apply({"params": variables["params"], "cache": cache}, tokens[:, lo:hi],
                       decode=True, mutable=["cache"])
    cache = new["cache"]
    parts.append(y)
  np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, rtol=1e-6)
  with pytest.raises(ValueError, match="valid: learned"):
    Embeddings(11, 6, 8, position="alibi").init(jax.random.key(0), tokens)
