"""GNMT (Wu et al. 2016): beam search's length normalisation and coverage penalty (eq. 14) against
NumPy written from the formula, and the RNN stack's wiring (residuals from layer 3, a bidirectional
bottom encoder layer, attention from the bottom decoder layer fed up) against a NumPy re-computation
of a 3-layer model (attnlab/decoding.py, attnlab/models/seq2seq.py, configs/seq2seq.py:preset=gnmt).
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import config_utils
from attnlab import decoding
from attnlab import run_config
from attnlab.cli import translate as translate_cli
from attnlab.errors import ConfigError
from attnlab.models import seq2seq

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "seq2seq.py")


def _config(arg: str = ""):
  return config_utils.load_config_file(f"{CONFIG}:{arg}" if arg else CONFIG)


# ------------------------------------------------------------------------------ the formulas


def np_lp(length, alpha):
  """lp(Y) = (5 + |Y|)^alpha / (5 + 1)^alpha."""
  return (5.0 + length) ** alpha / (5.0 + 1.0) ** alpha


def np_cp(weights, beta, src_len):
  """cp(X; Y) = beta * sum_{i < |X|} log(min(sum_j p_ij, 1.0)); weights [steps j, src i]."""
  return beta * sum(np.log(min(weights[:, i].sum(), 1.0)) for i in range(src_len))


def test_length_and_coverage_penalties_match_the_formula():
  rng = np.random.default_rng(0)
  lengths = np.array([1, 2, 7, 30])
  for alpha in (0.0, 0.6, 1.0):
    np.testing.assert_allclose(decoding.length_normalizer(jnp.asarray(lengths), alpha),
                               [np_lp(n, alpha) for n in lengths], rtol=1e-6)
  # [batch, steps, src]: softmax weights; 1 step leaves every sum < 1, 6 steps push some over 1.
  for steps in (1, 6):
    logits = rng.normal(size=(3, steps, 5)) * 2.0
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    src_len = np.array([5, 3, 1])
    mask = np.arange(5)[None, :] < src_len[:, None]
    got = decoding.coverage_penalty(jnp.asarray(weights.sum(1)), 0.2, jnp.asarray(mask))
    want = [np_cp(weights[b], 0.2, src_len[b]) for b in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert steps == 1 or np.any(weights.sum(1) > 1.0)  # the min(., 1) is exercised
  assert np.all(np.asarray(got)[:2] < -0.01)  # far above rounding (row 2: one position, covered)


# ------------------------------------------------------------------------------ beam search

PAD, END, VOCAB, SRC = 0, 1, 4, 4
RNG = np.random.default_rng(1)
# Toy model: logits and attention logits depend on the step and the previous token.
TABLE = (RNG.normal(size=(6, VOCAB, VOCAB)) * 2.0).astype(np.float32)  # [step, prev, next]
TABLE[:, :, PAD] = -1e4  # the model never asks for padding itself
ATTN = (RNG.normal(size=(6, VOCAB, SRC)) * 2.0).astype(np.float32)  # [step, prev, src]
START = np.array([1, 2, 3], np.int32)
SRC_LEN = np.array([4, 2, 3], np.int32)


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_weights(t, prev, src_len):
  """The toy attention: a softmax over the real source positions."""
  w = np.exp(ATTN[t, prev, :src_len] - ATTN[t, prev, :src_len].max())
  return np.concatenate([w / w.sum(), np.zeros(SRC - src_len)])


def toy_step(state, tokens):
  """state {'t': [b], 'mask': [b, src]}; aux: the step's attention weights [b, src]."""
  logits = jnp.asarray(TABLE)[state["t"], tokens]  # [batch, vocab]
  scores = jnp.where(state["mask"], jnp.asarray(ATTN)[state["t"], tokens], -jnp.inf)
  return logits, {**state, "t": state["t"] + 1}, jax.nn.softmax(scores, axis=-1)


def _mask(src_len):
  return np.arange(SRC)[None, :] < src_len[:, None]  # [batch, src]


