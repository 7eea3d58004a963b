"""Head roles (Clark et al. 2019, "What Does BERT Look At?"): what each head of an encoder attends to.

  from attnlab.analysis import roles
  words = "the animal did n't cross the street because it was too tired .".split()
  ids, units, spans = roles.bert_words(run.task.tokenizer, words)    # [CLS] pieces [SEP]
  w = roles.stack_capture(analysis.capture(run, ids))                  # [layers, heads, n, n]
  scores = roles.head_roles([w], [units], [spans])    # {"previous": [layers, heads], ...}
  chance = roles.uniform_roles([units], [spans])      # {"previous": float, ...}
  marked = roles.read_marked("pronouns.txt")          # sentences with their antecedent marked
  acc = roles.antecedent_scores(weights, spans, marked)   # {"all", "candidates", "weight"}
  base = roles.antecedent_baselines(marked)           # random choice, nearest candidate
  roles.plot_head_roles(scores, chance, path="head_roles.png")   # a heatmap per category

Units. A head's weights are over the model's tokens (word pieces). Given `spans` (the token
positions of each word, [CLS] and [SEP] as words of one piece) they are turned into word-to-word
weights as Clark et al. do (`word_attention`): the attention *to* a word is the sum over its
pieces, the attention *from* a word the mean of its pieces' rows, so every row still sums to 1.
Without spans the units are the tokens themselves.

Categories (`CATEGORIES`; a category is a function units -> bool `[n, n]`, True where key j is a
target of query i): "previous" (j = i - 1), "next" (j = i + 1), "[CLS]", "[SEP]" (every key
with that text) and "punctuation" (keys made only of punctuation characters, `is_punctuation`).
A head's score in a category is its mean attention on the targets over every query row that has
at least one target (the [CLS] row has no previous word, a sentence without punctuation no
punctuation target), pooled over all the examples' rows:
  score = sum_rows sum_j w_ij [j is a target of i] / number of rows with a target.
The chance level (`uniform_roles`) is the same score of a head that spreads every row uniformly
over the sequence's tokens (1 / n_tokens each), turned into words by the same spans: a word of
three pieces then gets three times the weight of a word of one.

Pronoun to antecedent (`antecedent_scores`; sentences written with the antecedent marked,
`parse_marked`): per head, the share of sentences in which the pronoun's most-attended word is
its antecedent (Clark et al.'s antecedent selection accuracy), over two sets of words the argmax
may choose from: "all" (every word of the sentence but the pronoun itself and [CLS]/[SEP]) and
"candidates" (the antecedent and the other nouns marked as candidates). Ties go to the earlier
word. Baselines (`antecedent_baselines`): picking uniformly at random among those words (the
mean of 1 / their number) and picking the nearest candidate before the pronoun.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import string
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from attnlab.errors import DataFormatError

__all__ = ["CATEGORIES", "MarkedSentence", "antecedent_baselines", "antecedent_scores",
           "bert_words", "head_roles", "is_punctuation", "parse_marked", "plot_head_roles",
           "read_marked", "stack_capture", "uniform_roles", "word_attention"]

CLS, SEP = "[CLS]", "[SEP]"
# Words of SST-2's writing (attnlab.data.imdb_corpus.sst_words) that stand for brackets.
BRACKET_WORDS = frozenset({"-lrb-", "-rrb-", "-lsb-", "-rsb-", "-lcb-", "-rcb-"})
# The sentencepiece word-start mark, stripped before a token is tested for punctuation.
WORD_START = "\u2581"

Category = Callable[[Sequence[str]], np.ndarray]


def is_punctuation(unit: str) -> bool:
  """True for a word or piece made only of punctuation characters ("." "," "..." "``" "''"), and
  for SST-2's bracket words (-lrb- -rrb-); a leading word-start mark is ignored."""
  text = unit.replace(WORD_START, "")
  if text in BRACKET_WORDS:
    return True
  return bool(text) and all(c in string.punctuation or unicodedata.category(c).startswith("P")
                            for c in text)


def _column(units: Sequence[str], hit: Callable[[str], bool]) -> np.ndarray:
  targets = np.array([hit(u) for u in units], bool)  # [n]
  return np.broadcast_to(targets[None, :], (len(units), len(units)))


CATEGORIES: dict[str, Category] = {
    "previous": lambda units: np.eye(len(units), k=-1, dtype=bool),
    "next": lambda units: np.eye(len(units), k=1, dtype=bool),
    "[CLS]": lambda units: _column(units, lambda u: u == CLS),
    "[SEP]": lambda units: _column(units, lambda u: u == SEP),
    "punctuation": lambda units: _column(units, lambda u: u not in (CLS, SEP)
                                         and is_punctuation(u)),
}


