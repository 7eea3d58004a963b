"""The fields every run has (`base_config`): the trainer's, the mesh's and the optimizer's, one
comment above each. A config file (configs/*.py) starts from it through
`config_utils.base_config()`, sets `task` and fills `model` and `data`."""

from __future__ import annotations

import ml_collections

ConfigDict = ml_collections.ConfigDict


def base_config() -> ConfigDict:
  """The fields every run has; a config file fills `task`, `model` and `data` and tunes the rest."""
  config = ConfigDict()
  # Name of the task in the registry (attnlab.tasks.get_task): it supplies model, data, loss, metrics.
  config.task = ""
  # Seed of parameter init, dropout and data order: equal seeds give bit-identical runs.
  config.seed = 0
  # Number of optimizer updates.
  config.num_train_steps = 1000
  # Examples per training step.
  config.batch_size = 32
  # Write train metrics (metrics.jsonl, TensorBoard, progress bar) every this many steps.
  config.log_every = 50
  # Evaluate every this many steps (0: only at the end); always evaluates after the last step.
  config.eval_every = 500
  # Evaluation batches before the last step (0: the whole validation split): the first this many
  # of the task's evaluation batches, a fixed subset, for the periodic evaluations; the evaluation
  # after the last step always covers the whole split. Tasks with their own evaluate (decoding,
  # BLEU: translation, regression) always evaluate in full.
  config.eval_batches = 0
  # Early stopping: stop after this many evaluations in a row without a lower validation loss
  # than the best so far (0: off; needs eval_every > 0). The best evaluation's checkpoint is kept
  # and is the run's result (what generate, view, export and init_from restore); attnlab/train.py.
  config.early_stop_patience = 0
  # Save a checkpoint every this many steps (0: only at the end); also at the end and on SIGTERM/Ctrl-C.
  config.checkpoint_every = 500
  # How many of the most recent checkpoints to keep.
  config.keep_checkpoints = 3
  # Shrink the run to seconds (see RUNLOCAL and the config file's own runlocal overrides).
  config.runlocal = False
  # Allow continuing a workdir whose config.json differs from this config (config.json is replaced).
  config.allow_config_change = False
  # Let the task write its plots (PNG) into the workdir after the last step.
  config.write_plots = True
  # The train step's Dense products (attnlab.precision): auto (bfloat16 operands, float32
  # accumulation, for a float32 model on a CPU with bfloat16 dot instructions; elsewhere JAX's
  # default), float32 or bfloat16. Evaluation and generation compute in float32 regardless.
  config.matmul_precision = "auto"
  # Replicas trained at once by jax.vmap (seeds seed, seed+1, ...; 1: an ordinary run).
  config.num_seeds = 1

  config.mesh = ConfigDict()
  # Devices on the data-parallel axis (-1: all devices not on fsdp); one device = the plain path.
  config.mesh.data = -1
  # Devices on the FSDP axis: parameters and optimizer state are split over them (1: replicated).
  config.mesh.fsdp = 1
  # Under FSDP, state leaves with fewer elements than this stay replicated.
  config.mesh.fsdp_min_size = 1024
  # JAX CPU devices to split the process into, so that the data axis above spreads each batch
  # over the cores; set before JAX starts (the trainer does it first). -1: automatic, one per core
  # (or the most that divide batch_size) on a CPU-only machine, devices left alone when JAX may use
  # a GPU/TPU; 0: the same on any machine; 1: one device, the plain path; N: N devices.
  config.mesh.cpu_devices = -1

  config.optimizer = ConfigDict()
  # One of adamw, adam, sgd.
  config.optimizer.name = "adamw"
  # Peak learning rate, reached after the warmup.
  config.optimizer.learning_rate = 1e-3
  # Steps of linear warmup from 0 to learning_rate.
  config.optimizer.warmup_steps = 0
  # Decay after the warmup: cosine, linear (both down to end_learning_rate) or constant.
  config.optimizer.schedule = "cosine"
  # Learning rate at the last step for the cosine and linear schedules.
  config.optimizer.end_learning_rate = 0.0
  # Decoupled weight decay (adamw only).
  config.optimizer.weight_decay = 0.0
  # Which parameters weight decay applies to: all, or matrices (ndim >= 2: kernels and embedding
  # tables, not biases, norm scales or other vectors).
  config.optimizer.decay = "all"
  # Adam first-moment decay.
  config.optimizer.b1 = 0.9
  # Adam second-moment decay.
  config.optimizer.b2 = 0.999
  # SGD momentum (0: plain SGD).
  config.optimizer.momentum = 0.0
  # Clip gradients to this global norm (0: no clipping).
  config.optimizer.grad_clip = 0.0

  # Model hyperparameters, defined by the task (see its config file).
  config.model = ConfigDict()
  # Data hyperparameters, defined by the task (see its config file).
  config.data = ConfigDict()
  return config


def add_labeled_file(data: ConfigDict, *, pairs: bool = True) -> None:
  """The keys of a labelled CSV/TSV file (`dataset=csv`, attnlab/data/labeled_csv.py), in the data
  group of a classifier's config (BERT fine-tuning; the RNN classifier without `pairs`)."""
  # csv: the training file, CSV or TSV with a header row (attnlab/data/labeled_csv.py).
  data.path = ""
  # csv: the delimiter: "" (from the extension: .csv comma, .tsv tab), comma, tab, semicolon,
  # pipe, or one character.
  data.delimiter = ""
  # csv: the header's name of the text column (sentence A of a pair).
  data.text_column = "sentence"
  if pairs:
    # csv: the column of the second text of sentence pairs ("" = single sentences).
    data.text_pair_column = ""
  # csv: the label column (any strings; the classes are its sorted distinct values).
  data.label_column = "label"
  # csv: the validation file, with the same columns ("" = hold out data.valid_fraction).
  data.valid_path = ""
  # csv without data.valid_path: the fraction of the training file's rows held out.
  data.valid_fraction = 0.1
  # csv without data.valid_path: the seed of the permutation that picks the held-out rows.
  data.valid_seed = 0
