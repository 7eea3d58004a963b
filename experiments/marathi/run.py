"""English -> Marathi with Bahdanau attention (the attention-NMT tutorial's model) on anki_mar_eng.

  ATTNLAB_DATA_DIR=../shared/data python experiments/marathi/run.py [--workdir=runs/marathi] \
      [--seeds=0] [--beam_size=4] [--arg=num_train_steps=4000] [--parallel=1]
  ATTNLAB_DATA_DIR=../shared/data python experiments/marathi/run.py --arms=all \
      [--workdir=runs/marathi_arms] [--seeds=0,1,2] [--steps=4000] [--beam_rows=0] [--vmap]

Without --arms (the seed's study):
1. Trains configs/seq2seq.py:task=marathi (word tokens, pairs of <= 12 words, bidirectional GRU
   encoder, Bahdanau additive attention) for each seed through the sweep runner
   (WORKDIR/seed=N/, resumable; finished members are skipped).
2. Reloads each run and decodes the held-out *test* split: corpus BLEU (sacrebleu over words) and
   exact match, greedy and with beam search.
3. Writes WORKDIR/results.md (metrics + sample translations) and heatmaps of the first seed for a
   handful of test sentences and "Rahul is a good boy" to WORKDIR/figures/.

With --arms=NAME,... (or all; ARMS below, each one change from the baseline `bahdanau`):
1. Trains each arm for the seeds (default 0,1,2) in WORKDIR/<arm>/, one run per seed
   (WORKDIR/<arm>/seed=N/), or with --vmap as one program of `num_seeds` replicas
   (WORKDIR/<arm>/seed=0/ holds seeds 0, 1, 2); `--steps` sets num_train_steps (the cosine
   schedule decays over them).
2. Decodes the test split per seed, greedy over all of it and with beam search (--beam_size) over
   all of it or over a fixed sample of --beam_rows sentences (seeded, the same for every arm and
   seed; greedy is then scored on that sample too, beside the whole split).
3. Caches each seed's metrics in WORKDIR/<arm>/result.json and its decoded test outputs in
   WORKDIR/<arm>/decoded_seed=N.json, so that a re-invocation trains and decodes only what is
   missing (a finished member is skipped by the sweep runner, a decoded seed by the cache).
4. Writes WORKDIR/results.md (per arm mean ± std over seeds, then per seed), WORKDIR/results.json
   and WORKDIR/arms.png (test BLEU per arm, each seed a point, greedy and beam) after every arm;
   --report_only rewrites them from the cache without training or decoding anything.
Every arm runs on one JAX device (ARMS_BASE). --vmap stalled at the initial state at this model's
sizes on the study's machine (README), so one run per seed is the default.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

CONFIG = REPO / "configs" / "seq2seq.py"
EXTRA_SENTENCES = ("Rahul is a good boy.",)
NUM_HEATMAPS = 5

# Arm name -> (what it changes from the baseline, its configs/seq2seq.py keys). In run order.
ARMS = {
    "bahdanau": ("baseline: bi-GRU encoder, GRU decoder, Bahdanau attention, additive score", ""),
    "none": ("no attention: the final encoder state is the decoder's only view of the source",
             "attention=none"),
    "luong": ("Luong attention (after the cell step, attentional state, input feeding); the "
              "additive score kept", "attention=luong"),
    "lstm": ("LSTM cells in encoder and decoder", "model.cell=lstm"),
    "unidirectional": ("the encoder reads left to right only", "model.bidirectional=False"),
    "gnmt": ("GNMT's stack (preset=gnmt) at 4 LSTM layers: bottom encoder layer bidirectional, "
             "residuals from layer 3, attention queried by the bottom decoder layer and fed up",
             "preset=gnmt,model.num_layers=4"),
}
BASELINE = "bahdanau"
# Keys of every arm besides task=marathi: one JAX device. On a 2-core machine shared with other
# jobs, the two-device split's all-reduce rendezvous stalls or times out (experiments/benchmarks
# README); the replicas are the batch dimension that keeps the cores busy instead.
ARMS_BASE = "mesh.cpu_devices=1"
RESULT_FILE = "result.json"
# Seed of the fixed sample of test sentences that beam search decodes with --beam_rows > 0.
BEAM_SAMPLE_SEED = 0


# ------------------------------------------------------------------------------- seed's study


def single(args: argparse.Namespace) -> int:
  """The study without arms: one config, its seeds, test decoding, heatmaps."""
  workdir = pathlib.Path(args.workdir or REPO / "runs" / "marathi").absolute()
  seeds = args.seeds or "0"
  spec = f"{CONFIG}:task=marathi" + (f",{args.arg}" if args.arg else "")

  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  tool.setup_logging()  # the members' progress on stderr
  start = time.time()
  status = sweep.run(spec, seeds=seeds, workdir=workdir, parallel=args.parallel).report(
      "run.py")
  print(f"sweep finished in {time.time() - start:.0f} s (status {status})")

  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  rows, samples = [], []
  for n, seed in enumerate(seeds.split(",")):
    member = workdir / f"seed={seed}"
    run = analysis.load_run(member)
    greedy, records = run.task.evaluate_split(run.params, "test", beam_size=1)
    beam, _ = run.task.evaluate_split(run.params, "test", beam_size=args.beam_size)
    rows.append(f"| {seed} | {run.step} | {len(records)} | {greedy['ce']:.3f} | "
                f"{greedy['bleu']:.2f} | {beam['bleu']:.2f} | {greedy['exact_match']:.3f} | "
                f"{beam['exact_match']:.3f} |")
    print(rows[-1])
    if n:
      continue
    short = [r for r in records if len(r["source"].split()) <= 8][:NUM_HEATMAPS]
    sentences = [r["source"] for r in short] + list(EXTRA_SENTENCES)
    for i, t in enumerate(run.task.translate(run.params, sentences, beam_size=args.beam_size)):
      plt.close(run.task.plot_alignment(t, workdir / "figures" / f"marathi_{i}.png"))
      reference = short[i]["reference"] if i < len(short) else ""
      samples.append(f"| {t.source} | {reference} | {t.text} |")
  table = "\n".join([
      f"Config: `configs/seq2seq.py:task=marathi{',' + args.arg if args.arg else ''}`; "
      f"test split of anki_mar_eng (pairs of <= 12 words).",
      "",
      f"| seed | steps | test pairs | test CE | BLEU greedy | BLEU beam {args.beam_size} | "
      f"exact match greedy | exact match beam |",
      "|---|---|---|---|---|---|---|---|",
      *rows,
      "",
      f"Sample translations (seed {seeds.split(',')[0]}, beam {args.beam_size}):",
      "",
      "| English | reference | model |",
      "|---|---|---|",
      *samples,
  ])
  (workdir / "results.md").write_text(table + "\n")
  print(table)
  return status


# ------------------------------------------------------------------------------- arms


def arm_spec(arm: str, steps: int, extra: str) -> str:
  """The config spec of one arm: the baseline's keys, the arm's change, --steps, --arg."""
  keys = ["task=marathi", ARMS_BASE, ARMS[arm][1]]
  if steps:
    keys.append(f"num_train_steps={steps}")
  keys.append(extra)
  return f"{CONFIG}:" + ",".join(k for k in keys if k)


def parse_arms(text: str) -> list[str]:
  from attnlab.errors import UserError  # pylint: disable=g-import-not-at-top
  names = list(ARMS) if text.strip() == "all" else [a.strip() for a in text.split(",") if a.strip()]
  unknown = [a for a in names if a not in ARMS]
  if unknown or not names:
    raise UserError(f"unknown arm(s) {', '.join(unknown) or '(none given)'}; valid arms: "
                    f"{', '.join(ARMS)} (or all)")
  return names


def parse_seeds(text: str, vmap: bool) -> list[int]:
  from attnlab.errors import UserError  # pylint: disable=g-import-not-at-top
  try:
    seeds = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    seeds = []
  if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise UserError(f"--seeds={text!r} must be distinct ints >= 0, e.g. --seeds=0,1,2")
  if vmap and seeds != list(range(seeds[0], seeds[0] + len(seeds))):
    raise UserError(f"--seeds={text!r}: a vmapped run trains consecutive seeds (seed, seed+1, "
                    f"...); give e.g. --seeds=0,1,2 or add --no-vmap")
  return seeds


def write_json(path: pathlib.Path, value) -> None:
  """`value` as JSON, written whole (a temporary file renamed) so an interrupt leaves no half."""
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


def members_of(arm_dir: pathlib.Path, seeds: list[int], vmap: bool
               ) -> list[tuple[int, pathlib.Path, int | None]]:
  """(seed, run directory, replica index or None) of each seed of an arm."""
  if vmap:
    return [(s, arm_dir / f"seed={seeds[0]}", i) for i, s in enumerate(seeds)]
  return [(s, arm_dir / f"seed={s}", None) for s in seeds]


def train_speed(member: pathlib.Path) -> tuple[float, int]:
  """(steps/s of training, steps) from the run's train log records after the first (whose
  interval holds the compile); evaluations are not in them (the trainer restarts its clock)."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  train = [r for r in rundir.read_metrics(member) if r["split"] == "train"
           and r.get("steps_per_sec")]
  steps = [b["step"] - a["step"] for a, b in zip(train, train[1:])]
  seconds = [n / b["steps_per_sec"] for n, b in zip(steps, train[1:])]
  last = train[-1]["step"] if train else 0
  return (sum(steps) / sum(seconds) if sum(seconds) > 0 else float("nan")), last


