"""BERT on SST-2: does pretraining (on which text) help a tiny encoder? Eight arms, N seeds each.

  python experiments/bert_sst2/run.py [--workdir=runs/bert_sst2] [--size=tiny] [--seeds=0,1,2] \
      [--arms=scratch,shakespeare,sst2,both] [--lrs=1e-4,3e-4,1e-3] [--pretrain_seeds=...] \
      [--pretrain_args=key=value,...] [--finetune_args=key=value,...] \
      [--manual_dir=../shared/data] [--publish_dir=experiments/bert_sst2] [--plan] \
      [--label_fractions=0.01,0.1,1] [--label_arm=best]

Arms (configs/bert.py; every pretraining run with STUDY_PRETRAIN, then --pretrain_args):
  scratch      no pretraining; the vocabulary of --scratch_corpus (default sst2_sentences)
  shakespeare  pretrained on Tiny Shakespeare (corpus "shakespeare", sentence-order pairs)
  sst2         pretrained on SST-2's training sentences rebuilt from its phrases, less a held-out
               tenth (corpus "sst2_sentences"; sentence-order pairs of sentence halves)
  both         both corpora, half of each batch from each ("shakespeare+sst2_sentences")
  imdb         24,500 IMDB reviews (corpus "imdb": attnlab.data.imdb_corpus, one document per
               review, SST-2's validation and held-out sentences removed; sentence-order pairs of
               consecutive sentences); IMDB_PRETRAIN's longer schedule with the plateau rule
  imdb+sst2    IMDB reviews and SST-2's rebuilt sentences, half of each batch from each
  imdb+shakespeare  IMDB reviews and Shakespeare's speeches (document pairs of both)
  imdb_sst2vocab  the imdb arm's pretraining in the scratch arm's vocabulary (data.vocab_corpus:
               learned on SST-2's rebuilt training sentences), so that the two differ only by
               the pretraining
Whole-word masking and dynamic masking everywhere; each arm's subword vocabulary is learned on
its own pretraining text, but for the arms of ARM_VOCAB (the labels of SST-2 are never read by
pretraining).

Per arm: pretraining runs WORKDIR/<arm>/pretrain_s<p> (p = pretrain_seeds[i % len], default the
fine-tuning seeds; WORKDIR/<arm> may be a link to another study's arm folder, whose finished runs
are then reused, e.g. to compare it with a scratch arm of another vocabulary); the fine-tuning
learning rate chosen among --lrs by fine-tuning (seed --select_seed, from the first pretraining
run) on SST-2 training phrases and measuring accuracy
on the held-out sentences of the *training* split (attnlab.data.sst2_corpus: no phrase found only
in a held-out sentence is trained on; the validation split is not read), runs
WORKDIR/<arm>/select_lr<lr>; then one fine-tuning run per seed at that rate on the whole
training split, WORKDIR/<arm>/finetune_s<s>, evaluated on SST-2's validation split (872
sentences), the reported figure. Every run is an ordinary resumable attnlab run: re-running the
command continues or skips it.

Writes WORKDIR/results.json ({arm: {"seeds": [...], "sst2_val": [...]}}), WORKDIR/details.json
(chosen learning rates and held-out accuracies, MLM and sentence-order accuracy of each
pretraining run, wall time of every run) and WORKDIR/results.md (the table: mean ± std, per-seed
differences to scratch); with --publish_dir also copies them there, with the head views
(figures/<arm>_pretrained_head_view.png, figures/<arm>_cls_attention.png). `--plan` prints the
runs and their steps without running anything.

Plateau rule (IMDB arms, `plateau_step`): the held-out MLM accuracy is evaluated every
`eval_every` steps; once the best of the last PLATEAU["patience"] evaluations is less than
PLATEAU["min_delta"] above the best before them, the run saves a checkpoint and stops there
(WORKDIR/<arm>/pretrain_s<p>/plateau.json marks it finished; re-running skips it).

Label efficiency (`--label_fractions`): SST-2 validation accuracy of `--label_arm` (default: the
pretrained arm of this study with the best mean) and of scratch, fine-tuned on a seeded random
subset (LABEL_SUBSET_SEED) of each fraction of the training phrases, at each arm's chosen rate,
for max(LABEL_MIN_STEPS, fraction * the fine-tuning steps) steps, `--label_seeds` seeds trained
together (config.num_seeds); runs WORKDIR/label/<arm>_f<fraction>, results in
WORKDIR/label_efficiency.json ({arm: {fraction: {"seeds": [...], "sst2_val": [...]}}}) and the
figure WORKDIR/label_efficiency.png.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence

from absl import flags

from attnlab.cli import tool
from attnlab.errors import UserError

REPO = pathlib.Path(__file__).resolve().parents[2]
_LOG = logging.getLogger("attnlab.bert_sst2")
CONFIG_FILE = REPO / "configs" / "bert.py"

# Arm -> pretraining corpus (None: no pretraining).
ARMS = {"scratch": None, "shakespeare": "shakespeare", "sst2": "sst2_sentences",
        "both": "shakespeare+sst2_sentences", "imdb": "imdb", "imdb+sst2": "imdb+sst2_sentences",
        "imdb+shakespeare": "imdb+shakespeare", "imdb_sst2vocab": "imdb"}
# Arms whose vocabulary is learned on another corpus than their pretraining text
# (data.vocab_corpus): IMDB reviews in the scratch arm's vocabulary, SST-2's own sentences.
ARM_VOCAB = {"imdb_sst2vocab": "sst2_sentences"}
# Arms pretrained on IMDB reviews: IMDB_PRETRAIN after STUDY_PRETRAIN, and the plateau rule.
IMDB_ARMS = ("imdb", "imdb+sst2", "imdb+shakespeare", "imdb_sst2vocab")
# Pretraining options of every arm (before --pretrain_args, which win): sentence-order pairs,
# whole-word masking, and the longer schedule of the study (experiments/bert_sst2/README.md).
STUDY_PRETRAIN = ("data.pair_task=sop,data.whole_word=True,num_train_steps=10000,batch_size=64,"
                  "optimizer.learning_rate=1e-3,optimizer.warmup_steps=1000,eval_every=1000,"
                  "checkpoint_every=1000")
# The IMDB arms' schedule (after STUDY_PRETRAIN, before --pretrain_args): at most 20000 steps
# (about 4.3 passes over the 293k sentence pairs of the reviews at batch 64; the plateau rule may
# stop it sooner), warm-up 1000 steps, the held-out curve every 1000 steps, a checkpoint every 500
# (a slow shared machine loses little on a restart).
IMDB_PRETRAIN = "num_train_steps=20000,eval_every=1000,checkpoint_every=500,log_every=100"
# Plateau rule: stop once the best held-out `metric` of the last `patience` evaluations is less
# than `min_delta` above the best before them (0.005 = half a point of accuracy).
PLATEAU = {"metric": "mlm_accuracy", "patience": 3, "min_delta": 0.005}
# Name of the file that marks a pretraining run stopped by the plateau rule.
PLATEAU_FILE = "plateau.json"
# Seconds between two reads of metrics.jsonl by the plateau watch: the run saves and stops this
# long after the evaluation that fires the rule (5 s let BERT-Mini on an H100 run 213 steps on).
PLATEAU_POLL_S = 1.0
# Label efficiency: the subset seed of the training phrases, the fewest fine-tuning steps of a
# fraction, the fractions' task (registered by `register_label_task`).
LABEL_SUBSET_SEED = 0
LABEL_MIN_STEPS = 500
LABEL_TASK = "sst2_fraction_classification"
# The head-view sentence, written as SST-2 writes its text (lower case, split clitics and
# punctuation): the SST-2 vocabularies have no capital letters.
PLOT_SENTENCE = "the animal did n't cross the street because it was too tired ."
# Data options a fine-tuning config must share with its pretraining run (the vocabulary's).
SHARED_DATA_KEYS = ("data.vocab_size", "data.max_documents", "data.max_extra_sentences",
                    "data.tokenizer_dir")
# Task of the learning-rate choice runs (registered by `register_selection_task`).
SELECTION_TASK = "sst2_heldout_classification"


def _define_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  flags.DEFINE_string("workdir", "runs/bert_sst2", "Output folder (one sub-folder per run).",
                      flag_values=fv)
  flags.DEFINE_string("size", "tiny", "Encoder size: tiny (BERT-Tiny), mini, small or test.",
                      flag_values=fv)
  flags.DEFINE_string("score", "scaled_dot", "Attention score name.", flag_values=fv)
  flags.DEFINE_list("arms", list(ARMS), f"Arms to run, of {', '.join(ARMS)}.", flag_values=fv)
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of the fine-tuning runs.", flag_values=fv)
  flags.DEFINE_list("pretrain_seeds", [], "Seeds of the pretraining runs (default: --seeds); "
                    "fine-tuning seed i starts from pretrain_seeds[i % len].", flag_values=fv)
  flags.DEFINE_list("lrs", ["1e-4", "3e-4", "1e-3"], "Fine-tuning learning rates to choose from "
                    "(on held-out sentences of the training split).", flag_values=fv)
  flags.DEFINE_integer("select_seed", 0, "Seed of the learning-rate choice runs.", flag_values=fv)
  flags.DEFINE_string("scratch_corpus", "sst2_sentences", "Corpus whose vocabulary the scratch "
                      "arm uses.", flag_values=fv)
  flags.DEFINE_string("pretrain_args", "", "Extra key=value,... for the pretraining configs.",
                      flag_values=fv)
  flags.DEFINE_string("finetune_args", "", "Extra key=value,... for every SST-2 config.",
                      flag_values=fv)
  flags.DEFINE_string("manual_dir", str(REPO.parent / "shared" / "data"),
                      "Folder with the raw data files ('' = $ATTNLAB_DATA_DIR or download).",
                      flag_values=fv)
  flags.DEFINE_string("data_dir", "", "TFDS data dir for the prepared datasets.", flag_values=fv)
  flags.DEFINE_string("publish_dir", "", "Also copy results.json/.md, details.json and the "
                      "figures here (e.g. experiments/bert_sst2).", flag_values=fv)
  flags.DEFINE_bool("plan", False, "Print the runs and their steps; run nothing.", flag_values=fv)
  flags.DEFINE_list("label_fractions", [], "Fractions of the SST-2 training phrases of the "
                    "label-efficiency curve, e.g. 0.01,0.1,1 (empty: no curve).", flag_values=fv)
  flags.DEFINE_string("label_arm", "best", "Pretrained arm of the label-efficiency curve (best: "
                      "the pretrained arm of this study with the highest mean).", flag_values=fv)
  flags.DEFINE_integer("label_seeds", 3, "Seeds per fraction (trained together, num_seeds).",
                       flag_values=fv)
  return fv


# ---------------------------------------------------------------------------------------------
# The learning-rate choice task


def register_selection_task() -> None:
  """Registers SELECTION_TASK: SST-2 fine-tuning that trains on the training phrases inside the
  pretraining sentences and evaluates on the held-out sentences of the training split."""
  from attnlab.data import sst2_corpus  # pylint: disable=g-import-not-at-top
  from attnlab.tasks import classification  # pylint: disable=g-import-not-at-top
  from attnlab.tasks import register_task  # pylint: disable=g-import-not-at-top

  @register_task(SELECTION_TASK)
  class HeldoutSst2(classification.ClassificationTask):
    """[CLS] fine-tuning for the learning-rate choice (module docstring of run.py)."""

    def _split(self, split: str, limit: int):
      data = self.config.data
      kwargs = dict(data_dir=data.data_dir or None, manual_dir=data.manual_dir or None)
      train, heldout = sst2_corpus.selection_examples(**kwargs)
      examples = train if split == "train" else heldout
      if limit > 0:
        examples = examples[:limit]
      return classification.encode_sst2(self.tokenizer, examples, data.max_len)

  del HeldoutSst2


def label_subset(n: int, fraction: float, seed: int = LABEL_SUBSET_SEED) -> list[int]:
  """Ascending indices of round(n * fraction) (at least 1) of n rows, a seeded permutation's
  first ones: a smaller fraction's subset lies inside a larger one's."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  count = min(n, max(1, int(round(n * fraction))))
  return sorted(np.random.default_rng(seed).permutation(n)[:count].tolist())


