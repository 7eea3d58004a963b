"""The run directory: config.json, checkpoints/ (orbax), metrics.jsonl.

    workdir/
      config.json        the full resolved config of the run (checked when the run is resumed)
      checkpoints/<step>/ orbax checkpoints: item "state" (TrainState pytree) and item "meta" (JSON:
                         step, data-iterator state, and the shape/dtype of every state leaf)
      metrics.jsonl      one JSON object per logged step and split
      tensorboard/       TensorBoard event files
      checkpoints_corrupt/<step>/  unreadable checkpoints moved aside when a run resumes
      run.lock           held (flock) by the process training in the workdir; names its host and pid

Checkpoints are written synchronously (the call returns once the step directory is final), so a
SIGKILL at any moment leaves only whole checkpoints behind; orbax's temporary directories from an
interrupted save are removed when the run restarts. A save the disk refuses (full, read-only)
removes its partial directory and raises CheckpointWriteError; the checkpoints before it stay.

One process at a time trains in a workdir: `WorkdirLock` refuses a second one with a line naming
the holder, and takes over the lock file of a holder that died (the kernel drops its flock).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import gc
import json
import logging
import os
import pathlib
import re
import shutil
import socket
import sys
import time
import weakref
from collections.abc import Iterable
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from attnlab import config_utils
from attnlab.errors import CheckpointError
from attnlab.errors import CheckpointWriteError
from attnlab.errors import ConfigMismatchError
from attnlab.errors import CorruptCheckpointError
from attnlab.errors import MetricsError
from attnlab.errors import WorkdirBusyError

_LOG = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "checkpoints_corrupt"
LOCK_FILE = "run.lock"
# Suffix of orbax's directory for a checkpoint being written (renamed to <step> when complete).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
# errno values of a write the file system refuses: full, over quota, file too large, read-only.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
# errno values of a write refused for want of permission (counted as such inside a workdir only).
PERMISSION_ERRNOS = (errno.EACCES, errno.EPERM)


# ---------------------------------------------------------------------------------------------------
# Refused writes


def exception_chain(exc: BaseException) -> list[BaseException]:
  """`exc`, its cause (or context), that one's cause, ..."""
  chain, node = [], exc
  while node is not None and node not in chain:
    chain.append(node)
    node = node.__cause__ or node.__context__
  return chain


def write_errno(exc: BaseException, within: str | os.PathLike | None = None) -> int | None:
  """The errno of a write the file system refused (disk full, read-only, ...) behind `exc`, or None.

  Looks at the OSErrors in the exception chain and at the `[os_error_code='28']` that tensorstore
  (orbax's array writer) puts in its messages. A permission error counts only for a file inside
  `within` (the workdir), so that an unreadable input elsewhere is not mistaken for one.
  """
  for node in exception_chain(exc):
    code = node.errno if isinstance(node, OSError) else None
    if code is None:
      found = re.search(r"os_error_code='?(\d+)", str(node))
      code = int(found.group(1)) if found else None
    if code in DISK_ERRNOS:
      return code
    if code in PERMISSION_ERRNOS and within is not None:
      filename = getattr(node, "filename", None) or _file_in_error(str(node))
      if filename and pathlib.Path(os.path.abspath(filename)).is_relative_to(
          os.path.abspath(within)):
        return code
  return None


def finished_steps(workdir: str | os.PathLike) -> list[int]:
  """Steps of the finished checkpoints of a run, from the directory names (orbax's temporary
  directories of a save in progress or refused end in TMP_SUFFIX and are not counted)."""
  directory = pathlib.Path(workdir) / CHECKPOINT_DIR
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir()
                if p.is_dir() and p.name.isascii() and p.name.isdigit())  # not "²" (no int)


