"""`listops`: the ListOps task of the Long Range Arena (Tay et al. 2021; Nangia & Bowman 2018).

Each example is a nested prefix expression over the digits 0-9 and four operators, written as
space-separated tokens; the label (10 classes) is its value:

    [ MAX 4 3 [ MIN 2 3 ] 1 0 [ MED 1 5 8 9 2 ] ]   ->   5

Operators (each takes 2..`max_args` arguments): MIN, MAX, MED (the median; of an even number of
values the lower middle one, `sorted(values)[(n - 1) // 2]`) and SM (SUM_MOD: the sum modulo 10).
Tokens: the ten digits, the four operator names, "[" and "]" (`VOCAB`). Nesting depth (operators
inside operators, the outermost at depth 1) is at most `max_depth` (LRA: 10).

Generator (written from the paper's description): each example's length in tokens is drawn
uniformly from the lengths in [min_len, max_len] (the paper: 500-2000) that such an expression can
have (`possible_lengths`: with few arguments some lengths are impossible), then a random tree of
exactly that length is grown top-down: an operator node of length n has 3 tokens of its own ("[",
the operator, "]") and splits the other n - 3 among k = 2..max_args arguments, s of them subtrees
(>= 5 tokens, within the nesting depth left) and k - s digits; k is uniform among the feasible
numbers, then s uniform among the feasible ones for that k, and the subtrees' lengths are the
feasible lengths nearest to Dirichlet(1, ..., 1) shares of their total (feasibility comes from
exact tables of the reachable lengths per depth, so the tree always closes at the drawn length).
The operator of each node and each digit are uniform. Split i is drawn from
`np.random.default_rng([seed, i])`, so the same config gives the same examples everywhere.

Sizes (builder configs): runlocal (200/50/50 examples, 20-100 tokens), cpu (20,000/1,000/1,000,
50-250 tokens: the CPU study), paper (96,000/2,000/2,000, 500-2000 tokens: the LRA setting);
`Listops.custom_config(preset, min_len=..., max_len=...)` changes any setting.

Examples: `{"expression": str (space-separated tokens), "label": int (0-9)}`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator, Mapping

import numpy as np
import tensorflow_datasets as tfds

from attnlab.data.builders import base
from attnlab.data.builders import generated
from attnlab.errors import DataError

# Operator names, in the order of their ids.
OPERATORS = ("MIN", "MAX", "MED", "SM")
OPEN, CLOSE = "[", "]"
DIGITS = tuple(str(d) for d in range(10))
# Every token an expression uses.
VOCAB = DIGITS + OPERATORS + (OPEN, CLOSE)
NUM_CLASSES = 10
# Tokens an operator node has besides its arguments: "[", the operator, "]".
_NODE_TOKENS = 3
# Shortest subtree: "[ OP d d ]".
_MIN_SUBTREE = _NODE_TOKENS + 2


def apply_operator(op: str, values: list[int]) -> int:
  """The value of operator `op` on `values` (module docstring)."""
  if op == "MIN":
    return min(values)
  if op == "MAX":
    return max(values)
  if op == "MED":
    return sorted(values)[(len(values) - 1) // 2]
  if op == "SM":
    return sum(values) % 10
  raise ValueError(f"unknown ListOps operator {op!r}; valid: {', '.join(OPERATORS)}")


def evaluate(expression: str) -> int:
  """The value of a space-separated ListOps expression (DataError naming the token if it is not
  one)."""
  stack: list[list] = []  # open operators: [operator, argument values...]
  result = None
  tokens = expression.split()
  for i, token in enumerate(tokens):
    if token == OPEN:
      if i + 1 >= len(tokens) or tokens[i + 1] not in OPERATORS:
        raise DataError(f"listops: '[' at token {i} is not followed by an operator")
      stack.append([])
    elif token in OPERATORS:
      if not stack or stack[-1]:
        raise DataError(f"listops: operator {token} at token {i} does not follow '['")
      stack[-1].append(token)
    elif token == CLOSE:
      if not stack or len(stack[-1]) < 3:
        raise DataError(f"listops: ']' at token {i} closes no operator with >= 2 arguments")
      op, *values = stack.pop()
      value = apply_operator(op, values)
      if stack:
        stack[-1].append(value)
      elif result is None and i == len(tokens) - 1:
        result = value
      else:
        raise DataError(f"listops: tokens after the end of the expression at token {i}")
    elif token in DIGITS:
      if stack:
        stack[-1].append(int(token))
      elif len(tokens) == 1:
        result = int(token)
      else:
        raise DataError(f"listops: digit {token} at token {i} is outside any operator")
    else:
      raise DataError(f"listops: unknown token {token!r} at {i}; valid: {' '.join(VOCAB)}")
  if stack or result is None:
    raise DataError(f"listops: {len(stack)} unclosed '[' in {expression[:60]!r}")
  return result


def capacity(levels: int, max_args: int) -> int:
  """The most tokens of an expression with at most `levels` nested operators (0: one digit)."""
  return 1 if levels <= 0 else _NODE_TOKENS + max_args * capacity(levels - 1, max_args)


def _bits(mask: int) -> list[int]:
  """The set bits of `mask` (the members of a set of lengths kept as a bit mask)."""
  out, i = [], 0
  while mask:
    if mask & 1:
      out.append(i)
    mask >>= 1
    i += 1
  return out


@functools.lru_cache(maxsize=32)
def _tables(levels: int, max_args: int, limit: int) -> tuple[list[int], list[list[int]]]:
  """Which lengths (<= limit) can be built, as bit masks.

  Returns (lengths, sums): lengths[h] has bit n set when an expression of n tokens with at most h
  nested operators exists (h = 0: n = 1, a digit); sums[h][j] has bit n set when j subtrees
  (operator expressions, >= 5 tokens) of at most h levels can have n tokens together.
  Not every length is possible: with max_args=4 an operator of 8 tokens would need 5 digits.
  """
  keep = (1 << (limit + 1)) - 1
  lengths, sums = [1 << 1], []
  for h in range(levels + 1):
    subtrees = _bits(lengths[h] & ~(1 << 1))
    by_count = [1]  # j = 0 subtrees: 0 tokens
    for _ in range(max_args):
      acc, prev = 0, by_count[-1]
      for p in subtrees:
        acc |= prev << p
      by_count.append(acc & keep)
    sums.append(by_count)
    if h == levels:
      break
    # An operator with h + 1 levels: 3 tokens + (k - s) digits + s subtrees of <= h levels.
    nxt = 1 << 1
    for k in range(2, max_args + 1):
      for s in range(k + 1):
        nxt |= by_count[s] << (_NODE_TOKENS + k - s)
    lengths.append(nxt & keep)
  return lengths, sums


@functools.lru_cache(maxsize=32)
def _sum_arrays(levels: int, max_args: int, limit: int) -> np.ndarray:
  """bool `[levels + 1, max_args + 1, limit + 1]`: `_tables`' sums as arrays (fast lookups)."""
  _, sums = _tables(levels, max_args, limit)
  out = np.zeros((levels + 1, max_args + 1, limit + 1), bool)
  for h, by_count in enumerate(sums):
    for j, mask in enumerate(by_count):
      out[h, j, _bits(mask)] = True
  return out


