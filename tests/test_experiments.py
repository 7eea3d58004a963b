"""Every experiment and benchmark script end to end, as a user runs it (a fresh process).

The studies take minutes to hours (their READMEs hold the figures); here each script trains
seconds-long runlocal runs and must still reload them, analyse, plot and write its tables, and
each benchmark prints its ratio table on its smallest setting. A script that calls the library
the way it used to (an attribute filled lazily since, a renamed function) fails here, not after
an hour-long run. bert_sst2 has its own test (test_bert_study.py).
"""

import importlib.util
import itertools
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, data_dir: pathlib.Path | None = None) -> str:
  """stdout of `python experiments/<script> args` from the repository root; rc must be 0."""
  env = dict(os.environ)
  if data_dir is not None:
    env["ATTNLAB_DATA_DIR"] = str(data_dir)
  proc = subprocess.run([sys.executable, str(REPO / "experiments" / script), *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def _rows(markdown: str) -> list[list[str]]:
  """The cells of every table row of a markdown text (header rows too; separator rows left out)."""
  rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
          for line in markdown.splitlines() if line.startswith("|")]
  return [r for r in rows if not all(re.fullmatch(r"-+", c) for c in r)]


def _pngs(*paths: pathlib.Path) -> None:
  for path in paths:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


pytestmark = pytest.mark.slow


def test_nadaraya_watson(tmp_path):
  out = _run("nadaraya_watson/run.py", f"--workdir={tmp_path}",
             f"--config={REPO / 'configs' / 'nadaraya_watson.py'}:runlocal=True")
  table = [line.split() for line in out.splitlines()]  # kernel, w, test MSE, train LOO MSE
  mse = {cells[0]: float(cells[2]) for cells in table
         if len(cells) == 4 and cells[0] in ("average", "gaussian", "learned")}
  assert set(mse) == {"average", "gaussian", "learned"} and all(map(math.isfinite, mse.values()))
  # Average pooling ignores x: on y = x + sin(x) over [0, 10) any kernel that localises is better.
  assert mse["gaussian"] < mse["average"] and mse["learned"] < mse["average"]
  _pngs(tmp_path / "fit.png", tmp_path / "attention.png")


@pytest.mark.parametrize("script, args, needle", [
    ("nadaraya_watson/run.py", ["--config.nope=1"], "unknown config key 'nope'"),
    ("shakespeare/run.py", ["--config_arg=size=huge"], "unknown GPT size 'huge'"),
    ("analysis/run.py", ["--only=dates_bahdanau", "--train_only", "--arg=nope=1"],
     "unknown config key 'nope'"),
    ("rnn_vs_transformer/run.py", ["--tasks=dates", "--extra=nope=1"], "unknown config key 'nope'"),
    ("long_range/run.py", ["--runlocal", "--mechanisms=full,nope"], "unknown mechanism(s) nope"),
    ("induction_heads/run.py", ["--config_arg=nope=1"], "unknown config key 'nope'"),
    ("marathi/run.py", ["--arms=bahdanau,nope"], "unknown arm(s) nope; valid arms: bahdanau"),
    ("marathi/run.py", ["--arms=all", "--arg=nope=1"], "unknown config key 'nope'"),
    ("induction_heads/mechanisms.py", ["--arms=full,nope"], "unknown arm(s) nope"),
    ("induction_heads/mechanisms.py", ["--config_arg=nope=1"], "unknown config key 'nope'"),
])
def test_bad_input_is_one_line_before_any_run(script, args, needle, tmp_path):
  # A mistyped key or name: one line and status 2, nothing trained (no traceback, no study left
  # to run on after the error).
  proc = subprocess.run([sys.executable, str(REPO / "experiments" / script),
                         f"--workdir={tmp_path / 'out'}", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  last = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode == 2, proc.stderr[-3000:]
  prog = pathlib.Path(script).name
  assert last.startswith(f"{prog}: error: ") and needle in last, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  assert not list((tmp_path / "out").rglob("checkpoints"))


def test_shakespeare(tmp_path, shared_data):
  _run("shakespeare/run.py", f"--workdir={tmp_path}", "--config_arg=runlocal=True",
       f"--data_dir={shared_data}", "--draws=10")
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["final_step"] == 20
  # nanoGPT's sampled estimate and the full-set loss estimate one number.
  assert summary["nanogpt_style_estimates"]["draws"] == 10
  assert abs(summary["nanogpt_style_estimates"]["mean"] - summary["val_loss"]) < 0.1
  assert summary["sample"].startswith("ROMEO:") and len(summary["sample"]) > len("ROMEO:")
  _pngs(tmp_path / "loss_curve.png", tmp_path / "attention.png")


def test_dates(tmp_path):
  _run("dates/run.py", f"--workdir={tmp_path}", "--seeds=0", "--arg=runlocal=True")
  seed_row = next(r for r in _rows((tmp_path / "results.md").read_text()) if r[0] == "0")
  assert seed_row[1] == "20" and 0 <= float(seed_row[4]) <= 100  # steps, test BLEU
  _pngs(*(tmp_path / "figures" / f"dates_{i}.png" for i in range(6)))


def test_marathi(tmp_path, shared_data):
  _run("marathi/run.py", f"--workdir={tmp_path}", "--seeds=0", "--arg=runlocal=True",
       "--beam_size=2", data_dir=shared_data)
  text = (tmp_path / "results.md").read_text()
  seed_row = next(r for r in _rows(text) if r[0] == "0")
  assert seed_row[1] == "20" and int(seed_row[2]) > 0 and math.isfinite(float(seed_row[3]))
  # Sample translations: test sentences with their references, then the extra sentence without.
  samples = [r for r in _rows(text) if len(r) == 3 and r[0] != "English"]
  assert len(samples) >= 2 and all(r[2] for r in samples)
  assert samples[-1][:2] == ["Rahul is a good boy.", ""]
  _pngs(*(tmp_path / "figures" / f"marathi_{i}.png" for i in range(6)))  # 5 test + Rahul


def test_marathi_arms(tmp_path, shared_data):
  import sacrebleu  # pylint: disable=g-import-not-at-top
  arms, seeds = ("bahdanau", "none"), ("0", "1")
  args = (f"--workdir={tmp_path}", f"--arms={','.join(arms)}", f"--seeds={','.join(seeds)}",
          "--arg=runlocal=True", "--beam_size=2", "--beam_rows=6", "--vmap")
  _run("marathi/run.py", *args, data_dir=shared_data)
  results = json.loads((tmp_path / "results.json").read_text())["arms"]
  assert list(results) == list(arms)
  table = {r[0]: r for r in _rows((tmp_path / "results.md").read_text()) if len(r) == 12}
  for arm in arms:
    per_seed = results[arm]["per_seed"]
    assert sorted(per_seed) == list(seeds) and results[arm]["status"] == "done"
    # Two seeds trained as one vmapped run (bucketed batches of different widths stacked).
    assert (tmp_path / arm / "seed=0" / "checkpoints").is_dir()
    assert not (tmp_path / arm / "seed=1").exists()
    for seed in seeds:
      # Each BLEU is sacrebleu's corpus BLEU of the decoded outputs saved beside it.
      decoded = json.loads((tmp_path / arm / f"decoded_seed={seed}.json").read_text())
      bleu = lambda hyp, ref: sacrebleu.corpus_bleu(hyp, [ref], tokenize="none", force=True).score
      greedy, beam = decoded["greedy"], decoded["beam"]
      assert len(greedy["hyp"]) == per_seed[seed]["test_pairs"] > 6 == len(beam["hyp"])
      assert bleu(greedy["hyp"], greedy["ref"]) == pytest.approx(per_seed[seed]["bleu_greedy"])
      assert bleu(beam["hyp"], beam["ref"]) == pytest.approx(per_seed[seed]["bleu_beam"])
      # Beam decoded the sampled rows of the split; greedy is scored on the same sample too.
      rows = beam["rows"]
      assert beam["ref"] == [greedy["ref"][i] for i in rows]
      assert bleu([greedy["hyp"][i] for i in rows], beam["ref"]) == pytest.approx(
          per_seed[seed]["bleu_greedy_sample"])
    # The table's cells: mean ± sample std over the seeds, from the per-seed values.
    for column, key, digits in ((3, "test_ce", 3), (4, "bleu_greedy", 2), (5, "bleu_beam", 2)):
      values = [per_seed[s][key] for s in seeds]
      assert table[arm][column] == (f"{np.mean(values):.{digits}f} ± "
                                    f"{np.std(values, ddof=1):.{digits}f}"), (arm, key)
    assert table[arm][1] == "2" and table[arm][2] == "20"  # seeds, steps (runlocal)
  assert results["bahdanau"]["setting"]["spec"] == "task=marathi,mesh.cpu_devices=1,runlocal=True"
  assert results["none"]["setting"]["spec"] == ("task=marathi,mesh.cpu_devices=1,attention=none,"
                                                "runlocal=True")
  _pngs(tmp_path / "arms.png")
  # A second call finds everything done: nothing is trained or decoded again.
  before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("decoded_seed=*.json")}
  out = _run("marathi/run.py", *args, data_dir=shared_data)
  assert "decoding the test split" not in out
  assert before == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("decoded_seed=*.json")}
  # --report_only rewrites the same table from the cache alone.
  table = (tmp_path / "results.md").read_text()
  (tmp_path / "results.md").unlink()
  _run("marathi/run.py", *args, "--report_only", data_dir=shared_data)
  assert (tmp_path / "results.md").read_text() == table


def test_bottleneck(tmp_path):
  _run("bottleneck/run.py", f"--workdir={tmp_path}", "--seeds=0", "--max_len=10",
       "--arg=runlocal=True")
  rows = _rows((tmp_path / "results.md").read_text())
  assert rows[0][1:] == ["exact match, attention=none", "exact match, attention=bahdanau"]
  assert [r[0] for r in rows[1:3]] == ["1-5", "6-10"]
  assert all(0 <= float(x) <= 1 for r in rows[1:3] for x in r[1:])
  _pngs(tmp_path / "bottleneck.png")


def test_score_functions(tmp_path):
  _run("score_functions/run.py", f"--workdir={tmp_path}", "--datasets=dates",
       "--scores=dot,additive", "--seeds=0", "--dates_arg=runlocal=True")
  rows = {r[0]: r for r in _rows((tmp_path / "results.md").read_text())}
  assert {"dot", "additive"} <= set(rows)
  assert all(math.isfinite(float(rows[s][4])) for s in ("dot", "additive"))  # validation CE
  _pngs(*(tmp_path / "figures" / f"dates_{score}.png" for score in ("dot", "additive")))


def test_rnn_vs_transformer(tmp_path):
  _run("rnn_vs_transformer/run.py", f"--workdir={tmp_path}", "--tasks=reverse", "--seeds=0",
       "--steps=20", "--extra=runlocal=True")
  rows = [r for r in _rows((tmp_path / "results.md").read_text()) if r[0] == "reverse"]
  assert [r[1] for r in rows] == ["rnn (seed 0)", "transformer (seed 0)", "rnn_none (seed 0)"]
  assert all(r[3] == "20" and int(r[2].replace(",", "")) > 0 for r in rows)  # steps, parameters
  _pngs(tmp_path / "reverse_by_length.png")


def test_induction_heads(tmp_path, shared_data):
  args = (f"--workdir={tmp_path}", "--steps=20", "--every=10", "--seeds=2",
          "--config_arg=data.num_train=200", "--shakespeare_steps=5", f"--data_dir={shared_data}")
  _run("induction_heads/run.py", *args)
  summary = json.loads((tmp_path / "results.json").read_text())
  arms = summary["arms"]
  assert set(arms) == {"layers2", "layers1"}
  for name, arm in arms.items():
    layers = int(name[-1])
    assert arm["seeds"] == [0, 1] and sorted(arm["rows"], key=int) == ["10", "20"]
    for rows in arm["rows"].values():
      assert len(rows) == 2
      for row in rows:
        # The trainer's evaluation (metrics.jsonl, per seed) and the script's own forward pass
        # on the same validation sequences give one copy loss.
        assert row["copy_loss"] == pytest.approx(row["copy_loss_here"], rel=1e-4)
        assert np.asarray(row["induction"]).shape == (layers, 4)
        assert ("k_composition" in row) == (layers == 2)
    for c in arm["controls"]:
      assert np.asarray(c["copy_loss_ablated"]).shape == (layers, 4)
      assert np.asarray(c["copy_loss_patched"]).shape == (layers, 4)
      # Near-untrained heads: zeroing one moves the copy loss little; all values are losses.
      assert np.all(np.abs(np.asarray(c["copy_loss_ablated"]) - c["copy_loss_clean"]) < 0.1)
  # The composition baseline: ||A B||_F / (||A||_F ||B||_F) for A = V O^T, B = Q K^T of i.i.d.
  # Gaussian [64, 16] factors, estimated here by its own draws.
  rng = np.random.default_rng(0)
  draws = []
  for _ in range(100):
    v, o, q, k = rng.standard_normal((4, 64, 16))
    a, b = v @ o.T, q @ k.T
    draws.append(np.linalg.norm(a @ b) / (np.linalg.norm(a) * np.linalg.norm(b)))
  assert summary["composition_baseline"] == pytest.approx(np.mean(draws), rel=0.05)
  # The nano GPT on Shakespeare: per-head scores on random and on text ids, each head ablated.
  nano = summary["shakespeare"]
  assert nano["steps"] == 5 and math.isfinite(nano["val_loss"])
  for key in ("induction", "previous_token", "text_induction", "repeat_loss_second_half_ablated"):
    assert np.asarray(nano[key]).shape == (4, 4), key
  assert len(_rows((tmp_path / "results.md").read_text())) == 2 * 3 + 5 + 5 + 9 + 5 + 5
  _pngs(tmp_path / "induction_heads.png", tmp_path / "controls.png")
  # Run again: both arms are finished, so nothing trains (the checkpoints stay as they were).
  before = sorted(p.name for p in (tmp_path / "layers2").rglob("*"))
  again = _run("induction_heads/run.py", *args)
  assert "layers2: done" in again and "layers1: done" in again
  assert "shakespeare: training" not in again
  assert sorted(p.name for p in (tmp_path / "layers2").rglob("*")) == before


def test_induction_mechanisms(tmp_path):
  # Two arms of experiments/mechanisms on the induction study's model, 20 steps, 2 seeds. The
  # table's cells are recomputed from the saved per-seed rows; linear attention's induction
  # scores, read from the matrix it forms only when asked, are recomputed in NumPy from its
  # queries and keys. ln 64 = 4.1589: 20 steps leave the copy loss about there, so this threshold
  # may or may not be crossed, and the recomputation covers either case.
  threshold = 4.159
  args = (f"--workdir={tmp_path}", "--arms=full,linear", "--steps=20", "--every=10", "--seeds=2",
          "--config_arg=data.num_train=200", f"--threshold={threshold}")
  _run("induction_heads/mechanisms.py", *args)
  results = json.loads((tmp_path / "results.json").read_text())
  assert list(results["arms"]) == ["full", "linear"]
  table = {r[0]: r for r in _rows((tmp_path / "results.md").read_text()) if len(r) == 10}
  fmt = lambda xs: f"{np.mean(xs):.2f} ± {np.std(xs):.2f}"
  for name, arm in results["arms"].items():
    steps = sorted(arm["rows"], key=int)
    assert steps == ["10", "20"] and arm["seeds"] == [0, 1]
    final = arm["rows"]["20"]
    copy = np.array([[r["copy_loss_here"] for r in arm["rows"][s]] for s in steps])  # [steps, 2]
    below = copy < threshold
    when = " / ".join(steps[int(np.argmax(below[:, i]))] if below[:, i].any() else "none"
                      for i in range(2))
    row = table[name]
    assert row[2] == ("none by 20" if not below.any() else when)
    assert row[3] == fmt(copy[-1])
    assert row[4] == fmt([np.max(r["previous_token"][0]) for r in final])
    assert row[5] == fmt([np.max(r["induction"][1]) for r in final])
    assert row[6] == fmt([np.max(r["induction_near"][1]) for r in final])
    rise = [np.max(np.asarray(a["copy_loss_ablated"][1]) - a["copy_loss_clean"])
            for a in arm["ablation"]]
    assert row[8].startswith(fmt(rise) + " (")
    for a, r in zip(arm["ablation"], final):
      # The ablation's clean forward pass and measure()'s give one copy loss.
      assert a["copy_loss_clean"] == pytest.approx(r["copy_loss_here"], rel=1e-4)
      assert np.asarray(a["copy_loss_ablated"]).shape == (2, 4)
  assert results["arms"]["full"]["ablation"][0]["pattern_note"] is None
  assert "'linear'" in results["arms"]["linear"]["ablation"][0]["pattern_note"]
  # Linear attention's implicit matrix, A_qk = phi(q)·phi(k) / sum over k' <= q, phi = elu + 1,
  # on the detectors' input (32 random ids in [1, 64) repeated twice, 16 rows, seed 0); the
  # induction score is the mean of A[q, q - 31] over the second half's queries.
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  run = analysis.load_run(tmp_path / "linear", 20, replica=0)
  half = np.random.default_rng(0).integers(1, 64, (16, 32), dtype=np.int32)
  tokens = np.concatenate([half, half], axis=1)
  _, cache = analysis.run_with_cache(run, tokens, ["blocks.1.attn.q", "blocks.1.attn.k"])
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
  q, k = (phi(np.asarray(cache[f"blocks.1.attn.{s}"], np.float64)) for s in "qk")
  a = np.einsum("bhqd,bhkd->bhqk", q, k) * np.tril(np.ones((64, 64)))
  a /= a.sum(-1, keepdims=True)
  queries = np.arange(32, 64)
  expected = a[:, :, queries, queries - 31].mean(axis=(0, 2))  # [heads]
  assert np.allclose(results["arms"]["linear"]["rows"]["20"][0]["induction"][1], expected,
                     atol=2e-4)
  _pngs(tmp_path / "mechanisms.png")
  # Run again: both arms are finished, so nothing trains.
  again = _run("induction_heads/mechanisms.py", *args)
  assert "full: done" in again and "linear: done" in again


def test_analysis(tmp_path, shared_data):
  # Six of its nine runs (GPT, BERT pretraining and fine-tuning, the three reverse-task models;
  # the dates models share their code) at 20 steps each, without the runs' own plots (each
  # model's tests check those; all nine took 51-66 s).
  out = tmp_path / "out"
  reverse = [f"reverse_{model}" for model in ("bahdanau", "luong", "transformer")]
  _run("analysis/run.py", f"--workdir={tmp_path / 'runs'}", f"--out={out}",
       f"--only=gpt_shakespeare,bert_pretrain,bert_sst2,{','.join(reverse)}",
       "--arg=runlocal=True,num_train_steps=20,write_plots=False", "--num_examples=20",
       f"--data_dir={shared_data}")
  results = json.loads((out / "results.json").read_text())
  assert set(results["alignment"]) == set(reverse)
  assert set(results["ablation"]) == {"gpt_shakespeare", "bert_sst2", "reverse_transformer"}
  assert set(results["views"]) == {"gpt_shakespeare", "bert_sst2", "reverse_transformer"}
  assert all(0 <= r["best"]["accuracy"] <= 1 for r in results["alignment"].values())
  # 20 steps leave the GPT's causal attention near uniform: row i spreads over positions 0..i,
  # whose mean distance to i is i / 2 (NumPy below), and the entropy is near its maximum.
  gpt = results["entropy"]["gpt_shakespeare"]
  uniform_offset = np.mean(np.arange(64) / 2)
  assert np.allclose(gpt["mean_abs_offset"], uniform_offset, atol=1.0)
  assert np.min(gpt["normalized_entropy"]) > 0.95
  _pngs(out / "figures" / "entropy.png", out / "figures" / "alignment_by_length.png",
        *(out / "figures" / f"ablation_{name}.png" for name in results["ablation"]))
  for view in results["views"].values():
    page = (out / "figures" / view["file"]).read_bytes()
    assert page.lower().startswith(b"<!doctype html") and len(page) == view["bytes"]


# ---------------------------------------------------------------------------------------------------
# The benchmark scripts (experiments/benchmarks), on their smallest settings: the tables they print.

SHARED = REPO.parent / "shared"


def _needs_torch() -> None:
  if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed; its CPU build: pip install torch==2.13.0 (as .ci/run)")


def _table(out: str, *header: str) -> dict[str, list[str]]:
  """Rows of the printed table whose header starts with the cells `header`, keyed by their first
  cell."""
  lines = out.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("|") and
               [c.strip() for c in line.split("|")[1:len(header) + 1]] == list(header))
  rows = _rows("\n".join(itertools.takewhile(lambda l: l.startswith("|"), lines[start + 1:])))
  return {r[0]: r for r in rows}


