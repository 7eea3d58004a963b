"""Transformer encoder-decoder for translation (task "translation", `model.name=transformer`).

  source tokens -> Embeddings -> num_layers encoder TransformerBlocks (self-attention with a
    source padding mask) -> [final LayerNorm] = encoder outputs `[batch, src_len, d]`
  target tokens -> Embeddings -> num_decoder_layers TransformerBlocks (self-attention with the
    look-ahead mask; cross-attention from the target positions to the encoder outputs with the
    source padding mask) -> [final LayerNorm] -> logits `[batch, tgt_len, tgt_vocab]`

The blocks are `attnlab.layers.TransformerBlock` (pre-LN by default, post-LN as in Vaswani et al.
with `norm_position="post"`), so every score function of `attnlab.attention.scores` and every
`attend` implementation is available by name. Positions are sinusoidal (default), learned, or
rotary (queries and keys of the encoder and decoder self-attentions rotated; cross-attention
then compares content only).
`share_embeddings`: "none" (separate source/target tables and output layer), "target" (the target
table is also the output layer, logits scaled by d_model ** -0.5) or "all" (one table of
max(src_vocab, tgt_vocab) rows for source, target and output: meaningful when both sides use the
same vocabulary, e.g. reverse/copy with characters).

Training (`__call__`) is teacher-forced: the decoder reads `<start> y_1 .. y_n` and predicts
`y_1 .. y_n <end>`; the look-ahead mask keeps position t from seeing target tokens after t.

Decoding (`encode` + `decode_step`, driven by `attnlab.decoding` through the translation task)
keeps in its state, per decoder layer, the cross-attention keys/values projected once from the
encoder outputs, and the self-attention KV cache of `attnlab.layers.MultiHeadAttention` (the Flax
"cache" collection, carried explicitly in the state so the task can call `model.apply` without
mutable collections). Each step feeds one token and costs one position. The cache holds `max_len`
positions: asking for more decoding steps than that raises ValueError (`max_decode_len`; the
config's default max_len covers twice the longest training source).
`make_step_fn(..., use_cache=False)` is the uncached reference (every step re-runs the decoder
over the whole prefix); tests check both give the same tokens. A self-attention mechanism without
KV-cache decoding (attnlab.attention.registry) decodes the uncached way through `encode` and
`decode_step` too.

Attention weights are sown by every attention module: `intermediates/encoder_layer_<i>/
self_attention/attention_weights` and `intermediates/decoder_layer_<i>/{self,cross}_attention/
attention_weights` `[batch, heads, q_len, k_len]` (`attention_grids` collects them per layer).

Hook sites (attnlab.layers.hooks; their public names and shapes: attnlab.analysis.hooks.SITES):
"encoder_embedded", "decoder_embedded" (the embeddings' outputs), "encoder_final",
"decoder_final" (the final LayerNorms' outputs, pre-LN only) here, the blocks' and attention
layers' own (self_attention and cross_attention distinct) below them. They act on the
teacher-forced forward pass (`__call__`); the decoding methods run without them.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnlab import decoding
from attnlab import models as models_lib
from attnlab import precision
from attnlab.attention.config import AttentionConfig
from attnlab.attention import masks as masks_lib
from attnlab.layers import Dense
from attnlab.layers import Embeddings
from attnlab.layers import LayerNorm
from attnlab.layers import NORM_POSITIONS
from attnlab.layers import POSITION_BIASES
from attnlab.layers import POSITIONS
from attnlab.layers import T5_NUM_BUCKETS
from attnlab.layers import TransformerBlock
from attnlab.layers import get_activation
from attnlab.layers import hooks
from attnlab.layers import project_kv
from attnlab.layers import sown

Array = jax.Array

# size name -> (num_layers, num_heads, d_model, mlp_dim) (attnlab.models.SIZES).
SIZES: dict[str, dict[str, int]] = models_lib.SIZES["transformer"]
# Position encodings the Transformer accepts.
TRANSFORMER_POSITIONS: tuple[str, ...] = tuple(p for p in POSITIONS if p != "none") + POSITION_BIASES
# Embedding sharing choices (module docstring).
SHARE_EMBEDDINGS: tuple[str, ...] = ("none", "target", "all")


class Transformer(nn.Module):
  """Encoder-decoder Transformer (module docstring). Padding id 0 in both vocabularies."""
  # Source vocabulary size.
  src_vocab_size: int
  # Target vocabulary size.
  tgt_vocab_size: int
  # Encoder blocks.
  num_layers: int = 2
  # Decoder blocks (None: num_layers).
  num_decoder_layers: int | None = None
  # Attention heads of every attention layer.
  num_heads: int = 4
  # Model width (embeddings, residual stream).
  d_model: int = 64
  # Hidden size of the position-wise MLPs.
  mlp_dim: int = 128
  # Dropout on embeddings and on every residual branch (training only).
  dropout_rate: float = 0.0
  # Dropout on the attention weights (training only).
  attention_dropout_rate: float = 0.0
  # The attention config, handed whole to every block (attnlab.attention.config); its mechanism
  # runs the encoder and decoder self-attentions, the cross-attentions are full.
  attention: AttentionConfig = AttentionConfig()
  # Position encoding: sinusoidal, learned, rotary, alibi or t5_bias (self-attention biases; T5:
  # one table for the encoder's layers, one for the decoder's).
  position: str = "sinusoidal"
  # none | target | all (module docstring).
  share_embeddings: str = "none"
  # LayerNorm placement: pre (stable, default) or post (Vaswani et al.).
  norm_position: str = "pre"
  # MLP activation (attnlab.layers.ACTIVATIONS).
  activation: str = "relu"
  # Longest source and target (position tables, KV-cache length, location score size).
  max_len: int = 64
  # Decoder layer whose head-averaged cross-attention decode_step reports (-1: the last).
  weights_layer: int = -1
  # Compute dtype (None: float32; parameters stay float32, logits are float32; attnlab.precision).
  dtype: Any = None

  def setup(self):
    if self.position not in TRANSFORMER_POSITIONS:
      raise ValueError(f"unknown position {self.position!r}; valid: "
                       f"{', '.join(TRANSFORMER_POSITIONS)}")
    if self.share_embeddings not in SHARE_EMBEDDINGS:
      raise ValueError(f"unknown share_embeddings {self.share_embeddings!r}; valid: "
                       f"{', '.join(SHARE_EMBEDDINGS)}")
    # norm_position and activation are checked by the blocks.
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}")
    if not -self.decoder_depth <= self.weights_layer < self.decoder_depth:
      raise ValueError(f"weights_layer={self.weights_layer} is not a decoder layer; valid: "
                       f"-{self.decoder_depth}..{self.decoder_depth - 1}")
    # Token tables start at unit scale, like the sinusoids they are added to.
    bias = self.position if self.position in POSITION_BIASES else None
    embed = lambda vocab, name: Embeddings(
        vocab, self.d_model, self.max_len, position="none" if bias else self.position,
        dropout_rate=self.dropout_rate, embedding_init=nn.initializers.normal(1.0),
        dtype=self.dtype, name=name)
    if self.share_embeddings == "all":
      self.src_embed = embed(max(self.src_vocab_size, self.tgt_vocab_size), "embed")
      self.tgt_embed = self.src_embed
    else:
      self.src_embed = embed(self.src_vocab_size, "src_embed")
      self.tgt_embed = embed(self.tgt_vocab_size, "tgt_embed")
    block = dict(num_heads=self.num_heads, mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate,
                 attention_dropout_rate=self.attention_dropout_rate, attention=self.attention,
                 norm_position=self.norm_position, activation=self.activation,
                 max_len=self.max_len, rotary=self.position == "rotary", position_bias=bias,
                 dtype=self.dtype)
    self.encoder_layers = [TransformerBlock(**block, mechanism_seed=i, name=f"encoder_layer_{i}")
                           for i in range(self.num_layers)]
    self.decoder_layers = [TransformerBlock(**block, causal=True, cross_attention=True,
                                            mechanism_seed=self.num_layers + i,
                                            name=f"decoder_layer_{i}")
                           for i in range(self.decoder_depth)]
    # T5's relative-bias tables: one per stack, shared by its layers (as in T5).
    t5 = lambda name: (self.param(name, _init_t5_table, T5_NUM_BUCKETS, self.num_heads)
                       if bias == "t5_bias" else None)  # [num_buckets, heads]
    self.encoder_t5_table = t5("encoder_t5_bias")
    self.decoder_t5_table = t5("decoder_t5_bias")
    if self.norm_position == "pre":
      # attnlab's LayerNorm (flax.linen.LayerNorm's parameters and epsilon) has a hook site
      # for its 1 / std.
      self.encoder_norm = LayerNorm(epsilon=1e-6, dtype=self.dtype, name="encoder_norm")
      self.decoder_norm = LayerNorm(epsilon=1e-6, dtype=self.dtype, name="decoder_norm")
    if self.share_embeddings == "none":
      self.output = Dense(self.tgt_vocab_size, dtype=self.dtype, name="output")

  @property
  def max_decode_len(self) -> int:
    """Most tokens one decoding may produce (the KV cache and position table hold max_len)."""
    return self.max_len

  @property
  def decoder_depth(self) -> int:
    return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

  # ------------------------------------------------------------------------------- stacks

  def encode_source(self, src: Array, src_lengths: Array, *, deterministic: bool = True
                    ) -> tuple[Array, Array]:
    """(encoder outputs `[batch, src_len, d]`, source padding mask `[batch, 1, 1, src_len]`)."""
    mask = masks_lib.padding_mask(src_lengths.astype(jnp.int32), src.shape[1])
    x = self.src_embed(src, deterministic=deterministic)  # [batch, src_len, d]
    x = hooks.hook(self, "encoder_embedded", x)  # [batch, src_len, d]
    for layer in self.encoder_layers:
      x = layer(x, mask=mask, deterministic=deterministic,
                t5_table=self.encoder_t5_table)  # [batch, src_len, d]
    if self.norm_position == "pre":
      x = hooks.hook(self, "encoder_final", self.encoder_norm(x))  # [batch, src_len, d]
    return x, mask

  def decode_tokens(self, tgt: Array, memory: Any, src_mask: Array, *, deterministic: bool = True,
                    decode: bool = False) -> Array:
    """Decoder logits `[batch, tgt_len, tgt_vocab]`.

    memory: the encoder outputs `[batch, src_len, d]`, or a list with one {"key", "value"} dict
      per decoder layer (`attnlab.layers.project_kv`).
    decode: feed `tgt` into the self-attention KV cache (needs the "cache" collection mutable).
    """
    y = self.tgt_embed(tgt, deterministic=deterministic, decode=decode)  # [batch, tgt_len, d]
    y = hooks.hook(self, "decoder_embedded", y)  # [batch, tgt_len, d]
    for i, layer in enumerate(self.decoder_layers):
      encoded = memory[i] if isinstance(memory, (list, tuple)) else memory
      y = layer(y, encoded=encoded, encoder_mask=src_mask, deterministic=deterministic,
                decode=decode, t5_table=self.decoder_t5_table)  # [batch, tgt_len, d]
    if self.norm_position == "pre":
      y = hooks.hook(self, "decoder_final", self.decoder_norm(y))  # [batch, tgt_len, d]
    if self.share_embeddings == "none":
      return self.output(y).astype(jnp.float32)  # [batch, tgt_len, tgt_vocab]
    logits = self.tgt_embed.attend(y) * self.d_model ** -0.5  # [batch, tgt_len, vocab]
    return logits[..., :self.tgt_vocab_size].astype(jnp.float32)

  def __call__(self, src: Array, src_lengths: Array, tgt_in: Array, *, deterministic: bool = True
               ) -> tuple[Array, dict[str, Array]]:
    """Teacher forcing: (logits `[batch, tgt_len, tgt_vocab]`, aux).

    deterministic: False enables dropout (needs a "dropout" rng).
    aux holds "attention_weights" `[batch, tgt_len, src_len]` (weights_layer's cross-attention,
    averaged over heads) when the "intermediates" collection is mutable, else nothing.
    """
    encoded, mask = self.encode_source(src, src_lengths, deterministic=deterministic)
    logits = self.decode_tokens(tgt_in, encoded, mask, deterministic=deterministic)
    aux = {}
    if self.is_mutable_collection("intermediates"):
      layer = self.decoder_layers[self.weights_layer]
      sown = layer.variables.get("intermediates", {})
      if "cross_attention" in sown:
        weights = sown["cross_attention"]["attention_weights"][-1]  # [b, heads, tgt_len, src_len]
        aux["attention_weights"] = jnp.mean(weights, axis=1)
    return logits, aux

  # ------------------------------------------------------------------------------- decoding

  def _apply_decoder(self, variables: dict[str, Any], *args, **kwargs) -> Any:
    """`decode_tokens` applied on an unbound copy to the given variables (e.g. a KV cache)."""
    return self.clone(parent=None).apply(variables, *args, method=Transformer.decode_tokens,
                                         **kwargs)

  def _cross_weights(self, intermediates: Any) -> Array:
    """weights_layer's sown cross-attention weights, head-averaged: `[batch, q_len, src_len]`."""
    layer = f"decoder_layer_{range(self.decoder_depth)[self.weights_layer]}"
    return jnp.mean(intermediates[layer]["cross_attention"]["attention_weights"][0], axis=1)

  @property
  def supports_cache(self) -> bool:
    """Whether the self-attention mechanism supports KV-cache decoding (its registry entry)."""
    from attnlab.attention import registry  # pylint: disable=g-import-not-at-top
    return bool(registry.get_mechanism(self.attention.mechanism).supports.cache)

  def encode(self, src: Array, src_lengths: Array) -> dict[str, Any]:
    """The decoding state: cross keys/values per layer, source mask, an empty KV cache (the
    uncached state of `encode_uncached` for a mechanism without KV-cache decoding)."""
    if not self.supports_cache:
      return self.encode_uncached(src, src_lengths)
    encoded, mask = self.encode_source(src, src_lengths)
    params = self.variables["params"]
    memory = [project_kv(params[f"decoder_layer_{i}"]["cross_attention"], encoded,
                         self.num_heads) for i in range(self.decoder_depth)]
    batch = src.shape[0]
    mask = jnp.broadcast_to(mask, (batch, 1, 1, src.shape[1]))  # batch-first leaf for beams

    def cache_shapes(params, memory, mask):
      tokens = jnp.zeros((batch, self.max_len), jnp.int32)
      _, variables = self._apply_decoder({"params": params}, tokens, memory, mask, decode=True,
                                         mutable=["cache"])
      return variables["cache"]

    shapes = jax.eval_shape(cache_shapes, params, memory, mask)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return {"memory": memory, "mask": mask, "cache": cache}

  def decode_step(self, state: dict[str, Any], tokens: Array
                  ) -> tuple[Array, dict[str, Any], Array]:
    """One step for attnlab.decoding: (logits `[b, vocab]`, new state, cross weights `[b, s]`);
    `decode_step_uncached` for a mechanism without KV-cache decoding."""
    if not self.supports_cache:
      return self.decode_step_uncached(state, tokens)
    variables = {"params": self.variables["params"], "cache": state["cache"]}
    logits, updated = self._apply_decoder(
        variables, tokens[:, None].astype(jnp.int32), state["memory"], state["mask"],
        decode=True, mutable=["cache", "intermediates"])
    weights = self._cross_weights(updated["intermediates"])[:, 0]  # [batch, src_len]
    return logits[:, 0], {**state, "cache": updated["cache"]}, weights

  def encode_uncached(self, src: Array, src_lengths: Array) -> dict[str, Any]:
    """State of the uncached reference decoder: source, lengths, a growing target prefix."""
    batch = src.shape[0]
    return {"src": src, "src_lengths": src_lengths.astype(jnp.int32),
            "prefix": jnp.zeros((batch, self.max_len), jnp.int32),
            "index": jnp.zeros((batch,), jnp.int32)}

  def decode_step_uncached(self, state: dict[str, Any], tokens: Array
                           ) -> tuple[Array, dict[str, Any], Array]:
    """Like decode_step, but re-runs encoder and decoder over the whole prefix (no cache)."""
    index = state["index"]  # [batch]
    prefix = jax.vmap(lambda p, t, i: p.at[i].set(t))(state["prefix"], tokens.astype(jnp.int32),
                                                      index)  # [batch, max_len]
    encoded, mask = self.encode_source(state["src"], state["src_lengths"])
    logits, inter = self._apply_decoder({"params": self.variables["params"]}, prefix, encoded,
                                        mask, mutable=["intermediates"])  # [b, max_len, V]
    weights = self._cross_weights(inter["intermediates"])  # [batch, max_len, src_len]
    pick = jax.vmap(lambda a, i: a[i])
    return (pick(logits, index), {**state, "prefix": prefix, "index": index + 1},
            pick(weights, index))  # [batch, vocab], state, [batch, src_len]


