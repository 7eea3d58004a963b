"""Attention plots: one heatmap, a grid of heads (and layers) for a head view, position encodings.

Every function draws on a figure of its own with matplotlib's Agg canvas (no display needed),
returns the figure, and saves it as PNG when given `path`. Figures are made with matplotlib's object
API (`Figure`, `FigureCanvasAgg`), never pyplot's global list of figures: the trainer draws the
end-of-run plots on a thread of its own (attnlab/train.py), and a figure needs no `plt.close`.
"""

import functools
import logging
import pathlib
from typing import Sequence

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
import numpy as np


_LOG = logging.getLogger(__name__)

# Fonts with Devanagari glyphs (Marathi labels), in order of preference.
DEVANAGARI_FONTS = ("Noto Sans Devanagari", "Lohit Devanagari", "Mukta", "Gargi", "Nakula",
                    "Sahadeva", "Samyak Devanagari", "Annapurna SIL")
# PyPI packages whose font files attnlab registers with matplotlib (module name, font family):
# one of attnlab's dependencies (pyproject.toml), so a fresh install draws Devanagari labels.
PACKAGED_FONTS = (("fontpkg_noto_sans_devanagari", "Noto Sans Devanagari"),)
# The install line a warning names when no Devanagari font is found.
DEVANAGARI_INSTALL = ("pip install fontpkg-noto-sans-devanagari (an attnlab dependency), or "
                      "apt-get install fonts-noto-core")


def register_packaged_fonts() -> list[str]:
  """Adds the font files of the installed PACKAGED_FONTS packages to matplotlib's font list (once
  per process); returns the families added."""
  import importlib  # pylint: disable=g-import-not-at-top
  from matplotlib import font_manager  # pylint: disable=g-import-not-at-top
  added = []
  for module, family in PACKAGED_FONTS:
    try:
      root = pathlib.Path(importlib.import_module(module).__file__).parent
    except ImportError:
      continue
    known = {f.fname for f in font_manager.fontManager.ttflist}
    for path in sorted(root.rglob("*.[to]tf")):
      if str(path) not in known:
        font_manager.fontManager.addfont(str(path))
    added.append(family)
  return added


@functools.lru_cache(maxsize=None)
def _installed_devanagari_fonts() -> tuple[str, ...]:
  from matplotlib import font_manager  # pylint: disable=g-import-not-at-top
  register_packaged_fonts()
  installed = {f.name for f in font_manager.fontManager.ttflist}
  found = tuple(name for name in DEVANAGARI_FONTS if name in installed)
  if not found:
    _LOG.warning("no Devanagari font found for matplotlib: Marathi labels will show as boxes; "
                 "install one: %s", DEVANAGARI_INSTALL)
  return found


def font_family(text: str) -> list[str]:
  """matplotlib font.family for labels containing `text`: with Devanagari fallbacks when it
  needs them (use as `with matplotlib.rc_context({"font.family": font_family(text)}):`)."""
  if any("\u0900" <= ch <= "\u097f" for ch in text):
    return ["DejaVu Sans", *_installed_devanagari_fonts()]
  return list(matplotlib.rcParams["font.family"])


def _figure(figsize) -> Figure:
  """A new figure on its own Agg canvas (not in pyplot's list: nothing to close)."""
  fig = Figure(figsize=figsize)
  FigureCanvasAgg(fig)
  return fig


def _save(fig, path, dpi=120, bbox_inches="tight"):
  """Saves `fig` as `path` (parent folders created) unless `path` is None; returns `fig`."""
  if path is not None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches=bbox_inches)
  return fig


def _check_2d(weights, x_labels, y_labels):
  weights = np.asarray(weights, dtype=np.float32)
  if weights.ndim != 2:
    raise ValueError(f"attention weights must be [rows, cols] (queries x keys), got shape "
                     f"{weights.shape}")
  for name, labels, n in (("x_labels", x_labels, weights.shape[1]),
                          ("y_labels", y_labels, weights.shape[0])):
    if labels is not None and len(labels) != n:
      raise ValueError(f"{name} has {len(labels)} entries but the weights have {n} along that axis")
  return weights


