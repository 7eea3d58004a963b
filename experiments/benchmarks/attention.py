"""Attention speed and memory benchmark: attnlab paths vs jax.nn and torch, side by side.

Times softmax attention (scaled_dot score) forward and forward+backward, with and without a
causal mask, for
  reference   attnlab `attend(implementation="reference")` (einsum + masked softmax)
  blocked     attnlab `attend(implementation="blocked")` (attnlab.attention.blocked), what
              `attend()` runs by default at these shapes: on an AVX-512 CPU, float32, the fused
              C++ kernel of attnlab.backends.cpu.fused_kernel (since 2026-11-26)
  blocked-loops  the pure-JAX tile loops of the same module on one device with their one-device
              tiles (blocked.ONE_DEVICE_TILES), what `attend()` ran before the fused kernel and
              still runs with a mask, a bias or on a CPU without AVX-512
  blocked-2chunks  the same kernel with `parallel=2`: the rows cut into two independent chunks
              whose tile loops XLA:CPU runs concurrently, to show what the chunking buys
  blocked-small-tiles  the same kernel on one device with the tiles a device gets under a batch
              split (blocked.PER_DEVICE_TILES; one device's default was these until 2026-11-24),
              to show what the larger one-device tiles buy
  blocked-devices  blocked on one JAX CPU device per core (`jax_num_cpu_devices`, what
              `mesh.cpu_devices=0` gives a training run) with the batch split over them, traced
              under the mesh as the train step is: each device runs the kernel on its slice
  matmuls     the one-device kernel's forward matmuls alone (no softmax): over the head groups
              of blocked.ONE_DEVICE_TILES, q kᵀ then its product with v, on the key range each
              query tile visits (under a causal mask, the tiles the kernel does not skip). Not
              attention: its forward is a floor for the kernel's on this machine (its
              "blocked speed-up" column = the share of the kernel's time that the matmuls
              need); its fwd+bwd is the vjp of two plain products, not a floor
  jax.nn.dpa  `jax.nn.dot_product_attention` (its XLA implementation)
  torch       `torch.nn.functional.scaled_dot_product_attention` (CPU, when torch imports:
              `pip install -e '.[torch]'`)
and prints one table with ms, GFLOP/s and the speed-ups of blocked over jax.nn.dpa and torch,
then the same cells in process CPU time (all threads; steadier than wall time on a shared
machine, and CPU ms / wall ms tells how many cores a call kept busy).
FLOPs are counted as 4·B·H·S²·D forward and 3x that forward+backward, also for causal cells
(dense-equivalent GFLOP/s). Each cell is the best of --reps timed calls after a warm-up; the
implementations take turns in every round so that load from other processes hits them alike.

A last table gives the peak memory of one jitted forward+backward (arguments, outputs and
XLA temporaries, from the compiled executable's memory analysis: deterministic, no run
needed) for blocked vs reference at growing lengths, with the growth factor per doubling.

With --mechanisms, it instead compares the attention mechanisms of attnlab.attention.registry
and the position biases / normalisers of attend side by side (MECHANISM_CELLS): forward+backward
wall ms and peak memory of the jitted step at each --seq, with the growth from the first length
(time(4096)/time(1024) <= 5 is about linear; softmax without the blocked kernel grows ~16x).
--one-core pins the process to one CPU core first.

Run from the repository root:
  python experiments/benchmarks/attention.py                 # S = 128, 512, 1024 + memory
  python experiments/benchmarks/attention.py --seq=512,1024 --reps=7
  python experiments/benchmarks/attention.py --quick         # small and fast smoke run
  python experiments/benchmarks/attention.py --mechanisms=all --seq=512,1024,2048,4096 \
      --batch=1 --heads=4 --one-core                         # every mechanism, one core
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attnlab.attention import core
from attnlab.backends import cpu as cpu_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/machine.py
import machine  # pylint: disable=g-bad-import-order,wrong-import-position

try:  # torch is optional: the [torch] extra
  import torch
except ImportError:  # pragma: no cover - depends on the environment
  torch = None

IMPLS = ("reference", "blocked", "blocked-loops", "blocked-2chunks", "blocked-small-tiles", "blocked-devices",
         "matmuls", "jax.nn.dpa", "torch")
# contenders that the wall-clock table divides by blocked's time (the "blocked speed-up" columns)
BLOCKED_VS = ("blocked-loops", "blocked-2chunks", "blocked-small-tiles", "matmuls", "jax.nn.dpa", "torch")
# GFLOP/s of a large float32 matmul on the 2-core development CPU (issue #14; FMA peak ~233)
MATMUL_CEILING_GFLOPS = 215.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seq", default="128,512,1024",
                 help="comma-separated sequence lengths to time (q_len = k_len)")
  p.add_argument("--batch", type=int, default=8, help="batch size B")
  p.add_argument("--heads", type=int, default=8, help="number of heads H")
  p.add_argument("--head-dim", type=int, default=64, help="head dim D")
  p.add_argument("--reps", type=int, default=5, help="timed calls per cell (best is kept)")
  p.add_argument("--impls", default=",".join(IMPLS),
                 help=f"comma-separated implementations among {', '.join(IMPLS)}")
  p.add_argument("--passes", default="fwd,fwd+bwd", help="fwd and/or fwd+bwd")
  p.add_argument("--causal", default="no,yes", help="no and/or yes")
  p.add_argument("--memory-seq", default="1024,2048,4096",
                 help="lengths for the peak-memory table ('' to skip it)")
  p.add_argument("--torch-threads", type=int, default=0,
                 help="torch.set_num_threads (0 = torch's default, one per core)")
  p.add_argument("--ceiling", type=float, default=MATMUL_CEILING_GFLOPS,
                 help="matmul GFLOP/s ceiling of the machine, for blocked's %% column")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: S=128,256, B=2, 2 reps, memory at 256,512")
  p.add_argument("--mechanisms", default="",
                 help="'all' or comma-separated cells of MECHANISM_CELLS: time and memory of "
                      "each mechanism instead of the implementation tables")
  p.add_argument("--mech-causal", default="yes", choices=("yes", "no"),
                 help="causal (decoder) or bidirectional cells in the --mechanisms table")
  p.add_argument("--one-core", action="store_true",
                 help="pin the process to one CPU core (before JAX starts its threads)")
  args = p.parse_args(argv)
  if args.one_core and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
  if args.mechanisms:
    names = list(MECHANISM_CELLS) if args.mechanisms == "all" else [
        x.strip() for x in args.mechanisms.split(",") if x.strip()]
    unknown = [x for x in names if x not in MECHANISM_CELLS]
    if unknown:
      p.error(f"unknown --mechanisms {unknown}; valid: all, {', '.join(MECHANISM_CELLS)}")
    args.mechanisms = names
  if args.quick:
    args.seq, args.batch, args.reps, args.memory_seq = "128,256", 2, 2, "256,512"
  args.seq = _int_list(args.seq, "--seq")
  args.memory_seq = _int_list(args.memory_seq, "--memory-seq") if args.memory_seq else []
  args.impls = [x.strip() for x in args.impls.split(",") if x.strip()]
  unknown = [x for x in args.impls if x not in IMPLS]
  if unknown:
    p.error(f"unknown --impls {unknown}; valid: {', '.join(IMPLS)}")
  if "blocked-devices" in args.impls and not args.mechanisms:
    cores = len(os.sched_getaffinity(0))
    if cores < 2 or args.batch % cores:
      print(f"blocked-devices needs >= 2 cores and a batch that splits over them ({cores} cores, "
            f"--batch={args.batch}): its column is skipped")
      args.impls.remove("blocked-devices")
    else:  # before any JAX operation fixes the device count
      jax.config.update("jax_num_cpu_devices", cores)
  if "torch" in args.impls and torch is None:
    print("torch is not installed (pip install -e '.[torch]'): its column is skipped")
    args.impls.remove("torch")
  if torch is not None and args.torch_threads > 0:
    torch.set_num_threads(args.torch_threads)
  args.passes = [x.strip() for x in args.passes.split(",") if x.strip()]
  if any(x not in ("fwd", "fwd+bwd") for x in args.passes):
    p.error(f"--passes takes fwd and/or fwd+bwd; got {args.passes}")
  causal = [x.strip() for x in args.causal.split(",") if x.strip()]
  if any(x not in ("no", "yes") for x in causal):
    p.error(f"--causal takes no and/or yes; got {causal}")
  args.causal = [x == "yes" for x in causal]
  return args


def _int_list(text: str, flag: str) -> list[int]:
  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise SystemExit(f"{flag} expects comma-separated integers, e.g. 512,1024; got {text!r}")
  if not values or min(values) < 1:
    raise SystemExit(f"{flag} expects positive integers; got {text!r}")
  return values


# ----------------------------------------------------------------------------- callables


def _attnlab_fn(impl: str, causal: bool) -> Callable:
  if impl == "blocked-2chunks":
    from attnlab.attention import blocked  # pylint: disable=g-import-not-at-top
    return lambda q, k, v: blocked.blocked_attention(q, k, v, causal=causal, parallel=2)
  if impl == "blocked-loops":
    from attnlab.attention import blocked  # pylint: disable=g-import-not-at-top
    return lambda q, k, v: blocked.blocked_attention(q, k, v, causal=causal,
                                                     tiles=blocked.ONE_DEVICE_TILES)
  if impl == "blocked-small-tiles":
    from attnlab.attention import blocked  # pylint: disable=g-import-not-at-top
    return lambda q, k, v: blocked.blocked_attention(q, k, v, causal=causal,
                                                     tiles=blocked.PER_DEVICE_TILES)
  if impl == "blocked-devices":
    # `attend(implementation="blocked")` traced under the mesh, as the train step traces the
    # model: the kernel then runs on each device's slice of the batch.
    plain, mesh = _attnlab_fn("blocked", causal), _batch_mesh()

    def under_mesh(q, k, v):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return plain(q, k, v)
    return under_mesh

  def f(q, k, v):  # [B, H, S, D] each
    return core.attend(q, k, v, score="scaled_dot", causal=causal, implementation=impl,
                       return_weights=False)[0]
  return f


def _matmul_floor(causal: bool) -> Callable:
  """The matmuls of the one-device kernel without its softmax (the `matmuls` contender)."""
  from attnlab.attention import blocked  # pylint: disable=g-import-not-at-top
  tiles = blocked.ONE_DEVICE_TILES

  def f(q, k, v):  # [B, H, S, D] each
    lead, s, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    rows = int(np.prod(lead))
    bq = min(s, tiles.causal_block if causal else tiles.block_q)
    bk = min(s, tiles.causal_block if causal else tiles.block_k)
    group = max(g for g in range(1, max(1, tiles.tile_elements // (bq * bk)) + 1)
                if rows % g == 0)
    split = lambda x: x.reshape((rows // group, group) + x.shape[-2:])

    def one(qkv):
      qg, kg, vg = qkv  # [G, S, D]
      outs = []
      for start in range(0, s, bq):  # query tiles; causal: keys up to the tile's last row
        stop = min(s, start + bq)
        keys = -(-stop // bk) * bk if causal else s
        scores = jnp.einsum("gqd,gkd->gqk", qg[:, start:stop] / np.sqrt(d), kg[:, :keys])
        outs.append(jnp.einsum("gqk,gkd->gqd", scores, vg[:, :keys]))
      return jnp.concatenate(outs, axis=1)
    return jax.lax.map(one, (split(q), split(k), split(v))).reshape(q.shape)
  return f


def _batch_mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((len(jax.devices()),), ("batch",),
                       axis_types=(jax.sharding.AxisType.Auto,))


def _dpa_fn(causal: bool) -> Callable:
  def f(q, k, v):  # [B, S, H, D] each (jax.nn's layout)
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  return f


def jax_callables(impl: str, causal: bool) -> dict[str, Callable]:
  f = (_dpa_fn(causal) if impl == "jax.nn.dpa" else _matmul_floor(causal) if impl == "matmuls"
       else _attnlab_fn(impl, causal))

  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)

  return {"fwd": jax.jit(f), "fwd+bwd": jax.jit(fwd_bwd)}


def torch_callables(causal: bool) -> dict[str, Callable]:
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def fwd(q, k, v, do):
    with torch.no_grad():
      return sdpa(q, k, v, is_causal=causal)

  def fwd_bwd(q, k, v, do):
    for x in (q, k, v):
      x.grad = None
    out = sdpa(q, k, v, is_causal=causal)
    out.backward(do)
    return out

  return {"fwd": fwd, "fwd+bwd": fwd_bwd}


# ----------------------------------------------------------------------------- timing


def make_inputs(b: int, h: int, s: int, d: int, seed: int = 0) -> dict[str, tuple]:
  """The same numbers in each implementation's layout."""
  rng = np.random.default_rng(seed)
  q, k, v, do = (rng.standard_normal((b, h, s, d), dtype=np.float32) for _ in range(4))
  bhsd = tuple(jnp.asarray(x) for x in (q, k, v, do))  # [B, H, S, D]
  bshd = tuple(jnp.asarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v, do))  # [B, S, H, D]
  out = {"reference": bhsd, "blocked": bhsd, "blocked-loops": bhsd, "blocked-2chunks": bhsd,
         "blocked-small-tiles": bhsd, "matmuls": bhsd, "jax.nn.dpa": bshd}
  if len(jax.devices()) > 1 and b % len(jax.devices()) == 0:  # blocked-devices: batch split
    split = NamedSharding(_batch_mesh(), P("batch"))
    out["blocked-devices"] = tuple(jax.device_put(x, split) for x in (q, k, v, do))
  if torch is not None:
    out["torch"] = tuple(torch.from_numpy(x.copy()).requires_grad_(i < 3)
                         for i, x in enumerate((q, k, v, do)))
  return out