def _limit(length: int) -> int:
  """The table size used for expressions of `length` tokens (a power of two: few tables)."""
  return max(64, 1 << (length - 1).bit_length())


def possible_lengths(max_depth: int, max_args: int, low: int, high: int) -> list[int]:
  """The lengths in [low, high] that an expression with these limits can have."""
  lengths, _ = _tables(max_depth, max_args, _limit(high))
  return [n for n in _bits(lengths[max_depth]) if low <= n <= high]


@functools.lru_cache(maxsize=1 << 16)
def _pairs(table: tuple[int, int, int], levels: int, inner: int) -> tuple[tuple[int, int], ...]:
  """The (arguments k, subtrees s) that can share `inner` tokens under an operator with `levels`
  levels; `table` = (max_depth, max_args, limit) of `_sum_arrays`."""
  max_args = table[1]
  child = _sum_arrays(*table)[levels - 1]
  return tuple((k, s) for k in range(2, max_args + 1) for s in range(k + 1)
               if 0 <= inner - (k - s) < child.shape[1] and child[s, inner - (k - s)])


def _split(rng: np.random.Generator, inner: int, levels: int,
           table: tuple[int, int, int]) -> list[int]:
  """Lengths of the arguments of an operator node with `levels` levels whose arguments have
  `inner` tokens together (module docstring: k, then the number of subtrees s, uniform among the
  feasible ones; the subtrees' lengths near Dirichlet shares of their total)."""
  # [max_args + 1, limit + 1]: which sums j subtrees of <= levels - 1 levels can have
  child = _sum_arrays(*table)[levels - 1]
  pairs = _pairs(table, levels, inner)
  if not pairs:
    raise ValueError(f"no arguments of {inner} tokens fit {levels} levels and {max_args} "
                     f"arguments")
  ks = sorted({k for k, _ in pairs})
  k = ks[rng.integers(len(ks))]
  ss = [s for kk, s in pairs if kk == k]
  s = ss[rng.integers(len(ss))]
  left = inner - (k - s)  # tokens of the s subtrees
  shares = rng.dirichlet(np.ones(s)) if s else np.zeros(0)
  parts = []
  for i in range(s - 1):
    target = left * shares[i] / shares[i:].sum()
    rest = s - i - 1
    ok = lambda p: (_MIN_SUBTREE <= p <= left and child[1, p]  # noqa: E731
                    and child[rest, left - p])
    center = int(round(target))
    for distance in range(left + 1):  # the feasible lengths nearest the target, ties at random
      choices = [p for p in {center - distance, center + distance} if ok(p)]
      if choices:
        break
    p = sorted(choices)[rng.integers(len(choices))]
    parts.append(p)
    left -= p
  if s:
    parts.append(left)
  lengths = [1] * (k - s) + parts
  return [lengths[i] for i in rng.permutation(k)]


