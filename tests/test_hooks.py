"""Tests for the hook sites, run_with_cache / run_with_hooks, patching and head detectors (#52),
against a NumPy GPT written here."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab.analysis import detectors
from attnlab.analysis import hooks
from attnlab.analysis.hooks import Intervention
from attnlab.attention.config import AttentionConfig
from attnlab.layers import hooks as layer_hooks
from attnlab.layers import normalization
from attnlab.models import gpt

VOCAB = 11
TINY = dict(num_layers=2, num_heads=2, d_model=16, block_size=16)
LEN = 8


@pytest.fixture(scope="module")
def run():
  """(model, params) of a tiny GPT whose parameters are random enough to give varied activations."""
  model = gpt.GPT(vocab_size=VOCAB, **TINY)
  params = model.init(jax.random.key(0), jnp.zeros((1, LEN), jnp.int32))["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(tree, [l + 0.3 * jax.random.normal(k, l.shape)
                                     for k, l in zip(keys, leaves)])
  return model, params


@pytest.fixture(scope="module")
def tokens():
  rng = np.random.default_rng(0)
  clean = rng.integers(0, VOCAB, (2, LEN)).astype(np.int32)
  corrupted = clean.copy()
  corrupted[:, 2] = (corrupted[:, 2] + 3) % VOCAB  # one token differs
  corrupted[:, 5] = (corrupted[:, 5] + 5) % VOCAB
  return clean, corrupted


@pytest.fixture(scope="module")
def clean_cache(run, tokens):
  return hooks.run_with_cache(run, tokens[0])  # every site, one compile


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _layer_norm(x, scale, eps=1e-5):
  centred = x - x.mean(-1, keepdims=True)
  r = 1 / np.sqrt((centred * centred).mean(-1, keepdims=True) + eps)
  return centred * r * scale, r


def numpy_gpt(params, ids, zero_head=None):
  """(logits, {site: value}) of attnlab's GPT (learned positions, pre-LN, no biases, tied head)
  in float64; zero_head=(layer, head) zeroes that head's context."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  batch, length = ids.shape
  heads = TINY["num_heads"]
  table = p["embed"]["token"]["embedding"]
  x = table[ids] + p["embed"]["position"][:length]
  acts = {"embed": x}
  causal = np.tril(np.ones((length, length), bool))
  split = lambda t: t.reshape(batch, length, heads, -1).transpose(0, 2, 1, 3)
  for i in range(TINY["num_layers"]):
    b = p[f"block_{i}"]
    a = b["self_attention"]
    acts[f"blocks.{i}.resid_pre"] = x
    h, acts[f"blocks.{i}.ln1.scale"] = _layer_norm(x, b["ln_1"]["scale"])
    q, k, v = (split(h @ a[f"{n}_kernel"]) for n in ("query", "key", "value"))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    scores = np.where(causal, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)  # [batch, heads, q, k]
    z = (w @ v).transpose(0, 2, 1, 3)  # [batch, len, heads, head_dim]
    if zero_head is not None and zero_head[0] == i:
      z = z.copy()
      z[:, :, zero_head[1]] = 0.0
    out = z.reshape(batch, length, -1) @ a["out"]["kernel"]
    acts.update({f"blocks.{i}.attn.q": q, f"blocks.{i}.attn.k": k, f"blocks.{i}.attn.v": v,
                 f"blocks.{i}.attn.pattern": w, f"blocks.{i}.attn.z": z,
                 f"blocks.{i}.attn_out": out})
    x = x + out
    acts[f"blocks.{i}.resid_mid"] = x
    h, acts[f"blocks.{i}.ln2.scale"] = _layer_norm(x, b["ln_2"]["scale"])
    mlp = _gelu_tanh(h @ b["mlp"]["fc"]["kernel"]) @ b["mlp"]["proj"]["kernel"]
    acts[f"blocks.{i}.mlp_out"] = mlp
    x = x + mlp
    acts[f"blocks.{i}.resid_post"] = x
  final, acts["ln_final.scale"] = _layer_norm(x, p["ln_f"]["scale"])
  acts["resid_final"] = final
  return final @ table.T, acts


# ------------------------------------------------------------------------------ sites, cache


def test_every_declared_site_is_cached_with_its_declared_shape(run, clean_cache):
  model, _ = run
  _, cache = clean_cache
  table = hooks.sites(model)
  assert list(cache) == list(table)  # all of them, in forward order, nothing else
  dims = dict(batch=2, len=LEN, q_len=LEN, k_len=LEN, d_model=16, heads=2, kv_heads=2,
              head_dim=8)
  for name, site in table.items():
    words = site.shape.strip("[]").split(", ")
    want = tuple(dims[w] if w in dims else int(w) for w in words)
    assert cache[name].shape == want, name
  assert len(table) == 3 + 12 * TINY["num_layers"]