# ------------------------------------------------------------------------------ words and pieces


def _check_spans(spans: Sequence[Sequence[int]], n_tokens: int) -> None:
  flat = [i for span in spans for i in span]
  if sorted(flat) != list(range(n_tokens)) or any(len(s) == 0 for s in spans):
    raise ValueError(f"spans must cover the {n_tokens} tokens once each, every word with at "
                     f"least one piece; got {[list(s) for s in spans]}")


def word_attention(weights: Any, spans: Sequence[Sequence[int]]) -> np.ndarray:
  """Token weights `[..., n_tokens, n_tokens]` -> word weights `[..., n_words, n_words]`: to a
  word, the sum over its pieces; from a word, the mean of its pieces' rows (Clark et al. 2019)."""
  w = np.asarray(weights, np.float64)
  _check_spans(spans, w.shape[-1])
  member = np.zeros((w.shape[-1], len(spans)))  # [n_tokens, n_words]
  for word, span in enumerate(spans):
    member[list(span), word] = 1.0
  mean_rows = member / member.sum(0, keepdims=True)  # [n_tokens, n_words]: a word's row average
  return np.swapaxes(mean_rows, 0, 1) @ w @ member  # [..., n_words, n_words]


def bert_words(tokenizer: Any, words: Sequence[str], max_len: int | None = None
               ) -> tuple[np.ndarray, list[str], list[list[int]]]:
  """(ids `[n_tokens]` of `[CLS] words [SEP]`, the units `[CLS] w_1 .. w_m [SEP]`, each unit's
  token positions) under a BERT run's tokenizer: each word is encoded as inside a text (" word",
  the first as "word"; attnlab.data.mlm.encode_words), so the pieces are those of the whole
  sentence. Raises ValueError when the ids are longer than `max_len`."""
  from attnlab.data import mlm  # pylint: disable=g-import-not-at-top
  pieces = mlm.encode_words(tokenizer.encode, " ".join(words)).words
  ids, units, spans = [tokenizer.cls_id], [CLS], [[0]]
  for word, word_ids in zip(words, pieces):
    spans.append(list(range(len(ids), len(ids) + len(word_ids))))
    ids += list(word_ids)
    units.append(word)
  spans.append([len(ids)])
  ids.append(tokenizer.sep_id)
  units.append(SEP)
  if any(len(s) == 0 for s in spans):
    raise ValueError(f"a word of {' '.join(words)!r} encodes to no piece")
  if max_len is not None and len(ids) > max_len:
    raise ValueError(f"{len(ids)} tokens with [CLS] and [SEP], more than max_len={max_len}")
  return np.asarray(ids, np.int32), units, spans


def stack_capture(capture: Any, prefix: str = "encoder/") -> np.ndarray:
  """A Capture's encoder layers as one array `[layers, heads, n, n]` (layer order)."""
  paths = [p for p in capture.weights if p.startswith(prefix)]
  if not paths:
    raise ValueError(f"the capture has no layer under {prefix!r}; layers: "
                     f"{', '.join(capture.weights) or 'none'}")
  return np.stack([capture.weights[p] for p in paths])


# ------------------------------------------------------------------------------ categories


def _as_layers(w: Any) -> np.ndarray:
  w = np.asarray(w, np.float64)
  if w.ndim == 3:
    w = w[None]
  if w.ndim != 4 or w.shape[-1] != w.shape[-2]:
    raise ValueError(f"weights must be [layers, heads, n, n] or [heads, n, n] self-attention, "
                     f"got shape {w.shape}")
  return w


