"""A mechanism attnlab does not ship, registered from outside the package: cosine attention with a
learned temperature per head (in the spirit of Henry et al. 2020, "Query-Key Normalization for
Transformers"): softmax(t_h · cos(q_i, k_j)) with t_h = exp(log_t_h) learned, starting at
`init_temperature`.

  attnlab train --config=configs/gpt.py:model.attention.plugins=tests/plugins/cosine_temperature.py,\
mechanism=cosine_temperature,model.attention.cosine_temperature.init_temperature=5 --workdir=runs/ct

tests/test_plugins.py trains GPT, BERT and the Transformer with it; nothing in attnlab/ names it.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from attnlab.attention import core
from attnlab.attention import masks
from attnlab.attention import registry


@dataclasses.dataclass(frozen=True)
class Options:
  """cosine_temperature's knobs (config keys model.attention.cosine_temperature.*)."""
  # Temperature every head starts at (the scale of the cosine before the softmax).
  init_temperature: float = 10.0

  def validate(self, *, causal: bool) -> None:
    del causal
    if not self.init_temperature > 0:
      raise ValueError(f"cosine_temperature.init_temperature must be > 0, got "
                       f"{self.init_temperature}")


def init(rng, num_heads, head_dim, max_len, *, init_temperature=Options.init_temperature,
         **options):
  """Learned parameters: the log-temperature of each head `[heads, 1, 1]`."""
  del rng, head_dim, max_len, options
  return {"log_temperature": jnp.full((num_heads, 1, 1), math.log(init_temperature), jnp.float32)}


def attention(q, k, v, *, mask=None, causal=False, params=None, return_weights=False,
              **options):
  """softmax(exp(log_t) · q̂ k̂ᵀ) v over `[batch, heads, len, d]`, q̂, k̂ unit rows."""
  del options
  unit = lambda x: x / jnp.sqrt(jnp.sum(jnp.square(x), -1, keepdims=True) + 1e-6)
  cosine = jnp.einsum("...qd,...kd->...qk", unit(q), unit(k))  # [batch, heads, q_len, k_len]
  logits = jnp.exp(params["log_temperature"]).astype(cosine.dtype) * cosine
  if causal:
    mask = masks.combine(mask, masks.causal_mask(q.shape[-2], k.shape[-2], offset=None))
  weights = core.masked_softmax(logits, mask)  # [batch, heads, q_len, k_len]
  context = jnp.einsum("...qk,...kd->...qd", weights, v.astype(weights.dtype))
  return context.astype(v.dtype), (weights if return_weights else None)


registry.register(registry.Mechanism(
    "cosine_temperature", attention, init,
    registry.Supports(causal=True, bidirectional=True, cache=True, weights=True,
                      scores=("scaled_dot",), bias=False, normalizers=("softmax",)),
    "Henry et al. 2020", "cosine similarity scaled by a learned per-head temperature",
    options=Options, module=__name__), replace=True)
