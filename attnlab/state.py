"""The train state of a run and its N >= 1 replicas (seeds), apart from the loop that trains it.

- `TrainState` (step, params, optimizer state); `make_optimizer(config.optimizer, schedule)`;
  `task_optimizer`, the one a run trains with: the task's frozen parameters (Task.frozen, e.g.
  GPT's finetune.freeze_layers) left out by `freeze`, loss scaling for float16.
- Keys: parameters come from `split(key(seed))[0]`; step t's dropout/sampling key is
  `fold_in(split(key(seed))[1], t)` (`run_keys`).
- Replicas: with `config.num_seeds = N > 1`, N replicas (seeds seed, ..., seed+N-1: each its own
  init key, step keys and data order) train in one program by `jax.vmap`: parameters and
  optimizer state get a leading `[N]` axis (`REPLICA_AXES`; the step counter is shared). Every
  function here takes the replica count from the config, so the trainer has no seed branches.
- `initial_state` (step 0, placed on the mesh), `with_pretrained` (`Task.load_pretrained`, eager),
  `abstract_train_state` (the restore target), `evaluate` (per replica, averaged).
- `restore(workdir, step)`: a run's config, task and restored state, for `attnlab.analysis.load_run`,
  `attnlab inspect` and the start of a fine-tuning run (`config.init_from`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
import os
import pathlib
import weakref
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from attnlab import checkpoint
from attnlab import config_utils
from attnlab import config_checks
from attnlab import errors
from attnlab import parallel
from attnlab import precision
from attnlab import rundir
from attnlab import tasks
from attnlab.data import assets as assets_lib

_LOG = logging.getLogger(__name__)


@flax.struct.dataclass
class TrainState:
  """Everything a checkpoint holds besides the data-iterator position."""
  # [] int32: number of updates applied so far.
  step: jax.Array
  # The task's parameters (a pytree of arrays).
  params: Any
  # The optax optimizer state.
  opt_state: Any


def make_schedule(opt: ml_collections.ConfigDict, num_train_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to learning_rate, then cosine, linear or constant."""
  lr, warmup, end = opt.learning_rate, opt.warmup_steps, opt.end_learning_rate
  decay_steps = max(num_train_steps - warmup, 1)
  if opt.schedule == "cosine":
    decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=end / lr if lr else 0.0)
  elif opt.schedule == "linear":
    decay = optax.linear_schedule(lr, end, decay_steps)
  elif opt.schedule == "constant":
    decay = optax.constant_schedule(lr)
  else:
    raise config_utils.ConfigError(f"unknown optimizer.schedule {opt.schedule!r}; valid schedules: "
                                   f"{', '.join(config_checks.SCHEDULES)}")
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def decay_mask(decay: str) -> Callable[[Any], Any] | None:
  """optax mask for `optimizer.decay`: None (every parameter) or a matrices-only predicate."""
  if decay == "all":
    return None
  if decay == "matrices":
    return lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  raise config_utils.ConfigError(f"unknown optimizer.decay {decay!r}; valid: "
                                 f"{', '.join(config_checks.DECAYS)}")


def make_optimizer(opt: ml_collections.ConfigDict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
  """adamw, adam or sgd on `schedule`, after global-norm clipping when opt.grad_clip > 0."""
  if opt.name == "adamw":
    tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                     mask=decay_mask(opt.get("decay", "all")))
  elif opt.name == "adam":
    tx = optax.adam(schedule, b1=opt.b1, b2=opt.b2)
  elif opt.name == "sgd":
    tx = optax.sgd(schedule, momentum=opt.momentum or None)
  else:
    raise config_utils.ConfigError(f"unknown optimizer.name {opt.name!r}; valid optimizers: "
                                   f"{', '.join(config_checks.OPTIMIZERS)}")
  if opt.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip), tx)
  return tx


# Labels of `freeze`'s partition of the parameters.
TRAINED, FROZEN = "trained", "frozen"