def register_label_task() -> None:
  """Registers LABEL_TASK: SST-2 fine-tuning on `label_subset` of the training phrases
  (config.data.train_fraction), evaluated on the validation split."""
  from attnlab import data as data_lib  # pylint: disable=g-import-not-at-top
  from attnlab.tasks import classification  # pylint: disable=g-import-not-at-top
  from attnlab.tasks import register_task  # pylint: disable=g-import-not-at-top

  @register_task(LABEL_TASK)
  class FractionSst2(classification.ClassificationTask):
    """[CLS] fine-tuning on a fraction of SST-2's training phrases (module docstring)."""

    def _split(self, split: str, limit: int):
      if split != "train":
        return super()._split(split, limit)
      data = self.config.data
      examples = data_lib.get_dataset("sst2", "train", data_dir=data.data_dir or None,
                                      manual_dir=data.manual_dir or None)
      rows = examples.__getitems__(label_subset(len(examples), data.train_fraction))
      return classification.encode_sst2(self.tokenizer, rows, data.max_len)

  del FractionSst2


# ---------------------------------------------------------------------------------------------
# The plateau rule


def plateau_step(evals: Sequence[tuple[int, float]], patience: int = PLATEAU["patience"],
                 min_delta: float = PLATEAU["min_delta"]) -> int | None:
  """The first evaluation step where the rule fires, or None: evals are (step, value) in step
  order; at evaluation i >= patience, the best of evals[i-patience+1..i] (the last `patience`)
  is compared with the best of evals[..i-patience]."""
  values = [v for _, v in evals]
  for i in range(patience, len(values)):
    before, recent = max(values[:i - patience + 1]), max(values[i - patience + 1:i + 1])
    if recent < before + min_delta:
      return evals[i][0]
  return None


