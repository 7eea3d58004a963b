"""BERT pretraining data paths of issue #17: SST-2 sentence reconstruction, the held-out split,
whole-word masking on a subword vocabulary, sentence-order pairs (halves and documents)."""

import itertools
import pathlib
import time

import numpy as np
import pytest

from attnlab import config_utils
from attnlab.data import mlm
from attnlab.data import sst2_corpus
from attnlab.data import tokenizers
from attnlab.tasks import classification
from attnlab.tasks import masked_lm

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "bert.py"
CLS, SEP = tokenizers.CLS_ID, tokenizers.SEP_ID


# ------------------------------------------------------------------------------ references


def _inside(p: str, q: str) -> bool:
  """Reference: the words of p are a contiguous run of the words of q."""
  a, b = p.split(), q.split()
  return any(b[i:i + len(a)] == a for i in range(len(b) - len(a) + 1))


def _maximal_reference(phrases):
  """O(n^2) reference of sst2_corpus.maximal_phrases."""
  normal = [" ".join(p.split()) for p in phrases]
  kept = []
  for i, p in enumerate(normal):
    if not p or p in normal[:i]:
      continue
    if not any(_inside(p, q) for q in set(normal) if q != p):
      kept.append(i)
  return kept


# ------------------------------------------------------------------------------ reconstruction


HAND_MADE = [
    "a good film",                       # 0: inside 4
    "good",                              # 1: inside 0 (and 4, 6)
    "goods and services",                # 2: maximal ("good" is not a word of it)
    "the plot is thin",                  # 3: maximal
    "it is a good film , really",        # 4: maximal
    "a good film",                       # 5: duplicate of 0
    "really good",                       # 6: maximal (not contiguous in 4)
    "is thin",                           # 7: inside 3
    "film , really",                     # 8: inside 4
    "services and goods",                # 9: maximal (same words as 2, other order)
    "  the   plot ",                     # 10: inside 3 after white space is normalised
]


def test_maximal_phrases_hand_made():
  assert sst2_corpus.maximal_phrases(HAND_MADE) == [2, 3, 4, 6, 9]
  assert sst2_corpus.maximal_phrases(HAND_MADE) == _maximal_reference(HAND_MADE)


def test_maximal_phrases_match_the_quadratic_reference_on_random_treebanks():
  rng = np.random.default_rng(0)
  words = [f"w{i}" for i in range(12)]  # few words: many shared tokens and near-misses
  for _ in range(30):
    sentences = [" ".join(rng.choice(words, int(rng.integers(1, 9)))) for _ in range(8)]
    phrases = list(sentences)
    for s in sentences:  # random spans of the sentences, as the treebank's constituents
      toks = s.split()
      for _ in range(6):
        i = int(rng.integers(len(toks)))
        j = int(rng.integers(i + 1, len(toks) + 1))
        phrases.append(" ".join(toks[i:j]))
    order = rng.permutation(len(phrases))
    phrases = [phrases[k] for k in order]
    assert sst2_corpus.maximal_phrases(phrases) == _maximal_reference(phrases)


def test_contained_in_matches_the_reference():
  containers = ["it is a good film , really", "the plot is thin"]
  got = sst2_corpus.contained_in(HAND_MADE, containers)
  want = [any(_inside(p, c) for c in containers) for p in HAND_MADE]
  np.testing.assert_array_equal(got, want)
  assert got.tolist() == [True, True, False, True, True, True, False, True, True, False, True]


def test_split_phrases_holds_out_whole_sentences_without_leaks():
  rng = np.random.default_rng(1)
  words = [f"w{i}" for i in range(30)]
  sentences = [" ".join(rng.choice(words, int(rng.integers(3, 12)))) for _ in range(200)]
  phrases = list(sentences)
  for s in sentences:
    toks = s.split()
    for _ in range(5):
      i = int(rng.integers(len(toks)))
      phrases.append(" ".join(toks[i:int(rng.integers(i + 1, len(toks) + 1))]))
  split = sst2_corpus.split_phrases(phrases, fraction=0.1, seed=3)
  assert split.sentences == _maximal_reference(phrases)
  assert len(split.heldout) == round(0.1 * len(split.sentences))
  assert sorted(split.heldout + split.pretrain) == split.sentences
  assert not set(split.heldout) & set(split.pretrain)
  pretrain_text = [phrases[i] for i in split.pretrain]
  heldout_text = {phrases[i] for i in split.heldout}
  for i, p in enumerate(phrases):  # the lr-choice training set: phrases inside a training sentence
    inside = any(_inside(p, q) for q in pretrain_text)
    assert (i in split.selection_train) == inside, p
  assert not heldout_text & {phrases[i] for i in split.selection_train}
  # The same seed gives the same split; another seed another.
  assert sst2_corpus.split_phrases(phrases, 0.1, 3) == split
  assert sst2_corpus.split_phrases(phrases, 0.1, 4).heldout != split.heldout