def validation_bleu(member: pathlib.Path, replica: int | None) -> dict[str, float]:
  """{step: validation BLEU} of one seed from the run's eval records."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  out = {}
  for r in rundir.read_metrics(member):
    if r["split"] == "eval" and "bleu" in r:
      value = r["bleu"] if replica is None else r["per_seed"]["bleu"][replica]
      out[str(r["step"])] = float(value)
  return out


def corpus_bleu(records: list[dict], tokenize: str) -> float:
  import sacrebleu  # pylint: disable=g-import-not-at-top
  return float(sacrebleu.corpus_bleu([r["bleu_hyp"] for r in records],
                                     [[r["bleu_ref"] for r in records]], tokenize=tokenize,
                                     force=True).score)


def decode_seed(run, params, beam_size: int, beam_rows: list[int] | None) -> tuple[dict, dict]:
  """(metrics, decoded outputs) of one seed's parameters on the test split."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  task = run.task
  start = time.time()
  greedy, records = task.evaluate_split(params, "test", beam_size=1)
  greedy_s = time.time() - start
  tokenize = task.bleu_tokenize([r["bleu_ref"] for r in records])
  start = time.time()
  beam, beam_records = task.evaluate_split(params, "test", beam_size=beam_size, rows=beam_rows)
  beam_s = time.time() - start
  metrics = {
      "test_ce": greedy["ce"], "test_pairs": len(records),
      "bleu_greedy": greedy["bleu"], "exact_greedy": greedy["exact_match"],
      "bleu_beam": beam["bleu"], "exact_beam": beam["exact_match"],
      "beam_pairs": len(beam_records), "bleu_tokenize": tokenize,
      "greedy_decode_s": greedy_s, "beam_decode_s": beam_s,
  }
  if beam_rows is not None:  # greedy on the beam's sample, to compare like with like
    sample = [records[i] for i in beam_rows]
    metrics["bleu_greedy_sample"] = corpus_bleu(sample, tokenize)
    metrics["exact_greedy_sample"] = float(np.mean([r["exact"] for r in sample]))
  decoded = {
      "greedy": {"hyp": [r["bleu_hyp"] for r in records],
                 "ref": [r["bleu_ref"] for r in records]},
      "beam": {"hyp": [r["bleu_hyp"] for r in beam_records],
               "ref": [r["bleu_ref"] for r in beam_records],
               "rows": beam_rows},
      "bleu_tokenize": tokenize,
  }
  return metrics, decoded


