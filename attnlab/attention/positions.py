"""Position schemes: encodings (sinusoidal, rotary) and biases on the scores (ALiBi, T5).

Encodings, which change the inputs or the queries and keys:
- sinusoidal (Vaswani et al., 2017): fixed encodings `[length, dim]` added to the embeddings.
- rotary (Su et al., 2021): rotates feature pairs of the queries and keys by angles proportional
  to their positions, so their dot product depends on the positions only through their difference.

Biases added to the attention scores. Both are functions of the relative distance j - i between
key j and query i only, so they are pure functions of (q_len, k_len) and extrapolate to any length:
a model trained at one length evaluates at a longer one without new parameters.

- ALiBi (Press et al., 2022, "Train Short, Test Long"): bias[h, i, j] = -m_h · |i - j| with
  fixed per-head slopes m_h = 2^(-8h/H), h = 1..H.
- T5 relative position bias (Raffel et al., 2020): bias[h, i, j] = table[bucket(j - i), h],
  a learned scalar per (bucket, head); distances are bucketed exactly up to num_buckets/2
  (per direction) and logarithmically beyond, up to max_distance.

`AlibiBias` and `T5Bias` describe the same biases without materialising them; `core.attend`
accepts them as `bias=` and the blocked kernel recomputes each score tile's bias from the tile
indices (memory linear in the length); `materialize(q_len, k_len)` gives the full array.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# names of the position biases (so config validation can list every position kind)
POSITION_BIASES: tuple[str, ...] = ("alibi", "t5_bias")
# position encodings of the embeddings or of q/k (attnlab.layers.Embeddings; rotary in attention)
EMBEDDING_POSITIONS: tuple[str, ...] = ("learned", "sinusoidal", "rotary", "none")
# T5's defaults: number of relative-position buckets and the distance of the last bucket
T5_NUM_BUCKETS = 32
T5_MAX_DISTANCE = 128


# ------------------------------------------------------------------ sinusoidal and rotary


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


# ----------------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi's per-head slopes `[heads]` (Press et al. 2022, section 3 and their code).

  For H a power of two: m_h = 2^(-8h/H), h = 1..H (a geometric sequence starting at and with
  ratio 2^(-8/H); H = 8 gives 1/2, 1/4, ..., 1/256). Otherwise, with n the largest power of two
  below H: the n slopes of n heads, followed by every other slope of 2n heads (the odd
  positions 2^(-8(2i-1)/(2n))) until there are H.
  """
  if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
    raise ValueError(f"alibi_slopes needs num_heads >= 1; got {num_heads!r}")

  def power_of_two(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (h + 1) for h in range(n)]

  n = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_two(n)
  if n < num_heads:
    slopes += power_of_two(2 * n)[0::2][:num_heads - n]
  return np.asarray(slopes, np.float64)


def _float_dtype() -> Any:
  """The default float type: float64 under jax_enable_x64, else float32 (bf16 models promote
  the bias to float32 when they add it)."""
  return jax.dtypes.canonicalize_dtype(jnp.float64)


def _distance(q_len: int, k_len: int, q_offset: Any) -> Array:
  """(j - (q_offset + i)) for query i, key j: `[q_len, k_len]` or `[batch, q_len, k_len]`."""
  q_offset = jnp.asarray(q_offset, jnp.int32)
  q_pos = jnp.arange(q_len, dtype=jnp.int32)[:, None] + q_offset[..., None, None]  # [.., q, 1]
  return jnp.arange(k_len, dtype=jnp.int32)[None, :] - q_pos  # [..., q_len, k_len]


def _with_heads(grid: Array) -> Array:
  """[q, k, heads] -> [heads, q, k]; [batch, q, k, heads] -> [batch, heads, q, k]."""
  return jnp.moveaxis(grid, -1, -3)


