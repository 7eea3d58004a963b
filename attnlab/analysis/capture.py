"""Capture every attention layer's weights of a run in one jit-compiled forward pass.

  cap = capture_text(run, "9 october 1993")        # encoder-decoder: greedy-decodes the target
  cap = capture_text(run, "9 october 1993", target="1993-10-09")   # teacher-forced on a target
  cap = capture_text(run, "ROMEO:")                # GPT;  BERT: "[CLS] text [SEP]" (target = B)
  cap = capture(run, {"source": ids, "target": ids})   # token ids instead of text
  cap.weights["encoder_layer_0/self_attention"]    # [heads, q_len, k_len] float32 numpy
  cap.sides["decoder_layer_0/cross_attention"]     # ("target", "source")
  maps = capture_batch(run, inputs)                # {path: [batch, heads, q_len, k_len]}

Paths are the "/"-joined module paths of `attention_maps` (sorted naturally: layer_2 before
layer_10): "block_<i>/self_attention" (GPT), "encoder/block_<i>/self_attention" (BERT),
"encoder_layer_<i>/self_attention", "decoder_layer_<i>/{self,cross}_attention" (Transformer),
"." (the RNN seq2seq sows its one attention at the model root; heads = 1), "." for the
Nadaraya-Watson regression (sides "queries" and "keys") and "pooling" for the RNN text
classifier's attention pooling (`[1, 1, len]`: sides "context", the one position of the learned
context vector u_w, labelled "[u_w]", and "tokens"; kind "cross"; a run with last or mean
pooling has no attention and captures nothing).

Token sides. Encoder-decoder runs: "source" = the source tokens, "target" = the decoder's input
tokens `<start> y_1 .. y_n`, one per decoder position: row i of a cross-attention is the step
that *produces* y_(i+1) (`<end>` for the last row). So the rows of an alignment read "the step
after this token"; the self-attention keys are exactly the tokens at those positions (as for
GPT, whose position i reads token i and predicts token i + 1).

Inputs of `capture` / `capture_batch` (int arrays `[len]` for one example or `[batch, len]`,
padded with 0), by task:
  translation     {"source", "source_length"?, "target"?, "target_length"?}: target as in
                  training, `<start> y_1 .. y_n <end>`; without it the source is decoded greedily
                  with the task's decoder and the decoded output is teacher-forced.
  causal_lm       {"inputs", "length"?} or the ids themselves.
  masked_lm, classification  {"tokens", "segments"?, "valid"?} or the ids themselves.
  rnn_classification  {"tokens"} or the ids themselves (right-padded with 0).
  regression      {"queries", "keys", "values"} float `[n]` (default: the task's test grid and
                  training points).

extras=True adds, per MultiHeadAttention path, "<path>/queries", "<path>/keys", "<path>/values"
`[heads, len, head_dim]` (after rotary; grouped-query kv heads repeated to the query heads),
"<path>/scores" `[heads, q_len, k_len]` (the layer's score function on those queries and keys:
the raw logits, before position biases, masking and the normaliser), "<path>/context"
`[heads, q_len, head_dim]` (each head's output before the output projection), and
"<block path>/output" `[len, d]` for every TransformerBlock (and the RNN encoder's states). All
are the forward pass's own activations, read at its hook sites (attnlab.analysis.hooks: attn.q,
.k, .v, .z, resid_post, encoder.states) in the same pass as the weights. The default path
(extras=False) computes nothing beyond the forward pass.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from attnlab.analysis import hooks as hooks_lib
from attnlab.attention import scores as scores_lib
from attnlab.layers import hooks as layer_hooks
from attnlab.layers import sown
from attnlab.layers.attention import repeat_kv_heads

__all__ = ["Capture", "capture", "capture_batch", "capture_text", "layer_info", "SUPPORTED_TASKS"]


@dataclasses.dataclass
class Capture:
  """The attention of one example, every layer, as plain numpy."""
  # Token strings per side: {"source": [...], "target": [...]} for encoder-decoder runs,
  # {"tokens": [...]} for GPT/BERT (and the Nadaraya-Watson regression: {"queries", "keys"}).
  tokens: dict[str, list[str]]
  # Layer path -> weights [heads, q_len, k_len] of ONE example (float32); RNN attention has heads=1.
  weights: dict[str, np.ndarray]
  # Layer path -> (query side, key side), names from `tokens`, e.g. ("target", "source").
  sides: dict[str, tuple[str, str]]
  # Layer path -> "self" | "causal" | "cross".
  kind: dict[str, str]
  # Optional q/k/v/scores/block outputs by path ("<layer path>/<name>"), empty by default.
  extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Prepared:
  """One batch ready for the model: positional args, and ids/lengths of every token side."""
  args: tuple[Any, ...]
  ids: dict[str, np.ndarray]  # side -> [batch, len]
  lengths: dict[str, np.ndarray]  # side -> [batch]


def _as_batch(x: Any, name: str) -> np.ndarray:
  x = np.asarray(x, np.int32)
  if x.ndim == 1:
    x = x[None]
  if x.ndim != 2 or x.shape[1] == 0:
    raise ValueError(f"inputs[{name!r}] must be ids [len] or [batch, len] with len >= 1; got "
                     f"shape {x.shape}")
  return x


def pad_ids(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
  """Id lists as one 0-padded int32 batch `[len(rows), longest]` and their lengths `[len(rows)]`."""
  lengths = np.array([len(r) for r in rows], np.int32)
  ids = np.zeros((len(rows), lengths.max()), np.int32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
  return ids, lengths


def _length(x: np.ndarray) -> np.ndarray:
  """Real lengths `[batch]` of 0-padded rows (index of the last nonzero + 1)."""
  nonzero = x != 0
  return np.where(nonzero.any(1), x.shape[1] - np.argmax(nonzero[:, ::-1], axis=1), 0)


def _dict_inputs(inputs: Any, main: str) -> dict[str, Any]:
  return dict(inputs) if isinstance(inputs, Mapping) else {main: inputs}


def _check_keys(task: str, inputs: Mapping[str, Any], required: tuple[str, ...],
                optional: tuple[str, ...]) -> None:
  unknown = sorted(set(inputs) - set(required) - set(optional))
  missing = [k for k in required if k not in inputs]
  if unknown or missing:
    raise ValueError(f"{task} inputs take the keys {', '.join(required)} (required) and "
                     f"{', '.join(optional) or 'none'} (optional); "
                     + (f"missing {', '.join(missing)}" if missing else
                        f"unknown {', '.join(unknown)}"))


# ------------------------------------------------------------------------------ task families


def _prepare_translation(run, inputs) -> _Prepared:
  inputs = _dict_inputs(inputs, "source")
  _check_keys("translation", inputs, ("source",),
              ("source_length", "target", "target_length"))
  src = _as_batch(inputs["source"], "source")
  src_len = np.asarray(inputs.get("source_length", _length(src)), np.int32).reshape(-1)
  if "target" in inputs:
    tgt = _as_batch(inputs["target"], "target")
    tgt_len = np.asarray(inputs.get("target_length", _length(tgt)), np.int32).reshape(-1)
  else:
    tgt, tgt_len = _greedy_targets(run, src, src_len)
  if len(src) != len(tgt):
    raise ValueError(f"source has {len(src)} rows but target has {len(tgt)}")
  if tgt.shape[1] < 2:
    raise ValueError("target must be <start> tokens... <end> (at least 2 ids)")
  tgt_in = tgt[:, :-1]  # [batch, t]: <start> y_1 .. y_n
  return _Prepared(args=(src, src_len, tgt_in),
                   ids={"source": src, "target": tgt_in},
                   lengths={"source": src_len, "target": np.maximum(tgt_len - 1, 0)})


def _greedy_targets(run, src: np.ndarray, src_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`<start> decoded <end>` ids `[batch, t]` and lengths of a greedy decoding of `src`."""
  task = run.task
  tokens, _ = task.decode_arrays(run.params, src, src_len, beam_size=1, batch_size=len(src))
  end = task.tgt_tok.end_id
  rows = []
  for row in np.asarray(tokens):
    ids = [int(i) for i in row]
    rows.append([task.tgt_tok.start_id] + (ids[:ids.index(end) + 1] if end in ids else ids))
  return pad_ids(rows)