def run_arm(arm: str, args: argparse.Namespace, workdir: pathlib.Path, seeds: list[int]) -> dict:
  """Trains (or skips) one arm, decodes its seeds not yet cached; returns its result.json."""
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top
  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  arm_dir = workdir / arm
  arm_dir.mkdir(parents=True, exist_ok=True)
  spec = arm_spec(arm, args.steps, args.arg)
  saved = arm_dir / RESULT_FILE
  result = json.loads(saved.read_text()) if saved.is_file() else {}
  setting = {"spec": spec.split(":", 1)[1], "seeds": seeds, "vmap": args.vmap}
  decoding = {"beam_size": args.beam_size, "beam_rows": args.beam_rows}
  if result.get("setting") != setting:  # other runs: nothing cached applies
    result = {"arm": arm, "change": ARMS[arm][0], "setting": setting}
  if result.get("decoding") != decoding:  # the same runs decoded otherwise: decode again
    result.update(decoding=decoding, per_seed={})

  members = members_of(arm_dir, seeds, args.vmap)
  start = time.time()
  print(f"[{time.strftime('%H:%M:%S')}] arm {arm}: training {spec.split(':', 1)[1]}", flush=True)
  if args.vmap:
    sweep_result = sweep.run(spec, seeds=[seeds[0]], num_seeds=len(seeds), workdir=arm_dir)
  else:
    sweep_result = sweep.run(spec, seeds=seeds, workdir=arm_dir)
  status = sweep_result.report("run.py", summary=False)
  trained = [m.name for m in sweep_result.members if m.status == "done"]
  if trained:  # this invocation trained (or finished) them: its wall time
    result["train_wall_s"] = result.get("train_wall_s", 0.0) + (time.time() - start)
    result.setdefault("trained_in", []).append(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
  if status:
    result["status"] = "failed: " + "; ".join(m.error for m in sweep_result.failed)
    write_json(saved, result)
    return result

  speeds = {}
  for directory in sorted({m[1] for m in members}):
    speeds[directory.name] = train_speed(directory)
  result["steps_per_sec"] = {name: s for name, (s, _) in speeds.items()}
  result["steps"] = max(n for _, n in speeds.values())

  beam_rows = None
  loaded = {}
  for seed, directory, replica in members:
    if str(seed) in result["per_seed"]:
      continue
    if directory not in loaded:
      loaded[directory] = analysis.load_run(directory, replica=None)
    run = loaded[directory]
    params = run.params if replica is None else state_lib.replica(run.params, replica)
    if args.beam_rows and beam_rows is None:
      beam_rows = beam_sample(len(run.task.examples("test")), args.beam_rows)
    print(f"[{time.strftime('%H:%M:%S')}] arm {arm} seed {seed}: decoding the test split",
          flush=True)
    metrics, decoded = decode_seed(run, params, args.beam_size, beam_rows)
    metrics["validation_bleu"] = validation_bleu(directory, replica)
    metrics["step"] = run.step
    write_json(arm_dir / f"decoded_seed={seed}.json", decoded)
    result["per_seed"][str(seed)] = metrics
    write_json(saved, result)  # after each seed: an interrupt loses at most one decode
    print(f"  BLEU greedy {metrics['bleu_greedy']:.2f}, beam {metrics['bleu_beam']:.2f} "
          f"({metrics['greedy_decode_s']:.0f} s + {metrics['beam_decode_s']:.0f} s)", flush=True)
  result["status"] = "done"
  result["wall_s_this_call"] = time.time() - start
  write_json(saved, result)
  return result


def beam_sample(num_examples: int, size: int) -> list[int]:
  """The fixed, seeded sample of test rows beam search decodes (sorted; all if size >= n)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if size >= num_examples:
    return list(range(num_examples))
  rng = np.random.default_rng(BEAM_SAMPLE_SEED)
  return sorted(int(i) for i in rng.choice(num_examples, size, replace=False))


def mean_std(values: list[float]) -> tuple[float, float]:
  """Mean and sample std (ddof=1; NaN for one value), as the sweep summary gives them."""
  n = len(values)
  mean = sum(values) / n
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
  return mean, std


def fmt(values: list[float], digits: int) -> str:
  if not values:
    return "-"
  mean, std = mean_std(values)
  return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if not math.isnan(std) else "")


def tables(results: dict[str, dict], args: argparse.Namespace, seeds: list[int]) -> str:
  """results.md: one row per arm (mean ± std over its seeds), then one row per seed."""
  beam = f"beam {args.beam_size}"
  sample = args.beam_rows
  beam_what = f"{beam}, {sample} sampled pairs" if sample else beam
  how = f"one vmapped run of {len(seeds)} replicas" if args.vmap else "one run per seed"
  columns = ["arm", "seeds", "steps", "test CE", "BLEU greedy", f"BLEU {beam_what}",
             *(["BLEU greedy, same sample"] if sample else []), "exact match greedy",
             f"exact match {beam}", "steps/s", "train wall (s)", "test decode wall (s)"]
  rows, per_seed_rows = [], []
  for arm, result in results.items():
    per = [result["per_seed"][str(s)] for s in seeds if str(s) in result.get("per_seed", {})]
    if not per:
      cells = [arm, "0", result.get("status", "pending")] + ["-"] * (len(columns) - 3)
      rows.append("| " + " | ".join(cells) + " |")
      continue
    col = lambda key, per=per: [p[key] for p in per]
    speed = ", ".join(f"{s:.2f}" for s in result.get("steps_per_sec", {}).values()) or "-"
    wall = f"{result['train_wall_s']:.0f}" if "train_wall_s" in result else "-"
    decode = sum(p["greedy_decode_s"] + p["beam_decode_s"] for p in per)
    cells = [arm, str(len(per)), str(per[0]["step"]), fmt(col("test_ce"), 3),
             fmt(col("bleu_greedy"), 2), fmt(col("bleu_beam"), 2),
             *([fmt(col("bleu_greedy_sample"), 2)] if sample else []),
             fmt(col("exact_greedy"), 3), fmt(col("exact_beam"), 3), speed, wall, f"{decode:.0f}"]
    rows.append("| " + " | ".join(cells) + " |")
    for seed in seeds:
      p = result["per_seed"].get(str(seed))
      if p is None:
        continue
      curve = ", ".join(f"{step}: {b:.1f}" for step, b in p["validation_bleu"].items())
      per_seed_rows.append(
          f"| {arm} | {seed} | {p['step']} | {p['test_ce']:.3f} | {p['bleu_greedy']:.2f} | "
          f"{p['bleu_beam']:.2f} | {p['exact_greedy']:.3f} | {p['exact_beam']:.3f} | {curve} |")
  return "\n".join([
      f"Arms of `{arm_spec(BASELINE, args.steps, args.arg).split(':', 1)[1]}`, each one change "
      f"from `{BASELINE}`; seeds {','.join(map(str, seeds))} ({how}); test split of "
      f"anki_mar_eng. Mean ± sample std (ddof=1) over the seeds.",
      "",
      "| " + " | ".join(columns) + " |",
      "|" + "---|" * len(columns),
      *rows,
      "",
      "Per seed (validation BLEU: greedy, the whole validation split, at the trainer's "
      "evaluations):",
      "",
      f"| arm | seed | step | test CE | BLEU greedy | BLEU {beam_what} | exact match greedy | "
      f"exact match {beam} | validation BLEU by step |",
      "|---|---|---|---|---|---|---|---|---|",
      *per_seed_rows,
  ]) + "\n"


def plot(results: dict[str, dict], seeds: list[int], path: pathlib.Path, beam_label: str) -> None:
  """Test BLEU per arm: a bar for the mean (std as error bar), each seed a point; greedy, beam."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  arms = [a for a, r in results.items() if r.get("per_seed")]
  fig, ax = plt.subplots(figsize=(1.3 * max(len(arms), 4) + 1.5, 4))
  width = 0.38
  for k, (key, label, color) in enumerate((("bleu_greedy", "greedy", "tab:blue"),
                                           ("bleu_beam", beam_label, "tab:orange"))):
    for i, arm in enumerate(arms):
      values = [results[arm]["per_seed"][str(s)][key] for s in seeds
                if str(s) in results[arm]["per_seed"]]
      x = i + (k - 0.5) * width
      mean, std = mean_std(values)
      ax.bar(x, mean, width * 0.9, color=color, alpha=0.35, label=label if i == 0 else None,
             yerr=None if math.isnan(std) else std, capsize=3)
      jitter = np.linspace(-width * 0.25, width * 0.25, len(values)) if len(values) > 1 else [0]
      ax.scatter(x + np.asarray(jitter), values, color=color, s=16, zorder=3)
  ax.set_xticks(range(len(arms)), arms)
  ax.set_ylabel("test BLEU")
  ax.set_title("English -> Marathi, test BLEU per arm\n(bars: mean ± std over seeds; points: "
               "seeds)", fontsize=10)
  ax.legend(loc="lower right")
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
  except OSError:
    return ""


def log_uptime(workdir: pathlib.Path, when: str) -> None:
  """Prints `uptime` (the machine's load) and appends it to WORKDIR/uptime.txt."""
  line = f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} {when}: {uptime()}"
  print(line, flush=True)
  with open(workdir / "uptime.txt", "a") as f:
    f.write(line + "\n")


