"""The attention-pooling study: Nadaraya-Watson regression with three kernels.

  python experiments/nadaraya_watson/run.py [--workdir=runs/nadaraya_watson] \
      [--config.optimizer.learning_rate=0.05 ...]

Data: y = x + sin(x) + N(0, 1) at 100 sorted training points in [0, 10); test grid 0, 0.1, ..., 9.9.
Average pooling and the fixed Gaussian kernel (w = 1) need no training; the learned kernel trains
its w with optax through the ordinary runner (a resumable run in WORKDIR/learned) and is reloaded
with attnlab.analysis.load_run. Prints the test MSE of each (against the noise-free curve) and
saves WORKDIR/fit.png and WORKDIR/attention.png.
"""

from __future__ import annotations

import copy
import pathlib
import sys
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]

from absl import flags  # pylint: disable=g-import-not-at-top

from attnlab.cli import tool  # pylint: disable=g-import-not-at-top

KERNELS = ("average", "gaussian", "learned")
CONFIG = str(REPO / "configs" / "nadaraya_watson.py")


def _define_flags(argv: Sequence[str]) -> flags.FlagValues:
  return tool.run_flags(
      argv, "Config of the learned-kernel run (model.kernel is set per kernel); override fields "
      "with --config.<field>=<value>.", "Output directory (the learned-kernel run goes to "
      "WORKDIR/learned; re-running resumes it).",
      config_default=CONFIG,
      workdir_default="runs/nadaraya_watson")


def run_study(config, workdir: pathlib.Path) -> dict[str, dict[str, float]]:
  """Fits the three kernels; returns {kernel: metrics}; writes fit.png and attention.png."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab import tasks  # pylint: disable=g-import-not-at-top
  from attnlab import train  # pylint: disable=g-import-not-at-top
  from attnlab.tasks import regression  # pylint: disable=g-import-not-at-top

  results, predictions, weights = {}, {}, {}
  for kernel in KERNELS:
    kernel_config = copy.deepcopy(config)
    kernel_config.model.kernel = kernel
    if kernel == "learned":
      train.train_and_evaluate(kernel_config, workdir / "learned")
      run = analysis.load_run(workdir / "learned")
      task, params = run.task, run.params
    else:  # nothing to fit: evaluate the initial (parameter-free) model
      task = tasks.build_task(kernel_config)
      params = task.init(jax.random.key(kernel_config.seed))
    results[kernel] = task.evaluate(params)
    pred, attention = task.predict(params)
    predictions[kernel], weights[kernel] = np.asarray(pred), np.asarray(attention)
  workdir.mkdir(parents=True, exist_ok=True)
  regression.plot_fit(task.data, predictions, workdir / "fit.png")
  regression.plot_attention(task.data, weights, workdir / "attention.png")
  return results


def main(argv: Sequence[str] | None = None) -> int:
  argv = tool.with_default_config(sys.argv if argv is None else argv, CONFIG)
  flag_values = _define_flags(argv)
  message = tool.parse_flags(flag_values, argv)

  def body() -> None:
    config, workdir = flag_values.config, pathlib.Path(flag_values.workdir).absolute()
    results = run_study(config, workdir)
    data = config.data
    print(f"\nNadaraya-Watson regression: y = x + sin(x) + N(0, {data.noise_std:g}²), "
          f"{data.num_train} training points in [0, {data.x_max:g}), test grid step "
          f"{data.test_step:g}")
    print("test MSE is measured against the noise-free y = x + sin(x) on the test grid\n")
    print(f"{'kernel':<10} {'w':>7} {'test MSE':>10} {'train LOO MSE':>14}")
    for kernel, metrics in results.items():
      w = metrics.get("w", config.model.init_w if kernel == "gaussian" else float("nan"))
      w_text = "-" if w != w else f"{w:.3f}"
      print(f"{kernel:<10} {w_text:>7} {metrics['test_mse']:>10.4f} "
            f"{metrics['train_loo_mse']:>14.4f}")
    verdict = "beats" if results["learned"]["test_mse"] < results["average"]["test_mse"] else \
        "does NOT beat"
    print(f"\nlearned kernel {verdict} average pooling on test MSE")
    print(f"plots: {workdir / 'fit.png'}, {workdir / 'attention.png'}; "
          f"learned-kernel run: {workdir / 'learned'}")
  return tool.launch("run.py", message, body)


if __name__ == "__main__":
  sys.exit(main())
