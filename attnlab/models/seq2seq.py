"""RNN encoder-decoder for sequence-to-sequence tasks, with or without attention.

The encoder embeds the source and runs 1..n GRU or LSTM layers over it (optionally bidirectional,
the two directions' states concatenated; `bidirectional_layers` keeps that to the bottom layers).
The decoder is one recurrent cell scanned over time (`nn.scan`, no Python loop over steps); what it
sees of the source is the `attention` choice:

- `none`: the encoder's final state initialises the decoder and is its only view of the source;
- `bahdanau`: before the cell step, the previous decoder state scores every encoder state; the
  weighted sum (the context vector) is concatenated with the previous output's embedding as the
  cell input, and the output layer reads [new state; context];
- `luong`: after the cell step, the new state scores the encoder states; the attentional hidden
  state tanh(W_c [context; state]) feeds the output layer and, with `input_feeding`, the next step.

The score function comes from `attnlab.attention.scores` by name, and `window` picks how the
weights are spread: `global` (a softmax over every source position), `local` (local-p: a predicted
centre and a Gaussian-weighted window of half-width D), `local_m` (local-m: the window of
half-width D centred at p_t = t, the decoder step, clipped to the source's last position; a softmax
over the window, no Gaussian), or `hard` (one sampled position, trained with REINFORCE; the most
likely position when decoding). Every step's attention weights are
returned in `aux["attention_weights"]` `[batch, tgt_len, src_len]` and sown under
`intermediates/attention_weights`. The part of the score that depends on the source alone (the
additive score's W_k h_j) is computed once per source in `encode`, not at every decoder step.
With `attention_values=projected` the attention reads separate transforms of the encoder states,
key = W_k h and value = W_v h (Dense, no bias; the values keep the states' size); the default
`states` scores the states (projected only where a parameter-free score needs the size) and
averages the states themselves.

GNMT's wiring (Wu et al. 2016, "Google's Neural Machine Translation System", section 3; the
`preset=gnmt` key of configs/seq2seq.py sets all three):

- `residual_start=3`: from the third layer on, in encoder and decoder, a layer's input is added to
  its output, so the input of layer i+1 is x_i + LSTM_i(x_i) (the paper's eq. 6). Layer 1 reads the
  embeddings and cannot have one; layer 2 of an encoder whose bottom layer alone is bidirectional
  reads 2 * hidden and cannot either. In the decoder the sum is over the previous layer's output
  only, not the context concatenated to it.
- `bidirectional_layers=1`: only the bottom encoder layer reads both ways; the layers above are
  unidirectional (`0`, the default, keeps every layer bidirectional when `bidirectional` is on).
- `attention_from=bottom`: the bottom decoder layer's state queries the attention (bahdanau: its
  previous state, the paper's y_{i-1}; luong: its new state) and the context is concatenated to the
  input of every decoder layer above it, as well as to the bottom layer's input (bahdanau) and the
  output layer's input. `top` (the default) queries with the top layer's state and gives the
  context to the bottom layer alone.

Decoding goes through `attnlab.decoding` with `init_decode_state` and `Seq2Seq.decode_step`
(see `make_step_fn`).

Hook sites (attnlab.layers.hooks; their public names and shapes: attnlab.analysis.hooks.SITES) of
the teacher-forced pass (`__call__`; decoding runs without them): the encoder's "embedded" and
"states" (its top layer's states, what the attention reads; the final carries that start the
decoder are not edited with them), the decoder's "decoder_embedded", and per step (STEP_SITES,
inside the scan, cached stacked over the steps): "attn_pattern", "attn_context" (an edited
pattern makes the context pattern @ values), "decoder_states" (the top layer's new state: the
cell's output and its next carry) and "decoder_features" (what the output layer reads; Luong's
attentional state, also the next step's input feed). An edit at step t reaches every later step
through the recurrence. A step's intervention sees only that step, so op "mean" needs its value.
"""

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab import models as models_lib
from attnlab import precision
from attnlab.attention import core as attn_core
from attnlab.attention import masks as attn_masks
from attnlab.attention import scores as attn_scores
from attnlab.errors import ConfigError
from attnlab.layers import hooks

