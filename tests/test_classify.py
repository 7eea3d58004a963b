"""The RNN text classifier (configs/classify.py, task rnn_classification): its three poolings
against NumPy references written here from their formulas, with padding; a short run that learns
the synthetic cue_word task, reloads without its data, and shows its pooling weights to capture
and `attnlab view`."""

import itertools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import data as data_lib
from attnlab import errors
from attnlab import train
from attnlab.attention import pooling
from attnlab.data import labelled
from attnlab.models import rnn_classifier

REPO = pathlib.Path(__file__).resolve().parents[1]
CLASSIFY = REPO / "configs" / "classify.py"
TOL = dict(rtol=1e-5, atol=1e-6)


def _config(arg: str):
  return config_utils.load_config_file(f"{CLASSIFY}:{arg}")


def np_softmax_masked(scores, mask):
  e = np.where(mask, np.exp(scores - np.max(np.where(mask, scores, -np.inf), -1, keepdims=True)),
               0.0)
  return e / e.sum(-1, keepdims=True)


def np_yang_pooling(states, w, b, u_w, mask):
  """Yang et al. (2016): u_t = tanh(W h_t + b), a_t = softmax_t(u_t . u_w), s = sum_t a_t h_t."""
  u = np.tanh(states @ w + b)  # [batch, len, d_attn]
  alpha = np_softmax_masked(u @ u_w, mask)  # [batch, len]
  return np.einsum("bt,btd->bd", alpha, states), alpha


# ---------------------------------------------------------------------------------------------
# The pure pooling functions


def test_context_attention_pooling_matches_the_formula_with_padding():
  r = np.random.default_rng(0)
  states = r.normal(size=(3, 6, 5)).astype(np.float32)  # [batch, len, d]
  lengths = np.array([6, 3, 1])
  mask = np.arange(6)[None] < lengths[:, None]  # [batch, len]
  params = {"w": r.normal(size=(5, 4)).astype(np.float32),
            "b": r.normal(size=(4,)).astype(np.float32),
            "context": r.normal(size=(4,)).astype(np.float32) * 2}
  want_pooled, want_alpha = np_yang_pooling(states.astype(np.float64), params["w"], params["b"],
                                            params["context"], mask)
  pooled, alpha = jax.jit(pooling.context_attention_pooling)(params, states, mask)
  np.testing.assert_allclose(alpha, want_alpha, **TOL)
  np.testing.assert_allclose(pooled, want_pooled, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(alpha)[~mask] == 0.0)
  np.testing.assert_allclose(np.asarray(alpha).sum(-1), 1.0, **TOL)
  # Rubbish at padded positions changes nothing; the last row is its one real state.
  noisy = np.where(mask[..., None], states, 1e3)
  np.testing.assert_allclose(pooling.context_attention_pooling(params, noisy, mask)[0], pooled,
                             **TOL)
  np.testing.assert_allclose(pooled[2], states[2, 0], **TOL)
  # vmap over the batch gives the same; a row without tokens pools to zeros, not NaN.
  per_row = jax.vmap(pooling.context_attention_pooling, in_axes=(None, 0, 0))(params, states, mask)
  np.testing.assert_allclose(per_row[0], pooled, **TOL)
  empty, weights = pooling.context_attention_pooling(params, states[:1], np.zeros((1, 6), bool))
  assert np.all(np.asarray(empty) == 0) and np.all(np.asarray(weights) == 0)


def test_masked_mean_ignores_padding():
  r = np.random.default_rng(1)
  states = r.normal(size=(2, 5, 3)).astype(np.float32)
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  got = pooling.masked_mean(np.where(mask[..., None], states, -7.0), mask)
  np.testing.assert_allclose(got[0], states[0, :3].mean(0), **TOL)
  np.testing.assert_allclose(got[1], states[1].mean(0), **TOL)
  with pytest.raises(ValueError, match="bool mask"):
    pooling.masked_mean(states, mask.astype(np.int32))


# ---------------------------------------------------------------------------------------------
# The model: each pooling on padded rows against the same row run alone

# Rows of different lengths, right-padded with 0 (ids from 1).
TOKENS = np.array([[5, 9, 2, 7, 3, 4],
                   [8, 3, 6, 0, 0, 0],
                   [4, 0, 0, 0, 0, 0]], np.int32)
LENGTHS = (TOKENS != 0).sum(1)


def _model(pooling_name, cell="gru", bidirectional=False):
  model = rnn_classifier.RNNClassifier(vocab_size=12, num_classes=3, embed_dim=4, hidden_dim=5,
                                       cell=cell, bidirectional=bidirectional,
                                       pooling=pooling_name, attn_dim=6)
  params = model.init(jax.random.key(0), jnp.asarray(TOKENS))["params"]
  return model, params


