"""The bottleneck study: sequence reversal, no attention against Bahdanau attention, by length.

  python experiments/bottleneck/run.py [--workdir=runs/bottleneck] [--seeds=0,1,2] \
      [--attentions=none,bahdanau] [--max_len=30] [--parallel=1] [--arg=num_train_steps=2000]

Task: reverse a random string of 1..max_len symbols (alphabet of 10), character tokens. Both
models are the same GRU encoder-decoder (configs/seq2seq.py, data.name=reverse): with
`model.attention=none` the encoder's last state is the decoder's only view of the source; with
`bahdanau` the decoder attends over every encoder state. The sweep runner trains every
(attention, seed) member in WORKDIR/<model.attention=...,seed=...>/ (resumable, finished members
skipped) and evaluates the held-out validation strings by source-length bin. This script then
writes WORKDIR/results.md (exact match per bin, mean ± std over seeds) and WORKDIR/bottleneck.png
(exact match, decoded token accuracy and character BLEU against source length).
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

CONFIG = REPO / "configs" / "seq2seq.py"
METRICS = (("exact_match", "exact match"), ("decoded_token_accuracy", "token accuracy"),
           ("bleu", "BLEU (characters)"))


def run_seconds(workdir: pathlib.Path) -> float:
  """Wall-clock seconds of a run (compilation and evaluations included), from metrics.jsonl."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  records = rundir.read_metrics(workdir)
  first = next(r for r in records if r["split"] == "train")
  return records[-1]["wall_time"] - (first["wall_time"] - first["step"] / first["steps_per_sec"])


def read_bins(summary_csv: pathlib.Path, group_key: str = "model.attention"):
  """{setting: {metric: [(low, high, mean, std), ...]}} from a sweep's summary.csv."""
  out = {}
  with open(summary_csv) as f:
    for row in csv.DictReader(f):
      per_metric = out.setdefault(row[group_key], {})
      for column, value in row.items():
        m = re.fullmatch(r"eval/(\w+?)_len_(\d+)_(\d+)_mean", column)
        if not m or value == "":
          continue
        name, low, high = m.group(1), int(m.group(2)), int(m.group(3))
        std = row[column[:-len("mean")] + "std"]
        per_metric.setdefault(name, []).append(
            (low, high, float(value), float(std) if std else float("nan")))
  for per_metric in out.values():
    for values in per_metric.values():
      values.sort()
  return out


def plot(bins, path: pathlib.Path, title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.4))
  for ax, (metric, label) in zip(axes, METRICS):
    for setting, per_metric in bins.items():
      values = per_metric.get(metric, [])
      if not values:
        continue
      mid = [(low + high) / 2 for low, high, _, _ in values]
      mean = np.array([v[2] for v in values])
      std = np.nan_to_num(np.array([v[3] for v in values]))
      ax.errorbar(mid, mean, yerr=std, marker="o", capsize=3, label=f"attention={setting}")
    ax.set_xlabel("source length (symbols, bin centre)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize="small")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def results_table(bins, seeds: str, seconds: dict[str, list[float]]) -> str:
  settings = list(bins)
  edges = [(low, high) for low, high, _, _ in next(iter(bins.values()))["exact_match"]]
  lines = ["| source length | " + " | ".join(f"exact match, attention={s}" for s in settings)
           + " |", "|---|" + "---|" * len(settings)]
  for i, (low, high) in enumerate(edges):
    cells = []
    for s in settings:
      _, _, mean, std = bins[s]["exact_match"][i]
      cells.append(f"{mean:.3f}" + ("" if std != std else f" ± {std:.3f}"))
    lines.append(f"| {low}-{high} | " + " | ".join(cells) + " |")
  lines.append("| wall time per run (s) | " + " | ".join(
      f"{sum(seconds[s]) / len(seconds[s]):.0f}" if seconds.get(s) else "" for s in settings)
      + " |")
  return f"Mean ± std over seeds {seeds} (validation strings of each length bin).\n\n" + \
      "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "bottleneck"))
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--attentions", default="none,bahdanau")
  parser.add_argument("--max_len", type=int, default=30)
  parser.add_argument("--parallel", type=int, default=1)
  parser.add_argument("--arg", default="", help="extra key=value,... for configs/seq2seq.py")
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir).absolute()
  bins = tuple(range(5, args.max_len + 1, 5))
  if not bins or bins[-1] != args.max_len:
    bins = bins + (args.max_len,)
  spec = (f"{CONFIG}:data.name=reverse,data.max_len={args.max_len},"
          f"data.length_bins=({','.join(map(str, bins))})" + (f",{args.arg}" if args.arg else ""))

  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  tool.setup_logging()  # the members' progress on stderr
  result = sweep.run(spec, {"model.attention": args.attentions}, seeds=args.seeds,
                     workdir=workdir, parallel=args.parallel)
  status = result.report("run.py")
  results = read_bins(result.summary_csv)
  if not results or not all("exact_match" in r for r in results.values()):
    print("no finished members to summarise", file=sys.stderr)
    return status or 1
  plot(results, workdir / "bottleneck.png",
       f"reverse 1..{args.max_len} symbols, seeds {args.seeds}")
  seconds = {}
  for setting in results:
    for seed in args.seeds.split(","):
      member = workdir / f"model.attention={setting},seed={seed}"
      if (member / "metrics.jsonl").is_file():
        seconds.setdefault(setting, []).append(run_seconds(member))
  table = results_table(results, args.seeds, seconds)
  (workdir / "results.md").write_text(table + "\n")
  print(table)
  print(f"plot: {workdir / 'bottleneck.png'}")
  return status


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config or axis: one line, status 2
