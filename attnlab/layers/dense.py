"""A dense (linear) layer: `x @ kernel + bias`, its matmul taken from the platform's kernels.

`Dense` computes `x @ kernel + bias` like `flax.linen.Dense` (same parameter names and shapes)
through `matmul`, which runs the "matmul" kernel of attnlab.backends when one is in use: by
default attnlab.backends.cpu.matmul, whose hand-written backward pass keeps the weight gradient
in the layout XLA:CPU's matmul kernels take (measured at about a quarter of a nano-GPT training
step), the same numbers as autodiff's up to float rounding (tests/test_layers.py checks).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab import backends

Array = jax.Array
Initializer = Callable[..., Array]

# Initialisation used by the Transformer layers (GPT-2 / BERT): normal with std 0.02.
default_kernel_init = nn.initializers.normal(stddev=0.02)


def matmul(x: Array, w: Array) -> Array:
  """`x @ w` for x `[..., d_in]` and w `[d_in, d_out]`: the backends' "matmul" kernel, or
  `jnp.matmul` when none is in use."""
  impl = backends.kernel("matmul")
  return jnp.matmul(x, w) if impl is None else impl(x, w)  # [..., d_out]


class Dense(nn.Module):
  """`x @ kernel + bias` on the last axis; parameters `kernel` `[d_in, features]`, `bias`."""
  # Output size.
  features: int
  # Whether to add a bias.
  use_bias: bool = True
  # Initialiser of the kernel `[d_in, features]`.
  kernel_init: Initializer = default_kernel_init
  # Initialiser of the bias `[features]`.
  bias_init: Initializer = nn.initializers.zeros
  # Compute dtype (None: the promoted dtype of inputs and parameters).
  dtype: Any = None
  # Parameter dtype.
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features),
                        self.param_dtype)  # [d_in, features]
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    dtype = self.dtype or jnp.result_type(x, kernel)
    y = matmul(x.astype(dtype), kernel.astype(dtype))  # [..., features]
    if bias is not None:
      y = y + bias.astype(dtype)
    return y
