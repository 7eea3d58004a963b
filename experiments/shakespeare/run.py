"""Nano GPT on Tiny Shakespeare characters: the nanoGPT CPU recipe, 2000 steps.

  python experiments/shakespeare/run.py                         # runs/shakespeare_nano
  python experiments/shakespeare/run.py --workdir=/tmp/shk --config_arg=score=cosine
  python experiments/shakespeare/run.py --config_arg=runlocal=True --workdir=/tmp/shk_local

Trains (or resumes) `configs/gpt.py` (size=nano by default) with the one trainer, then writes
into the workdir: loss_curve.png (train and validation loss against steps), sample.txt (300
tokens after "ROMEO:", temperature 0.8, KV cache), attention.png (every head on the first 32
characters), and summary.json (final validation loss, wall time, steps/s, the sample). The
validation loss is the token-weighted mean over every non-overlapping 64-character window of
the last 10% of the text; summary.json also gives the spread of nanoGPT's own estimate (20
random batches of 12 windows) over 50 draws (`--draws`), for comparison with nanoGPT's reported
numbers.
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


def plot_losses(records: list[dict], path: pathlib.Path, title: str) -> None:
  """Train and validation loss against the step, saved as PNG."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(6.4, 4.0))
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  for split, style in (("train", "-"), ("eval", "o-")):
    rows = [r for r in records if r["split"] == split]
    if rows:
      label = "train (mean over each log interval)" if split == "train" else "validation"
      ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, label=label,
              markersize=3)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats / character)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def nanogpt_estimates(task, params, *, draws: int = 50, iters: int = 20, batch: int = 12,
                      seed: int = 0) -> list[float]:
  """nanoGPT's estimate_loss on the validation text, repeated with `draws` different samples.

  Each estimate is the mean loss over `iters` batches of `batch` windows at random offsets
  (15,360 characters for nanoGPT's CPU recipe); their spread shows how far a single estimate
  (such as nanoGPT's reported 1.8857) can sit from the full validation loss.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  block, ids = task.block_size, task.validation_ids()
  loss_fn = jax.jit(lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
      task.model.apply({"params": p}, x), y).mean())
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(draws):
    starts = rng.integers(0, len(ids) - block, size=iters * batch)
    pos = starts[:, None] + np.arange(block)[None, :]  # [iters * batch, block]
    x, y = ids[pos].reshape(iters, batch, block), ids[pos + 1].reshape(iters, batch, block)
    out.append(float(np.mean([loss_fn(params, x[i], y[i]) for i in range(iters)])))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "shakespeare_nano"))
  parser.add_argument("--config_arg", default="", help="extra configs/gpt.py args, key=value,...")
  parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data"),
                      help="folder with tinyshakespeare/input.txt ('' = $ATTNLAB_DATA_DIR or "
                      "download)")
  parser.add_argument("--draws", type=int, default=50,
                      help="nanoGPT-style loss estimates drawn (each 20 batches of 12 windows)")
  args = parser.parse_args(argv)
  if args.draws < 1:
    parser.error(f"--draws={args.draws}: at least 1 estimate is needed")

  # pylint: disable=g-import-not-at-top  (JAX is imported only once the flags are parsed)
  from attnlab import analysis, config_utils, rundir, train
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  tool.setup_logging()
  arg = "size=nano"
  if args.data_dir:
    arg += f",data.manual_dir={args.data_dir}"
  if args.config_arg:
    arg += "," + args.config_arg
  config = config_utils.load_config_file(f"{REPO / 'configs' / 'gpt.py'}:{arg}")
  workdir = pathlib.Path(args.workdir)

  summary_path = workdir / "summary.json"
  previous = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
  already_done = rundir.is_complete(workdir, config.num_train_steps)
  start = time.time()
  load_start = os.getloadavg()[0]
  train.train_and_evaluate(config, workdir)
  # Wall time of this invocation (compilation, evaluations and checkpoints included); a finished
  # run keeps the time it was trained in (null if no summary of that invocation was written).
  wall = previous.get("wall_time_s") if already_done else time.time() - start
  records = rundir.read_metrics(workdir)
  train_rows = [r for r in records if r["split"] == "train"]
  eval_rows = [r for r in records if r["split"] == "eval"]
  plot_losses(records, workdir / "loss_curve.png",
              f"GPT {config.model.size} on Tiny Shakespeare ({config.model.attention.score})")
  run = analysis.load_run(workdir)
  sample = run.task.sample_text(run.params, "ROMEO:", num_tokens=300, temperature=0.8,
                                seed=config.seed)
  estimates = nanogpt_estimates(run.task, run.params, draws=args.draws)
  summary = {
      "final_step": eval_rows[-1]["step"],
      "val_loss": eval_rows[-1]["loss"],
      "nanogpt_style_estimates": {
          "draws": len(estimates), "mean": statistics.mean(estimates),
          "std": statistics.stdev(estimates), "min": min(estimates), "max": max(estimates)},
      "val_perplexity": eval_rows[-1]["perplexity"],
      "train_loss_last_interval": train_rows[-1]["loss"],
      "wall_time_s": wall,
      "median_steps_per_sec": sorted(r["steps_per_sec"] for r in train_rows)[len(train_rows) // 2],
      "load_average_start_end": [load_start, os.getloadavg()[0]],
      "cpus": os.cpu_count(),
      "config_arg": arg,
      "sample": "ROMEO:" + sample,
  }
  summary_path.write_text(json.dumps(summary, indent=2) + "\n")
  print(json.dumps({k: v for k, v in summary.items() if k != "sample"}, indent=2))
  print("\nsample:\n" + summary["sample"])
  return 0


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config arg: one line, status 2