def _prepare_causal_lm(run, inputs) -> _Prepared:
  inputs = _dict_inputs(inputs, "inputs")
  _check_keys("causal_lm", inputs, ("inputs",), ("length",))
  ids = _as_batch(inputs["inputs"], "inputs")
  block = run.model.block_size
  if ids.shape[1] > block:
    raise ValueError(f"the input has {ids.shape[1]} tokens but this GPT reads at most "
                     f"block_size={block}; shorten it")
  length = np.asarray(inputs.get("length", np.full(len(ids), ids.shape[1])), np.int32)
  return _Prepared(args=(ids,), ids={"tokens": ids}, lengths={"tokens": length.reshape(-1)})


def _prepare_bert(run, inputs) -> _Prepared:
  inputs = _dict_inputs(inputs, "tokens")
  _check_keys(run.config.task, inputs, ("tokens",), ("segments", "valid"))
  ids = _as_batch(inputs["tokens"], "tokens")
  max_len = run.model.max_len
  if ids.shape[1] > max_len:
    raise ValueError(f"the input has {ids.shape[1]} tokens but this BERT reads at most "
                     f"max_len={max_len}; shorten it")
  segments = np.asarray(inputs.get("segments", np.zeros_like(ids)), np.int32).reshape(ids.shape)
  valid = np.asarray(inputs.get("valid", ids != 0), bool).reshape(ids.shape)
  return _Prepared(args=(ids, segments, valid), ids={"tokens": ids},
                   lengths={"tokens": valid.sum(1).astype(np.int32)})


