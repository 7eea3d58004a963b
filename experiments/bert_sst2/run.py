"""BERT on SST-2: MLM + NSP pretraining, then [CLS] fine-tuning, against fine-tuning from scratch.

  python experiments/bert_sst2/run.py [--workdir=runs/bert_sst2] [--size=tiny] [--seeds=0,1,2] \
      [--pretrain_seeds=0,1,2] [--pretrain_args=num_train_steps=6000] \
      [--finetune_args=num_train_steps=2000] [--manual_dir=../shared/data]

For each seed s: a pretraining run WORKDIR/pretrain_s<p> (p = pretrain_seeds[i % len], default
p = s), a fine-tuning run WORKDIR/finetune_s<s> initialised from it, and a from-scratch run
WORKDIR/scratch_s<s>; all use configs/bert.py with the given size and extra args (any
`key=value` the config file accepts, comma separated). Every run is an ordinary resumable attnlab
run: re-running the command skips finished runs. Writes WORKDIR/results.json and
WORKDIR/results.md (MLM and NSP accuracy on held-out Shakespeare pairs, SST-2 validation
accuracy of both, mean ± std over seeds, and the wall time of each stage); the head-view and
[CLS] attention plots are in each run's folder (head_view.png, cls_attention.png).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]

from absl import flags  # pylint: disable=g-import-not-at-top

from attnlab import main as main_lib  # pylint: disable=g-import-not-at-top

CONFIG_FILE = REPO / "configs" / "bert.py"


def _define_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  flags.DEFINE_string("workdir", "runs/bert_sst2", "Output folder (one sub-folder per run).",
                      flag_values=fv)
  flags.DEFINE_string("size", "tiny", "Encoder size: tiny (BERT-Tiny), mini or test.",
                      flag_values=fv)
  flags.DEFINE_string("score", "scaled_dot", "Attention score name.", flag_values=fv)
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of the fine-tuning and scratch runs.",
                    flag_values=fv)
  flags.DEFINE_list("pretrain_seeds", [], "Seeds of the pretraining runs (default: --seeds); "
                    "fine-tuning seed i starts from pretrain_seeds[i % len].", flag_values=fv)
  flags.DEFINE_string("pretrain_args", "", "Extra key=value,... for the pretraining config.",
                      flag_values=fv)
  flags.DEFINE_string("finetune_args", "", "Extra key=value,... for both SST-2 configs.",
                      flag_values=fv)
  flags.DEFINE_string("manual_dir", str(REPO.parent / "shared" / "data"),
                      "Folder with the raw data files ('' = $ATTNLAB_DATA_DIR or download).",
                      flag_values=fv)
  flags.DEFINE_string("data_dir", "", "TFDS data dir for the prepared datasets.", flag_values=fv)
  return fv


def _config(mode: str, fv: flags.FlagValues, seed: int, extra: str):
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  parts = [f"mode={mode}", f"size={fv.size}", f"score={fv.score}", f"seed={seed}"]
  if fv.manual_dir and pathlib.Path(fv.manual_dir).is_dir():
    parts.append(f"data.manual_dir={pathlib.Path(fv.manual_dir).absolute()}")
  if fv.data_dir:
    parts.append(f"data.data_dir={fv.data_dir}")
  if extra:
    parts.append(extra)
  return config_utils.load_config_file(f"{CONFIG_FILE}:{','.join(parts)}")


def _run(config, workdir: pathlib.Path, timings: dict[str, float]) -> dict[str, float]:
  """Trains (or resumes/reuses) one run; returns its last eval record."""
  from attnlab import checkpoint  # pylint: disable=g-import-not-at-top
  from attnlab import train  # pylint: disable=g-import-not-at-top
  start = time.time()
  train.train_and_evaluate(config, workdir)
  timings[workdir.name] = time.time() - start
  return checkpoint.last_records(checkpoint.read_metrics(workdir))["eval"]


def _mean_std(values: list[float]) -> str:
  if not values:
    return "-"
  if len(values) == 1:
    return f"{100 * values[0]:.1f} (one run)"
  return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def run_study(fv: flags.FlagValues) -> dict:
  """Runs every stage; returns the results dict written to results.json."""
  workdir = pathlib.Path(fv.workdir).absolute()
  seeds = [int(s) for s in fv.seeds]
  pretrain_seeds = [int(s) for s in (fv.pretrain_seeds or fv.seeds)]
  timings: dict[str, float] = {}
  pretrain = {}
  for p in pretrain_seeds:
    pretrain[p] = _run(_config("pretrain", fv, p, fv.pretrain_args), workdir / f"pretrain_s{p}",
                       timings)
  rows = []
  for i, s in enumerate(seeds):
    p = pretrain_seeds[i % len(pretrain_seeds)]
    ft_config = _config("finetune", fv, s, fv.finetune_args)
    ft_config.init_from = str(workdir / f"pretrain_s{p}")
    finetuned = _run(ft_config, workdir / f"finetune_s{s}", timings)
    scratch = _run(_config("finetune", fv, s, fv.finetune_args), workdir / f"scratch_s{s}",
                   timings)
    rows.append({"seed": s, "pretrain_seed": p, "mlm_accuracy": pretrain[p]["mlm_accuracy"],
                 "nsp_accuracy": pretrain[p]["nsp_accuracy"],
                 "sst2_pretrained": finetuned["accuracy"], "sst2_scratch": scratch["accuracy"]})
  results = {"size": fv.size, "score": fv.score, "pretrain_args": fv.pretrain_args,
             "finetune_args": fv.finetune_args, "rows": rows, "seconds": timings}
  (workdir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
  (workdir / "results.md").write_text(results_table(results))
  return results


def results_table(results: dict) -> str:
  """The markdown table of results.json."""
  lines = [f"BERT size {results['size']}, score {results['score']}; pretrain args "
           f"`{results['pretrain_args'] or '-'}`, fine-tune args `{results['finetune_args'] or '-'}`",
           "",
           "| seed | pretrain run | MLM acc % | NSP acc % | SST-2 val % (pretrained) | "
           "SST-2 val % (scratch) |",
           "|---|---|---|---|---|---|"]
  rows = results["rows"]
  for r in rows:
    lines.append(f"| {r['seed']} | s{r['pretrain_seed']} | {100 * r['mlm_accuracy']:.1f} | "
                 f"{100 * r['nsp_accuracy']:.1f} | {100 * r['sst2_pretrained']:.1f} | "
                 f"{100 * r['sst2_scratch']:.1f} |")
  pretrain_rows = {r["pretrain_seed"]: r for r in rows}.values()
  lines.append(f"| mean ± std | | {_mean_std([r['mlm_accuracy'] for r in pretrain_rows])} | "
               f"{_mean_std([r['nsp_accuracy'] for r in pretrain_rows])} | "
               f"{_mean_std([r['sst2_pretrained'] for r in rows])} | "
               f"{_mean_std([r['sst2_scratch'] for r in rows])} |")
  lines += ["", "Wall time per run (s): " + ", ".join(
      f"{name} {sec:.0f}" for name, sec in results["seconds"].items()), ""]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv if argv is None else argv)
  fv = _define_flags()
  try:
    extra = fv(argv)
  except flags.Error as e:
    print(f"run.py: error: {e}", file=sys.stderr)
    return main_lib.USAGE_ERROR
  if len(extra) > 1:
    print(f"run.py: error: unexpected arguments {extra[1:]}", file=sys.stderr)
    return main_lib.USAGE_ERROR
  main_lib.setup_logging()

  def body() -> None:
    results = run_study(fv)
    print(results_table(results))
    print(f"results: {pathlib.Path(fv.workdir).absolute() / 'results.md'}")
  return main_lib.run_tool("run.py", body)


if __name__ == "__main__":
  sys.exit(main())