def _run_once(impl: str, fn: Callable, args: tuple, pass_: str) -> tuple[float, float]:
  """(wall seconds, process CPU seconds over all threads) of one call."""
  t0, c0 = time.perf_counter(), time.process_time()
  if impl == "torch":
    fn(*args)
  else:
    jax.block_until_ready(fn(*args) if pass_ == "fwd+bwd" else fn(*args[:3]))
  return time.perf_counter() - t0, time.process_time() - c0


def time_cell(fns: dict[str, Callable], inputs: dict[str, tuple], pass_: str,
              reps: int) -> dict[str, tuple[float, float]]:
  """Best-of-reps (wall, CPU) seconds per implementation, taking turns every round; the order
  rotates from round to round, so that no implementation always runs right after the same one
  (torch's OpenMP threads keep spinning for a while after its call and slow whatever follows)."""
  times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
  for name, fn in fns.items():  # warm-up: compile and first touch
    _run_once(name, fn, inputs[name], pass_)
  names = list(fns)
  for round_ in range(reps):
    shift = round_ % len(names)
    for name in names[shift:] + names[:shift]:
      times[name].append(_run_once(name, fns[name], inputs[name], pass_))
  return {name: (min(t[0] for t in ts), min(t[1] for t in ts)) for name, ts in times.items()}