def _eval_curve(workdir: pathlib.Path, metric: str) -> list[tuple[int, float]]:
  """(step, metric) of the run's evaluation records, one per step (the last written wins)."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  by_step = {r["step"]: r[metric] for r in rundir.read_metrics(workdir)
             if r.get("split") == "eval" and metric in r}
  return sorted(by_step.items())


def write_plateau_marker(workdir: pathlib.Path, step: int, curve) -> None:
  (workdir / PLATEAU_FILE).write_text(json.dumps(
      {"step": step, **PLATEAU, "curve": curve}, indent=2) + "\n")


def plateau_reached(workdir: pathlib.Path, num_train_steps: int) -> bool:
  """Whether the run is finished by the plateau rule: its marker, or (a process stopped between
  the evaluation and the marker) a curve on which the rule fires, then marked."""
  if (workdir / PLATEAU_FILE).is_file():
    return True
  curve = _eval_curve(workdir, PLATEAU["metric"])
  step = plateau_step(curve, PLATEAU["patience"], PLATEAU["min_delta"])
  if step is None or curve[-1][0] >= num_train_steps:
    return False
  write_plateau_marker(workdir, step, curve)
  return True


class _PlateauWatch:
  """While a pretraining run trains in this process: reads its metrics.jsonl every few seconds
  and, once `plateau_step` fires, writes PLATEAU_FILE and sends this process SIGTERM, which the
  trainer turns into "save a checkpoint and stop" (a few steps after that evaluation)."""

  def __init__(self, workdir: pathlib.Path, num_train_steps: int):
    self.workdir, self.num_train_steps, self.poll_s = workdir, num_train_steps, PLATEAU_POLL_S
    self.fired: int | None = None
    # Only evaluations written after this one are acted on: they come from the running training
    # loop, whose SIGTERM handler saves and stops (a signal before it starts would kill).
    curve = _eval_curve(workdir, PLATEAU["metric"])
    self._seen = curve[-1][0] if curve else -1
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True)

  def __enter__(self) -> "_PlateauWatch":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._done.set()
    self._thread.join()

  def _watch(self) -> None:
    while not self._done.wait(self.poll_s):
      curve = _eval_curve(self.workdir, PLATEAU["metric"])
      step = plateau_step(curve, PLATEAU["patience"], PLATEAU["min_delta"])
      if step is None or curve[-1][0] <= self._seen or curve[-1][0] >= self.num_train_steps:
        continue
      self.fired = step
      write_plateau_marker(self.workdir, step, curve)
      if not self._done.is_set():
        os.kill(os.getpid(), signal.SIGTERM)
      return


# ---------------------------------------------------------------------------------------------
# Runs


def _shared_data_args(pretrain_args: str) -> str:
  """The key=value parts of pretrain_args that fine-tuning must share (SHARED_DATA_KEYS)."""
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  return ",".join(f"{k}={v}" for k, v in config_utils.parse_arg(pretrain_args)
                  if k in SHARED_DATA_KEYS)


def _config(mode: str, fv: flags.FlagValues, seed: int, *extra: str):
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  parts = [f"mode={mode}", f"size={fv.size}", f"score={fv.score}", f"seed={seed}"]
  if fv.manual_dir and pathlib.Path(fv.manual_dir).is_dir():
    parts.append(f"data.manual_dir={pathlib.Path(fv.manual_dir).absolute()}")
  if fv.data_dir:
    parts.append(f"data.data_dir={fv.data_dir}")
  parts += [e for e in extra if e]
  config = config_utils.load_config_file(f"{CONFIG_FILE}:{','.join(parts)}")
  # Set here: the quote in "n't" would start a quoted value in a config arg.
  config.data.plot_sentence = PLOT_SENTENCE
  return config


def lr_name(lr: float) -> str:
  return f"{lr:.0e}".replace("e-0", "e-")


def _data_args(arm: str, fv: flags.FlagValues) -> str:
  """The corpus (and vocabulary) options of an arm's configs, pretraining and fine-tuning."""
  args = f"data.corpus={ARMS[arm] or fv.scratch_corpus}"
  return args + (f",data.vocab_corpus={ARM_VOCAB[arm]}" if arm in ARM_VOCAB else "")