def last_good_checkpoint(workdir: str | os.PathLike) -> str:
  """"the last good checkpoint is step N in DIR" (or that none was saved) for error messages."""
  steps = finished_steps(workdir)
  if not steps:
    return "no checkpoint had been saved yet"
  directory = pathlib.Path(workdir).absolute() / CHECKPOINT_DIR
  return f"the last good checkpoint is step {steps[-1]} in {directory}"


# ---------------------------------------------------------------------------------------------------
# config.json


def read_config(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
  """The config stored in `workdir/config.json`."""
  path = pathlib.Path(workdir) / CONFIG_FILE
  if not path.is_file():
    what = "does not exist" if not pathlib.Path(workdir).exists() else f"has no {CONFIG_FILE}"
    raise CheckpointError(f"{workdir} {what}: give the --workdir of a run started with "
                          f"`attnlab train` (it writes {CONFIG_FILE} there)")
  try:
    data = json.loads(path.read_text())
  except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path} is not valid JSON ({e}); restore it from the run's launch "
                          f"command or remove the workdir") from None
  try:
    return config_utils.from_jsonable(data)
  except config_utils.ConfigError as e:
    problem = str(e)
  # Raised outside the handler, so that this line (naming the file) is the one the tools print.
  raise CheckpointError(f"{path}: {problem}")


def _write_atomically(path: pathlib.Path, text: str) -> None:
  """Writes `path` through a temporary file beside it: a crash leaves the old or the new text."""
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


def write_config(workdir: str | os.PathLike, config: ml_collections.ConfigDict) -> None:
  """Writes `workdir/config.json` atomically."""
  _write_atomically(pathlib.Path(workdir) / CONFIG_FILE,
                    json.dumps(config_utils.to_jsonable(config), indent=2, sort_keys=True) + "\n")


