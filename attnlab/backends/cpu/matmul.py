"""`x @ w` with its backward pass laid out for the XLA CPU backend (the matmul of `Dense`).

The gradient is written out by hand (`matmul`, a `jax.custom_vjp`). The automatic weight gradient
`xᵀ @ g` contracts the leading (token) axis of both operands, a layout the CPU matmul kernels do
not take, so XLA inserts a transpose and fuses it into the producer of `g` (e.g. the GELU
backward). That fused elementwise-plus-transpose loop was measured at about a quarter of a
nano-GPT training step. Here the stored x is transposed explicitly as a plain copy (see
`_plain_transpose`), and the matmul then runs in the layout the kernels like. The numbers are
identical to autodiff's up to float rounding (tests/test_layers.py checks).

It is the default "matmul" kernel of attnlab.backends, which attnlab.layers.dense.matmul calls;
it changes nothing outside the call and runs on every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _plain_transpose(x: Array) -> Array:
  """`x.T` `[n, d] -> [d, n]` as a plain copy of the stored x.

  Left to itself XLA fuses x's producer (a LayerNorm, a GELU, a residual add) into the
  transposing loop and recomputes it there with strided reads, which was measured at a quarter of
  a training step. A conditional is a fusion boundary XLA keeps (optimization_barrier is removed
  before fusion on the CPU); both branches are the same transpose, the predicate only has to be
  unknown at compile time.
  """
  if x.size == 0:
    return x.T
  return jax.lax.cond(x[0, 0] == x[0, 0], jnp.transpose, jnp.transpose, x)  # [d, n]


@jax.custom_vjp
def matmul(x: Array, w: Array) -> Array:
  """`x @ w` for x `[..., d_in]` and w `[d_in, d_out]`, with a CPU-friendly backward pass."""
  return jnp.matmul(x, w)  # [..., d_out]


def _matmul_fwd(x: Array, w: Array) -> tuple[Array, tuple[Array, Array]]:
  return jnp.matmul(x, w), (x, w)


def _matmul_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
  x, w = res
  dx = jnp.matmul(g, w.T).astype(x.dtype)  # [..., d_in]
  g2 = g.reshape(-1, g.shape[-1])  # [n, d_out]
  x_t = _plain_transpose(x.reshape(-1, x.shape[-1]))  # [d_in, n]
  dw = jnp.matmul(x_t, g2.astype(x_t.dtype))  # [d_in, d_out]
  return dx, dw.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)
