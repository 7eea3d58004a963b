"""Tests for the circuit tools of #52: QK/OV matrices and composition scores, their random
baseline, path patching, attention-sink metrics and the per-head table of `attnlab inspect
--heads` and `attnlab view`, against NumPy references written here."""

import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import config_utils
from attnlab import train
from attnlab.analysis import circuits
from attnlab.analysis import hooks
from attnlab.analysis import paths
from attnlab.analysis import sinks
from attnlab.attention.config import AttentionConfig
from attnlab.models import gpt

REPO = pathlib.Path(__file__).resolve().parents[1]


def _perturbed(model, length, seed=1, scale=0.3):
  """(model, params) with every parameter moved by Gaussian noise (varied activations)."""
  params = model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return model, jax.tree.unflatten(tree, [l + scale * jax.random.normal(k, l.shape)
                                          for k, l in zip(keys, leaves)])


# ------------------------------------------------------------------ QK, OV and composition

LAYERS, HEADS, KV_HEADS, D = 3, 4, 2, 16
HEAD_DIM = D // HEADS


@pytest.fixture(scope="module")
def gqa_run():
  """A 3-layer GPT with grouped-query attention (4 query heads, 2 kv heads), biases and
  LayerNorm scales away from 1."""
  model = gpt.GPT(vocab_size=11, num_layers=LAYERS, num_heads=HEADS, d_model=D, block_size=16,
                  mlp_ratio=0, use_bias=True, attention=AttentionConfig(num_kv_heads=KV_HEADS))
  return _perturbed(model, 8)


def _numpy_matrices(params, fold_ln):
  """{(layer, head): (QK, OV)} `[d, d]` float64 from the raw kernels: query head h reads kv
  head h // (HEADS // KV_HEADS); with fold_ln, ln_1's scale multiplies the reading kernels' rows
  and W_O's rows are centred over d_model."""
  out = {}
  for l in range(LAYERS):
    a = jax.tree.map(lambda x: np.asarray(x, np.float64), params[f"block_{l}"]["self_attention"])
    gamma = np.asarray(params[f"block_{l}"]["ln_1"]["scale"], np.float64)
    read = (lambda w: gamma[:, None] * w) if fold_ln else (lambda w: w)
    for h in range(HEADS):
      g = h // (HEADS // KV_HEADS)
      cols, kv_cols = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM), slice(g * HEAD_DIM,
                                                                      (g + 1) * HEAD_DIM)
      w_q, w_k = read(a["query_kernel"][:, cols]), read(a["key_kernel"][:, kv_cols])
      w_v = read(a["value_kernel"][:, kv_cols])
      w_o = a["out"]["kernel"][cols]  # [head_dim, d]
      if fold_ln:
        w_o = w_o - w_o.mean(1, keepdims=True)
      out[l, h] = (w_q @ w_k.T, w_v @ w_o)
  return out


@pytest.mark.parametrize("fold_ln", [False, True])
def test_composition_scores_match_the_formula_in_numpy(gqa_run, fold_ln):
  model, params = gqa_run
  weights = circuits.head_weights(gqa_run, fold_ln=fold_ln)
  mats = _numpy_matrices(params, fold_ln)
  frob = np.linalg.norm
  score = lambda a, b: frob(a @ b) / (frob(a) * frob(b))
  for (l, h), (qk, ov) in mats.items():
    np.testing.assert_allclose(weights.qk(l, h), qk, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights.ov(l, h), ov, rtol=1e-10, atol=1e-12)
  for kind in ("q", "k", "v"):
    grid = circuits.composition_scores(weights, kind)
    assert grid.shape == (LAYERS, HEADS, LAYERS, HEADS)
    for (la, ha), (_, ov_a) in mats.items():
      for (lb, hb), (qk_b, ov_b) in mats.items():
        if lb <= la:
          assert np.isnan(grid[la, ha, lb, hb])
          continue
        receiver = {"q": qk_b, "k": qk_b.T, "v": ov_b}[kind]
        np.testing.assert_allclose(grid[la, ha, lb, hb], score(ov_a, receiver), rtol=2e-4)
  # Query heads of one group read their kv head's keys and values; the groups differ.
  np.testing.assert_array_equal(weights.w_k[:, 0], weights.w_k[:, 1])
  np.testing.assert_array_equal(weights.w_v[:, 2], weights.w_v[:, 3])
  assert not np.allclose(weights.w_v[:, 1], weights.w_v[:, 2])
  with pytest.raises(ValueError, match="unknown composition 'x'; valid: q, k, v"):
    circuits.composition_scores(weights, "x")