@functools.partial(jax.jit, static_argnames=("beam_size", "max_len", "coverage"))
def _beam(start, src_len, beam_size, max_len, alpha=0.0, beta=0.0, coverage=True):
  mask = jnp.arange(SRC)[None, :] < src_len[:, None]
  state = {"t": jnp.zeros(start.shape[0], jnp.int32), "mask": mask}
  return decoding.beam_search(toy_step, state, start, beam_size=beam_size, max_len=max_len,
                              end_id=END, length_penalty=alpha, coverage_penalty=beta,
                              coverage_mask=mask if coverage else None)


def np_beam(start, src_len, k, max_len, alpha, beta):
  """Beam search written from eq. 14: at every step keep the k best extensions by
  log P / lp + cp (a finished hypothesis stays as it is). Returns [(tokens, score, length)]."""
  def score(h):
    return h["raw"] / np_lp(h["len"], alpha) + np_cp(np.array(h["w"]).reshape(-1, SRC), beta,
                                                      src_len)
  beams = [{"toks": [], "raw": 0.0, "len": 0, "w": [], "done": False, "prev": start}]
  for t in range(max_len):
    cands = []
    for h in beams:
      if h["done"]:
        cands.append({**h, "toks": h["toks"] + [PAD]})
        continue
      lp = _np_log_softmax(TABLE[t, h["prev"]])
      w = h["w"] + [_np_weights(t, h["prev"], src_len)]
      for tok in range(1, VOCAB):
        cands.append({"toks": h["toks"] + [tok], "raw": h["raw"] + lp[tok], "len": h["len"] + 1,
                      "w": w, "done": tok == END, "prev": tok})
    beams = sorted(cands, key=score, reverse=True)[:k]
  return [(h["toks"], score(h), h["len"]) for h in beams]


@pytest.mark.parametrize("k,alpha,beta", [(2, 0.0, 0.0), (2, 1.0, 0.0), (3, 0.0, 0.5),
                                          (2, 0.6, 0.2)])
def test_beam_search_matches_numpy_eq14_beam(k, alpha, beta):
  out = _beam(START, SRC_LEN, k, 4, alpha, beta)
  for b in range(len(START)):
    ref = np_beam(int(START[b]), int(SRC_LEN[b]), k, 4, alpha, beta)
    for rank, (toks, score, length) in enumerate(ref):
      np.testing.assert_array_equal(out.tokens[b, rank], toks)
      np.testing.assert_allclose(out.scores[b, rank], score, rtol=1e-4)
      assert int(out.lengths[b, rank]) == length


def test_zero_penalties_equal_the_plain_beam_search():
  # alpha = beta = 0 with the coverage path on equals the search without it, field by field, and
  # ranks by the summed log-probability (the NumPy beam above with both weights 0).
  plain = _beam(START, SRC_LEN, 3, 5, coverage=False)
  zero = _beam(START, SRC_LEN, 3, 5, 0.0, 0.0, coverage=True)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(zero)):
    np.testing.assert_array_equal(a, b)
  for b in range(len(START)):
    ref = np_beam(int(START[b]), int(SRC_LEN[b]), 3, 5, 0.0, 0.0)
    np.testing.assert_allclose(plain.scores[b], [s for _, s, _ in ref], rtol=1e-5)
  # The penalties do change the search on this toy (else the comparisons above prove little).
  gnmt = _beam(START, SRC_LEN, 3, 5, 1.0, 0.5)
  assert not np.array_equal(gnmt.tokens, plain.tokens)


def _table_step(log_probs, weights):
  """A step function of hand-made tables: log_probs[t][prev] [vocab], weights[t][prev] [src]."""
  lp_table, w_table = jnp.asarray(log_probs), jnp.asarray(weights)

  def step(state, tokens):
    t = state["t"]
    return lp_table[t, tokens], {"t": t + 1}, w_table[t, tokens]
  return step


