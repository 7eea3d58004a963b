"""Induction heads at CPU scale (issue #52): a 2-layer attention-only GPT on the synthetic
induction task, with a 1-layer control; the phase change over training, then ablation, patching
and composition at the last checkpoint.

  python experiments/induction_heads/run.py                         # runs/induction_heads
  python experiments/induction_heads/run.py --steps=40 --every=20 --seeds=2 --workdir=/tmp/ind
  python experiments/induction_heads/run.py --shakespeare_steps=1000   # + the nano GPT's heads

Arms: `configs/gpt.py` with dataset=induction, model.mlp_ratio=0 and model.num_layers 2
(WORKDIR/layers2) and 1 (WORKDIR/layers1), `--seeds` replicas trained in one vmapped program
(num_seeds; each replica its own init and data order), a checkpoint every `--every` steps.
At every checkpoint and for every seed:
  copy_loss         the validation loss on the copied ids an induction head can predict (the
                    task's eval metric, from metrics.jsonl)
  previous_token    attnlab.analysis.detect_heads' score per head (16 sequences of 32 random ids
                    repeated twice); the plot shows layer 0's best head
  induction         the same detector's induction score; the plot shows the last layer's best head
  icl_score         on the 256 validation sequences, the mean loss of the last 16 targets minus
                    that of the first 16 (Olsson et al. 2022's in-context-learning score: < 0 when
                    later ids are easier)
  repeat_loss_gap   on random ids repeated twice, the mean loss on the first half minus that on
                    the second (> 0 when the model uses the first occurrence)
  k_composition     layer 0 -> layer 1 K-composition scores (attnlab.analysis.composition_scores)
At the last checkpoint, per seed: the copy loss with each head's output zeroed (ablation); the
copy loss of a corrupted run (each sequence's source segment replaced by other random ids, so
its copy has nothing to match) with one head's output patched in from the clean run
(analysis.patch_sweep over layer x head); the K-, Q- and V-composition of every layer-0 head into
the top induction head against analysis.random_baseline.
With `--shakespeare_steps=N`: the nano GPT (configs/gpt.py's default, 4 layers with MLPs) trained
N steps on Tiny Shakespeare (WORKDIR/shakespeare) and the same detectors and head ablation on it.

Resumable: an arm whose measurements cover its last step is skipped; otherwise the trainer resumes
its workdir and only the checkpoints not yet measured are measured (WORKDIR/<arm>/measure.json).
Writes WORKDIR/results.json, WORKDIR/induction_heads.png (the curves on one time axis) and
WORKDIR/controls.png (ablation and patching heatmaps), and prints the README's tables.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

# The model and data of the study (configs/gpt.py keys); the layer count and seeds are per arm.
# Copied segments of 8..32 ids: about 19 of the 64 targets of a sequence are predictable by an
# induction head (README: with 4..16, about 9, the 2-layer model stayed on the plateau).
BASE_ARG = ("dataset=induction,model.mlp_ratio=0,model.num_heads=4,model.d_model=64,"
            "model.block_size=64,data.vocab_size=64,data.min_span=8,data.max_span=32,"
            "data.num_eval=256,data.eval_batch_size=128,batch_size=32,"
            "optimizer.warmup_steps=50,mesh.cpu_devices=1")
ARMS = {"layers2": 2, "layers1": 1}
# Half the detectors' repeated sequence (2 * 32 = block_size ids).
SEQ_LEN = 32
# Targets averaged at each end of the context for the in-context-learning score.
ICL_WIDTH = 16
MEASURE_FILE = "measure.json"


def arm_config(layers: int, steps: int, every: int, seeds: int, extra: str):
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  arg = (f"{BASE_ARG},model.num_layers={layers},num_seeds={seeds},num_train_steps={steps},"
         f"eval_every={every},checkpoint_every={every},keep_checkpoints={steps // every + 2},"
         f"log_every={every}")
  if extra:
    arg += "," + extra
  return config_utils.load_config_file(f"{REPO / 'configs' / 'gpt.py'}:{arg}"), arg


# ------------------------------------------------------------------------------- measurements


def corrupt_sources(ids, src, span, vocab_size: int, seed: int = 0):
  """int32 `[n, length]`: `ids` with each row's source segment ids[src:src + span] replaced by
  random ids, each different from the one it replaces (the copy at dst keeps its ids, so it no
  longer repeats anything earlier in the sequence, barring chance)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  out = np.array(ids, np.int32)
  rng = np.random.default_rng(seed)
  for row, (s, n) in enumerate(zip(src, span)):
    shift = rng.integers(1, vocab_size, n)  # [n]: never 0, so every id changes
    out[row, s:s + n] = (out[row, s:s + n] + shift) % vocab_size
  return out