def test_random_baseline_matches_a_numpy_monte_carlo():
  rng = np.random.default_rng(0)
  frob = np.linalg.norm
  for d, hd in ((16, 4), (32, 2)):
    draws = 3000
    mc = []
    for _ in range(draws):
      v, o, q, k = (rng.normal(size=(d, hd)) for _ in range(4))
      a, b = v @ o.T, q @ k.T  # OV of the sender, QK of the receiver
      mc.append(frob(a @ b) / (frob(a) * frob(b)))
    mc = np.asarray(mc)
    ours = circuits.random_baseline(d, hd, "q", draws=3000, seed=1)
    # two independent Monte Carlo estimates of one mean: 4 combined standard errors
    assert abs(ours - mc.mean()) < 4 * math.sqrt(2) * mc.std() / math.sqrt(draws)
    assert circuits.random_baseline(d, hd, "k", draws=3000, seed=1) == pytest.approx(ours)
  # lower rank in a wider space composes less by chance
  assert circuits.random_baseline(32, 2) < circuits.random_baseline(16, 4)


def test_model_notes_name_what_the_weights_leave_out():
  notes = lambda **kw: " ".join(circuits.model_notes(gpt.GPT(vocab_size=5, **kw)))
  assert "rotary" in notes(position="rotary")
  assert "alibi" in notes(position="alibi") and "held by no weight matrix" in notes(
      position="alibi")
  assert "forms no attention weights" in notes(attention=AttentionConfig(mechanism="linear"))
  assert notes(position="learned") == ""
  assert sinks.mechanism_note(gpt.GPT(vocab_size=5, attention=AttentionConfig(
      mechanism="performer"))).startswith("mechanism 'performer' forms no attention weights")
  assert sinks.mechanism_note(gpt.GPT(vocab_size=5)) is None


# ------------------------------------------------------------------------------- sinks


def test_sink_metrics_on_hand_made_patterns():
  t = 6
  causal = np.tril(np.ones((t, t)))
  perfect = np.zeros((2, 1, t, t))
  perfect[..., 0] = 1.0
  diagonal = np.broadcast_to(np.eye(t), (2, 1, t, t))
  uniform = np.broadcast_to(causal / causal.sum(1, keepdims=True), (2, 1, t, t))
  assert sinks.first_token_score(perfect)[0] == pytest.approx(1.0)
  assert sinks.first_token_score(diagonal)[0] == pytest.approx(0.0)
  # the first query row is left out; with it, a diagonal gives that row's 1 / t
  assert sinks.first_token_score(diagonal, include_first_query=True)[0] == pytest.approx(1 / t)
  assert sinks.first_token_score(uniform)[0] == pytest.approx(
      np.mean([1 / (q + 1) for q in range(1, t)]))
  # Gu et al.'s alpha (first query included) from ours, under a causal softmax
  ours = sinks.first_token_score(uniform)[0]
  assert sinks.first_token_score(uniform, include_first_query=True)[0] == pytest.approx(
      (1 + (t - 1) * ours) / t)
  # rate: heads strictly above the threshold, over every layer
  assert sinks.sink_rate(np.array([[0.9, 0.1], [0.31, 0.3]])) == pytest.approx(0.5)
  assert sinks.sink_rate(np.array([0.9, 0.1]), threshold=0.05) == 1.0
  # rows that do not sum to 1 (sigmoid gates): first_token is the gate, share its share
  rng = np.random.default_rng(0)
  gates = rng.uniform(0, 1, (3, 2, t, t)) * causal
  np.testing.assert_allclose(sinks.first_token_score(gates), gates[:, :, 1:, 0].mean((0, 2)))
  np.testing.assert_allclose(sinks.first_token_score(gates, share=True),
                             (gates[:, :, 1:, 0] / gates[:, :, 1:].sum(-1)).mean((0, 2)))
  np.testing.assert_allclose(sinks.row_sums(gates), gates[:, :, 1:].sum(-1).mean((0, 2)))
  # a single example's [heads, q, k]
  assert sinks.first_token_score(perfect[0]).shape == (1,)
  with pytest.raises(ValueError, match="must be"):
    sinks.first_token_score(np.zeros((t, t)))


