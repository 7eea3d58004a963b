"""The data-parallel train step on CPU devices: per device with one all-reduce, or the compiler's split.

attnlab's nano GPT (configs/gpt.py:size=nano) on `--devices` CPU devices of one process
(`mesh.cpu_devices`), with two versions of the same train step (train.make_train_step):
- `per_device=True`, the trainer's choice: each device runs the step on its slice of the batch
  (`jax.shard_map`) and one all-reduce sums the gradients (plus one for the loss's sum and count);
- `per_device=False`: the whole step left to XLA's partitioner, which all-reduces the gradients
  in groups (18 all-reduces per step for the nano model).
Both are compiled in one process, each with its own state and batch iterator, and they alternate
every `--chunk` steps for `--rounds` rounds (the order flips each round; the first two rounds are
dropped), so that the machine's drift hits both alike. Each step is timed as the trainer runs it:
fetch the batch, step, host sync on the loss. Printed: median ms per step of each, their ratio,
the number of all-reduces in each compiled step, and the last loss of each (the two follow the
same batches, so they agree up to float rounding).

  python experiments/benchmarks/dp_step.py                       # learned and rotary, 20 rounds
  python experiments/benchmarks/dp_step.py --positions=rotary --rounds=40 --chunk=5
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"


def build(position: str, devices: int, per_device: bool, data_dir: str) -> dict:
  from attnlab import config_utils, parallel, tasks, train  # pylint: disable=g-import-not-at-top
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top
  from attnlab.backends import cpu as cpu_backend  # pylint: disable=g-import-not-at-top
  config = config_utils.load_config_file(
      f"{REPO / 'configs' / 'gpt.py'}:size=nano,model.position={position},"
      f"data.manual_dir={data_dir},num_train_steps=2000,mesh.cpu_devices={devices}")
  cpu_backend.enable(config)  # as the trainer: the allocator, the device split (the first call)
  mesh = parallel.make_mesh(config)
  task = tasks.build_task(config)
  parts = state_lib.training(task, config, mesh)  # what the trainer builds
  step = train.make_train_step(task, parts.tx, parts.schedule, mesh=mesh,
                               state_shardings=parts.shardings, per_device=per_device)
  state = state_lib.initial_state(task, parts.tx, parts.init_rng, 1, mesh, parts.shardings)
  batches, rng = parts.batches, parts.train_rng
  batch = next(batches)
  hlo = step.lower(state, batch, rng).compile().as_text()
  state, metrics = step(state, batch, rng)
  float(metrics["loss"])
  assert step.per_device is per_device, "the step did not take the path asked for"
  return {"step": step, "state": state, "batches": batches, "rng": rng, "times": [], "loss": None,
          "all_reduces": sum(" all-reduce(" in line for line in hlo.splitlines())}


def run(contenders: dict, rounds: int, chunk: int) -> None:
  names = list(contenders)
  for r in range(rounds):
    for name in names if r % 2 == 0 else names[::-1]:
      c = contenders[name]
      for _ in range(chunk):
        t0 = time.perf_counter()
        batch = next(c["batches"])
        c["state"], metrics = c["step"](c["state"], batch, c["rng"])
        c["loss"] = float(metrics["loss"])  # host sync, as the trainer's logging
        if r >= 2:
          c["times"].append((time.perf_counter() - t0) * 1e3)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--positions", default="learned,rotary")
  parser.add_argument("--devices", type=int, default=2, help="CPU devices (mesh.cpu_devices)")
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--chunk", type=int, default=10, help="steps per contender and round")
  parser.add_argument("--data_dir", default=str(SHARED / "data"))
  args = parser.parse_args(argv)
  if args.rounds < 3:
    parser.error(f"--rounds must be >= 3 (the first two rounds are warm-up), got {args.rounds}")
  uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
  print(f"uptime before: {uptime()}")
  rows = []
  for position in args.positions.split(","):
    contenders = {mode: build(position, args.devices, mode == "per_device", args.data_dir)
                  for mode in ("per_device", "compiler_split")}
    run(contenders, args.rounds, args.chunk)
    ms = {mode: statistics.median(c["times"]) for mode, c in contenders.items()}
    rows.append((position, ms, contenders))
    print(f"  {position}: per device {ms['per_device']:.1f} ms, compiler's split "
          f"{ms['compiler_split']:.1f} ms", flush=True)
  print(f"uptime after: {uptime()}")
  print(f"\nnano GPT train step on {args.devices} CPU devices, median ms over "
        f"{args.rounds - 2} rounds x {args.chunk} steps, alternating in one process")
  print("| position | per device, one all-reduce | compiler's split | split ms / per-device ms "
        "| all-reduces (per device / split) | last loss (per device / split) |")
  print("|---|---|---|---|---|---|")
  for position, ms, c in rows:
    p, s = c["per_device"], c["compiler_split"]
    print(f"| {position} | {ms['per_device']:.1f} | {ms['compiler_split']:.1f} | "
          f"**{ms['compiler_split'] / ms['per_device']:.2f}x** | {p['all_reduces']} / "
          f"{s['all_reduces']} | {p['loss']:.5f} / {s['loss']:.5f} |")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  raise SystemExit(main())
