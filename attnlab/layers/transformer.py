"""Transformer building blocks: the position-wise MLP and the (pre- or post-LN) block.

`TransformerBlock` is self-attention + MLP, each in a residual branch, with an optional
cross-attention branch in between (encoder-decoder decoders):

  pre-LN (GPT-2, default):  x = x + drop(attn(LN(x)));   [x = x + drop(cross(LN(x), enc))];
                            x = x + drop(mlp(LN(x)))
  post-LN (BERT, Vaswani):  x = LN(x + drop(attn(x)));   [x = LN(x + drop(cross(x, enc)))];
                            x = LN(x + drop(mlp(x)))

With mlp_dim = 0 the block has no MLP branch (and no ln_2): an attention-only block.

Sub-module names: self_attention, cross_attention, mlp, ln_1, ln_2 (ln_cross for the cross
branch). Attention weights are sown by the MultiHeadAttention modules
(`intermediates/.../self_attention/attention_weights`).

Hook sites (attnlab.layers.hooks; `[batch, len, d]` each): resid_pre (the block's input),
attn_out (the self-attention branch's output, after dropout), resid_mid (after the self-attention
residual: pre-LN, the sum x + attn_out; post-LN, ln_1 of that sum), cross_attn_out and
resid_mid_cross (the same two for the cross-attention branch, when there is one), mlp_out (the
MLP branch's output; absent without an MLP), resid_post (the block's output: post-LN, ln_2 of
the sum). So in either placement resid_mid / resid_mid_cross / resid_post are what the next
branch reads, and the LayerNorms' `scale` sites (ln_1, ln_cross, ln_2) normalise the branch's
input (pre-LN) or the residual sum (post-LN).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax

from attnlab.attention.config import AttentionConfig
from attnlab.layers import hooks
from attnlab.layers.attention import MultiHeadAttention
from attnlab.layers.dense import Dense
from attnlab.layers.dense import default_kernel_init
from attnlab.layers.normalization import LayerNorm

Array = jax.Array
Initializer = Callable[..., Array]

# Activation names an MLP accepts -> function.
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    # GELU with the tanh approximation (GPT-2); much cheaper on the CPU than the exact one.
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    # Exact GELU, x * Phi(x) (BERT, PyTorch's default).
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
}
# LayerNorm placements a TransformerBlock accepts.
NORM_POSITIONS: tuple[str, ...] = ("pre", "post")


def get_activation(name: str) -> Callable[[Array], Array]:
  """The activation function `name`; raises ValueError listing the valid names."""
  if name not in ACTIVATIONS:
    raise ValueError(f"unknown activation {name!r}; valid activations: {', '.join(ACTIVATIONS)}")
  return ACTIVATIONS[name]


class MLP(nn.Module):
  """Position-wise feed-forward: Dense(mlp_dim) -> activation -> Dense(d) -> dropout."""
  # Hidden size (4 * d_model in GPT-2 and BERT).
  mlp_dim: int
  # Activation name (ACTIVATIONS).
  activation: str = "gelu_tanh"
  # Dropout on the output.
  dropout_rate: float = 0.0
  # Whether the two Dense layers have biases.
  use_bias: bool = True
  # Initialiser of the first kernel.
  kernel_init: Initializer = default_kernel_init
  # Initialiser of the second (output) kernel.
  out_kernel_init: Initializer = default_kernel_init
  # Compute dtype (None: float32).
  dtype: Any = None

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    act = get_activation(self.activation)
    d = x.shape[-1]
    h = Dense(self.mlp_dim, use_bias=self.use_bias, kernel_init=self.kernel_init,
              dtype=self.dtype, name="fc")(x)  # [batch, len, mlp_dim]
    h = act(h)
    y = Dense(d, use_bias=self.use_bias, kernel_init=self.out_kernel_init, dtype=self.dtype,
              name="proj")(h)  # [batch, len, d]
    return nn.Dropout(rate=self.dropout_rate)(y, deterministic=deterministic)


class TransformerBlock(nn.Module):
  """Self-attention (+ optional cross-attention) + MLP with residuals (module docstring)."""
  # Number of attention heads.
  num_heads: int
  # MLP hidden size (0: no MLP branch, an attention-only block).
  mlp_dim: int
  # Dropout on each residual branch's output.
  dropout_rate: float = 0.0
  # Dropout on the attention weights.
  attention_dropout_rate: float = 0.0
  # The attention config, passed whole to the self-attention (the cross-attention takes its
  # `cross()`: the full mechanism, the rest the same).
  attention: AttentionConfig = AttentionConfig()
  # Look-ahead mask in the self-attention (decoders).
  causal: bool = False
  # Add a cross-attention branch over `encoded` (encoder-decoder decoders).
  cross_attention: bool = False
  # LayerNorm placement: "pre" (GPT-2) or "post" (BERT, original Transformer).
  norm_position: str = "pre"
  # MLP activation (transformer.ACTIVATIONS).
  activation: str = "gelu_tanh"
  # Biases in the Dense layers and LayerNorms.
  use_bias: bool = True
  # LayerNorm epsilon.
  layer_norm_epsilon: float = 1e-5
  # Longest sequence (needed by the location score).
  max_len: int | None = None
  # Rotary position encoding of the self-attention's queries and keys.
  rotary: bool = False
  # Score bias of the self-attention: None, "alibi" or "t5_bias".
  position_bias: str | None = None
  # Seed of the mechanism's fixed random draws.
  mechanism_seed: int = 0
  # Initialiser of the input kernels (q/k/v, first MLP layer).
  kernel_init: Initializer = default_kernel_init
  # Initialiser of the kernels that write into the residual stream (attention out, MLP out).
  out_kernel_init: Initializer = default_kernel_init
  # Compute dtype (None: float32).
  dtype: Any = None

  def _attention(self, name: str, causal: bool, self_attention: bool) -> MultiHeadAttention:
    own = dict(position_bias=self.position_bias,
               mechanism_seed=self.mechanism_seed) if self_attention else {}
    return MultiHeadAttention(
        num_heads=self.num_heads,
        attention=self.attention if self_attention else self.attention.cross(),
        dropout_rate=self.attention_dropout_rate, use_bias=self.use_bias, causal=causal,
        max_len=self.max_len, rotary=self.rotary, kernel_init=self.kernel_init,
        out_kernel_init=self.out_kernel_init, dtype=self.dtype, name=name, **own)

  def _norm(self, name: str) -> LayerNorm:
    return LayerNorm(epsilon=self.layer_norm_epsilon, use_bias=self.use_bias, dtype=self.dtype,
                     name=name)

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None, encoded: Array | None = None,
               encoder_mask: Array | None = None, deterministic: bool = True,
               decode: bool = False, sow_weights: bool | None = None,
               t5_table: Array | None = None) -> Array:
    """x `[batch, len, d]` -> `[batch, len, d]`.

    Args:
      x: the residual stream.
      mask: self-attention mask (bool, True = may attend), e.g. a padding mask.
      encoded: encoder outputs `[batch, src_len, d_enc]` (required with cross_attention).
      encoder_mask: cross-attention mask, e.g. padding_mask(src_lengths, src_len).
      deterministic: disables dropout.
      decode: KV-cache decoding in the self-attention (see MultiHeadAttention).
      sow_weights: passed to the attention modules.
      t5_table: a T5 relative-bias table `[num_buckets, heads]` shared across the layers
        (position_bias="t5_bias"); None: the self-attention's own.
    """
    if self.norm_position not in NORM_POSITIONS:
      raise ValueError(f"unknown norm_position {self.norm_position!r}; valid: "
                       f"{', '.join(NORM_POSITIONS)}")
    if self.cross_attention and encoded is None:
      raise ValueError("a TransformerBlock with cross_attention=True needs encoded=[batch, "
                       "src_len, d] (the encoder outputs)")
    pre = self.norm_position == "pre"
    drop = lambda y: nn.Dropout(rate=self.dropout_rate)(y, deterministic=deterministic)
    attn_kw = dict(deterministic=deterministic, sow_weights=sow_weights)

    def branch(x, norm_name, fn):
      if pre:
        return x + fn(self._norm(norm_name)(x))  # [batch, len, d]
      return self._norm(norm_name)(x + fn(x))  # [batch, len, d]

    x = hooks.hook(self, "resid_pre", x)  # [batch, len, d]
    x = branch(x, "ln_1", lambda h: hooks.hook(self, "attn_out", drop(
        self._attention("self_attention", self.causal, True)(
            h, mask=mask, decode=decode, t5_table=t5_table, **attn_kw))))
    x = hooks.hook(self, "resid_mid", x)  # [batch, len, d]
    if self.cross_attention:
      x = branch(x, "ln_cross", lambda h: hooks.hook(self, "cross_attn_out", drop(
          self._attention("cross_attention", False, False)(h, encoded, mask=encoder_mask,
                                                           **attn_kw))))
      x = hooks.hook(self, "resid_mid_cross", x)  # [batch, len, d]
    if self.mlp_dim:
      mlp = MLP(self.mlp_dim, activation=self.activation, dropout_rate=self.dropout_rate,
                use_bias=self.use_bias, kernel_init=self.kernel_init,
                out_kernel_init=self.out_kernel_init, dtype=self.dtype, name="mlp")
      x = branch(x, "ln_2", lambda h: hooks.hook(self, "mlp_out", mlp(
          h, deterministic=deterministic)))
    return hooks.hook(self, "resid_post", x)  # [batch, len, d]
