"""`listops`: the ListOps task of the Long Range Arena (Tay et al. 2021; Nangia & Bowman 2018).

Each example is a nested prefix expression over the digits 0-9 and four operators, written as
space-separated tokens; the label (10 classes) is its value:

    [ MAX 4 3 [ MIN 2 3 ] 1 0 [ MED 1 5 8 9 2 ] ]   ->   5

Operators (each takes 2..`max_args` arguments): MIN, MAX, MED (the median; of an even number of
values the lower middle one, `sorted(values)[(n - 1) // 2]`) and SM (SUM_MOD: the sum modulo 10).
Tokens: the ten digits, the four operator names, "[" and "]" (`VOCAB`). Nesting depth (operators
inside operators, the outermost at depth 1) is at most `max_depth` (LRA: 10).

Generator (written from the paper's description): each example's length in tokens is drawn
uniformly from [min_len, max_len] (the paper: 500-2000), then a random tree of exactly that length
is grown top-down: an operator node of length n has 3 tokens of its own ("[", the operator, "]")
and splits the other n - 3 among 2..max_args arguments, each a digit (1 token) or a subtree
(>= 5 tokens, no longer than the nesting depth left allows); the number of arguments, how many
of them are subtrees, and the subtrees' lengths are drawn uniformly among the feasible choices.
The operator of each node and each digit are uniform. Split i is drawn from
`np.random.default_rng([seed, i])`, so the same config gives the same examples everywhere.

Sizes (builder configs): runlocal (200/50/50 examples, 20-100 tokens), cpu (20,000/1,000/1,000,
100-500 tokens: the CPU study), paper (96,000/2,000/2,000, 500-2000 tokens: the LRA setting);
`Listops.custom_config(preset, min_len=..., max_len=...)` changes any setting.

Examples: `{"expression": str (space-separated tokens), "label": int (0-9)}`.
"""

from __future__ import annotations

import dataclasses
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


def capacity(levels: int, max_args: int) -> int:
  """The most tokens of an expression with at most `levels` nested operators (0: one digit)."""
  return 1 if levels <= 0 else _NODE_TOKENS + max_args * capacity(levels - 1, max_args)


def _feasible_counts(total: int, max_args: int, cap: int) -> list[tuple[int, int]]:
  """(arguments k, subtrees s) pairs that can split `total` tokens: k - s digits, s subtrees of
  _MIN_SUBTREE..cap tokens each."""
  pairs = []
  for k in range(2, min(max_args, total) + 1):
    extra = total - k  # tokens beyond one per argument
    for s in range(0, k + 1):
      if cap < _MIN_SUBTREE and s:
        break
      lo, hi = (_MIN_SUBTREE - 1) * s, (cap - 1) * s
      if lo <= extra <= hi:
        pairs.append((k, s))
  return pairs


def _split(rng: np.random.Generator, total: int, max_args: int, cap: int) -> list[int]:
  """Lengths of the arguments of a node whose arguments have `total` tokens together."""
  pairs = _feasible_counts(total, max_args, cap)
  if not pairs:
    raise ValueError(f"cannot split {total} tokens into 2..{max_args} arguments of at most {cap}")
  ks = sorted({k for k, _ in pairs})
  k = ks[rng.integers(len(ks))]
  ss = [s for kk, s in pairs if kk == k]
  s = ss[rng.integers(len(ss))]
  if s == 0:
    return [1] * k
  # s subtrees of _MIN_SUBTREE + e_i tokens, sum e_i = spare, 0 <= e_i <= cap - _MIN_SUBTREE.
  spare = total - (k - s) - _MIN_SUBTREE * s
  room = cap - _MIN_SUBTREE
  extra = np.zeros(s, np.int64)
  if spare:
    weights = rng.dirichlet(np.ones(s))
    extra = np.minimum(np.floor(weights * spare).astype(np.int64), room)
    left = spare - int(extra.sum())
    while left:  # hand out the rounding remainder (and any overflow) one token at a time
      open_ = np.flatnonzero(extra < room)
      i = open_[rng.integers(len(open_))]
      extra[i] += 1
      left -= 1
  lengths = [1] * (k - s) + [_MIN_SUBTREE + int(e) for e in extra]
  return [lengths[i] for i in rng.permutation(k)]


def random_expression(rng: np.random.Generator, length: int, max_depth: int = 10,
                      max_args: int = 10) -> tuple[list[str], int]:
  """(tokens, value) of a random expression of exactly `length` tokens (module docstring)."""
  if length != 1 and length < _MIN_SUBTREE:
    raise ValueError(f"an expression has 1 or >= {_MIN_SUBTREE} tokens, not {length}")
  if length > capacity(max_depth, max_args):
    raise ValueError(f"{length} tokens need more nesting than max_depth={max_depth} allows")
  tokens: list[str] = []

  def grow(n: int, levels: int) -> int:
    if n == 1:
      digit = int(rng.integers(10))
      tokens.append(DIGITS[digit])
      return digit
    op = OPERATORS[rng.integers(len(OPERATORS))]
    tokens.extend((OPEN, op))
    parts = _split(rng, n - _NODE_TOKENS, max_args, capacity(levels - 1, max_args))
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
  CONFIG_CLASS = ListopsConfig
  BUILDER_CONFIGS = [
      ListopsConfig(name="runlocal", description="seconds-long checks", num_train=200,
                    num_validation=50, num_test=50, min_len=20, max_len=100),
      ListopsConfig(name="cpu", description="the reduced scale of the CPU study",
                    num_train=20_000, num_validation=1_000, num_test=1_000, min_len=100,
                    max_len=500),
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
    if config.max_len > most:
      raise DataError(f"listops: max_len={config.max_len} tokens cannot be reached with "
                      f"max_depth={config.max_depth} and max_args={config.max_args} (at most "
                      f"{most}); raise max_depth or max_args, or lower max_len")

  @classmethod
  def generate(cls, config: ListopsConfig, split: str, rng: np.random.Generator,
               count: int) -> Iterator[dict[str, Any]]:
    for _ in range(count):
      length = int(rng.integers(config.min_len, config.max_len + 1))
      tokens, value = random_expression(rng, length, config.max_depth, config.max_args)
      yield {"expression": " ".join(tokens), "label": value}

  @classmethod
  def to_example(cls, record: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    return {"expression": base.as_str(record["expression"]), "label": int(record["label"])}
