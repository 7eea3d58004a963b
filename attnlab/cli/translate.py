"""Translate sentences with a trained translation run and save the alignment heatmap.

  attnlab translate --workdir=runs/marathi "Rahul is a good boy"
  attnlab translate --workdir=runs/dates --beam_size=4 --output=/tmp/date.png "9 October 1993"
  attnlab translate --workdir=runs/gnmt --beam_size=4 --length_penalty=0.6 --coverage_penalty=0.2 \
      "9 October 1993"                       # GNMT's beam score (Wu et al. 2016, eq. 14)
  python -m attnlab.cli.translate --workdir=runs/dates "tuesday 9 october 1993" "09/10/93"

Prints one translation per input on stdout and writes one PNG per input: the attention weights with
the source tokens across and the output tokens down (DIR/alignment.png for one input,
DIR/alignment_<i>.png for several, or --output). From Python / a notebook:

  run = attnlab.analysis.load_run("runs/marathi")
  [t] = run.task.translate(run.params, ["Rahul is a good boy"])
  run.task.plot_alignment(t)          # the same figure

Words (or characters, subword symbols) of an input outside the run's source vocabulary are fed to
the model as <unk>, with a warning naming them.
"""

from __future__ import annotations

import logging
import math
import pathlib
import sys
from collections.abc import Callable, Sequence

from absl import flags

from attnlab.cli import tool
from attnlab.errors import UserError

_LOG = logging.getLogger("attnlab.cli.translate")  # not __name__: it is __main__ under python -m


def _define_flags() -> flags.FlagValues:
  flag_values = tool.tool_flags("Run directory of a trained translation run.", step=True)
  flags.DEFINE_integer("beam_size", None, "Beams (1 = greedy); default: the run's decode.beam_size.",
                       flag_values=flag_values)
  flags.DEFINE_float("length_penalty", None, "Beam search's GNMT length penalty alpha (0: none); "
                     "default: the run's decode.length_penalty.", flag_values=flag_values)
  flags.DEFINE_float("coverage_penalty", None, "Beam search's GNMT coverage penalty beta (0: none); "
                     "default: the run's decode.coverage_penalty.", flag_values=flag_values)
  flags.DEFINE_string("output", None, "PNG path of the heatmap (several inputs: suffixed _<i>); "
                      "default: DIR/alignment.png.", flag_values=flag_values)
  return flag_values


def output_paths(workdir: str, output: str | None, count: int) -> list[pathlib.Path]:
  """Where the heatmaps of `count` inputs go."""
  base = pathlib.Path(output) if output else pathlib.Path(workdir) / "alignment.png"
  if base.suffix.lower() != ".png":
    base = base.with_suffix(".png")
  if count == 1:
    return [base]
  return [base.with_name(f"{base.stem}_{i}{base.suffix}") for i in range(count)]


def translate(workdir: str, sentences: Sequence[str], *, step: str = "latest",
              beam_size: int | None = None, output: str | None = None,
              warn: Callable[[str], None] | None = None, length_penalty: float | None = None,
              coverage_penalty: float | None = None) -> list[str]:
  """Loads the run, translates, saves the heatmaps; returns the lines to print.

  `length_penalty` and `coverage_penalty` (None: the run's decode.*) weigh beam search's score.

  `warn` (default: a logged warning) gets one line per input with symbols outside the source
  vocabulary.
  """
  from attnlab import analysis  # pylint: disable=g-import-not-at-top  (imports JAX)
  from attnlab.data import tokenizers  # pylint: disable=g-import-not-at-top
  run = analysis.load_run(workdir, step)
  if not hasattr(run.task, "translate"):
    raise UserError(f"{workdir} is a {run.config.task!r} run; translate needs a translation run "
                    f"(configs/seq2seq.py)")
  few = analysis.few_steps_warning(run)
  if few is not None:
    (warn or _LOG.warning)(few)
  # The source text as the task segments it (punctuation split off for word tokenizers).
  for sentence in sentences:
    message = tokenizers.unknown_warning(run.task.src_tok, run.task.prepare_text(sentence, "source"),
                                         f"the input {sentence!r}")
    if message is not None:
      (warn or _LOG.warning)(message)
  try:
    results = run.task.translate(run.params, list(sentences), beam_size,
                                 length_penalty=length_penalty, coverage_penalty=coverage_penalty)
  except ValueError as e:
    raise UserError(str(e)) from e
  lines = []
  for t, path in zip(results, output_paths(workdir, output, len(results))):
    run.task.plot_alignment(t, path)  # its own figure (attnlab.plotting): nothing to close
    lines.append(t.text)
    print(f"alignment of {t.source!r} saved to {path}", file=sys.stderr)
  return lines


# The widest beam translate searches with (its memory grows with beams x steps x source length).
MAX_BEAM_SIZE = 64


def _check(fv: flags.FlagValues, sentences: Sequence[str]) -> str | None:
  if not fv.workdir:
    return "--workdir is required: the run directory of a trained translation model"
  if not sentences:
    return 'give the sentence(s) to translate, e.g. attnlab translate --workdir=DIR "Hello"'
  if fv.beam_size is not None and not 1 <= fv.beam_size <= MAX_BEAM_SIZE:
    return f"--beam_size must be between 1 (greedy) and {MAX_BEAM_SIZE}, got {fv.beam_size}"
  for name in ("length_penalty", "coverage_penalty"):
    value = getattr(fv, name)
    if value is not None and not (math.isfinite(value) and value >= 0):
      return f"--{name} must be a number >= 0 (0: none), got {value}"
  return tool.step_error(fv.step)


def main(argv: Sequence[str] | None = None) -> int:
  """`attnlab translate` / `python -m attnlab.cli.translate`: returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  prog = tool.prog_name(argv, "attnlab.cli.translate")
  flag_values = _define_flags()
  try:
    sentences = flag_values(list(argv))[1:]  # the arguments that are not flags
  except (flags.Error, ValueError) as e:
    sentences, message = [], tool.error_line(e)
  else:
    tool.resolve_paths(flag_values)
    message = _check(flag_values, sentences)

  def body() -> None:
    warn = lambda message: print(f"{prog}: warning: {message}", file=sys.stderr)
    for line in translate(flag_values.workdir, sentences, step=flag_values.step,
                          beam_size=flag_values.beam_size, output=flag_values.output, warn=warn,
                          length_penalty=flag_values.length_penalty,
                          coverage_penalty=flag_values.coverage_penalty):
      print(line)
  return tool.launch(prog, message, body)


if __name__ == "__main__":
  sys.exit(main())
