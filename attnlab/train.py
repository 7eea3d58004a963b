"""The one training loop for every model family: `train_and_evaluate(config, workdir)`.

The task (attnlab/tasks) supplies model, data, loss and evaluation; this module supplies the rest:
the optax optimizer from `config.optimizer`, a jit-compiled train step with donated state, the run
directory (attnlab/checkpoint.py), TensorBoard events, a tqdm progress bar, resume, and the faults:
a non-finite loss stops the run without saving over the last good checkpoint; SIGTERM or Ctrl-C
saves a checkpoint and stops; a write the disk refuses (full, read-only) stops the run with one line
naming the file and the last good checkpoint; a second process on a busy workdir is refused
(checkpoint.WorkdirLock).

Determinism: parameters come from `split(key(seed))[0]`; step t's dropout/sampling key is
`fold_in(split(key(seed))[1], t)`, so the key needs no saving; the data order comes from the task's
iterator, whose state is in every checkpoint. A resumed run therefore ends with the same
parameters, bit for bit, as an uninterrupted one.

Scale (attnlab/parallel.py): with several devices the state lives on a ("data", "fsdp") mesh from
`config.mesh` and every batch is split over it; with one device nothing changes. With
`config.num_seeds = N > 1`, N replicas (seeds seed, seed+1, ..., seed+N-1: each its own init key,
step keys and data order, on the data set built from `config.seed`) train in one program by
`jax.vmap`: parameters and optimizer state get a leading `[N]` axis (the step counter is shared),
checkpoints hold all replicas, and each metrics.jsonl record holds the mean over replicas plus
`seeds` and `per_seed` ({name: [N values]}).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import json
import logging
import os
import pathlib
import signal
import threading
import time
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from attnlab import checkpoint
from attnlab import config_utils
from attnlab import errors
from attnlab import parallel
from attnlab import tasks

_LOG = logging.getLogger(__name__)

# How often each jitted function was traced (tests check: once per run, no recompiles per step).
TRACE_COUNTS: collections.Counter = collections.Counter()


@flax.struct.dataclass
class TrainState:
  """Everything a checkpoint holds besides the data-iterator position."""
  # [] int32: number of updates applied so far.
  step: jax.Array
  # The task's parameters (a pytree of arrays).
  params: Any
  # The optax optimizer state.
  opt_state: Any


# How a run stops early (attnlab/errors.py), under the names this module always gave them.
RunStopped = errors.RunStopped
NonFiniteLossError = errors.NonFiniteLossError
WriteFailed = errors.WriteFailed
TrainingInterrupted = errors.TrainingInterrupted


# ---------------------------------------------------------------------------------------------------
# Optimizer and state


def make_schedule(opt: ml_collections.ConfigDict, num_train_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to learning_rate, then cosine, linear or constant."""
  lr, warmup, end = opt.learning_rate, opt.warmup_steps, opt.end_learning_rate
  decay_steps = max(num_train_steps - warmup, 1)
  if opt.schedule == "cosine":
    decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=end / lr if lr else 0.0)
  elif opt.schedule == "linear":
    decay = optax.linear_schedule(lr, end, decay_steps)
  elif opt.schedule == "constant":
    decay = optax.constant_schedule(lr)
  else:
    raise config_utils.ConfigError(f"unknown optimizer.schedule {opt.schedule!r}; valid schedules: "
                                   f"{', '.join(config_utils.SCHEDULES)}")
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def decay_mask(decay: str) -> Callable[[Any], Any] | None:
  """optax mask for `optimizer.decay`: None (every parameter) or a matrices-only predicate."""
  if decay == "all":
    return None
  if decay == "matrices":
    return lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  raise config_utils.ConfigError(f"unknown optimizer.decay {decay!r}; valid: "
                                 f"{', '.join(config_utils.DECAYS)}")


