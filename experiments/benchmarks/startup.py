"""Where a whole `attnlab train` run's time goes: time to the first log line and to the first train
step, with an empty and with a warm JAX compilation cache, and the run's phase line.

Each measurement is one `attnlab train` process (`python -m attnlab.cli train`), as a user starts
it, timed from its start: the first line it writes (the first log line), the line "first train
step done" (the train step traced, compiled or loaded from the cache, and run once), its exit, and
the seconds of each phase that the run logs at its end ("run phases: setup ..., first step
(compile) ..., ...": attnlab/train.py). "cold" runs with an empty compilation cache of its own
(ATTNLAB_COMPILATION_CACHE pointed at a new folder: a user's first run of a config), "warm" with
the cache the cold run just filled (the same command run again: a resume, a second seed).

Several code trees can be compared (--trees: folders holding an attnlab checkout, e.g. an export
of the commit before a change and the working tree): every round runs each tree's cold and warm
runs, the trees' order alternating from round to round, so that the load of a shared machine falls
on all of them alike. The table gives medians over rounds and the load average around them.

  python experiments/benchmarks/startup.py                                 # this tree, 3 rounds
  python experiments/benchmarks/startup.py --trees=/tmp/before,. --rounds=3
  python experiments/benchmarks/startup.py --arg=runlocal=True --rounds=5
  python experiments/benchmarks/startup.py --trees=/tmp/before,. --arg=num_train_steps=2000 \
      --kinds=cold --rounds=2                                  # whole default runs, first runs

`timed_train` and `parse_phases` are also gpt_vs_nanogpt.py's whole-run measurement.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/machine.py
import machine  # pylint: disable=g-bad-import-order,wrong-import-position

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
FIRST_STEP = "first train step done"
PHASES = "run phases: "


def parse_phases(line: str) -> dict[str, float]:
  """{phase: seconds} of a run's "run phases: a 1.0 s, b 2.0 s, other 0.1 s; total 3.1 s; x 1.0 s
  in the background" line (the background items are named "x (background)")."""
  body = line.split(PHASES, 1)[1]
  head, *tail = body.split("; ")
  out = {}
  for part in head.split(", "):
    name, value = part.rsplit(" ", 2)[0], part.rsplit(" ", 2)[1]
    out[name] = float(value)
  for part in tail:
    if part.startswith("total "):
      out["total"] = float(part.split()[1])
    elif part.endswith(" s in the background"):
      name, value = part[:-len(" s in the background")].rsplit(" ", 1)
      out[f"{name} (background)"] = float(value)
  return out


def timed_train(tree: pathlib.Path, arg: str, workdir: pathlib.Path, cache: str | None,
                config: str = "configs/gpt.py") -> dict[str, float]:
  """Runs `attnlab train --config=<config>:<arg>` from `tree` (its attnlab imported); returns the
  seconds from the process start to its first output line ("first line"), to the first train
  step's line ("first step"), to its exit ("exit"), the run's phases (`parse_phases`) and the
  final validation loss ("val loss") when the run logged one. `cache`: the compilation cache
  folder (None: the user's)."""
  # The tree first; the rest of PYTHONPATH stays (dependencies installed outside site-packages)
  path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
  env = dict(os.environ, TQDM_DISABLE="1", PYTHONPATH=path)
  if cache is not None:
    env["ATTNLAB_COMPILATION_CACHE"] = cache
  cmd = [sys.executable, "-m", "attnlab.cli", "train", f"--config={config}:{arg}",
         f"--workdir={workdir}"]
  times: dict[str, float] = {}
  lines: list[str] = []
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1)

  def read() -> None:
    for line in proc.stdout:
      now = time.perf_counter() - start
      lines.append(line.rstrip("\n"))
      times.setdefault("first line", now)
      if FIRST_STEP in line:
        times.setdefault("first step", now)
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  code = proc.wait()
  times["exit"] = time.perf_counter() - start
  reader.join()
  if code:
    raise RuntimeError(f"attnlab train failed ({code}) in {tree}:\n" + "\n".join(lines[-30:]))
  for line in lines:
    if PHASES in line:
      times.update(parse_phases(line))
    if " eval: loss=" in line:
      times["val loss"] = float(line.split(" eval: loss=")[1].split(",")[0])
  return times


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--trees", default=str(REPO),
                      help="comma-separated attnlab checkouts to compare (default: this one)")
  parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
  parser.add_argument("--arg", default="num_train_steps=2,eval_every=1000",
                      help="the config arg of configs/gpt.py (default: a 2-step default run)")
  parser.add_argument("--data_dir", default=str(SHARED / "data"),
                      help="folder with tinyshakespeare/input.txt (data.manual_dir)")
  parser.add_argument("--kinds", default="cold,warm",
                      help="which runs: cold (an empty cache), warm (the cold run's cache; "
                      "without cold, an untimed run fills it first)")
  args = parser.parse_args(argv)
  trees = [pathlib.Path(t).resolve() for t in args.trees.split(",") if t]
  arg = f"{args.arg},data.manual_dir={args.data_dir}" if args.data_dir else args.arg
  print(machine.cpu_line())
  print(f"{machine.cores()} CPUs; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"at start; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; arg {args.arg}")
  scratch = pathlib.Path(tempfile.mkdtemp(prefix="attnlab_startup_"))
  results: dict[tuple[str, str], list[dict[str, float]]] = {}
  loads = []
  try:
    for r in range(args.rounds):
      order = trees[r % len(trees):] + trees[:r % len(trees)]
      for tree in order:
        cache = str(scratch / f"cache_{r}_{tree.name}")
        kinds = [k for k in ("cold", "warm") if k in args.kinds.split(",")]
        for kind in kinds:
          if kinds == ["warm"]:  # fill it, untimed
            timed_train(tree, arg, scratch / f"fill_{r}_{tree.name}", cache)
          times = timed_train(tree, arg, scratch / f"run_{r}_{tree.name}_{kind}", cache)
          load = os.getloadavg()[0]
          loads.append(load)
          results.setdefault((str(tree), kind), []).append(times)
          print(f"  round {r + 1}: {tree} {kind}: first line {times['first line']:.1f} s, first "
                f"step {times.get('first step', float('nan')):.1f} s, exit {times['exit']:.1f} s; "
                f"load {load:.2f}", flush=True)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)

  names: list[str] = []
  for runs in results.values():
    for times in runs:
      names += [n for n in times if n not in names and n != "val loss"]
  print(f"\nseconds, median over {args.rounds} rounds (load average {min(loads):.1f}-"
        f"{max(loads):.1f}; {time.strftime('%Y-%m-%d %H:%M')})")
  print("| " + " | ".join(["tree", "cache", *names]) + " |")
  print("|" + "---|" * (len(names) + 2))
  for (tree, kind), runs in results.items():
    cells = []
    for name in names:
      values = [t[name] for t in runs if name in t]
      cells.append(f"{statistics.median(values):.1f}" if values else "-")
    print(f"| {tree} | {kind} | " + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