def freeze(tx: optax.GradientTransformation, frozen: Callable[[Any], Any] | None
           ) -> optax.GradientTransformation:
  """`tx` on the parameters `frozen(params)` marks False; those it marks True get zero updates
  (optax.set_to_zero) and no optimizer state: optax.multi_transform hands `tx` the trained
  leaves only (the frozen ones are empty MaskedNodes in its state), so Adam keeps no moments
  and gradient clipping and weight decay see no frozen leaf. `frozen` None: `tx` itself (the
  optimizer state keeps its plain layout, so runs without freezing restore as before)."""
  if frozen is None:
    return tx
  labels = lambda params: jax.tree.map(lambda f: FROZEN if f else TRAINED, frozen(params))
  return optax.multi_transform({TRAINED: tx, FROZEN: optax.set_to_zero()}, labels)


def task_optimizer(task: tasks.Task, config: ml_collections.ConfigDict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
  """The optimizer a run of `config` trains `task` with: `make_optimizer`, the task's frozen
  parameters left out (`freeze`, Task.frozen), inside loss scaling for float16 (precision)."""
  return precision.wrap_optimizer(freeze(make_optimizer(config.optimizer, schedule),
                                         task.frozen()), config)


def create_train_state(task: tasks.Task, tx: optax.GradientTransformation,
                       rng: jax.Array) -> TrainState:
  """Step 0: the task's initial parameters and a fresh optimizer state."""
  params = task.init(rng)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def num_seeds_of(config: ml_collections.ConfigDict) -> int:
  """`config.num_seeds` (1 for configs written before the field existed)."""
  return int(config.get("num_seeds", 1) or 1)


def replica_seeds(config: ml_collections.ConfigDict) -> list[int]:
  """The seeds of a run's replicas: seed, seed+1, ..., seed+num_seeds-1."""
  return [config.seed + i for i in range(num_seeds_of(config))]


# vmap axes of a replicated TrainState: one shared step counter, params and optimizer state [N, ...].
REPLICA_AXES = TrainState(step=None, params=0, opt_state=0)


def create_replicas(task: tasks.Task, tx: optax.GradientTransformation,
                    rngs: jax.Array) -> TrainState:
  """`create_train_state` for each key of `rngs` ([N] keys), stacked: params and optimizer state
  get a leading [N] axis; the step counter stays one scalar, shared by the replicas."""
  return jax.vmap(functools.partial(create_train_state, task, tx), out_axes=REPLICA_AXES)(rngs)


def abstract_train_state(task: tasks.Task, tx: optax.GradientTransformation, rng: jax.Array, *,
                         mesh: jax.sharding.Mesh | None = None) -> TrainState:
  """Shapes, dtypes and shardings of the initial state without computing it (restore target).

  With `task.config.num_seeds = N > 1` the leaves have a leading [N] axis. Without a mesh the
  arrays are placed on the first device; with one they follow `parallel.state_shardings`.
  """
  abstract = trace_initial_state(task, tx, rng).out_info
  if mesh is None:
    first_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: first_device, abstract)
  else:
    shardings = state_shardings_for(task.config, abstract, mesh)
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                      abstract, shardings)


def state_shardings_for(config: ml_collections.ConfigDict, abstract: Any,
                        mesh: jax.sharding.Mesh) -> Any:
  """`parallel.state_shardings` of a (possibly replicated over seeds) train state under `config`."""
  min_size = int(config.get("mesh", {}).get("fsdp_min_size", 1024))
  return parallel.state_shardings(abstract, mesh, min_size=min_size,
                                  replica_axes=1 if num_seeds_of(config) > 1 else 0)


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
  """(init key, train key) of a run; step t uses fold_in(train key, t)."""
  init_rng, train_rng = jax.random.split(jax.random.key(seed))
  return init_rng, train_rng


def replica_keys(config: ml_collections.ConfigDict) -> tuple[jax.Array, jax.Array]:
  """(init key, train key) of `config.seed`, or with num_seeds > 1 both stacked over the replicas
  ([N] keys, replica i's being `run_keys(seed + i)`)."""
  seeds = replica_seeds(config)
  if len(seeds) == 1:
    return run_keys(seeds[0])
  pairs = [run_keys(seed) for seed in seeds]
  stack = lambda keys: jax.random.wrap_key_data(jnp.stack([jax.random.key_data(k) for k in keys]))
  return stack([p[0] for p in pairs]), stack([p[1] for p in pairs])


