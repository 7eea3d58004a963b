"""Scaling out with jax.sharding: the device mesh from config, sharding rules, multi-host start.

The mesh has two axes, sized by `config.mesh`:
  data   batches are split over it; parameters are replicated along it (data parallelism)
  fsdp   batches are split over it too, and parameters and optimizer state are split along their
         largest divisible dimension (FSDP-style; leaves under `mesh.fsdp_min_size` elements stay
         replicated)
`mesh.data = -1` takes every device not used by `fsdp`. On a CPU-only machine `mesh.cpu_devices`
(by default -1: one per core) first splits the process into several CPU devices (the CPU
backend's `enable`, attnlab/backends/cpu/devices.py), so that the data axis spreads each batch
over the cores. When the mesh would hold a single device, `make_mesh` returns None and the
trainer runs exactly its single-device path. Without an fsdp
split the train step runs per device inside `jax.shard_map` and sums the gradients in one
all-reduce (`sum_over_devices`; losses written with `losses.ratio`, train.make_train_step).

With `config.num_seeds = N > 1` every state leaf and batch leaf has a leading replica axis `[N, ...]`
that is never split: the rules below apply to the dimensions after it.

Multi-host: `maybe_initialize_distributed()` calls `jax.distributed.initialize()` when the launcher's
environment says the job has several processes (SLURM `srun`, Open MPI `mpirun`, or the variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID set by hand). Every process runs the same
command; each builds the global batch from the deterministic data iterator and transfers only the
rows that its own devices hold.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attnlab.errors import ConfigError

_LOG = logging.getLogger(__name__)

# Mesh axis names: batches are split over both, parameters only over FSDP_AXIS.
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
MESH_AXES = (DATA_AXIS, FSDP_AXIS)
# Environment switch: 1 forces jax.distributed.initialize() (cluster auto-detection), 0 never calls it.
DISTRIBUTED_ENV = "ATTNLAB_DISTRIBUTED"


# ---------------------------------------------------------------------------------------------------
# Multi-host start


def distributed_env(environ: dict[str, str] | None = None) -> dict[str, Any] | None:
  """The `jax.distributed.initialize` arguments the environment asks for, or None (one process).

  JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES and JAX_PROCESS_ID) gives them explicitly; a SLURM
  step or an Open MPI job with more than one task uses JAX's cluster auto-detection ({}).
  """
  env = os.environ if environ is None else environ
  switch = env.get(DISTRIBUTED_ENV, "").strip().lower()
  if switch in ("0", "false", "no", "off"):
    return None
  if env.get("JAX_COORDINATOR_ADDRESS"):
    missing = [v for v in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if not env.get(v, "").isdigit()]
    if missing:
      raise ConfigError(f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not an int; "
                        f"set all three on every host (process ids 0..JAX_NUM_PROCESSES-1)")
    return {"coordinator_address": env["JAX_COORDINATOR_ADDRESS"],
            "num_processes": int(env["JAX_NUM_PROCESSES"]),
            "process_id": int(env["JAX_PROCESS_ID"])}
  if switch in ("1", "true", "yes", "on"):
    return {}
  if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_STEP_NODELIST" in env:
    return {}
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
    return {}
  return None


def maybe_initialize_distributed() -> bool:
  """Starts JAX's distributed runtime once if the environment is a multi-process job.

  Must run before anything touches a JAX device; the trainer calls it first. Returns whether the
  runtime is initialised.
  """
  if jax.distributed.is_initialized():
    return True
  kwargs = distributed_env()
  if kwargs is None:
    return False
  jax.distributed.initialize(**kwargs)
  _LOG.info("jax.distributed: process %d of %d, %d local / %d global devices",
            jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


# Environment switch of JAX's persistent compilation cache: a folder, or 0/off for none (default:
# the user's cache folder, $XDG_CACHE_HOME or ~/.cache, /attnlab/jax).
COMPILATION_CACHE_ENV = "ATTNLAB_COMPILATION_CACHE"
# Programs that compile faster than this are not stored. JAX's default (1 s) leaves out most of a
# small run's programs: a runlocal GPT run restarted with a warm cache took 10.0 s at 1 s and 8.3 s
# at 0.1 s (7 programs stored, 0.6 MB), against 20 s cold; storing every program (0 s: 25) gave
# only another 0.3 s.
CACHE_MIN_COMPILE_S = 0.1


def enable_compilation_cache(environ: dict[str, str] | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache in the user's cache folder, so that a run of a
  config compiled before (a resume, the same command again, generate after train) loads its
  programs from disk instead of compiling them. Programs that took under CACHE_MIN_COMPILE_S to
  compile are not stored. Left alone when JAX's own setting (JAX_COMPILATION_CACHE_DIR) names a
  folder; ATTNLAB_COMPILATION_CACHE=DIR picks another folder, =0 turns it off. Returns the folder
  or None.
  """
  env = os.environ if environ is None else environ
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  choice = env.get(COMPILATION_CACHE_ENV, "").strip()
  if choice.lower() in ("0", "off", "false", "no"):
    return None
  if not choice:
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    choice = os.path.join(base, "attnlab", "jax")
  try:
    os.makedirs(choice, exist_ok=True)
  except OSError as e:  # a read-only home: compile as usual
    _LOG.info("no compilation cache (%s: %s)", choice, e.strerror)
    return None
  jax.config.update("jax_compilation_cache_dir", choice)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)
  return choice


