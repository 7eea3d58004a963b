"""What every command-line tool shares: flags, one-line usage errors, logging, exit statuses.

Flags live only in attnlab/cli/ (library code takes config and workdir). Each tool (train.py,
sweep.py, inspect_run.py, generate.py, translate.py, view.py, import_hf.py) defines its flags on
its own FlagValues (`tool_flags`, `run_flags`), parses them (`parse_tool`: None or the one-line
usage error) and hands its body to `launch`. Errors a user can fix print one line to stderr and
exit with status 2 (USAGE_ERROR); a write the disk refuses exits with 1 (IO_ERROR); a run that
stops on purpose (RunStopped: a NaN/Inf loss, SIGTERM or Ctrl-C) prints its line and exits with
its own status.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags
from ml_collections import config_flags

from attnlab import config_utils
from attnlab.backends import cpu as cpu_backend
from attnlab.errors import RunStopped
from attnlab.errors import UserError
from attnlab.errors import error_line

USAGE_ERROR = 2
# Exit status of a tool stopped by a file it could not write or read (disk full, read-only, ...).
IO_ERROR = 1
# errno values run_tool reports in one line: the disk refused a write, or a permission is missing.
_IO_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def tool_flags(workdir_help: str, *, workdir_default: str | None = None,
               step: bool = False) -> flags.FlagValues:
  """New FlagValues with --workdir and, with `step`, --step (the checkpoint a tool restores)."""
  flag_values = flags.FlagValues()
  flags.DEFINE_string("workdir", workdir_default, workdir_help, flag_values=flag_values)
  if step:
    flags.DEFINE_string("step", "latest", "Checkpoint step to restore, or 'latest'.",
                        flag_values=flag_values)
  return flag_values


def step_error(step: str) -> str | None:
  """The usage error of a --step value that is neither 'latest' nor a step number, or None."""
  if step != "latest" and not step.isdigit():
    return f"--step must be a checkpoint step number or 'latest', got {step!r}"
  return None


def with_default_config(argv: Sequence[str], default: str) -> list[str]:
  """`argv` with --config=`default` put first when it names no --config.

  A tool with a default config passes its argv through this before `run_flags`: the flag library
  parses a default config and its --config.<key> flags as the flag is defined, where an unknown
  key is a traceback; named, they are checked first as any --config's are (`check_config_args`).
  """
  argv = list(argv)
  if _config_spec(argv) is not None:
    return argv
  return [*argv[:1], f"--config={default}", *argv[1:]]


def run_flags(argv: Sequence[str], config_help: str, workdir_help: str,
              config_default: str | None = None,
              workdir_default: str | None = None) -> flags.FlagValues:
  """`tool_flags` with --config too (a config file and its args, read from `argv`)."""
  flag_values = tool_flags(workdir_help, workdir_default=workdir_default)
  config_flags.DEFINE_config_file("config", config_default, config_help, flag_values=flag_values,
                                  lock_config=True, sys_argv=list(argv))
  return flag_values


def _config_spec(argv: Sequence[str]) -> str | None:
  """The value of --config in argv (path[:args]), or None."""
  for i, arg in enumerate(argv):
    if arg.startswith(("--config=", "-config=")):
      return arg.split("=", 1)[1]
    if arg in ("--config", "-config") and i + 1 < len(argv):
      return argv[i + 1]
  return None


def check_config_args(argv: Sequence[str]) -> str | None:
  """Checks --config's file, its args and every --config.<key>=<value> before the flag library.

  The flag library reports these with tracebacks or defers them; checking first gives one line
  naming the key and the valid keys. Returns that line, or None when all is well.
  """
  spec = _config_spec(argv)
  if spec is None:
    return None
  try:
    config = config_utils.load_config_file(spec)
    for arg in argv:
      if arg.startswith(("--config.", "-config.")):
        key, eq, value = arg.lstrip("-")[len("config."):].partition("=")
        default = config_utils.get_value(config, key)
        if eq:
          config_utils.parse_value(key, value, default)
  except UserError as e:
    return str(e)
  return None


# Flags naming a directory, resolved by every tool once its flags are parsed (`resolve_paths`).
PATH_FLAGS = ("workdir", "member", "export_to")


def resolve_path(path: str | os.PathLike) -> str:
  """`path` absolute, with '~', '..' and symbolic links resolved: the one form every tool hands
  on (orbax and tensorstore refuse a path with '..' in it)."""
  return str(pathlib.Path(os.path.expanduser(os.fspath(path))).resolve())


def resolve_paths(flag_values: flags.FlagValues) -> None:
  """Replaces the value of each PATH_FLAGS flag that is set with its `resolve_path`."""
  for name in PATH_FLAGS:
    if name in flag_values and flag_values[name].value:
      flag_values[name].value = resolve_path(flag_values[name].value)


def parse_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> str | None:
  """Parses argv into flag_values; returns None, or the one-line message of a usage error.

  With -h/--help among the arguments it prints the flags' help and exits with status 0. The
  directories of PATH_FLAGS come out resolved (`resolve_path`).
  """
  if any(arg in ("-h", "--help", "-help", "--helpfull") for arg in argv[1:]):
    print(f"usage: {argv[0] if argv else 'attnlab'} [flags]\n\n{flag_values.get_help()}")
    sys.exit(0)
  message = check_config_args(argv)
  if message is not None:
    return message
  try:
    extra = flag_values(list(argv))
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    return error_line(e)
  if len(extra) > 1:
    return f"unexpected arguments {extra[1:]}; pass options as --name=value"
  resolve_paths(flag_values)
  return None


def parse_tool(argv: Sequence[str] | None, module: str, flag_values: flags.FlagValues,
               check: Callable[[flags.FlagValues], str | None]) -> tuple[str, str | None]:
  """A tool's start: (its name, its usage error or None) after parsing `argv` (None: sys.argv)
  into `flag_values` and then, if that went well, `check(flag_values)`."""
  argv = list(sys.argv if argv is None else argv)
  message = parse_flags(flag_values, argv)
  return prog_name(argv, module), check(flag_values) if message is None else message


def prog_name(argv: Sequence[str], module: str) -> str:
  """"attnlab train" under the console script, the module name under `python -m`."""
  prog = argv[0] if argv else module
  return module if prog.endswith(".py") else prog


class _StderrHandler(logging.StreamHandler):
  """A StreamHandler on whatever `sys.stderr` is when a record comes, not the one at setup: a
  redirect or capture (and its closing) after `setup_logging` must not break later messages."""

  @property
  def stream(self) -> Any:
    return sys.stderr

  @stream.setter
  def stream(self, _: Any) -> None:
    pass  # StreamHandler.__init__ and setStream set it; the live sys.stderr wins


def _unraisable(unraisable: Any) -> None:
  """The tools' sys.unraisablehook: Python's own, less RuntimeError('Event loop is closed'), which
  tensorstore's threads report after a failed checkpoint read or write (the reads and writes still
  running then complete into the event loop that orbax closed when the first one failed)."""
  exc = unraisable.exc_value
  if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
    sys.__unraisablehook__(unraisable)


def setup_logging() -> None:
  """Progress messages of attnlab to stderr; other libraries only warn. A checkpoint read or write
  that fails is said in one line: the records of it that orbax's threads log (absl, with a
  traceback) and those of asyncio's failed futures are left out (CRITICAL only), and so are
  tensorstore's reports of it (`_unraisable`)."""
  logger = logging.getLogger("attnlab")
  if not logger.handlers:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  logger.propagate = False  # absl's first log call gives the root logger a handler too
  for name in ("absl", "asyncio"):
    logging.getLogger(name).setLevel(logging.CRITICAL)
  sys.unraisablehook = _unraisable


