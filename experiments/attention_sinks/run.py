"""The attention-sink study (issue #52): does the first-token sink emerge in the nano GPT, and do
other normalisers remove it at equal validation loss?

  PYTHONPATH=$PWD python experiments/attention_sinks/run.py     # runs/attention_sinks, 400 steps
  PYTHONPATH=$PWD python experiments/attention_sinks/run.py --arms=softmax --steps=1000 \
      --workdir=runs/attention_sinks_long
  PYTHONPATH=$PWD python experiments/attention_sinks/run.py --runlocal --workdir=/tmp/sinks

One arm per normaliser (`model.attention.normalizer`: softmax, softmax_sink, sigmoid, sparsemax),
each one run of configs/gpt.py (nano: 4 layers, 4 heads, 128 dims, block 64, rotary, Tiny
Shakespeare) with `num_seeds` vmapped seeds (default 3: seeds 0, 1, 2), trained in WORKDIR/<arm>/
with a checkpoint every `steps / checkpoints` steps, all of them kept, and one evaluation, after
the last step (on `--eval_windows` validation windows: periodic evaluations of three seeds cost
more than the training on a shared 2-core CPU).
At step 0 (the seeds' initial parameters, recomputed from their keys) and at every kept checkpoint,
each seed's sink metrics (attnlab.analysis.sinks.sink_metrics; its docstring defines them) are
measured on two inputs:
  text    `--windows` windows of block_size characters of the validation text (the last 10% of
          Tiny Shakespeare), evenly spaced over it: the first token of a window is whatever
          character it starts on;
  random  as many rows of uniform random token ids (fixed seed): no language at all.
Per step and seed WORKDIR/<arm>/sinks.json keeps: the trainer's validation loss (metrics.jsonl;
the last step only), the next-token loss on the text windows (every step: the curve over
training), and per view first_token, share, row_sum ([layers, heads]), sink_mass (softmax_sink)
and the sink rate (Gu et al. 2024: the fraction of heads whose mean first-token weight exceeds
0.3). One forward pass per seed and view gives the patterns and the logits.
WORKDIR/results.json holds these per arm and step as mean and std over the seeds (the mean over
heads, per layer, the largest head), the wall time and load average of each arm;
results.md the tables, results.png the curves over training.

Resumable: a finished run is skipped (an interrupted one resumes from its last checkpoint), and a
measured step is not measured again while the measurement settings are unchanged. One line per arm
goes to stdout, then the final table.
Data: Tiny Shakespeare from --data_dir (default ../shared/data), else $ATTNLAB_DATA_DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]

ARMS = ("softmax", "softmax_sink", "sigmoid", "sparsemax")
VIEWS = ("text", "random")
# Seed of the random-token rows (the same rows for every arm, seed and step).
RANDOM_TOKENS_SEED = 1234


def _load(spec: str):
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  config = config_utils.load_config_file(spec)
  config_utils.validate(config)
  return config


def arm_spec(arm: str, args) -> str:
  """The configs/gpt.py spec of one arm."""
  local = ",runlocal=True" if args.runlocal else ""
  every = max(1, args.steps // args.checkpoints)
  keys = [f"size={'tiny' if args.runlocal else 'nano'}{local}",
          f"model.attention.normalizer={arm}", f"num_seeds={args.seeds}",
          f"num_train_steps={args.steps}", f"checkpoint_every={every}", "eval_every=0",
          f"data.eval_windows={args.eval_windows}", f"keep_checkpoints={args.checkpoints + 2}",
          "write_plots=False", f"mesh.cpu_devices={args.cpu_devices}"]
  if args.data_dir:
    keys.append(f"data.manual_dir={args.data_dir}")
  if args.arg.strip(","):
    keys.append(args.arg.strip(","))
  return f"{REPO / 'configs' / 'gpt.py'}:" + ",".join(keys)


def uniform_first_token(length: int) -> float:
  """The mean first-token weight of uniform causal attention over `length` tokens, queries
  1 .. length-1 (row q spreads 1 / (q + 1) over its q + 1 keys): the no-sink reference."""
  return float(np.mean([1.0 / (q + 1) for q in range(1, length)]))


def text_windows(ids, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, next-token targets) `[count, length]` of `count` windows evenly spaced over `ids`."""
  ids = np.asarray(ids)
  starts = np.linspace(0, len(ids) - length - 1, count).astype(np.int64)
  pos = starts[:, None] + np.arange(length)[None, :]
  return ids[pos], ids[pos + 1]