def icl_score(nll, width: int = ICL_WIDTH) -> float:
  """Mean of the last `width` targets' losses minus that of the first `width` (nll `[n, len]`)."""
  return float(nll[:, -width:].mean() - nll[:, :width].mean())


def token_nll(model, params, inputs, targets):
  """float `[n, len]` per-token cross-entropy of next-token `targets`."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  logits = model.apply({"params": params}, inputs)  # [n, len, vocab]
  return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def replicas(run, num_seeds: int):
  """The params of each replica of a run loaded with replica=None."""
  import jax  # pylint: disable=g-import-not-at-top
  if num_seeds == 1:
    return [run.params]
  return [jax.tree.map(lambda x, i=i: x[i], run.params) for i in range(num_seeds)]


def validation(task) -> dict:
  """The task's validation sequences with their src / span (rebuilt from the same options) and
  a corrupted copy of their inputs."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from attnlab import data as data_lib  # pylint: disable=g-import-not-at-top
  d, val = task.config.data, task.induction_val
  examples = data_lib.get_dataset(
      "induction", "validation", num_examples=d.num_eval,
      seed=d.seed if d.seed >= 0 else task.config.seed, length=task.block_size + 1,
      vocab_size=d.vocab_size, min_span=d.min_span, max_span=d.max_span)
  ids = np.asarray([ex["ids"] for ex in examples], np.int32)  # [n, block + 1]
  assert np.array_equal(ids[:, :-1], val["inputs"]), "validation sequences differ from the task's"
  corrupted = corrupt_sources(ids, [ex["src"] for ex in examples], [ex["span"] for ex in examples],
                              d.vocab_size)
  return {"inputs": val["inputs"], "targets": val["targets"], "copy_mask": val["copy_mask"],
          "corrupted": corrupted[:, :-1]}