def test_softmax_sink_mass_matches_numpy():
  model = gpt.GPT(vocab_size=13, num_layers=2, num_heads=2, d_model=8, block_size=16,
                  mlp_ratio=0, attention=AttentionConfig(normalizer="softmax_sink"))
  run = _perturbed(model, 10, scale=1.0)
  tokens = np.random.default_rng(0).integers(0, 13, (3, 10)).astype(np.int32)
  metrics = sinks.sink_metrics(run, tokens)
  names = [f"blocks.{l}.attn.{s}" for l in range(2) for s in ("q", "k")]
  _, cache = hooks.run_with_cache(run, tokens, names)
  causal = np.tril(np.ones((10, 10), bool))
  for l in range(2):
    q = np.asarray(cache[f"blocks.{l}.attn.q"], np.float64)  # [batch, heads, len, hd]
    k = np.asarray(cache[f"blocks.{l}.attn.k"], np.float64)
    sink = np.asarray(run[1][f"block_{l}"]["self_attention"]["normalizer_params"]["sink"],
                      np.float64)  # [heads]
    logits = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), -np.inf)
    e = np.exp(logits)
    denom = np.exp(sink)[None, :, None] + e.sum(-1)  # [batch, heads, len]
    mass = (np.exp(sink)[None, :, None] / denom)[:, :, 1:].mean((0, 2))
    first = (e[..., 0] / denom)[:, :, 1:].mean((0, 2))
    np.testing.assert_allclose(metrics.sink_mass[l], mass, rtol=1e-4)
    np.testing.assert_allclose(metrics.first_token[l], first, rtol=1e-4)
    np.testing.assert_allclose(metrics.share[l], (e[..., 0] / e.sum(-1))[:, :, 1:].mean((0, 2)),
                               rtol=1e-4)
  assert 0.05 < metrics.sink_mass.mean() < 0.95  # the sink takes a real share here
  assert sinks.sink_metrics((model, run[1]), tokens).normalizer == "softmax_sink"


# ------------------------------------------------------------------------ path patching

# The hand-built circuit: a 2-layer attention-only GPT whose residual stream has three
# subspaces: E (embeddings), A (written by head 0.1 only) and B (written by head 0.0 only).
# Head 1.0's query reads A only (its key and value read E): the path 0.1 -> 1.0 (q).
# Head 1.1's value reads B only (its query and key read E): the path 0.0 -> 1.1 (v).
# Layer 0 writes little (so the LayerNorms' 1 / std barely couples the subspaces) and mean-zero
# rows (so their centring does not), and the readers of A and B amplify it; only layer 1 writes
# into E, which the tied unembedding reads.
HV, HD_MODEL, HH, HLEN = 12, 16, 2, 10
HHD = HD_MODEL // HH
E, A, B = np.arange(0, 6), np.arange(6, 11), np.arange(11, 16)


@pytest.fixture(scope="module")
def hand_run():
  model = gpt.GPT(vocab_size=HV, num_layers=2, num_heads=HH, d_model=HD_MODEL, block_size=16,
                  mlp_ratio=0, position="learned")
  shapes = model.init(jax.random.key(0), jnp.zeros((1, HLEN), jnp.int32))["params"]
  p = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), shapes)
  rng = np.random.default_rng(0)
  p["embed"]["token"]["embedding"][:, E] = rng.normal(size=(HV, len(E)))
  p["embed"]["position"][:, E] = 0.5 * rng.normal(size=(16, len(E)))
  for ln in (p["block_0"]["ln_1"], p["block_1"]["ln_1"], p["ln_f"]):
    ln["scale"][:] = 1.0

  def write(kernel, head, cols, scale):  # head's rows of W_O into `cols`, mean-zero rows
    w = scale * rng.normal(size=(HHD, len(cols)))
    kernel[head * HHD:(head + 1) * HHD, cols] = w - w.mean(1, keepdims=True)

  def read(kernel, head, rows, scale=1.0):
    kernel[np.ix_(rows, np.arange(head * HHD, (head + 1) * HHD))] = scale * rng.normal(
        size=(len(rows), HHD))

  a0, a1 = p["block_0"]["self_attention"], p["block_1"]["self_attention"]
  for name in ("query", "key", "value"):
    for h in range(HH):
      read(a0[f"{name}_kernel"], h, E)
  write(a0["out"]["kernel"], 0, B, 0.005)
  write(a0["out"]["kernel"], 1, A, 0.005)
  read(a1["query_kernel"], 0, A, 160.0)
  read(a1["key_kernel"], 0, E)
  read(a1["value_kernel"], 0, E)
  read(a1["query_kernel"], 1, E)
  read(a1["key_kernel"], 1, E)
  read(a1["value_kernel"], 1, B, 160.0)
  write(a1["out"]["kernel"], 0, E, 1.0)
  write(a1["out"]["kernel"], 1, E, 1.0)
  return model, jax.tree.map(jnp.asarray, p)


