"""experiments/benchmarks/patching.py --smoke: the patching benchmark end to end on a tiny GPT-2.

Needs torch, transformers and TransformerLens (the `bench` extra); skipped without them. The
script itself checks that attnlab's and TransformerLens's sweep grids agree to 1e-4 and exits
non-zero otherwise; here the printed table is read back and checked against that bound.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_smoke_run_agrees_with_transformer_lens(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "benchmarks" / "patching.py"), "--smoke",
       f"--scratch={tmp_path}"], capture_output=True, text=True, cwd=REPO, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = re.findall(r"^\| (z_head|resid_pre_position) \((\d+), (\d+)\) \|.*\| ([\d.e+-]+) \| "
                    r"([+-][\d.]+) \.\. ([+-][\d.]+) \|$", proc.stdout, re.M)
  assert [r[0] for r in rows] == ["z_head", "resid_pre_position"]
  # z: [layers, heads] = (2, 2); resid_pre: [layers, len] = (2, 8)
  assert [r[1:3] for r in rows] == [("2", "2"), ("2", "8")]
  for _, _, _, diff, low, high in rows:
    assert float(diff) <= 1e-4
    assert float(high) - float(low) > 1e-2  # patching moves the metric: the check means something
  assert re.search(r"^\| smoke \| 2x8 \| \d+ ", proc.stdout, re.M)  # the cache table
