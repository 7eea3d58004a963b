"""Config helpers shared by every `configs/*.py`: common fields, typed `key=value` args, runlocal.

Config convention (every model family follows it):

- A config file defines `get_config(arg: str | None = None) -> ml_collections.ConfigDict`. It starts
  from `base_config()` (the fields every run has), sets `task`, fills `model` and `data`, and ends
  with `return finalize(config, arg, runlocal=..., shortcuts=SHORTCUTS)`. Its docstring holds the
  command that launches it and its shortcuts.
- `arg` is `key=value,key=value` (what follows the `:` in `--config=configs/x.py:arg`). Values are
  typed from the defaults (`num_train_steps=50` is an int, `optimizer.learning_rate=3e-4` a float,
  `runlocal=True` a bool, `model.score=dot` a string, `model.dims=(64,64)` a tuple); nested keys use
  dots; an unknown key or a value of the wrong type raises `ConfigError` listing the valid keys.
- Shortcuts: a config file declares a small table of short keys (`shortcut_table`) and passes it
  to `finalize`. The shared ones mean the same thing in every family that has them (SHORTCUTS):
  `dataset=`/`task=` (data.name), `attention=` (model.attention), `score=` (model.score), `size=`
  (model.size), `implementation=`, `tokenizer=`; a family may add its own (BERT: `mode=`,
  `pretrained=`; Nadaraya-Watson: `kernel=`). The file's docstring lists its table. `attnlab
  sweep` axes may be named by the shared ones too (`--sweep=score=dot,cosine`).
- One name per concept across families: data.num_train / data.num_eval (examples used),
  model.dropout_rate / model.attention_dropout_rate; modules take `deterministic=` (Flax's name).
  Keys renamed since older runs (RENAMED) still load from their config.json.
- `runlocal=True` shrinks the run to seconds: `finalize` applies `RUNLOCAL` (few steps, small
  batches, frequent logs and checkpoints) and then the file's own `runlocal` overrides (small model
  and data); keys given explicitly in `arg` always win over both.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import json
import os
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ml_collections

from attnlab.errors import ConfigError
from attnlab.errors import UserError

ConfigDict = ml_collections.ConfigDict

# Applied by `finalize` when runlocal=True, before the config file's own runlocal overrides.
RUNLOCAL: dict[str, Any] = {
    "num_train_steps": 20,
    "batch_size": 8,
    "log_every": 5,
    "eval_every": 10,
    "checkpoint_every": 10,
    "keep_checkpoints": 2,
}

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("cosine", "linear", "constant")
# Values of optimizer.decay: which parameters weight decay applies to.
DECAYS = ("all", "matrices")
# Values of model.dtype, the compute dtype (attnlab.precision; parameters stay float32).
DTYPES = ("float32", "bfloat16", "float16")


def base_config() -> ConfigDict:
  """The fields every run has; a config file fills `task`, `model` and `data` and tunes the rest."""
  config = ConfigDict()
  # Name of the task in the registry (attnlab.tasks.get_task): it supplies model, data, loss, metrics.
  config.task = ""
  # Seed of parameter init, dropout and data order: equal seeds give bit-identical runs.
  config.seed = 0
  # Number of optimizer updates.
  config.num_train_steps = 1000
  # Examples per training step.
  config.batch_size = 32
  # Write train metrics (metrics.jsonl, TensorBoard, progress bar) every this many steps.
  config.log_every = 50
  # Evaluate every this many steps (0: only at the end); always evaluates after the last step.
  config.eval_every = 500
  # Evaluation batches before the last step (0: the whole validation split): the first this many
  # of the task's evaluation batches, a fixed subset, for the periodic evaluations; the evaluation
  # after the last step always covers the whole split. Tasks with their own evaluate (decoding,
  # BLEU: translation, regression) always evaluate in full.
  config.eval_batches = 0
  # Save a checkpoint every this many steps (0: only at the end); also at the end and on SIGTERM/Ctrl-C.
  config.checkpoint_every = 500
  # How many of the most recent checkpoints to keep.
  config.keep_checkpoints = 3
  # Shrink the run to seconds (see RUNLOCAL and the config file's own runlocal overrides).
  config.runlocal = False
  # Allow continuing a workdir whose config.json differs from this config (config.json is replaced).
  config.allow_config_change = False
  # Let the task write its plots (PNG) into the workdir after the last step.
  config.write_plots = True
  # Replicas trained at once by jax.vmap (seeds seed, seed+1, ...; 1: an ordinary run).
  config.num_seeds = 1

  config.mesh = ConfigDict()
  # Devices on the data-parallel axis (-1: all devices not on fsdp); one device = the plain path.
  config.mesh.data = -1
  # Devices on the FSDP axis: parameters and optimizer state are split over them (1: replicated).
  config.mesh.fsdp = 1
  # Under FSDP, state leaves with fewer elements than this stay replicated.
  config.mesh.fsdp_min_size = 1024
  # JAX CPU devices to split the process into, so that the data axis above spreads each batch
  # over the cores; set before JAX starts (the trainer does it first). -1: automatic, one per core
  # (or the most that divide batch_size) on a CPU-only machine, devices left alone when JAX may use
  # a GPU/TPU; 0: the same on any machine; 1: one device, the plain path; N: N devices.
  config.mesh.cpu_devices = -1

  config.optimizer = ConfigDict()
  # One of adamw, adam, sgd.
  config.optimizer.name = "adamw"
  # Peak learning rate, reached after the warmup.
  config.optimizer.learning_rate = 1e-3
  # Steps of linear warmup from 0 to learning_rate.
  config.optimizer.warmup_steps = 0
  # Decay after the warmup: cosine, linear (both down to end_learning_rate) or constant.
  config.optimizer.schedule = "cosine"
  # Learning rate at the last step for the cosine and linear schedules.
  config.optimizer.end_learning_rate = 0.0
  # Decoupled weight decay (adamw only).
  config.optimizer.weight_decay = 0.0
  # Which parameters weight decay applies to: all, or matrices (ndim >= 2: kernels and embedding
  # tables, not biases, norm scales or other vectors).
  config.optimizer.decay = "all"
  # Adam first-moment decay.
  config.optimizer.b1 = 0.9
  # Adam second-moment decay.
  config.optimizer.b2 = 0.999
  # SGD momentum (0: plain SGD).
  config.optimizer.momentum = 0.0
  # Clip gradients to this global norm (0: no clipping).
  config.optimizer.grad_clip = 0.0

  # Model hyperparameters, defined by the task (see its config file).
  config.model = ConfigDict()
  # Data hyperparameters, defined by the task (see its config file).
  config.data = ConfigDict()
  return config


# ---------------------------------------------------------------------------------------------------
# key=value args


def split_top_level(text: str, sep: str = ",") -> list[str]:
  """Splits `text` at `sep` outside brackets and quotes: "a=1,b=(2,3)" -> ["a=1", "b=(2,3)"]."""
  parts, depth, quote, start = [], 0, "", 0
  for i, ch in enumerate(text):
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def parse_arg(arg: str | None) -> list[tuple[str, str]]:
  """"a=1,model.b=x" -> [("a", "1"), ("model.b", "x")]; raises ConfigError on a part without '='."""
  pairs = []
  for part in split_top_level(arg or ""):
    key, eq, value = part.partition("=")
    if not eq or not key.strip():
      raise ConfigError(f"config arg {part!r} is not key=value; write e.g. "
                        f"'configs/x.py:runlocal=True,model.score=dot'")
    pairs.append((key.strip(), value.strip()))
  return pairs


# ---------------------------------------------------------------------------------------------------
# Shortcuts: short arg keys


# A shortcut stands for a config key ("size" -> "model.size"), or is a function
# `apply(config, value_text)` that sets what the short key means in that config file (e.g. BERT's
# `size=mini` sets four model fields) and raises ConfigError for a bad value.
Shortcut = str | tuple[str, ...] | Callable[[ConfigDict, str], None]

# The short keys that mean the same thing in every config file that offers them. A config file
# takes the ones that apply to its family with `shortcut_table(...)` and passes it to `finalize`.
SHORTCUTS: dict[str, str | tuple[str, ...]] = {
    # The data set (a config whose defaults depend on it reads it first with `arg_value`).
    "dataset": "data.name",
    # The same: `task=marathi` reads as "the marathi task" (where a file offers this shortcut, the
    # `task` field itself is the file's own business).
    "task": "data.name",
    # Attention variant of the RNN decoder: none, bahdanau, luong.
    "attention": "model.attention",
    # Attention score function (attnlab.attention.scores): the Transformer families' attention
    # subtree, the RNN's model.score (a tuple: the first key the config has).
    "score": ("model.attention.score", "model.score"),
    "size": "model.size",
    # attend() implementation: auto, reference, xla, blocked, cudnn.
    "implementation": ("model.attention.implementation", "model.implementation"),
    # Attention mechanism (attnlab.attention.registry) of the Transformer families.
    "mechanism": "model.attention.mechanism",
    "tokenizer": "data.tokenizer",
}


def shortcut_table(*names: str, **own: Shortcut) -> dict[str, Shortcut]:
  """A config file's shortcut table: the shared `names` of SHORTCUTS plus the file's `own`.

  An own shortcut may reuse a shared name only as a function that gives it the same meaning in a
  family without that field (BERT's `size` sets the encoder's dimensions; it has no model.size).
  """
  table: dict[str, Shortcut] = {}
  for name in names:
    if name not in SHORTCUTS:
      raise ValueError(f"{name!r} is not a shared shortcut; shared: {', '.join(SHORTCUTS)}")
    table[name] = SHORTCUTS[name]
  for name, target in own.items():
    if name in SHORTCUTS and isinstance(target, str) and target != SHORTCUTS[name]:
      raise ValueError(f"shortcut {name!r} means {SHORTCUTS[name]} in every config file; "
                       f"give {target} another short name")
    table[name] = target
  return table


def arg_value(arg: str | None, key: str, default: str,
              table: Mapping[str, Shortcut] | None = None) -> str:
  """The text `arg` gives `key` (the last one, directly or through a shortcut of `table`).

  For config files whose defaults depend on a value (the data set, BERT's mode): they read it
  first, build the defaults for it, then `finalize` applies the whole arg.
  """
  value = default
  for name, text in parse_arg(arg):
    target = (table or {}).get(name)
    if name == key or target == key or (isinstance(target, tuple) and key in target):
      value = text
  return value


def check_choice(key: str, value: str, valid: Iterable[str], plural: str = "") -> str:
  """`value` if it is one of `valid`, else ConfigError "unknown KEY 'x'; valid PLURAL: a, b"."""
  valid = tuple(valid)
  if value not in valid:
    raise ConfigError(f"unknown {key} {value!r}; valid{' ' + plural if plural else ''}: "
                      f"{', '.join(valid)}")
  return value


def flatten(config: Mapping[str, Any] | ConfigDict, prefix: str = "") -> dict[str, Any]:
  """{"a": 1, "m": {"b": 2}} -> {"a": 1, "m.b": 2} (leaves only; ConfigDicts are descended)."""
  if isinstance(config, ConfigDict):
    config = config.to_dict()
  flat = {}
  for key, value in config.items():
    if isinstance(value, Mapping):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def _unknown_key(key: str, config: ConfigDict,
                 table: Mapping[str, Shortcut] | None = None) -> ConfigError:
  valid = sorted(flatten(config))
  if key in RENAMED and RENAMED[key] in valid:
    return ConfigError(f"config key {key!r} is now called {RENAMED[key]!r}; write "
                       f"{RENAMED[key]}=... instead")
  if key in MOVED_ATTENTION_KEYS and "model.attention.mechanism" in valid:
    return ConfigError(f"config key {key!r} is now {MOVED_ATTENTION_KEYS[key]!r} (the attention "
                       f"options live in model.attention)")
  close = difflib.get_close_matches(key, valid + list(table or {}), n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  short = ", ".join(f"{name} (= {shortcut_target(config, target)})" if isinstance(
      target, (str, tuple)) else name for name, target in (table or {}).items())
  short = f"; shortcuts: {short}" if short else ""
  return ConfigError(f"unknown config key {key!r}{hint}{short}; valid keys: {', '.join(valid)}")


def get_value(config: ConfigDict, key: str) -> Any:
  """The value of a dotted key; raises ConfigError listing the valid keys if there is none."""
  node, leaf = _lookup(config, key)
  return node[leaf]


def _lookup(config: ConfigDict, key: str,
            table: Mapping[str, Shortcut] | None = None) -> tuple[ConfigDict, str]:
  """(parent ConfigDict, leaf name) of a dotted key; ConfigError naming `table` if it is unknown."""
  *groups, leaf = key.split(".")
  node = config
  for group in groups:
    node = node.get(group)
    if not isinstance(node, ConfigDict):
      raise _unknown_key(key, config, table)
  if leaf not in node:
    raise _unknown_key(key, config, table)
  if isinstance(node[leaf], ConfigDict):
    raise ConfigError(f"config key {key!r} is a group, not a value; set one of its fields: "
                      f"{', '.join(sorted(flatten(node[leaf], key + '.')))}")
  return node, leaf


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_value(key: str, text: str, default: Any) -> Any:
  """Parses `text` into the type of `default` (the field's current value)."""
  def bad(expected: str) -> ConfigError:
    return ConfigError(f"config key {key!r} expects {expected}, got {text!r}")
  if isinstance(default, bool):
    if text.lower() in _TRUE:
      return True
    if text.lower() in _FALSE:
      return False
    raise bad("a bool (True or False)")
  if isinstance(default, (int, float)):
    try:
      return type(default)(text)
    except ValueError:
      raise bad("an int" if isinstance(default, int) else "a float") from None
  if isinstance(default, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    if default is None:
      return text
    raise bad(f"a Python literal like {default!r}") from None
  if isinstance(default, (tuple, list)):
    value = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return type(default)(value)
  return value


def set_value(config: ConfigDict, key: str, value: Any,
              shortcuts: Mapping[str, Shortcut] | None = None) -> None:
  """Sets a dotted key to a Python value (or command-line text), checking the key and the type.

  An unknown key raises ConfigError naming the valid keys and the `shortcuts` table's.
  """
  node, leaf = _lookup(config, key, shortcuts)
  default = node[leaf]
  if isinstance(value, str) and not isinstance(default, str):  # command-line text
    value = parse_value(key, value, default)
  elif default is not None and not _type_ok(value, default):
    raise ConfigError(f"config key {key!r} expects {type(default).__name__}, "
                      f"got {value!r} ({type(value).__name__})")
  if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if isinstance(default, tuple) and isinstance(value, list):
    value = tuple(value)
  node[leaf] = value  # a locked ConfigDict still accepts values for existing keys


def _type_ok(value: Any, default: Any) -> bool:
  if isinstance(default, bool) or isinstance(value, bool):
    return isinstance(value, bool) and isinstance(default, bool)
  if isinstance(default, float):
    return isinstance(value, (int, float))
  if isinstance(default, (tuple, list)):
    return isinstance(value, (tuple, list))
  return isinstance(value, type(default))


def apply_args(config: ConfigDict, pairs: Iterable[tuple[str, str]],
               table: Mapping[str, Shortcut] | None = None) -> ConfigDict:
  """Applies parsed `key=value` string pairs, typing each value from the field's default.

  A key of the shortcut `table` applies its target: the config key it stands for, or its
  function. An unknown key raises ConfigError naming the shortcuts and the valid keys.
  """
  for key, text in pairs:
    target = shortcut_target(config, (table or {}).get(key, key))
    if callable(target):
      target(config, text)
    else:
      set_value(config, target, text, table)
  return config


def shortcut_target(config: ConfigDict, target: Shortcut) -> Shortcut:
  """A shortcut's target in `config`: the first key of a tuple that the config has."""
  if isinstance(target, tuple):
    have = flatten(config)
    return next((key for key in target if key in have), target[0])
  return target


def apply_overrides(config: ConfigDict, overrides: Mapping[str, Any]) -> ConfigDict:
  """Applies {dotted key: Python value}, checking keys and types."""
  for key, value in overrides.items():
    set_value(config, key, value)
  return config


def finalize(config: ConfigDict, arg: str | None,
             runlocal: Mapping[str, Any] | None = None,
             shortcuts: Mapping[str, Shortcut] | None = None) -> ConfigDict:
  """Applies `arg` to the defaults in `config`, then the runlocal shrink if `runlocal=True`.

  Args:
    config: the config file's defaults (from `base_config()` plus the task's fields).
    arg: `key=value,...` from the command line (or None).
    runlocal: the config file's own overrides for runlocal=True (small model/data), applied after
      the generic `RUNLOCAL` ones; explicit `arg` keys win over both.
    shortcuts: the file's short keys (`shortcut_table(...)`): {short: config key, or a function
      `apply(config, value_text)`}; `arg` may use them beside the full keys.
  Returns:
    The config (not locked: the flag library locks it).
  """
  pairs = parse_arg(arg)
  apply_args(config, pairs, shortcuts)
  if config.runlocal:
    shrunk = {key: min(get_value(config, key), value) for key, value in RUNLOCAL.items()}
    apply_overrides(config, {**shrunk, **(runlocal or {})})
    apply_args(config, pairs, shortcuts)
  attention = config.get("model", {}).get("attention")
  if isinstance(attention, ConfigDict) and attention.get("plugins"):
    # A plugin file is recorded by its absolute path: the run reloads it from anywhere.
    attention.plugins = ",".join(
        os.path.abspath(x) if x.endswith(".py") else x
        for x in (y.strip() for y in attention.plugins.split(",")) if x)
  return config


# ---------------------------------------------------------------------------------------------------
# The translation task's data and decode groups, shared by configs/seq2seq.py and
# configs/transformer.py so that the RNN and the Transformer read identical data.


# data.name -> the data fields that differ from the defaults in `translation_groups`.
TRANSLATION_DATA: dict[str, dict[str, Any]] = {
    "dates": {},
    "marathi": {"tokenizer": "word", "max_tokens": 12, "min_count": 2, "num_eval": 0,
                "num_train": 0, "buckets": (6, 9), "length_bins": (4, 6, 8, 12)},
    "reverse": {"length_bins": (5, 10, 15, 20, 25, 30), "max_len": 30},
}
TRANSLATION_DATA["copy"] = TRANSLATION_DATA["reverse"]


def translation_groups(config: ConfigDict, arg: str | None,
                       shortcuts: Mapping[str, Shortcut]) -> str:
  """Fills `config.data` for the data set `arg` names (default dates) and adds `config.decode`.

  The data set is read from `arg` first (data.name, or a shortcut of it) because it picks the data
  defaults (TRANSLATION_DATA); the caller applies its own per-data-set presets and then `finalize`.
  Returns the data set's name.
  """
  dataset = check_choice("data.name", arg_value(arg, "data.name", "dates", shortcuts),
                         TRANSLATION_DATA, "datasets")
  config.data = ConfigDict({
      # Dataset: dates (synthetic), marathi (anki_mar_eng), reverse, copy (synthetic).
      "name": dataset,
      # Tokenizer of source and target: char, word (punctuation split off) or subword
      # (sentencepiece).
      "tokenizer": "char",
      # Subword vocabulary size, or the word vocabulary's cap (0: subword 4000, words uncapped).
      "tokenizer_size": 0,
      # Words seen fewer times in training become <unk> (word tokenizer).
      "min_count": 1,
      # Lower-case words (word tokenizer).
      "lower": True,
      # Training examples (synthetic: generated; marathi: the first N of the split, 0 = all).
      "num_train": 50000,
      # Evaluation examples (synthetic: generated; marathi: the first N of the split, 0 = all).
      "num_eval": 1000,
      # Seed of the synthetic data (fixed, so runs with different seeds see the same examples).
      "seed": 0,
      # reverse/copy: fewest symbols per sequence.
      "min_len": 1,
      # reverse/copy: most symbols per sequence.
      "max_len": 10,
      # reverse/copy: alphabet size.
      "symbols": 10,
      # marathi: en-mr (English -> Marathi) or mr-en.
      "direction": "en-mr",
      # Drop pairs with more whitespace-separated words (punctuation counted) on either side
      # (0: keep).
      "max_tokens": 0,
      # Padded lengths to group training batches by (): pad everything to the longest.
      "buckets": (),
      # Upper edges of source-length bins for per-length metrics, e.g. (5, 10, 15) (): none.
      "length_bins": (),
      # Split evaluated during training.
      "eval_split": "validation",
      # Examples per evaluation and decoding batch.
      "eval_batch_size": 250,
      # TFDS data dir of prepared real datasets ("": $TFDS_DATA_DIR or ~/tensorflow_datasets).
      "data_dir": "",
      # Folder with the raw files of a real dataset ("": $ATTNLAB_DATA_DIR, else download).
      "manual_dir": "",
      **TRANSLATION_DATA[dataset],
  })
  config.decode = ConfigDict({
      # 1: greedy decoding; > 1: beam search with this many beams.
      "beam_size": 1,
      # GNMT length penalty alpha of beam search (0: none).
      "length_penalty": 0.0,
      # Most output tokens, <end> included (0: the longest training target + 1).
      "max_len": 0,
  })
  return dataset


def validate(config: ConfigDict) -> None:
  """Checks the common fields and the attention score and implementation names (the one place
  they are checked); raises ConfigError saying what to change."""
  def need(ok: bool, message: str) -> None:
    if not ok:
      raise ConfigError(message)
  for key in ("task", "seed", "num_train_steps", "batch_size", "log_every", "eval_every",
              "checkpoint_every", "keep_checkpoints", "optimizer"):
    need(key in config, f"config has no field {key!r}; start config files from "
                        f"attnlab.config_utils.base_config()")
  # The comparisons below need the types of the defaults (a config built in code, not through
  # set_value, may hold "x" where an int belongs).
  data = config.to_dict()
  check_types(data, run_defaults(data))
  need(bool(config.task), "config.task is empty; set it to a registered task name")
  at_end = " (0: only at the end)"
  for key, least, note in (("num_train_steps", 0, ""), ("batch_size", 1, ""), ("log_every", 1, ""),
                           ("eval_every", 0, at_end), ("checkpoint_every", 0, at_end),
                           ("eval_batches", 0, " (0: the whole split)"),
                           ("keep_checkpoints", 1, "")):
    need(config.get(key, least) >= least, f"{key} must be >= {least}{note}, got {config[key]}")
  num_seeds = config.get("num_seeds", 1)
  need(isinstance(num_seeds, int) and num_seeds >= 1,
       f"num_seeds must be an int >= 1 (1: an ordinary run), got {num_seeds!r}")
  mesh = config.get("mesh")
  if mesh is not None:
    data, fsdp = mesh.get("data", -1), mesh.get("fsdp", 1)
    need(data == -1 or data >= 1, f"mesh.data must be -1 (all devices) or >= 1, got {data}")
    need(fsdp >= 1, f"mesh.fsdp must be >= 1 (1: parameters replicated), got {fsdp}")
    cpu = mesh.get("cpu_devices", -1)
    need(cpu >= -1, f"mesh.cpu_devices must be >= -1 (-1: automatic, 0: one per core, 1: one "
         f"device), got {cpu}")
  opt = config.optimizer
  check_choice("optimizer.name", opt.name, OPTIMIZERS, "optimizers")
  check_choice("optimizer.schedule", opt.schedule, SCHEDULES, "schedules")
  need(opt.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {opt.warmup_steps}")
  need(opt.weight_decay == 0 or opt.name == "adamw",
       f"optimizer.weight_decay={opt.weight_decay} is only used by adamw; set optimizer.name=adamw "
       f"or optimizer.weight_decay=0")
  check_choice("optimizer.decay", opt.get("decay", "all"), DECAYS)
  _validate_lengths(config.get("data"))
  _validate_attention(config.get("model"))
  model = config.get("model")
  if isinstance(model, ConfigDict) and "dtype" in model:
    check_choice("model.dtype", model.dtype, DTYPES, "dtypes")
  if isinstance(model, ConfigDict) and isinstance(model.get("attention"), ConfigDict):
    validate_attention_tree(model, config.task)


def _validate_lengths(data: ConfigDict | None) -> None:
  """data.buckets (padded lengths) and data.length_bins (upper edges of source-length bins): ints
  >= 1, the bins increasing (their defaults are empty, so check_types cannot check the items)."""
  if not isinstance(data, ConfigDict):
    return
  for key, what in (("buckets", "padded lengths, e.g. (16, 32, 64)"),
                    ("length_bins", "increasing upper edges of source lengths, e.g. (5, 10, 15)")):
    values = data.get(key)
    if not values:
      continue
    if (not isinstance(values, (list, tuple))
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)):
      raise ConfigError(f"data.{key} must be ints >= 1 ({what}), got {values!r:.80}")
    if key == "length_bins" and any(a >= b for a, b in zip(values, values[1:])):
      raise ConfigError(f"data.length_bins must increase ({what}), got {tuple(values)!r:.80}")


def _validate_attention(model: ConfigDict | None) -> None:
  """Checks the RNN family's model.score and model.implementation (the Transformer families'
  attention subtree: validate_attention_tree)."""
  if not isinstance(model, ConfigDict) or isinstance(model.get("attention"), ConfigDict):
    return
  if "score" not in model and "implementation" not in model:
    return
  # Imported here: reading a config file stays free of JAX.
  from attnlab.attention import core  # pylint: disable=g-import-not-at-top
  from attnlab.attention import scores  # pylint: disable=g-import-not-at-top
  score, implementation = model.get("score"), model.get("implementation")
  if score is not None:
    check_choice("model.score", score, scores.SCORE_FNS, "scores")
  if implementation is None:
    return
  check_choice("model.implementation", implementation, core.IMPLEMENTATIONS, "implementations")
  if implementation not in ("auto", "reference") and score not in (None, *core.FAST_SCORES):
    raise ConfigError(f"model.implementation={implementation} supports only the scores "
                      f"{', '.join(core.FAST_SCORES)}, not {score!r}; use implementation=auto "
                      f"or reference for other scores")


# The self-attention directions each task's model runs (a mechanism must support all of them):
# GPT is causal, BERT bidirectional, the Transformer both (encoder and decoder).
TASK_DIRECTIONS: dict[str, tuple[str, ...]] = {
    "causal_lm": ("causal",), "masked_lm": ("bidirectional",),
    "classification": ("bidirectional",), "long_range": ("bidirectional",),
    "translation": ("bidirectional", "causal")}
# How the errors name a task's model.
_TASK_MODELS = {"causal_lm": "GPT (causal)", "masked_lm": "BERT (bidirectional)",
                "classification": "BERT (bidirectional)",
                "long_range": "the long-range classifier (a BERT encoder)",
                "translation": "the Transformer (a causal decoder)"}


def validate_attention_tree(model: ConfigDict, task: str) -> None:
  """Checks `model.attention` (and model.position's bias) with attnlab.attention.registry's one
  validation; ConfigError with one line saying what to change."""
  # pylint: disable=g-import-not-at-top
  from attnlab.attention import config as attention_lib
  from attnlab.attention import positions
  position = model.get("position")
  if position is not None:
    check_choice("model.position", position,
                 positions.EMBEDDING_POSITIONS + positions.POSITION_BIASES, "positions")
  try:
    attention_lib.validate_tree(
        model.attention, directions=TASK_DIRECTIONS.get(task, ()),
        num_heads=model.get("num_heads", 0), position_bias=position in positions.POSITION_BIASES,
        attention_dropout=model.get("attention_dropout_rate", 0.0) > 0,
        where=_TASK_MODELS.get(task, ""))
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f"model.attention: {e}") from None


def add_attention(model: ConfigDict, arg: str | None) -> None:
  """Adds the attention subtree of the Transformer families to `config.model`
  (attnlab.attention.config: every registered mechanism's options, after importing the plugins
  `arg` names in model.attention.plugins)."""
  from attnlab.attention import config as attention_lib  # pylint: disable=g-import-not-at-top
  model.attention = attention_lib.config_tree(arg_value(arg, "model.attention.plugins", ""))


# ---------------------------------------------------------------------------------------------------
# Files and JSON


def _python_error(path: str, exc: BaseException) -> str:
  """"line N: SyntaxError: invalid syntax" for an error raised while running the file `path`."""
  if isinstance(exc, SyntaxError) and exc.filename and os.path.samefile(exc.filename, path):
    return f"line {exc.lineno}: {type(exc).__name__}: {exc.msg}"
  lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__)
           if os.path.exists(frame.filename) and os.path.samefile(frame.filename, path)]
  where = f"line {lines[-1]}: " if lines else ""
  message = " ".join(str(exc).split())
  return f"{where}{type(exc).__name__}{': ' + message if message else ''}"


