"""One table of attention mechanisms: name -> pure function, parameter init, what it supports.

Layers and config validation read this table; nothing else branches on a mechanism's name.

| name | paper | cost | causal | bidirectional | KV cache | weights | scores | bias (ALiBi/T5) | normalizers |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| full | Vaswani et al. 2017 | O(n²) (blocked kernel: O(n) memory) | yes | yes | yes | yes | all | yes | all |
| linear | Katharopoulos et al. 2020 | O(n) | yes (chunked prefix sums) | yes | yes (quadratic in the cache) | implicit | scaled_dot (the default) only: phi(q)ᵀphi(k) replaces it | no | softmax (the default) only: its own normalisation replaces it |
| performer | Choromanski et al. 2021 | O(n) | yes (chunked prefix sums) | yes | yes (quadratic in the cache) | implicit | scaled_dot only (estimates it) | no | softmax only (estimates it) |
| linformer | Wang et al. 2020 | O(n) | no | yes | no | implicit | scaled_dot only | no | softmax only |
| sliding_window | Beltagy et al. 2020 | O(n · window) | yes | yes | yes | yes | all (non-dot scores: reference path) | yes | all (non-softmax: reference path) |
| bigbird | Zaheer et al. 2020 | O(n · block) | yes | yes | no | yes | all (non-dot scores: reference path) | yes | all (non-softmax: reference path) |

Every `fn` is `fn(q, k, v, *, mask=None, causal=False, params=None, return_weights=False,
**options) -> (context [..., q_len, d_v], weights [..., q_len, k_len] or None)` with q, k, v
`[batch, heads, len, d]`. Options every fn accepts (ignored where meaningless): score,
score_params, bias, normalizer, normalizer_params, topk, implementation, q_offset, window,
block, num_global, num_random, rng_seed, chunk_size. A mechanism refuses an option value it
cannot honour (e.g. a bias for linear) with one clear ValueError.
`init(rng, num_heads, head_dim, max_len, **options) -> params or None`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax

from attnlab import errors
from attnlab.attention import core
from attnlab.attention import efficient
from attnlab.attention import masks as masks_lib
from attnlab.attention import positions as positions_lib
from attnlab.attention import scores as scores_lib

Array = jax.Array

# position kinds that are biases added to the scores (the others live in the embeddings/q,k)
POSITIONS_BIAS: tuple[str, ...] = positions_lib.POSITION_BIASES
# every score name (for the mechanisms that compose with all of them)
ALL_SCORES: tuple[str, ...] = tuple(scores_lib.SCORE_FNS)
# defaults of the mechanisms' options
DEFAULT_WINDOW = 64
DEFAULT_BLOCK = 64
DEFAULT_NUM_FEATURES = 256
DEFAULT_LINFORMER_K = 64


@dataclasses.dataclass(frozen=True)
class Supports:
  """What a mechanism supports."""
  # causal (decoder) attention
  causal: bool
  # bidirectional (encoder) attention
  bidirectional: bool
  # KV-cache decoding (one query against the cached keys)
  cache: bool
  # can materialise its (possibly implicit) attention weights [..., q_len, k_len]
  weights: bool
  # score functions it composes with
  scores: tuple[str, ...]
  # takes an additive position bias (ALiBi, T5)
  bias: bool
  # normalizers it composes with
  normalizers: tuple[str, ...]
  # forms the full [q_len, k_len] score matrix (talking heads mix it across heads)
  scores_matrix: bool = False


@dataclasses.dataclass(frozen=True)
class Mechanism:
  """One attention mechanism: a pure function, its parameter init and what it supports."""
  # registry name (the value of model.mechanism)
  name: str
  # fn(q, k, v, *, mask, causal, params, return_weights, **options) -> (context, weights|None)
  fn: Callable[..., tuple[Array, Array | None]]
  # init(rng, num_heads, head_dim, max_len, **options) -> params or None
  init: Callable[..., Any]
  # what it supports
  supports: Supports
  # the paper it comes from
  paper: str
  # one line for tables
  summary: str
  # init outputs that are fixed random draws, not learned (Performer's features): the layer
  # draws them from its seed and keeps them out of the optimiser
  fixed: tuple[str, ...] = ()


def _no_params(rng, num_heads, head_dim, max_len, **options):
  del rng, num_heads, head_dim, max_len, options
  return None


def _refuse(name: str, *, score: Any = "scaled_dot", bias: Any = None,
            normalizer: str = "softmax", allowed_scores: tuple[str, ...] = ("scaled_dot",),
            normalizer_ok: bool = False) -> None:
  if score not in allowed_scores:
    raise ValueError(f"mechanism {name!r} composes only with the scores "
                     f"{', '.join(allowed_scores)}; got {score!r}. Use mechanism 'full'")
  if bias is not None:
    raise ValueError(f"mechanism {name!r} takes no additive position bias (alibi, t5_bias); use "
                     "position learned/sinusoidal/rotary/none, or mechanism 'full'")
  if normalizer != "softmax" and not normalizer_ok:
    raise ValueError(f"mechanism {name!r} has its own normalisation; normalizer must be "
                     f"'softmax', got {normalizer!r}")


# ----------------------------------------------------------------------------- full


def _full(q, k, v, *, mask=None, causal=False, params=None, return_weights=False,
          score="scaled_dot", score_params=None, bias=None, normalizer="softmax",
          normalizer_params=None, topk=8, implementation="auto", **options):
  del params, options
  return core.attend(q, k, v, score=score, params=score_params, mask=mask, causal=causal,
                     implementation=implementation, return_weights=return_weights, bias=bias,
                     normalizer=normalizer, normalizer_params=normalizer_params, topk=topk)


# ----------------------------------------------------------------------------- kernelised


def _linear(q, k, v, *, mask=None, causal=False, params=None, return_weights=False,
            score=None, bias=None, normalizer="softmax", chunk_size=efficient.DEFAULT_CHUNK,
            **options):
  del params, options
  _refuse("linear", score=score, bias=bias, normalizer=normalizer,
          allowed_scores=(None, "scaled_dot"))
  context = efficient.linear_attention(q, k, v, causal=causal, mask=mask, chunk_size=chunk_size)
  weights = (efficient.linear_attention_weights(q, k, causal=causal, mask=mask)
             if return_weights else None)
  return context, weights


def _performer_init(rng, num_heads, head_dim, max_len, *, num_features=DEFAULT_NUM_FEATURES,
                    **options):
  del num_heads, max_len, options
  return {"features": efficient.performer_features(rng, num_features, head_dim)}


def _performer(q, k, v, *, mask=None, causal=False, params=None, return_weights=False,
               score="scaled_dot", bias=None, normalizer="softmax",
               chunk_size=efficient.DEFAULT_CHUNK, **options):
  del options
  _refuse("performer", score=score, bias=bias, normalizer=normalizer)
  if not params or "features" not in params:
    raise ValueError("mechanism 'performer' needs params {'features': [num_features, head_dim]}"
                     "; make them with get_mechanism('performer').init(rng, heads, head_dim, "
                     "max_len, num_features=...)")
  feats = params["features"]
  context = efficient.performer_attention(q, k, v, features=feats, causal=causal, mask=mask,
                                          chunk_size=chunk_size)
  weights = (efficient.performer_weights(q, k, features=feats, causal=causal, mask=mask)
             if return_weights else None)
  return context, weights


def _linformer_init(rng, num_heads, head_dim, max_len, *, linformer_k=DEFAULT_LINFORMER_K,
                    **options):
  del num_heads, head_dim, options
  return efficient.init_linformer_projections(rng, max_len, linformer_k)


def _linformer(q, k, v, *, mask=None, causal=False, params=None, return_weights=False,
               score="scaled_dot", bias=None, normalizer="softmax", **options):
  del options
  if causal:
    raise ValueError("mechanism 'linformer' is not causal (its projections mix all positions);"
                     " use it in encoders, or pick linear/performer/sliding_window/bigbird")
  _refuse("linformer", score=score, bias=bias, normalizer=normalizer)
  if not params or "proj_k" not in params:
    raise ValueError("mechanism 'linformer' needs params {'proj_k', 'proj_v'} [max_len, k]; make "
                     "them with get_mechanism('linformer').init(rng, heads, head_dim, max_len)")
  context = efficient.linformer_attention(q, k, v, proj_k=params["proj_k"],
                                          proj_v=params["proj_v"], mask=mask)
  weights = (efficient.linformer_weights(q, k, proj_k=params["proj_k"], proj_v=params["proj_v"],
                                         mask=mask) if return_weights else None)
  return context, weights


# ----------------------------------------------------------------------------- block-sparse


def _pattern_or_reference(q, k, v, pattern, fast_fn, *, mask, causal, return_weights, score,
                          score_params, bias, normalizer, normalizer_params, topk,
                          implementation):
  """fast_fn (the blocked kernel with the pattern computed per tile) when it can run, else
  attend's reference path with the pattern as a mask (weights, other scores/normalisers)."""
  fast = (not return_weights and score in core.FAST_SCORES and normalizer == "softmax"
          and not score_params and implementation in ("auto", "blocked")
          and (bias is None or isinstance(bias, positions_lib.LAZY_BIASES))
          and q.shape[-2] > 1)
  if fast:
    return fast_fn(q, k, v, causal=causal, mask=mask, bias=bias,
                   scale=None if score == "scaled_dot" else 1.0), None
  return core.attend(q, k, v, score=score, params=score_params,
                     mask=masks_lib.combine(pattern, mask), causal=causal,
                     implementation="reference", return_weights=return_weights, bias=bias,
                     normalizer=normalizer, normalizer_params=normalizer_params, topk=topk)