def _prepare_regression(run, inputs) -> _Prepared:
  if inputs is None:
    data = run.task.data
    inputs = {"queries": data.x_test, "keys": data.x_train, "values": data.y_train}
  if not isinstance(inputs, Mapping):
    raise ValueError("regression inputs are {'queries', 'keys', 'values'} float arrays [n]")
  _check_keys("regression", inputs, ("queries", "keys", "values"), ())
  q, k, v = (np.asarray(inputs[n], np.float32).reshape(-1) for n in ("queries", "keys", "values"))
  if len(k) != len(v):
    raise ValueError(f"regression keys ({len(k)}) and values ({len(v)}) must have one entry each")
  return _Prepared(args=(q, k, v), ids={"queries": q[None], "keys": k[None]},
                   lengths={"queries": np.array([len(q)]), "keys": np.array([len(k)])})


def _translation_info(path: str) -> tuple[tuple[str, str], str]:
  if path.endswith("cross_attention") or path == ".":
    return ("target", "source"), "cross"
  if path.startswith("encoder"):
    return ("source", "source"), "self"
  return ("target", "target"), "causal"


@dataclasses.dataclass(frozen=True)
class _Family:
  # Builds the model's inputs from ids (or text-derived ids).
  prepare: Callable[[Any, Any], _Prepared]
  # Layer path -> ((query side, key side), kind).
  info: Callable[[str], tuple[tuple[str, str], str]]
  # Text -> inputs (None: no text form).
  encode_text: Callable[[Any, str, str | None], Any] | None
  # (run, side) -> the tokenizer of that side's ids (None: the inputs are numbers, not ids).
  tokenizer: Callable[[Any, str], Any] | None

  def labels(self, run, side: str, ids: np.ndarray) -> list[str]:
    if self.tokenizer is None:
      return [f"{float(x):.3g}" for x in ids]
    tok = self.tokenizer(run, side)
    return [tok.id_to_token(int(i)) for i in ids]


