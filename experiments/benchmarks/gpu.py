"""GPU benchmark: GPT-2-small training throughput against nanoGPT, attention against torch SDPA.

Measured on an H200 (experiments/benchmarks/README.md: the tables, the command, the date);
experiments/benchmarks/gpu_device.sh runs it on a lent device machine. On a CPU only `--smoke`
makes sense (tiny model, S = 128, seconds: tests/test_experiments.py runs it end to end).

Part `train`: tokens/s and model FLOPs utilisation (MFU) of one training step of
  attnlab   configs/gpt.py `size=gpt2,dataset=synthetic_tokens,model.dtype=bfloat16` on one
            device (mesh.data=1): GPT-2 small, 12 layers, 12 heads, 768 dims, block 1024, learned
            positions, no biases, vocabulary 50257 padded to 50304, float32 parameters and AdamW
            state; the trainer's own pieces (experiments/benchmarks/gpt_vs_nanogpt.py
            `time_train_steps`: batch, train step, host sync on the loss)
  nanoGPT   its own train.py from ../shared/anchors/nanogpt, unmodified, copied into a temp
            folder whose data/synthetic/{train,val}.bin hold uniform random tokens (uint16, what
            its prepare.py scripts write): `--compile=True --dtype=bfloat16` (autocast, float32
            parameters), the same model (`--n_layer=12 --n_head=12 --n_embd=768 --bias=False
            --dropout=0.0`, vocabulary 50304), the same batch (`--batch_size=12 --block_size=1024
            --gradient_accumulation_steps=1`), its time per iteration from its log
            (gpt_vs_nanogpt.py `run_nanogpt`).
FLOPs per token: 6N + 12·L·d·T (N the parameters without the position table, L layers, d
width, T the block: nanoGPT's estimate_mfu and the PaLM paper's appendix B; the attention term
counts the full T x T score matrix, causal or not). MFU = FLOPs per token x tokens/s / the
device's dense bfloat16 peak (PEAK_TFLOPS by the device kind JAX reports, or --peak_tflops;
none on a CPU: MFU is left out).

Part `attention`: forward+backward of causal softmax attention, [B, H, S, D] with H = 12, D = 64,
B = --attn_tokens / S (16K tokens per call by default), bfloat16, at S = 1K..8K, for each attnlab
implementation (`attend(implementation=...)`: auto, xla, cudnn, blocked, reference) and, when
attnlab.attention.registry imports, every other mechanism of its table that supports causal
attention (`mech:NAME`), beside torch's `scaled_dot_product_attention` (flash on an H100).
GFLOP/s count 4·B·H·S²·D forward and 3x that forward+backward (dense-equivalent, as
benchmarks/attention.py). The first length's output is compared with a float32 reference
(max |error|): a fast path must also be right. A path that fails (cudnn off a GPU, a shape it
refuses) gets its error in its cell. The error is measured on the first batch row.

Timing: every contender is a fresh process per round (a worker: this script with --worker), the
order rotates from round to round; a train contender's figure is the median of its iterations
after the first --skip (compilation, warm-up), an attention cell the median of --reps calls
after two warm-up calls; the tables give the median over rounds. `uptime` is printed before and
after.

  python experiments/benchmarks/gpu.py                       # on a GPU: both parts, 3 rounds
  python experiments/benchmarks/gpu.py --parts=train --rounds=5 --iters=60
  python experiments/benchmarks/gpu.py --parts=attention --seq=1024,2048,4096,8192
  python experiments/benchmarks/gpu.py --smoke               # a CPU check of the whole script

Needs torch (nanoGPT, SDPA) and numpy; nanoGPT's export in ../shared/anchors/nanogpt.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import pathlib
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpt_vs_nanogpt  # pylint: disable=g-import-not-at-top,wrong-import-position

# Dense bfloat16 peak TFLOP/s by the device kind JAX reports (the first name it contains; NVIDIA's
# datasheets: H100 SXM 989, H100 PCIe 756, H200 989, A100 312). None: no MFU (CPU).
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
# attnlab attention implementations timed (core.IMPLEMENTATIONS, "auto" first).
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "blocked", "reference")
# GPT-2 small (configs/gpt.py size=gpt2) and its synthetic vocabulary (50304 once padded).
GPT2 = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=12, vocab_size=50257)
# --smoke: a CPU check of the whole script in seconds.
SMOKE = dict(n_layer=2, n_head=2, n_embd=64, block_size=128, batch_size=4, vocab_size=256)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--parts", default="train,attention",
                 help="train, profile (where the attnlab step's device time goes) and/or "
                 "attention")
  p.add_argument("--profile_steps", type=int, default=5, help="train steps traced by profile")
  p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
  p.add_argument("--iters", type=int, default=50, help="train iterations per process and round")
  p.add_argument("--skip", type=int, default=10,
                 help="first train iterations of each process left out of its median")
  p.add_argument("--dtype", default="bfloat16", help="compute dtype: bfloat16, float16, float32")
  p.add_argument("--train_impls", default="auto",
                 help="attnlab attention implementations of the train contenders (one each)")
  p.add_argument("--no_nanogpt", action="store_true", help="leave nanoGPT out of the train part")
  p.add_argument("--compile", default="True", help="nanoGPT's --compile")
  for key, value in GPT2.items():
    p.add_argument(f"--{key}", type=int, default=value, help=f"model/batch (GPT-2: {value})")
  p.add_argument("--seq", default="1024,2048,4096,8192", help="attention sequence lengths")
  p.add_argument("--attn_tokens", type=int, default=16384, help="B x S of each attention call")
  p.add_argument("--heads", type=int, default=12, help="attention heads H")
  p.add_argument("--head_dim", type=int, default=64, help="attention head dim D")
  p.add_argument("--reps", type=int, default=10, help="timed attention calls per cell")
  p.add_argument("--impls", default=",".join(ATTENTION_IMPLS) + ",mechanisms,torch",
                 help="attention contenders: attnlab implementations, 'mechanisms' (every "
                 "causal mechanism of attnlab.attention.registry, when it imports), torch")
  p.add_argument("--peak_tflops", type=float, default=0.0,
                 help="dense bf16 peak of the device (0: from PEAK_TFLOPS by its kind)")
  p.add_argument("--nanogpt_dir", default=str(SHARED / "anchors" / "nanogpt"))
  p.add_argument("--scratch", default="", help="scratch folder, kept ('' = a temp folder)")
  p.add_argument("--smoke", action="store_true",
                 help="CPU check: tiny model, S=128, 1 round, a few iterations")
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)
  p.add_argument("--impl", default="", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.smoke:
    for key, value in SMOKE.items():
      setattr(args, key, value)
    args.rounds, args.iters, args.skip, args.reps = 1, 4, 1, 2
    args.seq, args.attn_tokens, args.heads, args.head_dim = "128", 256, 2, 16
    args.compile = "False"
  args.parts = [x for x in args.parts.split(",") if x]
  if not args.parts or set(args.parts) - {"train", "profile", "attention"}:
    p.error(f"--parts takes train, profile and/or attention; got {args.parts}")
  args.seq = [int(x) for x in args.seq.split(",") if x]
  return args


def uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return f"load average {os.getloadavg()}"


def _worker(args, kind: str, *extra: str) -> dict:
  """Runs this script as a worker in a fresh process; its RESULT line as a dict."""
  keys = (*GPT2, "iters", "dtype", "attn_tokens", "heads", "head_dim", "reps", "profile_steps")
  flags = [f"--{k}={getattr(args, k)}" for k in keys] + [f"--seq={','.join(map(str, args.seq))}"]
  path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
  proc = subprocess.run([sys.executable, __file__, f"--worker={kind}", *flags, *extra],
                        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path))
  line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
  if proc.returncode or line is None:
    raise RuntimeError(f"worker {kind} {extra} failed ({proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")
  return json.loads(line[len("RESULT "):])


# ----------------------------------------------------------------------------- workers


def probe_worker(args) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  return {"backend": jax.default_backend(), "kind": device.device_kind,
          "count": jax.device_count(), "jax": jax.__version__}


def attnlab_train_arg(args, impl: str) -> str:
  return (f"size=gpt2,dataset=synthetic_tokens,model.dtype={args.dtype},"
          f"model.num_layers={args.n_layer},model.num_heads={args.n_head},"
          f"model.d_model={args.n_embd},model.block_size={args.block_size},"
          f"batch_size={args.batch_size},data.vocab_size={args.vocab_size},"
          f"implementation={impl},mesh.data=1,num_train_steps={args.iters + 100}")


def train_worker(args) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab import config_utils, parallel, tasks  # pylint: disable=g-import-not-at-top
  parallel.enable_compilation_cache()  # as `attnlab train`: later rounds skip the compile
  config = config_utils.load_config_file(
      f"{REPO / 'configs' / 'gpt.py'}:{attnlab_train_arg(args, args.impl)}")
  times = gpt_vs_nanogpt.time_train_steps(config, args.iters)
  task = tasks.build_task(config)
  shapes = jax.eval_shape(task.init, jax.random.key(0))
  params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  position = math.prod(shapes["embed"]["position"].shape) if "position" in shapes["embed"] else 0
  return {"times": times, "params": params - position, "vocab": task.model.vocab_size}


# Device-time categories of the profile part: the first whose keywords occur in an op's name
# (lower case) takes it; the rest is "fusions and other kernels" (element-wise work: softmax
# outside a fused kernel, layer norms, GELU, the loss, AdamW's update).
PROFILE_CATEGORIES = (
    ("attention (fused kernels)", ("fmha", "flash", "cudnn", "attention")),
    # cuBLAS's Hopper GEMMs are named nvjet_sm90_*
    ("matmuls (cuBLAS/cuDNN GEMMs)", ("gemm", "cublas", "nvjet", "matmul", "dot", "convolution")),
    ("collectives", ("all-reduce", "all-gather", "nccl")),
    ("copies and transposes", ("copy", "transpose", "memcpy", "memset")),
)


def profile_worker(args) -> dict:
  """Device time per category over --profile_steps traced steps of the attnlab train step."""
  import glob  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  from attnlab import config_utils, parallel  # pylint: disable=g-import-not-at-top
  parallel.enable_compilation_cache()
  config = config_utils.load_config_file(
      f"{REPO / 'configs' / 'gpt.py'}:{attnlab_train_arg(args, args.impl)}")
  state, step, batches, rng = gpt_vs_nanogpt.train_pieces(config)
  for _ in range(5):  # compile and warm up
    state, metrics = step(state, next(batches), rng)
    float(metrics["loss"])
  untraced = []  # the step without the tracer (tracing slows the host side down)
  for _ in range(10):
    t0 = time.perf_counter()
    state, metrics = step(state, next(batches), rng)
    float(metrics["loss"])
    untraced.append((time.perf_counter() - t0) * 1e3)
  trace_dir = tempfile.mkdtemp(prefix="gpu_profile_")
  n = args.profile_steps
  t0 = time.perf_counter()
  with jax.profiler.trace(trace_dir):
    for _ in range(n):
      state, metrics = step(state, next(batches), rng)
      float(metrics["loss"])
  wall_ms = (time.perf_counter() - t0) * 1e3 / n
  files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  data = ProfileData.from_file(files[0])
  planes = [pl for pl in data.planes if pl.name.startswith("/device:")]
  ops: dict[str, float] = {}
  lines_seen = []
  for plane in planes[:1]:
    lines = list(plane.lines)
    lines_seen = [line.name for line in lines]
    chosen = [l for l in lines if l.name == "XLA Ops"] or [
        l for l in lines if l.name.startswith("Stream")]
    for line in chosen:
      for event in line.events:
        ops[event.name] = ops.get(event.name, 0.0) + event.duration_ns / 1e6 / n
  shutil.rmtree(trace_dir, ignore_errors=True)
  categories: dict[str, float] = {}
  for name, ms in ops.items():
    low = name.lower()
    cat = next((c for c, keys in PROFILE_CATEGORIES if any(k in low for k in keys)),
               "fusions and other kernels")
    categories[cat] = categories.get(cat, 0.0) + ms
  top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
  return {"wall_ms": wall_ms, "untraced_ms": statistics.median(untraced),
          "device": planes[0].name if planes else None,
          "lines": lines_seen, "categories": categories, "top": top}


def profile_part(args) -> None:
  result = _worker(args, "profile", f"--impl={args.train_impls.split(',')[0]}")
  if not result["device"]:
    print("\nprofile: no device plane in the trace (a CPU run): nothing to split")
    return
  busy = sum(result["categories"].values())
  wall = result["untraced_ms"]  # device time per step is the same traced or not; the host's is not
  print(f"\nprofile of the attnlab train step ({result['device']}, {args.profile_steps} steps "
        f"traced with jax.profiler; lines {', '.join(result['lines'])}): ms per step")
  print("| where | ms/step | share of the untraced step |")
  print("|---|---|---|")
  for cat, ms in sorted(result["categories"].items(), key=lambda kv: -kv[1]):
    print(f"| {cat} | {ms:.2f} | {100 * ms / wall:.1f}% |")
  print(f"| device idle (host, launch gaps, sync) | {max(wall - busy, 0.0):.2f} | "
        f"{100 * max(wall - busy, 0.0) / wall:.1f}% |")
  print(f"| whole step (wall, untraced median of 10) | {wall:.2f} | 100% |")
  print(f"(traced, the step took {result['wall_ms']:.2f} ms: the tracer slows the host down)")
  print("top ops (ms/step): " + "; ".join(f"{name[:60]} {ms:.2f}" for name, ms in result["top"]),
        flush=True)


def _attention_fn(impl: str, causal: bool, heads: int, head_dim: int, seq: int):
  """f(q, k, v) -> context for an attnlab implementation, `mech:NAME` of the registry or
  `alibi` (scaled-dot attention with ALiBi's lazy bias, implementation auto)."""
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab.attention import core  # pylint: disable=g-import-not-at-top
  if impl.startswith("mech:"):
    from attnlab.attention import registry  # pylint: disable=g-import-not-at-top
    mechanism = registry.get_mechanism(impl[len("mech:"):])
    params = mechanism.init(jax.random.key(0), heads, head_dim, seq)
    return lambda q, k, v: mechanism.fn(q, k, v, mask=None, causal=causal, params=params,
                                        return_weights=False)[0]
  if impl == "alibi":
    from attnlab.attention import positions  # pylint: disable=g-import-not-at-top
    bias = positions.AlibiBias(positions.alibi_slopes(heads))
    return lambda q, k, v: core.attend(q, k, v, score="scaled_dot", causal=causal, bias=bias,
                                       return_weights=False)[0]
  return lambda q, k, v: core.attend(q, k, v, score="scaled_dot", causal=causal,
                                     implementation=impl, return_weights=False)[0]


def _exact(impl: str) -> bool:
  """Whether `impl` computes plain causal softmax attention (checked against float64 NumPy);
  the others (mechanisms, ALiBi) are checked against themselves in float32."""
  return impl in ATTENTION_IMPLS


def _reference(q, k, v, causal: bool) -> np.ndarray:
  """softmax(q kᵀ / sqrt(D)) v in float64 NumPy, [B, H, S, D]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # [B, H, S, S]
  if causal:
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhqk,bhkd->bhqd", w / w.sum(-1, keepdims=True), v)


def _inputs(seq: int, args, seed: int = 0) -> list[np.ndarray]:
  batch = max(1, args.attn_tokens // seq)
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((batch, args.heads, seq, args.head_dim), np.float32)
          for _ in range(4)]  # q, k, v, d_out: [B, H, S, D]


def attention_worker(args) -> dict:
  """{S: {"ms": median fwd+bwd ms, "err": max |error| at the first S} or {"error": text}}."""
  if args.impl == "torch":
    return torch_attention_worker(args)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  dtype = jnp.dtype(args.dtype)
  out = {}
  for i, seq in enumerate(args.seq):
    try:
      f = _attention_fn(args.impl, True, args.heads, args.head_dim, seq)

      def fwd_bwd(q, k, v, do, f=f):
        y, vjp = jax.vjp(f, q, k, v)
        return y, vjp(do.astype(y.dtype))  # a mechanism may return float32 from bf16 inputs

      step = jax.jit(fwd_bwd)
      arrays = [jnp.asarray(x, dtype) for x in _inputs(seq, args)]
      cell = {}
      if i == 0:  # on the first batch row
        row = [x[:1] for x in arrays[:3]]
        y = np.asarray(jax.jit(f)(*row), np.float64)
        if _exact(args.impl):  # float64 softmax attention, computed on the host
          ref = _reference(*row, True)
        else:  # the same function in float32 with full-precision matmuls
          with jax.default_matmul_precision("highest"):
            ref = np.asarray(jax.jit(f)(*(x.astype(jnp.float32) for x in row)), np.float64)
        cell["err"] = float(np.max(np.abs(y - ref)))
      for _ in range(2):
        jax.block_until_ready(step(*arrays))
      times = []
      for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*arrays))
        times.append((time.perf_counter() - t0) * 1e3)
      out[str(seq)] = {**cell, "ms": statistics.median(times)}
    except Exception as e:  # pylint: disable=broad-except  (a path that refuses: in its cell)
      out[str(seq)] = {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:80]}
  return out


def torch_attention_worker(args) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = getattr(torch, args.dtype)
  sdpa = torch.nn.functional.scaled_dot_product_attention
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  out = {}
  for i, seq in enumerate(args.seq):
    try:
      q, k, v, do = (torch.from_numpy(x).to(device=device, dtype=dtype).requires_grad_(j < 3)
                     for j, x in enumerate(_inputs(seq, args)))
      cell = {}
      if i == 0:
        with torch.no_grad():
          y = sdpa(q, k, v, is_causal=True)[:1].float().cpu().numpy()
        ref = _reference(*(x[:1].detach().float().cpu().numpy() for x in (q, k, v)), True)
        cell["err"] = float(np.max(np.abs(y - ref)))

      def step():
        for x in (q, k, v):
          x.grad = None
        sdpa(q, k, v, is_causal=True).backward(do)
      for _ in range(2):
        step()
      sync()
      times = []
      for _ in range(args.reps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
      out[str(seq)] = {**cell, "ms": statistics.median(times)}
    except Exception as e:  # pylint: disable=broad-except
      out[str(seq)] = {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:80]}
  return out


def run_worker(args) -> None:
  result = {"probe": probe_worker, "train": train_worker, "profile": profile_worker,
            "attention": attention_worker}[args.worker](args)
  print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- nanoGPT


def prepare_synthetic_nanogpt(scratch: pathlib.Path, nanogpt_dir: pathlib.Path,
                              vocab_size: int) -> pathlib.Path:
  """nanoGPT copied (unmodified) into scratch, with uniform random tokens in data/synthetic."""
  work = gpt_vs_nanogpt.copy_nanogpt(scratch, nanogpt_dir)
  data = work / "data" / "synthetic"
  data.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  for split, size in (("train", 1 << 22), ("val", 1 << 18)):
    rng.integers(0, vocab_size, size, dtype=np.uint16).tofile(data / f"{split}.bin")
  padded = -(-vocab_size // 64) * 64  # as configs/gpt.py size=gpt2 (GPT-2: 50304)
  with open(data / "meta.pkl", "wb") as f:
    pickle.dump({"vocab_size": padded}, f)
  return work


def nanogpt_args(args, device: str) -> list[str]:
  return ["--dataset=synthetic", "--gradient_accumulation_steps=1",
          f"--batch_size={args.batch_size}", f"--block_size={args.block_size}",
          f"--n_layer={args.n_layer}", f"--n_head={args.n_head}", f"--n_embd={args.n_embd}",
          "--dropout=0.0", "--bias=False", f"--compile={args.compile}", f"--dtype={args.dtype}",
          f"--device={device}", "--eval_iters=1", "--log_interval=1",
          "--always_save_checkpoint=False", "--wandb_log=False"]


# ----------------------------------------------------------------------------- main


def rotations(names: list[str], rounds: int):
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    yield r, (order[::-1] if r % 2 else order)


def train_part(args, device: dict, peak: float | None, scratch: pathlib.Path) -> None:
  contenders = [f"attnlab:{impl}" for impl in args.train_impls.split(",") if impl]
  if not args.no_nanogpt:
    contenders.append("nanogpt")
    work = prepare_synthetic_nanogpt(scratch, pathlib.Path(args.nanogpt_dir), args.vocab_size)
  torch_device = "cuda" if device["backend"] == "gpu" else "cpu"
  per_round = {c: [] for c in contenders}
  flops_per_token = None
  for r, order in rotations(contenders, args.rounds):
    for c in order:
      if c == "nanogpt":
        times, _, _ = gpt_vs_nanogpt.run_nanogpt(work, args.iters, 10**9, scratch / "out",
                                                 args=nanogpt_args(args, torch_device))
      else:
        result = _worker(args, "train", f"--impl={c.split(':')[1]}")
        times = result["times"]
        n = result["params"]
        flops_per_token = 6 * n + 12 * args.n_layer * args.n_embd * args.block_size
      med = statistics.median(times[args.skip:])
      per_round[c].append(med)
      print(f"  round {r + 1}: {c:16s} {med:8.2f} ms/iter (median of "
            f"{len(times[args.skip:])})", flush=True)
  tokens = args.batch_size * args.block_size
  print(f"\ntraining step, {args.dtype}: {args.n_layer} layers, {args.n_head} heads, "
        f"{args.n_embd} dims, batch {args.batch_size} x {args.block_size} tokens; median over "
        f"{args.rounds} rounds of {args.iters} iterations (first {args.skip} dropped)")
  if flops_per_token:
    print(f"FLOPs per token 6N + 12·L·d·T = {flops_per_token / 1e9:.3f} GFLOP"
          f"{f'; peak {peak:.0f} TFLOP/s' if peak else '; no peak known: MFU left out'}")
  print("| contender | ms/iter (rounds) | tokens/s | MFU | nanoGPT ms / this ms |")
  print("|---|---|---|---|---|")
  nano = statistics.median(per_round["nanogpt"]) if "nanogpt" in per_round else None
  for c in contenders:
    med = statistics.median(per_round[c])
    tps = tokens / (med / 1e3)
    mfu = (f"{100 * flops_per_token * tps / (peak * 1e12):.1f}%"
           if peak and flops_per_token else "-")
    ratio = f"{nano / med:.2f}x" if nano else "-"
    rounds = ", ".join(f"{x:.1f}" for x in per_round[c])
    print(f"| {c} | {med:.2f} ({rounds}) | {tps:,.0f} | {mfu} | {ratio} |", flush=True)


def attention_part(args) -> None:
  wanted = [x for x in args.impls.split(",") if x]
  contenders = [x for x in wanted if x in ATTENTION_IMPLS]
  if "mechanisms" in wanted:
    try:
      from attnlab.attention import registry  # pylint: disable=g-import-not-at-top
      contenders += [f"mech:{name}" for name, m in registry.MECHANISMS.items()
                     if name != "full" and m.supports.causal]
    except ImportError:
      print("attnlab.attention.registry does not import: no mechanism columns")
    contenders.append("alibi")
  if "torch" in wanted:
    contenders.append("torch")
  cells = {c: {s: [] for s in args.seq} for c in contenders}
  errors: dict[str, dict[int, str]] = {c: {} for c in contenders}
  accuracy: dict[str, float] = {}
  for r, order in rotations(contenders, args.rounds):
    for c in order:
      result = _worker(args, "attention", f"--impl={c}")
      for s in args.seq:
        cell = result[str(s)]
        if "error" in cell:
          errors[c][s] = cell["error"]
        else:
          cells[c][s].append(cell["ms"])
        if "err" in cell:
          accuracy[c] = cell["err"]
      print(f"  round {r + 1}: {c:22s} " + ", ".join(
          f"S={s}: {result[str(s)].get('ms', float('nan')):.2f} ms" for s in args.seq),
          flush=True)
  print(f"\nattention forward+backward, causal, {args.dtype}, H={args.heads}, D={args.head_dim}, "
        f"B x S = {args.attn_tokens}; median ms over {args.rounds} rounds of {args.reps} calls; "
        f"GFLOP/s dense-equivalent (3 x 4·B·H·S²·D); max |error| at S={args.seq[0]}, first batch "
        "row: the implementations against float64 softmax attention, the mechanisms and ALiBi "
        "against themselves in float32")
  print("| S | contender | ms | GFLOP/s | torch ms / this ms | max error |")
  print("|---|---|---|---|---|---|")
  for s in args.seq:
    batch = max(1, args.attn_tokens // s)
    flops = 3 * 4 * batch * args.heads * s * s * args.head_dim
    torch_ms = statistics.median(cells["torch"][s]) if cells.get("torch", {}).get(s) else None
    for c in contenders:
      if not cells[c][s]:
        print(f"| {s} | {c} | failed: {errors[c].get(s, '?')} | - | - | - |")
        continue
      ms = statistics.median(cells[c][s])
      ratio = f"{torch_ms / ms:.2f}x" if torch_ms else "-"
      err = f"{accuracy[c]:.1e}" if c in accuracy else "-"
      gflops = flops / ms / 1e6
      rate = f"{gflops:,.0f}" if gflops >= 100 else f"{gflops:.2f}"
      print(f"| {s} | {c} | {ms:.3f} | {rate} | {ratio} | {err} |", flush=True)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    from attnlab.backends import cpu as cpu_backend  # pylint: disable=g-import-not-at-top
    cpu_backend.enable()  # the allocator settings, as the trainer and `attnlab` commands
    run_worker(args)
    return 0
  scratch = pathlib.Path(args.scratch or tempfile.mkdtemp(prefix="gpu_bench_"))
  scratch.mkdir(parents=True, exist_ok=True)
  if not args.scratch:
    atexit.register(shutil.rmtree, scratch, True)
  print(f"uptime before: {uptime()}")
  print(gpt_vs_nanogpt.machine.cpu_line())  # the host's CPU (the device line follows)
  device = _worker(args, "probe")
  peak = args.peak_tflops or next((tf for name, tf in PEAK_TFLOPS if name in device["kind"]),
                                  None)
  if device["backend"] == "cpu":
    peak = args.peak_tflops or None
  print(f"device: {device['kind']} ({device['backend']}, {device['count']} visible; jax "
        f"{device['jax']}); dense bf16 peak: {f'{peak:.0f} TFLOP/s' if peak else 'unknown'}",
        flush=True)
  if "train" in args.parts:
    train_part(args, device, peak, scratch)
  if "profile" in args.parts:
    profile_part(args)
  if "attention" in args.parts:
    attention_part(args)
  print(f"uptime after: {uptime()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
