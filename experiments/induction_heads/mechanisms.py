"""Which attention mechanisms form induction heads, and when (issue #52): the induction study's
measurements on every GPT arm of experiments/mechanisms, on the synthetic induction task.

  python experiments/induction_heads/mechanisms.py --workdir=runs/induction_mechanisms
  python experiments/induction_heads/mechanisms.py --arms=full,alibi,linear      # a few arms
  python experiments/induction_heads/mechanisms.py --arms=full,linear --steps=20 --every=10 \
      --seeds=2 --config_arg=data.num_train=200 --workdir=/tmp/im              # seconds per arm

Every arm is run.py's 2-layer attention-only GPT (configs/gpt.py with dataset=induction,
model.mlp_ratio=0, 4 heads, d_model 64, block 64; rotary positions and softmax attention) with
the keys of one GPT arm of experiments/mechanisms/run.py changed. The arms are that script's
gpt_arms() (imported, so the two studies share one table): 5 mechanisms, 5 position schemes,
4 normalisers, grouped- and multi-query attention, talking heads. They train in ORDER (the most
informative first, the rest in the table's order), `--seeds` replicas in one vmapped program
(num_seeds: each its own init and data order), a checkpoint every `--every` steps.

At every checkpoint and for every seed (run.py's measure()): the copy loss (validation loss on
the copied ids that an induction head can predict), the best layer-0 head's previous-token
score, the best last-layer head's induction score on 32 random ids repeated twice (the key
31 positions back) and on 12 ids repeated twice (`induction_near`: 11 back, inside the
sliding_window arm's window of 16), the ICL score, the repeat gap and the layer 0 -> 1
K-composition. At the last checkpoint, per seed: the copy loss with each head's output zeroed
(`blocks.l.attn.z`), and each head's mean row sum of attention weights before the detectors
normalise the rows.

Phase change: the first checkpoint at which a seed's copy loss is below `--threshold` (2.0 nats;
a uniform guess is ln 64 = 4.16, the softmax baseline ends near 0.5), else "none by step N".

How the detectors read the arms (attnlab.analysis.detectors): a score is a mean of a head's
captured weights (`blocks.l.attn.pattern`) on one key per query, after dividing each row by its
sum. Softmax, sparsemax and top-k rows already sum to 1; a sigmoid row's gates sum to anything,
and a softmax_sink row to less than 1 (the rest goes to the learned sink), so there a score is
the share of the row's weight that the target key gets. Linear attention and Performer never form
weights to compute their output; asked for the pattern they materialise their implicit matrix
phi(q_i)ᵀphi(k_j) / sum_l phi(q_i)ᵀphi(k_l), whose product with the values is their output, so
their scores are read from the matrix they compute with (`pattern_note` of each arm says so).

Resumable: an arm whose measurements (WORKDIR/<arm>/measure.json) reach the last step is skipped,
otherwise the trainer resumes its workdir. After every arm, WORKDIR/results.json, results.md
(the tables) and mechanisms.png (copy loss, previous-token and induction score against the step,
mean over seeds, one line per arm) are rewritten from every finished arm of these settings.
`--report_only` rewrites them without training (e.g. while another invocation trains).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _load(name: str, path: pathlib.Path):
  """A study script as a module (the experiments folders are not packages)."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


induction = _load("induction_heads_run", HERE / "run.py")
mechanisms = _load("mechanisms_run", REPO / "experiments" / "mechanisms" / "run.py")
machine = _load("benchmarks_machine", REPO / "experiments" / "benchmarks" / "machine.py")

# Training order: the baseline, then the arms whose outcome was least predictable (positions,
# normalisers, the kernelised mechanisms), then the rest. bigbird is last: at block 64 its
# 64-token blocks cover every causal key, so it computes full attention (mechanisms README).
ORDER = ("full", "alibi", "none", "learned", "sigmoid", "sparsemax", "softmax_sink", "linear",
         "performer", "sliding_window", "gqa", "mqa", "topk", "talking_heads", "t5_bias",
         "sinusoidal", "bigbird")
# Copy loss (nats) under which a seed counts as past its phase change.
THRESHOLD = 2.0
# Repeat length of the second induction detector: its key lies NEAR - 1 = 11 positions back,
# inside experiments/mechanisms' sliding window of 16 keys each side.
NEAR = 12
LAYERS = 2


def arm_table() -> dict[str, dict[str, object]]:
  """Arm name -> the configs/gpt.py keys it changes, in training order."""
  arms = mechanisms.gpt_arms()
  order = [a for a in ORDER if a in arms] + [a for a in arms if a not in ORDER]
  return {a: arms[a] for a in order}


