"""Data parallelism and FSDP on 4 fake CPU devices, sharded checkpoints, multi-host start rules.

The 4-device runs happen in one subprocess (XLA_FLAGS must be set before JAX is imported), which
calls `worker` below and writes its results as JSON; the tests check them against a NumPy SGD
reference and against each other, and restore its sharded checkpoint here, on one device.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import losses
from attnlab import parallel
from attnlab import tasks
from attnlab.backends.cpu import devices
from attnlab.backends.cpu import fused_kernel
from attnlab.config_utils import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]
D_IN, D_OUT, BATCH, STEPS, LR = 8, 16, 8, 6, 0.1


# Rows 0-2 count nothing: on 4 devices the first holds no counted row, the second one of two.
WEIGHTS = (np.arange(BATCH) >= 3).astype(np.float32)


def _batch(seed: int, index: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng([seed, index])
  return {"x": rng.normal(size=(BATCH, D_IN)).astype(np.float32),  # [batch, d_in]
          "y": rng.normal(size=(BATCH, D_OUT)).astype(np.float32),  # [batch, d_out]
          "weight": WEIGHTS}  # [batch]


@tasks.register_task("linear_probe")
class LinearProbeTask(tasks.Task):
  """Weighted least squares y ≈ x W + b on Gaussian batches drawn from (seed, batch index); the
  loss is the whole batch's weighted mean (`losses.ratio`), so a data-parallel mesh runs the step
  per device with one all-reduce."""

  def init(self, rng):
    return {"kernel": 0.1 * jax.random.normal(rng, (D_IN, D_OUT)), "bias": jnp.zeros((D_OUT,))}

  def train_iterator(self):
    seed = self.config.seed
    return tasks.IndexedBatches(lambda i: _batch(seed, i))

  def loss_fn(self, params, batch, rng):
    return losses.ratio(*self.weighted_sums(params, batch)), {}

  @staticmethod
  def weighted_sums(params, batch):
    """(sum of weighted squared errors, their count) over the rows this call sees."""
    pred = batch["x"] @ params["kernel"] + params["bias"]  # [batch, d_out]
    weight = batch["weight"][:, None]  # [batch, 1]
    return jnp.sum(jnp.square(pred - batch["y"]) * weight), jnp.sum(weight) * D_OUT

  def eval_batches(self):
    return [_batch(1000, 0)]


@tasks.register_task("linear_probe_mean")
class LinearProbeMeanTask(LinearProbeTask):
  """The same loss as a plain mean over the rows each device holds (the first's is 0/0, and
  `jnp.mean` knows no other devices): the trainer must let the compiler split this step."""

  def loss_fn(self, params, batch, rng):
    total, count = self.weighted_sums(params, batch)
    return total / count, {}


@tasks.register_task("linear_probe_shape")
class LinearProbeShapeTask(LinearProbeTask):
  """The squared errors' weighted sum over a count every device holds alike, its slice's shape
  (rows x outputs): `losses.ratio` counts each device's slice once per device, without a
  collective of its own."""

  def loss_fn(self, params, batch, rng):
    total, _ = self.weighted_sums(params, batch)
    return losses.ratio(total, batch["x"].shape[0] * D_OUT), {}


def probe_config(**overrides) -> config_utils.ConfigDict:
  config = config_utils.base_config()
  config.task = "linear_probe"
  config.num_train_steps, config.batch_size, config.log_every = STEPS, BATCH, 1
  config.eval_every, config.checkpoint_every, config.write_plots = 0, 3, False
  config.optimizer.name, config.optimizer.schedule = "sgd", "constant"
  config.optimizer.learning_rate = LR
  return config_utils.apply_overrides(config, overrides)


def worker(out: str) -> None:
  """Runs in the 4-device subprocess: trains the probe under several meshes, writes JSON."""
  import shutil  # pylint: disable=g-import-not-at-top
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  from attnlab import train  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(out).parent
  result = {"devices": jax.device_count(), "runs": {}}
  steps, make = [], train.make_train_step
  train.make_train_step = lambda *a, **k: steps.append(make(*a, **k)) or steps[-1]

  def run(name, **overrides):
    state = train.train_and_evaluate(probe_config(**overrides), root / name)
    records = rundir.read_metrics(root / name)
    result["runs"][name] = {
        "per_device": steps[-1].per_device,
        "losses": [r["loss"] for r in records if r["split"] == "train"],
        "per_seed": [r.get("per_seed", {}).get("loss") for r in records if r["split"] == "train"],
        "kernel": np.asarray(jax.device_get(state.params["kernel"])).tolist(),
        "specs": {k: str(getattr(v.sharding, "spec", "single device"))
                  for k, v in state.params.items()},
        "devices": len(state.params["kernel"].sharding.device_set),
        "opt_specs": [str(getattr(x.sharding, "spec", "single device"))
                      for x in jax.tree.leaves(state.opt_state)],
    }
    return state

  run("one", checkpoint_every=0, **{"mesh.data": 1})
  run("dp4", checkpoint_every=0)
  run("dp4_mean", checkpoint_every=0, task="linear_probe_mean")
  run("dp4_shape", checkpoint_every=0, task="linear_probe_shape")
  run("fsdp_momentum", checkpoint_every=0, **{"mesh.data": 2, "mesh.fsdp": 2,
                                              "mesh.fsdp_min_size": 16, "optimizer.momentum": 0.9})
  run("fsdp4", **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.fsdp_min_size": 16})
  # Resume the FSDP run from its step-3 checkpoint on a 2-device data-parallel mesh.
  shutil.copytree(root / "fsdp4", root / "resumed")
  shutil.rmtree(root / "resumed" / "checkpoints" / str(STEPS))
  rundir.truncate_metrics(root / "resumed", 3)
  run("resumed", **{"mesh.data": 2, "mesh.fsdp": 1, "mesh.fsdp_min_size": 16})
  run("seeds_dp4", num_seeds=3, checkpoint_every=0)
  probe = LinearProbeTask(probe_config())
  result["init_kernels"] = [np.asarray(probe.init(train.run_keys(seed)[0])["kernel"]).tolist()
                            for seed in (0, 1, 2)]
  try:
    train.train_and_evaluate(probe_config(batch_size=6), root / "bad_batch")
  except ConfigError as e:
    result["bad_batch_error"] = str(e)
  pathlib.Path(out).write_text(json.dumps(result))


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory):
  root = tmp_path_factory.mktemp("parallel")
  return root, _in_fresh_process("worker", root / "result.json",
                                 XLA_FLAGS="--xla_force_host_platform_device_count=4")


def _in_fresh_process(worker_name: str, out: pathlib.Path, **env_vars: str) -> dict:
  """Runs `test_parallel.<worker_name>(out)` in a new Python process (JAX fixes its CPU device
  count when it starts); returns the JSON the worker wrote. No XLA_FLAGS unless given."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", ATTNLAB_DISTRIBUTED="0",
             PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ["PYTHONPATH"]]),
             **env_vars)
  code = f"import test_parallel; test_parallel.{worker_name}({str(out)!r})"
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