def plan(fv: flags.FlagValues) -> list[dict]:
  """Every run of the study in order: {arm, kind, seed, workdir, config}. The configs of the
  fine-tuning runs (kind "finetune") have their learning rate set once the choice is made."""
  workdir = pathlib.Path(fv.workdir).absolute()
  seeds = [int(s) for s in fv.seeds]
  pretrain_seeds = [int(s) for s in (fv.pretrain_seeds or fv.seeds)]
  lrs = [float(x) for x in fv.lrs]
  unknown = [a for a in fv.arms if a not in ARMS]
  if unknown:
    raise UserError(f"unknown arm(s) {', '.join(unknown)}; valid: {', '.join(ARMS)}")
  shared = _shared_data_args(fv.pretrain_args)
  runs = []
  for arm in fv.arms:
    corpus = ARMS[arm]
    folder = workdir / arm
    data_args = _data_args(arm, fv)
    if corpus is not None:
      for p in pretrain_seeds:
        config = _config("pretrain", fv, p, data_args, STUDY_PRETRAIN,
                         IMDB_PRETRAIN if arm in IMDB_ARMS else "", fv.pretrain_args)
        runs.append({"arm": arm, "kind": "pretrain", "seed": p, "plateau": arm in IMDB_ARMS,
                     "workdir": folder / f"pretrain_s{p}", "config": config})
    # resolved: an arm folder may be a link to another study's arm (its pretraining shared)
    init = (lambda i: str((folder / f"pretrain_s{pretrain_seeds[i % len(pretrain_seeds)]}")
                          .resolve())) if corpus is not None else (lambda i: "")
    for lr in lrs:
      config = _config("finetune", fv, fv.select_seed, data_args, shared, fv.finetune_args,
                       f"optimizer.learning_rate={lr}")
      config.task = SELECTION_TASK
      config.init_from = init(0)
      runs.append({"arm": arm, "kind": "select", "seed": fv.select_seed, "lr": lr,
                   "workdir": folder / f"select_lr{lr_name(lr)}", "config": config})
    for i, s in enumerate(seeds):
      config = _config("finetune", fv, s, data_args, shared, fv.finetune_args)
      config.init_from = init(i)
      runs.append({"arm": arm, "kind": "finetune", "seed": s,
                   "workdir": folder / f"finetune_s{s}", "config": config})
  return runs