def _init_t5_table(rng: Array, num_buckets: int, num_heads: int) -> Array:
  from attnlab.attention import positions  # pylint: disable=g-import-not-at-top
  return positions.init_t5_table(rng, num_buckets, num_heads)  # [num_buckets, heads]


def make_step_fn(model: Transformer, params: Any, *, use_cache: bool = True):
  """A `step_fn(state, tokens) -> (logits, state, cross weights)` for attnlab.decoding."""
  if use_cache and not model.supports_cache:
    raise ValueError(f"mechanism {model.attention.mechanism!r} does not support KV-cache "
                     f"decoding; use "
                     f"use_cache=False")
  method = Transformer.decode_step if use_cache else Transformer.decode_step_uncached

  def step_fn(state, tokens):
    return model.apply({"params": params}, state, tokens, method=method)
  return step_fn


def init_decode_state(model: Transformer, params: Any, src: Array, src_lengths: Array, *,
                      use_cache: bool = True) -> dict[str, Any]:
  """The `state` for make_step_fn(model, params, use_cache=use_cache)."""
  if use_cache and not model.supports_cache:
    raise ValueError(f"mechanism {model.attention.mechanism!r} does not support KV-cache "
                     f"decoding; use "
                     f"use_cache=False")
  method = Transformer.encode if use_cache else Transformer.encode_uncached
  return model.apply({"params": params}, src, src_lengths, method=method)


