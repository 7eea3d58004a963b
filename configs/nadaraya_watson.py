"""Nadaraya-Watson regression: attention pooling with a learnable Gaussian kernel (task "regression").

Launch (from the repository root):
  python -m attnlab.cli train --config=configs/nadaraya_watson.py --workdir=runs/nw
  attnlab train --config=configs/nadaraya_watson.py:kernel=gaussian --workdir=runs/nw_gaussian
A seconds-long check of the whole pipeline:
  attnlab train --config=configs/nadaraya_watson.py:runlocal=True --workdir=/tmp/nw_local
The study with all three kernels, plots included: python experiments/nadaraya_watson/run.py

Shortcuts in the arg (besides any field): kernel=average|gaussian|learned (= model.kernel).
"""

from attnlab import config_utils

# Short arg keys (config_utils.shortcut_table): this family has no data set, score or size choice.
SHORTCUTS = config_utils.shortcut_table(kernel="model.kernel")


def get_config(arg: str | None = None):
  """`arg`: key=value,... typed from the defaults below (e.g. "runlocal=True,kernel=average")."""
  config = config_utils.base_config()
  # The task in attnlab/tasks/regression.py.
  config.task = "regression"
  # Adam steps; w has converged after ~100.
  config.num_train_steps = 200
  # Training queries per step (100 = all training points every step).
  config.batch_size = 100
  # Log train metrics every 10 steps.
  config.log_every = 10
  # Evaluate on the test grid every 50 steps.
  config.eval_every = 50
  # Checkpoint every 50 steps.
  config.checkpoint_every = 50
  # Adam on the single parameter w.
  config.optimizer.name = "adam"
  # A large step suits one scalar parameter.
  config.optimizer.learning_rate = 0.1
  # No decay: the loss is smooth in w.
  config.optimizer.schedule = "constant"

  # One of average, gaussian (fixed w), learned (w trained); weights softmax(-((x - x_i)·w)²/2).
  config.model.kernel = "learned"
  # w of the gaussian kernel, or the starting w of the learned one.
  config.model.init_w = 1.0

  # Number of training points, drawn uniformly from [0, x_max) and sorted.
  config.data.num_train = 100
  # Inputs lie in [0, x_max).
  config.data.x_max = 10.0
  # Standard deviation of the Gaussian noise added to the training targets.
  config.data.noise_std = 1.0
  # Spacing of the noise-free test grid 0, test_step, ... < x_max.
  config.data.test_step = 0.1
  # Seed of the data set; -1 = use the run's seed (so a sweep over seeds also redraws the data).
  config.data.seed = -1

  return config_utils.finalize(config, arg, runlocal={"data.num_train": 50}, shortcuts=SHORTCUTS)
