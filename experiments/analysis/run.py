"""Attention analysis of the project's own trained runs: entropy, rollout, alignment, ablation.

  python experiments/analysis/run.py [--workdir=runs/analysis] [--only=gpt_shakespeare,...]
      [--data_dir=../shared/data] [--train_only] [--arg=key=value,...] [--out=DIR]

Trains (or resumes; finished runs are skipped) one run per entry of RUNS (or of --only; each
analysis below then covers the runs selected), each an ordinary run directory WORKDIR/<name>,
then analyses them with attnlab.analysis and writes into experiments/analysis/ or --out
(figures/ and results.json; the README quotes them):
  - entropy per layer and head of the GPT (Tiny Shakespeare) and BERT (MLM+NSP, then SST-2)
    runs on held-out text, and attention rollout through their layers;
  - argmax alignment accuracy by source length of Bahdanau (GRU, additive score), Luong (GRU,
    general score) and Transformer cross-attention on the synthetic reverse and dates tasks,
    whose gold alignment is known;
  - head ablation heatmaps (change of the task metric with each head zeroed);
  - self-contained HTML attention views of one input per run (figures/*.html).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import matplotlib.pyplot as plt
import numpy as np

from attnlab import analysis
from attnlab import plotting  # pylint: disable=unused-import  (selects the Agg backend)
from attnlab.analysis import view as view_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
OUT = pathlib.Path(__file__).resolve().parent

# name -> (config file, config arg). Sizes and step counts are the families' defaults except
# where noted; the Transformers use the parameter-matched sizes of experiments/rnn_vs_transformer.
RUNS = {
    "gpt_shakespeare": ("gpt.py", "size=nano"),
    # 3000 pretraining steps (the BERT study's default is 6000) to keep this study under an hour.
    "bert_pretrain": ("bert.py", "mode=pretrain,size=tiny,num_train_steps=3000"),
    "bert_sst2": ("bert.py", "mode=finetune,size=tiny,num_train_steps=1000"),
    "reverse_bahdanau": ("seq2seq.py", "task=reverse,model.attention=bahdanau,"
                                       "model.score=additive"),
    "reverse_luong": ("seq2seq.py", "task=reverse,model.attention=luong,model.score=general"),
    "reverse_transformer": ("transformer.py", "task=reverse,model.d_model=36,model.mlp_dim=72,"
                                              "data.max_len=30,"
                                              "data.length_bins=(5,10,15,20,25,30)"),
    "dates_bahdanau": ("seq2seq.py", "task=dates,model.attention=bahdanau,model.score=additive"),
    "dates_luong": ("seq2seq.py", "task=dates,model.attention=luong,model.score=general"),
    "dates_transformer": ("transformer.py", "task=dates,model.d_model=56,model.mlp_dim=96"),
}


def _figures(args: argparse.Namespace) -> pathlib.Path:
  return pathlib.Path(args.out) / "figures"


def train_runs(names: list[str], workdir: pathlib.Path, extra: str = "") -> None:
  """Trains (or resumes) each named run; the fine-tuning run starts from the pretraining run.
  `extra`: key=value,... added to every run's config arg (e.g. runlocal=True for a quick check)."""
  from attnlab import config_utils, train  # pylint: disable=g-import-not-at-top
  for name in names:
    file, arg = RUNS[name]
    if extra:
      arg += "," + extra
    if name == "bert_sst2":
      arg += f",init_from={workdir / 'bert_pretrain'}"
    config = config_utils.load_config_file(f"{CONFIGS / file}:{arg}")
    print(f"== {name}: {file}:{arg}", flush=True)
    train.train_and_evaluate(config, workdir / name)


SEQ2SEQ_TASKS = ("reverse", "dates")
SEQ2SEQ_MODELS = ("bahdanau", "luong", "transformer")
# Source-length bins (upper edges) of the alignment plot: reverse uses its config's; dates (whose
# config has none) these, in characters ("9/10/93" is 7, "tuesday 9 october 1993" 22).
ALIGNMENT_BINS = {"reverse": None, "dates": (10, 15, 20, 25, 30, 40)}
# One input per run for the HTML views (a dates source, a reverse source of 12 tokens).
VIEW_INPUTS = {"dates": "tuesday 9 october 1993", "reverse": "q w e r t y u i o p a s"}
GPT_TEXT = "ROMEO:\nWhat light through yonder window breaks? It is the east."


