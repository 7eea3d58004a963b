"""A run's stored config (config.json): reading it back (keys, value types, the keys of older
versions under their current names, the defaults of the config file it was built from) and
comparing two (what may change when a run resumes).

Versions: RENAMED keys are read under their current names; the Transformer families' flat
attention keys of version 1 (model.mechanism, model.window, ...) move into model.attention
(attnlab.attention.config.migrate_flat_keys); fields added since (ADDED_DEFAULTS) read as their
defaults (and ADDED_TASK_DEFAULTS, those of one task), so older runs load, resume and analyse
unchanged.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import Any

from attnlab.config_utils import ConfigDict
from attnlab.config_utils import _type_ok
from attnlab.config_utils import base_config
from attnlab.config_utils import flatten
from attnlab.config_utils import load_config_file
from attnlab.errors import ConfigError
from attnlab.errors import UserError


def to_jsonable(config: ConfigDict | Mapping[str, Any]) -> dict[str, Any]:
  """The config as plain JSON types (tuples become lists), as stored in config.json."""
  data = config.to_dict() if isinstance(config, ConfigDict) else dict(config)
  return json.loads(json.dumps(data))


def from_jsonable(data: Mapping[str, Any]) -> ConfigDict:
  """Inverse of `to_jsonable` (lists stay lists); keys of older versions get their RENAMED names.

  Raises ConfigError (one line) for a key that cannot be a config field (`check_keys`).
  """
  if not isinstance(data, Mapping):
    raise ConfigError(f"a config is a JSON object of fields, got a {type(data).__name__}")
  check_keys(data)
  data = rename_old_keys(data)
  check_types(data, run_defaults(data))
  return ConfigDict(data)


# Names a config field cannot have: the attributes and methods of ConfigDict itself.
RESERVED_KEYS = frozenset(name for name in dir(ConfigDict) if not name.startswith("__"))


def check_keys(data: Mapping[str, Any], prefix: str = "") -> None:
  """Every key of `data` (and of its nested groups) is a plain field name: an identifier that does
  not start with '_' and is not a ConfigDict attribute (RESERVED_KEYS); ConfigError otherwise."""
  for key, value in data.items():
    name = f"{prefix}{key}"
    if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
      raise ConfigError(f"config key {name!r:.80} is not a config field (a field name is an "
                        f"identifier that does not start with '_'); remove it from the config")
    if key in RESERVED_KEYS:
      raise ConfigError(f"config key {name!r:.80} is reserved (a method of the config object); "
                        f"remove it from the config")
    if isinstance(value, Mapping):
      check_keys(value, f"{name}.")


def _expected(default: Any) -> str:
  """How an error names the type of `default`: "an int (like 1000)"."""
  if isinstance(default, Mapping):
    return "a group of fields (a JSON object)"
  if isinstance(default, (tuple, list)):
    return f"a list (like {list(default)!r:.40})"
  if isinstance(default, bool):
    return "a bool (true or false)"
  kind = ("an int" if isinstance(default, int) else "a number" if isinstance(default, float)
          else "a string" if isinstance(default, str) else type(default).__name__)
  return f"{kind} (like {default!r:.40})"


def _wrong_type(name: str, found: Any, default: Any) -> ConfigError:
  return ConfigError(f"config key {name!r} is {found!r:.60} ({type(found).__name__}), but "
                     f"expects {_expected(default)}; write a value of that type there")


def check_types(data: Mapping[str, Any], defaults: Mapping[str, Any], prefix: str = "") -> None:
  """Every value of `data` (a run's config.json) has the type of the same key in `defaults` (the
  config it was built from, `run_defaults`), as `set_value` checks a value given on the command
  line: an int where a float is expected is fine, a bool is no int, None only where the default
  is None (whose type is then unknown: any value), groups are descended, a list's items are checked
  when the default's are all of one type. Keys without a default (fields a run added) are not
  checked. ConfigError names the key, the value found and the type expected.
  """
  for key, value in data.items():
    if key not in defaults or defaults[key] is None:
      continue
    name, default = f"{prefix}{key}", defaults[key]
    if isinstance(default, Mapping):
      if not isinstance(value, Mapping):
        raise _wrong_type(name, value, default)
      check_types(value, default, f"{name}.")
    elif isinstance(value, Mapping) or not _type_ok(value, default):
      raise _wrong_type(name, value, default)
    elif isinstance(default, (tuple, list)) and default and len(set(map(type, default))) == 1:
      item = default[0]
      for i, element in enumerate(value):
        if isinstance(item, (bool, int, float, str)) and not _type_ok(element, item):
          raise _wrong_type(f"{name}[{i}]", element, item)


# Where a run's base config comes from: the repository's configs/ folder (absent when attnlab is
# installed from a wheel: then base_config() alone is the base).
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# config.task -> the config file that builds such runs and the arg that picks its defaults.
TASK_CONFIG_FILES: dict[str, tuple[str, str]] = {
    "regression": ("nadaraya_watson.py", ""), "causal_lm": ("gpt.py", ""),
    "masked_lm": ("bert.py", "mode=pretrain"), "classification": ("bert.py", "mode=finetune"),
    "long_range": ("lra.py", ""), "translation": ("seq2seq.py", ""),
    "rnn_classification": ("classify.py", "")}


def _merge(into: dict[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
  for key, value in more.items():
    if isinstance(value, Mapping) and isinstance(into.get(key), dict):
      _merge(into[key], value)
    else:
      into[key] = value
  return into


@functools.lru_cache(maxsize=32)
def _config_file_defaults(name: str, arg: str) -> dict[str, Any] | None:
  """The defaults of configs/<name>:<arg> as a dict (None: no such file, or it refuses `arg`)."""
  path = os.path.join(CONFIGS_DIR, name)
  if not os.path.isfile(path):
    return None
  try:
    return load_config_file(f"{path}:{arg}" if arg else path).to_dict()
  except UserError:  # e.g. a data.name it does not know: validate names that one later
    return None


def run_defaults(data: Mapping[str, Any]) -> dict[str, Any]:
  """The defaults of the config a run (its config.json `data`) was built from: base_config(), the
  fields older runs lack (ADDED_DEFAULTS), and the defaults of the task's config file
  (TASK_CONFIG_FILES; config.json names no file, so the task, the translation model.name, and
  the data.name that picks a file's data defaults stand for it) when the repository has it."""
  defaults = base_config().to_dict()
  for key, value in added_defaults(data).items():
    *groups, leaf = key.split(".")
    node = defaults
    for group in groups:
      node = node.setdefault(group, {})
    node.setdefault(leaf, value)
  task = data.get("task")
  if not isinstance(task, str) or task not in TASK_CONFIG_FILES:
    return defaults
  name, arg = TASK_CONFIG_FILES[task]
  model, group = data.get("model"), data.get("data")
  if task == "translation" and isinstance(model, Mapping) and model.get("name") == "transformer":
    name = "transformer.py"
  dataset = group.get("name") if isinstance(group, Mapping) else None
  if (task in ("translation", "long_range", "rnn_classification") and isinstance(dataset, str)
      and dataset.isidentifier()):
    arg = f"data.name={dataset}"
  found = _config_file_defaults(name, arg)
  return _merge(defaults, found) if found is not None else defaults


# The flat attention keys of the Transformer families before model.attention existed (older
# runs' config.json read through attention.config.migrate_flat_keys): for the error's hint.
MOVED_ATTENTION_KEYS: dict[str, str] = {
    "model.mechanism": "model.attention.mechanism", "model.score": "model.attention.score",
    "model.implementation": "model.attention.implementation",
    "model.normalizer": "model.attention.normalizer", "model.topk": "model.attention.topk",
    "model.num_kv_heads": "model.attention.num_kv_heads",
    "model.talking_heads": "model.attention.talking_heads",
    "model.window": "model.attention.sliding_window.window",
    "model.num_features": "model.attention.performer.num_features",
    "model.linformer_k": "model.attention.linformer.projected_len",
    "model.sparse_block": "model.attention.bigbird.block (or sliding_window.block)"}


# Config keys renamed after runs existed: old key -> current key. A config.json holding an old key
# reads with the current one (`from_jsonable`); an old key in an arg or flag gets one line naming
# the current key.
RENAMED: dict[str, str] = {
    # GPT.
    "model.dropout": "model.dropout_rate",
    "model.attention_dropout": "model.attention_dropout_rate",
    # GPT (addition); BERT pretraining's held-out pairs.
    "data.num_train_examples": "data.num_train",
    "data.num_eval_examples": "data.num_eval",
    # BERT fine-tuning.
    "data.max_train_examples": "data.num_train",
    "data.max_eval_examples": "data.num_eval",
}


def rename_old_keys(data: Mapping[str, Any]) -> dict[str, Any]:
  """`to_jsonable(data)` with the RENAMED keys under their current names."""
  out = to_jsonable(data)

  def group_of(key: str, create: bool) -> tuple[dict[str, Any] | None, str]:
    node, parts = out, key.split(".")
    for part in parts[:-1]:
      if not isinstance(node.get(part), dict):
        if not create:
          return None, parts[-1]
        node[part] = {}
      node = node[part]
    return node, parts[-1]

  for old, new in RENAMED.items():
    group, leaf = group_of(old, create=False)
    if group is not None and leaf in group:
      value = group.pop(leaf)
      target, new_leaf = group_of(new, create=True)
      target.setdefault(new_leaf, value)
  model = out.get("model")
  if isinstance(model, dict) and _transformer_family(out):
    # Version 1 -> 2: the flat attention keys (model.mechanism, model.window, ...) move into
    # model.attention (attnlab.attention.config).
    from attnlab.attention import config as attention_lib  # pylint: disable=g-import-not-at-top
    attention_lib.migrate_flat_keys(model)
  return out


def _transformer_family(data: Mapping[str, Any]) -> bool:
  """Whether a config (as JSON) is of GPT, BERT, the long-range classifier or the Transformer."""
  task, model = data.get("task"), data.get("model")
  if task == "translation":
    return isinstance(model, Mapping) and model.get("name") == "transformer"
  from attnlab.config_checks import TASK_DIRECTIONS  # pylint: disable=g-import-not-at-top
  return task in TASK_DIRECTIONS


# Fields added to base_config after runs existed: absent from an old config.json, they read as these
# defaults (so such runs resume without allow_config_change).
ADDED_DEFAULTS: dict[str, Any] = {"num_seeds": 1, "mesh.data": -1, "mesh.fsdp": 1,
                                  "mesh.fsdp_min_size": 1024, "mesh.cpu_devices": 1,
                                  "optimizer.decay": "all", "eval_batches": 0,
                                  "model.dtype": "float32",
                                  # BERT's (GPT and the Transformer always had the key).
                                  "model.position": "learned", "data.vocab_corpus": "",
                                  # IMDB held-out sentences seen in training were kept before.
                                  "data.heldout_unseen": False,
                                  # GPT's induction data set (#52): its span lengths.
                                  "data.min_span": 2, "data.max_span": 16,
                                  # GPT's own text corpus and pretrained start (#49).
                                  "data.path": "", "init_from": "",
                                  # The translation family's own corpora (#49): anki's pair,
                                  # per-side tokenizers, BLEU's tokenizer.
                                  "data.pair": "", "data.source_tokenizer": "",
                                  "data.target_tokenizer": "", "data.bleu_tokenize": "",
                                  # Fine-tuning: early stopping, GPT's frozen parameters.
                                  "early_stop_patience": 0, "finetune.freeze_embeddings": False,
                                  "finetune.freeze_layers": 0,
                                  # The RNN's GNMT wiring and beam search's coverage penalty (#50).
                                  "model.bidirectional_layers": 0, "model.residual_start": 0,
                                  "model.attention_from": "top", "decode.coverage_penalty": 0.0,
                                  # The train step's matmul precision (#51): float32 before.
                                  "matmul_precision": "float32"}


# Fields added to one task's config file after runs of it existed: an older config.json of that
# task without them reads as these defaults, as with ADDED_DEFAULTS.
ADDED_TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    # BERT fine-tuning on the user's own labelled file (#49).
    "classification": {"data.name": "sst2", "data.delimiter": "", "data.text_column": "sentence",
                       "data.text_pair_column": "", "data.label_column": "label",
                       "data.valid_path": "", "data.valid_fraction": 0.1,
                       "data.valid_seed": 0},
}


