"""The one training loop for every model family: `train_and_evaluate(config, workdir)`.

The task (attnlab/tasks) supplies model, data, loss and evaluation; this module supplies the rest:
the optax optimizer from `config.optimizer`, a jit-compiled train step with donated state, the run
directory (attnlab/rundir.py, its checkpoints attnlab/checkpoint.py), TensorBoard events, a tqdm
progress bar, resume, and the faults: a non-finite loss stops the run without saving over the last
good checkpoint; SIGTERM or Ctrl-C saves a checkpoint and stops; a write the disk refuses (full,
read-only) stops the run with one line naming the file and the last good checkpoint; a second
process on a busy workdir is refused (rundir.WorkdirLock).

Determinism: the keys are functions of the seed and the step (attnlab/state.py: `run_keys`), so
they need no saving; the data order comes from the task's iterator, whose state is in every
checkpoint. A resumed run therefore ends with the same parameters, bit for bit, as an
uninterrupted one. A step's evaluation follows its checkpoint; a run killed between the two
evaluates that checkpoint when it resumes, so no evaluation record is lost.

Early stopping (`config.early_stop_patience` = P > 0, `EarlyStopping`): every evaluation step
also saves a checkpoint; the run stops at the P-th evaluation in a row that does not lower the
validation loss below its best, writes an "early_stop" record (rundir.EARLY_STOP_SPLIT: the
step, best_step, best_loss, patience) to metrics.jsonl and says so in the log. The best
evaluation's checkpoint is never pruned (keep_checkpoints counts the others) and is the run's
result: `state.restore(workdir)` ("latest": generate, view, inspect, export, a fine-tuning
run's init_from) gives it, and so do the plots. The same command resumes a stopped run without
training further (the state is replayed from metrics.jsonl).

The train state, its N >= 1 replicas (`config.num_seeds`, trained in one program by `jax.vmap`)
and their keys, data and evaluation are in attnlab/state.py; checkpoints hold all replicas, and
each metrics.jsonl record holds the mean over replicas plus `seeds` and `per_seed` ({name: [N
values]}). Scale (attnlab/parallel.py): with several devices the state lives on a ("data", "fsdp")
mesh from `config.mesh` and every batch is split over it; with one device nothing changes.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import math
import os
import pathlib
import shutil
import signal
import threading
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from attnlab import checkpoint
from attnlab import config_utils
from attnlab import run_config
from attnlab import parallel
from attnlab import precision
from attnlab import rundir
from attnlab import state as state_lib
from attnlab import tasks
from attnlab.backends import cpu as cpu_backend
from attnlab.data import assets as assets_lib
from attnlab.errors import NonFiniteLossError
from attnlab.errors import RunStopped
from attnlab.errors import TrainingInterrupted
from attnlab.errors import UserError
from attnlab.errors import WriteFailed
from attnlab.state import TrainState
# Importable from here too (benchmarks and tests build their own train steps).
from attnlab.state import make_optimizer
from attnlab.state import make_schedule
from attnlab.state import run_keys

_LOG = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# Optimizer and state


def make_train_step(task: tasks.Task, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    *, num_seeds: int = 1, mesh: jax.sharding.Mesh | None = None,
                    state_shardings: Any = None, per_device: bool = True):
  """The jitted update `(state, batch, rng) -> (state, metrics)`; the input state is donated.

  `rng` is the train key (or its raw uint32 key data); with `num_seeds > 1` state, batch, rng and
  metrics carry a leading replica axis and the update is vmapped over it. With a mesh, the output
  state keeps `state_shardings` and the metrics are replicated. The returned function's `traces`
  attribute counts how often it was traced (tests check: once per run, no recompiles per step).
  The step is traced under the config's matmul precision (`precision.matmul_precision`: on a
  CPU with bfloat16 dot instructions, Dense's products on bfloat16 operands by default).

  Data parallel (a mesh without an fsdp split): every device runs the step on its slice of the
  batch (`jax.shard_map`) with a dropout key of its own; the task's loss, written with
  `losses.ratio`, is the whole batch's, and one all-reduce adds up the devices' gradients. Left to
  the compiler, XLA:CPU all-reduced them in 18 pieces per nano GPT step, each a rendezvous of the
  devices on one thread pool: 1.06-1.16x slower steps on two CPU devices (benchmarks/dp_step.py). A
  task whose loss or metrics stay per device (a plain `jnp.mean`), or a model that shard_map's
  check of per-device values refuses (flax's nn.RNN scans), gets the compiler's version;
  `per_device=False` asks for it (benchmarks/dp_step.py compares the two).
  """
  def one_step(state: TrainState, batch: Any, rng: jax.Array,
               axes: tuple[str, ...] = ()) -> tuple[TrainState, dict]:
    step_rng = jax.random.fold_in(rng, state.step)
    params = state.params
    if axes:  # inside shard_map: this device's slice of the batch
      step_rng = jax.random.fold_in(step_rng, jax.lax.axis_index(axes))
      params = parallel.vary(params, axes)  # gradients of this device's examples only
    # float16 runs scale the loss (attnlab.precision); otherwise jax.value_and_grad
    grad_fn = precision.value_and_grad(task.loss_fn, state.opt_state)
    (loss, metrics), grads = grad_fn(params, batch, step_rng)
    if axes:
      if any(parallel.varying_axes(x) for x in jax.tree.leaves((loss, metrics))):
        raise _PerDeviceLoss
      grads = parallel.sum_over_devices(grads, axes)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule(state.step)}
    scale = precision.loss_scale(state.opt_state)
    if scale is not None:
      metrics["loss_scale"] = scale
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def replicas(axes: tuple[str, ...] = ()):
    step = functools.partial(one_step, axes=axes)
    return state_lib.over_replicas(step, num_seeds, in_axes=(0, 0), out_axes=(0,))

  def data_parallel(state: TrainState, batch: Any, rng: jax.Array):
    axes, replica_axes = tuple(mesh.axis_names), int(num_seeds > 1)
    batch_specs = jax.tree.map(
        lambda x: parallel.batch_sharding(mesh, x.ndim, replica_axes).spec, batch)
    return jax.shard_map(replicas(axes), mesh=mesh, in_specs=(P(), batch_specs, P()),
                         out_specs=P())(state, batch, rng)

  def train_step(state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict]:
    jitted.traces += 1  # this Python body runs once per trace
    with precision.matmul_scope(matmul):  # the Dense products' operands (attnlab.precision)
      return split_step(state, batch, rng)

  def split_step(state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict]:
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
      rng = jax.random.wrap_key_data(rng)  # raw key data, as placed on a multi-host mesh
    if mesh is None:
      return replicas()(state, batch, rng)
    if per_device and mesh.shape[parallel.FSDP_AXIS] == 1:
      try:
        out = data_parallel(state, batch, rng)
        jitted.per_device = True
        return out
      except (_PerDeviceLoss, TypeError, ValueError) as e:
        # TypeError: shard_map's check of per-device values, e.g. a scan whose initial carry all
        # devices hold alike (flax's nn.RNN) returning one that differs per device; ValueError:
        # the same check inside a primitive ("varying manual axes", e.g. the block-sparse
        # kernel's lax.cond under vmapped seeds). A genuine error in the task comes back from
        # the compiler's version below.
        if isinstance(e, ValueError) and "varying manual axes" not in str(e):
          raise
        _LOG.info("task %r: the compiler splits the train step over the devices (%s)", task.name,
                  (str(e).strip() or type(e).__name__).splitlines()[0])
    jitted.per_device = False
    # The mesh is visible to the model code (the blocked attention kernel runs per batch shard).
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return replicas()(state, batch, rng)

  matmul = precision.matmul_precision(task.config)
  if matmul == "bfloat16":
    _LOG.info("train step: Dense products on bfloat16 operands, accumulated in float32 "
              "(matmul_precision=%s; matmul_precision=float32 keeps float32)",
              task.config.get("matmul_precision"))
  shardings = {} if mesh is None else {
      "out_shardings": (state_shardings, parallel.replicated(mesh))}
  jitted = jax.jit(train_step, donate_argnums=0, **shardings)
  jitted.traces = 0
  jitted.per_device = None  # after a trace on a mesh: whether each device ran its own slice
  return jitted


class _PerDeviceLoss(Exception):
  """Raised while tracing the data-parallel step when the task's loss is not the whole batch's."""

  def __str__(self) -> str:
    return "its loss or metrics differ per device: write them with losses.ratio"


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


def _import_tensorboardx():
  """tensorboardX, imported without torch and boto3 where they are installed but not imported
  yet: its writer imports torch only to accept torch tensors (attnlab logs floats), which was
  3.5 s of its 3.8 s import (torch 2.13 CPU), and boto3 only to write to s3:// paths (a run
  directory is a local folder), 0.47 of its remaining 0.6 s. Imported only when training."""
  import sys  # pylint: disable=g-import-not-at-top
  if "tensorboardX" in sys.modules:
    return sys.modules["tensorboardX"]
  # `import torch` (boto3) then raises ImportError, which tensorboardX handles.
  blocked = [name for name in ("torch", "boto3") if name not in sys.modules]
  for name in blocked:
    sys.modules[name] = None
  try:
    import tensorboardX  # pylint: disable=g-import-not-at-top
  finally:
    for name in blocked:
      if sys.modules.get(name, 0) is None:
        del sys.modules[name]
  return tensorboardX


class _MetricLogger:
  """Appends records to metrics.jsonl and TensorBoard (on process 0 only); a context manager that
  closes them, ignoring write errors while another error propagates."""

  def __init__(self, workdir: pathlib.Path, start_step: int, seeds: list[int] | None = None):
    # The replicas' seeds when num_seeds > 1 (records then carry per-seed values).
    self._seeds = seeds if seeds and len(seeds) > 1 else None
    self._enabled = parallel.is_main_process()
    if not self._enabled:
      return
    tensorboardX = _import_tensorboardx()
    self._path, self._tb_dir = workdir / rundir.METRICS_FILE, workdir / "tensorboard"
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

  def __enter__(self) -> _MetricLogger:
    return self

  def __exit__(self, exc_type: Any, *exc: Any) -> None:
    self.close(quiet=exc_type is not None)

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


class _Phases:
  """Seconds spent per phase of a run, logged in one line when it ends (`attnlab train`'s log):
  where a whole run's time goes beside its steps."""

  def __init__(self):
    self.start = time.perf_counter()
    self.seconds: dict[str, float] = {}
    # Work done on another thread beside the phases (the plots): not part of their sum.
    self.background: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, name: str):
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

  def report(self) -> str:
    """The line: each phase's seconds on the run's own thread (they add up to the total), then
    the seconds of work done on another thread beside them (`background`: the plots)."""
    total = time.perf_counter() - self.start
    parts = [f"{name} {secs:.1f} s" for name, secs in self.seconds.items()]
    other = total - sum(self.seconds.values())
    line = f"run phases: {', '.join(parts)}, other {other:.1f} s; total {total:.1f} s"
    for name, secs in self.background.items():
      line += f"; {name} {secs:.1f} s in the background"
    return line