def replica_iterators(task: tasks.Task, seeds: list[int]) -> list[tasks.BatchIterator]:
  """One training iterator per seed: the task's iterator as if `config.seed` were that seed.

  The task object is shallow-copied with a config whose seed differs (the Task contract makes the
  data order depend on `config.seed` only), so data and tokenizers are shared, not rebuilt.
  """
  iterators = []
  for seed in seeds:
    clone = copy.copy(task)
    clone.config = copy.deepcopy(task.config)
    clone.config.seed = seed
    iterators.append(clone.train_iterator())
  return iterators


def over_replicas(fn: Callable[..., Any], num_seeds: int, *, in_axes: tuple, out_axes: tuple
                  ) -> Callable[..., Any]:
  """`fn(state, *args)` itself for one replica; for N, vmapped over the replica axis of the state
  (`REPLICA_AXES`) and of the other arguments/outputs (`in_axes`, `out_axes` after the state)."""
  if num_seeds == 1:
    return fn
  return jax.vmap(fn, in_axes=(REPLICA_AXES, *in_axes), out_axes=(REPLICA_AXES, *out_axes))


def replica(params: Any, i: int) -> Any:
  """Replica i's leaves of a pytree with a leading replica axis."""
  return jax.tree.map(lambda x: x[i], params)


def first_replica(params: Any, num_seeds: int) -> Any:
  """The parameters of the first replica (the run's own seed)."""
  return params if num_seeds == 1 else replica(params, 0)


def stack_replicas(trees: list[Any]) -> Any:
  """Host pytrees of the same structure stacked leaf by leaf along a new leading replica axis."""
  return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def place_key(key: jax.Array, mesh: jax.sharding.Mesh | None) -> jax.Array:
  """The key as it enters the train step: itself, or on a mesh its raw key data replicated (a
  key array cannot cross processes as it is)."""
  return key if mesh is None else parallel.put_replicated(jax.random.key_data(key), mesh)


def train_batches(task: tasks.Task, seeds: list[int],
                  mesh: jax.sharding.Mesh | None) -> tasks.BatchIterator:
  """The training batches of the replicas of `seeds` (stacked when several), on the mesh."""
  batches = (task.train_iterator() if len(seeds) == 1
             else ReplicaBatches(replica_iterators(task, seeds)))
  if mesh is None:
    return batches
  return PlacedBatches(batches, mesh, 1 if len(seeds) > 1 else 0)


@dataclasses.dataclass
class Training:
  """What a run trains with besides its state (`training`): the trainer's and the benchmarks'."""
  schedule: optax.Schedule
  tx: optax.GradientTransformation
  seeds: list[int]  # the replicas' seeds (config.seed first)
  init_rng: jax.Array  # [N] keys with several seeds
  train_rng: jax.Array  # as it enters the train step (`place_key`)
  batches: tasks.BatchIterator  # at position 0, on the mesh
  abstract: TrainState  # shapes, dtypes and shardings of the state (the restore target)
  shardings: Any  # the state's shardings on the mesh, None without one


def training(task: tasks.Task, config: ml_collections.ConfigDict,
             mesh: jax.sharding.Mesh | None) -> Training:
  """Optimizer, keys, batches and state layout of `config` for `task` on `mesh`."""
  schedule = make_schedule(config.optimizer, config.num_train_steps)
  tx = task_optimizer(task, config, schedule)
  seeds = replica_seeds(config)
  init_rng, train_rng = replica_keys(config)
  abstract = abstract_train_state(task, tx, run_keys(config.seed)[0], mesh=mesh)
  shardings = None if mesh is None else jax.tree.map(lambda x: x.sharding, abstract)
  return Training(schedule, tx, seeds, init_rng, place_key(train_rng, mesh),
                  train_batches(task, seeds, mesh), abstract, shardings)


