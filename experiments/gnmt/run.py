"""GNMT's residual connections at a CPU-sized depth: dates, preset=gnmt with and without residuals.

  python experiments/gnmt/run.py [--workdir=runs/gnmt] [--seeds=0,1] [--layers=6] [--steps=600]

1. Trains configs/seq2seq.py:preset=gnmt (LSTM, bidirectional bottom encoder layer, attention from
   the bottom decoder layer fed up the stack) at `--layers` layers, once with
   model.residual_start=3 (GNMT) and once with model.residual_start=0 (the same stack without
   residuals), for every seed: WORKDIR/r<R>-s<S>/, ordinary run directories (a finished one is
   not trained again; an interrupted one resumes).
2. Writes WORKDIR/results.md: validation cross-entropy, token accuracy (teacher-forced) and exact
   match (greedy decoding of the 1,000 validation dates) at every evaluation, mean ± std over the
   seeds, and one row per run at the last step.

Each run is its own process (`attnlab train`), one after the other.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "seq2seq.py"
ARMS = (("no residuals", 0), ("GNMT residuals from layer 3", 3))
METRICS = (("ce", "validation CE"), ("token_accuracy", "token accuracy"),
           ("exact_match", "exact match"))


def spec(layers: int, residual_start: int, steps: int, seed: int) -> str:
  return (f"{CONFIG}:preset=gnmt,model.num_layers={layers},model.residual_start={residual_start},"
          f"num_train_steps={steps},eval_every={steps // 3},checkpoint_every={steps},seed={seed},"
          f"mesh.cpu_devices=1")


def mean_std(values) -> str:
  import numpy as np  # pylint: disable=g-import-not-at-top
  values = np.asarray(values, float)
  if len(values) == 1:
    return f"{values[0]:.4f}"
  return f"{values.mean():.4f} ± {values.std(ddof=1):.4f}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "gnmt"))
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--steps", type=int, default=600)
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir).absolute()
  seeds = [int(s) for s in args.seeds.split(",")]
  for seed in seeds:
    for _, r in ARMS:
      member = workdir / f"r{r}-s{seed}"
      command = [sys.executable, "-m", "attnlab.cli", "train",
                 f"--config={spec(args.layers, r, args.steps, seed)}", f"--workdir={member}"]
      if subprocess.run(command, cwd=REPO, check=False).returncode:
        print(f"run.py: {member} failed; see its log above", file=sys.stderr)
        return 1

  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  evals = {(r, seed): [x for x in rundir.read_metrics(workdir / f"r{r}-s{seed}")
                       if x["split"] == "eval"] for _, r in ARMS for seed in seeds}
  lines = [f"dates, configs/seq2seq.py:preset=gnmt,model.num_layers={args.layers}, "
           f"{args.steps} steps, seeds {args.seeds} (mean ± std over seeds)", "",
           "| arm | step | " + " | ".join(name for _, name in METRICS) + " |",
           "|---|---|" + "---|" * len(METRICS)]
  for arm, r in ARMS:
    for i, record in enumerate(evals[(r, seeds[0])]):
      cells = [mean_std([evals[(r, s)][i][key] for s in seeds]) for key, _ in METRICS]
      lines.append(f"| {arm} | {record['step']} | " + " | ".join(cells) + " |")
  lines += ["", "| arm | seed | " + " | ".join(name for _, name in METRICS) + " |",
            "|---|---|" + "---|" * len(METRICS)]
  for arm, r in ARMS:
    for seed in seeds:
      last = evals[(r, seed)][-1]
      lines.append(f"| {arm} | {seed} | " + " | ".join(f"{last[key]:.4f}" for key, _ in METRICS)
                   + " |")
  text = "\n".join(lines) + "\n"
  (workdir / "results.md").write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
