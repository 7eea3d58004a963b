"""Sweeps: cross product, summary mean ± std over seeds, skipping finished members."""

import csv
import pathlib

import numpy as np
import pytest

from attnlab import config_utils
from attnlab import errors
from attnlab import rundir
from attnlab import sweep
from attnlab.cli import sweep as sweep_cli

REPO = pathlib.Path(__file__).resolve().parents[1]
NW = str(REPO / "configs" / "nadaraya_watson.py")
SPEC = f"{NW}:runlocal=True,write_plots=False,num_train_steps=10,eval_every=0,checkpoint_every=0"


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sweep")
  status = sweep_cli.main(["attnlab sweep", f"--config={SPEC}", f"--workdir={workdir}",
                           "--sweep=model.kernel=gaussian,learned", "--sweep=seed=0,1"])
  return workdir, status


@pytest.mark.slow
def test_members_run_in_their_own_directories(swept):
  workdir, status = swept
  assert status == 0
  names = sorted(p.name for p in workdir.iterdir() if p.is_dir())
  assert names == ["model.kernel=gaussian,seed=0", "model.kernel=gaussian,seed=1",
                   "model.kernel=learned,seed=0", "model.kernel=learned,seed=1"]
  config = rundir.read_config(workdir / "model.kernel=learned,seed=1")
  assert config.model.kernel == "learned" and config.seed == 1 and config.num_train_steps == 10


@pytest.mark.slow
def test_summary_is_mean_and_std_over_seeds(swept):
  workdir, _ = swept
  with open(workdir / "summary.csv") as f:
    rows = list(csv.DictReader(f))
  assert [row["model.kernel"] for row in rows] == ["gaussian", "learned"]
  for row in rows:
    finals = []
    for seed in (0, 1):
      records = rundir.read_metrics(workdir / f"model.kernel={row['model.kernel']},seed={seed}")
      finals.append([r for r in records if r["split"] == "eval"][-1]["test_mse"])
    assert row["seeds"] == "2" and row["failed"] == "0"
    assert float(row["eval/test_mse_mean"]) == pytest.approx(np.mean(finals), rel=1e-3)
    assert float(row["eval/test_mse_std"]) == pytest.approx(np.std(finals, ddof=1), rel=1e-3)
  table = (workdir / "summary.md").read_text()
  assert "| model.kernel | seeds | failed | eval/test_mse |" in table
  assert "| learned | 2 | 0 | " in table and " ± " in table


@pytest.mark.slow
def test_rerun_skips_finished_members(swept):
  workdir, _ = swept
  metrics = workdir / "model.kernel=learned,seed=0" / "metrics.jsonl"
  before = metrics.stat().st_mtime_ns
  base = config_utils.load_config_file(SPEC)
  members = sweep.run_sweep(base, {"model.kernel": ["gaussian", "learned"], "seed": [0, 1]},
                            workdir)
  assert [m.status for m in members] == ["skipped"] * 4
  assert metrics.stat().st_mtime_ns == before


def test_sweep_arg_is_typed_and_checked():
  config = config_utils.load_config_file(SPEC)
  assert sweep.parse_sweep_arg("optimizer.learning_rate=0.1,1e-2", config) == (
      "optimizer.learning_rate", [0.1, 0.01])
  with pytest.raises(config_utils.ConfigError, match="unknown config key 'model.score'"):
    sweep.parse_sweep_arg("model.score=dot,general", config)


def test_sweep_file_declares_config_and_axes():
  base, axes = sweep.load_sweep_file(REPO / "configs" / "sweeps" / "nadaraya_watson_kernels.py")
  assert base == str(REPO / "configs" / "nadaraya_watson.py")
  assert axes == {"model.kernel": ["average", "gaussian", "learned"], "seed": [0, 1, 2]}
  members = sweep.expand(config_utils.load_config_file(base), axes, "/tmp/unused")
  assert len(members) == 9 and members[-1].name == "model.kernel=learned,seed=2"


def test_axes_may_use_the_shared_shortcuts_of_the_config_arg():
  seq2seq = str(REPO / "configs" / "seq2seq.py")
  base, axes = sweep.prepare(f"{seq2seq}:runlocal=True", {"score": "dot,general",
                                                          "task": ["reverse"]}, seeds=[3])
  assert axes == {"model.score": ["dot", "general"], "data.name": ["reverse"], "seed": [3]}
  members = sweep.expand(base, axes, "/tmp/unused")
  assert [m.name for m in members] == ["model.score=dot,data.name=reverse,seed=3",
                                       "model.score=general,data.name=reverse,seed=3"]
  expected = [{"model.score": "dot", "data.name": "reverse", "seed": 3},
              {"model.score": "general", "data.name": "reverse", "seed": 3}]
  for member, keys in zip(members, expected):
    flat = config_utils.flatten(member.config)
    assert {key: flat[key] for key in keys} == keys and member.values == keys
    assert flat["model.attention"] == "bahdanau" and flat["runlocal"] is True
  # The same shortcut in a Transformer family's config is its model.attention.score.
  gpt = str(REPO / "configs" / "gpt.py")
  base, axes = sweep.prepare(f"{gpt}:runlocal=True", {"score": "dot,general"})
  assert axes == {"model.attention.score": ["dot", "general"]}
  assert [m.config.model.attention.score for m in sweep.expand(base, axes, "/tmp/unused")] == [
      "dot", "general"]
  # A shortcut whose field the config lacks stays the key it is: `task` of nadaraya_watson.py.
  base, axes = sweep.prepare(SPEC, {"task": "regression"})
  assert axes == {"task": ["regression"]}
  assert sweep.expand(base, axes, "/tmp/unused")[0].config.task == "regression"