def arms(args: argparse.Namespace) -> int:
  """The arms study (module docstring, "With --arms")."""
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  from attnlab.errors import UserError  # pylint: disable=g-import-not-at-top
  names = parse_arms(args.arms)
  seeds = parse_seeds(args.seeds or "0,1,2", args.vmap)
  if args.steps < 0 or args.beam_rows < 0 or args.beam_size < 1:
    raise UserError("--steps and --beam_rows must be >= 0 and --beam_size >= 1")
  for arm in names:  # every arm's config checked before anything trains
    config_utils.load_config_file(arm_spec(arm, args.steps, args.arg))
  workdir = pathlib.Path(args.workdir or REPO / "runs" / "marathi_arms").absolute()
  if args.report_only:  # the table and figure of what is cached, nothing trained or decoded
    results = {}
    for arm in names:
      saved = workdir / arm / RESULT_FILE
      result = json.loads(saved.read_text()) if saved.is_file() else {"status": "pending"}
      spec = arm_spec(arm, args.steps, args.arg).split(":", 1)[1]
      if result.get("setting", {}).get("spec", spec) != spec:
        result = {"status": "pending (cached runs have another config)"}
      results[arm] = result
    report(results, args, seeds, workdir)
    print((workdir / "results.md").read_text())
    return 0
  workdir.mkdir(parents=True, exist_ok=True)
  tool.setup_logging()
  log_uptime(workdir, "before")
  status, results = 0, {arm: {"status": "pending"} for arm in names}
  for arm in names:
    results[arm] = run_arm(arm, args, workdir, seeds)
    status = status or int(results[arm]["status"] != "done")
    # The table and figure after every arm: a long study shows what is done so far.
    report(results, args, seeds, workdir)
  log_uptime(workdir, "after")
  print((workdir / "results.md").read_text())
  return status


