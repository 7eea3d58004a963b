"""The run directory: config.json, checkpoints/ (orbax), metrics.jsonl.

    workdir/
      config.json        the full resolved config of the run (checked when the run is resumed)
      checkpoints/<step>/ orbax checkpoints: item "state" (TrainState pytree) and item "meta" (JSON:
                         step, data-iterator state, and the shape/dtype of every state leaf)
      metrics.jsonl      one JSON object per logged step and split
      tensorboard/       TensorBoard event files
      checkpoints_corrupt/<step>/  unreadable checkpoints moved aside when a run resumes

Checkpoints are written synchronously (the call returns once the step directory is final), so a
SIGKILL at any moment leaves only whole checkpoints behind; orbax's temporary directories from an
interrupted save are removed when the run restarts.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import shutil
import sys
import time
from collections.abc import Iterable
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from attnlab import config_utils
from attnlab.config_utils import UserError

_LOG = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "checkpoints_corrupt"


class ConfigMismatchError(UserError):
  """The workdir holds a run with a different config."""


class CheckpointError(UserError):
  """A checkpoint is missing, unreadable, or does not fit the model."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint's files cannot be read (a damaged or partial write)."""


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
    return config_utils.from_jsonable(json.loads(path.read_text()))
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path} is not valid JSON ({e}); restore it from the run's launch "
                          f"command or remove the workdir") from None


def write_config(workdir: str | os.PathLike, config: ml_collections.ConfigDict) -> None:
  """Writes `workdir/config.json` atomically."""
  path = pathlib.Path(workdir) / CONFIG_FILE
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(config_utils.to_jsonable(config), indent=2, sort_keys=True) + "\n")
  os.replace(tmp, path)


def prepare_workdir(workdir: str | os.PathLike, config: ml_collections.ConfigDict) -> None:
  """Creates `workdir` and its config.json, refusing a workdir that holds a different config."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  if (workdir / CONFIG_FILE).is_file():
    diff = config_utils.config_diff(read_config(workdir).to_dict(), config)
    if diff and not config.allow_config_change:
      shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
      raise ConfigMismatchError(
          f"workdir {workdir} holds a run with a different config ({shown}); use another "
          f"--workdir, or pass --config.allow_config_change=True to continue this run with the "
          f"new config")
    if diff:
      _LOG.warning("config changed (allow_config_change=True): %s", "; ".join(diff))
  write_config(workdir, config)


# ---------------------------------------------------------------------------------------------------
# metrics.jsonl


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """All records of `workdir/metrics.jsonl` (a line cut short by a crash is skipped)."""
  path = pathlib.Path(workdir) / METRICS_FILE
  if not path.is_file():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict) and "step" in record:
      records.append(record)
  return records


def truncate_metrics(workdir: str | os.PathLike, last_step: int) -> None:
  """Keeps the records with step <= last_step: a resumed run rewrites the steps after its checkpoint."""
  path = pathlib.Path(workdir) / METRICS_FILE
  if not path.is_file():
    return
  kept = [r for r in read_metrics(workdir) if r["step"] <= last_step]
  tmp = path.with_suffix(".jsonl.tmp")
  tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
  os.replace(tmp, path)


def last_records(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """{split: the record with the highest step of that split}."""
  last: dict[str, dict[str, Any]] = {}
  for record in records:
    split = record.get("split", "")
    if split not in last or record["step"] >= last[split]["step"]:
      last[split] = record
  return last


def is_complete(workdir: str | os.PathLike, num_train_steps: int) -> bool:
  """Whether the run reached its last step: the final evaluation (written after the final
  checkpoint) is in metrics.jsonl."""
  last_eval = last_records(read_metrics(workdir)).get("eval")
  return last_eval is not None and last_eval["step"] >= num_train_steps


# ---------------------------------------------------------------------------------------------------
# checkpoints/


def tree_signature(tree: Any) -> dict[str, str]:
  """{leaf path: "dtype[shape]"} of a pytree of arrays or ShapeDtypeStructs."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
          for path, leaf in leaves}


def _file_in_error(message: str) -> str | None:
  found = re.findall(r'local file "([^"]+)"', message)
  return found[-1] if found else None


def _short(message: str, limit: int = 300) -> str:
  """The first line of an orbax/tensorstore error without its long spec dump."""
  message = re.split(r"\s*\[tensorstore_spec", message)[0].strip()
  message = message.splitlines()[0] if message else message
  return message if len(message) <= limit else message[:limit] + "..."


def _silence_closed_loop_noise() -> None:
  """After a failed read, orbax's pending tensorstore callbacks hit a closed asyncio loop and print
  "RuntimeError: Event loop is closed" tracebacks; drop exactly those (others go to the old hook)."""
  previous = sys.unraisablehook
  if getattr(previous, "_attnlab_filter", False):
    return

  def hook(unraisable: Any) -> None:
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
      return
    previous(unraisable)
  hook._attnlab_filter = True  # pytype: disable=attribute-error
  sys.unraisablehook = hook


class Checkpointer:
  """Saves and restores (TrainState, meta JSON) pairs under `directory/<step>/` with orbax."""

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

  def steps(self) -> list[int]:
    """Steps of the finished checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
    """Saves `state` (a pytree of arrays) and the data-iterator state as checkpoint `step`."""
    meta = {"step": int(step), "data_iterator": data_state, "tree": tree_signature(state)}
    if step in self._manager.all_steps():
      return  # already saved (e.g. a stop request on a checkpoint step)
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def _step_dir(self, step: int) -> pathlib.Path:
    return self.directory / str(step)

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
    step_dir = self._step_dir(step)
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      if not isinstance(meta, dict) or "tree" not in meta:
        raise ValueError("item 'meta' lacks the state signature")
    except Exception as e:  # orbax raises many types for a damaged file
      file = step_dir / "meta" / "metadata"
      raise CorruptCheckpointError(f"checkpoint step {step} is unreadable: file {file}: "
                                   f"{type(e).__name__}: {_short(str(e))}") from e
    wanted = tree_signature(abstract_state)
    if meta["tree"] != wanted:
      raise CheckpointError(_mismatch_message(step, step_dir, meta["tree"], wanted))
    try:
      state = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state))).state
    except Exception as e:
      _silence_closed_loop_noise()
      time.sleep(0.2)  # let those callbacks fail now, under the filter, not at interpreter exit
      file = _file_in_error(str(e)) or str(step_dir / "state")
      raise CorruptCheckpointError(f"checkpoint step {step} is unreadable: file {file}: "
                                   f"{type(e).__name__}: {_short(str(e))}") from e
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
    shutil.move(str(self._step_dir(step)), str(target))
    self._manager.reload()
    return f" (moved to {target})"

  def close(self) -> None:
    self._manager.close()


def _mismatch_message(step: int, step_dir: pathlib.Path, stored: dict[str, str],
                      wanted: dict[str, str]) -> str:
  diffs = [f"{k}: stored {stored.get(k, 'absent')}, model {wanted.get(k, 'absent')}"
           for k in sorted(set(stored) | set(wanted)) if stored.get(k) != wanted.get(k)]
  return (f"checkpoint step {step} in {step_dir.parent} does not fit the model built from the "
          f"config ({'; '.join(diffs[:3])}{' ...' if len(diffs) > 3 else ''}); the model config "
          f"changed since it was saved: use a new --workdir")
