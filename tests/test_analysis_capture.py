"""analysis.capture on tiny GPT / BERT / RNN seq2seq / Transformer models with random params."""

import pathlib
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import tasks
from attnlab.data import tokenizers
from attnlab.models import bert

REPO = pathlib.Path(__file__).resolve().parents[1]


def random_params(shapes, seed: int = 0):
  """Random normal parameters of the given shapes (no compiled init needed)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype), shapes)


def _run(arg: str) -> analysis.Run:
  config = config_utils.load_config_file(str(REPO / "configs" / arg))
  task = tasks.build_task(config)
  params = random_params(jax.eval_shape(task.init, jax.random.key(0)))
  return analysis.Run(workdir=None, config=config, task=task, model=task.model, params=params,
                      step=0)


@pytest.fixture(scope="module")
def gpt_run():
  return _run("gpt.py:dataset=addition,runlocal=True")


@pytest.fixture(scope="module")
def seq2seq_run():
  return _run("seq2seq.py:runlocal=True,data.num_train=50")


@pytest.fixture(scope="module")
def transformer_run():
  return _run("transformer.py:runlocal=True,data.num_train=50")


@pytest.fixture(scope="module")
def bert_run():
  tok = tokenizers.CharTokenizer.train(["the cat sat on the mat"])
  model = bert.BertForPretraining(vocab_size=len(tok), num_layers=2, d_model=16, num_heads=2,
                                  mlp_dim=32, max_len=24, dropout_rate=0.0)
  params = random_params(jax.eval_shape(model.init, jax.random.key(1),
                                        jnp.zeros((1, 8), jnp.int32))["params"], seed=1)
  config = ml_collections.ConfigDict({"task": "masked_lm"})
  return analysis.Run(workdir=None, config=config, task=types.SimpleNamespace(tokenizer=tok),
                      model=model, params=params, step=0)


def _check_rows(cap):
  for path, w in cap.weights.items():
    q_side, k_side = cap.sides[path]
    assert w.dtype == np.float32 and w.ndim == 3
    assert w.shape[1:] == (len(cap.tokens[q_side]), len(cap.tokens[k_side])), path
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5, err_msg=path)


def _softmax(x, mask):
  x = np.where(mask, x, -np.inf)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_view_target_on_a_gpt_run_says_to_leave_it_out(gpt_run, tmp_path):
  from attnlab.cli import view  # pylint: disable=g-import-not-at-top
  from attnlab.errors import UserError  # pylint: disable=g-import-not-at-top
  with pytest.raises(UserError, match="leave the target out .--target of `attnlab view`"):
    view.view_text(gpt_run, "12+", target="34", out=tmp_path / "v.html")
  assert not (tmp_path / "v.html").exists()


def test_gpt_capture_is_causal_and_extras_are_consistent(gpt_run):
  cap = analysis.capture_text(gpt_run, "12+34=", extras=True)
  assert cap.tokens == {"tokens": ["<start>", "1", "2", "+", "3", "4", "="]}
  assert list(cap.weights) == ["block_0/self_attention", "block_1/self_attention"]
  assert set(cap.kind.values()) == {"causal"}
  _check_rows(cap)
  causal = np.tril(np.ones((7, 7), bool))
  for path, w in cap.weights.items():
    assert w.shape == (2, 7, 7)
    assert np.all(w[:, ~causal] == 0.0)
    scores = cap.extras[f"{path}/scores"]  # [heads, q, k] raw scaled-dot logits
    q, k, v = (cap.extras[f"{path}/{n}"] for n in ("queries", "keys", "values"))
    np.testing.assert_allclose(scores, q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_softmax(scores, causal), w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(cap.extras[f"{path}/context"], w @ v, rtol=1e-4, atol=1e-6)
  assert cap.extras["block_1/output"].shape == (7, gpt_run.model.d_model)
  plain = analysis.capture_text(gpt_run, "12+34=")
  assert plain.extras == {}
  for path in plain.weights:
    np.testing.assert_allclose(plain.weights[path], cap.weights[path], rtol=1e-6, atol=1e-7)


def test_bert_capture_of_a_pair_and_padding(bert_run):
  cap = analysis.capture_text(bert_run, "the cat", target="sat")
  assert cap.tokens["tokens"] == ["[CLS]", *"the cat", "[SEP]", *"sat", "[SEP]"]
  assert list(cap.weights) == ["encoder/block_0/self_attention", "encoder/block_1/self_attention"]
  assert set(cap.kind.values()) == {"self"}
  _check_rows(cap)
  ids = [bert_run.task.tokenizer.token_to_id(t) for t in cap.tokens["tokens"]]
  padded = np.zeros((2, 20), np.int32)
  padded[0, :3] = ids[:3]
  padded[1, :len(ids)] = ids
  segments = np.zeros_like(padded)
  segments[1, 9:len(ids)] = 1
  cap2 = analysis.capture(bert_run, {"tokens": padded, "segments": segments}, example=1)
  assert cap2.tokens == cap.tokens
  for path, w in cap.weights.items():  # padding keys get no weight: the same numbers
    np.testing.assert_allclose(cap2.weights[path], w, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"keys tokens \(required\) and segments, valid"):
    analysis.capture(bert_run, {"tokens": ids, "mask": ids})
  with pytest.raises(ValueError, match="example must be in 0..1"):
    analysis.capture(bert_run, {"tokens": padded}, example=2)


def test_seq2seq_capture_teacher_forced_and_decoded(seq2seq_run):
  cap = analysis.capture_text(seq2seq_run, "9 october 1993", target="1993-10-09")
  assert cap.tokens["source"] == list("9 october 1993")
  assert cap.tokens["target"] == ["<start>", *"1993-10-09"]
  assert list(cap.weights) == ["."] and cap.kind == {".": "cross"}
  assert cap.sides == {".": ("target", "source")}
  assert cap.weights["."].shape == (1, 11, 14)
  _check_rows(cap)
  # Without a target the greedy output is captured: its rows are the decoder's own step weights.
  decoded = analysis.capture_text(seq2seq_run, "9 october 1993")
  [t] = seq2seq_run.task.translate(seq2seq_run.params, ["9 october 1993"], beam_size=1)
  assert decoded.tokens["target"][1:] == [tok for tok in t.output_tokens if tok != "<end>"][
      :len(decoded.tokens["target"]) - 1]
  rows = min(len(t.output_tokens), decoded.weights["."].shape[1])
  np.testing.assert_allclose(decoded.weights["."][0, :rows], t.weights[:rows], rtol=1e-4,
                             atol=1e-6)


def test_transformer_capture_paths_sides_and_block_outputs(transformer_run):
  cap = analysis.capture_text(transformer_run, "9 october 1993", target="1993-10-09",
                              extras=True)
  assert cap.kind == {"decoder_layer_0/cross_attention": "cross",
                      "decoder_layer_0/self_attention": "causal",
                      "encoder_layer_0/self_attention": "self"}
  assert cap.sides["decoder_layer_0/cross_attention"] == ("target", "source")
  assert cap.sides["encoder_layer_0/self_attention"] == ("source", "source")
  assert cap.weights["decoder_layer_0/cross_attention"].shape == (2, 11, 14)
  assert cap.weights["decoder_layer_0/self_attention"].shape == (2, 11, 11)
  _check_rows(cap)
  d = transformer_run.model.d_model
  assert cap.extras["encoder_layer_0/output"].shape == (14, d)
  assert cap.extras["decoder_layer_0/output"].shape == (11, d)


def test_capture_errors_name_the_choices(gpt_run):
  fake = analysis.Run(workdir=None, config=ml_collections.ConfigDict({"task": "nope"}),
                      task=None, model=object(), params=None, step=0)
  with pytest.raises(ValueError, match="supported tasks: translation, causal_lm, masked_lm"):
    analysis.capture(fake, [1, 2])
  with pytest.raises(ValueError, match="block_size=32"):
    analysis.capture(gpt_run, np.ones((40,), np.int32))


def test_extras_are_the_forward_pass_own_activations(bert_run):
  """extras=True reads the hook sites of the same forward pass (attnlab.analysis.hooks)."""
  from attnlab.analysis import hooks  # pylint: disable=g-import-not-at-top
  tok = bert_run.task.tokenizer
  ids = np.array([[tok.cls_id, *tok.encode("the cat"), tok.sep_id, *tok.encode("sat"),
                   tok.sep_id]], np.int32)
  segments = np.zeros_like(ids)
  segments[0, 9:] = 1
  inputs = {"tokens": ids, "segments": segments}
  cap = analysis.capture(bert_run, inputs, extras=True)
  _, cache = hooks.run_with_cache(bert_run, inputs)
  for i in range(2):
    path = f"encoder/block_{i}/self_attention"
    for name, site in (("queries", "q"), ("keys", "k"), ("values", "v")):
      np.testing.assert_allclose(cap.extras[f"{path}/{name}"], cache[f"blocks.{i}.attn.{site}"][0],
                                 rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cap.extras[f"{path}/context"],
                               np.swapaxes(cache[f"blocks.{i}.attn.z"][0], 0, 1), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(cap.extras[f"encoder/block_{i}/output"],
                               cache[f"blocks.{i}.resid_post"][0], rtol=1e-6, atol=1e-6)
    q, k = cap.extras[f"{path}/queries"], cap.extras[f"{path}/keys"]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    np.testing.assert_allclose(cap.extras[f"{path}/scores"], scores, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_softmax(scores, True), cap.weights[path], rtol=1e-4, atol=1e-6)