def check_agreement(b: int, h: int, s: int, d: int, causal: bool) -> float:
  """Max |blocked - reference| of the context on the benchmark inputs (sanity check)."""
  q, k, v, _ = make_inputs(b, h, s, d)["reference"]
  ref = jax.jit(_attnlab_fn("reference", causal))(q, k, v)
  blk = jax.jit(_attnlab_fn("blocked", causal))(q, k, v)
  err = float(jnp.max(jnp.abs(ref - blk)))
  if len(jax.devices()) > 1 and b % len(jax.devices()) == 0:
    q, k, v, _ = make_inputs(b, h, s, d)["blocked-devices"]
    split = jax.jit(_attnlab_fn("blocked-devices", causal))(q, k, v)
    err = max(err, float(jnp.max(jnp.abs(ref - np.asarray(split)))))
  return err


# ----------------------------------------------------------------------------- memory


def memory_bytes(impl: str, b: int, h: int, s: int, d: int,
                 causal: bool = False) -> tuple[int, int]:
  """(peak, temporaries) in bytes of the compiled jitted forward+backward.

  peak = arguments + outputs + XLA temporaries (minus aliased buffers).
  """
  fwd_bwd = jax_callables(impl, causal)["fwd+bwd"]
  spec = jax.ShapeDtypeStruct((b, h, s, d), jnp.float32)
  stats = fwd_bwd.lower(spec, spec, spec, spec).compile().memory_analysis()
  peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
          + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  return int(peak), int(stats.temp_size_in_bytes)