def test_length_penalty_picks_the_hypothesis_the_formula_predicts():
  # From <start> (id 2): <end> with 0.40, token 3 with 0.60; after 3: <end> 0.60, 3 0.40.
  # A = [<end>], P = 0.40; B = [3, <end>], P = 0.36: log P favours A, log P / lp(Y) with alpha 1
  # favours B (-1.022 / (7/6) = -0.876 > -0.916 / 1).
  probs = np.full((2, 4, 4), 1e-9)
  probs[0, 2] = [1e-9, 0.40, 1e-9, 0.60]
  probs[1, 3] = [1e-9, 0.60, 1e-9, 0.40]
  log_probs = np.log(probs / probs.sum(-1, keepdims=True)).astype(np.float32)
  hyps = {(1, 0): np.log(0.40), (3, 1): np.log(0.36)}
  lengths = {(1, 0): 1, (3, 1): 2}
  step = _table_step(log_probs, np.ones((2, 4, 1), np.float32))
  winners = {}
  for alpha in (0.0, 1.0):
    predicted = max(hyps, key=lambda y: hyps[y] / np_lp(lengths[y], alpha))
    out = decoding.beam_search(step, {"t": jnp.zeros(1, jnp.int32)}, jnp.array([2], jnp.int32),
                               beam_size=2, max_len=2, end_id=END, length_penalty=alpha)
    assert tuple(np.asarray(out.tokens[0, 0])) == predicted
    np.testing.assert_allclose(out.scores[0, 0], hyps[predicted] / np_lp(lengths[predicted], alpha),
                               rtol=1e-4)
    winners[alpha] = predicted
  assert winners == {0.0: (1, 0), 1.0: (3, 1)}


def test_coverage_penalty_picks_the_hypothesis_the_formula_predicts():
  # Two 2-token outputs: A = [2, <end>] (P = 0.45) looks at source position 0 twice, B = [3, <end>]
  # (P = 0.40) at 0 then 1. cp(A) = beta * (log 1 + log 0.2), cp(B) = beta * (log 1 + log 1).
  probs = np.full((2, 4, 4), 1e-9)
  probs[0, 2] = [1e-9, 0.15, 0.45, 0.40]  # <end> at once: P 0.15, far behind both
  probs[1, 2] = [1e-9, 1.0, 1e-9, 1e-9]
  probs[1, 3] = [1e-9, 1.0, 1e-9, 1e-9]
  log_probs = np.log(probs / probs.sum(-1, keepdims=True)).astype(np.float32)
  weights = np.full((2, 4, 2), 0.5, np.float32)
  weights[0, 2] = [0.9, 0.1]  # step 0 (from <start>): position 0
  weights[1, 2] = [0.9, 0.1]  # after 2: position 0 again
  weights[1, 3] = [0.1, 0.9]  # after 3: position 1
  step = _table_step(log_probs, weights)
  total = {(2, 1): np.log(0.45), (3, 1): np.log(0.40)}
  seen = {(2, 1): weights[0, 2] + weights[1, 2], (3, 1): weights[0, 2] + weights[1, 3]}
  for beta, winner in ((0.0, (2, 1)), (0.2, (3, 1))):
    s = {y: total[y] + np_cp(seen[y][None], beta, 2) for y in total}
    assert max(s, key=s.get) == winner  # the formula's choice
    out = decoding.beam_search(step, {"t": jnp.zeros(1, jnp.int32)}, jnp.array([2], jnp.int32),
                               beam_size=2, max_len=2, end_id=END, coverage_penalty=beta,
                               coverage_mask=jnp.ones((1, 2), bool))
    assert tuple(np.asarray(out.tokens[0, 0])) == winner
    np.testing.assert_allclose(out.scores[0, :2], sorted(s.values(), reverse=True), rtol=1e-4)


def test_coverage_needs_a_mask_and_attention_weights():
  state = {"t": jnp.zeros(1, jnp.int32)}
  step = _table_step(np.zeros((2, 4, 4), np.float32), np.ones((2, 4, 3), np.float32))
  with pytest.raises(ValueError, match="coverage_mask"):
    decoding.beam_search(step, state, jnp.array([2]), beam_size=2, max_len=2, end_id=END,
                         coverage_penalty=0.2)
  with pytest.raises(ValueError, match="attention weights"):
    decoding.beam_search(step, state, jnp.array([2]), beam_size=2, max_len=2, end_id=END,
                         coverage_penalty=0.2, coverage_mask=jnp.ones((1, 5), bool))