def random_rows(vocab_size: int, length: int, count: int) -> np.ndarray:
  return np.random.default_rng(RANDOM_TOKENS_SEED).integers(0, vocab_size, (count, length))


def eval_losses(run_dir: pathlib.Path) -> dict[int, list[float]]:
  """step -> per-seed validation loss of the trainer (the last evaluation record of the step)."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  out = {}
  for r in rundir.read_metrics(run_dir):
    if r["split"] == "eval":
      out[r["step"]] = [float(x) for x in r["per_seed"]["loss"]] if "per_seed" in r else [
          float(r["loss"])]
  return out


def initial_params(task, config):
  """The replicas' step-0 parameters `[seeds, ...]`, from the keys the trainer draws them with."""
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top
  init_keys, _ = state_lib.replica_keys(config)
  if state_lib.num_seeds_of(config) == 1:
    return jax.tree.map(lambda x: x[None], task.init(init_keys))
  return jax.vmap(task.init)(init_keys)


def view_metrics(cache: dict, names: list[str], normalizer: str) -> dict:
  """The sink metrics of one forward pass's patterns (what sinks.sink_metrics computes from the
  same cache; here the pass also gives the logits of the loss)."""
  from attnlab.analysis import sinks  # pylint: disable=g-import-not-at-top
  first = np.stack([sinks.first_token_score(cache[n]) for n in names])  # [layers, heads]
  share = np.stack([sinks.first_token_score(cache[n], share=True) for n in names])
  sums = np.stack([sinks.row_sums(cache[n]) for n in names])
  return {"first_token": first.tolist(), "share": share.tolist(), "row_sum": sums.tolist(),
          "sink_mass": (1.0 - sums).tolist() if normalizer == "softmax_sink" else None,
          "rate": sinks.sink_rate(first)}