def keys_arg(keys: dict[str, object]) -> str:
  return ",".join(f"{k}={v}" for k, v in keys.items())


def phase_step(losses: list[float], steps: list[int], threshold: float) -> int | None:
  """The first of `steps` whose copy loss is below `threshold`, or None."""
  return next((s for s, loss in zip(steps, losses) if loss < threshold), None)


def ablation(workdir: pathlib.Path, num_seeds: int) -> list[dict]:
  """Per seed, at the last checkpoint: the copy loss with each head's output zeroed, the mean
  row sum of each head's weights, and the line about a mechanism without explicit weights."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import optax
  from attnlab import analysis
  run = analysis.load_run(workdir, "latest", replica=None)
  val = induction.validation(run.task)
  mask = val["copy_mask"]
  layers, heads = run.model.num_layers, run.model.num_heads
  eye = np.eye(heads, dtype=bool)

  def copy_loss(model, ivs):
    logits = analysis.run_with_hooks(model, val["inputs"], ivs)  # [n, len, vocab]
    nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, val["targets"]))
    return float((nll * mask).sum() / mask.sum())

  out = []
  for params in induction.replicas(run, num_seeds):
    model = (run.model, params)
    ablated = np.zeros((layers, heads))
    for l in range(layers):
      for h in range(heads):
        ablated[l, h] = copy_loss(model, [analysis.Intervention(
            f"blocks.{m}.attn.z", "zero", heads=eye[h] if m == l else np.zeros(heads, bool))
            for m in range(layers)])
    sinks = analysis.sink_metrics(model, seq_len=induction.SEQ_LEN, batch=16)
    out.append({"copy_loss_clean": copy_loss(model, []),
                "copy_loss_ablated": np.round(ablated, 4).tolist(),
                "row_sum": np.round(sinks.row_sum, 4).tolist(),
                "pattern_note": sinks.note})
  return out


# ------------------------------------------------------------------------------------ report


def _curves(arm: dict) -> tuple[list[int], list[list[dict]]]:
  steps = sorted(int(s) for s in arm["rows"])
  return steps, [arm["rows"][str(s)] for s in steps]  # [checkpoints][seeds]


def summary(arm: dict, threshold: float) -> dict:
  """Per seed: the phase-change step and the last checkpoint's numbers (the table's sources)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  steps, rows = _curves(arm)
  seeds = range(len(rows[-1]))
  out = {"phase_step": [phase_step([r[i]["copy_loss_here"] for r in rows], steps, threshold)
                        for i in seeds],
         "copy_loss": [rows[-1][i]["copy_loss_here"] for i in seeds],
         "previous_token": [max(rows[-1][i]["previous_token"][0]) for i in seeds],
         "induction": [max(rows[-1][i]["induction"][-1]) for i in seeds],
         "induction_near": [max(rows[-1][i]["induction_near"][-1]) for i in seeds],
         "icl_score": [rows[-1][i]["icl_score"] for i in seeds]}
  if "ablation" in arm:
    rise, top = [], []
    for a, r in zip(arm["ablation"], rows[-1]):
      last = np.asarray(a["copy_loss_ablated"][-1]) - a["copy_loss_clean"]  # [heads]
      rise.append(float(last.max()))
      # the top induction head: the highest sum of the two scores (the sliding window's heads
      # all score 0 on the 32-id repeat, whose key lies outside the window)
      both = np.asarray(r["induction"][-1]) + np.asarray(r["induction_near"][-1])  # [heads]
      top.append(int(np.argmax(last)) == int(np.argmax(both)))
    out["largest_rise"], out["largest_is_top_induction"] = rise, top
  return out


def _fmt(xs: list[float], digits: int = 2) -> str:
  import numpy as np  # pylint: disable=g-import-not-at-top
  return f"{np.mean(xs):.{digits}f}" + (f" ± {np.std(xs):.{digits}f}" if len(xs) > 1 else "")