ATTENTIONS = ("none", "bahdanau", "luong")
WINDOWS = ("global", "local", "local_m", "hard")
CELLS = ("gru", "lstm")
# What the attention reads from the encoder states: the states themselves, or key = W_k h and
# value = W_v h (separate transforms).
ATTENTION_VALUES = ("states", "projected")
# Which decoder layer's state queries the attention (and which layers read the context).
ATTENTION_FROM = ("top", "bottom")
# Scores with no parameters of their own need queries and keys of the same size.
_SAME_SIZE_SCORES = ("dot", "scaled_dot", "cosine")

# Hook sites of the decoder's steps (Seq2Seq's own, stacked over the steps `[batch, tgt_len,
# ...]`): the attention weights and context, the top layer's new state, the output layer's input.
STEP_SITES = ("attn_pattern", "attn_context", "decoder_states", "decoder_features")

Carry = Any  # one layer's recurrent state: [batch, hidden] (GRU) or a (c, h) pair (LSTM)


def _check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
  if value not in valid:
    raise ValueError(f"unknown {name} {value!r}; valid choices: {', '.join(valid)}")


def _make_cell(cell: str, features: int, name: str | None = None) -> nn.RNNCellBase:
  _check_choice("cell", cell, CELLS)
  if cell == "gru":
    return nn.GRUCell(features, name=name)
  return nn.LSTMCell(features, name=name)


def hidden_state(carry: Carry) -> jax.Array:
  """The output state of one layer's carry (h of an LSTM's (c, h))."""
  return carry[1] if isinstance(carry, tuple) else carry


def residual_layer(layer: int, residual_start: int) -> bool:
  """Whether 0-based `layer` adds its input to its output (1-based `residual_start`; 0: none)."""
  return residual_start > 0 and layer + 1 >= residual_start


def structure_error(num_layers: int, bidirectional: bool, bidirectional_layers: int,
                    residual_start: int, attention: str, attention_from: str) -> str | None:
  """What is wrong with a stack's wiring (one line naming the keys to change), or None."""
  if attention_from not in ATTENTION_FROM:
    return (f"unknown model.attention_from {attention_from!r}; valid choices: "
            f"{', '.join(ATTENTION_FROM)}")
  if attention_from == "bottom" and attention == "none":
    return ("model.attention_from=bottom needs an attention to feed up the stack; set "
            "model.attention=bahdanau or luong, or model.attention_from=top")
  if not 0 <= bidirectional_layers <= num_layers:
    return (f"model.bidirectional_layers={bidirectional_layers} must lie in 0..model.num_layers="
            f"{num_layers} (0: every encoder layer reads both ways)")
  if bidirectional_layers and not bidirectional:
    return (f"model.bidirectional_layers={bidirectional_layers} needs model.bidirectional=True "
            f"(or set model.bidirectional_layers=0)")
  if residual_start < 0 or residual_start == 1:
    return (f"model.residual_start={residual_start}: the first layer reads the embeddings and "
            f"cannot add them to its output; give 0 (no residuals) or a layer >= 2 (GNMT: 3)")
  # The first unidirectional layer above bidirectional ones reads 2 * hidden, returns hidden.
  first_uni = bidirectional_layers if bidirectional else 0
  if 0 < first_uni < num_layers and residual_layer(first_uni, residual_start):
    return (f"model.residual_start={residual_start}: encoder layer {first_uni + 1} reads the "
            f"bidirectional layer's 2 * hidden_dim states and returns hidden_dim, so it cannot "
            f"add them; start at {first_uni + 2} or above (GNMT: 3)")
  return None