def prepare_workdir(workdir: str | os.PathLike, config: ml_collections.ConfigDict) -> None:
  """Creates `workdir` and its config.json, refusing a workdir that holds a different config.

  A workdir without a finished checkpoint takes the new config: the earlier start stopped before
  saving one (a data error, a wrong init_from, a NaN at the first steps), so a run of either
  config starts from step 0 and nothing of it would be continued; a corrected re-run just works.
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  if (workdir / CONFIG_FILE).is_file():
    diff = config_utils.config_diff(read_config(workdir).to_dict(), config)
    shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
    if diff and not finished_steps(workdir):
      _LOG.warning("workdir %s holds no checkpoint yet: starting it afresh with the new config "
                   "(%s)", workdir, shown)
    elif diff and not config.allow_config_change:
      raise ConfigMismatchError(
          f"workdir {workdir} holds a run with a different config ({shown}); use another "
          f"--workdir, or pass --config.allow_config_change=True to continue this run with the "
          f"new config")
    elif diff:
      _LOG.warning("config changed (allow_config_change=True): %s", "; ".join(diff))
  write_config(workdir, config)


# ---------------------------------------------------------------------------------------------------
# metrics.jsonl


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _record_problem(record: Any) -> str | None:
  """None if `record` (a parsed line) is a metrics record the readers can use, else what is wrong:
  a JSON object whose "step" is an int >= 0, whose "split" is a string, whose "per_seed" (if
  any) is {name: [a number per replica]}, "seeds" (if any) [an int per replica], and whose other
  values (the metrics, wall_time) are numbers (NaN included: a diverged loss is a number)."""
  if not isinstance(record, dict):
    return f"it is a JSON {type(record).__name__}, not a record (a JSON object)"
  step, split = record.get("step"), record.get("split")
  if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
    return f"'step' is {step!r:.40}, not a step number (an int >= 0)"
  if not isinstance(split, str):
    return f"'split' is {split!r:.40}, not a split name (a string such as \"eval\")"
  per_seed = record.get("per_seed")
  if per_seed is not None and not (isinstance(per_seed, dict) and all(
      isinstance(v, list) and all(map(_is_number, v)) for v in per_seed.values())):
    return f"'per_seed' is {per_seed!r:.40}, not {{name: [a number per seed]}}"
  seeds = record.get("seeds")
  if seeds is not None and not (isinstance(seeds, list) and all(
      isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
    return f"'seeds' is {seeds!r:.40}, not [a seed number per replica]"
  for key, value in record.items():
    if key not in ("step", "split", "per_seed", "seeds") and not _is_number(value):
      return f"{key!r:.40} is {value!r:.40}, not a number (every metric is one)"
  return None


def scan_metrics(workdir: str | os.PathLike) -> tuple[list[dict[str, Any]], list[str]]:
  """(the usable records of `workdir/metrics.jsonl`, "FILE line N: what is wrong" for each line
  that is not one), the one reader of the file: every other reader goes through it.

  A last line cut short by a crash (no newline, not JSON) is the normal mark of a killed run: it
  is left out and not counted as a problem (a resumed run rewrites the file without it). Lines
  that are not UTF-8, not JSON, or not a record (`_record_problem`: "step": "x", "split": [...])
  come from elsewhere and are reported.
  """
  path = pathlib.Path(workdir) / METRICS_FILE
  if not path.is_file():
    return [], []
  lines = path.read_bytes().split(b"\n")
  records, problems = [], []
  for number, raw in enumerate(lines, start=1):
    if not raw.strip():
      continue
    torn = number == len(lines)  # the text after the last newline (the writer's are ASCII)
    try:
      record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      problem = f"it is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
    except (json.JSONDecodeError, RecursionError) as e:
      if torn:
        continue
      problem = f"it is not JSON ({type(e).__name__}: {str(e)[:80]})"
    else:
      problem = _record_problem(record)
    if problem is None:
      records.append(record)
    else:
      problems.append(f"{path} line {number}: {problem}")
  return records, problems


# The problems read_metrics has warned about already (the same file is read many times a run:
# by is_complete, the summaries, a plateau watch that polls it): each one is logged once.
_WARNED: set[str] = set()


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """All usable records of `workdir/metrics.jsonl` (`scan_metrics`); each bad line is left out
  with a warning naming it (once): a report or summary goes on from the others."""
  records, problems = scan_metrics(workdir)
  for problem in problems:
    if problem not in _WARNED:
      _WARNED.add(problem)
      _LOG.warning("%s; line left out", problem)
  return records


def truncate_metrics(workdir: str | os.PathLike, last_step: int) -> None:
  """Keeps the records with step <= last_step (a resumed run rewrites the steps after it).

  Raises:
    MetricsError: a line of the file is not a record (`scan_metrics`). The file is left as it is:
      rewriting it would drop that line, which may be saved data.
  """
  path = pathlib.Path(workdir) / METRICS_FILE
  if not path.is_file():
    return
  records, problems = scan_metrics(workdir)
  if problems:
    more = "" if len(problems) == 1 else f" (and {len(problems) - 1} more line" + (
        "s)" if len(problems) > 2 else ")")
    raise MetricsError(f"{problems[0]}{more}; the file is left as it is: fix or delete that line "
                       f"(the run rewrites this file when it resumes), then run again")
  kept = [r for r in records if r["step"] <= last_step]
  _write_atomically(path, "".join(json.dumps(r) + "\n" for r in kept))


def last_records(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """{split: the record with the highest step of that split}."""
  last: dict[str, dict[str, Any]] = {}
  for record in records:
    split = record.get("split", "")
    if split not in last or record["step"] >= last[split]["step"]:
      last[split] = record
  return last


def is_complete(workdir: str | os.PathLike, num_train_steps: int,
                records: Iterable[dict[str, Any]] | None = None) -> bool:
  """Whether the run reached its last step: the final evaluation (written after the final
  checkpoint) is in metrics.jsonl (or in `records`, when the caller has read them already)."""
  records = read_metrics(workdir) if records is None else records
  last_eval = last_records(records).get("eval")
  return last_eval is not None and last_eval["step"] >= num_train_steps


# ---------------------------------------------------------------------------------------------------
# checkpoints/


def tree_signature(tree: Any) -> dict[str, str]:
  """{leaf path: "dtype[shape]"} of a pytree of arrays or ShapeDtypeStructs."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
          for path, leaf in leaves}