def _pool(model, params, tokens):
  return jax.device_get(model.apply({"params": params}, jnp.asarray(tokens),
                                    method=rnn_classifier.RNNClassifier.pool))


def _alone(model, params, b):
  """The states of row b run alone, without padding: `[len_b, enc_dim]`."""
  return _pool(model, params, TOKENS[b:b + 1, :LENGTHS[b]])["states"][0]


@pytest.mark.parametrize("cell, bidirectional", [("gru", False), ("lstm", True)])
def test_last_pooling_takes_the_last_real_tokens_state(cell, bidirectional):
  model, params = _model("last", cell, bidirectional)
  out = _pool(model, params, TOKENS)
  hidden = model.hidden_dim
  for b in range(len(TOKENS)):
    alone = _alone(model, params, b)
    if bidirectional:  # forward after the last token; backward after reading back to the first
      want = np.concatenate([alone[-1, :hidden], alone[0, hidden:]])
    else:
      want = alone[-1]
    np.testing.assert_allclose(out["pooled"][b], want, **TOL)
  # The padded positions' states are not the last real one's (so picking them would be wrong).
  assert not np.allclose(out["states"][1, -1], out["pooled"][1])


def test_mean_pooling_ignores_padding():
  model, params = _model("mean", "gru", True)
  out = _pool(model, params, TOKENS)
  for b in range(len(TOKENS)):
    np.testing.assert_allclose(out["pooled"][b], _alone(model, params, b).mean(0), **TOL)


def test_attention_pooling_weights_follow_the_formula_and_are_sown():
  model, params = _model("attention", "gru", True)
  logits, state = model.apply({"params": params}, jnp.asarray(TOKENS), mutable=["intermediates"])
  sown = np.asarray(state["intermediates"]["pooling"]["attention_weights"][0])  # [batch, 1, len]
  out = _pool(model, params, TOKENS)
  p = jax.device_get(params["pooling"])
  mask = TOKENS != 0
  want_pooled, want_alpha = np_yang_pooling(out["states"].astype(np.float64), p["w"], p["b"],
                                            p["context"], mask)
  assert sown.shape == (3, 1, 6)
  np.testing.assert_allclose(sown[:, 0], want_alpha, **TOL)
  np.testing.assert_allclose(out["pooled"], want_pooled, rtol=1e-5, atol=1e-5)
  for b in range(len(TOKENS)):  # the same as the row alone
    alone = _alone(model, params, b)
    np.testing.assert_allclose(out["pooled"][b], np_yang_pooling(
        alone[None].astype(np.float64), p["w"], p["b"], p["context"],
        np.ones((1, LENGTHS[b]), bool))[0][0], rtol=1e-5, atol=1e-5)
  want_logits = want_pooled @ p_classifier(params)[0] + p_classifier(params)[1]
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)


def test_hook_sites_cache_and_edit_the_pooling():
  from attnlab.analysis import hooks  # pylint: disable=g-import-not-at-top
  model, params = _model("attention", "gru", True)
  assert list(hooks.sites(model)) == ["encoder.embed", "encoder.states", "pooling.pattern",
                                      "pooled"]
  assert "pooling.pattern" not in hooks.sites(_model("mean")[0])
  logits, cache = hooks.run_with_cache((model, params), TOKENS)
  p = jax.device_get(params["pooling"])
  states = np.asarray(cache["encoder.states"], np.float64)
  want_pooled, want_alpha = np_yang_pooling(states, p["w"], p["b"], p["context"], TOKENS != 0)
  np.testing.assert_allclose(cache["pooling.pattern"], want_alpha, **TOL)
  np.testing.assert_allclose(cache["pooled"], want_pooled, rtol=1e-5, atol=1e-5)
  # All the weight on each row's first token: the classifier reads that token's state.
  first = np.zeros(TOKENS.shape, np.float32)
  first[:, 0] = 1.0
  edit = hooks.Intervention("pooling.pattern", "replace", first)
  edited, cache = hooks.run_with_cache((model, params), TOKENS, ["pooled"], interventions=[edit])
  np.testing.assert_allclose(cache["pooled"], states[:, 0], rtol=1e-5, atol=1e-6)
  kernel, bias = p_classifier(params)
  np.testing.assert_allclose(edited, states[:, 0] @ kernel + bias, rtol=1e-5, atol=1e-5)
  assert not np.allclose(edited, logits)


def p_classifier(params):
  c = jax.device_get(params["classifier"])
  return c["kernel"], c["bias"]


