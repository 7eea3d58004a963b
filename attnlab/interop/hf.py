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

import json
import logging
import os
import pathlib
import shutil
from typing import Any, Callable

import numpy as np

from attnlab import errors
from attnlab.errors import UserError
from attnlab.data import assets as assets_lib
from attnlab.data import hf_tokenizer
from attnlab.interop import torch_pickle

_LOG = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
# Sub-folder of an imported run holding the checkpoint's tokenizer files (its kept vocabulary).
TOKENIZER_DIR = f"{assets_lib.DIRNAME}/tokenizer"
# Provenance file of an imported run.
IMPORT_FILE = "import_hf.json"
# Hugging Face activation names -> attnlab activations.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu": "gelu", "relu": "relu"}


HFError = errors.HFError


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
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise HFError(f"{path} is not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise HFError(f"{path} holds no JSON object")
  return config


def _read_weight_file(path: pathlib.Path) -> dict[str, np.ndarray]:
  if path.suffix == ".safetensors":
    from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    try:
      return load_file(str(path))
    except (SafetensorError, OSError, ValueError, TypeError) as e:
      raise HFError(f"{path}: not a readable safetensors file ({e})") from None
  try:
    return torch_pickle.load_state_dict(path)
  except torch_pickle.TorchFileError as e:
    raise HFError(str(e)) from None


def read_weights(folder: PathLike) -> dict[str, np.ndarray]:
  """{tensor name: array} of the folder's weights (safetensors preferred; shards followed)."""
  folder = pathlib.Path(folder)
  for name in ("model.safetensors", "pytorch_model.bin"):
    index = folder / f"{name}.index.json"
    if (folder / name).is_file():
      return _read_weight_file(folder / name)
    if index.is_file():
      try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
      except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise HFError(f"{index}: not a weight index (a 'weight_map' object expected; "
                      f"{e})") from None
      tensors: dict[str, np.ndarray] = {}
      for shard in shards:
        if not (folder / shard).is_file():
          raise HFError(f"{index} names the shard {shard}, which is missing from {folder}")
        tensors.update(_read_weight_file(folder / shard))
      return tensors
  raise HFError(f"{folder} has no weights: expected model.safetensors or pytorch_model.bin "
                f"(or their .index.json with shards) beside config.json")


class _Tensors:
  """The checkpoint's tensors, taken by name; remembers which were used."""

  def __init__(self, tensors: dict[str, np.ndarray], prefix: str, folder: pathlib.Path):
    self.tensors = tensors
    self.prefix = prefix
    self.folder = folder
    self.used: set[str] = set()

  def has(self, name: str) -> bool:
    return self.prefix + name in self.tensors

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

  def check_all_used(self, ignore: Callable[[str], bool]) -> None:
    left = sorted(k for k in self.tensors if k not in self.used and not ignore(k))
    if left:
      raise HFError(f"the weights in {self.folder} hold tensors this architecture has no place "
                    f"for: {', '.join(left[:5])}{' ...' if len(left) > 5 else ''}; the "
                    f"checkpoint has options attnlab does not express")


def _get(config: dict[str, Any], key: str, default: Any = None) -> Any:
  value = config.get(key, default)
  if value is None and default is None:
    raise HFError(f"config.json lacks {key!r}, which this architecture needs")
  return default if value is None else value


def _activation(name: str) -> str:
  if name not in ACTIVATIONS:
    raise HFError(f"activation {name!r} of config.json is not supported; valid: "
                  f"{', '.join(ACTIVATIONS)}")
  return ACTIVATIONS[name]


# --------------------------------------------------------------------------------------------------
# GPT-2


def _gpt2_dims(hf: dict[str, Any]) -> dict[str, Any]:
  d = int(_get(hf, "n_embd"))
  inner = int(hf.get("n_inner") or 4 * d)
  if inner % d:
    raise HFError(f"n_inner={inner} is not a multiple of n_embd={d}; attnlab's GPT takes the "
                  f"MLP size as mlp_ratio * d_model")
  for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                  ("add_cross_attention", False)):
    if bool(hf.get(key, ok)) != ok:
      raise HFError(f"config.json has {key}={hf.get(key)}, which attnlab's GPT does not "
                    f"express (it needs {ok})")
  return dict(vocab_size=int(_get(hf, "vocab_size")), num_layers=int(_get(hf, "n_layer")),
              num_heads=int(_get(hf, "n_head")), d_model=d, block_size=int(_get(hf, "n_positions")),
              mlp_ratio=inner // d,
              activation=_activation(hf.get("activation_function", "gelu_new")),
              layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
              dropout_rate=float(hf.get("resid_pdrop", 0.0)),
              attention_dropout_rate=float(hf.get("attn_pdrop", 0.0)))