def measure(workdir: pathlib.Path, num_seeds: int, done: dict, near: int = 0) -> dict:
  """{step: [one row per seed]} for every checkpoint of the run in `workdir` not in `done`; with
  `near` > 0 also `induction_near`, the induction scores on `near` random ids repeated twice
  (the induction key then lies near - 1 positions back: within reach of a sliding window)."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from attnlab import analysis, checkpoint, rundir
  evals = {r["step"]: r for r in rundir.read_metrics(workdir) if r["split"] == "eval"}
  out = {}
  for step in sorted(checkpoint.finished_steps(workdir)):
    if str(step) in done:
      continue
    run = analysis.load_run(workdir, step, replica=None)
    val = validation(run.task)
    ev = evals.get(step, {})
    per_seed = ev.get("per_seed", {k: [v] for k, v in ev.items() if isinstance(v, float)})
    tokens = analysis.repeated_random_tokens(run.model.vocab_size, SEQ_LEN, 16, seed=1, low=0)
    rows = []
    for i, params in enumerate(replicas(run, num_seeds)):
      model = (run.model, params)
      scores = analysis.detect_heads(model, seq_len=SEQ_LEN, batch=16)
      nll = token_nll(run.model, params, val["inputs"], val["targets"])
      rep = token_nll(run.model, params, tokens[:, :-1], tokens[:, 1:])
      row = {"copy_loss": per_seed.get("copy_loss", [None] * num_seeds)[i],
             "loss": per_seed.get("loss", [None] * num_seeds)[i],
             "copy_accuracy": per_seed.get("copy_accuracy", [None] * num_seeds)[i],
             "copy_loss_here": float((nll * val["copy_mask"]).sum() / val["copy_mask"].sum()),
             "icl_score": icl_score(nll),
             "repeat_loss_gap": float(rep[:, :SEQ_LEN - 1].mean() - rep[:, SEQ_LEN:].mean()),
             **{k: np.round(v, 4).tolist() for k, v in scores.items()}}
      if near:
        row["induction_near"] = np.round(analysis.detect_heads(
            model, seq_len=near, batch=16)["induction"], 4).tolist()
      if run.model.num_layers > 1:
        row["k_composition"] = np.round(analysis.composition_scores(model, "k")[0, :, 1], 4).tolist()
      rows.append(row)
    out[str(step)] = rows
    print(f"  measured step {step}: copy_loss "
          + " ".join(f"{r['copy_loss_here']:.3f}" for r in rows), flush=True)
  return out


def controls(workdir: pathlib.Path, num_seeds: int) -> list[dict]:
  """Per seed, at the last checkpoint: head ablation, patching and composition (docstring)."""
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import numpy as np
  from attnlab import analysis
  run = analysis.load_run(workdir, "latest", replica=None)
  val = validation(run.task)
  layers, heads = run.model.num_layers, run.model.num_heads
  targets, mask = jnp.asarray(val["targets"]), jnp.asarray(val["copy_mask"])

  def copy_loss(logits):  # traced: the mean loss on the copied ids
    logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.sum(mask)

  other = 1.0 - val["copy_mask"]
  eye = np.eye(heads, dtype=bool)
  out = []
  for params in replicas(run, num_seeds):
    model = (run.model, params)
    scores = analysis.detect_heads(model, seq_len=SEQ_LEN, batch=16)
    clean_logits = analysis.run_with_hooks(model, val["inputs"], [])
    clean = float(copy_loss(clean_logits))
    corrupted = float(copy_loss(analysis.run_with_hooks(model, val["corrupted"], [])))
    ablated = np.zeros((layers, heads))
    ablated_other = np.zeros((layers, heads))
    for l in range(layers):
      for h in range(heads):
        ivs = [analysis.Intervention(f"blocks.{m}.attn.z", "zero", heads=eye[h] if m == l else
                                     np.zeros(heads, bool)) for m in range(layers)]
        logits = analysis.run_with_hooks(model, val["inputs"], ivs)
        ablated[l, h] = float(copy_loss(logits))
        nll = np.asarray(-jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None],
                                              axis=-1)[..., 0])
        ablated_other[l, h] = float((nll * other).sum() / other.sum())
    clean_nll = np.asarray(-jnp.take_along_axis(jax.nn.log_softmax(clean_logits),
                                                targets[..., None], axis=-1)[..., 0])
    patched = analysis.patch_sweep(model, val["inputs"], val["corrupted"], copy_loss,
                                   site="attn.z", over="head")  # [layers, heads]
    top = int(np.argmax(scores["induction"][-1]))
    row = {"induction_head": [layers - 1, int(top)],
           "induction_score": float(scores["induction"][-1, top]),
           "previous_token_head": [0, int(np.argmax(scores["previous_token"][0]))],
           "previous_token_score": float(scores["previous_token"][0].max()),
           "copy_loss_clean": clean, "copy_loss_corrupted": corrupted,
           "other_loss_clean": float((clean_nll * other).sum() / other.sum()),
           "copy_loss_ablated": np.round(ablated, 4).tolist(),
           "other_loss_ablated": np.round(ablated_other, 4).tolist(),
           "copy_loss_patched": np.round(patched, 4).tolist(),
           "patch_recovery": np.round((corrupted - patched) / (corrupted - clean), 4).tolist()}
    if layers > 1:
      w = analysis.head_weights(model)
      row["composition_into_induction_head"] = {
          kind: np.round(analysis.composition_scores(w, kind)[0, :, 1, top], 4).tolist()
          for kind in ("k", "q", "v")}
      row["composition_baseline"] = analysis.random_baseline(w.d_model, w.head_dim, "k")
      row["composition_notes"] = list(w.notes)
    out.append(row)
  return out


def shakespeare(workdir: pathlib.Path, steps: int, data_dir: str) -> dict:
  """The nano GPT trained `steps` steps on Tiny Shakespeare: detectors and head ablation."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from attnlab import analysis, config_utils, train
  arg = (f"num_train_steps={steps},eval_every={steps},checkpoint_every={steps},"
         f"log_every={max(1, steps // 20)},mesh.cpu_devices=1")
  if data_dir:
    arg += f",data.manual_dir={data_dir}"
  start = time.time()
  train.train_and_evaluate(
      config_utils.load_config_file(f"{REPO / 'configs' / 'gpt.py'}:{arg}"), workdir)
  seconds = time.time() - start
  run = analysis.load_run(workdir)
  scores = analysis.detect_heads(run, seq_len=SEQ_LEN, batch=16)
  tokens = analysis.repeated_random_tokens(run.model.vocab_size, SEQ_LEN, 16, seed=1)
  layers, heads = run.model.num_layers, run.model.num_heads
  eye = np.eye(heads, dtype=bool)

  def second_half(ivs):  # loss on the repeated half of random characters
    logits = analysis.run_with_hooks(run, tokens[:, :-1], ivs)
    import optax  # pylint: disable=g-import-not-at-top
    nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))
    return float(nll[:, SEQ_LEN:].mean()), float(nll[:, :SEQ_LEN - 1].mean())

  clean = second_half([])
  ablated = np.zeros((layers, heads))
  for l in range(layers):
    for h in range(heads):
      ablated[l, h] = second_half([analysis.Intervention(
          f"blocks.{m}.attn.z", "zero", heads=eye[h] if m == l else np.zeros(heads, bool))
          for m in range(layers)])[0]
  # The same detectors on in-distribution input: 32 characters of validation text, twice.
  text = run.task.eval_batches()[0]["inputs"][:16, :SEQ_LEN]  # [16, 32]
  text = np.concatenate([text, text], axis=1)  # [16, 64]
  on_text = analysis.detect_heads(run, tokens=text)
  logits = analysis.run_with_hooks(run, text[:, :-1], [])
  import optax  # pylint: disable=g-import-not-at-top
  nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, text[:, 1:]))
  evals = [r for r in analysis.read_metrics(workdir) if r["split"] == "eval"]
  return {"steps": steps, "train_s_this_invocation": seconds, "val_loss": evals[-1]["loss"],
          "repeat_loss_second_half": clean[0], "repeat_loss_first_half": clean[1],
          "repeat_loss_second_half_ablated": np.round(ablated, 4).tolist(),
          **{k: np.round(v, 4).tolist() for k, v in scores.items()},
          "text_loss_first_half": float(nll[:, :SEQ_LEN - 1].mean()),
          "text_loss_second_half": float(nll[:, SEQ_LEN:].mean()),
          **{f"text_{k}": np.round(v, 4).tolist() for k, v in on_text.items()}}


