"""attnlab's nano GPT against the real nanoGPT on the CPU: ms per iteration and 2000-step wall time.

nanoGPT is run, unmodified, from its export in ../shared/anchors/nanogpt (MIT licence; nothing of
it is copied here): its files are copied into a scratch folder, its Tiny Shakespeare data is
prepared offline from ../shared/data/tinyshakespeare/input.txt (its prepare.py minus the
download), and its train.py runs with the documented CPU setting
(`config/train_shakespeare_char.py --device=cpu --compile=False --block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0`, see its README).

attnlab's contenders are its nano GPT (configs/gpt.py, the same architecture and recipe) with a
learned position table (`model.position=learned`: nanoGPT's architecture exactly) and with the
default rotary positions, each with the default config (`learned`, `rotary`: on a CPU-only
machine `mesh.cpu_devices=-1` gives one JAX device per core, each step's batch split over them,
the gradients summed; what `attnlab train` does), on one device (`learned_1dev`, `rotary_1dev`:
`mesh.cpu_devices=1`), with `mesh.cpu_devices=0` (`learned_dp`, `rotary_dp`, the split asked
for explicitly: the same as the default on a CPU-only machine) and with float32 products
(`learned_f32`, `rotary_f32`: `matmul_precision=float32`; the default, auto, trains on bfloat16
operands where the CPU has AVX512_BF16 or AMX, while nanoGPT's CPU setting is float32). Each attnlab
worker is this script started with --worker: it builds the real trainer (task, optimizer, train
step on the config's mesh, training-batch iterator) and times every step the way nanoGPT's loop
times an iteration: fetch the batch, train step, and a host sync on the loss (nanoGPT's
`loss.item()`), wall clock from one step to the next.

Timing rounds: every contender is a fresh process per round, the order rotates from round to
round, and each process runs the same number of iterations; the first --skip iterations of each
(compilation, warm-up, nanoGPT's step-0 evaluation) are dropped and the median of the rest is the
round's figure. The table reports the median over rounds and the ratio nanoGPT ms / attnlab ms
(= attnlab's iterations per second over nanoGPT's; > 1 means attnlab is faster).

Wall time (--wall_steps, default 2000): one full training run of each, as a user launches it,
start of the process to its exit: nanoGPT's command above with --max_iters=2000 (evaluation every
250 iterations on 20 train and 20 validation batches, as its README's command), and
`attnlab train --config=configs/gpt.py:...` (its defaults: evaluation every 250 steps on the first
512 validation windows, `eval_batches=16` of `data.eval_batch_size=32`, and on the whole validation text after the
last step; checkpoints every 500 steps), each attnlab run with an empty JAX compilation cache of
its own (a user's first run; --warm_cache: the user's cache, a second run). The final validation
loss of each is printed beside its time (nanoGPT estimates it on 20 batches, attnlab on the whole
validation text), and for attnlab the seconds from its start to its first log line and to its
first train step, and the phases its log ends with (startup.py's `timed_train`).

  python experiments/benchmarks/gpt_vs_nanogpt.py                          # 3 rounds x 300 iters + wall
  python experiments/benchmarks/gpt_vs_nanogpt.py --rounds=5 --iters=400 --wall_steps=0
  python experiments/benchmarks/gpt_vs_nanogpt.py --rounds=0 --wall_steps=2000   # wall time only
  python experiments/benchmarks/gpt_vs_nanogpt.py --rounds=0 --wall_contenders=nanogpt,rotary \
      --wall_rounds=5                      # 5 alternating pairs, per-pair ratios and their median
  python experiments/benchmarks/gpt_vs_nanogpt.py --contenders=nanogpt,learned --rounds=3

Needs torch and numpy for nanoGPT (`pip install -e '.[torch]'`, CPU build).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/machine.py
import machine  # pylint: disable=g-bad-import-order,wrong-import-position
import startup  # pylint: disable=g-bad-import-order,wrong-import-position

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"

# nanoGPT's documented CPU setting (its README in ../shared/anchors/nanogpt)
NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
                "--n_layer=4", "--n_head=4", "--n_embd=128", "--lr_decay_iters=2000",
                "--dropout=0.0"]
ITER_LINE = re.compile(r"^iter (\d+): loss [-\d.naif]+, time ([\d.]+)ms")
VAL_LINE = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


# ----------------------------------------------------------------------------- nanoGPT


def copy_nanogpt(scratch: pathlib.Path, nanogpt_dir: pathlib.Path) -> pathlib.Path:
  """nanoGPT's files copied, unmodified, into scratch/nanogpt (once); returns that folder."""
  work = scratch / "nanogpt"
  if not (work / "train.py").exists():
    shutil.copytree(nanogpt_dir, work, dirs_exist_ok=True)
  return work