def _translation_text(run, text: str, target: str | None) -> dict[str, Any]:
  task = run.task
  src = task.encode_source(text)
  if not src:
    raise ValueError("cannot capture an empty input; give at least one source token")
  task.check_source(src)
  inputs: dict[str, Any] = {"source": np.asarray(src, np.int32)}
  if target is not None:
    tgt = task.encode_target(target)
    if len(tgt) > task.max_target_len():
      raise ValueError(f"the target has {len(tgt)} tokens with <start> and <end> but this model "
                       f"reads at most {task.max_target_len()}; shorten it")
    inputs["target"] = np.asarray(tgt, np.int32)
  return inputs


def _causal_lm_text(run, text: str, target: str | None) -> np.ndarray:
  if target is not None:
    raise ValueError("a causal_lm run reads one text; leave the target out (--target of "
                     "`attnlab view`, target= of capture_text) and append it to the text")
  return run.task.encode_prompt(text)


def _bert_text(run, text: str, target: str | None) -> dict[str, np.ndarray]:
  from attnlab.tasks import masked_lm  # pylint: disable=g-import-not-at-top
  tok = run.task.tokenizer
  a = tok.encode(text)
  b = tok.encode(target) if target is not None else None
  ids, segments = masked_lm.make_pair(a, b, run.model.max_len, np.random.default_rng(0),
                                      cls_id=tok.cls_id, sep_id=tok.sep_id)
  return {"tokens": np.asarray(ids, np.int32), "segments": np.asarray(segments, np.int32)}


def _task_tokenizer(run, side: str):
  return run.task.tokenizer


# The query side of attention pooling: the learned context vector u_w, one position (no token).
CONTEXT_SIDE = "context"
CONTEXT_LABEL = "[u_w]"


def _prepare_rnn_classifier(run, inputs) -> _Prepared:
  inputs = _dict_inputs(inputs, "tokens")
  _check_keys("rnn_classification", inputs, ("tokens",), ())
  ids = _as_batch(inputs["tokens"], "tokens")
  if np.any((ids[:, 1:] != 0) & (ids[:, :-1] == 0)):
    raise ValueError("rnn_classification tokens must be right-padded with 0 (no id after a 0)")
  lengths = (ids != 0).sum(1).astype(np.int32)
  return _Prepared(args=(ids,), ids={"tokens": ids, CONTEXT_SIDE: np.ones((len(ids), 1),
                                                                         np.int32)},
                   lengths={"tokens": lengths, CONTEXT_SIDE: np.ones((len(ids),), np.int32)})


def _rnn_classifier_info(path: str) -> tuple[tuple[str, str], str]:
  if path.startswith("encoder"):  # the encoder's states (extras=True)
    return ("tokens", "tokens"), "self"
  return (CONTEXT_SIDE, "tokens"), "cross"


def _rnn_classifier_text(run, text: str, target: str | None) -> np.ndarray:
  if target is not None:
    raise ValueError("an rnn_classification run reads one text; leave the target out")
  return run.task.encode(text)


class _ContextFamily(_Family):
  """A family with attention pooling: the context side's one position is labelled u_w."""

  def labels(self, run, side: str, ids: np.ndarray) -> list[str]:
    if side == CONTEXT_SIDE:
      return [CONTEXT_LABEL] * len(ids)
    return super().labels(run, side, ids)


_BERT = _Family(_prepare_bert, lambda p: (("tokens", "tokens"), "self"), _bert_text,
                _task_tokenizer)
# config.task -> how its model is fed and its layers are named.
_FAMILIES: dict[str, _Family] = {
    "translation": _Family(
        _prepare_translation, _translation_info, _translation_text,
        lambda run, side: run.task.src_tok if side == "source" else run.task.tgt_tok),
    "causal_lm": _Family(_prepare_causal_lm, lambda p: (("tokens", "tokens"), "causal"),
                         _causal_lm_text, _task_tokenizer),
    "masked_lm": _BERT,
    "classification": _BERT,
    "regression": _Family(_prepare_regression, lambda p: (("queries", "keys"), "cross"), None,
                          None),
    "rnn_classification": _ContextFamily(_prepare_rnn_classifier, _rnn_classifier_info,
                                         _rnn_classifier_text, _task_tokenizer),
}
# Tasks whose runs capture() understands.
SUPPORTED_TASKS: tuple[str, ...] = tuple(_FAMILIES)


