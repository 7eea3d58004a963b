"""Sinusoidal position encodings (Vaswani et al., 2017)."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def sinusoidal(length: int, dim: int, base: float = 10000.0, dtype: Any = jnp.float32) -> Array:
  """Position encodings `[length, dim]`: P[i, 2j] = sin(i / base^(2j/dim)), P[i, 2j+1] = cos(...).

  Column c uses the frequency of pair j = c // 2. An odd `dim` ends with a sine column
  (pair j = (dim - 1) / 2) that has no cosine partner.
  """
  if length < 0 or dim < 1:
    raise ValueError(f"sinusoidal needs length >= 0 and dim >= 1; got length={length}, dim={dim}")
  # Computed in float64 numpy (length and dim are static) for accuracy at long lengths.
  pos = np.arange(length, dtype=np.float64)[:, None]  # [length, 1]
  col = np.arange(dim)  # [dim]
  inv_freq = np.power(float(base), -(2 * (col // 2)) / dim)  # [dim]
  angle = pos * inv_freq[None, :]  # [length, dim]
  enc = np.where(col % 2 == 0, np.sin(angle), np.cos(angle))  # [length, dim]
  return jnp.asarray(enc, dtype)


def plot_sinusoidal(length: int, dim: int, path: str | pathlib.Path | None = None,
                    ax: Any = None) -> Any:
  """Heatmap of sinusoidal(length, dim) (position × dimension); saved to `path` if given.

  Draws into `ax` when given, else on a new figure (Agg canvas, never a display window).
  Returns the figure.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  if ax is None:
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
  else:
    fig = ax.figure
  enc = np.asarray(sinusoidal(length, dim))  # [length, dim]
  image = ax.imshow(enc, aspect="auto", cmap="RdBu", vmin=-1.0, vmax=1.0, origin="upper",
                    interpolation="nearest")
  ax.set_xlabel("dimension")
  ax.set_ylabel("position")
  ax.set_title(f"sinusoidal position encoding ({length} x {dim})")
  fig.colorbar(image, ax=ax)
  if path is not None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
  return fig
