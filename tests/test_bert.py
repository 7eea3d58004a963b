"""BERT: masking and NSP statistics, padding, MLM loss, encoder transfer, runlocal end to end."""

import json
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import rundir
from attnlab import train
from attnlab.data import mlm
from attnlab.data import tokenizers
from attnlab.models import bert
from attnlab.tasks import classification
from attnlab.tasks import masked_lm

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "bert.py"
VOCAB = 1000
CLS, SEP, MASK = tokenizers.CLS_ID, tokenizers.SEP_ID, tokenizers.MASK_ID


# ------------------------------------------------------------------------------ masking


def _random_pair(rng, len_a, len_b):
  a = rng.integers(7, VOCAB, len_a).tolist()
  b = rng.integers(7, VOCAB, len_b).tolist()
  return [CLS, *a, SEP, *b, SEP], [0] * (len_a + 2) + [1] * (len_b + 1)


def test_masking_statistics_and_special_tokens_untouched():
  rng = np.random.default_rng(0)
  max_len, chosen, candidates = 64, 0, 0
  mask_count = random_count = kept_count = 0
  for _ in range(2000):
    ids, segments = _random_pair(rng, int(rng.integers(10, 40)), int(rng.integers(5, 20)))
    ex = mlm.pack_example(ids, segments, rng, max_len=max_len, is_next=1, nsp_weight=1.0,
                          vocab_size=VOCAB, mask_prob=0.15, max_predictions=20, word_starts=None)
    ids_np = np.asarray(ids)
    length = len(ids)
    n = int(ex.mlm_weights.sum())
    positions, labels = ex.mlm_positions[:n], ex.mlm_labels[:n]
    # Never a special token, never padding; labels are the original ids; padding stays 0.
    assert np.all(ids_np[positions] >= 7) and np.all(positions < length)
    np.testing.assert_array_equal(labels, ids_np[positions])
    assert np.all(ex.tokens[length:] == 0) and not ex.valid[length:].any() and ex.valid[:length].all()
    special = ids_np < 7
    np.testing.assert_array_equal(ex.tokens[:length][special], ids_np[special])
    untouched = np.setdiff1d(np.arange(length), positions)
    np.testing.assert_array_equal(ex.tokens[untouched], ids_np[untouched])
    assert np.all(ex.mlm_positions[n:] == 0) and np.all(ex.mlm_weights[n:] == 0)
    chosen += n
    candidates += int((ids_np >= 7).sum())
    new = ex.tokens[positions]
    mask_count += int((new == MASK).sum())
    kept_count += int((new == labels).sum())
    random_count += int(((new != MASK) & (new != labels)).sum())
  assert abs(chosen / candidates - 0.15) < 0.01
  assert abs(mask_count / chosen - 0.8) < 0.015
  assert abs(random_count / chosen - 0.1) < 0.015
  assert abs(kept_count / chosen - 0.1) < 0.015


def test_max_predictions_caps_the_count():
  rng = np.random.default_rng(1)
  ids, _ = _random_pair(rng, 60, 60)
  counts = [len(mlm.mask_tokens(ids, rng, vocab_size=VOCAB, max_predictions=4)[1])
            for _ in range(50)]
  assert max(counts) == 4


def test_whole_word_masking_masks_whole_words():
  rng = np.random.default_rng(2)
  word_starts = np.zeros(VOCAB, bool)
  word_starts[::3] = True  # ids divisible by 3 begin a word
  word_starts[:7] = True
  chosen = candidates = 0
  for _ in range(300):
    ids, _ = _random_pair(rng, 30, 15)
    _, positions, _ = mlm.mask_tokens(ids, rng, vocab_size=VOCAB, max_predictions=20,
                                      word_starts=word_starts)
    # Reference word segmentation: a word starts at a word-start id or right after a special.
    words, current = [], []
    for pos, tok in enumerate(ids):
      if tok < 7:
        if current:
          words.append(current)
        current = []
      elif word_starts[tok] and current:
        words.append(current)
        current = [pos]
      else:
        current.append(pos)
    if current:
      words.append(current)
    picked = set(positions.tolist())
    for word in words:
      assert picked.isdisjoint(word) or picked.issuperset(word), (word, sorted(picked))
    chosen += len(positions)
    candidates += sum(len(w) for w in words)
  assert 0.10 < chosen / candidates <= 0.16