def attention_grids(model: Transformer, params: Any, src: Array, src_lengths: Array,
                    tgt_in: Array) -> dict[str, np.ndarray]:
  """Sown weights of one teacher-forced pass, stacked per kind as `[layers, batch, heads, q, k]`.

  Keys: "encoder_self" (q = k = src), "decoder_self" (q = k = tgt), "cross" (q = tgt, k = src);
  `weights[:, i]` is the `[layers, heads, rows, cols]` grid of example i for
  attnlab.plotting.attention_grid.
  """
  _, state = model.apply({"params": params}, src, src_lengths, tgt_in, mutable=["intermediates"])
  maps = sown.sown_values(state["intermediates"])
  grab = lambda prefix, kind: sown.stack_layers(maps, f"{prefix}_layer_", f"/{kind}", example=None)
  return {"encoder_self": grab("encoder", "self_attention"),
          "decoder_self": grab("decoder", "self_attention"),
          "cross": grab("decoder", "cross_attention")}


def from_config(model_config: Any, src_vocab_size: int, tgt_vocab_size: int,
                max_src_len: int) -> Transformer:
  """The Transformer described by a `config.model` group (configs/transformer.py).

  Fields left at 0 take their value from `model.size`; `model.max_len` 0 means
  max(64, 2 * max_src_len + 2). Raises ConfigError (a ValueError) naming the valid choices.
  """
  from attnlab.errors import ConfigError  # pylint: disable=g-import-not-at-top
  dims = models_lib.config_dims("transformer", model_config)
  models_lib.check_choices(model_config, {"position": TRANSFORMER_POSITIONS,
                                          "share_embeddings": SHARE_EMBEDDINGS,
                                          "norm_position": NORM_POSITIONS})
  try:  # model.attention: checked by registry.validate where the config is read
    get_activation(model_config.activation)
  except ValueError as e:
    raise ConfigError(f"model: {e}") from None
  if dims["d_model"] % dims["num_heads"]:
    raise ConfigError(f"model.d_model={dims['d_model']} must be divisible by "
                      f"model.num_heads={dims['num_heads']}")
  attention = models_lib.attention_config(model_config)
  try:
    attention.kv_heads(dims["num_heads"])
  except ValueError as e:
    raise ConfigError(f"model.attention: {e}") from None
  max_len = model_config.max_len or max(64, 2 * max_src_len + 2)
  if max_len < max_src_len:
    raise ConfigError(f"model.max_len={max_len} is shorter than the longest training source "
                      f"({max_src_len} tokens); raise it or set 0 (automatic)")
  fields = ("dropout_rate", "attention_dropout_rate", "position", "share_embeddings",
            "norm_position", "activation", "weights_layer")
  return Transformer(src_vocab_size, tgt_vocab_size, **dims, max_len=max_len,
                     num_decoder_layers=model_config.num_decoder_layers or dims["num_layers"],
                     dtype=precision.compute_dtype(model_config, "transformer"),
                     **{key: model_config[key] for key in fields}, attention=attention)
