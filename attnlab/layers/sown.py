"""Reading what the layers sow: the "intermediates" collection as {module path: values}.

Every attention layer sows `intermediates/<module path>/attention_weights`; Flax keeps one value
per call, as a tuple. This is the one place that walks that tree: analysis (`attention_maps`,
`capture`) and every task's plots go through it.

    _, state = model.apply({"params": params}, *args, mutable=["intermediates"])
    maps = sown_values(state["intermediates"])          # {"encoder/layer_0/attention": (w,)}
    grid = stack_layers(maps, "block_")                  # [layers, heads, q, k] of example 0
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

# The name every attention layer sows its weights under.
ATTENTION_WEIGHTS = "attention_weights"


def natural_key(path: str) -> list[Any]:
  """Sort key that orders "layer_2" before "layer_10"."""
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def sown_values(intermediates: Any, name: str | None = ATTENTION_WEIGHTS) -> dict[str, tuple]:
  """{"/"-joined module path ("." at the top): the tuple of sown values (one per call)} of the
  values sown as `name` (None: every name, keyed "<path>/<name>"), in natural path order."""
  found = {}
  flat = jax.tree_util.tree_flatten_with_path(
      intermediates, is_leaf=lambda x: isinstance(x, tuple))[0]
  for key_path, value in flat:
    names = [str(getattr(p, "key", p)) for p in key_path]
    if name is None:
      path = "/".join(names)
    elif names and names[-1] == name:
      path = "/".join(names[:-1]) or "."
    else:
      continue
    found[path] = value if isinstance(value, tuple) else (value,)
  return {k: found[k] for k in sorted(found, key=natural_key)}


def stack_layers(maps: dict[str, tuple], prefix: str = "", suffix: str = "",
                 example: int | None = 0) -> np.ndarray:
  """The first call's weights of every path that starts with `prefix` and ends with `suffix`,
  stacked in path order: `[layers, ...]`; with `example` set, of that batch row only (e.g.
  `[layers, heads, q, k]`)."""
  values = [np.asarray(v[0]) for path, v in maps.items()
            if path.startswith(prefix) and path.endswith(suffix)]
  if not values:
    raise ValueError(f"no sown attention weights at a path {prefix}...{suffix}; "
                     f"paths: {', '.join(maps) or 'none'}")
  stacked = np.stack(values)
  return stacked if example is None else stacked[:, example]