def test_truncate_pair_fits_and_keeps_order():
  rng = np.random.default_rng(3)
  a, b = list(range(100, 150)), list(range(200, 210))
  ta, tb = mlm.truncate_pair(a, b, 30, rng)
  assert len(ta) + len(tb) == 30 and tb == b  # only the longer side is cut here
  assert ta == list(range(ta[0], ta[0] + len(ta)))  # a contiguous span of a


# ------------------------------------------------------------------------------ NSP pairs


def test_nsp_pairs_half_real_half_random(numbered_corpus):
  documents, owner = numbered_corpus(4, 40)
  data = masked_lm.PretrainingData(documents, [], vocab_size=VOCAB, max_len=16, mask_prob=0.0)
  real = 0
  n = 3000
  for position in range(n):
    ex = data.stream(1, position, seed=0)
    tokens, segments = ex.tokens[ex.valid], ex.segments[ex.valid]
    assert tokens[0] == CLS and list(tokens[[3, 6]]) == [SEP, SEP]
    np.testing.assert_array_equal(segments, [0, 0, 0, 0, 1, 1, 1])
    (da, sa), (db, sb) = owner[int(tokens[1])], owner[int(tokens[4])]
    truly_next = da == db and sb == sa + 1
    assert bool(ex.is_next) == truly_next
    if not truly_next:
      assert db != da  # the random partner comes from another document
    assert float(ex.nsp_weight) == 1.0
    real += truly_next
  assert abs(real / n - 0.5) < 0.03


def test_masks_are_redrawn_every_epoch():
  rng = np.random.default_rng(5)
  singles = [rng.integers(7, VOCAB, 30).tolist() for _ in range(50)]
  data = masked_lm.PretrainingData([[[7, 8], [9, 10]], [[11, 12]]], singles, vocab_size=VOCAB,
                                   max_len=40, mask_prob=0.15)
  masks = {0: {}, 1: {}}
  for epoch in (0, 1):
    for offset in range(50):
      ex = data.stream(2, epoch * 50 + offset, seed=0)
      n = int(ex.mlm_weights.sum())
      sentence = next(i for i, s in enumerate(singles)
                      if np.array_equal(np.asarray(s)[ex.mlm_positions[:n] - 1], ex.mlm_labels[:n]))
      masks[epoch][sentence] = tuple(ex.mlm_positions[:n].tolist())
  assert set(masks[0]) == set(masks[1]) == set(range(50))  # every sentence once per epoch
  assert sum(masks[0][i] != masks[1][i] for i in range(50)) > 40


# ------------------------------------------------------------------------------ model


@pytest.fixture(scope="module")
def tiny_pretrain_model():
  model = bert.BertForPretraining(vocab_size=50, **bert.size_config("test"), max_len=16,
                                  dropout_rate=0.0, attention_dropout_rate=0.0)
  tokens = jnp.zeros((2, 10), jnp.int32)
  params = model.init(jax.random.key(0), tokens, tokens, tokens != 0,
                      jnp.zeros((2, 3), jnp.int32))["params"]
  return model, params


@pytest.mark.slow
def test_padding_never_receives_attention(tiny_pretrain_model):
  model, params = tiny_pretrain_model
  rng = np.random.default_rng(6)
  lengths = np.array([5, 8])
  valid = np.arange(10)[None, :] < lengths[:, None]  # [2, 10]
  tokens = np.where(valid, rng.integers(7, 50, (2, 10)), 0).astype(np.int32)
  other_pad = np.where(valid, tokens, rng.integers(7, 50, (2, 10))).astype(np.int32)
  segments = np.zeros((2, 10), np.int32)
  positions = np.array([[1, 2, 3], [1, 4, 6]], np.int32)

  @jax.jit
  def run(tok):
    (mlm, nsp), state = model.apply({"params": params}, tok, segments, jnp.asarray(valid),
                                    positions, mutable=["intermediates"])
    return mlm, nsp, state["intermediates"]
  mlm_a, nsp_a, inter = run(tokens)
  weights = masked_lm.stacked_attention(jax.tree.map(lambda x: x, inter))  # example 0 only
  assert weights.shape == (2, 2, 10, 10)
  for layer in inter["encoder"].values():
    w = np.asarray(layer["self_attention"]["attention_weights"][0])  # [2, heads, 10, 10]
    for b in range(2):
      np.testing.assert_array_equal(w[b, :, :, lengths[b]:], 0.0)
      np.testing.assert_allclose(w[b].sum(-1), 1.0, atol=1e-5)
  mlm_b, nsp_b, _ = run(other_pad)  # different ids under the padding: same outputs
  np.testing.assert_allclose(mlm_a, mlm_b, atol=1e-5)
  np.testing.assert_allclose(nsp_a, nsp_b, atol=1e-5)