# ------------------------------------------------------------------------------ the GNMT stack

V_SRC, V_TGT, EMBED, HIDDEN = 9, 11, 6, 8
SRC_TOKENS = np.array([[3, 4, 5, 6], [8, 3, 5, 7]], np.int32)  # full length: no padding
SRC_LENGTHS = np.array([4, 4], np.int32)
TGT_IN = np.array([[1, 3, 4], [1, 6, 7]], np.int32)
GNMT = dict(cell="lstm", bidirectional=True, bidirectional_layers=1, residual_start=3,
            attention_from="bottom")


def _model(**kw):
  return seq2seq.Seq2Seq(V_SRC, V_TGT, embed_dim=EMBED, hidden_dim=HIDDEN,
                         max_src_len=SRC_TOKENS.shape[1], **kw)


def _param_shapes(model):
  init = lambda rng: model.init({"params": rng, "sample": rng}, SRC_TOKENS, SRC_LENGTHS, TGT_IN)
  shapes = jax.eval_shape(init, jax.random.key(0))["params"]
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf.shape
          for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}


def test_gnmt_parameter_shapes():
  shapes = _param_shapes(_model(num_layers=4, attention="bahdanau", **GNMT))
  enc = "encoder"
  # The bottom encoder layer alone reads both ways; layer 2 reads its 2 * hidden states.
  assert f"{enc}/layer0_fwd/ii/kernel" in shapes and f"{enc}/layer0_bwd/ii/kernel" in shapes
  assert not any(f"{enc}/layer{i}_fwd" in k for k in shapes for i in (1, 2, 3))
  assert shapes[f"{enc}/layer1/ii/kernel"] == (2 * HIDDEN, HIDDEN)
  assert shapes[f"{enc}/layer2/ii/kernel"] == shapes[f"{enc}/layer3/ii/kernel"] == (HIDDEN, HIDDEN)
  # One bridge (the bidirectional layer's final state); the top encoder states are hidden wide.
  assert sorted(k.split("/")[0] for k in shapes if k.startswith("bridge")) == ["bridge_0"] * 2
  # Decoder: the bottom cell reads [embedding; context], every cell above [output below; context].
  dec = "decoder_cell"
  assert shapes[f"{dec}/cell_0/ii/kernel"] == (EMBED + HIDDEN, HIDDEN)
  for i in (1, 2, 3):
    assert shapes[f"{dec}/cell_{i}/ii/kernel"] == (2 * HIDDEN, HIDDEN)
  assert shapes["output/kernel"] == (2 * HIDDEN, V_TGT)
  # The plain stack (the defaults): every encoder layer bidirectional, context at the bottom only.
  plain = _param_shapes(_model(num_layers=4, cell="lstm", bidirectional=True))
  assert plain[f"{enc}/layer1_fwd/ii/kernel"] == (2 * HIDDEN, HIDDEN)
  assert plain[f"{dec}/cell_0/ii/kernel"] == (EMBED + 2 * HIDDEN, HIDDEN)
  assert plain[f"{dec}/cell_1/ii/kernel"] == (HIDDEN, HIDDEN)
  assert sorted({k.split("/")[0] for k in plain if k.startswith("bridge")}) == [
      f"bridge_{i}" for i in range(4)]


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _np_lstm(p, carry, x):
  """Flax LSTMCell: i, f, g, o gates; input kernels without bias, recurrent ones with."""
  c, h = carry
  gate = lambda name: x @ p["i" + name]["kernel"] + h @ p["h" + name]["kernel"] + p["h" + name][
      "bias"]
  i, f, g, o = _sigmoid(gate("i")), _sigmoid(gate("f")), np.tanh(gate("g")), _sigmoid(gate("o"))
  c = f * c + i * g
  return (c, o * np.tanh(c)), o * np.tanh(c)