def pad_to_common_shape(trees: list[Any]) -> list[Any]:
  """Host pytrees of one structure with every leaf zero-padded at the end of each axis to the
  largest shape of that leaf among them (bool leaves with False): the replicas' batches of a
  bucketed task (data.buckets), whose padded lengths differ from one replica to the next, made
  stackable. The pipeline pads with zeros and marks real tokens in its masks, so the padding
  added here is more of what a wider bucket would have given the same rows."""
  leaves = [jax.tree.leaves(tree) for tree in trees]
  treedef = jax.tree.structure(trees[0])
  padded = [[] for _ in trees]
  for column in zip(*leaves):
    arrays = [np.asarray(x) for x in column]
    shape = np.max([a.shape for a in arrays], axis=0) if arrays[0].ndim else ()
    for out, a in zip(padded, arrays):
      pad = [(0, int(n) - k) for n, k in zip(shape, a.shape)]
      out.append(np.pad(a, pad) if any(p for _, p in pad) else a)  # [*shape]
  return [jax.tree.unflatten(treedef, out) for out in padded]


class ReplicaBatches:
  """Stacks the batches of N replica iterators (every leaf gets a leading [N] axis; leaves whose
  lengths differ, as bucketed batches do, are zero-padded to the longest: `pad_to_common_shape`);
  its state is that of every replica's iterator."""

  def __init__(self, iterators: list[tasks.BatchIterator]):
    self._iterators = iterators

  def __iter__(self) -> ReplicaBatches:
    return self

  def __next__(self) -> Any:
    return stack_replicas(pad_to_common_shape([next(it) for it in self._iterators]))

  def get_state(self) -> dict[str, Any]:
    return {"replicas": [it.get_state() for it in self._iterators]}

  def set_state(self, state: dict[str, Any]) -> None:
    states = state.get("replicas") if isinstance(state, dict) else None
    if not isinstance(states, list) or len(states) != len(self._iterators):
      raise checkpoint.CheckpointError(
          f"the checkpoint's data-iterator state is not that of {len(self._iterators)} replicas "
          f"(got {str(state)[:80]}); num_seeds changed since it was saved: use a new --workdir")
    for it, st in zip(self._iterators, states):
      it.set_state(st)


class PlacedBatches:
  """A BatchIterator whose batches are placed on the mesh (split over its devices)."""

  def __init__(self, inner: tasks.BatchIterator, mesh: jax.sharding.Mesh, replica_axes: int):
    self._inner, self._mesh, self._replica_axes = inner, mesh, replica_axes

  def __iter__(self) -> PlacedBatches:
    return self

  def __next__(self) -> Any:
    return parallel.shard_batch(next(self._inner), self._mesh, self._replica_axes)

  def get_state(self) -> dict[str, Any]:
    return self._inner.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._inner.set_state(state)


def mean_metrics(pending: list[tuple[int, dict]], num_seeds: int = 1
                 ) -> tuple[dict[str, float], dict[str, list[float]] | None]:
  """(metrics averaged over the steps (and replicas), per-replica averages or None)."""
  values = parallel.to_host([m for _, m in pending])
  if num_seeds == 1:
    return {key: float(np.mean([v[key] for v in values])) for key in values[0]}, None
  per_seed = {key: [float(x) for x in np.mean([np.asarray(v[key]) for v in values], axis=0)]
              for key in values[0]}  # {name: [N]}
  return {key: float(np.mean(vals)) for key, vals in per_seed.items()}, per_seed


def evaluate(task: tasks.Task, params: Any, num_seeds: int = 1, max_batches: int = 0
             ) -> tuple[dict[str, float], dict[str, list[float]] | None]:
  """(task.evaluate metrics, None), or with num_seeds > 1 (means over replicas, {name: [N]}).

  `max_batches` > 0: only the first that many of `task.eval_batches()` (a fixed subset: the
  trainer's evaluations before the last step, `config.eval_batches`) for tasks that use the
  default `Task.evaluate`; tasks with their own `evaluate` (decoding, BLEU...) evaluate in full.
  Several processes: the parameters are first gathered to every host, which evaluates alone.
  """
  params = parallel.to_local(params)

  def one(p):
    if max_batches > 0 and type(task).evaluate is tasks.Task.evaluate:
      subset = itertools.islice(task.eval_batches(), max_batches)
      return task.finish_metrics(task.mean_metrics(p, subset))
    return task.evaluate(p)
  if num_seeds == 1:
    return one(params), None
  results = [one(replica(params, i)) for i in range(num_seeds)]
  per_seed = {key: [float(r[key]) for r in results] for key in results[0]}
  return {key: float(np.mean(vals)) for key, vals in per_seed.items()}, per_seed


