"""Grouped-query / multi-query and talking-heads attention in MultiHeadAttention, against NumPy
references written here from the papers' formulas (Ainslie et al. 2023, Shazeer 2019, Shazeer et
al. 2020)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.attention.config import AttentionConfig
from attnlab.layers import MultiHeadAttention
from attnlab.layers import TransformerBlock

B, T, D, H = 2, 6, 16, 4
RNG = np.random.default_rng(0)


def _x(*shape):
  return jnp.asarray(RNG.normal(size=shape), jnp.float32)


def np_softmax(z, mask=None):
  z = np.asarray(z, np.float64)
  if mask is not None:
    z = np.where(mask, z, -np.inf)
  z = z - z.max(axis=-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=-1, keepdims=True)


def np_attention(p, x, num_heads, num_kv_heads, causal=False, talking=False):
  """Self-attention with kv head g = h // (num_heads // num_kv_heads) serving query head h;
  talking heads: logits and weights mixed across heads by p's two [heads, heads] matrices."""
  x = np.asarray(x, np.float64)
  proj = lambda n: x @ np.asarray(p[f"{n}_kernel"], np.float64) + np.asarray(p[f"{n}_bias"])
  q, k, v = proj("query"), proj("key"), proj("value")
  hd = q.shape[-1] // num_heads
  b, t, _ = x.shape
  group = num_heads // num_kv_heads
  out = np.zeros((b, t, num_heads * hd))
  logits = np.zeros((b, num_heads, t, t))
  for h in range(num_heads):
    g = h // group
    qh = q[..., h * hd:(h + 1) * hd]
    kh = k[..., g * hd:(g + 1) * hd]
    logits[:, h] = qh @ kh.transpose(0, 2, 1) / math.sqrt(hd)
  mask = np.tril(np.ones((t, t), bool)) if causal else None
  if talking:
    logits = np.einsum("bhqk,hg->bgqk", logits, np.asarray(p["talking_heads_logits"]))
  weights = np_softmax(logits, mask)
  if talking:
    weights = np.einsum("bhqk,hg->bgqk", weights, np.asarray(p["talking_heads_weights"]))
  for h in range(num_heads):
    g = h // group
    out[..., h * hd:(h + 1) * hd] = weights[:, h] @ v[..., g * hd:(g + 1) * hd]
  return out @ np.asarray(p["out"]["kernel"]) + np.asarray(p["out"]["bias"]), weights


