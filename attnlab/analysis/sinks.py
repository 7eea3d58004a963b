"""Attention-sink metrics: how much each head attends to the first token, and to a learned sink.

  from attnlab.analysis import sinks
  m = sinks.sink_metrics(run)                  # on random tokens; or tokens=[batch, len] ids
  m.first_token                                # [layers, heads]: mean weight on the first token
  m.rate                                       # fraction of heads over the threshold (0.3)
  m.sink_mass                                  # [layers, heads] (normalizer=softmax_sink), else None
  sinks.first_token_score(pattern)             # pattern [(batch,) heads, q, k] -> [heads]

Definitions, for a head's weights w `[batch, heads, q_len, k_len]` (the normaliser's output, the
model's own `blocks.{i}.attn.pattern`):
  first_token  mean over the batch and the queries q = 1 .. q_len - 1 of w[q, 0]
  share        the same of w[q, 0] / sum_k w[q, k] (the share of the row's weight; 0 for a row
               summing to 0)
  row_sum      the same of sum_k w[q, k]
  sink_mass    the same of 1 - sum_k w[q, k] = exp(s_h) / (exp(s_h) + sum_k exp(x_qk)): the weight
               the learned sink logit s_h of normalizer=softmax_sink takes (None for the others)
  rate         the fraction of all heads (every layer) whose first_token exceeds the threshold
The first query row (q = 0) is left out of every mean: under a causal mask its only key is the
first token, so a softmax gives it weight 1 there whatever the head does.

The rate follows Gu et al. 2024 ("When Attention Sink Emerges in Language Models: An Empirical
View", ICLR 2025): their importance score of token k in head h of layer l is the mean attention
on it over the queries that can see it, alpha = 1 / (T - k + 1) sum_{i >= k} A[i, k] (first
token: every query, the first included), and Sink_k^eps = (1 / L) sum_l (1 / H) sum_h
1[alpha > eps] with eps = 0.3, the fraction of heads over the threshold. With the first query
left out, their alpha of the first token is (1 + (T - 1) * first_token) / T under a causal
softmax; `include_first_query=True` gives theirs.

Normalisers whose rows do not sum to 1. softmax, sparsemax and topk rows sum to 1, so
first_token = share and row_sum = 1. softmax_sink rows sum to 1 - sink_mass: first_token is the
weight the first token really gets (what the value average uses), share is its part of the
weight that reaches real tokens, and sink_mass is where the rest went; a head that "dumps"
attention into the learned sink has a high sink_mass instead of a high first_token. sigmoid
weights are independent gates in (0, 1), no distribution: first_token is the mean gate of the
first token (0.3 = a gate 30% open; with the -log(n) bias a uniform row has gates near 1 / n),
share is its share of the row's total gate, and row_sum the total (any value). Gu et al.
threshold the weights themselves, so `rate` uses first_token, not share.

Pattern-level: these numbers need weights. A mechanism that forms none of its own (linear,
Performer, Linformer: attnlab.analysis.circuits.explicit_weights) forms its equivalent weights
when asked (the pattern site), and `SinkMetrics.note` says so in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from attnlab.analysis import detectors
from attnlab.analysis import hooks as hooks_lib

__all__ = ["SINK_THRESHOLD", "SinkMetrics", "first_token_score", "mechanism_note", "row_sums",
           "sink_mass", "sink_metrics", "sink_rate"]

# Gu et al. 2024's threshold eps on a head's mean weight on the first token.
SINK_THRESHOLD = 0.3


def _pattern(pattern: Any) -> np.ndarray:
  """`[batch, heads, q, k]` float64 (a single example's `[heads, q, k]` gets a batch axis)."""
  w = np.asarray(pattern, np.float64)
  if w.ndim == 3:
    w = w[None]
  if w.ndim != 4:
    raise ValueError(f"attention weights must be [batch, heads, q_len, k_len] or [heads, q_len, "
                     f"k_len], got shape {w.shape}")
  return w


def _rows(w: np.ndarray, include_first_query: bool) -> np.ndarray:
  """The query rows averaged over: 1 .. q_len - 1 (0 .. with include_first_query)."""
  first = 0 if include_first_query or w.shape[-2] == 1 else 1
  return w[..., first:, :]  # [batch, heads, rows, k]


def first_token_score(pattern: Any, *, share: bool = False,
                      include_first_query: bool = False) -> np.ndarray:
  """`[heads]`: the mean over the batch and the query rows q >= 1 of w[q, 0] (share=True: of
  w[q, 0] / sum_k w[q, k]). `pattern`: `[batch, heads, q, k]` or `[heads, q, k]`."""
  w = _rows(_pattern(pattern), include_first_query)
  first = w[..., 0]  # [batch, heads, rows]
  if share:
    total = w.sum(-1)
    first = np.where(total > 0, first / np.where(total > 0, total, 1.0), 0.0)
  return first.mean(axis=(0, 2))


def row_sums(pattern: Any, *, include_first_query: bool = False) -> np.ndarray:
  """`[heads]`: the mean row sum sum_k w[q, k] over the batch and the query rows q >= 1."""
  return _rows(_pattern(pattern), include_first_query).sum(-1).mean(axis=(0, 2))


def sink_mass(pattern: Any, *, include_first_query: bool = False) -> np.ndarray:
  """`[heads]`: 1 - row_sums: under normalizer=softmax_sink the weight of the learned sink."""
  return 1.0 - row_sums(pattern, include_first_query=include_first_query)


def sink_rate(first_token: Any, threshold: float = SINK_THRESHOLD) -> float:
  """The fraction of heads (every entry of `first_token`, e.g. `[layers, heads]`) whose score is
  above `threshold` (Gu et al. 2024's Sink^eps)."""
  scores = np.asarray(first_token, np.float64)
  return float(np.mean(scores > threshold)) if scores.size else float("nan")


def mechanism_note(model: Any) -> str | None:
  """The one line a pattern-level tool prints for a mechanism without explicit weights."""
  from attnlab.analysis import circuits  # pylint: disable=g-import-not-at-top
  from attnlab.attention import registry  # pylint: disable=g-import-not-at-top
  name = model.attention.mechanism
  try:
    mechanism = registry.get_mechanism(name)
  except Exception:  # pylint: disable=broad-except
    return f"mechanism {name!r} is not registered here; its weights are read as formed"
  if circuits.explicit_weights(mechanism):
    return None
  return (f"mechanism {name!r} forms no attention weights in its forward pass: the "
          "pattern-level numbers use the equivalent weights it forms when asked")


@dataclasses.dataclass(frozen=True)
class SinkMetrics:
  """Sink metrics of every head (module docstring), numpy `[layers, heads]`."""
  first_token: np.ndarray
  share: np.ndarray
  row_sum: np.ndarray
  # Only for normalizer=softmax_sink.
  sink_mass: np.ndarray | None
  # Fraction of heads with first_token > threshold.
  rate: float
  threshold: float
  # The normaliser, and the one-line note of a mechanism without explicit weights (or None).
  normalizer: str
  note: str | None = None


def sink_metrics(run: Any, tokens: Any = None, *, threshold: float = SINK_THRESHOLD,
                 include_first_query: bool = False, batch: int = 8, seq_len: int | None = None,
                 seed: int = 0, interventions: Any = ()) -> SinkMetrics:
  """The sink metrics of a GPT run (or (model, params)) on `tokens` `[batch, len]`; None: uniform
  random token ids (detectors.repeated_random_tokens: seq_len ids repeated twice; seq_len:
  default half the block size, at most 50)."""
  model, _ = hooks_lib._unpack(run)  # pylint: disable=protected-access
  if tokens is None:
    seq_len = seq_len or min(model.block_size // 2, 50)
    tokens = detectors.repeated_random_tokens(model.vocab_size, seq_len, batch, seed)
  names = [f"blocks.{l}.attn.pattern" for l in range(model.num_layers)]
  _, cache = hooks_lib.run_with_cache(run, jnp.asarray(tokens), names,
                                      interventions=interventions)
  opts = dict(include_first_query=include_first_query)
  first = np.stack([first_token_score(cache[n], **opts) for n in names])
  share = np.stack([first_token_score(cache[n], share=True, **opts) for n in names])
  sums = np.stack([row_sums(cache[n], **opts) for n in names])
  normalizer = model.attention.normalizer
  return SinkMetrics(first_token=first, share=share, row_sum=sums,
                     sink_mass=1.0 - sums if normalizer == "softmax_sink" else None,
                     rate=sink_rate(first, threshold), threshold=threshold,
                     normalizer=normalizer, note=mechanism_note(model))
