"""BERT's pretraining examples: `[CLS] A [SEP] B [SEP]` pairs and masked tokens (NumPy, host side).

Each example is drawn from a NumPy generator seeded by (seed, stream, position in the stream), so an
epoch is a fresh permutation and the masks and random partners are redrawn every epoch (dynamic
masking):
- pair stream: `[CLS] A [SEP] B [SEP]` with A a sentence that has a successor in its document.
  Next-sentence prediction (`pair_task="nsp"`): with probability 1/2, B is that successor
  (is_next = 1), else a sentence of another random document (is_next = 0). Sentence-order
  prediction (`pair_task="sop"`): A and B are the sentence and its successor, in that order
  (is_next = 1) or swapped (is_next = 0), with probability 1/2 each. The longer side is cut (at
  its front or back, at random) until the pair fits `max_len`.
- sentence stream (corpora without documents, e.g. SST-2's rebuilt sentences): sentence-order
  prediction on the two halves of one sentence (`sop_halves`): the sentence is cut at a word
  boundary drawn uniformly between its first and last quarter of words (at least one word each
  side), and the halves are given in order (is_next = 1) or swapped (is_next = 0). Each half is
  tokenized as a text of its own (`WordSentence`: the first word of a subword text has no leading
  "▁"), so the pieces do not tell which half began the sentence.
- single stream: `[CLS] sentence [SEP]`, MLM only (its NSP weight is 0).
Masking (`mask_tokens`): `mask_prob` of the ordinary tokens (never [CLS], [SEP] or padding; the
count rounded stochastically so the expected rate is exact), at most `max_predictions` per
sequence; of those 80% become [MASK], 10% a random ordinary token, 10% stay. With `word_starts`
(`word_start_table`) whole words are chosen and masked with all their pieces.

The task that trains on them is attnlab/tasks/masked_lm.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from attnlab.config_utils import check_choice
from attnlab.data import tokenizers
from attnlab.data.pipeline import rng_for
from attnlab.errors import ConfigError

# Ids below this are special tokens (<pad>, <start>, <end>, <unk>, [CLS], [SEP], [MASK]).
FIRST_ORDINARY_ID = len(tokenizers.SPECIAL_TOKENS)
# Stream ids for rng_for: pairs, single sentences, evaluation, halves of sentences (training and
# evaluation).
_PAIR_STREAM, _SINGLE_STREAM, _EVAL_STREAM = 1, 2, 3
_SENTENCE_STREAM, _SENTENCE_EVAL_STREAM = 4, 5
# Pair tasks of the document pairs: next-sentence prediction or sentence-order prediction.
PAIR_TASKS = ("nsp", "sop")


class WordSentence(NamedTuple):
  """A sentence as pieces per word, for cutting it into halves that are texts of their own.

  words[i]: the pieces of word i as inside the text (word 0 as at the start of a text);
  heads[i]: the pieces of word i as at the start of a text. `sum(words, [])` is the sentence's
  encoding; a half starting at word k is `heads[k] + words[k + 1] + ...`.
  """
  words: list[list[int]]
  heads: list[list[int]]


def encode_words(encode: Any, text: str, cache: dict[str, tuple[list[int], list[int]]] | None = None
                 ) -> WordSentence:
  """The WordSentence of `text` (words split at single spaces) under `encode` (str -> ids).

  A word inside a text is encoded as " word" (a subword vocabulary gives its "▁" pieces), a word
  at the start as "word". Pieces never cross white space, so `sum(words, [])` equals
  `encode(text)` for texts whose words are separated by single spaces. `cache`: a dict reused
  across calls ({word: (inside pieces, start pieces)}).
  """
  cache = {} if cache is None else cache
  words, heads = [], []
  for i, word in enumerate(text.split()):
    if word not in cache:
      cache[word] = (list(encode(" " + word)), list(encode(word)))
    inside, head = cache[word]
    words.append(list(head if i == 0 else inside))
    heads.append(list(head))
  return WordSentence(words, heads)


def sop_split_point(num_words: int, rng: np.random.Generator) -> int:
  """Word index k where a sentence of `num_words` (>= 2) words is cut: uniform in [lo, n - lo]
  with lo = max(1, n // 4), so each half keeps at least a quarter of the words (and one)."""
  if num_words < 2:
    raise ValueError(f"a sentence of {num_words} word(s) has no halves")
  lo = max(1, num_words // 4)
  return int(rng.integers(lo, num_words - lo + 1))


def sop_halves(sentence: WordSentence, rng: np.random.Generator
               ) -> tuple[list[int], list[int], int]:
  """(first segment, second segment, in_order) of a sentence-order example (module docstring)."""
  k = sop_split_point(len(sentence.words), rng)
  first = [t for w in sentence.words[:k] for t in w]
  second = list(sentence.heads[k]) + [t for w in sentence.words[k + 1:] for t in w]
  if rng.random() < 0.5:
    return first, second, 1
  return second, first, 0


def word_start_table(tokenizer: tokenizers.Vocab) -> np.ndarray:
  """bool `[vocab]`: True where a piece begins a word (starts with "▁") or is special.

  For a WordPiece vocabulary (data.tokenizer=hf): every piece but the "##" continuations.
  """
  if tokenizer.kind in ("hf", "ids"):
    return np.array([not t.startswith("##") for t in tokenizer.tokens], bool)  # [vocab]
  table = np.array([t.startswith("\u2581") for t in tokenizer.tokens], bool)  # [vocab]
  table[:FIRST_ORDINARY_ID] = True
  return table


def special_ids(tokenizer: Any, vocab_size: int) -> dict[str, Any] | None:
  """{cls_id, sep_id, mask_id, ordinary} of an imported tokenizer (PretrainingData's
  `special`); None for attnlab's own vocabularies (ids 0..6 special)."""
  if tokenizer.kind not in ("hf", "ids"):
    return None
  ids = {"cls_id": tokenizer.cls_id, "sep_id": tokenizer.sep_id, "mask_id": tokenizer.mask_id}
  missing = [k[:-3] for k, v in ids.items() if v is None]
  if missing:
    raise ConfigError(f"the tokenizer has no {', '.join(missing)} token, which BERT's pairs and "
                      f"masks need; import a checkpoint whose tokenizer has [CLS], [SEP], [MASK]")
  ordinary = np.zeros((vocab_size,), bool)  # [vocab]
  ordinary[:len(tokenizer)] = True
  ordinary[list(tokenizer.all_special_ids)] = False
  return {**ids, "ordinary": ordinary}


class MaskedExample(NamedTuple):
  # int32 [max_len] input ids ([MASK] etc. in place), padded with 0.
  tokens: np.ndarray
  # int32 [max_len] segment ids (0 = [CLS] + A + first [SEP], 1 = B + last [SEP]).
  segments: np.ndarray
  # bool [max_len] True = real token.
  valid: np.ndarray
  # int32 [max_predictions] masked positions (0 where unused).
  mlm_positions: np.ndarray
  # int32 [max_predictions] original ids at those positions (0 where unused).
  mlm_labels: np.ndarray
  # float32 [max_predictions] 1 = a real prediction, 0 = padding.
  mlm_weights: np.ndarray
  # int32 [] 1 = B follows A, 0 = B is random (or no B).
  is_next: np.ndarray
  # float32 [] 1 = the example counts for NSP, 0 = single segment.
  nsp_weight: np.ndarray


def truncate_pair(a: list[int], b: list[int], max_tokens: int,
                  rng: np.random.Generator | None) -> tuple[list[int], list[int]]:
  """Cuts one token at a time from the longer side (front or back at random; always the back
  when rng is None, as for classification inputs) until they fit."""
  a, b = list(a), list(b)
  while len(a) + len(b) > max_tokens:
    longer = a if len(a) > len(b) else b
    if rng is not None and rng.random() < 0.5:
      del longer[0]
    else:
      longer.pop()
  return a, b


def make_pair(a: Sequence[int], b: Sequence[int] | None, max_len: int,
              rng: np.random.Generator | None, *, cls_id: int = tokenizers.CLS_ID,
              sep_id: int = tokenizers.SEP_ID) -> tuple[list[int], list[int]]:
  """(`[CLS] A [SEP] B [SEP]` ids, segment ids), or `[CLS] A [SEP]` when b is None; fits max_len
  (a single sentence loses its end; a pair, tokens of its longer side: `truncate_pair`, from the
  back when rng is None).

  cls_id, sep_id: the tokenizer's ids (`tokenizer.cls_id`; an imported vocabulary has its own).
  """
  if b is None:
    a = list(a)[:max_len - 2]
    return [cls_id, *a, sep_id], [0] * (len(a) + 2)
  a, b = truncate_pair(a, b, max_len - 3, rng)
  ids = [cls_id, *a, sep_id, *b, sep_id]
  return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)


def mask_tokens(ids: Sequence[int], rng: np.random.Generator, *, vocab_size: int,
                mask_prob: float = 0.15, max_predictions: int = 20,
                word_starts: np.ndarray | None = None, mask_id: int = tokenizers.MASK_ID,
                ordinary: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """BERT's masking of one sequence.

  Args:
    ids: the sequence (special tokens included; they are never chosen).
    rng: NumPy generator.
    vocab_size: random replacements are drawn from the ordinary ids [7, vocab_size).
    mask_prob: expected fraction of ordinary tokens chosen (stochastic rounding of the count).
    max_predictions: cap on the number chosen.
    word_starts: bool `[vocab]` (word_start_table) for whole-word masking; None = per piece.
    mask_id: the tokenizer's [MASK] id.
    ordinary: bool `[vocab]`, True = an ordinary token (may be chosen, or drawn as a random
      replacement); None = the ids >= 7 (attnlab's vocabularies).
  Returns:
    (masked ids int32 `[len]`, chosen positions int32 `[n]` ascending, their original ids `[n]`).
  """
  ids = np.asarray(ids, np.int32)  # [len]
  if ordinary is None:
    candidates = np.flatnonzero(ids >= FIRST_ORDINARY_ID)  # [num_candidates]
  else:
    candidates = np.flatnonzero(ordinary[ids])  # [num_candidates]
  # Group candidates into words: a new word at a word-start piece or after a non-candidate.
  if word_starts is None:
    starts = np.ones((len(candidates),), bool)  # [num_candidates]
  else:
    starts = np.asarray(word_starts, bool)[ids[candidates]]  # [num_candidates]
    starts[1:] |= np.diff(candidates) != 1
    starts[:1] = True
  word_begin = np.flatnonzero(starts)  # [num_words] index into candidates
  word_end = np.append(word_begin[1:], len(candidates))  # [num_words]
  target = int(np.floor(len(candidates) * mask_prob + rng.random()))
  target = min(target, max_predictions)
  chosen: list[int] = []
  for w in rng.permutation(len(word_begin)):
    if len(chosen) >= target:
      break
    if len(chosen) + word_end[w] - word_begin[w] > target:
      continue
    chosen.extend(candidates[word_begin[w]:word_end[w]].tolist())
  positions = np.sort(np.asarray(chosen, np.int32))  # [n]
  labels = ids[positions]  # [n]
  masked = ids.copy()
  u = rng.random(len(positions))  # [n]
  if ordinary is None:
    random_ids = rng.integers(FIRST_ORDINARY_ID, vocab_size, len(positions))  # [n]
  else:
    random_ids = np.flatnonzero(ordinary)[rng.integers(0, int(ordinary.sum()), len(positions))]
  masked[positions] = np.where(u < 0.8, mask_id,
                               np.where(u < 0.9, random_ids, labels))
  return masked, positions, labels


def pack_example(ids: list[int], segments: list[int], rng: np.random.Generator, *,
                 max_len: int, is_next: int, nsp_weight: float, vocab_size: int,
                 mask_prob: float, max_predictions: int,
                 word_starts: np.ndarray | None, mask_id: int = tokenizers.MASK_ID,
                 ordinary: np.ndarray | None = None) -> MaskedExample:
  """Masks a sequence and pads it to fixed-size arrays."""
  masked, positions, labels = mask_tokens(ids, rng, vocab_size=vocab_size, mask_prob=mask_prob,
                                          max_predictions=max_predictions,
                                          word_starts=word_starts, mask_id=mask_id,
                                          ordinary=ordinary)
  n, length = len(positions), len(ids)

  def pad(x, size, dtype):
    out = np.zeros((size,), dtype)
    out[:len(x)] = x
    return out
  return MaskedExample(
      tokens=pad(masked, max_len, np.int32), segments=pad(segments, max_len, np.int32),
      valid=np.arange(max_len) < length, mlm_positions=pad(positions, max_predictions, np.int32),
      mlm_labels=pad(labels, max_predictions, np.int32),
      mlm_weights=pad(np.ones(n), max_predictions, np.float32),
      is_next=np.asarray(is_next, np.int32), nsp_weight=np.asarray(nsp_weight, np.float32))


def stack_examples(examples: Sequence[MaskedExample]) -> dict[str, np.ndarray]:
  """A batch dict: every field stacked along a new leading axis."""
  return {field: np.stack([getattr(ex, field) for ex in examples])
          for field in MaskedExample._fields}


class PretrainingData:
  """Encoded documents, sentences and singles, and their example streams (module docstring)."""

  def __init__(self, documents: Sequence[Sequence[Sequence[int]]],
               singles: Sequence[Sequence[int]], *, vocab_size: int, max_len: int,
               mask_prob: float = 0.15, max_predictions: int = 20,
               word_starts: np.ndarray | None = None, special: dict[str, Any] | None = None,
               sentences: Sequence[WordSentence] = (), pair_task: str = "nsp"):
    """documents: encoded sentences per document; singles: encoded extra sentences;
    special: {cls_id, sep_id, mask_id, ordinary} of the tokenizer (`special_ids`; None: attnlab's
    fixed ids); sentences: WordSentences of the sentence stream (those of fewer than two words
    are dropped); pair_task: "nsp" or "sop" for the document pairs."""
    self.pair_task = check_choice("pair task", pair_task, PAIR_TASKS)
    self.documents = [list(map(list, doc)) for doc in documents if len(doc)]
    self.singles = [list(s) for s in singles if len(s)]
    self.sentences = [WordSentence([list(w) for w in s.words], [list(w) for w in s.heads])
                      for s in sentences if len(s.words) >= 2]
    # (document, sentence) of every sentence with a successor in its document.
    self.anchors = [(d, s) for d, doc in enumerate(self.documents) for s in range(len(doc) - 1)]
    if not self.anchors and not self.sentences:
      raise ConfigError("the pretraining corpus has no document with two sentences, so no "
                        "next-sentence pair can be built; use more documents (data.max_documents)")
    if self.anchors and pair_task == "nsp" and len(self.documents) < 2:
      raise ConfigError("random next-sentence partners need at least two documents")
    special = special or {}
    # make_pair's and pack_example's options (an imported tokenizer's own ids where given).
    self._pair_ids = {k: v for k, v in special.items() if k in ("cls_id", "sep_id")}
    self.options = dict(vocab_size=vocab_size, max_len=max_len, mask_prob=mask_prob,
                        max_predictions=max_predictions, word_starts=word_starts,
                        **{k: v for k, v in special.items() if k in ("mask_id", "ordinary")})
    self._orders: dict[tuple[int, ...], np.ndarray] = {}

  def pair_example(self, anchor: int, rng: np.random.Generator) -> MaskedExample:
    """The pair of anchor `anchor`: NSP, real successor or random partner with probability 1/2;
    SOP, the sentence and its successor in order or swapped with probability 1/2."""
    d, s = self.anchors[anchor]
    a = self.documents[d][s]
    if self.pair_task == "sop":
      b, is_next = self.documents[d][s + 1], 1
      if rng.random() >= 0.5:
        a, b, is_next = b, a, 0
    elif rng.random() < 0.5:
      b, is_next = self.documents[d][s + 1], 1
    else:
      other = int(rng.integers(len(self.documents) - 1))
      other += other >= d  # any document but d
      doc = self.documents[other]
      b, is_next = doc[int(rng.integers(len(doc)))], 0
    return self._example(a, b, rng, is_next=is_next, nsp_weight=1.0)

  def sentence_example(self, index: int, rng: np.random.Generator) -> MaskedExample:
    """Sentence-order example of sentence `index`: its two halves in order or swapped."""
    a, b, in_order = sop_halves(self.sentences[index], rng)
    return self._example(a, b, rng, is_next=in_order, nsp_weight=1.0)

  def single_example(self, index: int, rng: np.random.Generator) -> MaskedExample:
    """`[CLS] sentence [SEP]` of extra sentence `index`, MLM only."""
    return self._example(self.singles[index], None, rng, is_next=0, nsp_weight=0.0)

  def _example(self, a: Sequence[int], b: Sequence[int] | None, rng: np.random.Generator, *,
               is_next: int, nsp_weight: float) -> MaskedExample:
    """`[CLS] a [SEP] b [SEP]` (`[CLS] a [SEP]` when b is None), masked and padded."""
    ids, segments = make_pair(a, b, self.options["max_len"], rng, **self._pair_ids)
    return pack_example(ids, segments, rng, is_next=is_next, nsp_weight=nsp_weight,
                        **self.options)

  def stream(self, kind: int, position: int, seed: int) -> MaskedExample:
    """Example `position` of a stream: epoch = position // size walks a fresh permutation; the
    generator depends on the position itself, so masks and partners change every epoch."""
    examples = {_PAIR_STREAM: (len(self.anchors), self.pair_example),
                _SINGLE_STREAM: (len(self.singles), self.single_example),
                _SENTENCE_STREAM: (len(self.sentences), self.sentence_example)}
    size, make = examples[kind]
    if size == 0:
      raise ConfigError("a batch asks for examples of a kind this corpus does not have "
                        "(pairs, single sentences or sentence halves); check data.corpus and the "
                        "batch fractions")
    epoch, offset = divmod(position, size)
    index = int(self._permutation(seed, kind, epoch, size)[offset])
    rng = rng_for(seed, kind, epoch, offset, 1)
    return make(index, rng)

  def _permutation(self, seed: int, kind: int, epoch: int, size: int) -> np.ndarray:
    """The order of epoch `epoch` of a stream (the last few kept: a batch reads one or two)."""
    key = (seed, kind, epoch, size)
    if key not in self._orders:
      if len(self._orders) >= 8:
        self._orders.pop(next(iter(self._orders)))
      self._orders[key] = rng_for(seed, kind, epoch).permutation(size)
    return self._orders[key]

  def batch(self, index: int, batch_size: int, num_single: int, seed: int,
            num_sentence: int = 0) -> dict[str, np.ndarray]:
    """Training batch `index`: batch_size - num_single - num_sentence document pairs, then
    num_sentence sentence-halves examples, then num_single single sentences."""
    num_pairs = batch_size - num_single - num_sentence
    examples = [self.stream(_PAIR_STREAM, index * num_pairs + j, seed) for j in range(num_pairs)]
    examples += [self.stream(_SENTENCE_STREAM, index * num_sentence + j, seed)
                 for j in range(num_sentence)]
    examples += [self.stream(_SINGLE_STREAM, index * num_single + j, seed)
                 for j in range(num_single)]
    return stack_examples(examples)

  def eval_examples(self, num_examples: int, seed: int) -> list[MaskedExample]:
    """Fixed held-out examples (for a corpus built from held-out text): the document pairs, or the
    sentence halves when there are no documents; example i cycles over them, with masks and
    partners drawn from (seed, stream, i)."""
    if self.anchors:
      return [self.pair_example(i % len(self.anchors), rng_for(seed, _EVAL_STREAM, i))
              for i in range(num_examples)]
    return [self.sentence_example(i % len(self.sentences), rng_for(seed, _SENTENCE_EVAL_STREAM, i))
            for i in range(num_examples)]