def _random_params(params, seed=1):
  """Every leaf replaced by a random draw (the identity talking-heads init would test nothing)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [0.5 * jax.random.normal(k, l.shape) for k, l in
                                   zip(keys, leaves)])


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_matches_numpy(kv_heads, causal):
  layer = MultiHeadAttention(num_heads=H, causal=causal, attention=AttentionConfig(
      num_kv_heads=kv_heads, implementation="reference"))
  x = _x(B, T, D)
  params = _random_params(layer.init(jax.random.key(0), x)["params"])
  hd = D // H
  assert params["key_kernel"].shape == (D, kv_heads * hd)
  assert params["value_kernel"].shape == (D, kv_heads * hd)
  out, state = layer.apply({"params": params}, x, mutable=["intermediates"])
  want, want_w = np_attention(params, x, H, kv_heads, causal)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
  got_w = state["intermediates"]["attention_weights"][0]
  np.testing.assert_allclose(np.asarray(got_w), want_w, atol=1e-5)


def test_gqa_equals_mha_with_kv_kernels_repeated_per_group():
  """GQA with 2 kv heads = MHA whose kv head h is a copy of GQA's kv head h // 2; and
  num_kv_heads = num_heads (or 0) is MHA itself, with the same parameters."""
  x = _x(B, T, D)
  gqa = MultiHeadAttention(num_heads=H, attention=AttentionConfig(num_kv_heads=2), causal=True)
  mha = MultiHeadAttention(num_heads=H, causal=True)
  p = _random_params(gqa.init(jax.random.key(0), x)["params"])
  hd = D // H
  mapped = dict(p)
  for name in ("key", "value"):
    k = np.asarray(p[f"{name}_kernel"]).reshape(D, 2, hd)
    mapped[f"{name}_kernel"] = jnp.asarray(np.repeat(k, 2, axis=1).reshape(D, H * hd))
    b = np.asarray(p[f"{name}_bias"]).reshape(2, hd)
    mapped[f"{name}_bias"] = jnp.asarray(np.repeat(b, 2, axis=0).reshape(H * hd))
  np.testing.assert_allclose(np.asarray(gqa.apply({"params": p}, x)),
                             np.asarray(mha.apply({"params": mapped}, x)), atol=1e-5)
  full = MultiHeadAttention(num_heads=H, attention=AttentionConfig(num_kv_heads=H), causal=True)
  zero = MultiHeadAttention(num_heads=H, attention=AttentionConfig(num_kv_heads=0), causal=True)
  pm = mha.init(jax.random.key(3), x)["params"]
  assert jax.tree.map(jnp.shape, full.init(jax.random.key(3), x)["params"]) == \
      jax.tree.map(jnp.shape, pm)
  for layer in (full, zero):
    np.testing.assert_array_equal(np.asarray(layer.apply({"params": pm}, x)),
                                  np.asarray(mha.apply({"params": pm}, x)))


def test_num_kv_heads_must_divide_num_heads():
  layer = MultiHeadAttention(num_heads=H, attention=AttentionConfig(num_kv_heads=3))
  with pytest.raises(ValueError, match="must divide num_heads"):
    layer.init(jax.random.key(0), _x(1, 3, D))


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_cache_holds_kv_heads_and_cached_decoding_equals_the_full_forward(kv_heads):
  layer = MultiHeadAttention(num_heads=H, attention=AttentionConfig(num_kv_heads=kv_heads),
                             causal=True)
  x = _x(B, T, D)
  params = _random_params(layer.init(jax.random.key(0), x)["params"])
  cache = layer.init(jax.random.key(0), x, decode=True)["cache"]
  assert cache["cached_key"].shape == (B, kv_heads, T, D // H)
  assert cache["cached_value"].shape == (B, kv_heads, T, D // H)
  cache = jax.tree.map(jnp.zeros_like, cache)
  full = np.asarray(layer.apply({"params": params}, x))
  # a prefill of 3 tokens, then one token at a time
  out, state = layer.apply({"params": params, "cache": cache}, x[:, :3], decode=True,
                           mutable=["cache"])
  outs = [np.asarray(out)]
  for t in range(3, T):
    out, state = layer.apply({"params": params, "cache": state["cache"]}, x[:, t:t + 1],
                             decode=True, mutable=["cache"])
    outs.append(np.asarray(out))
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-5)


def test_gqa_cross_attention_with_precomputed_keys():
  from attnlab.layers import project_kv
  layer = MultiHeadAttention(num_heads=H, attention=AttentionConfig(num_kv_heads=2))
  xq, xkv = _x(B, 3, D), _x(B, 5, D)
  params = layer.init(jax.random.key(0), xq, xkv)["params"]
  memory = project_kv(params, xkv, H)
  assert memory["key"].shape == (B, 2, 5, D // H)
  np.testing.assert_allclose(np.asarray(layer.apply({"params": params}, xq, memory)),
                             np.asarray(layer.apply({"params": params}, xq, xkv)), atol=1e-5)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_talking_heads_matches_numpy(kv_heads):
  layer = MultiHeadAttention(num_heads=H, attention=AttentionConfig(
      num_kv_heads=kv_heads, talking_heads=True), causal=True)
  x = _x(B, T, D)
  params = layer.init(jax.random.key(0), x)["params"]
  np.testing.assert_array_equal(np.asarray(params["talking_heads_logits"]), np.eye(H))
  params = _random_params(params, seed=2)
  out, state = layer.apply({"params": params}, x, mutable=["intermediates"])
  want, want_w = np_attention(params, x, H, kv_heads, causal=True, talking=True)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-4)
  np.testing.assert_allclose(np.asarray(state["intermediates"]["attention_weights"][0]), want_w,
                             atol=1e-5)
  # gradients reach both mixing matrices
  grads = jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x) ** 2))(params)
  assert float(jnp.abs(grads["talking_heads_logits"]).max()) > 0
  assert float(jnp.abs(grads["talking_heads_weights"]).max()) > 0


def test_talking_heads_at_identity_equals_multi_head_and_masks_hold():
  x = _x(B, T, D)
  th = MultiHeadAttention(num_heads=H, attention=AttentionConfig(talking_heads=True))
  mha = MultiHeadAttention(num_heads=H)
  p = th.init(jax.random.key(0), x)["params"]
  mask = jnp.asarray(np.arange(T)[None, None, None, :] < np.array([T, 0])[:, None, None, None])
  out_th = th.apply({"params": p}, x, mask=mask, sow_weights=True, mutable=["intermediates"])
  base = {k: v for k, v in p.items() if not k.startswith("talking_heads")}
  out_mha = mha.apply({"params": base}, x, mask=mask)
  np.testing.assert_allclose(np.asarray(out_th[0]), np.asarray(out_mha), atol=1e-5)
  w = np.asarray(out_th[1]["intermediates"]["attention_weights"][0])
  assert np.all(w[1] == 0)  # every key of example 1 masked: its rows stay zero


def test_block_passes_the_head_options():
  block = TransformerBlock(num_heads=H, mlp_dim=32, causal=True,
                           attention=AttentionConfig(num_kv_heads=1, talking_heads=True))
  x = _x(B, T, D)
  p = block.init(jax.random.key(0), x)["params"]["self_attention"]
  assert p["key_kernel"].shape == (D, D // H)
  assert p["talking_heads_logits"].shape == (H, H)
