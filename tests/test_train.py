"""The training loop: run directory, one compile, NaN guard, resume after SIGTERM and SIGKILL."""

import io
import json
import logging
import math
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import analysis
from attnlab import checkpoint
from attnlab import config_utils
from attnlab import run_config
from attnlab import errors
from attnlab import rundir
from attnlab import tasks
from attnlab import train
from attnlab.cli import tool
from attnlab.cli import train as train_cli

REPO = pathlib.Path(__file__).resolve().parents[1]
NW = str(REPO / "configs" / "nadaraya_watson.py")
LOCAL = "runlocal=True,write_plots=False"


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
  """A runlocal run: 20 steps, logs every 5, eval and checkpoints every 10."""
  workdir = tmp_path_factory.mktemp("run")
  config = config_utils.load_config_file(f"{NW}:{LOCAL}")
  steps, make = [], train.make_train_step
  lines = io.StringIO()
  handler, logger = logging.StreamHandler(lines), logging.getLogger("attnlab.train")
  with pytest.MonkeyPatch.context() as patch:  # keep the train steps the run builds
    patch.setattr(train, "make_train_step", lambda *a, **k: steps.append(make(*a, **k)) or steps[-1])
    # and its progress messages: setLevel, which also clears the logger's cache of enabled levels
    # (an INFO line logged earlier in the process, at WARNING, left "INFO: off" there)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
      state = train.train_and_evaluate(config, workdir)
    finally:
      logger.removeHandler(handler)
      logger.setLevel(level)
  return config, workdir, state, [step.traces for step in steps], lines.getvalue().splitlines()


def test_run_directory(local_run):
  config, workdir, state, _, _ = local_run
  assert json.loads((workdir / "config.json").read_text()) == run_config.to_jsonable(config)
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [10, 20]
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["split"]) for r in records] == [
      (5, "train"), (10, "train"), (10, "eval"), (15, "train"), (20, "train"), (20, "eval")]
  for r in records:
    assert isinstance(r["wall_time"], float)
  for r in records[:2]:
    assert {"loss", "mse", "grad_norm", "learning_rate", "w", "steps_per_sec"} <= set(r)
  assert {"test_mse", "train_loo_mse", "w"} <= set(records[-1])
  # The logged final w is the trained parameter.
  assert records[-1]["w"] == float(state.params["w"])
  assert int(state.step) == 20


def test_train_step_compiles_once(local_run):
  assert local_run[3] == [1]  # one train step built, traced once


def test_startup_lines_announce_the_compile_and_time_the_first_step(local_run):
  lines = local_run[4]
  compiling = [i for i, line in enumerate(lines) if line.startswith("compiling the train step")]
  first = [i for i, line in enumerate(lines) if line.startswith("first train step done in ")]
  progress = [i for i, line in enumerate(lines) if line.startswith("step ")]
  assert len(compiling) == len(first) == 1 and progress, lines
  assert compiling[0] < first[0] < progress[0]  # before anything else of the loop
  seconds = float(lines[first[0]].split("done in ")[1].split(" s")[0])
  assert 0 < seconds < 600


def test_the_run_ends_with_the_seconds_of_each_phase(local_run):
  """One line names where the run's time went: setup, the first step (its compile), the other
  steps, checkpoints, evaluations; the phases add up to no more than the total."""
  lines = [line for line in local_run[4] if line.startswith("run phases: ")]
  assert len(lines) == 1 and lines[0] == local_run[4][-1], local_run[4]
  body, total = lines[0][len("run phases: "):].split("; total ")
  seconds = {}
  for part in body.split(", "):
    name, value = part.rsplit(" ", 2)[0], float(part.rsplit(" ", 2)[1])
    seconds[name] = value
  assert {"setup", "first step (compile)", "training steps", "checkpoints", "evaluations",
          "final evaluation", "other"} <= set(seconds), seconds
  assert all(v >= 0 for v in seconds.values())
  assert abs(sum(seconds.values()) - float(total.split(" s")[0])) < 0.15  # rounding of 8 parts


