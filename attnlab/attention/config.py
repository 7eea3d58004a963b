"""The attention config, passed whole: `config.model.attention` read once into a frozen dataclass.

A model family (GPT, BERT, the Transformer) carries one `attention: AttentionConfig` field and
hands it unchanged to every block's MultiHeadAttention, the only module that reads it. The
config subtree:

  model.attention.mechanism       full, linear, performer, ... (attnlab.attention.registry)
  model.attention.score           scaled_dot, dot, cosine, general, additive, location
  model.attention.implementation  auto, reference, xla, blocked, cudnn
  model.attention.normalizer      softmax, softmax_sink, sigmoid, sparsemax, topk
  model.attention.topk            keys kept per query by normalizer topk
  model.attention.num_kv_heads    key/value heads (0: num_heads, 1: multi-query)
  model.attention.talking_heads   learned [heads, heads] mixes of logits and weights
  model.attention.plugins         user modules that register mechanisms ("my_mech.py,pkg.mod")
  model.attention.<mechanism>.*   each registered mechanism's options (its Options dataclass)

`config_tree()` builds the subtree's defaults from the registry (a plugin's options included),
`from_config` reads and validates it once (`registry.validate`), `migrate_flat_keys` moves the
flat keys of runs written before the subtree existed (model.mechanism, model.window, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from attnlab.attention import registry

@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """What a MultiHeadAttention computes, beside its sizes and positions."""
  # Mechanism name (attnlab.attention.registry).
  mechanism: str = "full"
  # The mechanism's options (its registry entry's Options dataclass; None: its defaults).
  options: Any = None
  # Score function (attnlab.attention.scores).
  score: str = "scaled_dot"
  # attend() implementation: auto, reference, xla, blocked, cudnn.
  implementation: str = "auto"
  # Scores -> weights (attnlab.attention.normalizers).
  normalizer: str = "softmax"
  # Keys kept per query by the topk normalizer.
  topk: int = 8
  # Key/value heads (grouped-query attention); 0: num_heads; 1: multi-query.
  num_kv_heads: int = 0
  # Talking heads (Shazeer et al. 2020): learned [heads, heads] mixes of logits and weights.
  talking_heads: bool = False

  def __post_init__(self):
    entry = registry.get_mechanism(self.mechanism)
    object.__setattr__(self, "options", entry.make_options(self.options))

  @property
  def entry(self) -> registry.Mechanism:
    """The mechanism's registry entry."""
    return registry.get_mechanism(self.mechanism)

  def option_values(self) -> dict[str, Any]:
    """The options as keyword arguments of the mechanism's fn and init."""
    return dataclasses.asdict(self.options)

  def kv_heads(self, num_heads: int) -> int:
    """Key/value heads for `num_heads` query heads."""
    kv = self.num_kv_heads or num_heads
    if kv < 1 or num_heads % kv:
      raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={num_heads} "
                       f"(1: multi-query, num_heads: multi-head)")
    return kv

  def cross(self) -> AttentionConfig:
    """The config of a cross-attention (always the full mechanism)."""
    return dataclasses.replace(self, mechanism="full", options=None)

  def validate(self, *, directions: tuple[str, ...] = (), num_heads: int = 0,
               position_bias: bool = False, attention_dropout: bool = False,
               where: str = "", prefix: str = "") -> AttentionConfig:
    """registry.validate on this config; returns self."""
    registry.validate(self.mechanism, self.options, directions=directions, score=self.score,
                      normalizer=self.normalizer, position_bias=position_bias,
                      talking_heads=self.talking_heads, attention_dropout=attention_dropout,
                      implementation=self.implementation, num_heads=num_heads,
                      num_kv_heads=self.num_kv_heads, topk=self.topk, where=where,
                      prefix=prefix)
    return self


# The plain fields of the subtree and their defaults (today's multi-head softmax attention): the
# dataclass's own, but its options (a group per mechanism), and the plugins that register them.
FIELDS: dict[str, Any] = {**{f.name: f.default for f in dataclasses.fields(AttentionConfig)
                             if f.name != "options"}, "plugins": ""}


