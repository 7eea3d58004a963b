"""LayerNorm with a hand-written backward pass (same parameters as flax.linen.LayerNorm).

y = (x - mean(x)) / sqrt(var(x) + eps) * scale (+ bias), over the last axis. The gradient is the
closed form dx = r · (dx̂ - mean(dx̂) - x̂ · mean(dx̂ · x̂)) with x̂ the normalised input, r the
reciprocal standard deviation and dx̂ = dy · scale; it reuses x̂ and r from the forward pass,
which XLA turns into fewer and cheaper CPU loops than the automatic derivative of the statistics
(measured a few percent of a nano-GPT training step). Statistics are computed in at least float32.
Hook site (attnlab.layers.hooks): "scale", the per-token reciprocal standard deviation `[..., 1]`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab.layers import hooks

Array = jax.Array


def _stats(x: Array, eps: float) -> tuple[Array, Array]:
  """(x̂, r): the normalised x and the reciprocal standard deviation `[..., 1]`."""
  centred = x - jnp.mean(x, axis=-1, keepdims=True)  # [..., d]
  r = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)  # [..., 1]
  return centred * r, r


def _layer_norm_impl(x: Array, scale: Array, eps: float) -> Array:
  x_hat, _ = _stats(x, eps)
  return x_hat * scale


layer_norm = jax.custom_vjp(_layer_norm_impl, nondiff_argnums=(2,))


def _layer_norm_fwd(x: Array, scale: Array, eps: float) -> tuple[Array, tuple[Array, ...]]:
  x_hat, r = _stats(x, eps)
  return x_hat * scale, (x_hat, r, scale)


def _layer_norm_bwd(eps: float, res: tuple[Array, ...], dy: Array) -> tuple[Array, Array]:
  del eps
  x_hat, r, scale = res
  dx_hat = dy * scale  # [..., d]
  dx = r * (dx_hat - jnp.mean(dx_hat, axis=-1, keepdims=True)
            - x_hat * jnp.mean(dx_hat * x_hat, axis=-1, keepdims=True))  # [..., d]
  dscale = jnp.sum((dy * x_hat).reshape(-1, x_hat.shape[-1]), axis=0)  # [d]
  return dx, dscale.astype(scale.dtype)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)
layer_norm.__doc__ = """(x - mean) / sqrt(var + eps) * scale over the last axis (custom VJP)."""


class LayerNorm(nn.Module):
  """Layer normalisation over the last axis; parameters `scale` (ones) and `bias` (zeros)."""
  # Added to the variance.
  epsilon: float = 1e-5
  # Whether to add a learned bias.
  use_bias: bool = True
  # Output dtype (None: the input's float dtype); statistics use at least float32.
  dtype: Any = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    d = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (d,), jnp.float32)  # [d]
    compute = jnp.promote_types(x.dtype, jnp.float32)
    if hooks.active(self, "scale"):
      # Hook site "scale": the per-token 1 / std `[..., 1]` (attnlab.layers.hooks), cached or
      # edited (e.g. frozen); the same forward values as layer_norm, its gradient by autodiff.
      x = x.astype(compute)
      centred = x - jnp.mean(x, axis=-1, keepdims=True)  # [..., d]
      r = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True)
                        + self.epsilon)  # [..., 1]
      r = hooks.hook(self, "scale", r, positions_axis=1 if x.ndim >= 3 else None)
      y = centred * r * scale.astype(compute)  # [..., d]
    else:
      y = layer_norm(x.astype(compute), scale.astype(compute), self.epsilon)  # [..., d]
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (d,), jnp.float32).astype(compute)
    return y.astype(self.dtype or x.dtype)
