"""The split of a CPU-only process into one JAX device per core (`mesh.cpu_devices`).

XLA:CPU runs a step's elementwise fusions one after another on one thread; as separate devices the
cores each run a slice of the batch (data parallel: the same updates up to float rounding, the
gradients summed in one all-reduce, attnlab.parallel). JAX fixes its device count when it starts,
so `use_cpu_devices` must run before anything touches a device: `attnlab.backends.cpu.enable`
(config) calls it, and the trainer calls that first.
"""

from __future__ import annotations

import logging
import os

import jax
import ml_collections

from attnlab.backends.cpu import xla_flags
from attnlab.errors import ConfigError

_LOG = logging.getLogger(__name__)

# `mesh.cpu_devices` value meaning "automatic": one device per core on a CPU-only machine.
AUTO_CPU_DEVICES = -1


def use_cpu_devices(count: int, batch_size: int | None = None,
                    mesh_config: ml_collections.ConfigDict | None = None) -> int | None:
  """Splits this process's CPU into JAX devices so that the mesh's data axis spreads a batch over
  the cores. `count`: -1 (the default, AUTO_CPU_DEVICES) one per core on a CPU-only machine, or
  fewer, the most that divides `batch_size` (one logged line when that is one device); 0 the same
  on any machine; 1 leaves JAX's default alone (one device); N > 1 N devices.

  XLA:CPU runs a step's elementwise fusions one after another on one thread; as separate devices
  the cores each run a slice of the batch (data parallel: same updates, up to float rounding).
  JAX fixes the count when it starts, so this must run before anything touches a device
  (`attnlab.backends.cpu.enable(config)` calls it, and the trainer calls that first).
  Afterwards an explicit count that differs from the running one is a ConfigError; -1 and 0
  keep whatever is running. Automatic mode leaves the devices alone when JAX may use an
  accelerator (JAX_PLATFORMS, or an installed GPU/TPU plugin) or when XLA_FLAGS
  forces a host device count. Nothing changes on other backends (the mesh takes `jax.devices()`,
  the GPUs or TPUs, whatever the CPU count). Returns the count set, or None when left alone.
  """
  cores = len(os.sched_getaffinity(0))
  if count == AUTO_CPU_DEVICES:
    if cores < 2 or not _cpu_only() or "xla_force_host_platform_device_count" in os.environ.get(
        "XLA_FLAGS", ""):
      return None
    data, fsdp = _mesh_sizes(mesh_config)
    if data != -1:  # an explicit mesh: as many devices as it names
      wanted = data * fsdp
    else:
      wanted = cpu_device_count(0, batch_size, cores, multiple_of=fsdp)
      if wanted < cores and not _backend_started():
        _LOG.info("batch_size=%s does not split over the %d CPU cores: training on %d device(s) "
                  "(a batch_size divisible by %d uses them all; mesh.cpu_devices=1 silences this)",
                  batch_size, cores, wanted, cores)
  else:
    wanted = cpu_device_count(count, batch_size, cores)
  if wanted <= 1:  # JAX's own default (which honours XLA_FLAGS' forced device count)
    return None
  try:
    jax.config.update("jax_num_cpu_devices", wanted)
  except RuntimeError:  # JAX has started: the count is fixed
    running = len(jax.devices("cpu"))
    if count > 0 and running != count:
      raise ConfigError(
          f"mesh.cpu_devices={count} but JAX already started with {running} CPU device(s) in this "
          f"process; start a fresh process (`attnlab train` does), or call "
          f"jax.config.update('jax_num_cpu_devices', {count}) right after importing jax") from None
    return None
  if count == AUTO_CPU_DEVICES:
    _LOG.info("training on %d CPU devices, one per core, each taking a slice of every batch "
              "(mesh.cpu_devices=1: one device)", wanted)
  else:
    _LOG.info("mesh.cpu_devices=%d: %d CPU devices", count, wanted)
  return wanted


def _mesh_sizes(mesh_config: ml_collections.ConfigDict | None) -> tuple[int, int]:
  mesh_config = {} if mesh_config is None else mesh_config
  return int(mesh_config.get("data", -1)), max(1, int(mesh_config.get("fsdp", 1)))


def _backend_started() -> bool:
  """Whether JAX has created its backends (the device count is then fixed); other jax versions:
  assume not (the answer only decides whether a line is logged)."""
  return xla_flags.backend_started(unknown=False)


def _cpu_only() -> bool:
  """Whether JAX will run on the CPU only: JAX_PLATFORMS (or jax_platforms) names only cpu, or,
  unset, no GPU/TPU plugin (jax_plugins entry points, jax_cuda*/jax_rocm*, libtpu) is installed.
  Checked without starting JAX."""
  platforms = (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "") or "").lower()
  if platforms.strip():
    return {p.strip() for p in platforms.split(",") if p.strip()} == {"cpu"}
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  try:
    if importlib.metadata.entry_points(group="jax_plugins"):
      return False
  except Exception:  # pylint: disable=broad-except  (broken metadata: assume accelerators)
    return False
  names = {d.metadata.get("Name", "").lower().replace("_", "-")
           for d in importlib.metadata.distributions()}
  if any(n.startswith(("jax-cuda", "jax-rocm", "libtpu", "jax-tpu")) for n in names):
    return False
  return importlib.util.find_spec("libtpu") is None


def cpu_device_count(count: int, batch_size: int | None, cores: int, multiple_of: int = 1) -> int:
  """`mesh.cpu_devices` resolved: `count` (> 0), or for 0 and -1 the most devices, at most one per
  core and a multiple of `multiple_of`, that divide `batch_size` (`multiple_of` if none does)."""
  if count > 0:
    return count
  fits = [n for n in range(multiple_of, max(cores, multiple_of) + 1, multiple_of)
          if not batch_size or batch_size % n == 0]
  return max(fits) if fits else multiple_of