def _ln(x, scale):
  centred = x - x.mean(-1, keepdims=True)
  return centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-5) * scale


def numpy_forward(params, ids, z=None, inputs=None):
  """(logits, {"z": [per layer], "q"/"k"/"v": [per layer]}) of the attention-only GPT in
  float64. z: {layer: [batch, len, heads, hd]} replaces each layer's head outputs; inputs:
  {(layer, "q"|"k"|"v"): (value [batch, heads, len, hd], head mask [heads])} replaces those
  heads' projections."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  batch, length = ids.shape
  x = p["embed"]["token"]["embedding"][ids] + p["embed"]["position"][:length]
  causal = np.tril(np.ones((length, length), bool))
  split = lambda t: t.reshape(batch, length, HH, HHD).transpose(0, 2, 1, 3)
  acts = {"z": [], "q": [], "k": [], "v": []}
  for l in range(2):
    a = p[f"block_{l}"]["self_attention"]
    h = _ln(x, p[f"block_{l}"]["ln_1"]["scale"])
    qkv = {}
    for name, kernel in (("q", "query_kernel"), ("k", "key_kernel"), ("v", "value_kernel")):
      t = split(h @ a[kernel])
      if inputs and (l, name) in inputs:
        value, mask = inputs[l, name]
        t = np.where(mask[None, :, None, None], value, t)
      qkv[name] = t
      acts[name].append(t)
    scores = np.where(causal, qkv["q"] @ qkv["k"].transpose(0, 1, 3, 2) / math.sqrt(HHD),
                      -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    heads_z = (w @ qkv["v"]).transpose(0, 2, 1, 3)  # [batch, len, heads, hd]
    if z is not None and l in z:
      heads_z = z[l]
    acts["z"].append(heads_z)
    x = x + heads_z.reshape(batch, length, -1) @ a["out"]["kernel"]
  logits = _ln(x, p["ln_f"]["scale"]) @ p["embed"]["token"]["embedding"].T
  return logits, acts


def numpy_metric(logits):
  return float(np.mean(logits[:, :, 0] - logits[:, :, 1]))


def jax_metric(logits):
  return jnp.mean(logits[:, :, 0] - logits[:, :, 1])


def numpy_path_patch(params, clean, corrupted, receivers, inputs):
  """Path patching written out (paths module docstring), every sender below the receivers."""
  _, c = numpy_forward(params, clean)
  _, k = numpy_forward(params, corrupted)
  top = 2 if receivers == "logits" else max(l for l, _ in receivers)
  grid = np.full((2, HH), np.nan)
  for sl in range(top):
    for sh in range(HH):
      z = {l: c["z"][l].copy() for l in range(2)}
      z[sl][:, :, sh] = k["z"][sl][:, :, sh]
      logits, step1 = numpy_forward(params, clean, z=z)
      if receivers != "logits":
        patch = {}
        for rl, rh in receivers:
          for name in inputs:
            mask = patch.get((rl, name), (None, np.zeros(HH, bool)))[1]
            mask[rh] = True
            patch[rl, name] = (step1[name][rl], mask)
        logits, _ = numpy_forward(params, clean, inputs=patch)
      grid[sl, sh] = numpy_metric(logits)
  return grid


@pytest.fixture(scope="module")
def hand_tokens():
  rng = np.random.default_rng(1)
  clean = rng.integers(0, HV, (4, HLEN)).astype(np.int32)
  corrupted = clean.copy()
  corrupted[:, 1::2] = rng.integers(0, HV, (4, HLEN // 2))
  return clean, corrupted


def test_numpy_forward_is_the_model(hand_run, hand_tokens):
  model, params = hand_run
  ours = np.asarray(model.apply({"params": params}, hand_tokens[0]))
  np.testing.assert_allclose(ours, numpy_forward(params, hand_tokens[0])[0], atol=2e-4)


@pytest.mark.parametrize("receivers,inputs", [
    ("logits", "q"), ([(1, 0)], "q"), ([(1, 1)], "v"), ([(1, 0)], "k"),
    ([(1, 0), (1, 1)], ("q", "v"))])
def test_path_patching_matches_numpy_and_finds_the_hand_built_paths(
    hand_run, hand_tokens, receivers, inputs):
  clean, corrupted = hand_tokens
  grid = paths.path_patch(hand_run, clean, corrupted, jax_metric, receivers=receivers,
                          receiver_input=inputs)
  want = numpy_path_patch(hand_run[1], clean, corrupted, receivers,
                          (inputs,) if isinstance(inputs, str) else inputs)
  np.testing.assert_array_equal(np.isnan(grid), np.isnan(want))
  np.testing.assert_allclose(grid, want, atol=2e-4, equal_nan=True)
  effect = grid - numpy_metric(numpy_forward(hand_run[1], clean)[0])
  big = lambda x: abs(x) > 1e-2
  small = lambda x: abs(x) < 1e-3
  if receivers == "logits":  # layer 1 writes into what the unembedding reads; layer 0 does not
    assert big(effect[1]).all() and small(effect[0]).all()
  elif receivers == [(1, 0)] and inputs == "q":  # 1.0's query reads 0.1's output only
    assert big(effect[0, 1]) and small(effect[0, 0])
    assert abs(effect[0, 1]) > 20 * abs(effect[0, 0])
  elif receivers == [(1, 1)]:  # 1.1's value reads 0.0's output only
    assert big(effect[0, 0]) and small(effect[0, 1])
  elif receivers == [(1, 0)] and inputs == "k":  # 1.0's key reads the embeddings only
    assert small(effect[0]).all()
  else:  # both paths at once
    assert big(effect[0]).all()
  assert np.isnan(effect[1]).all() or receivers == "logits"


def test_path_patching_senders_batches_and_bad_input(hand_run, hand_tokens):
  clean, corrupted = hand_tokens
  full = paths.path_patch(hand_run, clean, corrupted, jax_metric, receivers=(1, 0))
  one = paths.path_patch(hand_run, clean, corrupted, jax_metric, receivers=(1, 0),
                         senders=[(0, 1), (1, 1)], batch_size=1)
  assert np.isnan(one[0, 0]) and np.isnan(one[1]).all()  # not asked for / not below 1.0
  np.testing.assert_allclose(one[0, 1], full[0, 1], atol=1e-5)
  with pytest.raises(ValueError, match="receiver head \\(2, 0\\) is not in the model"):
    paths.path_patch(hand_run, clean, corrupted, jax_metric, receivers=[(2, 0)])
  with pytest.raises(ValueError, match="receiver_input must be one or more of q, k, v"):
    paths.path_patch(hand_run, clean, corrupted, jax_metric, receivers=[(1, 0)],
                     receiver_input="z")
  with pytest.raises(ValueError, match="must have the same shape"):
    paths.path_patch(hand_run, clean, corrupted[:, :4], jax_metric)


def test_hand_built_circuit_shows_in_the_composition_scores(hand_run):
  """The weight-level view of the same circuit: 0.1 -> 1.0 by Q-composition, 0.0 -> 1.1 by
  V-composition, and nothing else (disjoint subspaces: exactly 0)."""
  weights = circuits.head_weights(hand_run)
  q, k, v = (circuits.composition_scores(weights, kind) for kind in "qkv")
  assert q[0, 1, 1, 0] > 0.1 and v[0, 0, 1, 1] > 0.1
  assert q[0, 0, 1, 0] == pytest.approx(0, abs=1e-6) and v[0, 1, 1, 1] == pytest.approx(
      0, abs=1e-6)
  assert np.nanmax(k) == pytest.approx(0, abs=1e-6)
  assert circuits.top_compositions({"q": q, "k": k, "v": v}, 1, 0)[0][:3] == ("q", 0, 1)
  assert circuits.top_compositions({"q": q, "k": k, "v": v}, 1, 1)[0][:3] == ("v", 0, 0)


# ---------------------------------------------------------------------------- the tools


@pytest.fixture(scope="module")
def gpt_run_dir(tmp_path_factory):
  """One tiny trained GPT run directory (runlocal, 2 steps, no data files)."""
  workdir = tmp_path_factory.mktemp("gpt_run")
  config = config_utils.load_config_file(
      f"{REPO / 'configs' / 'gpt.py'}:runlocal=True,dataset=addition,num_train_steps=2,"
      "write_plots=False")
  train.train_and_evaluate(config, workdir)
  return workdir


def _numpy_columns(run, seq_len, batch=8, seed=0):
  """prev-token and first-token scores `[layers, heads]` from the model's patterns, in NumPy."""
  from attnlab.analysis import detectors  # pylint: disable=g-import-not-at-top
  tokens = detectors.repeated_random_tokens(run.model.vocab_size, seq_len, batch, seed)
  names = [f"blocks.{l}.attn.pattern" for l in range(run.model.num_layers)]
  _, cache = hooks.run_with_cache(run, tokens, names)
  prev, first = [], []
  for n in names:
    w = np.asarray(cache[n], np.float64)  # [batch, heads, q, k]
    idx = np.arange(1, w.shape[-1])
    prev.append(w[:, :, idx, idx - 1].mean((0, 2)))
    first.append(w[:, :, 1:, 0].mean((0, 2)))
  return np.stack(prev), np.stack(first)


