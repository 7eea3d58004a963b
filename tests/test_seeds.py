"""Several seeds in one compiled program (config.num_seeds): each replica equals its own run."""

import csv
import pathlib
import shutil

import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import rundir
from attnlab import sweep
from attnlab import train

REPO = pathlib.Path(__file__).resolve().parents[1]
NW = str(REPO / "configs" / "nadaraya_watson.py")
# Fixed data set (data.seed=0): replicas differ in data order only (the kernel init is constant).
ARGS = ("runlocal=True,write_plots=False,data.seed=0,num_train_steps=10,log_every=5,eval_every=5,"
        "checkpoint_every=5")
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A 3-seed vmapped run and the three single-seed runs it stands for."""
  root = tmp_path_factory.mktemp("seeds")
  steps, make = [], train.make_train_step
  with pytest.MonkeyPatch.context() as patch:  # keep the train step the vmapped run builds
    patch.setattr(train, "make_train_step", lambda *a, **k: steps.append(make(*a, **k)) or steps[-1])
    vmapped = train.train_and_evaluate(
        config_utils.load_config_file(f"{NW}:{ARGS},num_seeds=3"), root / "vmapped")
  traces = [step.traces for step in steps]
  singles = [train.train_and_evaluate(config_utils.load_config_file(f"{NW}:{ARGS},seed={s}"),
                                      root / f"seed{s}") for s in SEEDS]
  return root, vmapped, singles, traces


def _records(workdir):
  return [(r["step"], r["split"], r) for r in rundir.read_metrics(workdir)]


@pytest.mark.slow
def test_each_replica_matches_its_single_seed_run(runs):
  root, vmapped, singles, traces = runs
  assert traces == [1]  # one train step built, traced once for all replicas
  assert vmapped.params["w"].shape == (3,) and vmapped.step.shape == ()
  np.testing.assert_allclose(np.asarray(vmapped.params["w"]),
                             [float(s.params["w"]) for s in singles], rtol=1e-5)
  stacked = _records(root / "vmapped")
  assert [(step, split) for step, split, _ in stacked] == [
      (5, "train"), (5, "eval"), (10, "train"), (10, "eval")]
  for i, seed in enumerate(SEEDS):
    single = _records(root / f"seed{seed}")
    assert [(a, b) for a, b, _ in single] == [(a, b) for a, b, _ in stacked]
    for (_, _, mine), (_, _, theirs) in zip(stacked, single):
      assert mine["seeds"] == list(SEEDS)
      for name, values in mine["per_seed"].items():
        assert values[i] == pytest.approx(theirs[name], rel=1e-5, abs=1e-7), (seed, name)
  # The replicas really differ (their data orders do), and each record's value is their mean.
  final = stacked[-1][2]
  assert len(set(final["per_seed"]["test_mse"])) == 3
  assert final["test_mse"] == pytest.approx(np.mean(final["per_seed"]["test_mse"]), rel=1e-6)


@pytest.mark.slow
def test_replica_evaluation_matches_numpy(runs):
  root, vmapped, _, _ = runs
  run = analysis.load_run(root / "vmapped", replica=None)  # all replicas, stacked
  data = run.task.data
  final = _records(root / "vmapped")[-1][2]
  for i, w in enumerate(np.asarray(run.params["w"])):
    logits = -np.square((data.x_test[:, None] - data.x_train[None, :]) * w) / 2  # [n_test, n_train]
    weights = np.exp(logits - logits.max(1, keepdims=True))
    weights /= weights.sum(1, keepdims=True)
    expected = np.mean((weights @ data.y_train - (data.x_test + np.sin(data.x_test))) ** 2)
    assert final["per_seed"]["test_mse"][i] == pytest.approx(expected, rel=1e-4)
  np.testing.assert_array_equal(np.asarray(run.params["w"]), np.asarray(vmapped.params["w"]))
  # By default load_run hands back one replica, shaped like a single-seed run.
  one = analysis.load_run(root / "vmapped", replica=2)
  assert one.replica == 2
  np.testing.assert_array_equal(np.asarray(one.params["w"]), np.asarray(vmapped.params["w"])[2])
  with pytest.raises(ValueError, match=r"replica must be in 0\.\.2"):
    analysis.load_run(root / "vmapped", replica=3)


@pytest.mark.slow
def test_resume_restores_every_replica_and_its_data_order(runs, tmp_path):
  root, vmapped, _, _ = runs
  copy = tmp_path / "copy"
  shutil.copytree(root / "vmapped", copy)
  shutil.rmtree(copy / "checkpoints" / "10")
  rundir.truncate_metrics(copy, 5)
  resumed = train.train_and_evaluate(rundir.read_config(copy), copy)
  np.testing.assert_array_equal(np.asarray(resumed.params["w"]), np.asarray(vmapped.params["w"]))


@pytest.mark.slow
def test_sweep_summary_counts_every_replica(runs, tmp_path):
  root, _, _, _ = runs
  base = config_utils.load_config_file(f"{NW}:{ARGS},num_seeds=3")
  members = sweep.run_sweep(base, {"model.kernel": ["learned"]}, tmp_path)
  assert [m.status for m in members] == ["done"]
  with open(tmp_path / sweep.SUMMARY_CSV) as f:
    (row,) = list(csv.DictReader(f))
  finals = [[r for r in rundir.read_metrics(root / f"seed{s}") if r["split"] == "eval"][-1]
            for s in SEEDS]
  values = [r["test_mse"] for r in finals]
  assert row["seeds"] == "3"
  assert float(row["eval/test_mse_mean"]) == pytest.approx(np.mean(values), rel=1e-3)
  assert float(row["eval/test_mse_std"]) == pytest.approx(np.std(values, ddof=1), rel=1e-3)
  assert "replicas of each `num_seeds` run" in (tmp_path / sweep.SUMMARY_MD).read_text()


def test_bad_num_seeds_is_a_clear_error(tmp_path):
  config = config_utils.load_config_file(f"{NW}:{ARGS},num_seeds=0")
  with pytest.raises(config_utils.ConfigError, match="num_seeds must be an int >= 1"):
    train.train_and_evaluate(config, tmp_path)


def test_bucketed_replica_batches_are_padded_to_the_longest():
  """Replicas of a bucketed task draw batches of different padded lengths in one step: stacked,
  each replica's rows are its own batch with zeros (False in the masks) appended."""
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top
  from attnlab.data import pipeline  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  ids = lambda n: [int(i) for i in rng.integers(1, 9, size=n)]
  examples = [{"source": ids(n), "target": ids(m)}
              for n, m in zip(rng.integers(1, 12, size=40), rng.integers(1, 12, size=40))]
  make = lambda seed: pipeline.Batcher(examples, 4, seed=seed, buckets=(3, 6, 12))
  stacked = state_lib.ReplicaBatches([make(s) for s in (0, 1, 2)])
  own = [make(s) for s in (0, 1, 2)]
  widths = set()
  for _ in range(10):
    batch = next(stacked)
    for i, it in enumerate(own):
      mine = next(it)
      for name, value in mine.items():
        width = batch[name].shape[2:]
        expected = np.zeros(batch[name].shape[1:], value.dtype)
        expected[tuple(slice(0, k) for k in value.shape)] = value
        np.testing.assert_array_equal(batch[name][i], expected, err_msg=name)
        widths.add((i, name, value.shape[1:], width))
  # The replicas did draw different widths in some step (else nothing was padded).
  assert any(own_w != w for _, _, own_w, w in widths)