def test_strip_final_punctuation():
  strip = sst2_corpus.strip_final_punctuation
  assert strip("a good film .") == "a good film"
  assert strip("is it any good ? ''") == "is it any good"
  assert strip("wow ... !") == "wow"
  assert strip("the u.s. version") == "the u.s. version"
  assert strip("x.") == "x."
  assert strip("...") == "..."  # a sentence of punctuation only keeps its one word


# ------------------------------------------------------------------------------ subword words


CORPUS = ["the film is a charming , funny and moving piece of work .",
          "a dull , lifeless and predictable thriller that never moves .",
          "funny , moving , charming : the best film of the year .",
          "the plot is thin and the acting is wooden .",
          "an unpredictable , moving portrait of a family ."] * 20


@pytest.fixture(scope="module")
def subword(tmp_path_factory):
  return tokenizers.SubwordTokenizer.train(CORPUS, vocab_size=50,
                                           model_dir=tmp_path_factory.mktemp("sp"))


def test_encode_words_matches_the_tokenizer(subword):
  cache = {}
  for text in CORPUS[:5] + ["unpredictably wooden films"]:
    ws = mlm.encode_words(subword.encode, text, cache)
    assert sum(ws.words, []) == subword.encode(text)
    for k, word in enumerate(text.split()):
      assert ws.heads[k] == subword.encode(word)  # each word as the start of a text
      if k:
        assert ws.words[k] == subword.encode(" " + word)
  assert any(len(w) > 1 for w in mlm.encode_words(subword.encode, CORPUS[1]).words)


def test_whole_word_masking_on_the_subword_vocabulary(subword):
  table = mlm.word_start_table(subword)
  rng = np.random.default_rng(2)
  split_words = 0
  for trial in range(300):
    text = CORPUS[trial % 5]
    ws = mlm.encode_words(subword.encode, text)
    ids = [CLS, *sum(ws.words, []), SEP]
    # Reference words: the positions of each space-separated word's pieces.
    spans, pos = [], 1
    for w in ws.words:
      spans.append(set(range(pos, pos + len(w))))
      pos += len(w)
    split_words += sum(len(s) > 1 for s in spans)
    _, positions, labels = mlm.mask_tokens(ids, rng, vocab_size=len(subword), mask_prob=0.3,
                                           max_predictions=20, word_starts=table)
    picked = set(positions.tolist())
    assert picked, text
    for span in spans:
      assert picked.isdisjoint(span) or picked >= span, (text, span, sorted(picked))
    np.testing.assert_array_equal(labels, np.asarray(ids)[positions])
  assert split_words > 0  # the check saw words of several pieces


# ------------------------------------------------------------------------------ SOP pairs


def _numbered_sentence(num_words, first=100):
  """Word i has pieces [first + 2i] inside a text, [first + 2i + 1] at the start of a text
  (word 0 inside the sentence is its start form)."""
  words = [[first + 2 * i + (1 if i == 0 else 0)] for i in range(num_words)]
  heads = [[first + 2 * i + 1] for i in range(num_words)]
  return mlm.WordSentence(words, heads)