def gpt2_to_params(hf: dict[str, Any], tensors: dict[str, np.ndarray],
                   folder: PathLike = "") -> dict[str, Any]:
  """attnlab GPT params from GPT-2 tensors (GPT2LMHeadModel or GPT2Model names)."""
  dims = _gpt2_dims(hf)
  prefix = "transformer." if "transformer.wte.weight" in tensors else ""
  t = _Tensors(tensors, prefix, pathlib.Path(folder))
  v, d, n = dims["vocab_size"], dims["d_model"], dims["block_size"]
  inner = dims["mlp_ratio"] * d
  ln = lambda name: {"scale": t.take(f"{name}.weight", (d,)), "bias": t.take(f"{name}.bias", (d,))}
  dense = lambda name, i, o: {"kernel": t.take(f"{name}.weight", (i, o)),
                              "bias": t.take(f"{name}.bias", (o,))}
  params: dict[str, Any] = {"embed": {"token": {"embedding": t.take("wte.weight", (v, d))},
                                      "position": t.take("wpe.weight", (n, d))}}
  for i in range(dims["num_layers"]):
    h = f"h.{i}"
    w = t.take(f"{h}.attn.c_attn.weight", (d, 3 * d))  # [d, 3d]: query | key | value
    b = t.take(f"{h}.attn.c_attn.bias", (3 * d,))
    attn = {}
    for j, name in enumerate(("query", "key", "value")):
      attn[f"{name}_kernel"] = w[:, j * d:(j + 1) * d]
      attn[f"{name}_bias"] = b[j * d:(j + 1) * d]
    attn["out"] = dense(f"{h}.attn.c_proj", d, d)
    params[f"block_{i}"] = {"ln_1": ln(f"{h}.ln_1"), "self_attention": attn,
                            "ln_2": ln(f"{h}.ln_2"),
                            "mlp": {"fc": dense(f"{h}.mlp.c_fc", d, inner),
                                    "proj": dense(f"{h}.mlp.c_proj", inner, d)}}
  params["ln_f"] = ln("ln_f")
  head = tensors.get("lm_head.weight")
  if head is not None:
    t.used.add("lm_head.weight")
    if head.shape != (v, d) or not np.array_equal(head, params["embed"]["token"]["embedding"]):
      raise HFError("lm_head.weight differs from the token table wte.weight: attnlab's GPT ties "
                    "its output layer to the token table (tie_word_embeddings=true), so an untied "
                    "head cannot be imported")
  # Buffers of older checkpoints (the causal mask), not parameters.
  t.check_all_used(lambda k: k.endswith((".attn.bias", ".attn.masked_bias")))
  return params


def gpt2_from_params(params: Any) -> dict[str, np.ndarray]:
  """GPT2LMHeadModel tensors (transformer.* names) from attnlab GPT params."""
  p = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  out = {"transformer.wte.weight": p(params["embed"]["token"]["embedding"]),
         "transformer.wpe.weight": p(params["embed"]["position"])}

  def ln(name, tree):
    out[f"transformer.{name}.weight"] = p(tree["scale"])
    out[f"transformer.{name}.bias"] = p(tree["bias"])

  def dense(name, tree):
    out[f"transformer.{name}.weight"] = p(tree["kernel"])
    out[f"transformer.{name}.bias"] = p(tree["bias"])

  i = 0
  while f"block_{i}" in params:
    blk, h = params[f"block_{i}"], f"h.{i}"
    attn = blk["self_attention"]
    ln(f"{h}.ln_1", blk["ln_1"])
    out[f"transformer.{h}.attn.c_attn.weight"] = p(np.concatenate(
        [attn[f"{n}_kernel"] for n in ("query", "key", "value")], axis=1))  # [d, 3d]
    out[f"transformer.{h}.attn.c_attn.bias"] = p(np.concatenate(
        [attn[f"{n}_bias"] for n in ("query", "key", "value")]))
    dense(f"{h}.attn.c_proj", attn["out"])
    ln(f"{h}.ln_2", blk["ln_2"])
    dense(f"{h}.mlp.c_fc", blk["mlp"]["fc"])
    dense(f"{h}.mlp.c_proj", blk["mlp"]["proj"])
    i += 1
  ln("ln_f", params["ln_f"])
  return out