def _np_run(p, xs, reverse=False):
  carry, out = (np.zeros(HIDDEN), np.zeros(HIDDEN)), []
  for x in (xs[::-1] if reverse else xs):
    carry, y = _np_lstm(p, carry, x)
    out.append(y)
  return carry, np.stack(out[::-1] if reverse else out)


def _np_encode(p, tokens, residual_start):
  """3 layers: bidirectional bottom, then two unidirectional ones; layer 3 adds its input."""
  x = p["embed"]["embedding"][tokens]  # [src, embed]
  (cf, hf), fwd = _np_run(p["layer0_fwd"], x)
  (cb, hb), bwd = _np_run(p["layer0_bwd"], x, reverse=True)
  finals = [(np.concatenate([cf, cb]), np.concatenate([hf, hb]))]
  x = np.concatenate([fwd, bwd], -1)  # [src, 2 * hidden]
  for layer in (1, 2):
    final, y = _np_run(p[f"layer{layer}"], x)
    x = y + x if residual_start and layer + 1 >= residual_start else y
    finals.append(final)
  return x, finals


def _np_decode_step(p, carry, token, keys, values, attention, residual_start):
  """One step of the 3-layer decoder with attention from the bottom layer (dot score)."""
  dec = p["decoder_cell"]
  emb = p["tgt_embed"]["embedding"][token]

  def attend(query):
    s = keys @ query
    w = np.exp(s - s.max())
    w = w / w.sum()
    return w @ values, w

  def layers(rnn, x, first, context):
    new = []
    for i, c in enumerate(rnn, start=first):
      c, y = _np_lstm(dec[f"cell_{i}"], c, x if i == 0 else np.concatenate([x, context]))
      x = y + x if residual_start and i + 1 >= residual_start else y
      new.append(c)
    return new, x

  rnn = carry["rnn"]
  if attention == "bahdanau":
    context, w = attend(rnn[0][1])  # the bottom layer's previous h
    rnn, h = layers(rnn, np.concatenate([emb, context]), 0, context)
    features = np.concatenate([h, context])
  else:  # luong with input feeding: the bottom layer's new h queries
    first, h1 = layers(rnn[:1], np.concatenate([emb, carry["feed"]]), 0, None)
    context, w = attend(h1)
    rest, h = layers(rnn[1:], h1, 1, context)
    rnn = first + rest
    features = np.tanh(np.concatenate([context, h]) @ dec["combine"]["kernel"])
  logits = features @ p["output"]["kernel"] + p["output"]["bias"]
  return logits, rnn, w


@pytest.mark.parametrize("attention,residual_start", [("bahdanau", 3), ("luong", 3),
                                                      ("bahdanau", 0)])