def tables(results: dict) -> str:
  """The README's tables: one row per arm at the last step; copy loss and induction score over
  training."""
  threshold, last = results["threshold"], results["steps"]
  chance = results["chance"]
  lines = [f"Per arm at step {last} (mean ± std over the seeds; best layer-0 previous-token head, "
           f"best layer-1 induction head; a uniform head scores {chance['previous_token']:.3f}, "
           f"{chance['induction']:.3f} and, on the 12-id repeat, "
           f"{results['chance_near']['induction']:.3f}):", "",
           f"| arm | keys | copy loss < {threshold:g} at step (per seed) | copy loss | "
           "prev-token (L0) | induction (L1) | induction, 12-id repeat | ICL score | largest "
           "rise, one L1 head zeroed (seeds where it is the top induction head) | train s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for name, arm in results["arms"].items():
    s = summary(arm, threshold)
    when = " / ".join("none" if p is None else str(p) for p in s["phase_step"])
    if all(p is None for p in s["phase_step"]):
      when = f"none by {last}"
    rise = (f"{_fmt(s['largest_rise'])} ({sum(s['largest_is_top_induction'])}/"
            f"{len(s['largest_rise'])})" if "largest_rise" in s else "")
    keys = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in arm["keys"].items())
    lines.append(f"| {name} | {keys} | {when} | {_fmt(s['copy_loss'])} | "
                 f"{_fmt(s['previous_token'])} | {_fmt(s['induction'])} | "
                 f"{_fmt(s['induction_near'])} | {_fmt(s['icl_score'])} | {rise} | "
                 f"{arm['train_s']:.0f} |")
  stride = max(last // 4, results["every"])
  picks = sorted({int(s) for arm in results["arms"].values() for s in arm["rows"]
                  if int(s) % stride == 0} | {last})
  lines += ["", "Copy loss / layer-1 induction score (mean over the seeds) during training:", "",
            "| arm | " + " | ".join(f"step {s}" for s in picks) + " |",
            "|---|" + "---|" * len(picks)]
  for name, arm in results["arms"].items():
    cells = []
    for s in picks:
      rows = arm["rows"].get(str(s))
      cells.append("" if rows is None else
                   f"{sum(r['copy_loss_here'] for r in rows) / len(rows):.2f} / "
                   f"{sum(max(r['induction'][-1]) for r in rows) / len(rows):.2f}")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
  """Copy loss, previous-token and induction scores against the step, mean over the seeds."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from matplotlib import colormaps
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(10.0, 9.0))
  FigureCanvasAgg(fig)
  axes = fig.subplots(3, 1, sharex=True)
  palette = colormaps["tab10"]
  for k, (name, arm) in enumerate(results["arms"].items()):
    steps, rows = _curves(arm)
    # the baseline black; the others 10 colours, then the same colours dashed, then dotted
    style = ({"color": "black", "lw": 2.2} if name == "full" else
             {"color": palette(k % 10), "lw": 1.3, "ls": ["-", "--", ":"][(k // 10) % 3]})
    mean = lambda f, rows=rows: [np.mean([f(r) for r in seeds]) for seeds in rows]
    axes[0].plot(steps, mean(lambda r: r["copy_loss_here"]), label=name, **style)
    axes[1].plot(steps, mean(lambda r: max(r["previous_token"][0])), label=name, **style)
    axes[2].plot(steps, mean(lambda r: max(r["induction"][-1])), label=name, **style)
  chance = results["chance"]
  axes[0].axhline(np.log(64), color="grey", lw=0.8, ls=":")
  axes[0].axhline(results["threshold"], color="grey", lw=0.8, ls="--")
  axes[1].axhline(chance["previous_token"], color="grey", lw=0.8, ls=":")
  axes[2].axhline(chance["induction"], color="grey", lw=0.8, ls=":")
  axes[0].set_ylabel("copy loss (nats)\n(grey: ln 64, threshold)")
  axes[1].set_ylabel("previous-token score\nlayer 0, best head")
  axes[2].set_ylabel("induction score\nlayer 1, best head")
  axes[2].set_xlabel("training step")
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  axes[0].set_title(f"Induction task, 2-layer attention-only GPT: mean over "
                    f"{results['seeds']} seeds per arm")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def report(workdir: pathlib.Path, results: dict) -> str:
  text = tables(results)
  (workdir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
  (workdir / "results.md").write_text(text + "\n")
  plot(results, workdir / "mechanisms.png")
  return text


# -------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "induction_mechanisms"))
  parser.add_argument("--arms", default="all", help="comma-separated arm names, or all")
  parser.add_argument("--steps", type=int, default=2000, help="training steps per arm")
  parser.add_argument("--every", type=int, default=100, help="steps between checkpoints")
  parser.add_argument("--seeds", type=int, default=3, help="vmapped seeds per arm (num_seeds)")
  parser.add_argument("--threshold", type=float, default=THRESHOLD,
                      help="copy loss (nats) that marks the phase change")
  parser.add_argument("--config_arg", default="", help="extra configs/gpt.py args, key=value,...")
  parser.add_argument("--report_only", action="store_true",
                      help="train nothing: rewrite the tables and figure from the finished arms")
  args = parser.parse_args(argv)
  if args.steps < 1 or not 1 <= args.every <= args.steps or args.seeds < 1:
    parser.error("need --steps >= 1, 1 <= --every <= --steps and --seeds >= 1")

  # pylint: disable=g-import-not-at-top  (JAX is imported only once the flags are parsed)
  from attnlab import analysis, train
  from attnlab.cli import tool
  from attnlab.errors import UserError
  tool.setup_logging()
  table = arm_table()
  if args.arms != "all":
    wanted = [a for a in args.arms.split(",") if a]
    unknown = [a for a in wanted if a not in table]
    if unknown:
      raise UserError(f"unknown arm(s) {', '.join(unknown)}; valid arms: {', '.join(table)}")
  else:
    wanted = list(table)
  configs = {}  # every arm's config, so that a bad key stops the study before any training
  for name, keys in table.items():
    extra = ",".join(a for a in (keys_arg(keys), args.config_arg.strip(",")) if a)
    configs[name] = induction.arm_config(LAYERS, args.steps, args.every, args.seeds, extra)
  workdir = pathlib.Path(args.workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  started, uptime_before = time.time(), machine.uptime()
  print(f"uptime before: {uptime_before}", flush=True)
  results = {"steps": args.steps, "every": args.every, "seeds": args.seeds,
             "threshold": args.threshold, "near": NEAR,
             "chance": analysis.chance_scores(induction.SEQ_LEN),
             "chance_near": analysis.chance_scores(NEAR), "cpu": machine.cpu_line(),
             "cpus": os.cpu_count(), "uptime_before": uptime_before, "arms": {}}

  def finished() -> dict:  # the arms on disk measured with these settings, in training order
    out = {}
    for name in table:
      saved = workdir / name / induction.MEASURE_FILE
      arm = json.loads(saved.read_text()) if saved.is_file() else {}
      if arm.get("config_arg") == configs[name][1] and "ablation" in arm:
        out[name] = arm
    return out

  for name in [] if args.report_only else wanted:
    config, arg = configs[name]
    arm_dir = workdir / name
    saved = arm_dir / induction.MEASURE_FILE
    arm = json.loads(saved.read_text()) if saved.is_file() else {}
    if arm.get("config_arg") != arg:
      arm = {"config_arg": arg, "keys": table[name], "rows": {}, "train_s": 0.0,
             "measure_s": 0.0, "invocations": []}
    arm["seeds"] = [config.seed + i for i in range(args.seeds)]
    if str(args.steps) in arm["rows"] and "ablation" in arm:
      print(f"{name}: done (step {args.steps} measured), skipped", flush=True)
      continue
    print(f"{name}: training to step {args.steps} ({args.seeds} seeds, vmapped): {arg}",
          flush=True)
    record = {"start_utc": time.strftime("%H:%M:%S", time.gmtime()),
              "uptime_start": machine.uptime()}
    start = time.time()
    train.train_and_evaluate(config, arm_dir)
    arm["train_s"] += time.time() - start
    start = time.time()
    arm["rows"].update(induction.measure(arm_dir, args.seeds, arm["rows"], near=NEAR))
    saved.write_text(json.dumps(arm) + "\n")  # the curves survive an interrupted ablation
    arm["ablation"] = ablation(arm_dir, args.seeds)
    arm["measure_s"] += time.time() - start
    record.update(end_utc=time.strftime("%H:%M:%S", time.gmtime()),
                  uptime_end=machine.uptime())
    arm["invocations"].append(record)
    saved.write_text(json.dumps(arm) + "\n")
    results["arms"] = finished()
    report(workdir, results)
    s = summary(arm, args.threshold)
    print(f"{name}: copy loss {_fmt(s['copy_loss'], 3)}, phase change at {s['phase_step']}, "
          f"train {arm['train_s']:.0f} s, measure {arm['measure_s']:.0f} s", flush=True)

  results["arms"] = finished()
  results.update(uptime_after=machine.uptime(),
                 wall_s_this_invocation=time.time() - started)
  if not results["arms"]:
    print("no arm finished with these settings yet")
    return 0
  text = report(workdir, results)
  print(text)
  print(f"\nuptime after: {results['uptime_after']}\nwall time this invocation: "
        f"{results['wall_s_this_invocation']:.0f} s\n{results['cpu']}")
  return 0


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("mechanisms.py", main))  # a bad config arg or arm: one line, status 2