def test_config_errors_are_one_line():
  from attnlab.tasks import rnn_classification  # pylint: disable=g-import-not-at-top
  for arg, needle in [("pooling=max", "unknown model.pooling 'max'; valid choices: last, mean"),
                      ("cell=rnn", "unknown model.cell 'rnn'; valid choices: gru, lstm"),
                      ("dataset=cue_word,data.cue_word.max_len=40",
                       "data.cue_word.max_len=40 makes sentences longer than data.max_len=32")]:
    with pytest.raises(errors.ConfigError, match=needle) as info:
      rnn_classification.RNNClassificationTask(_config(f"runlocal=True,{arg}"))
    assert len(str(info.value).splitlines()) == 1
  with pytest.raises(errors.ConfigError, match="valid datasets: sst2, cue_word, csv"):
    _config("dataset=imdb")
  with pytest.raises(errors.DataError, match="set data.num_train and data.num_eval >= 1"):
    labelled.read(_config("dataset=cue_word,data.num_train=0").data, "train", 0)


# ---------------------------------------------------------------------------------------------
# A run on the synthetic task, end to end

CUE_ARG = ("runlocal=True,dataset=cue_word,num_train_steps=120,batch_size=32,"
           "optimizer.learning_rate=1e-2,eval_every=60,checkpoint_every=60,write_plots=False")


@pytest.fixture(scope="module")
def cue_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("classify") / "cue"
  config = _config(CUE_ARG)
  train.train_and_evaluate(config, workdir)
  return workdir


def _final_eval(workdir):
  return [r for r in analysis.read_metrics(workdir) if r.get("split") == "eval"][-1]


def test_a_short_run_learns_the_cue_word_task(cue_run):
  final = _final_eval(cue_run)
  assert final["step"] == 120
  assert final["accuracy"] > 0.9  # chance: 0.5 (two balanced classes)


def test_the_run_reloads_and_captures_without_its_data(cue_run, monkeypatch):
  monkeypatch.setattr(data_lib, "get_dataset", _refuse)
  monkeypatch.setattr(labelled.synthetic, "get_synthetic", _refuse)
  run = analysis.load_run(cue_run)
  assert run.step == 120 and run.task.num_classes == 2
  # One sentence: the weights over its real tokens sum to 1, the cue word holds the most.
  cap = analysis.capture_text(run, "w3 w11 w40 c1_2 w7 w7 w19")
  assert list(cap.weights) == ["pooling"] and cap.sides["pooling"] == ("context", "tokens")
  assert cap.tokens["context"] == ["[u_w]"] and cap.kind["pooling"] == "cross"
  w = cap.weights["pooling"]  # [heads 1, q 1, tokens 7]
  assert w.shape == (1, 1, 7)
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
  assert int(np.argmax(w[0, 0])) == 3
  # A padded batch: weights 0 on padding, rows summing to 1 over the real tokens.
  ids = [run.task.encode(t) for t in ("w1 c0_1 w2", "w5 w6 w7 w8 c1_0 w9", "c0_2")]
  tokens = np.zeros((3, 6), np.int32)
  for i, row in enumerate(ids):
    tokens[i, :len(row)] = row
  weights = analysis.capture_batch(run, tokens)["pooling"]  # [batch, 1, 1, len]
  real = tokens != 0
  np.testing.assert_allclose(weights[:, 0, 0].sum(-1), 1.0, rtol=1e-5)
  assert np.all(weights[:, 0, 0][~real] == 0)
  assert [int(np.argmax(weights[i, 0, 0])) for i in range(3)] == [1, 4, 0]
  with pytest.raises(ValueError, match="right-padded"):
    analysis.capture_batch(run, np.array([[0, 5, 6]]))


def test_view_writes_the_pooling_page_and_refuses_a_model_without_attention(cue_run, tmp_path):
  from attnlab.cli import view  # pylint: disable=g-import-not-at-top
  page = view.view_text(str(cue_run), "w3 c0_1 w9", out=tmp_path / "v.html")
  html = page.read_text()
  assert "[u_w]" in html and "c0_1" in html
  # last pooling has no attention to view: one line, not an empty page.
  config = _config("runlocal=True,dataset=cue_word,pooling=last")
  from attnlab.tasks import rnn_classification  # pylint: disable=g-import-not-at-top
  task = rnn_classification.RNNClassificationTask(config)
  run = analysis.Run(workdir=tmp_path, config=config, task=task, model=task.model,
                     params=task.init(jax.random.key(0)), step=0)
  with pytest.raises(errors.UserError, match="has no attention"):
    view.view_text(run, "w3 c0_1 w9", out=tmp_path / "w.html")


def _refuse(*args, **kwargs):
  raise errors.DataError(f"the dataset is gone (read {args} {kwargs})")


# ---------------------------------------------------------------------------------------------
# SST-2, the default data set


