"""attnlab's CPU tuning, in one place; the entry points switch it on with `enable(config)`.

  allocator.py     glibc's malloc thresholds, raised so that XLA:CPU's large buffers stay in the
                   heap between calls (process-wide; ATTNLAB_MALLOC_TUNING=0 leaves them alone)
  cpuinfo.py       the CPU's vendor and instruction-set flags (/proc/cpuinfo), read without JAX
  devices.py       the split of a CPU-only process into one JAX device per core, each step's batch
                   spread over them (`mesh.cpu_devices`, default -1; process-wide, and only
                   before JAX starts)
  fused_kernel.py  the fused softmax-attention C++ kernel (flash_attention.cc, AVX-512, float32)
                   through the jax FFI, compiled on first use (ATTNLAB_CPU_KERNEL=0 turns it off)
  matmul.py        `x @ w` with a backward pass laid out for XLA:CPU's matmul kernels (Dense's),
                   on bfloat16 operands when the trace asks for them (the train step's
                   `matmul_precision`, attnlab.precision: by default where the CPU has
                   AVX512_BF16 or AMX)
  xla_flags.py     XLA:CPU's flags for the process: on Intel CPUs YNNPACK takes the matmuls alone,
                   not the elementwise work around them (faster there, no gain on AMD); added to
                   XLA_FLAGS before JAX starts, never over the user's value
                   (ATTNLAB_XLA_TUNING=0: never, 1: on any CPU)

The allocator, the devices and the XLA flags change the whole process, so nothing applies them
on import: `enable` does, and the trainer (`train.train_and_evaluate`), every `attnlab` command
(`attnlab.cli.tool.launch`) and the benchmarks call it, so the default run is the fast one. A
library user who wants the same calls it once, before anything touches a JAX device:

  from attnlab.backends import cpu
  cpu.enable(config)   # or cpu.enable(): the allocator and the XLA flags, the devices left alone

The fused kernel and the matmul are kernels (attnlab.backends): pure functions that change
nothing outside the call, which attention/ and layers/ ask for by name. They are on by default
wherever attnlab runs, and a kernel applies only where it can (the fused one: float32 math on an
x86-64 CPU with AVX-512 and a C++ compiler, no mask or a key mask; elsewhere the portable JAX
code runs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attnlab.backends.cpu import allocator
from attnlab.backends.cpu import cpuinfo  # pylint: disable=unused-import  (cpu.cpuinfo)
from attnlab.backends.cpu import xla_flags


@dataclasses.dataclass(frozen=True)
class Enabled:
  """What `enable` left in effect."""
  # glibc's malloc thresholds are raised (allocator.keep_freed_memory)
  allocator: bool
  # CPU devices this call split the process into (devices.use_cpu_devices), or None: left alone
  cpu_devices: int | None
  # the flag this call added to XLA_FLAGS (xla_flags.set_flags), or None: left alone
  xla_flag: str | None = None


def enable(config: Any = None) -> Enabled:
  """Applies the CPU tuning to this process; an entry point calls it before anything touches a
  JAX device. Safe to call again (the allocator is set once per process, the XLA flag once:
  a second call finds it in XLA_FLAGS).

  Args:
    config: a run config (ml_collections.ConfigDict) or None. With a config, `mesh.cpu_devices`
      (-1 by default: one device per core on a CPU-only machine, the most that divides
      `batch_size`; 1: one device) splits the CPU into JAX devices; None leaves them alone.
  Returns:
    What is in effect (`Enabled`).
  Raises:
    ConfigError: an explicit `mesh.cpu_devices` that differs from the count JAX already runs.
  """
  applied = allocator.keep_freed_memory()
  xla_flag = xla_flags.set_flags()
  cpu_devices = None
  if config is not None:
    from attnlab.backends.cpu import devices  # pylint: disable=g-import-not-at-top  (imports JAX)
    mesh = config.get("mesh")
    count = devices.AUTO_CPU_DEVICES if mesh is None else mesh.get(
        "cpu_devices", devices.AUTO_CPU_DEVICES)
    cpu_devices = devices.use_cpu_devices(count, config.get("batch_size"), mesh)
  return Enabled(allocator=applied, cpu_devices=cpu_devices, xla_flag=xla_flag)