def test_mlm_head_is_tied_to_token_table(tiny_pretrain_model):
  """The MLM logits are h · table[j] + bias[j] with the token table itself: moving row 20 by a
  random delta changes logit 20 by h · delta and no other logit. (A constant delta, as this test
  once used, is cancelled by the head's zero-mean LayerNorm: sum(h) = 0 up to rounding, #47.)"""
  model, params = tiny_pretrain_model
  assert "mlm_output" not in params and params["mlm_bias"].shape == (50,)
  tokens = jnp.asarray([[CLS, 9, 10, SEP, 0, 0, 0, 0, 0, 0]] * 2, jnp.int32)
  pos = jnp.asarray([[1, 2, 0]] * 2, jnp.int32)
  base = np.asarray(model.apply({"params": params}, tokens, None, None, pos)[0], np.float64)
  table = params["encoder"]["embed"]["token"]["embedding"]  # [vocab, d]
  delta = np.random.default_rng(0).normal(size=table.shape[1]).astype(np.float32)  # [d]
  bumped = jax.tree.map(lambda x: x, params)
  bumped["encoder"]["embed"]["token"]["embedding"] = table.at[20].add(delta)
  # Token 20 is not in the input: only its output logit changes, through the tied table.
  out = np.asarray(model.apply({"params": bumped}, tokens, None, None, pos)[0], np.float64)
  # h [batch, P, d] recovered from the base logits by least squares on the table (50 x 32, full
  # rank): the logits lie in the table's span (tied), and h predicts the change of logit 20
  t64 = np.asarray(table, np.float64)  # [vocab, d]
  y = (base - np.asarray(params["mlm_bias"])).reshape(-1, 50).T  # [vocab, batch * P]
  h = np.linalg.lstsq(t64, y, rcond=None)[0]  # [d, batch * P]
  np.testing.assert_allclose(t64 @ h, y, atol=1e-5)  # logits up to ~0.3; residual ~2e-8
  want = (h.T @ delta.astype(np.float64)).reshape(base.shape[:2])  # [batch, P]
  assert np.abs(want).min() > 0.5  # far above float32 rounding of the logits (~1e-6)
  np.testing.assert_allclose(out[..., 20] - base[..., 20], want, rtol=1e-3, atol=1e-4)
  others = np.delete(np.abs(out - base), 20, axis=-1)  # [batch, P, vocab - 1]
  assert others.max() < 1e-5


# ------------------------------------------------------------------------------ tasks


@pytest.fixture(scope="module")
def data_args(shared_data, tmp_path_factory):
  root = tmp_path_factory.mktemp("bert_data")
  return (f"data.manual_dir={shared_data},data.data_dir={root / 'tfds'},"
          f"data.tokenizer_dir={root / 'tok'}")


def _config(mode: str, data_args: str, extra: str = ""):
  arg = f"mode={mode},runlocal=True,{data_args}" + (f",{extra}" if extra else "")
  return config_utils.load_config_file(f"{CONFIG}:{arg}")


@pytest.fixture(scope="module")
def pretrain_run(data_args, tmp_path_factory):
  """A runlocal pretraining run, end to end through the trainer."""
  workdir = tmp_path_factory.mktemp("bert_pretrain")
  config = _config("pretrain", data_args, "num_train_steps=4,eval_every=0,write_plots=False")
  train.train_and_evaluate(config, workdir)
  return workdir


