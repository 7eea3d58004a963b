"""Synthetic tasks: deterministic by seed, no files needed.

Each task is a random-access sequence: example `i` of split `s` is drawn from its own generator
seeded by `(seed, split index, i)`, so it does not depend on `num_examples` or on which other
examples were read. Splits draw from independent streams but are not de-duplicated against each
other (identical examples are possible when the task's space is small).

Tasks and example fields (python `str`, but for induction's ints):
- `dates`: {"source": a date written in one of DATE_FORMATS, "target": ISO "YYYY-MM-DD"}; dates
  are uniform over 1950-01-01..2049-12-31, two-digit years mean 1950..2049 ("93" -> 1993,
  "07" -> 2007), numeric dates are day first ("09/10/93" = 9 October 1993).
- `reverse` / `copy`: {"source": random tokens, "target": the tokens reversed / unchanged};
  the number of tokens is uniform in [min_len, max_len].
- `addition`: {"source": "123+4567=", "target": "4690", "text": "123+4567=4690"}; each operand
  has a uniform number of digits in [min_digits, max_digits] (no leading zeros).
- `induction`: {"ids": `length` token ids uniform in [0, vocab_size), "src": int, "dst": int,
  "span": int}: a segment of `span` ids (uniform in [min_span, max_span]) starting at `src` is
  copied over the ids at `dst` (src + span <= dst, dst + span <= length; src uniform over where
  both fit, then dst uniform over where the copy fits), so ids[dst:dst + span] ==
  ids[src:src + span]. The copy's offset dst - src varies from example to example, so a head
  attending at a fixed offset cannot find the segment; an induction head (attend to the token
  after the previous occurrence of the current one) predicts ids dst + 1 .. dst + span - 1.
- `cue_word`: {"sentence": words, "label": int} (the fields of SST-2's examples): a sentence of
  min_len..max_len (uniform) filler words "w0".."w<vocab_size - 1>", one of them (at a uniform
  position) replaced by a cue word of its class, "c<label>_<j>" (j < cues_per_class); the label
  is uniform over num_classes. Only the cue decides the label, so a classifier that attends to
  it is right: the offline test of the RNN text classifier (configs/classify.py).
"""

from __future__ import annotations

import collections.abc
import datetime
import string
from typing import Any, Callable, Sequence

import numpy as np

from attnlab.errors import DataError

# Split names and their index in the per-example seed.
SPLITS = ("train", "validation", "test")

_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august",
           "september", "october", "november", "december")
# First and last date of the `dates` task; two-digit years are read inside this century.
_FIRST_DATE = datetime.date(1950, 1, 1)
_LAST_DATE = datetime.date(2049, 12, 31)


def _ordinal(day: int) -> str:
  suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
  return f"{day}{suffix}"


def _date_fields(d: datetime.date) -> dict[str, str]:
  month, weekday = _MONTHS[d.month - 1], _WEEKDAYS[d.weekday()]
  return {
      "d": str(d.day), "dd": f"{d.day:02d}", "dth": _ordinal(d.day),
      "m": str(d.month), "mm": f"{d.month:02d}",
      "month": month, "Month": month.capitalize(), "mon": month[:3], "Mon": month[:3].capitalize(),
      "weekday": weekday, "Weekday": weekday.capitalize(),
      "yyyy": str(d.year), "yy": f"{d.year % 100:02d}",
  }