def test_sst2_is_read_and_encoded(shared_data, monkeypatch):
  from attnlab.tasks import rnn_classification  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("ATTNLAB_DATA_DIR", str(shared_data))
  task = rnn_classification.RNNClassificationTask(_config("runlocal=True"))
  assert task.num_classes == 2
  assert task.buckets() == [16, 32, 64]
  for batch in itertools.islice(task.train_iterator(), 5):  # padded to the bucket that holds it
    longest = batch["tokens_length"].max()
    assert batch["tokens"].shape[1] == min(b for b in (16, 32, 64) if b >= longest)
    assert batch["tokens"].shape[0] == 8 and batch["example_mask"].all()
  batch = task.eval_batches()[0]
  assert batch["tokens"].shape == (40, 64) and set(np.unique(batch["labels"])) == {0, 1}
  first = data_lib.get_dataset("sst2", "validation[:1]")[0]["sentence"]
  words = re.findall(r"\w+|[^\w\s]", first.lower())  # words, punctuation split off
  ids = batch["tokens"][0][batch["tokens"][0] != 0]
  assert len(ids) == min(len(words), 64)
  known = [task.tokenizer.id_to_token(int(i)) for i in ids]
  assert all(k in (w, "<unk>") for k, w in zip(known, words))


def test_sst2_with_character_tokens(shared_data, monkeypatch):
  from attnlab.tasks import rnn_classification  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("ATTNLAB_DATA_DIR", str(shared_data))
  config = _config("runlocal=True,tokenizer=char")
  assert config.data.max_len == 256 and tuple(config.data.buckets) == (64, 128)
  task = rnn_classification.RNNClassificationTask(config)
  text = data_lib.get_dataset("sst2", "train[:1]")[0]["sentence"]
  assert [task.tokenizer.id_to_token(int(i)) for i in task.encode(text)] == list(text)[:256]


# ---------------------------------------------------------------------------------------------
# The user's own labelled file (dataset=csv)

WORDS = ("good", "bad", "fine")  # the label of a row is the class word in it


def _write_csv(path, rows):
  path.write_text("label,sentence,extra\n" + "".join(f"{lab},{text},x\n" for lab, text in rows))
  return path


def test_csv_rows_become_labelled_texts_with_sorted_class_names(tmp_path):
  rng = np.random.default_rng(0)
  rows = [(WORDS[c], f"the {WORDS[c]} film number {i}") for i, c in
          enumerate(rng.integers(0, 3, 30))]
  path = _write_csv(tmp_path / "mine.csv", rows)
  data = _config(f"runlocal=True,dataset=csv,data.path={path}").data
  train_part, valid_part = labelled.read(data, "train"), labelled.read(data, "validation")
  names = sorted(WORDS)  # classes: the distinct labels sorted as strings
  assert train_part.names == valid_part.names == tuple(names) and train_part.num_classes == 3
  # The held-out rows: round(0.1 * 30) = 3 rows picked by default_rng(valid_seed=0).permutation.
  held = np.sort(np.random.default_rng(0).permutation(30)[:3])
  kept = [i for i in range(30) if i not in held]
  assert valid_part.texts == [rows[i][1] for i in held]
  assert train_part.texts == [rows[i][1] for i in kept]
  np.testing.assert_array_equal(train_part.labels, [names.index(rows[i][0]) for i in kept])
  assert labelled.read(data, "train", 5).texts == [rows[i][1] for i in kept[:5]]
  pair = _config(f"dataset=csv,data.path={path}").data
  pair.text_pair_column = "extra"
  with pytest.raises(errors.DataError, match="one text per example"):
    labelled.read(pair, "train")


def test_csv_run_trains_and_reloads_with_its_class_names(tmp_path, monkeypatch):
  rng = np.random.default_rng(1)
  fillers = [f"w{i}" for i in range(12)]
  rows = []
  for i in range(240):
    c = int(rng.integers(0, 3))
    words = list(rng.choice(fillers, 5))
    words.insert(int(rng.integers(0, 6)), WORDS[c])
    rows.append((WORDS[c], " ".join(words)))
  path = _write_csv(tmp_path / "mine.csv", rows)
  workdir = tmp_path / "run"
  train.train_and_evaluate(_config(
      f"runlocal=True,dataset=csv,data.path={path},num_train_steps=120,batch_size=32,"
      "optimizer.learning_rate=1e-2,eval_every=120,checkpoint_every=120,write_plots=False,"
      "data.buckets=()"), workdir)
  assert _final_eval(workdir)["accuracy"] > 0.8  # chance: about 1/3
  path.unlink()  # the run reloads without its file
  run = analysis.load_run(workdir)
  assert run.task.labels == tuple(sorted(WORDS)) and run.task.num_classes == 3
