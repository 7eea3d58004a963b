"""attnlab.analysis.metrics and alignment scoring against NumPy references on hand-made weights."""

import numpy as np
import pytest

from attnlab.analysis import alignment
from attnlab.analysis import metrics
from attnlab.analysis.capture import Capture


def _random_rows(rng, shape, causal=False):
  logits = rng.normal(size=shape)
  if causal:
    q, k = shape[-2:]
    logits = np.where(np.tril(np.ones((q, k), bool)), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  return w / w.sum(-1, keepdims=True)


def test_entropy_and_normalised_entropy_mind_causal_rows():
  rng = np.random.default_rng(0)
  w = _random_rows(rng, (2, 4, 4), causal=True)  # [heads, q, k]
  expected = np.array([[-sum(p * np.log(p) for p in row if p > 0) for row in head] for head in w])
  np.testing.assert_allclose(metrics.entropy(w), expected, rtol=1e-6, atol=1e-12)
  norm = metrics.normalized_entropy(w, "causal")
  assert np.all(np.isnan(norm[:, 0]))  # the first query can only see itself
  np.testing.assert_allclose(norm[:, 1:], expected[:, 1:] / np.log([2, 3, 4]), rtol=1e-6)
  uniform = np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None]
  np.testing.assert_allclose(metrics.normalized_entropy(uniform, "causal")[1:], 1.0, rtol=1e-6)
  np.testing.assert_allclose(metrics.normalized_entropy(np.full((3, 5), 0.2), "cross"), 1.0)
  with pytest.raises(ValueError, match="valid kinds: self, causal, cross"):
    metrics.normalized_entropy(w, "global")


def test_offsets_match_loops():
  rng = np.random.default_rng(1)
  w = _random_rows(rng, (3, 5, 7))
  off = np.zeros((3, 5))
  dist = np.zeros((3, 5))
  for h in range(3):
    for i in range(5):
      for j in range(7):
        off[h, i] += w[h, i, j] * (j - i)
        dist[h, i] += w[h, i, j] * abs(j - i)
  np.testing.assert_allclose(metrics.mean_offset(w), off, rtol=1e-6)
  np.testing.assert_allclose(metrics.mean_abs_offset(w), dist, rtol=1e-6)
  previous = np.eye(4, k=-1)
  previous[0, 0] = 1.0  # every query looks one back (the first at itself)
  np.testing.assert_allclose(metrics.mean_offset(previous), [0, -1, -1, -1])


def test_special_token_mass():
  w = np.array([[0.5, 0.2, 0.3], [0.1, 0.1, 0.8]])
  np.testing.assert_allclose(metrics.special_token_mass(w, ["[CLS]", "a", "[SEP]"]), [0.8, 0.9])
  np.testing.assert_allclose(metrics.special_token_mass(w, ["x", "<end>", "y"]), [0.2, 0.1])
  with pytest.raises(ValueError, match="2 key tokens given for 3 keys"):
    metrics.special_token_mass(w, ["a", "b"])


def test_rollout_matches_numpy_reference():
  rng = np.random.default_rng(2)
  layers = [_random_rows(rng, (2, 4, 4)) for _ in range(3)]
  expected = np.eye(4)
  for w in layers:
    a = 0.5 * w.mean(0) + 0.5 * np.eye(4)  # rows of w sum to 1, so (W + I) renormalised
    expected = a @ expected
  np.testing.assert_allclose(metrics.attention_rollout(layers), expected, rtol=1e-6)
  np.testing.assert_allclose(metrics.attention_rollout(layers).sum(-1), 1.0, rtol=1e-6)
  cap = Capture(tokens={"tokens": list("abcd")},
                weights={f"block_{i}/self_attention": w for i, w in enumerate(layers)},
                sides={f"block_{i}/self_attention": ("tokens", "tokens") for i in range(3)},
                kind={f"block_{i}/self_attention": "causal" for i in range(3)})
  np.testing.assert_allclose(metrics.attention_rollout(cap), expected, rtol=1e-6)
  with pytest.raises(ValueError, match="no self-attention layers on side 'source'"):
    metrics.attention_rollout(cap, side="source")


