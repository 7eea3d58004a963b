"""The whole run's end and start (attnlab/train.py, issue #51): the end-of-run plots drawn on a
thread beside the final evaluation and in the run directory when the run returns, evaluation
records the same as without plots, the evaluation program compiled once (ahead, beside the train
step's compile), a failed plot raised, and the initial state traced once."""

import io
import logging
import pathlib
import threading
import time

import jax
import numpy as np
import pytest

from attnlab import config_utils
from attnlab import rundir
from attnlab import state as state_lib
from attnlab import tasks
from attnlab import train
from attnlab.tasks import causal_lm

REPO = pathlib.Path(__file__).resolve().parents[1]
GPT = str(REPO / "configs" / "gpt.py")
NW = str(REPO / "configs" / "nadaraya_watson.py")


def _gpt_config(data: pathlib.Path, tmp: pathlib.Path, **extra):
  more = "".join(f",{k}={v}" for k, v in extra.items())
  return config_utils.load_config_file(
      f"{GPT}:runlocal=True,num_train_steps=4,eval_every=2,checkpoint_every=2,"
      f"data.manual_dir={data},data.data_dir={tmp / 'tfds'},data.eval_windows=8,"
      f"generate.num_tokens=10{more}")


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory, shared_data):
  """Two runlocal GPT runs of the same config, with and without plots; the plotted one records
  when its plots and its evaluations ran (and on which thread), how often the evaluation program
  was traced, and its log lines."""
  tmp = tmp_path_factory.mktemp("whole_run")
  events, traces = [], []
  write_plots, evaluate = causal_lm.CausalLMTask.write_plots, state_lib.evaluate
  metric_sums = causal_lm.CausalLMTask.metric_sums

  def slow_plots(self, params, workdir):
    events.append(("plots", time.monotonic(), threading.current_thread().name))
    time.sleep(1.0)  # long enough that the final evaluation must run meanwhile
    write_plots(self, params, workdir)
    events.append(("plots done", time.monotonic(), (pathlib.Path(workdir) / "sample.txt").read_text()))

  def timed_evaluate(task, params, num_seeds=1, max_batches=0):
    events.append(("eval", time.monotonic(), max_batches))
    return evaluate(task, params, num_seeds, max_batches)

  def counted_sums(self, params, batch, rng=None):
    traces.append(threading.current_thread().name)  # the Python body runs once per trace
    return metric_sums(self, params, batch, rng)

  log = io.StringIO()
  handler, logger = logging.StreamHandler(log), logging.getLogger("attnlab.train")
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(causal_lm.CausalLMTask, "write_plots", slow_plots)
    patch.setattr(causal_lm.CausalLMTask, "metric_sums", counted_sums)
    patch.setattr(state_lib, "evaluate", timed_evaluate)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel also clears the logger's cache of enabled levels
    logger.addHandler(handler)
    try:
      plotted = train.train_and_evaluate(_gpt_config(shared_data, tmp), tmp / "plotted")
      files_on_return = {name: (tmp / "plotted" / name).exists()
                         for name in ("sample.txt", "attention.png")}
    finally:
      logger.removeHandler(handler)
      logger.setLevel(level)
  plain = train.train_and_evaluate(_gpt_config(shared_data, tmp, write_plots=False), tmp / "plain")
  return tmp, plotted, plain, events, traces, files_on_return, log.getvalue().splitlines()


