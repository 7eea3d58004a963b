"""Hugging Face GPT-2 and BERT checkpoints <-> attnlab run directories.

Import (`import_checkpoint(folder, workdir)`, `attnlab import-hf FOLDER --workdir=DIR`): a local
checkpoint folder in the Hugging Face layout, read with NumPy only (no torch):
  config.json                     model_type "gpt2" or "bert" and the hyperparameters
  model.safetensors               the weights (or model.safetensors.index.json + shards), else
  pytorch_model.bin               a torch.save zip (or its .index.json + shards), read by
                                  attnlab.interop.torch_pickle without torch
  tokenizer files (optional)      tokenizer.json, vocab.json + merges.txt (GPT-2), vocab.txt (BERT)
becomes a run directory at step 0 that `load_run`, `attnlab generate` (GPT-2), the plots and
fine-tuning (`init_from`, BERT) accept:
  DIR/config.json                 a configs/gpt.py (task causal_lm) or configs/bert.py
                                  (mode=pretrain, task masked_lm) config with the checkpoint's
                                  hyperparameters, plus model.layer_norm_epsilon (both),
                                  model.vocab_size (GPT-2), model.type_vocab_size (BERT), and
                                  data.tokenizer = hf (DIR/tokenizer/, copied from the folder,
                                  data.tokenizer_path its absolute path) or ids (no tokenizer
                                  files: text is written as token ids)
  DIR/checkpoints/0/              TrainState: the weights, a fresh optimizer state, step 0
  DIR/import_hf.json              where the weights came from

Architectures (the attnlab options that express them exactly):
- gpt2 (GPT2LMHeadModel / GPT2Model): GPT with position=learned, use_bias=True, pre-LN,
  activation gelu_tanh ("gelu_new"), layer_norm_epsilon, the LM head tied to the token table.
  The fused c_attn projection `[d, 3d]` splits into query/key/value kernels.
- bert (BertForPreTraining): BertForPretraining, post-LN, activation gelu, token-type
  embeddings, pooler (Dense + tanh), MLM transform (Dense + activation + LayerNorm) and a decoder
  tied to the token table with its own bias, NSP head on the pooled [CLS] vector.
PyTorch Linear weights `[out, in]` are transposed to Flax kernels `[in, out]`; GPT-2's Conv1D
weights are already `[in, out]`.

Export (`export(run_or_dir, out_dir)`): the inverse, writing config.json + model.safetensors that
`transformers` loads (GPT2LMHeadModel / BertForPreTraining), plus the run's tokenizer files.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import re
import shutil
from typing import Any, Callable

from flax import traverse_util
import numpy as np

from attnlab.data import assets as assets_lib
from attnlab.data import hf_tokenizer
from attnlab.errors import HFError
from attnlab.errors import TorchFileError
from attnlab.interop import torch_pickle

_LOG = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
# Sub-folder of an imported run holding the checkpoint's tokenizer files (its kept vocabulary).
TOKENIZER_DIR = f"{assets_lib.DIRNAME}/tokenizer"
# Provenance file of an imported run.
IMPORT_FILE = "import_hf.json"
# Hugging Face activation names -> attnlab activations, and back (export).
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu": "gelu", "relu": "relu"}
_EXPORT_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_QKV = ("query", "key", "value")


# --------------------------------------------------------------------------------------------------
# Reading a checkpoint folder


def read_hf_config(folder: PathLike) -> dict[str, Any]:
  """The folder's config.json."""
  folder = pathlib.Path(folder)
  if not folder.is_dir():
    raise HFError(f"{folder} is not a folder; give the folder of a Hugging Face checkpoint "
                  f"(config.json + model.safetensors or pytorch_model.bin)")
  path = folder / "config.json"
  if not path.is_file():
    raise HFError(f"{folder} has no config.json; a Hugging Face checkpoint folder holds "
                  f"config.json beside model.safetensors or pytorch_model.bin (save_pretrained "
                  f"writes both)")
  try:
    config = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    raise HFError(f"{path} is not valid JSON ({' '.join(str(e).split())[:200]})") from None
  if not isinstance(config, dict):
    raise HFError(f"{path} holds no JSON object")
  return config


# safetensors dtype -> bytes per element (the names of the format's header).
SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                        "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
                        "F8_E4M3": 1, "F8_E5M2": 1}
# The largest header a safetensors file may have (the format's own limit).
SAFETENSORS_MAX_HEADER = 100_000_000


