"""Logit lens, direct logit attribution and attribution patching of GPT runs (issue #52).

  from attnlab.analysis import lens
  layers = lens.logit_lens(run, tokens)               # [layers + 1, batch, len, vocab]
  dla = lens.logit_attribution(run, tokens)           # components that sum to the logits
  dla.components["blocks.1.attn_out"], dla.heads[1, 2] # [batch, len, vocab] each
  grid = lens.attribution_patch(run, clean, corrupted, metric, site="attn.z", over="head")

Logit lens: the residual stream after each block (`blocks.{i}.resid_post`, and the embeddings as
`blocks.0.resid_pre` first) through the final LayerNorm, its statistics (mean, 1 / std)
recomputed for that residual, then the unembedding. Its last row is the model's logits.

Direct logit attribution: the final LayerNorm is linear in its input once its 1 / std is fixed,
so with the forward pass's own 1 / std (the cached `ln_final.scale` site, r) the logits split into
a sum over what was added to the residual stream:
  logits = sum_c  (c - mean(c)) * r * gamma @ W_U^T  +  beta @ W_U^T
over the components c: the embeddings (`embed`), each block's attention output (`attn_out`) and
MLP output (`mlp_out`); each attention output splits further into its heads (head h's context z_h
through its rows of the output projection, z_h @ W_O[h]) plus the projection's bias. Each
component is centred (its own mean over d_model subtracted: the norm's mean term, distributed),
gamma/beta are the final norm's scale and bias (beta: 0 without biases), W_U the tied token table.

Attribution patching (Nanda 2023, the gradient approximation of activation patching): the metric
after patching a cell of site `blocks.{l}.<site>` with its clean value is approximated to first
order at the corrupted run,
  metric(corrupted) + sum_cell (clean - corrupted) * d metric / d activation |corrupted,
for every cell at once from one forward and one backward pass; `attribution_patch` returns the
same grid as `hooks.patch_sweep` (metric values, not differences), so the two compare directly.
The gradient at a site is that of an `add` intervention of zeros there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.analysis import hooks as hooks_lib
from attnlab.analysis.hooks import Intervention

__all__ = ["LogitAttribution", "attribution_patch", "logit_attribution", "logit_lens"]

Array = jax.Array


def _check(model: Any) -> None:
  if hooks_lib.family(model) != "gpt":  # ValueError for a family without hook sites
    raise ValueError(f"the logit lens and attributions read a GPT (its tied unembedding and "
                     f"final LayerNorm); got a {type(model).__name__}")


def _final_norm(model: Any, params: Any) -> tuple[Array, Array | None]:
  """(gamma `[d]`, beta `[d]` or None) of the final LayerNorm, float32."""
  ln = params["ln_f"]
  beta = ln.get("bias") if model.use_bias else None
  return (jnp.asarray(ln["scale"], jnp.float32),
          None if beta is None else jnp.asarray(beta, jnp.float32))


def _unembedding(params: Any) -> Array:
  return jnp.asarray(params["embed"]["token"]["embedding"], jnp.float32)  # [vocab, d]


def _columns(table: Array, ids: Any) -> Array:
  """The rows of the token table whose logits are wanted (all when ids is None)."""
  return table if ids is None else table[jnp.asarray(ids)]  # [vocab or n, d]


def logit_lens(run: Any, tokens: Any, *, ids: Any = None) -> np.ndarray:
  """`[layers + 1, batch, len, vocab]` float32 logits read from the residual stream before block 0
  (the embeddings) and after each block: each through the final LayerNorm with its statistics
  recomputed for that residual, then the tied unembedding. The last row equals the model's
  logits. `ids`: only these vocabulary columns (the last axis becomes len(ids))."""
  model, params = hooks_lib._unpack(run)  # pylint: disable=protected-access
  _check(model)
  names = ["blocks.0.resid_pre"] + [f"blocks.{i}.resid_post" for i in range(model.num_layers)]
  _, cache = hooks_lib.run_with_cache((model, params), tokens, names)
  gamma, beta = _final_norm(model, params)
  table = _columns(_unembedding(params), ids)
  eps = model.layer_norm_epsilon
  stack = jnp.stack([jnp.asarray(cache[n], jnp.float32) for n in names])  # [L+1, b, len, d]
  return np.asarray(_lens(stack, gamma, beta, table, eps))


@functools.partial(jax.jit, static_argnums=(4,))
def _lens(stack: Array, gamma: Array, beta: Array | None, table: Array, eps: float) -> Array:
  centred = stack - jnp.mean(stack, axis=-1, keepdims=True)  # [L+1, b, len, d]
  r = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)  # [L+1, b, len, 1]
  normed = centred * r * gamma + (0.0 if beta is None else beta)  # [L+1, b, len, d]
  return normed @ table.T  # [L+1, b, len, vocab]


@dataclasses.dataclass(frozen=True)
class LogitAttribution:
  """Direct logit attribution of one forward pass (numpy float32; vocab: len(ids) if given).

  sum(components.values()) + bias == logits; heads[l].sum(0) + head_bias[l] ==
  components[f"blocks.{l}.attn_out"]."""
  # The model's logits `[batch, len, vocab]`.
  logits: np.ndarray
  # {"embed", "blocks.{i}.attn_out", "blocks.{i}.mlp_out" (with an MLP)}: `[batch, len, vocab]`.
  components: dict[str, np.ndarray]
  # Each head's share of its block's attention output `[layers, heads, batch, len, vocab]`.
  heads: np.ndarray
  # The output projection's bias in each block's attention output `[layers, batch, len, vocab]`
  # (zeros without biases).
  head_bias: np.ndarray
  # The final LayerNorm's bias through the unembedding `[vocab]` (zeros without biases).
  bias: np.ndarray


def logit_attribution(run: Any, tokens: Any, *, ids: Any = None) -> LogitAttribution:
  """The logits of `tokens` split into the direct contributions of the embeddings, each block's
  attention and MLP outputs and each head (module docstring), using the final LayerNorm's 1 / std
  cached in the same forward pass (`ln_final.scale`). `ids`: only these vocabulary columns
  (recommended for large vocabularies: the heads' array is layers x heads x batch x len x vocab).

  Exact in the absence of dropout (evaluation); float32 rounding only."""
  model, params = hooks_lib._unpack(run)  # pylint: disable=protected-access
  _check(model)
  has_mlp = bool(model.mlp_ratio)
  layers = range(model.num_layers)
  names = (["embed", "ln_final.scale"] + [f"blocks.{i}.attn.z" for i in layers]
           + [f"blocks.{i}.attn_out" for i in layers]
           + ([f"blocks.{i}.mlp_out" for i in layers] if has_mlp else []))
  logits, cache = hooks_lib.run_with_cache((model, params), tokens, names)
  gamma, beta = _final_norm(model, params)
  table = _columns(_unembedding(params), ids)  # [vocab, d]
  r = jnp.asarray(cache["ln_final.scale"], jnp.float32)  # [batch, len, 1]
  through = lambda c: _through(jnp.asarray(c, jnp.float32), r, gamma, table)

  components = {"embed": through(cache["embed"])}
  heads, head_bias = [], []
  for i in layers:
    attn = params[f"block_{i}"]["self_attention"]["out"]
    kernel = jnp.asarray(attn["kernel"], jnp.float32)  # [heads * head_dim, d]
    z = jnp.asarray(cache[f"blocks.{i}.attn.z"], jnp.float32)  # [batch, len, heads, head_dim]
    per_head = jnp.einsum("blhk,hkd->hbld", z,
                          kernel.reshape(z.shape[2], z.shape[3], -1))  # [heads, batch, len, d]
    heads.append(through(per_head))  # [heads, batch, len, vocab]
    out_bias = (jnp.asarray(attn["bias"], jnp.float32) if "bias" in attn
                else jnp.zeros(kernel.shape[-1]))  # [d]
    head_bias.append(through(jnp.broadcast_to(out_bias, z.shape[:2] + out_bias.shape)))
    components[f"blocks.{i}.attn_out"] = through(cache[f"blocks.{i}.attn_out"])
    if has_mlp:
      components[f"blocks.{i}.mlp_out"] = through(cache[f"blocks.{i}.mlp_out"])
  bias = (jnp.zeros(table.shape[0]) if beta is None else table @ beta)  # [vocab]
  if ids is not None:
    logits = jnp.take(logits, jnp.asarray(ids), axis=-1)
  order = ["embed"] + [f"blocks.{i}.{part}" for i in layers
                       for part in (("attn_out", "mlp_out") if has_mlp else ("attn_out",))]
  return LogitAttribution(
      logits=np.asarray(logits, np.float32),
      components={n: np.asarray(components[n]) for n in order},
      heads=np.stack([np.asarray(h) for h in heads]), head_bias=np.stack(
          [np.asarray(b) for b in head_bias]), bias=np.asarray(bias, np.float32))


@jax.jit
def _through(c: Array, r: Array, gamma: Array, table: Array) -> Array:
  """A component `[..., batch, len, d]` through the final norm at the cached 1 / std r
  `[batch, len, 1]` (centred, scaled, no bias) and the unembedding -> `[..., batch, len, vocab]`."""
  centred = c - jnp.mean(c, axis=-1, keepdims=True)
  return (centred * r * gamma) @ table.T


# ---------------------------------------------------------------------- attribution patching


def attribution_patch(run: Any, clean: Any, corrupted: Any, metric: Callable[[Array], Array], *,
                      site: str = "resid_pre", over: str = "position") -> np.ndarray:
  """The first-order estimate of `hooks.patch_sweep(run, clean, corrupted, metric, site=site,
  over=over)`: metric(corrupted) + (clean - corrupted) . d metric / d activation at the corrupted
  run, summed over each cell's entries (module docstring). One forward pass of the clean tokens,
  one forward and backward pass of the corrupted ones, whatever the number of cells.

  Returns `[layers, len]`, `[layers, heads]` or `[layers, len, heads]` numpy, as patch_sweep."""
  if over not in hooks_lib.OVER:
    raise ValueError(f"unknown over={over!r}; valid: {', '.join(hooks_lib.OVER)}")
  model, params = hooks_lib._unpack(run)  # pylint: disable=protected-access
  _check(model)
  table = hooks_lib.sites(model)
  names = tuple(hooks_lib._site(table, f"blocks.{l}.{site}").name  # pylint: disable=protected-access
                for l in range(model.num_layers))
  info = table[names[0]]
  if over != "position" and info.heads_axis is None:
    raise ValueError(f"site {site!r} has no heads; use over='position'")
  if info.positions_axis is None:
    raise ValueError(f"site {site!r} has no positions axis")
  clean, corrupted = jnp.asarray(clean), jnp.asarray(corrupted)
  if clean.shape != corrupted.shape:
    raise ValueError(f"clean {clean.shape} and corrupted {corrupted.shape} token ids must have "
                     "the same shape")
  _, clean_cache = hooks_lib.run_with_cache((model, params), clean, list(names))
  value, corrupted_cache, grads = _gradients(model, names, metric)(params, corrupted, clean_cache)
  keep = {"position": (info.positions_axis,), "head": (info.heads_axis,),
          "position_head": (info.positions_axis, info.heads_axis)}[over]
  rows = []
  for n in names:
    delta = (clean_cache[n] - corrupted_cache[n]).astype(jnp.float32) * grads[n]
    summed = tuple(a for a in range(delta.ndim) if a not in keep)
    rows.append(jnp.sum(delta, axis=summed))  # the kept axes, in their order
  out = np.asarray(jnp.stack(rows)) + float(value)
  if over == "position_head" and info.heads_axis < info.positions_axis:
    out = np.swapaxes(out, 1, 2)  # [layers, len, heads] as patch_sweep
  return out


@functools.lru_cache(maxsize=32)
def _gradients(model: Any, names: tuple[str, ...], metric: Callable[[Array], Array]
               ) -> Callable[..., Any]:
  """jit (params, tokens, like) -> (metric, {site: activation}, {site: d metric / d site}):
  the gradient at each site is that of an `add` intervention of zeros there."""
  def fn(params, tokens, like):
    def forward(deltas):
      ivs = [Intervention(n, "add", deltas[n]) for n in names]
      logits, cache = hooks_lib._apply(  # pylint: disable=protected-access
          model, params, tokens, hooks_lib.intervention_tree(model, ivs), names)
      return metric(logits), cache
    zeros = {n: jnp.zeros(like[n].shape, jnp.float32) for n in names}
    (value, cache), grads = jax.value_and_grad(forward, has_aux=True)(zeros)
    return value, cache, grads
  return jax.jit(fn)