def sst2_sentences(data_dir: str, n: int) -> list[str]:
  """The first `n` sentences of SST-2's validation split (labels unread)."""
  lines = (pathlib.Path(data_dir) / "sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()
  return [line.split("\t", 1)[1] for line in lines[1:n + 1]]


def layer_matrix(rows: list[dict], key: str) -> tuple[list[str], np.ndarray]:
  """head_table rows -> (layer paths, [layers, heads] of `key`)."""
  layers = list(dict.fromkeys(r["layer"] for r in rows))
  heads = 1 + max(r["head"] for r in rows)
  out = np.full((len(layers), heads), np.nan)
  for r in rows:
    out[layers.index(r["layer"]), r["head"]] = r[key]
  return layers, out


def mean_table(captures: list, keys=("entropy", "normalized_entropy", "mean_abs_offset",
                                     "special_mass")) -> list[dict]:
  """head_table rows averaged over several captures of the same run."""
  tables = [analysis.head_table(c) for c in captures]
  rows = []
  for i, row in enumerate(tables[0]):
    rows.append({**row, **{k: float(np.nanmean([t[i][k] for t in tables])) for k in keys}})
  return rows


def _selected(args: argparse.Namespace, names) -> list[str]:
  """The runs of `names` that --only selects (each analysis covers the runs it was given)."""
  only = set(args.only.split(","))
  return [n for n in names if n in only]


def entropy_and_rollout(workdir: pathlib.Path, args: argparse.Namespace, results: dict) -> None:
  """Per-head entropy of GPT and BERT on held-out text; rollout after each layer of one input."""
  sentences = sst2_sentences(os.environ["ATTNLAB_DATA_DIR"], 16)
  texts = {"gpt_shakespeare": None, "bert_pretrain": sentences, "bert_sst2": sentences}
  texts = {n: texts[n] for n in _selected(args, texts)}
  if not texts:
    return
  fig, axes = plt.subplots(1, len(texts), figsize=(4 * len(texts), 3.4),
                           gridspec_kw={"wspace": 0.35})
  for ax, name in zip(np.atleast_1d(axes), texts):
    run = analysis.load_run(workdir / name)
    if name == "gpt_shakespeare":  # 16 windows of held-out characters
      ids, block = run.task.validation_ids(), run.task.block_size
      starts = np.linspace(0, len(ids) - block - 1, 16).astype(int)
      caps = [analysis.capture(run, np.asarray(ids[s:s + block])) for s in starts]
    else:
      caps = [analysis.capture_text(run, t) for t in texts[name]]
    rows = mean_table(caps)
    layers, ent = layer_matrix(rows, "normalized_entropy")
    _, special = layer_matrix(rows, "special_mass")
    _, dist = layer_matrix(rows, "mean_abs_offset")
    results["entropy"][name] = {
        "inputs": len(caps), "layers": layers,
        "normalized_entropy": ent.round(4).tolist(), "mean_abs_offset": dist.round(3).tolist(),
        "special_mass": special.round(4).tolist()}
    image = ax.imshow(ent, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for (i, j), v in np.ndenumerate(ent):
      ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
              color="white" if v < 0.6 else "black")
    ax.set_yticks(range(len(layers)), [l.replace("/self_attention", "").replace("encoder/", "")
                                       for l in layers], fontsize=8)
    ax.set_xticks(range(ent.shape[1]))
    ax.set_xlabel("head")
    ax.set_title(f"{name} ({len(caps)} inputs)", fontsize=9)
  fig.colorbar(image, ax=axes, fraction=0.02, label="entropy / log(#keys)")
  fig.suptitle("Attention entropy per head, normalised (1 = uniform over the keys it may see)")
  fig.savefig(_figures(args) / "entropy.png", dpi=120, bbox_inches="tight")
  plt.close(fig)

  # Rollout after layers 1..L of one input per model.
  inputs = {"gpt_shakespeare": GPT_TEXT,
            "bert_sst2": "the movie is a charming , funny and moving story ."}
  for name in _selected(args, inputs):
    text = inputs[name]
    run = analysis.load_run(workdir / name)
    cap = analysis.capture_text(run, text)
    paths = [p for p in cap.weights if cap.kind[p] != "cross"]
    tokens = cap.tokens[cap.sides[paths[0]][1]]
    fig, axes = plt.subplots(1, len(paths), figsize=(4.2 * len(paths), 4.4))
    rollouts = []
    for depth, ax in enumerate(np.atleast_1d(axes), start=1):
      r = analysis.attention_rollout([cap.weights[p] for p in paths[:depth]])
      rollouts.append(r)
      ax.imshow(r, cmap="magma", vmin=0, vmax=1)
      ax.set_title(f"rollout after layer {depth}", fontsize=9)
      if len(tokens) <= 24:
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=7)
      else:
        ax.set_xlabel("input position")
        ax.set_ylabel("position")
    fig.suptitle(f"Attention rollout of {name}: {text[:60]!r}", fontsize=10)
    fig.savefig(_figures(args) / f"rollout_{name}.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    # How far back the final representation reaches: the rollout mass on the own position and
    # the mean |i - j| under the rollout rows, per depth.
    n = len(tokens)
    dist = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    results["rollout"][name] = {
        "text": text, "tokens": n,
        "self_mass": [float(np.mean(np.diag(r))) for r in rollouts],
        "mean_abs_offset": [float(np.mean(np.sum(r * dist, axis=1))) for r in rollouts]}


def alignment_study(workdir: pathlib.Path, args: argparse.Namespace, results: dict) -> None:
  """Argmax alignment accuracy by source length for each cross-attention model.

  Scored against the gold links and against them moved one source position to the right
  (attnlab.analysis.alignment: RNN decoders over a unidirectional encoder may align one late);
  the plot shows each model's cross-attention layer and shift with the higher accuracy.
  """
  chosen = set(_selected(args, [f"{t}_{m}" for t in SEQ2SEQ_TASKS for m in SEQ2SEQ_MODELS]))
  tasks = [t for t in SEQ2SEQ_TASKS if any(f"{t}_{m}" in chosen for m in SEQ2SEQ_MODELS)]
  if not tasks:
    return
  fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 3.8))
  for ax, task in zip(np.atleast_1d(axes), tasks):
    for model in SEQ2SEQ_MODELS:
      name = f"{task}_{model}"
      if name not in chosen:
        continue
      run = analysis.load_run(workdir / name)
      reports = {shift: analysis.evaluate_alignment(run, num_examples=args.num_examples,
                                                    bins=ALIGNMENT_BINS[task], shift=shift)
                 for shift in (0, 1)}
      evals = [r for r in analysis.read_metrics(workdir / name) if r["split"] == "eval"]
      accuracy = {shift: {path: entry["all"]["accuracy"] for path, entry in report.items()}
                  for shift, report in reports.items()}
      shift, best = max(((s, p) for s in accuracy for p in accuracy[s]),
                        key=lambda sp: accuracy[sp[0]][sp[1]])
      entry = reports[shift][best]
      bins = [b for b in entry if b.startswith("len_")]
      results["alignment"][name] = {
          "exact_match": evals[-1].get("exact_match"),
          "accuracy_by_layer": {f"shift_{s}": a for s, a in accuracy.items()},
          "best": {"layer": best, "shift": shift, "accuracy": entry["all"]["accuracy"],
                   "aer": entry["all"]["aer"],
                   "by_length": {b: entry[b]["accuracy"] for b in bins},
                   "head_accuracy": entry["head_accuracy"]}}
      label = model + (f" {best.split('/')[0]}" if best != "." else "") + \
          (f", gold +{shift}" if shift else "")
      ax.plot(range(len(bins)), [entry[b]["accuracy"] for b in bins], "o-", label=label)
      ax.set_xticks(range(len(bins)), ["-".join(str(int(n)) for n in b[4:].split("_"))
                                       for b in bins])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("source length")
    ax.set_ylabel("argmax alignment accuracy")
    ax.set_title(f"{task} ({args.num_examples} held-out examples)", fontsize=10)
    ax.legend(fontsize=8)
  fig.savefig(_figures(args) / "alignment_by_length.png", dpi=120, bbox_inches="tight")
  plt.close(fig)