def test_evaluation_matches_numpy_reference(local_run):
  config, _, state, _, _ = local_run
  task = tasks.build_task(config)
  data = task.data
  assert len(data.x_train) == 50 and np.all(np.diff(data.x_train) >= 0)
  assert data.x_train.min() >= 0 and data.x_train.max() < 10
  np.testing.assert_allclose(data.x_test, np.arange(100) * 0.1, atol=1e-5)
  w = float(state.params["w"])
  logits = -np.square((data.x_test[:, None] - data.x_train[None, :]) * w) / 2  # [100, 50]
  weights = np.exp(logits - logits.max(1, keepdims=True))
  weights /= weights.sum(1, keepdims=True)
  pred = weights @ data.y_train
  expected = np.mean((pred - (data.x_test + np.sin(data.x_test))) ** 2)
  assert task.evaluate(state.params)["test_mse"] == pytest.approx(expected, rel=1e-4)


def test_schedule_matches_reference():
  opt = config_utils.base_config().optimizer
  opt.learning_rate, opt.warmup_steps, opt.end_learning_rate = 1.0, 10, 0.1
  schedule = train.make_schedule(opt, 110)
  for step in (0, 5, 10, 60, 110):
    if step < 10:
      expected = step / 10
    else:
      expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 10) / 100))
    assert float(schedule(step)) == pytest.approx(expected, abs=1e-6)
  opt.schedule = "linear"
  assert float(train.make_schedule(opt, 110)(60)) == pytest.approx(0.55, abs=1e-6)


def test_grad_clip_limits_update():
  opt = config_utils.base_config().optimizer
  opt.name, opt.learning_rate, opt.schedule, opt.grad_clip = "sgd", 1.0, "constant", 0.5
  tx = train.make_optimizer(opt, train.make_schedule(opt, 10))
  grads = {"a": jnp.array([3.0, 4.0])}  # norm 5 -> clipped to 0.5
  updates, _ = tx.update(grads, tx.init(grads))
  np.testing.assert_allclose(np.asarray(updates["a"]), [-0.3, -0.4], rtol=1e-6)


@tasks.register_task("nan_probe")
class NanProbeTask(tasks.Task):
  """Loss w², which becomes NaN from step data.nan_at on."""

  def init(self, rng):
    return {"w": jnp.ones(())}

  def train_iterator(self):
    return tasks.IndexedBatches(lambda i: {"i": np.int32(i)})

  def loss_fn(self, params, batch, rng):
    bad = batch["i"] + 1 >= self.config.data.nan_at  # step t consumes batch t - 1
    return jnp.where(bad, jnp.nan, jnp.square(params["w"])), {}

  def evaluate(self, params):
    return {"w": float(params["w"])}


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  config = config_utils.base_config()
  config.task = "nan_probe"
  config.num_train_steps, config.log_every, config.checkpoint_every = 20, 3, 5
  config.eval_every, config.write_plots = 0, False
  config.data.nan_at = 7
  with pytest.raises(errors.NonFiniteLossError) as info:
    train.train_and_evaluate(config, tmp_path)
  message = str(info.value)
  assert "loss is nan at step 7" in message and "last good checkpoint is step 5" in message
  with checkpoint.Checkpointer(tmp_path / "checkpoints") as ckpt:
    assert ckpt.steps() == [5]

  def no_nan(token):
    raise AssertionError(f"{token} in metrics.jsonl")
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  records = [json.loads(line, parse_constant=no_nan) for line in lines]
  assert [(r["step"], r["split"]) for r in records] == [(3, "train"), (6, "train")]
  run = analysis.load_run(tmp_path)
  assert run.step == 5 and np.isfinite(float(run.params["w"]))