def _gpt2_run_config(hf: dict[str, Any]):
  dims = _gpt2_dims(hf)
  config = _base_config("gpt.py", "")
  m = config.model
  m.size = "tiny"  # every dimension is set below
  for key in ("num_layers", "num_heads", "d_model", "block_size", "mlp_ratio", "activation",
              "dropout_rate", "attention_dropout_rate"):
    m[key] = dims[key]
  m.position = "learned"
  m.use_bias = True
  m.score = "scaled_dot"
  # LayerNorm epsilon (GPT-2: 1e-5).
  m.layer_norm_epsilon = dims["layer_norm_epsilon"]
  # Rows of the token table (the checkpoint's; 0 would mean the tokenizer's size).
  m.vocab_size = dims["vocab_size"]
  config.data.name = "tiny_shakespeare"
  return config, dims["vocab_size"]


def _gpt2_export_config(config: Any, params: Any) -> dict[str, Any]:
  m = config.model
  v, d = np.shape(params["embed"]["token"]["embedding"])
  n = np.shape(params["embed"]["position"])[0]
  activation = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}[m.activation]
  num_layers = sum(1 for k in params if k.startswith("block_"))
  return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": int(v),
          "n_positions": int(n), "n_embd": int(d), "n_layer": num_layers,
          "n_head": int(m.num_heads) or _heads_from_size(config),
          "n_inner": int(m.mlp_ratio * d), "activation_function": activation,
          "layer_norm_epsilon": float(m.get("layer_norm_epsilon", 1e-5)),
          "resid_pdrop": float(m.dropout_rate), "embd_pdrop": float(m.dropout_rate),
          "attn_pdrop": float(m.attention_dropout_rate), "tie_word_embeddings": True,
          "scale_attn_weights": True}


def _heads_from_size(config: Any) -> int:
  from attnlab.models import gpt  # pylint: disable=g-import-not-at-top
  return gpt.size_config(config.model.size)["num_heads"]


def _check_gpt_exportable(config: Any) -> None:
  m = config.model
  problems = []
  if m.position != "learned":
    problems.append(f"model.position={m.position} (GPT-2 has a learned position table)")
  if not m.use_bias:
    problems.append("model.use_bias=False (GPT-2 has biases)")
  if m.score != "scaled_dot":
    problems.append(f"model.score={m.score} (GPT-2 uses scaled_dot)")
  if problems:
    raise HFError(f"this GPT run cannot be written as GPT-2: {'; '.join(problems)}; only runs "
                  f"with position=learned, use_bias=True, score=scaled_dot can")


# --------------------------------------------------------------------------------------------------
# BERT


def _bert_dims(hf: dict[str, Any]) -> dict[str, Any]:
  if hf.get("position_embedding_type", "absolute") != "absolute":
    raise HFError(f"position_embedding_type={hf.get('position_embedding_type')!r} is not "
                  f"supported; attnlab's BERT has absolute (learned) positions")
  if hf.get("is_decoder", False):
    raise HFError("config.json has is_decoder=true; attnlab's BERT is an encoder")
  return dict(vocab_size=int(_get(hf, "vocab_size")),
              num_layers=int(_get(hf, "num_hidden_layers")),
              d_model=int(_get(hf, "hidden_size")), num_heads=int(_get(hf, "num_attention_heads")),
              mlp_dim=int(_get(hf, "intermediate_size")),
              max_len=int(_get(hf, "max_position_embeddings")),
              type_vocab_size=int(hf.get("type_vocab_size", 2)),
              activation=_activation(hf.get("hidden_act", "gelu")),
              layer_norm_epsilon=float(hf.get("layer_norm_eps", 1e-12)),
              dropout_rate=float(hf.get("hidden_dropout_prob", 0.1)),
              attention_dropout_rate=float(hf.get("attention_probs_dropout_prob", 0.1)))


