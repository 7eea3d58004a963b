"""The mechanism study: nano GPT on Tiny Shakespeare and a small BERT, one arm per mechanism.

  python experiments/mechanisms/run.py                       # runs/mechanisms, every arm
  python experiments/mechanisms/run.py --arms=full,alibi,linear --steps=500
  python experiments/mechanisms/run.py --runlocal --workdir=/tmp/mech   # seconds-long check

Each arm is one run of configs/gpt.py (size=nano: 4 layers, 4 heads, 128 dims, block 64; rotary
positions, full softmax attention) or configs/bert.py (mode=pretrain) with a few keys changed (the
ARMS tables below), trained by the sweep runner in WORKDIR/<family>/<arm>/<key=value>/ with
num_seeds=3 vmapped seeds (resumable: a finished arm is skipped, an interrupted one resumes).
For every arm this script then writes into WORKDIR:
  results.json  per arm: the config keys, final validation loss (GPT) or MLM accuracy (BERT) per
                seed, their mean and std, median steps/s of the training log, the wall time of
                the invocation that trained it, and (GPT) the validation loss at twice the
                training length or the reason it has none, and its run directory (relative to
                WORKDIR);
  results.md    the same as tables (mean ± sample std over the seeds);
  results.png   validation loss (GPT) and MLM accuracy (BERT) per arm with ±1 std error bars.
Extrapolation: each seed's reloaded params evaluate every non-overlapping window of 2 x block_size
tokens of the validation text (the last 10%); the figure is the mean next-token cross-entropy
over all positions of those windows. Learned and sinusoidal positions have none (n/a).
Data: Tiny Shakespeare from --data_dir (default ../shared/data), else $ATTNLAB_DATA_DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

NUM_SEEDS = 3
# Positions whose attention is defined past the training length (a bias or rotation computed for
# the actual length, or no positions at all).
EXTRAPOLATING = ("alibi", "t5_bias", "rotary", "none")
NO_EXTRAPOLATION = {
    "learned": "a learned table of block_size rows: no row for positions past it",
    "sinusoidal": "a table of block_size rows: the embedding refuses longer inputs",
}
# The sliding window of the sliding_window arms, in tokens each side (the default, 64, would see
# the whole 64-token block and equal full attention).
WINDOW = 16
# BERT's warmup is this fraction of its steps (configs/bert.py warms up for 600 of its 6000 steps;
# at the study's 1000 steps those 600 would leave only 400 steps at a useful learning rate).
BERT_WARMUP_DIVISOR = 10


def gpt_arms() -> dict[str, dict[str, object]]:
  """GPT arm name -> the configs/gpt.py keys it changes from the baseline (full, rotary, softmax).

  The causal mechanisms are the registry's (Supports.causal), not a list written here.
  """
  from attnlab.attention import registry  # pylint: disable=g-import-not-at-top
  arms: dict[str, dict[str, object]] = {}
  for name, mechanism in registry.MECHANISMS.items():
    if not mechanism.supports.causal:
      continue
    keys: dict[str, object] = {"model.attention.mechanism": name}
    if name == "sliding_window":
      keys["model.attention.sliding_window.window"] = WINDOW
    arms[name] = keys
  for position in ("learned", "sinusoidal", "alibi", "t5_bias", "none"):  # rotary: the baseline
    arms[position] = {"model.position": position}
  for normalizer in ("softmax_sink", "sigmoid", "sparsemax", "topk"):  # softmax: the baseline
    arms[normalizer] = {"model.attention.normalizer": normalizer}
  arms["gqa"] = {"model.attention.num_kv_heads": 2}  # 4 query heads share 2 key/value heads
  arms["mqa"] = {"model.attention.num_kv_heads": 1}
  arms["talking_heads"] = {"model.attention.talking_heads": True}
  return arms


def bert_arms() -> dict[str, dict[str, object]]:
  """BERT arm name -> configs/bert.py keys: the bidirectional mechanisms (linformer among them)."""
  from attnlab.attention import registry  # pylint: disable=g-import-not-at-top
  arms: dict[str, dict[str, object]] = {}
  for name, mechanism in registry.MECHANISMS.items():
    if not mechanism.supports.bidirectional or name == "bigbird":
      continue  # bigbird's 64-token blocks cover BERT's 64-token sequences: it equals full here
    keys: dict[str, object] = {"model.attention.mechanism": name}
    if name == "sliding_window":
      keys["model.attention.sliding_window.window"] = WINDOW
    arms["bert_" + name] = keys
  arms["bert_alibi"] = {"model.position": "alibi"}
  return arms


def _mean_std(values: list[float]) -> tuple[float, float]:
  if not values:
    return math.nan, math.nan
  return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def _fmt(mean: float, std: float, digits: int = 4) -> str:
  if math.isnan(mean):
    return ""
  return f"{mean:.{digits}f}" + ("" if math.isnan(std) else f" ± {std:.{digits}f}")


def extrapolation_losses(member: pathlib.Path, num_seeds: int, max_windows: int) -> list[float]:
  """Per seed: mean next-token cross-entropy over the non-overlapping windows of 2 x block_size
  tokens of the validation text (the first `max_windows` of them; 0 = all)."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top

  losses = []
  for replica in range(num_seeds):
    run = analysis.load_run(member, replica=replica if num_seeds > 1 else 0)
    x, y = extrapolation_windows(run.task.validation_ids(), 2 * run.task.block_size, max_windows)
    loss_sum = jax.jit(lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
        run.task.model.apply({"params": p}, x), y).sum())
    total = sum(float(loss_sum(run.params, x[i:i + 32], y[i:i + 32]))
                for i in range(0, len(x), 32))
    losses.append(total / y.size)
  return losses