# ----------------------------------------------------------------------------- tables


def _fmt_table(header: list[str], rows: list[list[str]]) -> str:
  widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
  line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(header), sep] + [line(r) for r in rows])


def speed_tables(args: argparse.Namespace) -> tuple[str, str]:
  """(wall-clock table, CPU-time table)."""
  b, h, d = args.batch, args.heads, args.head_dim
  header = ["S", "causal", "pass"] + [f"{i} ms (GFLOP/s)" for i in args.impls]
  cpu_header = ["S", "causal", "pass"] + [f"{i} CPU ms (GFLOP/CPU-s)" for i in args.impls]
  if "blocked" in args.impls:
    header += [f"blocked speed-up vs {i}" for i in args.impls
               if i in BLOCKED_VS]
    header += [f"blocked % of {args.ceiling:.0f} GFLOP/s"]
  devices_vs_torch = "blocked-devices" in args.impls and "torch" in args.impls
  if devices_vs_torch:
    header += ["blocked-devices vs torch", f"blocked-devices % of {args.ceiling:.0f} GFLOP/s"]
  rows, cpu_rows = [], []
  for s in args.seq:
    inputs = make_inputs(b, h, s, d)
    for causal in args.causal:
      fns = {i: (torch_callables(causal) if i == "torch" else jax_callables(i, causal))
             for i in args.impls}
      for pass_ in args.passes:
        timed = time_cell({i: fns[i][pass_] for i in args.impls}, inputs, pass_, args.reps)
        best = {i: timed[i][0] for i in args.impls}
        cpu = {i: timed[i][1] for i in args.impls}
        flops = 4 * b * h * s * s * d * (3 if pass_ == "fwd+bwd" else 1)
        row = [str(s), "yes" if causal else "no", pass_]
        cpu_rows.append(row + [f"{cpu[i] * 1e3:.1f} ({flops / max(cpu[i], 1e-9) / 1e9:.0f})"
                               for i in args.impls])
        row = row + [f"{best[i] * 1e3:.1f} ({flops / best[i] / 1e9:.0f})" for i in args.impls]
        if "blocked" in args.impls:
          row += [f"{best[i] / best['blocked']:.2f}x" for i in args.impls
                  if i in BLOCKED_VS]
          row += [f"{100 * flops / best['blocked'] / 1e9 / args.ceiling:.0f}%"]
        if devices_vs_torch:
          row += [f"{best['torch'] / best['blocked-devices']:.2f}x",
                  f"{100 * flops / best['blocked-devices'] / 1e9 / args.ceiling:.0f}%"]
        rows.append(row)
        print("  measured", " ".join(row), flush=True)
  return _fmt_table(header, rows), _fmt_table(cpu_header, cpu_rows)


