"""Platform tuning, kept out of the library code: one package per platform (today `cpu/`).

`import attnlab`, and importing any of its library modules, changes nothing in the process. What
tunes a platform lives in its package here, in two kinds:

  process settings  the memory allocator's thresholds and the split of the CPU into JAX devices.
                    They change the whole process, so only an entry point applies them, through
                    `attnlab.backends.cpu.enable(config)`: the trainer, every `attnlab` command
                    and the benchmarks call it, so the default run is the fast one.
  kernels           faster versions of one primitive (the fused softmax attention, the matmul of
                    `Dense`): pure functions that change nothing outside the call. The library
                    code (attention/, layers/) asks for them by name through `kernel(name)`
                    and knows nothing of the platform; a kernel says itself where it applies.
                    The defaults below are on wherever attnlab runs, a library call included
                    (its module is imported on the first use, not before).

  fused = backends.kernel("fused_attention")   # None: the portable JAX code
  backends.use_kernel("fused_attention", None)  # turn it off in this process (returns the old)
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

# kernel name -> "module" (the module is the kernel) or "module:attribute"; None = no kernel
DEFAULT_KERNELS: dict[str, str | None] = {
    # blocked_attention's fused path: a module with usable(), default_threads() and
    # attention(q, k, v, causal, threads, key_mask) (attnlab.backends.cpu.fused_kernel)
    "fused_attention": "attnlab.backends.cpu.fused_kernel",
    # layers.dense.matmul: `x @ w` with a backward pass laid out for XLA:CPU's matmuls
    "matmul": "attnlab.backends.cpu.matmul:matmul",
}

_lock = threading.Lock()
_chosen: dict[str, Any] = {}


def _load(spec: str | None) -> Any:
  if spec is None:
    return None
  module, _, attribute = spec.partition(":")
  loaded = importlib.import_module(module)
  return getattr(loaded, attribute) if attribute else loaded


def kernel(name: str) -> Any:
  """The kernel in use for `name` (see DEFAULT_KERNELS), or None: the caller's portable code."""
  try:
    return _chosen[name]
  except KeyError:
    pass
  if name not in DEFAULT_KERNELS:
    raise KeyError(f"unknown kernel {name!r}; valid: {', '.join(DEFAULT_KERNELS)}")
  with _lock:
    if name not in _chosen:
      _chosen[name] = _load(DEFAULT_KERNELS[name])
    return _chosen[name]


def use_kernel(name: str, impl: Any) -> Any:
  """Makes `impl` (None: none, the portable code) the kernel of `name` for the calls traced from
  now on; returns the one it replaces. Programs compiled before keep what they traced."""
  if name not in DEFAULT_KERNELS:
    raise KeyError(f"unknown kernel {name!r}; valid: {', '.join(DEFAULT_KERNELS)}")
  previous = kernel(name)
  with _lock:
    _chosen[name] = impl
  return previous
