"""SST-2's training split as a pretraining corpus: whole sentences rebuilt from its phrases.

GLUE's SST-2 training split holds 67,349 phrases: every labelled constituent of the Stanford
Sentiment Treebank's training sentences, so most rows are pieces of other rows. The sentences
(or, where a sentence's own label was neutral and dropped, its longest labelled pieces) are the
*maximal* phrases: those that are not a token-level substring of another phrase
(`maximal_phrases`; 6,886 of the 66,978 distinct phrases). They are found longest first with an
inverted index from each token to the maximal phrases holding it: a phrase is checked only
against the maximal phrases that contain its rarest token (seconds for the whole split).

There are no document boundaries (the rows are constituents of independent review sentences), so
no next-sentence pairs can be built from SST-2: the pretraining task of these sentences is
sentence-order prediction on the two halves of a sentence (attnlab/data/mlm.py).

Held-out sentences (`split_phrases`): a fixed `HELDOUT_FRACTION` of the maximal phrases (seeded
permutation), used for the held-out MLM/SOP metrics of pretraining and for choosing the
fine-tuning learning rate. They never enter the pretraining text or the tokenizer's text, and the
learning-rate choice trains on the phrases that lie inside some other (training) sentence only,
so no phrase of a held-out sentence that occurs nowhere else is seen; a short phrase that also
lies inside a training sentence stays in training, as the real validation sentences share short
phrases with the training split. The reported SST-2 validation split is never read here.

Pretraining reads only the phrase texts; labels are read only by `selection_examples`
(fine-tuning learning-rate choice).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from typing import Any, Sequence

import numpy as np

# Fraction of the rebuilt sentences held out (pretraining metrics, fine-tuning lr choice).
HELDOUT_FRACTION = 0.1
# Seed of the held-out permutation. Changing either constant changes the pretraining text (and
# so the tokenizer): they are constants, not config fields, for that reason.
HELDOUT_SEED = 0


def _normal(phrase: str) -> str:
  """The phrase with its words separated by single spaces."""
  return " ".join(phrase.split())


class _ContainerIndex:
  """Phrases added as containers; `contains(p)`: is p a token-level substring of one of them."""

  def __init__(self, token_counts: collections.Counter):
    self._counts = token_counts
    self._by_token: dict[str, list[int]] = collections.defaultdict(list)
    self._padded: list[str] = []

  def add(self, phrase: str) -> None:
    j = len(self._padded)
    self._padded.append(f" {phrase} ")
    for token in set(phrase.split()):
      self._by_token[token].append(j)

  def contains(self, phrase: str) -> bool:
    tokens = set(phrase.split())
    if not tokens:
      return True
    # Any container holding the phrase holds its rarest token: only those are compared.
    rare = min(tokens, key=lambda t: (self._counts[t], t))
    padded = f" {phrase} "
    return any(padded in self._padded[j] for j in self._by_token.get(rare, ()))


def _token_counts(phrases: Sequence[str]) -> collections.Counter:
  counts: collections.Counter = collections.Counter()
  for p in phrases:
    counts.update(set(p.split()))
  return counts


def maximal_phrases(phrases: Sequence[str]) -> list[int]:
  """Indices of the phrases that are not a token-level substring of another phrase.

  Token level: words separated by single spaces ("good" is in "a good film", not in "goods").
  Of identical phrases (after normalising white space) only the first is kept. Returned in
  row order.
  """
  normal = [_normal(p) for p in phrases]
  first: dict[str, int] = {}
  for i, p in enumerate(normal):
    if p:
      first.setdefault(p, i)
  index = _ContainerIndex(_token_counts(list(first)))
  kept = []
  # Longest first: a phrase is maximal iff no longer maximal phrase holds it (containment is
  # transitive, and two distinct phrases of the same length cannot hold each other).
  for p in sorted(first, key=lambda q: (-len(q.split()), q)):
    if not index.contains(p):
      index.add(p)
      kept.append(first[p])
  return sorted(kept)


def contained_in(phrases: Sequence[str], containers: Sequence[str]) -> np.ndarray:
  """bool `[len(phrases)]`: phrase i is a token-level substring of (or equal to) a container."""
  normal = [_normal(p) for p in phrases]
  containers = [_normal(c) for c in containers]
  index = _ContainerIndex(_token_counts(containers + normal))
  for c in containers:
    index.add(c)
  return np.array([bool(p) and index.contains(p) for p in normal], bool)


def heldout_mask(n: int, fraction: float = HELDOUT_FRACTION, seed: int = HELDOUT_SEED
                 ) -> np.ndarray:
  """bool `[n]`: round(n * fraction) entries True, chosen by a permutation seeded by `seed`."""
  mask = np.zeros((n,), bool)
  mask[np.random.default_rng(seed).permutation(n)[:int(round(n * fraction))]] = True
  return mask


@dataclasses.dataclass(frozen=True)
class PhraseSplit:
  """Indices into the phrase list (all ascending).

  sentences: the maximal phrases (rebuilt sentences).
  heldout: the held-out sentences (a subset of `sentences`).
  pretrain: the other sentences: the in-domain pretraining text.
  selection_train: the phrases inside some pretraining sentence: the training set of the
    fine-tuning learning-rate choice (never a held-out sentence, nor a phrase found only in one).
  """

  sentences: list[int]
  heldout: list[int]
  pretrain: list[int]
  selection_train: list[int]


def split_phrases(phrases: Sequence[str], fraction: float = HELDOUT_FRACTION,
                  seed: int = HELDOUT_SEED) -> PhraseSplit:
  """Rebuilds the sentences and holds out `fraction` of them (module docstring)."""
  sentences = maximal_phrases(phrases)
  held = heldout_mask(len(sentences), fraction, seed)
  heldout = [s for s, h in zip(sentences, held) if h]
  pretrain = [s for s, h in zip(sentences, held) if not h]
  inside = contained_in(phrases, [phrases[i] for i in pretrain])
  return PhraseSplit(sentences=sentences, heldout=heldout, pretrain=pretrain,
                     selection_train=np.flatnonzero(inside).tolist())


def strip_final_punctuation(sentence: str) -> str:
  """The sentence without its trailing words that hold no letter or digit (". ", "! ?", "--").

  Sentence-order pairs are built from the halves of a sentence; a final "." would tell which
  half comes last.
  """
  words = sentence.split()
  while len(words) > 1 and not any(ch.isalnum() for ch in words[-1]):
    words.pop()
  return " ".join(words)


# ---------------------------------------------------------------------------------------------
# The real split (read once per process and data location)


@functools.lru_cache(maxsize=4)
def _load(data_dir: str | None, manual_dir: str | None) -> tuple[tuple[str, ...], PhraseSplit]:
  from attnlab import data as data_lib  # pylint: disable=g-import-not-at-top (avoids a cycle)
  examples = data_lib.get_dataset("sst2", "train", data_dir=data_dir, manual_dir=manual_dir)
  phrases = tuple(ex["sentence"] for ex in examples)  # the labels are not read here
  return phrases, split_phrases(phrases)


def train_phrases(*, data_dir: Any = None, manual_dir: Any = None) -> tuple[tuple[str, ...],
                                                                              PhraseSplit]:
  """(SST-2 training phrases in row order, their PhraseSplit); labels not read."""
  return _load(os.fspath(data_dir) if data_dir else None,
               os.fspath(manual_dir) if manual_dir else None)


def pretraining_sentences(*, data_dir: Any = None, manual_dir: Any = None) -> list[str]:
  """The rebuilt SST-2 training sentences minus the held-out ones (row order)."""
  phrases, split = train_phrases(data_dir=data_dir, manual_dir=manual_dir)
  return [phrases[i] for i in split.pretrain]


def heldout_sentences(*, data_dir: Any = None, manual_dir: Any = None) -> list[str]:
  """The held-out rebuilt sentences (row order)."""
  phrases, split = train_phrases(data_dir=data_dir, manual_dir=manual_dir)
  return [phrases[i] for i in split.heldout]


def selection_examples(*, data_dir: Any = None, manual_dir: Any = None
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """(training examples, held-out examples) of the fine-tuning learning-rate choice.

  Both are rows of SST-2's *training* split ({"sentence", "label", "idx"}): the training phrases
  inside a pretraining sentence, and the held-out sentences. SST-2's validation split is not used.
  """
  train, heldout = _selection(os.fspath(data_dir) if data_dir else None,
                              os.fspath(manual_dir) if manual_dir else None)
  return list(train), list(heldout)


@functools.lru_cache(maxsize=4)
def _selection(data_dir: str | None, manual_dir: str | None
               ) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]]:
  """selection_examples' rows, read once per process and data location (61,577 rows: reading
  them through TFDS takes seconds, and every choice run asks twice, for training and held-out)."""
  from attnlab import data as data_lib  # pylint: disable=g-import-not-at-top
  _, split = train_phrases(data_dir=data_dir, manual_dir=manual_dir)
  examples = data_lib.get_dataset("sst2", "train", data_dir=data_dir, manual_dir=manual_dir)
  return (tuple(examples.__getitems__(split.selection_train)),
          tuple(examples.__getitems__(split.heldout)))