def _family(run) -> _Family:
  task = run.config.task
  if task not in _FAMILIES:
    raise ValueError(f"capture does not know task {task!r}; supported tasks: "
                     f"{', '.join(SUPPORTED_TASKS)}")
  if run.model is None:
    raise ValueError(f"task {task!r} has no Flax model to run")
  return _FAMILIES[task]


def layer_info(run, path: str) -> tuple[tuple[str, str], str]:
  """((query side, key side), kind) of the attention layer `path` of `run`."""
  return _family(run).info(path)


# ------------------------------------------------------------------------------ forward pass


# Hook sites read for extras=True, by their local name -> the extra's name.
_EXTRA_SITES = {"q": "queries", "k": "keys", "v": "values", "z": "context",
                "resid_post": "output"}


def _extra_sites(model: Any) -> dict[str, str]:
  """{site key: "<module path>/<extra name>"} of the hook sites that extras=True reads (none
  for a model without hook sites, e.g. the Nadaraya-Watson regression)."""
  try:
    table = hooks_lib.sites(model)
  except ValueError:
    return {}
  out = {}
  for site in table.values():
    path, _, local = site.key.rpartition("/")
    if local in _EXTRA_SITES:
      out[site.key] = f"{path}/{_EXTRA_SITES[local]}"
    elif site.name == "encoder.states":  # the RNN encoder's output
      out[site.key] = f"{path}/output"
  return out


@functools.partial(jax.jit, static_argnames=("model", "keys"))
def _forward(model, params, args, keys: tuple[str, ...] | None):
  """(intermediates, hook values {site key: value}) of one forward pass; keys: the hook sites
  to sow (None: none, the plain pass)."""
  if keys is None:
    _, state = model.apply({"params": params}, *args, mutable=["intermediates"])
    return state.get("intermediates", {}), {}  # a model without attention sows nothing
  with layer_hooks.capturing(keys):
    _, state = model.apply({"params": params}, *args, mutable=["intermediates", layer_hooks.HOOKS])
  flat = traverse_util.flatten_dict(state.get(layer_hooks.HOOKS, {}), sep="/")
  return state.get("intermediates", {}), {k: v[-1] for k, v in flat.items()}


def _extras(model: Any, params: Any, wanted: dict[str, str], values: dict[str, Any]
            ) -> dict[str, np.ndarray]:
  """{"<path>/<name>": batched value} from the forward pass's own hook values: queries, keys,
  values `[batch, heads, len, head_dim]` (kv heads repeated to the query heads), context (z)
  `[batch, heads, q_len, head_dim]`, scores `[batch, heads, q_len, k_len]` (the layer's score
  function on those queries and keys), block / RNN encoder outputs `[batch, len, d]`."""
  extra = {wanted[key]: np.asarray(value) for key, value in values.items()}
  for key in [k for k in extra if k.endswith("/context")]:
    extra[key] = np.swapaxes(extra[key], 1, 2)  # z [batch, len, heads, hd] -> [b, heads, len, hd]
  for key in [k for k in extra if k.endswith("/queries")]:
    path = key.rpartition("/")[0]
    q = extra[key]
    for name in ("keys", "values"):
      extra[f"{path}/{name}"] = np.asarray(repeat_kv_heads(extra[f"{path}/{name}"], q.shape[1]))
    layer = params
    for part in path.split("/"):
      layer = layer[part]
    score_params = layer.get("score_params") or {}
    scores = scores_lib.get_score_fn(model.attention.score)(
        jnp.asarray(q), jnp.asarray(extra[f"{path}/keys"]), **score_params)  # [b, h, q, k]
    extra[f"{path}/scores"] = np.asarray(scores, np.float32)
  return extra