def make_optimizer(opt: ml_collections.ConfigDict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
  """adamw, adam or sgd on `schedule`, after global-norm clipping when opt.grad_clip > 0."""
  if opt.name == "adamw":
    tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                     mask=decay_mask(opt.get("decay", "all")))
  elif opt.name == "adam":
    tx = optax.adam(schedule, b1=opt.b1, b2=opt.b2)
  elif opt.name == "sgd":
    tx = optax.sgd(schedule, momentum=opt.momentum or None)
  else:
    raise config_utils.ConfigError(f"unknown optimizer.name {opt.name!r}; valid optimizers: "
                                   f"{', '.join(config_utils.OPTIMIZERS)}")
  if opt.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip), tx)
  return tx


def create_train_state(task: tasks.Task, tx: optax.GradientTransformation,
                       rng: jax.Array) -> TrainState:
  """Step 0: the task's initial parameters and a fresh optimizer state."""
  params = task.init(rng)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def num_seeds_of(config: ml_collections.ConfigDict) -> int:
  """`config.num_seeds` (1 for configs written before the field existed)."""
  return int(config.get("num_seeds", 1) or 1)


def replica_seeds(config: ml_collections.ConfigDict) -> list[int]:
  """The seeds of a run's replicas: seed, seed+1, ..., seed+num_seeds-1."""
  return [config.seed + i for i in range(num_seeds_of(config))]


# vmap axes of a replicated TrainState: one shared step counter, params and optimizer state [N, ...].
_REPLICA_AXES = TrainState(step=None, params=0, opt_state=0)


def create_replicas(task: tasks.Task, tx: optax.GradientTransformation,
                    rngs: jax.Array) -> TrainState:
  """`create_train_state` for each key of `rngs` ([N] keys), stacked: params and optimizer state
  get a leading [N] axis; the step counter stays one scalar, shared by the replicas."""
  return jax.vmap(functools.partial(create_train_state, task, tx), out_axes=_REPLICA_AXES)(rngs)


def abstract_train_state(task: tasks.Task, tx: optax.GradientTransformation, rng: jax.Array, *,
                         mesh: jax.sharding.Mesh | None = None) -> TrainState:
  """Shapes, dtypes and shardings of the initial state without computing it (restore target).

  With `task.config.num_seeds = N > 1` the leaves have a leading [N] axis. Without a mesh the
  arrays are placed on the first device; with one they follow `parallel.state_shardings`.
  """
  num_seeds = num_seeds_of(task.config)
  if num_seeds > 1:
    keys = jax.random.split(rng, num_seeds)  # [N] (only their shape matters here)
    abstract = jax.eval_shape(functools.partial(create_replicas, task, tx), keys)
  else:
    abstract = jax.eval_shape(functools.partial(create_train_state, task, tx), rng)
  if mesh is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        abstract)
  shardings = state_shardings_for(task.config, abstract, mesh)
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                      abstract, shardings)


def state_shardings_for(config: ml_collections.ConfigDict, abstract: Any,
                        mesh: jax.sharding.Mesh) -> Any:
  """`parallel.state_shardings` of a (possibly replicated over seeds) train state under `config`."""
  min_size = int(config.get("mesh", {}).get("fsdp_min_size", 1024))
  return parallel.state_shardings(abstract, mesh, min_size=min_size,
                                  replica_axes=1 if num_seeds_of(config) > 1 else 0)


