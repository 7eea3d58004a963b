"""Head ablation (Michel et al. 2019, "Are Sixteen Heads Really Better than One?").

  result = head_ablation(run)                      # the task's loss with each head removed
  result = head_ablation(run, metric="token_accuracy", mode="mean")
  result.delta                                     # [layers, heads]: ablated - baseline
  plot_head_ablation(result, path="ablation.png")

Each MultiHeadAttention head is removed in turn, everything else intact, and the task's own
evaluation metric (`task.loss_fn(params, batch, None)`: "loss" or any metric it returns) is
averaged over held-out batches (`task.eval_batches()`, or for translation runs the first examples
of the evaluation split). A head is removed through MultiHeadAttention's "head_mask" collection,
which rescales and shifts each head's context before the output projection:
- mode="zero": the head's context is multiplied by 0 (Michel et al.'s mask);
- mode="mean": the head's context is replaced by its mean over every query position of the
  held-out batches (mean ablation: the head stops carrying information about the input but its
  average contribution to the residual stream stays).
The RNN seq2seq attention and the Nadaraya-Watson pooling have no heads to remove.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from attnlab.analysis import alignment as alignment_lib
from attnlab.layers import hooks as layer_hooks
from attnlab.layers import sown

__all__ = ["AblationResult", "MODES", "head_ablation", "plot_head_ablation"]

# How an ablated head's context is replaced.
MODES = ("zero", "mean")


@dataclasses.dataclass
class AblationResult:
  """The metric with each head removed."""
  # The MultiHeadAttention paths, one per row of `values`/`delta` (natural order).
  layers: list[str]
  # The metric's name ("loss" or a metric of task.loss_fn).
  metric: str
  # "zero" or "mean".
  mode: str
  # The metric with no head removed.
  baseline: float
  # [layers, heads] the metric with that head removed.
  values: np.ndarray
  # [layers, heads] values - baseline.
  delta: np.ndarray


class _MaskedModel:
  """Stands in for task.model inside task.loss_fn: adds the "head_mask" collection to every
  apply, and (record) keeps each attention layer's per-head context from its hook site."""

  def __init__(self, model, head_mask, record: list | None = None):
    self._model, self._head_mask, self._record = model, head_mask, record

  def apply(self, variables, *args, **kwargs):
    variables = dict(variables)
    if self._head_mask is not None:
      variables["head_mask"] = self._head_mask
    if self._record is None:
      return self._model.apply(variables, *args, **kwargs)
    # Each attention layer's per-head context, its hook site "z" [batch, len, heads, head_dim]
    # (the real activation of this pass), recorded as {layer path: [batch, heads, len, hd]}.
    out, state = self._model.apply(variables, *args, mutable=[layer_hooks.HOOKS], **kwargs)
    self._record.append({path: jnp.swapaxes(values[-1], 1, 2) for path, values in
                         sown.sown_values(state.get(layer_hooks.HOOKS, {}), "z").items()})
    return out

  def __getattr__(self, name):
    return getattr(self._model, name)


def _loss_fn(run, head_mask=None, record: list | None = None):
  """run.task.loss_fn on a copy of the task whose model is _MaskedModel(run.model, ...)."""
  task = copy.copy(run.task)
  task.model = _MaskedModel(run.model, head_mask, record)
  return task.loss_fn


def _eval_batches(run, max_batches: int, num_examples: int) -> list[Any]:
  task = run.task
  if run.config.task == "translation":
    examples = task.examples(run.config.data.eval_split)[:num_examples]
    return [alignment_lib.translation_arrays(task, examples)]
  batches = list(task.eval_batches())[:max_batches]
  if not batches:
    raise ValueError(f"task {run.config.task!r} has no evaluation batches; pass batches=[...]")
  return batches


def _heads(run, batch) -> dict[str, tuple[int, int]]:
  """{MultiHeadAttention path: (heads, head_dim)} found by one abstract pass of loss_fn."""
  record: list[Any] = []
  jax.eval_shape(_loss_fn(run, record=record), run.params, batch, None)
  return {p: (v.shape[1], v.shape[3]) for p, v in record[0].items()}  # v: [b, heads, q, hd]


def _mean_contexts(run, batches, paths) -> dict[str, np.ndarray]:
  """{path: mean context [heads, head_dim]} over every query position of `batches`."""
  def fn(params, batch):
    record: list[Any] = []
    _loss_fn(run, record=record)(params, batch, None)
    return {p: jnp.mean(record[0][p], axis=(0, 2)) for p in paths}  # [heads, head_dim]

  jitted = jax.jit(fn)
  sums = None
  for batch in batches:
    means = jax.device_get(jitted(run.params, batch))
    sums = means if sums is None else {p: sums[p] + means[p] for p in paths}
  return {p: np.asarray(sums[p]) / len(batches) for p in paths}


