"""Pools BERT-study result folders that differ by their pretraining seed into one table.

One study (`run.py`) pretrains an arm once and fine-tunes it with 3 seeds, so its mean difference
to scratch rests on one pretraining. Studies run with other `--pretrain_seeds` (on other machines,
e.g. seed 0 on an H100 and seed 1 on the CPU) are pooled here: each fine-tuned seed is compared
with the scratch seed of the same number *of the same study* (same machine, same code), and the
pooled figures are the mean over all those pairs.

  python experiments/bert_sst2/pool.py \
      --studies=experiments/bert_sst2/mini_gpu_20k,experiments/bert_sst2/mini_cpu_s1 \
      --arm=imdb_sst2vocab --out=experiments/bert_sst2/pooled

Reads each folder's results.json and details.json (and label_efficiency.json where present);
writes pooled.json, pooled.md and pooled.png (every pair's difference, per study) into --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Sequence

# The figure the issue asks of the best pretrained arm: points over scratch, every pair positive.
TARGET_POINTS = 2.0


class PoolError(ValueError):
  """A study folder that cannot be pooled; the message says which and why."""


def _read(folder: pathlib.Path, name: str, required: bool = True) -> dict | None:
  path = folder / name
  if not path.is_file():
    if required:
      raise PoolError(f"{path} not found: give folders written by run.py (--workdir or "
                      "--publish_dir)")
    return None
  try:
    return json.loads(path.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise PoolError(f"{path} is not JSON ({e})") from e


def _accuracies(results: dict, arm: str, folder: pathlib.Path) -> dict[int, float]:
  entry = results.get(arm)
  if not isinstance(entry, dict) or not entry.get("sst2_val"):
    raise PoolError(f"{folder / 'results.json'} has no results of arm {arm!r} (arms: "
                    f"{', '.join(results)})")
  seeds, values = entry.get("seeds"), entry["sst2_val"]
  if not isinstance(seeds, list) or len(seeds) != len(values) or not all(
      isinstance(v, (int, float)) for v in values):
    raise PoolError(f"{folder / 'results.json'}: arm {arm!r} needs as many seeds as sst2_val "
                    "numbers")
  return dict(zip(seeds, values))


def study_summary(folder: pathlib.Path, arm: str) -> dict:
  """One study: its pretraining seed(s) and held-out MLM, both arms' accuracy per fine-tuning
  seed, and the differences of the seeds both arms have."""
  results, details = _read(folder, "results.json"), _read(folder, "details.json")
  pretrained, scratch = _accuracies(results, arm, folder), _accuracies(results, "scratch", folder)
  pairs = sorted(set(pretrained) & set(scratch))
  if not pairs:
    raise PoolError(f"{folder}: arm {arm!r} and scratch share no fine-tuning seed")
  info = details.get("arms", {}).get(arm, {})
  pretrain = info.get("pretrain", {})
  summary = {
      "folder": str(folder), "pretrain_seeds": sorted(int(s) for s in pretrain),
      "mlm_accuracy": [p.get("mlm_accuracy") for p in pretrain.values()],
      "lr": {arm: info.get("lr"), "scratch": details.get("arms", {}).get("scratch", {}).get("lr")},
      "seeds": pairs, arm: [pretrained[s] for s in pairs],
      "scratch": [scratch[s] for s in pairs],
      "differences": [pretrained[s] - scratch[s] for s in pairs]}
  label = _read(folder, "label_efficiency.json", required=False)
  if label and label.get("arm") == arm:
    summary["label"] = {
        fraction: {a: label["arms"][a][fraction]["sst2_val"] for a in (arm, "scratch")
                   if fraction in label["arms"].get(a, {})}
        for fraction in label["arms"].get(arm, {})}
  return summary


def _stats(values: Sequence[float]) -> dict:
  return {"mean": statistics.mean(values),
          "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def pool(folders: Sequence[pathlib.Path], arm: str) -> dict:
  """pooled.json's dict: each study's summary and the figures over every pair of all of them."""
  if len(folders) < 1:
    raise PoolError("--studies needs at least one folder")
  studies = [study_summary(f, arm) for f in folders]
  seen: dict[int, str] = {}
  for s in studies:
    for seed in s["pretrain_seeds"]:
      if seed in seen:
        raise PoolError(f"pretraining seed {seed} is in both {seen[seed]} and {s['folder']}: "
                        "pool studies of different pretraining seeds")
      seen[seed] = s["folder"]
  differences = [d for s in studies for d in s["differences"]]
  out = {"arm": arm, "target_points": TARGET_POINTS, "studies": studies,
         "pooled": {arm: _stats([v for s in studies for v in s[arm]]),
                    "scratch": _stats([v for s in studies for v in s["scratch"]]),
                    "difference": {**_stats(differences),
                                   "positive": sum(d > 0 for d in differences)}}}
  fractions = sorted({f for s in studies for f in s.get("label", {})}, key=float)
  label = {}
  for fraction in fractions:
    values = {a: [v for s in studies for v in s.get("label", {}).get(fraction, {}).get(a, [])]
              for a in (arm, "scratch")}
    if all(values.values()):
      label[fraction] = {a: _stats(v) for a, v in values.items()}
      label[fraction]["difference"] = (label[fraction][arm]["mean"]
                                       - label[fraction]["scratch"]["mean"])
      label[fraction]["studies"] = sum(fraction in s.get("label", {}) for s in studies)
  if label:
    out["label"] = label
  return out


def _ms(stats: dict) -> str:
  return f"{100 * stats['mean']:.1f} ± {100 * stats['std']:.1f}"


def pooled_table(pooled: dict) -> str:
  """Markdown: a row per study and the pooled row; then the label-efficiency rows."""
  arm = pooled["arm"]
  lines = [f"Pooled over pretraining seeds: {arm} vs scratch (each fine-tuning seed paired with "
           "the scratch seed of its own study)", "",
           "| study | pretraining seed | held-out MLM % | fine-tune lr (arm, scratch) | "
           f"{arm} % per seed | scratch % per seed | difference per seed | mean difference |",
           "|---|---|---|---|---|---|---|---|"]
  for s in pooled["studies"]:
    mlm = ", ".join(f"{100 * m:.1f}" for m in s["mlm_accuracy"] if m is not None) or "-"
    lines.append(
        f"| {pathlib.Path(s['folder']).name} | {', '.join(map(str, s['pretrain_seeds']))} | "
        f"{mlm} | {s['lr'][arm]:g}, {s['lr']['scratch']:g} | "
        f"{', '.join(f'{100 * v:.1f}' for v in s[arm])} | "
        f"{', '.join(f'{100 * v:.1f}' for v in s['scratch'])} | "
        f"{', '.join(f'{100 * d:+.1f}' for d in s['differences'])} | "
        f"{100 * statistics.mean(s['differences']):+.2f} |")
  p = pooled["pooled"]
  d = p["difference"]
  n = len(pooled["studies"])
  lines.append(f"| **pooled** | {n} pretraining seed{'s' if n > 1 else ''} | | | {_ms(p[arm])} | "
               f"{_ms(p['scratch'])} | {d['positive']} of {d['n']} positive | "
               f"**{100 * d['mean']:+.2f}** ± {100 * d['std']:.2f} |")
  met = d["mean"] * 100 >= pooled["target_points"] and d["positive"] == d["n"]
  lines += ["", f"Target: +{pooled['target_points']:.1f} points with every pair positive: "
            + ("met." if met else "not met.")]
  if pooled.get("label"):
    lines += ["", "| % of training phrases | studies | "
              f"{arm} mean ± std | scratch mean ± std | difference |", "|---|---|---|---|---|"]
    for fraction, row in pooled["label"].items():
      lines.append(f"| {100 * float(fraction):g} | {row['studies']} | {_ms(row[arm])} | "
                   f"{_ms(row['scratch'])} | {100 * row['difference']:+.1f} |")
  return "\n".join(lines) + "\n"


def write_figure(pooled: dict, path: pathlib.Path) -> None:
  """pooled.png: every pair's difference (points), per study, with the pooled mean and target."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for i, s in enumerate(pooled["studies"]):
    values = [100 * d for d in s["differences"]]
    ax.scatter([i] * len(values), values, zorder=3)
    ax.hlines(statistics.mean(values), i - 0.25, i + 0.25, color="gray")
  n = len(pooled["studies"])
  mean = 100 * pooled["pooled"]["difference"]["mean"]
  ax.axhline(mean, color="C3", label=f"pooled mean {mean:+.2f}")
  target = pooled["target_points"]
  ax.axhline(target, color="k", ls="--", label=f"target +{target}")
  ax.axhline(0, color="k", lw=0.5)
  ax.set_xticks(range(n))
  ax.set_xticklabels([f"{pathlib.Path(s['folder']).name}\n(pretraining seed "
                      f"{','.join(map(str, s['pretrain_seeds']))})" for s in pooled["studies"]],
                     fontsize=8)
  ax.set_xlim(-0.6, n - 0.4)
  ax.set_ylabel("SST-2 val: pretrained − scratch (points)")
  ax.set_title(f"{pooled['arm']}: difference per fine-tuning seed", fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="pool.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("--studies", required=True,
                      help="comma-separated folders written by run.py (one per pretraining seed)")
  parser.add_argument("--arm", default="imdb_sst2vocab", help="the pretrained arm to pool")
  parser.add_argument("--out", required=True, help="folder for pooled.json, .md and .png")
  args = parser.parse_args(argv)
  try:
    pooled = pool([pathlib.Path(f) for f in args.studies.split(",") if f], args.arm)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pooled.json").write_text(json.dumps(pooled, indent=2) + "\n")
    table = pooled_table(pooled)
    (out / "pooled.md").write_text(table)
    write_figure(pooled, out / "pooled.png")
  except (PoolError, OSError) as e:
    print(f"pool.py: error: {e}", file=sys.stderr)
    return 2
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