def check_safetensors_header(path: PathLike) -> None:
  """Checks a safetensors file's header before any tensor is read: its length inside the file,
  every entry a known dtype, a shape of non-negative integers and data offsets inside the data
  that hold exactly shape x itemsize bytes. Raises HFError naming the file and the tensor."""
  path = pathlib.Path(path)
  size = path.stat().st_size

  def bad(what: str) -> HFError:
    return HFError(f"{path}: {what}; not a readable safetensors file (damaged or forged)")

  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise bad(f"{size} bytes, shorter than the 8-byte header length")
    length = int.from_bytes(head, "little")
    if length > min(size - 8, SAFETENSORS_MAX_HEADER):
      raise bad(f"the header claims {length} bytes but the file has {size - 8} after its length")
    try:
      header = json.loads(f.read(length).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
      raise bad(f"the header is not JSON ({' '.join(str(e).split())[:80]})") from None
  if not isinstance(header, dict):
    raise bad("the header is not a JSON object")
  data_size = size - 8 - length
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    if not isinstance(entry, dict):
      raise bad(f"tensor {name!r:.80} has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_ITEMSIZE:
      raise bad(f"tensor {name!r:.80} has dtype {dtype!r:.40}; valid: "
                f"{', '.join(SAFETENSORS_ITEMSIZE)}")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
      raise bad(f"tensor {name!r:.80} has shape {shape!r:.80}, not non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_size):
      raise bad(f"tensor {name!r:.80} has data_offsets {offsets!r:.80} outside the "
                f"{data_size} data bytes")
    nbytes = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
      raise bad(f"tensor {name!r:.80} of shape {tuple(shape)} and dtype {dtype} needs {nbytes} "
                f"bytes but its data_offsets hold {offsets[1] - offsets[0]}")


def _read_weight_file(path: pathlib.Path) -> dict[str, np.ndarray]:
  if path.suffix == ".safetensors":
    check_safetensors_header(path)
    from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    try:
      return load_file(str(path))
    # AttributeError: a dtype the header allows but NumPy lacks (F8_E4M3, F8_E5M2).
    except (SafetensorError, OSError, ValueError, TypeError, AttributeError) as e:
      message = " ".join(str(e).split())[:200]
      raise HFError(f"{path}: not a readable safetensors file ({message})") from None
  try:
    return torch_pickle.load_state_dict(path)
  except TorchFileError as e:
    problem = str(e)
  raise HFError(problem)  # outside the handler: this is the line the tools print


def read_weights(folder: PathLike) -> dict[str, np.ndarray]:
  """{tensor name: array} of the folder's weights (safetensors preferred; shards followed)."""
  folder = pathlib.Path(folder)
  for name in ("model.safetensors", "pytorch_model.bin"):
    index = folder / f"{name}.index.json"
    if (folder / name).is_file():
      return _read_weight_file(folder / name)
    if index.is_file():
      try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
      except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise HFError(f"{index}: not a weight index (a 'weight_map' object expected; "
                      f"{e})") from None
      tensors: dict[str, np.ndarray] = {}
      for shard in shards:
        if not isinstance(shard, str) or shard in ("", ".", "..") \
            or pathlib.Path(shard).name != shard:
          raise HFError(f"{index} names the shard {shard!r:.80}, which is not a file name in "
                        f"{folder}; shards lie beside the index")
        if not (folder / shard).is_file():
          raise HFError(f"{index} names the shard {shard}, which is missing from {folder}")
        tensors.update(_read_weight_file(folder / shard))
      return tensors
  raise HFError(f"{folder} has no weights: expected model.safetensors or pytorch_model.bin "
                f"(or their .index.json with shards) beside config.json")


class _Tensors:
  """The checkpoint's tensors, taken by name; remembers which were used."""

  def __init__(self, tensors: dict[str, np.ndarray], prefix: str, folder: PathLike):
    self.tensors = tensors
    self.prefix = prefix
    self.folder = pathlib.Path(folder)
    self.used: set[str] = set()

  def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    full = self.prefix + name
    if full not in self.tensors:
      raise HFError(f"tensor {full} is missing from the weights in {self.folder}; the checkpoint "
                    f"is not a complete {self.prefix or 'model '}checkpoint of the architecture "
                    f"its config.json names (save the full model with save_pretrained)")
    x = np.asarray(self.tensors[full])
    if tuple(x.shape) != tuple(shape):
      raise HFError(f"tensor {full} has shape {tuple(x.shape)} but config.json implies "
                    f"{tuple(shape)}; the weights and config.json do not belong together")
    self.used.add(full)
    return x.astype(np.float32)

  def untied(self, full: str, tied: np.ndarray) -> bool:
    """Whether tensor `full` is there and differs from `tied`, the tensor attnlab ties it to."""
    if full not in self.tensors:
      return False
    self.used.add(full)
    return not np.array_equal(self.tensors[full], tied)

  def check_all_used(self, ignore: Callable[[str], bool]) -> None:
    left = sorted(k for k in self.tensors if k not in self.used and not ignore(k))
    if left:
      raise HFError(f"the weights in {self.folder} hold tensors this architecture has no place "
                    f"for: {', '.join(left[:5])}{' ...' if len(left) > 5 else ''}; the "
                    f"checkpoint has options attnlab does not express")


def _get(config: dict[str, Any], key: str) -> Any:
  if config.get(key) is None:
    raise HFError(f"config.json lacks {key!r}, which this architecture needs")
  return config[key]


# The most parameters config.json may imply: checked before anything is built or read (GPT-2 XL
# has 1.6e9).
MAX_IMPORT_PARAMS = 10_000_000_000


def _positive(hf: dict[str, Any], key: str, default: Any = None) -> int:
  """config.json's `key` (or `default` when it is absent or null), a positive integer."""
  value = hf.get(key)
  if value is None:
    value = default if default is not None else _get(hf, key)
  if type(value) is not int or value < 1:  # bool and float are refused too
    raise HFError(f"config.json has {key}={value!r:.40}; it must be a positive integer")
  return value


def _real(hf: dict[str, Any], key: str, default: float) -> float:
  """config.json's `key` (or `default` when it is absent or null), a finite number >= 0."""
  value = hf.get(key)
  if value is None:
    value = default
  if type(value) not in (int, float) or not 0 <= value < math.inf:  # bool and str are refused
    raise HFError(f"config.json has {key}={value!r:.40}; it must be a number >= 0")
  return float(value)


def _check_sizes(dims: dict[str, Any], names: dict[str, str], params: int) -> None:
  """Heads that divide the width, and at most MAX_IMPORT_PARAMS parameters (`params`, as the
  sizes imply them); `names`: attnlab name -> config.json key."""
  d, h = dims["d_model"], dims["num_heads"]
  if d % h:
    raise HFError(f"config.json has {names['num_heads']}={h}, which does not divide "
                  f"{names['d_model']}={d}; the heads split the width evenly")
  if params > MAX_IMPORT_PARAMS:
    raise HFError(f"config.json implies {params:.3g} parameters ({names['num_layers']}="
                  f"{dims['num_layers']}, {names['d_model']}={d}, {names['vocab_size']}="
                  f"{dims['vocab_size']}), more than the {MAX_IMPORT_PARAMS:.0e} import-hf "
                  f"takes; the file is damaged or not a GPT-2/BERT config")


def _check_layer_count(tensors: dict[str, np.ndarray], pattern: str, key: str,
                       num_layers: int, folder: PathLike) -> None:
  """The layers the weights hold (tensor names matching `pattern`, a layer index group) are
  exactly 0..num_layers-1, checked before the layout of num_layers layers is built."""
  # An index too long for int() (4300 digits) stands as one past any layer count.
  indices = {int(m[1]) if len(m[1]) <= 18 else 10**18
             for name in tensors if isinstance(name, str) and (m := re.match(pattern, name))}
  # The length first: set(range(num_layers)) of a forged n_layer would take gigabytes.
  if len(indices) != num_layers or indices != set(range(num_layers)):
    held = f"layers 0..{max(indices)}" if indices == set(range(len(indices))) and indices \
        else f"{len(indices)} layers"
    raise HFError(f"config.json has {key}={num_layers} but the weights in {folder} hold "
                  f"{held if indices else 'no layers'}; the weights and config.json do not "
                  f"belong together")


def _activation(name: str) -> str:
  if not isinstance(name, str) or name not in ACTIVATIONS:
    raise HFError(f"activation {name!r:.40} of config.json is not supported; valid: "
                  f"{', '.join(ACTIVATIONS)}")
  return ACTIVATIONS[name]


# --------------------------------------------------------------------------------------------------
# Layouts: which checkpoint tensor holds which attnlab parameter, read one way on import and the
# other on export


# The checkpoint's tensors in reading order, each as (name, shape in the checkpoint, the attnlab
# param paths it holds, transposed: a PyTorch Linear weight). A tensor with several paths is split
# evenly along its last axis (GPT-2's fused query | key | value).
_Layout = list[tuple[str, tuple[int, ...], list[tuple[str, ...]], bool]]


def _tensor(name: str, shape: tuple[int, ...], *path: str) -> _Layout:
  return [(name, shape, [path], False)]


def _norm(name: str, path: tuple[str, ...], d: int) -> _Layout:
  """A LayerNorm: NAME.weight, NAME.bias -> PATH/scale, PATH/bias."""
  return (_tensor(f"{name}.weight", (d,), *path, "scale")
          + _tensor(f"{name}.bias", (d,), *path, "bias"))


def _dense(name: str, path: tuple[str, ...], i: int, o: int, *, linear: bool,
           parts: tuple[str, ...] = ()) -> _Layout:
  """A dense layer: NAME.weight, NAME.bias -> PATH/kernel, PATH/bias, or with `parts` the output
  axis split into PATH/<part>_kernel, PATH/<part>_bias."""
  kernels = [path + (f"{p}_kernel",) for p in parts] or [path + ("kernel",)]
  biases = [path + (f"{p}_bias",) for p in parts] or [path + ("bias",)]
  return [(f"{name}.weight", (o, i) if linear else (i, o), kernels, linear),
          (f"{name}.bias", (o,), biases, False)]


def _params_from(t: _Tensors, layout: _Layout) -> dict[str, Any]:
  flat = {}
  for name, shape, paths, transposed in layout:
    x = t.take(name, shape)
    flat.update(zip(paths, np.split(x.T if transposed else x, len(paths), axis=-1)))
  return traverse_util.unflatten_dict(flat)


def _tensors_from(params: Any, layout: _Layout, prefix: str = "") -> dict[str, np.ndarray]:
  flat = traverse_util.flatten_dict(params)
  tensors = {}
  for name, _, paths, transposed in layout:
    x = np.concatenate([np.asarray(flat[p], np.float32) for p in paths], axis=-1)
    tensors[prefix + name] = np.ascontiguousarray(x.T if transposed else x)
  return tensors


# --------------------------------------------------------------------------------------------------
# GPT-2


def _gpt2_dims(hf: dict[str, Any]) -> dict[str, Any]:
  d = _positive(hf, "n_embd")
  inner = _positive(hf, "n_inner", 4 * d)
  if inner % d:
    raise HFError(f"n_inner={inner} is not a multiple of n_embd={d}; attnlab's GPT takes the "
                  f"MLP size as mlp_ratio * d_model")
  for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                  ("add_cross_attention", False)):
    if bool(hf.get(key, ok)) != ok:
      raise HFError(f"config.json has {key}={hf.get(key)}, which attnlab's GPT does not "
                    f"express (it needs {ok})")
  dims = dict(vocab_size=_positive(hf, "vocab_size"), num_layers=_positive(hf, "n_layer"),
              num_heads=_positive(hf, "n_head"), d_model=d, block_size=_positive(hf, "n_positions"),
              mlp_ratio=inner // d,
              activation=_activation(hf.get("activation_function", "gelu_new")),
              layer_norm_epsilon=_real(hf, "layer_norm_epsilon", 1e-5),
              dropout_rate=_real(hf, "resid_pdrop", 0.0),
              attention_dropout_rate=_real(hf, "attn_pdrop", 0.0))
  v, n, layers = dims["vocab_size"], dims["block_size"], dims["num_layers"]
  _check_sizes(dims, _GPT2_NAMES,
               (v + n) * d + layers * (4 * d * d + 2 * d * inner + 9 * d + inner))
  return dims


# attnlab model field -> its GPT-2 config.json key (for messages).
_GPT2_NAMES = {"vocab_size": "vocab_size", "num_layers": "n_layer", "num_heads": "n_head",
               "d_model": "n_embd"}


def _gpt2_layout(hf: dict[str, Any]) -> _Layout:
  """GPT2Model's tensors (GPT2LMHeadModel prefixes them with "transformer.")."""
  dims = _gpt2_dims(hf)
  v, d, n = dims["vocab_size"], dims["d_model"], dims["block_size"]
  f = dims["mlp_ratio"] * d
  conv1d = functools.partial(_dense, linear=False)
  layout = (_tensor("wte.weight", (v, d), "embed", "token", "embedding")
            + _tensor("wpe.weight", (n, d), "embed", "position"))
  for i in range(dims["num_layers"]):
    h, block = f"h.{i}", f"block_{i}"
    layout += (_norm(f"{h}.ln_1", (block, "ln_1"), d)
               + conv1d(f"{h}.attn.c_attn", (block, "self_attention"), d, 3 * d, parts=_QKV)
               + conv1d(f"{h}.attn.c_proj", (block, "self_attention", "out"), d, d)
               + _norm(f"{h}.ln_2", (block, "ln_2"), d)
               + conv1d(f"{h}.mlp.c_fc", (block, "mlp", "fc"), d, f)
               + conv1d(f"{h}.mlp.c_proj", (block, "mlp", "proj"), f, d))
  return layout + _norm("ln_f", ("ln_f",), d)


def gpt2_to_params(hf: dict[str, Any], tensors: dict[str, np.ndarray],
                   folder: PathLike = "") -> dict[str, Any]:
  """attnlab GPT params from GPT-2 tensors (GPT2LMHeadModel or GPT2Model names)."""
  _check_layer_count(tensors, r"(?:transformer\.)?h\.(\d+)\.", "n_layer",
                     _gpt2_dims(hf)["num_layers"], folder)
  layout = _gpt2_layout(hf)
  t = _Tensors(tensors, "transformer." if "transformer.wte.weight" in tensors else "", folder)
  params = _params_from(t, layout)
  if t.untied("lm_head.weight", params["embed"]["token"]["embedding"]):
    raise HFError("lm_head.weight differs from the token table wte.weight: attnlab's GPT ties "
                  "its output layer to the token table (tie_word_embeddings=true), so an untied "
                  "head cannot be imported")
  # Buffers of older checkpoints (the causal mask), not parameters.
  t.check_all_used(lambda k: k.endswith((".attn.bias", ".attn.masked_bias")))
  return params


def gpt2_from_params(params: Any, hf: dict[str, Any]) -> dict[str, np.ndarray]:
  """GPT2LMHeadModel tensors (transformer.* names) from attnlab GPT params and their config.json."""
  return _tensors_from(params, _gpt2_layout(hf), "transformer.")


def _gpt2_run_config(hf: dict[str, Any]):
  # Every dimension is the checkpoint's; model.vocab_size: the rows of its token table.
  config = _base_config("gpt.py", "", dict(_gpt2_dims(hf), size="tiny", position="learned",
                                           use_bias=True))
  config.data.name = "tiny_shakespeare"
  return config


def _gpt2_export_config(config: Any, params: Any) -> dict[str, Any]:
  from attnlab.models import gpt  # pylint: disable=g-import-not-at-top
  m = config.model
  if not m.mlp_ratio:
    raise HFError("an attention-only GPT (model.mlp_ratio=0) has no GPT-2 form: every GPT-2 "
                  "block has an MLP")
  v, d = np.shape(params["embed"]["token"]["embedding"])
  n = np.shape(params["embed"]["position"])[0]
  num_layers = sum(1 for k in params if k.startswith("block_"))
  return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": int(v),
          "n_positions": int(n), "n_embd": int(d), "n_layer": num_layers,
          "n_head": int(m.num_heads) or gpt.size_config(m.size)["num_heads"],
          "n_inner": int(m.mlp_ratio * d), "activation_function": _EXPORT_ACTIVATIONS[m.activation],
          "layer_norm_epsilon": float(m.get("layer_norm_epsilon", 1e-5)),
          "resid_pdrop": float(m.dropout_rate), "embd_pdrop": float(m.dropout_rate),
          "attn_pdrop": float(m.attention_dropout_rate), "tie_word_embeddings": True,
          "scale_attn_weights": True}


def _attention_option_problems(m: Any, name: str) -> list[str]:
  """The attention options of `m` (its model.attention) that differ from plain multi-head
  softmax attention with the scaled dot score, which `name` has."""
  from attnlab import models as models_lib  # pylint: disable=g-import-not-at-top
  from attnlab.attention.config import AttentionConfig  # pylint: disable=g-import-not-at-top
  have = dataclasses.asdict(models_lib.attention_config(m))
  plain = dataclasses.asdict(AttentionConfig())
  return [f"model.attention.{key}={have[key]} ({name} has plain multi-head softmax attention)"
          for key in plain if key != "implementation" and have[key] != plain[key]]


def _check_gpt_exportable(config: Any) -> None:
  m = config.model
  problems = []
  if m.position != "learned":
    problems.append(f"model.position={m.position} (GPT-2 has a learned position table)")
  if not m.use_bias:
    problems.append("model.use_bias=False (GPT-2 has biases)")
  problems += _attention_option_problems(m, "GPT-2")
  if problems:
    raise HFError(f"this GPT run cannot be written as GPT-2: {'; '.join(problems)}; GPT-2's "
                  f"settings are learned positions, biases and plain attention (the tied output "
                  f"layer and the gelu_tanh, gelu or relu MLP come along): train the run with "
                  f"configs/gpt.py:model.position=learned,model.use_bias=True (a GPT-2 imported "
                  f"with import-hf, and its fine-tuned runs, have them)")


# --------------------------------------------------------------------------------------------------
# BERT


def _bert_dims(hf: dict[str, Any]) -> dict[str, Any]:
  if hf.get("position_embedding_type", "absolute") != "absolute":
    raise HFError(f"position_embedding_type={hf.get('position_embedding_type')!r} is not "
                  f"supported; attnlab's BERT has absolute (learned) positions")
  if hf.get("is_decoder", False):
    raise HFError("config.json has is_decoder=true; attnlab's BERT is an encoder")
  dims = dict(vocab_size=_positive(hf, "vocab_size"),
              num_layers=_positive(hf, "num_hidden_layers"),
              d_model=_positive(hf, "hidden_size"), num_heads=_positive(hf, "num_attention_heads"),
              mlp_dim=_positive(hf, "intermediate_size"),
              max_len=_positive(hf, "max_position_embeddings"),
              type_vocab_size=_positive(hf, "type_vocab_size", 2),
              activation=_activation(hf.get("hidden_act", "gelu")),
              layer_norm_epsilon=_real(hf, "layer_norm_eps", 1e-12),
              dropout_rate=_real(hf, "hidden_dropout_prob", 0.1),
              attention_dropout_rate=_real(hf, "attention_probs_dropout_prob", 0.1))
  d, f, v = dims["d_model"], dims["mlp_dim"], dims["vocab_size"]
  _check_sizes(dims, _BERT_NAMES,
               (v + dims["max_len"] + dims["type_vocab_size"]) * d + 2 * d * d + v
               + dims["num_layers"] * (4 * d * d + 2 * d * f + 9 * d + f))
  return dims


# attnlab model field -> its BERT config.json key (for messages).
_BERT_NAMES = {"vocab_size": "vocab_size", "num_layers": "num_hidden_layers",
               "num_heads": "num_attention_heads", "d_model": "hidden_size"}


# Older names of the LayerNorm parameters.
_NORM_NAMES = {"gamma": ".weight", "beta": ".bias"}


def _bert_layout(hf: dict[str, Any], mlm_bias: str = "cls.predictions.bias") -> _Layout:
  """BertForPreTraining's tensors; `mlm_bias`: the name of the MLM output bias."""
  dims = _bert_dims(hf)
  v, d, f, n = dims["vocab_size"], dims["d_model"], dims["mlp_dim"], dims["max_len"]
  linear = functools.partial(_dense, linear=True)
  e, c = "bert.embeddings", "cls.predictions"
  layout = (_tensor(f"{e}.word_embeddings.weight", (v, d), "encoder", "embed", "token", "embedding")
            + _tensor(f"{e}.position_embeddings.weight", (n, d), "encoder", "embed", "position")
            + _tensor(f"{e}.token_type_embeddings.weight", (dims["type_vocab_size"], d),
                      "encoder", "segment", "embedding")
            + _norm(f"{e}.LayerNorm", ("encoder", "embed_norm"), d))
  for i in range(dims["num_layers"]):
    layer, block = f"bert.encoder.layer.{i}", ("encoder", f"block_{i}")
    for part in _QKV:
      layout += linear(f"{layer}.attention.self.{part}", block + ("self_attention",), d, d,
                       parts=(part,))
    layout += (linear(f"{layer}.attention.output.dense", block + ("self_attention", "out"), d, d)
               + _norm(f"{layer}.attention.output.LayerNorm", block + ("ln_1",), d)
               + linear(f"{layer}.intermediate.dense", block + ("mlp", "fc"), d, f)
               + linear(f"{layer}.output.dense", block + ("mlp", "proj"), f, d)
               + _norm(f"{layer}.output.LayerNorm", block + ("ln_2",), d))
  return (layout + linear("bert.pooler.dense", ("encoder", "pooler"), d, d)
          + _tensor(mlm_bias, (v,), "mlm_bias")
          + linear(f"{c}.transform.dense", ("mlm_transform",), d, d)
          + _norm(f"{c}.transform.LayerNorm", ("mlm_norm",), d)
          + linear("cls.seq_relationship", ("nsp",), d, 2))


def bert_to_params(hf: dict[str, Any], tensors: dict[str, np.ndarray],
                   folder: PathLike = "") -> dict[str, Any]:
  """attnlab BertForPretraining params from BertForPreTraining tensors."""
  # Older BERT checkpoints name LayerNorm parameters gamma/beta: use weight/bias.
  tensors = {re.sub(r"\.(gamma|beta)$", lambda m: _NORM_NAMES[m[1]], k): x
             for k, x in tensors.items()}
  c = "cls.predictions"
  # The MLM output bias; some checkpoints keep it only as the decoder's bias.
  mlm_bias = f"{c}.bias" if f"{c}.bias" in tensors else f"{c}.decoder.bias"
  _check_layer_count(tensors, r"bert\.encoder\.layer\.(\d+)\.", "num_hidden_layers",
                     _bert_dims(hf)["num_layers"], folder)
  layout = _bert_layout(hf, mlm_bias)
  t = _Tensors(tensors, "", folder)
  params = _params_from(t, layout)
  for name, tied in ((f"{c}.decoder.weight", params["encoder"]["embed"]["token"]["embedding"]),
                     (f"{c}.decoder.bias", params["mlm_bias"])):
    if t.untied(name, tied):
      raise HFError(f"{name} differs from the tensor it is tied to; attnlab's BERT ties the "
                    f"MLM decoder to the token table (tie_word_embeddings=true)")
  t.check_all_used(lambda k: k.endswith("position_ids"))  # a buffer of 0..max_len-1
  return params


def bert_from_params(params: Any, hf: dict[str, Any]) -> dict[str, np.ndarray]:
  """BertForPreTraining tensors from attnlab BertForPretraining params and their config.json."""
  return _tensors_from(params, _bert_layout(hf))


def _bert_run_config(hf: dict[str, Any]):
  model = _bert_dims(hf)
  vocab_size = model.pop("vocab_size")
  config = _base_config("bert.py", "mode=pretrain",
                        dict(model, norm_position="post"))
  config.data.max_len = min(config.data.max_len, model["max_len"])
  config.data.vocab_size = vocab_size
  return config


def _bert_export_config(config: Any, params: Any) -> dict[str, Any]:
  m = config.model
  enc = params["encoder"]
  v, d = np.shape(enc["embed"]["token"]["embedding"])
  return {"architectures": ["BertForPreTraining"], "model_type": "bert", "vocab_size": int(v),
          "hidden_size": int(d), "num_hidden_layers": int(m.num_layers),
          "num_attention_heads": int(m.num_heads), "intermediate_size": int(m.mlp_dim),
          "hidden_act": _EXPORT_ACTIVATIONS[m.activation],
          "max_position_embeddings": int(m.max_len),
          "type_vocab_size": int(np.shape(enc["segment"]["embedding"])[0]),
          "layer_norm_eps": float(m.get("layer_norm_epsilon", 1e-12)),
          "hidden_dropout_prob": float(m.dropout_rate),
          "attention_probs_dropout_prob": float(m.attention_dropout_rate),
          "position_embedding_type": "absolute", "pad_token_id": 0, "tie_word_embeddings": True}


def _check_bert_exportable(config: Any) -> None:
  m = config.model
  problems = []
  if m.norm_position != "post":
    problems.append(f"model.norm_position={m.norm_position} (BERT is post-LN)")
  if m.get("position", "learned") != "learned":
    problems.append(f"model.position={m.position} (BERT has a learned position table)")
  problems += _attention_option_problems(m, "BERT")
  if problems:
    raise HFError(f"this BERT run cannot be written as a Hugging Face BERT: "
                  f"{'; '.join(problems)}")


# --------------------------------------------------------------------------------------------------
# Registry, import, export


# model_type -> (params from tensors, tensors from params, run config, HF config, export check).
ARCHITECTURES: dict[str, tuple[Callable, ...]] = {
    "gpt2": (gpt2_to_params, gpt2_from_params, _gpt2_run_config, _gpt2_export_config,
             _check_gpt_exportable),
    "bert": (bert_to_params, bert_from_params, _bert_run_config, _bert_export_config,
             _check_bert_exportable),
}
# attnlab task -> the model_type it exports as.
TASK_ARCHITECTURES = {"causal_lm": "gpt2", "masked_lm": "bert"}


def _base_config(name: str, arg: str, model: dict[str, Any]):
  """The repository's configs/<name>:<arg> with the model fields `model`."""
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).resolve().parents[2] / "configs" / name
  if not path.is_file():
    raise HFError(f"{path} not found: import-hf builds its run config from the repository's "
                  f"configs/ folder (install attnlab from its repository: pip install -e .)")
  config = config_utils.load_config_file(f"{path}:{arg}" if arg else str(path))
  for key, value in model.items():
    config.model[key] = value
  return config


