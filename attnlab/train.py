"""The one training loop for every model family: `train_and_evaluate(config, workdir)`.

The task (attnlab/tasks) supplies model, data, loss and evaluation; this module supplies the rest:
the optax optimizer from `config.optimizer`, a jit-compiled train step with donated state, the run
directory (attnlab/checkpoint.py), TensorBoard events, a tqdm progress bar, resume, and the faults:
a non-finite loss stops the run without saving over the last good checkpoint; SIGTERM or Ctrl-C
saves a checkpoint and stops.

Determinism: parameters come from `split(key(seed))[0]`; step t's dropout/sampling key is
`fold_in(split(key(seed))[1], t)`, so the key needs no saving; the data order comes from the task's
iterator, whose state is in every checkpoint. A resumed run therefore ends with the same
parameters, bit for bit, as an uninterrupted one.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import os
import pathlib
import signal
import threading
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from attnlab import checkpoint
from attnlab import config_utils
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


class RunStopped(RuntimeError):
  """Training stopped early; the command-line tools print the message and exit with exit_code."""
  exit_code = 1


class NonFiniteLossError(RunStopped):
  """The loss became NaN or Inf; nothing was saved after the last good checkpoint."""


class TrainingInterrupted(RunStopped):
  """SIGTERM or SIGINT (Ctrl-C) arrived; a checkpoint was saved before stopping."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum
    self.exit_code = 128 + signum


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


def make_optimizer(opt: ml_collections.ConfigDict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
  """adamw, adam or sgd on `schedule`, after global-norm clipping when opt.grad_clip > 0."""
  if opt.name == "adamw":
    tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay)
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


def abstract_train_state(task: tasks.Task, tx: optax.GradientTransformation,
                         rng: jax.Array) -> TrainState:
  """Shapes, dtypes and shardings of `create_train_state` without computing it (restore target)."""
  abstract = jax.eval_shape(functools.partial(create_train_state, task, tx), rng)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract)


def make_train_step(task: tasks.Task, tx: optax.GradientTransformation, schedule: optax.Schedule):
  """The jitted update `(state, batch, rng) -> (state, metrics)`; the input state is donated."""
  def train_step(state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict]:
    TRACE_COUNTS["train_step"] += 1
    step_rng = jax.random.fold_in(rng, state.step)
    grad_fn = jax.value_and_grad(task.loss_fn, has_aux=True)
    (loss, metrics), grads = grad_fn(state.params, batch, step_rng)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics
  return jax.jit(train_step, donate_argnums=0)


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
  """(init key, train key) of a run; step t uses fold_in(train key, t)."""
  init_rng, train_rng = jax.random.split(jax.random.key(seed))
  return init_rng, train_rng


# ---------------------------------------------------------------------------------------------------
# Logging


class _MetricLogger:
  """Appends records to metrics.jsonl and TensorBoard."""

  def __init__(self, workdir: pathlib.Path, start_step: int):
    import tensorboardX  # pylint: disable=g-import-not-at-top  (slow import, only when training)
    self._file = open(workdir / checkpoint.METRICS_FILE, "a")
    self._tb = tensorboardX.SummaryWriter(str(workdir / "tensorboard"),
                                          purge_step=start_step + 1 if start_step else None)

  def write(self, step: int, split: str, metrics: dict[str, float], **extra: float) -> None:
    record = {"step": step, "split": split, **metrics, "wall_time": time.time(), **extra}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for name, value in {**metrics, **extra}.items():
      self._tb.add_scalar(f"{split}/{name}", value, step)
    self._tb.flush()

  def close(self) -> None:
    self._file.close()
    self._tb.close()