def test_plots_are_drawn_beside_the_final_evaluation_and_there_on_return(gpt_runs):
  tmp, _, _, events, _, files_on_return, lines = gpt_runs
  assert files_on_return == {"sample.txt": True, "attention.png": True}
  assert (tmp / "plotted" / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (tmp / "plotted" / "sample.txt").read_text().startswith("ROMEO:")
  (_, start, thread), = [e for e in events if e[0] == "plots"]
  (_, end, sample), = [e for e in events if e[0] == "plots done"]
  assert thread != threading.main_thread().name
  final = [t for name, t, subset in (e for e in events if e[0] == "eval") if subset == 0]
  assert len(final) == 1 and start <= final[0] <= end  # the final evaluation ran meanwhile
  phases = [l for l in lines if l.startswith("run phases: ")]
  assert len(phases) == 1 and "; plots " in phases[0] and " s in the background" in phases[0]
  assert sample == (tmp / "plotted" / "sample.txt").read_text()


def test_evaluation_records_do_not_change_with_the_plots(gpt_runs, shared_data):
  tmp, plotted, plain, _, _, _, _ = gpt_runs
  strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_time", "steps_per_sec")}
  a = [strip(r) for r in rundir.read_metrics(tmp / "plotted")]
  b = [strip(r) for r in rundir.read_metrics(tmp / "plain")]
  assert [(r["step"], r["split"]) for r in a] == [(r["step"], r["split"]) for r in b]
  assert a == b
  for x, y in zip(jax.tree.leaves(plotted.params), jax.tree.leaves(plain.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The last record is the whole validation split's mean cross-entropy: recomputed here from the
  # model's logits with NumPy (log-softmax of each window's positions).
  config = _gpt_config(shared_data, tmp)
  task = tasks.build_task(config)
  loss_sum, count = 0.0, 0
  for batch in task.eval_batches():
    logits = np.asarray(task.model.apply({"params": plain.params}, batch["inputs"]), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]  # [batch, len]
    loss_sum += float(-(picked * batch["weights"]).sum())
    count += int(batch["weights"].sum())
  final = [r for r in a if r["split"] == "eval"][-1]
  assert final["loss"] == pytest.approx(loss_sum / count, rel=1e-4)


def test_the_evaluation_program_is_traced_once_ahead_of_the_first_evaluation(gpt_runs):
  _, _, _, _, traces, _, _ = gpt_runs
  # One trace for the run's two evaluations and its final one, made on the warm-up thread (the
  # plots' attention capture calls the model, not metric_sums).
  assert len(traces) == 1 and traces[0] != threading.main_thread().name, traces


def test_a_failed_plot_is_raised_and_the_run_is_saved_first(tmp_path, monkeypatch):
  from attnlab.tasks import regression  # pylint: disable=g-import-not-at-top

  def broken(self, params, workdir):
    raise RuntimeError("the plot broke")
  monkeypatch.setattr(regression.RegressionTask, "write_plots", broken)
  # 6 steps: not test_train.py's program (an identical one, compiled in this process, would
  # make that file's first step take no time)
  config = config_utils.load_config_file(f"{NW}:runlocal=True,num_train_steps=6")
  with pytest.raises(RuntimeError, match="the plot broke"):
    train.train_and_evaluate(config, tmp_path / "run")
  records = rundir.read_metrics(tmp_path / "run")
  assert records[-1]["split"] == "eval" and records[-1]["step"] == config.num_train_steps
  assert (tmp_path / "run" / "checkpoints" / str(config.num_train_steps)).is_dir()


def test_initial_state_is_traced_once(monkeypatch):
  """The abstract state (the restore target) and the initial values come from one trace of the
  task's init; the values are those of the eagerly built state."""
  config = config_utils.load_config_file(f"{NW}:runlocal=True")
  task = tasks.build_task(config)
  inits = []
  init = type(task).init
  monkeypatch.setattr(type(task), "init", lambda self, rng: inits.append(1) or init(self, rng))
  parts = state_lib.training(task, config, None)
  state = state_lib.initial_state(task, parts.tx, parts.init_rng, 1, None, None)
  assert len(inits) == 1
  assert jax.tree.structure(state) == jax.tree.structure(parts.abstract)
  eager = state_lib.create_train_state(task, parts.tx, parts.init_rng)
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(eager)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_attention_picture_is_the_unpadded_samples_attention(gpt_runs, shared_data,
                                                                    monkeypatch, tmp_path):
  """write_plots captures the attention on the sample padded to PLOT_TOKENS (one program,
  compiled while the sample is generated) and shows its first rows and columns: they must be
  the attention of the sample alone (here 16 tokens: "ROMEO:" and 10 sampled)."""
  from attnlab import plotting  # pylint: disable=g-import-not-at-top
  from attnlab.layers import sown  # pylint: disable=g-import-not-at-top
  tmp, plotted, _, _, _, _, _ = gpt_runs
  task = tasks.build_task(_gpt_config(shared_data, tmp))
  drawn = {}
  monkeypatch.setattr(plotting, "attention_grid",
                      lambda weights, **kw: drawn.update(weights=weights, **kw))
  task.write_plots(plotted.params, tmp_path)
  ids = task.encode_prompt(
      (tmp_path / "sample.txt").read_text(encoding="utf-8")[:-1])[:causal_lm.PLOT_TOKENS]
  assert len(ids) == 16 and drawn["x_labels"] == drawn["y_labels"]
  assert len(drawn["x_labels"]) == 16
  _, inter = task.model.apply({"params": plotted.params}, np.asarray(ids)[None],
                              mutable=["intermediates"])
  alone = np.asarray(sown.stack_layers(sown.sown_values(inter["intermediates"])))
  weights = np.asarray(drawn["weights"])
  assert weights.shape == alone.shape == (2, 2, 16, 16)  # runlocal: 2 layers of 2 heads
  np.testing.assert_allclose(weights, alone, atol=1e-5)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)  # rows over the sample alone
  assert np.all(np.triu(weights, 1) == 0.0)  # causal: nothing from later (or padded) tokens