def signature_diffs(got: dict[str, str], wanted: dict[str, str], what: str) -> list[str]:
  """"path: <what> dtype[shape], model dtype[shape]" for each leaf where two signatures differ."""
  return [f"{k}: {what} {got.get(k, 'absent')}, model {wanted.get(k, 'absent')}"
          for k in sorted(set(got) | set(wanted)) if got.get(k) != wanted.get(k)]


def _file_in_error(message: str) -> str | None:
  found = re.findall(r'local file "([^"]+)"', message)
  return found[-1] if found else None


def _short(message: str, limit: int = 300) -> str:
  """The first line of an orbax/tensorstore error without its long spec dump."""
  message = re.split(r"\s*\[tensorstore_spec", message)[0].strip()
  message = message.splitlines()[0] if message else message
  return message if len(message) <= limit else message[:limit] + "..."


def _is_closed_loop_error(exc: BaseException | None) -> bool:
  return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


# The loggers orbax's threads log a failed read or write through.
_NOISY_LOGGERS = ("absl", "asyncio")
# How asyncio's record of a failed future that nobody awaited begins: "<its class> exception was
# never retrieved" (Future, Task, _GatheringFuture for asyncio.gather, ...).
_UNRETRIEVED = re.compile(r"\w+ exception was never retrieved")
# orbax's package folder: a future's error whose traceback passes through it came from orbax.
_ORBAX_DIR = os.path.dirname(os.path.abspath(ocp.__file__)) + os.sep


def _is_noise(record: logging.LogRecord) -> bool:
  """A record of orbax's threads' failure (absl) or of a failed future nobody awaited (asyncio)."""
  message = str(record.msg)
  return ("_SignalingThread.run() raised an exception" in message
          or _UNRETRIEVED.match(message) is not None)


