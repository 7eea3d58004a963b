"""Write an interactive HTML page of a run's attention on one input.

  attnlab view --workdir=runs/gpt_nano --text="ROMEO: But soft"
  attnlab view --workdir=runs/dates --text="9 October 1993"                  (decodes the target)
  attnlab view --workdir=runs/dates --text="9 October 1993" --target="1993-10-09" --out=/tmp/d.html
  attnlab view --workdir=runs/bert --text="the cat sat on the mat" --step=2000

Restores the run (attnlab.analysis.load_run), captures every attention layer's weights on the text
(analysis.capture.capture_text), measures each head (analysis.metrics.head_table; the mean weight
on the first token, and for a GPT run the previous-token, duplicate-token and induction scores on
random tokens: analysis.head_report.view_columns) and writes one
self-contained page (analysis.view.write_html; DIR/view.html by default): layer and head pickers,
the token-to-token line view, the heatmap or, for cross-attention, the alignment, and the per-head
metrics table. Prints the page's path. From Python / a notebook:

  from attnlab.cli import view
  path = view.view_text("runs/dates", "9 October 1993")
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Sequence

import numpy as np
from absl import flags

from attnlab.cli import tool
from attnlab.errors import UserError


def _define_flags() -> flags.FlagValues:
  fv = tool.tool_flags("Run directory of a trained run.", step=True)
  flags.DEFINE_string("text", None, "Input text (the source sentence of a translation run).",
                      flag_values=fv)
  flags.DEFINE_string("target", None, "Translation runs: the target text to attend over "
                      "(default: the model's greedy translation).", flag_values=fv)
  flags.DEFINE_string("out", None, "HTML file to write (default: DIR/view.html).", flag_values=fv)
  return fv


def _check(fv: flags.FlagValues) -> str | None:
  if not fv.workdir:
    return "--workdir is required: the run directory of a trained run (attnlab train ...)"
  if not os.path.isdir(fv.workdir):
    return f"--workdir {fv.workdir} is not a directory; train a run there first (attnlab train)"
  if fv.text is None or not fv.text.strip():
    return "--text is required and must not be empty, e.g. --text=\"the cat sat\""
  if fv.target is not None and not fv.target.strip():
    return "--target must not be empty; leave it out to use the model's own translation"
  return tool.step_error(fv.step)


def view_text(workdir, text: str, target: str | None = None, out: str | os.PathLike | None = None,
              step: str | int = "latest") -> pathlib.Path:
  """Captures the attention of run `workdir` (a path or a loaded analysis.Run) on `text`.

  Writes the page to `out` (default: the run's view.html) and returns its path.
  Raises:
    UserError: no readable run there, an input the run cannot take, or a model without attention.
  """
  # pylint: disable=g-import-not-at-top  (these import JAX)
  from attnlab import analysis
  run = workdir if isinstance(workdir, analysis.Run) else analysis.load_run(workdir, step)
  # (attnlab.analysis also exports a function named `capture`: import the names themselves.)
  from attnlab.analysis.capture import capture_text
  from attnlab.analysis.head_report import view_columns as head_columns
  from attnlab.analysis.metrics import head_table
  from attnlab.analysis.view import write_html
  # pylint: enable=g-import-not-at-top
  if run.model is None:
    raise UserError(f"{run.workdir} is a {run.config.task!r} run without a Flax model; there is no "
                    "attention to view")
  try:
    capture = capture_text(run, text, target=target)
  except UserError:
    raise
  except ValueError as e:  # an input the run's tokenizer or task refuses
    raise UserError(f"cannot capture attention of {run.workdir} on {text!r}: {e}") from e
  # A model without attention (the RNN seq2seq with model.attention=none) sows all-zero weights.
  if not any(np.any(w) for w in capture.weights.values()):
    raise UserError(f"{run.workdir} is a {run.config.task!r} run whose model has no attention "
                    "(no layer sows nonzero weights); there is nothing to view")
  rows = head_columns(run, capture, head_table(capture))
  path = pathlib.Path(out) if out else run.workdir / "view.html"
  title = f"{run.workdir.name} \u00b7 step {run.step}"
  try:
    return write_html(path, capture, rows, title=title)
  except OSError as e:
    raise UserError(f"cannot write {path}: {e.strerror or e}") from e


def main(argv: Sequence[str] | None = None) -> int:
  """`attnlab view` / `python -m attnlab.cli.view`: returns the exit status."""
  fv = _define_flags()
  prog, message = tool.parse_tool(argv, "attnlab.cli.view", fv, _check)

  def body() -> None:
    print(view_text(fv.workdir, fv.text, target=fv.target, out=fv.out, step=fv.step))
  return tool.launch(prog, message, body)


if __name__ == "__main__":
  sys.exit(main())
