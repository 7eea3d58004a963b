"""A GPT-2 from `transformers`, imported, fine-tuned on a text file and exported back (#49), all
offline: a tiny random GPT2LMHeadModel and a byte-level BPE tokenizer trained with `tokenizers`
on a few lines stand in for a downloaded checkpoint (the GPT-2 file layout: config.json,
model.safetensors, vocab.json, merges.txt).

One module-scoped chain serves every test: `checkpoint` (the folder) -> `imported` (attnlab
import-hf) -> `tuned` (configs/gpt.py:pretrained=IMPORTED,dataset=text,data.path=FILE).
"""

import json
import pathlib

import numpy as np
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import train
from attnlab.cli import generate as generate_cli
from attnlab.cli import import_hf

torch = pytest.importorskip("torch", reason="needs torch and transformers: pip install "
                            "torch==2.13.0 && pip install -e \".[test,hf]\"")
transformers = pytest.importorskip("transformers")
hf_tokenizers = pytest.importorskip("tokenizers")

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "gpt.py"
LINES = ["The quick brown fox jumps over the lazy dog.",
         "A journey of a thousand miles begins with a single step.",
         "To be, or not to be, that is the question.",
         "All that glitters is not gold; all who wander are not lost.",
         "Speak, speak: you are all resolved rather to die than to famish?",
         "Before we proceed any further, hear me speak."]
VOCAB = 300
STEPS = 8
TOL = 1e-4  # |attnlab - transformers| on logits and losses (float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(folder, model): a random 2-layer GPT-2 and its BPE files, as save_pretrained lays them."""
  folder = tmp_path_factory.mktemp("gpt2")
  bpe = hf_tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator(LINES * 4, vocab_size=VOCAB, min_frequency=1,
                          special_tokens=["<|endoftext|>"], show_progress=False)
  bpe.save_model(str(folder))  # vocab.json, merges.txt
  assert bpe.get_vocab_size() == VOCAB
  config = transformers.GPT2Config(
      vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
      embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1, bos_token_id=0, eos_token_id=0)
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(config).eval()
  model.save_pretrained(folder)
  return folder, model


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("text") / "corpus.txt"
  path.write_text("\n".join(LINES * 8) + "\n", encoding="utf-8")
  return path


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("imported") / "run"
  assert import_hf.main(["attnlab import-hf", str(checkpoint[0]), f"--workdir={workdir}"]) == 0
  return workdir


def _tuned_config(imported, corpus):
  # float32 steps: the first step's loss is checked against transformers' to 1e-4, and bfloat16
  # operands (matmul_precision=auto on a CPU with AVX512_BF16) move it by about that much.
  return config_utils.load_config_file(
      f"{CONFIG}:runlocal=True,pretrained={imported},dataset=text,data.path={corpus},"
      f"num_train_steps={STEPS},log_every=1,eval_every={STEPS},checkpoint_every={STEPS},"
      f"optimizer.learning_rate=3e-3,write_plots=False,matmul_precision=float32")


@pytest.fixture(scope="module")
def tuned(imported, corpus, tmp_path_factory, recording_pretrained_load):
  """(workdir, step-0 parameters) of the fine-tuning run."""
  workdir = tmp_path_factory.mktemp("tuned") / "run"
  with recording_pretrained_load() as step0:
    train.train_and_evaluate(_tuned_config(imported, corpus), workdir)
  return workdir, step0[0]


def _train_losses(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [r["loss"] for r in records if r["split"] == "train"]


def test_the_text_is_tokenized_with_the_imported_bpe(checkpoint, imported, tuned, corpus):
  reference = transformers.AutoTokenizer.from_pretrained(checkpoint[0])
  assert sorted(p.name for p in (imported / "assets" / "tokenizer").iterdir()) == [
      "merges.txt", "vocab.json"]
  run = analysis.load_run(tuned[0])
  assert run.config.data.tokenizer == "hf" and len(run.task.tokenizer) == VOCAB
  # The fine-tuned run keeps its own copy of the BPE files.
  assert run.task.tokenizer.directory == tuned[0] / "assets" / "tokenizer"
  text = "Speak, speak: the quick fox is not lost!"
  assert run.task.tokenizer.encode(text) == reference(text)["input_ids"]
  whole = corpus.read_text(encoding="utf-8")
  run.task._text_ids()  # pylint: disable=protected-access
  assert run.task.train_ids.tolist() == reference(whole[:int(0.9 * len(whole))])["input_ids"]


def test_the_first_step_sees_the_transformers_logits(checkpoint, tuned):
  model = checkpoint[1]
  workdir, step0 = tuned
  task = analysis.load_run(workdir).task
  batch = next(task.train_iterator())  # the trainer's first batch (drawn from seed and step)
  with torch.no_grad():
    want = model(torch.from_numpy(batch["inputs"].astype(np.int64))).logits.numpy()
  got = np.asarray(task.model.apply({"params": step0}, batch["inputs"]))
  assert got.shape == want.shape and np.ptp(want) > 1.0
  assert np.abs(got - want).max() <= TOL
  # The loss the trainer logged for step 1 is transformers' cross-entropy on that batch.
  top = want.max(-1, keepdims=True)
  logp = want - top - np.log(np.exp(want - top).sum(-1, keepdims=True))  # log-softmax
  reference = -np.take_along_axis(logp, batch["targets"][..., None], -1).mean()
  assert abs(_train_losses(workdir)[0] - reference) <= TOL


def test_finetuning_lowers_the_loss_and_generates(tuned, capsys):
  workdir, _ = tuned
  losses = _train_losses(workdir)
  assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, losses
  capsys.readouterr()
  assert generate_cli.main(["attnlab generate", f"--workdir={workdir}", "--prompt=To be",
                            "--num_tokens=5", "--temperature=0"]) == 0
  assert capsys.readouterr().out.startswith("To be")


def test_the_finetuned_run_exports_back_to_transformers(tuned, tmp_path):
  workdir, _ = tuned
  out = tmp_path / "exported"
  assert import_hf.main(["attnlab import-hf", str(workdir), f"--export_to={out}"]) == 0
  model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  run = analysis.load_run(workdir)
  text = "All that glitters is not gold."
  ids = np.asarray([run.task.tokenizer.encode(text)])
  assert ids[0].tolist() == tokenizer(text)["input_ids"]
  with torch.no_grad():
    want = model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
  got = np.asarray(run.model.apply({"params": run.params}, ids))
  assert np.ptp(want) > 1.0 and np.abs(got - want).max() <= TOL