def label_runs(fv: flags.FlagValues, label_arm: str, lrs: dict[str, float]) -> list[dict]:
  """The label-efficiency runs of `label_arm` and scratch: {arm, fraction, workdir, config}
  (lrs: each arm's chosen fine-tuning rate)."""
  workdir = pathlib.Path(fv.workdir).absolute()
  pretrain_first = int((fv.pretrain_seeds or fv.seeds)[0])
  runs = []
  for arm in (label_arm, "scratch"):
    corpus = ARMS[arm]
    data_args = _data_args(arm, fv)
    for text in fv.label_fractions:
      fraction = float(text)
      if not 0.0 < fraction <= 1.0:
        raise UserError(f"--label_fractions: {text} is not in (0, 1]")
      config = _config("finetune", fv, 0, data_args, _shared_data_args(fv.pretrain_args),
                       fv.finetune_args, f"optimizer.learning_rate={lrs[arm]}")
      steps = max(LABEL_MIN_STEPS, int(round(config.num_train_steps * fraction)))
      config.task = LABEL_TASK
      config.num_seeds = fv.label_seeds
      config.num_train_steps = config.eval_every = config.checkpoint_every = steps
      config.data.train_fraction = fraction
      config.init_from = (str((workdir / arm / f"pretrain_s{pretrain_first}").resolve())
                          if corpus is not None else "")
      runs.append({"arm": arm, "fraction": fraction, "config": config,
                   "workdir": workdir / "label" / f"{arm}_f{text}"})
  return runs


def _timings_path(workdir: pathlib.Path) -> pathlib.Path:
  return workdir / "timings.json"


def linked_timings(root: pathlib.Path, arms: Sequence[str]) -> dict[str, float]:
  """The seconds of the runs of arms whose folder in `root` links to another study's arm (the
  runs trained there; device.sh links each job's arms into one folder): {"ARM/RUN": s}."""
  found = {}
  for arm in arms:
    folder = root / arm
    if not folder.is_symlink():
      continue
    source = folder.resolve()
    path = _timings_path(source.parent)
    if not path.is_file():
      continue
    for name, seconds in json.loads(path.read_text()).items():
      if name.startswith(f"{source.name}/"):
        found[f"{arm}/{name.split('/', 1)[1]}"] = seconds
  return found


def _write_plots(workdir: pathlib.Path) -> None:
  """The plots a finished run writes (head views), from its last checkpoint: for a run the
  plateau rule stopped (the trainer writes them only at the last step)."""
  from attnlab.analysis import runs as runs_lib  # pylint: disable=g-import-not-at-top
  run = runs_lib.load_run(workdir)
  if run.config.write_plots:
    run.task.write_plots(run.params, workdir)


def _run(run: dict, timings: dict[str, float], root: pathlib.Path) -> dict[str, float]:
  """Trains (or resumes/skips) one run; adds the seconds spent to timings unless the run was
  already complete (re-running the study to publish adds nothing), also when it stops early (a
  signal, an error: a run resumed over several sessions sums its parts); returns its last eval
  record."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  plateau = run.get("plateau", False)
  stopped = plateau and plateau_reached(run["workdir"], run["config"].num_train_steps)
  done = stopped or rundir.is_complete(run["workdir"], run["config"].num_train_steps)
  start = time.time()
  try:
    _train(run, plateau, stopped)
  finally:
    if not done:
      name = str(run["workdir"].relative_to(root))
      timings[name] = timings.get(name, 0.0) + time.time() - start
      _timings_path(root).write_text(json.dumps(timings, indent=2) + "\n")
  return rundir.last_records(rundir.read_metrics(run["workdir"]))["eval"]


def _train(run: dict, plateau: bool, stopped: bool) -> None:
  """The training part of `_run` (nothing when the plateau rule stopped the run already)."""
  from attnlab import train  # pylint: disable=g-import-not-at-top
  from attnlab.errors import TrainingInterrupted  # pylint: disable=g-import-not-at-top
  if not stopped:
    if plateau:
      with _PlateauWatch(run["workdir"], run["config"].num_train_steps) as watch:
        try:
          train.train_and_evaluate(run["config"], run["workdir"])
        except TrainingInterrupted:
          if watch.fired is None:
            raise
          _LOG.info("%s: the held-out %s flattened at step %d (plateau rule); stopped",
                    run["workdir"], PLATEAU["metric"], watch.fired)
    else:
      train.train_and_evaluate(run["config"], run["workdir"])
  if plateau and not (run["workdir"] / "head_view.png").is_file() and plateau_reached(
      run["workdir"], run["config"].num_train_steps):
    _write_plots(run["workdir"])  # stopped by the rule now or earlier: the trainer wrote none


def _preload() -> None:
  """Imports every module the study will need, so that a long run keeps going when its checkout
  changes under it (a merge, a switched branch)."""
  # pylint: disable=g-import-not-at-top,unused-import
  import matplotlib.pyplot
  from attnlab import plotting, rundir, train
  from attnlab.data import imdb_corpus, sst2_corpus
  from attnlab.tasks import classification, masked_lm


def _pretrain_info(run: dict, record: dict) -> dict:
  """details.json's entry of a pretraining run: final held-out accuracies, the held-out curve,
  the plateau step (IMDB arms) and, for IMDB corpora, the overlap check's report."""
  info = {"mlm_accuracy": record["mlm_accuracy"], "sop_accuracy": record["nsp_accuracy"],
          "pair_task": run["config"].data.get("pair_task", "nsp"), "step": record["step"],
          "curve": {metric: _eval_curve(run["workdir"], metric)
                    for metric in ("mlm_accuracy", "nsp_accuracy")}}
  marker = run["workdir"] / PLATEAU_FILE
  if marker.is_file():
    info["plateau_step"] = json.loads(marker.read_text())["step"]
  data = run["config"].data
  if data.corpus.startswith("imdb"):
    from attnlab.data import imdb_corpus  # pylint: disable=g-import-not-at-top
    info["imdb"] = imdb_corpus.imdb_corpus(data_dir=data.data_dir or None,
                                           manual_dir=data.manual_dir or None,
                                           max_documents=data.max_documents).report
  return info


