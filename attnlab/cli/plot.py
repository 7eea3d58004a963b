"""Figures that need no run: `attnlab plot <what> [flags]`.

  attnlab plot positions --length=10000 --dim=512 --out=positions.png
  attnlab plot positions --length=10 --dim=512 --out=positions_10.png

`positions` draws the sinusoidal position encoding of Vaswani et al. 2017 (position x dimension,
attnlab.attention.positions.sinusoidal) as a heatmap (attnlab.plotting.plot_sinusoidal) into the
PNG --out (default positions.png in the current folder): the 10000 x 512 table and its first 10
positions are the two figures of the Transformer's positional-encoding story.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from attnlab.cli import tool

# What `attnlab plot` draws -> one-line help.
FIGURES = {"positions": "heatmap of the sinusoidal position encoding (--length x --dim)"}
# The largest table drawn (length * dim values; 10000 x 512 is about 5M).
MAX_VALUES = 2 ** 26


def _define_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  flags.DEFINE_integer("length", 10000, "positions: number of positions (rows).", flag_values=fv)
  flags.DEFINE_integer("dim", 512, "positions: encoding size (columns; even, sine/cosine pairs).",
                       flag_values=fv)
  flags.DEFINE_string("out", "positions.png", "PNG file to write.", flag_values=fv)
  return fv


def _integer_error(argv: Sequence[str]) -> str | None:
  """The one-line error of a --length or --dim value that is not an integer, or None."""
  for arg in argv:
    name, _, value = arg.lstrip("-").partition("=")
    if name in ("length", "dim") and "=" in arg and not value.strip().lstrip("+-").isdigit():
      return f"--{name} must be a positive integer, got {value!r}"
  return None


def _check(fv: flags.FlagValues, what: list[str]) -> str | None:
  """The one-line usage error of the arguments, or None."""
  if len(what) != 1 or what[0] not in FIGURES:
    got = f"got {' '.join(what)!r}" if what else "got none"
    return f"name one figure to draw: {', '.join(FIGURES)} ({got}), e.g. attnlab plot positions " \
           "--length=10000 --dim=512"
  if fv.length < 1:
    return f"--length must be a positive integer (the number of positions), got {fv.length}"
  if fv.dim < 2 or fv.dim % 2:
    return (f"--dim must be a positive even integer (sine/cosine pairs), got {fv.dim}; "
            f"e.g. --dim=512")
  if fv.length * fv.dim > MAX_VALUES:
    return (f"--length x --dim = {fv.length * fv.dim} values is more than this plot draws "
            f"({MAX_VALUES}); lower --length or --dim")
  if not fv.out.lower().endswith(".png"):
    return f"--out must name a .png file, got {fv.out!r}"
  return None


def main(argv: Sequence[str] | None = None) -> int:
  """`attnlab plot` / `python -m attnlab.cli.plot`: returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  prog = tool.prog_name(argv, "attnlab.cli.plot")
  fv = _define_flags()
  what = [a for a in argv[1:] if not a.startswith("-")]
  message = _integer_error(argv[1:])
  if message is None:
    message = tool.parse_flags(fv, [argv[0]] + [a for a in argv[1:] if a.startswith("-")])
  if message is None:
    message = _check(fv, what)

  def body() -> None:
    from attnlab import plotting  # pylint: disable=g-import-not-at-top  (imports JAX)
    plotting.plot_sinusoidal(fv.length, fv.dim, fv.out)  # its own Agg figure, not pyplot's
    print(f"wrote {fv.out} (sinusoidal position encoding, {fv.length} x {fv.dim})")
  return tool.launch(prog, message, body)


if __name__ == "__main__":
  sys.exit(main())