def _bert_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Older BERT checkpoints name LayerNorm parameters gamma/beta; use weight/bias."""
  out = {}
  for k, x in tensors.items():
    if k.endswith(".gamma"):
      k = k[:-len("gamma")] + "weight"
    elif k.endswith(".beta"):
      k = k[:-len("beta")] + "bias"
    out[k] = x
  return out


def bert_to_params(hf: dict[str, Any], tensors: dict[str, np.ndarray],
                   folder: PathLike = "") -> dict[str, Any]:
  """attnlab BertForPretraining params from BertForPreTraining tensors."""
  dims = _bert_dims(hf)
  tensors = _bert_names(tensors)
  t = _Tensors(tensors, "", pathlib.Path(folder))
  v, d, f, n = dims["vocab_size"], dims["d_model"], dims["mlp_dim"], dims["max_len"]
  ln = lambda name: {"scale": t.take(f"{name}.weight", (d,)), "bias": t.take(f"{name}.bias", (d,))}
  # PyTorch Linear weight [out, in] -> Flax kernel [in, out].
  linear = lambda name, i, o: {"kernel": t.take(f"{name}.weight", (o, i)).T,
                               "bias": t.take(f"{name}.bias", (o,))}
  e = "bert.embeddings"
  encoder: dict[str, Any] = {
      "embed": {"token": {"embedding": t.take(f"{e}.word_embeddings.weight", (v, d))},
                "position": t.take(f"{e}.position_embeddings.weight", (n, d))},
      "segment": {"embedding": t.take(f"{e}.token_type_embeddings.weight",
                                      (dims["type_vocab_size"], d))},
      "embed_norm": ln(f"{e}.LayerNorm")}
  for i in range(dims["num_layers"]):
    layer = f"bert.encoder.layer.{i}"
    attn = {}
    for name in ("query", "key", "value"):
      lin = linear(f"{layer}.attention.self.{name}", d, d)
      attn[f"{name}_kernel"], attn[f"{name}_bias"] = lin["kernel"], lin["bias"]
    attn["out"] = linear(f"{layer}.attention.output.dense", d, d)
    encoder[f"block_{i}"] = {
        "self_attention": attn, "ln_1": ln(f"{layer}.attention.output.LayerNorm"),
        "mlp": {"fc": linear(f"{layer}.intermediate.dense", d, f),
                "proj": linear(f"{layer}.output.dense", f, d)},
        "ln_2": ln(f"{layer}.output.LayerNorm")}
  encoder["pooler"] = linear("bert.pooler.dense", d, d)
  c = "cls.predictions"
  if t.has(f"{c}.bias"):
    mlm_bias = t.take(f"{c}.bias", (v,))
  else:
    mlm_bias = t.take(f"{c}.decoder.bias", (v,))
  for name in (f"{c}.decoder.weight", f"{c}.decoder.bias"):
    if name in tensors:
      t.used.add(name)
      tied = encoder["embed"]["token"]["embedding"] if name.endswith("weight") else mlm_bias
      if tensors[name].shape != tied.shape or not np.array_equal(tensors[name], tied):
        raise HFError(f"{name} differs from the tensor it is tied to; attnlab's BERT ties the "
                      f"MLM decoder to the token table (tie_word_embeddings=true)")
  params = {"encoder": encoder, "mlm_transform": linear(f"{c}.transform.dense", d, d),
            "mlm_norm": ln(f"{c}.transform.LayerNorm"), "mlm_bias": mlm_bias,
            "nsp": linear("cls.seq_relationship", d, 2)}
  t.check_all_used(lambda k: k.endswith("position_ids"))  # a buffer of 0..max_len-1
  return params


def bert_from_params(params: Any) -> dict[str, np.ndarray]:
  """BertForPreTraining tensors from attnlab BertForPretraining params."""
  p = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  out: dict[str, np.ndarray] = {}

  def ln(name, tree):
    out[f"{name}.weight"], out[f"{name}.bias"] = p(tree["scale"]), p(tree["bias"])

  def linear(name, tree):
    out[f"{name}.weight"], out[f"{name}.bias"] = p(np.asarray(tree["kernel"]).T), p(tree["bias"])

  enc, e = params["encoder"], "bert.embeddings"
  out[f"{e}.word_embeddings.weight"] = p(enc["embed"]["token"]["embedding"])
  out[f"{e}.position_embeddings.weight"] = p(enc["embed"]["position"])
  out[f"{e}.token_type_embeddings.weight"] = p(enc["segment"]["embedding"])
  ln(f"{e}.LayerNorm", enc["embed_norm"])
  i = 0
  while f"block_{i}" in enc:
    blk, layer = enc[f"block_{i}"], f"bert.encoder.layer.{i}"
    attn = blk["self_attention"]
    for name in ("query", "key", "value"):
      linear(f"{layer}.attention.self.{name}",
             {"kernel": attn[f"{name}_kernel"], "bias": attn[f"{name}_bias"]})
    linear(f"{layer}.attention.output.dense", attn["out"])
    ln(f"{layer}.attention.output.LayerNorm", blk["ln_1"])
    linear(f"{layer}.intermediate.dense", blk["mlp"]["fc"])
    linear(f"{layer}.output.dense", blk["mlp"]["proj"])
    ln(f"{layer}.output.LayerNorm", blk["ln_2"])
    i += 1
  linear("bert.pooler.dense", enc["pooler"])
  linear("cls.predictions.transform.dense", params["mlm_transform"])
  ln("cls.predictions.transform.LayerNorm", params["mlm_norm"])
  out["cls.predictions.bias"] = p(params["mlm_bias"])
  linear("cls.seq_relationship", params["nsp"])
  return out


def _bert_run_config(hf: dict[str, Any]):
  dims = _bert_dims(hf)
  config = _base_config("bert.py", "mode=pretrain")
  m = config.model
  for key in ("num_layers", "d_model", "num_heads", "mlp_dim", "max_len", "activation",
              "dropout_rate", "attention_dropout_rate"):
    m[key] = dims[key]
  m.score = "scaled_dot"
  m.norm_position = "post"
  # LayerNorm epsilon of the embeddings, blocks and MLM head (BERT: 1e-12).
  m.layer_norm_epsilon = dims["layer_norm_epsilon"]
  # Number of segment (token type) ids.
  m.type_vocab_size = dims["type_vocab_size"]
  config.data.max_len = min(config.data.max_len, dims["max_len"])
  config.data.vocab_size = dims["vocab_size"]
  return config, dims["vocab_size"]


def _bert_export_config(config: Any, params: Any) -> dict[str, Any]:
  m = config.model
  enc = params["encoder"]
  v, d = np.shape(enc["embed"]["token"]["embedding"])
  activation = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}[m.activation]
  return {"architectures": ["BertForPreTraining"], "model_type": "bert", "vocab_size": int(v),
          "hidden_size": int(d), "num_hidden_layers": int(m.num_layers),
          "num_attention_heads": int(m.num_heads), "intermediate_size": int(m.mlp_dim),
          "hidden_act": activation, "max_position_embeddings": int(m.max_len),
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
  if m.score != "scaled_dot":
    problems.append(f"model.score={m.score} (BERT uses scaled_dot)")
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


def _configs_dir() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parents[2] / "configs"


def _base_config(name: str, arg: str):
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  path = _configs_dir() / name
  if not path.is_file():
    raise HFError(f"{path} not found: import-hf builds its run config from the repository's "
                  f"configs/ folder (install attnlab from its repository: pip install -e .)")
  return config_utils.load_config_file(f"{path}:{arg}" if arg else str(path))


def model_type_of(hf: dict[str, Any]) -> str:
  """The checkpoint's model_type, checked against the supported ones."""
  model_type = hf.get("model_type")
  if model_type not in ARCHITECTURES:
    raise HFError(f"unsupported model_type {model_type!r} in config.json; attnlab imports: "
                  f"{', '.join(ARCHITECTURES)}")
  return model_type


