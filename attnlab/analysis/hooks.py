"""Hook sites of a model family, caching and interventions on the live forward pass, patching.

  from attnlab.analysis import hooks
  logits, cache = hooks.run_with_cache(run, tokens)                     # every site
  logits, cache = hooks.run_with_cache(run, tokens, ["blocks.0.attn.pattern"])
  logits, cache = hooks.run_with_cache(run, tokens, lambda name: name.endswith("resid_post"))
  iv = hooks.Intervention("blocks.1.attn.z", "zero", heads=np.eye(4, dtype=bool)[2])
  logits = hooks.run_with_hooks(run, tokens, [iv])                     # head 1.2 zeroed
  grid = hooks.patch_sweep(run, clean, corrupted, metric, site="resid_pre", over="position")

`run` is a loaded run (attnlab.analysis.load_run) or a `(model, params)` pair. Sites are declared
once per family in a table (`SITES`, `sites(model)`: public name -> where the model produces it,
its shape); the model code marks each with attnlab.layers.hooks.hook, which costs nothing in a
plain forward pass (its program is the same). Cached values are the real activations of the
forward pass (after any interventions given with them), not recomputed; only the sites asked for
are sown (attention forms its weights only when a `pattern` is asked for).

An intervention is data (`Intervention`: site, op, value, position and head masks; a pytree), so
one compiled program serves every value and mask: `patch_sweep` vmaps one forward pass over the
masks of every (layer, position) or (layer, head) cell.

GPT sites (`[batch, len, d_model]` unless noted; i = 0 .. num_layers - 1):

| name | produced | shape |
|---|---|---|
| embed | token + position embeddings (after dropout) | |
| blocks.{i}.resid_pre | block i's input (the residual stream) | |
| blocks.{i}.ln1.scale | ln_1's per-token 1 / std | `[batch, len, 1]` |
| blocks.{i}.attn.q | queries, after rotary | `[batch, heads, len, head_dim]` |
| blocks.{i}.attn.k, .v | keys, values, after rotary, per kv head | `[batch, kv_heads, len, head_dim]` |
| blocks.{i}.attn.pattern | attention weights (the normaliser's output) | `[batch, heads, q_len, k_len]` |
| blocks.{i}.attn.z | each head's context, before the output projection | `[batch, len, heads, head_dim]` |
| blocks.{i}.attn_out | the attention branch's output | |
| blocks.{i}.resid_mid | after the attention residual | |
| blocks.{i}.ln2.scale | ln_2's per-token 1 / std (not without an MLP) | `[batch, len, 1]` |
| blocks.{i}.mlp_out | the MLP branch's output (not without an MLP) | |
| blocks.{i}.resid_post | block i's output | |
| ln_final.scale | the final LayerNorm's per-token 1 / std | `[batch, len, 1]` |
| resid_final | the final LayerNorm's output, what the unembedding reads | |

The `*.scale` sites are the reciprocal standard deviation (TransformerLens's `hook_scale` is the
standard deviation itself). An edited `pattern` makes the head's context weights @ values.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from attnlab.layers import hooks as hooks_lib
from attnlab.layers.hooks import OPS, Intervention

__all__ = ["Intervention", "OPS", "SITES", "Site", "patch_sweep", "run_with_cache",
           "run_with_hooks", "sites"]

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


_RESID = "[batch, len, d_model]"
_SCALE = "[batch, len, 1]"
# The GPT family's sites (attnlab.models.gpt): (name, key, shape, doc, positions axis, heads
# axis, needs an MLP); "{i}" is the block index.
SITES: dict[str, tuple[tuple[str, str, str, str, int | None, int | None, bool], ...]] = {
    "gpt": (
        ("embed", "embedded", _RESID, "token + position embeddings (after dropout)", 1, None,
         False),
        ("blocks.{i}.resid_pre", "block_{i}/resid_pre", _RESID, "block i's input", 1, None,
         False),
        ("blocks.{i}.ln1.scale", "block_{i}/ln_1/scale", _SCALE, "ln_1's per-token 1 / std", 1,
         None, False),
        ("blocks.{i}.attn.q", "block_{i}/self_attention/q", "[batch, heads, len, head_dim]",
         "queries, after rotary", 2, 1, False),
        ("blocks.{i}.attn.k", "block_{i}/self_attention/k", "[batch, kv_heads, len, head_dim]",
         "keys, after rotary (per kv head under grouped-query attention)", 2, 1, False),
        ("blocks.{i}.attn.v", "block_{i}/self_attention/v", "[batch, kv_heads, len, head_dim]",
         "values (per kv head under grouped-query attention)", 2, 1, False),
        ("blocks.{i}.attn.pattern", "block_{i}/self_attention/pattern",
         "[batch, heads, q_len, k_len]", "attention weights (the normaliser's output)", 2, 1,
         False),
        ("blocks.{i}.attn.z", "block_{i}/self_attention/z", "[batch, len, heads, head_dim]",
         "each head's context, before the output projection", 1, 2, False),
        ("blocks.{i}.attn_out", "block_{i}/attn_out", _RESID, "the attention branch's output", 1,
         None, False),
        ("blocks.{i}.resid_mid", "block_{i}/resid_mid", _RESID, "after the attention residual",
         1, None, False),
        ("blocks.{i}.ln2.scale", "block_{i}/ln_2/scale", _SCALE, "ln_2's per-token 1 / std", 1,
         None, True),
        ("blocks.{i}.mlp_out", "block_{i}/mlp_out", _RESID, "the MLP branch's output", 1, None,
         True),
        ("blocks.{i}.resid_post", "block_{i}/resid_post", _RESID, "block i's output", 1, None,
         False),
        ("ln_final.scale", "ln_f/scale", _SCALE, "the final LayerNorm's per-token 1 / std", 1,
         None, False),
        ("resid_final", "resid_final", _RESID,
         "the final LayerNorm's output, what the unembedding reads", 1, None, False),
    ),
}


def _family(model: Any) -> str:
  from attnlab.models import gpt  # pylint: disable=g-import-not-at-top
  if isinstance(model, gpt.GPT):
    return "gpt"
  raise ValueError(f"hook sites are declared for the GPT family only so far (issue #52); got a "
                   f"{type(model).__name__}")


@functools.lru_cache(maxsize=64)
def sites(model: Any) -> dict[str, Site]:
  """{public name: Site} of `model` in forward order (its family's table, expanded per block;
  an attention-only GPT has no ln2/mlp sites)."""
  table = SITES[_family(model)]
  has_mlp = bool(getattr(model, "mlp_ratio", 1))
  out = {}

  def add(row, **fmt):
    name, key, shape, doc, pos, heads, needs_mlp = row
    if needs_mlp and not has_mlp:
      return
    out[name.format(**fmt)] = Site(name.format(**fmt), key.format(**fmt), shape, doc, pos, heads)

  per_block = [row for row in table if "{i}" in row[0]]
  before = [row for row in table[:table.index(per_block[0])]]
  after = [row for row in table[table.index(per_block[-1]) + 1:]]
  for row in before:
    add(row)
  for i in range(model.num_layers):
    for row in per_block:
      add(row, i=i)
  for row in after:
    add(row)
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


def _apply(model: Any, params: Any, tokens: Array, tree: Mapping[str, Any],
           names: Sequence[str]) -> tuple[Array, dict[str, Array]]:
  """The traced forward pass: (logits, {name: value}) with `tree` applied and `names` sown."""
  variables = {"params": params}
  if tree:
    variables["interventions"] = tree
  if not names:
    return model.apply(variables, tokens), {}
  table = sites(model)
  with hooks_lib.capturing([table[n].key for n in names]):
    logits, state = model.apply(variables, tokens, mutable=[hooks_lib.HOOKS])
  flat = traverse_util.flatten_dict(state.get(hooks_lib.HOOKS, {}), sep="/")
  return logits, {n: flat[table[n].key][-1] for n in names}


@functools.lru_cache(maxsize=64)
def _compiled(model: Any, names: tuple[str, ...]) -> Callable[..., Any]:
  return jax.jit(functools.partial(_apply, model, names=names))


def run_with_cache(run: Any, tokens: Any,
                   names: None | str | Iterable[str] | Callable[[str], bool] = None, *,
                   interventions: Intervention | Sequence[Intervention] = ()
                   ) -> tuple[Array, dict[str, Array]]:
  """(logits `[batch, len, vocab]`, {site name: its value in this forward pass}) of the sites
  `names` selects (None: all; a list; a predicate on the name), jit-compiled once per model and
  selection. With `interventions`, the cached values are those after them (what flows on)."""
  model, params = _unpack(run)
  chosen = tuple(select(model, names))
  tree = intervention_tree(model, interventions)
  logits, cache = _compiled(model, chosen)(params, jnp.asarray(tokens), tree)
  return logits, {n: cache[n] for n in chosen}  # forward order (jit returns sorted keys)


def run_with_hooks(run: Any, tokens: Any,
                   interventions: Intervention | Sequence[Intervention]) -> Array:
  """Logits `[batch, len, vocab]` with `interventions` applied (one compiled program for every
  value and mask of the same sites and ops)."""
  model, params = _unpack(run)
  tree = intervention_tree(model, interventions)
  return _compiled(model, ())(params, jnp.asarray(tokens), tree)[0]


# ---------------------------------------------------------------------------------- patching

# What a patch_sweep varies besides the layer -> the result's axes after [layers].
OVER = ("position", "head", "position_head")


def patch_sweep(run: Any, clean: Any, corrupted: Any, metric: Callable[[Array], Array], *,
                site: str = "resid_pre", over: str = "position",
                batch_size: int | None = None) -> np.ndarray:
  """Activation patching, clean -> corrupted: `metric(logits)` of the corrupted run with site
  `blocks.{l}.<site>` replaced by its clean value in one cell at a time.

  Args:
    run: a loaded run or a (model, params) pair.
    clean, corrupted: token ids `[batch, len]` of the same shape.
    metric: logits `[batch, len, vocab]` -> a scalar (e.g. a mean logit difference); traced.
    site: the per-block site after "blocks.{l}.": resid_pre, resid_mid, resid_post, attn_out,
      mlp_out, attn.q, attn.k, attn.v, attn.pattern, attn.z, ...
    over: the cells, besides the layer: "position" (every position, all heads), "head" (every
      head, all positions) or "position_head".
    batch_size: cells run at once (None: all in one vmap; else jax.lax.map in chunks).
  Returns:
    `[layers, len]`, `[layers, heads]` or `[layers, len, heads]` numpy metric values (heads: kv
    heads for attn.k/v). One compiled program runs every cell (a vmap over the cells' masks).
    Normalise as you like, e.g. (grid - metric(corrupted)) / (metric(clean) - metric(corrupted)).
  """
  if over not in OVER:
    raise ValueError(f"unknown over={over!r}; valid: {', '.join(OVER)}")
  model, params = _unpack(run)
  table = sites(model)
  names = [_site(table, f"blocks.{l}.{site}").name for l in range(model.num_layers)]
  info = table[names[0]]
  clean, corrupted = jnp.asarray(clean), jnp.asarray(corrupted)
  if clean.shape != corrupted.shape:
    raise ValueError(f"clean {clean.shape} and corrupted {corrupted.shape} token ids must have "
                     "the same shape")
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
  cells = np.stack(np.meshgrid(*[np.arange(n) for n in grid], indexing="ij"), -1).reshape(-1, 3)
  eye = lambda n, i: np.arange(n)[None, :] == np.asarray(i)[:, None]  # [cells, n]
  # [cells, layers, len]: the cell's positions in its own layer, none elsewhere
  positions = eye(layers, cells[:, 0])[:, :, None] & (
      eye(length, cells[:, 1]) if by_position else np.ones((len(cells), length), bool))[:, None]
  head_masks = eye(heads, cells[:, 2]) if by_head else None  # [cells, heads]

  masks = (jnp.asarray(positions), None if head_masks is None else jnp.asarray(head_masks))
  sweep = _sweep_fn(model, tuple(names), metric, batch_size)
  values = np.asarray(sweep(params, corrupted, cache, masks))
  return values.reshape(grid if by_head and by_position else
                        (layers, heads) if by_head else (layers, length))


@functools.lru_cache(maxsize=32)
def _sweep_fn(model: Any, names: tuple[str, ...], metric: Callable[[Array], Array],
              batch_size: int | None) -> Callable[..., Array]:
  """The jitted sweep (params, corrupted, clean cache, cell masks) -> metric per cell: one
  forward pass with every layer's site replaced at its cell's mask, vmapped over the cells
  (compiled once per model, sites, metric and batch_size; a new metric object compiles anew)."""
  def sweep(params, corrupted, cache, masks):
    def one(masks):
      pos, head = masks  # [layers, len], [heads] or None
      ivs = [Intervention(n, "replace", cache[n], positions=pos[l], heads=head)
             for l, n in enumerate(names)]
      logits, _ = _apply(model, params, corrupted, intervention_tree(model, ivs), ())
      return metric(logits)
    if batch_size is None:
      return jax.vmap(one)(masks)
    return jax.lax.map(one, masks, batch_size=batch_size)
  return jax.jit(sweep)
