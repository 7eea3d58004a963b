"""Hook sites in the layers: read (cache) and edit (intervene on) the live forward pass.

A layer marks an activation as a site with one call, `x = hook(self, "name", x, ...)`. The
public names of a family's sites (`blocks.0.attn.z`, ...) and their shapes are declared once in
attnlab.analysis.hooks; here a site is the module that produces it and a local name.

  cache:      model.apply(variables, ..., mutable=["hooks"]) sows every site's value (after its
              interventions, i.e. what flows on) under `hooks/<module path>/<name>`; inside
              `capturing(keys)` only the sites whose "<module path>/<name>" is in `keys` are sown
              (so only those materialise, and attention forms its weights only when
              `pattern` is asked for).
  intervene:  model.apply({"params": ..., "interventions": tree}, ...) with
              `interventions/<module path>/<name>` a tuple of `Intervention`s, applied in order.
              An Intervention is data (a pytree: its arrays are leaves, its site and op static),
              so one jitted program serves any values and masks, and `jax.vmap` over the masks
              runs a whole patching sweep in one program.

Neither collection present (a plain `apply`): `hook` returns x itself and adds no operation to
the program; which sites are sown is decided at trace time, in Python.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array

# The mutable collection the sites are sown into.
HOOKS = "hooks"
# The input collection of interventions.
INTERVENTIONS = "interventions"
# What an intervention does at the masked entries (the rest is left as it is).
OPS: tuple[str, ...] = ("replace", "add", "zero", "mean", "scale")

# "<module path>/<name>" keys of the sites to sow; None: every site (set by `capturing`).
_WANTED: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "attnlab_hook_sites", default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Intervention:
  """One edit of one site, as data. At the entries selected by `positions` and `heads` (all when
  None), x becomes:
    replace  value                 add    x + value            zero   0
    mean     value, or (None) x's mean over the batch and position axes
    scale    x * value
  `value` broadcasts against the site's array (a cached activation, a vector, a scalar)."""
  # The site's public name (attnlab.analysis.hooks), e.g. "blocks.0.attn.z".
  site: str = dataclasses.field(metadata=dict(static=True))
  # replace, add, zero, mean or scale (OPS).
  op: str = dataclasses.field(default="replace", metadata=dict(static=True))
  # The new value (replace, add, mean), the factor (scale); None for zero and a batch mean.
  value: Any = None
  # bool `[len]` or `[batch, len]`: the positions edited (queries, for a pattern); None: all.
  positions: Any = None
  # bool `[heads]` (kv heads for k and v under grouped-query attention); None: all.
  heads: Any = None

  def __post_init__(self):
    if self.op not in OPS:
      raise ValueError(f"unknown intervention op {self.op!r}; valid: {', '.join(OPS)}")
    if self.op in ("replace", "add", "scale") and self.value is None:
      raise ValueError(f"intervention {self.op!r} at {self.site!r} needs a value")


@contextlib.contextmanager
def capturing(keys: Iterable[str] | None) -> Iterator[None]:
  """Within the block, a mutable "hooks" collection receives only the sites whose
  "<module path>/<name>" is in `keys` (None: every site). Enter it inside the traced function."""
  token = _WANTED.set(None if keys is None else frozenset(keys))
  try:
    yield
  finally:
    _WANTED.reset(token)


def site_key(module: nn.Module, name: str) -> str:
  """"<module path>/<name>" of a site (the path "/"-joined, empty at the model's root)."""
  return "/".join(tuple(module.path) + (name,))


def capturing_site(module: nn.Module, name: str) -> bool:
  """Whether `hook(module, name, ...)` sows its value in this call."""
  if module.is_initializing() or not module.is_mutable_collection(HOOKS):
    return False
  wanted = _WANTED.get()
  return wanted is None or site_key(module, name) in wanted


def intervened(module: nn.Module, name: str) -> bool:
  """Whether an intervention is given for the site."""
  return module.has_variable(INTERVENTIONS, name)


def active(module: nn.Module, name: str) -> bool:
  """Whether `hook(module, name, ...)` does anything in this call (sows or edits)."""
  return intervened(module, name) or capturing_site(module, name)


def _axis_mask(mask: Any, x: Array, axis: int, what: str, site: str) -> Array:
  """A bool mask `[n]` (or `[batch, n]` for positions) shaped to broadcast against x along
  `axis` (and the batch axis 0)."""
  mask = jnp.asarray(mask, bool)
  shape = [1] * x.ndim
  if mask.ndim == 2 and what == "positions":
    shape[0] = mask.shape[0]
  elif mask.ndim != 1:
    raise ValueError(f"{what} mask of {site!r} must be [n]{' or [batch, n]' * (what == 'positions')}"
                     f", got shape {mask.shape}")
  if mask.shape[-1] != x.shape[axis]:
    raise ValueError(f"{what} mask of {site!r} has {mask.shape[-1]} entries but the site has "
                     f"{x.shape[axis]} {what}")
  shape[axis] = mask.shape[-1]
  return mask.reshape(shape)


def apply_intervention(x: Array, iv: Intervention, *, positions_axis: int | None,
                       heads_axis: int | None) -> Array:
  """x with `iv` applied (Intervention's docstring); the masks select along the given axes."""
  mask = None
  for given, axis, what in ((iv.positions, positions_axis, "positions"),
                            (iv.heads, heads_axis, "heads")):
    if given is None:
      continue
    if axis is None:
      raise ValueError(f"site {iv.site!r} has no {what} axis; leave its {what} mask out")
    m = _axis_mask(given, x, axis, what, iv.site)
    mask = m if mask is None else mask & m
  value = None if iv.value is None else jnp.asarray(iv.value).astype(x.dtype)
  if iv.op == "replace":
    new = jnp.broadcast_to(value, x.shape)
  elif iv.op == "add":
    new = x + value
  elif iv.op == "zero":
    new = jnp.zeros_like(x)
  elif iv.op == "mean":
    axes = (0,) if positions_axis is None else (0, positions_axis)
    new = jnp.broadcast_to(jnp.mean(x, axis=axes, keepdims=True) if value is None else value,
                           x.shape)
  else:  # scale
    new = x * value
  return new if mask is None else jnp.where(mask, new, x)


def hook(module: nn.Module, name: str, x: Array, *, positions_axis: int | None = 1,
         heads_axis: int | None = None) -> Array:
  """The site `name` of `module`: x after the interventions given for it, sown into "hooks" when
  that collection is mutable (and the site wanted). Without either, x itself (no operation).

  positions_axis / heads_axis: the axes the interventions' masks select along (None: none).
  """
  if intervened(module, name):
    for iv in module.get_variable(INTERVENTIONS, name):
      x = apply_intervention(x, iv, positions_axis=positions_axis, heads_axis=heads_axis)
  if capturing_site(module, name):
    module.sow(HOOKS, name, x)
  return x
