"""RNN attention against the Transformer: quality, parameters, training time; reverse by length.

  python experiments/rnn_vs_transformer/run.py [--workdir=runs/rnn_vs_transformer] \
      [--tasks=dates,marathi,reverse] [--seeds=0] [--steps=0] [--rnn_arg=...] [--tf_arg=...]
  python experiments/rnn_vs_transformer/run.py --heatmaps=RUN_DIR [--sentence="..."]

Models (every run is an ordinary run directory WORKDIR/<task>/<model>/seed_<s>/: resumable,
finished runs are skipped, loadable with attnlab.analysis.load_run):
  rnn          configs/seq2seq.py with --rnn_arg (default: bidirectional GRU + Bahdanau
               attention with the additive score, the seq2seq study's best attention model);
  transformer  configs/transformer.py with TF_MATCHED[task] then --tf_arg (sizes within ~6% of
               the RNN's parameters: "small"/"medium" with narrower width or wider MLPs);
  rnn_none     (reverse only) the same GRU without attention, for the bottleneck plot.
Both families read identical data (configs/seq2seq.py and configs/transformer.py take their
data fields from configs/_translation.py). --steps > 0 overrides
num_train_steps of every run (a reduced study).

Outputs in WORKDIR: results.md (parameters, final exact match / BLEU, training time and the time
to reach a common target: 90% of the weaker model's final score), reverse_by_length.png (exact
match against source length, no attention / Bahdanau / Transformer), and with --heatmaps
cross_attention.png / encoder_self_attention.png (per layer and head, one sentence pair).
Training time is the sum of the logged train intervals (log_every / steps_per_sec): it excludes
compilation and evaluation. All timings are on whatever CPU runs the script.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

CONFIGS = {"rnn": REPO / "configs" / "seq2seq.py", "rnn_none": REPO / "configs" / "seq2seq.py",
           "transformer": REPO / "configs" / "transformer.py"}
DEFAULT_RNN = "model.attention=bahdanau,model.score=additive"
# task -> (headline metric, extra config arg shared by every model of the task).
# reverse is exactly the bottleneck study's config (experiments/bottleneck), so its GRU runs can
# be reused (README).
TASKS = {
    "dates": ("exact_match", "eval_every=250"),
    "marathi": ("bleu", "eval_every=1000"),
    "reverse": ("exact_match", "data.max_len=30,data.length_bins=(5,10,15,20,25,30),"
                               "eval_every=1000"),
}
# task -> Transformer size (before --tf_arg) within ~6% of the parameters of that task's RNN:
# dates 126,570 vs GRU 119,346; reverse 55,853 vs 54,513; Marathi 3,752,444 vs 3,984,636.
TF_MATCHED = {
    "dates": "model.d_model=56,model.mlp_dim=96",
    "marathi": "model.mlp_dim=768",
    "reverse": "model.d_model=36,model.mlp_dim=72",
}
# Fraction of the weaker model's final score that defines the common target.
TARGET_FRACTION = 0.9


def read_records(workdir: pathlib.Path) -> list[dict]:
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  return rundir.read_metrics(workdir)


def train_seconds(records: list[dict], log_every: int) -> dict[int, float]:
  """{step: cumulative training seconds} from the train records' logged speed."""
  out, total, last = {}, 0.0, 0
  for r in records:
    if r["split"] == "train" and r.get("steps_per_sec"):
      total += (r["step"] - last) / r["steps_per_sec"]
      last = r["step"]
      out[r["step"]] = total
  return out


def summarise(workdir: pathlib.Path, metric: str) -> dict:
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab import models as models_lib  # pylint: disable=g-import-not-at-top
  run = analysis.load_run(workdir)
  records = read_records(workdir)
  evals = [r for r in records if r["split"] == "eval"]
  seconds = train_seconds(records, run.config.log_every)
  curve = [(r["step"], seconds_at(seconds, r["step"]), r[metric]) for r in evals]
  return {"params": models_lib.count_params(run.params), "final": evals[-1], "curve": curve,
          "steps": run.step, "seconds": seconds_at(seconds, run.step)}