def make_train_step(task: tasks.Task, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    *, num_seeds: int = 1, mesh: jax.sharding.Mesh | None = None,
                    state_shardings: Any = None):
  """The jitted update `(state, batch, rng) -> (state, metrics)`; the input state is donated.

  `rng` is the train key (or its raw uint32 key data); with `num_seeds > 1` state, batch, rng and
  metrics carry a leading replica axis and the update is vmapped over it. With a mesh, the output
  state keeps `state_shardings` and the metrics are replicated.
  """
  def one_step(state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict]:
    step_rng = jax.random.fold_in(rng, state.step)
    grad_fn = jax.value_and_grad(task.loss_fn, has_aux=True)
    (loss, metrics), grads = grad_fn(state.params, batch, step_rng)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def train_step(state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict]:
    TRACE_COUNTS["train_step"] += 1
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
      rng = jax.random.wrap_key_data(rng)  # raw key data, as placed on a multi-host mesh
    if num_seeds > 1:
      return jax.vmap(one_step, in_axes=(_REPLICA_AXES, 0, 0), out_axes=(_REPLICA_AXES, 0))(
          state, batch, rng)
    return one_step(state, batch, rng)

  if mesh is None:
    return jax.jit(train_step, donate_argnums=0)
  return jax.jit(train_step, donate_argnums=0,
                 out_shardings=(state_shardings, parallel.replicated(mesh)))


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
  """(init key, train key) of a run; step t uses fold_in(train key, t)."""
  init_rng, train_rng = jax.random.split(jax.random.key(seed))
  return init_rng, train_rng


def replica_keys(config: ml_collections.ConfigDict) -> tuple[jax.Array, jax.Array]:
  """(init key, train key) of `config.seed`, or with num_seeds > 1 both stacked over the replicas
  ([N] keys, replica i's being `run_keys(seed + i)`)."""
  seeds = replica_seeds(config)
  if len(seeds) == 1:
    return run_keys(seeds[0])
  pairs = [run_keys(seed) for seed in seeds]
  stack = lambda keys: jax.random.wrap_key_data(jnp.stack([jax.random.key_data(k) for k in keys]))
  return stack([p[0] for p in pairs]), stack([p[1] for p in pairs])


def replica_iterators(task: tasks.Task, seeds: list[int]) -> list[tasks.BatchIterator]:
  """One training iterator per seed: the task's iterator as if `config.seed` were that seed.

  The task object is shallow-copied with a config whose seed differs (the Task contract makes the
  data order depend on `config.seed` only), so data and tokenizers are shared, not rebuilt.
  """
  iterators = []
  for seed in seeds:
    replica = copy.copy(task)
    replica.config = copy.deepcopy(task.config)
    replica.config.seed = seed
    iterators.append(replica.train_iterator())
  return iterators


class ReplicaBatches:
  """Stacks the batches of N replica iterators (every leaf gets a leading [N] axis); its state
  is that of every replica's iterator."""

  def __init__(self, iterators: list[tasks.BatchIterator]):
    self._iterators = iterators

  def __iter__(self) -> ReplicaBatches:
    return self

  def __next__(self) -> Any:
    batches = [next(it) for it in self._iterators]
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)

  def get_state(self) -> dict[str, Any]:
    return {"replicas": [it.get_state() for it in self._iterators]}

  def set_state(self, state: dict[str, Any]) -> None:
    states = state.get("replicas") if isinstance(state, dict) else None
    if not isinstance(states, list) or len(states) != len(self._iterators):
      raise checkpoint.CheckpointError(
          f"the checkpoint's data-iterator state is not that of {len(self._iterators)} replicas "
          f"(got {str(state)[:80]}); num_seeds changed since it was saved: use a new --workdir")
    for it, st in zip(self._iterators, states):
      it.set_state(st)


class _PlacedBatches:
  """A BatchIterator whose batches are placed on the mesh (split over its devices)."""

  def __init__(self, inner: tasks.BatchIterator, mesh: jax.sharding.Mesh, replica_axes: int):
    self._inner, self._mesh, self._replica_axes = inner, mesh, replica_axes

  def __iter__(self) -> _PlacedBatches:
    return self

  def __next__(self) -> Any:
    return parallel.shard_batch(next(self._inner), self._mesh, self._replica_axes)

  def get_state(self) -> dict[str, Any]:
    return self._inner.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._inner.set_state(state)


# ---------------------------------------------------------------------------------------------------
# Logging


@contextlib.contextmanager
def _writing(path: str | os.PathLike):
  """Names `path` in an OSError raised inside that carries no file name (a failed write/flush)."""
  try:
    yield
  except OSError as e:
    if e.filename or e.errno is None:
      raise
    raise OSError(e.errno, e.strerror, str(path)) from e


