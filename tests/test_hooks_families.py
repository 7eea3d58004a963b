"""Hook sites of BERT, the Transformer encoder-decoder and the RNN seq2seq, and interventions
during GPT generation (#52), against NumPy computations written here."""

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from attnlab import analysis
from attnlab.analysis import hooks
from attnlab.analysis.hooks import Intervention
from attnlab.models import bert
from attnlab.models import gpt
from attnlab.models import seq2seq
from attnlab.models import transformer

VOCAB = 13
FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"


def _random_params(model, *args, seed=0):
  """Random normal parameters of `model`'s shapes (no compiled init), varied enough to give
  varied activations and attention weights."""
  shapes = jax.eval_shape(model.init, jax.random.key(0), *args)["params"]
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype), shapes)


def _dims(model):
  """Sizes of the words in the sites' shape strings."""
  return dict(batch=2, d_model=16, heads=2, kv_heads=2, head_dim=8)


def _check_shapes(table, cache, dims):
  assert list(cache) == list(table)
  for name, site in table.items():
    words = site.shape.strip("[]").split(", ")
    assert cache[name].shape == tuple(int(w) if w.isdigit() else dims[w] for w in words), name


def _assert_tree_close(a, b, atol=1e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=atol)


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _softmax(x, mask):
  x = np.where(mask, x, -np.inf)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _layer_norm(x, p, eps):
  centred = x - x.mean(-1, keepdims=True)
  r = 1 / np.sqrt((centred * centred).mean(-1, keepdims=True) + eps)
  return centred * r * p["scale"] + p["bias"], r


# ------------------------------------------------------------------------------------- BERT

BERT_LEN = 9


@pytest.fixture(scope="module")
def bert_run():
  model = bert.BertForPretraining(vocab_size=VOCAB, num_layers=2, d_model=16, num_heads=2,
                                  mlp_dim=32, max_len=16, dropout_rate=0.0)
  return model, _random_params(model, jnp.ones((1, BERT_LEN), jnp.int32))


@pytest.fixture(scope="module")
def bert_inputs():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, VOCAB, (2, BERT_LEN)).astype(np.int32)
  tokens[1, -3:] = 0  # padding
  segments = np.zeros_like(tokens)
  segments[:, 5:] = 1
  corrupted = tokens.copy()
  corrupted[:, 2:4] = corrupted[:, 2:4] % (VOCAB - 1) + 1
  return {"tokens": tokens, "segments": segments}, {"tokens": corrupted, "segments": segments}


@pytest.fixture(scope="module")
def bert_cache(bert_run, bert_inputs):
  return hooks.run_with_cache(bert_run, bert_inputs[0])


