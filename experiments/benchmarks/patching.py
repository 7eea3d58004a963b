"""Activation patching on the CPU: attnlab's patch_sweep against TransformerLens on the same weights.

Two figures (issue #52):

  cache  what caching every hook site costs: attnlab's jitted plain forward pass against
         `hooks.run_with_cache(run, tokens)` with all sites (its own jitted program), the two
         calls alternating in one process, medians; on the nano GPT of configs/gpt.py (rotary
         positions), the nano-sized GPT-2 and the GPT-2-shaped model below. Target: <= 1.3x.
  sweep  a full activation-patching sweep, clean -> corrupted, of every layer x head on
         `attn.z` (all positions) and of every layer x position on `resid_pre`, metric the mean
         logit difference of two tokens at the last position: attnlab's
         `hooks.patch_sweep(run, clean, corrupted, metric, site=..., over=...)` against
         TransformerLens's own patching functions on a `TransformerBridge` of the same weights
         (`patching.get_act_patch_attn_head_out_all_pos` and `patching.get_act_patch_resid_pre`
         after `bridge.run_with_cache(clean)`, the way its docs run them). The time of a sweep
         includes the clean run that fills the cache in both. attnlab's first call (tracing and
         compiling) is reported apart from its steady state; TransformerLens compiles nothing.
         Both grids must agree to 1e-4 (the script checks it and prints the largest
         difference). Target: attnlab >= 3x faster in steady state.

The models are Hugging Face GPT-2s built with `transformers` (random initialisation, seed 0,
weights drawn with standard deviation INIT_STD = 0.1 so that patching moves the metric by
tenths of a logit,
saved with save_pretrained in a scratch folder), imported into attnlab with
`python -m attnlab.cli.import_hf FOLDER --workdir=RUN` (`attnlab import-hf`), and booted in
TransformerLens offline with `TransformerBridge.boot_transformers(FOLDER, hf_model=MODEL)`:
both libraries run the same weights, and each worker checks its logits against the
`transformers` model's. Sizes:

  nano  4 layers, 4 heads, 128 dims, block 64, vocabulary 65 (the nano GPT's Tiny Shakespeare
        characters), batch 12 x 64: the issue's "nano-GPT-sized GPT-2, batch 12 x 64"
  gpt2  GPT-2 small's shape: 12 layers, 12 heads, 768 dims, block 1024, vocabulary 50257;
        the sweep batch --gpt2_batch (default 2 x 16: every sweep is 144 or 192 forward passes
        for TransformerLens, and one takes about 0.1-0.3 s on the shared 2-core CPU)

Clean tokens are uniform random ids (seed 1); the corrupted batch changes the ids at a quarter
and at half of the length. The metric: mean over the batch of logits[:, -1, 1] - logits[:, -1, 2].

Timing: every contender is a fresh process per round, the order alternating between rounds;
within a process each sweep is called once to warm up (attnlab: the compile) and then --reps
times, the median of those is the round's figure, and the table gives the median over rounds.
TransformerLens runs with torch's default threads (one per core) and OMP_WAIT_POLICY=passive
(--omp_wait_policy): on this shared machine torch's default spin-waiting threads make a forward
pass 4x slower under load (400 against 90 ms for the nano GPT-2 at load 8), which would flatter
attnlab; --tl_threads=1 is the other fair setting. `uptime` is printed before and after, the
CPU model with experiments/benchmarks/machine.py.

  python experiments/benchmarks/patching.py                                  # both parts
  python experiments/benchmarks/patching.py --parts=sweep --models=nano --rounds=5
  python experiments/benchmarks/patching.py --parts=cache --reps=10
  python experiments/benchmarks/patching.py --smoke                          # seconds: a check

Needs torch, transformers and TransformerLens (`pip install -e '.[bench]'`, torch's CPU build
first); the cache part needs only attnlab.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/machine.py
import machine  # pylint: disable=g-bad-import-order,wrong-import-position

REPO = pathlib.Path(__file__).resolve().parents[2]
# The two tokens of the metric (logit difference at the last position).
TOKEN_A, TOKEN_B = 1, 2
# (attnlab site, over) of the two sweeps, and their names in the tables.
SWEEPS = {"z_head": ("attn.z", "head"), "resid_pre_position": ("resid_pre", "position")}
# Hugging Face GPT2Config fields of each size.
SIZES = {
    "nano": dict(n_layer=4, n_head=4, n_embd=128, n_positions=64, vocab_size=65),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257),
    "smoke": dict(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=50),
}
# Standard deviation of the random weights (GPT-2's own, 0.02, leaves every patching effect
# under 0.01 logits, which would make the 1e-4 agreement check loose).
INIT_STD = 0.1
# Largest |attnlab - TransformerLens| allowed on the sweep grids.
TOL = 1e-4


def uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "(uptime unavailable)"


def batch_shape(text: str) -> tuple[int, int]:
  """"12x64" -> (12, 64)."""
  batch, _, length = text.partition("x")
  return int(batch), int(length)


# ------------------------------------------------------------------------------ the models


def build_model(name: str, scratch: pathlib.Path, batch: tuple[int, int]) -> pathlib.Path:
  """The GPT-2 `name` (SIZES) saved with transformers in scratch/name/hf, imported into attnlab
  at scratch/name/run, with the clean and corrupted tokens and the transformers logits of
  both; returns scratch/name."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  folder = scratch / name
  hf_dir, run_dir = folder / "hf", folder / "run"
  folder.mkdir(parents=True, exist_ok=True)
  config = transformers.GPT2Config(**SIZES[name], resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                   initializer_range=INIT_STD)
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(config).eval()
  model.save_pretrained(hf_dir)
  subprocess.run([sys.executable, "-m", "attnlab.cli.import_hf", str(hf_dir),
                  f"--workdir={run_dir}", "--overwrite"], cwd=REPO, check=True,
                 capture_output=True, text=True)
  rng = np.random.default_rng(1)
  clean = rng.integers(0, config.vocab_size, batch).astype(np.int64)
  corrupted = clean.copy()
  for position in (batch[1] // 4, batch[1] // 2):
    corrupted[:, position] = (corrupted[:, position] + 1 + rng.integers(
        0, config.vocab_size - 1, batch[0])) % config.vocab_size
  np.save(folder / "clean.npy", clean)
  np.save(folder / "corrupted.npy", corrupted)
  with torch.no_grad():
    for which, ids in (("clean", clean), ("corrupted", corrupted)):
      np.save(folder / f"hf_logits_{which}.npy", model(torch.from_numpy(ids)).logits.numpy())
  return folder


# ------------------------------------------------------------------------------ workers


def _timed(fn, reps: int) -> dict[str, object]:
  """First call, then `reps` more: wall seconds of the first, the median and all, and the
  median process CPU seconds of the timed calls."""
  start = time.perf_counter()
  result = fn()
  first = time.perf_counter() - start
  walls, cpus = [], []
  for _ in range(reps):
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    walls.append(time.perf_counter() - start)
    cpus.append(time.process_time() - cpu)
  return dict(first=first, median=statistics.median(walls), all=walls,
              cpu=statistics.median(cpus), result=result)


def attnlab_sweep_worker(folder: pathlib.Path, reps: int) -> dict[str, object]:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab.analysis import hooks  # pylint: disable=g-import-not-at-top
  from attnlab.backends import cpu  # pylint: disable=g-import-not-at-top
  cpu.enable()  # the allocator tuning every attnlab entry point applies
  run = analysis.load_run(folder / "run")
  clean = np.load(folder / "clean.npy").astype(np.int32)
  corrupted = np.load(folder / "corrupted.npy").astype(np.int32)

  def metric(logits):
    return jnp.mean(logits[:, -1, TOKEN_A] - logits[:, -1, TOKEN_B])

  out: dict[str, object] = {}
  logits = np.asarray(hooks.run_with_hooks(run, corrupted, []))
  out["logits_vs_hf"] = float(np.abs(logits - np.load(folder / "hf_logits_corrupted.npy")).max())
  for key, (site, over) in SWEEPS.items():
    timed = _timed(lambda site=site, over=over: hooks.patch_sweep(
        run, clean, corrupted, metric, site=site, over=over), reps)
    np.save(folder / f"grid_attnlab_{key}.npy", timed.pop("result"))
    out[key] = timed
  return out


def tl_sweep_worker(folder: pathlib.Path, reps: int, threads: int) -> dict[str, object]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  if threads:
    torch.set_num_threads(threads)
  from transformer_lens import patching  # pylint: disable=g-import-not-at-top
  from transformer_lens.model_bridge import TransformerBridge  # pylint: disable=g-import-not-at-top
  torch.set_grad_enabled(False)
  hf_model = transformers.GPT2LMHeadModel.from_pretrained(folder / "hf").eval()
  bridge = TransformerBridge.boot_transformers(str(folder / "hf"), hf_model=hf_model,
                                               device="cpu")
  clean = torch.from_numpy(np.load(folder / "clean.npy"))
  corrupted = torch.from_numpy(np.load(folder / "corrupted.npy"))

  def metric(logits):
    return (logits[:, -1, TOKEN_A] - logits[:, -1, TOKEN_B]).mean()

  sweeps = {"z_head": patching.get_act_patch_attn_head_out_all_pos,
            "resid_pre_position": patching.get_act_patch_resid_pre}

  def sweep(fn):
    _, cache = bridge.run_with_cache(clean)
    return fn(bridge, corrupted, cache, metric).numpy()

  out: dict[str, object] = {"threads": torch.get_num_threads()}
  logits = bridge(corrupted).numpy()
  out["logits_vs_hf"] = float(np.abs(logits - np.load(folder / "hf_logits_corrupted.npy")).max())
  for key, fn in sweeps.items():
    timed = _timed(lambda fn=fn: sweep(fn), reps)
    np.save(folder / f"grid_tl_{key}.npy", timed.pop("result"))
    out[key] = timed
  return out


def cache_worker(model_name: str, scratch: pathlib.Path, batch: tuple[int, int],
                 reps: int) -> dict[str, object]:
  """attnlab alone: jitted plain forward pass against run_with_cache of every site, the two
  alternating; medians."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab.analysis import hooks  # pylint: disable=g-import-not-at-top
  from attnlab.backends import cpu  # pylint: disable=g-import-not-at-top
  cpu.enable()
  if model_name == "nano_config":  # configs/gpt.py's default nano GPT (rotary, no biases)
    from attnlab import config_utils  # pylint: disable=g-import-not-at-top
    from attnlab.models import gpt  # pylint: disable=g-import-not-at-top
    config = config_utils.load_config_file(str(REPO / "configs" / "gpt.py"))
    model = gpt.from_config(config.model, 65)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  else:  # an imported GPT-2 of build_model
    run = analysis.load_run(scratch / model_name / "run")
    model, params = run.model, run.params
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 50, batch), jnp.int32)
  forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
  calls = {"forward": lambda: forward(params, tokens).block_until_ready(),
           "run_with_cache": lambda: jax.block_until_ready(
               hooks.run_with_cache((model, params), tokens))}
  first = {}
  for name, call in calls.items():
    start = time.perf_counter()
    call()
    first[name] = time.perf_counter() - start
  _, cache = hooks.run_with_cache((model, params), tokens)
  times: dict[str, list[float]] = {name: [] for name in calls}
  for rep in range(reps):
    for name in (list(calls) if rep % 2 == 0 else list(calls)[::-1]):
      start = time.perf_counter()
      calls[name]()
      times[name].append(time.perf_counter() - start)
  return dict(first=first, median={n: statistics.median(t) for n, t in times.items()},
              all=times, sites=len(cache),
              cache_mib=sum(v.size * v.dtype.itemsize for v in cache.values()) / 2**20)


def worker(args) -> None:
  scratch = pathlib.Path(args.scratch)
  if args.worker == "attnlab":
    out = attnlab_sweep_worker(scratch / args.model, args.reps)
  elif args.worker == "tl":
    out = tl_sweep_worker(scratch / args.model, args.reps, args.tl_threads)
  else:
    out = cache_worker(args.model, scratch, batch_shape(args.batch), 4 * args.reps)
  print("RESULT " + json.dumps(out))


def run_worker(kind: str, model: str, args, scratch: pathlib.Path, batch: str = "") -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), f"--worker={kind}", f"--model={model}",
         f"--scratch={scratch}", f"--reps={args.reps}", f"--tl_threads={args.tl_threads}",
         f"--batch={batch}"]
  env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
  if kind == "tl" and args.omp_wait_policy:
    env["OMP_WAIT_POLICY"] = args.omp_wait_policy
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  raise SystemExit(f"worker {kind} {model} failed (exit {proc.returncode}):\n"
                   f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


# ------------------------------------------------------------------------------ the parts


def sweep_part(args, scratch: pathlib.Path, models: list[str]) -> bool:
  """Runs and prints the sweep comparison; returns whether every grid agreed to TOL."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  agreed = True
  for name in models:
    batch = batch_shape(args.gpt2_batch if name == "gpt2" else args.nano_batch)
    folder = build_model(name, scratch, batch)
    size = SIZES[name]
    print(f"\n## sweep: {name} GPT-2 ({size['n_layer']} layers, {size['n_head']} heads, "
          f"{size['n_embd']} dims, vocabulary {size['vocab_size']}), batch {batch[0]} x "
          f"{batch[1]}; cells: z {size['n_layer'] * size['n_head']}, resid_pre "
          f"{size['n_layer'] * batch[1]}", flush=True)
    results: dict[str, list[dict]] = {"attnlab": [], "tl": []}
    for r in range(args.rounds):
      order = ["attnlab", "tl"] if r % 2 == 0 else ["tl", "attnlab"]
      for contender in order:
        res = run_worker(contender, name, args, scratch)
        results[contender].append(res)
        print(f"  round {r + 1} {contender}: " + ", ".join(
            f"{k} {res[k]['median']:.3f} s (first {res[k]['first']:.2f} s)" for k in SWEEPS),
              flush=True)
    print(f"  logits vs transformers: attnlab {results['attnlab'][-1]['logits_vs_hf']:.1e}, "
          f"TransformerLens {results['tl'][-1]['logits_vs_hf']:.1e} (torch threads "
          f"{results['tl'][-1]['threads']})")
    print("\n| sweep | attnlab first call (compile + run) | attnlab steady s | TransformerLens "
          "steady s | TL / attnlab | rounds (TL / attnlab) | max abs diff | grid range |")
    print("|---|---|---|---|---|---|---|---|")
    for key in SWEEPS:
      ours = [res[key]["median"] for res in results["attnlab"]]
      theirs = [res[key]["median"] for res in results["tl"]]
      first = statistics.median(res[key]["first"] for res in results["attnlab"])
      a, t = statistics.median(ours), statistics.median(theirs)
      grid_a = np.load(folder / f"grid_attnlab_{key}.npy")
      grid_t = np.load(folder / f"grid_tl_{key}.npy")
      diff = float(np.abs(grid_a - grid_t).max()) if grid_a.shape == grid_t.shape else np.inf
      agreed &= diff <= TOL
      rounds = ", ".join(f"{y / x:.2f}" for x, y in zip(ours, theirs))
      print(f"| {key} {grid_a.shape} | {first:.2f} s | {a:.3f} | {t:.3f} | **{t / a:.2f}x** | "
            f"{rounds} | {diff:.1e}{'' if diff <= TOL else ' (over 1e-4!)'} | "
            f"{grid_t.min():+.4f} .. {grid_t.max():+.4f} |", flush=True)
  return agreed


def cache_part(args, scratch: pathlib.Path, models: list[str]) -> None:
  rows = []
  for name in models:
    if name != "nano_config" and not (scratch / name / "run").exists():
      base = "gpt2" if name == "gpt2" else name
      build_model(base, scratch, batch_shape(args.nano_batch if base != "gpt2" else
                                             args.gpt2_batch))
    batch = args.gpt2_cache_batch if name == "gpt2" else args.nano_batch
    per_round = [run_worker("cache", name, args, scratch, batch) for _ in range(args.rounds)]
    forward = [r["median"]["forward"] for r in per_round]
    cached = [r["median"]["run_with_cache"] for r in per_round]
    ratios = ", ".join(f"{c / f:.2f}" for f, c in zip(forward, cached))
    f, c = statistics.median(forward), statistics.median(cached)
    res = per_round[-1]
    rows.append(f"| {name} | {batch} | {res['sites']} ({res['cache_mib']:.0f} MiB) | "
                f"{f * 1e3:.1f} | {c * 1e3:.1f} | **{c / f:.2f}x** | {ratios} | "
                f"{res['first']['forward']:.2f} / {res['first']['run_with_cache']:.2f} |")
    print(f"  cache {name}: forward {f * 1e3:.1f} ms, run_with_cache {c * 1e3:.1f} ms "
          f"(rounds {ratios})", flush=True)
  print("\n## cache: attnlab's jitted forward pass against run_with_cache of every site\n")
  print("| model | batch | sites (cached) | forward ms | run_with_cache ms | cache / forward | "
        "rounds | first calls s (forward / cache) |")
  print("|---|---|---|---|---|---|---|---|")
  print("\n".join(rows))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--parts", default="cache,sweep", help="cache, sweep or both")
  parser.add_argument("--models", default="nano,gpt2",
                      help="sweep models (nano, gpt2); the cache part adds nano_config")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--reps", type=int, default=2,
                      help="timed calls per process after the first (sweeps); cache part: x4")
  parser.add_argument("--nano_batch", default="12x64")
  parser.add_argument("--gpt2_batch", default="2x16", help="the GPT-2 sweep's batch")
  parser.add_argument("--gpt2_cache_batch", default="2x128", help="the GPT-2 cache part's batch")
  parser.add_argument("--tl_threads", type=int, default=0, help="torch threads (0: its default)")
  parser.add_argument("--omp_wait_policy", default="passive",
                      help="OMP_WAIT_POLICY of the TransformerLens workers ('' leaves it unset)")
  parser.add_argument("--scratch", default="", help="folder for the models (default: a temp dir)")
  parser.add_argument("--smoke", action="store_true",
                      help="a tiny GPT-2, one round, one rep: checks the script in seconds")
  parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
  parser.add_argument("--model", default="", help=argparse.SUPPRESS)
  parser.add_argument("--batch", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args)
    return
  parts = [p for p in args.parts.split(",") if p]
  models = [m for m in args.models.split(",") if m]
  if args.smoke:
    models, args.rounds, args.reps, args.nano_batch = ["smoke"], 1, 1, "2x8"
  scratch = pathlib.Path(args.scratch or tempfile.mkdtemp(prefix="attnlab_patching_"))
  print(machine.cpu_line())
  print(f"uptime before: {uptime()}")
  print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
  print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
  agreed = True
  try:
    if "sweep" in parts:
      agreed = sweep_part(args, scratch, models)
    if "cache" in parts:
      cache_part(args, scratch, (["nano_config"] if not args.smoke else []) + models)
  finally:
    if not args.scratch:
      shutil.rmtree(scratch, ignore_errors=True)
  print(f"\nuptime after: {uptime()}")
  if not agreed:
    raise SystemExit(f"attnlab's and TransformerLens's grids differ by more than {TOL}")


if __name__ == "__main__":
  main()