def test_gnmt_stack_matches_numpy(attention, residual_start):
  # score=dot: no score parameters, and the top encoder layer's states are hidden wide as the
  # decoder's, so keys = values = the encoder states.
  model = _model(num_layers=3, attention=attention, score="dot",
                 **{**GNMT, "residual_start": residual_start})
  params = model.init({"params": jax.random.key(1), "sample": jax.random.key(1)}, SRC_TOKENS,
                      SRC_LENGTHS, TGT_IN)["params"]
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  state = seq2seq.init_decode_state(model, params, SRC_TOKENS, SRC_LENGTHS)
  # A random carry for the step: every layer's (c, h) and the fed-back attentional state.
  rng = np.random.default_rng(2)
  carry = {"rnn": tuple((rng.normal(size=(2, HIDDEN)).astype(np.float32),
                         rng.normal(size=(2, HIDDEN)).astype(np.float32)) for _ in range(3)),
           "feed": rng.normal(size=(2, HIDDEN)).astype(np.float32)}
  tokens = np.array([3, 5], np.int32)
  logits, new_state, weights = seq2seq.make_step_fn(model, params)(
      {**state, "carry": carry}, jnp.asarray(tokens))
  for b in range(2):
    states, finals = _np_encode(p["encoder"], SRC_TOKENS[b], residual_start)
    np.testing.assert_allclose(state["memory"]["values"][b], states, atol=1e-5)
    np.testing.assert_allclose(state["memory"]["keys"][b], states, atol=1e-5)
    # The decoder starts from the bridged bidirectional final state and the others as they are.
    bridged = [np.tanh(a @ p["bridge_0"]["kernel"] + p["bridge_0"]["bias"]) for a in finals[0]]
    for layer, want in enumerate([bridged] + finals[1:]):
      for got, ref in zip(state["carry"]["rnn"][layer], want):
        np.testing.assert_allclose(got[b], ref, atol=1e-5)
    row = {"rnn": [tuple(np.asarray(x[b], np.float64) for x in c) for c in carry["rnn"]],
           "feed": np.asarray(carry["feed"][b], np.float64)}
    ref_logits, ref_rnn, ref_w = _np_decode_step(p, row, tokens[b], states, states, attention,
                                                 residual_start)
    np.testing.assert_allclose(logits[b], ref_logits, atol=1e-4)
    np.testing.assert_allclose(weights[b], ref_w, atol=1e-5)
    for got, ref in zip(new_state["carry"]["rnn"], ref_rnn):
      np.testing.assert_allclose(got[1][b], ref[1], atol=1e-5)
  if residual_start:
    # The residual matters on this model: without it layer 3's output (the top states) differs.
    plain, _ = _np_encode(p["encoder"], SRC_TOKENS[0], 0)
    assert np.abs(plain - np.asarray(state["memory"]["values"][0])).max() > 1e-2


def _family(name):
  """(model, params, make_step_fn, init_decode_state, teacher-forced weights fn) of a tiny model."""
  from attnlab.models import transformer  # pylint: disable=g-import-not-at-top
  src, tgt = np.array([[3, 4, 5, 6], [8, 3, 0, 0]], np.int32), TGT_IN
  if name == "seq2seq":
    model = _model(num_layers=3, attention="bahdanau", **GNMT)
    module = seq2seq
    weights = lambda inter, aux: np.asarray(aux["attention_weights"])
  else:
    model = transformer.Transformer(src_vocab_size=V_SRC, tgt_vocab_size=V_TGT, num_layers=1,
                                    num_decoder_layers=2, num_heads=2, d_model=16, mlp_dim=32,
                                    max_len=10)
    module = transformer
    # The last decoder layer's cross-attention, averaged over its heads: [batch, tgt, src].
    weights = lambda inter, aux: np.asarray(
        inter["decoder_layer_1"]["cross_attention"]["attention_weights"][0]).mean(axis=1)
  params = model.init({"params": jax.random.key(3), "sample": jax.random.key(3)}, src,
                      np.array([4, 2], np.int32), tgt)["params"]
  return model, params, module, weights


@pytest.mark.parametrize("family", ["seq2seq", "transformer"])
def test_beam_scores_are_eq14_of_the_models_own_attention(family):
  # The beam's best score equals eq. 14 recomputed from a teacher-forced pass of the model over
  # the chosen output: log P from its logits, cp from its attention weights (the RNN's; the
  # Transformer's last decoder layer's cross-attention averaged over heads).
  model, params, module, weights_of = _family(family)
  src, src_len = np.array([[3, 4, 5, 6], [8, 3, 0, 0]], np.int32), np.array([4, 2], np.int32)
  alpha, beta, steps, start, end = 0.6, 0.5, 3, 1, 2
  out = decoding.beam_search(
      module.make_step_fn(model, params), module.init_decode_state(model, params, src, src_len),
      jnp.full((2,), start, jnp.int32), beam_size=3, max_len=steps, end_id=end,
      length_penalty=alpha, coverage_penalty=beta,
      coverage_mask=jnp.arange(4)[None, :] < src_len[:, None])
  tokens, lengths = np.asarray(out.tokens[:, 0]), np.asarray(out.lengths[:, 0])
  tgt_in = np.concatenate([np.full((2, 1), start), tokens[:, :-1]], axis=1).astype(np.int32)
  (logits, aux), state = model.apply({"params": params}, src, src_len, tgt_in,
                                     mutable=["intermediates"])
  log_probs = _np_log_softmax(np.asarray(logits, np.float64))  # [batch, steps, vocab]
  weights = weights_of(state["intermediates"], aux)  # [batch, steps, src]
  for b in range(2):
    n = lengths[b]
    log_p = sum(log_probs[b, j, tokens[b, j]] for j in range(n))
    want = log_p / np_lp(n, alpha) + np_cp(weights[b, :n], beta, src_len[b])
    np.testing.assert_allclose(out.scores[b, 0], want, rtol=1e-4)
  # The coverage term is in play: 3 steps leave row 0's 4 positions short of 1.
  assert np_cp(weights[0, :lengths[0]], beta, 4) < -0.05


