"""N seeds in one vmapped program (config.num_seeds=N) against N sequential single-seed runs.

For each config and N in --seeds: the wall time of one `train_and_evaluate` with num_seeds=N
against the sum of the wall times of the single-seed runs with seeds 0..N-1 (each run in its own
workdir; every run compiles its own train step, as a separate launch would). Both include start-up,
compilation, the final evaluation and checkpoint (after one untimed warm-up run that pays the
imports and first data loading); `steady` columns are the training steps alone
(from the last train record's steps_per_sec: no compilation, no evaluation). Ratios > 1 mean the
vmapped run is faster. Run from the repository root:

  python experiments/benchmarks/seeds.py                          # small GPT and seq2seq, N=1,2,4,8
  python experiments/benchmarks/seeds.py --steps=50 --seeds=1,4 --configs=gpt
  python experiments/benchmarks/seeds.py --json=/tmp/seeds.json    # also write the numbers

The configs are the runlocal shrinks of configs/gpt.py (tiny GPT on Tiny Shakespeare characters)
and configs/seq2seq.py (dates, GRU with attention), with plots, periodic evaluation and
intermediate checkpoints off. N=1 is the same run on both sides: its ratio shows the noise. On a
shared CPU the numbers are noisy: compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

from attnlab import config_utils
from attnlab import rundir
from attnlab import train
from attnlab.cli import tool

# Benchmark name -> config spec (runlocal shrinks).
CONFIGS = {
    "gpt": "configs/gpt.py:runlocal=True",
    "seq2seq": "configs/seq2seq.py:runlocal=True",
}
# Overrides that keep the runs to the training loop.
COMMON = "write_plots=False,eval_every=0,checkpoint_every=0,mesh.data=1"


def _run(spec: str, workdir: pathlib.Path) -> tuple[float, float]:
  """(wall seconds of the whole run, steady-state seconds per step)."""
  config = config_utils.load_config_file(spec)
  start = time.perf_counter()
  train.train_and_evaluate(config, workdir)
  wall = time.perf_counter() - start
  records = [r for r in rundir.read_metrics(workdir) if r["split"] == "train"]
  return wall, 1.0 / records[-1]["steps_per_sec"]


def benchmark(name: str, steps: int, seeds: list[int], root: pathlib.Path) -> list[dict]:
  """Rows {config, n, vmapped_s, sequential_s, ratio, steady ratio} for one config."""
  base = f"{CONFIGS[name]},{COMMON},num_train_steps={steps},log_every={max(steps // 2, 1)}"
  _run(f"{base},seed=99", root / f"{name}_warmup")  # imports, data files, first compile: not timed
  singles = [_run(f"{base},seed={s}", root / f"{name}_seed{s}") for s in range(max(seeds))]
  rows = []
  for n in seeds:
    wall, step_s = _run(f"{base},num_seeds={n}", root / f"{name}_n{n}")
    seq_wall = sum(w for w, _ in singles[:n])
    seq_step = sum(s for _, s in singles[:n])
    rows.append({"config": name, "n": n, "vmapped_s": wall, "sequential_s": seq_wall,
                 "ratio": seq_wall / wall, "vmapped_step_ms": 1e3 * step_s,
                 "sequential_step_ms": 1e3 * seq_step, "steady_ratio": seq_step / step_s})
    print(_format_row(rows[-1]), flush=True)
  return rows


HEADER = ("| config | N | vmapped (s) | N sequential (s) | ratio | vmapped step (ms) | "
          "N sequential steps (ms) | steady ratio |\n|---|---|---|---|---|---|---|---|")


def _format_row(row: dict) -> str:
  return (f"| {row['config']} | {row['n']} | {row['vmapped_s']:.1f} | {row['sequential_s']:.1f} | "
          f"{row['ratio']:.2f} | {row['vmapped_step_ms']:.1f} | {row['sequential_step_ms']:.1f} | "
          f"{row['steady_ratio']:.2f} |")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", default="gpt,seq2seq",
                      help=f"comma-separated names from {', '.join(CONFIGS)}")
  parser.add_argument("--seeds", default="1,2,4,8", help="comma-separated N values")
  parser.add_argument("--steps", type=int, default=20, help="training steps per run")
  parser.add_argument("--json", default="", help="also write the rows to this JSON file")
  args = parser.parse_args(argv)
  names = [n for n in args.configs.split(",") if n]
  unknown = [n for n in names if n not in CONFIGS]
  if unknown:
    parser.error(f"unknown config {unknown[0]!r}; valid: {', '.join(CONFIGS)}")
  try:
    seeds = sorted({int(n) for n in args.seeds.split(",") if n})
  except ValueError:
    parser.error(f"--seeds must be comma-separated ints, got {args.seeds!r}")
  if not seeds or seeds[0] < 1:
    parser.error("--seeds values must be >= 1")
  tool.setup_logging()
  import logging  # pylint: disable=g-import-not-at-top
  logging.getLogger("attnlab").setLevel(logging.WARNING)
  print(HEADER, flush=True)
  rows = []
  with tempfile.TemporaryDirectory(prefix="attnlab_seeds_") as tmp:
    for name in names:
      rows += benchmark(name, args.steps, seeds, pathlib.Path(tmp))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
