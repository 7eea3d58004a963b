"""Fused softmax attention on the CPU: a C++ kernel (AVX-512) called through the jax FFI.

XLA:CPU runs the blocked kernel's tile loops op by op, so each score tile makes four trips through
memory (matmul out, max in, exp out, matmul in). `flash_attention.cc` (beside this file) does one
block of query rows at a time with the rows' scores kept in the core's L2 cache: scores, softmax
and the product with v in one pass, and the same in the backward pass (probabilities recomputed
from the saved row logsumexp). It runs on every core of the process (threads of its own, one per
core).

The kernel is compiled on first use with the machine's C++ compiler (`$CXX`, else `c++`/`g++`,
`-O3 -march=native`) into `$XDG_CACHE_HOME/attnlab/kernels` (default `~/.cache`), once per source,
jax version and compiler. It is used only where it applies: float32, an x86-64 CPU with AVX-512,
a compiler present (else `blocked_attention` keeps its pure-JAX path, with one logged line saying
why), no mask or a key (padding) mask. `ATTNLAB_CPU_KERNEL=0` turns it off.

It is the default "fused_attention" kernel of attnlab.backends: attnlab.attention.blocked asks for
it by that name (and calls `usable`, `default_threads` and `attention`), knowing nothing of the CPU.

  out = attention(q, k, v, causal=False)   # q (already scaled), k, v: [rows, len, d] float32
  out = attention(q, k, v, False, None, key_mask)   # key_mask: bool [mask_rows, k_len]
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.backends.cpu import cpuinfo

_LOG = logging.getLogger(__name__)
SOURCE = pathlib.Path(__file__).with_name("flash_attention.cc")
FORWARD, BACKWARD = "attnlab_fused_attention_fwd", "attnlab_fused_attention_bwd"
# Set ATTNLAB_CPU_KERNEL=0 to keep the pure-JAX blocked kernel everywhere.
ENV_SWITCH = "ATTNLAB_CPU_KERNEL"
_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
  for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cache_dir() -> pathlib.Path:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "attnlab" / "kernels"


def _build(compiler: str) -> pathlib.Path:
  """The compiled library for this source, jax version and compiler (built once, cached)."""
  include = jax.ffi.include_dir()
  flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-isystem", include]
  key = hashlib.sha256(b"\0".join(
      [SOURCE.read_bytes(), jax.__version__.encode(), compiler.encode(), " ".join(flags).encode(),
       platform.machine().encode()])).hexdigest()[:16]
  target = _cache_dir() / f"flash_attention-{key}.so"
  if target.is_file():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  # another process may build the same library at once: each writes its own file, then renames
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
  os.close(fd)
  try:
    result = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp, "-lpthread"],
                            capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
      raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
    os.replace(tmp, target)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return target


def unavailable_reason() -> str | None:
  """None when the fused kernel can run here (building and registering it on the first call),
  else why not (one line)."""
  with _lock:
    if "reason" in _state:
      return _state["reason"]  # type: ignore[return-value]
    reason = None
    if os.environ.get(ENV_SWITCH, "1") == "0":
      reason = f"{ENV_SWITCH}=0"
    elif platform.machine() not in ("x86_64", "AMD64"):
      reason = f"not an x86-64 CPU ({platform.machine()})"
    elif not {"avx512f", "avx512bw", "avx512vl"} <= cpuinfo.flags():
      reason = "the CPU lacks AVX-512 (F, BW and VL)"
    elif (compiler := _compiler()) is None:
      reason = "no C++ compiler (set CXX, or install g++)"
    else:
      try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(FORWARD, jax.ffi.pycapsule(library.AttnlabFusedAttentionFwd),
                                    platform="cpu")
        jax.ffi.register_ffi_target(BACKWARD, jax.ffi.pycapsule(library.AttnlabFusedAttentionBwd),
                                    platform="cpu")
        _state["library"] = library
      except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        reason = f"building the kernel failed: {' '.join(str(e).split())[:300]}"
    if reason is not None:
      _LOG.info("fused CPU attention kernel not used (%s); the pure-JAX blocked kernel runs", reason)
    _state["reason"] = reason
    return reason


def usable() -> bool:
  """Whether `attention` (float32) can run on the default backend."""
  return jax.default_backend() == "cpu" and unavailable_reason() is None


def default_threads() -> int:
  """Threads of one call: one per core this process may run on."""
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:
    return max(1, os.cpu_count() or 1)


def _require() -> None:
  reason = unavailable_reason()  # builds and registers the kernel on the first call
  if reason is not None:
    raise RuntimeError(f"the fused CPU attention kernel cannot run here: {reason}")


def _call(target: str, results, operands, key_mask, causal: bool, threads: int | None):
  """The FFI call of `target` (building the kernel first if need be): operands, then the key
  mask's bytes (a 1-byte placeholder without one), then the attributes."""
  _require()
  mask = (jnp.zeros((1,), jnp.uint8) if key_mask is None
          else jnp.asarray(key_mask).astype(jnp.uint8))
  return jax.ffi.ffi_call(target, results, vmap_method="broadcast_all")(
      *operands[:3], mask, *operands[3:], causal=np.int64(causal),
      masked=np.int64(key_mask is not None), threads=np.int64(threads or default_threads()))


def _forward_call(q, k, v, key_mask, causal: bool, threads: int | None):
  rows, q_len, _ = q.shape
  results = (jax.ShapeDtypeStruct((rows, q_len, v.shape[-1]), jnp.float32),
             jax.ShapeDtypeStruct((rows, q_len), jnp.float32))
  return _call(FORWARD, results, (q, k, v), key_mask, causal, threads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = False,
              threads: int | None = None, key_mask: jax.Array | None = None) -> jax.Array:
  """softmax(q kᵀ) v for q `[rows, q_len, d]` (scaled already), k `[rows, k_len, d]`, v
  `[rows, k_len, d_v]`, float32, q_len and k_len >= 1; causal: query i sees key j iff
  j <= i + max(k_len - q_len, 0). `threads`: of each call (None: one per core; a slice of a
  batch split over CPU devices gets its share). `key_mask`: None, or bool `[mask_rows, k_len]`
  (True = visible) with mask_rows dividing rows, row m shared by rows m * g .. (m + 1) * g - 1
  (g = rows / mask_rows: a `[batch, 1, 1, k_len]` padding mask against `[batch * heads]` rows);
  a query with no visible key gets a zero context. Check `usable` first."""
  return _varying_like(_forward_call(q, k, v, key_mask, causal, threads)[0], q)


def _varying_like(x: jax.Array, ref: jax.Array) -> jax.Array:
  """x marked as varying over the manual mesh axes that `ref` varies over (inside shard_map the
  FFI's results carry no such axes, and a custom VJP's cotangents must match its inputs')."""
  def varying(y):
    aval = jax.typeof(y)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))
  missing = tuple(sorted(varying(ref) - varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _attention_fwd(q, k, v, causal, threads, key_mask):
  out, lse = _forward_call(q, k, v, key_mask, causal, threads)
  out = _varying_like(out, q)
  return out, (q, k, v, key_mask, out, _varying_like(lse, q))


def _attention_bwd(causal, threads, residuals, dout):
  q, k, v, key_mask, out, lse = residuals
  results = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
  dq, dk, dv = _call(BACKWARD, results, (q, k, v, out, lse, dout.astype(jnp.float32)), key_mask,
                     causal, threads)
  return _varying_like(dq, q), _varying_like(dk, k), _varying_like(dv, v), None


attention.defvjp(_attention_fwd, _attention_bwd)
