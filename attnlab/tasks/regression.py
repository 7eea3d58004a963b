"""Nadaraya-Watson regression: attention pooling over scalar inputs (task "regression").

Data: y = x + sin(x) + N(0, noise_std²) at `num_train` sorted points drawn uniformly from
[0, x_max); the test set is the noise-free curve on the grid 0, test_step, 2·test_step, ... < x_max.
Model: the prediction at a query x is the attention-weighted mean of the training targets y_i, with
keys x_i. Kernels (config.model.kernel):
  average   uniform weights (predicts the mean of y)
  gaussian  softmax(-((x - x_i)·w)²/2) with fixed w = model.init_w
  learned   the same with w a trainable parameter (initialised to model.init_w)
Training minimises the leave-one-out squared error: each training point is predicted from the
others (otherwise w would grow until every point predicts itself).
"""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnlab.attention import pooling
from attnlab.data import pipeline
from attnlab.config_utils import check_choice
from attnlab.errors import ConfigError
from attnlab.layers import sown
from attnlab.tasks import register_task
from attnlab.tasks.base import Task

KERNELS = ("average", "gaussian", "learned")


def target_fn(x: np.ndarray) -> np.ndarray:
  """The noise-free curve y = x + sin(x)."""
  return x + np.sin(x)


class RegressionData(NamedTuple):
  # [num_train] sorted training inputs (the keys).
  x_train: np.ndarray
  # [num_train] noisy training targets (the values).
  y_train: np.ndarray
  # [num_test] test grid (the queries at evaluation).
  x_test: np.ndarray
  # [num_test] noise-free targets on the test grid.
  y_test: np.ndarray


def make_data(num_train: int = 100, x_max: float = 10.0, noise_std: float = 1.0,
              test_step: float = 0.1, seed: int = 0) -> RegressionData:
  """The attention-pooling regression data set (float32 NumPy arrays)."""
  if num_train < 2:
    raise ConfigError(f"data.num_train must be >= 2 (leave-one-out needs another point), got {num_train}")
  if x_max <= 0 or test_step <= 0:
    raise ConfigError(f"data.x_max and data.test_step must be > 0, got {x_max} and {test_step}")
  rng = np.random.default_rng(seed)
  x_train = np.sort(rng.uniform(0.0, x_max, num_train))
  y_train = target_fn(x_train) + rng.normal(0.0, noise_std, num_train)
  x_test = np.arange(0.0, x_max, test_step)
  f32 = lambda a: np.asarray(a, np.float32)
  return RegressionData(f32(x_train), f32(y_train), f32(x_test), f32(target_fn(x_test)))


class KernelRegression(nn.Module):
  """Attention pooling of `values` at `queries` over `keys`; sows the weights for analysis."""
  # One of KERNELS.
  kernel: str = "learned"
  # w of the gaussian kernel, or the initial w of the learned one.
  init_w: float = 1.0

  @nn.compact
  def __call__(self, queries: jax.Array, keys: jax.Array, values: jax.Array,
               mask: jax.Array | None = None) -> jax.Array:
    check_choice("model.kernel", self.kernel, KERNELS, "kernels")
    if self.kernel == "average":
      pred, weights = pooling.average_pooling(queries, keys, values, mask=mask)
    elif self.kernel == "gaussian":
      pred, weights = pooling.nadaraya_watson(queries, keys, values, w=self.init_w, mask=mask)
    else:
      w = self.param("w", lambda rng: pooling.init_kernel_params(self.init_w)["w"])  # []
      pred, weights = pooling.learned_kernel_pooling({"w": w}, queries, keys, values, mask=mask)
    self.sow("intermediates", sown.ATTENTION_WEIGHTS, weights)  # [n_q, n_k]
    return pred  # [n_q]