def _draw(ax, weights, x_labels, y_labels, title, vmax=None):
  image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto",
                    interpolation="nearest")
  for axis_labels, set_ticks, set_labels, rotation in (
      (x_labels, ax.set_xticks, ax.set_xticklabels, 90),
      (y_labels, ax.set_yticks, ax.set_yticklabels, 0)):
    if axis_labels is not None:
      set_ticks(range(len(axis_labels)))
      set_labels([str(label) for label in axis_labels], rotation=rotation, fontsize=8)
  if title:
    ax.set_title(title, fontsize=9)
  return image


def attention_heatmap(weights, *, x_labels: Sequence[str] | None = None,
                      y_labels: Sequence[str] | None = None, title: str | None = None,
                      xlabel: str = "keys", ylabel: str = "queries", ax=None, path=None):
  """Heatmap of one attention matrix `[rows (queries), cols (keys)]` with optional token labels."""
  weights = _check_2d(weights, x_labels, y_labels)
  if ax is None:
    height, width = weights.shape
    fig = _figure((min(2 + 0.3 * width, 14), min(1.5 + 0.3 * height, 14)))
    ax = fig.subplots()
  else:
    fig = ax.figure
  image = _draw(ax, weights, x_labels, y_labels, title)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
  return _save(fig, path)


def attention_grid(weights, *, x_labels: Sequence[str] | None = None,
                   y_labels: Sequence[str] | None = None, title: str | None = None, path=None):
  """Head view: weights `[heads, rows, cols]` or `[layers, heads, rows, cols]`, one panel each."""
  weights = np.asarray(weights, dtype=np.float32)
  if weights.ndim == 3:
    weights = weights[None]
  if weights.ndim != 4:
    raise ValueError(f"attention_grid expects [heads, rows, cols] or [layers, heads, rows, cols], "
                     f"got shape {weights.shape}")
  layers, heads = weights.shape[:2]
  _check_2d(weights[0, 0], x_labels, y_labels)
  size = 1.2 + 0.18 * max(weights.shape[2:])
  fig = _figure((size * heads, size * layers))
  axes = fig.subplots(layers, heads, squeeze=False)
  for layer in range(layers):
    for head in range(heads):
      ax = axes[layer, head]
      _draw(ax, weights[layer, head], x_labels if layer == layers - 1 else None,
            y_labels if head == 0 else None, f"layer {layer} head {head}", vmax=1.0)
      if layer != layers - 1:
        ax.set_xticks([])
      if head != 0:
        ax.set_yticks([])
  if title:
    fig.suptitle(title)
  # tight_layout fits the labels into the figure once; the save then needs no second drawing
  # pass, neither bbox_inches="tight" nor the draw that savefig adds for a figure with a layout
  # engine (tight_layout leaves a placeholder one): a 4 x 4 grid of 32 tokens took 3.8 s, now 2.
  fig.tight_layout()
  fig.set_layout_engine(None)
  return _save(fig, path, bbox_inches=None)


def plot_sinusoidal(length: int, dim: int, path: str | pathlib.Path | None = None, ax=None):
  """Heatmap of sinusoidal(length, dim) (position × dimension); saved to `path` if given.

  Draws into `ax` when given, else on a new figure (Agg canvas, never a display window).
  Returns the figure.
  """
  from attnlab.attention import positions  # pylint: disable=g-import-not-at-top  (JAX)
  if ax is None:
    fig = _figure((6, 4))
    ax = fig.add_subplot(1, 1, 1)
  else:
    fig = ax.figure
  enc = np.asarray(positions.sinusoidal(length, dim))  # [length, dim]
  image = ax.imshow(enc, aspect="auto", cmap="RdBu", vmin=-1.0, vmax=1.0, origin="upper",
                    interpolation="nearest")
  ax.set_xlabel("dimension")
  ax.set_ylabel("position")
  ax.set_title(f"sinusoidal position encoding ({length} x {dim})")
  fig.colorbar(image, ax=ax)
  return _save(fig, path, dpi=None, bbox_inches=None)  # matplotlib's savefig defaults