def ablation_study(workdir: pathlib.Path, args: argparse.Namespace, results: dict) -> None:
  """Head-ablation heatmaps: the change of each run's metric with one head zeroed."""
  metrics = {"gpt_shakespeare": "loss", "bert_sst2": "accuracy", "reverse_transformer": "loss",
             "dates_transformer": "loss"}
  for name in _selected(args, metrics):
    metric = metrics[name]
    run = analysis.load_run(workdir / name)
    res = analysis.head_ablation(run, metric=metric, mode="zero")
    analysis.plot_head_ablation(res, path=_figures(args) / f"ablation_{name}.png",
                                title=f"{name}: {metric} change with one head zeroed "
                                      f"(baseline {res.baseline:.4g})")
    plt.close("all")
    results["ablation"][name] = {"metric": metric, "baseline": res.baseline,
                                 "layers": res.layers, "delta": np.round(res.delta, 4).tolist()}


def views(workdir: pathlib.Path, args: argparse.Namespace, results: dict) -> None:
  """One self-contained HTML attention view per run (figures/view_<run>.html)."""
  inputs = {"gpt_shakespeare": GPT_TEXT,
            "bert_sst2": "the movie is a charming , funny and moving story .",
            "dates_transformer": VIEW_INPUTS["dates"], "dates_bahdanau": VIEW_INPUTS["dates"],
            "reverse_transformer": VIEW_INPUTS["reverse"]}
  for name in _selected(args, inputs):
    text = inputs[name]
    run = analysis.load_run(workdir / name)
    cap = analysis.capture_text(run, text)
    path = view_lib.write_html(_figures(args) / f"view_{name}.html", cap,
                               analysis.head_table(cap), title=f"{name}: {text}")
    results["views"][name] = {"file": path.name, "bytes": path.stat().st_size}