def local_abstract(tree: Any) -> Any | None:
  """The jax.ShapeDtypeStructs (with shardings) of what `to_local` makes of arrays like those of
  `tree` (ShapeDtypeStructs with shardings, or arrays); None with several processes (there it
  gathers to the host)."""
  if jax.process_count() > 1:
    return None
  leaves = jax.tree.leaves(tree)
  devices = {d for x in leaves for d in x.sharding.device_set}
  single = None
  if len(devices) > 1 and all(d.platform == "cpu" for d in devices):
    single = jax.sharding.SingleDeviceSharding(min(devices, key=lambda d: d.id))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=single or x.sharding), tree)


def is_main_process() -> bool:
  """Whether this process writes logs, metrics and plots (process 0)."""
  return jax.process_index() == 0


# ---------------------------------------------------------------------------------------------------
# Mesh


def mesh_shape(mesh_config: ml_collections.ConfigDict | None,
               num_devices: int) -> tuple[int, int]:
  """(data, fsdp) sizes from `config.mesh` for `num_devices` devices; -1 = the rest."""
  mesh_config = {} if mesh_config is None else mesh_config
  data, fsdp = int(mesh_config.get("data", -1)), int(mesh_config.get("fsdp", 1))
  if fsdp < 1 or data == 0 or data < -1:
    raise ConfigError(f"mesh.data must be -1 (all devices) or >= 1 and mesh.fsdp >= 1, got "
                      f"mesh.data={data}, mesh.fsdp={fsdp}")
  if num_devices % fsdp:
    raise ConfigError(f"mesh.fsdp={fsdp} does not divide the {num_devices} devices; pick a divisor")
  if data == -1:
    data = num_devices // fsdp
  if data * fsdp > num_devices:
    raise ConfigError(f"mesh.data={data} x mesh.fsdp={fsdp} needs {data * fsdp} devices but "
                      f"{num_devices} are available; set mesh.data=-1 to use them all")
  return data, fsdp


