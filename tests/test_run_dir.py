"""A finished run directory is self-contained: moved elsewhere, with ATTNLAB_DATA_DIR unset, an
empty tokenizer cache and every dataset reader refusing, it still reloads (`load_run`),
translates and generates, with the same outputs as before the move."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import data as data_lib
from attnlab import errors
from attnlab import tasks
from attnlab import train
from attnlab.cli import generate
from attnlab.cli import translate

REPO = pathlib.Path(__file__).resolve().parents[1]


def _train(spec: str, workdir: pathlib.Path, shared_data: pathlib.Path, monkeypatch) -> None:
  monkeypatch.setenv("ATTNLAB_DATA_DIR", str(shared_data))
  config = config_utils.load_config_file(str(REPO / spec))
  config.write_plots = False
  train.train_and_evaluate(config, workdir)


def _without_data(monkeypatch, tmp_path: pathlib.Path) -> list[str]:
  """No data directory, no cached tokenizers, and every dataset read fails as a missing dataset
  does (and is listed in the returned list)."""
  monkeypatch.delenv("ATTNLAB_DATA_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty_cache"))
  reads = []

  def refuse(*args, **kwargs):
    reads.append(f"{args} {kwargs}")
    raise errors.DataError(f"the dataset is gone (read {args})")
  monkeypatch.setattr(data_lib, "get_dataset", refuse)
  monkeypatch.setattr(data_lib, "shakespeare_documents", refuse)
  return reads


def _move(workdir: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
  moved = tmp_path / "elsewhere" / "run"
  moved.parent.mkdir()
  shutil.move(str(workdir), moved)
  return moved


@pytest.mark.slow
def test_translation_run_translates_after_a_move(tmp_path, shared_data, monkeypatch):
  workdir = tmp_path / "marathi"
  _train("configs/seq2seq.py:data.name=marathi,runlocal=True", workdir, shared_data, monkeypatch)
  assert (workdir / "assets" / "source.json").is_file()
  sentences = ["I am happy.", "Where is the house?"]
  before = translate.translate(str(workdir), sentences, output=str(tmp_path / "a.png"))
  run = analysis.load_run(workdir)
  vocab = (run.task.src_tok.tokens, run.task.tgt_tok.tokens, run.task.max_src_len)

  moved = _move(workdir, tmp_path)
  reads = _without_data(monkeypatch, tmp_path)
  after = translate.translate(str(moved), sentences, output=str(tmp_path / "b.png"))
  assert after == before
  run = analysis.load_run(moved)
  assert (run.task.src_tok.tokens, run.task.tgt_tok.tokens, run.task.max_src_len) == vocab
  assert reads == []
  # The start was recorded: versions and the commit of this checkout.
  record = json.loads((moved / "provenance.jsonl").read_text().splitlines()[0])
  assert record["packages"]["jax"] == jax.__version__
  assert "git_commit" in record


@pytest.mark.slow
def test_gpt_run_generates_after_a_move(tmp_path, shared_data, monkeypatch):
  workdir = tmp_path / "gpt"
  _train("configs/gpt.py:runlocal=True", workdir, shared_data, monkeypatch)
  # Sampled (seeded): a barely trained model's greedy choice may be a token that prints nothing.
  options = dict(num_tokens=40, temperature=1.0, seed=3)
  _, before, _ = generate.generate_text(str(workdir), "ROMEO:", **options)

  moved = _move(workdir, tmp_path)
  reads = _without_data(monkeypatch, tmp_path)
  _, after, _ = generate.generate_text(str(moved), "ROMEO:", **options)
  assert after == before and len(after) > 0
  assert reads == []


@pytest.mark.slow
def test_bert_run_reloads_after_a_move_and_old_runs_get_one_line(tmp_path, shared_data,
                                                                 monkeypatch):
  workdir = tmp_path / "bert"
  _train("configs/bert.py:mode=pretrain,runlocal=True", workdir, shared_data, monkeypatch)
  run = analysis.load_run(workdir)
  tokens, leaves = run.task.tokenizer.tokens, jax.tree.leaves(run.params)
  ids = run.task.tokenizer.encode("the king is dead")

  moved = _move(workdir, tmp_path)
  old = tmp_path / "old_run"
  shutil.copytree(moved, old)
  shutil.rmtree(old / "assets")  # as written before runs kept their vocabularies
  with monkeypatch.context() as m:
    reads = _without_data(m, tmp_path)
    run = analysis.load_run(moved)
    assert run.task.tokenizer.tokens == tokens
    assert run.task.tokenizer.encode("the king is dead") == ids
    for a, b in zip(leaves, jax.tree.leaves(run.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert reads == []
    # An old run directory without the data: one line saying why.
    with pytest.raises(errors.UserError, match="predates runs that keep their vocabularies"):
      analysis.load_run(old)

  # With the data back, the old run directory loads and keeps its vocabulary from then on.
  monkeypatch.setenv("ATTNLAB_DATA_DIR", str(shared_data))
  assert analysis.load_run(old).task.tokenizer.tokens == tokens
  assert (old / "assets" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_more_steps_resume_with_the_runs_own_vocabularies_after_a_move(tmp_path, monkeypatch):
  """Training on for more steps (allow_config_change) takes the vocabularies and sizes from the
  run's assets, as load_run does: no tokenizer is rebuilt from the data or a cache (a fine-tuned
  BERT run needed its pretraining corpus for that)."""
  workdir = tmp_path / "dates"
  spec = f"{REPO}/configs/seq2seq.py:runlocal=True,write_plots=False,eval_every=0,log_every=1"
  train.train_and_evaluate(config_utils.load_config_file(f"{spec},num_train_steps=2"), workdir)
  kept = {p.name: p.read_bytes() for p in (workdir / "assets").iterdir()}

  moved = _move(workdir, tmp_path)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty_cache"))
  built = []

  def refuse(self, texts):
    built.append(len(texts))
    raise errors.DataError("the vocabulary was rebuilt from the data")
  monkeypatch.setattr(tasks.get_task("translation"), "_train_tokenizer", refuse)
  more = config_utils.load_config_file(f"{spec},num_train_steps=4,allow_config_change=True")
  state = train.train_and_evaluate(more, moved)
  assert int(state.step) == 4 and built == []
  assert {p.name: p.read_bytes() for p in (moved / "assets").iterdir()} == kept