def test_inspect_heads_prints_one_line_per_head(gpt_run_dir, capsys):
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab.cli import inspect_run  # pylint: disable=g-import-not-at-top
  assert inspect_run.main(["attnlab inspect", f"--workdir={gpt_run_dir}", "--heads"]) == 0
  out = capsys.readouterr().out
  run = analysis.load_run(gpt_run_dir)
  layers, heads = run.model.num_layers, run.model.num_heads
  assert f"heads @ step {run.step}:" in out
  assert "sink rate (Gu et al. 2024)" in out and "composition baseline" in out
  seq_len = int(re.search(r"random sequences of (\d+) ids", out).group(1))
  prev, first = _numpy_columns(run, seq_len)
  rows = {m.group(1): m.group(2).split() for m in re.finditer(
      r"^\s+(\d+\.\d+)\s+(.*)$", out, re.M)}
  assert len(rows) == layers * heads
  comps = {kind: circuits.composition_scores(run, kind) for kind in "qkv"}
  for l in range(layers):
    for h in range(heads):
      cells = rows[f"{l}.{h}"]
      assert float(cells[0]) == pytest.approx(prev[l, h], abs=6e-4)  # prev, printed to 3 places
      assert float(cells[3]) == pytest.approx(first[l, h], abs=6e-4)  # first
      if l == 0:
        assert cells[4:] == ["-", "-"]
      else:
        best = max(np.nanmax(comps[kind][:, :, l, h]) for kind in "qkv")
        assert float(cells[-1]) == pytest.approx(best, abs=6e-4)
  assert inspect_run.main(["attnlab inspect", "--workdir=/nonexistent/run", "--heads"]) == 2


def test_view_table_gains_detector_and_sink_columns(gpt_run_dir, tmp_path):
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab.analysis import detectors  # pylint: disable=g-import-not-at-top
  from attnlab.cli import view as view_cli  # pylint: disable=g-import-not-at-top
  run = analysis.load_run(gpt_run_dir)
  page = view_cli.view_text(run, "1+2=", out=tmp_path / "v.html").read_text()
  blob = re.search(r'<script type="application/json" id="attn-data">(.*?)</script>', page, re.S)
  data = json.loads(blob.group(1))
  scores = detectors.detect_heads(run)
  cap = analysis.capture_text(run, "1+2=")
  assert len(data["metrics"]) == run.model.num_layers * run.model.num_heads
  for row in data["metrics"]:
    layer = int(re.match(r"block_(\d+)/", row["layer"]).group(1))
    for column, key in (("prev_token", "previous_token"), ("induction", "induction")):
      assert row[column] == pytest.approx(scores[key][layer, row["head"]], abs=1e-6)
    w = cap.weights[row["layer"]][row["head"]]  # [q, k] of the viewed text
    assert row["first_token"] == pytest.approx(w[1:, 0].mean(), abs=1e-6)
