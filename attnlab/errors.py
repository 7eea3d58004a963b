"""Every error a user can meet, at the bottom of the package (this module imports nothing).

Two families, each handled once by the command-line tools (`attnlab.cli.tool.run_tool`):
- `UserError` (a ValueError): bad input (a config key or value, a data file, a checkpoint that
  does not fit, a busy workdir). The tools print its message as one line, no traceback, and exit
  with status 2.
- `RunStopped` (a RuntimeError): a run that stopped early on purpose (NaN loss, a signal, a write
  the disk refused). The tools print the message and exit with `exit_code`; the last good
  checkpoint stays readable and the same command resumes.

A few modules still export some of them under the same names (`config_utils.ConfigError`,
`checkpoint.CheckpointError`, `data.DataError`, ...); new code imports them from here.
"""

from __future__ import annotations


class UserError(ValueError):
  """An error caused by the user's input; command-line tools print it as one line, no traceback."""


def error_line(exc: BaseException) -> str:
  """The one line to show for an exception: the innermost UserError's message if there is one."""
  chain, seen = [], set()
  node: BaseException | None = exc
  while node is not None and id(node) not in seen:
    seen.add(id(node))
    chain.append(node)
    node = node.__cause__ or node.__context__
  for item in reversed(chain):  # the original error, not the flag library's re-wrapping
    if isinstance(item, UserError) and not str(item).startswith("Error whilst parsing"):
      return str(item)
  lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
  return lines[0] if lines else type(exc).__name__


class ConfigError(UserError):
  """A config key, value or file that cannot be used."""


# ---------------------------------------------------------------------------------------------------
# Data


class DataError(UserError):
  """Bad data or a bad data request (malformed file, empty split, unknown name)."""


class DataFormatError(DataError):
  """A raw dataset file does not have the expected format; the message names file and line."""


class DatasetNotFoundError(DataError, FileNotFoundError):
  """A dataset's raw file is neither available locally nor downloadable."""


# ---------------------------------------------------------------------------------------------------
# Run directories and checkpoints


class ConfigMismatchError(UserError):
  """The workdir holds a run with a different config."""


class CheckpointError(UserError):
  """A checkpoint is missing, unreadable, or does not fit the model."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint's files cannot be read (a damaged or partial write)."""


class CheckpointWriteError(OSError):
  """A checkpoint could not be written (disk full, read-only directory); its partial directory
  was removed, the earlier checkpoints are untouched. `errno` is set when the cause is known."""

  def __init__(self, code: int | None, message: str):
    super().__init__(message)
    self.errno = code


class MetricsError(UserError):
  """A record of a run's metrics.jsonl that cannot be used; the message names the file and line."""


class WorkdirBusyError(UserError):
  """Another process holds the lock of the workdir (it is training there)."""


class DamagedCheckpoints(RuntimeError):
  """Some checkpoints of the run are damaged; `report` is the full text, the message one line."""
  exit_code = 1

  def __init__(self, message: str, report: str):
    super().__init__(message)
    self.report = report


# ---------------------------------------------------------------------------------------------------
# Imported checkpoints


class HFError(UserError):
  """A checkpoint folder that cannot be imported (or a run that cannot be exported)."""


class TorchFileError(UserError):
  """A file that is not a readable PyTorch state dict."""


# ---------------------------------------------------------------------------------------------------
# Training that stops early


class RunStopped(RuntimeError):
  """Training stopped early; the command-line tools print the message and exit with exit_code."""
  exit_code = 1


class NonFiniteLossError(RunStopped):
  """The loss became NaN or Inf; nothing was saved after the last good checkpoint."""


class WriteFailed(RunStopped):
  """A file of the run could not be written (disk full, read-only workdir); the checkpoints before
  it are intact and the same command resumes from the last of them once the disk takes writes."""


class TrainingInterrupted(RunStopped):
  """SIGTERM or SIGINT (Ctrl-C) arrived; a checkpoint was saved before stopping."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum
    self.exit_code = 128 + signum
