"""attnlab.analysis.roles (issue #50): word-level attention, the category scores and their
chance levels, the pronoun-antecedent accuracy, against NumPy written here from the definitions;
and experiments/head_roles/run.py end to end on a seconds-long run."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from attnlab.analysis import roles
from attnlab.errors import DataFormatError

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "head_roles" / "run.py"


def _random_rows(rng, shape):
  """Random attention weights whose last axis sums to 1."""
  w = rng.random(shape)
  return w / w.sum(-1, keepdims=True)


def _word_reference(w, spans):
  """Word-level weights by loops: to a word, the sum over its pieces; from a word, the mean."""
  m = len(spans)
  out = np.zeros(w.shape[:-2] + (m, m))
  for a, qa in enumerate(spans):
    for b, kb in enumerate(spans):
      out[..., a, b] = np.mean([w[..., q, kb].sum(-1) for q in qa], axis=0)
  return out


def test_word_attention_sums_to_and_averages_from_pieces():
  rng = np.random.default_rng(0)
  spans = [[0], [1, 2], [3], [4, 5, 6], [7]]
  w = _random_rows(rng, (2, 3, 8, 8))
  got = roles.word_attention(w, spans)
  np.testing.assert_allclose(got, _word_reference(w, spans), atol=1e-12)
  np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-12)  # rows still distributions
  with pytest.raises(ValueError, match="cover the 8 tokens"):
    roles.word_attention(w, [[0], [1, 2]])


def _category_reference(weights, units, target):
  """Mean over every query row with a target (all examples pooled) of the mass on the targets."""
  layers, heads = weights[0].shape[:2]
  total, rows = np.zeros((layers, heads)), 0
  for w, names in zip(weights, units):
    n = len(names)
    for i in range(n):
      keys = [j for j in range(n) if target(names, i, j)]
      if keys:
        total += w[:, :, i, keys].sum(-1)
        rows += 1
  return total / rows


TARGETS = {
    "previous": lambda u, i, j: j == i - 1,
    "next": lambda u, i, j: j == i + 1,
    "[CLS]": lambda u, i, j: u[j] == "[CLS]",
    "[SEP]": lambda u, i, j: u[j] == "[SEP]",
    "punctuation": lambda u, i, j: u[j] in {",", ".", "``", "''", "-lrb-", "-rrb-"},
}


def test_categories_match_numpy_on_random_weights():
  rng = np.random.default_rng(1)
  units = [["[CLS]", "the", "film", ",", "sadly", ".", "[SEP]"],
           ["[CLS]", "``", "wow", "''", "-lrb-", "yes", "-rrb-", "[SEP]"],
           ["[CLS]", "no", "punctuation", "here", "[SEP]"]]
  weights = [_random_rows(rng, (2, 3, len(u), len(u))) for u in units]
  got = roles.head_roles(weights, units)
  assert set(got) == set(TARGETS)
  for name, target in TARGETS.items():
    np.testing.assert_allclose(got[name], _category_reference(weights, units, target),
                               atol=1e-12, err_msg=name)


def test_perfect_patterns_score_one_and_uniform_scores_chance():
  n = 6
  units = [["[CLS]", "a", "b", ",", "c", "[SEP]"]]
  previous = np.zeros((1, 2, n, n))
  previous[0, 0] = np.eye(n, k=-1)
  previous[0, 0, 0, 0] = 1.0  # [CLS] has no previous word: anywhere (its row is not counted)
  previous[0, 1] = np.eye(n, k=1)
  previous[0, 1, -1, -1] = 1.0
  got = roles.head_roles([previous], units)
  assert got["previous"][0].tolist() == [1.0, 0.0]
  assert got["next"][0].tolist() == [0.0, 1.0]
  # Uniform rows: 1/n on each key. previous/next/[CLS]/[SEP]: 1/n; punctuation: 1 key in 6.
  uniform = np.full((1, 1, n, n), 1.0 / n)
  chance = roles.uniform_roles(units)
  for name, value in roles.head_roles([uniform], units).items():
    assert value[0, 0] == pytest.approx(chance[name])
    assert chance[name] == pytest.approx(1.0 / n)
  # Word level: uniform over tokens, a three-piece word gets 3/n_tokens of every row.
  words = [["[CLS]", "un", "believable", ".", "[SEP]"]]
  spans = [[[0], [1], [2, 3, 4], [5], [6]]]
  chance = roles.uniform_roles(words, spans)
  # previous: rows 1..4; the row of "." (unit 3) gives 3/7 to "believable", the others 1/7.
  assert chance["previous"] == pytest.approx((1 + 1 + 3 + 1) / 7 / 4)
  assert chance["next"] == pytest.approx((1 + 3 + 1 + 1) / 7 / 4)
  assert chance["punctuation"] == pytest.approx(1 / 7) and chance["[CLS]"] == pytest.approx(1 / 7)


def test_is_punctuation():
  for unit in (".", ",", "...", "``", "''", "-lrb-", "-rrb-", "\u2581.", "!?", "--"):
    assert roles.is_punctuation(unit), unit
  for unit in ("a", "n't", "'s", "\u2581", "", "[CLS]x", "1."):
    assert not roles.is_punctuation(unit), unit


def test_parse_marked_and_its_errors(tmp_path):
  s = roles.parse_marked("the [animal] did n't cross the {street} because <it> was too tired .")
  assert s.words[1] == "animal" and s.words[s.pronoun] == "it"
  assert (s.antecedent, s.pronoun, s.candidates) == (1, 8, (1, 6))
  assert s.nearest_candidate() == 6
  with pytest.raises(DataFormatError, match="one pronoun"):
    roles.parse_marked("the [animal] is tired .")
  with pytest.raises(DataFormatError, match="must come before"):
    roles.parse_marked("<it> was the [animal] .")
  path = tmp_path / "p.txt"
  path.write_text("# comment\n\nthe [dog] saw the {cat} and <it> ran .\nno marks here .\n")
  with pytest.raises(DataFormatError, match=r"p.txt line 4: mark one pronoun"):
    roles.read_marked(path)
  real = roles.read_marked(REPO / "experiments" / "head_roles" / "pronouns.txt")
  assert 20 <= len(real) <= 40
  first = real[0]
  assert " ".join(first.words).startswith("the animal did n't cross the street because it")
  assert first.words[first.antecedent] == "animal" and first.words[first.pronoun] == "it"


def test_antecedent_scores_on_hand_made_patterns():
  sentences = [roles.parse_marked("the [dog] saw a {cat} and <it> ran"),   # words 0..7
               roles.parse_marked("a {cat} saw the [dog] so <it> ran")]
  spans = [[[0]] + [[k + 1] for k in range(8)] + [[9]]] * 2  # one piece per word
  # Head 0: the pronoun row peaks on "dog" in both sentences; head 1: on the nearest candidate
  # ("cat" at 4, then "dog" at 4); head 2: on "saw" (a word, not a candidate) with "dog" next.
  weights = []
  for s in sentences:
    w = np.full((1, 3, 10, 10), 0.01)
    row = s.pronoun + 1
    w[0, 0, row, s.antecedent + 1] = 0.5
    w[0, 1, row, s.nearest_candidate() + 1] = 0.5
    w[0, 2, row, 2 + 1] = 0.5
    w[0, 2, row, s.antecedent + 1] = 0.3
    weights.append(w / w.sum(-1, keepdims=True))
  got = roles.antecedent_scores(weights, spans, sentences)
  assert got["all"][0].tolist() == [1.0, 0.5, 0.0]
  assert got["candidates"][0].tolist() == [1.0, 0.5, 1.0]
  assert got["hits_all"][:, 0].tolist() == [[True, False, False], [True, True, False]]
  assert got["hits_candidates"].shape == (2, 1, 3)
  # The mean weight from the pronoun to the antecedent, by NumPy on the same rows.
  expected = np.mean([w[0, :, s.pronoun + 1, s.antecedent + 1] for w, s in
                      zip(weights, sentences)], axis=0)
  np.testing.assert_allclose(got["weight"][0], expected, atol=1e-12)
  base = roles.antecedent_baselines(sentences)
  assert base == pytest.approx({"all": 1 / 7, "candidates": 1 / 2, "nearest_candidate": 0.5})


def test_plot_head_roles_writes_a_png(tmp_path):
  scores = {"previous": np.eye(2, 3), "[SEP]": np.full((2, 3), 0.5)}
  roles.plot_head_roles(scores, {"previous": 0.1}, title="t", path=tmp_path / "h.png")
  assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------ the study


def _run(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(REPO))  # this checkout's attnlab
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def test_study_bad_config_key_is_one_line(tmp_path):
  proc = _run(f"--workdir={tmp_path / 'out'}", "--pretrain_args=nope=1")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "unknown config key 'nope'" in proc.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "out" / "pretrain").exists()


@pytest.mark.slow
def test_study_end_to_end(tmp_path, shared_data):
  """A 4-step run on Tiny Shakespeare (seconds), measured on 4 sentences of a file and the
  pronoun set; the seed sentence's row and the chance levels checked against NumPy."""
  sentences = tmp_path / "s.txt"
  sentences.write_text("the film is good , and the cast is fine .\nwhat a bore !\n"
                       "i liked it .\nthe plot -lrb- such as it is -rrb- goes nowhere .\n")
  work = tmp_path / "study"
  args = [f"--workdir={work}", "--steps=4", f"--sentences={sentences}", "--num_sentences=4",
          f"--manual_dir={shared_data}", f"--publish_dir={tmp_path / 'pub'}",
          "--pretrain_args=runlocal=True,data.corpus=shakespeare,data.vocab_corpus=shakespeare,"
          "model.num_layers=2,model.d_model=32,model.num_heads=2,model.mlp_dim=64,batch_size=8,"
          "eval_every=4,checkpoint_every=4,log_every=2,data.vocab_size=300,"
          "data.num_eval=16,data.max_len=64,model.max_len=64,"
          f"data.tokenizer_dir={tmp_path / 'tok'}"]
  proc = _run(*args)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads((work / "results.json").read_text())
  m = result["measure"]
  assert result["checkpoint_step"] == 4 and m["sentences"] == 4 and m["pronoun_sentences"] == 32
  assert 0.0 <= result["pretraining"]["mlm_accuracy"] <= 1.0
  for name in ("head_roles.png", "it_attention.png", "results.md", "results.json"):
    assert (tmp_path / "pub" / name).is_file(), name
  assert np.asarray(m["word"]["previous"]).shape == (2, 2)

  # The seed sentence again, by hand: ids from the kept tokenizer, one forward pass, word rows.
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  run = analysis.load_run(work / "pretrain")
  tok = run.task.tokenizer
  words = m["seed"]["sentence"].split()
  ids, spans = [tok.cls_id], [[0]]
  for k, word in enumerate(words):
    pieces = tok.encode(word if k == 0 else " " + word)
    spans.append(list(range(len(ids), len(ids) + len(pieces))))
    ids += pieces
  spans.append([len(ids)])
  ids.append(tok.sep_id)
  cap = analysis.capture(run, np.asarray(ids, np.int32))
  w = np.stack([cap.weights[p] for p in cap.weights])  # [layers, heads, n, n]
  pronoun = words.index("it") + 1
  expected = np.stack([w[..., spans[pronoun], :][..., s].sum(-1).mean(-1) for s in spans], -1)
  np.testing.assert_allclose(m["seed"]["row"], expected, atol=1e-5)
  # Token-level chance of [CLS]: uniform rows give 1/n to it, every row counted.
  lengths = []
  for line in sentences.read_text().splitlines():
    n = 2 + sum(len(tok.encode(w if k == 0 else " " + w)) for k, w in enumerate(line.split()))
    lengths.append(n)
  assert m["token_chance"]["[CLS]"] == pytest.approx(len(lengths) / sum(lengths))
  assert m["tokens"] == sum(lengths)

  # A re-run skips the finished pretraining and measures again.
  again = _run(*args)
  assert again.returncode == 0 and "pretraining: finished (4 steps), skipped" in again.stdout