def _mean_metrics(pending: list[tuple[int, dict]]) -> dict[str, float]:
  values = jax.device_get([m for _, m in pending])
  return {key: float(np.mean([v[key] for v in values])) for key in values[0]}


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
  return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, disable=None,
              desc="train")


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
  workdir = pathlib.Path(workdir).absolute()
  task = tasks.build_task(config)  # before touching the workdir: a bad model config writes nothing
  checkpoint.prepare_workdir(workdir, config)
  num_steps = config.num_train_steps
  schedule = make_schedule(config.optimizer, num_steps)
  tx = make_optimizer(config.optimizer, schedule)
  init_rng, train_rng = run_keys(config.seed)
  train_iter = task.train_iterator()

  ckpt = checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR,
                                 max_to_keep=config.keep_checkpoints)
  try:
    restored = ckpt.restore_latest(abstract_train_state(task, tx, init_rng), quarantine=True)
    if restored is None:
      state = create_train_state(task, tx, init_rng)
    else:
      state, data_state = restored
      train_iter.set_state(data_state)
      _LOG.info("resuming %s from checkpoint step %d", workdir, int(state.step))
    start = int(state.step)
    checkpoint.truncate_metrics(workdir, start)
    if start >= num_steps:
      _finish_complete_run(task, state, workdir, start)
      return state
    state = _train_loop(config, workdir, task, state, train_iter, ckpt,
                        make_train_step(task, tx, schedule), train_rng)
  finally:
    ckpt.close()
  if config.write_plots:
    task.write_plots(state.params, workdir)
  return state


def _finish_complete_run(task: tasks.Task, state: TrainState, workdir: pathlib.Path,
                         step: int) -> None:
  """A run already at its last step: add the final evaluation if a crash skipped it."""
  if not checkpoint.is_complete(workdir, step):
    logger = _MetricLogger(workdir, step)
    logger.write(step, "eval", task.evaluate(state.params))
    logger.close()
  _LOG.info("%s is complete (step %d); nothing to train", workdir, step)


def _check_finite(pending: list[tuple[int, dict]], ckpt: checkpoint.Checkpointer) -> None:
  losses = jax.device_get([m["loss"] for _, m in pending])
  for (step, _), loss in zip(pending, losses):
    if not np.isfinite(loss):
      last = ckpt.latest_step()
      kept = (f"the last good checkpoint is step {last} in {ckpt.directory}" if last is not None
              else "no checkpoint had been saved yet")
      raise NonFiniteLossError(
          f"loss is {float(loss)} at step {step}; training stopped and nothing was saved after it: "
          f"{kept}, metrics.jsonl is intact. Lower optimizer.learning_rate or set "
          f"optimizer.grad_clip, and pass --config.allow_config_change=True to resume from it")


def _train_loop(config, workdir, task, state, train_iter, ckpt, train_step, train_rng) -> TrainState:
  num_steps, start = config.num_train_steps, int(state.step)
  logger = _MetricLogger(workdir, start)
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
        _check_finite(pending[checked:], ckpt)  # before anything is written for this step
        checked = len(pending)
        if do_log:
          now = time.time()
          summary = _mean_metrics(pending)
          steps_per_sec = (step - last_log_step) / max(now - last_log_time, 1e-9)
          logger.write(step, "train", summary, steps_per_sec=steps_per_sec)
          bar.set_postfix(loss=f"{summary['loss']:.4g}", refresh=False)
          if bar.disable:
            _LOG.info("step %d: loss %.4g, %.1f steps/s", step, summary["loss"], steps_per_sec)
          pending, checked = [], 0
          last_log_step, last_log_time = step, now
        if do_ckpt:
          ckpt.save(step, state, train_iter.get_state())
        if do_eval:
          eval_metrics = task.evaluate(state.params)
          logger.write(step, "eval", eval_metrics)
          _LOG.info("step %d eval: %s", step,
                    ", ".join(f"{k}={v:.4g}" for k, v in eval_metrics.items()))
          last_log_time = time.time()  # throughput counts training only
        if stopping and not last:
          name = signal.Signals(stop.signum).name
          raise TrainingInterrupted(
              f"stopped by {name} at step {step}; checkpoint saved in {ckpt.directory}; run the "
              f"same command to resume", stop.signum)
  finally:
    bar.close()
    logger.close()
  return state
