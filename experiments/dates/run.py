"""Dates with Bahdanau attention: held-out exact match and alignment heatmaps.

  python experiments/dates/run.py [--workdir=runs/dates] [--seeds=0,1,2] [--parallel=1] \
      [--arg=model.attention=luong,model.score=general]

1. Trains configs/seq2seq.py (task dates: human-readable date -> ISO date, character tokens,
   bidirectional GRU encoder, Bahdanau additive attention) for every seed through the sweep runner
   (WORKDIR/seed=N/, resumable; finished members are skipped on a re-run).
2. Reloads each run and decodes the 1000 held-out *test* dates (greedy): exact match and BLEU.
3. Writes WORKDIR/results.md (one row per seed + mean ± std) and heatmaps of seed 0 for one date
   written in several formats to WORKDIR/figures/ (copy them next to the README to publish).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

CONFIG = REPO / "configs" / "seq2seq.py"
# One date (9 October 1993) in several of the task's formats.
EXAMPLES = ("tuesday 9 october 1993", "09/10/93", "October 9th, 1993", "9.10.1993",
            "oct 9 1993", "9th of october 1993")


def run_seconds(workdir: pathlib.Path) -> float:
  """Wall-clock seconds of a run (compilation and evaluations included), from metrics.jsonl.

  The start is the first train record's time minus its steps / steps-per-second (exact for a run
  that was not resumed).
  """
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  records = rundir.read_metrics(workdir)
  first = next(r for r in records if r["split"] == "train")
  return records[-1]["wall_time"] - (first["wall_time"] - first["step"] / first["steps_per_sec"])


def mean_std(values):
  import numpy as np  # pylint: disable=g-import-not-at-top
  values = np.asarray(values, float)
  std = values.std(ddof=1) if len(values) > 1 else float("nan")
  return f"{values.mean():.4f} ± {std:.4f}" if len(values) > 1 else f"{values.mean():.4f}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "dates"))
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--parallel", type=int, default=1)
  parser.add_argument("--arg", default="", help="extra key=value,... for configs/seq2seq.py")
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir).absolute()
  spec = f"{CONFIG}:data.name=dates" + (f",{args.arg}" if args.arg else "")

  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  tool.setup_logging()  # the members' progress on stderr
  start = time.time()
  status = sweep.run(spec, seeds=args.seeds, workdir=workdir, parallel=args.parallel).report(
      "run.py")
  print(f"sweep finished in {time.time() - start:.0f} s (status {status})")

  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  rows, test_em, test_bleu, val_em = [], [], [], []
  for seed in args.seeds.split(","):
    member = workdir / f"seed={seed}"
    run = analysis.load_run(member)
    val = [r for r in analysis.read_metrics(member) if r["split"] == "eval"][-1]
    metrics, records = run.task.evaluate_split(run.params, "test")
    seconds = run_seconds(member)
    rows.append(f"| {seed} | {run.step} | {val['exact_match']:.4f} | {metrics['exact_match']:.4f} "
                f"| {metrics['bleu']:.2f} | {seconds:.0f} |")
    val_em.append(val["exact_match"])
    test_em.append(metrics["exact_match"])
    test_bleu.append(metrics["bleu"])
    wrong = [r for r in records if not r["exact"]]
    print(f"seed {seed}: test exact match {metrics['exact_match']:.4f}, "
          f"{len(wrong)} wrong, e.g. {[(r['source'], r['output']) for r in wrong[:5]]}")
    if seed == args.seeds.split(",")[0]:
      figures = workdir / "figures"
      for i, t in enumerate(run.task.translate(run.params, EXAMPLES)):
        plt.close(run.task.plot_alignment(t, figures / f"dates_{i}.png"))
        print(f"{t.source!r} -> {t.text!r}")
  table = "\n".join([
      f"Config: `configs/seq2seq.py:data.name=dates{',' + args.arg if args.arg else ''}`, "
      f"greedy decoding, 1000 validation / 1000 test dates.",
      "",
      "| seed | steps | validation exact match | test exact match | test BLEU (chars) | "
      "wall time (s) |",
      "|---|---|---|---|---|---|",
      *rows,
      f"| mean ± std | | {mean_std(val_em)} | {mean_std(test_em)} | {mean_std(test_bleu)} | |",
  ])
  (workdir / "results.md").write_text(table + "\n")
  print(table)
  return status


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config or axis: one line, status 2
