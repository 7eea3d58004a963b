"""Reload a finished (or running) run to study its attention.

  run = load_run("runs/nw")                 # config, task, model, params of the latest checkpoint
  run = load_run("runs/nw", step=100)        # a given checkpoint
  maps = attention_maps(run, queries, keys, values)   # {module path: weights} sown by the model
  records = read_metrics("runs/nw")          # metrics.jsonl as a list of dicts

The caller never sees the checkpoint layout: the model is rebuilt from config.json and the
parameters are restored into its abstract shapes.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import jax
import ml_collections

from attnlab import checkpoint
from attnlab import state as state_lib
from attnlab import tasks
from attnlab.layers import sown
from attnlab.rundir import read_metrics  # re-exported for analysis scripts

__all__ = ["Run", "attention_maps", "few_steps_warning", "load_run", "read_metrics"]

# A checkpoint of fewer training steps than this is "barely trained" (few_steps_warning).
FEW_STEPS = 200


@dataclasses.dataclass
class Run:
  """A reloaded run."""
  workdir: pathlib.Path
  # The run's full config (from config.json).
  config: ml_collections.ConfigDict
  # The task built from the config (data, loss, evaluate, plots).
  task: tasks.Task
  # The Flax module (task.model), or None for tasks without one.
  model: Any
  # The restored parameters: model.apply({"params": params}, ...).
  params: Any
  # The checkpoint step they come from.
  step: int
  # For a run of several vmapped seeds (config.num_seeds > 1): the replica whose params these are
  # (seed = config.seed + replica), or None when params keep the leading [num_seeds] axis.
  replica: int | None = None


def load_run(workdir: str | os.PathLike, step: int | str = "latest",
             replica: int | None = 0) -> Run:
  """The config, model and parameters of checkpoint `step` ("latest" or an int) of a run.

  A run of several seeds in one program (config.num_seeds = N > 1) stores params with a leading
  [N] axis: `replica` picks one (0..N-1, seed = config.seed + replica) so `model.apply` works as
  for a single-seed run; `replica=None` keeps them all.

  "latest" is the run's result: its newest checkpoint, or for a run that early stopping ended
  (config.early_stop_patience), its best evaluation's. With "latest", an unreadable newest
  checkpoint is reported and the previous one is used.
  Raises:
    checkpoint.CheckpointError (a ValueError): no run there, no such step, no readable checkpoint,
      or a checkpoint that does not fit the model in config.json.
  """
  restored = state_lib.restore(workdir, step)
  config, task = restored.config, restored.task
  params, num_seeds = restored.state.params, state_lib.num_seeds_of(config)
  if num_seeds == 1:
    replica = None
  elif replica is not None:
    if not 0 <= replica < num_seeds:
      raise checkpoint.CheckpointError(
          f"replica must be in 0..{num_seeds - 1} (the run trained num_seeds={num_seeds}), "
          f"got {replica}")
    params = jax.tree.map(lambda x: x[replica], params)
  return Run(workdir=restored.workdir, config=config, task=task, model=task.model, params=params,
             step=restored.step, replica=replica)


def few_steps_warning(run: Run) -> str | None:
  """A line warning that `run`'s checkpoint trained for very few steps (fewer than FEW_STEPS, a
  runlocal run), whose outputs are therefore close to random; None for a trained run, and for
  weights trained elsewhere (an imported checkpoint: import_hf.json; `config.init_from`)."""
  if run.step >= FEW_STEPS or run.config.get("init_from", ""):
    return None
  if (pathlib.Path(run.workdir) / "import_hf.json").is_file():  # attnlab.interop.hf.IMPORT_FILE
    return None
  why = " (runlocal=True: a smoke-test run)" if run.config.get("runlocal", False) else ""
  return (f"{run.workdir} step {run.step} was trained for only {run.step} steps{why}: expect "
          f"near-random output; train longer (e.g. without runlocal=True) for a useful model")


def attention_maps(run: Run, *args: Any, **kwargs: Any) -> dict[str, jax.Array]:
  """Runs `run.model` on the inputs and returns the sown attention weights by module path.

  Every attention layer sows `intermediates/.../attention_weights` (shape `[..., q_len, k_len]`);
  keys of the result are "/"-joined module paths such as "encoder/layer_0/attention".
  """
  if run.model is None:
    raise ValueError(f"task {run.config.task!r} has no Flax model to run; use run.task instead")
  _, state = run.model.apply({"params": run.params}, *args, mutable=["intermediates"], **kwargs)
  # sow keeps a tuple of every call's value; one call is the common case.
  return {path: values[0] if len(values) == 1 else values
          for path, values in sown.sown_values(state.get("intermediates", {})).items()}
