"""The Long Range Arena re-measured: accuracy per task and mechanism, and efficiency vs softmax.

  python experiments/long_range/run.py [--workdir=runs/long_range] \
      [--tasks=listops,imdb_bytes,pathfinder] [--mechanisms=full,linear,...] [--num_seeds=3] \
      [--arg=key=value,...] [--lengths=1024,2048,3072,4096] [--batch=4] [--reps=5] \
      [--parallel=1] [--skip_accuracy] [--skip_efficiency] [--publish_dir=experiments/long_range]
  python experiments/long_range/run.py --runlocal --workdir=/tmp/lra   # seconds: a smoke test
  python experiments/long_range/run.py --plan     # time a few steps, project the study's time

1. Accuracy: for each task, the sweep runner (attnlab.sweep) trains configs/lra.py at CPU scale
   (`task=<task>,data.eval_split=test`, then --arg) with `model.attention.mechanism` = each mechanism, each
   member one run of `--num_seeds` vmapped replicas (seeds 0..N-1), in
   WORKDIR/accuracy/<task>/model.attention.mechanism=<m>/. Finished members are skipped, so the command can
   be run in pieces (stop it any time; run it again). Reported: test accuracy (%) mean ± std
   (ddof=1) over the replicas, beside LRA's published figure for that mechanism where the paper
   has one (its Table 1, as quoted in the issue; LRA's test sets and model sizes differ: see
   README.md).
2. Efficiency: in this one process, one jitted training step (forward, backward, AdamW update) of
   the classifier of configs/lra.py:task=imdb_bytes (byte-level text, as LRA measures it; CPU
   scale: 2 layers, d_model 64; mean pooling so that the sequence has exactly L tokens) at each
   length L of --lengths (--arg applies here too, except num_train_steps, eval_every,
   checkpoint_every and what the table fixes: the task, L and mean pooling), for softmax
   attention that forms the score matrix (`model.attention.implementation=reference`: LRA's vanilla
   Transformer, the baseline), softmax through
   the blocked online-softmax kernel (`implementation=blocked`), and each other mechanism. The
   variants are timed alternately (a round of one step each, --reps rounds after a warm-up step)
   and each reports the median; peak memory is the compiled step's (arguments + outputs + XLA
   temporaries, minus donated buffers: attnlab's memory analysis, deterministic). Reported:
   steps/s and peak memory, and both relative to softmax.

Writes WORKDIR/results.json (everything, with the wall time of each run, and under "pieces" one
record per invocation: its settings, start time, wall time and load average at both ends),
WORKDIR/results.md (both tables) and WORKDIR/results.png; with --publish_dir copies the three
there. Progress: the sweep's log lines and a tqdm bar over the efficiency cells.

Mechanisms: by default every name of attnlab.attention.registry.MECHANISMS where the checkout has
that registry (the mechanisms of issue 28), else only "full".
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "lra.py"
TASKS = ("listops", "imdb_bytes", "pathfinder")
# How the LRA paper names the tasks and the mechanisms.
TASK_TITLES = {"listops": "ListOps", "imdb_bytes": "Text", "pathfinder": "Pathfinder"}
MECHANISM_TITLES = {"full": "Transformer", "performer": "Performer", "bigbird": "BigBird",
                    "linear": "Linear Trans.", "linformer": "Linformer",
                    "sliding_window": "Local Attention"}
# LRA's published test accuracies (%), Table 1 of Tay et al. (2021), as quoted in issue 29 (only
# the rows the issue quotes; the others are left out rather than copied from memory).
LRA_ACCURACY: dict[str, dict[str, float]] = {
    "full": {"listops": 36.37, "imdb_bytes": 64.27, "pathfinder": 71.40},
    "performer": {"listops": 18.01, "imdb_bytes": 65.40, "pathfinder": 77.05},
    "bigbird": {"listops": 36.05, "imdb_bytes": 64.02, "pathfinder": 74.87},
}
# LRA's efficiency table, Table 2 of Tay et al. (2021): steps per second and peak memory (GB per
# TPU v3 device) of the byte-level text task at batch 32, 1K-4K tokens, for the rows whose
# mechanism attnlab has (Local Attention = sliding_window). The printed ratios are derived from
# these figures (mechanism / Transformer), as the paper's bracketed speed-ups are.
LRA_EFFICIENCY_RAW: dict[str, dict[int, tuple[float, float]]] = {
    "softmax": {1024: (8.1, 0.85), 2048: (4.9, 2.65), 3072: (2.3, 5.51), 4096: (1.4, 9.48)},
    "sliding_window": {1024: (9.2, 0.42), 2048: (8.4, 0.76), 3072: (7.4, 1.06),
                       4096: (7.4, 1.37)},
    "linformer": {1024: (9.3, 0.37), 2048: (9.1, 0.55), 3072: (8.5, 0.99), 4096: (7.7, 0.99)},
    "bigbird": {1024: (7.4, 0.77), 2048: (3.9, 1.49), 3072: (2.7, 2.18), 4096: (1.5, 2.88)},
    "linear": {1024: (9.1, 0.37), 2048: (9.3, 0.57), 3072: (8.6, 0.80), 4096: (7.8, 1.03)},
    "performer": {1024: (9.5, 0.37), 2048: (9.4, 0.59), 3072: (8.7, 0.82), 4096: (8.0, 1.06)},
}
# {mechanism: {length: (speed ratio, memory ratio)}} relative to LRA's Transformer.
LRA_EFFICIENCY: dict[str, dict[int, tuple[float, float]]] = {
    name: {length: (speed / LRA_EFFICIENCY_RAW["softmax"][length][0],
                    memory / LRA_EFFICIENCY_RAW["softmax"][length][1])
           for length, (speed, memory) in rows.items()}
    for name, rows in LRA_EFFICIENCY_RAW.items()}
# The efficiency baseline: softmax attention that forms the score matrix.
BASELINE = "softmax"
# The classifier timed by the efficiency table: the CPU-scale text model as the published table
# measured it (2 heads, MLP 128; the Text accuracy runs now use 4 heads and MLP 256), mean
# pooling so that the sequence has exactly L tokens, no dropout.
EFFICIENCY_MODEL = "model.pooling=mean,model.num_heads=2,model.mlp_dim=128,model.dropout_rate=0.0"


def default_mechanisms() -> list[str]:
  """Every registered mechanism (attnlab.attention.registry)."""
  from attnlab.attention import registry  # pylint: disable=g-import-not-at-top
  return list(registry.MECHANISMS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", default=str(REPO / "runs" / "long_range"))
  p.add_argument("--tasks", default=",".join(TASKS))
  p.add_argument("--mechanisms", default="", help="default: every registered mechanism")
  p.add_argument("--num_seeds", type=int, default=3, help="vmapped replicas per run")
  p.add_argument("--arg", default="", help="extra key=value,... for every configs/lra.py run")
  p.add_argument("--lengths", default=None, help="efficiency lengths (1024,2048,3072,4096)")
  p.add_argument("--batch", type=int, default=None, help="efficiency batch size (4)")
  p.add_argument("--reps", type=int, default=None, help="timed rounds per efficiency cell (5)")
  p.add_argument("--parallel", type=int, default=1, help="sweep members at once")
  p.add_argument("--skip_accuracy", action="store_true")
  p.add_argument("--skip_efficiency", action="store_true")
  p.add_argument("--publish_dir", default="", help="also copy results.{json,md,png} here")
  p.add_argument("--plan", action="store_true",
                 help="time a few training steps per task and print the study's projected "
                      "time; run nothing else")
  p.add_argument("--runlocal", action="store_true",
                 help="seconds: runlocal=True configs of 10 steps, 2 seeds; efficiency at "
                 "lengths 128,256, batch 2, 2 rounds (unless given)")
  args = p.parse_args(argv)
  defaults = ("128,256", 2, 2) if args.runlocal else ("1024,2048,3072,4096", 4, 5)
  for key, value in zip(("lengths", "batch", "reps"), defaults):
    if getattr(args, key) is None:
      setattr(args, key, value)
  if args.runlocal:
    args.arg = ",".join(x for x in ("runlocal=True,num_train_steps=10,eval_every=0,"
                                    "checkpoint_every=0", args.arg) if x)
    args.num_seeds = min(args.num_seeds, 2)
  args.tasks = [t for t in args.tasks.split(",") if t]
  unknown = [t for t in args.tasks if t not in TASKS]
  if unknown:
    p.error(f"unknown task(s) {', '.join(unknown)}; valid: {', '.join(TASKS)}")
  valid = default_mechanisms() if args.mechanisms else []
  unknown = [m for m in args.mechanisms.split(",") if m and m not in valid]
  if unknown:  # before the accuracy sweep and the efficiency table, not after
    p.error(f"unknown mechanism(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
  lengths = [x.strip() for x in args.lengths.split(",") if x.strip()]
  if not lengths or not all(x.isdigit() and int(x) >= 1 for x in lengths):
    p.error(f"--lengths must be token counts >= 1, e.g. 1024,2048; got {args.lengths!r}")
  args.lengths = [int(x) for x in lengths]
  # Each >= 1: the efficiency table times batches of exactly --batch and takes the median of
  # --reps timed rounds.
  for key in ("batch", "reps", "num_seeds", "parallel"):
    if getattr(args, key) < 1:
      p.error(f"--{key} must be >= 1, got {getattr(args, key)}")
  return args


def run_seconds(workdir: pathlib.Path) -> float | None:
  """Wall seconds of a run from its metrics.jsonl (compilation and evaluation included; the
  start is the first train record's time less its steps / steps-per-second)."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  records = rundir.read_metrics(workdir)  # the checked records (none: no file)
  train = [r for r in records if r.get("split") == "train" and r.get("steps_per_sec")]
  if not train:
    return None
  first = train[0]
  return records[-1]["wall_time"] - (first["wall_time"] - first["step"] / first["steps_per_sec"])


# ---------------------------------------------------------------------------------------------
# Accuracy


def accuracy(args: argparse.Namespace, mechanisms: list[str],
             workdir: pathlib.Path) -> tuple[dict[str, Any], int]:
  """{task: {mechanism: {mean, std, per_seed, seconds}}} of the test accuracy (%), exit status."""
  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  results: dict[str, Any] = {}
  status = 0
  for task in args.tasks:
    spec = f"{CONFIG}:task={task},data.eval_split=test" + (f",{args.arg}" if args.arg else "")
    result = sweep.run(spec, {"model.attention.mechanism": mechanisms}, num_seeds=args.num_seeds,
                       workdir=workdir / "accuracy" / task, parallel=args.parallel)
    status |= result.report("run.py", summary=False)
    results[task] = {}
    for member in result.members:
      mechanism = member.values["model.attention.mechanism"]
      if member.status not in ("done", "skipped"):
        results[task][mechanism] = {"status": member.status, "error": member.error}
        continue
      per_seed = [100 * m["eval/accuracy"] for m in sweep.final_metrics_per_seed(member.workdir)
                  if "eval/accuracy" in m]
      results[task][mechanism] = {
          "mean": statistics.fmean(per_seed) if per_seed else None,
          "std": statistics.stdev(per_seed) if len(per_seed) > 1 else None,
          "per_seed": per_seed, "seconds": run_seconds(member.workdir),
          "steps": member.config.num_train_steps}
  return results, status


def accuracy_markdown(results: dict[str, Any], mechanisms: list[str]) -> str:
  tasks = list(results)
  header = "| mechanism | " + " | ".join(
      f"{TASK_TITLES[t]} (ours) | {TASK_TITLES[t]} (LRA)" for t in tasks) + " |"
  lines = [header, "|---|" + "---|---|" * len(tasks)]
  for m in mechanisms:
    cells = []
    for t in tasks:
      r = results[t].get(m, {})
      if r.get("mean") is None:
        ours = r.get("status", "not run")
      else:
        ours = f"{r['mean']:.2f}" + (f" ± {r['std']:.2f}" if r.get("std") is not None else "")
      lra = LRA_ACCURACY.get(m, {}).get(t)
      cells += [ours, f"{lra:.2f}" if lra is not None else "-"]
    lines.append(f"| {m} ({MECHANISM_TITLES.get(m, m)}) | " + " | ".join(cells) + " |")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Efficiency


def efficiency_variants(mechanisms: list[str]) -> list[tuple[str, dict[str, Any]]]:
  """(name, config overrides) of each timed variant; the BASELINE first."""
  variants = [(BASELINE, {"model.attention.mechanism": "full", "model.attention.implementation": "reference"}),
              ("softmax_blocked", {"model.attention.mechanism": "full", "model.attention.implementation": "blocked"})]
  variants += [(m, {"model.attention.mechanism": m}) for m in mechanisms if m != "full"]
  return variants


def efficiency_arg(length: int, extra: str = "") -> str:
  """The configs/lra.py arg of the classifier timed at `length` tokens: EFFICIENCY_MODEL, then
  `extra` (--arg), then the text task, `length` and mean pooling, which --arg cannot change (the
  table's row says `length` tokens)."""
  return ",".join(part for part in (f"task=imdb_bytes,{EFFICIENCY_MODEL}", extra,
                                    f"task=imdb_bytes,data.max_len={length},model.pooling=mean")
                  if part)


def build_step(arg: str, overrides: dict[str, Any], batch: int | None = None):
  """(compiled train step, its inputs, peak bytes) of the classifier of configs/lra.py:`arg`
  with `overrides`, on random tokens (batch: the config's batch_size when None)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  from attnlab.tasks import long_range  # pylint: disable=g-import-not-at-top

  config = config_utils.load_config_file(f"{CONFIG}:{arg}")
  config_utils.apply_overrides(config, overrides)
  config_utils.validate(config)
  task = long_range.LongRangeTask(config)
  batch = batch or config.batch_size
  params = task.init(jax.random.key(0))
  tx = optax.adamw(1e-3)
  opt_state = tx.init(params)
  rng = np.random.default_rng(task.seq_len)
  batch_arrays = {
      "tokens": jnp.asarray(rng.integers(2, task.vocab_size, (batch, task.seq_len)), jnp.int32),
      "labels": jnp.asarray(rng.integers(0, task.num_classes, (batch,)), jnp.int32),
      "weights": jnp.ones((batch,), jnp.float32)}

  def step(params, opt_state, batch_):
    loss, grads = jax.value_and_grad(lambda p: task.loss_fn(p, batch_, None)[0])(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batch_arrays).compile()
  stats = compiled.memory_analysis()
  peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
          - stats.alias_size_in_bytes)
  return compiled, [params, opt_state, batch_arrays], int(peak)


def plan(args: argparse.Namespace, mechanisms: list[str], steps_timed: int = 3) -> str:
  """A projection of the accuracy study's time: CPU seconds of one training step per task (the
  config's batch, one replica, softmax, no dropout) x steps x replicas x mechanisms / cores."""
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  lines = ["| task | tokens x batch | CPU s/step | wall s/step | steps | projected minutes |",
           "|---|---|---|---|---|---|"]
  cores = os.cpu_count() or 1
  total = 0.0
  for task in args.tasks:
    arg = f"task={task}" + (f",{args.arg}" if args.arg else "")
    config = config_utils.load_config_file(f"{CONFIG}:{arg}")
    compiled, inputs, _ = build_step(arg, {"model.dropout_rate": 0.0})
    cpu, wall = [], []
    for i in range(steps_timed + 1):
      c0, w0 = time.process_time(), time.perf_counter()
      params, opt_state, loss = compiled(*inputs)
      jax.block_until_ready((params, opt_state, loss))
      inputs = [params, opt_state, inputs[2]]
      if i:  # the first call warms up
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    per_step = statistics.median(cpu)
    minutes = (per_step * config.num_train_steps * args.num_seeds * len(mechanisms)
               / cores / 60)
    total += minutes
    lines.append(f"| {task} | {inputs[2]['tokens'].shape[1]} x {config.batch_size} | "
                 f"{per_step:.3f} | {statistics.median(wall):.3f} | {config.num_train_steps} | "
                 f"{minutes:.0f} |")
  lines.append(f"\nProjected: {total:.0f} minutes for {len(mechanisms)} mechanism(s) x "
               f"{args.num_seeds} seeds on {cores} cores (CPU time split evenly over the cores; "
               f"softmax's step for every mechanism; evaluation and compilation not counted); "
               f"load average now {os.getloadavg()[0]:.1f}.")
  return "\n".join(lines)


def efficiency(args: argparse.Namespace, mechanisms: list[str]) -> dict[str, Any]:
  """{length: {variant: {steps_per_sec, peak_bytes, speed_ratio, memory_ratio}}}."""
  import jax  # pylint: disable=g-import-not-at-top
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  variants = efficiency_variants(mechanisms)
  extra = ",".join(part for part in args.arg.split(",")
                   if part and not part.startswith(("num_train_steps", "eval_every",
                                                    "checkpoint_every")))
  results: dict[str, Any] = {}
  bar = tqdm(total=len(args.lengths) * len(variants) * (args.reps + 1), desc="efficiency",
             file=sys.stderr)
  for length in args.lengths:
    cells: dict[str, Any] = {}
    for name, overrides in variants:
      try:
        arg = efficiency_arg(length, extra)
        compiled, inputs, peak = build_step(arg, overrides, args.batch)
      except Exception as e:  # one variant failing (memory, a missing mechanism) keeps the rest
        cells[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
        bar.update(args.reps + 1)
        continue
      cells[name] = {"compiled": compiled, "inputs": inputs, "peak_bytes": peak, "times": []}
    live = [n for n, c in cells.items() if "compiled" in c]
    for round_ in range(args.reps + 1):  # round 0 warms up (first run of each executable)
      for name in live:
        cell = cells[name]
        params, opt_state, batch = cell["inputs"]
        start = time.perf_counter()
        params, opt_state, loss = cell["compiled"](params, opt_state, batch)
        jax.block_until_ready((params, opt_state, loss))
        if round_:
          cell["times"].append(time.perf_counter() - start)
        cell["inputs"] = [params, opt_state, batch]
        bar.update(1)
    base = cells.get(BASELINE, {})
    out = {}
    for name, cell in cells.items():
      if "compiled" not in cell:
        out[name] = cell
        continue
      median = statistics.median(cell["times"])
      row = {"steps_per_sec": 1.0 / median, "peak_bytes": cell["peak_bytes"],
             "times": cell["times"]}
      if "compiled" in base:
        row["speed_ratio"] = statistics.median(base["times"]) / median
        row["memory_ratio"] = cell["peak_bytes"] / base["peak_bytes"]
      out[name] = row
    results[str(length)] = out
  bar.close()
  return results


def efficiency_markdown(results: dict[str, Any], batch: int) -> str:
  lengths = list(results)
  names = list(dict.fromkeys(n for cells in results.values() for n in cells))
  header = "| variant | " + " | ".join(f"steps/s at {l} (x softmax) [LRA]"
                                       for l in lengths) + " | " + " | ".join(
      f"peak MB at {l} (x softmax) [LRA]" for l in lengths) + " |"
  lines = [f"Batch {batch}; softmax = the score matrix formed (model.attention.implementation=reference); "
           "[LRA] = the paper's ratio (Table 2) where transcribed, '-' otherwise.", "",
           header, "|---|" + "---|" * (2 * len(lengths))]
  for name in names:
    speed, memory = [], []
    for l in lengths:
      r = results[l].get(name, {})
      lra = LRA_EFFICIENCY.get(name, {}).get(int(l))
      if "steps_per_sec" not in r:
        speed.append(r.get("error", "-")[:40])
        memory.append("-")
        continue
      speed.append(f"{r['steps_per_sec']:.3g} ({r.get('speed_ratio', float('nan')):.2f}x) "
                   f"[{f'{lra[0]:.1f}x' if lra else '-'}]")
      memory.append(f"{r['peak_bytes'] / 2**20:.0f} ({r.get('memory_ratio', float('nan')):.2f}x) "
                    f"[{f'{lra[1]:.2f}x' if lra else '-'}]")
    lines.append(f"| {name} | " + " | ".join(speed + memory) + " |")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Figure and main


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
  """Panels for what the results hold: test accuracy per task (bars, LRA's figure as a black
  tick), and steps/s and peak memory relative to softmax by length."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  acc = results.get("accuracy") or {}
  eff = results.get("efficiency") or {}
  panels = (["accuracy"] if acc else []) + (["speed_ratio", "memory_ratio"] if eff else [])
  panels = panels or ["accuracy"]  # nothing measured: one empty, titled panel
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
  for ax, panel in zip(axes[0], panels):
    if panel == "accuracy":
      _plot_accuracy(ax, acc)
    else:
      _plot_ratio(ax, eff, panel)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _plot_accuracy(ax, acc: dict[str, Any]) -> None:
  mechanisms = list(dict.fromkeys(m for per_task in acc.values() for m in per_task))
  width = 0.8 / max(len(mechanisms), 1)
  for i, m in enumerate(mechanisms):
    xs, means, stds = [], [], []
    for j, task in enumerate(acc):
      r = acc[task].get(m, {})
      if r.get("mean") is not None:
        xs.append(j + i * width)
        means.append(r["mean"])
        stds.append(r.get("std") or 0.0)
    ax.bar(xs, means, width, yerr=stds, label=m)
    for j, task in enumerate(acc):
      if (lra := LRA_ACCURACY.get(m, {}).get(task)) is not None:
        ax.plot([j + i * width], [lra], "k_", markersize=12)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(acc))], [TASK_TITLES[t] for t in acc])
  ax.set_ylabel("test accuracy (%); black: LRA")
  ax.set_title("accuracy (CPU scale)" if acc else "accuracy: not measured")
  if mechanisms:
    ax.legend(fontsize=8)


def _plot_ratio(ax, eff: dict[str, Any], key: str) -> None:
  lengths = [int(length) for length in eff]
  names = list(dict.fromkeys(n for cells in eff.values() for n in cells))
  for name in names:
    pts = [(int(length), eff[length][name][key]) for length in eff
           if key in eff[length].get(name, {})]
    if pts:
      ax.plot(*zip(*pts), marker="o", label=name)
  ax.set_xlabel("tokens")
  if key == "speed_ratio":
    ax.set_ylabel("steps/s relative to softmax")
    ax.set_title("training-step speed (higher is faster)")
  else:
    ax.set_yscale("log")
    ax.set_ylabel("peak memory relative to softmax (log)")
    ax.set_title("training-step peak memory (lower is less)")
  ax.set_xticks(lengths)
  ax.legend(fontsize=8)


def missing_from(new: dict[str, Any], old: dict[str, Any]) -> list[str]:
  """The results of `old` (a published results.json) that `new` lacks: accuracy rows by
  task/mechanism and efficiency lengths."""
  lost = [f"accuracy {task}/{m}" for task, rows in old.get("accuracy", {}).items() for m in rows
          if m not in new.get("accuracy", {}).get(task, {})]
  return lost + [f"efficiency at {n} tokens" for n in old.get("efficiency", {})
                 if n not in new.get("efficiency", {})]


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  tool.setup_logging()  # the sweep members' progress on stderr
  workdir = pathlib.Path(args.workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  mechanisms = [m for m in args.mechanisms.split(",") if m] or default_mechanisms()
  if args.plan:
    print(plan(args, mechanisms))
    return 0
  results: dict[str, Any] = {
      "settings": {"tasks": args.tasks, "mechanisms": mechanisms, "num_seeds": args.num_seeds,
                   "arg": args.arg, "lengths": args.lengths, "batch": args.batch,
                   "reps": args.reps, "cpu_count": os.cpu_count()},
      "load_average_start": os.getloadavg()}
  status = 0
  sections = []
  start = time.time()
  path = workdir / "results.json"
  previous = json.loads(path.read_text()) if path.is_file() else {}
  # A run in pieces (--tasks=..., --skip_*) adds to the results of the earlier pieces.
  results["accuracy"] = previous.get("accuracy", {})
  if not args.skip_accuracy:
    measured, status = accuracy(args, mechanisms, workdir)
    for task, rows in measured.items():  # by mechanism: other mechanisms' rows stay
      results["accuracy"].setdefault(task, {}).update(rows)
  if results["accuracy"]:
    shown = list(dict.fromkeys(m for per_task in results["accuracy"].values() for m in per_task))
    sections.append("## Accuracy (test, %, mean ± std over the vmapped seeds)\n\n"
                    + accuracy_markdown(results["accuracy"], shown))
  results["efficiency"] = previous.get("efficiency", {})
  if not args.skip_efficiency:  # by length: a length's variants are measured together
    results["efficiency"].update(efficiency(args, mechanisms))
  if results["efficiency"]:
    sections.append("## Efficiency (one training step, text classifier)\n\n"
                    + efficiency_markdown(results["efficiency"], args.batch))
  results["wall_seconds"] = time.time() - start
  results["load_average_end"] = os.getloadavg()
  # the top-level settings / wall / load are this invocation's; each piece keeps its own
  piece = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
           "skip_accuracy": args.skip_accuracy, "skip_efficiency": args.skip_efficiency}
  piece.update({k: results[k] for k in ("settings", "wall_seconds", "load_average_start",
                                        "load_average_end")})
  results["pieces"] = previous.get("pieces", []) + [piece]
  path.write_text(json.dumps(results, indent=1) + "\n")
  text = "\n\n".join(sections)
  (workdir / "results.md").write_text(text + "\n")
  plot(results, workdir / "results.png")
  print(text)
  print(f"\nwall {results['wall_seconds']:.0f} s; load average {results['load_average_start']} "
        f"at the start, {results['load_average_end']} at the end")
  if args.publish_dir:
    dest = pathlib.Path(args.publish_dir)
    if (dest / "results.json").is_file():  # publishing must not drop what is published
      lost = missing_from(results, json.loads((dest / "results.json").read_text()))
      if lost:
        from attnlab.errors import UserError  # pylint: disable=g-import-not-at-top
        raise UserError(
            f"--publish_dir: {dest / 'results.json'} holds results that {path} lacks "
            f"({', '.join(lost[:6])}{', ...' if len(lost) > 6 else ''}); publish from the "
            "workdir that measured them, or merge them into its results.json first")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "results.md", "results.png"):
      shutil.copy(workdir / name, dest / name)
  return status


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))