def run_study(fv: flags.FlagValues) -> dict:
  """Runs every stage; returns {"results": results.json's dict, "details": details.json's}."""
  _preload()
  register_selection_task()
  register_label_task()
  root = pathlib.Path(fv.workdir).absolute()
  root.mkdir(parents=True, exist_ok=True)
  path = _timings_path(root)
  timings = json.loads(path.read_text()) if path.is_file() else {}
  timings = {**linked_timings(root, fv.arms), **timings}
  results, details = {}, {}
  runs = plan(fv)
  for arm in fv.arms:
    arm_runs = [r for r in runs if r["arm"] == arm]
    info = {"corpus": (ARMS[arm] or f"none (vocabulary of {fv.scratch_corpus})")
            + (f" (vocabulary of {ARM_VOCAB[arm]})" if arm in ARM_VOCAB else ""), "pretrain": {},
            "selection": {}}
    for run in (r for r in arm_runs if r["kind"] == "pretrain"):
      record = _run(run, timings, root)
      info["pretrain"][str(run["seed"])] = _pretrain_info(run, record)
    for run in (r for r in arm_runs if r["kind"] == "select"):
      info["selection"][str(run["lr"])] = _run(run, timings, root)["accuracy"]
    # The best held-out accuracy; a tie goes to the smaller rate.
    best = max(info["selection"], key=lambda k: (info["selection"][k], -float(k)))
    info["lr"] = float(best)
    seeds, accuracy = [], []
    for run in (r for r in arm_runs if r["kind"] == "finetune"):
      run["config"].optimizer.learning_rate = info["lr"]
      seeds.append(run["seed"])
      accuracy.append(_run(run, timings, root)["accuracy"])
    results[arm] = {"seeds": seeds, "sst2_val": accuracy}
    details[arm] = info
  details = {"size": fv.size, "score": fv.score, "study_pretrain": STUDY_PRETRAIN,
             "imdb_pretrain": IMDB_PRETRAIN, "plateau": PLATEAU,
             "pretrain_args": fv.pretrain_args, "finetune_args": fv.finetune_args,
             "arms": details, "seconds": timings}
  write_outputs(root, results, details)
  write_curve_figure(root, details)
  if fv.label_fractions:
    label = run_label_efficiency(fv, results, details, timings, root)
    details["seconds"] = timings
    write_outputs(root, results, details)
    write_label_outputs(root, label)
  if fv.publish_dir:
    publish(root, pathlib.Path(fv.publish_dir), fv)
  return {"results": results, "details": details}


def best_pretrained_arm(results: dict) -> str:
  """The pretrained arm of `results` with the highest mean SST-2 validation accuracy."""
  pretrained = {a: r for a, r in results.items() if ARMS.get(a) is not None and r["sst2_val"]}
  if not pretrained:
    raise UserError("--label_fractions needs a pretrained arm in --arms (and scratch)")
  return max(pretrained, key=lambda a: statistics.mean(pretrained[a]["sst2_val"]))


def run_label_efficiency(fv: flags.FlagValues, results: dict, details: dict,
                         timings: dict[str, float], root: pathlib.Path) -> dict:
  """The label-efficiency runs (module docstring); returns label_efficiency.json's dict."""
  if "scratch" not in results:
    raise UserError("--label_fractions compares with scratch: add scratch to --arms")
  arm = best_pretrained_arm(results) if fv.label_arm == "best" else fv.label_arm
  if arm not in results or ARMS.get(arm) is None:
    raise UserError(f"--label_arm={arm} is not a pretrained arm of this study's --arms")
  lrs = {a: details["arms"][a]["lr"] for a in (arm, "scratch")}
  out: dict = {"arm": arm, "lr": lrs, "subset_seed": LABEL_SUBSET_SEED, "arms": {}}
  for run in label_runs(fv, arm, lrs):
    record = _run(run, timings, root)
    per_seed = record.get("per_seed", {}).get("accuracy", [record["accuracy"]])
    seeds = record.get("seeds", [run["config"].seed])
    out["arms"].setdefault(run["arm"], {})[f"{run['fraction']:g}"] = {
        "seeds": seeds, "sst2_val": per_seed, "steps": run["config"].num_train_steps}
  return out