class _Background:
  """A piece of the run's work done on a thread of its own (`start`), beside the run's own
  thread; `finish` waits for it and raises its error. JAX traces, compiles and runs programs
  from several threads; XLA's compiler and its programs run outside Python's lock."""

  def __init__(self, name: str, work: Callable[..., Any]):
    self._name, self._work = name, work
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.seconds = 0.0  # the work's own time, on its thread
    self.result: Any = None  # what the work returned

  @property
  def started(self) -> bool:
    return self._thread is not None

  def _run(self, *args: Any) -> None:
    t0 = time.perf_counter()
    try:
      self.result = self._work(*args)
    except BaseException as e:  # pylint: disable=broad-except  (raised again by finish)
      self._error = e
    finally:
      self.seconds = time.perf_counter() - t0

  def start(self, *args: Any) -> None:
    self._thread = threading.Thread(target=self._run, args=args, name=f"attnlab-{self._name}",
                                    daemon=True)
    self._thread.start()

  def run_here(self, *args: Any) -> None:
    """Does the work on the calling thread."""
    self._run(*args)
    self._raise()

  def finish(self, quiet: bool = False) -> None:
    """Waits for the work started by `start` (if any); raises its error (`quiet`: while another
    error propagates, only waits)."""
    if self._thread is not None:
      self._thread.join()
      if not quiet:
        self._raise()

  def _raise(self) -> None:
    if self._error is not None:
      error, self._error = self._error, None
      raise error