@pytest.mark.slow
def test_pretrain_runlocal_end_to_end(pretrain_run):
  records = rundir.read_metrics(pretrain_run)
  last_eval = rundir.last_records(records)["eval"]
  assert last_eval["step"] == 4
  for key in ("mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy"):
    assert np.isfinite(last_eval[key])
  assert 0.0 <= last_eval["nsp_accuracy"] <= 1.0
  config = json.loads((pretrain_run / "config.json").read_text())
  assert config["task"] == "masked_lm"


@pytest.mark.slow
def test_mlm_loss_counts_only_masked_positions(pretrain_run):
  run = analysis.load_run(pretrain_run)
  task, params = run.task, run.params
  batch = next(task.train_iterator())
  batch["mlm_weights"][:, 2:] = 0.0  # only the first two predictions of each row count
  loss_fn = jax.jit(lambda p, b: task.loss_fn(p, b, None))
  loss, metrics = loss_fn(params, batch)
  logits, nsp_logits = task.model.apply({"params": params}, batch["tokens"], batch["segments"],
                                        batch["valid"], batch["mlm_positions"])
  logits = np.asarray(logits, np.float64)  # [b, P, vocab]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, batch["mlm_labels"][..., None], -1)[..., 0]  # [b, P]
  w = batch["mlm_weights"]
  np.testing.assert_allclose(float(metrics["mlm_loss"]), (nll * w).sum() / w.sum(), rtol=1e-4)
  nsp = np.asarray(nsp_logits, np.float64)
  nsp_logp = nsp - np.log(np.exp(nsp).sum(-1, keepdims=True))
  nsp_nll = -nsp_logp[np.arange(len(nsp)), batch["is_next"]]
  nsp_w = batch["nsp_weight"]
  np.testing.assert_allclose(float(metrics["nsp_loss"]), (nsp_nll * nsp_w).sum() / nsp_w.sum(),
                             rtol=1e-4)
  np.testing.assert_allclose(float(loss), float(metrics["mlm_loss"] + metrics["nsp_loss"]),
                             rtol=1e-6)
  # Labels at unweighted positions do not matter.
  batch["mlm_labels"][:, 2:] = 7
  loss2, _ = loss_fn(params, batch)
  np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)