# name -> str.format pattern over `_date_fields`; the `dates` task picks one uniformly.
DATE_FORMATS: dict[str, str] = {
    "weekday_d_month_yyyy": "{weekday} {d} {month} {yyyy}",    # saturday 9 october 1993
    "dd/mm/yy": "{dd}/{mm}/{yy}",                              # 09/10/93
    "d_Mon_yyyy": "{d} {Mon} {yyyy}",                          # 9 Oct 1993
    "month_d,_yyyy": "{month} {d}, {yyyy}",                    # october 9, 1993
    "d.m.yyyy": "{d}.{m}.{yyyy}",                              # 9.10.1993
    "dd.mm.yy": "{dd}.{mm}.{yy}",                              # 09.10.93
    "d_month_yyyy": "{d} {month} {yyyy}",                      # 9 october 1993
    "mon_d_yyyy": "{mon} {d} {yyyy}",                          # oct 9 1993
    "weekday,_month_d,_yyyy": "{weekday}, {month} {d}, {yyyy}",  # saturday, october 9, 1993
    "d_mon,_yyyy": "{d} {mon}, {yyyy}",                        # 9 oct, 1993
    "dd_Mon_yy": "{dd} {Mon} {yy}",                            # 09 Oct 93
    "d/m/yyyy": "{d}/{m}/{yyyy}",                              # 9/10/1993
    "Weekday_d_Month_yyyy": "{Weekday} {d} {Month} {yyyy}",    # Saturday 9 October 1993
    "dth_of_month_yyyy": "{dth} of {month} {yyyy}",            # 9th of october 1993
    "Month_dth,_yyyy": "{Month} {dth}, {yyyy}",                # October 9th, 1993
}

# Default token alphabet of `reverse`/`copy`: a vocab_size of n uses its first n symbols.
ALPHABET = string.ascii_lowercase + string.digits + string.ascii_uppercase


def make_date(rng: np.random.Generator, formats: Sequence[str]) -> dict[str, str]:
  """One `dates` example."""
  span = (_LAST_DATE - _FIRST_DATE).days
  d = _FIRST_DATE + datetime.timedelta(days=int(rng.integers(0, span + 1)))
  pattern = DATE_FORMATS[formats[int(rng.integers(0, len(formats)))]]
  return {"source": pattern.format(**_date_fields(d)), "target": d.isoformat()}


def make_sequence(rng: np.random.Generator, tokens: Sequence[str], sep: str, min_len: int,
                  max_len: int, reverse: bool) -> dict[str, str]:
  """One `reverse` or `copy` example."""
  length = int(rng.integers(min_len, max_len + 1))
  seq = [tokens[int(j)] for j in rng.integers(0, len(tokens), size=length)]
  out = seq[::-1] if reverse else seq
  return {"source": sep.join(seq), "target": sep.join(out)}


def _number(rng: np.random.Generator, min_digits: int, max_digits: int) -> int:
  digits = int(rng.integers(min_digits, max_digits + 1))
  low = 0 if digits == 1 else 10 ** (digits - 1)
  return int(rng.integers(low, 10 ** digits))


def make_addition(rng: np.random.Generator, min_digits: int, max_digits: int) -> dict[str, str]:
  """One `addition` example."""
  a, b = _number(rng, min_digits, max_digits), _number(rng, min_digits, max_digits)
  source, target = f"{a}+{b}=", str(a + b)
  return {"source": source, "target": target, "text": source + target}


def make_induction(rng: np.random.Generator, length: int, vocab_size: int, min_span: int,
                   max_span: int) -> dict[str, Any]:
  """One `induction` example."""
  ids = rng.integers(0, vocab_size, length)  # [length]
  span = int(rng.integers(min_span, max_span + 1))
  src = int(rng.integers(0, length - 2 * span + 1))
  dst = int(rng.integers(src + span, length - span + 1))
  ids[dst:dst + span] = ids[src:src + span]
  return {"ids": [int(i) for i in ids], "src": src, "dst": dst, "span": span}


def make_cue_word(rng: np.random.Generator, min_len: int, max_len: int, vocab_size: int,
                  num_classes: int, cues_per_class: int) -> dict[str, Any]:
  """One `cue_word` example."""
  length = int(rng.integers(min_len, max_len + 1))
  words = [f"w{int(j)}" for j in rng.integers(0, vocab_size, size=length)]
  label = int(rng.integers(0, num_classes))
  words[int(rng.integers(0, length))] = f"c{label}_{int(rng.integers(0, cues_per_class))}"
  return {"sentence": " ".join(words), "label": label}