def prepare_nanogpt(scratch: pathlib.Path, nanogpt_dir: pathlib.Path,
                    data_dir: pathlib.Path) -> pathlib.Path:
  """Copies nanoGPT into scratch/nanogpt and prepares its data offline; returns that folder."""
  work = scratch / "nanogpt"
  if (work / "data" / "shakespeare_char" / "train.bin").exists():
    return work
  copy_nanogpt(scratch, nanogpt_dir)
  char_dir = work / "data" / "shakespeare_char"
  shutil.copy(data_dir / "tinyshakespeare" / "input.txt", char_dir / "input.txt")
  source = (char_dir / "prepare.py").read_text()
  (char_dir / "prepare_local.py").write_text(re.sub(r"(?m)^import requests\s*$", "", source))
  subprocess.run([sys.executable, "prepare_local.py"], cwd=char_dir, check=True,
                 stdout=subprocess.DEVNULL)
  return work


def run_nanogpt(work: pathlib.Path, iters: int, eval_interval: int, out_dir: pathlib.Path,
                passive: bool = False, args: list[str] | None = None):
  """Runs nanoGPT's train.py for `iters` iterations: (per-iter ms list, wall s, last val loss).

  passive: OMP_WAIT_POLICY=PASSIVE in its environment (torch's OpenMP threads sleep instead of
  spinning; nanoGPT itself unchanged). args: its config arguments (default NANOGPT_ARGS, the CPU
  setting; benchmarks/gpu.py passes its GPU setting).
  """
  cmd = [sys.executable, "train.py", *(NANOGPT_ARGS if args is None else args),
         f"--max_iters={iters}",
         f"--eval_interval={eval_interval}", f"--out_dir={out_dir}"]
  env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE") if passive else None
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
  wall = time.perf_counter() - start
  if proc.returncode:
    raise RuntimeError(f"nanoGPT failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  times, val = [], None
  for line in proc.stdout.splitlines():
    if m := ITER_LINE.match(line):
      times.append(float(m.group(2)))
    elif m := VAL_LINE.match(line):
      val = float(m.group(3))
  return times, wall, val


# ----------------------------------------------------------------------------- attnlab


# attnlab contenders: name -> (model.position, mesh.cpu_devices, matmul_precision); None = the
# config's default. mesh.cpu_devices: -1 (default) on a CPU-only machine one JAX device per core,
# each running a slice of the batch; 0 = one device per core asked for explicitly (the same
# here); 1 = one device (the plain path). matmul_precision: auto (default) the train step's Dense
# products on bfloat16 operands where the CPU has AVX512_BF16 or AMX; float32 never (nanoGPT's
# CPU setting is float32 throughout).
ATTNLAB = {"learned": ("learned", None, None), "rotary": ("rotary", None, None),
           "learned_1dev": ("learned", 1, None), "rotary_1dev": ("rotary", 1, None),
           "learned_dp": ("learned", 0, None), "rotary_dp": ("rotary", 0, None),
           "learned_f32": ("learned", None, "float32"), "rotary_f32": ("rotary", None, "float32")}


def attnlab_arg(contender: str, implementation: str, data_dir: pathlib.Path, steps: int) -> str:
  position, cpu_devices, matmul = ATTNLAB[contender]
  mesh = "" if cpu_devices is None else f",mesh.cpu_devices={cpu_devices}"
  matmul = "" if matmul is None else f",matmul_precision={matmul}"
  return (f"size=nano,model.position={position},implementation={implementation},"
          f"data.manual_dir={data_dir},num_train_steps={steps}{mesh}{matmul}")


def worker(args) -> None:
  """Times `args.iters` attnlab train steps like nanoGPT's loop; prints them as JSON."""
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top

  arg = attnlab_arg(args.contender, args.implementation, pathlib.Path(args.data_dir), 2000)
  config = config_utils.load_config_file(f"{REPO / 'configs' / 'gpt.py'}:{arg}")
  print("TIMES " + json.dumps(time_train_steps(config, args.iters)), flush=True)


def train_pieces(config):
  """(state, train_step, batch iterator, train rng) as the trainer builds them for `config`
  (task, optimizer, train step on the config's mesh, training-batch iterator)."""
  from attnlab import parallel, tasks, train  # pylint: disable=g-import-not-at-top
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top
  from attnlab.backends import cpu as cpu_backend  # pylint: disable=g-import-not-at-top

  cpu_backend.enable(config)  # as the trainer: the allocator, the `mesh.cpu_devices` split
  mesh = parallel.make_mesh(config)
  task = tasks.build_task(config)
  parts = state_lib.training(task, config, mesh)  # what the trainer builds
  state = state_lib.initial_state(task, parts.tx, parts.init_rng, 1, mesh, parts.shardings)
  train_step = train.make_train_step(task, parts.tx, parts.schedule, mesh=mesh,
                                     state_shardings=parts.shardings)
  return state, train_step, parts.batches, parts.train_rng


def run_steps(state, train_step, iterator, train_rng, iters: int):
  """(state, ms of each step) after `iters` steps timed as nanoGPT's loop times an iteration:
  fetch the batch, train step, host sync on the loss; step to step wall clock."""
  times = []
  t0 = time.perf_counter()
  for _ in range(iters):
    batch = next(iterator)
    state, metrics = train_step(state, batch, train_rng)
    float(metrics["loss"])  # host sync, as nanoGPT's loss.item()
    t1 = time.perf_counter()
    times.append((t1 - t0) * 1e3)
    t0 = t1
  return state, times


def time_train_steps(config, iters: int) -> list[float]:
  """ms of each of `iters` steps (`run_steps`) of the real trainer's pieces for `config`
  (`train_pieces`)."""
  state, train_step, iterator, train_rng = train_pieces(config)
  return run_steps(state, train_step, iterator, train_rng, iters)[1]


def run_attnlab_worker(contender: str, args) -> list[float]:
  cmd = [sys.executable, __file__, "--worker", f"--contender={contender}",
         f"--iters={args.iters}", f"--implementation={args.implementation}",
         f"--data_dir={args.data_dir}"]
  # The worker imports attnlab from this checkout (installed or not); nanoGPT's runs above get no
  # such path: they only ever run in their own processes, from their scratch copy.
  path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
  proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path))
  if proc.returncode:
    raise RuntimeError(f"attnlab worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  line = next(l for l in proc.stdout.splitlines() if l.startswith("TIMES "))
  return json.loads(line[len("TIMES "):])


def run_attnlab_training(contender: str, args, workdir: pathlib.Path):
  """`attnlab train` for wall_steps steps: (wall s, final validation loss, startup.timed_train's
  times: first log line, first train step, exit and the run's phases)."""
  arg = attnlab_arg(contender, args.implementation, pathlib.Path(args.data_dir), args.wall_steps)
  # args.warm_cache: the user's cache; otherwise a user's first run, nothing compiled before
  cache = None if args.warm_cache else str(workdir.parent / f"jax_cache_{workdir.name}")
  times = startup.timed_train(REPO, arg, workdir, cache)
  val = None
  metrics = workdir / "metrics.jsonl"
  if metrics.exists():
    for line in metrics.read_text().splitlines():
      rec = json.loads(line)
      if rec.get("split") == "eval" and "loss" in rec:
        val = float(rec["loss"])
  return times["exit"], val, times


# ----------------------------------------------------------------------------- main


def print_timing_table(args, contenders, nanogpts, per_round, label) -> None:
  """The timing rounds' table: median ms per iteration over rounds, ratios to nanoGPT."""
  print(f"\nms per iteration: median over {args.rounds} alternating rounds of {args.iters} "
        f"iterations (first {args.skip} of each dropped)")
  print("| contender | ms/iter (rounds) | iters/s | "
        + " | ".join(f"{n} ms / this ms" for n in nanogpts) + " |")
  print("|---|---|---|" + "---|" * len(nanogpts))
  for c in contenders:
    med = statistics.median(per_round[c])
    rounds = ", ".join(f"{x:.1f}" for x in per_round[c])
    ratios = [f"**{statistics.median(per_round[n]) / med:.2f}x**" if c not in nanogpts else
              f"{statistics.median(per_round[n]) / med:.2f}x" for n in nanogpts]
    print(f"| {label[c]} | {med:.1f} ({rounds}) | {1e3 / med:.1f} | " + " | ".join(ratios)
          + " |")
  for n in nanogpts:
    for c in contenders:
      if c not in nanogpts:
        rr = [x / a for x, a in zip(per_round[n], per_round[c])]
        print(f"per-round ratio {n}/{c}: " + ", ".join(f"{x:.2f}" for x in rr))
  for learned, rotary in (("learned", "rotary"), ("learned_1dev", "rotary_1dev"),
                          ("learned_dp", "rotary_dp"), ("learned_f32", "rotary_f32")):
    if learned in per_round and rotary in per_round:
      ratio = statistics.median(per_round[rotary]) / statistics.median(per_round[learned])
      print(f"{rotary} / {learned} ms: {ratio:.3f}")
  print(f"load average after timing rounds: {os.getloadavg()[0]:.2f}", flush=True)


def print_wall_ratios(walls: dict[str, list[float]], label: dict[str, str]) -> None:
  """Whole runs over rounds: each contender's median, and each attnlab contender's per-round
  ratios to each nanoGPT contender of the same round (its wall s / attnlab's) and their median."""
  for c, values in walls.items():
    print(f"{label[c]}: median {statistics.median(values):.1f} s over {len(values)} rounds")
  for n in [c for c in walls if c.startswith("nanogpt")]:
    for c in [c for c in walls if not c.startswith("nanogpt")]:
      ratios = [a / b for a, b in zip(walls[n], walls[c])]
      print(f"whole-run ratio {n} s / {c} s per round: "
            + ", ".join(f"{x:.2f}" for x in ratios)
            + f"; median **{statistics.median(ratios):.2f}x**")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
  parser.add_argument("--iters", type=int, default=300, help="iterations per process and round")
  parser.add_argument("--skip", type=int, default=20,
                      help="first iterations of each process left out of its median")
  parser.add_argument("--contenders", default="nanogpt,learned,rotary,learned_1dev",
                      help="subset of nanogpt, nanogpt_passive (nanoGPT with "
                      "OMP_WAIT_POLICY=PASSIVE: torch's spinning OpenMP threads collapse when "
                      "another process holds a core), learned (attnlab's default config with "
                      "learned positions: on a CPU-only machine one JAX device per core, the "
                      "batch split over them), rotary (the default config as it comes, rotary "
                      "positions), learned_1dev and rotary_1dev (the same with "
                      "mesh.cpu_devices=1: one device), learned_dp and rotary_dp "
                      "(mesh.cpu_devices=0 asked for explicitly), learned_f32 and rotary_f32 "
                      "(matmul_precision=float32: float32 products on any CPU)")
  parser.add_argument("--wall_steps", type=int, default=2000,
                      help="steps of the full-run wall-time comparison (0 skips it)")
  parser.add_argument("--wall_rounds", type=int, default=1,
                      help="rounds of the wall-time comparison, the contenders' order reversed "
                      "every other round; with 2 or more, per-round ratios and their median")
  parser.add_argument("--wall_contenders", default="",
                      help="contenders of the wall-time runs ('' = --contenders)")
  parser.add_argument("--warm_cache", action="store_true",
                      help="wall-time runs use the user's JAX compilation cache (what a second run "
                      "of the same config gets); default: an empty cache per run, a first run")
  parser.add_argument("--implementation", default="auto", help="attnlab attention implementation")
  parser.add_argument("--nanogpt_dir", default=str(SHARED / "anchors" / "nanogpt"))
  parser.add_argument("--data_dir", default=str(SHARED / "data"),
                      help="folder with tinyshakespeare/input.txt")
  parser.add_argument("--scratch", default="",
                      help="scratch folder, kept ('' = a fresh temp folder, removed at exit)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--contender", default="learned", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  if args.rounds < 0 or args.wall_steps < 0 or (args.rounds and args.iters <= args.skip):
    parser.error("--rounds and --wall_steps must be >= 0 and --iters > --skip")
  if args.wall_rounds < 1:
    parser.error("--wall_rounds must be >= 1")
  if not args.rounds and not args.wall_steps:
    parser.error("--rounds=0 and --wall_steps=0 leave nothing to measure")

  contenders = [c for c in args.contenders.split(",") if c]
  nanogpts = [c for c in contenders if c.startswith("nanogpt")]
  valid = ["nanogpt", "nanogpt_passive", *ATTNLAB]
  unknown = (set(contenders) | set(args.wall_contenders.split(",")) - {""}) - set(valid)
  if unknown:
    parser.error(f"unknown contenders {sorted(unknown)}; valid: {', '.join(valid)}")
  scratch = pathlib.Path(args.scratch or tempfile.mkdtemp(prefix="gpt_vs_nanogpt_"))
  scratch.mkdir(parents=True, exist_ok=True)
  if not args.scratch:  # a temp folder of its own (nanoGPT's copy, the runs): gone at exit
    atexit.register(shutil.rmtree, scratch, True)
  import torch  # pylint: disable=g-import-not-at-top  (only its version and threads)
  print(f"{machine.cores()} CPUs; torch {torch.__version__} ({torch.get_num_threads()} threads); "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start; "
        f"scratch {scratch}")
  print(machine.cpu_line())
  work = prepare_nanogpt(scratch, pathlib.Path(args.nanogpt_dir), pathlib.Path(args.data_dir))
  label = {"nanogpt": "nanoGPT (torch, nano CPU setting)",
           "nanogpt_passive": "nanoGPT, OMP_WAIT_POLICY=PASSIVE",
           "learned": "attnlab nano GPT, position=learned, default config",
           "rotary": "attnlab nano GPT, default config (rotary)",
           "learned_1dev": "attnlab nano GPT, position=learned, mesh.cpu_devices=1",
           "rotary_1dev": "attnlab nano GPT, rotary, mesh.cpu_devices=1",
           "learned_dp": "attnlab nano GPT, position=learned, mesh.cpu_devices=0",
           "rotary_dp": "attnlab nano GPT, position=rotary (default), mesh.cpu_devices=0",
           "learned_f32": "attnlab nano GPT, position=learned, matmul_precision=float32",
           "rotary_f32": "attnlab nano GPT, rotary, matmul_precision=float32"}

  per_round: dict[str, list[float]] = {c: [] for c in contenders}
  for r in range(args.rounds):
    order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
    if r % 2:
      order.reverse()
    for c in order:
      if c in nanogpts:
        times, _, _ = run_nanogpt(work, args.iters, 10**9, scratch / "out",
                                  passive=c == "nanogpt_passive")
      else:
        times = run_attnlab_worker(c, args)
      med = statistics.median(times[args.skip:])
      per_round[c].append(med)
      print(f"  round {r + 1}: {c:15s} {med:7.2f} ms/iter (median of {len(times) - args.skip}) "
            f"load {os.getloadavg()[0]:.2f}", flush=True)

  if args.rounds:
    print_timing_table(args, contenders, nanogpts, per_round, label)

  if args.wall_steps:
    wall_contenders = [c for c in (args.wall_contenders or args.contenders).split(",") if c]
    print(f"\nwall time of one {args.wall_steps}-step training run (process start to exit)"
          + (f", {args.wall_rounds} rounds, the order reversed every other round:"
             if args.wall_rounds > 1 else ":"))
    print("| contender | wall s | first log line s | first train step s | final val loss |")
    print("|---|---|---|---|---|")
    phases, walls = {}, {c: [] for c in wall_contenders}
    for r in range(args.wall_rounds):
      for c in (wall_contenders[::-1] if r % 2 else wall_contenders):
        first_line = first_step = "-"
        if c.startswith("nanogpt"):
          _, wall, val = run_nanogpt(work, args.wall_steps, 250, scratch / "out_wall",
                                     passive=c == "nanogpt_passive")
        else:
          wall, val, times = run_attnlab_training(c, args,
                                                  scratch / f"attnlab_{c}_{time.time_ns()}")
          first_line, first_step = f"{times['first line']:.1f}", f"{times['first step']:.1f}"
          phases.setdefault(c, []).append({k: v for k, v in times.items() if k not in (
              "first line", "first step", "exit", "val loss")})
        walls[c].append(wall)
        val_s = f"{val:.4f}" if isinstance(val, float) else str(val)
        name = label[c] + (f", round {r + 1}" if args.wall_rounds > 1 else "")
        print(f"| {name} | {wall:.1f} | {first_line} | {first_step} | {val_s} |", flush=True)
    for c, runs in phases.items():
      for r, seconds in enumerate(runs):
        print(f"{c} phases{f' (round {r + 1})' if len(runs) > 1 else ''}: "
              + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    if args.wall_rounds > 1:
      print_wall_ratios(walls, label)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
