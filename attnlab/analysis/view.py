"""One self-contained HTML page to explore a Capture: head view, heatmaps, per-head metrics.

  from attnlab.analysis import view
  html = view.render_html(capture, metrics=rows, title="dates, step 4000")
  view.write_html("runs/dates/view.html", capture, metrics=rows)

The page needs nothing but a browser: its script, style and data are inline (no CDN, no network
at view time). Its markup, style and script are the package files assets/view.html, view.css and
view.js; render_html puts the style, the script and the data into the markup's slots. It shows
  * a layer picker (grouped: encoder self / decoder self / causal / cross-attention) and a head
    picker (each head, or the mean of all heads; the left/right arrow keys step through heads);
  * the line view: query tokens on the left, key tokens on the right, one line per (query, key)
    pair with opacity = weight; hovering a token keeps its lines and dims the others;
  * the heatmap, queries down and keys across (for cross-attention: the alignment, target down and
    source across), with a tooltip giving query token, key token and weight;
  * the per-head metrics table (`metrics`, e.g. analysis.metrics.head_table(capture)), sortable by
    any column; the rows of the selected layer and head are highlighted, and a click on a row
    selects that layer and head.

Weights are stored as integers in units of 10**-decimals (4 decimals; 3 or 2 when a page would pass
PAGE_BUDGET = 1 MiB): 4 layers of 4 heads over 64 tokens make a page of about 180 KiB. The page
exposes `window.attnView` (current selection, `select(layer, head)`, `weight(q, k)`, `colour(w)`)
for scripting and tests.
"""

from __future__ import annotations

import functools
import html
import importlib.resources
import json
import math
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["PAGE_BUDGET", "page_data", "render_html", "write_html"]

# Pages over this many bytes store their weights with fewer decimals (render_html, decimals=None).
PAGE_BUDGET = 1 << 20

# Names of layer groups in the picker, in the order they appear.
_GROUP_ORDER = ("encoder self-attention", "decoder self-attention", "self-attention",
                "causal self-attention", "cross-attention")


@functools.cache
def _asset(name: str) -> str:
  """The text of the package file attnlab/analysis/assets/`name` (read once per process):
  view.html, the markup with %TITLE%, %STYLE%, %SCRIPT% and %DATA% slots; view.css; view.js."""
  return (importlib.resources.files("attnlab.analysis") / "assets" / name).read_text(
      encoding="utf-8")


def _group(kind: str, sides: tuple[str, str]) -> str:
  """The picker group of a layer from its kind and its (query, key) sides."""
  if kind == "cross":
    return "cross-attention"
  if sides == ("source", "source"):
    return "encoder self-attention"
  if sides == ("target", "target"):
    return "decoder self-attention"
  return "causal self-attention" if kind == "causal" else "self-attention"


def _jsonable(value: Any) -> Any:
  """Metrics cells as JSON values: numpy scalars to Python, NaN/inf to None, pairs as "a → b"."""
  if isinstance(value, np.generic):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  if isinstance(value, (tuple, list)):  # e.g. the (query, key) sides
    return " \u2192 ".join(str(v) for v in value)
  return str(value)