def extrapolation_windows(ids, length: int, max_windows: int = 0):
  """(inputs, targets) [windows, length] of the non-overlapping windows of `ids`."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  count = (len(ids) - 1) // length
  if max_windows:
    count = min(count, max_windows)
  starts = np.arange(count) * length
  pos = starts[:, None] + np.arange(length)[None, :]  # [windows, length]
  return np.asarray(ids)[pos], np.asarray(ids)[pos + 1]


def run_arm(family: str, arm: str, keys: dict[str, object], spec: str, workdir: pathlib.Path,
            previous: dict, max_windows: int) -> dict:
  """Trains (or skips) one arm through the sweep runner and returns its results entry."""
  from attnlab import rundir, sweep  # pylint: disable=g-import-not-at-top
  [(axis_key, axis_value)] = list(keys.items())[:1]
  fixed = dict(list(keys.items())[1:])
  out = workdir / family / arm
  start = time.time()
  result = sweep.run(spec, {axis_key: [axis_value]}, workdir=out, num_seeds=NUM_SEEDS,
                     overrides=fixed)
  [member] = result.members
  entry: dict = {"family": family, "keys": keys, "status": member.status}
  if member.status == "failed":
    entry["error"] = member.error
    print(f"run.py: arm {arm} failed: {member.error}", file=sys.stderr)
    return entry
  entry["wall_time_s"] = (previous.get("wall_time_s") if member.status == "skipped"
                          else time.time() - start)
  records = rundir.read_metrics(member.workdir)
  train_rows = [r for r in records if r["split"] == "train"]
  entry["steps"] = max(r["step"] for r in records if r["split"] == "eval")
  entry["num_train_steps"] = member.config.num_train_steps
  rates = sorted(r["steps_per_sec"] for r in train_rows if "steps_per_sec" in r)
  entry["steps_per_sec"] = rates[len(rates) // 2] if rates else None
  per_seed = sweep.final_metrics_per_seed(member.workdir)
  metric = "eval/loss" if family == "gpt" else "eval/mlm_accuracy"
  entry["metric"] = metric
  entry["per_seed"] = [m[metric] for m in per_seed]
  entry["mean"], entry["std"] = _mean_std(entry["per_seed"])
  entry["run_dir"] = str(member.workdir.relative_to(workdir))  # relative: the results travel
  if family == "gpt":
    position = member.config.model.position
    if position in EXTRAPOLATING:
      entry["extrapolation"] = extrapolation_losses(member.workdir, NUM_SEEDS, max_windows)
      entry["extrapolation_windows"] = max_windows
      entry["extrapolation_mean"], entry["extrapolation_std"] = _mean_std(entry["extrapolation"])
    else:
      entry["extrapolation_na"] = NO_EXTRAPOLATION.get(position, f"position {position}")
  return entry


def markdown(results: dict) -> str:
  lines = []
  gpt = {a: r for a, r in results["arms"].items() if r["family"] == "gpt"}
  bert = {a: r for a, r in results["arms"].items() if r["family"] == "bert"}
  if gpt:
    lines += [f"### GPT on Tiny Shakespeare (`{results['gpt_spec']}`, {NUM_SEEDS} seeds)", "",
              "| arm | keys | steps | validation loss | loss at 2x length | steps/s |",
              "|---|---|---|---|---|---|"]
    for arm, r in gpt.items():
      lines.append(_row(arm, r, extra=(
          _fmt(r["extrapolation_mean"], r["extrapolation_std"]) if "extrapolation" in r
          else f"n/a ({r['extrapolation_na']})" if "extrapolation_na" in r else "")))
  if bert:
    lines += ["", f"### BERT MLM (`{results['bert_spec']}`, {NUM_SEEDS} seeds)", "",
              "| arm | keys | steps | MLM accuracy | steps/s |", "|---|---|---|---|---|"]
    for arm, r in bert.items():
      lines.append(_row(arm, r))
  return "\n".join(lines) + "\n"


def _row(arm: str, r: dict, extra: str | None = None) -> str:
  keys = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["keys"].items())
  if r["status"] == "failed":
    cells = [arm, keys, "", f"failed: {r['error']}"] + ([""] if extra is not None else []) + [""]
  else:
    rate = "" if r.get("steps_per_sec") is None else f"{r['steps_per_sec']:.1f}"
    cells = [arm, keys, str(r["steps"]), _fmt(r["mean"], r["std"])] + \
        ([extra] if extra is not None else []) + [rate]
  return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def plot(results: dict, path: pathlib.Path) -> None:
  """Validation loss (GPT) and MLM accuracy (BERT) per arm, ±1 std over the seeds."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  panels = [(f, [(a, r) for a, r in results["arms"].items()
                 if r["family"] == f and r["status"] != "failed"]) for f in ("gpt", "bert")]
  panels = [(f, arms) for f, arms in panels if arms]
  fig = Figure(figsize=(7.0, 3.2 * max(len(panels), 1)))
  FigureCanvasAgg(fig)
  axes = fig.subplots(max(len(panels), 1), 1, squeeze=False)[:, 0]
  for ax, (family, arms) in zip(axes, panels):
    ys = [r["mean"] for _, r in arms]
    errs = [0.0 if math.isnan(r["std"]) else r["std"] for _, r in arms]
    ax.errorbar(range(len(arms)), ys, yerr=errs, fmt="o", capsize=3)
    ax.set_xticks(range(len(arms)), [a for a, _ in arms], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("validation loss" if family == "gpt" else "MLM accuracy")
    ax.set_title(f"{family.upper()}: mean ± std over {NUM_SEEDS} seeds")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "mechanisms"))
  parser.add_argument("--arms", default="all",
                      help="comma-separated arm names (see results.md), or all")
  parser.add_argument("--families", default="gpt,bert")
  parser.add_argument("--steps", type=int, default=0,
                      help="training steps per arm (0: 2000 for GPT, --bert_steps for BERT; the "
                      "runlocal settings with --runlocal)")
  parser.add_argument("--bert_steps", type=int, default=1000)
  parser.add_argument("--runlocal", action="store_true",
                      help="seconds-long check: runlocal=True configs, 20 steps, 8 windows")
  parser.add_argument("--extrapolation_windows", type=int, default=0,
                      help="validation windows of 2 x block for the extrapolation loss (0: all)")
  parser.add_argument("--arg", default="",
                      help="extra key=value,... for every arm's config (e.g. mesh.cpu_devices=1)")
  parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data"),
                      help="folder with tinyshakespeare/input.txt ('' = $ATTNLAB_DATA_DIR)")
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)

  import tqdm  # pylint: disable=g-import-not-at-top
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  from attnlab.errors import UserError  # pylint: disable=g-import-not-at-top
  tool.setup_logging()

  extra = "".join(f",{a}" for a in (f"data.manual_dir={args.data_dir}" if args.data_dir else "",
                                      args.arg.strip(",")) if a)  # every arm's extra keys
  local = ",runlocal=True" if args.runlocal else ""
  gpt_steps = args.steps or (0 if args.runlocal else 2000)
  bert_steps = args.steps or (0 if args.runlocal else args.bert_steps)
  specs = {
      "gpt": f"{REPO / 'configs' / 'gpt.py'}:size={'tiny' if local else 'nano'}{local}{extra}" +
             (f",num_train_steps={gpt_steps}" if gpt_steps else ""),
      "bert": f"{REPO / 'configs' / 'bert.py'}:mode=pretrain,size={'test' if local else 'tiny'}"
              f"{local}{extra}" + (f",num_train_steps={bert_steps},optimizer.warmup_steps="
                                   f"{bert_steps // BERT_WARMUP_DIVISOR}" if bert_steps else ""),
  }
  max_windows = args.extrapolation_windows or (8 if args.runlocal else 0)
  families = [f for f in args.families.split(",") if f]
  for family in families:
    if family not in specs:
      raise UserError(f"unknown family {family!r}; valid families: gpt, bert")
  all_arms = {"gpt": gpt_arms(), "bert": bert_arms()}
  table = {arm: (family, keys) for family in families for arm, keys in all_arms[family].items()}
  if args.arms != "all":
    wanted = [a for a in args.arms.split(",") if a]
    unknown = [a for a in wanted if a not in table]
    if unknown:
      raise UserError(f"unknown arm(s) {', '.join(unknown)}; valid arms: {', '.join(table)}")
    table = {a: table[a] for a in wanted}
  # the baseline of the GPT arms (full, rotary, softmax) is the registry's "full" arm

  results_path = workdir / "results.json"
  previous = json.loads(results_path.read_text()) if results_path.is_file() else {}
  results = {"gpt_spec": specs["gpt"].split(":", 1)[1], "bert_spec": specs["bert"].split(":", 1)[1],
             "num_seeds": NUM_SEEDS, "cpus": os.cpu_count(), "arms": {}}
  # arms of earlier invocations stay listed where their family's settings are unchanged
  results["arms"] = {arm: r for arm, r in previous.get("arms", {}).items()
                     if previous.get(f"{r.get('family')}_spec") == results.get(
                         f"{r.get('family')}_spec")}
  status = 0
  bar = tqdm.tqdm(table.items(), desc="arms", unit="arm", file=sys.stderr)
  for arm, (family, keys) in bar:
    bar.set_postfix_str(arm)
    load = os.getloadavg()[0]
    entry = run_arm(family, arm, keys, specs[family], workdir, results["arms"].get(arm, {}),
                    max_windows)
    entry["load_average_start"] = load
    results["arms"][arm] = entry
    status |= entry["status"] == "failed"
    summary = (f"{entry['metric']} {_fmt(entry['mean'], entry['std'])}"
               if entry["status"] != "failed" else "failed")
    tqdm.tqdm.write(f"arm {arm} ({family}): {entry['status']}, {summary}", file=sys.stderr)
    results_path.write_text(json.dumps(results, indent=2) + "\n")  # a partial table survives
  text = markdown(results)
  (workdir / "results.md").write_text(text)
  plot(results, workdir / "results.png")
  print(text)
  return int(status)


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config or arm: one line, status 2
