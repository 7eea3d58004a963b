"""The translation task (attnlab/tasks/translation.py), configs/seq2seq.py and `attnlab translate`."""

import json
import pathlib

import jax
import numpy as np
import pytest

from attnlab import config_utils
from attnlab.cli import train as train_cli
from attnlab.cli import translate as translate_cli
from attnlab.tasks import translation

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "seq2seq.py")


def _config(arg: str):
  return config_utils.load_config_file(f"{CONFIG}:{arg}")


def _eval_records(workdir: pathlib.Path) -> list[dict]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [r for r in map(json.loads, lines) if r["split"] == "eval"]


# ------------------------------------------------------------------------------ config


def test_dataset_presets_and_shorthand():
  marathi = _config("task=marathi")
  assert marathi.task == "translation" and marathi.data.name == "marathi"
  assert marathi.data.tokenizer == "word"
  reverse = _config("data.name=reverse,data.max_len=7,runlocal=True")
  assert reverse.data.max_len == 7 and reverse.num_train_steps == 20
  assert reverse.model.hidden_dim == 16  # runlocal shrinks the model


@pytest.mark.parametrize("arg,words", [
    ("data.name=klingon", ["data.name", "dates", "marathi", "reverse", "copy"]),
    ("model.scor=dot", ["model.score"]),
])
def test_config_errors_name_the_valid_choices(arg, words):
  with pytest.raises(config_utils.ConfigError) as info:
    _config(arg)
  for word in words:
    assert word in str(info.value)


def test_unknown_model_choice_is_a_config_error():
  # The score name is checked once, where the config is read.
  with pytest.raises(config_utils.ConfigError, match="additive"):
    config_utils.validate(_config("runlocal=True,model.score=mlp"))
  with pytest.raises(config_utils.ConfigError, match="seq2seq"):
    translation.TranslationTask(_config("runlocal=True,model.name=nosuchmodel"))


def test_separate_punctuation():
  assert translation.separate_punctuation('He said, "go!"') == 'He said , " go ! "'
  assert translation.separate_punctuation("मी तुला देईन.") == "मी तुला देईन ."


# ------------------------------------------------------------------------------ loss and metrics


@pytest.fixture(scope="module")
def dates_task():
  task = translation.TranslationTask(_config("runlocal=True,data.num_eval=8,"
                                             "data.eval_batch_size=8"))
  params = task.init(jax.random.key(0))
  return task, params


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_is_padding_masked_cross_entropy(dates_task):
  task, params = dates_task
  batch = next(iter(task.train_iterator()))
  loss_fn = jax.jit(lambda p, b: task.loss_fn(p, b, None))
  loss, metrics = loss_fn(params, batch)
  apply = jax.jit(lambda p, b: task.model.apply({"params": p}, b["source"], b["source_length"],
                                                b["target"][:, :-1]))
  logits, _ = apply(params, batch)
  logp = _np_log_softmax(np.asarray(logits, np.float64))
  target, mask = batch["target"][:, 1:], batch["target_mask"][:, 1:]
  nll = -np.take_along_axis(logp, target[..., None], -1)[..., 0]
  np.testing.assert_allclose(loss, (nll * mask).sum() / mask.sum(), rtol=1e-5)
  pred = np.asarray(logits).argmax(-1)
  np.testing.assert_allclose(metrics["token_accuracy"],
                             ((pred == target) & mask).sum() / mask.sum(), rtol=1e-6)
  # Tokens at padded target positions change nothing.
  noisy = dict(batch)
  noisy["target"] = np.where(batch["target_mask"], batch["target"], 5).astype(np.int32)
  loss2, _ = loss_fn(params, noisy)
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)