def test_changed_config_is_refused_unless_allowed(local_run, tmp_path):
  _, workdir, _, _, _ = local_run
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  config = config_utils.load_config_file(f"{NW}:{LOCAL},seed=1")
  with pytest.raises(errors.ConfigMismatchError, match=r"seed: 0 -> 1.*allow_config_change"):
    train.train_and_evaluate(config, copy)
  config = config_utils.load_config_file(f"{NW}:{LOCAL},num_train_steps=25,allow_config_change=True")
  state = train.train_and_evaluate(config, copy)
  assert int(state.step) == 25
  assert json.loads((copy / "config.json").read_text())["num_train_steps"] == 25


def test_corrupt_checkpoint_falls_back_to_previous(local_run, tmp_path):
  config, workdir, state, _, _ = local_run
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  for path in (copy / "checkpoints" / "20" / "state").rglob("*"):
    if path.is_file() and path.parent.name == "d":
      path.write_bytes(b"garbage")
  rundir.truncate_metrics(copy, 10)  # as if the run had died right after saving step 20
  messages = []
  handler = logging.Handler()
  handler.emit = lambda record: messages.append(record.getMessage())
  logger = logging.getLogger("attnlab.checkpoint")
  logger.addHandler(handler)
  try:
    resumed = train.train_and_evaluate(config, copy)
  finally:
    logger.removeHandler(handler)
  warning = " ".join(messages)
  assert "checkpoint step 20 is unreadable: file " + str(copy / "checkpoints" / "20") in warning
  assert (copy / "checkpoints_corrupt" / "20").is_dir()
  assert float(resumed.params["w"]) == float(state.params["w"])  # redone from step 10, same result


def _steps(workdir: pathlib.Path) -> list[int]:
  directory = workdir / "checkpoints"
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _start(spec: str, workdir: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
  with open(log, "w") as f:
    return subprocess.Popen([sys.executable, "-m", "attnlab.cli.train", f"--config={spec}",
                             f"--workdir={workdir}"], stdout=f, stderr=subprocess.STDOUT)


def _wait_for_checkpoint_after(proc, workdir, step, timeout=120.0):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if any(s > step for s in _steps(workdir)):
      return
    assert proc.poll() is None, "the run ended before it could be interrupted"
    time.sleep(0.01)
  raise AssertionError(f"no checkpoint after step {step} within {timeout}s")


@pytest.mark.slow
def test_sigterm_and_sigkill_then_resume_is_bit_identical(tmp_path):
  args = f"{LOCAL},num_train_steps=40,log_every=2,eval_every=0,keep_checkpoints=3"
  spec = f"{NW}:{args},checkpoint_every=2"  # a save every 2 steps makes the run last seconds
  reference = train.train_and_evaluate(
      config_utils.load_config_file(f"{NW}:{args},checkpoint_every=0"), tmp_path / "reference")
  workdir = tmp_path / "run"

  # SIGTERM: saves a checkpoint at the current step, exits with 128 + 15.
  proc = _start(spec, workdir, tmp_path / "sigterm.log")
  _wait_for_checkpoint_after(proc, workdir, 0)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=120) == 128 + signal.SIGTERM
  log = (tmp_path / "sigterm.log").read_text()
  stopped_at = int(log.split("stopped by SIGTERM at step ")[1].split(";")[0])
  assert stopped_at < 40 and _steps(workdir)[-1] == stopped_at

  # SIGKILL: no chance to save; the run restarts from its last finished checkpoint.
  proc = _start(spec, workdir, tmp_path / "sigkill.log")
  _wait_for_checkpoint_after(proc, workdir, stopped_at)
  proc.kill()
  proc.wait(timeout=60)
  assert "resuming" in (tmp_path / "sigkill.log").read_text()
  killed_at = _steps(workdir)[-1]
  assert stopped_at < killed_at < 40

  # The same command again (here in-process, through main) finishes the run.
  assert train_cli.main(["attnlab train", f"--config={spec}", f"--workdir={workdir}"]) == 0
  run = analysis.load_run(workdir)
  assert run.step == 40
  for name in reference.params:
    np.testing.assert_array_equal(np.asarray(run.params[name]), np.asarray(reference.params[name]))
  records = rundir.read_metrics(workdir)
  train_steps = [r["step"] for r in records if r["split"] == "train"]
  assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 40
  final = {r["split"]: r for r in records if r["step"] == 40}
  ref_final = {r["split"]: r for r in rundir.read_metrics(tmp_path / "reference")
               if r["step"] == 40}
  assert final["train"]["loss"] == ref_final["train"]["loss"]
  assert final["eval"]["test_mse"] == ref_final["eval"]["test_mse"]


