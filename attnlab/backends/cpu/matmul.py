"""`x @ w` with its backward pass laid out for the XLA CPU backend (the matmul of `Dense`).

The gradient is written out by hand (`matmul`, a `jax.custom_vjp`). The automatic weight gradient
`xᵀ @ g` contracts the leading (token) axis of both operands, a layout the CPU matmul kernels do
not take, so XLA inserts a transpose and fuses it into the producer of `g` (e.g. the GELU
backward). That fused elementwise-plus-transpose loop was measured at about a quarter of a
nano-GPT training step. Here the stored x is transposed explicitly as a plain copy (see
`_plain_transpose`), and the matmul then runs in the layout the kernels like. The numbers are
identical to autodiff's up to float rounding (tests/test_layers.py checks).

bfloat16 operands: under `jax.default_matmul_precision("bfloat16")` (what the trainer sets around
its train step where `matmul_precision` resolves to bfloat16, attnlab.precision) a float32
product runs on x, w and the gradient g rounded to bfloat16, accumulated and returned in float32:
`bf16(x) @ bf16(w)`, `bf16(g) @ bf16(w)ᵀ`, `bf16(x)ᵀ @ bf16(g)`. Each operand is rounded once
and the backward pass keeps the rounded x and w (half the bytes of the transpose). On a CPU
with bfloat16 dot instructions (AVX512_BF16) YNNPACK then runs the products at up to twice
float32's rate: the nano GPT's step 1.2x faster on an AMD EPYC (experiments/benchmarks/README.md,
"Issue #51, fifth pass"). Without that setting, or for inputs that are not float32, nothing is
rounded.

It is the default "matmul" kernel of attnlab.backends, which attnlab.layers.dense.matmul calls;
it changes nothing outside the call and runs on every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.backends.cpu import cpuinfo

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


# jax_default_matmul_precision values that ask for bfloat16 operands (JAX's names for them).
BF16_PRECISIONS = ("bfloat16", "BF16_BF16_F32")


def bf16_requested() -> bool:
  """Whether the trace in progress asks for bfloat16 operands (`jax.default_matmul_precision`)."""
  return jax.config.jax_default_matmul_precision in BF16_PRECISIONS


def matmul(x: Array, w: Array) -> Array:
  """`x @ w` for x `[..., d_in]` and w `[d_in, d_out]`, with a CPU-friendly backward pass; on
  bfloat16 operands for float32 inputs when the trace asks for them (`bf16_requested`)."""
  if x.dtype == w.dtype == jnp.float32 and bf16_requested():
    return _bf16_matmul(x, w)
  return _matmul(x, w)


@jax.custom_vjp
def _matmul(x: Array, w: Array) -> Array:
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


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@jax.custom_batching.custom_vmap
def _bf16_product(a: Array, b: Array) -> Array:
  """`a @ b` of bfloat16 operands, accumulated and returned in float32."""
  return jnp.matmul(a, b, preferred_element_type=jnp.float32)


@_bf16_product.def_vmap
def _bf16_product_batched(axis_size: int, in_batched: list[bool], a: Array, b: Array):
  """Under vmap (a model's seeds, a per-head map) the same numbers from float32 operands (a
  product of two bfloat16 values is exact in float32): XLA:CPU (jaxlib 0.10) left some batched
  bfloat16 products to a runtime that has no bfloat16 matmul, and the step failed. The rounding
  then gains nothing, so `matmul_precision=auto` keeps a run of several seeds in float32."""
  del axis_size
  axes = tuple(0 if batched else None for batched in in_batched)
  product = lambda a, b: jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))
  return jax.vmap(product, in_axes=axes)(a, b), True


@jax.custom_vjp
def _bf16_matmul(x: Array, w: Array) -> Array:
  return _bf16_product(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))  # [..., d_out] float32


def _bf16_matmul_fwd(x: Array, w: Array) -> tuple[Array, tuple[Array, Array]]:
  x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  return _bf16_product(x16, w16), (x16, w16)


def _bf16_matmul_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
  x16, w16 = res
  g16 = g.astype(jnp.bfloat16)
  dx = _bf16_product(g16, w16.T)  # [..., d_in] float32
  x_t = _plain_transpose(x16.reshape(-1, x16.shape[-1]))  # [d_in, n]
  dw = _bf16_product(x_t, g16.reshape(-1, g16.shape[-1]))  # [d_in, d_out] float32
  return dx, dw


_bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


def native_bf16(flags: frozenset[str] | None = None) -> bool:
  """Whether this CPU multiplies bfloat16 natively (/proc/cpuinfo's avx512_bf16 or amx_bf16):
  where `matmul_precision=auto` trains on bfloat16 operands. `flags`: for tests."""
  return bool({"avx512_bf16", "amx_bf16"} & (cpuinfo.flags() if flags is None else flags))