# ------------------------------------------------------------------------------ config and CLI


def test_preset_sets_the_gnmt_keys_and_the_defaults_stay():
  default = _config().model
  assert (default.residual_start, default.bidirectional_layers, default.attention_from,
          default.cell, default.num_layers) == (0, 0, "top", "gru", 1)
  gnmt = _config("preset=gnmt").model
  assert (gnmt.cell, gnmt.num_layers, gnmt.bidirectional, gnmt.bidirectional_layers,
          gnmt.residual_start, gnmt.attention_from) == ("lstm", 8, True, 1, 3, "bottom")
  # Keys after the preset win; runlocal applies the arg again and keeps them.
  small = _config("preset=gnmt,model.num_layers=4,model.residual_start=0,runlocal=True").model
  assert (small.num_layers, small.residual_start, small.attention_from) == (4, 0, "bottom")
  with pytest.raises(ConfigError, match="valid presets: gnmt"):
    _config("preset=gpt")


@pytest.mark.parametrize("arg,words", [
    ("preset=gnmt,model.residual_start=2", "start at 3"),
    ("preset=gnmt,model.residual_start=1", "layer >= 2"),
    ("preset=gnmt,attention=none", "model.attention_from=bottom needs"),
    ("model.bidirectional_layers=2", "lie in 0..model.num_layers=1"),
    ("model.bidirectional=False,model.num_layers=2,model.bidirectional_layers=1",
     "needs model.bidirectional=True"),
    ("model.attention_from=middle", "valid choices: top, bottom"),
])
def test_bad_wiring_is_one_config_error(arg, words):
  config = _config(arg)
  with pytest.raises(ConfigError, match=words):
    seq2seq.from_config(config.model, V_SRC, V_TGT, 5)


def test_old_run_configs_read_the_plain_stack():
  new = run_config.to_jsonable(_config())
  old = run_config.to_jsonable(_config())
  for key in ("bidirectional_layers", "residual_start", "attention_from"):
    del old["model"][key]
  del old["decode"]["coverage_penalty"]
  assert run_config.config_diff(old, new) == []  # resumes without allow_config_change
  model = seq2seq.from_config(run_config.from_jsonable(old).model, V_SRC, V_TGT, 5)
  assert (model.residual_start, model.bidirectional_layers, model.attention_from) == (0, 0, "top")


def test_translation_penalties_are_checked():
  from attnlab.tasks import translation  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match="model.attention=none has none"):
    translation.TranslationTask(_config("runlocal=True,attention=none,"
                                        "decode.coverage_penalty=0.2"))
  with pytest.raises(ConfigError, match="decode.length_penalty=-0.5 must be a number >= 0"):
    translation.TranslationTask(_config("runlocal=True,decode.length_penalty=-0.5"))


@pytest.mark.parametrize("flag", ["--length_penalty=-1", "--coverage_penalty=nan"])
def test_translate_cli_rejects_bad_penalties(flag, capsys):
  assert translate_cli.main(["translate", "--workdir=/nonexistent", flag, "hello"]) == 2
  assert "must be a number >= 0" in capsys.readouterr().err
