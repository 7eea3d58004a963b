"""Path patching: the effect of one head's output along one path, sender -> receiver.

  from attnlab.analysis import paths
  grid = paths.path_patch(run, clean, corrupted, metric)                       # senders -> logits
  grid = paths.path_patch(run, clean, corrupted, metric, receivers=[(1, 0)], receiver_input="q")
  grid = paths.path_patch(run, clean, corrupted, metric, receivers=[(2, 1), (2, 3)],
                          receiver_input=("k", "v"))                          # a set of receivers
  # grid [layers, heads]: the metric with each sender's path patched; NaN for senders not asked
  # for (or not below a receiver). Normalise as you like, e.g. grid - metric(clean logits).

Activation patching (hooks.patch_sweep) replaces a head's output everywhere it goes; path patching
(Wang et al. 2022, "Interpretability in the Wild", section 3.1 and appendix B; Goldowsky-Dill et
al. 2023, "Localizing Model Behavior with Path Patching") lets it reach one receiver only. Here
the base run is the clean one and the patched value comes from the corrupted one, for each sender
head s:
  1. run the clean tokens with every head's output (`blocks.{l}.attn.z`) frozen at its clean
     value, except s, whose output is its corrupted value; with `freeze_mlps`, every MLP output
     is frozen at its clean value too (default: the MLPs recompute, as Wang et al. do, so a path
     through an MLP counts as part of the direct path). Everything else (LayerNorms, the
     residual stream) recomputes, so s's corrupted output reaches each later layer only through
     the residual stream, directly.
  2. receivers="logits": the metric of step 1's logits is the answer (every other head frozen:
     only s's direct path to the unembedding, and the MLPs', changed).
     receivers=[(layer, head), ...]: keep each receiver's input (`receiver_input`: its query "q",
     key "k" or value "v" projection, or several) from step 1; run the clean tokens again with
     only those inputs replaced, at the receivers' heads, and everything downstream recomputing;
     the metric of that run is the answer.
A sender whose path is absent moves nothing: its grid entry is the clean metric.
Grouped-query attention: a receiver's key and value inputs are its kv head's, shared with its
group, so a "k" or "v" receiver patches the whole group's input.

Both steps are interventions given as data (attnlab.analysis.hooks), so one compiled program
runs every sender: a vmap over the senders' masks (`batch_size`: jax.lax.map in chunks instead).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.analysis import hooks as hooks_lib
from attnlab.analysis.hooks import Intervention

__all__ = ["INPUTS", "path_patch"]

Array = jax.Array

# A receiver head's inputs that a path may end in.
INPUTS = ("q", "k", "v")


def _receivers(model: Any, receivers: Any) -> tuple[tuple[int, int], ...] | None:
  """None for "logits", else the receiver heads as sorted (layer, head) pairs."""
  if isinstance(receivers, str):
    if receivers != "logits":
      raise ValueError(f"receivers must be 'logits' or (layer, head) pairs, got {receivers!r}")
    return None
  if (isinstance(receivers, tuple) and len(receivers) == 2
      and all(isinstance(x, (int, np.integer)) for x in receivers)):
    receivers = [receivers]
  pairs = []
  for pair in receivers:
    layer, head = (int(x) for x in pair)
    if not (0 <= layer < model.num_layers and 0 <= head < model.num_heads):
      raise ValueError(f"receiver head ({layer}, {head}) is not in the model ({model.num_layers} "
                       f"layers of {model.num_heads} heads)")
    pairs.append((layer, head))
  if not pairs:
    raise ValueError("receivers is empty; give (layer, head) pairs or 'logits'")
  return tuple(sorted(set(pairs)))


def _inputs(receiver_input: str | Iterable[str]) -> tuple[str, ...]:
  inputs = (receiver_input,) if isinstance(receiver_input, str) else tuple(receiver_input)
  bad = [i for i in inputs if i not in INPUTS]
  if bad or not inputs:
    raise ValueError(f"receiver_input must be one or more of {', '.join(INPUTS)}; got "
                     f"{receiver_input!r}")
  return tuple(dict.fromkeys(inputs))


def path_patch(run: Any, clean: Any, corrupted: Any, metric: Callable[[Array], Array], *,
               receivers: str | Sequence[tuple[int, int]] | tuple[int, int] = "logits",
               receiver_input: str | Iterable[str] = "q",
               senders: Sequence[tuple[int, int]] | None = None, freeze_mlps: bool = False,
               batch_size: int | None = None) -> np.ndarray:
  """Path patching of every sender head into `receivers` (module docstring).

  Args:
    run: a loaded GPT run or a (model, params) pair.
    clean, corrupted: token ids `[batch, len]` of the same shape.
    metric: logits `[batch, len, vocab]` -> a scalar; traced.
    receivers: "logits", or one (layer, head) pair or several (a set patched together).
    receiver_input: "q", "k", "v" or several of them: which inputs of the receivers the path
      ends in (not used for "logits").
    senders: (layer, head) pairs; None: every head below the last receiver's layer (every head
      for "logits").
    freeze_mlps: also freeze every MLP output at its clean value in step 1.
    batch_size: senders run at once (None: all in one vmap).
  Returns:
    `[layers, heads]` numpy float: the metric with each sender's path patched; NaN for the heads
    that are not senders (not asked for, or in no layer below a receiver).
  """
  model, params = hooks_lib._unpack(run)  # pylint: disable=protected-access
  table = hooks_lib.sites(model)
  layers, heads = model.num_layers, model.num_heads
  recv = _receivers(model, receivers)
  inputs = _inputs(receiver_input)
  clean, corrupted = jnp.asarray(clean), jnp.asarray(corrupted)
  if clean.shape != corrupted.shape:
    raise ValueError(f"clean {clean.shape} and corrupted {corrupted.shape} token ids must have "
                     "the same shape")
  top = layers if recv is None else max(l for l, _ in recv)
  if senders is None:
    senders = [(l, h) for l in range(top) for h in range(heads)]
  senders = [(int(l), int(h)) for l, h in senders]
  for l, h in senders:
    if not (0 <= l < layers and 0 <= h < heads):
      raise ValueError(f"sender head ({l}, {h}) is not in the model ({layers} layers of {heads} "
                       "heads)")
  senders = sorted(set((l, h) for l, h in senders if l < top))
  grid = np.full((layers, heads), np.nan)
  if not senders:
    return grid

  z_names = tuple(f"blocks.{l}.attn.z" for l in range(layers))
  mlp_names = tuple(n for n in (f"blocks.{l}.mlp_out" for l in range(layers)) if n in table)
  frozen = mlp_names if freeze_mlps else ()
  # Receiver sites and their head masks: kv heads for k and v under grouped-query attention.
  kv_heads = model.attention.kv_heads(heads)
  group = heads // kv_heads
  recv_masks: dict[str, np.ndarray] = {}
  for layer, head in recv or ():
    for name in inputs:
      site = f"blocks.{layer}.attn.{name}"
      width, index = (heads, head) if name == "q" else (kv_heads, head // group)
      mask = recv_masks.setdefault(site, np.zeros(width, bool))
      mask[index] = True
  recv_sites = tuple(sorted(recv_masks))

  _, clean_cache = hooks_lib.run_with_cache((model, params), clean, list(z_names + frozen))
  _, corrupted_cache = hooks_lib.run_with_cache((model, params), corrupted, list(z_names))
  masks = np.zeros((len(senders), layers, heads), bool)  # [senders, layers, heads]
  for i, (l, h) in enumerate(senders):
    masks[i, l, h] = True
  fn = _path_fn(model, z_names, frozen, recv_sites, metric, batch_size)
  values = np.asarray(fn(params, clean, {n: clean_cache[n] for n in z_names + frozen},
                         {n: corrupted_cache[n] for n in z_names},
                         {s: jnp.asarray(m) for s, m in recv_masks.items()}, jnp.asarray(masks)))
  for (l, h), value in zip(senders, values):
    grid[l, h] = value
  return grid


@functools.lru_cache(maxsize=32)
def _path_fn(model: Any, z_names: tuple[str, ...], frozen: tuple[str, ...],
             recv_sites: tuple[str, ...], metric: Callable[[Array], Array],
             batch_size: int | None) -> Callable[..., Array]:
  """The jitted (params, clean tokens, clean cache, corrupted z's, receiver masks, sender masks
  `[senders, layers, heads]`) -> metric per sender, vmapped over the senders (compiled once per
  model, sites, metric and batch_size)."""
  def run(params, clean, clean_cache, corrupted_z, recv_masks, sender_masks):
    def one(sender):  # [layers, heads]
      # Step 1: every head frozen at its clean output but the sender, at its corrupted one.
      ivs = [Intervention(n, "replace", jnp.where(sender[l][None, None, :, None],
                                                  corrupted_z[n], clean_cache[n]))
             for l, n in enumerate(z_names)]
      ivs += [Intervention(n, "replace", clean_cache[n]) for n in frozen]
      logits, cache = hooks_lib._apply(  # pylint: disable=protected-access
          model, params, clean, hooks_lib.intervention_tree(model, ivs), recv_sites)
      if not recv_sites:
        return metric(logits)
      # Step 2: the clean run with only the receivers' inputs replaced by step 1's.
      ivs = [Intervention(s, "replace", cache[s], heads=recv_masks[s]) for s in recv_sites]
      logits, _ = hooks_lib._apply(  # pylint: disable=protected-access
          model, params, clean, hooks_lib.intervention_tree(model, ivs), ())
      return metric(logits)
    if batch_size is None:
      return jax.vmap(one)(sender_masks)
    return jax.lax.map(one, sender_masks, batch_size=batch_size)
  return jax.jit(run)
