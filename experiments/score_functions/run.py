"""The score-function study: the six scores of attnlab.attention on dates and on Marathi.

  python experiments/score_functions/run.py [--workdir=runs/score_functions] \
      [--datasets=dates,marathi] [--scores=dot,scaled_dot,cosine,general,additive,location] \
      [--seeds=0,1,2] [--attention=bahdanau] [--parallel=1] \
      [--dates_arg=num_train_steps=1500] [--marathi_arg=num_train_steps=8000]

For each dataset, the sweep runner trains configs/seq2seq.py (unidirectional encoder, so that dot,
scaled_dot and cosine compare raw encoder and decoder states) with `model.score` = each score and
`seed` = each seed in WORKDIR/<dataset>/<model.score=...,seed=...>/ (resumable; finished members
are skipped) and writes WORKDIR/<dataset>/summary.md (every final metric, mean ± std over seeds).
This script then writes WORKDIR/results.md (exact match / BLEU / loss per score and dataset) and one
heatmap per score and dataset (seed 0, one held-out example) to WORKDIR/figures/.
Marathi needs the anki_mar_eng data: ATTNLAB_DATA_DIR=../shared/data (or data.manual_dir=...).
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

CONFIG = REPO / "configs" / "seq2seq.py"
SCORES = ("dot", "scaled_dot", "cosine", "general", "additive", "location")
# The sentence drawn for each dataset's heatmaps.
EXAMPLE = {"dates": "tuesday 9 october 1993", "marathi": "I want to go to school tomorrow."}
COLUMNS = (("eval/exact_match", "exact match"), ("eval/bleu", "BLEU"),
           ("eval/ce", "validation CE"))


def summary_rows(summary_csv: pathlib.Path) -> list[dict[str, str]]:
  with open(summary_csv) as f:
    return list(csv.DictReader(f))


def fmt(row: dict[str, str], name: str) -> str:
  mean, std = row.get(f"{name}_mean", ""), row.get(f"{name}_std", "")
  if not mean:
    return ""
  return f"{float(mean):.4g}" + (f" ± {float(std):.2g}" if std else "")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "score_functions"))
  parser.add_argument("--datasets", default="dates,marathi")
  parser.add_argument("--scores", default=",".join(SCORES))
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--attention", default="bahdanau")
  parser.add_argument("--parallel", type=int, default=1)
  parser.add_argument("--dates_arg", default="")
  parser.add_argument("--marathi_arg", default="")
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir).absolute()

  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  tool.setup_logging()  # the members' progress on stderr

  status, sections = 0, []
  for dataset in args.datasets.split(","):
    extra = {"dates": args.dates_arg, "marathi": args.marathi_arg}.get(dataset, "")
    # A unidirectional encoder: its states have the decoder's size, so dot, scaled_dot and cosine
    # compare raw states (a bidirectional one would need a learned key projection first).
    spec = f"{CONFIG}:data.name={dataset},model.attention={args.attention}," \
        f"model.bidirectional=False" + (f",{extra}" if extra else "")
    out = workdir / dataset
    result = sweep.run(spec, {"model.score": args.scores}, seeds=args.seeds, workdir=out,
                       parallel=args.parallel)
    status |= result.report("run.py")
    rows = summary_rows(result.summary_csv)
    lines = [f"### {dataset} (`{spec.split(':', 1)[1]}`, seeds {args.seeds})", "",
             "| score | seeds | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for row in rows:
      lines.append(f"| {row['model.score']} | {row['seeds']} | " +
                   " | ".join(fmt(row, name) for name, _ in COLUMNS) + " |")
    sections.append("\n".join(lines))
    first_seed = args.seeds.split(",")[0]
    for score in args.scores.split(","):
      member = out / f"model.score={score},seed={first_seed}"
      try:
        run = analysis.load_run(member)
      except ValueError as e:  # a member that failed or never ran: no heatmap
        print(f"{member.name}: no heatmap ({e})", file=sys.stderr)
        continue
      [t] = run.task.translate(run.params, [EXAMPLE.get(dataset, EXAMPLE["dates"])])
      plt.close(run.task.plot_alignment(t, workdir / "figures" / f"{dataset}_{score}.png",
                                        title=f"{score}: {t.source} -> {t.text}"))
  text = "\n\n".join(sections)
  (workdir / "results.md").write_text(text + "\n")
  print(text)
  return status


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config or axis: one line, status 2