class _MetricLogger:
  """Appends records to metrics.jsonl and TensorBoard (on process 0 only)."""

  def __init__(self, workdir: pathlib.Path, start_step: int, seeds: list[int] | None = None):
    # The replicas' seeds when num_seeds > 1 (records then carry per-seed values).
    self._seeds = seeds if seeds and len(seeds) > 1 else None
    self._enabled = parallel.is_main_process()
    if not self._enabled:
      return
    import tensorboardX  # pylint: disable=g-import-not-at-top  (slow import, only when training)
    self._path, self._tb_dir = workdir / checkpoint.METRICS_FILE, workdir / "tensorboard"
    with _writing(self._path):
      self._file = open(self._path, "a")
    with _writing(self._tb_dir):
      self._tb = tensorboardX.SummaryWriter(str(self._tb_dir),
                                            purge_step=start_step + 1 if start_step else None)

  def write(self, step: int, split: str, metrics: dict[str, float],
            per_seed: dict[str, list[float]] | None = None, **extra: float) -> None:
    """One record; `per_seed` ({name: [value per replica]}) is stored beside the means."""
    if not self._enabled:
      return
    record = {"step": step, "split": split, **metrics, "wall_time": time.time(), **extra}
    if per_seed is not None and self._seeds is not None:
      record["seeds"] = self._seeds
      record["per_seed"] = per_seed
    with _writing(self._path):
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
    with _writing(self._tb_dir):
      for name, value in {**metrics, **extra}.items():
        self._tb.add_scalar(f"{split}/{name}", value, step)
      if per_seed is not None and self._seeds is not None:
        for name, values in per_seed.items():
          for seed, value in zip(self._seeds, values):
            self._tb.add_scalar(f"{split}_seed{seed}/{name}", value, step)
      self._tb.flush()

  def close(self, quiet: bool = False) -> None:
    """Closes the files (once); `quiet`: while another error propagates, ignore write errors."""
    if not self._enabled:
      return
    self._enabled = False
    for path, close in ((self._path, self._file.close), (self._tb_dir, self._tb.close)):
      try:
        with _writing(path):
          close()
      except OSError:
        if not quiet:
          raise


def _mean_metrics(pending: list[tuple[int, dict]], num_seeds: int = 1
                  ) -> tuple[dict[str, float], dict[str, list[float]] | None]:
  """(metrics averaged over the steps (and replicas), per-replica averages or None)."""
  values = parallel.to_host([m for _, m in pending])
  if num_seeds == 1:
    return {key: float(np.mean([v[key] for v in values])) for key in values[0]}, None
  per_seed = {key: [float(x) for x in np.mean([np.asarray(v[key]) for v in values], axis=0)]
              for key in values[0]}  # {name: [N]}
  return {key: float(np.mean(vals)) for key, vals in per_seed.items()}, per_seed


def evaluate(task: tasks.Task, params: Any, num_seeds: int = 1
             ) -> tuple[dict[str, float], dict[str, list[float]] | None]:
  """(task.evaluate metrics, None), or with num_seeds > 1 (means over replicas, {name: [N]}).

  Several processes: the parameters are first gathered to every host, which evaluates alone.
  """
  params = parallel.to_local(params)
  if num_seeds == 1:
    return task.evaluate(params), None
  results = [task.evaluate(jax.tree.map(lambda x, i=i: x[i], params)) for i in range(num_seeds)]
  per_seed = {key: [float(r[key]) for r in results] for key in results[0]}
  return {key: float(np.mean(vals)) for key, vals in per_seed.items()}, per_seed


class _StopRequest:
  """Turns the first SIGINT/SIGTERM into a request to save and stop; a second one acts as usual."""

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> _StopRequest:
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    self.signum = signum
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    _LOG.warning("%s received: saving a checkpoint and stopping (send it again to quit at once)",
                 signal.Signals(signum).name)

  def __exit__(self, *exc: Any) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _progress_bar(total: int, initial: int):
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  # disable=None: drawn on a terminal only (log files get the periodic log lines instead).
  return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
              disable=None if parallel.is_main_process() else True, desc="train")


