"""experiments/induction_heads/run.py (issue #52): its corruption of the copies and its scores.

The end-to-end study in its seconds-long setting is tests/test_experiments.py::test_induction_heads.
"""

import pathlib

import numpy as np
import pytest

from attnlab import data

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "induction_heads" / "run.py"


@pytest.fixture(scope="module")
def study(script_loader):
  return script_loader(SCRIPT, "induction_heads_run")


def test_corrupted_sources_leave_the_copy_with_nothing_to_match(study):
  examples = data.get_dataset("induction", "validation", num_examples=50, seed=0, length=65,
                              vocab_size=64, min_span=8, max_span=32)
  ids = np.asarray([ex["ids"] for ex in examples])  # [50, 65]
  src = [ex["src"] for ex in examples]
  span = [ex["span"] for ex in examples]
  out = study.corrupt_sources(ids, src, span, 64, seed=0)
  assert out.dtype == np.int32 and out.shape == ids.shape
  assert out.min() >= 0 and out.max() < 64
  for row, ex in enumerate(examples):
    s, d, n = ex["src"], ex["dst"], ex["span"]
    inside = np.zeros(65, bool)
    inside[s:s + n] = True
    np.testing.assert_array_equal(out[row, ~inside], ids[row, ~inside])  # the rest untouched
    assert np.all(out[row, s:s + n] != ids[row, s:s + n])  # every source id changed
    np.testing.assert_array_equal(out[row, d:d + n], ids[row, s:s + n])  # the copy kept
  # A fixed seed gives the same corruption; another seed another one.
  np.testing.assert_array_equal(study.corrupt_sources(ids, src, span, 64, seed=0), out)
  assert not np.array_equal(study.corrupt_sources(ids, src, span, 64, seed=1), out)


def test_icl_score_is_late_minus_early_loss(study):
  nll = np.tile(np.linspace(4.0, 1.0, 64), (3, 1))  # [3, 64]: loss falling along the context
  late, early = np.linspace(4.0, 1.0, 64)[-16:].mean(), np.linspace(4.0, 1.0, 64)[:16].mean()
  assert study.icl_score(nll) == pytest.approx(late - early)
  assert study.icl_score(nll) < -2.0
  assert study.icl_score(np.full((2, 64), 4.2)) == pytest.approx(0.0, abs=1e-12)