def test_sweep_without_axes_is_one_line_error(tmp_path, capsys):
  assert sweep_cli.main(["attnlab sweep", f"--config={SPEC}", f"--workdir={tmp_path}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["attnlab sweep: error: nothing to sweep: give --sweep=key=value1,value2 (or a "
                 "--sweep_file)"]


# ---------------------------------------------------------------------------------------------------
# The Python API: sweep.run


@pytest.mark.slow
def test_run_is_the_command_line_sweep(swept):
  # The same sweep given to the API finds the command line's members (same directories, same
  # configs: prepare_workdir would refuse a changed one) complete, and summarises them alike.
  workdir, _ = swept
  summary = (workdir / "summary.csv").read_text()
  result = sweep.run(SPEC, {"model.kernel": "gaussian,learned"}, workdir=workdir, seeds=[0, 1])
  assert [m.name for m in result.members] == [
      "model.kernel=gaussian,seed=0", "model.kernel=gaussian,seed=1",
      "model.kernel=learned,seed=0", "model.kernel=learned,seed=1"]
  assert [m.status for m in result.members] == ["skipped"] * 4
  assert result.status == 0 and result.failed == [] and result.keys == ["model.kernel", "seed"]
  assert result.summary_csv.read_text() == summary
  [gaussian, learned] = result.summary()
  assert gaussian["model.kernel"] == "gaussian" and learned["seeds"] == 2
  mean, _ = learned["eval/test_mse"]
  with open(workdir / "summary.csv") as f:
    assert mean == pytest.approx(float(list(csv.DictReader(f))[1]["eval/test_mse_mean"]), rel=1e-3)


def test_prepare_types_axes_and_applies_overrides():
  config = config_utils.load_config_file(SPEC)
  base, axes = sweep.prepare(config, {"optimizer.learning_rate": "0.1,1e-2",
                                      "model.kernel": ("gaussian", "learned")},
                             seeds="0,1", num_seeds=2, overrides={"num_train_steps": 7})
  assert axes == {"optimizer.learning_rate": [0.1, 0.01], "model.kernel": ["gaussian", "learned"],
                  "seed": [0, 1]}
  assert base.num_train_steps == 7 and base.num_seeds == 2
  assert config.num_train_steps == 10 and config.num_seeds == 1  # the caller's config unchanged
  sweep_file = REPO / "configs" / "sweeps" / "nadaraya_watson_kernels.py"
  base, axes = sweep.prepare(sweep_file=sweep_file, axes={"seed": [5]})
  assert base.task == "regression"
  assert axes == {"model.kernel": ["average", "gaussian", "learned"], "seed": [5]}


@pytest.mark.parametrize("kwargs, message", [
    ({"seeds": [0], "axes": {"seed": [1]}}, "the seeds are given twice"),
    ({"axes": {"model.kernel": 3}}, "give a list of values"),
    ({"axes": {"model.kernel": ""}}, "sweep axis 'model.kernel' has no values"),
    ({"axes": {"model.score": "dot"}}, "unknown config key 'model.score'"),
    ({"axes": {"seed": [0]}, "parallel": 2, "inprocess": True}, "one at a time"),
    ({"axes": {"seed": [0]}, "parallel": 0}, "parallel=0"),
    ({"axes": {"batch_size": "8,0"}}, "sweep member batch_size=0: batch_size must be >= 1, got 0"),
])
def test_run_refuses_bad_arguments_before_running(tmp_path, kwargs, message):
  with pytest.raises(errors.UserError, match=message):
    sweep.run(SPEC, workdir=tmp_path / "sweep", **kwargs)
  assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_run_in_a_subprocess_one_at_a_time(tmp_path):
  result = sweep.run(SPEC, {"model.kernel": ["learned"]}, workdir=tmp_path, inprocess=False,
                     overrides={"num_train_steps": 2})
  [member] = result.members
  assert member.status == "done", member.error
  assert (member.workdir / "log.txt").is_file()  # a subprocess's log
  assert rundir.is_complete(member.workdir, 2)
  assert result.summary()[0]["seeds"] == 1
