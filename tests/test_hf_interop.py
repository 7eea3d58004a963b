"""Hugging Face interop (attnlab.interop.hf): GPT-2 and BERT logits against `transformers`.

The fixture tests compare with logits that `transformers` computed when the fixture was made
(tests/fixtures/make_hf_fixtures.py), so they run without torch; the tests marked `needs_hf`
build fresh random models with `transformers`, and check export by loading it back there.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import errors
from attnlab import tasks
from attnlab.cli import generate
from attnlab.cli import import_hf
from attnlab.data import tokenizers
from attnlab.interop import hf
from attnlab.interop import torch_pickle

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
# Largest |attnlab - transformers| allowed on the logits (float32).
TOL = 1e-4

try:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
except ImportError:
  torch = transformers = None
needs_hf = pytest.mark.skipif(
    transformers is None, reason="needs torch and transformers: pip install torch==2.13.0 && "
    "pip install -e \".[test,hf]\" (torch's CPU build first, as .ci/run)")


def _max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def _gpt_logits(run, ids):
  return run.model.apply({"params": run.params}, jnp.asarray(ids, jnp.int32))


def _bert_logits(run, ids, types, mask):
  return run.model.apply({"params": run.params}, jnp.asarray(ids, jnp.int32),
                         jnp.asarray(types, jnp.int32), jnp.asarray(mask).astype(bool))


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("gpt2") / "run"
  hf.import_checkpoint(FIXTURES / "gpt2", workdir)
  return analysis.load_run(workdir)


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("bert") / "run"
  hf.import_checkpoint(FIXTURES / "bert", workdir)  # pytorch_model.bin, read without torch
  return analysis.load_run(workdir)


# ------------------------------------------------------------------------------ fixture parity


def test_fixture_size():
  total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
  assert total < 400_000


def test_gpt2_fixture_logits(gpt2_run):
  expected = np.load(FIXTURES / "gpt2_expected.npz")
  logits = _gpt_logits(gpt2_run, expected["input_ids"])
  assert logits.shape == expected["logits"].shape
  assert _max_diff(logits, expected["logits"]) <= TOL
  assert gpt2_run.step == 0 and gpt2_run.config.task == "causal_lm"
  assert gpt2_run.config.data.tokenizer == "hf"


def test_bert_fixture_logits(bert_run):
  e = np.load(FIXTURES / "bert_expected.npz")
  mlm, nsp = _bert_logits(bert_run, e["input_ids"], e["token_type_ids"], e["attention_mask"])
  assert _max_diff(mlm, e["mlm_logits"]) <= TOL
  assert _max_diff(nsp, e["nsp_logits"]) <= TOL
  # The gathered MLM head gives the same logits at chosen positions.
  positions = np.array([[1, 3], [2, 10]], np.int32)
  gathered, _ = bert_run.model.apply(
      {"params": bert_run.params}, jnp.asarray(e["input_ids"]), jnp.asarray(e["token_type_ids"]),
      jnp.asarray(e["attention_mask"]).astype(bool), jnp.asarray(positions))
  want = np.take_along_axis(e["mlm_logits"], positions[..., None], axis=1)
  assert _max_diff(gathered, want) <= TOL


def test_tokenizers_of_imported_runs(gpt2_run, bert_run):
  tok = gpt2_run.task.tokenizer
  ids = tok.encode("To be, or not to be")
  assert tok.decode(ids) == "To be, or not to be"
  assert tok.start_id == tok.end_id == tok.token_to_id("<|endoftext|>")
  wp = bert_run.task.tokenizer
  vocab = (FIXTURES / "bert" / "vocab.txt").read_text().split("\n")
  assert [wp.id_to_token(i) for i in wp.encode("The cat sat")] == ["the", "cat", "sat"]
  assert (wp.cls_id, wp.sep_id, wp.mask_id, wp.pad_id) == tuple(
      vocab.index(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))
  # Tokenizer files live in the run directory's assets, which the reloaded task reads.
  kept = gpt2_run.workdir / "assets" / "tokenizer"
  assert pathlib.Path(gpt2_run.config.data.tokenizer_path) == kept
  assert gpt2_run.task.tokenizer.directory == kept


def test_unknown_symbols_of_imported_tokenizers(gpt2_run, bert_run):
  # WordPiece maps what it cannot spell to [UNK]; byte-level BPE spells every byte.
  wp = bert_run.task.tokenizer
  assert wp.split("the cat €") == ["the", "cat", "€"] and wp.unknown("the cat €") == ["€"]
  assert tokenizers.unknown_warning(wp, "the cat € €", "the prompt") == (
      "the prompt has 1 symbol outside the vocabulary of the run: '€' (2 times); it was encoded "
      "as [UNK], which the model reads as 'unknown'")
  assert gpt2_run.task.tokenizer.unknown("€€€") == []
  assert tokenizers.unknown_warning(gpt2_run.task.tokenizer, "€€€") is None


def test_capture_of_imported_bert_uses_its_special_tokens(bert_run):
  cap = analysis.capture_text(bert_run, "the cat sat", target="the cat")
  assert cap.tokens["tokens"] == ["[CLS]", "the", "cat", "sat", "[SEP]", "the", "cat", "[SEP]"]


@pytest.mark.slow
def test_generate_cli_on_imported_gpt2(gpt2_run, capsys):
  status = generate.main(["attnlab generate", f"--workdir={gpt2_run.workdir}",
                          "--prompt=To be", "--num_tokens=6", "--temperature=0"])
  assert status == 0
  out = capsys.readouterr().out
  assert out.startswith("To be")
  # Greedy: the first generated token is the argmax of the full forward pass.
  tok = gpt2_run.task.tokenizer
  ids = tok.encode("To be")
  first = int(jnp.argmax(_gpt_logits(gpt2_run, [ids])[0, -1]))
  assert out[len("To be"):].startswith(tok.decode([first]))


def test_masked_lm_examples_use_the_checkpoint_special_ids(bert_run):
  from attnlab.tasks import masked_lm  # pylint: disable=g-import-not-at-top
  tok = bert_run.task.tokenizer
  special = masked_lm.special_ids(tok, bert_run.task.vocab_size)
  data = masked_lm.PretrainingData([[tok.encode("the cat sat on the mat"),
                                     tok.encode("the dog was tired")],
                                    [tok.encode("it is not"), tok.encode("a sea of mind")]], [],
                                   vocab_size=bert_run.task.vocab_size, max_len=16,
                                   mask_prob=0.5, max_predictions=6, special=special)
  ex = data.pair_example(0, np.random.default_rng(0))
  n = int(ex.valid.sum())
  assert ex.tokens[0] == tok.cls_id and ex.tokens[n - 1] == tok.sep_id
  chosen = ex.mlm_labels[ex.mlm_weights > 0]
  assert len(chosen) and not set(chosen.tolist()) & set(tok.all_special_ids)
  assert set(ex.tokens[ex.mlm_positions[ex.mlm_weights > 0]].tolist()) - set(chosen.tolist()) <= (
      {tok.mask_id} | set(np.flatnonzero(special["ordinary"]).tolist()))


@pytest.mark.slow
def test_finetuning_starts_from_the_imported_encoder(bert_run):
  config = config_utils.load_config_file(
      f"{CONFIGS / 'bert.py'}:mode=finetune,runlocal=True,pretrained={bert_run.workdir}")
  assert config.init_from == str(bert_run.workdir)
  task = tasks.build_task(config)
  # What the trainer does at step 0 of a run with init_from (attnlab.state.with_pretrained).
  params = task.load_pretrained(task.init(jax.random.key(3)), bert_run.config, bert_run.params)
  got = jax.tree_util.tree_leaves_with_path(params["encoder"])
  want = dict(jax.tree_util.tree_leaves_with_path(bert_run.params["encoder"]))
  assert len(got) == len(want)
  for path, leaf in got:
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want[path]))
  assert task.tokenizer.kind == "hf"
  ids = task.model.apply({"params": params}, jnp.asarray([[tok for tok in (2, 46, 3)]]))
  assert ids.shape == (1, 2)


@pytest.mark.slow
def test_finetuning_run_from_the_imported_bert(bert_run, shared_data, tmp_path):
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  from attnlab import train  # pylint: disable=g-import-not-at-top
  config = config_utils.load_config_file(
      f"{CONFIGS / 'bert.py'}:mode=finetune,runlocal=True,pretrained={bert_run.workdir},"
      f"num_train_steps=2,eval_every=0,data.manual_dir={shared_data},"
      f"data.data_dir={tmp_path / 'tfds'}")
  workdir = tmp_path / "finetune"
  train.train_and_evaluate(config, workdir)
  last_eval = rundir.last_records(rundir.read_metrics(workdir))["eval"]
  assert last_eval["step"] == 2 and 0.0 <= last_eval["accuracy"] <= 1.0
  assert (workdir / "head_view.png").is_file()
  # SST-2 sentences are encoded with the checkpoint's WordPiece vocabulary and its [CLS]/[SEP].
  task = tasks.build_task(config)
  tokens = next(task.train_iterator())["tokens"]
  assert (tokens[:, 0] == task.tokenizer.cls_id).all() and (tokens == task.tokenizer.sep_id).any()


def test_without_tokenizer_files_prompts_are_ids(tmp_path, capsys):
  folder = tmp_path / "gpt2"
  folder.mkdir()
  for name in ("config.json", "model.safetensors"):
    shutil.copyfile(FIXTURES / "gpt2" / name, folder / name)
  workdir = tmp_path / "run"
  assert import_hf.main(["attnlab import-hf", str(folder), f"--workdir={workdir}"]) == 0
  assert json.loads((workdir / "config.json").read_text())["data"]["tokenizer"] == "ids"
  capsys.readouterr()
  args = ["attnlab generate", f"--workdir={workdir}", "--num_tokens=3", "--temperature=0"]
  assert generate.main(args + ["--prompt=5 17 42"]) == 0
  out = capsys.readouterr().out.split()
  assert out[:3] == ["5", "17", "42"] and len(out) == 6 and all(t.isdigit() for t in out)
  assert generate.main(args + ["--prompt=hello"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "token ids" in err[0]


# ------------------------------------------------------------------------------ bad input


def _import_error(capsys, folder, workdir) -> str:
  status = import_hf.main(["attnlab import-hf", str(folder), f"--workdir={workdir}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, err
  return err[0]


def test_bad_folders_get_one_line(tmp_path, capsys):
  work = tmp_path / "run"
  assert "has no config.json" in _import_error(capsys, tmp_path, work)
  bad = tmp_path / "llama"
  bad.mkdir()
  (bad / "config.json").write_text('{"model_type": "llama"}')
  assert "unsupported model_type 'llama'" in _import_error(capsys, bad, work)
  assert "gpt2, bert" in _import_error(capsys, bad, work)
  (bad / "config.json").write_text((FIXTURES / "gpt2" / "config.json").read_text())
  assert "has no weights" in _import_error(capsys, bad, work)
  run_dir = tmp_path / "attnlab_run"  # an attnlab run directory given by mistake
  (run_dir / "checkpoints").mkdir(parents=True)
  (run_dir / "config.json").write_text('{"task": "causal_lm", "model": {}}')
  assert "is an attnlab run directory, not a Hugging Face checkpoint" in _import_error(
      capsys, run_dir, work)
  assert not work.exists()


def _copy_with(tmp_path, name, edit_config=None, edit_tensors=None) -> pathlib.Path:
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  folder = tmp_path / name
  shutil.copytree(FIXTURES / "gpt2", folder)
  if edit_config:
    config = json.loads((folder / "config.json").read_text())
    edit_config(config)
    (folder / "config.json").write_text(json.dumps(config))
  if edit_tensors:
    tensors = load_file(str(folder / "model.safetensors"))
    edit_tensors(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
  return folder


def test_missing_and_misshapen_tensors(tmp_path, capsys):
  work = tmp_path / "run"
  folder = _copy_with(tmp_path, "missing",
                      edit_tensors=lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
  assert "tensor transformer.h.1.mlp.c_fc.bias is missing" in _import_error(capsys, folder, work)
  folder = _copy_with(tmp_path, "shape", edit_config=lambda c: c.update(n_positions=64))
  line = _import_error(capsys, folder, work)
  assert "transformer.wpe.weight has shape (32, 32)" in line and "(64, 32)" in line
  folder = _copy_with(tmp_path, "act", edit_config=lambda c: c.update(activation_function="silu"))
  assert "activation 'silu'" in _import_error(capsys, folder, work)
  assert not (work / "config.json").exists()
  hf.import_checkpoint(FIXTURES / "gpt2", work)
  assert "already holds a run" in _import_error(capsys, FIXTURES / "gpt2", work)


def test_torch_reader_refuses_other_globals(tmp_path):
  import pickle  # pylint: disable=g-import-not-at-top

  class Evil:
    def __reduce__(self):
      return (print, ("ran",))

  path = tmp_path / "pytorch_model.bin"
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("archive/data.pkl", pickle.dumps({"w": Evil()}, protocol=4))
  with pytest.raises(errors.TorchFileError, match="refusing to load builtins.print"):
    torch_pickle.load_state_dict(path)
  (tmp_path / "plain.bin").write_bytes(pickle.dumps({"w": 1}))
  with pytest.raises(errors.TorchFileError, match="not a zip archive"):
    torch_pickle.load_state_dict(tmp_path / "plain.bin")


def test_export_refuses_architectures_gpt2_lacks(gpt2_run):
  config = gpt2_run.config.copy_and_resolve_references()
  config.model.position = "rotary"
  run = analysis.Run(workdir=gpt2_run.workdir, config=config, task=gpt2_run.task,
                     model=gpt2_run.model, params=gpt2_run.params, step=0)
  with pytest.raises(errors.HFError, match="position=rotary"):
    hf.export(run, gpt2_run.workdir / "unused")


# ------------------------------------------------------------------------------ with transformers


def _spread(model, seed):
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(0.2 * noise if p.ndim >= 2 else
              (1.0 + 0.1 * noise if "weight" in name else 0.1 * noise))


@pytest.mark.slow
@needs_hf
@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_fresh_gpt2_against_transformers(tmp_path, weights):
  config = transformers.GPT2Config(vocab_size=97, n_positions=24, n_embd=24, n_layer=3, n_head=3,
                                   n_inner=48, activation_function="gelu",
                                   layer_norm_epsilon=1e-6)
  torch.manual_seed(5)
  model = transformers.GPT2LMHeadModel(config).eval()
  _spread(model, 5)
  folder = tmp_path / "ckpt"
  model.save_pretrained(folder)
  if weights == "bin":
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")  # with the tied lm_head.weight
  hf.import_checkpoint(folder, tmp_path / "run")
  run = analysis.load_run(tmp_path / "run")
  assert run.config.data.tokenizer == "ids"
  ids = np.random.default_rng(1).integers(0, 97, (3, 24))
  with torch.no_grad():
    want = model(torch.from_numpy(ids)).logits.numpy()
  assert _max_diff(_gpt_logits(run, ids), want) <= TOL
  # Greedy generation with the KV cache matches transformers' generate.
  with torch.no_grad():
    ref = model.generate(torch.from_numpy(ids[:1, :5]), max_new_tokens=8, do_sample=False,
                         pad_token_id=0).numpy()[0, 5:]
  from attnlab.models import gpt  # pylint: disable=g-import-not-at-top
  out = gpt.generate(run.model, run.params, ids[:1, :5], jax.random.key(0), num_tokens=8,
                     temperature=0.0)
  np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref)


@pytest.mark.slow
@needs_hf
def test_fresh_bert_against_transformers(tmp_path):
  config = transformers.BertConfig(vocab_size=83, hidden_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=40,
                                   max_position_embeddings=20, type_vocab_size=3,
                                   layer_norm_eps=1e-7)
  torch.manual_seed(6)
  model = transformers.BertForPreTraining(config).eval()
  _spread(model, 6)
  model.tie_weights()
  folder = tmp_path / "ckpt"
  model.save_pretrained(folder)
  hf.import_checkpoint(folder, tmp_path / "run")
  run = analysis.load_run(tmp_path / "run")
  rng = np.random.default_rng(2)
  ids = rng.integers(1, 83, (2, 20))
  types = rng.integers(0, 3, (2, 20))
  mask = np.ones_like(ids)
  mask[0, 15:] = 0
  with torch.no_grad():
    out = model(torch.from_numpy(ids), token_type_ids=torch.from_numpy(types),
                attention_mask=torch.from_numpy(mask))
  mlm, nsp = _bert_logits(run, ids, types, mask)
  assert _max_diff(mlm, out.prediction_logits.numpy()) <= TOL
  assert _max_diff(nsp, out.seq_relationship_logits.numpy()) <= TOL


@needs_hf
def test_export_round_trip_through_transformers(gpt2_run, bert_run, tmp_path):
  e = np.load(FIXTURES / "gpt2_expected.npz")
  out = hf.export(gpt2_run, tmp_path / "gpt2")
  assert (out / "vocab.json").is_file()
  model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
  with torch.no_grad():
    logits = model(torch.from_numpy(e["input_ids"].astype(np.int64))).logits.numpy()
  assert _max_diff(logits, e["logits"]) <= TOL
  e = np.load(FIXTURES / "bert_expected.npz")
  out = hf.export(str(bert_run.workdir), tmp_path / "bert")
  model = transformers.BertForPreTraining.from_pretrained(out).eval()
  t = lambda k: torch.from_numpy(e[k].astype(np.int64))
  with torch.no_grad():
    got = model(t("input_ids"), token_type_ids=t("token_type_ids"),
                attention_mask=t("attention_mask"))
  assert _max_diff(got.prediction_logits.numpy(), e["mlm_logits"]) <= TOL
  assert _max_diff(got.seq_relationship_logits.numpy(), e["nsp_logits"]) <= TOL
  # And back again: the exported folder imports to the same parameters.
  hf.import_checkpoint(out, tmp_path / "again")
  again = analysis.load_run(tmp_path / "again")
  for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(bert_run.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