def test_cache_equals_a_numpy_gpt_computed_from_the_params(run, tokens, clean_cache):
  model, params = run
  logits, cache = clean_cache
  want_logits, want = numpy_gpt(params, tokens[0])
  for name in ("blocks.0.resid_pre", "blocks.0.attn.pattern", "blocks.0.attn.z"):
    assert name in cache
  for name, value in cache.items():
    np.testing.assert_allclose(np.asarray(value, np.float64), want[name], rtol=1e-4, atol=2e-5,
                               err_msg=name)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
  # The activations are far from each other: a site cached at the wrong place would fail.
  assert np.abs(want["blocks.0.resid_pre"] - want["blocks.0.resid_mid"]).max() > 0.1
  assert np.abs(want["blocks.0.attn.pattern"] - np.tril(np.ones((LEN, LEN)))
                / np.arange(1, LEN + 1)[:, None]).max() > 0.1  # not uniform
  # The cached run's logits are the plain forward pass's.
  np.testing.assert_allclose(logits, model.apply({"params": params}, tokens[0]), atol=1e-5)


def test_name_filter_keeps_only_the_sites_asked_for(run, tokens):
  _, cache = hooks.run_with_cache(run, tokens[0], ["blocks.1.attn.z", "embed"])
  assert list(cache) == ["embed", "blocks.1.attn.z"]  # forward order
  _, cache = hooks.run_with_cache(run, tokens[0], lambda n: n.endswith("resid_post"))
  assert list(cache) == ["blocks.0.resid_post", "blocks.1.resid_post"]
  with pytest.raises(ValueError, match="did you mean blocks.0.attn.pattern"):
    hooks.run_with_cache(run, tokens[0], ["blocks.0.attn.patern"])


def test_grouped_query_sites_have_kv_heads():
  model = gpt.GPT(vocab_size=VOCAB, **dict(TINY, num_heads=4),
                  attention=AttentionConfig(num_kv_heads=1), position="rotary")
  x = jnp.zeros((3, LEN), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  _, cache = jax.eval_shape(lambda p: hooks.run_with_cache(
      (model, p), x, lambda n: n.startswith("blocks.0.attn.")), params)
  assert {n.split(".")[-1]: v.shape for n, v in cache.items()} == {
      "q": (3, 4, LEN, 4), "k": (3, 1, LEN, 4), "v": (3, 1, LEN, 4),
      "pattern": (3, 4, LEN, LEN), "z": (3, LEN, 4, 4)}


def test_unused_hooks_add_nothing_to_the_program(run, tokens, monkeypatch):
  """A plain forward pass and its gradient have the same program as with hook() an identity."""
  model, params = run
  x = jnp.asarray(tokens[0])
  programs = lambda: [str(jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params)),
                      str(jax.make_jaxpr(jax.grad(
                          lambda p: model.apply({"params": p}, x).sum()))(params))]
  with_hooks = programs()
  monkeypatch.setattr(layer_hooks, "hook", lambda module, name, value, **kw: value)
  monkeypatch.setattr(layer_hooks, "active", lambda module, name: False)
  assert programs() == with_hooks
  assert "hooks" not in jax.eval_shape(model.init, jax.random.key(0), x)  # init sows nothing


# ------------------------------------------------------------------------------ interventions


def test_replacing_every_site_with_its_clean_value_leaves_the_logits(run, tokens, clean_cache):
  logits, cache = clean_cache
  ivs = [Intervention(name, "replace", value) for name, value in cache.items()]
  patched = hooks.run_with_hooks(run, tokens[0], ivs)
  np.testing.assert_allclose(patched, logits, rtol=1e-5, atol=1e-5)
  # ... and the same replacement on the corrupted tokens gives the clean logits too.
  np.testing.assert_allclose(hooks.run_with_hooks(run, tokens[1], ivs), logits, rtol=1e-5,
                             atol=1e-5)


def test_zeroing_one_head_changes_exactly_what_numpy_predicts(run, tokens, clean_cache):
  _, params = run
  logits, _ = clean_cache
  iv = Intervention("blocks.0.attn.z", "zero", heads=np.array([False, True]))
  patched = np.asarray(hooks.run_with_hooks(run, tokens[0], [iv]))
  want, _ = numpy_gpt(params, tokens[0], zero_head=(0, 1))
  np.testing.assert_allclose(patched, want, rtol=1e-4, atol=1e-4)
  assert np.abs(patched - np.asarray(logits)).max() > 0.05  # the head mattered