def _raised_in_orbax(exc: BaseException | None) -> bool:
  """Whether `exc`, or an error in its cause/context chain, passed through orbax's code."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    tb = exc.__traceback__
    while tb is not None:
      if tb.tb_frame.f_code.co_filename.startswith(_ORBAX_DIR):
        return True
      tb = tb.tb_next
    exc = exc.__cause__ or exc.__context__
  return False


class _FailedIoNoiseFilter:
  """Drops exactly the noise orbax's threads print when a checkpoint read or write fails, while
  it is installed (a Checkpointer installs one when it opens and removes it when it closes):

  - absl records "_SignalingThread.run() raised an exception" (the failure with its traceback);
  - asyncio records "Future/Task exception was never retrieved" (orbax's other futures fail too);
  - "RuntimeError: Event loop is closed" through sys.unraisablehook, or sys.excepthook when
    tensorstore's thread prints it (its pending callbacks hit orbax's closed asyncio loop).

  The caller reports the failure in one line. The hooks chain to the ones that were there (every
  other error, and every error once removed, reaches them); `remove` puts those back, unless a
  later hook was installed over this one: then this one stays in the chain and passes all on.
  """

  def __init__(self):
    self._installed = False
    self._previous_unraisable: Any = None
    self._previous_except: Any = None
    # One object each, so that `sys.excepthook is self._except_hook` finds them again.
    self._unraisable_hook = self._on_unraisable
    self._except_hook = self._on_exception

  def filter(self, record: logging.LogRecord) -> bool:
    """The log filter (of the absl and asyncio loggers) that drops the noise records."""
    return not _is_noise(record)

  def _on_unraisable(self, unraisable: Any) -> None:
    if not (self._installed and _is_closed_loop_error(unraisable.exc_value)):
      self._previous_unraisable(unraisable)

  def _on_exception(self, exc_type: Any, exc: BaseException, tb: Any) -> None:
    if not (self._installed and _is_closed_loop_error(exc)):
      self._previous_except(exc_type, exc, tb)

  def install(self) -> None:
    if self._installed:
      return
    for logger in _NOISY_LOGGERS:
      logging.getLogger(logger).addFilter(self)
    self._previous_unraisable, self._previous_except = sys.unraisablehook, sys.excepthook
    sys.unraisablehook, sys.excepthook = self._unraisable_hook, self._except_hook
    self._installed = True

  def remove(self) -> None:
    if not self._installed:
      return
    self._installed = False
    for logger in _NOISY_LOGGERS:
      logging.getLogger(logger).removeFilter(self)
    if sys.unraisablehook is self._unraisable_hook:
      sys.unraisablehook = self._live_hook(self._previous_unraisable, "_previous_unraisable")
    if sys.excepthook is self._except_hook:
      sys.excepthook = self._live_hook(self._previous_except, "_previous_except")

  @staticmethod
  def _live_hook(hook: Any, previous: str) -> Any:
    """`hook`, or the first hook below it that is not a removed filter's (filters removed out of
    order leave no pass-through behind once the hooks above them are gone)."""
    owner = getattr(hook, "__self__", None)
    while isinstance(owner, _FailedIoNoiseFilter) and not owner._installed:
      hook = getattr(owner, previous)
      owner = getattr(hook, "__self__", None)
    return hook


class _EchoesOfFailedIo(logging.Filter):
  """Once a checkpoint read or write has failed (and been reported), drops the noise records
  (`_is_noise`) of errors that came out of orbax's code or name a failed directory.

  orbax reads and writes each array (and each small file) in its own future; the first failure is
  reported, and the others are collected whenever their writer thread lets go of them, which can
  be after the Checkpointer closed (its `_FailedIoNoiseFilter` is gone by then). Not all of them
  name the directory (a refused `write_text` fails with a bare "[Errno 28]"), hence the traceback
  test. Stays on the absl and asyncio loggers for good; until a failure it drops nothing.
  """

  def __init__(self):
    super().__init__()
    # Replaced, never changed in place: a collection in another thread iterates a whole set.
    self.directories: frozenset[str] = frozenset()

  def filter(self, record: logging.LogRecord) -> bool:
    if not (self.directories and _is_noise(record)):
      return True
    exc = record.exc_info[1] if record.exc_info else None
    text = record.getMessage() + ("" if exc is None else str(exc))
    return not (_raised_in_orbax(exc) or any(directory in text for directory in self.directories))

  def add(self, directory: pathlib.Path) -> None:
    if not self.directories:
      for logger in _NOISY_LOGGERS:
        logging.getLogger(logger).addFilter(self)
    self.directories = self.directories | {str(directory)}


_ECHOES = _EchoesOfFailedIo()


class Checkpointer:
  """Saves and restores (TrainState, meta JSON) pairs under `directory/<step>/` with orbax.

  While it is open (until `close`, or the end of a `with` block), the noise orbax's threads print
  when a read or write fails is dropped (`_FailedIoNoiseFilter`): the failure is raised once.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
               read_only: bool = False):
    self.directory = pathlib.Path(directory).absolute()
    if read_only and not self.directory.is_dir():
      raise CheckpointError(f"no checkpoints: {self.directory} does not exist (the run saved none "
                            f"yet; checkpoints are written every config.checkpoint_every steps)")
    # read_only here means "never create or clean up"; orbax's own read_only flag only warns.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=not read_only, enable_async_checkpointing=False,
        cleanup_tmp_directories=not read_only)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "meta"))
    # Installed before any save starts: the callbacks can fire before the failure is raised.
    self._noise_filter = _FailedIoNoiseFilter()
    self._noise_filter.install()
    # Removed by `close`, or when the Checkpointer is collected unclosed (at most once either way):
    # a dropped one must not leave its filter on the loggers for good.
    self._remove_noise_filter = weakref.finalize(self, self._noise_filter.remove)
    self._failed = False

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def steps(self) -> list[int]:
    """Steps of the finished checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
    """Saves `state` (a pytree of arrays) and the data-iterator state as checkpoint `step`.

    Raises:
      CheckpointWriteError: the write failed (disk full, read-only directory, ...); the partial
        directory is removed, so the earlier checkpoints stay the newest.
    """
    meta = {"step": int(step), "data_iterator": data_state, "tree": tree_signature(state)}
    if step in self._manager.all_steps():
      return  # already saved (e.g. a stop request on a checkpoint step)
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
      self._manager.wait_until_finished()
    except Exception as e:  # orbax and tensorstore raise many types for a refused write
      code = write_errno(e, self.directory)
      reason = os.strerror(code) if code is not None else f"{type(e).__name__}: {_short(str(e))}"
      self._fail()
      self._discard_partial(step)
      raise CheckpointWriteError(code, f"could not write checkpoint step {step} in "
                                       f"{self.directory} ({reason})") from e

  def _fail(self) -> None:
    """Marks a failed read or write: its other futures' errors are echoes, dropped even after
    `close` (`_EchoesOfFailedIo`)."""
    self._failed = True
    _ECHOES.add(self.directory)

  def _discard_partial(self, step: int) -> None:
    """Removes what a refused save of `step` left (on a read-only disk it stays, and the next run
    removes it); a finished checkpoint of that step, if orbax got that far, is kept."""
    try:  # orbax's other write threads may still be failing: let them end before removing
      self._manager.wait_until_finished()
    except Exception:  # pylint: disable=broad-except  (they fail as the first write did)
      pass
    for _ in range(20):  # a tensorstore writer may outlive the futures: remove until none is left
      partial = list(self.directory.glob(f"{step}{TMP_SUFFIX}*"))
      if not partial:
        break
      for path in partial:
        shutil.rmtree(path, ignore_errors=True)
      time.sleep(0.05)
    try:
      self._manager.reload()
    except Exception:  # pylint: disable=broad-except  (the listing is re-read on the next call)
      pass

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """(state, data-iterator state) of checkpoint `step`, restored into `abstract_state`.

    Raises:
      CorruptCheckpointError: a file is unreadable (the message names the step and the file).
      CheckpointError: the step does not exist, or the stored arrays do not fit `abstract_state`
        (the model changed).
    """
    steps = self.steps()
    if step not in steps:
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available steps: "
                            f"{', '.join(map(str, steps)) or 'none'}")
    step_dir = self.directory / str(step)

    def unreadable(file: Any, e: Exception) -> CorruptCheckpointError:
      return CorruptCheckpointError(f"checkpoint step {step} is unreadable: file {file}: "
                                    f"{type(e).__name__}: {_short(str(e))}")
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      if not (isinstance(meta, dict) and isinstance(meta.get("tree"), dict)
              and isinstance(meta.get("data_iterator"), dict)):
        raise ValueError("item 'meta' lacks the state signature or the data-iterator state")
    except Exception as e:  # orbax raises many types for a damaged file
      raise unreadable(step_dir / "meta" / "metadata", e) from e
    diffs = signature_diffs(meta["tree"], tree_signature(abstract_state), "stored")
    if diffs:
      raise CheckpointError(
          f"checkpoint step {step} in {self.directory} does not fit the model built from the "
          f"config ({'; '.join(diffs[:3])}{' ...' if len(diffs) > 3 else ''}); the model config "
          f"changed since it was saved: use a new --workdir")
    try:
      state = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state))).state
    except Exception as e:
      self._fail()
      time.sleep(0.2)  # let those callbacks fail now, under the filter, not at interpreter exit
      raise unreadable(_file_in_error(str(e)) or step_dir / "state", e) from e
    return state, meta["data_iterator"]

  def restore_latest(self, abstract_state: Any, *, quarantine: bool = False
                     ) -> tuple[Any, dict[str, Any]] | None:
    """The newest readable checkpoint as (state, data state), or None when there is none.

    An unreadable checkpoint is reported (step and file) and the previous one is tried; with
    `quarantine=True` (training) it is moved to `../checkpoints_corrupt/<step>` so that the run can
    save that step again. A checkpoint that does not fit the model is an error, not skipped.
    """
    for step in reversed(self.steps()):
      try:
        return self.restore(step, abstract_state)
      except CorruptCheckpointError as e:
        where = self._quarantine(step) if quarantine else ""
        _LOG.warning("%s%s; falling back to the previous checkpoint", e, where)
    return None

  def _quarantine(self, step: int) -> str:
    target = self.directory.parent / CORRUPT_DIR / str(step)
    if target.exists():
      shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(self.directory / str(step)), str(target))
    self._manager.reload()
    return f" (moved to {target})"

  def close(self) -> None:
    """Closes orbax's manager and removes the noise filter (the hooks that were there return);
    after a failed read or write, `_EchoesOfFailedIo` still drops its late futures' records."""
    try:
      self._manager.close()
    finally:
      if self._failed:  # the failed read's or write's unread futures: logged now, under the filter
        gc.collect()
      self._remove_noise_filter()


