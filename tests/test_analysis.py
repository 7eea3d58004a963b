"""Reloading runs: load_run, attention_maps and `attnlab inspect`."""

import pathlib

import numpy as np
import pytest

from attnlab import analysis
from attnlab import checkpoint
from attnlab import config_utils
from attnlab import rundir
from attnlab import train
from attnlab.cli import inspect_run

REPO = pathlib.Path(__file__).resolve().parents[1]
NW = str(REPO / "configs" / "nadaraya_watson.py")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  config = config_utils.load_config_file(f"{NW}:runlocal=True")
  state = train.train_and_evaluate(config, workdir)
  return workdir, state


def _nw_weights(queries, keys, w):
  logits = -np.square((queries[:, None] - keys[None, :]) * w) / 2  # [n_q, n_k]
  weights = np.exp(logits - logits.max(1, keepdims=True))
  return weights / weights.sum(1, keepdims=True)


@pytest.mark.slow
def test_load_run_restores_the_final_parameters(finished):
  workdir, state = finished
  run = analysis.load_run(workdir)
  assert run.step == 20 and run.config.task == "regression"
  assert run.model is run.task.model
  assert set(run.params) == set(state.params) == {"w"}
  np.testing.assert_array_equal(np.asarray(run.params["w"]), np.asarray(state.params["w"]))


@pytest.mark.slow
def test_load_run_at_a_step_matches_the_logged_evaluation(finished):
  workdir, _ = finished
  run = analysis.load_run(workdir, step=10)
  logged = [r for r in rundir.read_metrics(workdir) if r["split"] == "eval" and r["step"] == 10]
  assert run.step == 10 and float(run.params["w"]) == logged[0]["w"]


@pytest.mark.slow
def test_attention_maps_match_numpy(finished):
  workdir, _ = finished
  run = analysis.load_run(workdir)
  data = run.task.data
  maps = analysis.attention_maps(run, data.x_test, data.x_train, data.y_train)
  assert list(maps) == ["."]
  expected = _nw_weights(data.x_test, data.x_train, float(run.params["w"]))
  np.testing.assert_allclose(np.asarray(maps["."]), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_run_writes_plots(finished):
  workdir, _ = finished
  for name in ("fit.png", "attention.png"):
    assert (workdir / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_load_run_errors_name_what_is_missing(finished, tmp_path):
  workdir, _ = finished
  with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
    analysis.load_run(tmp_path / "nothing")
  with pytest.raises(checkpoint.CheckpointError, match="no checkpoint for step 7 .*steps: 10, 20"):
    analysis.load_run(workdir, step=7)


@pytest.mark.slow
def test_inspect_prints_config_metrics_and_checkpoints(finished, capsys):
  workdir, _ = finished
  assert inspect_run.main(["attnlab inspect", f"--workdir={workdir}", "--step=10"]) == 0
  out = capsys.readouterr().out
  assert "  model.kernel = 'learned'" in out
  assert "eval @ step 20: test_mse=" in out and "train @ step 20: " in out
  assert "checkpoints: 10, 20 (of 20 steps; complete)" in out
  assert "parameters @ step 10:" in out and "['w']: float32[]" in out
  # --step=latest, as generate, translate and view take it: the newest checkpoint.
  assert inspect_run.main(["attnlab inspect", f"--workdir={workdir}", "--step=latest"]) == 0
  assert "parameters @ step 20:" in capsys.readouterr().out


def test_inspect_error_is_one_line(tmp_path, capsys):
  assert inspect_run.main(["attnlab inspect", f"--workdir={tmp_path / 'x'}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("attnlab inspect: error: ")
  # --step takes a step number or 'latest' (the other tools' flag), and names what it takes.
  assert inspect_run.main(["attnlab inspect", f"--workdir={tmp_path / 'x'}", "--step=latest"]) == 2
  assert "x does not exist" in capsys.readouterr().err  # the step was taken; the run is missing
  assert inspect_run.main(["attnlab inspect", f"--workdir={tmp_path}", "--step=ten"]) == 2
  assert capsys.readouterr().err.strip() == ("attnlab inspect: error: --step must be a checkpoint "
                                             "step number or 'latest', got 'ten'")


def test_few_steps_warning_names_barely_trained_runs_only(tmp_path):
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  config = config_utils.base_config()
  config.runlocal = True
  run = analysis.Run(workdir=tmp_path, config=config, task=None, model=None, params=None, step=4)
  assert "trained for only 4 steps (runlocal=True" in analysis.few_steps_warning(run)
  config.runlocal = False
  assert "trained for only 4 steps: expect" in analysis.few_steps_warning(run)
  run.step = 200
  assert analysis.few_steps_warning(run) is None
  run.step = 0
  (tmp_path / "import_hf.json").write_text("{}")  # weights trained elsewhere
  assert analysis.few_steps_warning(run) is None