def memory_table(args: argparse.Namespace) -> str:
  b, h, d = args.batch, args.heads, args.head_dim
  header = ["S", "blocked peak MiB", "growth", "blocked temp MiB", "reference peak MiB",
            "growth", "reference temp MiB"]
  rows, prev = [], None
  growth = lambda now, before: "" if before is None else f"{now / before:.2f}x"
  for s in args.memory_seq:
    blk, blk_temp = memory_bytes("blocked", b, h, s, d)
    ref, ref_temp = memory_bytes("reference", b, h, s, d)
    rows.append([str(s), f"{blk / 2**20:.1f}", growth(blk, prev and prev[0]),
                 f"{blk_temp / 2**20:.1f}", f"{ref / 2**20:.1f}", growth(ref, prev and prev[1]),
                 f"{ref_temp / 2**20:.1f}"])
    prev = (blk, ref)
  return _fmt_table(header, rows)


# ----------------------------------------------------------------------------- mechanisms

# cell -> (registry mechanism, options for its fn, options for its init); "full" runs
# attend(implementation="auto"), i.e. the blocked kernel on CPU from 256x256 scores
MECHANISM_CELLS: dict[str, tuple[str, dict, dict]] = {
    "softmax": ("full", {}, {}),
    "softmax-reference": ("full", {"implementation": "reference"}, {}),
    "alibi": ("full", {"bias": "alibi"}, {}),
    "t5_bias": ("full", {"bias": "t5"}, {}),
    "softmax_sink": ("full", {"normalizer": "softmax_sink"}, {}),
    "sigmoid": ("full", {"normalizer": "sigmoid"}, {}),
    "sparsemax": ("full", {"normalizer": "sparsemax"}, {}),
    "topk": ("full", {"normalizer": "topk", "topk": 8}, {}),
    "linear": ("linear", {}, {}),
    "performer": ("performer", {}, {"num_features": 256}),
    "linformer": ("linformer", {}, {"linformer_k": 64}),
    "sliding_window": ("sliding_window", {"window": 128, "block": 128}, {}),
    "bigbird": ("bigbird", {"block": 64, "num_global": 1, "num_random": 2}, {}),
}


def mechanism_fn(cell: str, causal: bool, h: int, d: int, s: int) -> Callable | None:
  """f(q, k, v) -> context for one MECHANISM_CELLS cell, or None where it is not defined."""
  # pylint: disable-next=g-import-not-at-top
  from attnlab.attention import normalizers, positions, registry
  name, opts, init_opts = MECHANISM_CELLS[cell]
  mech = registry.get_mechanism(name)
  if causal and not mech.supports.causal:
    return None
  params = mech.init(jax.random.PRNGKey(0), h, d, s, **init_opts)
  opts = dict(opts)
  if opts.get("bias") == "alibi":
    opts["bias"] = positions.AlibiBias(positions.alibi_slopes(h))
  elif opts.get("bias") == "t5":
    opts["bias"] = positions.T5Bias(0.02 * jnp.ones((32, h)), bidirectional=not causal)
  if "normalizer" in opts:
    opts["normalizer_params"] = normalizers.init_normalizer_params(
        opts["normalizer"], jax.random.PRNGKey(1), h)

  def f(q, k, v):  # [B, H, S, D] each
    return mech.fn(q, k, v, causal=causal, params=params, return_weights=False, **opts)[0]
  return f