# ---------------------------------------------------------------------------------------------------
# Checking a checkpoint's files


# Files every finished checkpoint has (relative to checkpoints/<step>/); the JSON ones are parsed.
_JSON_FILES = ("_CHECKPOINT_METADATA", "meta/metadata", "state/_METADATA")
REQUIRED_FILES = _JSON_FILES + ("state/manifest.ocdbt",)


def missing_file(step_dir: str | os.PathLike) -> pathlib.Path | None:
  """The first file of REQUIRED_FILES that the checkpoint in `step_dir` lacks (None: all there)."""
  return next((pathlib.Path(step_dir) / name for name in REQUIRED_FILES
               if not (pathlib.Path(step_dir) / name).is_file()), None)


def check_files(step_dir: str | os.PathLike) -> str | None:
  """None if the checkpoint in `step_dir` is complete and readable, else what is wrong with it.

  Complete: every file of REQUIRED_FILES is there; readable: its JSON files parse and every value
  of its array store (tensorstore OCDBT: the B-tree index and the data files it points to) reads
  back whole. The arrays are not decoded: `attnlab inspect --verify` restores them too.
  """
  step_dir = pathlib.Path(step_dir)
  missing = missing_file(step_dir)
  if missing is not None:
    return f"file {missing} is missing"
  for name in _JSON_FILES:
    try:
      data = json.loads((step_dir / name).read_bytes())
    except (OSError, ValueError, RecursionError) as e:
      return f"file {step_dir / name} is not readable JSON ({type(e).__name__}: {_short(str(e))})"
    if not isinstance(data, dict) or (name == "meta/metadata" and not (
        isinstance(data.get("tree"), dict) and isinstance(data.get("data_iterator"), dict))):
      return f"file {step_dir / name} lacks the fields of a checkpoint"
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  state_dir = str((step_dir / "state").absolute()) + os.sep
  try:
    store = ts.KvStore.open({"driver": "ocdbt",
                             "base": {"driver": "file", "path": state_dir}}).result()
    keys = store.list().result()
    for key in keys:
      store.read(key).result()
  except Exception as e:  # tensorstore raises ValueError and others for damaged files
    file = _file_in_error(str(e)) or state_dir
    return f"file {file} is unreadable ({_short(str(e))})"
  if not keys:
    return f"the array store in {state_dir} is empty"
  return None