def _sliding_window(q, k, v, *, mask=None, causal=False, params=None, return_weights=False,
                    score="scaled_dot", score_params=None, bias=None, normalizer="softmax",
                    normalizer_params=None, topk=8, implementation="auto",
                    window=DEFAULT_WINDOW, block=None, q_offset=None, **options):
  del params, options
  q_len, k_len = q.shape[-2], k.shape[-2]
  if q_offset is not None:  # decoding: query i sits at key position q_offset + i
    pattern = masks_lib.local_mask(q_len, k_len, window, offset=q_offset)
    if causal:
      pattern = pattern & masks_lib.causal_mask(q_len, k_len, offset=q_offset)
    return core.attend(q, k, v, score=score, params=score_params,
                       mask=masks_lib.combine(pattern, mask), causal=False,
                       implementation="reference", return_weights=return_weights, bias=bias,
                       normalizer=normalizer, normalizer_params=normalizer_params, topk=topk)
  pattern = efficient.sliding_window_mask(q_len, k_len, window, causal=causal)
  fast_fn = functools.partial(efficient.sliding_window_attention, window=window, block=block)
  return _pattern_or_reference(q, k, v, pattern, fast_fn, mask=mask, causal=causal,
                               return_weights=return_weights, score=score,
                               score_params=score_params, bias=bias, normalizer=normalizer,
                               normalizer_params=normalizer_params, topk=topk,
                               implementation=implementation)


