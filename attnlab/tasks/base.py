"""The Task interface: what a model family plugs into the one training loop (attnlab/train.py).

A task bundles, for one objective, the model, the data, the loss and the evaluation. The trainer
owns everything else: optimizer, jit, checkpoints, metrics files, resume, signals, NaN guard.

    @register_task("my_task")              # attnlab/tasks/my_task.py; config.task = "my_task"
    class MyTask(Task):
      def __init__(self, config):           # build model and data from config.model / config.data
      def init(self, rng) -> params         # a pytree of arrays (e.g. a Flax "params" collection)
      def load_pretrained(self, params)     # optional: params with pretrained weights put in
      def train_iterator(self) -> BatchIterator
      def loss_fn(self, params, batch, rng) -> (loss, metrics)
      def evaluate(self, params) -> {name: float}        # optional (default: eval_batches below)
      def write_plots(self, params, workdir) -> None      # optional

Contract the trainer relies on:
- `loss_fn` is pure and jit-able: params and batch are pytrees of arrays, `rng` is a JAX key for
  dropout and sampling, or None for a deterministic (evaluation) pass. It returns the scalar loss
  that is minimised and a dict of scalar metrics (averaged over each log interval).
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
  averages the metrics of `loss_fn(params, batch, None)` over `eval_batches()` with a jitted step.
- `model` (a Flax module, or None) is what `attnlab.analysis.load_run` hands back for analysis;
  `model.apply({"params": params}, ...)` must run the forward pass.
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import jax
import ml_collections
import numpy as np

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


class IndexedBatches:
  """A BatchIterator over `batch_fn(0), batch_fn(1), ...`; its state is the next index.

  For data that can be produced from the batch index alone (synthetic tasks, or a permutation of
  an in-memory dataset seeded by (seed, epoch)): resuming is exact by construction.
  """

  def __init__(self, batch_fn: Callable[[int], Batch], start: int = 0):
    self._batch_fn = batch_fn
    self._index = start

  def __iter__(self) -> IndexedBatches:
    return self

  def __next__(self) -> Batch:
    batch = self._batch_fn(self._index)
    self._index += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"index": self._index}

  def set_state(self, state: dict[str, Any]) -> None:
    if "index" not in state:
      raise ValueError(f"IndexedBatches state must be {{'index': int}}, got {state!r}")
    self._index = int(state["index"])


class Task(abc.ABC):
  """One objective: model + data + loss + evaluation. See the module docstring for the contract."""

  # Registry name, set by attnlab.tasks.register_task.
  name: str = ""

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    # The Flax module for analysis (or None for tasks without one).
    self.model = None
    self._jit_eval_step = None

  @abc.abstractmethod
  def init(self, rng: jax.Array) -> Params:
    """Initial parameters (a pytree of arrays) from a JAX key."""

  def load_pretrained(self, params: Params) -> Params | None:
    """`params` (one replica's initial parameters) with pretrained weights put in, or None when
    the task loads none (the default). Called eagerly, outside any jit or vmap."""
    del params
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

  def evaluate(self, params: Params) -> dict[str, float]:
    """Metrics on held-out data: the mean of `loss_fn(params, batch, None)` over eval_batches."""
    if self._jit_eval_step is None:
      def eval_step(params, batch):
        loss, metrics = self.loss_fn(params, batch, None)
        return {**metrics, "loss": loss}
      self._jit_eval_step = jax.jit(eval_step)
    totals: dict[str, float] = {}
    count = 0
    for batch in self.eval_batches():
      metrics = jax.device_get(self._jit_eval_step(params, batch))
      for key, value in metrics.items():
        totals[key] = totals.get(key, 0.0) + float(value)
      count += 1
    return {key: value / count for key, value in totals.items()}

  def write_plots(self, params: Params, workdir: pathlib.Path) -> None:
    """Writes the task's figures (PNG) into `workdir` after training; nothing by default."""


def rng_for(seed: int, *keys: int) -> np.random.Generator:
  """A NumPy generator determined by (seed, *keys), for host-side data order and sampling."""
  return np.random.default_rng([seed, *keys])
