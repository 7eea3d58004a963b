"""BERT-style encoder-only Transformer: pretraining heads (MLM + NSP) and a [CLS] classifier.

Encoder (`BertEncoder`): token + learned position + segment embeddings, summed, LayerNorm,
dropout -> `num_layers` bidirectional post-LN TransformerBlocks (BERT's layout) under a padding
mask -> a pooler (Dense + tanh) on the final [CLS] vector. Any score of the attention registry
works (`score`); every block sows its weights `[batch, heads, len, len]` under
`intermediates/encoder/block_<i>/self_attention/attention_weights` when "intermediates" is mutable.

Heads:
- `BertForPretraining`: the MLM head (Dense + activation + LayerNorm, then logits through the
  transposed token table plus an output bias) evaluated only at the gathered masked positions,
  and the NSP head (Dense to 2 classes) on the pooled [CLS] vector.
- `BertForClassification`: dropout + Dense to `num_classes` on the pooled [CLS] vector.

Both keep the encoder under the sub-module name "encoder", so `params["encoder"]` of a
pretraining run is exactly the encoder of a classifier (`transfer_encoder`).

Hook sites (attnlab.layers.hooks; their public names and shapes: attnlab.analysis.hooks.SITES),
all in the encoder: "embedded" (token + position embeddings), "segment_embedded" (the segment
embeddings), the embedding LayerNorm's "scale" (1 / std of their sum, whose normalised value is
block 0's input), the blocks' and attention layers' own, "resid_final" (the final LayerNorm's
output, pre-LN stacks only) and "pooled" (the pooler's tanh output `[batch, d]`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab import models as models_lib
from attnlab import precision
from attnlab.attention.config import AttentionConfig
from attnlab.errors import ConfigError
from attnlab.attention import masks as masks_lib
from attnlab.layers import Dense
from attnlab.layers import Embeddings
from attnlab.layers import POSITION_BIASES
from attnlab.layers import POSITIONS
from attnlab.layers import T5_NUM_BUCKETS
from attnlab.layers import LayerNorm
from attnlab.layers import TransformerBlock
from attnlab.layers import default_kernel_init
from attnlab.layers import get_activation
from attnlab.layers import hooks

Array = jax.Array

# Number of segment (token type) ids: sentence A = 0, sentence B = 1.
NUM_SEGMENTS = 2


def size_config(name: str) -> dict[str, int]:
  """The hyperparameters of size `name`; raises ValueError listing the valid sizes."""
  return models_lib.size_config("bert", name)


class BertHyperparameters(nn.Module):
  """The encoder hyperparameters that the encoder and both heads share."""
  # Number of token ids.
  vocab_size: int
  # Number of Transformer blocks.
  num_layers: int = 2
  # Residual stream width.
  d_model: int = 128
  # Attention heads per block.
  num_heads: int = 2
  # MLP hidden size.
  mlp_dim: int = 512
  # Longest sequence (rows of the position table).
  max_len: int = 128
  # Dropout on the embeddings and the residual branches (training only).
  dropout_rate: float = 0.1
  # Dropout on the attention weights (training only; forces the reference attention path).
  attention_dropout_rate: float = 0.0
  # The attention config, handed whole to every block (attnlab.attention.config).
  attention: AttentionConfig = AttentionConfig()
  # MLP activation: gelu (BERT), gelu_tanh, relu.
  activation: str = "gelu"
  # LayerNorm placement in the blocks: post (BERT) or pre.
  norm_position: str = "post"
  # LayerNorm epsilon of the embeddings, blocks and MLM head (BERT: 1e-12).
  layer_norm_epsilon: float = 1e-12
  # Number of segment (token type) ids: BERT's sentence A = 0, sentence B = 1.
  type_vocab_size: int = NUM_SEGMENTS
  # Position encoding: learned (BERT), sinusoidal, rotary, none, alibi, t5_bias.
  position: str = "learned"
  # Compute dtype (None: float32).
  dtype: Any = None


class BertEncoder(BertHyperparameters):
  """tokens `[batch, len]` -> (sequence output `[batch, len, d]`, pooled [CLS] `[batch, d]`)."""

  def setup(self):
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}")
    bias = self.position if self.position in POSITION_BIASES else None
    self.embed = Embeddings(self.vocab_size, self.d_model, self.max_len,
                            position="none" if bias else self.position,
                            dropout_rate=0.0, embedding_init=default_kernel_init,
                            dtype=self.dtype)
    # T5's relative-bias table, shared by every layer (as in T5).
    self.t5_table = (self.param("t5_bias", _init_t5_table, T5_NUM_BUCKETS, self.num_heads)
                     if bias == "t5_bias" else None)  # [num_buckets, heads]
    self.segment = nn.Embed(self.type_vocab_size, self.d_model,
                            embedding_init=default_kernel_init, dtype=self.dtype)
    # attnlab's LayerNorm (flax.linen.LayerNorm's parameters) has a hook site for its 1 / std.
    self.embed_norm = LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype)
    self.embed_dropout = nn.Dropout(self.dropout_rate)
    self.blocks = [
        TransformerBlock(
            num_heads=self.num_heads, mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate,
            attention_dropout_rate=self.attention_dropout_rate, attention=self.attention,
            causal=False, norm_position=self.norm_position,
            activation=self.activation, use_bias=True,
            layer_norm_epsilon=self.layer_norm_epsilon, max_len=self.max_len,
            rotary=self.position == "rotary", position_bias=bias,
            mechanism_seed=i, dtype=self.dtype, name=f"block_{i}")
        for i in range(self.num_layers)]
    # A pre-LN stack needs a final LayerNorm; a post-LN one ends normalised already.
    self.final_norm = (LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype)
                       if self.norm_position == "pre" else None)
    self.pooler = Dense(self.d_model, dtype=self.dtype)

  def __call__(self, tokens: Array, segments: Array | None = None, valid: Array | None = None,
               *, deterministic: bool = True,
               sow_weights: bool | None = None) -> tuple[Array, Array]:
    """Encodes `[CLS] A [SEP] (B [SEP])` sequences.

    Args:
      tokens: int `[batch, len]`, position 0 the [CLS] token.
      segments: int `[batch, len]`, 0 for sentence A (and [CLS]), 1 for sentence B; None = all 0.
      valid: bool `[batch, len]`, True = real token; None = `tokens != 0` (0 is the pad id).
        Padded keys receive no attention.
      deterministic: False enables dropout (needs a "dropout" rng).
      sow_weights: sow every block's attention weights (None: when "intermediates" is mutable).
    Returns:
      (sequence output `[batch, len, d]`, pooled [CLS] vector `[batch, d]`).
    """
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, len] ids; got shape {tokens.shape}")
    if segments is None:
      segments = jnp.zeros_like(tokens)
    if valid is None:
      valid = tokens != 0
    x = hooks.hook(self, "embedded", self.embed(tokens))  # [batch, len, d]
    x = x + hooks.hook(self, "segment_embedded", self.segment(segments))  # [batch, len, d]
    x = self.embed_dropout(self.embed_norm(x), deterministic=deterministic)
    mask = masks_lib.padding_mask(valid.astype(bool))  # [batch, 1, 1, len]
    for block in self.blocks:
      x = block(x, mask=mask, deterministic=deterministic, sow_weights=sow_weights,
                t5_table=self.t5_table)  # [batch, len, d]
    if self.final_norm is not None:
      x = hooks.hook(self, "resid_final", self.final_norm(x))  # [batch, len, d]
    pooled = hooks.hook(self, "pooled", jnp.tanh(self.pooler(x[:, 0])),
                        positions_axis=None)  # [batch, d]
    return x, pooled


def _init_t5_table(rng: Array, num_buckets: int, num_heads: int) -> Array:
  from attnlab.attention import positions  # pylint: disable=g-import-not-at-top
  return positions.init_t5_table(rng, num_buckets, num_heads)  # [num_buckets, heads]


def _encoder(module: BertHyperparameters) -> BertEncoder:
  return BertEncoder(**models_lib.shared_fields(module, BertHyperparameters), name="encoder")


class BertForPretraining(BertHyperparameters):
  """Encoder + MLM head (tied to the token table) + NSP head on the pooled [CLS] vector."""

  def setup(self):
    self.encoder = _encoder(self)
    self.mlm_transform = Dense(self.d_model, dtype=self.dtype)
    self.mlm_norm = nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype)
    self.mlm_bias = self.param("mlm_bias", nn.initializers.zeros, (self.vocab_size,))
    self.nsp = Dense(2, dtype=self.dtype)

  def __call__(self, tokens: Array, segments: Array | None = None, valid: Array | None = None,
               mlm_positions: Array | None = None, *, deterministic: bool = True,
               sow_weights: bool | None = None) -> tuple[Array, Array]:
    """(MLM logits `[batch, P, vocab]`, NSP logits `[batch, 2]`), both float32.

    mlm_positions: int `[batch, P]`, the positions to predict (padding entries may point
      anywhere; the loss weights them out); None = every position (P = len).
    """
    x, pooled = self.encoder(tokens, segments, valid, deterministic=deterministic,
                             sow_weights=sow_weights)  # [batch, len, d], [batch, d]
    if mlm_positions is not None:
      x = jnp.take_along_axis(x, mlm_positions[..., None], axis=1)  # [batch, P, d]
    h = get_activation(self.activation)(self.mlm_transform(x))  # [batch, P, d]
    h = self.mlm_norm(h)
    mlm_logits = self.encoder.embed.attend(h) + self.mlm_bias  # [batch, P, vocab]
    nsp_logits = self.nsp(pooled)  # [batch, 2]
    return mlm_logits.astype(jnp.float32), nsp_logits.astype(jnp.float32)


class BertForClassification(BertHyperparameters):
  """Encoder + dropout + Dense(num_classes) on the pooled [CLS] vector."""
  # Number of classes.
  num_classes: int = 2

  def setup(self):
    self.encoder = _encoder(self)
    self.classifier_dropout = nn.Dropout(self.dropout_rate)
    self.classifier = Dense(self.num_classes, dtype=self.dtype)

  def __call__(self, tokens: Array, segments: Array | None = None, valid: Array | None = None,
               *, deterministic: bool = True, sow_weights: bool | None = None) -> Array:
    """Class logits `[batch, num_classes]` (float32)."""
    _, pooled = self.encoder(tokens, segments, valid, deterministic=deterministic,
                             sow_weights=sow_weights)  # [batch, d]
    pooled = self.classifier_dropout(pooled, deterministic=deterministic)
    return self.classifier(pooled).astype(jnp.float32)  # [batch, num_classes]


def transfer_encoder(pretrained: Any, target: Any) -> Any:
  """`target` params with their "encoder" subtree replaced by `pretrained["encoder"]`.

  Raises ValueError naming the first leaf whose shape differs (the two models' encoder
  hyperparameters or vocabularies disagree).
  """
  if "encoder" not in pretrained or "encoder" not in target:
    raise ValueError("both parameter trees need an 'encoder' subtree (BertForPretraining / "
                     "BertForClassification params)")
  shapes = lambda tree: {jax.tree_util.keystr(p): tuple(x.shape)
                         for p, x in jax.tree_util.tree_flatten_with_path(tree["encoder"])[0]}
  src_shapes, dst_shapes = shapes(pretrained), shapes(target)
  for key in sorted(set(src_shapes) | set(dst_shapes)):
    if src_shapes.get(key) != dst_shapes.get(key):
      raise ValueError(f"pretrained encoder does not fit: encoder{key} is "
                       f"{src_shapes.get(key, 'absent')} in the checkpoint but "
                       f"{dst_shapes.get(key, 'absent')} in the model; use the same size, "
                       f"score, max_len and tokenizer as the pretraining run")
  return {**target, "encoder": jax.tree.map(jnp.asarray, pretrained["encoder"])}


def config_kwargs(config: Any, vocab_size: int) -> dict[str, Any]:
  """Encoder hyperparameters of `config.model` (checked) as keyword arguments of the BERT models."""
  m = config.model
  if config.data.max_len > m.max_len:
    raise ConfigError(f"data.max_len={config.data.max_len} exceeds model.max_len={m.max_len} "
                      "(rows of the position table); lower data.max_len or raise model.max_len")
  if config.data.max_len < 8:
    raise ConfigError(f"data.max_len must be >= 8, got {config.data.max_len}")
  fields = ("num_layers", "d_model", "num_heads", "mlp_dim", "max_len", "dropout_rate",
            "attention_dropout_rate", "activation", "norm_position")
  position = m.get("position", "learned")
  models_lib.check_choices({"position": position},
                           {"position": POSITIONS + POSITION_BIASES})
  attention = models_lib.attention_config(m)
  try:
    attention.kv_heads(m.num_heads)
  except ValueError as e:
    raise ConfigError(f"model.attention: {e}") from None
  return dict(vocab_size=vocab_size, **{key: m[key] for key in fields}, position=position,
              attention=attention,
              # Written by attnlab import-hf; absent from older configs (BERT's values).
              layer_norm_epsilon=m.get("layer_norm_epsilon", 1e-12),
              type_vocab_size=m.get("type_vocab_size", NUM_SEGMENTS),
              dtype=precision.compute_dtype(m, "bert"))


def from_config(config: Any, vocab_size: int, num_classes: int = 0) -> BertHyperparameters:
  """BertForPretraining of the full `config` (model and data.max_len), or with `num_classes` > 0
  BertForClassification."""
  kwargs = config_kwargs(config, vocab_size)
  if num_classes:
    return BertForClassification(num_classes=num_classes, **kwargs)
  return BertForPretraining(**kwargs)
