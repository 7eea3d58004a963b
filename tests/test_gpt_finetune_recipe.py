"""The GPT fine-tuning recipe (#49): its optimizer defaults, frozen embeddings and blocks, early
stopping on the validation loss (and resuming a stopped run), and a fine-tuned attnlab GPT
exported for `transformers`.

One module-scoped pair of runs serves every test: `base_run` (a runlocal GPT with GPT-2's
settings: learned positions, biases) and `tuned_run`, fine-tuned from it with the embeddings and
the lower block frozen and early stopping on, on a corpus whose held-out tail ("bbbb...") is
unlike its training part ("abab..."): as the model learns that "a" follows "b", the validation
loss rises and early stopping ends the run.
"""

import json
import logging
import pathlib

import jax
import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import state as state_lib
from attnlab import train
from attnlab.cli import import_hf

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "gpt.py"
PATIENCE = 2
EVAL_EVERY = 2
MAX_STEPS = 60

try:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
except ImportError:
  torch = transformers = None
needs_hf = pytest.mark.skipif(
    transformers is None, reason="needs torch and transformers: pip install torch==2.13.0 && "
    "pip install -e \".[test,hf]\" (torch's CPU build first, as .ci/run)")


def _config(arg):
  return config_utils.load_config_file(f"{CONFIG}:{arg}")


def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _records(run):
  return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