def numpy_bert_block(p, x, valid, zero_head=None):
  """One post-LN BERT block (biases, exact GELU, eps 1e-12) in float64; zero_head zeroes that
  head's context."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  a = p["self_attention"]
  batch, length, _ = x.shape
  split = lambda t: t.reshape(batch, length, 2, -1).transpose(0, 2, 1, 3)
  q, k, v = (split(x @ a[f"{n}_kernel"] + a[f"{n}_bias"]) for n in ("query", "key", "value"))
  w = _softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), valid[:, None, None, :])
  z = (w @ v).transpose(0, 2, 1, 3)  # [batch, len, heads, head_dim]
  if zero_head is not None:
    z[:, :, zero_head] = 0.0
  attn_out = z.reshape(batch, length, -1) @ a["out"]["kernel"] + a["out"]["bias"]
  mid, _ = _layer_norm(x + attn_out, p["ln_1"], 1e-12)
  h = mid @ p["mlp"]["fc"]["kernel"] + p["mlp"]["fc"]["bias"]
  h = 0.5 * h * (1 + special.erf(h / math.sqrt(2)))
  mlp = h @ p["mlp"]["proj"]["kernel"] + p["mlp"]["proj"]["bias"]
  out, _ = _layer_norm(mid + mlp, p["ln_2"], 1e-12)
  return out


def test_bert_sites_are_cached_with_their_shapes_and_embeddings(bert_run, bert_inputs,
                                                               bert_cache):
  model, params = bert_run
  out, cache = bert_cache
  _check_shapes(hooks.sites(model), cache, dict(_dims(model), len=BERT_LEN, q_len=BERT_LEN,
                                                k_len=BERT_LEN))
  names = list(cache)
  # post-LN: ln_1 comes after the attention branch; the embeddings' own sites come first
  assert names[:4] == ["embed", "embed.segment", "embed.ln.scale", "blocks.0.resid_pre"]
  assert names.index("blocks.0.ln1.scale") > names.index("blocks.0.attn_out")
  assert "resid_final" not in names and names[-1] == "pooled"
  enc = jax.tree.map(lambda a: np.asarray(a, np.float64), params["encoder"])
  tokens, segments = bert_inputs[0]["tokens"], bert_inputs[0]["segments"]
  np.testing.assert_allclose(cache["embed.segment"], enc["segment"]["embedding"][segments],
                             rtol=1e-6, atol=1e-6)
  summed = (enc["embed"]["token"]["embedding"][tokens] + enc["embed"]["position"][:BERT_LEN]
            + enc["segment"]["embedding"][segments])
  normed, r = _layer_norm(summed, enc["embed_norm"], 1e-12)
  np.testing.assert_allclose(cache["embed.ln.scale"], r, rtol=1e-4)
  np.testing.assert_allclose(cache["blocks.0.resid_pre"], normed, rtol=1e-4, atol=1e-4)
  # the block's output is ln_2 of the sum: a post-LN residual is normalised
  np.testing.assert_allclose(
      cache["blocks.1.resid_post"],
      numpy_bert_block(enc["block_1"], np.asarray(cache["blocks.1.resid_pre"], np.float64),
                       tokens != 0), rtol=1e-4, atol=1e-4)
  _assert_tree_close(out, model.apply({"params": params}, tokens, segments))
  # a pre-LN BERT has a final LayerNorm, and its ln_1 before the attention
  pre = bert.BertForPretraining(vocab_size=VOCAB, num_layers=1, d_model=16, num_heads=2,
                                mlp_dim=32, norm_position="pre")
  pre_names = list(hooks.sites(pre))
  assert pre_names[-3:] == ["ln_final.scale", "resid_final", "pooled"]
  assert pre_names.index("blocks.0.ln1.scale") < pre_names.index("blocks.0.attn.q")


def test_bert_replacing_every_site_with_its_clean_value_gives_the_clean_outputs(
    bert_run, bert_inputs, bert_cache):
  out, cache = bert_cache
  corrupted = hooks.run_with_hooks(bert_run, bert_inputs[1], [])
  assert _max_diff(corrupted, out) > 0.02
  ivs = [Intervention(name, "replace", value) for name, value in cache.items()]
  _assert_tree_close(hooks.run_with_hooks(bert_run, bert_inputs[1], ivs), out)
  # the inputs as a tuple (tokens, segments) are the same inputs
  _assert_tree_close(hooks.run_with_hooks(
      bert_run, (bert_inputs[0]["tokens"], bert_inputs[0]["segments"]), []), out)


def test_bert_zeroing_one_head_changes_its_block_as_numpy_predicts(bert_run, bert_inputs,
                                                                   bert_cache):
  _, params = bert_run
  out, clean = bert_cache
  iv = Intervention("blocks.1.attn.z", "zero", heads=np.array([True, False]))
  patched_out, patched = hooks.run_with_cache(bert_run, bert_inputs[0], interventions=[iv])
  # nothing before the edit changes
  for name in ("blocks.1.resid_pre", "blocks.0.resid_post", "blocks.1.attn.pattern"):
    np.testing.assert_array_equal(patched[name], clean[name])
  np.testing.assert_array_equal(patched["blocks.1.attn.z"][:, :, 0], 0.0)
  want = numpy_bert_block(params["encoder"]["block_1"],
                          np.asarray(clean["blocks.1.resid_pre"], np.float64),
                          bert_inputs[0]["tokens"] != 0, zero_head=0)
  np.testing.assert_allclose(patched["blocks.1.resid_post"], want, rtol=1e-4, atol=1e-4)
  assert np.abs(want - np.asarray(clean["blocks.1.resid_post"])).max() > 0.05
  assert _max_diff(patched_out, out) > 0.05


def test_bert_sweep_over_heads_equals_single_patches(bert_run, bert_inputs, bert_cache):
  _, cache = bert_cache
  metric = lambda out: jnp.mean(out[1][:, 0] - out[1][:, 1])  # the NSP logit difference
  grid = hooks.patch_sweep(bert_run, bert_inputs[0], bert_inputs[1], metric, site="attn.z",
                           over="head")
  assert grid.shape == (2, 2)
  for layer, head in np.ndindex(*grid.shape):
    name = f"blocks.{layer}.attn.z"
    iv = Intervention(name, "replace", cache[name], heads=np.arange(2) == head)
    want = float(metric(hooks.run_with_hooks(bert_run, bert_inputs[1], [iv])))
    np.testing.assert_allclose(grid[layer, head], want, rtol=1e-5, atol=1e-5)
  assert np.ptp(grid) > 1e-4


# ------------------------------------------------------------------------------ Transformer

SRC, TGT = 7, 5


@pytest.fixture(scope="module")
def transformer_run():
  model = transformer.Transformer(VOCAB, 11, num_layers=2, num_decoder_layers=1, num_heads=2,
                                  d_model=16, mlp_dim=32, max_len=16)
  src = jnp.ones((1, SRC), jnp.int32)
  return model, _random_params(model, src, jnp.array([SRC]), jnp.ones((1, TGT), jnp.int32))


@pytest.fixture(scope="module")
def transformer_inputs():
  rng = np.random.default_rng(1)
  src = rng.integers(1, VOCAB, (2, SRC)).astype(np.int32)
  src[0, 4:] = 0  # a source of 4 tokens
  tgt = rng.integers(1, 11, (2, TGT)).astype(np.int32)
  corrupted = src.copy()
  corrupted[:, 1] = corrupted[:, 1] % (VOCAB - 1) + 1
  return {"src": src, "tgt_in": tgt}, {"src": corrupted, "tgt_in": tgt}


@pytest.fixture(scope="module")
def transformer_cache(transformer_run, transformer_inputs):
  return hooks.run_with_cache(transformer_run, transformer_inputs[0])


def test_transformer_sites_name_self_and_cross_attention_apart(transformer_run,
                                                              transformer_inputs,
                                                              transformer_cache):
  model, params = transformer_run
  logits, cache = transformer_cache
  _check_shapes(hooks.sites(model), cache, dict(_dims(model), src_len=SRC, tgt_len=TGT))
  assert [n for n in cache if n.startswith("decoder.blocks.0.") and "attn" in n] == [
      f"decoder.blocks.0.{n}" for n in ("attn.q", "attn.k", "attn.v", "attn.pattern", "attn.z",
                                        "attn_out", "cross_attn.q", "cross_attn.k",
                                        "cross_attn.v", "cross_attn.pattern", "cross_attn.z",
                                        "cross_attn_out")]
  assert not [n for n in cache if n.startswith("encoder.") and "cross" in n]
  assert len([n for n in cache if n.startswith("encoder.blocks.1.")]) == 12
  src = transformer_inputs[0]["src"]
  lengths = np.array([4, SRC])
  np.testing.assert_allclose(
      logits, model.apply({"params": params}, src, lengths, transformer_inputs[0]["tgt_in"])[0],
      rtol=1e-6, atol=1e-6)
  # the decoder's self-attention is causal, the encoder's sees every real source token
  self_w = np.asarray(cache["decoder.blocks.0.attn.pattern"])
  assert np.all(self_w[..., np.triu(np.ones((TGT, TGT), bool), 1)] == 0)
  enc_w = np.asarray(cache["encoder.blocks.0.attn.pattern"])
  assert np.all(enc_w[0, :, :, 4:] == 0) and np.all(enc_w[0, :, :, :4] > 0)


def test_cross_attention_rows_sum_to_one_over_the_real_source_tokens(transformer_cache):
  _, cache = transformer_cache
  w = np.asarray(cache["decoder.blocks.0.cross_attn.pattern"], np.float64)  # [b, h, tgt, src]
  real = np.arange(SRC)[None, :] < np.array([4, SRC])[:, None]  # [batch, src]
  np.testing.assert_allclose((w * real[:, None, None]).sum(-1), 1.0, atol=1e-6)
  assert np.all(w[0, ..., 4:] == 0)
  # ... and they are the softmax of the cached cross queries and keys (keys from the encoder)
  q = np.asarray(cache["decoder.blocks.0.cross_attn.q"], np.float64)
  k = np.asarray(cache["decoder.blocks.0.cross_attn.k"], np.float64)
  want = _softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), real[:, None, None])
  np.testing.assert_allclose(w, want, rtol=1e-4, atol=1e-6)
  z = np.asarray(cache["decoder.blocks.0.cross_attn.z"], np.float64)
  v = np.asarray(cache["decoder.blocks.0.cross_attn.v"], np.float64)
  np.testing.assert_allclose(z, (w @ v).transpose(0, 2, 1, 3), rtol=1e-4, atol=1e-5)
  assert np.abs(w[1] - 1 / SRC).max() > 0.02  # not uniform


def test_transformer_replacing_every_site_gives_the_clean_logits(
    transformer_run, transformer_inputs, transformer_cache):
  logits, cache = transformer_cache
  assert _max_diff(hooks.run_with_hooks(transformer_run, transformer_inputs[1], []),
                   logits) > 0.05
  ivs = [Intervention(name, "replace", value) for name, value in cache.items()]
  _assert_tree_close(hooks.run_with_hooks(transformer_run, transformer_inputs[1], ivs), logits)
  # Patching only the encoder's output (what every cross-attention reads) also restores them;
  # zeroing the cross-attention's head 1 changes nothing before the decoder.
  enc = "encoder.resid_final"
  _assert_tree_close(hooks.run_with_hooks(transformer_run, transformer_inputs[1],
                                          [Intervention(enc, "replace", cache[enc])]), logits)
  zero = Intervention("decoder.blocks.0.cross_attn.z", "zero", heads=np.array([False, True]))
  out, edited = hooks.run_with_cache(transformer_run, transformer_inputs[0],
                                     lambda n: n.startswith("encoder.") or "cross" in n,
                                     interventions=[zero])
  for name, value in edited.items():
    if name.startswith("encoder.") or ".cross_attn." in name and not name.endswith(".z"):
      np.testing.assert_array_equal(value, cache[name], err_msg=name)
  assert np.abs(np.asarray(edited["decoder.blocks.0.cross_attn_out"])
                - np.asarray(cache["decoder.blocks.0.cross_attn_out"])).max() > 0.05
  assert _max_diff(out, logits) > 0.05


def test_transformer_sweep_names_its_stack(transformer_run, transformer_inputs,
                                          transformer_cache):
  _, cache = transformer_cache
  metric = lambda logits: jnp.mean(logits[:, -1, 3] - logits[:, -1, 4])
  grid = hooks.patch_sweep(transformer_run, transformer_inputs[0], transformer_inputs[1], metric,
                           site="encoder.resid_post")
  assert grid.shape == (2, SRC)  # [encoder layers, source positions]
  name = "encoder.blocks.1.resid_post"
  iv = Intervention(name, "replace", cache[name], positions=np.arange(SRC) == 1)
  np.testing.assert_allclose(
      grid[1, 1], float(metric(hooks.run_with_hooks(transformer_run, transformer_inputs[1],
                                                    [iv]))), rtol=1e-5, atol=1e-5)
  assert hooks.sweep_sites(transformer_run[0], "decoder.cross_attn.z") == [
      "decoder.blocks.0.cross_attn.z"]
  with pytest.raises(ValueError, match="did you mean encoder.blocks.0.resid_pre"):
    hooks.run_with_cache(transformer_run, transformer_inputs[0], ["blocks.0.resid_pre"])
  with pytest.raises(ValueError, match="pass them as a tuple or a dict"):
    hooks.run_with_hooks(transformer_run, transformer_inputs[0]["src"], [])
  with pytest.raises(ValueError, match="unknown input 'source'"):
    hooks.run_with_hooks(transformer_run, {"source": 1}, [])


# ----------------------------------------------------------------------------- RNN seq2seq


@pytest.fixture(scope="module")
def rnn_run():
  model = seq2seq.Seq2Seq(VOCAB, 11, embed_dim=8, hidden_dim=16, attention="bahdanau")
  return model, _random_params(model, jnp.ones((1, SRC), jnp.int32), jnp.array([SRC]),
                           jnp.ones((1, TGT), jnp.int32))


@pytest.fixture(scope="module")
def rnn_cache(rnn_run, transformer_inputs):
  return hooks.run_with_cache(rnn_run, transformer_inputs[0])


def test_rnn_attention_sites(rnn_run, transformer_inputs, rnn_cache):
  model, params = rnn_run
  logits, cache = rnn_cache
  assert list(cache) == ["encoder.embed", "encoder.states", "decoder.embed", "attn.pattern",
                         "attn.context", "decoder.states", "decoder.features"]
  _check_shapes(hooks.sites(model), cache, dict(batch=2, src_len=SRC, tgt_len=TGT, embed_dim=8,
                                                enc_dim=16, hidden_dim=16, out_dim=32))
  ref, aux = model.apply({"params": params}, transformer_inputs[0]["src"], np.array([4, SRC]),
                         transformer_inputs[0]["tgt_in"])
  np.testing.assert_allclose(logits, ref, rtol=1e-6, atol=1e-6)
  w = np.asarray(cache["attn.pattern"], np.float64)
  np.testing.assert_allclose(w, aux["attention_weights"], rtol=1e-6, atol=1e-7)
  real = np.arange(SRC)[None, :] < np.array([4, SRC])[:, None]
  np.testing.assert_allclose((w * real[:, None]).sum(-1), 1.0, atol=1e-6)
  assert np.all(w[0, :, 4:] == 0)
  # the context is the weights times the encoder states (attention_values=states)
  np.testing.assert_allclose(cache["attn.context"], w @ np.asarray(cache["encoder.states"]),
                             rtol=1e-4, atol=1e-5)
  # Bahdanau's features are [h_t; context_t]
  np.testing.assert_allclose(cache["decoder.features"], np.concatenate(
      [cache["decoder.states"], cache["attn.context"]], -1), rtol=1e-6)
  pre = list(hooks.sites(seq2seq.Seq2Seq(VOCAB, 11, attention="luong")))
  assert pre.index("decoder.states") < pre.index("attn.pattern")
  assert "attn.pattern" not in hooks.sites(seq2seq.Seq2Seq(VOCAB, 11, attention="none"))


def test_rnn_replacing_every_site_gives_the_clean_logits(rnn_run, transformer_inputs,
                                                         rnn_cache):
  logits, cache = rnn_cache
  assert _max_diff(hooks.run_with_hooks(rnn_run, transformer_inputs[1], []), logits) > 0.05
  ivs = [Intervention(name, "replace", value) for name, value in cache.items()]
  _assert_tree_close(hooks.run_with_hooks(rnn_run, transformer_inputs[1], ivs), logits)


def test_rnn_step_edits_reach_only_later_steps(rnn_run, transformer_inputs, rnn_cache):
  _, params = rnn_run
  logits, cache = rnn_cache
  logits = np.asarray(logits)
  step = np.arange(TGT) == 2
  # the output layer's input at step 2 only: the logits of that step are W v + b, no other step
  v = np.linspace(-1, 1, 32, dtype=np.float32)
  out = np.asarray(hooks.run_with_hooks(
      rnn_run, transformer_inputs[0], [Intervention("decoder.features", "replace", v,
                                                    positions=step)]))
  want = logits.copy()
  want[:, 2] = v @ np.asarray(params["output"]["kernel"]) + np.asarray(params["output"]["bias"])
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  # the context at step 2 zeroed: steps before it are unchanged; it and every later step change
  # (the context feeds the cell, whose state carries on)
  out, edited = hooks.run_with_cache(
      rnn_run, transformer_inputs[0], ["attn.context", "decoder.states"],
      interventions=[Intervention("attn.context", "zero", positions=step)])
  out = np.asarray(out)
  np.testing.assert_allclose(out[:, :2], logits[:, :2], rtol=1e-6, atol=1e-6)
  assert np.all(np.abs(out[:, 2:] - logits[:, 2:]).max(-1) > 1e-3)
  np.testing.assert_array_equal(edited["attn.context"][:, 2], 0.0)
  np.testing.assert_allclose(edited["attn.context"][:, :2], cache["attn.context"][:, :2],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="needs its value"):
    hooks.run_with_hooks(rnn_run, transformer_inputs[0], [Intervention("decoder.states", "mean")])


# -------------------------------------------------------------------------- GPT generation

GPT_TINY = dict(num_layers=2, num_heads=2, d_model=16, block_size=16)


@pytest.fixture(scope="module")
def gpt_run():
  model = gpt.GPT(vocab_size=VOCAB, **GPT_TINY)
  return model, _random_params(model, jnp.zeros((1, 8), jnp.int32))


def _greedy_full_passes(run, prompt, ivs, num_tokens):
  """Greedy tokens of full forward passes with `ivs`, one per step (the sequence padded to the
  block: causal, so the padding after the last token changes nothing; one compile)."""
  block = GPT_TINY["block_size"]
  seq = np.zeros((len(prompt), block), np.int32)
  n = prompt.shape[1]
  seq[:, :n] = prompt
  out = []
  for _ in range(num_tokens):
    logits = np.asarray(hooks.run_with_hooks(run, seq, ivs))
    token = logits[:, n - 1].argmax(-1)
    seq[:, n] = token
    out.append(token)
    n += 1
  return np.stack(out, 1)


def test_a_head_zeroed_during_cached_generation_gives_the_full_pass_tokens(gpt_run):
  prompt = np.random.default_rng(2).integers(0, VOCAB, (2, 4)).astype(np.int32)
  ivs = [Intervention("blocks.0.attn.z", "zero", heads=np.array([False, True])),
         Intervention("blocks.1.attn.k", "scale", 0.0, heads=np.array([True, False]))]
  want = _greedy_full_passes(gpt_run, prompt, ivs, num_tokens=8)
  cached = hooks.generate_with_hooks(gpt_run, prompt, ivs, num_tokens=8, temperature=0.0,
                                     use_cache=True)
  uncached = hooks.generate_with_hooks(gpt_run, prompt, ivs, num_tokens=8, temperature=0.0,
                                       use_cache=False)
  np.testing.assert_array_equal(cached.tokens, want)
  np.testing.assert_array_equal(uncached.tokens, want)
  plain = gpt.generate(*gpt_run, prompt, jax.random.key(0), num_tokens=8, temperature=0.0)
  np.testing.assert_array_equal(plain.tokens, _greedy_full_passes(gpt_run, prompt, [], 8))
  assert np.any(plain.tokens != want)  # the edit mattered
  with pytest.raises(ValueError, match="leave positions out"):
    hooks.generate_with_hooks(gpt_run, prompt, [Intervention(
        "embed", "zero", positions=np.arange(4) == 1)], num_tokens=2)
  with pytest.raises(ValueError, match="only 'zero' and 'scale'"):
    hooks.generate_with_hooks(gpt_run, prompt, [Intervention(
        "blocks.0.attn.pattern", "replace", 0.5)], num_tokens=2)
  with pytest.raises(ValueError, match="has 4 positions"):
    hooks.generate_with_hooks(gpt_run, prompt, [Intervention(
        "embed", "add", np.ones((2, 4, 16)))], num_tokens=2)


# --------------------------------------------------------------------- Hugging Face imports


def test_imported_hf_gpt2_and_bert_runs_have_their_sites(tmp_path):
  from attnlab.interop import hf  # pylint: disable=g-import-not-at-top
  for name, inputs in (("gpt2", np.array([[5, 9, 2, 7, 1, 3]], np.int32)),
                       ("bert", {"tokens": np.array([[2, 9, 7, 5, 3, 0]], np.int32)})):
    hf.import_checkpoint(FIXTURES / name, tmp_path / name)
    run = analysis.load_run(tmp_path / name)
    out, cache = hooks.run_with_cache(run, inputs)
    assert "blocks.0.attn.pattern" in cache
    iv = Intervention("blocks.0.attn.z", "zero", heads=np.arange(run.model.num_heads) == 0)
    assert _max_diff(hooks.run_with_hooks(run, inputs, [iv]), out) > 1e-4
    ivs = [Intervention(n, "replace", v) for n, v in cache.items()]
    _assert_tree_close(hooks.run_with_hooks(run, inputs, ivs), out, atol=1e-4)