def _pyplot():
  """matplotlib.pyplot on the Agg backend (imported only when a study draws a figure)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def write_label_outputs(root: pathlib.Path, label: dict) -> None:
  """label_efficiency.json, .md (table) and .png (accuracy against the fraction of labels)."""
  plt = _pyplot()
  (root / "label_efficiency.json").write_text(json.dumps(label, indent=2) + "\n")
  (root / "label_efficiency.md").write_text(label_table(label))
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for arm, by_fraction in label["arms"].items():
    fractions = sorted(by_fraction, key=float)
    x = [100 * float(f) for f in fractions]
    values = [[100 * v for v in by_fraction[f]["sst2_val"]] for f in fractions]
    mean = [statistics.mean(v) for v in values]
    std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
    ax.errorbar(x, mean, yerr=std, marker="o", capsize=3, label=arm)
    for xi, v in zip(x, values):
      ax.scatter([xi] * len(v), v, s=8, alpha=0.4)
  ax.set_xscale("log")
  ax.set_xlabel("% of SST-2 training phrases")
  ax.set_ylabel("SST-2 validation accuracy %")
  ax.set_title("label efficiency (mean ± std over seeds)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(root / "label_efficiency.png", dpi=120)
  plt.close(fig)


def label_table(label: dict) -> str:
  """Markdown: per fraction, each arm's accuracy per seed and mean ± std, and the difference."""
  arms = list(label["arms"])
  fractions = sorted({f for by in label["arms"].values() for f in by}, key=float)
  lines = [f"Label efficiency: {' vs '.join(arms)} (fine-tuning lr {label['lr']})", "",
           "| % of training phrases | " + " | ".join(f"{a} % per seed | {a} mean ± std"
                                                   for a in arms) + " | difference |",
           "|---|" + "---|---|" * len(arms) + "---|"]
  for f in fractions:
    cells, means = [], []
    for a in arms:
      values = label["arms"][a].get(f, {}).get("sst2_val", [])
      cells += [_pct(values), _mean_std(values)]
      means.append(statistics.mean(values) if values else None)
    diff = (f"{100 * (means[0] - means[1]):+.1f}" if len(means) == 2 and None not in means
            else "-")
    lines.append(f"| {100 * float(f):g} | " + " | ".join(cells) + f" | {diff} |")
  return "\n".join(lines) + "\n"


def write_outputs(root: pathlib.Path, results: dict, details: dict) -> None:
  (root / "results.json").write_text(json.dumps(results, indent=2) + "\n")
  (root / "details.json").write_text(json.dumps(details, indent=2) + "\n")
  (root / "results.md").write_text(results_table(results, details))