# ---------------------------------------------------------------------------------------------------
# One run per workdir


class WorkdirLock:
  """Exclusive use of a run directory: `with WorkdirLock(workdir): ...train...`.

  The lock is an flock on workdir/run.lock, which holds the holder's host, pid and start time. The
  kernel drops an flock when its process ends, however it ends, so a lock file still naming a
  process whose flock is gone is stale: the next run takes it over and logs whose it was. Locks
  are per open file, so even a second lock in the same process is refused. On a file system
  without flock, the file is created exclusively instead and a holder on this host whose pid no
  longer runs counts as stale.
  """

  def __init__(self, workdir: str | os.PathLike):
    self.path = pathlib.Path(workdir).absolute() / LOCK_FILE
    self._fd: int | None = None
    self._flock = True

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc: Any) -> None:
    self.release()

  @staticmethod
  def describe(holder: dict[str, Any] | None) -> str:
    """"pid 123 on host h, since 2024-01-01T12:00:00" for a lock file's contents."""
    if not holder:
      return "a process that left no name in the lock file"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since "
            f"{holder.get('since', '?')}")

  def _read(self, fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", "replace").strip()
    try:
      holder = json.loads(text) if text else None
    except json.JSONDecodeError:
      return {"host": "?", "pid": text[:40]}
    return holder if isinstance(holder, dict) else None

  def _busy(self, holder: dict[str, Any] | None) -> WorkdirBusyError:
    return WorkdirBusyError(
        f"workdir {self.path.parent} is in use by another run ({self.describe(holder)}; lock file "
        f"{self.path}); wait for it to finish or stop it, or use another --workdir")

  def acquire(self) -> None:
    """Takes the lock (creating the workdir) or raises WorkdirBusyError naming the holder."""
    self.path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = self._read(fd)
      os.close(fd)
      raise self._busy(holder) from None
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        raise
      self._acquire_without_flock()
      return
    self._fd = fd
    self._take_over(self._read(fd))
    try:
      self._write_me()
    except OSError:
      self.release()
      raise

  def _acquire_without_flock(self) -> None:
    self._flock = False
    for _ in range(2):
      try:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._write_me()
        return
      except FileExistsError:
        fd = os.open(self.path, os.O_RDONLY)
        try:
          holder = self._read(fd)
        finally:
          os.close(fd)
        if not self._is_dead(holder):
          raise self._busy(holder) from None
        self._take_over(holder)
        self.path.unlink(missing_ok=True)
    raise self._busy(None)

  @staticmethod
  def _is_dead(holder: dict[str, Any] | None) -> bool:
    """Whether the holder is a process of this host that no longer runs (others: unknown)."""
    if not holder or holder.get("host") != socket.gethostname():
      return not holder
    try:
      os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
      return True
    except (OSError, ValueError, KeyError, TypeError):
      return False
    return False

  def _take_over(self, holder: dict[str, Any] | None) -> None:
    if holder:
      _LOG.warning("taking over the stale lock %s of %s, which has ended", self.path,
                   self.describe(holder))

  def _write_me(self) -> None:
    try:
      os.ftruncate(self._fd, 0)
      os.lseek(self._fd, 0, os.SEEK_SET)
      me = {"host": socket.gethostname(), "pid": os.getpid(),
            "since": datetime.datetime.now().isoformat(timespec="seconds")}
      os.write(self._fd, (json.dumps(me) + "\n").encode())
      os.fsync(self._fd)
    except OSError as e:
      raise OSError(e.errno, e.strerror, str(self.path)) from e

  def release(self) -> None:
    """Empties the lock file (an empty one is not stale) and drops the lock."""
    if self._fd is None:
      return
    try:
      if self._flock:
        os.ftruncate(self._fd, 0)
      else:
        self.path.unlink(missing_ok=True)
    except OSError:
      pass  # a full or read-only disk: the flock still goes with the file descriptor
    finally:
      if self._flock:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None