class Encoder(nn.Module):
  """Embedding + stacked (bi)directional GRU/LSTM layers over the source."""
  vocab_size: int
  embed_dim: int
  hidden_dim: int
  cell: str = "gru"
  num_layers: int = 1
  bidirectional: bool = False
  dropout_rate: float = 0.0
  # Bottom layers that read both ways when bidirectional (0: all of them).
  bidirectional_layers: int = 0
  # First layer (1-based) that adds its input to its output (0: none).
  residual_start: int = 0

  def layer_is_bidirectional(self, layer: int) -> bool:
    return self.bidirectional and (self.bidirectional_layers == 0
                                   or layer < self.bidirectional_layers)

  @nn.compact
  def __call__(self, tokens: jax.Array, lengths: jax.Array, *,
               deterministic: bool = True) -> tuple[jax.Array, list[Carry]]:
    """Returns the top layer's states `[batch, src_len, enc_dim]` and each layer's final carry.

    enc_dim is hidden_dim, or 2 * hidden_dim when the top layer is bidirectional (forward;
    backward); a bidirectional layer's final carry is the two directions' concatenated. Positions
    at or after a sequence's length do not change its final carry.
    """
    x = nn.Embed(self.vocab_size, self.embed_dim, name="embed")(tokens)  # [batch, src_len, embed]
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    x = hooks.hook(self, "embedded", x)  # [batch, src_len, embed]
    finals = []
    for layer in range(self.num_layers):
      if self.layer_is_bidirectional(layer):
        rnn = nn.Bidirectional(
            nn.RNN(_make_cell(self.cell, self.hidden_dim, f"layer{layer}_fwd")),
            nn.RNN(_make_cell(self.cell, self.hidden_dim, f"layer{layer}_bwd")),
            return_carry=True)
        (fwd, bwd), y = rnn(x, seq_lengths=lengths)  # y: [batch, src_len, 2 * hidden]
        final = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=-1), fwd, bwd)
      else:
        rnn = nn.RNN(_make_cell(self.cell, self.hidden_dim, f"layer{layer}"), return_carry=True)
        final, y = rnn(x, seq_lengths=lengths)  # y: [batch, src_len, hidden]
      if layer < self.num_layers - 1:
        y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
      # GNMT's residual: the next layer reads x_i + layer_i(x_i).
      x = y + x if residual_layer(layer, self.residual_start) else y
      finals.append(final)
    # The top layer's states: what the attention reads (the final carries go on unedited).
    return hooks.hook(self, "states", x), finals  # [batch, src_len, enc_dim]


class _Options(nn.Module, kw_only=True):
  """The recurrent and attention settings that Seq2Seq hands its DecoderCell unchanged
  (keyword-only, so Seq2Seq keeps its vocabulary sizes as the first positional arguments)."""
  # Size of every recurrent layer (per direction in the encoder).
  hidden_dim: int = 128
  # Recurrent cell: gru or lstm.
  cell: str = "gru"
  # Stacked recurrent layers in the encoder and in the decoder.
  num_layers: int = 1
  # Whether the encoder also reads the source right to left.
  bidirectional: bool = False
  # Bottom encoder layers that read both ways when bidirectional (0: all; GNMT: 1).
  bidirectional_layers: int = 0
  # First layer (1-based) that adds its input to its output, in encoder and decoder (0: none;
  # GNMT: 3).
  residual_start: int = 0
  # Decoder layer whose state queries the attention: top (the context enters the bottom layer) |
  # bottom (GNMT: the context also enters every layer above).
  attention_from: str = "top"
  # none | bahdanau | luong.
  attention: str = "bahdanau"
  # Score function name from attnlab.attention.scores.
  score: str = "additive"
  # global | local (local-p window) | local_m (window at p_t = t) | hard (sampled, REINFORCE).
  window: str = "global"
  # Hidden size of the additive score and of the local-p position predictor (None: hidden_dim).
  attn_dim: int | None = None
  # Half-width D of the local-p and local-m windows.
  local_half_width: int = 2
  # Luong: feed the previous attentional state into the next step.
  input_feeding: bool = True
  # states (keys and values are the encoder states h) | projected (key = W_k h, value = W_v h).
  attention_values: str = "states"
  # Longest source the model accepts (the location score's parameter size).
  max_src_len: int | None = None
  # Initial key strength of the cosine score (trainable; cosine alone lies in [-1, 1]).
  cosine_beta: float = 5.0

  @property
  def num_bidirectional(self) -> int:
    """Encoder layers (the bottom ones) that read both ways."""
    if not self.bidirectional:
      return 0
    return self.bidirectional_layers or self.num_layers

  @property
  def enc_dim(self) -> int:
    """Size of the encoder states: hidden_dim per direction of the top encoder layer."""
    return self.hidden_dim * (2 if self.num_bidirectional == self.num_layers else 1)

  @property
  def key_dim(self) -> int:
    """Size of the keys the score sees: encoder states, projected when the score needs it."""
    return self.hidden_dim if self.score in _SAME_SIZE_SCORES else self.enc_dim


