"""Blocked (flash-style) softmax attention for the dot and scaled_dot scores.

`blocked_attention` computes softmax(scale · q kᵀ) v without ever holding the full
`[..., q_len, k_len]` score matrix: queries and keys are cut into tiles, each query tile runs
over the key tiles with an online softmax (running row max and row sum), and a custom VJP
recomputes the score tiles in the backward pass from q, k and the saved row logsumexp. Peak
memory therefore grows linearly with the sequence length.

Tiles that a causal mask hides completely are never visited (the loop bounds depend on the
tile index), tiles it hides in part are masked, and tiles it leaves whole run without any
mask arithmetic. With a user mask every visited tile is masked, and each tile loop is bounded
by the first and last tile in which the mask (over the whole head group) leaves anything
visible, so the padding at the end of short sequences is skipped.

Position biases and sparsity patterns are recomputed per tile from the tile indices, so they
cost no quadratic memory either: `bias=` takes a positions.AlibiBias / positions.T5Bias (their
per-head parameters travel with the rows; the backward pass returns their gradient), and
`pattern=` a WindowPattern (sliding window) or BlockPattern (a block table such as BigBird's):
a WindowPattern's loops span its band of tiles, and a BlockPattern's walk each row's (column's)
list of visible tiles, computed from the static table (a global block makes the span from the
first to the last visible tile as long as the sequence, the list stays short), so block-sparse
attention costs time linear in the length.

A float32 call with no bias, sparsity pattern or tile setting, and with no mask or only a key
(padding) mask, runs the platform's fused attention kernel instead where there is one (the
"fused_attention" kernel of attnlab.backends: on a CPU with AVX-512, the C++ kernel of
attnlab.backends.cpu.fused_kernel): what `attend(..., implementation="auto")` makes for plain,
causal and padded attention, on one device or on each device's slice under a batch split. It
makes one pass per block of query rows with the scores in cache, on every core: 1.01-2.13x
torch's fused kernel, where the tile loops below were 0.76-1.07x
(experiments/benchmarks/README.md, 2026-11-26). Other calls take the tile loops.

The tile loops are pure JAX (`lax.fori_loop`, `lax.map`, `dot_general`), so the same code compiles
for CPU, GPU and TPU; the default tile sizes are tuned for XLA:CPU (see
experiments/benchmarks/README.md). On one device the tiles are large (ONE_DEVICE_TILES): XLA:CPU
splits each large tile op over its threads, so a single call uses every core; under a batch split
over CPU devices each device's loops get the smaller PER_DEVICE_TILES.

Row chunks (`parallel`): the flattened (batch * heads) rows can be cut into independent chunks,
each with its own tile loops (forward and backward alike); XLA's thunk executor then runs the
loops concurrently on its thread pool (a profile shows two worker threads). On the shared
2-core development machine this was measured 4-24% SLOWER than one chunk in every S=512/1024
cell (experiments/benchmarks/README.md, 2026-11-23), so the default is one chunk; the option
stays for machines with more cores and for further tuning.

Under a mesh (the trainer traces its step under it), the kernel runs on each device's slice of
the batch through `jax.shard_map` (`_batch_shards`): each device then runs its own tile loops.

Causal alignment follows `masks.causal_mask(offset=None)` and `core.attend`: query i may see
key j iff j <= i + max(k_len - q_len, 0), i.e. the queries are the last positions when
k_len > q_len (KV-cache decoding) and start at key 0 otherwise (q_len == k_len in the common
case).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from attnlab import backends
from attnlab import parallel
from attnlab.attention import core
from attnlab.attention import masks as masks_lib

Array = jax.Array

# scores this implementation computes (others go through core.attend's reference path)
SUPPORTED_SCORES: tuple[str, ...] = ("dot", "scaled_dot")


@dataclasses.dataclass(frozen=True)
class TileDefaults:
  """Default tile sizes of the kernel (each can be overridden per call)."""
  # query tile length (rows of each score tile)
  block_q: int
  # key tile length without a causal mask (one tile covering k_len <= block_k: plain softmax)
  block_k: int
  # query and key tile length under a causal mask (small enough to skip hidden tiles)
  causal_block: int
  # score-tile budget in elements (head_group * block_q * block_k); the head group fills it
  tile_elements: int


# One device holding all the process's threads (a plain `attend()` call): XLA:CPU splits a tile
# op over its threads only when the op is large, so the tiles are big (4 MiB of float32 scores):
# measured 1.03-1.55x faster in wall time than PER_DEVICE_TILES in every S = 512/1024 cell on 2
# cores (experiments/benchmarks/README.md, 2026-11-24 23:12 UTC).
ONE_DEVICE_TILES = TileDefaults(block_q=512, block_k=1024, causal_block=512,
                                tile_elements=1 << 20)
# Under a mesh that splits the batch over CPU devices (`_batch_shards`: one device per core),
# each device runs its own loops on one thread, so the tiles are the ones tuned in CPU time
# (2 MiB of scores; 256 x 256 causal tiles skip more of the hidden half).
PER_DEVICE_TILES = TileDefaults(block_q=128, block_k=1024, causal_block=256,
                                tile_elements=1 << 19)


@dataclasses.dataclass(frozen=True)
class _Tiling:
  """Static description of one blocked-attention problem (hashable: a custom_vjp static)."""
  # true (unpadded) query length
  q_len: int
  # true (unpadded) key length
  k_len: int
  # query tile length; the queries are padded to a multiple of it
  block_q: int
  # key tile length; the keys are padded to a multiple of it
  block_k: int
  # rows of the flattened leading dims handled per step (divides their product)
  head_group: int
  # independent row chunks (each with its own tile loops; XLA runs them concurrently)
  chunks: int
  # whether the look-ahead mask applies
  causal: bool
  # key j visible to query i iff j <= i + causal_offset (when causal)
  causal_offset: int
  # whether a user mask is given
  has_mask: bool
  # whether that mask has a leading axis of the full flattened size (else size 1)
  mask_rows: bool
  # whether the user mask varies along the queries (else broadcast along them)
  mask_q: bool
  # whether the user mask varies along the keys (else broadcast along them)
  mask_k: bool
  # whether to bound the tile loops by the tiles the user mask leaves visible
  skip_empty: bool
  # lazy position bias (positions.AlibiBias / T5Bias with its arrays removed) or None; its
  # per-row parameters travel with q, k, v and each score tile's bias is recomputed
  bias: Any = None
  # whether to skip, inside the visible range, each tile the user mask hides (block-sparse)
  skip_inner: bool = False
  # structured sparsity pattern (WindowPattern / BlockPattern) or None: its tile visibility
  # and in-tile mask are computed from tile indices, no [q_len, k_len] mask is formed
  pattern: Any = None

  def tile_bias(self, rp: Array, i: Any, j: Any) -> Array:
    """Additive bias of score tile (i, j) from the rows' parameters rp `[G, P]`: [G, bq, bk]."""
    bq, bk = self.block_q, self.block_k
    q_pos = self.bias.q_offset + i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    return self.bias.tile(rp, k_pos - q_pos)  # [G, bq, bk]

  @property
  def num_q_blocks(self) -> int:
    return -(-self.q_len // self.block_q)

  @property
  def num_k_blocks(self) -> int:
    return -(-self.k_len // self.block_k)

  @property
  def q_pad(self) -> int:
    return self.num_q_blocks * self.block_q

  @property
  def k_pad(self) -> int:
    return self.num_k_blocks * self.block_k

  @property
  def k_ragged(self) -> bool:
    """The last key tile holds padding keys that must be masked."""
    return self.k_pad != self.k_len

  def key_blocks(self, i: Any) -> tuple[Any, Any]:
    """(full_hi, hi) for query tile i: key tiles [0, full_hi) need no mask, [full_hi, hi) do."""
    nk, bq, bk = self.num_k_blocks, self.block_q, self.block_k
    hi: Any = nk
    full_hi: Any = self.k_len // bk
    if self.causal:
      last_row = i * bq + bq - 1 + self.causal_offset  # last key the tile's last row sees
      hi = jnp.minimum(nk, last_row // bk + 1)
      full_hi = jnp.minimum(full_hi, (i * bq + self.causal_offset + 1) // bk)
      full_hi = jnp.minimum(full_hi, hi)
    if self.has_mask or self.pattern is not None:
      full_hi = 0
    return full_hi, hi

  def query_blocks(self, j: Any) -> tuple[Any, Any]:
    """(lo, full_lo) for key tile j: query tiles [lo, full_lo) need a mask, [full_lo, nq) not."""
    nq, bq, bk = self.num_q_blocks, self.block_q, self.block_k
    lo: Any = 0
    full_lo: Any = 0
    if self.causal:
      first_row = jnp.maximum(j * bk - self.causal_offset, 0)  # first row that sees the tile
      lo = jnp.minimum(first_row // bq, nq)
      full_row = (j + 1) * bk - 1 - self.causal_offset  # first row that sees all of it
      full_lo = jnp.clip(-(-full_row // bq), lo, nq)
    if self.k_ragged:
      full_lo = jnp.where(j == self.num_k_blocks - 1, nq, full_lo)
    if self.has_mask or self.pattern is not None:
      full_lo = nq
    return lo, full_lo


def _fit_block(length: int, target: int) -> int:
  """Tile length <= target covering `length` in the fewest tiles, with little padding."""
  if length <= target:
    return length
  n = -(-length // target)
  block = -(-length // n)
  return min(-(-block // 8) * 8, target)


def _tile(x: Array, index: Any, size: int, axis: int = 1) -> Array:
  """Tile `index` (of length `size`) of x along `axis`."""
  return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _put(x: Array, tile: Array, index: Any, axis: int = 1) -> Array:
  """x with tile `index` along `axis` replaced by `tile`."""
  return lax.dynamic_update_slice_in_dim(x, tile, index * tile.shape[axis], axis=axis)


def _tile_mask(t: _Tiling, mask: Array | None, i: Any, j: Any) -> Array:
  """Which entries of score tile (i, j) may attend: bool broadcastable to [G, bq, bk]."""
  bq, bk = t.block_q, t.block_k
  k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (1, 1, bk), 2)  # [1, 1, bk]
  ok = None
  if t.causal:
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (1, bq, 1), 1)  # [1, bq, 1]
    ok = k_pos <= q_pos + t.causal_offset  # [1, bq, bk]
  if t.k_ragged:
    valid = k_pos < t.k_len  # [1, 1, bk]
    ok = valid if ok is None else ok & valid
  if t.has_mask:
    m = mask  # [G|1, q_pad|1, k_pad|1]
    if t.mask_q:
      m = _tile(m, i, bq, axis=1)
    if t.mask_k:
      m = _tile(m, j, bk, axis=2)
    ok = m if ok is None else ok & m  # [G|1, bq|1, bk|1]
  if t.pattern is not None:
    p = t.pattern.tile_mask(t, i, j)  # [1, bq, bk] or None (tile all visible)
    if p is not None:
      ok = p if ok is None else ok & p
  return ok


@dataclasses.dataclass(frozen=True)
class WindowPattern:
  """Sliding window: query i (at key position i + offset) sees keys |i + offset - j| <= window."""
  # largest |query position - key position| that is visible
  window: int
  # key position of query 0
  offset: int = 0

  def tile_mask(self, t: "_Tiling", i: Any, j: Any) -> Array:
    q_pos = i * t.block_q + lax.broadcasted_iota(jnp.int32, (1, t.block_q, 1), 1)
    k_pos = j * t.block_k + lax.broadcasted_iota(jnp.int32, (1, 1, t.block_k), 2)
    return jnp.abs(k_pos - q_pos - self.offset) <= self.window  # [1, bq, bk]

  def visible(self, t: "_Tiling") -> Array:
    """bool [nq, nk]: whether tile (i, j) holds any (query, key) pair within the window."""
    i = jnp.arange(t.num_q_blocks)[:, None]
    j = jnp.arange(t.num_k_blocks)[None, :]
    lo = j * t.block_k - (i * t.block_q + t.block_q - 1 + self.offset)  # min key - query
    hi = j * t.block_k + t.block_k - 1 - (i * t.block_q + self.offset)  # max key - query
    return (hi >= -self.window) & (lo <= self.window)


@dataclasses.dataclass(frozen=True)
class BlockPattern:
  """A block table: query block a sees key block b iff table[a][b] (tiles = blocks)."""
  # [q_blocks][k_blocks] visibility (a tuple of tuples: hashable, static)
  table: tuple
  # block length (the kernel's tile length along queries and keys)
  block: int

  def tile_mask(self, t: "_Tiling", i: Any, j: Any) -> None:
    del t, i, j  # a visible block is visible in full

  def visible(self, t: "_Tiling") -> Array:
    table = jnp.asarray(self.table, bool)
    if table.shape != (t.num_q_blocks, t.num_k_blocks):
      raise ValueError(f"block pattern table {table.shape} does not match the "
                       f"{t.num_q_blocks} x {t.num_k_blocks} tiles of block {self.block}")
    return table

  def visible_lists(self, axis: int) -> tuple[Array, Array]:
    """The visible tiles of each query row (axis=1) or key column (axis=0), compacted:
    (indices int32 [n, max count], padded with 0; counts int32 [n]). The tile loops walk these
    lists, so their length is the pattern's visible-tile count (O(len) for BigBird), not the
    span from the first to the last visible tile (O(len^2) with global blocks)."""
    table = np.asarray(self.table, bool)
    if axis == 0:
      table = table.T
    counts = table.sum(axis=1)
    lists = np.zeros((table.shape[0], max(int(counts.max(initial=0)), 1)), np.int32)
    for row, visible in enumerate(table):
      idx = np.flatnonzero(visible)
      lists[row, :len(idx)] = idx
    return jnp.asarray(lists), jnp.asarray(counts.astype(np.int32))


def _visible_table(t: _Tiling, mask: Array | None) -> tuple[Array | None, bool, bool]:
  """(tile visibility [nq|1, nk|1] or None, whether it varies along q, along k)."""
  user = _visible_tiles(t, mask) if t.has_mask and (t.skip_empty or t.pattern is not None) \
      else None
  if t.pattern is None:
    return user, t.mask_q, t.mask_k
  table = t.pattern.visible(t)  # [nq, nk]
  if user is not None:
    table = table & user
  return table, True, True


def _visible_tiles(t: _Tiling, mask: Array) -> Array:
  """Whether the user mask leaves any entry of tile (i, j) visible: bool [nq|1, nk|1]."""
  nq, bq = (t.num_q_blocks, t.block_q) if t.mask_q else (1, 1)
  nk, bk = (t.num_k_blocks, t.block_k) if t.mask_k else (1, 1)
  tiles = mask.reshape(mask.shape[0], nq, bq, nk, bk)  # [G|1, nq, bq, nk, bk]
  return jnp.any(tiles, axis=(0, 2, 4))  # [nq|1, nk|1]


def _visible_range(visible: Array, varies: bool, n: int) -> tuple[Any, Any]:
  """[lo, hi) spanning the visible tiles of one row/column of `_visible_tiles` (n tiles)."""
  if not varies:  # the mask is constant along this axis: all n tiles or none
    return 0, jnp.where(visible[0], n, 0)
  idx = jnp.arange(n)
  hi = jnp.max(jnp.where(visible, idx + 1, 0))
  lo = jnp.minimum(jnp.min(jnp.where(visible, idx, n)), hi)
  return lo, hi


def _loop(lo: Any, hi: Any, body, carry):
  """lax.fori_loop over [lo, hi) that vanishes when the range is statically empty."""
  if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
    return carry
  return lax.fori_loop(lo, hi, body, carry)


# ----------------------------------------------------------------------------- forward


def _forward_group(t: _Tiling, q: Array, k: Array, v: Array, rp: Array | None,
                   mask: Array | None) -> tuple[Array, Array]:
  """Forward pass for one head group: (out [G, q_pad, d_v], lse [G, q_pad])."""
  g, d_v = q.shape[0], v.shape[2]
  bq, bk = t.block_q, t.block_k
  dt = q.dtype
  visible, vary_q, vary_k = _visible_table(t, mask)

  def q_step(i, carry):
    out, lse = carry
    q_i = _tile(q, i, bq)  # [G, bq, d]

    def make_step(masked: bool):
      def k_step(j, c):
        m, l, acc = c
        k_j, v_j = _tile(k, j, bk), _tile(v, j, bk)  # [G, bk, d], [G, bk, d_v]
        s = jnp.einsum("gqd,gkd->gqk", q_i, k_j)  # [G, bq, bk]
        if t.bias is not None:
          s = s + t.tile_bias(rp, i, j)  # [G, bq, bk]
        ok = _tile_mask(t, mask, i, j) if masked else None
        if ok is not None:
          s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # [G, bq]
        # a row that has seen only masked keys keeps m = -inf; shift by 0 so exp gives 0
        m_use = m_new if ok is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_use[..., None])  # [G, bq, bk]
        alpha = jnp.exp(m - m_use)  # [G, bq]
        l = alpha * l + jnp.sum(p, axis=-1)
        pv = jnp.einsum("gqk,gkd->gqd", p, v_j)  # [G, bq, d_v]
        return m_new, l, alpha[..., None] * acc + pv
      return k_step

    # key tiles [0, full_hi) run unmasked, [lo, hi) masked (lo = full_hi without a user mask)
    full_hi, hi = t.key_blocks(i)
    lo = full_hi
    if visible is not None:  # tiles outside [vis_lo, vis_hi) are hidden by the user mask
      vis_lo, vis_hi = _visible_range(visible[i if vary_q else 0], vary_k, t.num_k_blocks)
      lo, hi = vis_lo, jnp.minimum(hi, vis_hi)
    init = _like(q, (jnp.full((g, bq), -jnp.inf, dt), jnp.zeros((g, bq), dt),
                     jnp.zeros((g, bq, d_v), dt)))
    c = _loop(0, full_hi, make_step(False), init)
    masked_step = make_step(True)
    if isinstance(t.pattern, BlockPattern):  # the row's visible tiles, inside [lo, hi)
      cols, counts = t.pattern.visible_lists(axis=1)
      m, l, acc = _walk_list(cols[i], counts[i], lo, hi, visible[i], masked_step, c)
    else:
      if visible is not None and t.skip_inner:  # block-sparse: skip each hidden tile
        row_vis = visible[i if vary_q else 0]
        masked_step = _skip_hidden(masked_step, lambda j: row_vis[j if vary_k else 0])
      m, l, acc = _loop(lo, hi, masked_step, c)
    seen = l > 0  # [G, bq]; False for rows with no visible key
    l_safe = jnp.where(seen, l, 1.0)
    out_i = acc / l_safe[..., None]  # [G, bq, d_v]
    lse_i = jnp.where(seen, m + jnp.log(l_safe), jnp.inf)  # [G, bq]; +inf: p = 0 in bwd
    return _put(out, out_i, i), _put(lse, lse_i, i)

  init = _like(q, (jnp.zeros((g, t.q_pad, d_v), dt), jnp.zeros((g, t.q_pad), dt)))
  return lax.fori_loop(0, t.num_q_blocks, q_step, init)


def _skip_hidden(step, visible_at):
  """A loop body that runs `step` only on tiles where visible_at(index) is True."""
  def body(index, carry):
    return lax.cond(visible_at(index), step, lambda _, c: c, index, carry)
  return body


def _walk_list(tiles: Array, count: Array, lo: Any, hi: Any, visible: Array, step, carry):
  """Runs `step(tile, carry)` on tiles[0:count] (a static pattern's visible tiles of one row or
  column) that lie in [lo, hi) and that `visible` (pattern AND user mask) keeps."""
  def body(index, c):
    tile = tiles[index]
    keep = visible[tile] & (tile >= lo) & (tile < hi)
    return lax.cond(keep, step, lambda _, c: c, tile, c)
  return lax.fori_loop(0, count, body, carry)


def _like(x: Array, carry: tuple[Array, ...]) -> tuple[Array, ...]:
  """Constant loop carries typed like `x` inside `jax.shard_map`: differing per device when `x`
  does (a loop's carry must keep its type; the data-parallel train step runs the kernel on
  each device's slice)."""
  return parallel.vary(carry, parallel.varying_axes(x))


# ----------------------------------------------------------------------------- backward


def _backward_group(t: _Tiling, q: Array, k: Array, v: Array, rp: Array | None,
                    mask: Array | None, lse: Array, delta: Array,
                    do: Array) -> tuple[Array, Array, Array, Array | None]:
  """Backward pass for one head group: (dq, dk, dv), recomputing the score tiles.

  Works on transposed score tiles `[G, bk, bq]` so that every tile product is a plain
  (or q·kᵀ-style) matmul; dq is accumulated transposed, `[G, d, q_pad]`.
  """
  g, d, d_v = q.shape[0], q.shape[2], v.shape[2]
  bq, bk = t.block_q, t.block_k
  dt = q.dtype
  k_t = jnp.swapaxes(k, 1, 2)  # [G, d, k_pad]
  visible, vary_q, vary_k = _visible_table(t, mask)

  def k_step(j, carry):
    dq_t, dk, dv, drp = carry
    k_j, v_j = _tile(k, j, bk), _tile(v, j, bk)  # [G, bk, d], [G, bk, d_v]
    k_t_j = _tile(k_t, j, bk, axis=2)  # [G, d, bk]

    def make_step(masked: bool):
      def q_step(i, c):
        dk_j, dv_j, dq_t, drp = c
        # [G, bq, d], [G, bq, d_v], [G, bq], [G, bq]
        q_i, do_i, lse_i, delta_i = (_tile(x, i, bq) for x in (q, do, lse, delta))
        s_t = jnp.einsum("gkd,gqd->gkq", k_j, q_i)  # [G, bk, bq]
        if t.bias is not None:
          bias_ij, bias_vjp = jax.vjp(lambda p: t.tile_bias(p, i, j), rp)  # [G, bq, bk]
          s_t = s_t + jnp.swapaxes(bias_ij, 1, 2)
        ok = _tile_mask(t, mask, i, j) if masked else None
        if ok is not None:
          s_t = jnp.where(jnp.swapaxes(ok, 1, 2), s_t, -jnp.inf)
        p_t = jnp.exp(s_t - lse_i[:, None, :])  # [G, bk, bq]; 0 where masked or row empty
        dv_j = dv_j + jnp.einsum("gkq,gqd->gkd", p_t, do_i)  # [G, bk, d_v]
        dp_t = jnp.einsum("gkd,gqd->gkq", v_j, do_i)  # [G, bk, bq]
        ds_t = p_t * (dp_t - delta_i[:, None, :])  # [G, bk, bq]
        dk_j = dk_j + jnp.einsum("gkq,gqd->gkd", ds_t, q_i)  # [G, bk, d]
        dq_t_i = _tile(dq_t, i, bq, axis=2) + jnp.einsum("gdk,gkq->gdq", k_t_j, ds_t)  # [G, d, bq]
        if t.bias is not None:
          drp = drp + bias_vjp(jnp.swapaxes(ds_t, 1, 2))[0]  # [G, P]
        return dk_j, dv_j, _put(dq_t, dq_t_i, i, axis=2), drp
      return q_step

    # query tiles [lo, hi) run masked, [full_lo, nq) unmasked (hi = full_lo without a user mask)
    lo, full_lo = t.query_blocks(j)
    hi = full_lo
    if visible is not None:  # tiles outside [vis_lo, vis_hi) are hidden by the user mask
      vis_lo, vis_hi = _visible_range(visible[:, j if vary_k else 0], vary_q, t.num_q_blocks)
      lo, hi = jnp.maximum(lo, vis_lo), jnp.minimum(hi, vis_hi)
    init = (*_like(q, (jnp.zeros((g, bk, d), dt), jnp.zeros((g, bk, d_v), dt))), dq_t, drp)
    masked_step = make_step(True)
    if isinstance(t.pattern, BlockPattern):  # the column's visible tiles, inside [lo, hi)
      rows, counts = t.pattern.visible_lists(axis=0)
      c = _walk_list(rows[j], counts[j], lo, hi, visible[:, j], masked_step, init)
    else:
      if visible is not None and t.skip_inner:  # block-sparse: skip each hidden tile
        col_vis = visible[:, j if vary_k else 0]
        masked_step = _skip_hidden(masked_step, lambda i: col_vis[i if vary_q else 0])
      c = _loop(lo, hi, masked_step, init)
    dk_j, dv_j, dq_t, drp = _loop(full_lo, t.num_q_blocks, make_step(False), c)
    return dq_t, _put(dk, dk_j, j), _put(dv, dv_j, j), drp

  drp0 = None if rp is None else jnp.zeros_like(rp)
  init = _like(q, (jnp.zeros((g, d, t.q_pad), dt), jnp.zeros((g, t.k_pad, d), dt),
                   jnp.zeros((g, t.k_pad, d_v), dt))) + (drp0,)
  dq_t, dk, dv, drp = lax.fori_loop(0, t.num_k_blocks, k_step, init)
  return jnp.swapaxes(dq_t, 1, 2), dk, dv, drp  # dq [G, q_pad, d]


# ----------------------------------------------------------------------------- head groups


def _map_groups(t: _Tiling, fn, arrays: tuple[Array, ...], mask: Array | None):
  """Applies fn(*arrays, mask) to consecutive head groups of the flattened leading axis.

  The rows are cut into t.chunks independent chunks (separate loops, run concurrently by
  XLA:CPU's thunk executor), each mapped over its head groups.
  """
  rows = arrays[0].shape[0]
  if t.chunks > 1:
    c = rows // t.chunks
    split_mask = mask is not None and t.mask_rows
    outs = [_map_chunk(t, fn, tuple(a[i * c:(i + 1) * c] for a in arrays),
                       mask[i * c:(i + 1) * c] if split_mask else mask)
            for i in range(t.chunks)]
    return tuple(jnp.concatenate(parts, axis=0) for parts in zip(*outs))
  return _map_chunk(t, fn, arrays, mask)


def _map_chunk(t: _Tiling, fn, arrays: tuple[Array, ...], mask: Array | None):
  """fn over the consecutive head groups of one chunk of rows (a lax.map when more than one)."""
  rows = arrays[0].shape[0]
  n = rows // t.head_group
  if n == 1:
    return fn(*arrays, mask)
  split = lambda x: x.reshape((n, t.head_group) + x.shape[1:])  # [n, G, ...]
  if mask is not None and t.mask_rows:
    outs = lax.map(lambda a: fn(*a[:-1], a[-1]), tuple(map(split, arrays)) + (split(mask),))
  else:
    outs = lax.map(lambda a: fn(*a, mask), tuple(map(split, arrays)))
  return tuple(x.reshape((rows,) + x.shape[2:]) for x in outs)


def _with_rp(t: _Tiling, arrays: tuple[Array, ...], rp: Array | None):
  """arrays + (rp,) when a bias travels with the rows (else arrays, rp given as None)."""
  return arrays + ((rp,) if t.bias is not None else ())


def _forward_fn(t: _Tiling):
  def fn(q, k, v, *rest):
    rp, mask = (rest[0], rest[1]) if t.bias is not None else (None, rest[0])
    return _forward_group(t, q, k, v, rp, mask)
  return fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked(t: _Tiling, q: Array, k: Array, v: Array, mask: Array | None,
             rp: Array | None) -> Array:
  out, _ = _map_groups(t, _forward_fn(t), _with_rp(t, (q, k, v), rp), mask)
  return out


def _blocked_fwd(t: _Tiling, q: Array, k: Array, v: Array, mask: Array | None,
                 rp: Array | None):
  out, lse = _map_groups(t, _forward_fn(t), _with_rp(t, (q, k, v), rp), mask)
  return out, (q, k, v, mask, rp, out, lse)


def _blocked_bwd(t: _Tiling, res, do: Array):
  q, k, v, mask, rp, out, lse = res
  delta = jnp.sum(do * out, axis=-1)  # [rows, q_pad]

  def group(q, k, v, lse, delta, do, *rest):
    rp, mask = (rest[0], rest[1]) if t.bias is not None else (None, rest[0])
    dq, dk, dv, drp = _backward_group(t, q, k, v, rp, mask, lse, delta, do)
    return (dq, dk, dv) + ((drp,) if t.bias is not None else ())

  grads = _map_groups(t, group, _with_rp(t, (q, k, v, lse, delta, do), rp), mask)
  drp = grads[3] if t.bias is not None else None
  return grads[0], grads[1], grads[2], None, drp


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


# ----------------------------------------------------------------------------- public API


def _check_positive(name: str, value: Any, what: str = "tile length") -> int:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name} must be a positive int ({what}); got {value!r}")
  return value


# row chunks by default (see the module docstring: more chunks measured slower on 2 cores)
DEFAULT_PARALLEL = 1


def _group_size(rows: int, target: int) -> int:
  """Largest divisor of `rows` that is <= target."""
  return next(g for g in range(max(1, min(rows, target)), 0, -1) if rows % g == 0)


def _batch_shards(q: Array, k: Array, v: Array, mask: Any, bias: Any = None):
  """Under a mesh (`jax.set_mesh`, or `jax.sharding.use_abstract_mesh` as the train step traces
  the model) whose devices split the batch: a
  function that runs a kernel on each device's slice of the batch (`jax.shard_map` over every
  mesh axis), else None. Left to the compiler, the tile loops' slicing of a batch-sharded array
  made XLA:CPU run the kernel 1.4-2x slower on two devices than on one; per slice, each device
  runs its own loops (experiments/benchmarks/README.md, attention.py's blocked-devices)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or q.ndim < 3:
    return None
  if any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return None  # inside shard_map (manual axes) or explicit sharding: leave it as it is
  batch = q.shape[0]
  if batch % mesh.size or any(x.ndim != q.ndim or x.shape[0] != batch for x in (k, v)):
    return None
  split = P(tuple(mesh.axis_names))
  mask = None if mask is None else jnp.asarray(mask)
  mask_split = mask is not None and mask.ndim == q.ndim and mask.shape[0] == batch

  def run(kernel):
    # the bias's parameters enter as a replicated argument (a closed-over traced array does
    # not lower inside shard_map on CPU)
    inner = lambda q, k, v, m, b: kernel(q, k, v, mask=m, bias=b)
    specs = (split, split, split, split if mask_split else P(), P())
    return jax.shard_map(inner, mesh=mesh, in_specs=specs, out_specs=split,
                         check_vma=False)(q, k, v, mask, bias)
  return run


def _fused_kernel(q: Array, k: Array, v: Array) -> Any:
  """The fused attention kernel (attnlab.backends' "fused_attention") if it can compute this
  call: float32 math (inputs of at most 32 bits), matching feature dims, non-empty lengths, and
  the kernel in use and able to run here (`usable()`); else None."""
  dt = jnp.result_type(q, k, v)
  if not (jnp.issubdtype(dt, jnp.floating) and jnp.dtype(dt).itemsize <= 4
          and q.shape[-1] == k.shape[-1] and q.shape[-2] > 0 and k.shape[-2] > 0):
    return None
  fused = backends.kernel("fused_attention")
  return fused if fused is not None and fused.usable() else None


def _key_mask_rows(q: Array, k: Array, v: Array, mask: Any) -> Array | None:
  """A mask that hides keys alike for every query (shape `[..., 1, k_len]`) and whose leading
  dims are those of the rows up to some axis, then ones (`[batch, 1, 1, k_len]` against
  `[batch, heads]` rows): as `[mask_rows, k_len]` bool, each row shared by consecutive rows (what
  the fused kernel takes). None for any other mask (the tile loops take those)."""
  lead = tuple(jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
  q_len, k_len = q.shape[-2], k.shape[-2]
  if jnp.issubdtype(jnp.asarray(mask).dtype, jnp.inexact):
    return None  # refused with its message by the tile loops' check
  mask = masks_lib.check_mask(mask, lead + (q_len, k_len))
  if mask.shape[-2] != 1 or mask.shape[-1] != k_len:
    return None
  mask_lead = (1,) * (len(lead) + 2 - mask.ndim) + tuple(mask.shape[:-2])
  shared = len(lead)
  while shared > 0 and mask_lead[shared - 1] == 1:
    shared -= 1
  if mask_lead[:shared] != lead[:shared]:
    return None
  return mask.reshape((math.prod(lead[:shared]), k_len))


def _fused(fused: Any, q: Array, k: Array, v: Array, key_mask: Array | None,
           scale: float | None, causal: bool, threads: int | None = None) -> Array:
  """blocked_attention's result through the fused kernel's `attention` (q, k, v
  `[..., len, feat]`; key_mask None or what _key_mask_rows made of the call's mask)."""
  out_dtype = jnp.result_type(q, k, v)
  lead = tuple(jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
  rows = math.prod(lead)
  if rows == 0:
    return jnp.zeros(lead + (q.shape[-2], v.shape[-1]), out_dtype)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

  def rows_of(x: Array) -> Array:
    x = jnp.broadcast_to(x.astype(jnp.float32), lead + x.shape[-2:])
    return x.reshape((rows,) + x.shape[-2:])
  out = fused.attention(rows_of(q) * scale, rows_of(k), rows_of(v), bool(causal), threads,
                        key_mask)
  return out.reshape(lead + (q.shape[-2], v.shape[-1])).astype(out_dtype)


def blocked_attention(q: Array, k: Array, v: Array, *, scale: float | None = None,
                      mask: Any = None, causal: bool = False, block_q: int | None = None,
                      block_k: int | None = None, head_group: int | None = None,
                      skip_empty_tiles: bool = True, parallel: int | None = None,
                      bias: Any = None, block_sparse: bool = False,
                      pattern: Any = None, tiles: TileDefaults | None = None) -> Array:
  """softmax(scale · q kᵀ, masked) v, computed tile by tile (flash-style).

  Args:
    q: queries `[..., q_len, d]`.
    k: keys `[..., k_len, d]`.
    v: values `[..., k_len, d_v]`; leading (batch, head) dims of q, k, v broadcast.
    scale: multiplies the dot products; None = 1/sqrt(d) (scaled_dot), 1.0 = dot score.
    mask: bool broadcastable to `[..., q_len, k_len]`, True = may attend (a padding mask
      arrives as `[batch, 1, 1, k_len]`).
    causal: query i may see key j iff j <= i + max(k_len - q_len, 0).
    block_q, block_k: query / key tile lengths; default from `tiles` (one device: 512 / 1024,
      or 512 / 512 when causal). Lengths that are not a multiple are padded and masked
      internally; a length shorter than its tile is one tile.
    head_group: flattened (batch * heads) rows per tile step; default fills a score tile of
      `tiles.tile_elements` (head_group * block_q * block_k); rounded down to a divisor of
      the number of rows.
    skip_empty_tiles: bound the tile loops by the first and last tile that the user mask
      leaves visible (False visits every tile; the result is the same).
    parallel: independent chunks of the flattened rows, each with its own tile loops (XLA:CPU
      runs them concurrently); None = DEFAULT_PARALLEL (1); rounded down to a divisor of the
      number of rows.
    bias: None or a lazy position bias (positions.AlibiBias / positions.T5Bias) added to the
      scaled scores; each tile's bias is recomputed from the tile indices (nothing quadratic
      is stored) and its parameters get their gradients. The leading dims must end with the
      heads axis of the bias's parameters.
    block_sparse: also skip, inside each tile loop's visible range, every tile the mask hides
      (a lax.cond per tile): for block-sparse masks (sliding window, BigBird) whose visible
      tiles are not contiguous. Use tiles aligned with the pattern's blocks.
    pattern: a structured sparsity pattern ANDed with the mask, computed per tile from the
      tile indices (no [q_len, k_len] array): WindowPattern(window, offset) or
      BlockPattern(table, block) (then both tile lengths are `block`). Hidden tiles are
      skipped one by one, so a pattern with O(len) visible tiles costs O(len) time and memory.
    tiles: the defaults of block_q, block_k and head_group; None = ONE_DEVICE_TILES, or
      PER_DEVICE_TILES for each device's slice when a mesh splits the batch over CPU devices
      and for `pattern` / `block_sparse` calls.

  Returns:
    context `[..., q_len, d_v]` in the inputs' dtype. A query with no visible key gets a zero
    context and zero gradients. Computation runs in at least float32.
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  core.check_qkv(q, k, v)
  per_shard = _batch_shards(q, k, v, mask, bias)
  # A call with no bias, sparsity or tile settings, and no mask or only a key (padding) mask
  # `[batch, 1, 1, k_len]`, may run the platform's fused kernel (attnlab.backends; on an AVX-512
  # CPU, float32 math, the C++ kernel), which keeps each block's scores in cache; under a batch
  # split over devices each device runs it on its slice with its share of the threads.
  plain_call = (tiles is None and bias is None and pattern is None
                and not block_sparse and block_q is None and block_k is None
                and head_group is None and parallel is None)
  key_rows = None if mask is None or not plain_call else _key_mask_rows(q, k, v, mask)
  fused = (_fused_kernel(q, k, v) if plain_call and (mask is None or key_rows is not None)
           else None)
  if fused is not None:
    # on a mesh of devices (split here, or inside the data-parallel step's shard_map) each
    # device's call gets its share of the threads
    mesh = jax.sharding.get_abstract_mesh()
    threads = None if mesh.empty else max(1, fused.default_threads() // mesh.size)
    if per_shard is None:
      return _fused(fused, q, k, v, key_rows, scale, causal, threads)

    def on_slice(q, k, v, mask, bias):  # the mask as each device's slice of it
      rows = None if mask is None else _key_mask_rows(q, k, v, mask)
      return _fused(fused, q, k, v, rows, scale, causal, threads)
    return per_shard(on_slice)
  # the smaller tiles for each device's slice (one thread per device) and for sparsity patterns
  # (their efficiency was measured with them); the large ones for a whole device
  if tiles is None:
    small = per_shard is not None or pattern is not None or block_sparse
    tiles = PER_DEVICE_TILES if small else ONE_DEVICE_TILES
  if per_shard is not None:
    return per_shard(functools.partial(
        blocked_attention, scale=scale, causal=causal, block_q=block_q, block_k=block_k,
        head_group=head_group, skip_empty_tiles=skip_empty_tiles, parallel=parallel,
        block_sparse=block_sparse, pattern=pattern, tiles=tiles))
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"q and k must share the feature dim d for a dot score; got q {q.shape}, "
                     f"k {k.shape}")
  lead = tuple(jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
  if block_q is None:
    block_q = tiles.causal_block if causal else tiles.block_q
  if block_k is None:
    block_k = tiles.causal_block if causal else tiles.block_k
  block_q = _check_positive("block_q", block_q)
  block_k = _check_positive("block_k", block_k)
  if head_group is not None:
    head_group = _check_positive("head_group", head_group)

  out_dtype = jnp.result_type(q, k, v)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    out_dtype = jnp.float32
  dt = jnp.promote_types(out_dtype, jnp.float32)
  q_len, d = q.shape[-2:]
  k_len, d_v = v.shape[-2:]
  rows = math.prod(lead)
  if q_len == 0 or k_len == 0 or rows == 0:
    return jnp.zeros(lead + (q_len, d_v), out_dtype)
  scale = 1.0 / math.sqrt(d) if scale is None else scale

  if mask is not None:
    mask = masks_lib.check_mask(mask, lead + (q_len, k_len))
    mask = mask.reshape((1,) * (len(lead) + 2 - mask.ndim) + mask.shape)
  if isinstance(pattern, BlockPattern):  # tiles are the pattern's blocks (no refitting)
    block_q = block_k = pattern.block
  else:
    block_q, block_k = _fit_block(q_len, block_q), _fit_block(k_len, block_k)
  if head_group is None:
    head_group = max(1, tiles.tile_elements // (block_q * block_k))
  chunks = _group_size(rows, DEFAULT_PARALLEL if parallel is None
                       else _check_positive("parallel", parallel, "row chunks"))
  t = _Tiling(
      q_len=q_len, k_len=k_len, block_q=block_q, block_k=block_k,
      head_group=_group_size(rows // chunks, head_group), chunks=chunks,
      causal=bool(causal), causal_offset=max(k_len - q_len, 0), has_mask=mask is not None,
      mask_rows=mask is not None and math.prod(mask.shape[:-2]) > 1,
      mask_q=mask is not None and mask.shape[-2] > 1,
      mask_k=mask is not None and mask.shape[-1] > 1, skip_empty=bool(skip_empty_tiles),
      bias=None if bias is None else bias.spec(),
      skip_inner=bool(block_sparse) or pattern is not None, pattern=pattern)

  def flat(x: Array, length: int, pad: int) -> Array:
    x = jnp.broadcast_to(x.astype(dt), lead + x.shape[-2:]).reshape((rows, length, -1))
    return jnp.pad(x, ((0, 0), (0, pad - length), (0, 0)))  # [rows, pad, feat]

  qf = flat(q.astype(dt) * scale, q_len, t.q_pad)  # [rows, q_pad, d]
  kf = flat(k, k_len, t.k_pad)  # [rows, k_pad, d]
  vf = flat(v, k_len, t.k_pad)  # [rows, k_pad, d_v]
  mf = None
  if mask is not None:
    m_rows = rows if t.mask_rows else 1
    m_q, m_k = mask.shape[-2:]
    mf = jnp.broadcast_to(mask, (lead if t.mask_rows else (1,) * len(lead)) + (m_q, m_k))
    mf = mf.reshape((m_rows, m_q, m_k))
    mf = jnp.pad(mf, ((0, 0), (0, t.q_pad - q_len if t.mask_q else 0),
                      (0, t.k_pad - k_len if t.mask_k else 0)))  # [rows|1, q_pad|1, k_pad|1]
  rp = None
  if bias is not None:
    rp = bias.row_params().astype(dt)  # [heads, P]
    if not lead or rp.shape[0] not in (1, lead[-1]):
      raise ValueError(f"the bias has {rp.shape[0]} heads but the leading dims of q/k/v "
                       f"{lead} do not end with a heads axis of that size")
    rp = jnp.broadcast_to(rp, lead + rp.shape[-1:]).reshape(rows, -1)  # [rows, P]
  out = _blocked(t, qf, kf, vf, mf, rp)  # [rows, q_pad, d_v]
  return out[:, :q_len].reshape(lead + (q_len, d_v)).astype(out_dtype)