def _plots(task: tasks.Task, workdir: pathlib.Path, num_seeds: int) -> _Background:
  """The end-of-run figures (`task.write_plots`: GPT's sample.txt and attention.png, ...) of a
  state, `start`ed once the last step's state is saved: drawn beside the final evaluation on the
  whole validation split, and waited for (`finish`) before the run returns, so that they are in
  the run directory when `attnlab train` exits. The drawing uses matplotlib's object API only
  (attnlab/plotting.py), never pyplot's global state, and the run's thread draws nothing
  meanwhile. Takes the state's parameters (the last step donates no buffers after them)."""
  def draw(params: Any) -> None:
    with _writing(workdir):
      task.write_plots(params, workdir)
  plots = _Background("plots", draw)
  first = lambda state: state_lib.first_replica(parallel.to_local(state.params), num_seeds)
  plots.start_with = lambda state: plots.start(first(state))
  plots.draw_now = lambda state: plots.run_here(first(state))
  return plots


def _warm_evaluation(task: tasks.Task, abstract: TrainState, num_seeds: int) -> _Background:
  """Compiles the evaluation program (`state.compile_evaluation`) on a thread of its own while
  the run's thread compiles the train step, so that neither the first periodic evaluation nor
  the final one compiles; its failure is only logged (the evaluation itself then raises it)."""
  def work() -> None:
    try:
      state_lib.compile_evaluation(task, abstract.params, num_seeds)
    except Exception as e:  # pylint: disable=broad-except
      _LOG.debug("compiling the evaluation ahead failed: %s", e)
  return _Background("evaluation-compile", work)