def seconds_at(seconds: dict[int, float], step: int) -> float:
  """Training seconds at `step`, interpolated between the logged steps."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  steps = [0] + sorted(seconds)
  return float(np.interp(step, steps, [0.0] + [seconds[s] for s in steps[1:]]))


def time_to(curve, target: float) -> tuple[int | None, float]:
  for step, sec, value in curve:
    if value >= target:
      return step, sec
  return None, float("nan")


def mean_row(task: str, model: str, rs: list[dict], metric: str, target: float) -> str:
  """Table row of mean ± sample std (ddof=1, as attnlab.sweep) over seeds; time to target over
  the seeds that reach it."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  ms = lambda xs: f"{np.mean(xs):.{3 if max(xs) <= 1 else 1}f} ± {np.std(xs, ddof=1):.3f}"
  reached = [time_to(r["curve"], target) for r in rs]
  reached = [(step, sec) for step, sec in reached if step is not None]
  to_target = (f"{np.mean([s for s, _ in reached]):.0f} ({len(reached)}/{len(rs)} seeds) | "
               f"{np.mean([t for _, t in reached]):.0f}" if reached else "not reached | nan")
  return (f"| {task} | **{model} (mean ± std, {len(rs)} seeds)** | {rs[0]['params']:,} | "
          f"{rs[0]['steps']} | {metric} {ms([r['final'][metric] for r in rs])} | "
          f"{np.mean([r['seconds'] for r in rs]):.0f} | {metric} >= {target:.3f} | {to_target} |")


def run_one(task: str, model: str, seed: int, workdir: pathlib.Path, args) -> int:
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  parts = [f"task={task}", f"seed={seed}", TASKS[task][1]]
  if model == "rnn":
    parts.append(args.rnn_arg)
  elif model == "rnn_none":
    parts.append("model.attention=none")
  else:
    parts += [TF_MATCHED[task], args.tf_arg]
  if args.steps:
    parts.append(f"num_train_steps={args.steps}")
  if args.extra:
    parts.append(args.extra)
  arg = ",".join(p for p in parts if p)
  print(f"== {task}/{model}/seed_{seed}: {CONFIGS[model].name}:{arg}", flush=True)
  tool.setup_logging()

  def body() -> None:
    from attnlab import config_utils, train  # pylint: disable=g-import-not-at-top
    train.train_and_evaluate(config_utils.load_config_file(f"{CONFIGS[model]}:{arg}"), workdir)
  return tool.run_tool("run.py", body)  # a failed run: one line and its status, as `train`