def test_decoded_metrics_against_the_references(dates_task, monkeypatch):
  """Exact match, token accuracy and BLEU of known outputs (decoding replaced by the references)."""
  task, params = dates_task
  arrays = task._eval_arrays("validation")
  refs = arrays["target"][:, 1:]  # the reference ids after <start>, <end> included
  # Example 0 gets one wrong character; the others are decoded perfectly.
  outputs = refs.copy()
  wrong = task.tgt_tok.encode("9")[0] if refs[0, 0] != task.tgt_tok.encode("9")[0] \
      else task.tgt_tok.encode("8")[0]
  outputs[0, 0] = wrong
  n = len(task.examples("validation"))

  def fake_decode(params, src, src_len, beam_size=None, max_len=None, batch_size=None):
    width = max_len or task._max_decode_len()
    out = np.zeros((len(src), width), np.int32)
    out[:, :refs.shape[1]] = outputs[:len(src), :width]
    return out, np.zeros((len(src), width, src.shape[1]), np.float32)

  monkeypatch.setattr(task, "decode_arrays", fake_decode)
  metrics, records = task.evaluate_split(params)
  assert len(records) == n
  assert metrics["exact_match"] == pytest.approx((n - 1) / n)
  ref_len = int(arrays["target_length"][0]) - 2  # characters without <start>/<end>
  expected = ((ref_len - 1) / ref_len + (n - 1)) / n
  assert metrics["decoded_token_accuracy"] == pytest.approx(expected)
  # BLEU over characters: 100 for perfect output, below 100 with one wrong character.
  assert 0 < metrics["bleu"] < 100
  assert records[1]["output"] == records[1]["reference"]
  assert np.isfinite(metrics["loss"])


def test_evaluate_split_on_rows_is_those_rows_of_the_whole_split(dates_task):
  """`rows`: the records of those examples, as the whole split's evaluation gives them (greedy
  decoding reads each row alone), and metrics over them only (CE from NumPy per row)."""
  task, params = dates_task
  whole, records = task.evaluate_split(params, beam_size=1)
  rows = [5, 1, 6]
  part, picked = task.evaluate_split(params, beam_size=1, rows=rows)
  assert [r["output"] for r in picked] == [records[i]["output"] for i in rows]
  assert [r["reference"] for r in picked] == [records[i]["reference"] for i in rows]
  assert part["exact_match"] == pytest.approx(np.mean([records[i]["exact"] for i in rows]))
  # Teacher-forced CE over the rows' target tokens (one batch: a token mean), from the logits.
  arrays = task._eval_arrays("validation")
  src, src_len, tgt = (arrays[k][rows] for k in ("source", "source_length", "target"))
  logits, _ = task.model.apply({"params": params}, src, src_len, tgt[:, :-1])
  logp = _np_log_softmax(np.asarray(logits, np.float64))
  nll = -np.take_along_axis(logp, tgt[:, 1:, None], -1)[..., 0]  # [3, t]
  valid = arrays["target_mask"][rows, 1:]
  assert part["ce"] == pytest.approx((nll * valid).sum() / valid.sum(), rel=1e-4)
  assert part["ce"] != pytest.approx(whole["ce"], rel=1e-4)  # not the whole split's
  with pytest.raises(ValueError, match="rows must be"):
    task.evaluate_split(params, rows=[len(records)])


# ------------------------------------------------------------------------------ end to end


def _train(workdir: pathlib.Path, arg: str) -> int:
  return train_cli.main(["attnlab train", f"--config={CONFIG}:{arg}", f"--workdir={workdir}"])


