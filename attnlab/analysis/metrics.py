"""Per-layer, per-head attention statistics of a Capture (numpy only).

  table = head_table(cap)          # one dict per (layer path, head): what the viewer lists
  h = entropy(cap.weights[path], kind=cap.kind[path])          # [heads, q_len] nats
  r = attention_rollout(cap)       # [n, n] rollout through the self-attention stack

Definitions, for weights w `[..., q_len, k_len]` (row i = query i, column j = key j):
- entropy H_i = -sum_j w_ij log w_ij (nats); normalised by log(n_i), n_i the number of keys
  query i may attend to: k_len, or i + 1 + (k_len - q_len) under a causal mask (keys aligned to
  the end, as attnlab.attention.core does). Rows with n_i = 1 have no normalised entropy (NaN,
  left out of the means).
- offset: sum_j w_ij (j - i), the mean attended position relative to the diagonal (negative =
  looks back), and the mean distance sum_j w_ij |j - i|.
- special-token mass: sum of w_ij over the keys whose token is special ([CLS], [SEP], <start>,
  <end>, <pad>, <unk>, [MASK]: attnlab.data.tokenizers.SPECIAL_TOKENS).
- rollout (Abnar & Zuidema 2020): per layer average the heads, add the identity for the residual
  connection and renormalise the rows, A_l = (mean_h W_l + I) / 2; rollout = A_L ... A_2 A_1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from attnlab.data.tokenizers import SPECIAL_TOKENS

__all__ = ["allowed_keys", "attention_rollout", "entropy", "head_table", "mean_abs_offset",
           "mean_offset", "normalized_entropy", "special_token_mass", "KINDS", "SPECIAL_TOKENS"]

# Attention kinds a Capture names.
KINDS = ("self", "causal", "cross")


def _weights(w: Any) -> np.ndarray:
  w = np.asarray(w, np.float64)
  if w.ndim < 2:
    raise ValueError(f"attention weights must be [..., q_len, k_len], got shape {w.shape}")
  return w


def allowed_keys(q_len: int, k_len: int, kind: str = "self") -> np.ndarray:
  """Number of keys each query may attend to `[q_len]`."""
  if kind not in KINDS:
    raise ValueError(f"unknown attention kind {kind!r}; valid kinds: {', '.join(KINDS)}")
  if kind != "causal":
    return np.full((q_len,), k_len, np.int64)
  return np.clip(np.arange(q_len) + 1 + max(k_len - q_len, 0), 0, k_len)


def entropy(weights: Any) -> np.ndarray:
  """Entropy in nats of every row: `[..., q_len]`."""
  w = _weights(weights)
  logs = np.log(np.where(w > 0, w, 1.0))
  return -np.sum(w * logs, axis=-1)


def normalized_entropy(weights: Any, kind: str = "self") -> np.ndarray:
  """Entropy / log(number of keys the row may attend to) `[..., q_len]`; NaN where that is 1."""
  w = _weights(weights)
  n = allowed_keys(w.shape[-2], w.shape[-1], kind).astype(np.float64)  # [q_len]
  denom = np.where(n > 1, np.log(np.maximum(n, 1)), np.nan)
  return entropy(w) / denom


def _offsets(q_len: int, k_len: int) -> np.ndarray:
  return np.arange(k_len)[None, :] - np.arange(q_len)[:, None]  # [q_len, k_len]: j - i


def mean_offset(weights: Any) -> np.ndarray:
  """sum_j w_ij (j - i) per row `[..., q_len]`."""
  w = _weights(weights)
  return np.sum(w * _offsets(*w.shape[-2:]), axis=-1)


def mean_abs_offset(weights: Any) -> np.ndarray:
  """sum_j w_ij |j - i| per row `[..., q_len]`."""
  w = _weights(weights)
  return np.sum(w * np.abs(_offsets(*w.shape[-2:])), axis=-1)


def special_token_mass(weights: Any, key_tokens: Sequence[str],
                       specials: Sequence[str] = SPECIAL_TOKENS) -> np.ndarray:
  """Attention mass on the special keys per row `[..., q_len]`."""
  w = _weights(weights)
  if len(key_tokens) != w.shape[-1]:
    raise ValueError(f"{len(key_tokens)} key tokens given for {w.shape[-1]} keys")
  special = np.array([t in set(specials) for t in key_tokens], bool)  # [k_len]
  return np.sum(w * special, axis=-1)


def attention_rollout(layers: Any, side: str | None = None) -> np.ndarray:
  """Attention rollout `[n, n]` through a stack of self-attention layers.

  Args:
    layers: a Capture (its self/causal layers of one token side, in path order), or a sequence of
      per-layer weights `[heads, n, n]` (or `[n, n]`), first layer first.
    side: with a Capture, the token side whose stack to roll out ("tokens", "source",
      "target"); None = the only side that has self-attention.
  Returns:
    R `[n, n]`: R_ij is how much position i's final representation traces back to input j.
  """
  if hasattr(layers, "weights") and hasattr(layers, "sides"):
    cap = layers
    stacks: dict[str, list[np.ndarray]] = {}
    for path, w in cap.weights.items():
      q_side, k_side = cap.sides[path]
      if q_side == k_side and cap.kind[path] in ("self", "causal"):
        stacks.setdefault(q_side, []).append(w)
    if side is None:
      if len(stacks) != 1:
        raise ValueError(f"the capture has self-attention on the sides {sorted(stacks)}; pass "
                         f"side= one of them")
      side = next(iter(stacks))
    if side not in stacks:
      raise ValueError(f"no self-attention layers on side {side!r}; sides with some: "
                       f"{', '.join(sorted(stacks)) or 'none'}")
    layers = stacks[side]
  mats = [_weights(w) for w in layers]
  if not mats:
    raise ValueError("attention_rollout needs at least one layer")
  result = None
  for w in mats:
    a = w.mean(axis=0) if w.ndim == 3 else w  # [n, n]
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
      raise ValueError(f"rollout needs square self-attention [heads, n, n]; got {w.shape}")
    a = a + np.eye(a.shape[0])
    a = a / a.sum(axis=-1, keepdims=True)
    result = a if result is None else a @ result
  return result


def _nanmean(x: np.ndarray) -> float:
  x = x[~np.isnan(x)]
  return float(x.mean()) if x.size else float("nan")


def head_table(capture: Any, specials: Sequence[str] = SPECIAL_TOKENS) -> list[dict[str, Any]]:
  """One row per (layer path, head) with the means over the query rows of:

  entropy (nats), normalized_entropy (0..1), mean_offset, mean_abs_offset, special_mass; plus
  layer (the path), head (index), kind and sides.
  """
  rows = []
  for path, w in capture.weights.items():
    kind = capture.kind[path]
    q_side, k_side = capture.sides[path]
    keys = capture.tokens[k_side]
    w = _weights(w)  # [heads, q_len, k_len]
    ent, norm = entropy(w), normalized_entropy(w, kind)  # [heads, q_len]
    off, dist = mean_offset(w), mean_abs_offset(w)
    special = special_token_mass(w, keys, specials)
    for h in range(w.shape[0]):
      rows.append({
          "layer": path, "head": h, "kind": kind, "sides": (q_side, k_side),
          "entropy": _nanmean(ent[h]), "normalized_entropy": _nanmean(norm[h]),
          "mean_offset": _nanmean(off[h]), "mean_abs_offset": _nanmean(dist[h]),
          "special_mass": _nanmean(special[h]),
      })
  return rows
