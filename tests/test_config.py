"""Config args, config errors and the command-line error paths (one line, non-zero status)."""

import os
import pathlib
import subprocess
import sys

import pytest

from attnlab import cli
from attnlab import config_utils
from attnlab import main as main_lib
from attnlab import tasks

REPO = pathlib.Path(__file__).resolve().parents[1]
NW = str(REPO / "configs" / "nadaraya_watson.py")


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


def test_config_diff_lists_changed_keys():
  a = config_utils.load_config_file(NW)
  b = config_utils.load_config_file(f"{NW}:seed=3,allow_config_change=True")
  assert config_utils.config_diff(a, b) == ["seed: 0 -> 3"]
  # A config.json written before optimizer.decay existed reads as its old behaviour ("all").
  old = a.to_dict()
  del old["optimizer"]["decay"]
  assert config_utils.config_diff(old, a) == []
  b = config_utils.load_config_file(f"{NW}:optimizer.decay=matrices")
  assert config_utils.config_diff(old, b) == ["optimizer.decay: 'all' -> 'matrices'"]


@pytest.mark.parametrize("flags_, expected", [
    ([f"--config={NW}:runlocal=True,modle.kernel=x"], "unknown config key 'modle.kernel'"),
    ([f"--config={NW}:num_train_steps=abc"], "config key 'num_train_steps' expects an int"),
    ([f"--config={NW}", "--config.num_train_steps=abc"], "expects an int, got 'abc'"),
    ([f"--config={NW}", "--config.nokey=1"], "unknown config key 'nokey'; valid keys:"),
    (["--config=configs/missing.py"], "config file 'configs/missing.py' not found"),
    ([f"--config={NW}:model.kernel=cubic"], "unknown model.kernel 'cubic'; valid kernels"),
    (["--bogus=1"], "Unknown command line flag 'bogus'"),
])
def test_cli_errors_are_one_line(flags_, expected, tmp_path, capsys):
  # Through the console-script dispatcher, exactly as `attnlab train ...` runs it.
  status = cli.main(["attnlab", "train", *flags_, f"--workdir={tmp_path / 'run'}"])
  err = capsys.readouterr().err.strip()
  assert status == main_lib.USAGE_ERROR
  assert len(err.splitlines()) == 1, err
  assert err.startswith("attnlab train: error: ") and expected in err


def test_python_dash_m_error_exits_non_zero_without_traceback(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run(
      [sys.executable, "-m", "attnlab.main", f"--config={NW}:runlocal=True,seed=x",
       f"--workdir={tmp_path}"], capture_output=True, text=True, env=env, timeout=120, check=False)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "attnlab.main: error: config key 'seed' expects an int, got 'x'"]