def _numpy_sgd(kernel: np.ndarray, seed: int = 0, momentum: float = 0.0,
               shape_count: bool = False) -> tuple[np.ndarray, list[float]]:
  """SGD (heavy-ball momentum) on the probe's weighted mean squared error in NumPy: (final kernel,
  losses). `shape_count`: the weighted sum over rows x outputs (LinearProbeShapeTask)."""
  w, b, curve = kernel.astype(np.float64), np.zeros(D_OUT), []
  mw, mb = np.zeros_like(w), np.zeros_like(b)
  for index in range(STEPS):
    batch = _batch(seed, index)
    weight = batch["weight"][:, None]  # [batch, 1]
    residual = batch["x"] @ w + b - batch["y"]  # [batch, d_out]
    count = (len(weight) if shape_count else weight.sum()) * D_OUT
    curve.append(float(np.sum(weight * residual ** 2) / count))
    mw = 2.0 / count * batch["x"].T @ (weight * residual) + momentum * mw  # [d_in, d_out]
    mb = 2.0 / count * (weight * residual).sum(0) + momentum * mb  # [d_out]
    w, b = w - LR * mw, b - LR * mb
  return w, curve


@pytest.mark.slow
def test_data_parallel_and_fsdp_match_numpy_sgd(four_devices):
  _, result = four_devices
  assert result["devices"] == 4
  runs = result["runs"]
  expected_kernel, expected_losses = _numpy_sgd(np.asarray(result["init_kernels"][0]))
  # Each device's own slice and one all-reduce (dp4), or the compiler's split of a loss written
  # per device (dp4_mean): the same SGD.
  assert runs["dp4"]["per_device"] is True and runs["dp4_mean"]["per_device"] is False
  assert runs["one"]["per_device"] is None and runs["fsdp4"]["per_device"] is False
  for name in ("one", "dp4", "dp4_mean", "fsdp4"):
    np.testing.assert_allclose(runs[name]["losses"], expected_losses, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(runs[name]["kernel"], expected_kernel, rtol=1e-4, atol=1e-6,
                               err_msg=name)
  kernel, losses = _numpy_sgd(np.asarray(result["init_kernels"][0]), shape_count=True)
  assert runs["dp4_shape"]["per_device"] is True
  np.testing.assert_allclose(runs["dp4_shape"]["losses"], losses, rtol=1e-5)
  np.testing.assert_allclose(runs["dp4_shape"]["kernel"], kernel, rtol=1e-4, atol=1e-6)
  kernel, losses = _numpy_sgd(np.asarray(result["init_kernels"][0]), momentum=0.9)
  np.testing.assert_allclose(runs["fsdp_momentum"]["losses"], losses, rtol=1e-5)
  np.testing.assert_allclose(runs["fsdp_momentum"]["kernel"], kernel, rtol=1e-4, atol=1e-6)
  # The 4-device run reaches the 1-device run's loss at every step (same global batch).
  np.testing.assert_allclose(runs["dp4"]["losses"], runs["one"]["losses"], rtol=1e-6)


@pytest.mark.slow
def test_shardings_follow_the_mesh(four_devices):
  runs = four_devices[1]["runs"]
  assert runs["one"]["devices"] == 1 and runs["one"]["specs"]["kernel"] == "single device"
  assert runs["dp4"]["devices"] == 4 and runs["dp4"]["specs"]["kernel"] == "P()"
  # FSDP: the largest divisible dimension (d_out = 16) is split.
  assert runs["fsdp_momentum"]["specs"] == {"kernel": "P(None, 'fsdp')", "bias": "P('fsdp',)"}
  # The optimizer state is split like the parameters (momenta); its step count is replicated.
  assert sorted(runs["fsdp_momentum"]["opt_specs"]) == ["P('fsdp',)", "P()", "P(None, 'fsdp')"]
  assert runs["fsdp4"]["devices"] == 4
  assert runs["resumed"]["devices"] == 2 and runs["resumed"]["specs"]["kernel"] == "P()"


@pytest.mark.slow
def test_sharded_checkpoint_restores_on_other_device_counts(four_devices):
  root, result = four_devices
  runs = result["runs"]
  # Saved split over 4 devices at step 3, resumed on 2: the same end point.
  np.testing.assert_allclose(runs["resumed"]["kernel"], runs["fsdp4"]["kernel"], rtol=1e-6)
  np.testing.assert_allclose(runs["resumed"]["losses"], runs["fsdp4"]["losses"], rtol=1e-6)
  # And here, in a 1-device process.
  run = analysis.load_run(root / "fsdp4")
  assert run.step == STEPS and len(run.params["kernel"].sharding.device_set) == 1
  np.testing.assert_array_equal(np.asarray(run.params["kernel"]), runs["fsdp4"]["kernel"])


@pytest.mark.slow
def test_seeds_on_a_mesh_match_single_seed_runs(four_devices):
  result = four_devices[1]
  runs = result["runs"]
  assert runs["seeds_dp4"]["per_device"] is True  # vmapped over seeds inside each device's step
  per_step = np.asarray(runs["seeds_dp4"]["per_seed"])  # [steps, 3]
  assert per_step.shape == (STEPS, 3)
  np.testing.assert_allclose(per_step[:, 0], runs["one"]["losses"], rtol=1e-5)
  for seed in (0, 1, 2):
    _, expected = _numpy_sgd(np.asarray(result["init_kernels"][seed]), seed)
    np.testing.assert_allclose(per_step[:, seed], expected, rtol=1e-5)
  np.testing.assert_allclose(runs["seeds_dp4"]["losses"], per_step.mean(1), rtol=1e-6)


@pytest.mark.slow
def test_batch_that_does_not_split_is_a_clear_error(four_devices):
  message = four_devices[1]["bad_batch_error"]
  assert "batch_size=6 does not split over the 4 devices" in message and "multiple of 4" in message


def cpu_devices_worker(out: str) -> None:
  """Runs in a fresh process without XLA_FLAGS: `mesh.cpu_devices=2` splits the CPU, then the
  count is fixed (JSON to `out`)."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  from attnlab import train  # pylint: disable=g-import-not-at-top
  workdir = pathlib.Path(out).parent / "cpu2"
  state = train.train_and_evaluate(probe_config(checkpoint_every=0, **{"mesh.cpu_devices": 2}),
                                   workdir)
  result = {"devices": jax.device_count(),
            "kernel_devices": len(state.params["kernel"].sharding.device_set),
            "losses": [r["loss"] for r in rundir.read_metrics(workdir)
                       if r["split"] == "train"],
            "kernel": np.asarray(jax.device_get(state.params["kernel"])).tolist(),
            "init_kernel": np.asarray(LinearProbeTask(probe_config()).init(
                train.run_keys(0)[0])["kernel"]).tolist(),
            # evaluation and plots get the parameters on one CPU device
            "local_devices": [str(d) for d in
                              parallel.to_local(state.params)["kernel"].sharding.device_set]}
  result["blocked"] = _blocked_on_mesh()
  devices.use_cpu_devices(0)  # "one per core" keeps what is running
  devices.use_cpu_devices(2)  # the running count
  try:
    devices.use_cpu_devices(3)
  except ConfigError as e:
    result["error"] = str(e)
  pathlib.Path(out).write_text(json.dumps(result))


def _attention_inputs() -> tuple[np.ndarray, ...]:
  rng = np.random.default_rng(3)
  q, k, v, do = (rng.normal(size=(4, 2, 40, 8)).astype(np.float32) for _ in range(4))
  mask = np.ones((4, 1, 1, 40), bool)
  mask[1, ..., 25:] = mask[3, ..., 10:] = False  # padding of two rows
  return q, k, v, do, mask


def _blocked_on_mesh() -> dict[str, list]:
  """The blocked kernel traced under a 2-device mesh (as the compiler's split of the train step
  traces the model) and inside `jax.shard_map` (as the data-parallel step runs it): the context
  and the gradient of <context, do> w.r.t. q, k and v, plain and vmapped over replicas."""
  from attnlab.attention import blocked  # pylint: disable=g-import-not-at-top
  q, k, v, do, mask = _attention_inputs()
  mesh = parallel.make_mesh(config_utils.apply_overrides(config_utils.base_config(),
                                                          {"mesh.data": 2}))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

  def attend(q, k, v, do, mask):  # (<context, do>, context)
    out = blocked.blocked_attention(q, k, v, mask=mask, causal=True, block_q=16, block_k=16)
    return jnp.sum(out * do), out

  def loss(q, k, v, do):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return attend(q, k, v, do, mask)

  grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
      *(jax.device_put(x, split) for x in (q, k, v, do)))
  replica_split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
  stacked = [jax.device_put(np.stack([x, x[::-1]]), replica_split)  # two replicas
             for x in (q, k, v, do)]
  replicas = jax.jit(jax.vmap(loss))(*stacked)[1]

  def per_device(q, k, v, do, mask):  # each device on its slice, as the data-parallel train step
    return jax.grad(attend, argnums=(0, 1, 2), has_aux=True)(q, k, v, do, mask)

  spec = jax.sharding.PartitionSpec(parallel.MESH_AXES)
  device_grads, device_out = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec,
                                                   out_specs=spec))(q, k, v, do, mask)

  def per_device_fused(q, k, v, do, mask):  # the padding mask alone: the fused CPU kernel
    def attend_fused(q, k, v):
      out = blocked.blocked_attention(q, k, v, mask=mask, causal=True)
      return jnp.sum(out * do), out
    return jax.grad(attend_fused, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  fused_device_grads, fused_device_out = jax.jit(jax.shard_map(
      per_device_fused, mesh=mesh, in_specs=spec, out_specs=spec))(q, k, v, do, mask)

  def plain(q, k, v, do):  # no mask or tiles: the fused CPU kernel (where it runs) per slice
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      out = blocked.blocked_attention(q, k, v, causal=True)
      return jnp.sum(out * do), out
  plain_grad = jax.grad(plain, argnums=(0, 1, 2), has_aux=True)
  fused_grads, fused_out = jax.jit(plain_grad)(*(jax.device_put(x, split) for x in (q, k, v, do)))
  return {"out": np.asarray(out).tolist(), "grads": [np.asarray(g).tolist() for g in grads],
          "fused_device_out": np.asarray(fused_device_out).tolist(),
          "fused_device_grads": [np.asarray(g).tolist() for g in fused_device_grads],
          "fused_out": np.asarray(fused_out).tolist(),
          "fused_grads": [np.asarray(g).tolist() for g in fused_grads],
          "fused_traced": fused_kernel.FORWARD in str(jax.make_jaxpr(plain_grad)(q, k, v, do)),
          "replicas": np.asarray(replicas).tolist(), "out_devices": len(out.sharding.device_set),
          "device_out": np.asarray(device_out).tolist(),
          "device_grads": [np.asarray(g).tolist() for g in device_grads]}


def _numpy_attention(q, k, v, mask):
  """(probabilities, context) of causal, padding-masked softmax attention in NumPy (no query
  row here is fully masked); the test derives the q, k, v gradients from them."""
  scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])  # [b, h, s, s]
  visible = mask & np.tril(np.ones(scores.shape[-2:], bool))
  scores = np.where(visible, scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return p, p @ v


@pytest.mark.slow
def test_cpu_devices_split_a_fresh_process_into_a_data_parallel_mesh(tmp_path):
  result = _in_fresh_process("cpu_devices_worker", tmp_path / "result.json")
  assert result["devices"] == 2 and result["kernel_devices"] == 2
  assert result["local_devices"] == ["cpu:0"]
  # The blocked kernel per batch shard: values and gradients against NumPy.
  q, k, v, do, mask = (x.astype(np.float64) if x.dtype != bool else x
                       for x in _attention_inputs())
  p, out = _numpy_attention(q, k, v, mask)
  d_p = do @ np.swapaxes(v, -1, -2)
  d_s = p * (d_p - (d_p * p).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
  expected = [d_s @ k, np.swapaxes(d_s, -1, -2) @ q, np.swapaxes(p, -1, -2) @ do]
  blocked = result["blocked"]
  assert blocked["out_devices"] == 2
  # traced under the mesh; inside shard_map, per device; the same with the fused CPU kernel
  for name in ("", "device_", "fused_device_"):
    np.testing.assert_allclose(blocked[name + "out"], out, rtol=1e-4, atol=1e-5)
    for got, want in zip(blocked[name + "grads"], expected):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # Without the padding mask: the fused CPU kernel on each device's slice, where it runs.
  assert blocked["fused_traced"] == (fused_kernel.unavailable_reason() is None)
  p, out_plain = _numpy_attention(q, k, v, np.ones_like(mask))
  d_p = do @ np.swapaxes(v, -1, -2)
  d_s = p * (d_p - (d_p * p).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
  np.testing.assert_allclose(blocked["fused_out"], out_plain, rtol=1e-4, atol=1e-5)
  for got, want in zip(blocked["fused_grads"],
                       [d_s @ k, np.swapaxes(d_s, -1, -2) @ q, np.swapaxes(p, -1, -2) @ do]):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  reversed_out = _numpy_attention(q[::-1], k[::-1], v[::-1], mask)[1]
  np.testing.assert_allclose(blocked["replicas"], np.stack([out, reversed_out]), rtol=1e-4,
                             atol=1e-5)
  kernel, losses = _numpy_sgd(np.asarray(result["init_kernel"]))
  np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
  np.testing.assert_allclose(result["kernel"], kernel, rtol=1e-4, atol=1e-6)
  assert ("mesh.cpu_devices=3 but JAX already started with 2 CPU device(s)" in result["error"]
          and "fresh process" in result["error"])


def test_cpu_device_count_takes_the_cores_that_split_the_batch():
  assert devices.cpu_device_count(0, 12, cores=2) == 2
  assert devices.cpu_device_count(0, 12, cores=5) == 4
  assert devices.cpu_device_count(0, 7, cores=2) == 1
  assert devices.cpu_device_count(0, None, cores=3) == 3
  assert devices.cpu_device_count(3, 12, cores=2) == 3  # explicit: as asked


def test_cpu_devices_must_not_be_below_minus_one():
  with pytest.raises(ConfigError, match="mesh.cpu_devices must be >= -1"):
    config_utils.validate(probe_config(**{"mesh.cpu_devices": -2}))


# ---------------------------------------------------------------------------------------------------
# Rules that need no devices


def test_leaf_spec_splits_the_largest_divisible_dimension():
  assert parallel.leaf_spec((64, 96), 4, 16) == jax.sharding.PartitionSpec(None, "fsdp")
  assert parallel.leaf_spec((96, 64), 4, 16) == jax.sharding.PartitionSpec("fsdp", None)
  assert parallel.leaf_spec((6, 10), 4, 16) == jax.sharding.PartitionSpec()  # nothing divides
  assert parallel.leaf_spec((64, 96), 4, 10**6) == jax.sharding.PartitionSpec()  # too small
  assert parallel.leaf_spec((), 4, 0) == jax.sharding.PartitionSpec()
  # A leading replica axis (num_seeds) is never split.
  assert parallel.leaf_spec((128, 8, 12), 4, 16, replica_axes=1) == jax.sharding.PartitionSpec(
      None, None, "fsdp")
  assert parallel.leaf_spec((64, 96), 1, 16) == jax.sharding.PartitionSpec()


def test_mesh_shape_from_config():
  mesh = config_utils.base_config().mesh
  assert parallel.mesh_shape(mesh, 8) == (8, 1)
  mesh.fsdp = 4
  assert parallel.mesh_shape(mesh, 8) == (2, 4)
  mesh.data = 1
  assert parallel.mesh_shape(mesh, 8) == (1, 4)
  mesh.data = 3
  with pytest.raises(ConfigError, match="needs 12 devices but 8 are available"):
    parallel.mesh_shape(mesh, 8)
  mesh.data, mesh.fsdp = -1, 3
  with pytest.raises(ConfigError, match="mesh.fsdp=3 does not divide the 8 devices"):
    parallel.mesh_shape(mesh, 8)
  # One device: no mesh at all, the trainer's plain path.
  assert parallel.make_mesh(config_utils.base_config()) is None


def test_distributed_start_follows_the_launcher_environment():
  assert parallel.distributed_env({}) is None
  slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_PROCID": "0"}
  assert parallel.distributed_env(slurm) == {}
  assert parallel.distributed_env({**slurm, "SLURM_NTASKS": "1"}) is None
  assert parallel.distributed_env({"OMPI_COMM_WORLD_SIZE": "4"}) == {}
  assert parallel.distributed_env({**slurm, "ATTNLAB_DISTRIBUTED": "0"}) is None
  assert parallel.distributed_env({"ATTNLAB_DISTRIBUTED": "1"}) == {}
  manual = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": "1"}
  assert parallel.distributed_env(manual) == {"coordinator_address": "10.0.0.1:1234",
                                              "num_processes": 2, "process_id": 1}
  with pytest.raises(ConfigError, match="JAX_PROCESS_ID is not an int"):
    parallel.distributed_env({**manual, "JAX_PROCESS_ID": ""})


@pytest.mark.slow
def test_sweep_members_as_array_tasks(tmp_path, capsys):
  """--list, one member per --member_index (as cluster array tasks would), then --summarize."""
  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  from attnlab.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  spec = (f"{REPO / 'configs' / 'nadaraya_watson.py'}:runlocal=True,write_plots=False,"
          f"num_train_steps=4,eval_every=0,checkpoint_every=0,log_every=2")
  args = ["attnlab sweep", f"--config={spec}", f"--workdir={tmp_path}", "--sweep=seed=0,1"]
  assert sweep_cli.main([*args, "--list"]) == 0
  assert capsys.readouterr().out.splitlines() == ["0\tseed=0", "1\tseed=1"]
  assert sweep_cli.main([*args, "--member_index=2"]) == 2
  assert "out of range: the sweep has 2 members" in capsys.readouterr().err
  for index in (1, 0):
    assert sweep_cli.main([*args, f"--member_index={index}"]) == 0
    assert not (tmp_path / sweep.SUMMARY_CSV).exists()
  assert sweep_cli.main([*args, "--summarize"]) == 0
  finals = [[r for r in analysis.read_metrics(tmp_path / f"seed={s}") if r["split"] == "eval"][-1]
            ["test_mse"] for s in (0, 1)]
  table = (tmp_path / sweep.SUMMARY_MD).read_text()
  assert f"| 2 | 0 | {np.mean(finals):.4g} ± {np.std(finals, ddof=1):.2g} |" in table


# The nano GPT's runlocal config, shortened: the default run a user starts, for a few steps.
GPT_DEFAULT = (f"{REPO / 'configs' / 'gpt.py'}:runlocal=True,num_train_steps=4,log_every=1,"
               f"eval_every=0,checkpoint_every=0,write_plots=False,"
               f"data.manual_dir={REPO.parent / 'shared' / 'data'}")


def default_devices_worker(out: str) -> None:
  """Runs in a fresh process without XLA_FLAGS or mesh flags: the GPT config as it comes, so
  `mesh.cpu_devices` keeps its default (JSON to `out`)."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  from attnlab import train  # pylint: disable=g-import-not-at-top
  workdir = pathlib.Path(out).parent / "default"
  config = config_utils.load_config_file(f"{GPT_DEFAULT},data.data_dir={workdir.parent / 'tfds'}")
  state = train.train_and_evaluate(config, workdir)
  result = {"default": config.mesh.cpu_devices, "devices": jax.device_count(),
            "batch_size": config.batch_size,
            "state_devices": len(jax.tree.leaves(state.params)[0].sharding.device_set),
            "losses": [r["loss"] for r in rundir.read_metrics(workdir)
                       if r["split"] == "train"]}
  pathlib.Path(out).write_text(json.dumps(result))


@pytest.mark.slow
def test_default_trains_on_every_core_with_the_losses_of_one_device(tmp_path, shared_data):
  """The default run of a CPU-only machine is split over one device per core (2 here) and trains
  as one device does, up to float rounding."""
  result = _in_fresh_process("default_devices_worker", tmp_path / "result.json")
  cores = len(os.sched_getaffinity(0))
  expected = devices.cpu_device_count(0, result["batch_size"], cores)
  assert result["default"] == devices.AUTO_CPU_DEVICES
  assert result["devices"] == expected and result["state_devices"] == expected
  # The same run on one device, in this process (conftest started JAX with one CPU device).
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  from attnlab import train  # pylint: disable=g-import-not-at-top
  config = config_utils.load_config_file(
      f"{GPT_DEFAULT},data.data_dir={tmp_path / 'tfds'},mesh.cpu_devices=1")
  train.train_and_evaluate(config, tmp_path / "one")
  one = [r["loss"] for r in rundir.read_metrics(tmp_path / "one") if r["split"] == "train"]
  assert len(one) == len(result["losses"]) == 4
  np.testing.assert_allclose(result["losses"], one, rtol=2e-5)


def test_automatic_devices_leave_accelerators_and_forced_counts_alone(monkeypatch):
  """-1 resolves to nothing (JAX's own devices) where JAX may use a GPU/TPU or XLA_FLAGS fixes
  the host device count; the running process is not changed either way."""
  running = jax.device_count()
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
  assert devices.use_cpu_devices(-1, 12) is None
  monkeypatch.delenv("XLA_FLAGS")
  monkeypatch.setattr(devices, "_cpu_only", lambda: False)
  assert devices.use_cpu_devices(-1, 12) is None
  monkeypatch.setattr(devices, "_cpu_only", lambda: True)
  assert devices.use_cpu_devices(-1, 12) is None  # JAX has started: it keeps what runs
  assert jax.device_count() == running


def test_automatic_devices_fall_back_to_one_with_one_line(monkeypatch):
  """A batch that does not split over the cores: one device, and one line saying why."""
  import io  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  lines = io.StringIO()
  handler, logger = logging.StreamHandler(lines), logging.getLogger("attnlab.backends.cpu.devices")
  monkeypatch.setattr(logger, "level", logger.level)  # restored after the test
  logger.setLevel(logging.INFO)  # clears the logger's cache of enabled levels, as setattr does not
  monkeypatch.setattr(devices, "_cpu_only", lambda: True)
  monkeypatch.setattr(devices, "_backend_started", lambda: False)
  monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: {0, 1})
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  logger.addHandler(handler)
  try:
    assert devices.use_cpu_devices(-1, 7) is None  # 7 rows: no split over 2 cores
  finally:
    logger.removeHandler(handler)
  [line] = lines.getvalue().splitlines()
  assert line.startswith("batch_size=7 does not split over the 2 CPU cores: training on 1 device")