# ------------------------------------------------------------------------------------- plots


def plot_curves(results: dict, path: pathlib.Path, chance: dict, baseline: float) -> None:
  """Copy loss, detector scores, K-composition and ICL score of every seed on one time axis."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(7.5, 10.0))
  FigureCanvasAgg(fig)
  axes = fig.subplots(5, 1, sharex=True)
  colors = {"layers2": "tab:blue", "layers1": "tab:orange"}
  for name, arm in results.items():
    steps = sorted(int(s) for s in arm["rows"])
    rows = [arm["rows"][str(s)] for s in steps]  # [checkpoints][seeds]
    last = arm["controls"]
    for i in range(len(rows[0])):
      c, style = colors[name], "-" if i == 0 else ["--", ":", "-."][(i - 1) % 3]
      label = lambda what, i=i: f"{name} seed {arm['seeds'][i]}{what}"
      axes[0].plot(steps, [r[i]["copy_loss_here"] for r in rows], style, color=c, lw=1.2,
                   label=label(""))
      axes[1].plot(steps, [max(r[i]["previous_token"][0]) for r in rows], style, color=c,
                   label=label(""))
      axes[2].plot(steps, [max(r[i]["induction"][-1]) for r in rows], style, color=c,
                   label=label(""))
      if "k_composition" in rows[0][i]:
        prev, ind = last[i]["previous_token_head"][1], last[i]["induction_head"][1]
        axes[3].plot(steps, [r[i]["k_composition"][prev][ind] for r in rows], style, color=c,
                     label=label(f": L0.{prev} -> L1.{ind}"))
      axes[4].plot(steps, [r[i]["icl_score"] for r in rows], style, color=c, label=label(""))
  axes[0].axhline(np.log(64), color="grey", lw=0.8, ls=":", label="uniform guess (ln 64)")
  axes[1].axhline(chance["previous_token"], color="grey", lw=0.8, ls=":", label="uniform head")
  axes[2].axhline(chance["induction"], color="grey", lw=0.8, ls=":", label="uniform head")
  axes[3].axhline(baseline, color="grey", lw=0.8, ls=":", label="random baseline")
  axes[4].axhline(0.0, color="grey", lw=0.8, ls=":")
  axes[0].set_ylabel("copy loss (nats)\nvalidation copied ids")
  axes[1].set_ylabel("previous-token\nlayer 0, best head")
  axes[2].set_ylabel("induction score\nlast layer, best head")
  axes[3].set_ylabel("K-composition\nprev-token -> induction")
  axes[4].set_ylabel(f"ICL score (nats)\nlast {ICL_WIDTH} - first {ICL_WIDTH}")
  axes[4].set_xlabel("training step")
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
  axes[0].set_title("Attention-only GPT on the synthetic induction task")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def plot_controls(results: dict, path: pathlib.Path) -> None:
  """Per seed of the 2-layer arm: copy loss with each head ablated, and patching recovery."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  arm = results["layers2"]
  n = len(arm["controls"])
  fig = Figure(figsize=(3.2 * n, 4.6))
  FigureCanvasAgg(fig)
  axes = np.asarray(fig.subplots(2, n, squeeze=False))
  for i, c in enumerate(arm["controls"]):
    rise = np.asarray(c["copy_loss_ablated"]) - c["copy_loss_clean"]  # [layers, heads]
    for ax, key, title, cmap in ((axes[0, i], "copy_loss_ablated",
                                  "copy loss rise, head zeroed", "Reds"),
                                 (axes[1, i], "patch_recovery",
                                  "patched clean -> corrupted\n(share of copy loss recovered)",
                                  "RdBu_r")):
      grid = rise if key == "copy_loss_ablated" else np.asarray(c[key])
      kw = {"vmin": -1, "vmax": 1} if key == "patch_recovery" else {"vmin": 0}
      im = ax.imshow(grid, cmap=cmap, aspect="auto", **kw)
      for (l, h), v in np.ndenumerate(grid):
        ax.text(h, l, f"{v:.2f}", ha="center", va="center", fontsize=7)
      ax.set_xticks(range(grid.shape[1]))
      ax.set_yticks(range(grid.shape[0]))
      ax.set_xlabel("head")
      ax.set_ylabel("layer")
      extra = f"\n(clean {c['copy_loss_clean']:.2f} nats)" if key == "copy_loss_ablated" else ""
      ax.set_title(f"seed {arm['seeds'][i]}: {title}{extra}", fontsize=8)
      fig.colorbar(im, ax=ax, fraction=0.05)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------ tables