def plot_by_length(results: dict, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for model, per_seed in results.items():
    bins = sorted({k for r in per_seed for k in r["final"] if k.startswith("exact_match_len_")})
    mids = [np.mean([int(x) for x in k.rsplit("_", 2)[1:]]) for k in bins]
    values = np.array([[r["final"][k] for k in bins] for r in per_seed])  # [seeds, bins]
    std = values.std(0, ddof=1) if len(values) > 1 else np.zeros(len(bins))  # sample std, seeds
    ax.errorbar(mids, values.mean(0), yerr=std, marker="o", capsize=3, label=model)
  ax.set_xlabel("source length (symbols, bin centre)")
  ax.set_ylabel("exact match")
  ax.set_title("reverse: accuracy against length")
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def heatmaps(run_dir: str, sentence: str | None, out_dir: pathlib.Path) -> None:
  """Cross-attention and encoder self-attention grids (layers x heads) of one sentence pair."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab import plotting  # pylint: disable=g-import-not-at-top
  from attnlab.models import transformer as tf  # pylint: disable=g-import-not-at-top
  run = analysis.load_run(run_dir)
  task = run.task
  if sentence is None:
    sentence = task.examples(task.config.data.eval_split)[0]["source"]
  [t] = task.translate(run.params, [sentence], beam_size=1)
  src = np.array([task.encode_source(sentence)], np.int32)
  out_ids = [task.tgt_tok.token_to_id(tok) for tok in t.output_tokens]
  tgt_in = np.array([[task.tgt_tok.start_id] + out_ids[:-1]], np.int32)
  grids = tf.attention_grids(run.model, run.params, src, np.array([src.shape[1]], np.int32),
                             tgt_in)
  label = lambda tok: "\u2423" if tok == " " else tok
  src_labels = [label(s) for s in t.source_tokens]
  out_labels = [label(s) for s in t.output_tokens]
  out_dir.mkdir(parents=True, exist_ok=True)
  # Devanagari labels (Marathi) need a font that has them.
  family = plotting.font_family(t.text)
  with matplotlib.rc_context({"font.family": family}):
    plotting.attention_grid(grids["cross"][:, 0], x_labels=src_labels, y_labels=out_labels,
                            title=f"cross-attention: {sentence} -> {t.text}",
                            path=out_dir / "cross_attention.png")
    plotting.attention_grid(grids["encoder_self"][:, 0], x_labels=src_labels,
                            y_labels=src_labels, title=f"encoder self-attention: {sentence}",
                            path=out_dir / "encoder_self_attention.png")
  print(f"{sentence!r} -> {t.text!r}; grids in {out_dir}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "rnn_vs_transformer"))
  parser.add_argument("--tasks", default="dates,marathi,reverse")
  parser.add_argument("--seeds", default="0")
  parser.add_argument("--steps", type=int, default=0, help="num_train_steps of every run (0: "
                      "each config's default)")
  parser.add_argument("--rnn_arg", default=DEFAULT_RNN)
  parser.add_argument("--tf_arg", default="")
  parser.add_argument("--extra", default="", help="key=value,... added to every run")
  parser.add_argument("--heatmaps", default="", help="a Transformer run dir: plot its grids")
  parser.add_argument("--sentence", default=None)
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir).absolute()
  if args.heatmaps:
    heatmaps(args.heatmaps, args.sentence, workdir)
    return 0
  tasks = [t for t in args.tasks.split(",") if t]
  unknown = [t for t in tasks if t not in TASKS]
  if unknown:
    print(f"error: unknown tasks {unknown}; valid: {', '.join(TASKS)}", file=sys.stderr)
    return 2
  seeds = [int(s) for s in args.seeds.split(",")]
  lines = ["| task | model | parameters | steps | final | training s | target | "
           "steps to target | s to target |",
           "|---|---|---|---|---|---|---|---|---|"]
  status = 0
  for task in tasks:
    metric = TASKS[task][0]
    models = ["rnn", "transformer"] + (["rnn_none"] if task == "reverse" else [])
    results = {}
    for model in models:
      results[model] = []
      for seed in seeds:
        run_dir = workdir / task / model / f"seed_{seed}"
        code = run_one(task, model, seed, run_dir, args)
        if code == 2:  # a bad config (USAGE_ERROR, its line printed): the next runs would refuse
          # it too, and the summary below would read a run that never started
          return code
        status |= code
        results[model].append(summarise(run_dir, metric))
    finals = {m: sum(r["final"][metric] for r in rs) / len(rs) for m, rs in results.items()
              if m != "rnn_none"}
    target = TARGET_FRACTION * min(finals.values())
    for model in models:
      rs = results[model]
      if len(rs) > 1:
        lines.append(mean_row(task, model, rs, metric, target))
      for seed, r in zip(seeds, rs):
        step, sec = time_to(r["curve"], target)
        lines.append(f"| {task} | {model} (seed {seed}) | {r['params']:,} | {r['steps']} | "
                     f"{metric} {r['final'][metric]:.3f} | {r['seconds']:.0f} | "
                     f"{metric} >= {target:.3f} | {step if step is not None else 'not reached'} | "
                     f"{sec:.0f} |")
    if task == "reverse":
      plot_by_length({{"rnn": "bahdanau", "rnn_none": "no attention"}.get(m, m): rs
                      for m, rs in results.items()}, workdir / "reverse_by_length.png")
  table = "\n".join(lines)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "results.md").write_text(table + "\n")
  print(table)
  return status


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config arg: one line, status 2
