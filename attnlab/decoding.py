"""Autoregressive decoding shared by every sequence model: greedy, beam search, sampling.

Each decoder is generic over a step function, so the RNN seq2seq model, the GPT model (with its
KV cache) and the Transformer encoder-decoder all decode through the same code:

    step_fn(state, tokens) -> (logits, new_state, aux)

- `tokens` `[batch]` int32: the previous output token of every sequence;
- `logits` `[batch, vocab]`: the scores of the next token;
- `state`: any pytree whose leaves have a leading batch axis (RNN carry, encoder outputs, KV cache);
- `aux`: a pytree of per-step outputs to keep, e.g. the attention weights `[batch, src_len]` (or ()).

A prompt is prefilled by the model itself (run the prompt through the model to fill its cache, then
pass the last prompt token as `start_tokens`). Every function runs one `lax.scan` over a static
number of steps, so it compiles once under `jax.jit` (mark `max_len`, `num_steps`, `beam_size`,
`top_k` static). A finished sequence (it produced `end_id`) is padded with `pad_id` afterwards.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

StepFn = Callable[[Any, jax.Array], tuple[jax.Array, Any, Any]]

# Finite stand-in for -inf: keeps sums of log-probabilities free of inf - inf = NaN.
NEG_INF = -1e9


class Decoded(NamedTuple):
  """The output of a decoder; a beam search adds a beam axis after batch to every field."""
  tokens: jax.Array  # [batch, steps] int32, pad after <end>; the <end> token itself is kept
  lengths: jax.Array  # [batch] int32, tokens up to and including <end>
  scores: jax.Array  # [batch] float32, summed log-probability (beam search: GNMT's s(Y, X))
  aux: Any  # the step function's aux, stacked as [batch, steps, ...]


def filter_logits(logits: jax.Array, top_k: int | None = None,
                  top_p: float | None = None) -> jax.Array:
  """Keeps the `top_k` largest logits and/or the smallest set with probability >= `top_p`.

  The others are set to a large negative value, so sampling never picks them. Logits tied with
  the last kept one are kept too, and top-p always keeps the most likely token (even when
  top_p <= 0).
  """
  if top_k is not None and top_k > 0:
    kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]  # [batch, 1]
    logits = jnp.where(logits < kth, NEG_INF, logits)
  if top_p is not None and top_p < 1.0:
    sorted_logits = -jnp.sort(-logits, axis=-1)  # [batch, vocab], descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # A token stays when the tokens ranked above it hold less than top_p of the mass; the first
    # always stays (with top_p <= 0 none would, and sampling would pick token 0).
    first = jnp.arange(logits.shape[-1]) == 0  # [vocab]
    keep = (jnp.cumsum(probs, axis=-1) - probs < top_p) | first
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, NEG_INF, logits)
  return logits


def _decode(step_fn: StepFn, state, start_tokens: jax.Array, rng: jax.Array, num_steps: int,
            pick: Callable[[jax.Array, jax.Array], jax.Array], end_id: int | None,
            pad_id: int) -> Decoded:
  """The loop behind greedy and sampling: `pick(logits, rng)` chooses each next token."""
  batch = start_tokens.shape[0]

  def body(carry, step_rng):
    state, prev, done, score = carry
    logits, state, aux = step_fn(state, prev)  # [batch, vocab]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token = jnp.where(done, pad_id, pick(logits, step_rng)).astype(jnp.int32)  # [batch]
    token_log_prob = jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]
    score = score + jnp.where(done, 0.0, token_log_prob)
    finished = done if end_id is None else done | (token == end_id)
    return (state, token, finished, score), (token, aux, done)

  init = (state, start_tokens.astype(jnp.int32), jnp.zeros(batch, bool),
          jnp.zeros(batch, jnp.float32))
  (_, _, _, scores), (tokens, aux, was_done) = jax.lax.scan(
      body, init, jax.random.split(rng, num_steps))
  lengths = jnp.sum(~was_done, axis=0).astype(jnp.int32)  # [batch]
  aux = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), aux)  # [batch, steps, ...]
  return Decoded(tokens.T, lengths, scores, aux)


def greedy(step_fn: StepFn, state, start_tokens: jax.Array, *, max_len: int,
           end_id: int | None = None, pad_id: int = 0) -> Decoded:
  """Takes the most likely token at every step until `end_id` or `max_len` tokens."""
  return _decode(step_fn, state, start_tokens, jax.random.key(0), max_len,
                 lambda logits, _: jnp.argmax(logits, axis=-1), end_id, pad_id)


def sample(step_fn: StepFn, state, start_tokens: jax.Array, rng: jax.Array, *, num_steps: int,
           temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           end_id: int | None = None, pad_id: int = 0, banned_ids: tuple[int, ...] = ()
           ) -> Decoded:
  """Samples from softmax(logits / temperature) after top-k / top-p filtering.

  temperature 0 means greedy. `banned_ids` are never picked (e.g. special tokens that a text
  stream never holds). `scores` are log-probabilities under the unfiltered model.
  """
  if isinstance(temperature, (int, float)) and not temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")

  def ban(logits):
    if not banned_ids:
      return logits
    return logits.at[:, jnp.asarray(banned_ids, jnp.int32)].set(NEG_INF)  # [batch, vocab]

  def pick(logits, step_rng):
    logits = logits.astype(jnp.float32)
    safe_t = jnp.maximum(temperature, 1e-6)
    # Banned after the division: a large temperature would shrink NEG_INF into reach.
    sampled = jax.random.categorical(step_rng, filter_logits(ban(logits / safe_t), top_k, top_p))
    return jnp.where(temperature > 0, sampled, jnp.argmax(ban(logits), axis=-1))

  return _decode(step_fn, state, start_tokens, rng, num_steps, pick, end_id, pad_id)


def length_normalizer(lengths: jax.Array, alpha: float) -> jax.Array:
  """GNMT length penalty lp(Y) = (5 + |Y|)^alpha / (5 + 1)^alpha (Wu et al. 2016, eq. 14);
  alpha 0 leaves scores unchanged."""
  return ((5.0 + lengths.astype(jnp.float32)) / 6.0) ** alpha


# The least attention a source position counts as having received in the coverage penalty: a
# position no step attended (a local window's outside, padding left unmasked) adds
# beta * log(COVERAGE_FLOOR) rather than -inf, so every hypothesis keeps a finite score.
COVERAGE_FLOOR = 1e-10


def coverage_penalty(coverage: jax.Array, beta: float, mask: jax.Array | None = None
                     ) -> jax.Array:
  """GNMT coverage penalty cp(X; Y) = beta * sum_i log(min(sum_j p_ij, 1)) (Wu et al. 2016, eq.
  14): `coverage` `[..., src_len]` holds sum_j p_ij, the attention source position i received over
  the output steps j; `mask` `[..., src_len]` (True: a real position) limits the sum to the source.
  Returns `[...]`; a position below COVERAGE_FLOOR counts as the floor."""
  terms = jnp.log(jnp.clip(coverage.astype(jnp.float32), COVERAGE_FLOOR, 1.0))  # [..., src_len]
  if mask is not None:
    terms = jnp.where(mask, terms, 0.0)
  return beta * jnp.sum(terms, axis=-1)


# The same function under a name that beam_search's argument `coverage_penalty` does not shadow.
_coverage_penalty = coverage_penalty


def beam_search(step_fn: StepFn, state, start_tokens: jax.Array, *, beam_size: int, max_len: int,
                end_id: int, length_penalty: float = 0.0, coverage_penalty: float = 0.0,
                coverage_mask: jax.Array | None = None, pad_id: int = 0) -> Decoded:
  """Keeps the `beam_size` best partial outputs of every sequence; returns them best first.

  Hypotheses rank by GNMT's score (Wu et al. 2016, eq. 14)
      s(Y, X) = log P(Y | X) / lp(Y) + cp(X; Y),
  lp = `length_normalizer(|Y|, length_penalty)` (|Y| counts <end>), cp = `coverage_penalty` of
  the attention each source position has received so far, weighted by `coverage_penalty` (beta).
  At every step the candidates (each kept hypothesis extended by each token) are pruned to the best
  `beam_size` by this score, with each candidate's own length and coverage; a finished hypothesis
  stays in the beam with its final score and competes with unfinished ones. With both weights 0
  the score is the summed log-probability. The coverage penalty needs `coverage_mask`
  `[batch, src_len]` (True: a real source position) and a step function whose aux is the step's
  attention weights `[batch, src_len]`; a finished hypothesis's padding steps add none.

  Every field of the result has shape `[batch, beam, ...]`; `scores` are s(Y, X), and `aux` holds
  each kept hypothesis's own per-step aux (reordered with it). With beam_size 1 the result equals
  `greedy` (the penalties are the same for every extension of one hypothesis).
  """
  batch, k = start_tokens.shape[0], beam_size
  flat = lambda x: jnp.repeat(x, k, axis=0)  # [batch, ...] -> [batch * beam, ...]
  state = jax.tree.map(flat, state)
  prev = flat(start_tokens.astype(jnp.int32))  # [batch * beam]
  # The beams start identical: only the first may expand at step 0, so no duplicates appear.
  scores = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (batch, 1))  # [b, beam]
  _, _, aux_shape = jax.eval_shape(step_fn, state, prev)
  aux_hist = jax.tree.map(lambda s: jnp.zeros((batch, k, max_len) + s.shape[1:], s.dtype),
                          aux_shape)  # [batch, beam, max_len, ...]
  rows = jnp.arange(batch)[:, None]  # [batch, 1]
  use_coverage = coverage_mask is not None
  if not use_coverage and isinstance(coverage_penalty, (int, float)) and coverage_penalty != 0:
    raise ValueError("beam search's coverage penalty needs coverage_mask [batch, src_len] (True "
                     "at real source positions)")
  if use_coverage:
    src_len = coverage_mask.shape[-1]
    if (not isinstance(aux_shape, jax.ShapeDtypeStruct)
        or aux_shape.shape != (batch * k, src_len)):
      raise ValueError(f"beam search's coverage penalty needs attention weights [batch, "
                       f"src_len={src_len}] as the step function's aux; this model's step gives "
                       f"{jax.tree.map(lambda s: s.shape, aux_shape)}")
    coverage_mask = coverage_mask.astype(bool)[:, None, :]  # [batch, 1, src_len]
  coverage = jnp.zeros((batch, k, coverage_mask.shape[-1] if use_coverage else 0),
                       jnp.float32)  # [batch, beam, src_len]: attention received so far

  def penalty(coverage):
    """cp `[batch, beam]` of the attention `coverage` [batch, beam, src_len] received (0: none)."""
    if not use_coverage:
      return 0.0
    return _coverage_penalty(coverage, coverage_penalty, coverage_mask)

  def body(carry, t):
    state, prev, scores, done, lengths, coverage, tokens, aux_hist = carry
    logits, state, aux = step_fn(state, prev)  # [batch * beam, vocab]
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(batch, k, vocab)
    # A finished hypothesis may only continue with padding, at no cost.
    pad_only = jnp.full((vocab,), NEG_INF).at[pad_id].set(0.0)
    log_probs = jnp.where(done[..., None], pad_only, log_probs)
    # Every extension of a hypothesis shares its new length and coverage.
    lengths = lengths + (~done).astype(jnp.int32)  # [batch, beam]
    unflat = lambda x: x.reshape((batch, k) + x.shape[1:])  # [batch * beam, ...] -> [b, beam, ...]
    if use_coverage:
      coverage = coverage + jnp.where(done[..., None], 0.0, unflat(aux).astype(jnp.float32))
    raw = scores[..., None] + log_probs  # [batch, beam, vocab]
    # s(Y, X) of every extension: the parent's lp and cp are shared by its tokens.
    ranked = (raw / length_normalizer(lengths, length_penalty)[..., None]
              + jnp.asarray(penalty(coverage))[..., None])  # [batch, beam, vocab]
    _, index = jax.lax.top_k(ranked.reshape(batch, k * vocab), k)  # [batch, beam]
    scores = jnp.take_along_axis(raw.reshape(batch, k * vocab), index, axis=-1)
    parent, token = index // vocab, (index % vocab).astype(jnp.int32)

    reorder = lambda x: x[rows, parent]  # [batch, beam, ...]: follow each new beam's parent
    state = jax.tree.map(lambda x: reorder(unflat(x)).reshape(x.shape), state)
    was_done = reorder(done)
    tokens = reorder(tokens).at[:, :, t].set(jnp.where(was_done, pad_id, token))
    aux_hist = jax.tree.map(lambda h, a: reorder(h).at[:, :, t].set(reorder(unflat(a))),
                            aux_hist, aux)
    lengths, coverage = reorder(lengths), reorder(coverage)
    done = was_done | (token == end_id)
    return (state, token.reshape(batch * k), scores, done, lengths, coverage, tokens,
            aux_hist), None

  init = (state, prev, scores, jnp.zeros((batch, k), bool), jnp.zeros((batch, k), jnp.int32),
          coverage, jnp.zeros((batch, k, max_len), jnp.int32), aux_hist)
  (_, _, scores, _, lengths, coverage, tokens, aux_hist), _ = jax.lax.scan(
      body, init, jnp.arange(max_len))
  final = scores / length_normalizer(lengths, length_penalty) + penalty(coverage)  # [b, beam]
  order = jnp.argsort(-final, axis=-1)  # best first
  pick = lambda x: x[rows, order]
  return Decoded(pick(tokens), pick(lengths), pick(final), jax.tree.map(pick, aux_hist))


def check_decode_len(model: Any, max_len: int) -> None:
  """Raises ValueError when `max_len` steps exceed the model's `max_decode_len` (if it has one:
  a Transformer's KV cache and position table hold a fixed number of target positions)."""
  limit = getattr(model, "max_decode_len", None)
  if limit is not None and max_len > limit:
    raise ValueError(f"cannot decode {max_len} tokens: this model's KV cache and position table "
                     f"hold model.max_len={limit}; decode at most {limit} tokens or train a "
                     "model with a larger model.max_len")