# The traced initial state of each (task, optimizer): `trace_initial_state`.
_INIT_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def trace_initial_state(task: tasks.Task, tx: optax.GradientTransformation,
                        rng: jax.Array) -> jax.stages.Traced:
  """`create_train_state` (`create_replicas` with `task.config.num_seeds` = N > 1) traced once
  from raw key data of `rng`'s kind: its `out_info` is the abstract state (the restore target)
  and `initial_state` runs its jaxpr, so that the model's init is traced once per run, not once
  for the shapes and again for the values (0.4-0.8 s of the nano GPT's start-up)."""
  num_seeds = num_seeds_of(task.config)
  per_task = _INIT_TRACES.setdefault(task, {})
  found = per_task.get(id(tx))
  if found is not None and found[0] is tx:
    return found[1]
  create = functools.partial(create_train_state if num_seeds == 1 else create_replicas, task, tx)
  data = jax.eval_shape(jax.random.key_data, rng)  # one key's raw data
  impl = jax.random.key_impl(rng)
  if num_seeds > 1:
    data = jax.ShapeDtypeStruct((num_seeds, *data.shape), data.dtype)
  traced = jax.jit(lambda d: create(jax.random.wrap_key_data(d, impl=impl))).trace(data)
  per_task[id(tx)] = (tx, traced)
  return traced


def compile_evaluation(task: tasks.Task, abstract_params: Any, num_seeds: int = 1) -> bool:
  """Compiles the program that `evaluate` runs for parameters like `abstract_params` (the
  state's, with shardings), without running it: the trainer's warm-up of its evaluations. Only
  for tasks whose evaluation is the default loop (`Task.mean_metrics`) in one process; False
  when nothing was compiled."""
  if type(task).evaluate is not tasks.Task.evaluate:
    return False
  params = parallel.local_abstract(abstract_params)
  if params is None:
    return False
  if num_seeds > 1:  # one replica's, as `evaluate` slices them
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype,
                                                         sharding=x.sharding), params)
  return task.compile_mean_metrics(params)


def initial_state(task: tasks.Task, tx: optax.GradientTransformation, init_rng: jax.Array,
                   num_seeds: int, mesh: jax.sharding.Mesh | None, shardings: Any) -> TrainState:
  """Step 0 of every replica, created directly in its sharding on a mesh (one program, from the
  trace `trace_initial_state` made for the abstract state)."""
  traced = trace_initial_state(task, tx, init_rng if num_seeds == 1 else init_rng[0])
  run = jax.extend.core.jaxpr_as_fun(traced.jaxpr)
  create = lambda data: jax.tree.unflatten(traced.out_tree, run(data))
  key_data = jax.random.key_data(init_rng)
  if mesh is None:  # committed to the device, as a restored state and the restore target are
    return jax.jit(create)(jax.device_put(key_data, jax.devices()[0]))
  key_data = parallel.put_replicated(key_data, mesh)
  return jax.jit(create, out_shardings=shardings)(key_data)