def load_checkpoint(folder: PathLike) -> tuple[str, dict[str, Any], Any]:
  """(model_type, the attnlab run config, attnlab params) of a checkpoint folder."""
  hf = read_hf_config(folder)
  model_type = hf.get("model_type")
  if model_type is None and (pathlib.Path(folder) / "checkpoints").is_dir():
    raise HFError(f"{folder} is an attnlab run directory, not a Hugging Face checkpoint: use it "
                  "as --workdir of generate, inspect or view directly, or write it as a Hugging "
                  "Face checkpoint with `attnlab import-hf RUN_DIR --export_to=DIR`")
  if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
    raise HFError(f"unsupported model_type {model_type!r:.40} in config.json; attnlab imports: "
                  f"{', '.join(ARCHITECTURES)}")
  to_params, _, run_config, _, _ = ARCHITECTURES[model_type]
  config = run_config(hf)  # checks the config before the (large) weights are read
  return model_type, config, to_params(hf, read_weights(folder), folder)


def import_checkpoint(folder: PathLike, workdir: PathLike, *, overwrite: bool = False
                      ) -> pathlib.Path:
  """Writes an attnlab run directory (step 0) from a Hugging Face checkpoint folder.

  Returns the run directory. Raises HFError (one line: what is wrong, how to fix it).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from attnlab import checkpoint  # pylint: disable=g-import-not-at-top
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  from attnlab import tasks  # pylint: disable=g-import-not-at-top
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top

  folder = pathlib.Path(folder).absolute()
  workdir = pathlib.Path(workdir).absolute()
  model_type, config, params = load_checkpoint(folder)
  if (workdir / rundir.CONFIG_FILE).exists() or (workdir / checkpoint.CHECKPOINT_DIR).exists():
    if not overwrite:
      raise HFError(f"{workdir} already holds a run; give an empty or new --workdir (or "
                    f"--overwrite to replace it)")
    for name in (rundir.CONFIG_FILE, checkpoint.CHECKPOINT_DIR, assets_lib.DIRNAME,
                 IMPORT_FILE):
      target = workdir / name
      if target.is_dir():
        shutil.rmtree(target)
      elif target.exists():
        target.unlink()
  workdir.mkdir(parents=True, exist_ok=True)

  # Tokenizer: the checkpoint's files, copied into the run's assets (which a reloaded run reads,
  # wherever it was moved; the absolute path is for a fine-tuning config that copies it); else
  # token ids.
  copied = (hf_tokenizer.copy_files(folder, workdir / TOKENIZER_DIR)
            if hf_tokenizer.has_tokenizer_files(folder) else [])
  config.data.tokenizer = "hf" if copied else "ids"
  config.data.tokenizer_path = str(workdir / TOKENIZER_DIR) if copied else ""
  if not copied:
    _LOG.warning("%s has no tokenizer files: imported the weights with data.tokenizer=ids, so "
                 "prompts are token ids separated by spaces ('464 3290 318')", folder)

  task = tasks.build_task(config)
  task.save_assets(workdir / assets_lib.DIRNAME)
  diffs = checkpoint.signature_diffs(
      checkpoint.tree_signature(params),
      checkpoint.tree_signature(jax.eval_shape(task.init, jax.random.key(0))), "checkpoint")
  if diffs:
    raise HFError(f"the converted weights do not fit the attnlab model: {'; '.join(diffs[:3])}")
  params = jax.tree.map(jnp.asarray, params)
  tx = state_lib.make_optimizer(config.optimizer, state_lib.make_schedule(config.optimizer,
                                                                          config.num_train_steps))
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=tx.init(params))
  rundir.write_config(workdir, config)
  with checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR) as ckpt:
    ckpt.save(0, state, {"index": 0})
  (workdir / IMPORT_FILE).write_text(json.dumps(
      {"source": str(folder), "model_type": model_type, "tokenizer_files": copied,
       "weights": sorted(p.name for p in folder.iterdir()
                         if p.name.startswith(("model.safetensors", "pytorch_model.bin")))},
      indent=2) + "\n")
  return workdir


def _check_exportable(config: Any) -> None:
  """HFError (one line) unless a run of `config` has a Hugging Face form (TASK_ARCHITECTURES
  and the architecture's own check)."""
  if config.get("task") not in TASK_ARCHITECTURES:
    raise HFError(f"a {config.get('task')!r} run cannot be exported; valid tasks: "
                  f"{', '.join(f'{k} (as {v})' for k, v in TASK_ARCHITECTURES.items())}")
  ARCHITECTURES[TASK_ARCHITECTURES[config.task]][4](config)


def export(run_or_dir: Any, out_dir: PathLike) -> pathlib.Path:
  """Writes a Hugging Face checkpoint folder (config.json + model.safetensors, and the run's
  tokenizer files) from a causal_lm (GPT-2) or masked_lm (BERT) run or run directory."""
  import jax  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  if isinstance(run_or_dir, (str, os.PathLike)):
    from attnlab import analysis  # pylint: disable=g-import-not-at-top
    from attnlab import rundir  # pylint: disable=g-import-not-at-top
    _check_exportable(rundir.read_config(run_or_dir))  # before the checkpoint is read
    # The run's result: its newest checkpoint, or the best one of a run early stopping ended.
    run = analysis.load_run(run_or_dir)
  else:
    run = run_or_dir
  config = run.config
  _check_exportable(config)
  _, from_params, _, export_config, _ = ARCHITECTURES[TASK_ARCHITECTURES[config.task]]
  params = jax.tree.map(np.asarray, jax.device_get(run.params))
  hf = export_config(config, params)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  save_file(from_params(params, hf), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
  (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
  tokenizer = getattr(run.task, "tokenizer", None)
  if isinstance(tokenizer, hf_tokenizer.HFTokenizer):  # the run's kept tokenizer files
    hf_tokenizer.copy_files(tokenizer.directory, out_dir)
  return out_dir