@pytest.mark.slow
def test_dates_runlocal_end_to_end_and_translate(tmp_path, capsys):
  workdir = tmp_path / "dates"
  arg = "runlocal=True,num_train_steps=8,eval_every=0,data.length_bins=(12,40)"
  assert _train(workdir, arg) == 0
  [record] = _eval_records(workdir)
  for name in ("loss", "exact_match", "bleu", "token_accuracy", "exact_match_len_01_12",
               "bleu_len_13_40"):
    assert np.isfinite(record[name]), name
  assert sorted(p.name for p in workdir.glob("attention_*.png")) == [
      f"attention_{i}.png" for i in range(translation.NUM_PLOTS)]
  capsys.readouterr()
  png = tmp_path / "align.png"
  assert translate_cli.main(["attnlab translate", f"--workdir={workdir}", f"--output={png}",
                             "9 october 1993"]) == 0
  assert len(capsys.readouterr().out.strip().splitlines()) == 1
  assert png.is_file() and png.stat().st_size > 0
  # Errors: one line and a non-zero status.
  assert translate_cli.main(["attnlab translate", f"--workdir={tmp_path / 'none'}", "x"]) == 2
  assert translate_cli.main(["attnlab translate", f"--workdir={workdir}"]) == 2
  assert "error" in capsys.readouterr().err


@pytest.mark.slow
def test_dates_runlocal_local_m_trains_and_plots(tmp_path):
  """model.window=local_m (Luong's monotonic window) trains, evaluates and plots like local-p."""
  workdir = tmp_path / "dates_local_m"
  arg = ("runlocal=True,num_train_steps=6,eval_every=0,data.length_bins=(12,40),"
         "attention=luong,score=general,model.window=local_m")
  assert _train(workdir, arg) == 0
  [record] = _eval_records(workdir)
  assert np.isfinite(record["loss"]) and np.isfinite(record["bleu"])
  assert json.loads((workdir / "config.json").read_text())["model"]["window"] == "local_m"
  assert len(list(workdir.glob("attention_*.png"))) == translation.NUM_PLOTS


@pytest.mark.slow
def test_reverse_runlocal_without_attention(tmp_path):
  workdir = tmp_path / "reverse"
  arg = ("runlocal=True,num_train_steps=4,eval_every=0,data.name=reverse,data.max_len=6,"
         "model.attention=none")
  assert _train(workdir, arg) == 0
  [record] = _eval_records(workdir)
  assert np.isfinite(record["loss"]) and 0 <= record["exact_match"] <= 1
  assert not list(workdir.glob("attention_*.png"))  # nothing to plot without attention


@pytest.mark.slow
def test_marathi_runlocal_on_shared_data(tmp_path, shared_data):
  workdir = tmp_path / "marathi"
  arg = (f"runlocal=True,num_train_steps=4,eval_every=0,task=marathi,model.attention=luong,"
         f"model.score=general,data.manual_dir={shared_data},data.data_dir={tmp_path / 'tfds'},"
         f"write_plots=False,data.buckets=()")
  assert _train(workdir, arg) == 0
  [record] = _eval_records(workdir)
  assert np.isfinite(record["loss"]) and np.isfinite(record["bleu"])


def test_marathi_subword_tokenizer(tmp_path, shared_data):
  task = translation.TranslationTask(_config(
      f"task=marathi,runlocal=True,data.tokenizer=subword,data.tokenizer_size=300,"
      f"data.num_train=2000,data.manual_dir={shared_data},data.data_dir={tmp_path / 'tfds'}"))
  assert len(task.src_tok) == len(task.tgt_tok) == 300
  target = task.examples("train")[0]["target"]
  ids = task.tgt_tok.encode(target, add_start=True, add_end=True)
  assert task.tgt_tok.decode(ids) == target  # the task's references decode back exactly
  assert task._bleu([target], [task._bleu_tokens(target)]) == pytest.approx(100.0)


def test_bucketed_batches_fit_the_model_source_width(tmp_path, shared_data):
  """The location score's parameters cover the widest padded source a bucket can produce."""
  task = translation.TranslationTask(_config(
      f"task=marathi,runlocal=True,model.score=location,data.buckets=(3,5),"
      f"data.manual_dir={shared_data},data.data_dir={tmp_path / 'tfds'}"))
  batches = task.train_iterator()
  widths = {next(batches)["source"].shape[1] for _ in range(30)}
  assert len(widths) > 1  # several buckets were used
  assert max(widths) <= task.src_width
  assert task.src_width >= task.max_src_len