def alibi_bias(q_len: int, k_len: int, num_heads: int, *, causal: bool, q_offset: Any = 0,
               slopes: Any = None) -> Array:
  """ALiBi bias `[heads, q_len, k_len]`: bias[h, i, j] = -m_h · |(q_offset + i) - j|.

  causal=True is the paper's decoder form (-m_h · (i - j) for the keys j <= i it may see;
  the same formula, the future keys are masked by the caller); causal=False is the symmetric
  bidirectional form. q_offset is the position of query 0 among the keys (an int, or an int
  array `[batch]` for KV-cache decoding, then the bias is `[batch, heads, q_len, k_len]`).
  slopes defaults to alibi_slopes(num_heads).
  """
  del causal  # same formula; documented for the caller (future keys are masked anyway)
  m = jnp.asarray(alibi_slopes(num_heads) if slopes is None else slopes, _float_dtype())
  if m.shape != (num_heads,):
    raise ValueError(f"alibi slopes must have shape [num_heads={num_heads}]; got {m.shape}")
  dist = jnp.abs(_distance(q_len, k_len, q_offset)).astype(m.dtype)  # [..., q_len, k_len]
  return _with_heads(-dist[..., None] * m)  # [..., heads, q_len, k_len]


# ----------------------------------------------------------------------------- T5


