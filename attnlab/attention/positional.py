"""Position encodings: sinusoidal (Vaswani et al., 2017) and rotary (Su et al., 2021)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def sinusoidal(length: int, dim: int, base: float = 10000.0, dtype: Any = jnp.float32) -> Array:
  """Position encodings `[length, dim]`: P[i, 2j] = sin(i / base^(2j/dim)), P[i, 2j+1] = cos(...).

  Column c uses the frequency of pair j = c // 2. An odd `dim` ends with a sine column
  (pair j = (dim - 1) / 2) that has no cosine partner.
  """
  if (not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in (length, dim))
      or length < 0 or dim < 1):
    raise ValueError(f"sinusoidal needs integers length >= 0 and dim >= 1; got length={length!r}, "
                     f"dim={dim!r}")
  # Computed in float64 numpy (length and dim are static) for accuracy at long lengths.
  pos = np.arange(length, dtype=np.float64)[:, None]  # [length, 1]
  col = np.arange(dim)  # [dim]
  inv_freq = np.power(float(base), -(2 * (col // 2)) / dim)  # [dim]
  angle = pos * inv_freq[None, :]  # [length, dim]
  enc = np.where(col % 2 == 0, np.sin(angle), np.cos(angle))  # [length, dim]
  return jnp.asarray(enc, dtype)


def rotary(x: Array, positions: Array, base: float = 10000.0) -> Array:
  """Rotates feature pairs of `x` `[..., len, dim]` by angles proportional to `positions`.

  Pair j = (x[..., j], x[..., j + dim/2]) at position p turns by p / base^(2j/dim) (the
  "half-split" layout). Applied to queries and keys, it makes their dot product depend on the
  positions only through their difference. `positions` broadcasts against `x.shape[:-1]`
  (e.g. `[len]` or `[batch, 1, len]`); `dim` must be even. Computed in float32, returned in
  x's dtype.
  """
  dim = x.shape[-1]
  if dim % 2:
    raise ValueError(f"rotary position encoding needs an even feature size, got {dim}")
  half, dtype = dim // 2, x.dtype
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / dim)  # [half]
  angle = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # [..., len, half]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  # out = x * [cos, cos] + [x2, x1] * [-sin, sin]: one full-width multiply-add (x1 = x[..., :half],
  # x2 = x[..., half:]); ~5% faster nano GPT steps than rotating the halves apart (issue #14).
  cos = jnp.concatenate([cos, cos], axis=-1)  # [..., len, dim]
  sin = jnp.concatenate([-sin, sin], axis=-1)
  x = x.astype(jnp.float32)
  partner = jnp.concatenate([x[..., half:], x[..., :half]], axis=-1)  # [x2, x1]
  return (x * cos + partner * sin).astype(dtype)