def launch(prog: str, usage_error: str | None, body: Callable[[], int | None]) -> int:
  """A command-line tool's end: its usage error in one line (status 2), or logging set up, the
  CPU tuning switched on (attnlab.backends.cpu.enable: the allocator; the trainer adds the device
  split of its config) and `body` run as `run_tool` runs it."""
  if usage_error is not None:
    print(f"{prog}: error: {usage_error}", file=sys.stderr)
    return USAGE_ERROR
  setup_logging()
  cpu_backend.enable()
  return run_tool(prog, body)


def run_tool(prog: str, body: Callable[[], int | None]) -> int:
  """Runs a command-line tool's body, turning user errors and stops into one line and a status."""
  try:
    return body() or 0
  except UserError as e:
    print(f"{prog}: error: {error_line(e)}", file=sys.stderr)
    return USAGE_ERROR
  except OSError as e:
    if e.errno not in _IO_ERRNOS:
      raise
    where = f" {e.filename}" if e.filename else ""
    verb = "could not write" if e.errno not in (errno.EACCES, errno.EPERM) else "no permission for"
    print(f"{prog}: error: {verb}{where} ({os.strerror(e.errno)})", file=sys.stderr)
    return IO_ERROR
  except Exception as e:
    if not isinstance(e, RunStopped):
      raise
    print(f"{prog}: {e}", file=sys.stderr)
    return e.exit_code