@register_task("regression")
class RegressionTask(Task):
  """Fits the kernel by leave-one-out MSE on minibatches of training queries."""

  def __init__(self, config, assets=None):
    super().__init__(config, assets)
    model, data = config.model, config.data
    check_choice("model.kernel", model.kernel, KERNELS, "kernels")
    self.data_seed = data.seed if data.seed >= 0 else config.seed
    self.data = make_data(data.num_train, data.x_max, data.noise_std, data.test_step,
                          self.data_seed)
    self.model = KernelRegression(kernel=model.kernel, init_w=model.init_w)
    self._x = jnp.asarray(self.data.x_train)  # [n]
    self._y = jnp.asarray(self.data.y_train)  # [n]
    self._predict = jax.jit(self.predict)

  def init(self, rng: jax.Array) -> Any:
    variables = self.model.init(rng, self._x[:1], self._x, self._y)
    return variables.get("params", {})

  def train_iterator(self) -> pipeline.IndexedBatches:
    # Batches of training-point indices {"idx": int32 [batch]}, a fresh permutation per epoch.
    n = len(self.data.x_train)
    return pipeline.permuted_batches({"idx": np.arange(n, dtype=np.int32)},
                                     min(self.config.batch_size, n), self.config.seed)

  def loss_fn(self, params, batch, rng):
    del rng  # deterministic model
    idx = batch["idx"]  # [batch]
    mask = idx[:, None] != jnp.arange(self._x.shape[0])[None, :]  # [batch, n] leave-one-out
    pred = self.model.apply({"params": params}, self._x[idx], self._x, self._y, mask)  # [batch]
    mse = jnp.mean(jnp.square(pred - self._y[idx]))
    metrics = {"mse": mse}
    if "w" in params:
      metrics["w"] = params["w"]
    return mse, metrics

  def predict(self, params, queries: jax.Array | None = None, mask: jax.Array | None = None):
    """(prediction [n_q], attention weights [n_q, n_train]) at `queries` (default: test grid)."""
    queries = jnp.asarray(self.data.x_test) if queries is None else queries
    pred, state = self.model.apply({"params": params}, queries, self._x, self._y, mask,
                                   mutable=["intermediates"])
    # The model is the top module, so its weights are at path "."; one call, so one value.
    return pred, sown.sown_values(state["intermediates"])["."][0]

  def evaluate(self, params) -> dict[str, float]:
    pred, _ = self._predict(params)  # [n_test]
    n = self._x.shape[0]
    loo_pred, _ = self._predict(params, self._x, ~jnp.eye(n, dtype=bool))  # [n]
    metrics = {
        # Against the noise-free y = x + sin(x) on the test grid.
        "test_mse": float(jnp.mean(jnp.square(pred - self.data.y_test))),
        "train_loo_mse": float(jnp.mean(jnp.square(loo_pred - self._y))),
    }
    if "w" in params:
      metrics["w"] = float(params["w"])
    return metrics

  def write_plots(self, params, workdir: pathlib.Path) -> None:
    pred, weights = self._predict(params)
    label = self.config.model.kernel
    plot_fit(self.data, {label: np.asarray(pred)}, pathlib.Path(workdir) / "fit.png")
    plot_attention(self.data, {label: np.asarray(weights)}, pathlib.Path(workdir) / "attention.png")


def plot_fit(data: RegressionData, predictions: dict[str, np.ndarray], path: pathlib.Path) -> None:
  """Training points, the true curve and each prediction on the test grid, saved as PNG."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (slow import)
  fig = Figure(figsize=(6.4, 4.0))
  ax = fig.subplots()
  ax.plot(data.x_train, data.y_train, "o", color="0.6", markersize=3, label="train (noisy)")
  ax.plot(data.x_test, data.y_test, "k-", linewidth=1, label="truth: x + sin(x)")
  for label, pred in predictions.items():
    ax.plot(data.x_test, pred, label=label)
  ax.set_xlabel("x")
  ax.set_ylabel("y")
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def plot_attention(data: RegressionData, weights: dict[str, np.ndarray],
                   path: pathlib.Path) -> None:
  """One heatmap per kernel: attention of each test query (rows) over sorted train keys (columns)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(4.0 * len(weights), 3.6))
  axes = np.atleast_1d(fig.subplots(1, len(weights)))
  # Columns are training points in index order (sorted by x_i, not evenly spaced); rows in x units.
  extent = (-0.5, len(data.x_train) - 0.5, data.x_test[-1], data.x_test[0])
  for ax, (label, w) in zip(axes, weights.items()):
    image = ax.imshow(w, aspect="auto", cmap="Reds", extent=extent)  # [n_test, n_train]
    ax.set_title(label)
    ax.set_xlabel("training point i (key, sorted by x_i)")
    ax.set_ylabel("test input x (query)")
    fig.colorbar(image, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