def head_roles(weights: Sequence[Any], units: Sequence[Sequence[str]],
               spans: Sequence[Sequence[Sequence[int]]] | None = None,
               categories: Mapping[str, Category] | None = None) -> dict[str, np.ndarray]:
  """{category: `[layers, heads]`} mean attention on the category's targets (module docstring).

  Args:
    weights: per example, the token weights `[layers, heads, n_tokens, n_tokens]` (or
      `[heads, n, n]`) of its real tokens (no padding).
    units: per example, the strings of its units: words (with spans) or tokens.
    spans: per example, each unit's token positions (None: units are tokens).
    categories: {name: units -> bool `[n, n]`}, default CATEGORIES.
  A category with no query row that has a target in any example scores NaN.
  """
  categories = CATEGORIES if categories is None else categories
  if len(weights) != len(units) or (spans is not None and len(spans) != len(units)):
    raise ValueError(f"{len(weights)} weights, {len(units)} unit lists"
                     + (f" and {len(spans)} span lists" if spans is not None else "")
                     + ": one of each per example")
  sums: dict[str, np.ndarray] = {}
  rows = dict.fromkeys(categories, 0)
  for i, (w, names) in enumerate(zip(weights, units)):
    w = _as_layers(w)
    if spans is not None:
      w = word_attention(w, spans[i])
    if w.shape[-1] != len(names):
      raise ValueError(f"example {i}: {len(names)} units for weights over {w.shape[-1]}")
    for name, category in categories.items():
      mask = np.asarray(category(names), bool)  # [n, n]
      has = mask.any(-1)  # [n]: query rows with a target
      mass = (w * mask).sum(-1)[..., has].sum(-1)  # [layers, heads]
      sums[name] = sums.get(name, 0.0) + mass
      rows[name] += int(has.sum())
  shape = _as_layers(weights[0]).shape[:2] if weights else (0, 0)
  return {name: (sums[name] / rows[name] if rows[name] else np.full(shape, np.nan))
          for name in categories}


def uniform_roles(units: Sequence[Sequence[str]],
                  spans: Sequence[Sequence[Sequence[int]]] | None = None,
                  categories: Mapping[str, Category] | None = None) -> dict[str, float]:
  """{category: chance level}: `head_roles` of uniform attention over each example's tokens."""
  weights = []
  for i, names in enumerate(units):
    n = sum(len(s) for s in spans[i]) if spans is not None else len(names)
    weights.append(np.full((1, 1, n, n), 1.0 / n))
  return {name: float(value[0, 0]) for name, value in
          head_roles(weights, units, spans, categories).items()}


# ------------------------------------------------------------------------------ pronouns


@dataclasses.dataclass(frozen=True)
class MarkedSentence:
  """A sentence whose pronoun, antecedent and candidate nouns are marked (`parse_marked`)."""
  # The sentence's words, markers removed.
  words: tuple[str, ...]
  # Word indices (into `words`) of the pronoun, its antecedent and every candidate noun (the
  # antecedent included), ascending.
  pronoun: int
  antecedent: int
  candidates: tuple[int, ...]

  def nearest_candidate(self) -> int | None:
    """The candidate nearest before the pronoun (None: no candidate before it)."""
    before = [c for c in self.candidates if c < self.pronoun]
    return before[-1] if before else None


def parse_marked(line: str, where: str = "the sentence") -> MarkedSentence:
  """A sentence of words split by spaces in which `<word>` is the pronoun, `[word]` its
  antecedent (before it) and `{word}` another candidate noun, e.g.
  "the [animal] did n't cross the {street} because <it> was too tired ."
  Raises DataFormatError (naming `where`) unless there is one pronoun and one antecedent."""
  words, marks = [], {"<": [], "[": [], "{": []}
  for i, token in enumerate(line.split()):
    for open_, close in (("<", ">"), ("[", "]"), ("{", "}")):
      if len(token) > 2 and token[0] == open_ and token[-1] == close:
        marks[open_].append(i)
        token = token[1:-1]
        break
    words.append(token)
  if len(marks["<"]) != 1 or len(marks["["]) != 1:
    raise DataFormatError(f"{where}: mark one pronoun as <word> and one antecedent as [word] "
                          f"(found {len(marks['<'])} and {len(marks['['])}): {line.strip()!r}")
  pronoun, antecedent = marks["<"][0], marks["["][0]
  if antecedent >= pronoun:
    raise DataFormatError(f"{where}: the antecedent [word] must come before the pronoun "
                          f"<word>: {line.strip()!r}")
  return MarkedSentence(tuple(words), pronoun, antecedent,
                        tuple(sorted(marks["{"] + [antecedent])))