def test_attention_benchmark():
  out = _run("benchmarks/attention.py", "--quick", "--impls=reference,blocked")
  memory = _table(out, "S", "blocked peak MiB")
  # The blocked kernel's memory grows linearly with S, the reference path's quadratically.
  assert float(memory["512"][2].rstrip("x")) < 2.5 < float(memory["512"][5].rstrip("x"))


def test_padded_attention_benchmark():
  out = _run("benchmarks/padded_attention.py", "--seq=96", "--batch=2", "--heads=2",
             "--head-dim=8", "--reps=1")
  rows = [r for r in _rows(out) if r[0] == "96"]
  assert [r[1] for r in rows] == ["fwd", "fwd+bwd"]
  assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


def test_attention_benchmark_matmul_floor():
  """The `matmuls` contender computes (q kᵀ / sqrt(d)) v over the key range each query tile of
  the kernel visits: all keys without a mask, up to the end of the diagonal tile with one."""
  spec = importlib.util.spec_from_file_location(
      "attention_benchmark", REPO / "experiments" / "benchmarks" / "attention.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  rng = np.random.default_rng(3)
  s, d, tile = 768, 8, 512  # ONE_DEVICE_TILES: 512-row query tiles, 512 x 512 causal tiles
  q, k, v = (rng.standard_normal((1, 2, s, d)).astype(np.float32) for _ in range(3))
  scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(d)
  dense = np.asarray(bench._matmul_floor(False)(q, k, v))
  np.testing.assert_allclose(dense, scores @ v, rtol=1e-4, atol=1e-3)
  causal = np.asarray(bench._matmul_floor(True)(q, k, v))
  first = scores[..., :tile, :tile] @ v[..., :tile, :]  # tile 0 sees keys [0, 512)
  second = scores[..., tile:, :] @ v  # tile 1 (rows 512..767) sees keys [0, 1024) -> all 768
  np.testing.assert_allclose(causal, np.concatenate([first, second], axis=-2), rtol=1e-4,
                             atol=1e-3)


def test_dp_step_benchmark(shared_data):
  out = _run("benchmarks/dp_step.py", "--positions=learned", "--rounds=3", "--chunk=1",
             f"--data_dir={shared_data}")
  row = _table(out, "position")["learned"]
  assert float(row[3].strip("*x")) > 0
  per_device, split = (int(n) for n in row[4].split(" / "))
  assert per_device < split  # one all-reduce of the gradients against the compiler's several
  loss_a, loss_b = (float(x) for x in row[5].split(" / "))
  assert abs(loss_a - loss_b) < 1e-3  # the same step either way


def test_step_profile_benchmark():
  """step_profile.py times the trainer's step; with --loops, rounds of its loop beside the
  trainer's; with --profile, lists XLA:CPU's events per step (the fusions the compiled step runs
  among them), largest first."""
  out = _run("benchmarks/step_profile.py", "--steps=3", "--warmup=1", "--profile", "--loops=2",
             "--arg=size=nano,dataset=synthetic_tokens,data.vocab_size=65,runlocal=True")
  assert re.search(r"^jax \S+, \d+ device\(s\)", out, re.M), out
  median = float(re.search(r"^median step ([\d.]+) ms \(3 steps\)", out, re.M).group(1))
  assert median > 0
  rounds = re.findall(r"^\s+(\d)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
  assert [r for r, *_ in rounds] == ["1", "2"] and all(float(v) > 0 for _, *vs in rounds
                                                        for v in vs), out
  assert re.search(r"^median\s+[\d.]+\s+[\d.]+\s+\(trainer's / sync: [\d.]+\)$", out, re.M), out
  events = re.findall(r"^\s*([\d.]+)\s+([\d.]+)\s+(\S+)\s+(.+)$",
                      out.split("ms/step calls/step")[1], re.M)
  assert events and any("fusion" in name for *_, name in events), out
  per_step = [float(ms) for ms, *_ in events]
  assert per_step == sorted(per_step, reverse=True) and per_step[0] > 0


def test_gpt_train_benchmark(shared_data):
  _needs_torch()
  out = _run("benchmarks/gpt_train.py", "--rounds=1", "--steps=3", "--gen_tokens=0",
             "--twin_steps=0", f"--data_dir={shared_data}")
  rows = _table(out, "implementation")
  assert set(rows) == {"attnlab", "pytorch"}
  assert all(float(r[1].split()[0]) > 0 for r in rows.values())  # ms/step


def test_gpt_vs_nanogpt_benchmark(shared_data, tmp_path):
  _needs_torch()
  if not (SHARED / "anchors" / "nanogpt").is_dir():
    pytest.skip(f"{SHARED / 'anchors' / 'nanogpt'} not found: nanoGPT's export beside the repo")
  out = _run("benchmarks/gpt_vs_nanogpt.py", "--rounds=1", "--iters=4", "--skip=1",
             "--wall_steps=0", "--contenders=nanogpt,learned", f"--data_dir={shared_data}",
             f"--scratch={tmp_path}")
  rows = list(_table(out, "contender").values())
  assert [r[0].split()[0] for r in rows] == ["nanoGPT", "attnlab"]
  assert rows[0][3] == "1.00x" and float(rows[1][3].strip("*x")) > 0
  # Wall time alone (--rounds=0): each run's seconds and final validation loss, no timing table;
  # two rounds, the second in the reverse order, and the per-round ratios' median.
  out = _run("benchmarks/gpt_vs_nanogpt.py", "--rounds=0", "--wall_steps=2", "--wall_rounds=2",
             "--contenders=nanogpt,learned", f"--data_dir={shared_data}", f"--scratch={tmp_path}")
  assert "ms per iteration" not in out
  rows = list(_table(out, "contender").values())
  assert [(r[0].split()[0], r[0].split()[-1]) for r in rows] == [
      ("nanoGPT", "1"), ("attnlab", "1"), ("attnlab", "2"), ("nanoGPT", "2")]
  # wall s and final val loss; attnlab's first log line and first step (nanoGPT logs neither: -)
  assert all(float(r[1]) > 0 and float(r[4]) > 0 for r in rows)
  for nano, ours in ((rows[0], rows[1]), (rows[3], rows[2])):
    assert nano[2:4] == ["-", "-"] and 0 < float(ours[2]) < float(ours[3]) < float(ours[1])
  ratios = [float(rows[0][1]) / float(rows[1][1]), float(rows[3][1]) / float(rows[2][1])]
  line, = [l for l in out.splitlines() if l.startswith("whole-run ratio nanogpt s / learned s")]
  # (the table's seconds are rounded to 0.1 s: ratios of ~10 s runs agree to about 0.01)
  assert abs(float(line.rsplit("**", 2)[1].rstrip("x")) - np.median(ratios)) < 0.02, line


def test_gpu_benchmark_smoke(tmp_path):
  """benchmarks/gpu.py end to end on its CPU setting (tiny model, S=128): both tables."""
  _needs_torch()
  if not (SHARED / "anchors" / "nanogpt").is_dir():
    pytest.skip(f"{SHARED / 'anchors' / 'nanogpt'} not found: nanoGPT's export beside the repo")
  out = _run("benchmarks/gpu.py", "--smoke", "--impls=xla,torch", f"--scratch={tmp_path}")
  assert out.startswith("uptime before:") and "uptime after:" in out
  train_rows = _table(out, "contender", "ms/iter (rounds)")
  assert set(train_rows) == {"attnlab:auto", "nanogpt"}
  assert all(float(r[2].replace(",", "")) > 0 for r in train_rows.values())  # tokens/s
  assert train_rows["nanogpt"][4] == "1.00x" and float(train_rows["attnlab:auto"][4][:-1]) > 0
  attention = [r for r in _rows(out) if r[0] == "128"]
  assert [r[1] for r in attention] == ["xla", "torch"]
  assert attention[1][4] == "1.00x" and float(attention[0][4][:-1]) > 0
  assert all(float(r[5]) < 0.05 for r in attention)  # bfloat16 context vs the float64 formula


def test_seeds_benchmark():
  out = _run("benchmarks/seeds.py", "--configs=gpt", "--seeds=2", "--steps=2")
  row = _table(out, "config")["gpt"]
  assert row[1] == "2" and float(row[4]) > 0  # N, ratio


def test_mechanisms(tmp_path, shared_data):
  workdir = tmp_path / "mech"
  args = ("mechanisms/run.py", f"--workdir={workdir}", "--runlocal",
          "--arms=alibi,learned,bert_linformer", f"--data_dir={shared_data}")
  _run(*args)
  rows = {r[0]: r for r in _rows((workdir / "results.md").read_text())}
  assert {"alibi", "learned", "bert_linformer"} <= set(rows)
  assert all(rows[a][2] == "20" for a in ("alibi", "learned", "bert_linformer"))  # steps
  assert rows["learned"][4].startswith("n/a (")  # no loss at 2x the length for a learned table
  assert " ± " in rows["alibi"][3] and " ± " in rows["alibi"][4]
  assert 0 <= float(rows["bert_linformer"][3].split(" ± ")[0]) <= 1  # MLM accuracy
  _pngs(workdir / "results.png")
  results = json.loads((workdir / "results.json").read_text())
  alibi = results["arms"]["alibi"]
  assert len(alibi["per_seed"]) == 3 and alibi["steps"] == alibi["num_train_steps"] == 20
  # The loss at twice the training length, seed 0, recomputed here: the first 8 non-overlapping
  # windows of 2 x block tokens of the validation text, cross-entropy from the logits in NumPy.
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  run = analysis.load_run(workdir / alibi["run_dir"], replica=0)
  length, ids = 2 * run.task.block_size, np.asarray(run.task.validation_ids())
  x = np.stack([ids[i * length:(i + 1) * length] for i in range(8)])
  y = np.stack([ids[i * length + 1:(i + 1) * length + 1] for i in range(8)])
  logits = np.asarray(run.task.model.apply({"params": run.params}, x), np.float64)
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  ce = log_z - np.take_along_axis(logits, y[..., None], -1)[..., 0]
  assert abs(ce.mean() - alibi["extrapolation"][0]) < 1e-4
  # Resumable: a second invocation skips the finished arm and keeps its figures.
  _run("mechanisms/run.py", f"--workdir={workdir}", "--runlocal", "--arms=learned",
       f"--data_dir={shared_data}")
  again = json.loads((workdir / "results.json").read_text())["arms"]
  assert again["learned"]["status"] == "skipped" and set(again) == set(results["arms"])
  assert again["learned"]["per_seed"] == results["arms"]["learned"]["per_seed"]
  # Arms of a family whose settings changed are dropped; the other family's arms stay listed.
  stale = json.loads((workdir / "results.json").read_text())
  stale["bert_spec"] += ",num_train_steps=7"
  (workdir / "results.json").write_text(json.dumps(stale))
  _run("mechanisms/run.py", f"--workdir={workdir}", "--runlocal", "--arms=learned",
       f"--data_dir={shared_data}")
  kept = json.loads((workdir / "results.json").read_text())["arms"]
  assert set(kept) == {"alibi", "learned"}
