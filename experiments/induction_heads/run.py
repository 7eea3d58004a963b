"""Induction heads at CPU scale (issue #52): a 2-layer attention-only GPT on the synthetic
induction task, with a 1-layer control; head detectors and the copied-token loss over training.

  python experiments/induction_heads/run.py                       # runs/induction_heads
  python experiments/induction_heads/run.py --steps=200 --every=20 --workdir=/tmp/ind

Trains (or resumes: the trainer resumes a workdir by itself) `configs/gpt.py` with
dataset=induction, model.mlp_ratio=0 and model.num_layers 2 (WORKDIR/layers2) and 1
(WORKDIR/layers1), keeping a checkpoint every `--every` steps. Then, at every checkpoint:
  copy_loss         the validation loss on the copied ids an induction head can predict (the
                    task's eval metric, from metrics.jsonl), beside the loss on all ids
  previous_token    attnlab.analysis.detect_heads' score, best head of layer 0
  induction         the same, best head of the last layer (layer 1; layer 0 of the control)
  repeat_loss_gap   on random ids repeated twice, the mean loss on the first half minus that on
                    the second half (an in-context-learning score: > 0 when the model uses the
                    first occurrence)
Writes WORKDIR/results.json and WORKDIR/induction_heads.png (one time axis).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

# The model and data of the study (configs/gpt.py keys); the layer count is added per arm.
BASE_ARG = ("dataset=induction,model.mlp_ratio=0,model.num_heads=4,model.d_model=64,"
            "model.block_size=64,data.vocab_size=64,data.min_span=4,data.max_span=16,"
            "data.num_eval=256,data.eval_batch_size=128,batch_size=32,"
            "optimizer.warmup_steps=50,mesh.cpu_devices=1")


def arm_config(layers: int, steps: int, every: int, extra: str):
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  arg = (f"{BASE_ARG},model.num_layers={layers},num_train_steps={steps},eval_every={every},"
         f"checkpoint_every={every},keep_checkpoints={steps // every + 2},log_every={every}")
  if extra:
    arg += "," + extra
  return config_utils.load_config_file(f"{REPO / 'configs' / 'gpt.py'}:{arg}"), arg


def measure(workdir: pathlib.Path, seq_len: int) -> list[dict]:
  """One row per checkpoint of the run in `workdir`."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import optax
  from attnlab import analysis, checkpoint, rundir
  evals = {r["step"]: r for r in rundir.read_metrics(workdir) if r["split"] == "eval"}
  rows = []
  for step in sorted(checkpoint.finished_steps(workdir)):
    run = analysis.load_run(workdir, step)
    scores = analysis.detect_heads(run, seq_len=seq_len, batch=16)
    tokens = analysis.repeated_random_tokens(run.model.vocab_size, seq_len, 16, seed=1, low=0)
    logits = run.model.apply({"params": run.params}, tokens[:, :-1])
    nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))
    first, second = nll[:, :seq_len - 1].mean(), nll[:, seq_len:].mean()
    ev = evals.get(step, {})
    rows.append({
        "step": step, "copy_loss": ev.get("copy_loss"), "loss": ev.get("loss"),
        "copy_accuracy": ev.get("copy_accuracy"),
        "previous_token_layer0": float(scores["previous_token"][0].max()),
        "induction_last_layer": float(scores["induction"][-1].max()),
        "duplicate_token_layer0": float(scores["duplicate_token"][0].max()),
        "repeat_loss_gap": float(first - second),
        "previous_token": scores["previous_token"].round(3).tolist(),
        "induction": scores["induction"].round(3).tolist()})
  return rows


def plot(results: dict, path: pathlib.Path, chance: dict) -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(7.0, 7.5))
  FigureCanvasAgg(fig)
  top, middle, bottom = fig.subplots(3, 1, sharex=True)
  for name, rows in results.items():
    steps = [r["step"] for r in rows]
    style = "o-" if name == "layers2" else "s--"
    top.plot(steps, [r["copy_loss"] for r in rows], style, ms=3, label=f"{name}: copied ids")
    top.plot(steps, [r["loss"] for r in rows], style, ms=3, alpha=0.4, label=f"{name}: all ids")
    middle.plot(steps, [r["induction_last_layer"] for r in rows], style, ms=3,
                label=f"{name}: induction (last layer, best head)")
    middle.plot(steps, [r["previous_token_layer0"] for r in rows], style, ms=3, alpha=0.6,
                label=f"{name}: previous token (layer 0, best head)")
    bottom.plot(steps, [r["repeat_loss_gap"] for r in rows], style, ms=3, label=name)
  middle.axhline(chance["induction"], color="grey", lw=0.8, ls=":", label="uniform head")
  top.set_ylabel("validation loss (nats)")
  middle.set_ylabel("detector score")
  bottom.set_ylabel("loss 1st half - 2nd half\n(repeated random ids)")
  bottom.set_xlabel("training step")
  for ax in (top, middle, bottom):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  top.set_title("Attention-only GPT on the synthetic induction task")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "induction_heads"))
  parser.add_argument("--steps", type=int, default=1000, help="training steps per arm")
  parser.add_argument("--every", type=int, default=50, help="steps between checkpoints")
  parser.add_argument("--config_arg", default="", help="extra configs/gpt.py args, key=value,...")
  args = parser.parse_args(argv)
  if args.steps < 1 or not 1 <= args.every <= args.steps:
    parser.error("need --steps >= 1 and 1 <= --every <= --steps")

  # pylint: disable=g-import-not-at-top  (JAX is imported only once the flags are parsed)
  from attnlab import analysis, train
  from attnlab.cli import tool
  tool.setup_logging()
  workdir = pathlib.Path(args.workdir)
  results, walls, config_args = {}, {}, {}
  seq_len = 32  # 2 * 32 = block_size ids
  for layers in (2, 1):
    name = f"layers{layers}"
    config, arg = arm_config(layers, args.steps, args.every, args.config_arg)
    start = time.time()
    train.train_and_evaluate(config, workdir / name)
    walls[name] = time.time() - start
    config_args[name] = arg
    results[name] = measure(workdir / name, seq_len)
  chance = analysis.chance_scores(seq_len)
  plot(results, workdir / "induction_heads.png", chance)
  summary = {"chance": chance, "wall_s_this_invocation": walls, "config_args": config_args,
             "load_average": os.getloadavg(), "cpus": os.cpu_count(), "results": results}
  (workdir / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
  for name, rows in results.items():
    print(f"\n{name}: step  copy_loss  loss  prev_tok(L0)  induction(last)  repeat_gap")
    for r in rows:
      print(f"  {r['step']:6d}  {r['copy_loss'] or float('nan'):.3f}  "
            f"{r['loss'] or float('nan'):.3f}  {r['previous_token_layer0']:.3f}  "
            f"{r['induction_last_layer']:.3f}  {r['repeat_loss_gap']:.3f}")
  return 0


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config arg: one line, status 2