def page_data(capture, metrics: Sequence[Mapping[str, Any]] | None = None, title: str = "",
              decimals: int = 4) -> dict[str, Any]:
  """The JSON document the page renders (weights as integers in units of 10**-decimals).

  Raises:
    ValueError: a layer's weights are not [heads, q_len, k_len] or do not match its sides' tokens.
  """
  tokens = {side: [str(t) for t in toks] for side, toks in capture.tokens.items()}
  scale = 10 ** decimals
  layers = []
  for path, weights in capture.weights.items():
    weights = np.asarray(weights, np.float64)
    if weights.ndim != 3:
      raise ValueError(f"attention weights of {path!r} must be [heads, q_len, k_len] for one "
                       f"example, got shape {weights.shape}")
    q_side, k_side = capture.sides.get(path, (next(iter(tokens), "tokens"),) * 2)
    for side, length in ((q_side, weights.shape[1]), (k_side, weights.shape[2])):
      if side not in tokens:
        raise ValueError(f"layer {path!r} attends over side {side!r}, which has no tokens "
                         f"(sides with tokens: {', '.join(tokens) or 'none'})")
      if len(tokens[side]) != length:
        raise ValueError(f"layer {path!r}: {length} {side} positions in the weights but "
                         f"{len(tokens[side])} {side} tokens")
    kind = capture.kind.get(path, "self")
    ints = np.rint(np.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0) * scale).astype(np.int64)
    layers.append({
        "path": path, "kind": kind, "group": _group(kind, (q_side, k_side)),
        "q_side": q_side, "k_side": k_side,
        "heads": int(weights.shape[0]), "q_len": int(weights.shape[1]),
        "k_len": int(weights.shape[2]),
        # [heads][q_len * k_len], row-major: weight(q, k) = w[h][q * k_len + k] / scale.
        "w": ints.reshape(ints.shape[0], -1).tolist(),
    })
  # Stable order: groups as in _GROUP_ORDER, layers in capture order inside a group.
  layers.sort(key=lambda l: _GROUP_ORDER.index(l["group"]))
  rows = [{str(k): _jsonable(v) for k, v in row.items()} for row in (metrics or [])]
  # Rows in the picker's layer order (stable: heads keep their order); unknown layers last.
  order = {layer["path"]: i for i, layer in enumerate(layers)}
  rows.sort(key=lambda r: order.get(r.get("layer", r.get("path")), len(order)))
  # The page opens on the first cross-attention layer (the alignment) when there is one.
  initial = next((i for i, layer in enumerate(layers) if layer["kind"] == "cross"), 0)
  return {"title": title, "tokens": tokens, "scale": scale, "layers": layers, "metrics": rows,
          "initial_layer": initial}


def _script_json(data: Any) -> str:
  """JSON safe inside <script>: no '<', '>', '&' or line separators appear literally."""
  text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
  for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                       ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
    text = text.replace(char, escape)
  return text


def render_html(capture, metrics: Sequence[Mapping[str, Any]] | None = None, title: str = "",
                decimals: int | None = None) -> str:
  """The page for `capture` (an analysis.capture.Capture) as one HTML string.

  Args:
    capture: tokens, weights [heads, q_len, k_len] per layer path, sides and kind per path.
    metrics: rows of the per-head metrics table (analysis.metrics.head_table(capture)); each row
      names its layer path ("layer" or "path") and "head"; None or [] leaves the table out.
    title: shown as the page heading and window title.
    decimals: weights are rounded to this many decimals; None: 4, or 3 or 2 where that is what
      keeps the page under PAGE_BUDGET bytes (long texts through many layers and heads; a page
      still too big with 2 decimals is written as it is).
  Raises:
    ValueError: the capture holds no attention layer, or weights that do not fit its tokens.
  """
  for places in ([decimals] if decimals is not None else [4, 3, 2]):
    data = page_data(capture, metrics, title, places)
    if not data["layers"]:
      raise ValueError("the capture holds no attention layers; nothing to view")
    parts = {"TITLE": html.escape(title or "attention"), "STYLE": _asset("view.css"),
             "SCRIPT": _asset("view.js"), "DATA": _script_json(data)}
    # One pass, so that text put in (a title, a token) is never itself searched for a slot.
    page = re.sub(r"%(TITLE|STYLE|SCRIPT|DATA)%", lambda m: parts[m.group(1)], _asset("view.html"))
    if len(page.encode("utf-8")) <= PAGE_BUDGET:
      break
  return page


def write_html(path: str | os.PathLike, capture,
               metrics: Sequence[Mapping[str, Any]] | None = None, title: str = "",
               decimals: int | None = None) -> pathlib.Path:
  """Writes render_html(...) to `path` (parent folders created); returns the path."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(render_html(capture, metrics, title, decimals), encoding="utf-8")
  return path
