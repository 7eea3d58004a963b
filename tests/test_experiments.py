"""Every experiment script end to end on its runlocal config, as a user runs it (a fresh process).

The studies themselves take minutes to hours (their READMEs hold the figures); here each script
trains seconds-long runs and must still reload them, analyse, plot and write its tables: a script
that calls the library the way it used to (an attribute filled lazily since, a renamed function)
fails here, not after an hour-long run. bert_sst2 has its own test (test_bert_study.py).
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, data_dir: pathlib.Path | None = None) -> str:
  """stdout of `python experiments/<script>/run.py args` from the repository root; rc must be 0."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  if data_dir is not None:
    env["ATTNLAB_DATA_DIR"] = str(data_dir)
  proc = subprocess.run([sys.executable, str(REPO / "experiments" / script / "run.py"), *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def _rows(markdown: str) -> list[list[str]]:
  """The cells of every table row of a markdown text, header and separator rows left out."""
  rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
          for line in markdown.splitlines() if line.startswith("|")]
  return [r for r in rows if not all(re.fullmatch(r"-+", c) for c in r)]


def _pngs(*paths: pathlib.Path) -> None:
  for path in paths:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


pytestmark = pytest.mark.slow


def test_nadaraya_watson(tmp_path):
  out = _run("nadaraya_watson", f"--workdir={tmp_path}",
             f"--config={REPO / 'configs' / 'nadaraya_watson.py'}:runlocal=True")
  table = [line.split() for line in out.splitlines()]  # kernel, w, test MSE, train LOO MSE
  mse = {cells[0]: float(cells[2]) for cells in table
         if len(cells) == 4 and cells[0] in ("average", "gaussian", "learned")}
  assert set(mse) == {"average", "gaussian", "learned"} and all(map(math.isfinite, mse.values()))
  # Average pooling ignores x: on y = x + sin(x) over [0, 10) any kernel that localises is better.
  assert mse["gaussian"] < mse["average"] and mse["learned"] < mse["average"]
  _pngs(tmp_path / "fit.png", tmp_path / "attention.png")


def test_shakespeare(tmp_path, shared_data):
  _run("shakespeare", f"--workdir={tmp_path}", "--config_arg=runlocal=True",
       f"--data_dir={shared_data}")
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["final_step"] == 20
  # nanoGPT's sampled estimate and the full-set loss estimate one number.
  assert abs(summary["nanogpt_style_estimates"]["mean"] - summary["val_loss"]) < 0.1
  assert summary["sample"].startswith("ROMEO:") and len(summary["sample"]) > len("ROMEO:")
  _pngs(tmp_path / "loss_curve.png", tmp_path / "attention.png")


def test_dates(tmp_path):
  _run("dates", f"--workdir={tmp_path}", "--seeds=0", "--arg=runlocal=True")
  seed_row = next(r for r in _rows((tmp_path / "results.md").read_text()) if r[0] == "0")
  assert seed_row[1] == "20" and 0 <= float(seed_row[4]) <= 100  # steps, test BLEU
  _pngs(*(tmp_path / "figures" / f"dates_{i}.png" for i in range(6)))


def test_marathi(tmp_path, shared_data):
  _run("marathi", f"--workdir={tmp_path}", "--seeds=0", "--arg=runlocal=True", "--beam_size=2",
       data_dir=shared_data)
  text = (tmp_path / "results.md").read_text()
  seed_row = next(r for r in _rows(text) if r[0] == "0")
  assert seed_row[1] == "20" and int(seed_row[2]) > 0 and math.isfinite(float(seed_row[3]))
  # Sample translations: test sentences with their references, then the extra sentence without.
  samples = [r for r in _rows(text) if len(r) == 3 and r[0] != "English"]
  assert len(samples) >= 2 and all(r[2] for r in samples)
  assert samples[-1][:2] == ["Rahul is a good boy.", ""]
  _pngs(*(tmp_path / "figures" / f"marathi_{i}.png" for i in range(6)))  # 5 test + Rahul


def test_bottleneck(tmp_path):
  _run("bottleneck", f"--workdir={tmp_path}", "--seeds=0", "--max_len=10", "--arg=runlocal=True")
  rows = _rows((tmp_path / "results.md").read_text())
  assert rows[0][1:] == ["exact match, attention=none", "exact match, attention=bahdanau"]
  assert [r[0] for r in rows[1:3]] == ["1-5", "6-10"]
  assert all(0 <= float(x) <= 1 for r in rows[1:3] for x in r[1:])
  _pngs(tmp_path / "bottleneck.png")


def test_score_functions(tmp_path):
  _run("score_functions", f"--workdir={tmp_path}", "--datasets=dates", "--scores=dot,additive",
       "--seeds=0", "--dates_arg=runlocal=True")
  rows = {r[0]: r for r in _rows((tmp_path / "results.md").read_text())}
  assert {"dot", "additive"} <= set(rows)
  assert all(math.isfinite(float(rows[s][4])) for s in ("dot", "additive"))  # validation CE
  _pngs(*(tmp_path / "figures" / f"dates_{score}.png" for score in ("dot", "additive")))


def test_rnn_vs_transformer(tmp_path):
  _run("rnn_vs_transformer", f"--workdir={tmp_path}", "--tasks=reverse", "--seeds=0",
       "--steps=20", "--extra=runlocal=True")
  rows = [r for r in _rows((tmp_path / "results.md").read_text()) if r[0] == "reverse"]
  assert [r[1] for r in rows] == ["rnn (seed 0)", "transformer (seed 0)", "rnn_none (seed 0)"]
  assert all(r[3] == "20" and int(r[2].replace(",", "")) > 0 for r in rows)  # steps, parameters
  _pngs(tmp_path / "reverse_by_length.png")