def added_defaults(data: Mapping[str, Any]) -> dict[str, Any]:
  """ADDED_DEFAULTS and the ADDED_TASK_DEFAULTS of the task of the config `data`."""
  task = data.get("task")
  return {**ADDED_DEFAULTS, **(ADDED_TASK_DEFAULTS.get(task, {}) if isinstance(task, str) else {})}


# Keys that may change when a run resumes: they change where it runs, not what it computes.
# The evaluation's batching is among them: it changes no training step, and the evaluated
# windows only where eval_batches x data.eval_batch_size changes (the nano GPT's default went
# from 4 x 128 to 16 x 32 windows, the same 512, when batches of 32 proved faster on CPU).
# So is the train step's matmul precision: like the device split, it changes the float rounding
# of the steps, not the model or its data (a run of float32 steps may go on in bfloat16 ones).
RESUMABLE_KEYS = ("allow_config_change", "write_plots", "mesh.data", "mesh.fsdp",
                  "mesh.fsdp_min_size", "mesh.cpu_devices", "eval_batches",
                  "data.eval_batch_size", "matmul_precision")


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  """Differences "key: old -> new" between two configs, but in RESUMABLE_KEYS."""
  flat_old, flat_new = ({**added_defaults(c), **flatten(rename_old_keys(c))} for c in (old, new))
  lines = []
  for key in sorted((set(flat_old) | set(flat_new)) - set(RESUMABLE_KEYS)):
    a, b = flat_old.get(key, "<absent>"), flat_new.get(key, "<absent>")
    if a != b:
      lines.append(f"{key}: {a!r} -> {b!r}")
  return lines


def pretrained_fields(workdir: str, task: str, fields: tuple[str, ...], needed: str
                      ) -> dict[str, Any]:
  """{key: value} of the run `workdir`'s config.json for `fields` (a group, e.g. model.attention,
  with all of its fields), read as reading the run itself would (keys, types, older versions), for
  a config file's `pretrained=DIR` shortcut; ConfigError, one line, unless it is a `task` run
  (`needed` names what is needed)."""
  path = os.path.join(os.path.expanduser(workdir), "config.json")
  if not os.path.isfile(path):
    raise ConfigError(f"pretrained={workdir}: no config.json there; give the --workdir of {needed}")
  try:
    with open(path, encoding="utf-8") as f:
      stored = flatten(from_jsonable(json.load(f)))
  except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or a ConfigError
    raise ConfigError(f"pretrained={workdir}: {path}: {e}") from None
  if stored.get("task") != task:
    raise ConfigError(f"pretrained={workdir} is a {stored.get('task')!r} run; {needed} is needed")
  return {key: value for key, value in stored.items()
          if key == "task" or any(key == f or key.startswith(f + ".") for f in fields)}