def tables(results: dict, chance: dict, baseline: float) -> str:
  """The README's markdown tables: curves at a few steps (mean over seeds), the controls."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  lines = []
  fmt = lambda xs: f"{np.mean(xs):.3f}" + (f" ± {np.std(xs):.3f}" if len(xs) > 1 else "")
  for name, arm in results.items():
    steps = sorted(int(s) for s in arm["rows"])
    picks = sorted({steps[int(round(k * (len(steps) - 1) / 8))] for k in range(9)})
    lines += [f"\n{name} (mean ± std over seeds {arm['seeds']}; chance: previous-token "
              f"{chance['previous_token']:.3f}, induction {chance['induction']:.3f})", "",
              "| step | copy_loss | copy acc | prev-token (L0) | induction (last) | ICL score |"
              " repeat gap |", "|---|---|---|---|---|---|---|"]
    for s in picks:
      rows = arm["rows"][str(s)]
      lines.append("| " + " | ".join([
          str(s), fmt([r["copy_loss_here"] for r in rows]),
          fmt([r["copy_accuracy"] or float("nan") for r in rows]),
          fmt([max(r["previous_token"][0]) for r in rows]),
          fmt([max(r["induction"][-1]) for r in rows]),
          fmt([r["icl_score"] for r in rows]), fmt([r["repeat_loss_gap"] for r in rows])]) + " |")
  lines += ["\nThe steepest fall of the copy loss between two checkpoints, per seed, and the layer-0 "
            "previous-token and last-layer induction scores (best heads) across it:", "",
            "| arm | seed | steps | copy_loss | prev-token (L0) | induction (last) | ICL score |",
            "|---|---|---|---|---|---|---|"]
  for name, arm in results.items():
    steps = sorted(int(s) for s in arm["rows"])
    for i, seed in enumerate(arm["seeds"]):
      curve = [arm["rows"][str(s)][i] for s in steps]
      if len(curve) < 2:
        continue
      k = int(np.argmin(np.diff([r["copy_loss_here"] for r in curve])))
      a, b = curve[k], curve[k + 1]
      arrow = lambda f, a=a, b=b: f"{f(a):.2f} -> {f(b):.2f}"
      lines.append(f"| {name} | {seed} | {steps[k]} -> {steps[k + 1]} | "
                   f"{arrow(lambda r: r['copy_loss_here'])} | "
                   f"{arrow(lambda r: max(r['previous_token'][0]))} | "
                   f"{arrow(lambda r: max(r['induction'][-1]))} | "
                   f"{arrow(lambda r: r['icl_score'])} |")
  lines += ["\nControls at the last checkpoint (copy loss on the 256 validation sequences):", "",
            "| arm | seed | top induction head (score) | clean | it ablated | worst other head "
            "ablated | non-copy loss clean / it ablated | corrupted | it patched in (recovered) |",
            "|---|---|---|---|---|---|---|---|---|"]
  for name, arm in results.items():
    for seed, c in zip(arm["seeds"], arm["controls"]):
      l, h = c["induction_head"]
      abl, pat = np.asarray(c["copy_loss_ablated"]), np.asarray(c["copy_loss_patched"])
      others = np.delete(abl.reshape(-1), l * abl.shape[1] + h)
      lines.append(
          f"| {name} | {seed} | L{l}.{h} ({c['induction_score']:.2f}) | "
          f"{c['copy_loss_clean']:.3f} | {abl[l, h]:.3f} | "
          f"{others.max() if len(others) else float('nan'):.3f} | "
          f"{c['other_loss_clean']:.3f} / {c['other_loss_ablated'][l][h]:.3f} | "
          f"{c['copy_loss_corrupted']:.3f} | {pat[l, h]:.3f} "
          f"({c['patch_recovery'][l][h]:.2f}) |")
  arm = results.get("layers2")
  if arm:
    lines += [f"\nComposition of each layer-0 head into the top induction head (random baseline "
              f"{baseline:.3f}):", "", "| seed | induction head | L0 head | previous-token score |"
              " K-comp | Q-comp | V-comp |", "|---|---|---|---|---|---|---|"]
    last = arm["rows"][str(max(int(s) for s in arm["rows"]))]
    for seed, c, r in zip(arm["seeds"], arm["controls"], last):
      comp = c["composition_into_induction_head"]
      for h in range(len(comp["k"])):
        mark = " (prev-token head)" if h == c["previous_token_head"][1] else ""
        lines.append(f"| {seed} | L1.{c['induction_head'][1]} | L0.{h}{mark} | "
                     f"{r['previous_token'][0][h]:.3f} | {comp['k'][h]:.3f} | {comp['q'][h]:.3f}"
                     f" | {comp['v'][h]:.3f} |")
  return "\n".join(lines)


def shakespeare_table(s: dict) -> str:
  import numpy as np  # pylint: disable=g-import-not-at-top
  ind, prev = np.asarray(s["induction"]), np.asarray(s["previous_token"])
  abl = np.asarray(s["repeat_loss_second_half_ablated"])
  lines = [f"\nnano GPT on Tiny Shakespeare, {s['steps']} steps (val loss {s['val_loss']:.3f}); "
           f"repeated random characters: loss first half {s['repeat_loss_first_half']:.3f}, "
           f"second half {s['repeat_loss_second_half']:.3f}", "",
           "| layer | induction per head | previous-token per head | 2nd-half loss, head zeroed |",
           "|---|---|---|---|"]
  for l in range(ind.shape[0]):
    lines.append(f"| {l} | " + " / ".join(f"{v:.2f}" for v in ind[l]) + " | "
                 + " / ".join(f"{v:.2f}" for v in prev[l]) + " | "
                 + " / ".join(f"{v:.2f}" for v in abl[l]) + " |")
  if "text_induction" in s:
    ind, prev = np.asarray(s["text_induction"]), np.asarray(s["text_previous_token"])
    dup = np.asarray(s["text_duplicate_token"])
    lines += [f"\nOn 32 characters of validation text repeated twice (16 windows): loss first "
              f"half {s['text_loss_first_half']:.3f}, second half {s['text_loss_second_half']:.3f}",
              "", "| layer | induction per head | duplicate-token per head | previous-token per head |",
              "|---|---|---|---|"]
    for l in range(ind.shape[0]):
      lines.append(f"| {l} | " + " | ".join(" / ".join(f"{v:.2f}" for v in a[l])
                                             for a in (ind, dup, prev)) + " |")
  return "\n".join(lines)


# -------------------------------------------------------------------------------------- main


def _uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
  except OSError:
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "induction_heads"))
  parser.add_argument("--steps", type=int, default=3000, help="training steps per arm")
  parser.add_argument("--every", type=int, default=100, help="steps between checkpoints")
  parser.add_argument("--seeds", type=int, default=3, help="vmapped seeds per arm (num_seeds)")
  parser.add_argument("--config_arg", default="", help="extra configs/gpt.py args, key=value,...")
  parser.add_argument("--shakespeare_steps", type=int, default=0,
                      help="also train the nano GPT on Tiny Shakespeare this long (0: no)")
  parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data"),
                      help="folder holding tinyshakespeare/ (for --shakespeare_steps)")
  args = parser.parse_args(argv)
  if args.steps < 1 or not 1 <= args.every <= args.steps or args.seeds < 1:
    parser.error("need --steps >= 1, 1 <= --every <= --steps and --seeds >= 1")

  # pylint: disable=g-import-not-at-top  (JAX is imported only once the flags are parsed)
  from attnlab import analysis, train
  from attnlab.cli import tool
  tool.setup_logging()
  configs = {name: arm_config(layers, args.steps, args.every, args.seeds, args.config_arg)
             for name, layers in ARMS.items()}  # every bad key reported before any training
  workdir = pathlib.Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  started, uptime_before = time.time(), _uptime()
  print(f"uptime before: {uptime_before}", flush=True)
  results = {}
  for name, (config, arg) in configs.items():
    arm_dir = workdir / name
    saved = arm_dir / MEASURE_FILE
    arm = json.loads(saved.read_text()) if saved.is_file() else {}
    if arm.get("config_arg") != arg:
      arm = {"config_arg": arg, "rows": {}, "train_s": 0.0, "measure_s": 0.0}
    arm["seeds"] = [config.seed + i for i in range(args.seeds)]
    if str(args.steps) in arm["rows"] and "controls" in arm:
      print(f"{name}: done (step {args.steps} measured), skipped", flush=True)
      results[name] = arm
      continue
    print(f"{name}: training to step {args.steps} ({args.seeds} seeds, vmapped)", flush=True)
    start = time.time()
    train.train_and_evaluate(config, arm_dir)
    arm["train_s"] += time.time() - start
    start = time.time()
    arm["rows"].update(measure(arm_dir, args.seeds, arm["rows"]))
    arm["controls"] = controls(arm_dir, args.seeds)
    arm["measure_s"] += time.time() - start
    saved.write_text(json.dumps(arm) + "\n")
    results[name] = arm

  chance = analysis.chance_scores(SEQ_LEN)
  baseline = results["layers2"]["controls"][0]["composition_baseline"]
  plot_curves(results, workdir / "induction_heads.png", chance, baseline)
  plot_controls(results, workdir / "controls.png")
  text = tables(results, chance, baseline)
  summary = {"chance": chance, "composition_baseline": baseline, "arms": results}
  if args.shakespeare_steps:
    saved = workdir / "shakespeare" / MEASURE_FILE
    if saved.is_file() and json.loads(saved.read_text())["steps"] == args.shakespeare_steps \
        and "text_induction" in json.loads(saved.read_text()):
      summary["shakespeare"] = json.loads(saved.read_text())
    else:
      print(f"shakespeare: training the nano GPT {args.shakespeare_steps} steps", flush=True)
      summary["shakespeare"] = shakespeare(workdir / "shakespeare", args.shakespeare_steps,
                                           args.data_dir)
      saved.write_text(json.dumps(summary["shakespeare"]) + "\n")
    text += "\n" + shakespeare_table(summary["shakespeare"])
  summary.update({"uptime_before": uptime_before, "uptime_after": _uptime(),
                  "wall_s_this_invocation": time.time() - started, "cpus": os.cpu_count()})
  (workdir / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
  (workdir / "results.md").write_text(text + "\n")
  print(text)
  print(f"\nuptime after: {summary['uptime_after']}\nwall time this invocation: "
        f"{summary['wall_s_this_invocation']:.0f} s; per arm (all invocations): " + ", ".join(
            f"{n} train {a['train_s']:.0f} s + measure {a['measure_s']:.0f} s"
            for n, a in results.items()))
  return 0


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config arg: one line, status 2
