"""The Task interface: what a model family plugs into the one training loop (attnlab/train.py).

A task bundles, for one objective, the model, the data, the loss and the evaluation. The trainer
owns everything else: optimizer, jit, checkpoints, metrics files, resume, signals, NaN guard.

    @register_task("my_task")              # attnlab/tasks/my_task.py; config.task = "my_task"
    class MyTask(Task):
      def __init__(self, config, assets=None):  # model and data from config.model / config.data
      def init(self, rng) -> params         # a pytree of arrays (e.g. a Flax "params" collection)
      def load_pretrained(self, params, pretrained_config, pretrained_params)  # config.init_from
      def check_pretrained(cls, config, pretrained_config)  # optional classmethod: the same, early
      def frozen(self) -> params -> pytree of bools | None  # optional: parameters left unchanged
      def train_iterator(self) -> BatchIterator
      def loss_fn(self, params, batch, rng) -> (loss, metrics)
      def eval_batches(self) -> Iterable[batch]            # optional: held-out batches
      def metric_sums(self, params, batch, rng=None)      # optional: {name: (sum, denominator)}
      def finish_metrics(self, metrics) -> metrics        # optional: derived metrics (perplexity)
      def evaluate(self, params) -> {name: float}        # optional (default: the loop below)
      def write_plots(self, params, workdir) -> None      # optional

Contract the trainer relies on:
- `loss_fn` is pure and jit-able: params and batch are pytrees of arrays, `rng` is a JAX key for
  dropout and sampling, or None for a deterministic (evaluation) pass. It returns the scalar loss
  that is minimised and a dict of scalar metrics (averaged over each log interval). Write batch
  averages as `losses.ratio(sum, count)` (or `ratios(metric_sums)`): on a data-parallel mesh each
  device then runs the step on its slice of the batch and one all-reduce sums the gradients
  (train.make_train_step); a plain `jnp.mean` still trains, through the compiler's slower split.
- `train_iterator()` returns an iterator whose position can be saved: `get_state()` gives a
  JSON-serialisable dict stored in every checkpoint, `set_state(state)` puts a fresh iterator back
  at that position, so a resumed run sees exactly the batches an uninterrupted one would. Order
  must depend only on `config.seed` (and the data), never on wall-clock or global RNG state.
- `init` is a pure function of the key (the trainer and `load_run` trace it for shapes, and vmap
  it over seeds). Weights from elsewhere (`config.init_from`) come from `load_pretrained`, which
  the trainer calls eagerly once on every replica's step-0 parameters of a new run.
- Trainable state is `params` only; the trainer keeps the optimizer state and the step. None of the
  planned families (RNN seq2seq, Transformer, BERT, GPT) keeps batch statistics; attention weights
  are `sow`n into the "intermediates" collection, read by `attnlab.analysis.attention_maps`.
- `evaluate` runs on the host between train steps and may decode, compute BLEU, etc. The default
  (`mean_metrics`) owns the jit, the loop over `eval_batches()`, the padding of a short last
  batch (with zero rows, to the first batch's size: one compilation) and the division: it adds
  up `metric_sums(params, batch)` = {name: (sum over the batch, denominator)} and reports
  sum / max(denominator, 1) per name, then `finish_metrics`. A task's `metric_sums` must give
  zero rows zero weight (their weight or mask field is 0). Without one, each `loss_fn` metric
  counts once per batch (the mean over batches).
- What the model's shapes and the text <-> ids mapping take from the data (vocabularies, the
  longest source, a classifier's class names, ...) goes through `asset_tokenizer(name, build)` /
  `asset_size(name, compute)` / `asset_labels(name, compute)`:
  built from the data for a new run, read from the run directory's `assets/` folder
  (attnlab.data.assets) when the task is rebuilt from a run (resume, `load_run`), so that a run
  reloads, generates and translates with the dataset gone. Read the data itself lazily (on
  `train_iterator`, evaluation), never in `__init__` when assets are given.
- `model` (a Flax module, or None) is what `attnlab.analysis.load_run` hands back for analysis;
  `model.apply({"params": params}, ...)` must run the forward pass.
"""

from __future__ import annotations

import abc
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import ml_collections
import numpy as np

from attnlab import errors
from attnlab import losses
from attnlab.data import assets as assets_lib

Params = Any  # a pytree of arrays
Batch = Any  # a pytree of arrays
Metrics = dict[str, Any]


