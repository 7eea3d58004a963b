"""analysis.ablation (head masking through MultiHeadAttention's head_mask collection) and
analysis.alignment end to end on a translation task."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import tasks
from attnlab.analysis import ablation

REPO = pathlib.Path(__file__).resolve().parents[1]


def _random_params(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype), shapes)


@pytest.fixture(scope="module")
def gpt_run():
  """A tiny GPT whose head 1 of block_0 writes nothing: its rows of the output kernel are 0."""
  config = config_utils.load_config_file(
      str(REPO / "configs" / "gpt.py") + ":dataset=addition,runlocal=True")
  task = tasks.build_task(config)
  params = _random_params(jax.eval_shape(task.init, jax.random.key(0)))
  heads, d = task.model.num_heads, task.model.d_model
  head_dim = d // heads
  kernel = np.array(params["block_0"]["self_attention"]["out"]["kernel"])  # [inner, d]
  kernel[head_dim:2 * head_dim] = 0.0
  params["block_0"]["self_attention"]["out"]["kernel"] = jnp.asarray(kernel)
  return analysis.Run(workdir=None, config=config, task=task, model=task.model, params=params,
                      step=0)


def _loss(run, params, batch):
  return float(jax.jit(lambda p, b: run.task.loss_fn(p, b, None)[0])(params, batch))


def test_ablating_an_unused_head_changes_nothing(gpt_run, tmp_path):
  batches = gpt_run.task.eval_batches()[:1]
  result = analysis.head_ablation(gpt_run, batches=batches)
  assert result.layers == ["block_0/self_attention", "block_1/self_attention"]
  assert result.delta.shape == (2, 2)
  assert result.baseline == pytest.approx(_loss(gpt_run, gpt_run.params, batches[0]), rel=1e-5)
  assert abs(result.delta[0, 1]) < 1e-6  # the unused head
  assert np.all(np.abs(result.delta[[0, 1, 1], [0, 0, 1]]) > 1e-4)  # the used ones matter
  # Zeroing head 0 of block_0 is zeroing its rows of the output kernel: an independent check.
  params = jax.tree.map(lambda x: x, gpt_run.params)
  kernel = np.array(params["block_0"]["self_attention"]["out"]["kernel"])
  kernel[:kernel.shape[0] // 2] = 0.0
  params["block_0"]["self_attention"]["out"]["kernel"] = jnp.asarray(kernel)
  assert result.values[0, 0] == pytest.approx(_loss(gpt_run, params, batches[0]), rel=1e-5)
  fig = ablation.plot_head_ablation(result, path=tmp_path / "ablation.png")
  assert (tmp_path / "ablation.png").read_bytes()[:4] == b"\x89PNG"
  del fig


def test_mean_ablation_and_errors(gpt_run):
  batches = gpt_run.task.eval_batches()[:1]
  result = analysis.head_ablation(gpt_run, batches=batches, mode="mean", metric="perplexity")
  assert abs(result.delta[0, 1]) < 1e-4 * result.baseline
  assert abs(result.delta[0, 0]) > 1e-4 * result.baseline
  with pytest.raises(ValueError, match="valid modes: zero, mean"):
    analysis.head_ablation(gpt_run, batches=batches, mode="random")
  with pytest.raises(ValueError, match="reports: loss, perplexity"):
    analysis.head_ablation(gpt_run, batches=batches, metric="bleu")


class _FixedAlignment(nn.Module):
  """A stand-in translation model whose one attention looks at source position i + shift."""
  shift: int = 0
  vocab: int = 8

  @nn.compact
  def __call__(self, src, src_lengths, tgt_in, *, deterministic=True):
    t, s = tgt_in.shape[1], src.shape[1]
    weights = jax.nn.one_hot(jnp.clip(jnp.arange(t) + self.shift, 0, s - 1), s)  # [t, s]
    weights = jnp.broadcast_to(weights, (src.shape[0], t, s))  # [batch, t, s]
    self.sow("intermediates", "attention_weights", weights)
    return jnp.zeros(tgt_in.shape + (self.vocab,)), {"attention_weights": weights}


def test_alignment_accuracy_on_the_copy_task():
  config = config_utils.load_config_file(
      str(REPO / "configs" / "seq2seq.py") + ":data.name=copy,runlocal=True,data.num_train=50,"
      "data.length_bins=(4,10)")
  task = tasks.build_task(config)
  perfect = analysis.Run(workdir=None, config=config, task=task, model=_FixedAlignment(0),
                         params={}, step=0)
  report = analysis.evaluate_alignment(perfect, num_examples=16)
  assert list(report) == ["."]
  scores = report["."]
  examples = task.examples("validation")[:16]
  assert scores["all"]["accuracy"] == 1.0 and scores["all"]["aer"] == 0.0
  assert scores["all"]["positions"] == sum(len(ex["source"]) for ex in examples)
  short = sum(len(ex["source"]) <= 4 for ex in examples)
  assert scores.get("len_01_04", {"examples": 0})["examples"] == short
  assert scores["all"]["examples"] == 16 and scores["head_accuracy"] == [1.0]
  shifted = analysis.Run(workdir=None, config=config, task=task, model=_FixedAlignment(1),
                         params={}, step=0)
  scores = analysis.evaluate_alignment(shifted, num_examples=16)["."]["all"]
  width = max(len(ex["source"]) for ex in examples)  # the batch's padded source width
  right = 0
  for ex in examples:  # NumPy reference: row i looks at min(i + 1, width - 1), cut to n keys
    n = len(ex["source"])
    for i in range(n):
      row = np.eye(width)[min(i + 1, width - 1), :n]
      right += int(np.argmax(row)) == i
  assert 0 < right < scores["positions"]
  assert scores["accuracy"] == pytest.approx(right / scores["positions"])