def _collect(intermediates: Any) -> dict[str, np.ndarray]:
  """{path: weights [batch, heads, q, k]} of the sown attention weights."""
  weights = {}
  for key, values in sown.sown_values(intermediates, None).items():
    path, _, name = key.rpartition("/")
    path = path or "."
    if name != sown.ATTENTION_WEIGHTS:
      continue
    value = np.asarray(values[-1]).astype(np.float32)  # sow keeps every call's value
    if value.ndim == 2:  # Nadaraya-Watson: [n_q, n_k]
      value = value[None, None]
    elif value.ndim == 3:  # RNN seq2seq: [batch, tgt_len, src_len], one head
      value = value[:, None]
    weights[path] = value
  return weights


def _run_forward(run, prepared: _Prepared, extras: bool):
  wanted = _extra_sites(run.model) if extras else {}
  args = tuple(jnp.asarray(a) for a in prepared.args)
  intermediates, values = _forward(run.model, run.params, args,
                                   keys=tuple(sorted(wanted)) if extras else None)
  weights = _collect(jax.device_get(intermediates))
  extra = _extras(run.model, run.params, wanted, jax.device_get(values)) if wanted else {}
  order = lambda d: {k: d[k] for k in sorted(d, key=sown.natural_key)}
  return order(weights), order(extra)


def capture_batch(run, inputs: Any = None, *, extras: bool = False) -> dict[str, np.ndarray]:
  """{path: weights `[batch, heads, q_len, k_len]`} of a whole (padded) batch, one forward pass.

  Rows of padded positions are kept (trim them with the lengths of the inputs).
  """
  return _run_forward(run, _family(run).prepare(run, inputs), extras)[0]


def capture(run, inputs: Any = None, *, example: int = 0, extras: bool = False) -> Capture:
  """Every attention layer's weights for example `example` of `inputs` (see the module docstring).

  Raises ValueError naming the expected inputs, or the supported tasks.
  """
  family = _family(run)
  prepared = family.prepare(run, inputs)
  batch = len(next(iter(prepared.lengths.values())))
  if not -batch <= example < batch:
    raise ValueError(f"example must be in 0..{batch - 1} (the inputs hold {batch}), got {example}")
  weights, extra = _run_forward(run, prepared, extras)
  lengths = {side: int(n[example]) for side, n in prepared.lengths.items()}
  tokens = {side: family.labels(run, side, ids[example, :lengths[side]])
            for side, ids in prepared.ids.items()}
  out = Capture(tokens=tokens, weights={}, sides={}, kind={})
  for path, w in weights.items():
    (q_side, k_side), kind = family.info(path)
    w = w[example if w.shape[0] > 1 else 0, :, :lengths[q_side], :lengths[k_side]]
    out.weights[path] = np.ascontiguousarray(w, np.float32)  # [heads, q_len, k_len]
    out.sides[path] = (q_side, k_side)
    out.kind[path] = kind
  for key, value in extra.items():
    path, name = key.rsplit("/", 1)
    if name == "output":  # [batch, len, d] of a block
      side = family.info(path)[0][0]
      out.extras[key] = value[example, :lengths[side]]
      continue
    q_side, k_side = out.sides[path]
    n_q, n_k = lengths[q_side], lengths[k_side]
    value = value[example]  # [heads, len, ...]
    if name in ("queries", "context"):
      value = value[:, :n_q]
    elif name in ("keys", "values"):
      value = value[:, :n_k]
    else:  # scores
      value = value[:, :n_q, :n_k]
    out.extras[key] = np.asarray(value, np.float32)
  return out


def capture_text(run, text: str, target: str | None = None, *, extras: bool = False) -> Capture:
  """`capture` of raw text, encoded with the run's own tokenizer.

  translation: `text` is the source; `target` (optional) the reference output to teacher-force,
    otherwise the greedy decoding of `text` is captured. causal_lm: the prompt as
    `attnlab generate` encodes it. masked_lm / classification: `[CLS] text [SEP]`, or
    `[CLS] text [SEP] target [SEP]` (segments 0 and 1) when `target` is given.
    rnn_classification: the text's ids (cut to data.max_len), no target.
  """
  family = _family(run)
  if family.encode_text is None:
    raise ValueError(f"a {run.config.task!r} run has no text inputs; use capture(run, inputs)")
  return capture(run, family.encode_text(run, text, target), extras=extras)