# ---------------------------------------------------------------------------------------------------
# The loop


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> TrainState:
  """Trains `config.task` for `config.num_train_steps` in `workdir`, resuming what is there.

  Returns:
    The final TrainState (params equal those of the last checkpoint).
  Raises:
    config_utils.UserError: bad config, a workdir holding a different config, a checkpoint that
      does not fit the model.
    NonFiniteLossError: the loss became NaN/Inf (the last good checkpoint is kept).
    TrainingInterrupted: SIGTERM or Ctrl-C (a checkpoint was saved first).
  """
  config_utils.validate(config)
  parallel.maybe_initialize_distributed()  # before anything touches a device
  workdir = pathlib.Path(workdir).absolute()
  mesh = parallel.make_mesh(config)
  pieces = parallel.batch_divisor(mesh)
  if config.batch_size % pieces:
    raise config_utils.ConfigError(
        f"batch_size={config.batch_size} does not split over the {pieces} devices of the mesh "
        f"(mesh.data x mesh.fsdp); set batch_size to a multiple of {pieces} or set mesh.data")
  task = tasks.build_task(config)  # before touching the workdir: a bad model config writes nothing
  is_main = parallel.is_main_process()
  with _stop_on_refused_writes(workdir), contextlib.ExitStack() as stack:
    if is_main:
      stack.enter_context(checkpoint.WorkdirLock(workdir))
      checkpoint.prepare_workdir(workdir, config)
    return _train_in_workdir(config, workdir, task, mesh, is_main)


@contextlib.contextmanager
def _stop_on_refused_writes(workdir: pathlib.Path):
  """Turns a write the disk refuses (full, read-only, ...) into WriteFailed: one line naming what
  could not be written and the last good checkpoint."""
  try:
    yield
  except (RunStopped, config_utils.UserError):
    raise
  except Exception as e:
    code = checkpoint.write_errno(e, workdir)
    if isinstance(e, checkpoint.CheckpointWriteError):
      what = str(e)
    elif code is not None:
      names = [n.filename for n in checkpoint.exception_chain(e)
               if isinstance(n, OSError) and n.filename]
      what = f"could not write {names[0] if names else workdir} ({os.strerror(code)})"
    else:
      raise
    if checkpoint.finished_steps(workdir):
      then = f"{checkpoint.last_good_checkpoint(workdir)}; make room on the disk (or make it " \
             f"writable) and run the same command to resume from it"
    else:
      then = "no checkpoint had been saved yet; make room on the disk (or make it writable) and " \
             "run the same command to start again"
    raise WriteFailed(f"{what}; training stopped: {then}") from e


def _train_in_workdir(config: ml_collections.ConfigDict, workdir: pathlib.Path, task: tasks.Task,
                      mesh: jax.sharding.Mesh | None, is_main: bool) -> TrainState:
  """train_and_evaluate once the workdir is prepared (and locked by this process)."""
  num_steps = config.num_train_steps
  schedule = make_schedule(config.optimizer, num_steps)
  tx = make_optimizer(config.optimizer, schedule)
  seeds = replica_seeds(config)
  num_seeds = len(seeds)
  init_rng, train_rng = replica_keys(config)
  if num_seeds == 1:
    train_iter = task.train_iterator()
  else:
    train_iter = ReplicaBatches(replica_iterators(task, seeds))
  abstract = abstract_train_state(task, tx, run_keys(config.seed)[0], mesh=mesh)
  shardings = None
  if mesh is not None:
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    train_iter = _PlacedBatches(train_iter, mesh, 1 if num_seeds > 1 else 0)
    # Raw key data, replicated on the mesh (a key array cannot cross processes as it is).
    train_rng = parallel.put_replicated(jax.random.key_data(train_rng), mesh)

  ckpt = checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR,
                                 max_to_keep=config.keep_checkpoints)
  try:
    restored = ckpt.restore_latest(abstract, quarantine=is_main)
    if restored is None:
      state = _initial_state(task, tx, init_rng, num_seeds, mesh, shardings)
      state = _with_pretrained(task, tx, state, num_seeds, mesh, shardings)
    else:
      state, data_state = restored
      train_iter.set_state(data_state)
      _LOG.info("resuming %s from checkpoint step %d", workdir, _step_of(state))
    start = _step_of(state)
    if is_main:
      checkpoint.truncate_metrics(workdir, start)
    if start >= num_steps:
      _finish_complete_run(task, state, workdir, start, seeds)
      return state
    train_step = make_train_step(task, tx, schedule, num_seeds=num_seeds, mesh=mesh,
                                 state_shardings=shardings)
    state = _train_loop(config, workdir, task, state, train_iter, ckpt, train_step, train_rng,
                        seeds)
  finally:
    ckpt.close()
  if config.write_plots and is_main:
    params = parallel.to_local(state.params)
    if num_seeds > 1:  # the first replica's plots
      params = jax.tree.map(lambda x: x[0], params)
    with _writing(workdir):
      task.write_plots(params, workdir)
  return state