class SyntheticDataset(collections.abc.Sequence):
  """`num_examples` examples of one task and split; example i is a pure function of (seed, i)."""

  def __init__(self, name: str, make: Callable[[np.random.Generator], dict[str, str]],
               num_examples: int, seed: int, split: str):
    self.name, self.split, self.seed = name, split, seed
    self._make = make
    self._num_examples = num_examples
    self._split_index = SPLITS.index(split)

  def __len__(self) -> int:
    return self._num_examples

  def __getitem__(self, i):  # int -> dict; slice -> list[dict]
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    j = int(i) + len(self) if int(i) < 0 else int(i)
    if not 0 <= j < len(self):
      raise IndexError(f"{self.name}/{self.split}: index {i} out of range for {len(self)} examples")
    return self._make(np.random.default_rng([self.seed, self._split_index, j]))

  def __repr__(self) -> str:
    return f"SyntheticDataset({self.name}/{self.split}, {len(self)} examples, seed={self.seed})"


def _check_range(name: str, low_name: str, low: int, high_name: str, high: int,
                 minimum: int) -> None:
  if not minimum <= low <= high:
    raise DataError(f"{name}: need {minimum} <= {low_name} <= {high_name}, got {low_name}={low}, "
                    f"{high_name}={high}")


def dates(split: str = "train", *, num_examples: int = 1000, seed: int = 0,
          formats: Sequence[str] | None = None) -> SyntheticDataset:
  """Human-readable dates -> ISO dates; `formats` restricts DATE_FORMATS to the names given."""
  formats = tuple(DATE_FORMATS) if formats is None else tuple(formats)
  unknown = [f for f in formats if f not in DATE_FORMATS]
  if unknown or not formats:
    raise DataError(f"dates: unknown or no formats {unknown}; valid: {', '.join(DATE_FORMATS)}")
  return _dataset("dates", lambda rng: make_date(rng, formats), num_examples, seed, split)


def _tokens(name: str, vocab_size: int, vocab: Sequence[str] | None) -> tuple[str, ...]:
  if vocab is not None:
    tokens = tuple(vocab)
    if len(tokens) < 1 or len(set(tokens)) != len(tokens) or not all(tokens):
      raise DataError(f"{name}: vocab must be distinct non-empty strings, got {list(tokens)[:10]}")
    return tokens
  if not 1 <= vocab_size <= len(ALPHABET):
    raise DataError(f"{name}: vocab_size must be in 1..{len(ALPHABET)} (or pass vocab=[...]), "
                    f"got {vocab_size}")
  return tuple(ALPHABET[:vocab_size])


def _sequence_task(name: str, reverse: bool, split: str, num_examples: int, seed: int,
                   min_len: int, max_len: int, vocab_size: int, vocab: Sequence[str] | None,
                   sep: str | None) -> SyntheticDataset:
  _check_range(name, "min_len", min_len, "max_len", max_len, 1)
  tokens = _tokens(name, vocab_size, vocab)
  sep = ("" if all(len(t) == 1 for t in tokens) else " ") if sep is None else sep
  return _dataset(name, lambda rng: make_sequence(rng, tokens, sep, min_len, max_len, reverse),
                  num_examples, seed, split)


def reverse(split: str = "train", *, num_examples: int = 1000, seed: int = 0, min_len: int = 1,
            max_len: int = 10, vocab_size: int = 10, vocab: Sequence[str] | None = None,
            sep: str | None = None) -> SyntheticDataset:
  """Random token sequences -> the same tokens reversed.

  Tokens are the first `vocab_size` symbols of ALPHABET, or `vocab`; they are joined with `sep`
  (default: "" when every token is one character, so string length = token count, else " ").
  """
  return _sequence_task("reverse", True, split, num_examples, seed, min_len, max_len,
                        vocab_size, vocab, sep)


