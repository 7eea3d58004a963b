"""GPT on the user's own text (dataset=text) and from a pretrained run (pretrained=DIR, #49)."""

import importlib.util
import json
import pathlib

import jax
import numpy as np
import pytest

from attnlab import analysis
from attnlab import tasks
from attnlab import train
from attnlab.cli import generate as generate_cli
from attnlab.config_utils import ConfigError
from attnlab.data import tokenizers as tok_lib

# A few lines in Shakespeare's characters (the pretrained vocabulary covers them).
LINES = ["First Citizen:", "Before we proceed any further, hear me speak.", "", "All:",
         "Speak, speak.", "", "You are all resolved rather to die than to famish?", ""]


def _load_config(arg=None):
  spec = importlib.util.spec_from_file_location("gpt_config", "configs/gpt.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _evals(run):
  records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  return [r for r in records if r["split"] == "eval"]


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory, shared_data):
  """A runlocal GPT trained on Tiny Shakespeare characters for 4 steps."""
  tmp = tmp_path_factory.mktemp("pretrained")
  config = _load_config(f"runlocal=True,num_train_steps=4,eval_every=4,checkpoint_every=4,"
                        f"data.manual_dir={shared_data},data.data_dir={tmp / 'tfds'},"
                        f"data.eval_windows=8,write_plots=False")
  train.train_and_evaluate(config, tmp / "run")
  return tmp / "run"


def _corpus(tmp_path, repeats=30):
  path = tmp_path / "corpus.txt"
  path.write_text("\n".join(LINES * repeats) + "\n", encoding="utf-8")
  return path