@pytest.mark.slow
def test_finetune_loads_pretrained_encoder_end_to_end(pretrain_run, data_args, tmp_path):
  config = _config("finetune", data_args, "num_train_steps=3,eval_every=0")
  config.init_from = str(pretrain_run)
  task = classification.ClassificationTask(config)
  pretrained = analysis.load_run(pretrain_run).params
  rng = jax.random.key(3)
  loaded = task.load_pretrained(task.init(rng), rundir.read_config(pretrain_run), pretrained)
  for a, b in zip(jax.tree.leaves(pretrained["encoder"]), jax.tree.leaves(loaded["encoder"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens = jnp.zeros((1, config.data.max_len), jnp.int32)
  fresh = task.model.init(rng, tokens)["params"]  # what init gives without init_from
  np.testing.assert_array_equal(loaded["classifier"]["kernel"], fresh["classifier"]["kernel"])
  assert np.abs(np.asarray(loaded["classifier"]["kernel"])).sum() > 0  # a real random init
  assert not np.allclose(fresh["encoder"]["pooler"]["kernel"], loaded["encoder"]["pooler"]["kernel"])
  # The whole fine-tuning run through the trainer, with its plots.
  workdir = tmp_path / "finetune"
  train.train_and_evaluate(config, workdir)
  last_eval = rundir.last_records(rundir.read_metrics(workdir))["eval"]
  assert last_eval["step"] == 3 and 0.0 <= last_eval["accuracy"] <= 1.0
  assert (workdir / "head_view.png").is_file() and (workdir / "cls_attention.png").is_file()


@pytest.mark.slow
def test_finetune_rejects_a_different_pretraining_model(pretrain_run, data_args, tmp_path):
  config = _config("finetune", data_args, "model.num_layers=1")
  config.init_from = str(pretrain_run)
  task = classification.ClassificationTask(config)
  with pytest.raises(config_utils.ConfigError, match="model.num_layers: 2 .* 1 here"):
    task.load_pretrained(task.init(jax.random.key(0)), rundir.read_config(pretrain_run),
                         analysis.load_run(pretrain_run).params)
  with pytest.raises(config_utils.ConfigError, match="model.num_layers: 2 .* 1 here"):
    train.train_and_evaluate(config, tmp_path / "mismatch")


# Step 0 of a fine-tuning run in a subprocess with 2 fake CPU devices (a 2-way data mesh).
_TWO_DEVICE_WORKER = """
import sys, jax, numpy as np
from attnlab import config_utils, train
config = config_utils.load_config_file(sys.argv[1])
config.init_from = sys.argv[2]
state = train.train_and_evaluate(config, sys.argv[3])
leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
np.savez(sys.argv[4], devices=len(jax.tree.leaves(state.params)[0].sharding.device_set),
         **{jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves})
"""


@pytest.mark.slow
def test_init_from_loads_the_encoder_whatever_the_seeds_or_devices(pretrain_run, data_args,
                                                                   tmp_path):
  """Step 0 of every replica holds the pretraining run's encoder: num_seeds=2 on one device, and
  num_seeds=2 on a mesh of 2 fake CPU devices (the parameters are loaded after the state is
  built, never inside the traced init)."""
  pretrained = jax.device_get(analysis.load_run(pretrain_run).params["encoder"])
  arg = "num_train_steps=0,eval_every=0,write_plots=False,num_seeds=2"
  config = _config("finetune", data_args, arg)
  config.init_from = str(pretrain_run)
  state = train.train_and_evaluate(config, tmp_path / "seeds")
  params = jax.device_get(state.params)
  for replica in range(2):
    for a, b in zip(jax.tree.leaves(pretrained), jax.tree.leaves(params["encoder"])):
      np.testing.assert_array_equal(a, b[replica])
  kernels = params["classifier"]["kernel"]  # [2, d_model, classes]: each seed its own classifier
  assert not np.allclose(kernels[0], kernels[1])
  out = tmp_path / "two_devices.npz"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu", ATTNLAB_DISTRIBUTED="0")
  proc = subprocess.run(
      [sys.executable, "-c", _TWO_DEVICE_WORKER, f"{CONFIG}:mode=finetune,runlocal=True,"
       f"{data_args},{arg},batch_size=8", str(pretrain_run), str(tmp_path / "mesh"), str(out)],
      env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = np.load(out)
  assert int(result["devices"]) == 2
  flat = jax.tree_util.tree_flatten_with_path({"encoder": pretrained})[0]
  for path, value in flat:
    for replica in range(2):
      np.testing.assert_array_equal(value, result[jax.tree_util.keystr(path)][replica])


def test_config_shortcuts_and_errors():
  config = config_utils.load_config_file(f"{CONFIG}:mode=finetune,size=mini,score=additive")
  assert config.task == "classification" and config.init_from == ""
  assert (config.model.num_layers, config.model.d_model, config.model.attention.score) == (
      4, 256, "additive")
  with pytest.raises(config_utils.ConfigError, match="valid modes: pretrain, finetune"):
    config_utils.load_config_file(f"{CONFIG}:mode=train")
  with pytest.raises(config_utils.ConfigError, match="valid sizes"):
    config_utils.load_config_file(f"{CONFIG}:size=huge")
  with pytest.raises(ValueError, match="valid sizes"):
    bert.size_config("huge")
  assert config_utils.load_config_file(f"{CONFIG}:runlocal=True").model.d_model == 32


def test_init_from_a_run_of_another_task_is_refused_by_name():
  # A GPT run lacks the data fields a BERT pretraining run is compared on: one line naming its
  # task, not an AttributeError from the comparison.
  finetune = config_utils.load_config_file(f"{CONFIG}:mode=finetune,init_from=runs/gpt")
  gpt = config_utils.load_config_file(f"{REPO / 'configs' / 'gpt.py'}:runlocal=True")
  assert classification.pretraining_mismatch(gpt, finetune) == [
      "task: 'causal_lm' (a 'masked_lm' run is needed)"]
  task = types.SimpleNamespace(config=finetune)  # load_pretrained reads the config first
  with pytest.raises(config_utils.ConfigError,
                     match="init_from=runs/gpt is a 'causal_lm' run; a masked_lm run is needed"):
    classification.ClassificationTask.load_pretrained(task, None, gpt, None)
