"""The Transformer encoder-decoder (attnlab/models/transformer.py) and configs/transformer.py."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import decoding
from attnlab.cli import train as train_cli
from attnlab.layers import MultiHeadAttention
from attnlab.layers import project_kv
from attnlab.models import transformer as tf

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "transformer.py")
SRC_VOCAB, TGT_VOCAB, START, END = 11, 13, 1, 2


def _greedy_decode(model, params, src, src_lengths, *, start_id: int, end_id: int, max_len: int,
                   beam_size: int = 1, use_cache: bool = True) -> decoding.Decoded:
  """Greedy (beam_size 1) or beam-search decoding of a padded source batch."""
  decoding.check_decode_len(model, max_len)
  state = tf.init_decode_state(model, params, src, src_lengths, use_cache=use_cache)
  step_fn = tf.make_step_fn(model, params, use_cache=use_cache)
  start = jnp.full((src.shape[0],), start_id, jnp.int32)
  if beam_size <= 1:
    return decoding.greedy(step_fn, state, start, max_len=max_len, end_id=end_id)
  return decoding.beam_search(step_fn, state, start, beam_size=beam_size, max_len=max_len,
                              end_id=end_id)


def _config(arg: str):
  return config_utils.load_config_file(f"{CONFIG}:{arg}")


@pytest.fixture(scope="module")
def setup():
  """A tiny 1+2-layer model, its parameters and a padded batch."""
  model = tf.Transformer(src_vocab_size=SRC_VOCAB, tgt_vocab_size=TGT_VOCAB, num_layers=1,
                         num_decoder_layers=2, num_heads=2, d_model=16, mlp_dim=32, max_len=10)
  src = jnp.array([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 3, 4]], jnp.int32)  # [2, 6]
  src_len = jnp.array([4, 6], jnp.int32)
  tgt = jnp.array([[START, 5, 6, 7, 8], [START, 3, 4, 9, 12]], jnp.int32)  # [2, 5]
  params = jax.jit(model.init)(jax.random.key(0), src, src_len, tgt)["params"]
  apply = jax.jit(lambda p, s, n, t: model.apply({"params": p}, s, n, t,
                                                 mutable=["intermediates"]))
  return model, params, src, src_len, tgt, apply


def _weights(apply, params, src, src_len, tgt, layer, kind):
  (_, _), state = apply(params, src, src_len, tgt)
  return np.asarray(state["intermediates"][layer][kind]["attention_weights"][0])


def test_target_position_never_sees_later_target_tokens(setup):
  model, params, src, src_len, tgt, apply = setup
  (logits, _), _ = apply(params, src, src_len, tgt)
  for t in range(tgt.shape[1] - 1):
    changed = tgt.at[:, t + 1:].set((tgt[:, t + 1:] + 5) % TGT_VOCAB)
    (other, _), _ = apply(params, src, src_len, changed)
    np.testing.assert_allclose(other[:, :t + 1], logits[:, :t + 1], atol=1e-6)
    assert not np.allclose(other[:, t + 1:], logits[:, t + 1:], atol=1e-4)  # later ones do move
  # The decoder self-attention weights are lower triangular (NumPy reference of the mask).
  w = _weights(apply, params, src, src_len, tgt, "decoder_layer_1", "self_attention")
  future = np.triu(np.ones((5, 5), bool), k=1)
  assert w.shape == (2, 2, 5, 5) and np.all(w[..., future] == 0)
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)


def test_padded_source_positions_get_zero_weight(setup):
  model, params, src, src_len, tgt, apply = setup
  for layer in ("decoder_layer_0", "decoder_layer_1"):
    cross = _weights(apply, params, src, src_len, tgt, layer, "cross_attention")
    assert cross.shape == (2, 2, 5, 6)  # [batch, heads, tgt_len, src_len]
    assert np.all(cross[0, ..., 4:] == 0.0)
    assert np.all(cross[0, ..., :4] > 0.0)
    np.testing.assert_allclose(cross.sum(-1), 1.0, atol=1e-5)
  enc = _weights(apply, params, src, src_len, tgt, "encoder_layer_0", "self_attention")
  assert np.all(enc[0, :, :, 4:] == 0.0)
  # Whatever sits in the padding does not change the output.
  (logits, aux), _ = apply(params, src, src_len, tgt)
  (other, _), _ = apply(params, src.at[0, 4:].set(9), src_len, tgt)
  np.testing.assert_allclose(other, logits, atol=1e-6)
  # aux: head-mean of the last layer's cross-attention.
  np.testing.assert_allclose(aux["attention_weights"], cross.mean(axis=1), atol=1e-6)


@pytest.mark.slow
def test_cached_decoding_equals_uncached(setup):
  model, params, src, src_len, _, _ = setup
  run = jax.jit(lambda p, s, n, use_cache, beam: _greedy_decode(
      model, p, s, n, start_id=START, end_id=END, max_len=8, beam_size=beam, use_cache=use_cache),
      static_argnums=(3, 4))
  for beam in (1, 2):
    cached, uncached = run(params, src, src_len, True, beam), run(params, src, src_len, False, beam)
    np.testing.assert_array_equal(cached.tokens, uncached.tokens)
    np.testing.assert_allclose(cached.scores, uncached.scores, atol=1e-4)
    np.testing.assert_allclose(cached.aux, uncached.aux, atol=1e-5)  # cross weights per step
  assert cached.aux.shape == (2, 2, 8, 6)
  assert np.all(np.asarray(cached.aux)[0, ..., 4:] == 0.0)
  # max_len=10 cache positions: 10 steps fit, 11 would write past the cache and are refused.
  assert _greedy_decode(model, params, src, src_len, start_id=START, end_id=END,
                          max_len=10).tokens.shape == (2, 10)
  with pytest.raises(ValueError, match="cannot decode 11 tokens.*model.max_len=10"):
    _greedy_decode(model, params, src, src_len, start_id=START, end_id=END, max_len=11)


@pytest.mark.slow
def test_rotary_transformer_cached_decoding_equals_uncached():
  model = tf.Transformer(src_vocab_size=SRC_VOCAB, tgt_vocab_size=TGT_VOCAB, num_layers=1,
                         num_heads=2, d_model=16, mlp_dim=32, max_len=10, position="rotary")
  src = jnp.array([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 3, 4]], jnp.int32)  # [2, 6]
  src_len = jnp.array([4, 6], jnp.int32)
  tgt = jnp.array([[START, 5, 6, 7, 8]] * 2, jnp.int32)  # [2, 5]
  params = jax.jit(model.init)(jax.random.key(3), src, src_len, tgt)["params"]
  assert "position" not in params["src_embed"]  # no table: queries and keys are rotated
  rng = np.random.default_rng(3)  # larger weights than the init's: peaked attention
  params = jax.tree.map(lambda a: a + 0.3 * rng.normal(size=a.shape).astype(np.float32), params)
  logits, _ = model.apply({"params": params}, src, src_len, tgt)
  swapped, _ = model.apply({"params": params}, src, src_len, tgt[:, [0, 2, 1, 3, 4]])
  assert np.abs(np.asarray(swapped[:, 3:]) - np.asarray(logits[:, 3:])).max() > 1e-4  # order counts
  decode = lambda cache: _greedy_decode(model, params, src, src_len, start_id=START,
                                          end_id=END, max_len=8, use_cache=cache)
  cached, uncached = decode(True), decode(False)
  np.testing.assert_array_equal(cached.tokens, uncached.tokens)
  np.testing.assert_allclose(cached.scores, uncached.scores, atol=1e-4)


def test_cached_cross_attention_matches_numpy():
  """MultiHeadAttention on precomputed keys/values against a NumPy softmax(q k^T / sqrt(d)) v."""
  layer = MultiHeadAttention(num_heads=2)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(1, 3, 8)).astype(np.float32)  # [batch, q_len, d]
  enc = rng.normal(size=(1, 4, 8)).astype(np.float32)  # [batch, src_len, d]
  params = layer.init(jax.random.key(1), x, enc)["params"]
  params = jax.tree.map(lambda a: a + rng.normal(size=a.shape).astype(np.float32) * 0.1, params)
  memory = project_kv(params, enc, 2)
  valid = np.array([[True, True, True, False]])
  mask = valid[:, None, None, :]
  out = layer.apply({"params": params}, x, memory, mask=mask)
  p = jax.tree.map(np.asarray, params)
  q = (x @ p["query_kernel"] + p["query_bias"]).reshape(1, 3, 2, 4).transpose(0, 2, 1, 3)
  k = (enc @ p["key_kernel"] + p["key_bias"]).reshape(1, 4, 2, 4).transpose(0, 2, 1, 3)
  v = (enc @ p["value_kernel"] + p["value_bias"]).reshape(1, 4, 2, 4).transpose(0, 2, 1, 3)
  logits = np.where(mask, q @ k.transpose(0, 1, 3, 2) / 2.0, -np.inf)  # [1, 2, 3, 4]
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  ctx = (w @ v).transpose(0, 2, 1, 3).reshape(1, 3, 8)
  want = ctx @ p["out"]["kernel"] + p["out"]["bias"]
  np.testing.assert_allclose(out, want, atol=1e-5)
  # And the same as projecting the encoder outputs on every call.
  np.testing.assert_allclose(layer.apply({"params": params}, x, enc, mask=mask), want, atol=1e-5)


def test_config_choices_and_errors():
  config = _config("task=reverse,model.size=tiny,model.num_layers=3")
  assert config.data.name == "reverse" and config.data.max_len == 30  # seq2seq's reverse data
  model = tf.from_config(config.model, 12, 12, 30)
  assert (model.num_layers, model.num_heads, model.d_model, model.max_len) == (3, 2, 16, 64)
  # The score name is checked once, where the config is read (config_utils.validate).
  with pytest.raises(config_utils.ConfigError) as e:
    config_utils.validate(_config("score=mlp"))
  assert all(w in str(e.value) for w in ["scaled_dot", "additive", "location"]), str(e.value)
  for arg, words in [("model.size=huge", ["tiny", "small", "base"]),
                     ("model.share_embeddings=some", ["none", "target", "all"]),
                     ("model.position=rope", ["sinusoidal", "learned"]),
                     ("model.d_model=30", ["divisible", "num_heads"])]:
    with pytest.raises(config_utils.ConfigError) as e:
      tf.from_config(_config(arg).model, 12, 12, 30)
    assert all(w in str(e.value) for w in words), (arg, str(e.value))
  with pytest.raises(config_utils.ConfigError, match="dates, marathi, reverse"):
    _config("data.name=klingon")


# ------------------------------------------------------------------------------ end to end


def _train(workdir: pathlib.Path, arg: str) -> dict:
  assert train_cli.main(["attnlab train", f"--config={CONFIG}:{arg}",
                         f"--workdir={workdir}"]) == 0
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  [record] = [r for r in records if r["split"] == "eval"]
  return record


@pytest.mark.slow
def test_dates_runlocal_reload_and_translate(tmp_path):
  workdir = tmp_path / "dates"
  record = _train(workdir, "runlocal=True,num_train_steps=3,eval_every=0")
  assert all(np.isfinite(record[k]) for k in ("loss", "exact_match", "bleu"))
  assert (workdir / "attention_0.png").is_file()
  run = analysis.load_run(workdir)
  assert run.config.model.name == "transformer" and run.step == 3
  [t] = run.task.translate(run.params, ["9 october 1993"], beam_size=1)
  assert t.weights.shape == (len(t.output_tokens), len(t.source_tokens))
  np.testing.assert_allclose(t.weights.sum(-1), 1.0, atol=1e-5)
  # The restored model translates like the uncached reference decoder.
  src = np.array([run.task.encode_source("9 october 1993")], np.int32)
  ref = _greedy_decode(run.model, run.params, src, np.array([src.shape[1]], np.int32),
                         start_id=run.task.tgt_tok.start_id, end_id=run.task.tgt_tok.end_id,
                         max_len=len(t.output_tokens), use_cache=False)
  assert [run.task.tgt_tok.id_to_token(int(i)) for i in ref.tokens[0]] == t.output_tokens
  with pytest.raises(ValueError, match="KV cache"):  # the task refuses it too
    run.task.decode_arrays(run.params, src, np.array([src.shape[1]], np.int32), beam_size=1,
                           max_len=run.model.max_len + 1)


@pytest.mark.slow
def test_reverse_runlocal_variant(tmp_path):
  arg = ("runlocal=True,num_train_steps=1,eval_every=0,task=reverse,data.max_len=6,"
         "data.length_bins=(3,6),model.share_embeddings=all,model.position=learned,"
         "model.norm_position=post,model.attention.score=additive,write_plots=False")
  record = _train(tmp_path / "reverse", arg)
  assert np.isfinite(record["loss"]) and 0 <= record["exact_match_len_01_03"] <= 1


@pytest.mark.slow
def test_marathi_runlocal_on_shared_data(tmp_path, shared_data):
  arg = (f"runlocal=True,num_train_steps=1,eval_every=0,task=marathi,"
         f"data.manual_dir={shared_data},data.data_dir={tmp_path / 'tfds'},write_plots=False,"
         f"data.buckets=(),decode.beam_size=2")
  record = _train(tmp_path / "marathi", arg)
  assert np.isfinite(record["loss"]) and np.isfinite(record["bleu"])
