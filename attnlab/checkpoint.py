"""Checkpoints of a run, written and read by orbax's CheckpointManager.

    workdir/checkpoints/<step>/          item "state" (TrainState pytree) and item "meta" (JSON:
                                         step, data-iterator state, the shape/dtype of every leaf)
    workdir/checkpoints_corrupt/<step>/  unreadable checkpoints moved aside when a run resumes

orbax says what is finished: it writes a step under a temporary name and renames it when complete,
lists finalized steps only (`finished_steps`, `Checkpointer.steps`), and removes the temporary
directories of an interrupted save when it opens the directory for writing. Saves are synchronous
(`save` returns once the step is final), so a SIGKILL at any moment leaves only whole checkpoints
behind. A save the disk refuses (full, read-only) raises CheckpointWriteError and removes its
partial directory (what a writer thread still running leaves, orbax removes on the restart); the
checkpoints before it stay. The run directory's other files (config.json, metrics.jsonl,
provenance.jsonl, the lock) are attnlab/rundir.py's.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import re
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from attnlab.errors import CheckpointError
from attnlab.errors import CheckpointWriteError
from attnlab.errors import CorruptCheckpointError

_LOG = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "checkpoints_corrupt"
# orbax's step names ("<step>"); its find_all lists the finalized step directories only.
_NAMES = ocp.path.step.standard_name_format()
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
  """Steps of the finished checkpoints of a run, ascending: orbax's finalized step directories
  (a save in progress or refused is not one)."""
  return sorted(found.step for found in _NAMES.find_all(pathlib.Path(workdir) / CHECKPOINT_DIR))


def last_good_checkpoint(workdir: str | os.PathLike) -> str:
  """"the last good checkpoint is step N in DIR" (or that none was saved) for error messages."""
  steps = finished_steps(workdir)
  if not steps:
    return "no checkpoint had been saved yet"
  directory = pathlib.Path(workdir).absolute() / CHECKPOINT_DIR
  return f"the last good checkpoint is step {steps[-1]} in {directory}"


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


class _Unreadable(Exception):
  """What is wrong with a file of a checkpoint ("file F ..."), inside Checkpointer."""


class Checkpointer:
  """Saves and restores (TrainState, meta JSON) pairs under `directory/<step>/` with orbax's
  CheckpointManager; a context manager that closes it."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
               read_only: bool = False):
    self.directory = pathlib.Path(directory).absolute()
    if read_only and not self.directory.is_dir():
      raise CheckpointError(f"no checkpoints: {self.directory} does not exist (the run saved none "
                            f"yet; checkpoints are written every config.checkpoint_every steps)")
    # read_only here means "never create or clean up"; orbax's own read_only flag only warns.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=not read_only, enable_async_checkpointing=False,
        cleanup_tmp_directories=not read_only, step_name_format=_NAMES)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
        "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def steps(self) -> list[int]:
    """Steps of the finished checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def _step_dir(self, step: int) -> pathlib.Path:
    return self.directory / _NAMES.build_name(step)

  def save(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
    """Saves `state` (a pytree of arrays) and the data-iterator state as checkpoint `step`; a step
    at or before the latest one is not saved again (orbax's `should_save`: a stop request on a
    checkpoint step).

    Raises:
      CheckpointWriteError: the write failed (disk full, read-only directory, ...); orbax lists
        only finished steps, so the earlier checkpoints stay the newest.
    """
    meta = {"step": int(step), "data_iterator": data_state, "tree": tree_signature(state)}
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
      self._manager.wait_until_finished()
    except Exception as e:  # orbax and tensorstore raise many types for a refused write
      code = write_errno(e, self.directory)
      reason = os.strerror(code) if code is not None else f"{type(e).__name__}: {_short(str(e))}"
      self._discard_partial(step)
      raise CheckpointWriteError(code, f"could not write checkpoint step {step} in "
                                       f"{self.directory} ({reason})") from e

  def prune(self, keep: int, protect: tuple[int, ...] = ()) -> None:
    """Deletes the checkpoints but the newest `keep` and those of the steps in `protect` (a
    Checkpointer made with max_to_keep=None, whose caller decides: early stopping keeps the best
    evaluation's checkpoint however old)."""
    steps = self.steps()
    kept = set(steps[-keep:] if keep > 0 else []) | set(protect)
    for step in steps:
      if step not in kept:
        self._manager.delete(step)

  def _discard_partial(self, step: int) -> None:
    """Removes orbax's temporary directory of a refused save of `step`; what stays (on a read-only
    disk, or written by a writer thread still running) orbax removes when the run restarts."""
    try:
      self._manager.wait_until_finished()
    except Exception:  # pylint: disable=broad-except  (its other writes fail as the first did)
      pass
    for partial in ocp.path.step.all_temporary_paths(self.directory):
      if pathlib.Path(partial.get_final()) == self._step_dir(step):
        shutil.rmtree(partial.get(), ignore_errors=True)

  def _read_meta(self, step: int) -> dict[str, Any]:
    item = self._step_dir(step) / "meta"
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # orbax raises many types for a damaged file
      raise _Unreadable(f"file {item} is not readable JSON ({type(e).__name__}: "
                        f"{_short(str(e))})") from e
    if not (isinstance(meta, dict) and isinstance(meta.get("tree"), dict)
            and isinstance(meta.get("data_iterator"), dict)):
      raise _Unreadable(f"file {item} lacks the fields of a checkpoint")
    return meta

  def _read_state(self, step: int, abstract_state: Any) -> Any:
    try:
      return self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state))).state
    except Exception as e:
      file = _file_in_error(str(e)) or self._step_dir(step) / "state"
      raise _Unreadable(f"file {file}: {type(e).__name__}: {_short(str(e))}") from e

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
    try:
      meta = self._read_meta(step)
      diffs = signature_diffs(meta["tree"], tree_signature(abstract_state), "stored")
      if diffs:
        raise CheckpointError(
            f"checkpoint step {step} in {self.directory} does not fit the model built from the "
            f"config ({'; '.join(diffs[:3])}{' ...' if len(diffs) > 3 else ''}); the model "
            f"config changed since it was saved: use a new --workdir")
      return self._read_state(step, abstract_state), meta["data_iterator"]
    except _Unreadable as e:
      raise CorruptCheckpointError(f"checkpoint step {step} is unreadable: {e}") from e.__cause__

  def check(self, step: int) -> str | None:
    """None if checkpoint `step` reads back whole, else what is wrong with it (naming the file):
    its meta item is a checkpoint's and every array of its state restores as orbax stored it
    (onto the CPU; `restore` checks that they fit the model)."""
    try:
      self._read_meta(step)
      try:
        stored = self._manager.item_metadata(step).state
      except Exception as e:  # pylint: disable=broad-except  (a damaged metadata file)
        raise _Unreadable(f"file {self._step_dir(step) / 'state'}: {type(e).__name__}: "
                          f"{_short(str(e))}") from e
      cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
      self._read_state(step, jax.tree.map(
          lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=cpu), stored))
    except _Unreadable as e:
      return str(e)
    return None

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