def test_sop_split_point_range_and_spread():
  rng = np.random.default_rng(3)
  for n in range(2, 30):
    lo = max(1, n // 4)
    ks = [mlm.sop_split_point(n, rng) for _ in range(400)]
    assert min(ks) == lo and max(ks) == n - lo  # both ends reached, nothing outside
  with pytest.raises(ValueError):
    mlm.sop_split_point(1, rng)


def test_sop_halves_match_a_reference_cut():
  rng = np.random.default_rng(4)
  in_order = 0
  for trial in range(2000):
    n = int(rng.integers(2, 15))
    sentence = _numbered_sentence(n)
    seed = int(rng.integers(1 << 30))
    a, b, label = mlm.sop_halves(sentence, np.random.default_rng(seed))
    # Reference: the same draws, then the two halves as texts of their own.
    ref_rng = np.random.default_rng(seed)
    lo = max(1, n // 4)
    k = int(ref_rng.integers(lo, n - lo + 1))
    first = [100 + 1] + [100 + 2 * i for i in range(1, k)]
    second = [100 + 2 * k + 1] + [100 + 2 * i for i in range(k + 1, n)]
    want = (first, second, 1) if ref_rng.random() < 0.5 else (second, first, 0)
    assert (a, b, label) == want
    # Each segment starts with a start-of-text form, whatever the order.
    assert a[0] % 2 == 1 and b[0] % 2 == 1 and all(t % 2 == 0 for t in a[1:] + b[1:])
    in_order += label
  assert abs(in_order / 2000 - 0.5) < 0.03


def test_sentence_stream_examples():
  sentences = [_numbered_sentence(int(n), first=100 + 100 * s)
               for s, n in enumerate([3, 8, 5, 12, 1, 6])]  # the 1-word sentence is dropped
  data = mlm.PretrainingData([], [], sentences=sentences, vocab_size=2000, max_len=12,
                             mask_prob=0.0)
  assert len(data.sentences) == 5 and not data.anchors
  labels = []
  for position in range(500):
    ex = data.stream(mlm._SENTENCE_STREAM, position, seed=0)
    tokens, segments = ex.tokens[ex.valid].tolist(), ex.segments[ex.valid].tolist()
    sep = tokens.index(SEP)
    a, b = tokens[1:sep], tokens[sep + 1:-1]
    assert tokens[0] == CLS and tokens[-1] == SEP and len(tokens) <= 12
    assert segments == [0] * (sep + 1) + [1] * (len(b) + 1)
    assert a and b and a[0] // 100 == b[0] // 100  # one sentence
    # The label says whether the first segment holds the earlier words (ids grow along it).
    assert int(ex.is_next) == int(a[-1] < b[0]) and float(ex.nsp_weight) == 1.0
    labels.append(int(ex.is_next))
  assert abs(np.mean(labels) - 0.5) < 0.07
  # Held-out examples are fixed: the same seed gives the same masks and cuts.
  e1, e2 = data.eval_examples(20, seed=5), data.eval_examples(20, seed=5)
  for x, y in zip(e1, e2):
    for f in mlm.MaskedExample._fields:
      np.testing.assert_array_equal(getattr(x, f), getattr(y, f))


def test_document_sop_pairs_are_consecutive_sentences_in_or_out_of_order(numbered_corpus):
  documents, owner = numbered_corpus(5, 30)
  data = mlm.PretrainingData(documents, [], vocab_size=1000, max_len=16, mask_prob=0.0,
                             pair_task="sop")
  in_order = 0
  for position in range(2000):
    ex = data.stream(mlm._PAIR_STREAM, position, seed=0)
    tokens = ex.tokens[ex.valid]
    (da, sa), (db, sb) = owner[int(tokens[1])], owner[int(tokens[4])]
    assert da == db and abs(sa - sb) == 1  # always a sentence and its neighbour
    assert int(ex.is_next) == int(sb == sa + 1)
    in_order += int(ex.is_next)
  assert abs(in_order / 2000 - 0.5) < 0.03
  with pytest.raises(config_utils.ConfigError):
    mlm.PretrainingData(documents, [], vocab_size=1000, max_len=16, pair_task="nxt")


def test_batches_mix_pairs_and_sentence_halves():
  documents = [[[7 + 2 * d, 7], [8 + 2 * d, 8]] for d in range(10)]
  sentences = [_numbered_sentence(6, first=500 + 100 * s) for s in range(4)]
  data = mlm.PretrainingData(documents, [], sentences=sentences, vocab_size=2000, max_len=16,
                             mask_prob=0.0, pair_task="sop")
  batch = data.batch(3, 8, 0, seed=1, num_sentence=3)
  assert batch["tokens"].shape == (8, 16)
  assert (batch["tokens"][:5, 1] < 500).all() and (batch["tokens"][5:, 1] >= 500).all()
  only_halves = mlm.PretrainingData([], [], sentences=sentences, vocab_size=2000, max_len=16)
  with pytest.raises(config_utils.ConfigError):
    only_halves.batch(0, 8, 0, seed=1, num_sentence=4)  # asks for document pairs it lacks


def test_batch_composition_of_the_corpora():
  config = config_utils.load_config_file(f"{CONFIG}:mode=pretrain")
  data = config.data
  sizes = {}
  for corpus in masked_lm.CORPORA:
    data.corpus = corpus
    sizes[corpus] = masked_lm.batch_composition(data, 64)
  assert sizes == {"shakespeare": 0, "shakespeare+sst2": 0, "sst2_sentences": 64,
                   "shakespeare+sst2_sentences": 32, "imdb": 0, "imdb+shakespeare": 0,
                   "imdb+sst2_sentences": 32}
  data.corpus, data.sst2_fraction = "imdb+sst2_sentences", 0.0
  with pytest.raises(config_utils.ConfigError):
    masked_lm.batch_composition(data, 64)


def test_vocab_corpus_learns_the_vocabulary_on_another_text(monkeypatch):
  """data.vocab_corpus: the subword vocabulary is trained on that corpus's text (and cached
  under its options, so it is the very vocabulary of a run whose corpus that is), while the
  pretraining text stays data.corpus; a fine-tuning config without it is named as different."""
  texts = {"imdb": ([["an imdb review .", "its second sentence ."]], []),
           "sst2_sentences": ([], ["a sst-2 sentence", "another one"])}
  monkeypatch.setattr(masked_lm, "corpus_texts", lambda data: texts[data.corpus])
  seen = []
  monkeypatch.setattr(tokenizers, "cached_subword",
                      lambda kind, options, get_texts, folder: seen.append((options, get_texts())))
  config = config_utils.load_config_file(f"{CONFIG}:mode=pretrain,data.corpus=imdb,"
                                         "data.vocab_corpus=sst2_sentences")
  plain = config_utils.load_config_file(f"{CONFIG}:mode=pretrain,data.corpus=sst2_sentences")
  assert masked_lm.corpus_texts(config.data) == texts["imdb"]  # the pretraining text
  masked_lm.bert_tokenizer(config.data)
  masked_lm.bert_tokenizer(plain.data)
  assert seen[0] == seen[1]  # same cache key, same text: the same vocabulary
  assert seen[0][1] == ["a sst-2 sentence", "another one"]
  assert seen[0][0]["corpus"] == "sst2_sentences"
  finetune = config_utils.load_config_file(f"{CONFIG}:mode=finetune,data.corpus=imdb")
  assert classification.pretraining_mismatch(config, finetune) == [
      "data.corpus: 'sst2_sentences' in the pretraining run, 'imdb' here"]
  config.data.vocab_corpus = "wikipedia"
  with pytest.raises(config_utils.ConfigError, match="data.vocab_corpus"):
    masked_lm.tokenizer_options(config.data)


# ------------------------------------------------------------------------------ real SST-2


@pytest.mark.slow
def test_real_sst2_reconstruction(shared_data, tmp_path):
  start = time.time()
  phrases, split = sst2_corpus.train_phrases(data_dir=tmp_path / "tfds", manual_dir=shared_data)
  elapsed = time.time() - start
  assert len(phrases) == 67349
  assert (len(split.sentences), len(split.heldout), len(split.pretrain),
          len(split.selection_train)) == (6886, 689, 6197, 60888)
  assert elapsed < 120  # reading and preparing included; the reconstruction itself takes seconds
  heldout = [phrases[i] for i in split.heldout]
  pretrain = sst2_corpus.pretraining_sentences(data_dir=tmp_path / "tfds",
                                               manual_dir=shared_data)
  assert len(pretrain) == 6197 and not set(heldout) & set(pretrain)
  # No held-out sentence lies inside a pretraining sentence or a lr-choice training phrase.
  assert not sst2_corpus.contained_in(heldout, pretrain).any()
  train, held = sst2_corpus.selection_examples(data_dir=tmp_path / "tfds", manual_dir=shared_data)
  assert [ex["sentence"] for ex in held] == heldout
  assert not {ex["sentence"] for ex in train} & set(heldout)
  assert {ex["label"] for ex in held} == {0, 1}
  # A spot check of the longest-first search against the reference on a slice of rows.
  sample = list(itertools.islice(phrases, 0, 400))
  assert sst2_corpus.maximal_phrases(sample) == _maximal_reference(sample)