def _start_fresh(task: tasks.Task, parts: state_lib.Training, train_step: Callable[..., Any],
                 mesh: jax.sharding.Mesh | None, phases: _Phases) -> tuple[TrainState, Any]:
  """(step 0, the first batch) of a run that starts afresh, the train step compiled for them:
  the initial state is created on a thread of its own (`state.initial_state`, whose program
  took 1.5-1.8 s to compile for the nano GPT on 2 CPU cores) while this thread compiles the
  train step ahead of its first call, from the state's shapes and the first batch (which the
  first step then takes). With several processes, one after the other (no batch taken)."""
  num_seeds = len(parts.seeds)
  create = lambda: state_lib.initial_state(task, parts.tx, parts.init_rng, num_seeds, mesh,
                                           parts.shardings)
  if jax.process_count() > 1:
    return create(), None
  init = _Background("initial-state", create)
  init.start()
  _compiling_line()
  try:
    with phases("first step (compile)"):
      batch = next(parts.batches)
      train_step.lower(parts.abstract, batch, parts.train_rng).compile()
  except BaseException:
    init.finish(quiet=True)
    raise
  init.finish()
  return init.result, batch


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> TrainState:
  """Trains `config.task` for `config.num_train_steps` in `workdir`, resuming what is there.

  Returns:
    The final TrainState (params equal those of the last checkpoint; of a run that early stopping
    ended, those of its best evaluation's checkpoint).
  Raises:
    UserError: bad config, a workdir holding a different config, a checkpoint that
      does not fit the model.
    NonFiniteLossError: the loss became NaN/Inf (the last good checkpoint is kept).
    TrainingInterrupted: SIGTERM or Ctrl-C (a checkpoint was saved first).
  """
  phases = _Phases()
  config_utils.validate(config)
  workdir = pathlib.Path(workdir).absolute()
  check_inputs(config, workdir)
  # Before anything touches a device: the CPU tuning (allocator, `mesh.cpu_devices` split)
  cpu_backend.enable(config)
  parallel.maybe_initialize_distributed()
  parallel.enable_compilation_cache()
  mesh = parallel.make_mesh(config)
  pieces = parallel.batch_divisor(mesh)
  if config.batch_size % pieces:
    raise config_utils.ConfigError(
        f"batch_size={config.batch_size} does not split over the {pieces} devices of the mesh "
        f"(mesh.data x mesh.fsdp); set batch_size to a multiple of {pieces} or set mesh.data")
  # Before touching the workdir: a bad model config writes nothing. A run resumed with its own
  # config takes its vocabularies and sizes from its assets folder.
  own_assets = _own_assets(workdir, config)
  task = tasks.build_task(config, own_assets)
  is_main = parallel.is_main_process()
  with _stop_on_refused_writes(workdir), contextlib.ExitStack() as stack:
    if is_main:
      stack.enter_context(rundir.WorkdirLock(workdir))
      rundir.prepare_workdir(workdir, config)
    state = _train_in_workdir(config, workdir, task, mesh, is_main, own_assets is not None,
                              phases)
  _LOG.info("%s", phases.report())
  return state