PARTS = {"entropy": entropy_and_rollout, "alignment": alignment_study,
         "ablation": ablation_study, "views": views}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "analysis"))
  parser.add_argument("--only", default=",".join(RUNS), help="comma-separated run names")
  parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data"),
                      help="folder with the real datasets ('' = $ATTNLAB_DATA_DIR or download)")
  parser.add_argument("--train_only", action="store_true", help="train, skip the analysis")
  parser.add_argument("--parts", default="entropy,alignment,ablation,views",
                      help="which analyses to run (results.json keeps the others' numbers)")
  parser.add_argument("--num_examples", type=int, default=500,
                      help="held-out examples per seq2seq run for the alignment accuracy")
  parser.add_argument("--arg", default="", help="key=value,... added to every run's config "
                      "(e.g. runlocal=True: a seconds-long check of the whole study)")
  parser.add_argument("--out", default=str(OUT),
                      help="folder of figures/ and results.json (default: this experiment's)")
  args = parser.parse_args(argv)
  names = [n for n in args.only.split(",") if n]
  parts = [p for p in args.parts.split(",") if p]
  for given, valid, what in ((names, RUNS, "run"), (parts, PARTS, "part")):
    unknown = [n for n in given if n not in valid]
    if unknown:
      parser.error(f"unknown {what}(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
  if args.data_dir:
    os.environ["ATTNLAB_DATA_DIR"] = args.data_dir
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  tool.setup_logging()
  workdir = pathlib.Path(args.workdir)
  train_runs(names, workdir, args.arg)
  if args.train_only:
    return 0
  _figures(args).mkdir(parents=True, exist_ok=True)
  results_path = pathlib.Path(args.out) / "results.json"
  results = {"entropy": {}, "rollout": {}, "alignment": {}, "ablation": {}, "views": {},
             "load_average_start": os.getloadavg()[0]}
  for part in parts:
    print(f"== analysis: {part}", flush=True)
    PARTS[part](workdir, args, results)
  previous = json.loads(results_path.read_text()) if results_path.is_file() else {}
  for key, value in results.items():
    if isinstance(value, dict):
      previous.setdefault(key, {}).update(value)
    else:
      previous[key] = value
  results_path.write_text(json.dumps(previous, indent=1) + "\n")
  print(f"wrote {results_path} and {_figures(args)}/")
  return 0


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config arg: one line, status 2
