"""`attnlab train`: launch or resume a run.

  attnlab train --config=configs/nadaraya_watson.py:runlocal=True --workdir=/tmp/nw \
      [--config.optimizer.learning_rate=0.05 ...]
  python -m attnlab.cli train --config=... --workdir=...        (the same, as a module)

Running the same command on an existing workdir resumes from its last checkpoint. Errors a user can
fix (unknown config key, wrong value type, missing config file, a config file that fails to
import, a workdir holding a different config or in use by another run) print one line to stderr
and exit with status 2; a NaN/Inf loss, or a write the disk refuses (full, read-only), exits with 1
after one line naming the last good checkpoint; SIGTERM or Ctrl-C saves a checkpoint and exits
with 128 + the signal number.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from attnlab.cli import tool


def _check(fv: flags.FlagValues) -> str | None:
  if fv.config is None:
    return "--config is required, e.g. --config=configs/nadaraya_watson.py:runlocal=True"
  if not fv.workdir:
    return "--workdir is required: the run directory to create or resume"
  return None


def main(argv: Sequence[str] | None = None) -> int:
  """`attnlab train` / `python -m attnlab.cli.train`: returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  flag_values = tool.run_flags(
      argv, "Config file and args: configs/<family>.py[:key=value,...]; override any field with "
      "--config.<field>=<value>.", "Run directory (created, or resumed if it exists).")
  prog, message = tool.parse_tool(argv, "attnlab.cli.train", flag_values, _check)

  def body() -> None:
    from attnlab import train  # pylint: disable=g-import-not-at-top  (imports JAX)
    train.train_and_evaluate(flag_values.config, flag_values.workdir)
  return tool.launch(prog, message, body)


if __name__ == "__main__":
  sys.exit(main())