def load_checkpoint(folder: PathLike) -> tuple[str, dict[str, Any], Any]:
  """(model_type, the attnlab run config, attnlab params) of a checkpoint folder."""
  hf = read_hf_config(folder)
  model_type = model_type_of(hf)
  to_params, _, run_config, _, _ = ARCHITECTURES[model_type]
  config, _ = run_config(hf)  # checks the config before the (large) weights are read
  params = to_params(hf, read_weights(folder), folder)
  return model_type, config, params


def _abstract_params(task: Any) -> Any:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.eval_shape(task.init, jax.random.key(0))


def import_checkpoint(folder: PathLike, workdir: PathLike, *, overwrite: bool = False
                      ) -> pathlib.Path:
  """Writes an attnlab run directory (step 0) from a Hugging Face checkpoint folder.

  Returns the run directory. Raises HFError (one line: what is wrong, how to fix it).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from attnlab import checkpoint  # pylint: disable=g-import-not-at-top
  from attnlab import tasks  # pylint: disable=g-import-not-at-top
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top

  folder = pathlib.Path(folder).absolute()
  workdir = pathlib.Path(workdir).absolute()
  model_type, config, params = load_checkpoint(folder)
  if (workdir / checkpoint.CONFIG_FILE).exists() or (workdir / checkpoint.CHECKPOINT_DIR).exists():
    if not overwrite:
      raise HFError(f"{workdir} already holds a run; give an empty or new --workdir (or "
                    f"--overwrite to replace it)")
    for name in (checkpoint.CONFIG_FILE, checkpoint.CHECKPOINT_DIR, assets_lib.DIRNAME,
                 IMPORT_FILE):
      target = workdir / name
      if target.is_dir():
        shutil.rmtree(target)
      elif target.exists():
        target.unlink()
  workdir.mkdir(parents=True, exist_ok=True)

  # Tokenizer: the checkpoint's files, copied into the run; else token ids.
  copied = [n for n in hf_tokenizer.TOKENIZER_FILES if (folder / n).is_file()]
  if hf_tokenizer.has_tokenizer_files(folder):
    (workdir / TOKENIZER_DIR).mkdir(parents=True, exist_ok=True)
    for name in copied:
      shutil.copyfile(folder / name, workdir / TOKENIZER_DIR / name)
    config.data.tokenizer = "hf"
  else:
    copied = []
    config.data.tokenizer = "ids"
    _LOG.warning("%s has no tokenizer files: imported the weights with data.tokenizer=ids, so "
                 "prompts are token ids separated by spaces ('464 3290 318')", folder)
  # The folder of the tokenizer files, inside the run's assets (which a reloaded run reads,
  # wherever it was moved); absolute, for a fine-tuning config that copies it.
  config.data.tokenizer_path = str(workdir / TOKENIZER_DIR) if copied else ""

  task = tasks.build_task(config)
  task.save_assets(workdir / assets_lib.DIRNAME)
  expected = checkpoint.tree_signature(_abstract_params(task))
  got = checkpoint.tree_signature(params)
  if expected != got:
    diffs = [f"{k}: checkpoint {got.get(k, 'absent')}, model {expected.get(k, 'absent')}"
             for k in sorted(set(expected) | set(got)) if expected.get(k) != got.get(k)]
    raise HFError(f"the converted weights do not fit the attnlab model: {'; '.join(diffs[:3])}")
  params = jax.tree.map(jnp.asarray, params)
  tx = state_lib.make_optimizer(config.optimizer, state_lib.make_schedule(config.optimizer,
                                                                          config.num_train_steps))
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=tx.init(params))
  checkpoint.write_config(workdir, config)
  ckpt = checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR)
  try:
    ckpt.save(0, state, {"index": 0})
  finally:
    ckpt.close()
  (workdir / IMPORT_FILE).write_text(json.dumps(
      {"source": str(folder), "model_type": model_type, "tokenizer_files": copied,
       "weights": sorted(p.name for p in folder.iterdir()
                         if p.name.startswith(("model.safetensors", "pytorch_model.bin")))},
      indent=2) + "\n")
  return workdir


def export(run_or_dir: Any, out_dir: PathLike) -> pathlib.Path:
  """Writes a Hugging Face checkpoint folder (config.json + model.safetensors, and the run's
  tokenizer files) from a causal_lm (GPT-2) or masked_lm (BERT) run or run directory."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  if isinstance(run_or_dir, (str, os.PathLike)):
    from attnlab import analysis  # pylint: disable=g-import-not-at-top
    run = analysis.load_run(run_or_dir)
  else:
    run = run_or_dir
  config = run.config
  if config.task not in TASK_ARCHITECTURES:
    raise HFError(f"a {config.task!r} run cannot be exported; valid tasks: "
                  f"{', '.join(f'{k} (as {v})' for k, v in TASK_ARCHITECTURES.items())}")
  model_type = TASK_ARCHITECTURES[config.task]
  _, from_params, _, hf_config, check = ARCHITECTURES[model_type]
  check(config)
  import jax  # pylint: disable=g-import-not-at-top
  params = jax.tree.map(np.asarray, jax.device_get(run.params))
  tensors = from_params(params)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
  (out_dir / "config.json").write_text(json.dumps(hf_config(config, params), indent=2) + "\n")
  tokenizer = getattr(run.task, "tokenizer", None)
  if isinstance(tokenizer, hf_tokenizer.HFTokenizer):  # the run's kept tokenizer files
    for name in hf_tokenizer.TOKENIZER_FILES:
      if (tokenizer.directory / name).is_file():
        shutil.copyfile(tokenizer.directory / name, out_dir / name)
  return out_dir