def copy(split: str = "train", *, num_examples: int = 1000, seed: int = 0, min_len: int = 1,
         max_len: int = 10, vocab_size: int = 10, vocab: Sequence[str] | None = None,
         sep: str | None = None) -> SyntheticDataset:
  """Random token sequences -> the same tokens (see `reverse` for the options)."""
  return _sequence_task("copy", False, split, num_examples, seed, min_len, max_len,
                        vocab_size, vocab, sep)


def addition(split: str = "train", *, num_examples: int = 1000, seed: int = 0,
             min_digits: int = 1, max_digits: int = 4) -> SyntheticDataset:
  """"a+b=" -> "sum" (and "text" = both, for language modelling)."""
  _check_range("addition", "min_digits", min_digits, "max_digits", max_digits, 1)
  return _dataset("addition", lambda rng: make_addition(rng, min_digits, max_digits),
                  num_examples, seed, split)


def induction(split: str = "train", *, num_examples: int = 1000, seed: int = 0,
              length: int = 65, vocab_size: int = 64, min_span: int = 2,
              max_span: int = 16) -> SyntheticDataset:
  """Random token ids with a random-length segment copied to a random later offset (module
  docstring); `length` ids per example (a GPT's block_size + 1: inputs and next-token targets)."""
  _check_range("induction", "min_span", min_span, "max_span", max_span, 2)
  if length < 2 * max_span:
    raise DataError(f"induction: length={length} must be >= 2 * max_span = {2 * max_span} (the "
                    f"segment and its copy must fit)")
  if vocab_size < 2:
    raise DataError(f"induction: vocab_size must be >= 2, got {vocab_size}")
  return _dataset("induction", lambda rng: make_induction(rng, length, vocab_size, min_span,
                                                          max_span),
                  num_examples, seed, split)


def cue_word(split: str = "train", *, num_examples: int = 1000, seed: int = 0, min_len: int = 5,
             max_len: int = 20, vocab_size: int = 50, num_classes: int = 2,
             cues_per_class: int = 3) -> SyntheticDataset:
  """Sentences of filler words with one cue word that decides the label (module docstring)."""
  _check_range("cue_word", "min_len", min_len, "max_len", max_len, 1)
  for name, value in (("vocab_size", vocab_size), ("num_classes", num_classes),
                      ("cues_per_class", cues_per_class)):
    if value < 1:
      raise DataError(f"cue_word: {name} must be >= 1, got {value}")
  return _dataset("cue_word", lambda rng: make_cue_word(rng, min_len, max_len, vocab_size,
                                                        num_classes, cues_per_class),
                  num_examples, seed, split)


def _dataset(name: str, make: Callable[[np.random.Generator], dict[str, str]], num_examples: int,
             seed: int, split: str) -> SyntheticDataset:
  if split not in SPLITS:
    raise DataError(f"{name}: unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
  if int(num_examples) < 1:
    raise DataError(f"{name}: num_examples must be >= 1, got {num_examples}; an empty split "
                    f"cannot train or evaluate anything")
  if int(seed) < 0:
    raise DataError(f"{name}: seed must be >= 0, got {seed}")
  return SyntheticDataset(name, make, int(num_examples), int(seed), split)


# name -> constructor(split, **options); the one place a synthetic task is registered.
SYNTHETIC: dict[str, Callable[..., SyntheticDataset]] = {
    "dates": dates,
    "reverse": reverse,
    "copy": copy,
    "addition": addition,
    "induction": induction,
    "cue_word": cue_word,
}


def get_synthetic(name: str, split: str = "train", **options: Any) -> SyntheticDataset:
  """The synthetic task `name`; DataError listing valid names or options when one is wrong."""
  if name not in SYNTHETIC:
    raise DataError(f"unknown synthetic task {name!r}; valid names: {', '.join(SYNTHETIC)}")
  fn = SYNTHETIC[name]
  valid = list(fn.__kwdefaults__ or {})
  unknown = sorted(set(options) - set(valid))
  if unknown:
    raise DataError(f"{name}: unknown option(s) {', '.join(unknown)}; valid options: "
                    f"{', '.join(valid)}")
  return fn(split, **options)