def test_finetune_from_a_pretrained_run(tmp_path, pretrained_run, recording_pretrained_load,
                                       capsys):
  corpus = _corpus(tmp_path)

  arg = (f"runlocal=True,pretrained={pretrained_run},dataset=text,data.path={corpus},"
         f"num_train_steps=3,eval_every=3,checkpoint_every=3,write_plots=False,"
         f"optimizer.learning_rate=3e-3")
  config = _load_config(arg)
  assert config.init_from == str(pretrained_run)
  ft = tmp_path / "ft"
  with recording_pretrained_load() as step0:
    train.train_and_evaluate(config, ft)

  # Step 0 is the pretrained run's final parameters, every array equal.
  pre = analysis.load_run(pretrained_run)
  assert len(step0) == 1
  got, want = _flat(step0[0]), _flat(pre.params)
  assert got.keys() == want.keys() and len(want) > 5
  for key in want:
    assert got[key].shape == want[key].shape and np.array_equal(got[key], want[key]), key
  # ... and training moved them.
  tuned = _flat(analysis.load_run(ft).params)
  assert any(np.abs(tuned[k] - want[k]).max() > 1e-4 for k in want)
  assert np.isfinite(_evals(ft)[-1]["loss"])

  # Token ids mean what they meant in pretraining: the fine-tuned run's tokenizer is the
  # pretrained run's (built from Shakespeare's first 90%), not one built from this corpus.
  s = "Speak, speak. You are all resolved"
  ft_run = analysis.load_run(ft)
  assert ft_run.task.tokenizer.encode(s) == pre.task.tokenizer.encode(s)
  shakespeare = (pathlib.Path(pre.config.data.manual_dir) / "tinyshakespeare" /
                 "input.txt").read_text(encoding="utf-8")
  reference = sorted(set(shakespeare[:int(0.9 * len(shakespeare))]))  # independent char ids
  assert ft_run.task.tokenizer.encode(s) == [7 + reference.index(c) for c in s]
  own = tok_lib.CharTokenizer.train([corpus.read_text()])
  assert own.encode(s) != ft_run.task.tokenizer.encode(s)  # the check above can fail

  # generate works on the fine-tuned run.
  capsys.readouterr()
  assert generate_cli.main(["attnlab generate", f"--workdir={ft}", "--prompt=All:",
                            "--num_tokens=10", "--temperature=0"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("All:") and len(out) == len("All:") + 10 + 1


def test_a_key_that_differs_from_the_pretrained_run_is_refused(tmp_path, pretrained_run):
  corpus = _corpus(tmp_path, 3)
  for extra, named in (("model.num_layers=3", "model.num_layers: 2 in the pretraining run, 3"),
                       ("score=cosine", "model.attention.score"),
                       ("dataset=addition", "data.name")):
    config = _load_config(f"runlocal=True,pretrained={pretrained_run},dataset=text,"
                          f"data.path={corpus},{extra}")
    with pytest.raises(ConfigError) as e:
      train.train_and_evaluate(config, tmp_path / "ft")
    message = str(e.value)
    assert named in message and "\n" not in message, message
    assert not (tmp_path / "ft").exists()  # refused before anything was written
  # init_from alone, without the shortcut: the default nano architecture is refused too.
  config = _load_config(f"dataset=text,data.path={corpus}")
  config.init_from = str(pretrained_run)
  with pytest.raises(ConfigError, match="model.num_layers: 2 in the pretraining run, 4 here"):
    train.train_and_evaluate(config, tmp_path / "ft")
  # A character the pretrained vocabulary lacks is named.
  odd = tmp_path / "odd.txt"
  odd.write_text("Speak, speak. " * 40 + "\u20ac\n", encoding="utf-8")
  config = _load_config(f"runlocal=True,pretrained={pretrained_run},dataset=text,"
                        f"data.path={odd}")
  with pytest.raises(ConfigError, match="outside the pretrained run's .* '\u20ac'"):
    tasks.build_task(config).train_iterator()
  with pytest.raises(ConfigError, match="no config.json there"):
    _load_config(f"pretrained={tmp_path}")  # no config.json there


def test_text_corpus_split_vocabulary_and_training(tmp_path):
  folder = tmp_path / "texts"
  folder.mkdir()
  (folder / "b.txt").write_text("alpha beta gamma\n" * 20, encoding="utf-8")
  (folder / "a.txt").write_text("the first file\nends here", encoding="utf-8")
  (folder / "notes.md").write_text("not read", encoding="utf-8")
  whole = "the first file\nends here\n" + "alpha beta gamma\n" * 20  # sorted; newline added
  cut = int(0.9 * len(whole))

  config = _load_config(f"runlocal=True,dataset=text,data.path={folder},num_train_steps=4,"
                        f"eval_every=4,checkpoint_every=4,write_plots=False,"
                        f"model.block_size=16")
  task = tasks.build_task(config)
  train_text, val_text = task._texts()  # pylint: disable=protected-access
  assert train_text == whole[:cut] and val_text == whole[cut:]
  assert len(train_text) == 328 and len(val_text) == 37 and len(whole) == 365
  # The vocabulary: the 7 special tokens, then each character of the training part once.
  chars = sorted(set(whole[:cut]))
  assert len(task.tokenizer) == 7 + len(chars)
  assert sorted(task.tokenizer.id_to_token(i) for i in range(7, len(task.tokenizer))) == chars
  task._text_ids()  # pylint: disable=protected-access
  assert task.tokenizer.decode(task.val_ids.tolist()) == val_text

  run = tmp_path / "run"
  train.train_and_evaluate(config, run)
  final = _evals(run)[-1]
  assert final["step"] == 4 and np.isfinite(final["loss"])
  assert final["loss"] < np.log(len(task.tokenizer)) + 1.0


def test_text_corpus_errors_are_one_line(tmp_path):
  def error(arg):
    with pytest.raises(ConfigError) as e:
      tasks.build_task(_load_config(f"runlocal=True,dataset=text{arg}")).train_iterator()
    assert "\n" not in str(e.value)
    return str(e.value)
  assert "needs data.path" in error("")
  assert "does not exist" in error(f",data.path={tmp_path / 'missing.txt'}")
  (tmp_path / "empty.txt").write_text("")
  assert "holds no text" in error(f",data.path={tmp_path / 'empty.txt'}")
  (tmp_path / "empty_dir").mkdir()
  assert "without *.txt files" in error(f",data.path={tmp_path / 'empty_dir'}")
  (tmp_path / "latin1.txt").write_bytes(b"ok\ncaf\xe9\n")
  assert "latin1.txt:2: invalid UTF-8" in error(f",data.path={tmp_path / 'latin1.txt'}")
  # A character only in the held-out tail is outside a vocabulary built from the first 90%.
  (tmp_path / "tail.txt").write_text("abc\n" * 50 + "zz\n", encoding="utf-8")
  message = error(f",data.path={tmp_path / 'tail.txt'}")
  assert "validation text has 1 character outside" in message and "'z'" in message