class _Lines(logging.Handler):
  """Keeps the messages logged under "attnlab" (a module fixture cannot use caplog)."""

  def __init__(self):
    super().__init__(logging.INFO)
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Training part: "ab" lines; the last 10% (the validation text): "b"s only."""
  path = tmp_path_factory.mktemp("corpus") / "ab.txt"
  path.write_text(("ab" * 20 + "\n") * 20 + "b" * 150 + "\n", encoding="utf-8")
  return path


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus):
  """The pretrained run: 4 steps of a runlocal GPT with learned positions and biases."""
  workdir = tmp_path_factory.mktemp("base") / "run"
  train.train_and_evaluate(_config(
      f"runlocal=True,dataset=text,data.path={corpus},model.position=learned,"
      f"model.use_bias=True,model.block_size=16,num_train_steps=4,eval_every=4,"
      f"checkpoint_every=4,write_plots=False"), workdir)
  return workdir


def _tuned_config(base_run, corpus):
  return _config(
      f"runlocal=True,pretrained={base_run},dataset=text,data.path={corpus},"
      f"finetune.freeze_embeddings=True,finetune.freeze_layers=1,"
      f"early_stop_patience={PATIENCE},eval_every={EVAL_EVERY},log_every=1,keep_checkpoints=1,"
      f"num_train_steps={MAX_STEPS},optimizer.learning_rate=1e-2,write_plots=False")


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory, base_run, corpus, recording_pretrained_load):
  """(workdir, step-0 parameters, log lines) of the fine-tuning run."""
  workdir = tmp_path_factory.mktemp("tuned") / "run"
  handler = _Lines()
  logging.getLogger("attnlab").addHandler(handler)
  previous = logging.getLogger("attnlab").level
  logging.getLogger("attnlab").setLevel(logging.INFO)
  try:
    with recording_pretrained_load() as step0:
      train.train_and_evaluate(_tuned_config(base_run, corpus), workdir)
  finally:
    logging.getLogger("attnlab").removeHandler(handler)
    logging.getLogger("attnlab").setLevel(previous)
  assert len(step0) == 1
  return workdir, step0[0], handler.lines


def test_finetuning_defaults_to_the_recipe(base_run):
  scratch = _config("")
  assert (scratch.optimizer.learning_rate, scratch.optimizer.warmup_steps) == (1e-3, 100)
  assert scratch.finetune.freeze_layers == 0 and not scratch.finetune.freeze_embeddings
  tuned = _config(f"pretrained={base_run}")
  assert tuned.optimizer.learning_rate == 1e-4 and tuned.optimizer.warmup_steps == 20
  assert tuned.optimizer.end_learning_rate == 1e-5
  assert _config(f"init_from={base_run}").optimizer.learning_rate == 1e-4
  # A key given in the arg wins, before or after pretrained=.
  for arg in (f"pretrained={base_run},optimizer.learning_rate=5e-4",
              f"optimizer.learning_rate=5e-4,pretrained={base_run}"):
    assert _config(arg).optimizer.learning_rate == 5e-4
  # More blocks frozen than the model has: one line.
  from attnlab import tasks  # pylint: disable=g-import-not-at-top
  with pytest.raises(config_utils.ConfigError, match="freeze_layers=3 must be between 0 and the "
                     "model's 2 blocks"):
    tasks.build_task(_config(f"runlocal=True,pretrained={base_run},finetune.freeze_layers=3"))


def test_frozen_parameters_do_not_change(tuned_run):
  workdir, step0, _ = tuned_run
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir())
  last = analysis.load_run(workdir, step=steps[-1])
  assert last.step >= 2 * EVAL_EVERY
  before, after = _flat(step0), _flat(last.params)
  assert before.keys() == after.keys()
  frozen = [k for k in before if k.startswith(("['embed']", "['block_0']"))]
  trained = [k for k in before if k not in frozen]
  assert len(frozen) >= 8 and any(k.startswith("['block_1']") for k in trained)
  assert any("['embed']['token']" in k for k in frozen)  # the tied output layer too
  for key in frozen:
    assert np.array_equal(before[key], after[key]), key  # bit for bit
  for key in trained:  # (a key bias moves least: the softmax ignores it, but for rounding)
    assert not np.array_equal(before[key], after[key]), key
    if before[key].ndim == 2:
      assert np.abs(before[key] - after[key]).max() > 1e-3, key
  # No optimizer state for frozen parameters: Adam's two moments of the trained ones only.
  restored = state_lib.restore(workdir, steps[-1])
  moments = sum(np.size(x) for x in jax.tree.leaves(restored.state.opt_state) if np.ndim(x))
  assert moments == 2 * sum(before[k].size for k in trained)


def _expected_stop(evals):
  """(stop step, best step) by the rule: stop at the PATIENCE-th evaluation in a row whose loss
  is not below the best so far."""
  best, best_step, since = np.inf, None, 0
  for step, loss in evals:
    if loss < best:
      best, best_step, since = loss, step, 0
    else:
      since += 1
    if since == PATIENCE:
      return step, best_step
  return None, best_step


def test_early_stopping_stops_at_the_right_evaluation(tuned_run):
  workdir, _, log = tuned_run
  records = _records(workdir)
  evals = [(r["step"], r["loss"]) for r in records if r["split"] == "eval"]
  stop, best = _expected_stop(evals)
  assert stop is not None and stop < MAX_STEPS, evals  # the validation loss did rise
  assert best > EVAL_EVERY, evals  # it fell first: the best is not the first evaluation
  assert evals[-1][0] == stop  # no evaluation after the stop
  assert max(r["step"] for r in records) == stop  # nor any training
  stops = [r for r in records if r["split"] == "early_stop"]
  assert len(stops) == 1 and stops[0]["step"] == stop and stops[0]["best_step"] == best
  assert stops[0]["best_loss"] == min(loss for _, loss in evals)
  assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, stop + 1))
  assert any(f"early stopping at step {stop}" in line and f"step {best})" in line
             for line in log), log
  # The best evaluation's checkpoint is kept (keep_checkpoints=1 counts the others) and is what
  # generate, view and export restore.
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [best, stop]
  result = analysis.load_run(workdir)
  assert result.step == best
  from attnlab.cli import inspect_run  # pylint: disable=g-import-not-at-top
  assert (f"checkpoints: {best}, {stop} (of {MAX_STEPS} steps; stopped early at step {stop}; the "
          f"result is the best evaluation's checkpoint, step {best})") in inspect_run.describe(
              workdir)
  stopped = analysis.load_run(workdir, step=stop)
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(result.params), jax.tree.leaves(stopped.params)))


def test_resuming_a_stopped_run_trains_nothing(tuned_run, base_run, corpus, caplog):
  workdir, _, _ = tuned_run
  metrics = (workdir / "metrics.jsonl").read_bytes()
  checkpoints = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  best = analysis.load_run(workdir)
  with caplog.at_level(logging.INFO, logger="attnlab"):
    state = train.train_and_evaluate(_tuned_config(base_run, corpus), workdir)
  assert "was stopped early at step" in caplog.text and "nothing to train" in caplog.text
  assert (workdir / "metrics.jsonl").read_bytes() == metrics
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == checkpoints
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(best.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_stopped_run_is_complete_and_summarised_by_its_best_evaluation(tmp_path):
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  rows = [{"step": 2, "split": "train", "loss": 3.0}, {"step": 2, "split": "eval", "loss": 2.0},
          {"step": 4, "split": "train", "loss": 2.5}, {"step": 4, "split": "eval", "loss": 1.5},
          {"step": 6, "split": "train", "loss": 2.0}, {"step": 6, "split": "eval", "loss": 1.7},
          {"step": 8, "split": "train", "loss": 1.9}, {"step": 8, "split": "eval", "loss": 1.6},
          {"step": 8, "split": "early_stop", "best_step": 4, "best_loss": 1.5, "patience": 2}]
  write = lambda records: (tmp_path / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in records))
  write(rows)
  assert rundir.is_complete(tmp_path, 100) and state_lib.best_step(tmp_path) == 4
  assert sweep.final_metrics_per_seed(tmp_path) == [{"eval/loss": 1.5, "train/loss": 1.9}]
  # Resumed past the stop (a larger patience): the stop no longer counts.
  write(rows + [{"step": 10, "split": "train", "loss": 1.8}])
  assert not rundir.is_complete(tmp_path, 100) and state_lib.best_step(tmp_path) is None
  assert sweep.final_metrics_per_seed(tmp_path) == [{"eval/loss": 1.6, "train/loss": 1.8}]


@needs_hf
def test_finetuned_attnlab_gpt_exports_to_transformers(tuned_run, tmp_path, capsys):
  workdir, _, _ = tuned_run
  out = tmp_path / "hf"
  assert import_hf.main(["attnlab import-hf", str(workdir), f"--export_to={out}"]) == 0
  model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
  run = analysis.load_run(workdir)
  ids = np.random.default_rng(0).integers(0, len(run.task.tokenizer), (2, 16))
  with torch.no_grad():
    want = model(torch.from_numpy(ids)).logits.numpy()
  got = np.asarray(run.model.apply({"params": run.params}, ids))
  assert np.abs(got - want).max() <= 1e-5 and np.ptp(want) > 0.3  # a margin far below the spread

  # A run without GPT-2's settings is refused in one line, before its checkpoint is read.
  rotary = tmp_path / "rotary"
  rotary.mkdir()
  config = json.loads((workdir / "config.json").read_text())
  config["model"].update(position="rotary", use_bias=False)
  (rotary / "config.json").write_text(json.dumps(config))
  capsys.readouterr()
  assert import_hf.main(["attnlab import-hf", str(rotary), f"--export_to={tmp_path / 'x'}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "model.position=rotary" in err[0] and "use_bias=False" in err[0]
  assert "model.position=learned,model.use_bias=True" in err[0]