def write_curve_figure(root: pathlib.Path, details: dict) -> None:
  """pretraining_curves.png: the held-out MLM and sentence-task accuracy of every pretraining
  run against its step (a dot where the plateau rule stopped it); none without pretraining."""
  runs = [(f"{arm} s{seed}", info) for arm, arm_info in details["arms"].items()
          for seed, info in arm_info["pretrain"].items() if info.get("curve")]
  if not runs:
    return
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
  for name, info in runs:
    task = info.get("pair_task", "nsp").upper()
    for ax, metric in zip(axes, ("mlm_accuracy", "nsp_accuracy")):
      steps, values = zip(*info["curve"][metric]) if info["curve"][metric] else ((), ())
      line, = ax.plot(steps, [100 * v for v in values], marker=".",
                      label=name if metric == "mlm_accuracy" else f"{name} ({task})")
      if info.get("plateau_step") in steps:
        i = steps.index(info["plateau_step"])
        ax.plot(steps[i], 100 * values[i], "o", color=line.get_color(), markersize=8)
  axes[0].set_ylabel("held-out MLM accuracy %")
  axes[1].set_ylabel("held-out NSP / SOP accuracy %")
  for ax in axes:
    ax.set_xlabel("pretraining step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  stopped = any("plateau_step" in info for _, info in runs)
  fig.suptitle(f"BERT-{details['size']} pretraining, held-out curves"
               + (" (large dot: the plateau rule's stop)" if stopped else ""), fontsize=10)
  fig.tight_layout()
  fig.savefig(root / "pretraining_curves.png", dpi=120)
  plt.close(fig)


def publish(root: pathlib.Path, target: pathlib.Path, fv: flags.FlagValues) -> None:
  """Copies the results and the head-view figures of seed 0's runs into `target`."""
  target.mkdir(parents=True, exist_ok=True)
  for name in ("results.json", "details.json", "results.md"):
    shutil.copyfile(root / name, target / name)
  for name in ("label_efficiency.json", "label_efficiency.md"):
    if (root / name).is_file():
      shutil.copyfile(root / name, target / name)
  figures = target / "figures"
  figures.mkdir(exist_ok=True)
  for name in ("label_efficiency.png", "pretraining_curves.png"):
    if (root / name).is_file():
      shutil.copyfile(root / name, figures / name)
  first = int(fv.seeds[0])
  pretrain_first = int((fv.pretrain_seeds or fv.seeds)[0])
  for arm in fv.arms:
    sources = {f"{arm}_cls_attention.png": root / arm / f"finetune_s{first}" / "cls_attention.png"}
    if ARMS[arm] is not None:
      sources[f"{arm}_pretrained_head_view.png"] = (root / arm / f"pretrain_s{pretrain_first}" /
                                                    "head_view.png")
    for name, source in sources.items():
      if source.is_file():
        shutil.copyfile(source, figures / name)


# ---------------------------------------------------------------------------------------------
# The table


def _pct(values: Sequence[float]) -> str:
  return ", ".join(f"{100 * v:.1f}" for v in values)


def _mean_std(values: Sequence[float]) -> str:
  if not values:
    return "-"
  if len(values) == 1:
    return f"{100 * values[0]:.1f} (one run)"
  return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def results_table(results: dict, details: dict) -> str:
  """The markdown table of results.json and details.json."""
  arms = details["arms"]
  imdb = (f" (the IMDB arms then `{details['imdb_pretrain']}` and the plateau rule)"
          if any(arm in IMDB_ARMS for arm in results) and details.get("imdb_pretrain") else "")
  lines = [f"BERT size {details['size']}, score {details['score']}; pretraining "
           f"`{details['study_pretrain']}`{imdb} then `{details['pretrain_args'] or '-'}`; "
           f"fine-tuning args `{details['finetune_args'] or '-'}`", "",
           "| arm | pretraining corpus | MLM acc % (held-out) | NSP or SOP acc % (held-out) | "
           "fine-tune lr (held-out acc % per lr) | SST-2 val % per seed | mean ± std | "
           "difference to scratch per seed | mean difference |",
           "|---|---|---|---|---|---|---|---|---|"]
  scratch = results.get("scratch")
  for arm, result in results.items():
    info = arms[arm]
    pre = list(info["pretrain"].values())
    mlm = _mean_std([p["mlm_accuracy"] for p in pre]) if pre else "-"
    # details.json keeps the key "sop_accuracy" for either pair task; the cell names the task
    # where details.json records it (_pretrain_info)
    sop = "-"
    if pre:
      task = "/".join(sorted({p["pair_task"].upper() for p in pre if p.get("pair_task")}))
      sop = _mean_std([p["sop_accuracy"] for p in pre]) + (f", {task}" if task else "")
    choice = ", ".join(f"{float(lr):g}: {100 * acc:.1f}" for lr, acc in info["selection"].items())
    diff, mean_diff = "-", "-"
    if scratch is not None and arm != "scratch":
      by_seed = dict(zip(scratch["seeds"], scratch["sst2_val"]))
      deltas = [acc - by_seed[s] for s, acc in zip(result["seeds"], result["sst2_val"])
                if s in by_seed]
      if deltas:
        diff = ", ".join(f"{100 * d:+.1f}" for d in deltas)
        mean_diff = f"{100 * statistics.mean(deltas):+.1f}"
    lines.append(f"| {arm} | {info['corpus']} | {mlm} | {sop} | **{info['lr']:g}** ({choice}) | "
                 f"{_pct(result['sst2_val'])} | {_mean_std(result['sst2_val'])} | {diff} | "
                 f"{mean_diff} |")
  lines += ["", "MLM and NSP/SOP accuracy: held-out sentences of SST-2's training split (arms with "
            "SST-2 text), Tiny Shakespeare's validation split (shakespeare), held-out IMDB "
            "reviews (imdb arms). Seeds: "
            + ", ".join(f"{arm} {r['seeds']}" for arm, r in results.items()) + ".",
            "", "Wall time per run (s): " + ", ".join(
                f"{name} {sec:.0f}" for name, sec in details["seconds"].items()), ""]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv if argv is None else argv)
  fv = _define_flags()
  try:
    extra = fv(argv)
  except flags.Error as e:
    print(f"run.py: error: {e}", file=sys.stderr)
    return tool.USAGE_ERROR
  if len(extra) > 1:
    print(f"run.py: error: unexpected arguments {extra[1:]}", file=sys.stderr)
    return tool.USAGE_ERROR
  tool.setup_logging()

  def body() -> None:
    if fv.plan:
      for run in plan(fv):
        c = run["config"]
        lr = f", lr {run['lr']:g}" if "lr" in run else ""
        plateau = ", plateau rule" if run.get("plateau") else ""
        vocab = f" (vocabulary of {c.data.vocab_corpus})" if c.data.vocab_corpus else ""
        print(f"{run['workdir']}: {c.task}, corpus {c.data.corpus}{vocab}, "
              f"{c.num_train_steps} steps of {c.batch_size}{lr}{plateau}")
      if fv.label_fractions:
        print(f"then label efficiency ({fv.label_arm} arm and scratch): fractions "
              f"{', '.join(fv.label_fractions)}, {fv.label_seeds} seeds each")
      return
    out = run_study(fv)
    print(results_table(out["results"], out["details"]))
    print(f"results: {pathlib.Path(fv.workdir).absolute() / 'results.md'}")
  return tool.run_tool("run.py", body)


if __name__ == "__main__":
  sys.exit(main())