def test_ops_and_masks_edit_only_the_selected_entries(run, tokens, clean_cache):
  _, cache = clean_cache
  z = np.asarray(cache["blocks.1.attn.z"])  # [batch, len, heads, head_dim]
  positions = np.zeros(LEN, bool)
  positions[[1, 6]] = True
  heads = np.array([True, False])
  selected = positions[None, :, None, None] & heads[None, None, :, None]
  for op, value, want in (("scale", 3.0, np.where(selected, 3 * z, z)),
                          ("add", 0.5, np.where(selected, z + 0.5, z)),
                          ("zero", None, np.where(selected, 0.0, z)),
                          ("mean", None, np.where(selected, z.mean((0, 1), keepdims=True), z))):
    iv = Intervention("blocks.1.attn.z", op, value, positions=positions, heads=heads)
    _, got = hooks.run_with_cache(run, tokens[0], ["blocks.1.attn.z"], interventions=[iv])
    np.testing.assert_allclose(got["blocks.1.attn.z"], want, rtol=1e-6, atol=1e-6, err_msg=op)
  with pytest.raises(ValueError, match="unknown intervention op"):
    Intervention("embed", "resample")
  with pytest.raises(ValueError, match="has no heads axis"):
    hooks.run_with_hooks(run, tokens[0], [Intervention("embed", "zero", heads=heads)])


def test_patching_a_whole_layer_of_the_residual_stream_gives_the_clean_logits(
    run, tokens, clean_cache):
  logits, cache = clean_cache
  corrupted = np.asarray(hooks.run_with_hooks(run, tokens[1], []))
  assert np.abs(corrupted - np.asarray(logits)).max() > 0.05
  for layer in range(TINY["num_layers"]):
    name = f"blocks.{layer}.resid_pre"
    patched = hooks.run_with_hooks(run, tokens[1], [Intervention(name, "replace", cache[name])])
    np.testing.assert_allclose(patched, logits, rtol=1e-5, atol=1e-5)


def _metric(logits):
  """Logit difference of tokens 3 and 4 at the last position."""
  return jnp.mean(logits[:, -1, 3] - logits[:, -1, 4])


def test_position_sweep_at_the_last_layer_gives_the_clean_metric_at_the_last_position(
    run, tokens, clean_cache):
  logits, _ = clean_cache
  clean = float(_metric(logits))
  corrupted = float(_metric(hooks.run_with_hooks(run, tokens[1], [])))
  assert abs(clean - corrupted) > 0.01
  grid = hooks.patch_sweep(run, tokens[0], tokens[1], _metric, site="resid_post")  # [layers, len]
  assert grid.shape == (TINY["num_layers"], LEN)
  np.testing.assert_allclose(grid[-1, -1], clean, atol=1e-5)
  np.testing.assert_allclose(grid[-1, :-1], corrupted, atol=1e-5)  # no later layer reads them
  # Positions before the first corrupted token hold the same values in both runs.
  np.testing.assert_allclose(grid[:, :2], corrupted, atol=1e-5)


@pytest.mark.parametrize("site,over,batch_size,chunk_tokens", [
    ("resid_pre", "position", None, None),  # each layer's 8 cells in one vmap
    ("resid_pre", "position", None, 48),  # CPU chunks of 48 // 16 tokens -> 2 cells (lax.map)
    ("attn.z", "head", None, None),
    ("attn.z", "position_head", 8, None)])
def test_vmapped_sweep_equals_a_loop_of_single_patches(run, tokens, clean_cache, site, over,
                                                       batch_size, chunk_tokens, monkeypatch):
  model, _ = run
  if chunk_tokens is not None:
    monkeypatch.setattr(hooks, "CPU_CHUNK_TOKENS", chunk_tokens)
  traces = []

  def metric(logits):
    traces.append(1)  # counts traces: one per layer, all in one compiled program
    return _metric(logits)

  grid = hooks.patch_sweep(run, tokens[0], tokens[1], metric, site=site, over=over,
                           batch_size=batch_size)
  # (a batch_size that does not divide a layer's cells would trace a remainder too)
  assert len(traces) == TINY["num_layers"]
  again = hooks.patch_sweep(run, tokens[0], tokens[1], metric, site=site, over=over,
                            batch_size=batch_size)
  assert len(traces) == TINY["num_layers"]  # compiled once
  np.testing.assert_array_equal(again, grid)
  _, cache = clean_cache
  looped = np.zeros_like(grid)
  for index in np.ndindex(*grid.shape):
    name = f"blocks.{index[0]}.{site}"
    positions = heads = None
    if over != "head":
      positions = np.arange(LEN) == index[1]
    if over != "position":
      heads = np.arange(TINY["num_heads"]) == index[-1]
    iv = Intervention(name, "replace", cache[name], positions=positions, heads=heads)
    looped[index] = float(_metric(hooks.run_with_hooks(run, tokens[1], [iv])))
  np.testing.assert_allclose(grid, looped, rtol=1e-5, atol=1e-5)
  assert np.ptp(grid) > 1e-3  # the cells differ