def _read(node: Any) -> tuple[str, dict[str, Any] | None, dict[str, Any]]:
  """(mechanism, its options group or None, the other plain fields) of an attention subtree (a
  ConfigDict or dict; absent fields take their defaults), after importing the plugins it names."""
  if isinstance(node, ml_collections.ConfigDict):
    node = node.to_dict()
  node = dict(node or {})
  registry.load_plugins(node.get("plugins", ""))
  name = node.get("mechanism", FIELDS["mechanism"])
  options = node.get(name)
  values = {key: node.get(key, default) for key, default in FIELDS.items()
            if key not in ("mechanism", "plugins")}
  return name, (dict(options) if isinstance(options, Mapping) else None), values


def validate_tree(node: Any, *, prefix: str = "model.attention.", **context: Any
                  ) -> AttentionConfig:
  """The one check of a config's attention subtree (registry.validate, keys named with
  `prefix`); `context`: directions, num_heads, position_bias, attention_dropout, where."""
  name, options, values = _read(node)
  built = registry.validate(name, options, prefix=prefix, **values, **context)
  return AttentionConfig(mechanism=name, options=built, **values)


def config_tree(plugins: str = "") -> ml_collections.ConfigDict:
  """The defaults of `config.model.attention`: FIELDS and one group per mechanism with options:
  the built-in ones and those the modules named in `plugins` register (imported first)."""
  modules = registry.plugin_modules(plugins)
  tree = ml_collections.ConfigDict(dict(FIELDS, plugins=plugins))
  for name, entry in registry.MECHANISMS.items():
    if entry.module != "attnlab" and entry.module not in modules:
      continue  # a plugin another config of this process imported: not this config's
    fields = dataclasses.fields(entry.options)
    if fields:
      tree[name] = ml_collections.ConfigDict({f.name: f.default for f in fields})
  return tree


def from_config(node: Mapping[str, Any] | None) -> AttentionConfig:
  """The AttentionConfig of `config.model.attention` (a ConfigDict or dict; absent fields take
  their defaults). Imports the plugins it names first. Names and options are checked here;
  `validate` checks the combinations against the model."""
  name, options, values = _read(node)
  return AttentionConfig(mechanism=name, options=options, **values)


# ----------------------------------------------------------------------------- older runs

def migrate_flat_keys(model: dict[str, Any]) -> dict[str, Any]:
  """A Transformer family's `model` group with the flat attention keys (model.mechanism,
  model.window, ...; 0 meant "the mechanism's default") moved into `model.attention`."""
  if isinstance(model.get("attention"), Mapping):
    return model
  attention: dict[str, Any] = {}
  for key in ("mechanism", "score", "implementation", "normalizer", "topk", "num_kv_heads",
              "talking_heads"):
    if key in model:
      attention[key] = model.pop(key)
  mechanism = attention.get("mechanism", "full")
  knobs = {k: model.pop(k) for k in ("window", "num_features", "linformer_k", "sparse_block")
           if k in model}
  if knobs.get("window"):
    attention.setdefault("sliding_window", {})["window"] = knobs["window"]
  if knobs.get("sparse_block"):
    owner = mechanism if mechanism in ("sliding_window", "bigbird") else "bigbird"
    attention.setdefault(owner, {})["block"] = knobs["sparse_block"]
  if knobs.get("num_features"):
    attention["performer"] = {"num_features": knobs["num_features"]}
  if knobs.get("linformer_k"):
    attention["linformer"] = {"projected_len": knobs["linformer_k"]}
  # The keys the old layout lacked (model.attention.plugins, every mechanism's options) take
  # their defaults, as in a config built today: the run resumes without a config change.
  tree = config_tree().to_dict()
  for key, value in attention.items():
    if isinstance(value, Mapping):
      tree.setdefault(key, {}).update(value)
    else:
      tree[key] = value
  model["attention"] = tree
  return model
