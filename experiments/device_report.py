"""The records of every run under a folder, printed for a device call's log (the device scripts,
experiments/long_range/device.sh and experiments/bert_sst2/device.sh, end with it).

  python experiments/device_report.py ROOT [--test_pilots]

For each run folder under ROOT (one holding metrics.jsonl; links are not followed, so a folder
that links other runs' arms lists only its own runs): its last training step and speed, every
evaluation record (its float metrics, and the per-seed accuracy of vmapped seeds) and the
training loss every 1000 steps. --test_pilots: a run whose config evaluates on the validation
split (a pilot chosen there) also has its last checkpoint evaluated on the test split.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib


def _report(folder: pathlib.Path, root: pathlib.Path, test_pilots: bool) -> None:
  records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
             if line.strip()]
  config_path = folder / "config.json"
  config = json.loads(config_path.read_text()) if config_path.is_file() else {}
  split = config.get("data", {}).get("eval_split")
  train = [r for r in records if r.get("split") == "train"]
  print(f"== {folder.relative_to(root)}" + (f"  split={split}" if split else "")
        + f" steps={config.get('num_train_steps')} last_train_step="
        f"{train[-1]['step'] if train else 0} steps/s="
        f"{train[-1].get('steps_per_sec', 0) if train else 0:.1f}")
  for r in records:
    if r.get("split") == "eval":
      metrics = {k: round(v, 4) for k, v in r.items() if isinstance(v, float) and k != "wall_time"}
      seeds = r.get("per_seed", {}).get("accuracy")
      print(f"   step {r['step']:>6} eval {metrics}"
            + (f" per seed {[round(100 * a, 2) for a in seeds]}" if seeds else ""))
    elif r.get("split") == "train" and r["step"] % 1000 == 0:
      print(f"   step {r['step']:>6} train loss {r['loss']:.4f}")
  if test_pilots and split == "validation" and (folder / "checkpoints").is_dir():
    # A pilot chosen on the validation split is reported on the test split: its last checkpoint.
    # pylint: disable=g-import-not-at-top
    from attnlab import state as state_lib, tasks
    from attnlab.analysis.runs import load_run
    run = load_run(folder, replica=None)
    test_config = run.config.copy_and_resolve_references()
    test_config.data.eval_split = "test"
    n = state_lib.num_seeds_of(test_config)
    mean, per_seed = state_lib.evaluate(tasks.build_task(test_config), run.params, n)
    seeds = per_seed["accuracy"] if per_seed else [mean["accuracy"]]
    print(f"   step {run.step:>6} TEST acc {100 * mean['accuracy']:.2f} "
          f"per seed {[round(100 * a, 2) for a in seeds]}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("root")
  parser.add_argument("--test_pilots", action="store_true",
                      help="evaluate validation-split runs' last checkpoint on the test split")
  args = parser.parse_args(argv)
  root = pathlib.Path(args.root)
  for folder in sorted(pathlib.Path(d) for d, _, files in os.walk(root)
                       if "metrics.jsonl" in files):
    _report(folder, root, args.test_pilots)
  for name in ("results.md", "label_efficiency.md"):
    for path in sorted(root.glob(f"*/{name}")):
      print(f"== {path.relative_to(root)}\n{path.read_text()}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
