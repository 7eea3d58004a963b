"""Config args, config errors and the command-line error paths (one line, non-zero status)."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from attnlab import cli
from attnlab import config_utils
from attnlab import run_config
from attnlab import tasks
from attnlab.cli import tool

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
NW = str(CONFIGS / "nadaraya_watson.py")
GPT = str(CONFIGS / "gpt.py")
SEQ2SEQ = str(CONFIGS / "seq2seq.py")


def test_args_are_typed_from_defaults_and_nested_keys_work():
  config = config_utils.load_config_file(
      f"{NW}:num_train_steps=7,optimizer.learning_rate=3e-3,write_plots=false,"
      f"model.kernel=gaussian,data.x_max=5")
  assert config.num_train_steps == 7 and isinstance(config.num_train_steps, int)
  assert config.optimizer.learning_rate == 0.003
  assert config.write_plots is False
  assert config.model.kernel == "gaussian"
  assert config.data.x_max == 5.0 and isinstance(config.data.x_max, float)


def test_tuple_values_keep_their_commas():
  config = config_utils.base_config()
  config.model.dims = (1, 2)
  config_utils.finalize(config, "model.dims=(3,4,5),seed=2")
  assert config.model.dims == (3, 4, 5) and config.seed == 2


def test_runlocal_shrinks_and_explicit_args_win():
  default = config_utils.load_config_file(NW)
  local = config_utils.load_config_file(f"{NW}:runlocal=True")
  assert default.num_train_steps == 200 and local.num_train_steps == 20
  assert local.data.num_train == 50 and local.batch_size == 8
  explicit = config_utils.load_config_file(f"{NW}:runlocal=True,num_train_steps=33")
  assert explicit.num_train_steps == 33


@pytest.mark.parametrize("arg, expected", [
    ("modle.kernel=x", "unknown config key 'modle.kernel' (did you mean 'model.kernel'?)"),
    ("num_train_steps=abc", "config key 'num_train_steps' expects an int, got 'abc'"),
    ("runlocal=maybe", "config key 'runlocal' expects a bool"),
    ("model=3", "config key 'model' is a group"),
    ("justakey", "is not key=value"),
])
def test_bad_args_raise_config_error(arg, expected):
  with pytest.raises(config_utils.ConfigError) as info:
    config_utils.load_config_file(f"{NW}:{arg}")
  assert expected in str(info.value)
  if "unknown" in expected:
    assert "valid keys: " in str(info.value) and "model.kernel" in str(info.value)


def test_validate_and_unknown_task():
  config = config_utils.load_config_file(NW)
  config.optimizer.name = "lion"
  with pytest.raises(config_utils.ConfigError, match="valid optimizers: adamw, adam, sgd"):
    config_utils.validate(config)
  with pytest.raises(ValueError, match=r"unknown task 'nope'; valid tasks: .*regression"):
    tasks.get_task("nope")
  assert tasks.get_task("regression").name == "regression"


@pytest.mark.parametrize("key, value, expected", [
    ("buckets", ("a",), "data.buckets must be ints >= 1"),
    ("buckets", (8, 0), "data.buckets must be ints >= 1"),
    ("buckets", (6.5,), "data.buckets must be ints >= 1"),
    ("length_bins", (True,), "data.length_bins must be ints >= 1"),
    ("length_bins", (10, 5), "data.length_bins must increase"),
])
def test_length_lists_are_checked_item_by_item(key, value, expected):
  # Their defaults are empty, so the type check of config.json cannot see the items' type.
  config = config_utils.load_config_file(SEQ2SEQ)
  config.data[key] = value
  with pytest.raises(config_utils.ConfigError, match=expected):
    config_utils.validate(config)
  config.data[key] = (4, 8)  # fine
  config_utils.validate(config)


def test_config_diff_lists_changed_keys():
  a = config_utils.load_config_file(NW)
  b = config_utils.load_config_file(f"{NW}:seed=3,allow_config_change=True")
  assert run_config.config_diff(a, b) == ["seed: 0 -> 3"]
  # A config.json written before optimizer.decay existed reads as its old behaviour ("all").
  old = a.to_dict()
  del old["optimizer"]["decay"]
  assert run_config.config_diff(old, a) == []
  b = config_utils.load_config_file(f"{NW}:optimizer.decay=matrices")
  assert run_config.config_diff(old, b) == ["optimizer.decay: 'all' -> 'matrices'"]


# ----------------------------------------------------------------------------- shortcuts

# config file -> (an arg with shortcuts, the same arg with full keys).
SHORTCUT_ARGS = {
    "gpt.py": ("size=small,score=cosine,implementation=reference,mechanism=sliding_window,"
               "dataset=addition,tokenizer=subword",
               "model.size=small,model.attention.score=cosine,"
               "model.attention.implementation=reference,"
               "model.attention.mechanism=sliding_window,data.name=addition,"
               "data.tokenizer=subword"),
    "seq2seq.py": ("task=reverse,attention=luong,score=general",
                   "data.name=reverse,model.attention=luong,model.score=general"),
    "transformer.py": ("dataset=reverse,size=tiny,score=additive,implementation=reference,"
                       "mechanism=bigbird",
                       "data.name=reverse,model.size=tiny,model.attention.score=additive,"
                       "model.attention.implementation=reference,"
                       "model.attention.mechanism=bigbird"),
    # mode= picks the task and its defaults: there is no full key for it.
    "bert.py": ("mode=finetune,size=mini,score=additive,implementation=reference,"
                "mechanism=sliding_window",
                "mode=finetune,model.num_layers=4,model.d_model=256,model.num_heads=4,"
                "model.mlp_dim=1024,model.attention.score=additive,"
                "model.attention.implementation=reference,"
                "model.attention.mechanism=sliding_window"),
    "nadaraya_watson.py": ("kernel=gaussian", "model.kernel=gaussian"),
    # dataset= and tokenizer= pick the defaults of the data set and the tokenizer.
    "classify.py": ("dataset=cue_word,tokenizer=char,pooling=mean,cell=lstm",
                    "data.name=cue_word,data.tokenizer=char,model.pooling=mean,model.cell=lstm"),
    # scale= picks the defaults (like BERT's mode=): there is no full key for it.
    "lra.py": ("task=imdb_bytes,mechanism=full,score=cosine,implementation=reference",
               "data.name=imdb_bytes,model.attention.mechanism=full,"
               "model.attention.score=cosine,model.attention.implementation=reference"),
}


def _config_module(name, monkeypatch):
  del monkeypatch
  spec = importlib.util.spec_from_file_location(f"test_config_{name[:-3]}", CONFIGS / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_config_file_declares_its_shortcuts_with_the_shared_meanings(monkeypatch):
  # configs/_*.py are the config files' helper modules (_translation.py), not config files
  assert sorted(p.name for p in CONFIGS.glob("[!_]*.py")) == sorted(SHORTCUT_ARGS)
  for name in SHORTCUT_ARGS:
    table = _config_module(name, monkeypatch).SHORTCUTS
    assert table, name
    for short, target in table.items():
      if short in config_utils.SHORTCUTS and not callable(target):
        assert target == config_utils.SHORTCUTS[short], (name, short)
  with pytest.raises(ValueError, match=r"shortcut 'score' means .*model\.attention\.score.* in "
                                       r"every config file; give model\.kernel another"):
    config_utils.shortcut_table(score="model.kernel")


@pytest.mark.parametrize("name", sorted(SHORTCUT_ARGS))
def test_shortcuts_equal_their_full_keys(name):
  short, full = SHORTCUT_ARGS[name]
  with_shortcuts = config_utils.load_config_file(f"{CONFIGS / name}:{short}")
  with_keys = config_utils.load_config_file(f"{CONFIGS / name}:{full}")
  assert with_shortcuts.to_dict() == with_keys.to_dict()
  assert with_shortcuts.to_dict() != config_utils.load_config_file(str(CONFIGS / name)).to_dict()
  config_utils.validate(with_shortcuts)


def test_dataset_shortcuts_pick_the_dataset_presets():
  marathi = config_utils.load_config_file(f"{SEQ2SEQ}:data.name=marathi").to_dict()
  for arg in ("task=marathi", "dataset=marathi"):
    assert config_utils.load_config_file(f"{SEQ2SEQ}:{arg}").to_dict() == marathi
  assert marathi["data"]["tokenizer"] == "word" and marathi["num_train_steps"] == 4000
  tf = config_utils.load_config_file(f"{CONFIGS / 'transformer.py'}:dataset=marathi")
  assert tf.data.name == "marathi" and tf.model.size == "medium"
  assert config_utils.load_config_file(f"{GPT}:task=addition").data.name == "addition"
  with pytest.raises(config_utils.ConfigError,
                     match="unknown data.name 'nope'; valid datasets: dates, marathi, reverse"):
    config_utils.load_config_file(f"{SEQ2SEQ}:task=nope")


def test_seq2seq_attention_none_shortcut():
  config = config_utils.load_config_file(f"{SEQ2SEQ}:attention=none,runlocal=True")
  assert config.model.attention == "none" and config.runlocal
  config_utils.validate(config)
  from attnlab import models  # pylint: disable=g-import-not-at-top
  model = models.from_config("seq2seq")(config.model, 12, 12, 10)
  assert model.attention == "none"


def test_unknown_shortcut_is_one_line_naming_shortcuts_and_keys():
  with pytest.raises(config_utils.ConfigError) as info:
    config_utils.load_config_file(f"{GPT}:sise=small")
  message = str(info.value)
  assert len(message.splitlines()) == 1
  assert message.startswith("unknown config key 'sise' (did you mean 'size'?); shortcuts: "
                            "size (= model.size), score (= model.attention.score), ")
  assert "; valid keys: " in message and "model.dropout_rate" in message
  with pytest.raises(config_utils.ConfigError, match="unknown mode 'train'; valid modes"):
    config_utils.load_config_file(f"{CONFIGS / 'bert.py'}:mode=train")
  with pytest.raises(config_utils.ConfigError, match="pretrained=DIR goes with mode=finetune"):
    config_utils.load_config_file(f"{CONFIGS / 'bert.py'}:pretrained=/nowhere")


def test_score_and_implementation_are_validated_once_where_the_config_is_read():
  for arg, expected in [
      ("score=fancy",
       "unknown model.attention.score 'fancy'; valid scores: dot, scaled_dot, cosine"),
      ("implementation=fast",
       "unknown model.attention.implementation 'fast'; valid implementations: "),
      ("score=cosine,model.attention.implementation=xla",
       "model.attention.implementation=xla supports only the scores dot, scaled_dot, not "
       "'cosine'"),
  ]:
    config = config_utils.load_config_file(f"{GPT}:{arg}")  # reading does not check the name
    with pytest.raises(config_utils.ConfigError, match=expected):
      config_utils.validate(config)
  seq2seq = config_utils.load_config_file(f"{SEQ2SEQ}:score=bilinear")
  with pytest.raises(config_utils.ConfigError, match="unknown model.score 'bilinear'"):
    config_utils.validate(seq2seq)
  config_utils.validate(config_utils.load_config_file(NW))  # no score: nothing to check


# ----------------------------------------------------------------------------- renamed keys

# Keys as older versions wrote them in config.json, per config file.
OLD_KEYS = {
    "gpt.py": {"model.dropout": "model.dropout_rate",
               "model.attention_dropout": "model.attention_dropout_rate",
               "data.num_train_examples": "data.num_train",
               "data.num_eval_examples": "data.num_eval"},
    "bert.py:mode=finetune": {"data.max_train_examples": "data.num_train",
                              "data.max_eval_examples": "data.num_eval"},
    "bert.py:mode=pretrain": {"data.num_eval_examples": "data.num_eval"},
}


@pytest.mark.parametrize("spec", sorted(OLD_KEYS))
def test_old_config_json_loads_with_the_current_key_names(spec, tmp_path):
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  current = config_utils.load_config_file(str(CONFIGS / spec))
  stored = run_config.to_jsonable(current)
  for old, new in OLD_KEYS[spec].items():  # write the file as an older version did
    (old_group, old_leaf), (new_group, new_leaf) = old.split("."), new.split(".")
    stored[old_group][old_leaf] = stored[new_group].pop(new_leaf) + 1
  (tmp_path / "config.json").write_text(json.dumps(stored))
  loaded = rundir.read_config(tmp_path)
  flat = config_utils.flatten(loaded)
  for old, new in OLD_KEYS[spec].items():
    assert old not in flat and flat[new] == config_utils.get_value(current, new) + 1
  # Same values under the current names: the run resumes without allow_config_change.
  for new in OLD_KEYS[spec].values():
    config_utils.set_value(current, new, flat[new])
  assert run_config.config_diff(loaded, current) == []
  rundir.prepare_workdir(tmp_path, current)


def test_old_key_on_the_command_line_names_the_new_one():
  with pytest.raises(config_utils.ConfigError,
                     match="config key 'model.dropout' is now called 'model.dropout_rate'"):
    config_utils.load_config_file(f"{GPT}:model.dropout=0.1")


@pytest.mark.parametrize("flags_, expected", [
    ([f"--config={NW}:runlocal=True,modle.kernel=x"], "unknown config key 'modle.kernel'"),
    ([f"--config={NW}:num_train_steps=abc"], "config key 'num_train_steps' expects an int"),
    ([f"--config={NW}", "--config.num_train_steps=abc"], "expects an int, got 'abc'"),
    ([f"--config={NW}", "--config.nokey=1"], "unknown config key 'nokey'; valid keys:"),
    (["--config=configs/missing.py"], "config file 'configs/missing.py' not found"),
    ([f"--config={NW}:model.kernel=cubic"], "unknown model.kernel 'cubic'; valid kernels"),
    ([f"--config={NW}:kernl=gaussian"], "unknown config key 'kernl' (did you mean 'kernel'?); "
                                        "shortcuts: kernel (= model.kernel); valid keys: "),
    ([f"--config={GPT}", "--config.model.dropout=0.1"],
     "config key 'model.dropout' is now called 'model.dropout_rate'"),
    ([f"--config={GPT}:runlocal=True,score=fancy"],
     "unknown model.attention.score 'fancy'; valid scores"),
    (["--bogus=1"], "Unknown command line flag 'bogus'"),
])
def test_cli_errors_are_one_line(flags_, expected, tmp_path, capsys):
  # Through the console-script dispatcher, exactly as `attnlab train ...` runs it.
  status = cli.main(["attnlab", "train", *flags_, f"--workdir={tmp_path / 'run'}"])
  err = capsys.readouterr().err.strip()
  assert status == tool.USAGE_ERROR
  assert len(err.splitlines()) == 1, err
  assert err.startswith("attnlab train: error: ") and expected in err


def test_python_dash_m_error_exits_non_zero_without_traceback(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "attnlab.cli.train", f"--config={NW}:runlocal=True,seed=x",
       f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "attnlab.cli.train: error: config key 'seed' expects an int, got 'x'"]
