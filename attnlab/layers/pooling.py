"""Attention pooling of a sequence of states into one vector, with learned parameters.

`AttentionPooling(attn_dim)(states, mask)` is Yang et al. (2016)'s word-level attention
(`attnlab.attention.pooling.context_attention_pooling`): u_t = tanh(W h_t + b),
alpha_t = softmax_t(u_t . u_w) over the real tokens, pooled = sum_t alpha_t h_t, with the
context vector u_w a parameter. The weights are sown as `intermediates/<path>/attention_weights`
`[batch, 1, len]` (one query, the context vector, over the tokens), as every attention layer sows
its own, so analysis (attnlab.analysis.capture) and `attnlab view` read them without recomputing.
The weights are also the hook site "pattern" (`[batch, len]`; masks select token positions): an
edited pattern makes the pooled vector sum_t pattern_t h_t.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab.attention import pooling as pooling_lib
from attnlab.layers import hooks
from attnlab.layers import sown


class AttentionPooling(nn.Module):
  """states `[batch, len, d]`, mask bool `[batch, len]` -> pooled `[batch, d]` (module docstring)."""
  # Size of u_t and of the context vector u_w (0: the states' size d).
  attn_dim: int = 0

  @nn.compact
  def __call__(self, states: jax.Array, mask: jax.Array) -> jax.Array:
    d = states.shape[-1]
    d_attn = self.attn_dim or d
    w = self.param("w", nn.initializers.lecun_normal(), (d, d_attn))
    b = self.param("b", nn.initializers.zeros, (d_attn,))
    context = self.param("context", nn.initializers.normal(d_attn ** -0.5), (d_attn,))
    pooled, weights = pooling_lib.context_attention_pooling(
        {"w": w, "b": b, "context": context}, states, mask)  # [batch, d], [batch, len]
    edited = hooks.hook(self, "pattern", weights)  # [batch, len]
    if edited is not weights:  # an intervention: pool with the edited weights
      weights, pooled = edited, jnp.einsum("bt,btd->bd", edited, states)  # [batch, d]
    self.sow("intermediates", sown.ATTENTION_WEIGHTS, weights[:, None, :])  # [batch, 1, len]
    return pooled.astype(jnp.float32)