def make_mesh(config: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh | None:
  """The ("data", "fsdp") Mesh of `config.mesh`, or None when it would hold a single device.

  With several processes the mesh must span every device of the job.
  """
  devices = list(jax.devices() if devices is None else devices)
  data, fsdp = mesh_shape(config.get("mesh"), len(devices))
  if data * fsdp == 1:
    return None
  if data * fsdp < len(devices):
    if jax.process_count() > 1:
      raise ConfigError(f"mesh.data={data} x mesh.fsdp={fsdp} uses {data * fsdp} of the "
                        f"{len(devices)} devices of this {jax.process_count()}-process job; a "
                        f"multi-host mesh must use them all (set mesh.data=-1)")
    _LOG.info("mesh uses %d of %d devices", data * fsdp, len(devices))
    devices = devices[:data * fsdp]
  # Auto axes: the compiler propagates shardings (task code needs no sharding annotations).
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh((data, fsdp), MESH_AXES, axis_types=auto, devices=devices)


def batch_divisor(mesh: Mesh | None) -> int:
  """Number of pieces a batch is split into (data x fsdp devices)."""
  return 1 if mesh is None else mesh.shape[DATA_AXIS] * mesh.shape[FSDP_AXIS]


# ---------------------------------------------------------------------------------------------------
# Sharding rules


def replicated(mesh: Mesh) -> NamedSharding:
  """The same full value on every device of `mesh`."""
  return NamedSharding(mesh, P())


def leaf_spec(shape: Sequence[int], fsdp: int, min_size: int, replica_axes: int = 0) -> P:
  """PartitionSpec of one state leaf: its largest dimension divisible by `fsdp` (after the first
  `replica_axes` dimensions, and ties to the last) over "fsdp", or replicated."""
  dims = list(shape)[replica_axes:]
  if fsdp <= 1 or not dims or int(np.prod(dims)) < min_size:
    return P()
  candidates = [i for i, d in enumerate(dims) if d % fsdp == 0]
  if not candidates:
    return P()
  best = max(candidates, key=lambda i: (dims[i], i))
  spec = [None] * len(shape)
  spec[replica_axes + best] = FSDP_AXIS
  return P(*spec)


def state_shardings(abstract_state: Any, mesh: Mesh, *, min_size: int = 1024,
                    replica_axes: int = 0) -> Any:
  """NamedShardings for a pytree of arrays/ShapeDtypeStructs (parameters, optimizer state, step).

  Replicated over "data"; split over "fsdp" by `leaf_spec`.
  """
  fsdp = mesh.shape[FSDP_AXIS]
  return jax.tree.map(
      lambda x: NamedSharding(mesh, leaf_spec(x.shape, fsdp, min_size, replica_axes)),
      abstract_state)


def batch_sharding(mesh: Mesh, ndim: int, replica_axes: int = 0) -> NamedSharding:
  """Batch leaves: the example axis (after the replica axes) split over ("data", "fsdp")."""
  if ndim <= replica_axes:
    return replicated(mesh)
  return NamedSharding(mesh, P(*[None] * replica_axes, MESH_AXES))


def shard_batch(batch: Any, mesh: Mesh, replica_axes: int = 0) -> Any:
  """Places a host batch (NumPy pytree, the same global batch on every process) on the mesh.

  Each process transfers only the rows its own devices hold. Leaves without an example axis are
  replicated. Raises ConfigError when the example axis does not split evenly.
  """
  pieces = batch_divisor(mesh)

  def place(path, leaf):
    leaf = np.asarray(leaf)
    if leaf.ndim > replica_axes and leaf.shape[replica_axes] % pieces:
      raise ConfigError(
          f"batch leaf {jax.tree_util.keystr(path) or 'batch'} has {leaf.shape[replica_axes]} "
          f"examples, which do not split over the {pieces} devices of the mesh (data x fsdp); set "
          f"batch_size to a multiple of {pieces}, or choose mesh.data/mesh.fsdp to divide it")
    return _place(leaf, batch_sharding(mesh, leaf.ndim, replica_axes))
  return jax.tree_util.tree_map_with_path(place, batch)


def put_replicated(value: Any, mesh: Mesh) -> Any:
  """A host value (NumPy pytree, equal on every process) replicated over `mesh`."""
  sharding = replicated(mesh)
  return jax.tree.map(lambda leaf: _place(np.asarray(leaf), sharding), value)


def _place(leaf: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A host array (the same on every process) as a global array; each process transfers only
  the pieces its own devices hold."""
  return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])


# ---------------------------------------------------------------------------------------------------
# Inside jax.shard_map: per-device values (the data-parallel train step, train.make_train_step)


def varying_axes(x: Any) -> frozenset[str]:
  """The mesh axes along which `x` differs from device to device inside `jax.shard_map` (those of
  its batch slice, say); empty outside shard_map and for values every device holds alike."""
  aval = jax.typeof(x)
  kind = getattr(aval, "manual_axis_type", None)  # jax 0.10; earlier versions: aval.vma
  return frozenset(kind.varying if kind is not None else getattr(aval, "vma", ()))


def vary(tree: Any, axes: Sequence[str]) -> Any:
  """`tree` marked as differing along `axes` (a no-op on the values). Differentiating with respect
  to such a copy of the parameters gives each device the gradient of its own examples only,
  which `sum_over_devices` then adds up in one all-reduce."""
  def one(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
      return x
    if hasattr(lax, "pcast"):
      return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # older jax
  return jax.tree.map(one, tree)


def sum_over_devices(tree: Any, axes: Sequence[str]) -> Any:
  """`lax.psum` of every leaf of `tree` over `axes`, as one all-reduce of the leaves raveled into
  one vector. Per leaf, XLA:CPU ran 18 all-reduces per nano GPT step (its combiner groups them
  per layer), each a rendezvous of every device on the one thread pool."""
  flat, unravel = ravel_pytree(tree)
  return unravel(lax.psum(flat, tuple(axes)))


def to_host(tree: Any) -> Any:
  """NumPy copies of a pytree of (possibly multi-host) arrays: gathered across processes."""
  if jax.process_count() == 1:
    return jax.device_get(tree)

  def gather(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(gather, tree)


def to_local(tree: Any) -> Any:
  """The pytree as arrays this process can use alone (for host-side evaluation and plots).

  Several processes: gathered to this host. One process: unchanged (jit handles sharded inputs),
  but on CPU devices (`mesh.cpu_devices`) a tree spread over several of them is put on the first
  one, so that evaluation runs as a one-device program. XLA:CPU runs every device's work and its
  collectives on one thread pool (a thread per core); after an evaluation run on all devices at
  once, one device could lag behind and the other's all-reduces of the next training step held
  every thread: training stopped in a collective timeout (seen twice in 2000-step runs).
  """
  if jax.process_count() > 1:
    return jax.tree.map(jnp.asarray, to_host(tree))
  devices = {d for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)
             for d in x.sharding.device_set}
  if len(devices) > 1 and all(d.platform == "cpu" for d in devices):
    # Through host memory (on a CPU device a copy either way): a device_put of the mesh arrays
    # would keep the mesh in their abstract type, and the evaluation program compiled ahead
    # for plain one-device parameters (`local_abstract`, the trainer's warm-up) would not match.
    first = min(devices, key=lambda d: d.id)
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), first)
                        if isinstance(x, jax.Array) else x, tree)
  return tree
