"""The run directory's own files: config.json, metrics.jsonl, provenance.jsonl and run.lock.

    workdir/
      config.json        the full resolved config of the run (checked when the run is resumed)
      metrics.jsonl      one JSON object per logged step and split (and one "early_stop"
                         record when early stopping ended the run)
      provenance.jsonl   one JSON line per start: package versions, host, git commit
      run.lock           held (flock) by the process training in the workdir; names its host and pid
      checkpoints/       orbax checkpoints (attnlab/checkpoint.py)
      tensorboard/       TensorBoard event files

One process at a time trains in a workdir: `WorkdirLock` refuses a second one with a line naming
the holder, and takes over the lock file of a holder that died (the kernel drops its flock).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import importlib.metadata
import json
import logging
import os
import pathlib
import platform
import socket
import subprocess
import time
from collections.abc import Iterable
from typing import Any

import jax
import ml_collections

from attnlab import checkpoint
from attnlab import config_utils
from attnlab import run_config
from attnlab.errors import CheckpointError
from attnlab.errors import ConfigMismatchError
from attnlab.errors import MetricsError
from attnlab.errors import WorkdirBusyError

_LOG = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
# One JSON line per start of the run: versions, host, git commit (`record_provenance`).
PROVENANCE_FILE = "provenance.jsonl"
LOCK_FILE = "run.lock"


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
    return run_config.from_jsonable(data)
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
                    json.dumps(run_config.to_jsonable(config), indent=2, sort_keys=True) + "\n")


def prepare_workdir(workdir: str | os.PathLike, config: ml_collections.ConfigDict) -> None:
  """Creates `workdir` and its config.json, refusing a workdir that holds a different config.

  A workdir without a finished checkpoint takes the new config: the earlier start stopped before
  saving one (a data error, a wrong init_from, a NaN at the first steps), so a run of either
  config starts from step 0 and nothing of it would be continued; a corrected re-run just works.
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  if (workdir / CONFIG_FILE).is_file():
    diff = run_config.config_diff(read_config(workdir).to_dict(), config)
    shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
    if diff and not checkpoint.finished_steps(workdir):
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


# The split of the record the trainer writes when early stopping ends a run (config.
# early_stop_patience): {"step": the step it stopped at, "split": "early_stop", "best_step",
# "best_loss", "patience"}.
EARLY_STOP_SPLIT = "early_stop"


def early_stop(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
  """The early-stop record of a run that early stopping ended (its last record of that split,
  with no train or eval record after it: a run resumed past it with a larger patience has none),
  else None."""
  records = list(records)
  stops = [r for r in records if r.get("split") == EARLY_STOP_SPLIT]
  if not stops:
    return None
  last = max(stops, key=lambda r: r["step"])
  if any(r["step"] > last["step"] for r in records if r.get("split") != EARLY_STOP_SPLIT):
    return None
  return last


def is_complete(workdir: str | os.PathLike, num_train_steps: int,
                records: Iterable[dict[str, Any]] | None = None) -> bool:
  """Whether the run reached its last step: the final evaluation (written after the final
  checkpoint) is in metrics.jsonl (or in `records`, when the caller has read them already), or
  early stopping ended it (`early_stop`)."""
  records = list(read_metrics(workdir) if records is None else records)
  last_eval = last_records(records).get("eval")
  return (last_eval is not None and last_eval["step"] >= num_train_steps) or (
      early_stop(records) is not None)


# ---------------------------------------------------------------------------------------------------
# provenance.jsonl


def record_provenance(workdir: str | os.PathLike) -> None:
  """Appends this start's time, software versions, host and git commit to provenance.jsonl."""
  with open(pathlib.Path(workdir) / PROVENANCE_FILE, "a", encoding="utf-8") as f:
    f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **provenance()}) + "\n")


def provenance() -> dict[str, Any]:
  """Python and package versions, the host, and the git commit of the attnlab checkout (None
  when attnlab is installed from a wheel), with `git_dirty` when it has uncommitted changes."""
  versions = {}
  for package in ("attnlab", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  source = pathlib.Path(__file__).resolve().parent
  commit = dirty = None
  try:
    git = lambda *args: subprocess.run(["git", "-C", str(source), *args], capture_output=True,
                                       text=True, timeout=10, check=True).stdout.strip()
    # Only attnlab's own checkout (not a repository that merely holds an installed copy).
    if pathlib.Path(git("rev-parse", "--show-toplevel")) / "attnlab" == source:
      commit = git("rev-parse", "HEAD")
      dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
  except (OSError, subprocess.SubprocessError):
    pass
  return {"host": platform.node(), "python": platform.python_version(), "packages": versions,
          "git_commit": commit, "git_dirty": dirty, "devices": str(jax.devices()[0].platform)}


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