def check_inputs(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> None:
  """Checks what `config` points at that can be checked cheaply (no data read, no device), so
  that a wrong path is refused before the workdir is created or its config.json written: for a
  run that will start afresh (`workdir` holds no finished checkpoint), `data.manual_dir` is a
  folder and `init_from` a run it can start from (state.check_init_from). A resumed run is not
  checked: it never reads init_from again, and a run moved to a machine whose prepared datasets
  make its manual_dir unused resumes as before. Raises ConfigError."""
  if checkpoint.finished_steps(workdir):
    return
  data = config.get("data")
  manual_dir = data.get("manual_dir", "") if isinstance(data, ml_collections.ConfigDict) else ""
  folder = pathlib.Path(os.path.expanduser(manual_dir))
  if manual_dir and not folder.is_dir():
    what = "is not a folder" if folder.exists() else "does not exist"
    raise config_utils.ConfigError(
        f"data.manual_dir={manual_dir} {what}: give the folder with the raw data files (e.g. "
        f"../shared/data), or set it to \"\" to use $ATTNLAB_DATA_DIR or a download")
  state_lib.check_init_from(config)


def _own_assets(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> pathlib.Path | None:
  """The workdir's assets folder when it holds a run of this very config, or a run with a
  finished checkpoint (its parameters were trained with those vocabularies and sizes, which
  `_record_start` then keeps and `load_run` reads: a resume with allow_config_change, such as
  more steps, continues with them and needs no dataset or cache to rebuild them), else None."""
  folder = workdir / assets_lib.DIRNAME
  if not (folder.is_dir() and (workdir / rundir.CONFIG_FILE).is_file()):
    return None
  if checkpoint.finished_steps(workdir):
    return folder
  same = not run_config.config_diff(rundir.read_config(workdir).to_dict(), config)
  return folder if same else None


def _record_start(workdir: pathlib.Path, task: tasks.Task, own_assets: bool = True) -> None:
  """Keeps the vocabularies and sizes in the run (once) and appends this start's software
  versions and git commit to provenance.jsonl. `own_assets`: whether the task was built from the
  workdir's assets folder; one it was not built from, in a run without a finished checkpoint, was
  left by an earlier start of another config (which prepare_workdir replaced) and is replaced."""
  folder = workdir / assets_lib.DIRNAME
  if folder.is_dir() and not own_assets and not checkpoint.finished_steps(workdir):
    _LOG.info("replacing %s: it holds the vocabularies of the earlier config", folder)
    shutil.rmtree(folder)
  if not folder.is_dir():
    task.save_assets(folder)
  rundir.record_provenance(workdir)


@contextlib.contextmanager
def _stop_on_refused_writes(workdir: pathlib.Path):
  """Turns a write the disk refuses (full, read-only, ...) into WriteFailed: one line naming what
  could not be written and the last good checkpoint."""
  try:
    yield
  except (RunStopped, UserError):
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


class EarlyStopping:
  """`config.early_stop_patience` = P > 0: the run stops at the evaluation that is the P-th in a
  row not to lower the validation loss below the best so far (a NaN loss never does). The
  evaluation after the last step (the whole split; the others cover config.eval_batches) is
  not counted: the run ends there anyway, with its last checkpoint. The state is a function of
  the run's evaluation records, so a resumed run rebuilds it from metrics.jsonl (`replay`) and
  a run that stopped stays stopped."""

  def __init__(self, patience: int):
    self.patience = patience
    self.best_step: int | None = None  # None until an evaluation has a finite loss
    self.best_loss = math.inf
    self.since_best = 0  # evaluations since the best one

  @classmethod
  def replay(cls, patience: int, records: list[dict[str, Any]]) -> EarlyStopping:
    """The state after the evaluation records of metrics.jsonl."""
    stopper = cls(patience)
    for record in sorted((r for r in records if r.get("split") == "eval" and "loss" in r),
                         key=lambda r: r["step"]):
      stopper.update(record["step"], record["loss"])
    return stopper

  def update(self, step: int, loss: float) -> bool:
    """Counts the evaluation of `step`; True when the run stops there."""
    if math.isfinite(loss) and loss < self.best_loss:
      self.best_step, self.best_loss, self.since_best = step, float(loss), 0
    else:
      self.since_best += 1
    return self.stopped

  @property
  def stopped(self) -> bool:
    return self.since_best >= self.patience

  def record(self) -> dict[str, float]:
    """The early-stop record's fields (rundir.EARLY_STOP_SPLIT)."""
    return {"best_step": -1 if self.best_step is None else self.best_step,
            "best_loss": self.best_loss, "patience": self.patience}

  def protected(self) -> tuple[int, ...]:
    """The checkpoint steps pruning must keep: the best evaluation's."""
    return () if self.best_step is None else (self.best_step,)


def _best_state(ckpt: checkpoint.Checkpointer, stopper: EarlyStopping, state: TrainState,
                abstract: TrainState) -> TrainState:
  """The state of the best evaluation's checkpoint of a run that early stopping ended (`state`
  itself when that checkpoint is gone: a run that turned early stopping on when resumed)."""
  best = stopper.best_step
  if best is not None and best in ckpt.steps():
    return ckpt.restore(best, abstract)[0]
  _LOG.warning("the checkpoint of the best evaluation (step %s) is not in %s; the run's result "
               "is its newest checkpoint", best, ckpt.directory)
  return state


def _train_in_workdir(config: ml_collections.ConfigDict, workdir: pathlib.Path, task: tasks.Task,
                      mesh: jax.sharding.Mesh | None, is_main: bool,
                      own_assets: bool = True, phases: _Phases | None = None) -> TrainState:
  """train_and_evaluate once the workdir is prepared (and locked by this process); `own_assets`:
  the task was built from the workdir's assets folder (`_record_start`); `phases` times the
  phases of the run."""
  phases = phases or _Phases()
  num_steps = config.num_train_steps
  parts = state_lib.training(task, config, mesh)
  tx, seeds, train_iter, shardings = parts.tx, parts.seeds, parts.batches, parts.shardings
  num_seeds = len(seeds)
  plots = _plots(task, workdir, num_seeds) if config.write_plots and is_main else None
  if is_main:
    _record_start(workdir, task, own_assets)

  # Early stopping keeps the best evaluation's checkpoint however old (EarlyStopping.protected);
  # the loop prunes the others itself.
  patience = int(config.get("early_stop_patience", 0))
  ckpt = checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR,
                                 max_to_keep=None if patience else config.keep_checkpoints)
  train_step = make_train_step(task, tx, parts.schedule, num_seeds=num_seeds, mesh=mesh,
                               state_shardings=shardings)
  first_batch = None  # taken from train_iter ahead of the first step (`_start_fresh`)
  warmup = _warm_evaluation(task, parts.abstract, num_seeds)

  def end_setup() -> None:  # the evaluation then compiles beside what follows
    if not warmup.started:
      phases.seconds["setup"] = time.perf_counter() - phases.start
      warmup.start()
  try:
    restored = state_lib.restore_latest(ckpt, parts.abstract, num_seeds, quarantine=is_main)
    if restored is None:
      end_setup()
      state, first_batch = _start_fresh(task, parts, train_step, mesh, phases)
      state = state_lib.with_pretrained(task, tx, state, num_seeds, mesh, shardings)
    else:
      state, data_state = restored
      train_iter.set_state(data_state)
      _LOG.info("resuming %s from checkpoint step %d", workdir, state_lib.step_of(state))
    start = state_lib.step_of(state)
    if is_main:
      rundir.truncate_metrics(workdir, start)
    if start >= num_steps:
      _finish_complete_run(task, state, workdir, start, seeds)
      return state
    _evaluate_if_missing(config, task, state, workdir, start, seeds)
    stopper = EarlyStopping.replay(patience, rundir.read_metrics(workdir)) if patience else None
    if stopper is not None and stopper.stopped:
      _finish_stopped_run(workdir, stopper, start, seeds)
      return _best_state(ckpt, stopper, state, parts.abstract)
    end_setup()
    try:
      state = _train_loop(config, workdir, task, state, train_iter, ckpt, train_step,
                          parts.train_rng, seeds, phases, stopper, plots, warmup, first_batch)
    except BaseException:
      for work in (warmup, plots):
        if work is not None:  # the files the plots write are whole; the loop's error goes on
          work.finish(quiet=True)
      raise
    warmup.finish()
    phases.background["evaluation compile"] = warmup.seconds
    if stopper is not None and stopper.stopped:  # the run's result: its best evaluation
      state = _best_state(ckpt, stopper, state, parts.abstract)
  finally:
    warmup.finish(quiet=True)  # a run that returned or failed before its loop
    ckpt.close()
  if plots is not None:
    with phases("plots"):
      if plots.started:  # drawn beside the final evaluation: wait for the rest
        plots.finish()
        phases.background["plots"] = plots.seconds
      else:  # early stopping's result, the best evaluation's checkpoint: drawn now
        plots.draw_now(state)
  return state


def _finish_complete_run(task: tasks.Task, state: TrainState, workdir: pathlib.Path,
                         step: int, seeds: list[int]) -> None:
  """A run already at its last step: add the final evaluation if a crash skipped it."""
  if not rundir.is_complete(workdir, step):
    with _MetricLogger(workdir, step, seeds) as logger:
      metrics, per_seed = state_lib.evaluate(task, state.params, len(seeds))
      logger.write(step, "eval", metrics, per_seed)
  _LOG.info("%s is complete (step %d); nothing to train", workdir, step)


def _finish_stopped_run(workdir: pathlib.Path, stopper: EarlyStopping, step: int,
                        seeds: list[int]) -> None:
  """A run resumed from the checkpoint at which early stopping ended it: add its early-stop
  record if a crash skipped it, and train nothing."""
  if parallel.is_main_process() and rundir.early_stop(rundir.read_metrics(workdir)) is None:
    with _MetricLogger(workdir, step, seeds) as logger:
      logger.write(step, rundir.EARLY_STOP_SPLIT, stopper.record())
  _LOG.info("%s was stopped early at step %d (early_stop_patience=%d; its best evaluation is "
            "step %s); nothing to train: raise early_stop_patience (with "
            "--config.allow_config_change=True) to train on", workdir, step, stopper.patience,
            stopper.best_step)


def _evaluate_if_missing(config: ml_collections.ConfigDict, task: tasks.Task, state: TrainState,
                         workdir: pathlib.Path, step: int, seeds: list[int]) -> None:
  """A run resumed from checkpoint `step`, an evaluation step whose record is missing (the run
  was killed after saving the checkpoint and before evaluating, or stopped by a signal there):
  evaluate it now, so that no step's evaluation is lost."""
  if step <= 0 or config.eval_every <= 0 or step % config.eval_every:
    return
  if any(r["step"] == step and r.get("split") == "eval" for r in rundir.read_metrics(workdir)):
    return
  _LOG.info("evaluating checkpoint step %d, whose evaluation is missing from %s", step,
            rundir.METRICS_FILE)
  with _MetricLogger(workdir, step, seeds) as logger:
    metrics, per_seed = state_lib.evaluate(task, state.params, len(seeds))
    logger.write(step, "eval", metrics, per_seed)


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


def _compiling_line() -> None:
  _LOG.info("compiling the train step (the first step takes longer) ...")


def _stops_early(stopper: EarlyStopping, step: int, eval_metrics: dict[str, float],
                 task: tasks.Task, logger: _MetricLogger) -> bool:
  """Counts evaluation `step` for early stopping; when it ends the run, writes the early-stop
  record and says so in the log."""
  if "loss" not in eval_metrics:
    raise config_utils.ConfigError(
        f"early_stop_patience watches the validation loss, which the {task.name!r} task's "
        f"evaluation does not report (it reports {', '.join(eval_metrics)}); set "
        f"early_stop_patience=0")
  if not stopper.update(step, eval_metrics["loss"]):
    return False
  logger.write(step, rundir.EARLY_STOP_SPLIT, stopper.record())
  _LOG.info("early stopping at step %d: the validation loss has not improved on its best "
            "(%.4g, step %s) for %d evaluations (early_stop_patience=%d); training stopped, and "
            "checkpoint %s, the best, is the run's result (generate, view and export use it)",
            step, stopper.best_loss, stopper.best_step, stopper.since_best, stopper.patience,
            stopper.best_step)
  return True


# Steps dispatched ahead of the last one known finished. Unbounded (the loop waits only when it
# logs, every log_every = 50 steps), a nano GPT on two CPU devices stopped in XLA:CPU's
# collective timeout in about half of a dozen runs of such a loop: one device's part of a step
# waited at its all-reduce while the other's could not be launched (PjRt's launch blocked on a
# semaphore held by steps queued behind). Eight ahead: none in six runs (issue #51's second
# pass). Two ahead keeps the next step queued behind the running one and was faster on a 2-core
# CPU: the nano GPT's step 4-7% faster than with eight in alternating rounds of one process, its
# 800-step runs 2.2% over eight alternating pairs (experiments/benchmarks/README.md,
# issue #51's sixth pass).
MAX_STEPS_AHEAD = 2


class StepsInFlight:
  """The losses of the dispatched steps not yet known finished: `add` waits for the oldest once
  more than MAX_STEPS_AHEAD are in flight (or at once with `wait`). The trainer's loop, and the
  benchmark that times it (experiments/benchmarks/step_profile.py --loops)."""

  def __init__(self):
    self._losses: collections.deque = collections.deque()

  def add(self, loss: jax.Array, wait: bool = False) -> None:
    self._losses.append(loss)
    if wait or len(self._losses) > MAX_STEPS_AHEAD:
      jax.block_until_ready(self._losses.popleft())


def _train_loop(config, workdir, task, state, train_iter, ckpt, train_step, train_rng,
                seeds, phases: _Phases | None = None,
                stopper: EarlyStopping | None = None, plots: _Background | None = None,
                warmup: _Background | None = None, first_batch: Any = None) -> TrainState:
  """Trains from the state's step to config.num_train_steps, or until `stopper` (early
  stopping) says stop (then `stopper.stopped`); returns the state at the last step trained.
  `plots`: started on the last step's state, once it is saved, beside the final evaluation (a
  run that early stopping ends returns before its last step: its result, the best evaluation's
  checkpoint, is drawn afterwards). `warmup`: the evaluation's compile, waited for before the
  first evaluation. `first_batch`: the first step's batch, already taken from `train_iter`."""
  phases = phases or _Phases()
  num_steps, start, num_seeds = config.num_train_steps, state_lib.step_of(state), len(seeds)
  pending: list[tuple[int, dict]] = []  # per-step metrics (on device) since the last log
  in_flight = StepsInFlight()
  checked = 0  # pending[:checked] are known to have a finite loss
  with (_MetricLogger(workdir, start, seeds) as logger,
        contextlib.closing(_progress_bar(num_steps, start)) as bar,
        _StopRequest() as stop, contextlib.ExitStack() as stack):
    last_log_step, last_log_time = start, time.time()
    if not bar.disable:
      from tqdm.contrib.logging import logging_redirect_tqdm  # pylint: disable=g-import-not-at-top
      stack.enter_context(logging_redirect_tqdm([logging.getLogger("attnlab")]))
    if first_batch is None:  # else compiled ahead (`_start_fresh`)
      _compiling_line()
    for step in range(start + 1, num_steps + 1):
      first = step == start + 1
      with phases("first step (compile)" if first else "training steps"):
        batch = first_batch if first and first_batch is not None else next(train_iter)
        state, metrics = train_step(state, batch, train_rng)
        in_flight.add(metrics["loss"], wait=first)
      if first:
        _LOG.info("first train step done in %.1f s (compiling it included)",
                  phases.seconds["first step (compile)"])
      pending.append((step, metrics))
      bar.update()
      last, stopping = step == num_steps, stop.signum is not None
      do_log = step % config.log_every == 0 or last or stopping
      do_ckpt = last or stopping or (
          config.checkpoint_every > 0 and step % config.checkpoint_every == 0)
      do_eval = last or (not stopping and config.eval_every > 0 and step % config.eval_every == 0)
      do_ckpt = do_ckpt or (do_eval and stopper is not None)  # each evaluation may be the best
      if not (do_log or do_ckpt or do_eval):
        continue
      with phases("training steps"):  # reads the steps' losses: their device time lands here
        _check_finite(pending[checked:], ckpt, seeds)  # before anything is written for this step
      checked = len(pending)
      if do_log:
        now = time.time()
        summary, per_seed = state_lib.mean_metrics(pending, num_seeds)
        steps_per_sec = (step - last_log_step) / max(now - last_log_time, 1e-9)
        logger.write(step, "train", summary, per_seed, steps_per_sec=steps_per_sec)
        bar.set_postfix(loss=f"{summary['loss']:.4g}", refresh=False)
        if bar.disable:
          _LOG.info("step %d: loss %.4g, %.1f steps/s", step, summary["loss"], steps_per_sec)
        pending, checked = [], 0
        last_log_step, last_log_time = step, now
      if do_ckpt:
        with phases("checkpoints"):
          ckpt.save(step, state, train_iter.get_state())
      if last and plots is not None:  # the run's result (early stopping returns before it)
        plots.start_with(state)
      if do_eval:
        # A fixed subset before the last step (config.eval_batches), the whole split at the end.
        subset = 0 if last else config.get("eval_batches", 0)
        with phases("final evaluation" if last else "evaluations"):
          if warmup is not None:
            warmup.finish()
          eval_metrics, per_seed = state_lib.evaluate(task, state.params, num_seeds, subset)
        logger.write(step, "eval", eval_metrics, per_seed,
                     **({"eval_batches": subset} if subset else {}))
        _LOG.info("step %d eval: %s", step,
                  ", ".join(f"{k}={v:.4g}" for k, v in eval_metrics.items()))
        last_log_time = time.time()  # throughput counts training only
        if stopper is not None and not last and _stops_early(stopper, step, eval_metrics, task,
                                                              logger):
          if pending:  # the steps since the last log (no resumed run trains them again)
            summary, per_seed = state_lib.mean_metrics(pending, num_seeds)
            logger.write(step, "train", summary, per_seed)
          ckpt.prune(config.keep_checkpoints, stopper.protected())
          return state
      if do_ckpt and stopper is not None:
        ckpt.prune(config.keep_checkpoints, stopper.protected())
      if stopping and not last:
        name = signal.Signals(stop.signum).name
        raise TrainingInterrupted(
            f"stopped by {name} at step {step}; checkpoint saved in {ckpt.directory}; run the "
            f"same command to resume", stop.signum)
  return state
