"""Boolean attention masks: True = may attend.

Every mask broadcasts to logits `[batch, heads, q_len, k_len]`. `check_mask` is the
validation used by the attention functions; it also lets the 4-D masks made here be used
with 3-D single-head logits `[batch, q_len, k_len]` (see its docstring).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def padding_mask(lengths_or_valid: Any, k_len: int | None = None, *,
                 q_valid: Any = None) -> Array:
  """Key padding mask `[batch, 1, 1, k_len]` (or `[batch, 1, q_len, k_len]` with q_valid).

  Args:
    lengths_or_valid: integer key lengths `[batch]` (then `k_len` is required), or a bool
      valid-token array `[batch, k_len]` (True = real token).
    k_len: number of key positions; only with lengths (must match a valid array's last dim).
    q_valid: optional bool `[batch, q_len]`, True = real query. Padded queries get no allowed
      key, so their attention weights and context are all zero. Build it from query lengths
      with `jnp.arange(q_len) < q_lengths[:, None]`.
  """
  x = jnp.asarray(lengths_or_valid)
  if x.dtype == jnp.bool_:
    if x.ndim < 1:
      raise ValueError(f"a valid-token mask must have shape [batch, k_len]; got {x.shape}")
    if k_len is not None and k_len != x.shape[-1]:
      raise ValueError(f"k_len={k_len} does not match the valid mask's last dim {x.shape}")
    keys = x  # [batch, k_len]
  elif jnp.issubdtype(x.dtype, jnp.integer):
    if k_len is None:
      raise ValueError("padding_mask(lengths) needs k_len (the padded key length); pass "
                       "padding_mask(lengths, k_len) or a bool valid array [batch, k_len]")
    keys = jnp.arange(k_len) < x[..., None]  # [batch, k_len]
  else:
    raise ValueError(f"padding_mask expects integer lengths [batch] or a bool valid array "
                     f"[batch, k_len]; got dtype {x.dtype} with shape {x.shape}")
  mask = keys[..., None, None, :]  # [batch, 1, 1, k_len]
  if q_valid is None:
    return mask
  q_valid = jnp.asarray(q_valid)
  if q_valid.dtype != jnp.bool_ or q_valid.ndim < 1:
    raise ValueError(f"q_valid must be a bool array [batch, q_len]; got dtype {q_valid.dtype} "
                     f"with shape {q_valid.shape}")
  return jnp.logical_and(mask, q_valid[..., None, :, None])  # [batch, 1, q_len, k_len]


def _offset_grid(q_len: int, k_len: int, offset: Any) -> Array:
  """(j - i - offset) for every query i, key j: `[..., q_len, k_len]` (offset scalar or [batch])."""
  offset = jnp.asarray(offset)
  i = jnp.arange(q_len)[:, None] + offset[..., None, None]  # [..., q_len, 1]
  return jnp.arange(k_len)[None, :] - i  # [..., q_len, k_len]


def _to_4d(grid_mask: Array) -> Array:
  """[q, k] -> [1, 1, q, k]; [batch, q, k] -> [batch, 1, q, k]."""
  if grid_mask.ndim == 2:
    return grid_mask[None, None]
  return grid_mask[..., None, :, :]


def causal_mask(q_len: int, k_len: int | None = None, *, offset: Any = 0) -> Array:
  """Look-ahead mask `[1, 1, q_len, k_len]`: query i may see keys j <= i + offset.

  offset=0 (default) aligns query 0 with key 0. offset=None aligns the queries to the end of
  the keys, offset = max(k_len - q_len, 0), which is what KV-cache decoding needs (the
  queries are the last positions). offset may also be a traced int scalar (the current
  decoding position) or an int array `[batch]` (then the mask is `[batch, 1, q_len, k_len]`).
  `attend(..., causal=True)` uses offset=None.
  """
  k_len = q_len if k_len is None else k_len
  if offset is None:
    offset = max(k_len - q_len, 0)
  return _to_4d(_offset_grid(q_len, k_len, offset) <= 0)


def local_mask(q_len: int, k_len: int, window: int, *, offset: Any = 0) -> Array:
  """Sliding-window mask `[1, 1, q_len, k_len]`: query i may see keys |i + offset - j| <= window."""
  if window < 0:
    raise ValueError(f"window must be >= 0 (keys within |i - j| <= window); got {window}")
  return _to_4d(jnp.abs(_offset_grid(q_len, k_len, offset)) <= window)


def combine(*masks: Any) -> Array | None:
  """Logical AND of broadcastable masks, ignoring None; None when every mask is None."""
  present = [jnp.asarray(m) for m in masks if m is not None]
  if not present:
    return None
  try:
    jnp.broadcast_shapes(*(m.shape for m in present))
  except ValueError:
    raise ValueError("masks do not broadcast together: shapes "
                     f"{[tuple(m.shape) for m in present]}; expected masks broadcastable to "
                     "[batch, heads, q_len, k_len]") from None
  out = present[0].astype(bool)
  for m in present[1:]:
    out = jnp.logical_and(out, m)
  return out


def check_mask(mask: Any, logits_shape: tuple[int, ...]) -> Array:
  """Validates a mask against the logits' shape and returns it as bool.

  The mask must broadcast to `logits_shape` without growing it. Two conveniences let the
  4-D masks of this module serve 3-D/2-D logits: extra leading size-1 axes are dropped, and
  a singleton heads axis (`[batch, 1, q|1, k]` against logits `[batch, q, k]`) is removed.
  Integer 0/1 masks are accepted; float masks are refused (they look like additive biases).
  Raises ValueError naming both shapes when the mask does not fit.
  """
  mask = jnp.asarray(mask)
  if jnp.issubdtype(mask.dtype, jnp.floating) or jnp.issubdtype(mask.dtype, jnp.complexfloating):
    raise ValueError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}. For an "
                     "additive bias add it to the logits instead")
  mask = mask.astype(bool)
  given_shape = tuple(mask.shape)
  logits_shape = tuple(logits_shape)
  while mask.ndim > len(logits_shape) and mask.shape[0] == 1:
    mask = mask[0]
  if mask.ndim == len(logits_shape) + 1 and len(logits_shape) >= 2 and mask.shape[-3] == 1:
    mask = mask[..., 0, :, :]
  try:
    ok = np.broadcast_shapes(mask.shape, logits_shape) == logits_shape
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(f"mask of shape {given_shape} does not broadcast to the logits' shape "
                     f"{logits_shape}; expected a bool mask broadcastable to [..., q_len, k_len], "
                     "e.g. [batch, 1, 1, k_len] or [batch, heads, q_len, k_len]")
  return mask