class DecoderCell(_Options):
  """One decoder time step: attention (per `attention`) + stacked recurrent cells.

  Called as `cell(carry, embedded, memory, deterministic=...)` and returns
  `(new_carry, (features, weights, log_prob))`: `features` `[batch, out_dim]` feed the output
  layer, `weights` `[batch, src_len]` are the attention weights (zeros for `none`), `log_prob`
  `[batch]` is the log-probability of the sampled position for hard attention (zeros otherwise).
  """

  def setup(self):
    self.cells = [_make_cell(self.cell, self.hidden_dim, f"cell_{i}")
                  for i in range(self.num_layers)]
    if self.attention == "none":
      return
    # cosine gets a trainable key strength beta; dot and scaled_dot have no parameters.
    beta = self.cosine_beta if self.score == "cosine" else None
    self.score_params = None
    if self.score in attn_scores.PARAMETRIC_SCORES or beta is not None:
      self.score_params = self.param(
          "score", lambda rng: attn_scores.init_score_params(
              self.score, rng, self.hidden_dim, self.key_dim, d_attn=self.attn_dim,
              max_len=self.max_src_len, beta=beta))
    if self.window == "local":
      # local-p: p_t = S * sigmoid(v_p^T tanh(W_p h_t)).
      d_p = self.attn_dim or self.hidden_dim
      self.w_p = self.param("w_p", nn.initializers.lecun_normal(), (self.hidden_dim, d_p))
      self.v_p = self.param("v_p", nn.initializers.normal(d_p ** -0.5), (d_p,))
    if self.attention == "luong":
      self.combine = nn.Dense(self.hidden_dim, use_bias=False, name="combine")

  def score_keys(self, keys: jax.Array) -> jax.Array:
    """The keys as the steps score them: with the key-only part of the score computed once per
    source (the additive score's W_k k), not at every decoder step."""
    if self.attention == "none":
      return keys
    return attn_scores.precompute_keys(self.score, self.score_params, keys)[0]

  def _attend(self, query: jax.Array, memory: dict[str, jax.Array], deterministic: bool,
              step: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Context `[batch, enc_dim]`, weights `[batch, src_len]`, log-prob `[batch]` of one step
    (`step` `[batch]`: the decoder step t, local-m's window centre)."""
    q = query[:, None, :]  # [batch, 1, hidden]
    keys, values, mask = memory["keys"], memory["values"], memory["mask"]
    # memory["keys"] come from score_keys: the score params that go with them.
    params = attn_scores.precomputed_key_params(self.score, self.score_params)
    score = dict(score=self.score, params=params, mask=mask)
    log_prob = jnp.zeros(query.shape[:1], jnp.float32)
    if self.window == "global":
      context, weights = attn_core.attend(q, keys, values, **score, implementation="reference")
    elif self.window == "local":
      center = attn_core.predict_position(q, self.w_p, self.v_p, memory["lengths"])  # [batch, 1]
      context, weights = attn_core.local_attend(
          q, keys, values, center=center, half_width=self.local_half_width, **score)
    elif self.window == "local_m":
      # local-m: p_t = t (attn_core.monotonic_centers), clipped to each source's last position.
      last = jnp.maximum(memory["lengths"] - 1, 0)  # [batch]
      center = jnp.minimum(step, last).astype(jnp.float32)[:, None]  # [batch, 1]
      context, weights = attn_core.local_attend(
          q, keys, values, center=center, half_width=self.local_half_width, gaussian=False,
          **score)
    elif deterministic:
      # Hard attention at test time: the single most likely position. The weights reported are
      # the distribution the position is chosen from (as when training).
      _, weights = attn_core.attend(q, keys, values, **score,
                                    implementation="reference")  # [batch, 1, src_len]
      chosen = jax.nn.one_hot(jnp.argmax(weights, axis=-1), keys.shape[-2])  # [batch, 1, src_len]
      context = jnp.matmul(chosen * jnp.any(mask, -1, keepdims=True), values)  # [batch, 1, enc]
    else:
      # The weights reported are the distribution the position was sampled from.
      hard = attn_core.hard_attend(self.make_rng("sample"), q, keys, values, **score)
      context, weights, log_prob = hard.context, hard.weights, hard.log_prob[:, 0]
    return context[:, 0], weights[:, 0], log_prob

  def _step_cells(self, carry: list[Carry], x: jax.Array, first: int = 0,
                  context: jax.Array | None = None) -> tuple[list[Carry], jax.Array]:
    """Steps the layers `first`.. of the stack (their carries `carry`) on input `x`; layers above
    the bottom one also read `context` when given (attention_from=bottom). Returns their new
    carries and the top output `[batch, hidden]`."""
    new = []
    for layer, c in enumerate(carry, start=first):
      inputs = x if layer == 0 or context is None else jnp.concatenate([x, context], axis=-1)
      c, y = self.cells[layer](c, inputs)  # y: [batch, hidden]
      # GNMT's residual: over the previous layer's output only, not the context beside it.
      x = y + x if residual_layer(layer, self.residual_start) else y
      new.append(c)
    return new, x

  def __call__(self, carry: dict[str, Any], embedded: jax.Array, memory: dict[str, jax.Array],
               deterministic: bool = True, *, edits: Mapping[str, Any] | None = None,
               keep: tuple[str, ...] = ()):
    """One step; `edits` {step site: this step's Interventions, values `[batch, ...]`, position
    masks `[batch]`} (Seq2Seq._step_edits), `keep` the step sites to return (STEP_SITES)."""
    rnn = list(carry["rnn"])
    step = carry.get("step")  # [batch] int32: the decoder step t (local-m only)
    kept = {}
    bottom = self.attention_from == "bottom"

    def site(name, x):  # a hook site of one step, x [batch, ...]
      for iv in (edits or {}).get(name, ()):
        iv = hooks.Intervention(iv.site, iv.op, None if iv.value is None else iv.value[:, None],
                                None if iv.positions is None else iv.positions[:, None])
        x = hooks.apply_intervention(x[:, None], iv, positions_axis=1, heads_axis=None)[:, 0]
      if name in keep:
        kept[name] = x
      return x

    def attend(query):
      context, weights, log_prob = self._attend(query, memory, deterministic, step)
      weights = site("attn_pattern", weights)  # [batch, src_len]
      if (edits or {}).get("attn_pattern"):  # the context of the edited weights
        context = jnp.einsum("bs,bse->be", weights.astype(memory["values"].dtype),
                             memory["values"])  # [batch, enc_dim]
      return site("attn_context", context), weights, log_prob  # [batch, enc_dim]

    def cells(carries, x, first=0, context=None):
      """Steps layers first.. (their `carries`); the top layer's output is a hook site."""
      new, h = self._step_cells(carries, x, first, context)
      if carries and first + len(carries) == self.num_layers:
        edited = site("decoder_states", h)  # [batch, hidden]: the output and the top carry
        top = new[-1]
        # A residual top layer's carry is its cell's own state, not the output x + cell(x): it
        # takes the edit's change.
        own = (hidden_state(top) + (edited - h)
               if residual_layer(self.num_layers - 1, self.residual_start) else edited)
        new[-1] = (top[0], own) if isinstance(top, tuple) else own
        h = edited
      return new, h

    if self.attention == "none":
      rnn, h = cells(rnn, embedded)
      weights = jnp.zeros(memory["mask"].shape[:1] + memory["mask"].shape[-1:], h.dtype)
      features, log_prob = h, jnp.zeros(h.shape[:1], jnp.float32)
    elif self.attention == "bahdanau":
      # The previous state of the querying layer (GNMT: the bottom one, y_{i-1}).
      context, weights, log_prob = attend(hidden_state(rnn[0] if bottom else rnn[-1]))
      rnn, h = cells(rnn, jnp.concatenate([embedded, context], axis=-1),
                     context=context if bottom else None)
      features = jnp.concatenate([h, context], axis=-1)  # [batch, hidden + enc_dim]
    else:  # luong
      x = embedded
      if self.input_feeding:
        x = jnp.concatenate([embedded, carry["feed"]], axis=-1)  # [batch, embed + hidden]
      if bottom:
        # The bottom layer's new state queries; the layers above read [output below; context].
        first, h = cells(rnn[:1], x)
        context, weights, log_prob = attend(h)
        rest, h = cells(rnn[1:], h, first=1, context=context)
        rnn = first + rest
      else:
        rnn, h = cells(rnn, x)
        context, weights, log_prob = attend(h)
      features = jnp.tanh(self.combine(jnp.concatenate([context, h], axis=-1)))  # [batch, hidden]
    features = site("decoder_features", features)  # [batch, out_dim]
    new_carry = {"rnn": tuple(rnn), "feed": features if self.attention == "luong"
                 else carry["feed"]}
    if step is not None:
      new_carry["step"] = step + 1
    return new_carry, (features, weights, log_prob, kept)


class Seq2Seq(_Options):
  """Encoder-decoder with a config-chosen cell, attention style, score and window.

  `__call__(src, src_lengths, tgt_in, deterministic=...)` runs teacher-forced decoding (dropout
  and hard attention's sampling when deterministic=False) and returns
  `(logits [batch, tgt_len, tgt_vocab], aux)`, aux = {"attention_weights": [batch, tgt_len,
  src_len]} plus, for hard attention, "log_prob" [batch, tgt_len] (log-probability of each sampled
  position, for REINFORCE). Padding ids are 0 in both vocabularies. The recurrent and attention
  settings are the keyword-only fields of `_Options`.
  """
  src_vocab_size: int
  tgt_vocab_size: int
  # Size of the token embeddings (source and target).
  embed_dim: int = 64
  # Dropout on embeddings, between layers and before the output layer.
  dropout_rate: float = 0.0

  def setup(self):
    _check_choice("attention", self.attention, ATTENTIONS)
    _check_choice("window", self.window, WINDOWS)
    _check_choice("attention_values", self.attention_values, ATTENTION_VALUES)
    error = structure_error(self.num_layers, self.bidirectional, self.bidirectional_layers,
                            self.residual_start, self.attention, self.attention_from)
    if error:
      raise ValueError(error)
    if self.score == "location" and not self.max_src_len:
      raise ValueError("score='location' needs max_src_len (the longest source length)")
    self.encoder = Encoder(self.src_vocab_size, self.embed_dim, self.hidden_dim, self.cell,
                           self.num_layers, self.bidirectional, self.dropout_rate,
                           bidirectional_layers=self.bidirectional_layers,
                           residual_start=self.residual_start)
    self.tgt_embed = nn.Embed(self.tgt_vocab_size, self.embed_dim)
    self.decoder_cell = DecoderCell(**models_lib.shared_fields(self, _Options))
    # The bidirectional encoder layers' final states (2 * hidden) -> the decoder's first states.
    self.bridge = [nn.Dense(self.hidden_dim, name=f"bridge_{i}")
                   for i in range(self.num_bidirectional)]
    # Parameter-free scores compare same-size vectors: project the (2 * hidden) encoder states.
    # attention_values=projected: keys W_k h and values W_v h (the values keep enc_dim).
    projected = self.attention != "none" and self.attention_values == "projected"
    self.key_proj = (nn.Dense(self.key_dim, use_bias=False)
                     if self.attention != "none" and (self.key_dim != self.enc_dim or projected)
                     else None)
    self.value_proj = nn.Dense(self.enc_dim, use_bias=False) if projected else None
    self.dropout = nn.Dropout(self.dropout_rate)
    self.output = nn.Dense(self.tgt_vocab_size)

  def encode(self, src: jax.Array, src_lengths: jax.Array, *,
             deterministic: bool = True) -> dict[str, Any]:
    """The decoder's start state: {"carry": {...}, "memory": {...}}, every leaf batch-first."""
    src_lengths = src_lengths.astype(jnp.int32)
    states, finals = self.encoder(src, src_lengths, deterministic=deterministic)  # [b, s, enc]
    # The bottom (bidirectional) layers go through their bridge; the others fit as they are.
    finals = [jax.tree.map(lambda a, bridge=bridge: jnp.tanh(bridge(a)), f)
              for f, bridge in zip(finals, self.bridge)] + finals[len(self.bridge):]
    keys = states if self.key_proj is None else self.key_proj(states)  # [batch, src_len, key_dim]
    values = (states if self.value_proj is None
              else self.value_proj(states))  # [batch, src_len, enc_dim]
    mask = attn_masks.padding_mask(src_lengths, src.shape[1])[:, 0]  # [batch, 1, src_len]
    batch = src.shape[0]
    carry = {"rnn": tuple(finals), "feed": jnp.zeros((batch, self.hidden_dim), states.dtype)}
    if self.window == "local_m" and self.attention != "none":
      carry["step"] = jnp.zeros((batch,), jnp.int32)  # [batch]: local-m's p_t = t
    memory = {"keys": self.decoder_cell.score_keys(keys), "values": values, "mask": mask,
              "lengths": src_lengths}
    return {"carry": carry, "memory": memory}

  def _step_edits(self, steps: tuple[int, int], values: jax.Array) -> dict[str, Any]:
    """{step site: its Interventions with values `[batch, tgt_len, ...]` and position masks
    `[batch, tgt_len]` (None: all), broadcast in full}: the scan hands each step its slice."""
    batch, length = steps
    out_dim = self.hidden_dim + (values.shape[-1] if self.attention == "bahdanau" else 0)
    shapes = {"attn_pattern": (batch, length, values.shape[1]),
              "attn_context": (batch, length, values.shape[-1]),
              "decoder_states": (batch, length, self.hidden_dim),
              "decoder_features": (batch, length, out_dim)}
    edits = {}
    for name, shape in shapes.items():
      if not hooks.intervened(self, name):
        continue
      sliced = []
      for iv in self.get_variable(hooks.INTERVENTIONS, name):
        if iv.heads is not None:
          raise ValueError(f"site {iv.site!r} has no heads axis; leave its heads mask out")
        if iv.op == "mean" and iv.value is None:
          raise ValueError(f"op 'mean' at the recurrent site {iv.site!r} needs its value (e.g. "
                           f"the mean of a cached run): a step cannot see the later steps")
        positions = None
        if iv.positions is not None:
          positions = jnp.asarray(iv.positions, bool)
          if positions.ndim not in (1, 2) or positions.shape[-1] != length:
            raise ValueError(f"positions mask of {iv.site!r} must be [{length}] or [batch, "
                             f"{length}] (the target length), got shape {positions.shape}")
          positions = jnp.broadcast_to(positions, (batch, length))
        value = None if iv.value is None else jnp.broadcast_to(jnp.asarray(iv.value), shape)
        sliced.append(hooks.Intervention(iv.site, iv.op, value, positions))
      edits[name] = tuple(sliced)
    return edits

  def _logits(self, features: jax.Array, deterministic: bool) -> jax.Array:
    return self.output(self.dropout(features, deterministic=deterministic))

  def __call__(self, src: jax.Array, src_lengths: jax.Array, tgt_in: jax.Array, *,
               deterministic: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
    state = self.encode(src, src_lengths, deterministic=deterministic)
    embedded = self.dropout(self.tgt_embed(tgt_in), deterministic=deterministic)  # [b, t, embed]
    embedded = hooks.hook(self, "decoder_embedded", embedded)  # [batch, tgt_len, embed]
    edits = self._step_edits(embedded.shape[:2], state["memory"]["values"])
    keep = tuple(n for n in STEP_SITES if hooks.capturing_site(self, n))

    def body(cell, carry, x, edits, memory):
      return cell(carry, x, memory, deterministic=deterministic, edits=edits, keep=keep)

    scan = nn.scan(body, variable_broadcast="params", split_rngs={"params": False, "sample": True},
                   in_axes=(1, 1, nn.broadcast), out_axes=1)
    _, (features, weights, log_prob, kept) = scan(self.decoder_cell, state["carry"], embedded,
                                                  edits, state["memory"])
    # features: [batch, tgt_len, out_dim]; weights: [batch, tgt_len, src_len]
    for name, value in kept.items():  # the step sites, stacked [batch, tgt_len, ...]
      self.sow(hooks.HOOKS, name, value)
    self.sow("intermediates", "attention_weights", weights)
    logits = self._logits(features, deterministic)  # [batch, tgt_len, tgt_vocab]
    aux = {"attention_weights": weights}
    if self.attention != "none" and self.window == "hard":
      aux["log_prob"] = log_prob  # [batch, tgt_len]: log p of each sampled source position
    return logits, aux

  def decode_step(self, state: dict[str, Any], tokens: jax.Array
                  ) -> tuple[jax.Array, dict[str, Any], jax.Array]:
    """One greedy/beam step for `attnlab.decoding`: (logits [b, vocab], new state, weights [b, s])."""
    embedded = self.tgt_embed(tokens)  # [batch, embed]
    carry, (features, weights, _, _) = self.decoder_cell(state["carry"], embedded,
                                                         state["memory"], deterministic=True)
    logits = self._logits(features, True)  # [batch, tgt_vocab]
    return logits, {"carry": carry, "memory": state["memory"]}, weights


def make_step_fn(model: Seq2Seq, params: Any):
  """A `step_fn(state, tokens) -> (logits, state, aux)` for `attnlab.decoding`."""
  def step_fn(state, tokens):
    return model.apply({"params": params}, state, tokens, method=Seq2Seq.decode_step)
  return step_fn


def init_decode_state(model: Seq2Seq, params: Any, src: jax.Array,
                      src_lengths: jax.Array) -> dict[str, Any]:
  """Encodes the source: the `state` argument of `attnlab.decoding` functions."""
  return model.apply({"params": params}, src, src_lengths, method=Seq2Seq.encode)


def from_config(model_config: Any, src_vocab_size: int, tgt_vocab_size: int,
                max_src_len: int) -> Seq2Seq:
  """The Seq2Seq module described by a `config.model` group (see configs/seq2seq.py).

  Raises ConfigError (a ValueError) naming the valid choices for an unknown cell, attention or
  window (model.score is checked by config_utils.validate, where the config is read), and for a
  wiring `structure_error` refuses.
  """
  models_lib.check_choices(model_config,
                           {"cell": CELLS, "attention": ATTENTIONS, "window": WINDOWS})
  # Runs written before the key existed: their values were the encoder states.
  values = model_config.get("attention_values", "states")
  models_lib.check_choices({"attention_values": values}, {"attention_values": ATTENTION_VALUES})
  # Runs written before GNMT's wiring existed (run_config.ADDED_DEFAULTS): the plain stack.
  wiring = {"bidirectional_layers": model_config.get("bidirectional_layers", 0),
            "residual_start": model_config.get("residual_start", 0),
            "attention_from": model_config.get("attention_from", "top")}
  error = structure_error(model_config.num_layers, model_config.bidirectional,
                          attention=model_config.attention, **wiring)
  if error:
    raise ConfigError(error)
  precision.compute_dtype(model_config, "seq2seq")  # float32 only: ConfigError otherwise
  fields = ("embed_dim", "hidden_dim", "cell", "num_layers", "bidirectional", "attention", "score",
            "window", "local_half_width", "input_feeding", "cosine_beta", "dropout_rate")
  return Seq2Seq(src_vocab_size, tgt_vocab_size, attn_dim=model_config.attn_dim or None,
                 max_src_len=max_src_len, attention_values=values, **wiring,
                 **{key: model_config[key] for key in fields})