def t5_relative_bucket(relative_position: Any, *, bidirectional: bool,
                       num_buckets: int = T5_NUM_BUCKETS,
                       max_distance: int = T5_MAX_DISTANCE) -> Array:
  """T5's bucket of a relative position (key - query), int32 of the same shape.

  With n = query - key: bidirectional splits the buckets in half, keys after the query
  (n < 0) in the upper half, and buckets |n|; causal buckets max(n, 0). Within a half of B
  buckets, distances below B/2 get their own bucket; a larger distance n gets
  B/2 + floor(log(n / (B/2)) / log(max_distance / (B/2)) · (B - B/2)), capped at B - 1
  (Raffel et al. 2020, section 2.1; the T5 code's `_relative_position_bucket`).
  """
  n = -jnp.asarray(relative_position, jnp.int32)
  ret = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    ret = ret + jnp.where(n < 0, num_buckets, 0)
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  nf = jnp.maximum(n, 1).astype(jnp.float32)
  large = max_exact + (jnp.log(nf / max_exact) / math.log(max_distance / max_exact)
                       * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return (ret + jnp.where(is_small, n, large)).astype(jnp.int32)


def init_t5_table(rng: Array, num_buckets: int = T5_NUM_BUCKETS, num_heads: int = 1,
                  stddev: float = 0.02) -> Array:
  """A T5 bias table `[num_buckets, heads]`, normal(0, stddev) (learned)."""
  return stddev * jax.random.normal(rng, (num_buckets, num_heads), jnp.float32)


def t5_bias(table: Array, q_len: int, k_len: int, *, bidirectional: bool, q_offset: Any = 0,
            num_buckets: int = T5_NUM_BUCKETS, max_distance: int = T5_MAX_DISTANCE) -> Array:
  """T5 relative position bias `[heads, q_len, k_len]`: table[bucket(j - (q_offset + i)), h].

  table `[num_buckets, heads]`; q_offset an int or an int array `[batch]` (KV-cache decoding,
  then `[batch, heads, q_len, k_len]`). Gradients flow into the table.
  """
  table = jnp.asarray(table)
  if table.ndim != 2 or table.shape[0] != num_buckets:
    raise ValueError(f"t5 bias table must have shape [num_buckets={num_buckets}, heads]; got "
                     f"{table.shape}")
  bucket = t5_relative_bucket(_distance(q_len, k_len, q_offset), bidirectional=bidirectional,
                              num_buckets=num_buckets, max_distance=max_distance)
  return _with_heads(table[bucket])  # [..., heads, q_len, k_len]


# ----------------------------------------------------------------------------- lazy biases


@dataclasses.dataclass(frozen=True)
class AlibiBias:
  """ALiBi as a recipe: `attend(..., bias=AlibiBias(slopes))` (the blocked kernel recomputes it).

  slopes `[heads]` (alibi_slopes); q_offset a static int (position of query 0 among the keys).
  """
  # per-head slopes m_h [heads]
  slopes: Any
  # position of query 0 among the keys (static int)
  q_offset: int = 0

  def materialize(self, q_len: int, k_len: int) -> Array:
    """The full bias `[heads, q_len, k_len]`."""
    m = jnp.asarray(self.slopes, _float_dtype())
    return alibi_bias(q_len, k_len, m.shape[0], causal=False, q_offset=self.q_offset, slopes=m)

  def tile(self, row_params: Array, dist: Array) -> Array:
    """Bias of one score tile: row_params `[G, 1]` slopes, dist `[bq, bk]` (key - query)."""
    return -row_params[:, :, None] * jnp.abs(dist).astype(row_params.dtype)[None]  # [G, bq, bk]

  def row_params(self) -> Array:
    """Per-head parameters `[heads, P]` that the kernel tiles along the rows."""
    return jnp.asarray(self.slopes, _float_dtype())[:, None]  # [heads, 1]

  def spec(self) -> "AlibiBias":
    """The static part (arrays dropped): hashable, for the blocked kernel's tiling."""
    return dataclasses.replace(self, slopes=None)


@dataclasses.dataclass(frozen=True)
class T5Bias:
  """T5 relative bias as a recipe: `attend(..., bias=T5Bias(table, bidirectional=...))`."""
  # learned bias table [num_buckets, heads]
  table: Any
  # bidirectional (encoder) or causal (decoder) bucketing
  bidirectional: bool = True
  # position of query 0 among the keys (static int)
  q_offset: int = 0
  # T5 bucket count and the distance of the last bucket
  num_buckets: int = T5_NUM_BUCKETS
  max_distance: int = T5_MAX_DISTANCE

  def materialize(self, q_len: int, k_len: int) -> Array:
    return t5_bias(self.table, q_len, k_len, bidirectional=self.bidirectional,
                   q_offset=self.q_offset, num_buckets=self.num_buckets,
                   max_distance=self.max_distance)

  def tile(self, row_params: Array, dist: Array) -> Array:
    """row_params `[G, num_buckets]`, dist `[bq, bk]` -> `[G, bq, bk]`."""
    bucket = t5_relative_bucket(dist, bidirectional=self.bidirectional,
                                num_buckets=self.num_buckets, max_distance=self.max_distance)
    # a gather (its gradient a scatter-add): half the CPU time of a one-hot einsum per tile
    return jnp.take(row_params, bucket, axis=1)  # [G, bq, bk]

  def row_params(self) -> Array:
    return jnp.swapaxes(jnp.asarray(self.table), 0, 1)  # [heads, num_buckets]

  def spec(self) -> "T5Bias":
    return dataclasses.replace(self, table=None)


def _flatten_bias(b):
  return (b.slopes,), (b.q_offset,)


def _flatten_t5(b):
  return (b.table,), (b.bidirectional, b.q_offset, b.num_buckets, b.max_distance)


jax.tree_util.register_pytree_node(AlibiBias, _flatten_bias,
                                   lambda aux, ch: AlibiBias(ch[0], *aux))
jax.tree_util.register_pytree_node(T5Bias, _flatten_t5, lambda aux, ch: T5Bias(ch[0], *aux))

# the lazily computed biases attend() and the blocked kernel accept
LAZY_BIASES = (AlibiBias, T5Bias)


def materialize(bias: Any, q_len: int, k_len: int) -> Array | None:
  """An additive bias as an array (None stays None; arrays pass through)."""
  if bias is None:
    return None
  if isinstance(bias, LAZY_BIASES):
    return bias.materialize(q_len, k_len)
  return jnp.asarray(bias)