def run_python_file(path: str, module_name: str, what: str, function: str,
                    *args: Any) -> Any:
  """Imports the Python file `path` and returns `function(*args)` from it.

  A file that fails to import, lacks `function`, or whose `function` raises something other than
  a UserError raises ConfigError naming the file, the line in it and the Python error, e.g.
  "config file 'bad.py' failed to import: line 1: SyntaxError: invalid syntax".
  """
  module_spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:  # any error in the user's file: name the file and the line
    raise ConfigError(f"{what} {path!r} failed to import: {_python_error(path, e)}") from e
  if not callable(getattr(module, function, None)):
    raise ConfigError(f"{what} {path!r} defines no {function}()")
  try:
    return getattr(module, function)(*args)
  except UserError:
    raise
  except Exception as e:
    raise ConfigError(f"{what} {path!r} failed in {function}(): {_python_error(path, e)}") from e


def load_config_file(spec: str) -> ConfigDict:
  """Loads `path.py[:arg]` like `--config=` does: imports the file and calls `get_config(arg)`."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} not found (from {spec!r}); give a path to a "
                      f"configs/*.py file, relative to the current directory or absolute")
  name = "attnlab_config_" + os.path.basename(path)[:-3].replace("-", "_")
  return run_python_file(path, name, "config file", "get_config", *([arg] if arg else []))


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
    "long_range": ("lra.py", ""), "translation": ("seq2seq.py", "")}


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
  for key, value in ADDED_DEFAULTS.items():
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
  if task in ("translation", "long_range") and isinstance(dataset, str) and dataset.isidentifier():
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
                                  "data.heldout_unseen": False}


# Keys that may change when a run resumes: they change where it runs, not what it computes.
RESUMABLE_KEYS = ("allow_config_change", "write_plots", "mesh.data", "mesh.fsdp",
                  "mesh.fsdp_min_size", "mesh.cpu_devices", "eval_batches")


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  """Differences "key: old -> new" between two configs, but in RESUMABLE_KEYS."""
  flat_old, flat_new = ({**ADDED_DEFAULTS, **flatten(rename_old_keys(c))} for c in (old, new))
  lines = []
  for key in sorted((set(flat_old) | set(flat_new)) - set(RESUMABLE_KEYS)):
    a, b = flat_old.get(key, "<absent>"), flat_new.get(key, "<absent>")
    if a != b:
      lines.append(f"{key}: {a!r} -> {b!r}")
  return lines