@runtime_checkable
class BatchIterator(Protocol):
  """An iterator over training batches whose position can be checkpointed."""

  def __iter__(self) -> Iterator[Batch]:
    ...

  def __next__(self) -> Batch:
    ...

  def get_state(self) -> dict[str, Any]:
    """A JSON-serialisable dict that `set_state` accepts."""
    ...

  def set_state(self, state: dict[str, Any]) -> None:
    """Moves the iterator to the position saved by `get_state`."""
    ...


class Task(abc.ABC):
  """One objective: model + data + loss + evaluation. See the module docstring for the contract."""

  # Registry name, set by attnlab.tasks.register_task.
  name: str = ""

  def __init__(self, config: ml_collections.ConfigDict,
               assets: str | os.PathLike | None = None):
    self.config = config
    # The run directory's assets folder when the task is rebuilt from a run (None for a new run,
    # or an older run directory without one): vocabularies and sizes come from it.
    self.assets = pathlib.Path(assets) if assets and pathlib.Path(assets).is_dir() else None
    self._sizes_kept = assets_lib.load_sizes(self.assets) if self.assets else {}
    self._labels_kept = assets_lib.load_labels(self.assets) if self.assets else {}
    self._vocabularies: dict[str, Any] = {}
    self._sizes: dict[str, int] = {}
    self._labels: dict[str, tuple[str, ...]] = {}
    # The Flax module for analysis (or None for tasks without one).
    self.model = None
    self._jit_metric_sums = None

  def asset_tokenizer(self, name: str, build: Callable[[], Any]) -> Any:
    """The vocabulary `name`: the run's kept one (assets), else `build()` from the data."""
    tokenizer = assets_lib.load_tokenizer(self.assets, name) if self.assets else None
    if tokenizer is None:
      tokenizer = build()
    self._vocabularies[name] = tokenizer
    return tokenizer

  def asset_size(self, name: str, compute: Callable[[], int]) -> int:
    """A model size derived from the data: the run's kept value (assets), else `compute()`."""
    value = self._sizes_kept.get(name)
    self._sizes[name] = int(compute() if value is None else value)
    return self._sizes[name]

  def asset_labels(self, name: str, compute: Callable[[], Sequence[str]]) -> tuple[str, ...]:
    """A list of names derived from the data (a classifier's classes, in the order of its
    outputs): the run's kept list (assets), else `compute()`."""
    value = self._labels_kept.get(name)
    self._labels[name] = tuple(compute() if value is None else value)
    return self._labels[name]

  def save_assets(self, directory: str | os.PathLike) -> None:
    """Writes the vocabularies, sizes and labels this task used into `directory` (a run's
    assets/)."""
    assets_lib.save(directory, self._vocabularies, self._sizes, self._labels)

  @abc.abstractmethod
  def init(self, rng: jax.Array) -> Params:
    """Initial parameters (a pytree of arrays) from a JAX key."""

  def load_pretrained(self, params: Params, pretrained_config: ml_collections.ConfigDict,
                      pretrained_params: Params) -> Params:
    """`params` (one replica's initial parameters) with the weights of the run `config.init_from`
    put in (its config and restored parameters are given). The trainer calls it eagerly, outside
    any jit or vmap, when `config.init_from` is set; by default a task cannot start from one."""
    del params, pretrained_params
    raise _cannot_start_from(self.name, self.config, pretrained_config)

  @classmethod
  def check_pretrained(cls, config: ml_collections.ConfigDict,
                       pretrained_config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError when a run of `config` cannot start from the run `config.init_from`,
    whose config is `pretrained_config`: what `load_pretrained` would refuse that the two configs
    alone show. The trainer calls it before it creates or writes the workdir. By default a task
    that keeps Task.load_pretrained cannot start from another run; others are not checked."""
    if cls.load_pretrained is Task.load_pretrained:
      raise _cannot_start_from(cls.name, config, pretrained_config)

  def frozen(self) -> Callable[[Params], Any] | None:
    """The parameters training leaves unchanged (fine-tuning): a function of a params pytree
    giving a pytree of the same structure with True at each frozen leaf, or None (the default)
    when every parameter trains. The trainer's optimizer gives frozen leaves zero updates and no
    optimizer state (attnlab.state.task_optimizer). It may be called on the parameters of
    several replicas (a leading [num_seeds] axis): decide by the path, not the shape."""
    return None

  @abc.abstractmethod
  def train_iterator(self) -> BatchIterator:
    """A fresh iterator over training batches, at position 0 (the trainer restores its state)."""

  @abc.abstractmethod
  def loss_fn(self, params: Params, batch: Batch, rng: jax.Array | None) -> tuple[jax.Array, Metrics]:
    """(scalar loss, {name: scalar metric}); rng None = deterministic evaluation pass."""

  def eval_batches(self) -> Iterable[Batch]:
    """Batches for the default `evaluate` (none by default)."""
    return ()

  def metric_sums(self, params: Params, batch: Batch,
                  rng: jax.Array | None = None) -> dict[str, tuple[Any, Any]]:
    """{name: (sum over the batch's examples, its denominator)} (module docstring); rows of
    zeros must count nothing. Default: each `loss_fn` metric once per batch."""
    loss, metrics = self.loss_fn(params, batch, rng)
    return {name: (value, 1.0) for name, value in {**metrics, "loss": loss}.items()}

  def finish_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
    """The evaluation metrics from the ratios of `metric_sums` (add derived ones here)."""
    return metrics

  def _metric_program(self):
    if self._jit_metric_sums is None:
      self._jit_metric_sums = jax.jit(lambda p, b: self.metric_sums(p, b))
    return self._jit_metric_sums

  def mean_metrics(self, params: Params, batches: Iterable[Batch]) -> dict[str, float]:
    """sum / max(denominator, 1) of `metric_sums` over `batches` (a short last batch is padded
    with zero rows to the first one's size), under one jit-compiled step."""
    program = self._metric_program()
    totals: dict[str, list[float]] = {}
    size, pending = None, []
    for batch in batches:  # every batch dispatched before any result is read
      size = size or _num_rows(batch)
      pending.append(program(params, pad_rows(batch, size)))
    for sums in jax.device_get(pending):
      for name, (value, denominator) in sums.items():
        total = totals.setdefault(name, [0.0, 0.0])
        total[0] += float(value)
        total[1] += float(denominator)
    return {name: value / max(denominator, 1.0) for name, (value, denominator) in totals.items()}

  def compile_mean_metrics(self, params: Params) -> bool:
    """Compiles the program `mean_metrics` runs, for parameters of the shapes and placement of
    `params` (jax.ShapeDtypeStructs will do) and the batches of `eval_batches()`, without
    running it; False when there is no evaluation batch. The trainer calls it on a thread of
    its own while the train step compiles, so that the first evaluation does not stop training
    to compile."""
    batch = next(iter(self.eval_batches()), None)
    if batch is None:
      return False
    self._metric_program().lower(params, batch).compile()
    return True

  def evaluate(self, params: Params) -> dict[str, float]:
    """Metrics on held-out data: `finish_metrics(mean_metrics(params, eval_batches()))`."""
    return self.finish_metrics(self.mean_metrics(params, self.eval_batches()))

  def write_plots(self, params: Params, workdir: pathlib.Path) -> None:
    """Writes the task's figures (PNG) into `workdir` after training; nothing by default."""


def _cannot_start_from(name: str, config: ml_collections.ConfigDict,
                       pretrained_config: ml_collections.ConfigDict) -> errors.ConfigError:
  return errors.ConfigError(f"task {name!r} cannot start from another run "
                            f"(config.init_from={config.get('init_from')!r}, a "
                            f"{pretrained_config.get('task')!r} run); unset init_from")


def data_location(data: ml_collections.ConfigDict) -> dict[str, Any]:
  """The `data_dir` and `manual_dir` arguments of `attnlab.data.get_dataset` of a data config."""
  return {"data_dir": data.data_dir or None, "manual_dir": data.manual_dir or None}


def ratios(sums: dict[str, tuple[Any, Any]]) -> dict[str, jax.Array]:
  """{name: sum / max(denominator, 1)} of one `metric_sums` result (inside jit: loss_fn), over
  every device's examples in the data-parallel train step (`losses.ratio`)."""
  return {name: losses.ratio(value, denominator) for name, (value, denominator) in sums.items()}


def _num_rows(batch: Batch) -> int:
  return len(jax.tree.leaves(batch)[0])


def pad_rows(batch: Batch, size: int) -> Batch:
  """`batch` with zero rows appended to every leaf so that it has `size` rows."""
  pad = size - _num_rows(batch)
  if pad <= 0:
    return batch
  return jax.tree.map(
      lambda x: np.concatenate([np.asarray(x), np.zeros((pad,) + np.shape(x)[1:],
                                                        np.asarray(x).dtype)]), batch)