def _initial_state(task: tasks.Task, tx: optax.GradientTransformation, init_rng: jax.Array,
                   num_seeds: int, mesh: jax.sharding.Mesh | None, shardings: Any) -> TrainState:
  """Step 0 of every replica, created directly in its sharding on a mesh."""
  if mesh is None:
    if num_seeds == 1:
      return create_train_state(task, tx, init_rng)
    return create_replicas(task, tx, init_rng)

  def create(key_data: jax.Array) -> TrainState:
    keys = jax.random.wrap_key_data(key_data)
    if num_seeds == 1:
      return create_train_state(task, tx, keys)
    return create_replicas(task, tx, keys)
  key_data = parallel.put_replicated(jax.random.key_data(init_rng), mesh)
  return jax.jit(create, out_shardings=shardings)(key_data)


def _with_pretrained(task: tasks.Task, tx: optax.GradientTransformation, state: TrainState,
                     num_seeds: int, mesh: jax.sharding.Mesh | None, shardings: Any) -> TrainState:
  """Step 0 with the task's pretrained weights (`Task.load_pretrained`, called eagerly on every
  replica's parameters) and the optimizer state rebuilt for them; `state` when it loads none."""
  params = parallel.to_host(state.params)
  if num_seeds == 1:
    loaded = task.load_pretrained(params)
  else:
    replicas = [task.load_pretrained(jax.tree.map(lambda x, i=i: x[i], params))
                for i in range(num_seeds)]
    loaded = None if replicas[0] is None else jax.tree.map(
        lambda *xs: np.stack([np.asarray(x) for x in xs]), *replicas)  # [N, ...] leaves
  if loaded is None:
    return state

  def rebuild(params: Any) -> TrainState:
    opt_state = tx.init(params) if num_seeds == 1 else jax.vmap(tx.init)(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
  if mesh is None:
    return jax.jit(rebuild)(loaded)
  return jax.jit(rebuild, out_shardings=shardings)(parallel.put_replicated(loaded, mesh))


def _step_of(state: TrainState) -> int:
  """The step counter of a state (every replica has the same)."""
  return int(np.asarray(parallel.to_host(state.step)).reshape(-1)[0])


def _finish_complete_run(task: tasks.Task, state: TrainState, workdir: pathlib.Path,
                         step: int, seeds: list[int]) -> None:
  """A run already at its last step: add the final evaluation if a crash skipped it."""
  if not checkpoint.is_complete(workdir, step):
    logger = _MetricLogger(workdir, step, seeds)
    try:
      metrics, per_seed = evaluate(task, state.params, len(seeds))
      logger.write(step, "eval", metrics, per_seed)
    except BaseException:
      logger.close(quiet=True)
      raise
    logger.close()
  _LOG.info("%s is complete (step %d); nothing to train", workdir, step)


def _check_finite(pending: list[tuple[int, dict]], ckpt: checkpoint.Checkpointer,
                  seeds: list[int] | None = None) -> None:
  losses = parallel.to_host([m["loss"] for _, m in pending])
  for (step, _), loss in zip(pending, losses):
    loss = np.asarray(loss).reshape(-1)  # [num_seeds]
    bad = np.flatnonzero(~np.isfinite(loss))
    if bad.size:
      last = ckpt.latest_step()
      kept = (f"the last good checkpoint is step {last} in {ckpt.directory}" if last is not None
              else "no checkpoint had been saved yet")
      which = f" (replica of seed {seeds[bad[0]]})" if seeds and len(seeds) > 1 else ""
      raise NonFiniteLossError(
          f"loss is {float(loss[bad[0]])} at step {step}{which}; training stopped and nothing "
          f"was saved after it: "
          f"{kept}, metrics.jsonl is intact. Lower optimizer.learning_rate or set "
          f"optimizer.grad_clip, and pass --config.allow_config_change=True to resume from it")


def _train_loop(config, workdir, task, state, train_iter, ckpt, train_step, train_rng,
                seeds) -> TrainState:
  num_steps, start, num_seeds = config.num_train_steps, _step_of(state), len(seeds)
  logger = _MetricLogger(workdir, start, seeds)
  pending: list[tuple[int, dict]] = []  # per-step metrics (on device) since the last log
  checked = 0  # pending[:checked] are known to have a finite loss
  last_log_step, last_log_time = start, time.time()
  bar = _progress_bar(num_steps, start)
  try:
    with _StopRequest() as stop, contextlib.ExitStack() as stack:
      if not bar.disable:
        from tqdm.contrib.logging import logging_redirect_tqdm  # pylint: disable=g-import-not-at-top
        stack.enter_context(logging_redirect_tqdm([logging.getLogger("attnlab")]))
      for step in range(start + 1, num_steps + 1):
        batch = next(train_iter)
        state, metrics = train_step(state, batch, train_rng)
        pending.append((step, metrics))
        bar.update()
        last, stopping = step == num_steps, stop.signum is not None
        do_log = step % config.log_every == 0 or last or stopping
        do_ckpt = last or stopping or (
            config.checkpoint_every > 0 and step % config.checkpoint_every == 0)
        do_eval = last or (not stopping and config.eval_every > 0 and step % config.eval_every == 0)
        if not (do_log or do_ckpt or do_eval):
          continue
        _check_finite(pending[checked:], ckpt, seeds)  # before anything is written for this step
        checked = len(pending)
        if do_log:
          now = time.time()
          summary, per_seed = _mean_metrics(pending, num_seeds)
          steps_per_sec = (step - last_log_step) / max(now - last_log_time, 1e-9)
          logger.write(step, "train", summary, per_seed, steps_per_sec=steps_per_sec)
          bar.set_postfix(loss=f"{summary['loss']:.4g}", refresh=False)
          if bar.disable:
            _LOG.info("step %d: loss %.4g, %.1f steps/s", step, summary["loss"], steps_per_sec)
          pending, checked = [], 0
          last_log_step, last_log_time = step, now
        if do_ckpt:
          ckpt.save(step, state, train_iter.get_state())
        if do_eval:
          eval_metrics, per_seed = evaluate(task, state.params, num_seeds)
          logger.write(step, "eval", eval_metrics, per_seed)
          _LOG.info("step %d eval: %s", step,
                    ", ".join(f"{k}={v:.4g}" for k, v in eval_metrics.items()))
          last_log_time = time.time()  # throughput counts training only
        if stopping and not last:
          name = signal.Signals(stop.signum).name
          raise TrainingInterrupted(
              f"stopped by {name} at step {step}; checkpoint saved in {ckpt.directory}; run the "
              f"same command to resume", stop.signum)
  except BaseException:
    logger.close(quiet=True)  # the error on its way out is the one to report
    raise
  finally:
    bar.close()
    logger.close()
  return state