def mechanism_table(args: argparse.Namespace) -> str:
  """fwd+bwd wall ms and peak MiB per (mechanism, S), with the growth from the first S."""
  b, h, d = args.batch, args.heads, args.head_dim
  causal = args.mech_causal == "yes"
  header = ["mechanism"] + [f"S={s} ms" for s in args.seq] + [
      f"time x{args.seq[-1] // args.seq[0]} S"] + [f"S={s} MiB" for s in args.seq] + [
      f"memory x{args.seq[-1] // args.seq[0]} S"]
  rows = []
  for cell in args.mechanisms:
    times, mems = [], []
    for s in args.seq:
      f = mechanism_fn(cell, causal, h, d, s)
      if f is None:
        break
      inputs = make_inputs(b, h, s, d)["reference"]

      def fwd_bwd(q, k, v, do, f=f):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do)
      step = jax.jit(fwd_bwd)
      stats = step.lower(*inputs).compile().memory_analysis()
      mems.append(stats.argument_size_in_bytes + stats.output_size_in_bytes
                  + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
      times.append(time_cell({cell: step}, {cell: inputs}, "fwd+bwd", args.reps)[cell][0])
      print(f"  measured {cell} S={s}: {times[-1] * 1e3:.1f} ms, {mems[-1] / 2**20:.1f} MiB",
            flush=True)
    if not times:
      rows.append([cell] + ["-"] * (2 * len(args.seq) + 2))
      continue
    grow = lambda xs: f"{xs[-1] / xs[0]:.1f}x" if len(xs) == len(args.seq) > 1 else "-"
    rows.append([cell] + [f"{t * 1e3:.1f}" for t in times] + [grow(times)]
                + [f"{m / 2**20:.1f}" for m in mems] + [grow(mems)])
  return _fmt_table(header, rows)


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  cpu_backend.enable()  # the allocator settings, as the trainer and `attnlab` commands
  if args.mechanisms:
    b, h, d = args.batch, args.heads, args.head_dim
    print(f"attention mechanisms: B={b} H={h} D={d} float32, causal={args.mech_causal}, best "
          f"of {args.reps}; {len(os.sched_getaffinity(0))} core(s) of {os.cpu_count()}, "
          f"jax {jax.__version__} ({jax.default_backend()})")
    print(machine.cpu_line())
    if hasattr(os, "getloadavg"):
      print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    t0 = time.perf_counter()
    print(mechanism_table(args))
    if hasattr(os, "getloadavg"):
      print("load average after: %.2f %.2f %.2f" % os.getloadavg())
    print(f"total {time.perf_counter() - t0:.0f} s")
    return
  b, h, d = args.batch, args.heads, args.head_dim
  torch_info = (f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
                if torch is not None else "torch not installed")
  print(f"attention benchmark: B={b} H={h} D={d} float32, best of {args.reps}; "
        f"{platform.processor() or platform.machine()}, {machine.cores()} CPUs, "
        f"jax {jax.__version__} ({jax.default_backend()}), {torch_info}")
  print(machine.cpu_line())
  if hasattr(os, "getloadavg"):
    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
  for causal in args.causal:
    err = check_agreement(min(b, 2), min(h, 2), min(args.seq), d, causal)
    print(f"blocked vs reference max |diff| (S={min(args.seq)}, causal={causal}): {err:.1e}")
  t0 = time.perf_counter()
  table, cpu_table = speed_tables(args)
  print("\nspeed: wall ms per call (dense-equivalent GFLOP/s); speed-up = other ms / blocked ms")
  print(table)
  print("\nwork: process CPU ms per call, all threads (GFLOP per CPU-second); on a shared "
        "machine this is steadier than wall time, and it shows how many cores a call used")
  print(cpu_table)
  if args.memory_seq:
    print("\npeak memory of one jitted forward+backward (compiled memory analysis), "
          f"B={b} H={h} D={d}:")
    print(memory_table(args))
  if hasattr(os, "getloadavg"):
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())
  print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