def check_init_from(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError unless `config.init_from` (when set) is a run directory this config's task
  can start from: a folder with a readable config.json of a fitting run (Task.check_pretrained)
  and a finished checkpoint. Reads that config.json and lists the checkpoint folders only (no
  arrays), so the trainer runs it before it creates or writes the workdir."""
  init_from = config.get("init_from", "")
  if not init_from:
    return
  path = pathlib.Path(os.path.expanduser(init_from))
  what = (None if path.is_dir() else "is not a folder" if path.exists() else "does not exist")
  if what is None and not (path / rundir.CONFIG_FILE).is_file():
    what = f"has no {rundir.CONFIG_FILE}, so it is not a run directory"
  if what is not None:
    raise errors.ConfigError(f"config.init_from={init_from} {what}: give the --workdir of the run "
                             f"to start from, or set init_from=\"\" to start from scratch")
  try:
    pretrained_config = rundir.read_config(path)
  except errors.UserError as e:
    problem = str(e)
  else:
    problem = None
  if problem is not None:  # raised outside the handler: this line is the one the CLI prints
    raise errors.ConfigError(f"config.init_from={init_from}: {problem}")
  tasks.get_task(config.task).check_pretrained(config, pretrained_config)
  if not checkpoint.finished_steps(path):
    raise errors.ConfigError(
        f"config.init_from={init_from} holds no finished checkpoint (in "
        f"{path / checkpoint.CHECKPOINT_DIR}); let that run save one, or give another run")


def with_pretrained(task: tasks.Task, tx: optax.GradientTransformation, state: TrainState,
                     num_seeds: int, mesh: jax.sharding.Mesh | None, shardings: Any) -> TrainState:
  """Step 0 with the weights of the run `config.init_from` put in by `Task.load_pretrained`
  (called eagerly on every replica's parameters) and the optimizer state rebuilt for them;
  `state` itself when the config names no such run."""
  init_from = task.config.get("init_from", "")
  if not init_from:
    return state
  pretrained = restore(init_from)
  # A run of several seeds gives its first replica.
  pretrained_params = first_replica(jax.device_get(pretrained.state.params),
                                    num_seeds_of(pretrained.config))
  _LOG.info("initialising from %s (step %d)", pretrained.workdir, pretrained.step)
  params = parallel.to_host(state.params)
  load = lambda p: task.load_pretrained(p, pretrained.config, pretrained_params)
  if num_seeds == 1:
    loaded = load(params)
  else:
    loaded = stack_replicas([load(replica(params, i)) for i in range(num_seeds)])  # [N, ...]

  def rebuild(params: Any) -> TrainState:
    opt_state = tx.init(params) if num_seeds == 1 else jax.vmap(tx.init)(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
  if mesh is None:
    return jax.jit(rebuild)(loaded)
  return jax.jit(rebuild, out_shardings=shardings)(parallel.put_replicated(loaded, mesh))


def step_of(state: TrainState) -> int:
  """The step counter of a state (every replica has the same)."""
  return int(np.asarray(parallel.to_host(state.step)).reshape(-1)[0])


def restore_target(task: tasks.Task) -> TrainState:
  """The abstract state (shapes, dtypes, first-device shardings) a checkpoint of `task`'s config
  is restored into."""
  config = task.config
  tx = task_optimizer(task, config, make_schedule(config.optimizer, config.num_train_steps))
  return abstract_train_state(task, tx, run_keys(config.seed)[0])


def restore_latest(ckpt: checkpoint.Checkpointer, abstract: TrainState, num_seeds: int = 1, *,
                   quarantine: bool = False) -> tuple[TrainState, Any] | None:
  """`ckpt.restore_latest(abstract)`, also across the loss-scaling layouts of the optimizer state:
  a float16 run resumed in another dtype (or another resumed in float16; allow_config_change)
  keeps the optimizer's own state, and drops its loss scale (or starts one afresh)."""
  try:
    return ckpt.restore_latest(abstract, quarantine=quarantine)
  except checkpoint.CheckpointError as e:
    if isinstance(e, checkpoint.CorruptCheckpointError):
      raise
    first = e
  scaled = isinstance(abstract.opt_state, precision.LossScaleState)
  if scaled:
    other = abstract.replace(opt_state=abstract.opt_state.inner)
  else:
    step = abstract.step  # a replicated scalar: its sharding suits the scale and the count
    shape = (num_seeds,) if num_seeds > 1 else ()  # one scale per replica
    leaf = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=step.sharding)
    other = abstract.replace(opt_state=precision.LossScaleState(
        leaf(jnp.float32), leaf(jnp.int32), abstract.opt_state))
  try:
    restored = ckpt.restore_latest(other, quarantine=quarantine)
  except checkpoint.CheckpointError:
    raise first from None
  if restored is None:
    raise first
  state, data_state = restored
  if scaled:  # a fresh loss scale for the optimizer state that had none
    scale = abstract.opt_state
    opt_state = precision.LossScaleState(
        jax.device_put(jnp.full(scale.scale.shape, precision.LOSS_SCALE_INIT, jnp.float32),
                       scale.scale.sharding),
        jax.device_put(jnp.zeros(scale.good_steps.shape, jnp.int32), scale.good_steps.sharding),
        state.opt_state)
  else:
    opt_state = state.opt_state.inner
  _LOG.info("the checkpoint's optimizer state %s a loss scale: %s", "lacked" if scaled else "had",
            "a fresh one starts" if scaled else "dropped (this run does not scale its loss)")
  return state.replace(opt_state=opt_state), data_state


@dataclasses.dataclass
class Restored:
  """A run's checkpoint, restored."""
  workdir: pathlib.Path
  # The run's full config (config.json).
  config: ml_collections.ConfigDict
  # The task built from it.
  task: tasks.Task
  # The restored state (params with a leading [num_seeds] axis when num_seeds > 1).
  state: TrainState
  # The checkpoint step.
  step: int


def _rebuild_task(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> tasks.Task:
  """The run's task, from its assets folder; a run directory written before runs kept one
  rebuilds its vocabularies from the data (and keeps them, when it can write there)."""
  folder = workdir / assets_lib.DIRNAME
  if folder.is_dir():
    return tasks.build_task(config, folder)
  try:
    task = tasks.build_task(config)
  except errors.UserError as e:
    raise errors.UserError(
        f"{workdir} has no {assets_lib.DIRNAME}/ folder (it predates runs that keep their "
        f"vocabularies), so they are rebuilt from the data, which failed: {e}") from e
  try:
    task.save_assets(folder)
    _LOG.info("kept the vocabularies of %s in %s", workdir, folder)
  except OSError:
    pass  # a read-only run directory still loads, from the data
  return task


def best_step(workdir: str | os.PathLike) -> int | None:
  """The step of the best evaluation of a run that early stopping ended (config.
  early_stop_patience; its early-stop record in metrics.jsonl), else None."""
  record = rundir.early_stop(rundir.read_metrics(workdir))
  step = None if record is None else record.get("best_step")
  return int(step) if isinstance(step, (int, float)) and step >= 0 else None


def restore(workdir: str | os.PathLike, step: int | str = "latest") -> Restored:
  """Checkpoint `step` ("latest" or an int) of the run in `workdir`.

  "latest" is the run's result: its newest checkpoint, or for a run that early stopping ended
  (`best_step`), its best evaluation's. With "latest", an unreadable newest checkpoint is
  reported and the previous one is used.
  Raises:
    checkpoint.CheckpointError (a ValueError): no run there, no such step, no readable checkpoint,
      or a checkpoint that does not fit the model in config.json.
  """
  workdir = pathlib.Path(workdir).absolute()
  config = rundir.read_config(workdir)
  task = _rebuild_task(workdir, config)
  abstract = restore_target(task)
  ckpt = checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR, read_only=True)
  try:
    best = best_step(workdir) if step == "latest" else None
    if best is not None and best in ckpt.steps():
      _LOG.info("%s: early stopping ended the run; restoring its best evaluation's checkpoint, "
                "step %d", workdir, best)
      step = best
    if step == "latest":
      restored = ckpt.restore_latest(abstract)
      if restored is None:
        raise checkpoint.CheckpointError(
            f"no readable checkpoint in {ckpt.directory} (steps found: "
            f"{', '.join(map(str, ckpt.steps())) or 'none'})")
      state, _ = restored
    elif isinstance(step, int) or (isinstance(step, str) and step.isdigit()):
      state, _ = ckpt.restore(int(step), abstract)
    else:
      raise checkpoint.CheckpointError(f"step must be 'latest' or a step number, got {step!r}")
  finally:
    ckpt.close()
  return Restored(workdir=workdir, config=config, task=task, state=state, step=int(state.step))