def head_ablation(run, *, metric: str = "loss", mode: str = "zero", batches: list | None = None,
                  max_batches: int = 4, num_examples: int = 256) -> AblationResult:
  """The task's `metric` with each attention head of `run` removed (module docstring).

  Args:
    run: a loaded run (attnlab.analysis.load_run) whose model has MultiHeadAttention layers.
    metric: "loss" or a metric name that task.loss_fn returns.
    mode: "zero" or "mean" (module docstring).
    batches: evaluation batches in the task's format (default: the first `max_batches` of
      task.eval_batches(), or the first `num_examples` held-out pairs of a translation run).
  Raises:
    ValueError naming the valid modes/metrics, or when the model has no heads to remove.
  """
  if mode not in MODES:
    raise ValueError(f"unknown ablation mode {mode!r}; valid modes: {', '.join(MODES)}")
  if run.model is None:
    raise ValueError(f"task {run.config.task!r} has no Flax model")
  batches = list(batches) if batches is not None else _eval_batches(run, max_batches,
                                                                    num_examples)
  heads = _heads(run, batches[0])
  if not heads:
    raise ValueError(f"the {type(run.model).__name__} of this {run.config.task!r} run has no "
                     "MultiHeadAttention heads to ablate")
  paths = list(heads)

  def metrics_fn(params, head_mask, batch):
    loss, metrics = _loss_fn(run, head_mask)(params, batch, None)
    return {**metrics, "loss": loss}

  jitted = jax.jit(metrics_fn)
  identity = {p: {"scale": np.ones((h,), np.float32), "shift": np.zeros((h, d), np.float32)}
              for p, (h, d) in heads.items()}

  def evaluate(flat_mask) -> float:
    mask = traverse_util.unflatten_dict(flat_mask, sep="/")
    values = [jax.device_get(jitted(run.params, mask, b)) for b in batches]
    if metric not in values[0]:
      raise ValueError(f"unknown metric {metric!r}; task {run.config.task!r} reports: "
                       f"{', '.join(sorted(values[0]))}")
    return float(np.mean([v[metric] for v in values]))

  baseline = evaluate(identity)
  means = _mean_contexts(run, batches, paths) if mode == "mean" else None
  max_heads = max(h for h, _ in heads.values())
  values = np.full((len(paths), max_heads), np.nan)
  for l, path in enumerate(paths):
    for h in range(heads[path][0]):
      mask = {p: {k: v.copy() for k, v in m.items()} for p, m in identity.items()}
      mask[path]["scale"][h] = 0.0
      if means is not None:
        mask[path]["shift"][h] = means[path][h]
      values[l, h] = evaluate(mask)
  return AblationResult(layers=paths, metric=metric, mode=mode, baseline=baseline,
                        values=values, delta=values - baseline)


def plot_head_ablation(result: AblationResult, *, title: str | None = None, path=None):
  """Heatmap of `result.delta` `[layers, heads]` (diverging colours, 0 = white); saved if `path`."""
  from attnlab import plotting  # pylint: disable=g-import-not-at-top  (selects the Agg backend)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  delta = np.asarray(result.delta, np.float64)
  layers, heads = delta.shape
  fig, ax = plt.subplots(figsize=(min(3 + 0.6 * heads, 14), min(1.5 + 0.4 * layers, 14)))
  limit = float(np.nanmax(np.abs(delta))) if np.any(np.isfinite(delta)) else 1.0
  image = ax.imshow(delta, cmap="RdBu_r", vmin=-limit or -1.0, vmax=limit or 1.0, aspect="auto",
                    interpolation="nearest")
  for i in range(layers):
    for j in range(heads):
      if np.isfinite(delta[i, j]):
        ax.text(j, i, f"{delta[i, j]:+.3g}", ha="center", va="center", fontsize=7)
  ax.set_xticks(range(heads))
  ax.set_yticks(range(layers))
  ax.set_yticklabels(result.layers, fontsize=8)
  ax.set_xlabel("head")
  ax.set_ylabel("layer")
  ax.set_title(title or f"{result.metric} change with the head removed ({result.mode}); "
               f"baseline {result.baseline:.4g}", fontsize=9)
  fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
  return plotting._save(fig, path)  # pylint: disable=protected-access
