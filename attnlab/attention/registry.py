"""One table of attention mechanisms: name -> pure function, options, parameter init, what it
supports.

Layers and config validation read this table; nothing else branches on a mechanism's name. A
user's own mechanism joins it with `register(Mechanism(...))` from their own module (name that
module in `model.attention.plugins`, and a run records it, so the run reloads with it):
then it trains in GPT, BERT and the Transformer with `model.attention.mechanism=NAME`, its
options are config keys `model.attention.NAME.<field>`, and `validate` refuses what it does not
support in one line. `capability_table()` writes the table below (README.md carries the same
table; tests/test_plugins.py fails when either drifts from the registry).

<!-- mechanisms:begin -->
| name | paper | options (defaults) | causal | bidirectional | KV cache | scores | bias (ALiBi/T5) | normalizers |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| full | Vaswani et al. 2017 | - | yes | yes | yes | all | yes | all |
| linear | Katharopoulos et al. 2020 | - | yes | yes | yes | scaled_dot | no | softmax |
| performer | Choromanski et al. 2021 | num_features=256 | yes | yes | yes | scaled_dot | no | softmax |
| linformer | Wang et al. 2020 | projected_len=64 | no | yes | no | scaled_dot | no | softmax |
| sliding_window | Beltagy et al. 2020 | window=64, block=0 | yes | yes | yes | all | yes | all |
| bigbird | Zaheer et al. 2020 | block=64, num_global=1, num_random=1 | yes | yes | no | all | yes | all |
<!-- mechanisms:end -->

Every `fn` is `fn(q, k, v, *, mask=None, causal=False, params=None, return_weights=False,
**options) -> (context [..., q_len, d_v], weights [..., q_len, k_len] or None)` with q, k, v
`[batch, heads, len, d]`. Options every fn accepts (ignored where meaningless): score,
score_params, bias, normalizer, normalizer_params, topk, implementation, q_offset, rng_seed, and
the fields of its Options dataclass. A mechanism refuses an option value it cannot honour (e.g. a
bias for linear) with one clear ValueError.
`init(rng, num_heads, head_dim, max_len, **options) -> params or None`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
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


# ----------------------------------------------------------------------------- options
# Each mechanism's knobs: a frozen dataclass with its defaults and `validate(causal=...)`, which
# raises ValueError (one line) for a value it cannot honour. One comment above every field: the
# config files show them as `model.attention.<mechanism>.<field>`.


@dataclasses.dataclass(frozen=True)
class NoOptions:
  """A mechanism without knobs."""

  def validate(self, *, causal: bool) -> None:
    del causal


def _at_least(name: str, value: Any, least: int, note: str = "") -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < least:
    raise ValueError(f"{name} must be an int >= {least}{note}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SlidingWindowOptions:
  """sliding_window (Beltagy et al. 2020)."""
  # Keys each side of a query.
  window: int = 64
  # Tile length of the blocked kernel (0: the window rounded up to a multiple of 8).
  block: int = 0

  def validate(self, *, causal: bool) -> None:
    del causal
    _at_least("sliding_window.window", self.window, 1)
    _at_least("sliding_window.block", self.block, 0, " (0: from the window)")


@dataclasses.dataclass(frozen=True)
class BigBirdOptions:
  """bigbird (Zaheer et al. 2020)."""
  # Block size in tokens (window, global and random blocks).
  block: int = 64
  # Global blocks at the start (they see and are seen by every block).
  num_global: int = 1
  # Random key blocks per query block.
  num_random: int = 1

  def validate(self, *, causal: bool) -> None:
    del causal
    _at_least("bigbird.block", self.block, 1)
    _at_least("bigbird.num_global", self.num_global, 0)
    _at_least("bigbird.num_random", self.num_random, 0)


@dataclasses.dataclass(frozen=True)
class PerformerOptions:
  """performer (Choromanski et al. 2021)."""
  # Random features of FAVOR+.
  num_features: int = 256

  def validate(self, *, causal: bool) -> None:
    del causal
    _at_least("performer.num_features", self.num_features, 1)


@dataclasses.dataclass(frozen=True)
class LinformerOptions:
  """linformer (Wang et al. 2020)."""
  # Projected length of the keys and values (the paper's k).
  projected_len: int = 64

  def validate(self, *, causal: bool) -> None:
    del causal
    _at_least("linformer.projected_len", self.projected_len, 1)


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
  # its knobs: a frozen dataclass with defaults and validate(causal=...)
  options: type = NoOptions
  # the module that registered it ("attnlab" for the built-in ones; a user's plugin otherwise)
  module: str = "attnlab"

  def make_options(self, values: Any = None) -> Any:
    """The Options from a mapping of field values (None: the defaults); ValueError names an
    unknown field and the valid ones."""
    if isinstance(values, self.options):
      return values
    values = dict(values or {})
    fields = [f.name for f in dataclasses.fields(self.options)]
    unknown = sorted(set(values) - set(fields))
    if unknown:
      raise errors.ConfigError(
          f"mechanism {self.name!r} has no option {unknown[0]!r}; its options: "
          f"{', '.join(fields) or 'none'}")
    return self.options(**values)


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


def _performer_init(rng, num_heads, head_dim, max_len, *,
                    num_features=PerformerOptions.num_features, **options):
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


def _linformer_init(rng, num_heads, head_dim, max_len, *,
                    projected_len=LinformerOptions.projected_len, **options):
  del num_heads, head_dim, options
  return efficient.init_linformer_projections(rng, max_len, projected_len)


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
                    window=SlidingWindowOptions.window, block=0, q_offset=None, **options):
  del params, options
  block = block or None  # 0: the kernel's tile from the window
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
             normalizer_params=None, topk=8, implementation="auto",
             block=BigBirdOptions.block, num_global=BigBirdOptions.num_global,
             num_random=BigBirdOptions.num_random, rng_seed=0, **options):
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
                  fixed=("features",), options=PerformerOptions),
        Mechanism("linformer", _linformer, _linformer_init,
                  Supports(causal=False, bidirectional=True, cache=False, weights=True,
                           scores=("scaled_dot",), bias=False, normalizers=("softmax",)),
                  "Wang et al. 2020", "keys and values projected along the length to k rows",
                  options=LinformerOptions),
        Mechanism("sliding_window", _sliding_window, _no_params,
                  Supports(causal=True, bidirectional=True, cache=True, weights=True,
                           scores=ALL_SCORES, bias=True, normalizers=_ALL_NORMALIZERS),
                  "Beltagy et al. 2020", "keys within a window of each query, O(n · window)",
                  options=SlidingWindowOptions),
        Mechanism("bigbird", _bigbird, _no_params,
                  Supports(causal=True, bidirectional=True, cache=False, weights=True,
                           scores=ALL_SCORES, bias=True, normalizers=_ALL_NORMALIZERS),
                  "Zaheer et al. 2020", "window + global + random blocks, O(n · block)",
                  options=BigBirdOptions),
    )
}


def get_mechanism(name: Any) -> Mechanism:
  """The Mechanism registered under `name`; ConfigError listing the valid names otherwise."""
  if not isinstance(name, str) or name not in MECHANISMS:
    raise errors.ConfigError(f"unknown attention mechanism {name!r}; valid mechanisms: "
                             f"{', '.join(MECHANISMS)} (a mechanism of your own: register it "
                             f"and name its module in model.attention.plugins)")
  return MECHANISMS[name]


def register(mechanism: Mechanism, *, replace: bool = False) -> Mechanism:
  """Adds `mechanism` to the table (from a user's module: its `module` is recorded). A name
  already taken is refused unless `replace` (re-importing the same plugin module replaces its
  own entries)."""
  if not isinstance(mechanism, Mechanism):
    raise TypeError(f"register takes a registry.Mechanism, got {type(mechanism).__name__}")
  if not mechanism.name.isidentifier():
    raise ValueError(f"a mechanism name is an identifier (it becomes a config group), got "
                     f"{mechanism.name!r}")
  if not (dataclasses.is_dataclass(mechanism.options) and isinstance(mechanism.options, type)):
    raise TypeError(f"mechanism {mechanism.name!r}: options must be a dataclass type")
  old = MECHANISMS.get(mechanism.name)
  if old is not None and not replace and old.module != mechanism.module:
    raise ValueError(f"mechanism {mechanism.name!r} is already registered (by {old.module}); "
                     f"pick another name or pass replace=True")
  MECHANISMS[mechanism.name] = mechanism
  return mechanism


# plugin spec -> the module it imported (each is imported once per process)
_PLUGINS: dict[str, Any] = {}


def plugin_specs(text: Any) -> tuple[str, ...]:
  """The plugin modules named by `model.attention.plugins` ("a.py,pkg.mod")."""
  if isinstance(text, (list, tuple)):
    return tuple(str(x).strip() for x in text if str(x).strip())
  return tuple(x.strip() for x in str(text or "").split(",") if x.strip())


def load_plugins(text: Any) -> tuple[str, ...]:
  """Imports the modules that register mechanisms (`model.attention.plugins`): a path to a .py
  file (relative to the working directory) or a dotted module name on the Python path. Importing
  one runs its code: name only your own modules, and those of runs you trust."""
  specs = plugin_specs(text)
  for spec in specs:
    if spec in _PLUGINS:
      continue
    if spec.endswith(".py"):
      path = os.path.abspath(spec)
      if not os.path.isfile(path):
        raise errors.ConfigError(f"attention plugin {spec!r} not found (model.attention.plugins "
                                 f"names .py files or importable modules)")
      name = "attnlab_plugin_" + os.path.splitext(os.path.basename(path))[0]
      module_spec = importlib.util.spec_from_file_location(name, path)
      module = importlib.util.module_from_spec(module_spec)
      sys.modules[name] = module
      module_spec.loader.exec_module(module)
    else:
      try:
        module = importlib.import_module(spec)
      except ImportError as e:
        raise errors.ConfigError(f"attention plugin {spec!r} does not import ({e}); name a .py "
                                 f"file or a module on the Python path") from e
    _PLUGINS[spec] = module
  return specs


def plugin_modules(text: Any) -> set[str]:
  """The module names (Mechanism.module) of the plugins named by `text`, imported first."""
  return {_PLUGINS[spec].__name__ for spec in load_plugins(text)}


def validate(mechanism: str, options: Any = None, *, directions: tuple[str, ...] = (),
             score: str = "scaled_dot", normalizer: str = "softmax",
             position_bias: bool = False, talking_heads: bool = False,
             attention_dropout: bool = False, implementation: str = "auto",
             num_heads: int = 0, num_kv_heads: int = 0, topk: int = 8,
             where: str = "", prefix: str = "") -> Any:
  """The one check of an attention configuration: names against the registries, options against
  the mechanism's Options, combinations against what it supports. Returns the mechanism's Options
  (built from `options`, a mapping or an Options); raises ConfigError, one line saying what to
  change. `directions`: the self-attention directions the model runs ("causal",
  "bidirectional"); `where`: how the error names the model; `prefix`: how it names the keys
  ("model.attention." where a config is checked)."""
  # pylint: disable=g-import-not-at-top
  from attnlab.attention import normalizers as normalizers_lib
  if not isinstance(mechanism, str) or mechanism not in MECHANISMS:
    raise errors.ConfigError(f"unknown {prefix}mechanism {mechanism!r}; valid mechanisms: "
                             f"{', '.join(MECHANISMS)} (a mechanism of your own: register it and "
                             f"name its module in model.attention.plugins)")
  entry = MECHANISMS[mechanism]
  mech = f"{prefix}mechanism={mechanism}"

  def need(ok: bool, message: str) -> None:
    if not ok:
      raise errors.ConfigError(message)
  if score not in scores_lib.SCORE_FNS:
    raise errors.ConfigError(f"unknown {prefix}score {score!r}; valid scores: "
                             f"{', '.join(scores_lib.SCORE_FNS)}")
  if implementation not in core.IMPLEMENTATIONS:
    raise errors.ConfigError(f"unknown {prefix}implementation {implementation!r}; valid "
                             f"implementations:"
                             f" {', '.join(core.IMPLEMENTATIONS)}")
  if normalizer not in normalizers_lib.NORMALIZERS:
    raise errors.ConfigError(f"unknown {prefix}normalizer {normalizer!r}; valid normalizers: "
                             f"{', '.join(normalizers_lib.NORMALIZERS)}")
  need(implementation in ("auto", "reference") or score in core.FAST_SCORES,
       f"{prefix}implementation={implementation} supports only the scores "
       f"{', '.join(core.FAST_SCORES)}, not {score!r}; use implementation auto or reference")
  need(isinstance(topk, int) and topk >= 1,
       f"{prefix}topk must be >= 1 (keys kept per query), got {topk}")
  need(isinstance(num_kv_heads, int) and num_kv_heads >= 0,
       f"{prefix}num_kv_heads must be >= 0 (0: num_heads), got {num_kv_heads}")
  need(not (num_heads and num_kv_heads and num_heads % num_kv_heads),
       f"{prefix}num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (0: num_heads, "
       f"1: multi-query)")
  need(not ((normalizer != "softmax" or talking_heads)
            and implementation not in ("auto", "reference")),
       f"{'talking heads' if talking_heads else f'{prefix}normalizer={normalizer}'} runs on the "
       f"reference path; set {prefix}implementation=auto or reference (not {implementation})")
  supports = entry.supports
  for direction in directions:
    valid = [n for n, m in MECHANISMS.items() if all(getattr(m.supports, d) for d in directions)]
    need(getattr(supports, direction),
         f"{mech} is not defined for {direction} attention, which {where or 'this model'} "
         f"needs; valid mechanisms here: {', '.join(valid)}")
  need(not talking_heads or supports.scores_matrix,
       f"talking heads mix the score matrix, which {mech} never forms; use mechanism full or "
       f"talking_heads=False")
  need(not position_bias or supports.bias,
       f"{mech} never forms the scores that position alibi/t5_bias adds a bias to; use "
       f"position rotary (or learned, sinusoidal) with it")
  # The defaults (softmax, scaled_dot) always pass: a mechanism with its own similarity or
  # normalisation (linear) lists none and runs its own.
  need(normalizer == "softmax" or normalizer in supports.normalizers,
       f"{mech} runs the normalizers {', '.join(supports.normalizers) or 'of its own'}, not "
       f"{normalizer!r}; use {prefix}normalizer=softmax or mechanism full")
  need(score == "scaled_dot" or score in supports.scores,
       f"{mech} composes with the scores {', '.join(supports.scores) or 'of its own'}, not "
       f"{score!r}; use {prefix}score=scaled_dot or mechanism full")
  need(not attention_dropout or supports.weights,
       f"attention dropout drops attention weights, which {mech} never forms; set "
       f"attention_dropout_rate=0")
  built = entry.make_options(options)
  try:
    built.validate(causal="causal" in directions)
  except ValueError as e:
    raise errors.ConfigError(f"{mech}: {e}") from e
  return built


def capability_table() -> str:
  """The registry as a Markdown table (the README's and this module's docstring's)."""
  yes = lambda b: "yes" if b else "no"
  listed = lambda names, every: "all" if tuple(names) == tuple(every) else (
      ", ".join(names) or "its own")
  rows = ["| name | paper | options (defaults) | causal | bidirectional | KV cache | scores | "
          "bias (ALiBi/T5) | normalizers |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name, m in MECHANISMS.items():
    s = m.supports
    opts = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(m.options)) or "-"
    rows.append(f"| {name} | {m.paper} | {opts} | {yes(s.causal)} | {yes(s.bidirectional)} | "
                f"{yes(s.cache)} | {listed(s.scores, ALL_SCORES)} | {yes(s.bias)} | "
                f"{listed(s.normalizers, _ALL_NORMALIZERS)} |")
  return "\n".join(rows)
