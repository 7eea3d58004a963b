"""The config language every `configs/*.py` speaks: common fields, typed `key=value` args,
shortcuts, runlocal, and loading a config file.

A config file defines `get_config(arg: str | None = None) -> ml_collections.ConfigDict`: it starts
from `base_config()`, sets `task`, fills `model` and `data` (the Transformer families add the
attention subtree with `add_attention`) and ends with `return finalize(config, arg,
runlocal=..., shortcuts=SHORTCUTS)`; its docstring holds its launch command and short keys. `arg`
is `key=value,...` typed from the defaults; an unknown key or a value of the wrong type is one
line listing the valid keys. `runlocal=True` shrinks a run to seconds (RUNLOCAL, then the file's
own overrides; explicit keys win). docs/guide.md has the whole convention. A run's stored
config.json (reading, migrating, comparing) is attnlab.run_config's; the checks of a finished
config are attnlab.config_checks' (`validate`).
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ml_collections

from attnlab.config_base import add_labeled_file, base_config  # the config files start from it
from attnlab.errors import ConfigError
from attnlab.errors import UserError

ConfigDict = ml_collections.ConfigDict

# Applied by `finalize` when runlocal=True, before the config file's own runlocal overrides.
RUNLOCAL: dict[str, Any] = {"num_train_steps": 20, "batch_size": 8, "log_every": 5,
                            "eval_every": 10, "checkpoint_every": 10, "keep_checkpoints": 2}


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
  from attnlab.run_config import MOVED_ATTENTION_KEYS, RENAMED  # pylint: disable=g-import-not-at-top
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


def put_fields(config: ConfigDict, fields: Mapping[str, Any]) -> None:
  """Sets each dotted key of `fields` (values read from a stored run: typed already), creating
  the groups and fields that `config` lacks (e.g. those an imported run has)."""
  for key, value in fields.items():
    *groups, leaf = key.split(".")
    node = config
    for group in groups:
      if group not in node:
        node[group] = ConfigDict()
      node = node[group]
    node[leaf] = value


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
# Config files


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


def config_helper(config_file: str, name: str) -> Any:
  """The helper module `name` beside a config file (configs/_translation.py for
  configs/seq2seq.py: `config_utils.config_helper(__file__, "_translation")`), imported once."""
  path = os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py")
  key = f"attnlab_config_helper_{name}_{abs(hash(path))}"
  if key not in sys.modules:
    module_spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    sys.modules[key] = module
  return sys.modules[key]


def load_config_file(spec: str) -> ConfigDict:
  """Loads `path.py[:arg]` like `--config=` does: imports the file and calls `get_config(arg)`."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} not found (from {spec!r}); give a path to a "
                      f"configs/*.py file, relative to the current directory or absolute")
  name = "attnlab_config_" + os.path.basename(path)[:-3].replace("-", "_")
  return run_python_file(path, name, "config file", "get_config", *([arg] if arg else []))


def validate(config: ConfigDict) -> None:
  """attnlab.config_checks.validate: the checks of a finished config (one line saying what to
  change)."""
  from attnlab import config_checks  # pylint: disable=g-import-not-at-top
  config_checks.validate(config)


def add_attention(model: ConfigDict, arg: str | None) -> None:
  """Adds the attention subtree of the Transformer families to `config.model`
  (attnlab.attention.config: every built-in mechanism's options and those of the plugins `arg`
  names in model.attention.plugins, imported first)."""
  from attnlab.attention import config as attention_lib  # pylint: disable=g-import-not-at-top
  model.attention = attention_lib.config_tree(arg_value(arg, "model.attention.plugins", ""))
