"""Model families, found by name, with their size presets (this module imports no JAX).

    from attnlab import models
    build = models.from_config("transformer")      # the family's from_config function
    model = build(config.model, src_vocab_size, tgt_vocab_size, max_src_len)

Each family module has a `from_config`:
  seq2seq, transformer   from_config(model_config, src_vocab_size, tgt_vocab_size, max_src_len)
                         (the translation task's models: TRANSLATION_MODELS)
  gpt                    from_config(model_config, vocab_size)
  bert                   from_config(config, vocab_size, num_classes=0)
  rnn_classifier         from_config(model_config, vocab_size, num_classes) (configs/classify.py)
`SIZES[family][name]` holds the size presets (read by the config files too; `config_dims` applies
one to a config), `count_params` the number of scalars in a parameter pytree.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from attnlab.errors import ConfigError

# config.model.name -> the module whose from_config builds the model.
MODELS: dict[str, str] = {"seq2seq": "attnlab.models.seq2seq",
                          "transformer": "attnlab.models.transformer",
                          "gpt": "attnlab.models.gpt", "bert": "attnlab.models.bert"}
# The families the translation task can use (model.name in configs/seq2seq.py, transformer.py).
TRANSLATION_MODELS = ("seq2seq", "transformer")
# family -> size name -> hyperparameters (fields a config leaves at 0 take these).
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "bert": {
        # BERT-Tiny (Turc et al. 2019): 2 layers, 128 dims, 2 heads.
        "tiny": dict(num_layers=2, d_model=128, num_heads=2, mlp_dim=512),
        # BERT-Mini: 4 layers, 256 dims, 4 heads.
        "mini": dict(num_layers=4, d_model=256, num_heads=4, mlp_dim=1024),
        # BERT-Small: 4 layers, 512 dims, 8 heads.
        "small": dict(num_layers=4, d_model=512, num_heads=8, mlp_dim=2048),
        # For tests and runlocal: seconds on a CPU.
        "test": dict(num_layers=2, d_model=32, num_heads=2, mlp_dim=64),
        # BERT-base (Devlin et al. 2019): 12 layers, 768 dims, 12 heads, 512 positions (GPU).
        "base": dict(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072, max_len=512),
    },
    "gpt": {
        # nanoGPT's CPU setting for Shakespeare characters.
        "nano": dict(num_layers=4, num_heads=4, d_model=128, block_size=64),
        # nanoGPT's shakespeare_char setting.
        "small": dict(num_layers=6, num_heads=6, d_model=384, block_size=256),
        # For tests and runlocal: seconds on a CPU.
        "tiny": dict(num_layers=2, num_heads=2, d_model=32, block_size=32),
        # GPT-2 small (124M with the vocabulary padded to 50304): nanoGPT's train_gpt2 (GPU).
        "gpt2": dict(num_layers=12, num_heads=12, d_model=768, block_size=1024),
    },
    "transformer": {  # num_decoder_layers = num_layers
        # For tests and runlocal: seconds on a CPU.
        "tiny": dict(num_layers=1, num_heads=2, d_model=16, mlp_dim=32),
        # Synthetic tasks (dates, reverse) on a CPU, about the parameter count of the RNN baseline.
        "small": dict(num_layers=2, num_heads=4, d_model=64, mlp_dim=128),
        # Marathi on a CPU.
        "medium": dict(num_layers=3, num_heads=4, d_model=128, mlp_dim=512),
        # Vaswani et al. (2017) "base".
        "base": dict(num_layers=6, num_heads=8, d_model=512, mlp_dim=2048),
    },
}
# How error messages name a family.
_TITLES = {"bert": "BERT", "gpt": "GPT", "transformer": "Transformer"}


def size_config(family: str, name: str) -> dict[str, int]:
  """A copy of the hyperparameters of size `name`; raises ValueError listing the valid sizes."""
  sizes = SIZES[family]
  if name not in sizes:
    raise ValueError(f"unknown {_TITLES[family]} size {name!r}; valid sizes: {', '.join(sizes)}")
  return dict(sizes[name])


def config_dims(family: str, model_config: Any) -> dict[str, int]:
  """The hyperparameters of size `model_config.size`, each replaced by the config's field of the
  same name where that is set (non-zero); ConfigError listing the valid sizes."""
  try:
    dims = size_config(family, model_config.size)
  except ValueError as e:
    raise ConfigError(f"model.size: {e}") from None
  return {key: int(model_config.get(key, 0) or value) for key, value in dims.items()}


def from_config(name: str) -> Callable[..., Any]:
  """The `from_config` of model family `name`; ConfigError listing the valid names."""
  if name not in MODELS:
    raise ConfigError(f"unknown model.name {name!r}; valid models: {', '.join(MODELS)}")
  return importlib.import_module(MODELS[name]).from_config


def check_choices(model_config: Any, choices: dict[str, tuple[str, ...]]) -> None:
  """ConfigError naming the valid choices for a field `model.<key>` that is not in choices[key]."""
  for key, valid in choices.items():
    if model_config[key] not in valid:
      raise ConfigError(f"unknown model.{key} {model_config[key]!r}; valid choices: "
                        f"{', '.join(valid)}")


def shared_fields(module: Any, base: type) -> dict[str, Any]:
  """`module`'s values of the fields declared by `base` (a Flax Module class of hyperparameters
  that module subclasses), as keyword arguments for another subclass of `base`."""
  return {f.name: getattr(module, f.name) for f in dataclasses.fields(base)
          if f.name not in ("parent", "name")}


def attention_config(model_config: Any) -> Any:
  """The AttentionConfig of a `config.model` (its `attention` subtree, read once; the models hand
  it whole to their blocks). Absent fields take their defaults."""
  from attnlab.attention import config as attention_lib  # pylint: disable=g-import-not-at-top
  return attention_lib.from_config(model_config.get("attention"))


def attention_mismatch(pretrain_model: Any, model_config: Any) -> list[str]:
  """"model.attention.KEY: a in the pretraining run, b here" for each field of the attention
  config (its implementation aside: how it runs, not what it computes) in which a fine-tuning
  config differs from its pretraining run's."""
  a, b = (dataclasses.asdict(dataclasses.replace(attention_config(m), implementation="auto"))
          for m in (pretrain_model, model_config))
  return [f"model.attention.{key}: {a[key]!r} in the pretraining run, {b[key]!r} here"
          for key in sorted(a) if a[key] != b[key]]


def score_name(model_config: Any) -> str:
  """The score of a `config.model`: the Transformer families' `attention.score`, the RNN's
  `score`."""
  attention = model_config.get("attention")
  if not isinstance(attention, str) and hasattr(attention, "get"):
    return attention.get("score", "scaled_dot")
  return model_config.get("score", "scaled_dot")


def count_params(params: Any) -> int:
  """Number of scalars in a parameter pytree."""
  import jax  # pylint: disable=g-import-not-at-top  (config files import this package)
  return sum(int(x.size) for x in jax.tree.leaves(params))
