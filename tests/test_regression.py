"""The Nadaraya-Watson regression task: its predictions and the attention weights it reads back
through attnlab.layers.sown equal the pooling functions' own."""

import copy
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import config_utils
from attnlab import tasks
from attnlab.attention import pooling
from attnlab.layers import sown

REPO = pathlib.Path(__file__).resolve().parents[1]
NW = str(REPO / "configs" / "nadaraya_watson.py")


def _task(kernel: str):
  config = copy.deepcopy(config_utils.load_config_file(f"{NW}:runlocal=True,write_plots=False"))
  config.model.kernel = kernel
  task = tasks.build_task(config)
  return task, task.init(jax.random.key(config.seed))


@pytest.mark.parametrize("kernel", ["average", "gaussian", "learned"])
def test_predict_returns_the_sown_weights_of_the_pooling(kernel):
  task, params = _task(kernel)
  data = task.data
  x_test, x_train, y_train = (jnp.asarray(a) for a in (data.x_test, data.x_train, data.y_train))
  if kernel == "average":
    expected_pred, expected_w = pooling.average_pooling(x_test, x_train, y_train)
  elif kernel == "gaussian":
    expected_pred, expected_w = pooling.nadaraya_watson(x_test, x_train, y_train,
                                                        w=task.config.model.init_w)
  else:
    expected_pred, expected_w = pooling.learned_kernel_pooling(params, x_test, x_train, y_train)
  pred, weights = task.predict(params)
  assert weights.shape == (len(data.x_test), len(data.x_train))
  np.testing.assert_allclose(np.asarray(weights), np.asarray(expected_w), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(pred), np.asarray(expected_pred), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-5)


def test_weights_are_sown_at_the_top_module_path():
  task, params = _task("gaussian")
  x, y = task.data.x_train, task.data.y_train
  _, state = task.model.apply({"params": params}, x[:3], x, y, mutable=["intermediates"])
  maps = sown.sown_values(state["intermediates"])
  assert list(maps) == ["."] and len(maps["."]) == 1
  assert maps["."][0].shape == (3, len(task.data.x_train))
