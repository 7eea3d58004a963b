"""One config's train step as the trainer builds it: its time, and where that time goes.

  python experiments/benchmarks/step_profile.py                       # the nano GPT, 150 steps
  python experiments/benchmarks/step_profile.py --profile             # + XLA:CPU's thunks
  ATTNLAB_XLA_TUNING=0 python experiments/benchmarks/step_profile.py  # without attnlab's XLA flag
  python experiments/benchmarks/step_profile.py \
      --arg=size=nano,dataset=synthetic_tokens,data.vocab_size=65,matmul_precision=float32
  python experiments/benchmarks/step_profile.py --config=configs/bert.py --arg=runlocal=False
  python experiments/benchmarks/step_profile.py --loops=6 --steps=300   # the trainer's loop too

The step is built as `gpt_vs_nanogpt.py`'s worker builds it (`train_pieces`: the CPU tuning of
`attnlab.backends.cpu.enable`, the task, the optimizer, the train step on the config's mesh) and
timed the same way: fetch the batch, run the step, read the loss (a host sync); the median over
`--steps` steps after `--warmup`. The nano GPT's default reads `dataset=synthetic_tokens` with
the Shakespeare vocabulary's 65 ids (the same shapes and work; no corpus, so it runs where
../shared/data is absent, e.g. on a device machine's host). XLA_FLAGS and ATTNLAB_XLA_TUNING are
read at start, so compare settings in separate processes, alternating.

--loops=R: R alternating rounds of `--steps` steps in each of two loops, the same compiled step
in one process: this script's loop (a host sync every step) and `attnlab train`'s
(train.StepsInFlight: up to train.MAX_STEPS_AHEAD steps in flight); each round's mean ms a step
(wall time / steps, which is what a run's "training steps" phase adds up), then their medians.

--profile: 20 more steps under `jax.profiler.trace`; prints the milliseconds per step of each
kind of event (XLA:CPU's thunks: YNNPACK's dot fusions `ynn_fusion`, XLA's loop fusions, the
all-reduce and the devices' waits for each other), summed over the threads of one kind.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpt_vs_nanogpt  # pylint: disable=g-bad-import-order,wrong-import-position
import machine  # pylint: disable=g-bad-import-order,wrong-import-position

REPO = pathlib.Path(__file__).resolve().parents[2]
GPT_ARG = "size=nano,dataset=synthetic_tokens,data.vocab_size=65"


def profile(step, state, batches, rng, steps: int = 20, top: int = 30) -> list[str]:
  """Lines `ms/step  calls/step  thread-kind  event` of `steps` traced steps, largest first."""
  import jax  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      gpt_vs_nanogpt.run_steps(state, step, batches, rng, steps)
    path = sorted(glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
      events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  threads = {(e["pid"], e["tid"]): re.sub(r"/-?\d+$", "", e["args"]["name"])
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
  total, calls = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X":
      key = (threads.get((e["pid"], e["tid"]), "?")[:24], re.sub(r"[.\d]+$", "", e["name"])[:60])
      total[key] += e["dur"]
      calls[key] += 1
  return [f"{us / 1e3 / steps:8.2f} {calls[k] / steps:7.1f}  {k[0]:24s} {k[1]}"
          for k, us in total.most_common(top)]


def run_ahead(state, step, batches, rng, steps: int):
  """(state, mean ms a step) of `steps` steps dispatched as `attnlab train`'s loop dispatches
  them (`train.StepsInFlight`: at most train.MAX_STEPS_AHEAD in flight)."""
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab import train  # pylint: disable=g-import-not-at-top
  in_flight = train.StepsInFlight()
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, next(batches), rng)
    in_flight.add(metrics["loss"])
  jax.block_until_ready(state)  # the last step's output: every step before it has finished
  return state, (time.perf_counter() - t0) * 1e3 / steps


def run_synced(state, step, batches, rng, steps: int):
  """(state, mean ms a step) of `gpt_vs_nanogpt.run_steps`: a host sync every step."""
  state, times = gpt_vs_nanogpt.run_steps(state, step, batches, rng, steps)
  return state, sum(times) / steps


def compare_loops(state, step, batches, rng, steps: int, rounds: int):
  """(state, lines): per round, the mean ms a step of this script's loop (`run_synced`) and of
  the trainer's (`run_ahead`), alternating which goes first; then the medians over the rounds."""
  loops = {"sync": run_synced, "trainer": run_ahead}
  means = {name: [] for name in loops}
  lines = ["round  sync loop ms  trainer's loop ms  (mean a step)"]
  for r in range(rounds):
    for name in (list(loops) if r % 2 == 0 else list(loops)[::-1]):
      state, mean = loops[name](state, step, batches, rng, steps)
      means[name].append(mean)
    lines.append(f"{r + 1:5d}  {means['sync'][-1]:12.2f}  {means['trainer'][-1]:17.2f}")
  sync, ahead = (statistics.median(means[k]) for k in loops)
  lines.append(f"median {sync:11.2f}  {ahead:17.2f}  (trainer's / sync: {ahead / sync:.3f})")
  return state, lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/gpt.py", help="config file (repo-relative)")
  parser.add_argument("--arg", default=None,
                      help=f"the config's arg (default for configs/gpt.py: {GPT_ARG})")
  parser.add_argument("--steps", type=int, default=150, help="timed steps")
  parser.add_argument("--warmup", type=int, default=30, help="untimed steps after the first")
  parser.add_argument("--profile", action="store_true", help="also trace 20 steps")
  parser.add_argument("--loops", type=int, default=0,
                      help="also R alternating rounds of this loop and the trainer's loop")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.warmup < 0 or args.loops < 0:
    parser.error("--steps must be >= 1, --warmup and --loops >= 0")
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  arg = args.arg if args.arg is not None else (GPT_ARG if args.config == "configs/gpt.py" else "")
  config = config_utils.load_config_file(f"{REPO / args.config}:{arg}")
  print(machine.cpu_line())
  print(machine.uptime())
  state, step, batches, rng = gpt_vs_nanogpt.train_pieces(config)
  import jax  # pylint: disable=g-import-not-at-top
  print(f"jax {jax.__version__}, {len(jax.devices())} device(s); XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')!r}; {args.config}:{arg}")
  state, (first,) = gpt_vs_nanogpt.run_steps(state, step, batches, rng, 1)
  print(f"first step (compile included) {first / 1e3:.2f} s")
  state, _ = gpt_vs_nanogpt.run_steps(state, step, batches, rng, args.warmup)
  state, times = gpt_vs_nanogpt.run_steps(state, step, batches, rng, args.steps)
  print(f"median step {statistics.median(times):.2f} ms ({args.steps} steps)")
  if args.loops:
    state, lines = compare_loops(state, step, batches, rng, args.steps, args.loops)
    print("\n".join(lines))
  if args.profile:
    print("ms/step calls/step  threads                  event")
    print("\n".join(profile(step, state, batches, rng)))
  print(machine.uptime())
  return 0


if __name__ == "__main__":
  sys.exit(main())