def test_weight_decay_on_matrices_only():
  opt = config_utils.base_config().optimizer
  opt.learning_rate, opt.schedule, opt.weight_decay, opt.decay = 0.5, "constant", 0.1, "matrices"
  tx = train.make_optimizer(opt, train.make_schedule(opt, 10))
  params = {"kernel": jnp.full((2, 3), 2.0), "scale": jnp.full((3,), 2.0)}
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  # Zero gradients: Adam's step is 0, so the update is -lr * wd * param where decay applies.
  np.testing.assert_allclose(np.asarray(updates["kernel"]), np.full((2, 3), -0.5 * 0.1 * 2.0))
  np.testing.assert_array_equal(np.asarray(updates["scale"]), np.zeros(3))
  opt.decay = "all"
  tx = train.make_optimizer(opt, train.make_schedule(opt, 10))
  updates, _ = tx.update(zeros, tx.init(params), params)
  np.testing.assert_allclose(np.asarray(updates["scale"]), np.full(3, -0.5 * 0.1 * 2.0))
  opt.decay = "biases"
  with pytest.raises(config_utils.ConfigError, match="optimizer.decay"):
    train.make_optimizer(opt, train.make_schedule(opt, 10))


def test_progress_messages_follow_stderr_when_it_is_replaced(monkeypatch):
  # A tool run under one stderr (a capture, a redirect) and a later run under another: messages go
  # to the live stderr, and the first one's closing breaks nothing ("--- Logging error ---").
  logger = logging.getLogger("attnlab")
  monkeypatch.setattr(logger, "handlers", [])
  first, second = io.StringIO(), io.StringIO()
  monkeypatch.setattr(sys, "stderr", first)
  tool.setup_logging()
  logger.info("first message")
  assert first.getvalue().rstrip().endswith("I first message")
  first.close()
  monkeypatch.setattr(sys, "stderr", second)
  tool.setup_logging()  # the handler is kept (not added twice) ...
  logger.info("second message")
  assert len(logger.handlers) == 1
  assert second.getvalue().rstrip().endswith("I second message")  # ... and writes here
  assert "Logging error" not in second.getvalue()


class _RowsTask(tasks.Task):
  """Evaluation batches of known values: batch b holds rows b*10 .. b*10 + 3 (metric: the mean)."""

  def init(self, rng):
    return {}

  def train_iterator(self):
    return tasks.IndexedBatches(lambda i: {"x": np.zeros(4, np.float32)})

  def loss_fn(self, params, batch, rng):
    return jnp.mean(batch["x"]), {}

  def eval_batches(self):
    return [{"x": np.arange(4, dtype=np.float32) + 10 * b} for b in range(5)]

  def metric_sums(self, params, batch, rng=None):
    return {"x": (jnp.sum(batch["x"]), jnp.asarray(batch["x"].shape[0], jnp.float32))}


def test_evaluation_on_a_fixed_subset_of_batches():
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top
  task = _RowsTask(config_utils.base_config())
  rows = np.arange(4)[None, :] + 10 * np.arange(5)[:, None]  # [batches, rows]
  assert state_lib.evaluate(task, {})[0]["x"] == pytest.approx(rows.mean())
  assert state_lib.evaluate(task, {}, max_batches=2)[0]["x"] == pytest.approx(rows[:2].mean())
  with pytest.raises(config_utils.ConfigError, match="eval_batches must be >= 0"):
    config_utils.validate(config_utils.load_config_file(f"{NW}:{LOCAL},eval_batches=-1"))