def report(results: dict[str, dict], args: argparse.Namespace, seeds: list[int],
           workdir: pathlib.Path) -> None:
  write_json(workdir / "results.json", {"seeds": seeds, "arms": results})
  (workdir / "results.md").write_text(tables(results, args, seeds))
  plot(results, seeds, workdir / "arms.png", f"beam {args.beam_size}"
       + (f" ({args.beam_rows} pairs)" if args.beam_rows else ""))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="",
                      help="default runs/marathi, with --arms runs/marathi_arms")
  parser.add_argument("--seeds", default="", help="default 0, with --arms 0,1,2")
  parser.add_argument("--beam_size", type=int, default=4)
  parser.add_argument("--parallel", type=int, default=1)
  parser.add_argument("--arg", default="", help="extra key=value,... for configs/seq2seq.py")
  parser.add_argument("--arms", default="",
                      help=f"arms to run, in this order: {','.join(ARMS)} or all")
  parser.add_argument("--steps", type=int, default=0,
                      help="--arms: num_train_steps of every arm (0: the config's 4000)")
  parser.add_argument("--beam_rows", type=int, default=0,
                      help="--arms: beam-decode a fixed sample of this many test pairs (0: all)")
  parser.add_argument("--vmap", action=argparse.BooleanOptionalAction, default=False,
                      help="--arms: train an arm's seeds as one vmapped run (num_seeds)")
  parser.add_argument("--report_only", action="store_true",
                      help="--arms: rewrite the table and figure from the cached results only")
  args = parser.parse_args(argv)
  return arms(args) if args.arms else single(args)


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config or axis: one line, status 2
