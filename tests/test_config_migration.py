"""Runs written before the attention subtree existed (#47): their config.json has the flat keys
model.mechanism, model.score, model.window, ... (0 meaning "the mechanism's default"). They read
into model.attention (run_config.from_jsonable, attention.config.migrate_flat_keys), build the
same AttentionConfig from their run directory, and resume without a config change.

The fixtures tests/fixtures/old_configs/<family>.json are config.json files in the old flat
layout, written once from the configs of the time (they must not be regenerated from today's
config files: they stand for runs that exist)."""

import json
import pathlib
import re
import shutil

import pytest

from attnlab import rundir
from attnlab import config_utils
from attnlab import run_config
from attnlab import models
from attnlab.attention.config import AttentionConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
OLD_CONFIGS = pathlib.Path(__file__).resolve().parent / "fixtures" / "old_configs"

# The flat attention keys of the old layout (model.<key>).
FLAT_KEYS = ("score", "implementation", "mechanism", "normalizer", "topk", "num_kv_heads",
             "talking_heads", "window", "num_features", "linformer_k", "sparse_block")

# family -> (the config arg that builds the same run today, the model.attention values it has,
# the AttentionConfig both give).
FAMILIES = {
    "gpt": ("gpt.py:runlocal=True,mechanism=sliding_window,"
            "model.attention.sliding_window.window=8",
            {"mechanism": "sliding_window", "sliding_window.window": 8},
            AttentionConfig(mechanism="sliding_window", options={"window": 8})),
    "bert": ("bert.py:mode=pretrain,runlocal=True,mechanism=bigbird,"
             "model.attention.bigbird.block=16",
             {"mechanism": "bigbird", "bigbird.block": 16},
             AttentionConfig(mechanism="bigbird", options={"block": 16})),
    "transformer": ("transformer.py:task=reverse,score=additive,model.attention.num_kv_heads=1",
                    {"mechanism": "full", "score": "additive", "num_kv_heads": 1},
                    AttentionConfig(score="additive", num_kv_heads=1)),
    # The old LRA config set window 64, num_features 64 and linformer_k 64 (here 32) itself.
    "lra": ("lra.py:task=listops,mechanism=linformer,model.attention.linformer.projected_len=32",
            {"mechanism": "linformer", "linformer.projected_len": 32,
             "performer.num_features": 64, "sliding_window.window": 64},
            AttentionConfig(mechanism="linformer", options={"projected_len": 32})),
}


def _old(family):
  """The stored config.json of an older run (flat keys)."""
  return json.loads((OLD_CONFIGS / f"{family}.json").read_text())


def _fresh(family):
  """The same run's config as the config file builds it today (model.attention)."""
  return config_utils.load_config_file(str(CONFIGS / FAMILIES[family][0]))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_fixtures_are_in_the_old_flat_layout(family):
  model = _old(family)["model"]
  assert "attention" not in model
  assert {"score", "implementation", "mechanism", "window", "num_features", "linformer_k",
          "sparse_block"} <= set(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_jsonable_moves_the_flat_keys_into_model_attention(family):
  old = _old(family)
  migrated = run_config.from_jsonable(old)
  model = migrated.model
  assert not set(FLAT_KEYS) & set(model), sorted(set(FLAT_KEYS) & set(model))
  assert isinstance(model.attention, config_utils.ConfigDict)
  flat = config_utils.flatten(model.attention)
  _, values, _ = FAMILIES[family]
  for key, value in values.items():
    assert flat[key] == value, (key, flat.get(key))
  # The keys that were the same before keep their values; nothing else of the config changes.
  rest = {k: v for k, v in old["model"].items() if k not in FLAT_KEYS}
  assert {k: v for k, v in run_config.to_jsonable(model).items() if k != "attention"} == rest
  assert {k: v for k, v in run_config.to_jsonable(migrated).items() if k != "model"} == {
      k: v for k, v in old.items() if k != "model"}
  # A flat 0 meant "the mechanism's default": it is not carried over as a value (today 0 is
  # refused where it means nothing), so the migrated config passes validation.
  for key in ("sliding_window.window", "bigbird.block", "performer.num_features",
              "linformer.projected_len"):
    assert flat.get(key, 1) != 0, key
  config_utils.validate(migrated)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_run_directory_gives_the_same_attention_config(family, tmp_path):
  shutil.copy(OLD_CONFIGS / f"{family}.json", tmp_path / rundir.CONFIG_FILE)
  stored = rundir.read_config(tmp_path)  # config.json only: no checkpoint, no assets
  _, _, expected = FAMILIES[family]
  got = models.attention_config(stored.model)
  assert got == expected
  assert got == models.attention_config(_fresh(family).model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_migrated_old_config_equals_a_freshly_built_one(family):
  """No config_diff between the old run and the same run built today: it resumes without
  allow_config_change (rundir.prepare_workdir, train._own_assets)."""
  migrated = run_config.from_jsonable(_old(family))
  fresh = _fresh(family)
  assert run_config.config_diff(migrated.to_dict(), fresh) == []
  assert run_config.config_diff(_old(family), fresh) == []  # the raw config.json as well


@pytest.mark.parametrize("key", ["model." + k for k in FLAT_KEYS])
def test_an_old_flat_key_in_an_arg_names_its_new_key(key):
  with pytest.raises(config_utils.ConfigError) as e:
    config_utils.load_config_file(f"{CONFIGS / 'gpt.py'}:{key}=1")
  message = str(e.value)
  new = run_config.MOVED_ATTENTION_KEYS[key]
  assert message == (f"config key {key!r} is now {new!r} (the attention options live in "
                     f"model.attention)")
  assert re.fullmatch(r"model\.attention\.[a-z_.]+( \(or [a-z_.]+\))?", new), new


def test_the_rnn_keeps_its_flat_score_and_its_attention_variant():
  """configs/seq2seq.py is not a Transformer family: model.score and model.attention
  (bahdanau, luong, none) stay what they were, in args and in a stored config.json."""
  config = config_utils.load_config_file(f"{CONFIGS / 'seq2seq.py'}:model.score=general,"
                                         "model.attention=luong")
  assert (config.model.score, config.model.attention) == ("general", "luong")
  stored = run_config.to_jsonable(config)
  assert run_config.to_jsonable(run_config.from_jsonable(stored)) == stored
  assert run_config.config_diff(stored, config) == []
