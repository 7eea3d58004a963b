"""experiments/attention_sinks/run.py (issue #52): a seconds-long study of the softmax_sink arm
(tiny GPT, 4 steps, 2 vmapped seeds), its numbers against NumPy references written here from the
formulas, and its resume."""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "attention_sinks" / "run.py"
ARGS = ("--runlocal", "--arms=softmax_sink", "--steps=4", "--checkpoints=2", "--seeds=2",
        "--windows=4")


def _run(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(REPO))  # this checkout's attnlab
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def module(script_loader):
  return script_loader(SCRIPT, "attention_sinks_run")


@pytest.fixture(scope="module")
def study(tmp_path_factory, shared_data):
  workdir = tmp_path_factory.mktemp("sinks") / "study"
  proc = _run(f"--workdir={workdir}", f"--data_dir={shared_data}", *ARGS)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return workdir, proc.stdout


def test_uniform_reference_and_windows(module):
  # Uniform causal attention: row q gives 1 / (q + 1) to the first token; over q = 1 .. T-1 the
  # mean is (H_T - 1) / (T - 1), H_T the T-th harmonic number.
  for length in (2, 32, 64):
    harmonic = sum(1.0 / k for k in range(1, length + 1))
    assert abs(module.uniform_first_token(length) - (harmonic - 1) / (length - 1)) < 1e-12
  ids = np.arange(1000) * 7 % 101
  x, y = module.text_windows(ids, 16, 5)
  assert x.shape == y.shape == (5, 16) and x[0, 0] == ids[0] and x[-1, -1] == ids[1000 - 2]
  assert (y[:, :-1] == x[:, 1:]).all() and (y[:, -1] == ids[np.linspace(0, 983, 5).astype(int)
                                                             + 16]).all()


def _reference(q, k, sink):
  """NumPy softmax with a per-head sink logit (Xiao et al.): (weights, sink weight) of scaled
  dot-product scores under a causal mask; q, k `[batch, heads, len, dim]`, sink `[heads]`."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  scores = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
  length = q.shape[2]
  scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
  s = np.asarray(sink, np.float64)[None, :, None, None]
  top = np.maximum(scores.max(-1, keepdims=True), s)
  e, e_sink = np.exp(scores - top), np.exp(s - top)
  total = e.sum(-1, keepdims=True) + e_sink
  return e / total, (e_sink / total)[..., 0]


@pytest.mark.slow
def test_study_numbers_match_numpy(study, shared_data):
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab import analysis, rundir  # pylint: disable=g-import-not-at-top
  from attnlab.analysis import sinks  # pylint: disable=g-import-not-at-top
  workdir, stdout = study
  assert any(line.startswith("softmax_sink: trained, step 4,") for line in stdout.splitlines())
  measured = json.loads((workdir / "softmax_sink" / "sinks.json").read_text())
  assert list(measured["steps"]) == ["0", "2", "4"]
  assert all(len(seeds) == 2 for seeds in measured["steps"].values())
  results = json.loads((workdir / "results.json").read_text())
  run4 = analysis.load_run(workdir / "softmax_sink", step=4, replica=1)
  model, block = run4.model, run4.model.block_size
  ids = np.asarray(run4.task.validation_ids())
  starts = np.linspace(0, len(ids) - block - 1, 4).astype(int)  # 4 evenly spaced windows
  x = np.stack([ids[s:s + block] for s in starts])
  y = np.stack([ids[s + 1:s + block + 1] for s in starts])
  # Step 0: the seeds' initial parameters, from the trainer's keys (seed + replica).
  init1 = run4.task.init(jax.random.split(jax.random.key(run4.config.seed + 1))[0])
  for step, params in (("4", run4.params), ("0", init1)):
    entry = measured["steps"][step][1]
    names = [f"blocks.{l}.attn.{s}" for l in range(model.num_layers) for s in "qk"]
    logits, cache = analysis.run_with_cache((model, params), x, names)
    for l in range(model.num_layers):
      sink = params[f"block_{l}"]["self_attention"]["normalizer_params"]["sink"]
      w, mass = _reference(cache[f"blocks.{l}.attn.q"], cache[f"blocks.{l}.attn.k"], sink)
      np.testing.assert_allclose(entry["text"]["first_token"][l], w[:, :, 1:, 0].mean((0, 2)),
                                 atol=2e-5)
      np.testing.assert_allclose(entry["text"]["sink_mass"][l], mass[:, :, 1:].mean((0, 2)),
                                 atol=2e-5)
      np.testing.assert_allclose(entry["text"]["row_sum"][l], w[:, :, 1:].sum(-1).mean((0, 2)),
                                 atol=2e-5)
    first = np.asarray(entry["text"]["first_token"])
    assert entry["text"]["rate"] == np.mean(first > 0.3)
    # The loss on the text windows: cross-entropy of the logits, in NumPy.
    z = np.asarray(logits, np.float64)
    ce = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1) - \
        np.take_along_axis(z, y[..., None], -1)[..., 0]
    assert abs(entry["window_loss"] - ce.mean()) < 1e-4
    # The library's own sink_metrics on the same windows gives the same numbers.
    lib = sinks.sink_metrics((model, params), x)
    np.testing.assert_allclose(lib.first_token, first, atol=1e-6)
  # The trainer's validation loss (after the last step) per seed, and the summary over the seeds.
  last_eval = [r for r in rundir.read_metrics(workdir / "softmax_sink") if r["split"] == "eval"][-1]
  assert [s["eval_loss"] for s in measured["steps"]["4"]] == last_eval["per_seed"]["loss"]
  assert measured["steps"]["0"][0]["eval_loss"] is None
  summary = results["arms"]["softmax_sink"]["summary"]["4"]
  means = [np.mean(s["text"]["first_token"]) for s in measured["steps"]["4"]]
  np.testing.assert_allclose(summary["text"]["first_token_mean"],
                             [np.mean(means), np.std(means, ddof=1)], rtol=1e-9)
  maxima = [np.max(s["random"]["sink_mass"]) for s in measured["steps"]["4"]]
  np.testing.assert_allclose(summary["random"]["sink_mass_max"],
                             [np.mean(maxima), np.std(maxima, ddof=1)], rtol=1e-9)
  rows = [line for line in (workdir / "results.md").read_text().splitlines()
          if line.startswith("| softmax_sink | 4 |")]
  assert len(rows) == 3  # the two final tables and the last row over training
  assert (workdir / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_study_resumes_without_work_and_refuses_bad_arms(study, shared_data):
  workdir, _ = study
  path = workdir / "softmax_sink" / "sinks.json"
  before = path.read_bytes(), sorted(p.name for p in (workdir / "softmax_sink" /
                                                      "checkpoints").iterdir())
  proc = _run(f"--workdir={workdir}", f"--data_dir={shared_data}", *ARGS)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert any(line.startswith("softmax_sink: skipped, step 4,") for line in proc.stdout.splitlines())
  assert (path.read_bytes(), sorted(p.name for p in (workdir / "softmax_sink" /
                                                     "checkpoints").iterdir())) == before
  bad = _run(f"--workdir={workdir / 'other'}", "--runlocal", "--arms=softmax,nope")
  assert bad.returncode == 2 and "Traceback" not in bad.stderr
  assert bad.stderr.strip().splitlines()[-1] == (
      "run.py: error: unknown arm(s) nope; valid arms: softmax, softmax_sink, sigmoid, sparsemax")
  assert not (workdir / "other").exists()