def read_marked(path: str | os.PathLike) -> list[MarkedSentence]:
  """The marked sentences of a UTF-8 file, one per line (`parse_marked`); blank lines and lines
  starting with # are skipped. Raises DataFormatError naming the file and the line."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise DataFormatError(f"{path}: no such file of marked sentences")
  out = []
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if line.strip() and not line.lstrip().startswith("#"):
      out.append(parse_marked(line, f"{path} line {number}"))
  if not out:
    raise DataFormatError(f"{path}: no marked sentence in the file")
  return out


def _choices(sentence: MarkedSentence, among: str) -> list[int]:
  """Word indices the argmax chooses from ("all" or "candidates"), as indices into `words`."""
  if among == "candidates":
    return list(sentence.candidates)
  return [i for i in range(len(sentence.words)) if i != sentence.pronoun]


def antecedent_scores(weights: Sequence[Any], spans: Sequence[Sequence[Sequence[int]]],
                      sentences: Sequence[MarkedSentence]) -> dict[str, np.ndarray]:
  """Per head, over the sentences: {"all", "candidates": share whose pronoun's most-attended
  word (among those words) is the antecedent `[layers, heads]`, "weight": the mean word-level
  attention from the pronoun to the antecedent `[layers, heads]`, "hits_all", "hits_candidates":
  whether each sentence's choice is the antecedent, bool `[sentences, layers, heads]`}.

  weights: per sentence the token weights `[layers, heads, n, n]` of `[CLS] words [SEP]`; spans:
  per sentence the token positions of those units, [CLS] first (so word k is unit k + 1).
  """
  if not (len(weights) == len(spans) == len(sentences)) or not sentences:
    raise ValueError(f"{len(weights)} weights, {len(spans)} span lists and {len(sentences)} "
                     f"sentences: one of each per sentence, at least one")
  hits: dict[str, list[np.ndarray]] = {"all": [], "candidates": []}
  weight = 0.0
  for w, sp, s in zip(weights, spans, sentences):
    if len(sp) != len(s.words) + 2:
      raise ValueError(f"{len(sp)} spans for {len(s.words)} words with [CLS] and [SEP]")
    row = word_attention(_as_layers(w), sp)[..., s.pronoun + 1, 1:-1]  # [layers, heads, words]
    weight = weight + row[..., s.antecedent]
    for among in hits:
      choices = _choices(s, among)
      best = np.asarray(choices)[np.argmax(row[..., choices], axis=-1)]  # [layers, heads]
      hits[among].append(best == s.antecedent)
  n = len(sentences)
  out = {among: np.mean(hit, axis=0) for among, hit in hits.items()}
  return {**out, "weight": weight / n, "hits_all": np.stack(hits["all"]),
          "hits_candidates": np.stack(hits["candidates"])}


def antecedent_baselines(sentences: Sequence[MarkedSentence]) -> dict[str, float]:
  """{"all", "candidates": the expected accuracy of a uniformly random choice among those words
  (mean of 1 / their number), "nearest_candidate": the share of sentences whose nearest
  candidate before the pronoun is the antecedent}."""
  n = len(sentences)
  return {"all": sum(1.0 / len(_choices(s, "all")) for s in sentences) / n,
          "candidates": sum(1.0 / len(_choices(s, "candidates")) for s in sentences) / n,
          "nearest_candidate": sum(s.nearest_candidate() == s.antecedent for s in sentences) / n}


# ------------------------------------------------------------------------------ figure


def plot_head_roles(scores: Mapping[str, Any], chance: Mapping[str, float] | None = None, *,
                    title: str | None = None, path=None):
  """One heatmap per category, layers x heads, each cell annotated with its score; the panel's
  title gives the chance level. Colours run from 0 to 1 in every panel. Saved if `path`."""
  from attnlab import plotting  # pylint: disable=g-import-not-at-top  (matplotlib is slow)
  names = list(scores)
  if not names:
    raise ValueError("plot_head_roles needs at least one category")
  first = np.asarray(scores[names[0]])
  layers, heads = first.shape
  cols = min(3, len(names))
  rows = -(-len(names) // cols)
  fig = plotting._figure((cols * (1.6 + 0.7 * heads), rows * (1.2 + 0.5 * layers)))  # pylint: disable=protected-access
  fig.set_layout_engine("constrained")  # room for every panel's title and axis labels
  axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
  image = None
  for ax, name in zip(axes, names):
    values = np.asarray(scores[name], np.float64)
    image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest")
    for i in range(layers):
      for j in range(heads):
        if np.isfinite(values[i, j]):
          ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=7,
                  color="black" if values[i, j] > 0.6 else "white")
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.set_xlabel("head", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    label = name if chance is None or name not in chance else f"{name} (chance {chance[name]:.2f})"
    ax.set_title(label, fontsize=9)
  for ax in axes[len(names):]:
    ax.axis("off")
  if image is not None:
    fig.colorbar(image, ax=list(axes[:len(names)]), fraction=0.03, pad=0.03)
  if title:
    fig.suptitle(title, fontsize=10)
  return plotting._save(fig, path)  # pylint: disable=protected-access