def random_expression(rng: np.random.Generator, length: int, max_depth: int = 10,
                      max_args: int = 10) -> tuple[list[str], int]:
  """(tokens, value) of a random expression of exactly `length` tokens (module docstring)."""
  table = (max_depth, max_args, _limit(length))
  lengths, _ = _tables(*table)
  if not (lengths[max_depth] >> length) & 1:
    raise ValueError(f"no expression has {length} tokens with max_depth={max_depth} and "
                     f"max_args={max_args}")
  tokens: list[str] = []

  def grow(n: int, levels: int) -> int:
    if n == 1:
      digit = int(rng.integers(10))
      tokens.append(DIGITS[digit])
      return digit
    op = OPERATORS[rng.integers(len(OPERATORS))]
    tokens.extend((OPEN, op))
    parts = _split(rng, n - _NODE_TOKENS, levels, table)
    values = [grow(p, levels - 1) for p in parts]
    tokens.append(CLOSE)
    return apply_operator(op, values)

  value = grow(length, max_depth)
  return tokens, value


@dataclasses.dataclass(eq=False)
class ListopsConfig(generated.GeneratedConfig):
  """Sizes and generator settings of ListOps."""

  # Fewest and most tokens per expression (each length uniform in between; >= 5).
  min_len: int = 500
  max_len: int = 2000
  # Deepest nesting of operators (LRA: 10).
  max_depth: int = 10
  # Most arguments of one operator.
  max_args: int = 10


class Listops(generated.GeneratedBuilder, skip_registration=True):
  """Generated ListOps expressions and their values (module docstring)."""

  name = "listops"
  # The examples are a function of the generator's code: a change to it needs a new VERSION.
  CONFIG_CLASS = ListopsConfig
  BUILDER_CONFIGS = [
      ListopsConfig(name="runlocal", description="seconds-long checks", num_train=200,
                    num_validation=50, num_test=50, min_len=20, max_len=100),
      ListopsConfig(name="cpu", description="the reduced scale of the CPU study",
                    num_train=20_000, num_validation=1_000, num_test=1_000, min_len=50,
                    max_len=250),
      ListopsConfig(name="paper", description="the Long Range Arena setting", num_train=96_000,
                    num_validation=2_000, num_test=2_000, min_len=500, max_len=2000),
  ]
  DESCRIPTION = ("ListOps (Nangia & Bowman 2018) as in the Long Range Arena (Tay et al. 2021): "
                 "nested MIN/MAX/MED/SM expressions over digits, label = the value (10 classes); "
                 "generated from a seed.")
  HOMEPAGE = "https://github.com/google-research/long-range-arena"
  CITATION = ("@inproceedings{tay2021long, title={Long Range Arena: A Benchmark for Efficient "
              "Transformers}, author={Tay, Yi and others}, booktitle={ICLR}, year={2021}}")

  def _features(self) -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({
        "expression": tfds.features.Text(),
        "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
    })

  @classmethod
  def check_config(cls, config: ListopsConfig) -> None:
    super().check_config(config)
    if not _MIN_SUBTREE <= config.min_len <= config.max_len:
      raise DataError(f"listops: need {_MIN_SUBTREE} <= min_len <= max_len, got "
                      f"min_len={config.min_len}, max_len={config.max_len}")
    if config.max_depth < 1 or config.max_args < 2:
      raise DataError(f"listops: need max_depth >= 1 and max_args >= 2, got "
                      f"max_depth={config.max_depth}, max_args={config.max_args}")
    most = capacity(config.max_depth, config.max_args)
    if config.max_len > most or not possible_lengths(config.max_depth, config.max_args,
                                                     config.min_len, config.max_len):
      raise DataError(f"listops: no expression of {config.min_len}-{config.max_len} tokens has "
                      f"max_depth={config.max_depth} and max_args={config.max_args} (at most "
                      f"{capacity(config.max_depth, config.max_args)} tokens); raise max_depth or "
                      f"max_args, or lower max_len")

  @classmethod
  def generate(cls, config: ListopsConfig, split: str, rng: np.random.Generator,
               count: int) -> Iterator[dict[str, Any]]:
    lengths = possible_lengths(config.max_depth, config.max_args, config.min_len, config.max_len)
    for _ in range(count):
      length = lengths[rng.integers(len(lengths))]
      tokens, value = random_expression(rng, length, config.max_depth, config.max_args)
      yield {"expression": " ".join(tokens), "label": value}

  @classmethod
  def to_example(cls, record: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    return {"expression": base.as_str(record["expression"]), "label": int(record["label"])}