def _bigbird(q, k, v, *, mask=None, causal=False, params=None, return_weights=False,
             score="scaled_dot", score_params=None, bias=None, normalizer="softmax",
             normalizer_params=None, topk=8, implementation="auto", block=DEFAULT_BLOCK,
             num_global=1, num_random=1, rng_seed=0, **options):
  del params, options
  pattern = efficient.bigbird_mask(q.shape[-2], k.shape[-2], block=block, num_global=num_global,
                                   num_random=num_random, rng_seed=rng_seed, causal=causal)
  fast_fn = functools.partial(efficient.bigbird_attention, block=block, num_global=num_global,
                              num_random=num_random, rng_seed=rng_seed)
  return _pattern_or_reference(q, k, v, pattern, fast_fn, mask=mask, causal=causal,
                               return_weights=return_weights, score=score,
                               score_params=score_params, bias=bias, normalizer=normalizer,
                               normalizer_params=normalizer_params, topk=topk,
                               implementation=implementation)


# ----------------------------------------------------------------------------- the table


_ALL_NORMALIZERS = ("softmax", "softmax_sink", "sigmoid", "sparsemax", "topk")

# name -> Mechanism (the value of model.mechanism)
MECHANISMS: dict[str, Mechanism] = {
    m.name: m for m in (
        Mechanism("full", _full, _no_params,
                  Supports(causal=True, bidirectional=True, cache=True, weights=True,
                           scores=ALL_SCORES, bias=True, normalizers=_ALL_NORMALIZERS,
                           scores_matrix=True),
                  "Vaswani et al. 2017", "softmax attention over every key (today's default)"),
        Mechanism("linear", _linear, _no_params,
                  Supports(causal=True, bidirectional=True, cache=True, weights=True,
                           scores=("scaled_dot",), bias=False, normalizers=("softmax",)),
                  "Katharopoulos et al. 2020", "phi(q)ᵀ phi(k) with phi = elu + 1, O(n)"),
        Mechanism("performer", _performer, _performer_init,
                  Supports(causal=True, bidirectional=True, cache=True, weights=True,
                           scores=("scaled_dot",), bias=False, normalizers=("softmax",)),
                  "Choromanski et al. 2021", "FAVOR+ positive orthogonal random features, O(n)",
                  fixed=("features",)),
        Mechanism("linformer", _linformer, _linformer_init,
                  Supports(causal=False, bidirectional=True, cache=False, weights=True,
                           scores=("scaled_dot",), bias=False, normalizers=("softmax",)),
                  "Wang et al. 2020", "keys and values projected along the length to k rows"),
        Mechanism("sliding_window", _sliding_window, _no_params,
                  Supports(causal=True, bidirectional=True, cache=True, weights=True,
                           scores=ALL_SCORES, bias=True, normalizers=_ALL_NORMALIZERS),
                  "Beltagy et al. 2020", "keys within a window of each query, O(n · window)"),
        Mechanism("bigbird", _bigbird, _no_params,
                  Supports(causal=True, bidirectional=True, cache=False, weights=True,
                           scores=ALL_SCORES, bias=True, normalizers=_ALL_NORMALIZERS),
                  "Zaheer et al. 2020", "window + global + random blocks, O(n · block)"),
    )
}


def get_mechanism(name: Any) -> Mechanism:
  """The Mechanism registered under `name`; ValueError listing the valid names otherwise."""
  if not isinstance(name, str) or name not in MECHANISMS:
    raise errors.ConfigError(f"unknown attention mechanism {name!r}; valid mechanisms: "
                     f"{', '.join(MECHANISMS)}")
  return MECHANISMS[name]
