"""A mechanism of the user's own, registered from a file outside attnlab/ (tests/plugins/), trains
in GPT, BERT and the Transformer by config, is refused in one line where it does not compose,
sweeps, is seen by the analysis tools and the viewer, and reloads from its run directory; the
README's and the registry's capability tables are the registry's."""

import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from attnlab import config_utils
from attnlab import sweep
from attnlab.attention import registry
from attnlab.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
PLUGIN = REPO / "tests" / "plugins" / "cosine_temperature.py"
USE = f"model.attention.plugins={PLUGIN},mechanism=cosine_temperature"


def _table(text: str) -> str:
  begin, end = "<!-- mechanisms:begin -->\n", "<!-- mechanisms:end -->"
  assert begin in text and end in text
  return text[text.index(begin) + len(begin):text.index(end)].strip()


def test_readme_and_registry_tables_are_generated_from_the_registry():
  table = registry.capability_table()
  assert _table((REPO / "README.md").read_text(encoding="utf-8")) == table
  assert _table(registry.__doc__) == table
  assert table.count("\n") == 1 + len(registry.MECHANISMS)  # header, rule, one row each
  assert "| sliding_window | Beltagy et al. 2020 | window=64, block=0 | yes | yes | yes |" in table


def test_plugin_function_matches_numpy():
  registry.load_plugins(str(PLUGIN))
  entry = registry.get_mechanism("cosine_temperature")
  assert entry.module != "attnlab" and "attnlab" not in str(PLUGIN.relative_to(REPO).parts[0])
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(2, 3, 5, 4)).astype(np.float32) for _ in range(3))
  params = entry.init(None, 3, 4, 5, init_temperature=4.0)
  context, weights = entry.fn(q, k, v, causal=True, params=params, return_weights=True)
  # NumPy: softmax over j <= i of 4 * cos(q_i, k_j)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  logits = 4.0 * np.einsum("bhqd,bhkd->bhqk", unit(q), unit(k))
  logits = np.where(np.tril(np.ones((5, 5), bool)), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  np.testing.assert_allclose(weights, w, atol=1e-5)
  np.testing.assert_allclose(context, np.einsum("bhqk,bhkd->bhqd", w, v), atol=1e-5)


def test_plugin_options_are_config_keys_and_refused_in_one_line():
  config = config_utils.load_config_file(
      f"{CONFIGS / 'gpt.py'}:{USE},model.attention.cosine_temperature.init_temperature=5.0")
  config_utils.validate(config)
  assert config.model.attention.cosine_temperature.init_temperature == 5.0
  assert config.model.attention.plugins == str(PLUGIN)  # absolute: the run reloads from anywhere
  for arg, message in [
      ("position=alibi", "never forms the scores that position alibi/t5_bias adds a bias to"),
      ("score=cosine", "composes with the scores scaled_dot, not 'cosine'"),
      ("model.attention.cosine_temperature.init_temperature=0.0", "init_temperature must be > 0"),
  ]:
    arg = arg.replace("position=", "model.position=")
    with pytest.raises(ConfigError) as info:
      config_utils.validate(config_utils.load_config_file(f"{CONFIGS / 'gpt.py'}:{USE},{arg}"))
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1


def test_plugin_sweeps_beside_the_built_in_mechanisms():
  base, axes = sweep.prepare(f"{CONFIGS / 'gpt.py'}:model.attention.plugins={PLUGIN}",
                             {"mechanism": ["full", "cosine_temperature"]})
  assert axes == {"model.attention.mechanism": ["full", "cosine_temperature"]}
  assert base.model.attention.plugins == str(PLUGIN)


def _train(spec: str, workdir: pathlib.Path, cwd: pathlib.Path) -> None:
  proc = subprocess.run([sys.executable, "-m", "attnlab.cli.train", f"--config={spec}",
                         f"--workdir={workdir}"], cwd=cwd, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]


def _temperatures(params) -> list[float]:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return [float(t) for path, x in leaves if "log_temperature" in jax.tree_util.keystr(path)
          for t in np.exp(np.asarray(x)).ravel()]


def _check_learned(temps: list[float]) -> None:
  assert temps and all(3.0 < t < 8.0 for t in temps)  # learned from 5.0, three small steps
  assert not all(math.isclose(t, 5.0, rel_tol=1e-6) for t in temps)  # and it did learn


def _spec(family: str, arg: str) -> str:
  return (f"{CONFIGS / (family + '.py')}:{arg},runlocal=True,num_train_steps=3,eval_every=0,"
          f"write_plots=False,{USE},model.attention.cosine_temperature.init_temperature=5.0")


@pytest.mark.slow
def test_plugin_trains_gpt_and_reloads_in_a_fresh_process(tmp_path):
  """`attnlab train` with the plugin; then a process that never imported it reloads the run (the
  run names the module), captures its attention and writes the viewer's page."""
  workdir = tmp_path / "run"
  _train(_spec("gpt", "dataset=addition"), workdir, cwd=tmp_path)
  stored = json.loads((workdir / "config.json").read_text())["model"]["attention"]
  assert stored["mechanism"] == "cosine_temperature" and stored["plugins"] == str(PLUGIN)
  script = (
      "import json, jax, numpy as np\n"
      "from attnlab import analysis\nfrom attnlab.cli import view\n"
      f"run = analysis.load_run({str(workdir)!r})\n"
      "leaves = jax.tree_util.tree_flatten_with_path(run.params)[0]\n"
      "temps = [float(t) for path, x in leaves if 'log_temperature' in jax.tree_util.keystr(path)\n"
      "         for t in np.exp(np.asarray(x)).ravel()]\n"
      "cap = analysis.capture_text(run, '12+34=')\n"
      f"page = view.view_text(run, '12+34=', out={str(tmp_path / 'view.html')!r})\n"
      "print(json.dumps({'temps': temps, 'layers': sorted(cap.weights), 'page': str(page)}))\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd="/", capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  _check_learned(out["temps"])
  assert len(out["layers"]) == 2 and pathlib.Path(out["page"]).stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("family,arg,text", [
    ("transformer", "dataset=reverse", "abc"),
    ("bert", "mode=pretrain,data.manual_dir={shared},data.data_dir={tmp}/tfds,"
             "data.tokenizer_dir={tmp}/tok", "the king"),
])
def test_plugin_trains_bert_and_the_transformer(family, arg, text, shared_data, tmp_path):
  """The same plugin in the encoder families, in this process (the trainer, load_run, capture)."""
  from attnlab import analysis, train  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "run"
  config = config_utils.load_config_file(_spec(family, arg.format(shared=shared_data,
                                                                  tmp=tmp_path)))
  train.train_and_evaluate(config, workdir)
  run = analysis.load_run(workdir)
  assert run.model.attention.mechanism == "cosine_temperature"
  _check_learned(_temperatures(run.params))
  assert analysis.capture_text(run, text).weights
