"""Decoding against NumPy references on a toy Markov-chain 'model'."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import decoding

PAD, END, VOCAB = 0, 1, 4
RNG = np.random.default_rng(0)
# The toy model: next-token logits depend on the previous token and the step number.
TABLE = RNG.normal(size=(6, VOCAB, VOCAB)).astype(np.float32) * 2.0  # [step, prev, next]
TABLE[:, :, PAD] = -1e4  # the model never asks for padding itself


def toy_step(state, tokens):
  """state: {'t': [batch]} step counters; aux: the token fed in, to check beam reordering."""
  logits = jnp.asarray(TABLE)[state["t"], tokens]  # [batch, vocab]
  return logits, {"t": state["t"] + 1}, tokens


def np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_greedy(start, max_len):
  out, prev, score, done = [], start, 0.0, False
  for t in range(max_len):
    if done:
      out.append(PAD)
      continue
    lp = np_log_softmax(TABLE[t, prev])
    tok = int(np.argmax(lp))
    score += lp[tok]
    out.append(tok)
    prev, done = tok, tok == END
  return out, score


def np_all_hypotheses(start, max_len):
  """Every output of max_len steps (tokens 1..3, padding after <end>) with its log-probability."""
  hyps = {}
  for seq in itertools.product(range(1, VOCAB), repeat=max_len):
    if END in seq:
      seq = seq[:seq.index(END) + 1] + (PAD,) * (max_len - seq.index(END) - 1)
    if seq in hyps:
      continue
    prev, score = start, 0.0
    for t, tok in enumerate(seq):
      if tok == PAD:
        break
      score += np_log_softmax(TABLE[t, prev])[tok]
      prev = tok
    hyps[seq] = score
  return hyps


def _state(batch):
  return {"t": jnp.zeros(batch, jnp.int32)}


START = jnp.array([1, 2, 3], jnp.int32)


@functools.partial(jax.jit, static_argnames=("max_len",))
def _greedy(start, max_len):
  return decoding.greedy(toy_step, _state(start.shape[0]), start, max_len=max_len, end_id=END)


@functools.partial(jax.jit, static_argnames=("beam_size", "max_len"))
def _beam(start, beam_size, max_len, length_penalty=0.0):
  return decoding.beam_search(toy_step, _state(start.shape[0]), start, beam_size=beam_size,
                              max_len=max_len, end_id=END, length_penalty=length_penalty)


def test_greedy_matches_numpy_and_stops_at_end():
  out = _greedy(START, 5)
  for b, s in enumerate(np.asarray(START)):
    ref_tokens, ref_score = np_greedy(int(s), 5)
    np.testing.assert_array_equal(out.tokens[b], ref_tokens)
    np.testing.assert_allclose(out.scores[b], ref_score, rtol=1e-5)
    ref_len = ref_tokens.index(END) + 1 if END in ref_tokens else 5
    assert int(out.lengths[b]) == ref_len
    # Nothing but padding after <end>.
    assert all(tok == PAD for tok in ref_tokens[ref_len:])
  # aux is stacked batch-first: the token fed in at each step.
  assert out.aux.shape == (3, 5)
  np.testing.assert_array_equal(out.aux[:, 0], START)
  np.testing.assert_array_equal(out.aux[:, 1:][out.tokens[:, :-1] != PAD],
                                out.tokens[:, :-1][out.tokens[:, :-1] != PAD])


def test_beam_size_one_equals_greedy():
  g, b = _greedy(START, 5), _beam(START, 1, 5)
  np.testing.assert_array_equal(b.tokens[:, 0], g.tokens)
  np.testing.assert_array_equal(b.lengths[:, 0], g.lengths)
  np.testing.assert_allclose(b.scores[:, 0], g.scores, rtol=1e-5)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_wide_beam_is_exhaustive_search(length_penalty):
  # 27 beams hold every hypothesis of 3 steps over 3 tokens: the search is exact.
  max_len, width = 3, 27
  out = _beam(START, width, max_len, length_penalty)
  for b, s in enumerate(np.asarray(START)):
    hyps = np_all_hypotheses(int(s), max_len)
    lengths = {seq: sum(tok != PAD for tok in seq) for seq in hyps}
    norm = {seq: sc / ((5 + lengths[seq]) / 6) ** length_penalty for seq, sc in hyps.items()}
    best = sorted(norm, key=norm.get, reverse=True)[:5]
    for rank, seq in enumerate(best):
      np.testing.assert_array_equal(out.tokens[b, rank], seq)
      np.testing.assert_allclose(out.scores[b, rank], norm[seq], rtol=1e-5)
      assert int(out.lengths[b, rank]) == lengths[seq]
    # Each beam's aux was reordered with it: the token fed at step t is its own token t-1.
    for rank in range(5):
      toks, aux = np.asarray(out.tokens[b, rank]), np.asarray(out.aux[b, rank])
      assert aux[0] == s
      live = toks[:-1] != PAD
      np.testing.assert_array_equal(aux[1:][live], toks[:-1][live])


def test_sampling_temperature_zero_and_top_k_one_are_greedy():
  g = _greedy(START, 5)
  for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 1}):
    s = decoding.sample(toy_step, _state(3), START, jax.random.key(3), num_steps=5, end_id=END,
                        **kwargs)
    np.testing.assert_array_equal(s.tokens, g.tokens)


def test_sampling_frequencies_follow_tempered_softmax():
  logits = np.array([0.0, 1.0, 2.0, -1.0], np.float32)
  n, temperature = 20000, 0.7
  step = lambda state, tok: (jnp.broadcast_to(logits, (tok.shape[0], 4)), state, ())
  out = decoding.sample(step, (), jnp.zeros(n, jnp.int32), jax.random.key(0), num_steps=1,
                        temperature=temperature)
  freq = np.bincount(np.asarray(out.tokens[:, 0]), minlength=4) / n
  p = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
  np.testing.assert_allclose(freq, p, atol=0.015)


def test_banned_tokens_are_never_sampled_and_the_rest_keep_their_odds():
  logits = np.array([0.0, 1.0, 2.0, -1.0], np.float32)  # token 2 the likeliest
  n = 20000
  step = lambda state, tok: (jnp.broadcast_to(logits, (tok.shape[0], 4)), state, ())
  out = decoding.sample(step, (), jnp.zeros(n, jnp.int32), jax.random.key(0), num_steps=1,
                        temperature=1.0, banned_ids=(2,))
  freq = np.bincount(np.asarray(out.tokens[:, 0]), minlength=4) / n
  kept = np.exp(logits[[0, 1, 3]]) / np.exp(logits[[0, 1, 3]]).sum()
  assert freq[2] == 0
  np.testing.assert_allclose(freq[[0, 1, 3]], kept, atol=0.015)
  greedy = decoding.sample(step, (), jnp.zeros(2, jnp.int32), jax.random.key(0), num_steps=3,
                           temperature=0.0, banned_ids=(2,))
  np.testing.assert_array_equal(greedy.tokens, np.ones((2, 3)))  # the next likeliest


def test_filter_logits_against_numpy():
  logits = np.array([[3.0, 1.0, 2.0, 0.0, -1.0], [0.0, 0.0, 5.0, 1.0, 4.9]], np.float32)
  # top-k: the k largest survive.
  kept = np.asarray(decoding.filter_logits(jnp.asarray(logits), top_k=2)) > -1e8
  np.testing.assert_array_equal(kept, [[1, 0, 1, 0, 0], [0, 0, 1, 0, 1]])
  # top-p: the smallest prefix of the sorted distribution whose mass reaches p.
  for p_top in (0.3, 0.7, 0.95):
    kept = np.asarray(decoding.filter_logits(jnp.asarray(logits), top_p=p_top)) > -1e8
    for row, keep_row in zip(logits, kept):
      probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
      order = np.argsort(-probs)
      n_keep = int(np.searchsorted(np.cumsum(probs[order]), p_top) + 1)
      ref = np.zeros(5, bool)
      ref[order[:n_keep]] = True
      np.testing.assert_array_equal(keep_row, ref)


def test_top_p_at_or_below_zero_keeps_the_most_likely_token():
  # The smallest set holding >= top_p of the mass is never empty: at least the likeliest token.
  logits = np.array([[0.0, 1.0, 5.0, -1.0], [2.0, -3.0, 0.5, 2.5]], np.float32)
  for top_p in (0.0, -0.5, 1e-9):
    kept = np.asarray(decoding.filter_logits(jnp.asarray(logits), top_p=top_p)) > -1e8
    np.testing.assert_array_equal(kept, np.eye(4, dtype=bool)[logits.argmax(-1)])
  step = lambda state, tok: (jnp.broadcast_to(logits[0], (tok.shape[0], 4)), state, ())
  out = decoding.sample(step, (), jnp.zeros(500, jnp.int32), jax.random.key(0), num_steps=1,
                        top_p=0.0)
  np.testing.assert_array_equal(out.tokens, 2)


@pytest.mark.parametrize("temperature", [1e10, float("inf")])
def test_banned_tokens_stay_banned_at_huge_temperatures(temperature):
  # logits / temperature -> 0: uniform over the tokens that are not banned.
  logits = np.array([0.0, 1.0, 2.0, -1.0], np.float32)
  n = 6000
  step = lambda state, tok: (jnp.broadcast_to(logits, (tok.shape[0], 4)), state, ())
  out = decoding.sample(step, (), jnp.zeros(n, jnp.int32), jax.random.key(1), num_steps=1,
                        temperature=temperature, banned_ids=(2,))
  freq = np.bincount(np.asarray(out.tokens[:, 0]), minlength=4) / n
  assert freq[2] == 0
  np.testing.assert_allclose(freq[[0, 1, 3]], 1 / 3, atol=0.03)


@pytest.mark.parametrize("temperature", [-1.0, float("nan")])
def test_negative_or_nan_temperature_is_rejected(temperature):
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    decoding.sample(toy_step, _state(3), START, jax.random.key(0), num_steps=2,
                    temperature=temperature)