def test_head_table_rows():
  w = np.array([[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]],      # head 0: first query on [CLS]
                [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]]])     # head 1
  cap = Capture(tokens={"source": ["[CLS]", "x", "y"], "target": ["<start>", "z"]},
                weights={"dec/cross": w}, sides={"dec/cross": ("target", "source")},
                kind={"dec/cross": "cross"})
  rows = metrics.head_table(cap)
  assert [(r["layer"], r["head"]) for r in rows] == [("dec/cross", 0), ("dec/cross", 1)]
  assert rows[0]["entropy"] == pytest.approx(0.0)
  assert rows[1]["entropy"] == pytest.approx(np.log(2))
  assert rows[1]["normalized_entropy"] == pytest.approx(np.log(2) / np.log(3))
  assert rows[0]["mean_offset"] == pytest.approx((0 + 1) / 2)  # row 0: j=0,i=0; row 1: j=2,i=1
  assert rows[1]["mean_abs_offset"] == pytest.approx((0.5 + 0.5) / 2)
  assert rows[0]["special_mass"] == pytest.approx(0.5)
  assert rows[1]["special_mass"] == pytest.approx(0.25)


def test_gold_alignments_of_copy_and_reverse():
  assert [sorted(s) for s, _ in alignment.gold_alignment("copy", "abc", "abc")] == [[0], [1], [2]]
  assert [sorted(p) for _, p in alignment.gold_alignment("reverse", "abcd", "dcba")] == [
      [3], [2], [1], [0]]
  with pytest.raises(ValueError, match="tasks with one: copy, reverse, dates"):
    alignment.gold_alignment("marathi", "a", "b")


def test_dates_gold_follows_the_rendered_fields():
  gold = alignment.dates_gold("saturday 9 october 1993", "1993-10-09")
  sure = [sorted(s) for s, _ in gold]
  possible = [sorted(p) for _, p in gold]
  year, month, day = list(range(19, 23)), list(range(11, 18)), [9]
  assert possible == [year] * 4 + [[]] + [month] * 2 + [[]] + [day] * 2
  assert sure == [[19], [20], [21], [22], [], [], [], [], [], [9]]  # "0" of "09": no sure link
  gold = alignment.dates_gold("09/10/93", "1993-10-09")  # dd/mm/yy
  assert [sorted(s) for s, _ in gold] == [[], [], [6], [7], [], [3], [4], [], [0], [1]]
  assert sorted(gold[0][1]) == [6, 7]
  with pytest.raises(ValueError, match="no rendering of 1993-10-09"):
    alignment.dates_gold("10 september 1993", "1993-10-09")


def test_alignment_accuracy_perfect_and_shifted():
  gold = alignment.gold_alignment("reverse", "abcde", "edcba")
  perfect = np.eye(5)[::-1]  # row i on source n-1-i
  counts = alignment.alignment_counts(np.vstack([perfect, np.ones((1, 5)) / 5]), gold)  # + <end>
  assert alignment.score_counts(counts) == {"accuracy": 1.0, "aer": 0.0, "positions": 5}
  shifted = np.roll(perfect, 1, axis=1)  # every row one position to the right (one wraps)
  scores = alignment.score_counts(alignment.alignment_counts(shifted, gold))
  assert scores["accuracy"] == 0.0 and scores["aer"] == 1.0
  half = perfect.copy()
  half[:2] = shifted[:2]  # two of five rows wrong: AER = 1 - (3 + 3) / (5 + 5)
  scores = alignment.score_counts(alignment.alignment_counts(half, gold))
  assert scores["accuracy"] == pytest.approx(0.6) and scores["aer"] == pytest.approx(0.4)


def test_shifted_gold_scores_a_late_alignment():
  # An alignment one source position late (as a unidirectional RNN encoder may learn): wrong
  # against the gold links, right against them moved by one. Row 0's moved link (4 -> 5) leaves
  # the source, so that row is not scored.
  gold = alignment.gold_alignment("reverse", "abcde", "edcba")
  late = np.zeros((5, 5))
  for i in range(5):
    late[i, min(5 - i, 4)] = 1.0  # row i on source n-i (row 0 stays on 4)
  moved_gold = alignment.shift_gold(gold, 1, src_len=5)
  assert moved_gold[0] == (frozenset(), frozenset())
  assert moved_gold[1] == (frozenset([4]), frozenset([4]))
  plain = alignment.score_counts(alignment.alignment_counts(late, gold))
  moved = alignment.score_counts(alignment.alignment_counts(late, moved_gold))
  assert plain["accuracy"] == pytest.approx(1 / 5)  # only row 0 (on 4) matches gold 4
  assert moved["accuracy"] == 1.0 and moved["positions"] == 4
