"""Capture every attention layer's weights of a run in one forward pass.

  cap = capture_text(run, "june 3, 1998")          # encoder-decoder: greedy-decodes the target
  cap = capture_text(run, "the cat sat")           # GPT / BERT
  cap.weights["encoder/layer_0/attention"]         # [heads, q_len, k_len] float32 numpy
  cap.sides["decoder/layer_0/cross_attention"]     # ("target", "source")
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Capture"]


@dataclasses.dataclass
class Capture:
  """The attention of one example, every layer, as plain numpy."""
  # Token strings per side: {"source": [...], "target": [...]} for encoder-decoder runs,
  # {"tokens": [...]} for GPT/BERT (and the Nadaraya-Watson regression: {"queries", "keys"}).
  tokens: dict[str, list[str]]
  # Layer path -> weights [heads, q_len, k_len] of ONE example (float32); RNN attention has heads=1.
  weights: dict[str, np.ndarray]
  # Layer path -> (query side, key side), names from `tokens`, e.g. ("target", "source").
  sides: dict[str, tuple[str, str]]
  # Layer path -> "self" | "causal" | "cross".
  kind: dict[str, str]
  # Optional q/k/v/scores/block outputs by path ("<layer path>/<name>"), empty by default.
  extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
