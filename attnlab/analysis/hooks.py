"""Hook sites of the model families, caching and interventions on the live forward pass, patching.

  from attnlab.analysis import hooks
  logits, cache = hooks.run_with_cache(run, tokens)                     # every site
  logits, cache = hooks.run_with_cache(run, tokens, ["blocks.0.attn.pattern"])
  logits, cache = hooks.run_with_cache(run, tokens, lambda name: name.endswith("resid_post"))
  iv = hooks.Intervention("blocks.1.attn.z", "zero", heads=np.eye(4, dtype=bool)[2])
  logits = hooks.run_with_hooks(run, tokens, [iv])                     # head 1.2 zeroed
  grid = hooks.patch_sweep(run, clean, corrupted, metric, site="resid_pre", over="position")
  out = hooks.generate_with_hooks(run, prompt, [iv], num_tokens=20, temperature=0.0)   # GPT

`run` is a loaded run (attnlab.analysis.load_run) or a `(model, params)` pair of any family below.
Sites are declared once per family in a table (`SITES`, expanded per model by `sites(model)`:
public name -> where the model produces it, its shape); the model code marks each with
attnlab.layers.hooks.hook, which costs nothing in a plain forward pass (its program is the same).
Cached values are the real activations of the forward pass (after any interventions given with
them), not recomputed; only the sites asked for are sown (attention forms its weights only when
a `pattern` is asked for).

An intervention is data (`Intervention`: site, op, value, position and head masks; a pytree), so
one compiled program serves every value and mask: `patch_sweep` vmaps one forward pass over the
masks of every (layer, position) or (layer, head) cell (per layer; the blocks below the patched
one are read from the corrupted run, not run again; in chunks of cells on a CPU).

Inputs and outputs per family (`inputs` of run_with_cache / run_with_hooks / patch_sweep: one
array = the model's first argument; a tuple = its positional arguments; a dict = the same by
name):

| family | model | inputs | output (what a metric reads) |
|---|---|---|---|
| gpt | attnlab.models.gpt.GPT | tokens `[batch, len]` | logits `[batch, len, vocab]` |
| bert | BertForPretraining, BertForClassification, BertEncoder | tokens, or {"tokens", "segments", "valid", "mlm_positions"} (all but tokens optional) | the model's own: (MLM logits, NSP logits); class logits; (sequence, pooled) |
| transformer | attnlab.models.transformer.Transformer | (src, src_lengths, tgt_in) or {"src", "src_lengths", "tgt_in"} (src_lengths optional: up to the last nonzero id) | logits `[batch, tgt_len, tgt_vocab]` (teacher-forced) |
| seq2seq | attnlab.models.seq2seq.Seq2Seq | as transformer | logits `[batch, tgt_len, tgt_vocab]` |
| rnn_classifier | attnlab.models.rnn_classifier.RNNClassifier | tokens `[batch, len]` (right-padded with 0) | class logits `[batch, classes]` |

Shapes below: `[batch, len, d_model]` unless noted; i = 0 .. layers - 1; `scale` sites are the
LayerNorms' per-token reciprocal standard deviation `[batch, len, 1]` (TransformerLens's
`hook_scale` is the standard deviation itself).

Per TransformerBlock (GPT, BERT and the encoder-decoder's stacks; `<b>` = `blocks.{i}`):

| name | produced |
|---|---|
| <b>.resid_pre | the block's input (the residual stream) |
| <b>.ln1.scale | pre-LN: ln_1 of resid_pre; post-LN: ln_1 of resid_pre + attn_out (after attn_out) |
| <b>.attn.q | queries, after rotary `[batch, heads, len, head_dim]` |
| <b>.attn.k, .v | keys, values, after rotary, per kv head `[batch, kv_heads, len, head_dim]` |
| <b>.attn.pattern | attention weights (the normaliser's output) `[batch, heads, q_len, k_len]` |
| <b>.attn.z | each head's context, before the output projection `[batch, len, heads, head_dim]` |
| <b>.attn_out | the self-attention branch's output |
| <b>.resid_mid | after the self-attention residual (post-LN: ln_1's output) |
| <b>.ln_cross.scale, .cross_attn.q/k/v/pattern/z, .cross_attn_out, .resid_mid_cross | the cross-attention branch, as the four above (decoder blocks only; k, v `[batch, kv_heads, src_len, head_dim]`, pattern `[batch, heads, tgt_len, src_len]`) |
| <b>.ln2.scale | ln_2 (pre-LN: of resid_mid; post-LN: of resid_mid + mlp_out); not without an MLP |
| <b>.mlp_out | the MLP branch's output (not without an MLP) |
| <b>.resid_post | the block's output (post-LN: ln_2's output) |

So resid_mid / resid_mid_cross / resid_post are what the next branch reads in either LayerNorm
placement; BERT and `norm_position="post"` Transformers are post-LN, GPT pre-LN.

Family sites around the blocks:

| family | name | produced |
|---|---|---|
| gpt | embed | token + position embeddings (after dropout) |
| gpt | ln_final.scale, resid_final | the final LayerNorm's 1 / std and output (what the unembedding reads) |
| bert | embed | token + position embeddings |
| bert | embed.segment | segment (token type) embeddings |
| bert | embed.ln.scale | the embedding LayerNorm's 1 / std of embed + embed.segment (its output is blocks.0.resid_pre) |
| bert | ln_final.scale, resid_final | the final LayerNorm (pre-LN encoders only; post-LN: the last resid_post is the output) |
| bert | pooled | the pooler's tanh output on [CLS] `[batch, d_model]` (no positions axis) |
| transformer | encoder.embed, decoder.embed | source / target embeddings `[batch, src_len or tgt_len, d_model]` |
| transformer | encoder.blocks.{i}.*, decoder.blocks.{i}.* | the block sites; the decoder's self-attention `attn.*`, its cross-attention `cross_attn.*` |
| transformer | encoder.ln_final.scale, encoder.resid_final, decoder.ln_final.scale, decoder.resid_final | the final LayerNorms (pre-LN only) |
| seq2seq | encoder.embed | source embeddings `[batch, src_len, embed_dim]` |
| seq2seq | encoder.states | the top encoder layer's states `[batch, src_len, enc_dim]` (what the attention reads) |
| seq2seq | decoder.embed | target embeddings `[batch, tgt_len, embed_dim]` |
| seq2seq | attn.pattern | each step's attention weights `[batch, tgt_len, src_len]` (not with attention=none) |
| seq2seq | attn.context | each step's context vector `[batch, tgt_len, enc_dim]` (not with attention=none) |
| seq2seq | decoder.states | the top decoder cell's new state h_t `[batch, tgt_len, hidden_dim]` |
| seq2seq | decoder.features | what the output layer reads `[batch, tgt_len, out_dim]` ([h; c] for Bahdanau, Luong's attentional state) |
| rnn_classifier | encoder.embed | token embeddings `[batch, len, embed_dim]` |
| rnn_classifier | encoder.states | the top recurrent layer's states `[batch, len, enc_dim]` (what the pooling reads) |
| rnn_classifier | pooling.pattern | attention pooling's weights over the tokens `[batch, len]` (pooling=attention only; masks select tokens; an edited pattern pools sum_t pattern_t h_t) |
| rnn_classifier | pooled | the pooled vector, what the classifier reads `[batch, enc_dim]` (no positions axis) |

The seq2seq decoder's sites live inside its scan over steps: an edit at step t reaches every
later step through the recurrence (Bahdanau: pattern, context, then the cell; Luong: the cell,
then pattern and context), and op "mean" there needs its value. An edited `pattern` makes the
context `pattern @ values` in every family. Sites act on the teacher-forced forward pass of the
encoder-decoder models (their step-by-step decoders run without them); GPT's generation takes
interventions at every step, with or without the KV cache (`generate_with_hooks`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from attnlab.layers import hooks as hooks_lib
from attnlab.layers.hooks import OPS, Intervention

__all__ = ["FAMILIES", "Intervention", "OPS", "SITES", "Site", "family", "generate_with_hooks",
           "model_inputs", "patch_sweep", "run_with_cache", "run_with_hooks", "sites"]

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Site:
  """One activation site of a model."""
  # Public name, e.g. "blocks.0.attn.z".
  name: str
  # Where the model produces it: "<module path>/<local name>" (attnlab.layers.hooks.site_key).
  key: str
  # Its shape, in words.
  shape: str
  # What it is.
  doc: str
  # Axis of the positions (queries, for a pattern) that an intervention's mask selects.
  positions_axis: int | None = 1
  # Axis of the heads that an intervention's mask selects (None: the site has no heads).
  heads_axis: int | None = None


# A row of a family's table: (name, key, shape, doc, positions axis, heads axis, requires);
# "{i}" in the name and key is the block index, `requires` the features of the model the site
# needs (`_features`: "mlp", "pre_ln", "post_ln", "final_ln", "bahdanau", "luong", "attention";
# () = always), so each model gets exactly the sites its forward pass has.
Row = tuple[str, str, str, str, "int | None", "int | None", tuple[str, ...]]


def _resid(length: str) -> str:
  return f"[batch, {length}, d_model]"


def _scale(length: str) -> str:
  return f"[batch, {length}, 1]"


def _attention_rows(name: str, key: str, q_len: str, k_len: str, what: str) -> tuple[Row, ...]:
  """The q/k/v/pattern/z sites of one MultiHeadAttention `key` under the public `name`."""
  return (
      (f"{name}.q", f"{key}/q", f"[batch, heads, {q_len}, head_dim]",
       f"{what} queries, after rotary", 2, 1, ()),
      (f"{name}.k", f"{key}/k", f"[batch, kv_heads, {k_len}, head_dim]",
       f"{what} keys, after rotary (per kv head under grouped-query attention)", 2, 1, ()),
      (f"{name}.v", f"{key}/v", f"[batch, kv_heads, {k_len}, head_dim]",
       f"{what} values (per kv head under grouped-query attention)", 2, 1, ()),
      (f"{name}.pattern", f"{key}/pattern",
       "[batch, heads, q_len, k_len]" if q_len == k_len == "len" else
       f"[batch, heads, {q_len}, {k_len}]",
       f"{what} weights (the normaliser's output)", 2, 1, ()),
      (f"{name}.z", f"{key}/z", f"[batch, {q_len}, heads, head_dim]",
       f"{what}: each head's context, before the output projection", 1, 2, ()),
  )


def _norm_rows(name: str, key: str, length: str, pre_doc: str, post_doc: str, place: str,
               extra: tuple[str, ...] = ()) -> tuple[Row, ...]:
  """A block LayerNorm's scale site, placed where the pre-LN (place "pre") or post-LN ("post")
  forward pass computes it."""
  doc = pre_doc if place == "pre" else post_doc
  return ((name, key, _scale(length), doc, 1, None, (f"{place}_ln",) + extra),)


def _block_rows(name: str, key: str, length: str = "len", *, cross: bool = False) -> tuple[Row, ...]:
  """The sites of one TransformerBlock (attnlab.layers.transformer), forward order for either
  LayerNorm placement: public names under `name` ("blocks.{i}"), keys under `key` ("block_{i}")."""
  resid = _resid(length)
  rows: list[Row] = [(f"{name}.resid_pre", f"{key}/resid_pre", resid, "the block's input", 1,
                      None, ())]
  ln1 = lambda place: _norm_rows(f"{name}.ln1.scale", f"{key}/ln_1/scale", length,
                                 "ln_1's per-token 1 / std of resid_pre",
                                 "ln_1's per-token 1 / std of resid_pre + attn_out", place)
  rows += ln1("pre")
  rows += _attention_rows(f"{name}.attn", f"{key}/self_attention", length, length,
                          "self-attention" + (" (causal)" if cross else ""))
  rows += [(f"{name}.attn_out", f"{key}/attn_out", resid, "the self-attention branch's output",
            1, None, ())]
  rows += ln1("post")
  rows += [(f"{name}.resid_mid", f"{key}/resid_mid", resid,
            "after the self-attention residual (post-LN: ln_1's output)", 1, None, ())]
  if cross:
    lnc = lambda place: _norm_rows(f"{name}.ln_cross.scale", f"{key}/ln_cross/scale", length,
                                   "ln_cross's per-token 1 / std of resid_mid",
                                   "ln_cross's per-token 1 / std of resid_mid + cross_attn_out",
                                   place)
    rows += lnc("pre")
    rows += _attention_rows(f"{name}.cross_attn", f"{key}/cross_attention", length, "src_len",
                            "cross-attention")
    rows += [(f"{name}.cross_attn_out", f"{key}/cross_attn_out", resid,
              "the cross-attention branch's output", 1, None, ())]
    rows += lnc("post")
    rows += [(f"{name}.resid_mid_cross", f"{key}/resid_mid_cross", resid,
              "after the cross-attention residual (post-LN: ln_cross's output)", 1, None, ())]
  ln2 = lambda place: _norm_rows(f"{name}.ln2.scale", f"{key}/ln_2/scale", length,
                                 "ln_2's per-token 1 / std of the MLP's input",
                                 "ln_2's per-token 1 / std of the residual + mlp_out", place,
                                 ("mlp",))
  rows += ln2("pre")
  rows += [(f"{name}.mlp_out", f"{key}/mlp_out", resid, "the MLP branch's output", 1, None,
            ("mlp",))]
  rows += ln2("post")
  rows += [(f"{name}.resid_post", f"{key}/resid_post", resid,
            "the block's output (post-LN: ln_2's output)", 1, None, ())]
  return tuple(rows)


_RESID = _resid("len")
_SCALE = _scale("len")
# Each family's sites, in forward order (`Row`). BERT's keys are relative to its encoder
# (prefixed "encoder/" in BertForPretraining and BertForClassification).
SITES: dict[str, tuple[Row, ...]] = {
    # attnlab.models.gpt.GPT (pre-LN).
    "gpt": (
        ("embed", "embedded", _RESID, "token + position embeddings (after dropout)", 1, None, ()),
        *_block_rows("blocks.{i}", "block_{i}"),
        ("ln_final.scale", "ln_f/scale", _SCALE, "the final LayerNorm's per-token 1 / std", 1,
         None, ()),
        ("resid_final", "resid_final", _RESID,
         "the final LayerNorm's output, what the unembedding reads", 1, None, ()),
    ),
    # attnlab.models.bert (post-LN by default).
    "bert": (
        ("embed", "embedded", _RESID, "token + position embeddings", 1, None, ()),
        ("embed.segment", "segment_embedded", _RESID, "segment (token type) embeddings", 1, None,
         ()),
        ("embed.ln.scale", "embed_norm/scale", _SCALE,
         "the embedding LayerNorm's per-token 1 / std of embed + embed.segment", 1, None, ()),
        *_block_rows("blocks.{i}", "block_{i}"),
        ("ln_final.scale", "final_norm/scale", _SCALE,
         "the final LayerNorm's per-token 1 / std (pre-LN only)", 1, None, ("final_ln",)),
        ("resid_final", "resid_final", _RESID, "the final LayerNorm's output (pre-LN only)", 1,
         None, ("final_ln",)),
        ("pooled", "pooled", "[batch, d_model]", "the pooler's tanh output on [CLS]", None, None,
         ()),
    ),
    # attnlab.models.transformer.Transformer (pre-LN by default, post-LN with norm_position).
    "transformer": (
        ("encoder.embed", "encoder_embedded", _resid("src_len"),
         "source token + position embeddings (after dropout)", 1, None, ()),
        *_block_rows("encoder.blocks.{i}", "encoder_layer_{i}", "src_len"),
        ("encoder.ln_final.scale", "encoder_norm/scale", _scale("src_len"),
         "the encoder's final LayerNorm's per-token 1 / std (pre-LN only)", 1, None,
         ("final_ln",)),
        ("encoder.resid_final", "encoder_final", _resid("src_len"),
         "the encoder's output (its final LayerNorm's; pre-LN only)", 1, None, ("final_ln",)),
        ("decoder.embed", "decoder_embedded", _resid("tgt_len"),
         "target token + position embeddings (after dropout)", 1, None, ()),
        *_block_rows("decoder.blocks.{i}", "decoder_layer_{i}", "tgt_len", cross=True),
        ("decoder.ln_final.scale", "decoder_norm/scale", _scale("tgt_len"),
         "the decoder's final LayerNorm's per-token 1 / std (pre-LN only)", 1, None,
         ("final_ln",)),
        ("decoder.resid_final", "decoder_final", _resid("tgt_len"),
         "the decoder's final LayerNorm's output, what the output layer reads (pre-LN only)", 1,
         None, ("final_ln",)),
    ),
    # attnlab.models.seq2seq.Seq2Seq: the decoder's sites are per step, stacked over the steps.
    "seq2seq": (
        ("encoder.embed", "encoder/embedded", "[batch, src_len, embed_dim]",
         "source embeddings (after dropout)", 1, None, ()),
        ("encoder.states", "encoder/states", "[batch, src_len, enc_dim]",
         "the top encoder layer's states, what the attention reads", 1, None, ()),
        ("decoder.embed", "decoder_embedded", "[batch, tgt_len, embed_dim]",
         "target embeddings (after dropout)", 1, None, ()),
        ("attn.pattern", "attn_pattern", "[batch, tgt_len, src_len]",
         "each step's attention weights (from the previous state)", 1, None, ("bahdanau",)),
        ("attn.context", "attn_context", "[batch, tgt_len, enc_dim]",
         "each step's context vector (the cell's input with the embedding)", 1, None,
         ("bahdanau",)),
        ("decoder.states", "decoder_states", "[batch, tgt_len, hidden_dim]",
         "the top decoder cell's new state h_t (its output and next carry)", 1, None, ()),
        ("attn.pattern", "attn_pattern", "[batch, tgt_len, src_len]",
         "each step's attention weights (from the new state)", 1, None, ("luong",)),
        ("attn.context", "attn_context", "[batch, tgt_len, enc_dim]",
         "each step's context vector", 1, None, ("luong",)),
        ("decoder.features", "decoder_features", "[batch, tgt_len, out_dim]",
         "what the output layer reads ([h; context] for Bahdanau, the attentional state for "
         "Luong)", 1, None, ()),
    ),
    # attnlab.models.rnn_classifier.RNNClassifier.
    "rnn_classifier": (
        ("encoder.embed", "encoder/embedded", "[batch, len, embed_dim]",
         "token embeddings (after dropout)", 1, None, ()),
        ("encoder.states", "encoder/states", "[batch, len, enc_dim]",
         "the top recurrent layer's states, what the pooling reads", 1, None, ()),
        ("pooling.pattern", "pooling/pattern", "[batch, len]",
         "attention pooling's weights over the tokens", 1, None, ("attention",)),
        ("pooled", "pooled", "[batch, enc_dim]", "the pooled vector, what the classifier reads",
         None, None, ()),
    ),
}
# Families with hook sites.
FAMILIES: tuple[str, ...] = tuple(SITES)


def family(model: Any) -> str:
  """The family of `model` ("gpt", "bert", "transformer", "seq2seq", "rnn_classifier");
  ValueError otherwise."""
  # pylint: disable=g-import-not-at-top
  from attnlab.models import bert, gpt, rnn_classifier, seq2seq, transformer
  for name, kind in (("gpt", gpt.GPT), ("bert", bert.BertHyperparameters),
                     ("transformer", transformer.Transformer), ("seq2seq", seq2seq.Seq2Seq),
                     ("rnn_classifier", rnn_classifier.RNNClassifier)):
    if isinstance(model, kind):
      return name
  raise ValueError(f"hook sites are declared for the GPT, BERT, Transformer, RNN seq2seq and "
                   f"RNN classifier models ({', '.join(FAMILIES)}); got a "
                   f"{type(model).__name__}")


def _features(model: Any, kind: str) -> set[str]:
  """What the model's forward pass has, for the rows' `requires`."""
  if kind == "seq2seq":
    return {model.attention} | ({"attention"} if model.attention != "none" else set())
  if kind == "rnn_classifier":
    return {model.pooling}
  mlp = model.mlp_ratio if kind == "gpt" else model.mlp_dim
  placement = "pre" if kind == "gpt" else model.norm_position
  out = {f"{placement}_ln"} | ({"mlp"} if mlp else set())
  if placement == "pre" and kind != "gpt":
    out.add("final_ln")
  return out


def _layers(model: Any, name: str) -> int:
  """Blocks of the stack a "{i}" name belongs to."""
  return model.decoder_depth if name.startswith("decoder.") else model.num_layers


def _key_prefix(model: Any, kind: str) -> str:
  if kind == "bert":
    from attnlab.models import bert  # pylint: disable=g-import-not-at-top
    return "" if isinstance(model, bert.BertEncoder) else "encoder/"
  return ""


@functools.lru_cache(maxsize=64)
def sites(model: Any) -> dict[str, Site]:
  """{public name: Site} of `model` in forward order: its family's table, each run of "{i}"
  rows expanded per block of its stack, the rows whose `requires` the model lacks left out
  (e.g. an attention-only GPT has no ln2/mlp sites, a pre-LN BERT has a final LayerNorm)."""
  kind = family(model)
  have = _features(model, kind)
  prefix = _key_prefix(model, kind)
  rows = [row for row in SITES[kind] if set(row[6]) <= have]
  out: dict[str, Site] = {}

  def add(row, **fmt):
    name, key, shape, doc, pos, heads, _ = row
    out[name.format(**fmt)] = Site(name.format(**fmt), prefix + key.format(**fmt), shape, doc,
                                   pos, heads)

  stack = lambda row: row[0].split("{i}")[0] if "{i}" in row[0] else None
  i = 0
  while i < len(rows):
    group = stack(rows[i])
    if group is None:
      add(rows[i])
      i += 1
      continue
    j = i
    while j < len(rows) and stack(rows[j]) == group:
      j += 1
    for layer in range(_layers(model, rows[i][0])):
      for row in rows[i:j]:
        add(row, i=layer)
    i = j
  return out


def _unpack(run: Any) -> tuple[Any, Any]:
  if isinstance(run, (tuple, list)) and len(run) == 2:
    return run[0], run[1]
  if getattr(run, "model", None) is None:
    raise ValueError("run must be a loaded run (analysis.load_run) with a Flax model, or a "
                     "(model, params) pair")
  return run.model, run.params


def _site(table: Mapping[str, Site], name: str) -> Site:
  if name not in table:
    close = difflib.get_close_matches(name, list(table), n=3)
    raise ValueError(f"unknown hook site {name!r}"
                     + (f"; did you mean {', '.join(close)}?" if close else
                        f"; sites: {', '.join(list(table)[:8])}, ..."))
  return table[name]


def select(model: Any, names: None | str | Iterable[str] | Callable[[str], bool]) -> list[str]:
  """The site names `names` selects, in forward order: None = every site, a name, a list of
  names, or a predicate on the name."""
  table = sites(model)
  if names is None:
    return list(table)
  if callable(names):
    return [n for n in table if names(n)]
  if isinstance(names, str):
    names = [names]
  wanted = {_site(table, n).name for n in names}
  return [n for n in table if n in wanted]


def intervention_tree(model: Any, interventions: Intervention | Sequence[Intervention]
                      ) -> dict[str, Any]:
  """The "interventions" collection of `interventions` (applied in the given order per site)."""
  if isinstance(interventions, Intervention):
    interventions = [interventions]
  table = sites(model)
  grouped: dict[tuple[str, ...], tuple[Intervention, ...]] = {}
  for iv in interventions:
    if not isinstance(iv, Intervention):
      raise TypeError(f"interventions must be Intervention objects, got {type(iv).__name__}")
    key = tuple(_site(table, iv.site).key.split("/"))
    grouped[key] = grouped.get(key, ()) + (iv,)
  return traverse_util.unflatten_dict(grouped)


# ------------------------------------------------------------------------------ inputs, forward


def _arguments(model: Any) -> tuple[list[str], int]:
  """(names of the model's positional arguments, how many are required)."""
  params = [p for p in inspect.signature(type(model).__call__).parameters.values()
            if p.kind == p.POSITIONAL_OR_KEYWORD][1:]  # without self
  return [p.name for p in params], sum(p.default is p.empty for p in params)


def _last_nonzero(ids: np.ndarray) -> np.ndarray:
  """Lengths `[batch]` of 0-padded rows (up to the last nonzero id)."""
  nonzero = ids != 0
  return np.where(nonzero.any(1), ids.shape[1] - np.argmax(nonzero[:, ::-1], axis=1),
                  0).astype(np.int32)


def model_inputs(model: Any, inputs: Any) -> tuple[Any, ...]:
  """The model's positional arguments from `inputs`: one array (the first argument), a tuple
  (the positional arguments) or a dict (them by name; an encoder-decoder's src_lengths may be
  left out: each source row up to its last nonzero id). Module docstring, per family."""
  names, required = _arguments(model)
  if isinstance(inputs, Mapping):
    unknown = sorted(set(inputs) - set(names))
    if unknown:
      raise ValueError(f"unknown input {', '.join(map(repr, unknown))} for a "
                       f"{type(model).__name__}; its inputs: {', '.join(names)}")
    given = dict(inputs)
    if "src_lengths" in names and "src_lengths" not in given and "src" in given:
      given["src_lengths"] = _last_nonzero(np.asarray(given["src"]))
    missing = [n for n in names[:required] if n not in given]
    if missing:
      raise ValueError(f"a {type(model).__name__} needs the input(s) {', '.join(missing)} "
                       f"(its inputs: {', '.join(names)})")
    args = [given.get(n) for n in names]
    while args and args[-1] is None:
      args.pop()
  elif isinstance(inputs, tuple):
    args = list(inputs)
    if not required <= len(args) <= len(names):
      raise ValueError(f"a {type(model).__name__} takes {required} to {len(names)} positional "
                       f"inputs ({', '.join(names)}), got {len(args)}; or pass them as a dict")
  else:
    if required > 1:
      raise ValueError(f"a {type(model).__name__} takes the inputs ({', '.join(names)}): pass "
                       f"them as a tuple or a dict, not one array")
    args = [inputs]
  return tuple(None if a is None else jnp.asarray(a) for a in args)


def _output(model: Any, out: Any) -> Any:
  """What a metric reads: the encoder-decoders' logits without their aux dict."""
  return out[0] if family(model) in ("transformer", "seq2seq") else out


def _apply(model: Any, params: Any, inputs: Any, tree: Mapping[str, Any],
           names: Sequence[str]) -> tuple[Any, dict[str, Array]]:
  """The traced forward pass: (output, {name: value}) with `tree` applied and `names` sown;
  `inputs` the model's positional arguments (a tuple; one array = the first)."""
  args = inputs if isinstance(inputs, tuple) else (inputs,)
  variables = {"params": params}
  if tree:
    variables["interventions"] = tree
  if not names:
    return _output(model, model.apply(variables, *args)), {}
  table = sites(model)
  with hooks_lib.capturing([table[n].key for n in names]):
    out, state = model.apply(variables, *args, mutable=[hooks_lib.HOOKS])
  flat = traverse_util.flatten_dict(state.get(hooks_lib.HOOKS, {}), sep="/")
  return _output(model, out), {n: flat[table[n].key][-1] for n in names}


@functools.lru_cache(maxsize=64)
def _compiled(model: Any, names: tuple[str, ...]) -> Callable[..., Any]:
  return jax.jit(functools.partial(_apply, model, names=names))


def run_with_cache(run: Any, inputs: Any,
                   names: None | str | Iterable[str] | Callable[[str], bool] = None, *,
                   interventions: Intervention | Sequence[Intervention] = ()
                   ) -> tuple[Any, dict[str, Array]]:
  """(output, {site name: its value in this forward pass}) of the sites `names` selects (None:
  all; a list; a predicate on the name), jit-compiled once per model and selection. `inputs`
  and the output per family: module docstring (GPT: tokens -> logits `[batch, len, vocab]`).
  With `interventions`, the cached values are those after them (what flows on)."""
  model, params = _unpack(run)
  chosen = tuple(select(model, names))
  tree = intervention_tree(model, interventions)
  out, cache = _compiled(model, chosen)(params, model_inputs(model, inputs), tree)
  return out, {n: cache[n] for n in chosen}  # forward order (jit returns sorted keys)


def run_with_hooks(run: Any, inputs: Any,
                   interventions: Intervention | Sequence[Intervention]) -> Any:
  """The output (GPT: logits `[batch, len, vocab]`) with `interventions` applied (one compiled
  program for every value and mask of the same sites and ops)."""
  model, params = _unpack(run)
  tree = intervention_tree(model, interventions)
  return _compiled(model, ())(params, model_inputs(model, inputs), tree)[0]


# ---------------------------------------------------------------------------------- patching

# What a patch_sweep varies besides the layer -> the result's axes after [layers].
OVER = ("position", "head", "position_head")


def sweep_sites(model: Any, site: str) -> list[str]:
  """The sites a patch_sweep of `site` patches, one per layer: "resid_pre" -> blocks.{i}.resid_pre
  (GPT, BERT), "decoder.cross_attn.z" -> decoder.blocks.{i}.cross_attn.z (Transformer: the stack
  first), a template with "{i}", or one site outright ("embed", the seq2seq's "attn.context": one
  layer)."""
  table = sites(model)
  if "{i}" not in site:
    if site in table:
      return [site]
    stack, _, rest = site.partition(".")
    if stack in ("encoder", "decoder") and f"{stack}.blocks.0.resid_pre" in table:
      site = f"{stack}.blocks.{{i}}.{rest}"
    else:
      site = f"blocks.{{i}}.{site}"
  return [_site(table, site.format(i=l)).name for l in range(_layers(model, site))]


def patch_sweep(run: Any, clean: Any, corrupted: Any, metric: Callable[[Any], Array], *,
                site: str = "resid_pre", over: str = "position",
                batch_size: int | None = None) -> np.ndarray:
  """Activation patching, clean -> corrupted: `metric(output)` of the corrupted run with the
  site `blocks.{l}.<site>` (per layer l) replaced by its clean value in one cell at a time.

  Args:
    run: a loaded run or a (model, params) pair.
    clean, corrupted: inputs of the same shapes (module docstring; GPT: token ids
      `[batch, len]`).
    metric: the model's output (GPT: logits `[batch, len, vocab]`) -> a scalar (e.g. a mean
      logit difference); traced.
    site: the per-block site after "blocks.{l}.": resid_pre, resid_mid, resid_post, attn_out,
      mlp_out, attn.q, attn.k, attn.v, attn.pattern, attn.z, ...; for the Transformer its stack
      first ("encoder.resid_pre", "decoder.cross_attn.z"); a name with "{i}"; or a site outside
      the blocks (one layer), e.g. the seq2seq's "attn.context" (`sweep_sites`).
    over: the cells, besides the layer: "position" (every position, all heads), "head" (every
      head, all positions) or "position_head".
    batch_size: cells run at once (a vmap over them; jax.lax.map over the chunks of a layer's
      cells). None: on a CPU, chunks of about `CPU_CHUNK_TOKENS` tokens (cells x batch x len;
      XLA:CPU runs one wide vmap at half the speed of small chunks), elsewhere a layer's cells
      in one vmap.
  Returns:
    `[layers, len]`, `[layers, heads]` or `[layers, len, heads]` numpy metric values (heads: kv
    heads for attn.k/v; len: the site's positions, e.g. the source for encoder sites). One
    compiled program runs every cell: per layer, a vmap over its cells' masks, each cell's
    forward pass starting from the corrupted run's input to that layer's block (the blocks
    below are not run again; `_sweep_fn`). Normalise as you like, e.g.
    (grid - metric(corrupted)) / (metric(clean) - metric(corrupted)).
  """
  if over not in OVER:
    raise ValueError(f"unknown over={over!r}; valid: {', '.join(OVER)}")
  model, params = _unpack(run)
  table = sites(model)
  names = sweep_sites(model, site)
  info = table[names[0]]
  clean, corrupted = model_inputs(model, clean), model_inputs(model, corrupted)
  shapes = lambda args: jax.tree.map(lambda a: a.shape, args)
  if shapes(clean) != shapes(corrupted):
    raise ValueError(f"clean {shapes(clean)} and corrupted {shapes(corrupted)} inputs must have "
                     "the same shapes")
  if info.positions_axis is None:
    raise ValueError(f"site {site!r} has no positions axis to sweep; patch it whole with "
                     "run_with_hooks")
  _, cache = run_with_cache((model, params), clean, names)
  shape = cache[names[0]].shape
  layers = len(names)
  length = shape[info.positions_axis]
  by_head = over != "position"
  if by_head and info.heads_axis is None:
    raise ValueError(f"site {site!r} has no heads; use over='position'")
  heads = shape[info.heads_axis] if by_head else 1
  by_position = over != "head"
  grid = (layers, length if by_position else 1, heads)
  # The cells of one layer, position-major: [cells per layer, 2] (position, head)
  cells = np.stack(np.meshgrid(np.arange(grid[1]), np.arange(grid[2]), indexing="ij"),
                   -1).reshape(-1, 2)
  eye = lambda n, i: np.arange(n)[None, :] == np.asarray(i)[:, None]  # [cells, n]
  positions = eye(length, cells[:, 0]) if by_position else np.ones((len(cells), length), bool)
  head_masks = eye(heads, cells[:, 1]) if by_head else None  # [cells, heads]
  masks = (jnp.asarray(positions), None if head_masks is None else jnp.asarray(head_masks))
  # The corrupted run's input of each patched block (what every cell of that layer sees there)
  starts = tuple(_block_input(table, n) for n in names)
  wanted = sorted({s for s in starts if s is not None})
  _, inputs = run_with_cache((model, params), corrupted, wanted) if wanted else (None, {})
  if batch_size is None:
    batch_size = _chunk(len(cells), _tokens(corrupted))
  sweep = _sweep_fn(model, tuple(names), starts, metric, min(batch_size, len(cells)))
  values = np.asarray(sweep(params, corrupted, cache, inputs, masks))  # [layers, cells]
  return values.reshape(grid if by_head and by_position else
                        (layers, heads) if by_head else (layers, length))


# Tokens a patch_sweep runs at once on a CPU (batch_size=None): the nano GPT's resid_pre sweep
# (batch 12 x 64) ran 2x faster in chunks of 1-4 cells than in one vmap of a layer's 64 cells.
CPU_CHUNK_TOKENS = 2048


def _tokens(inputs: tuple[Any, ...]) -> int:
  """Tokens of one forward pass: the size of the first input (`[batch, len]` ids)."""
  return max(1, int(np.prod(inputs[0].shape)))


def _chunk(cells: int, tokens: int) -> int:
  """Cells per chunk for batch_size=None: all of a layer's off a CPU; on a CPU the largest
  divisor of `cells` whose chunk holds at most CPU_CHUNK_TOKENS tokens (at least one cell)."""
  if jax.default_backend() != "cpu":
    return cells
  most = max(1, CPU_CHUNK_TOKENS // tokens)
  return max(n for n in range(1, min(most, cells) + 1) if cells % n == 0)


def _block_input(table: Mapping[str, Site], name: str) -> str | None:
  """The resid_pre site of the block that holds `name` ("decoder.blocks.2.cross_attn.z" ->
  "decoder.blocks.2.resid_pre"), None for a site outside the blocks."""
  head, sep, rest = name.rpartition("blocks.")
  index = rest.split(".", 1)[0]
  start = f"{head}{sep}{index}.resid_pre"
  return start if sep and index.isdigit() and start in table else None


@functools.lru_cache(maxsize=32)
def _sweep_fn(model: Any, names: tuple[str, ...], starts: tuple[str | None, ...],
              metric: Callable[[Any], Array], batch_size: int) -> Callable[..., Array]:
  """The jitted sweep (params, corrupted inputs, clean cache, corrupted block inputs, one
  layer's cell masks) -> metric `[layers, cells]`: per layer l, one forward pass vmapped over
  the cells with the site `names[l]` replaced at the cell's mask (compiled once per model,
  sites, metric and batch_size; a new metric object compiles anew).

  Below layer l every cell of layer l computes the corrupted run itself, so its forward pass
  takes block l's input (`starts[l]`, its resid_pre) whole from the corrupted run's cache: the
  blocks before it are then dead code that XLA drops, and layer l's cells run only blocks
  l .. L-1 (12 cells, one per layer of a 12-layer model, run 78 blocks, not 144). Exact: the
  replaced value is what those blocks compute."""
  def sweep(params, corrupted, cache, inputs, masks):
    rows = []
    for name, start in zip(names, starts):
      def one(masks, name=name, start=start):
        pos, head = masks  # [len], [heads] or None
        ivs = [] if start is None else [Intervention(start, "replace", inputs[start])]
        ivs.append(Intervention(name, "replace", cache[name], positions=pos, heads=head))
        out, _ = _apply(model, params, corrupted, intervention_tree(model, ivs), ())
        return metric(out)
      if batch_size >= len(masks[0]):
        rows.append(jax.vmap(one)(masks))
      else:
        rows.append(jax.lax.map(one, masks, batch_size=batch_size))
    return jnp.stack(rows)
  return jax.jit(sweep)


# -------------------------------------------------------------------------------- generation


def _check_for_generation(table: Mapping[str, Site], iv: Intervention) -> None:
  """ValueError unless `iv` means the same at every decoding step as in a full forward pass: no
  position mask, a value that broadcasts over the positions, no batch mean; on a pattern only
  zero or scale (the cache's keys are not the full pass's)."""
  site = _site(table, iv.site)
  where = f"intervention {iv.op!r} at {iv.site!r} during generation"
  if iv.positions is not None:
    raise ValueError(f"{where}: generation edits every position (the prompt's and each new "
                     "token's); leave positions out")
  if iv.op == "mean" and iv.value is None:
    raise ValueError(f"{where}: a step sees one position; give the mean as its value (e.g. "
                     "from run_with_cache)")
  if site.name.endswith("pattern") and iv.op not in ("zero", "scale"):
    raise ValueError(f"{where}: a pattern's keys differ between the KV cache and the full pass; "
                     "only 'zero' and 'scale' edit it the same way")
  if iv.value is not None and site.positions_axis is not None:
    ndim = len(site.shape.strip("[]").split(", "))
    axis = site.positions_axis - (ndim - np.ndim(iv.value))
    if axis >= 0 and np.shape(iv.value)[axis] != 1:
      raise ValueError(f"{where}: its value has {np.shape(iv.value)[axis]} positions; give one "
                       f"that broadcasts over them (size 1 or absent on axis "
                       f"{site.positions_axis} of {site.shape})")


def generate_with_hooks(run: Any, prompt: Any,
                        interventions: Intervention | Sequence[Intervention], *,
                        num_tokens: int, rng: Array | None = None, **kwargs: Any) -> Any:
  """A GPT run's `attnlab.models.gpt.generate` with `interventions` applied at every step: to
  the prompt's forward pass and to each generated token's, with the KV cache (each cached key
  and value is the edited one, so later steps read the edit too) or without it (every step's
  full forward pass). Greedy, the two give the tokens of a loop of full forward passes with
  the same interventions (tests/test_hooks_families.py).

  The interventions must mean the same at every step (`_check_for_generation`): no position
  masks, values that broadcast over the positions (e.g. a head's `heads=` mask, a steering
  vector `[d_model]`), `mean` with its value, only `zero` / `scale` on a pattern.
  kwargs: generate's (temperature, top_k, top_p, use_cache, keep, end_id, banned_ids);
  rng: the sampling key (default key 0). Returns attnlab.decoding.Decoded.
  """
  from attnlab.models import gpt  # pylint: disable=g-import-not-at-top
  model, params = _unpack(run)
  if family(model) != "gpt":
    raise ValueError(f"generate_with_hooks runs a GPT; got a {type(model).__name__}")
  if isinstance(interventions, Intervention):
    interventions = [interventions]
  table = sites(model)
  for iv in interventions:
    _check_for_generation(table, iv)
  tree = intervention_tree(model, interventions)
  rng = jax.random.key(0) if rng is None else rng
  return gpt.generate(model, params, prompt, rng, num_tokens=num_tokens, interventions=tree,
                      **kwargs)