def next_token_loss(logits, targets) -> float:
  """Mean cross-entropy of `logits` `[batch, len, vocab]` against `targets` `[batch, len]`."""
  logits = np.asarray(logits, np.float64)
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  return float((log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean())


def measure(run_dir: pathlib.Path, settings: dict) -> dict:
  """{"settings", "steps": {step: [per seed {...}]}} of the run in `run_dir` (sinks.json there),
  measuring only the steps not in it yet."""
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab import checkpoint  # pylint: disable=g-import-not-at-top
  from attnlab.analysis import hooks  # pylint: disable=g-import-not-at-top
  path = run_dir / "sinks.json"
  done = json.loads(path.read_text()) if path.is_file() else {}
  if done.get("settings") != settings:
    done = {"settings": settings, "steps": {}}
  todo = [s for s in [0] + checkpoint.finished_steps(run_dir) if str(s) not in done["steps"]]
  if not todo:
    return done
  latest = analysis.load_run(run_dir, replica=None)
  model, task, config = latest.model, latest.task, latest.config
  done["block_size"] = model.block_size
  num_seeds = jax.tree.leaves(latest.params)[0].shape[0] if config.num_seeds > 1 else 1
  x, y = text_windows(task.validation_ids(), model.block_size, settings["windows"])
  views = {"text": x, "random": random_rows(model.vocab_size, model.block_size,
                                            settings["windows"])}
  losses = eval_losses(run_dir)
  names = [f"blocks.{l}.attn.pattern" for l in range(model.num_layers)]
  for step in todo:
    if step == 0:
      params = initial_params(task, config)
    elif step == latest.step:
      params = latest.params
    else:
      params = analysis.load_run(run_dir, step=step, replica=None).params
    if num_seeds == 1 and step != 0:
      params = jax.tree.map(lambda a: a[None], params)
    seeds = []
    for i in range(num_seeds):
      run = (model, jax.tree.map(lambda a, i=i: a[i], params))
      entry = {"eval_loss": losses[step][i] if step in losses else None}
      for view, tokens in views.items():
        logits, cache = hooks.run_with_cache(run, tokens, names)
        entry[view] = view_metrics(cache, names, model.attention.normalizer)
        if view == "text":
          entry["window_loss"] = next_token_loss(logits, y)
      seeds.append(entry)
    done["steps"][str(step)] = seeds
    path.write_text(json.dumps(done) + "\n")  # a measured step survives an interruption
  done["steps"] = dict(sorted(done["steps"].items(), key=lambda kv: int(kv[0])))
  path.write_text(json.dumps(done) + "\n")
  return done


def _ms(values) -> list[float]:
  """[mean, std] (sample std; nan for one value) of a list of numbers."""
  v = np.asarray([np.nan if x is None else x for x in values], np.float64)
  return [float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else math.nan]


def summarize(measured: dict) -> dict:
  """Per step: mean and std over the seeds of each summary number (module docstring)."""
  out = {}
  for step, seeds in measured["steps"].items():
    row = {"eval_loss": _ms([s["eval_loss"] for s in seeds]),
           "window_loss": _ms([s["window_loss"] for s in seeds])}
    for view in VIEWS:
      first = [np.asarray(s[view]["first_token"]) for s in seeds]  # [layers, heads] each
      row[view] = {
          "rate": _ms([s[view]["rate"] for s in seeds]),
          "first_token_mean": _ms([f.mean() for f in first]),
          "first_token_max": _ms([f.max() for f in first]),
          "first_token_layers": [_ms([f[l].mean() for f in first])
                                 for l in range(first[0].shape[0])],
          "share_mean": _ms([np.mean(s[view]["share"]) for s in seeds]),
          "row_sum_mean": _ms([np.mean(s[view]["row_sum"]) for s in seeds]),
      }
      if seeds[0][view]["sink_mass"] is not None:
        mass = [np.asarray(s[view]["sink_mass"]) for s in seeds]
        row[view]["sink_mass_mean"] = _ms([m.mean() for m in mass])
        row[view]["sink_mass_max"] = _ms([m.max() for m in mass])
    out[step] = row
  return out


def _f(ms, digits: int = 3) -> str:
  if ms is None or math.isnan(ms[0]):
    return "-"
  return f"{ms[0]:.{digits}f}" + ("" if math.isnan(ms[1]) else f" ± {ms[1]:.{digits}f}")


def markdown(results: dict) -> str:
  arms = results["arms"]
  seeds = results["num_seeds"]
  lines = [f"Spec (per arm, `model.attention.normalizer=ARM`): `{results['spec']}`; {seeds} "
           f"seeds, mean ± std over them. Validation loss: the trainer's evaluation after the "
           f"last step. Metrics on {results['settings']['windows']} text windows / random rows. "
           f"Uniform causal attention would give a mean first-token weight of "
           f"{results['uniform_first_token']:.3f} over {results['block_size']} tokens.", ""]
  for view, what in (("text", "validation text"), ("random", "random tokens")):
    lines += [f"### Final step, {what}", "",
              "| arm | steps | validation loss | sink rate (> 0.3) | mean first-token weight | "
              "max head first-token weight | mean sink mass | max head sink mass |",
              "|---|---|---|---|---|---|---|---|"]
    for arm, r in arms.items():
      last = r["summary"][str(r["final_step"])]
      v = last[view]
      lines.append(f"| {arm} | {r['final_step']} | {_f(last['eval_loss'], 4)} | {_f(v['rate'], 2)}"
                   f" | {_f(v['first_token_mean'])} | {_f(v['first_token_max'])} | "
                   f"{_f(v.get('sink_mass_mean'))} | {_f(v.get('sink_mass_max'))} |")
    lines.append("")
  lines += ["### Over training, validation text (loss: on the measured text windows; first-token "
            "weight per layer: mean over the layer's heads, layers 0 / 1 / ...)", "",
            "| arm | step | text-window loss | sink rate | mean first-token | per layer | "
            "max head | sink mass |", "|---|---|---|---|---|---|---|---|"]
  for arm, r in arms.items():
    for step, row in r["summary"].items():
      v = row["text"]
      layers = " / ".join(f"{m:.2f}" for m, _ in v["first_token_layers"])
      lines.append(f"| {arm} | {step} | {_f(row['window_loss'])} | {_f(v['rate'], 2)} | "
                   f"{_f(v['first_token_mean'])} | {layers} | {_f(v['first_token_max'])} | "
                   f"{_f(v.get('sink_mass_mean'))} |")
  return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
  """Sink metrics over training per arm (mean ± std over the seeds as a band)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(13.0, 7.0))
  FigureCanvasAgg(fig)
  axes = fig.subplots(2, 3).ravel()
  panels = [("mean first-token weight", "first_token_mean"),
            ("max head first-token weight", "first_token_max"),
            ("sink rate (heads over 0.3)", "rate"),
            ("sink mass (softmax_sink; mean over heads)", "sink_mass_mean"),
            ("loss on the text windows", None)]
  colors = dict(zip(ARMS, ("C0", "C1", "C2", "C3")))
  for ax, (title, key) in zip(axes, panels):
    for arm, r in results["arms"].items():
      steps = [int(s) for s in r["summary"]]
      for view, style in (("text", "-"), ("random", ":")) if key else (("loss", "-"),):
        if key is None:
          rows = [row["window_loss"] for row in r["summary"].values()]
        else:
          rows = [row[view].get(key) for row in r["summary"].values()]
        if rows[0] is None:
          continue
        mean = np.array([m for m, _ in rows])
        std = np.nan_to_num(np.array([s for _, s in rows]))
        ax.plot(steps, mean, style, color=colors.get(arm), marker=".",
                label=arm if view != "random" else None)
        ax.fill_between(steps, mean - std, mean + std, color=colors.get(arm), alpha=0.2)
    if key in ("first_token_mean", "first_token_max"):
      ax.axhline(results["uniform_first_token"], color="gray", lw=0.8, ls="--")
      ax.axhline(0.3, color="k", lw=0.5, ls="-.")  # Gu et al.'s threshold
    if key == "rate":
      ax.set_ylim(-0.03, 1.03)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8, title="solid: text, dotted: random", title_fontsize=7)
  # Per layer at the final step (validation text).
  ax = axes[5]
  arms = list(results["arms"])
  width = 0.8 / max(len(arms), 1)
  for j, arm in enumerate(arms):
    r = results["arms"][arm]
    layers = r["summary"][str(r["final_step"])]["text"]["first_token_layers"]
    xs = np.arange(len(layers)) + (j - (len(arms) - 1) / 2) * width
    ax.bar(xs, [m for m, _ in layers], width, yerr=[np.nan_to_num(s) for _, s in layers],
           color=colors.get(arm), label=arm, capsize=2)
  ax.axhline(results["uniform_first_token"], color="gray", lw=0.8, ls="--")
  ax.set_xticks(range(len(layers)), [f"layer {l}" for l in range(len(layers))])
  ax.set_title("first-token weight per layer, final step (text)", fontsize=9)
  ax.grid(alpha=0.3, axis="y")
  fig.suptitle(f"Attention sinks in the nano GPT ({results['num_seeds']} seeds, mean ± std; "
               f"dashed gray: uniform attention)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "attention_sinks"))
  parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated normalisers")
  parser.add_argument("--steps", type=int, default=0,
                      help="training steps per arm (0: 400; 20 with --runlocal)")
  parser.add_argument("--checkpoints", type=int, default=5,
                      help="checkpoints (and evaluations) per run, every steps/checkpoints steps")
  parser.add_argument("--seeds", type=int, default=3, help="vmapped seeds per arm (num_seeds)")
  parser.add_argument("--windows", type=int, default=64,
                      help="text windows (and random rows) the sink metrics average over")
  parser.add_argument("--eval_windows", type=int, default=0,
                      help="validation windows of the trainer's final evaluation (0: 512; 64 with "
                      "--runlocal; -1: every window of the validation text)")
  parser.add_argument("--runlocal", action="store_true",
                      help="seconds-long check: runlocal=True (tiny GPT), 20 steps")
  parser.add_argument("--cpu_devices", type=int, default=1,
                      help="mesh.cpu_devices (-1: one JAX device per core; on a loaded machine "
                      "XLA aborts a step whose all-reduce waits 40 s for the other core's thread)")
  parser.add_argument("--arg", default="", help="extra key=value,... for every arm's config")
  parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data"),
                      help="folder with tinyshakespeare/input.txt ('' = $ATTNLAB_DATA_DIR)")
  args = parser.parse_args(argv)
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  from attnlab.errors import UserError  # pylint: disable=g-import-not-at-top
  tool.setup_logging()
  args.steps = args.steps or (20 if args.runlocal else 400)
  args.eval_windows = args.eval_windows or (64 if args.runlocal else 512)
  args.eval_windows = max(args.eval_windows, 0)  # -1: data.eval_windows=0, all of them
  if args.steps < 1 or args.checkpoints < 1 or args.seeds < 1 or args.windows < 1:
    raise UserError("--steps, --checkpoints, --seeds and --windows must be positive")
  arms = [a for a in args.arms.split(",") if a]
  unknown = [a for a in arms if a not in ARMS]
  if unknown or not arms:
    raise UserError(f"unknown arm(s) {', '.join(unknown) or '(none)'}; valid arms: "
                    f"{', '.join(ARMS)}")
  configs = {arm: _load(arm_spec(arm, args)) for arm in arms}  # every config checked first
  from attnlab import rundir, train  # pylint: disable=g-import-not-at-top
  from attnlab.backends import cpu  # pylint: disable=g-import-not-at-top
  cpu.enable(configs[arms[0]])  # before anything touches a device (the trainer's CPU split)
  workdir = pathlib.Path(args.workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  for arm, config in configs.items():
    train.check_inputs(config, workdir / arm)

  results_path = workdir / "results.json"
  previous = json.loads(results_path.read_text()) if results_path.is_file() else {}
  spec = arm_spec("ARM", args).split(":", 1)[1]
  settings = {"windows": args.windows, "random_seed": RANDOM_TOKENS_SEED}
  # Arms measured with the same settings stay listed (each with the spec it was trained with).
  keep = previous.get("settings") == settings
  results = {"spec": spec, "settings": settings, "num_seeds": args.seeds, "cpus": os.cpu_count(),
             "arms": dict(previous.get("arms", {})) if keep else {}}
  for arm in arms:
    config, run_dir = configs[arm], workdir / arm
    entry = dict(results["arms"].get(arm, {}))
    load = os.getloadavg()[0]
    start = time.time()
    if rundir.is_complete(run_dir, config.num_train_steps):
      status = "skipped"
    else:
      train.train_and_evaluate(config, run_dir)
      status = "trained"
      entry.update(train_s=time.time() - start, load_train_start=load,
                   load_train_end=os.getloadavg()[0])
    start, load = time.time(), os.getloadavg()[0]
    before = (run_dir / "sinks.json").read_text() if (run_dir / "sinks.json").is_file() else None
    measured = measure(run_dir, settings)
    if (run_dir / "sinks.json").read_text() != before:
      entry.update(measure_s=time.time() - start, load_measure_start=load,
                   load_measure_end=os.getloadavg()[0])
    summary = summarize(measured)
    final = max(int(s) for s in summary)
    entry.update(status=status, run_dir=arm, final_step=final, summary=summary,
                 spec=arm_spec(arm, args).split(":", 1)[1])
    results["block_size"] = measured["block_size"]
    results["arms"][arm] = entry
    last = summary[str(final)]
    mass = last["text"].get("sink_mass_mean")
    print(f"{arm}: {status}, step {final}, validation loss {_f(last['eval_loss'], 4)}, sink rate "
          f"{_f(last['text']['rate'], 2)}, mean first-token weight "
          f"{_f(last['text']['first_token_mean'])}"
          + (f", sink mass {_f(mass)}" if mass else ""), flush=True)
    results_path.write_text(json.dumps(results, indent=1) + "\n")  # partial results survive
  results["uniform_first_token"] = uniform_first_token(results["block_size"])
  results["arms"] = {a: results["arms"][a] for a in ARMS if a in results["arms"]}
  results_path.write_text(json.dumps(results, indent=1) + "\n")
  text = markdown(results)
  (workdir / "results.md").write_text(text)
  plot(results, workdir / "results.png")
  print(text)
  return 0


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad arm or config key: one line, status 2