def test_cpu_chunks_of_a_sweep_divide_a_layers_cells():
  # cells per chunk = the largest divisor of the cells with at most CPU_CHUNK_TOKENS tokens
  assert hooks.CPU_CHUNK_TOKENS == 2048
  assert hooks._chunk(64, 12 * 64) == 2  # 2048 // 768 = 2
  assert hooks._chunk(12, 4 * 64) == 6  # at most 8 cells: 6 divides 12
  assert hooks._chunk(7, 12 * 64) == 1
  assert hooks._chunk(16, 2 * 8) == 16  # all in one vmap
  assert hooks._chunk(3, 12 * 1024) == 1  # at least one cell


# ------------------------------------------------------------------------------ detectors

T = 6


def _perfect(offset, first, length=2 * T, batch=3, heads=2, row_scale=1.0):
  w = np.zeros((batch, heads, length, length))
  for q in range(length):
    if q >= first:
      w[:, :, q, q - offset] = row_scale
    else:
      w[:, :, q, :q + 1] = row_scale / (q + 1)
  return w


def test_detectors_give_one_on_perfect_patterns_and_chance_on_random_ones():
  np.testing.assert_allclose(detectors.previous_token_score(_perfect(1, 1)), 1.0)
  np.testing.assert_allclose(detectors.induction_score(_perfect(T - 1, T), T), 1.0)
  # A sigmoid-like row summing to 0.3: the score is the share of the row.
  np.testing.assert_allclose(detectors.induction_score(_perfect(T - 1, T, row_scale=0.3), T),
                             1.0, rtol=1e-6)
  assert np.all(np.asarray(detectors.previous_token_score(_perfect(T - 1, T))) < 0.3)
  # Random causal rows (uniform on the simplex): about the uniform head's score.
  rng = np.random.default_rng(0)
  w = rng.exponential(size=(400, 2, 2 * T, 2 * T)) * np.tril(np.ones((2 * T, 2 * T)))
  w /= w.sum(-1, keepdims=True)
  chance = detectors.chance_scores(T)
  np.testing.assert_allclose(detectors.previous_token_score(w), chance["previous_token"],
                             rtol=0.05)
  np.testing.assert_allclose(detectors.induction_score(w, T), chance["induction"], rtol=0.05)
  tokens = detectors.repeated_random_tokens(VOCAB, T, batch=4)
  np.testing.assert_array_equal(tokens[:, :T], tokens[:, T:])


def test_detect_heads_reads_the_models_own_patterns(run):
  model, _ = run
  # Layer 0's weights replaced by a perfect previous-token pattern, layer 1's by an induction
  # pattern: the detector sees them through the model's forward pass.
  ivs = [Intervention("blocks.0.attn.pattern", "replace", _perfect(1, 1, batch=1)),
         Intervention("blocks.1.attn.pattern", "replace", _perfect(T - 1, T, batch=1))]
  scores = detectors.detect_heads(run, seq_len=T, interventions=ivs)
  np.testing.assert_allclose(scores["previous_token"][0], 1.0, rtol=1e-6)
  np.testing.assert_allclose(scores["induction"][1], 1.0, rtol=1e-6)
  plain = detectors.detect_heads(run, seq_len=T)
  assert plain["induction"].shape == (model.num_layers, model.num_heads)
  assert np.all((plain["induction"] >= 0) & (plain["induction"] <= 1))
  assert np.all(plain["induction"] < 0.9)  # a random model has no induction head


# ------------------------------------------------------------------------------ attention-only


def test_attention_only_gpt_has_no_mlp_and_trains_a_step():
  model = gpt.GPT(vocab_size=VOCAB, **TINY, mlp_ratio=0)
  x = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, (4, LEN)))
  params = model.init(jax.random.key(0), x)["params"]
  names = [n for n in jax.tree_util.tree_flatten_with_path(params)[0]]
  paths = ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in names]
  assert not [p for p in paths if "mlp" in p or "ln_2" in p]
  assert not [n for n in hooks.sites(model) if "mlp" in n or "ln2" in n]
  tx = optax.adam(1e-2)

  def loss_fn(p):
    logits = model.apply({"params": p}, x[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

  step = jax.jit(jax.value_and_grad(loss_fn))
  loss, grads = step(params)
  updates, _ = tx.update(grads, tx.init(params))
  after, _ = step(optax.apply_updates(params, updates))
  assert np.isfinite(float(loss)) and float(after) < float(loss)
  with pytest.raises(ValueError, match="mlp_ratio must be >= 0"):
    gpt.check_config(gpt.GPT(vocab_size=VOCAB, **TINY, mlp_ratio=-1))
