"""RNN encoder-decoder (attnlab/models/seq2seq.py) against NumPy references on a tiny model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab import decoding
from attnlab.attention import core as attn_core
from attnlab.models import seq2seq

V_SRC, V_TGT, EMBED, HIDDEN = 9, 11, 6, 8
END_ID = 2
# Three sources of lengths 5, 3, 1 (0 = padding) and teacher-forced decoder inputs.
SRC = np.array([[3, 4, 5, 6, 7], [8, 3, 5, 0, 0], [4, 0, 0, 0, 0]], np.int32)
SRC_LEN = np.array([5, 3, 1], np.int32)
TGT_IN = np.array([[1, 3, 4, 5], [1, 6, 7, 8], [1, 9, 0, 0]], np.int32)
TGT_OUT = np.array([[3, 4, 5, 2], [6, 7, 8, 2], [9, 2, 0, 0]], np.int32)


# XLA's backend optimisations triple the compile time of these tiny scans and buy nothing here.
_FAST_COMPILE = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}


def _compile(fn, *args):
  """`fn` jit-compiled for `args` (compiled once; call it with arrays of the same shapes)."""
  return jax.jit(fn).lower(*args).compile(compiler_options=_FAST_COMPILE)


def _model(**kw) -> seq2seq.Seq2Seq:
  return seq2seq.Seq2Seq(V_SRC, V_TGT, embed_dim=EMBED, hidden_dim=HIDDEN,
                         max_src_len=SRC.shape[1], **kw)


def _init(model, seed=0):
  init = lambda rng: model.init({"params": rng, "sample": rng}, SRC, SRC_LEN, TGT_IN)["params"]
  rng = jax.random.key(seed)
  return _compile(init, rng)(rng)


# ------------------------------------------------------------------------------ NumPy reference


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _np_gru(p, h, x):
  """Flax GRUCell: r, z gates; n = tanh(W_in x + b_in + r * (W_hn h + b_hn))."""
  dense = lambda name, v: v @ p[name]["kernel"] + p[name].get("bias", 0.0)
  r = _sigmoid(dense("ir", x) + dense("hr", h))
  z = _sigmoid(dense("iz", x) + dense("hz", h))
  n = np.tanh(dense("in", x) + r * dense("hn", h))
  return (1.0 - z) * n + z * h


def _np_softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def _np_encode(p, tokens, length, bidirectional):
  """One example: states [length, enc_dim] and the final state [enc_dim]."""
  x = p["embed"]["embedding"][tokens[:length]]  # [length, embed]
  if not bidirectional:
    h, states = np.zeros(HIDDEN), []
    for x_t in x:
      h = _np_gru(p["layer0"], h, x_t)
      states.append(h)
    return np.stack(states), h
  h_f, fwd = np.zeros(HIDDEN), []
  for x_t in x:
    h_f = _np_gru(p["layer0_fwd"], h_f, x_t)
    fwd.append(h_f)
  h_b, bwd = np.zeros(HIDDEN), []
  for x_t in x[::-1]:
    h_b = _np_gru(p["layer0_bwd"], h_b, x_t)
    bwd.append(h_b)
  states = np.concatenate([np.stack(fwd), np.stack(bwd[::-1])], axis=-1)  # [length, 2 * hidden]
  return states, np.concatenate([h_f, h_b])


def _np_local_m(scores, t, half_width):
  """Luong et al. 2015 local-m (eq. 7 over the window): p_t = t, clipped to the last source
  position; a_t = softmax of the scores over [p_t - D, p_t + D], zero outside."""
  n = len(scores)
  p_t = min(t, n - 1)
  inside = np.abs(np.arange(n) - p_t) <= half_width
  a = np.zeros(n)
  a[inside] = _np_softmax(scores[inside])
  return a


def _np_seq2seq(params, attention, bidirectional, local_m_width=None, projected=False):
  """Logits [batch, tgt_len, vocab] and weights [batch, tgt_len, src_len] of a 1-layer GRU.

  bahdanau uses the additive score, luong the general score with input feeding; with
  local_m_width D the weights are local-m's window of half-width D (global otherwise). With
  projected, the scores read keys W_k h and the context averages values W_v h (else both are h).
  """
  attend = (_np_softmax if local_m_width is None
            else lambda scores: _np_local_m(scores, t, local_m_width))
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  dec = p["decoder_cell"]
  batch, tgt_len = TGT_IN.shape
  logits = np.zeros((batch, tgt_len, V_TGT))
  weights = np.zeros((batch, tgt_len, SRC.shape[1]))
  for b in range(batch):
    n = SRC_LEN[b]
    states, h = _np_encode(p["encoder"], SRC[b], n, bidirectional)
    keys = values = states  # [n, enc_dim]
    if projected:
      keys, values = states @ p["key_proj"]["kernel"], states @ p["value_proj"]["kernel"]
    if bidirectional:
      h = np.tanh(h @ p["bridge_0"]["kernel"] + p["bridge_0"]["bias"])
    feed = np.zeros(HIDDEN)
    for t in range(tgt_len):
      e = p["tgt_embed"]["embedding"][TGT_IN[b, t]]
      if attention == "bahdanau":
        s = dec["score"]
        scores = np.tanh(h @ s["w_q"] + keys @ s["w_k"]) @ s["v"]  # [n]
        a = attend(scores)
        c = a @ values
        h = _np_gru(dec["cell_0"], h, np.concatenate([e, c]))
        features = np.concatenate([h, c])
      else:
        h = _np_gru(dec["cell_0"], h, np.concatenate([e, feed]))
        scores = keys @ (dec["score"]["w"].T @ h)  # h W k_j: [n]
        a = attend(scores)
        c = a @ values
        features = np.tanh(np.concatenate([c, h]) @ dec["combine"]["kernel"])
        feed = features
      weights[b, t, :n] = a
      logits[b, t] = features @ p["output"]["kernel"] + p["output"]["bias"]
  return logits, weights


@pytest.mark.parametrize("attention,score,bidirectional", [
    ("bahdanau", "additive", False),
    ("luong", "general", True),
])
def test_scan_decoder_matches_numpy_reference(attention, score, bidirectional):
  model = _model(attention=attention, score=score, bidirectional=bidirectional)
  params = _init(model)
  apply = lambda p: model.apply({"params": p}, SRC, SRC_LEN, TGT_IN, mutable=["intermediates"])
  (logits, aux), state = _compile(apply, params)(params)
  ref_logits, ref_weights = _np_seq2seq(params, attention, bidirectional)
  np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(aux["attention_weights"], ref_weights, atol=2e-6)
  # Padding positions get exactly zero weight; the sown weights are the returned ones.
  for b, n in enumerate(SRC_LEN):
    assert np.all(np.asarray(aux["attention_weights"])[b, :, n:] == 0.0)
  sown = state["intermediates"]["attention_weights"][0]
  np.testing.assert_array_equal(sown, aux["attention_weights"])


@pytest.mark.parametrize("attention,score", [("luong", "general"), ("bahdanau", "additive")])
def test_local_m_window_matches_numpy_reference(attention, score):
  half_width = 1
  model = _model(attention=attention, score=score, window="local_m",
                 local_half_width=half_width)
  params = _init(model)
  apply = lambda p: model.apply({"params": p}, SRC, SRC_LEN, TGT_IN)
  logits, aux = _compile(apply, params)(params)
  ref_logits, ref_weights = _np_seq2seq(params, attention, False, local_m_width=half_width)
  weights = np.asarray(aux["attention_weights"])
  np.testing.assert_allclose(weights, ref_weights, atol=2e-6)
  np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-4)
  # The window's centre is t, then the source's last position (lengths 5, 3, 1; D = 1):
  # example 1 (length 3) at t = 3 keeps positions 1..2 only; example 2 always position 0.
  support = weights > 0
  assert support[0, 0].tolist() == [True, True, False, False, False]
  assert support[0, 3].tolist() == [False, False, True, True, True]
  assert support[1, 3].tolist() == [False, True, True, False, False]
  np.testing.assert_allclose(weights[2, :, 0], 1.0, atol=1e-6)
  np.testing.assert_allclose(weights.sum(-1)[TGT_OUT > 0], 1.0, atol=1e-5)


@pytest.mark.parametrize("attention,score", [("luong", "general"), ("bahdanau", "additive")])
def test_projected_keys_and_values_match_numpy_reference(attention, score):
  model = _model(attention=attention, score=score, attention_values="projected")
  params = _init(model)
  assert params["key_proj"]["kernel"].shape == (HIDDEN, HIDDEN)
  assert params["value_proj"]["kernel"].shape == (HIDDEN, HIDDEN)
  apply = lambda p: model.apply({"params": p}, SRC, SRC_LEN, TGT_IN)
  logits, aux = _compile(apply, params)(params)
  ref_logits, ref_weights = _np_seq2seq(params, attention, False, projected=True)
  np.testing.assert_allclose(aux["attention_weights"], ref_weights, atol=2e-6)
  np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-4)
  # The values are not the states: the reference that averages the states is far off.
  states_logits, _ = _np_seq2seq(params, attention, False)
  assert np.abs(np.asarray(logits) - states_logits).max() > 1e-2


def test_states_values_add_no_parameters():
  """attention_values=states (the default) is the model without the key: same parameters."""
  params = _init(_model(attention="luong", score="general", attention_values="states"))
  assert "value_proj" not in params and "key_proj" not in params
  default = _init(_model(attention="luong", score="general"))
  jax.tree.map(np.testing.assert_array_equal, params, default)


# ------------------------------------------------------------------------------ every variant trains

# One variant per score; together they cover every attention style, window, cell and layout.
VARIANTS = [
    dict(attention="none"),
    dict(attention="bahdanau", score="dot", bidirectional=True),
    dict(attention="luong", score="scaled_dot", window="local"),
    dict(attention="luong", score="general", window="hard", cell="lstm"),
    dict(attention="bahdanau", score="cosine", window="local", cell="lstm"),
    dict(attention="luong", score="location", input_feeding=False, num_layers=2),
    dict(attention="bahdanau", score="additive", window="hard", bidirectional=True),
    dict(attention="luong", score="dot", window="local_m", bidirectional=True),
    dict(attention="bahdanau", score="general", attention_values="projected", bidirectional=True),
]


def _loss(model, params, rng):
  """Token cross-entropy (+ REINFORCE for hard attention), the way the translation task trains."""
  rngs = {"sample": rng, "dropout": rng}
  logits, aux = model.apply({"params": params}, SRC, SRC_LEN, TGT_IN, deterministic=False,
                            rngs=rngs)
  valid = TGT_OUT > 0
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, TGT_OUT)  # [batch, tgt_len]
  ce = jnp.sum(nll * valid) / jnp.sum(valid)
  reward = -jnp.sum(nll * valid, axis=1) / jnp.sum(valid, axis=1)  # [batch]
  rl = 0.0
  if "log_prob" in aux:  # hard attention
    rl = attn_core.reinforce_loss(aux["log_prob"], reward, jnp.mean(reward), valid=valid)
  return ce + rl, (ce, aux["attention_weights"])


def _train_one_step(model):
  """Init, one SGD step and the loss after it, in one compiled function."""
  tx = optax.sgd(0.3)
  grad_fn = jax.value_and_grad(functools.partial(_loss, model), has_aux=True)

  def run(rng):
    params = model.init({"params": rng, "sample": rng}, SRC, SRC_LEN, TGT_IN)["params"]
    (_, (loss_before, weights)), grads = grad_fn(params, rng)
    updates, _ = tx.update(grads, tx.init(params), params)
    _, (loss_after, _) = _loss(model, optax.apply_updates(params, updates), rng)
    return jnp.stack([loss_before, loss_after]), weights, grads

  rng = jax.random.key(0)
  return _compile(run, rng)(rng)


@pytest.mark.slow
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_every_variant_trains_with_finite_loss(kw):
  losses, weights, grads = _train_one_step(_model(dropout_rate=0.1, **kw))
  losses = np.asarray(losses)
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < losses[0], losses
  weights = np.asarray(weights)
  assert weights.shape == TGT_IN.shape + SRC.shape[1:]
  for b, n in enumerate(SRC_LEN):
    assert np.all(weights[b, :, n:] == 0.0)
  if kw["attention"] != "none":
    assert np.all(weights.sum(-1) <= 1.0 + 1e-5)
    # The score (or position predictor) learns: hard attention only through REINFORCE.
    dec_grads = grads["decoder_cell"]
    learnt = [dec_grads[k] for k in ("score", "w_p") if k in dec_grads]
    if learnt:
      assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(learnt))


# ------------------------------------------------------------------------------ decoding


@pytest.fixture(scope="module")
def luong_local():
  """A 2-layer LSTM Luong model with a local window, biased towards emitting <end>."""
  model = _model(attention="luong", score="general", window="local", cell="lstm", num_layers=2,
                 bidirectional=True)
  params = _init(model, seed=3)
  params["output"]["bias"] = params["output"]["bias"].at[END_ID].add(1.5)
  return model, params


def test_decode_step_matches_scan(luong_local):
  model, params = luong_local
  apply = lambda p: model.apply({"params": p}, SRC, SRC_LEN, TGT_IN)
  logits, aux = _compile(apply, params)(params)
  encode = lambda p: seq2seq.init_decode_state(model, p, SRC, SRC_LEN)
  state = _compile(encode, params)(params)
  step_fn = _compile(seq2seq.make_step_fn(model, params), state, TGT_IN[:, 0])
  for t in range(TGT_IN.shape[1]):
    step_logits, state, weights = step_fn(state, TGT_IN[:, t])
    np.testing.assert_allclose(step_logits, logits[:, t], atol=1e-5)
    np.testing.assert_allclose(weights, aux["attention_weights"][:, t], atol=1e-6)


@pytest.fixture(scope="module")
def greedy_and_beams(luong_local):
  model, params = luong_local
  encode = lambda p: seq2seq.init_decode_state(model, p, SRC, SRC_LEN)
  state = _compile(encode, params)(params)
  start = jnp.ones(SRC.shape[0], jnp.int32)
  step_fn = seq2seq.make_step_fn(model, params)
  greedy = functools.partial(decoding.greedy, step_fn, max_len=6, end_id=END_ID)
  beam1 = functools.partial(decoding.beam_search, step_fn, beam_size=1, max_len=6, end_id=END_ID)
  beam3 = functools.partial(decoding.beam_search, step_fn, beam_size=3, max_len=6, end_id=END_ID)
  return tuple(_compile(fn, state, start)(state, start) for fn in (greedy, beam1, beam3))


def test_greedy_stops_at_end_and_matches_teacher_forcing(luong_local, greedy_and_beams):
  model, params = luong_local
  out, _, _ = greedy_and_beams
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  ended = 0
  for row, n in zip(tokens, lengths):
    ends = np.flatnonzero(row == END_ID)
    expected = ends[0] + 1 if len(ends) else len(row)
    assert n == expected
    assert np.all(row[n:] == 0)  # padding after <end>
    ended += len(ends) > 0
  assert ended >= 1  # the biased model ends at least one sequence early
  # Feeding the greedy output back with teacher forcing reproduces it and its attention.
  tgt_in = np.concatenate([np.ones((len(tokens), 1), np.int32), tokens[:, :-1]], axis=1)
  apply = lambda p, tgt_in: model.apply({"params": p}, SRC, SRC_LEN, tgt_in)
  logits, aux = _compile(apply, params, tgt_in)(params, tgt_in)
  for b, n in enumerate(lengths):
    np.testing.assert_array_equal(np.argmax(logits[b, :n], -1), tokens[b, :n])
    np.testing.assert_allclose(out.aux[b, :n], aux["attention_weights"][b, :n], atol=1e-6)
    assert np.all(np.asarray(out.aux)[b, :, SRC_LEN[b]:] == 0.0)


def test_beam_size_one_equals_greedy_and_beams_are_ranked(greedy_and_beams):
  greedy, beam1, beam3 = greedy_and_beams
  np.testing.assert_array_equal(beam1.tokens[:, 0], greedy.tokens)
  np.testing.assert_array_equal(beam1.lengths[:, 0], greedy.lengths)
  np.testing.assert_allclose(beam1.aux[:, 0], greedy.aux, atol=1e-6)
  assert beam3.tokens.shape == (SRC.shape[0], 3, 6)
  assert beam3.aux.shape == (SRC.shape[0], 3, 6, SRC.shape[1])
  scores = np.asarray(beam3.scores)
  assert np.all(np.diff(scores, axis=1) <= 1e-6)


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("kw,words", [
    (dict(attention="soft"), ["attention", "bahdanau", "luong", "none"]),
    (dict(window="wide"), ["window", "global", "local", "local_m", "hard"]),
    (dict(cell="rnn"), ["cell", "gru", "lstm"]),
    (dict(attention_values="keys"), ["attention_values", "states", "projected"]),
    (dict(score="mlp"), ["score", "additive", "scaled_dot"]),
])
def test_unknown_names_list_the_valid_ones(kw, words):
  with pytest.raises(ValueError) as info:
    _init(_model(**kw))
  for word in words:
    assert word in str(info.value)


def test_location_score_needs_max_src_len():
  model = seq2seq.Seq2Seq(V_SRC, V_TGT, embed_dim=EMBED, hidden_dim=HIDDEN, score="location")
  with pytest.raises(ValueError, match="max_src_len"):
    _init(model)
