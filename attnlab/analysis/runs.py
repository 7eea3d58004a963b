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
from attnlab import tasks
from attnlab import train
from attnlab.checkpoint import read_metrics  # re-exported for analysis scripts

__all__ = ["Run", "attention_maps", "load_run", "read_metrics"]


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

  With "latest", an unreadable newest checkpoint is reported and the previous one is used.
  Raises:
    checkpoint.CheckpointError (a ValueError): no run there, no such step, no readable checkpoint,
      or a checkpoint that does not fit the model in config.json.
  """
  workdir = pathlib.Path(workdir).absolute()
  config = checkpoint.read_config(workdir)
  task = tasks.build_task(config)
  tx = train.make_optimizer(config.optimizer, train.make_schedule(config.optimizer,
                                                                  config.num_train_steps))
  abstract = train.abstract_train_state(task, tx, train.run_keys(config.seed)[0])
  ckpt = checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR, read_only=True)
  try:
    if step == "latest":
      restored = ckpt.restore_latest(abstract)
      if restored is None:
        raise checkpoint.CheckpointError(
            f"no readable checkpoint in {ckpt.directory} (steps found: "
            f"{', '.join(map(str, ckpt.steps())) or 'none'})")
      state, _ = restored
    elif isinstance(step, int) or (isinstance(step, str) and step.isdigit()):
      state, _ = ckpt.restore(int(step), abstract)
    else:
      raise checkpoint.CheckpointError(f"step must be 'latest' or a step number, got {step!r}")
  finally:
    ckpt.close()
  params, num_seeds = state.params, train.num_seeds_of(config)
  if num_seeds == 1:
    replica = None
  elif replica is not None:
    if not 0 <= replica < num_seeds:
      raise checkpoint.CheckpointError(
          f"replica must be in 0..{num_seeds - 1} (the run trained num_seeds={num_seeds}), "
          f"got {replica}")
    params = jax.tree.map(lambda x: x[replica], params)
  return Run(workdir=workdir, config=config, task=task, model=task.model, params=params,
             step=int(state.step), replica=replica)


def attention_maps(run: Run, *args: Any, **kwargs: Any) -> dict[str, jax.Array]:
  """Runs `run.model` on the inputs and returns the sown attention weights by module path.

  Every attention layer sows `intermediates/.../attention_weights` (shape `[..., q_len, k_len]`);
  keys of the result are "/"-joined module paths such as "encoder/layer_0/attention".
  """
  if run.model is None:
    raise ValueError(f"task {run.config.task!r} has no Flax model to run; use run.task instead")
  _, state = run.model.apply({"params": run.params}, *args, mutable=["intermediates"], **kwargs)
  maps = {}
  flat = jax.tree_util.tree_flatten_with_path(
      state.get("intermediates", {}), is_leaf=lambda x: isinstance(x, tuple))[0]
  for path, value in flat:
    names = [str(getattr(p, "key", p)) for p in path]
    if names and names[-1] == "attention_weights":
      # sow keeps a tuple of every call's value; one call is the common case.
      maps["/".join(names[:-1]) or "."] = value[0] if len(value) == 1 else value
  return maps
