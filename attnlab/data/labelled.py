"""Labelled texts by name: the data of a text classifier (attnlab/tasks/rnn_classification.py).

    texts = labelled.read(config.data, "train", limit=0)   # LabelledTexts(texts, labels, num_classes)

`config.data.name` picks a reader; a reader takes the data group (it reads the fields it needs:
`data_dir`, `manual_dir`, its own group), a split ("train" or "validation") and `limit` (the first
N examples; 0 = all), and returns every example as text and an int label in 0..num_classes-1.
The task tokenizes the texts itself, so every reader feeds every tokenizer.

Readers:
- `sst2`: GLUE SST-2 (`attnlab.data.get_dataset("sst2", ...)`: ../shared/data, $ATTNLAB_DATA_DIR
  or a download), train (67,349 phrases) and validation (872 sentences); 2 classes.
- `cue_word`: the synthetic task of `attnlab.data.synthetic.cue_word` (no files): `limit`
  examples generated from the options of the `data.cue_word` group (seed, lengths, vocabulary,
  classes); a limit of 0 is refused (a generated split has no size of its own).

- `csv`: the user's own labelled file (attnlab/data/labeled_csv.py, the format and checks BERT's
  `dataset=csv` uses): the text column `data.text_column` and the label column
  `data.label_column` of `data.path`; validation rows from `data.valid_path`, else the held-out
  `data.valid_fraction` (seed `data.valid_seed`). The classes are the file's sorted distinct
  labels (`names`). One text per example (no sentence pairs).

Another source is one function `reader(data, split, limit)` added with `register_reader(name)`;
its fields go into the data group of the config file that offers it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from attnlab.data import synthetic
from attnlab.errors import DataError

# The splits a reader is asked for.
SPLITS = ("train", "validation")


@dataclasses.dataclass(frozen=True)
class LabelledTexts:
  """Examples of one split: texts[i] has label labels[i] (int32, in 0..num_classes - 1)."""
  texts: list[str]
  labels: np.ndarray
  num_classes: int
  # The name of each class id, where the data have names (csv); () otherwise.
  names: tuple[str, ...] = ()

  def __post_init__(self):
    if len(self.texts) != len(self.labels):
      raise DataError(f"{len(self.texts)} texts but {len(self.labels)} labels")
    if len(self.labels) and not (0 <= self.labels.min() and self.labels.max() < self.num_classes):
      raise DataError(f"labels must lie in 0..{self.num_classes - 1}, found "
                      f"{int(self.labels.min())}..{int(self.labels.max())}")


Reader = Callable[[Any, str, int], LabelledTexts]
_READERS: dict[str, Reader] = {}


def register_reader(name: str) -> Callable[[Reader], Reader]:
  """Decorator: makes `data.name = name` read labelled texts with the decorated function."""
  def decorator(fn: Reader) -> Reader:
    if name in _READERS and _READERS[name] is not fn:
      raise ValueError(f"labelled-text reader {name!r} is already registered; pick another name")
    _READERS[name] = fn
    return fn
  return decorator


def reader_names() -> list[str]:
  """The names `data.name` may take."""
  return list(_READERS)


def read(data: Any, split: str, limit: int = 0) -> LabelledTexts:
  """The examples of `split` of the data set `data.name` (the first `limit`; 0 = all)."""
  if data.name not in _READERS:
    raise DataError(f"unknown data.name {data.name!r} for a text classifier; valid: "
                    f"{', '.join(_READERS)}")
  if split not in SPLITS:
    raise DataError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
  return _READERS[data.name](data, split, int(limit))


@register_reader("sst2")
def read_sst2(data: Any, split: str, limit: int) -> LabelledTexts:
  """GLUE SST-2 (module docstring)."""
  # pylint: disable=g-import-not-at-top  (the TFDS builders load only when SST-2 is read)
  from attnlab import data as data_lib
  from attnlab.data.builders import sst2
  examples = data_lib.get_dataset("sst2", f"{split}[:{limit}]" if limit > 0 else split,
                                  data_dir=data.get("data_dir") or None,
                                  manual_dir=data.get("manual_dir") or None)
  examples = list(examples)
  return LabelledTexts([ex["sentence"] for ex in examples],
                       np.array([ex["label"] for ex in examples], np.int32), len(sst2.LABELS))


@register_reader("cue_word")
def read_cue_word(data: Any, split: str, limit: int) -> LabelledTexts:
  """The synthetic cue_word task (module docstring)."""
  if limit < 1:
    raise DataError(f"cue_word generates its examples: set data.num_train and data.num_eval "
                    f">= 1 (got {limit} for the {split} split)")
  options = dict(data.cue_word)
  examples = synthetic.get_synthetic("cue_word", split, num_examples=limit, **options)
  examples = examples[:]
  return LabelledTexts([ex["sentence"] for ex in examples],
                       np.array([ex["label"] for ex in examples], np.int32),
                       int(options.get("num_classes", 2)))


@register_reader("csv")
def read_csv(data: Any, split: str, limit: int) -> LabelledTexts:
  """A labelled CSV/TSV file (module docstring)."""
  from attnlab.data import labeled_csv  # pylint: disable=g-import-not-at-top
  if data.get("text_pair_column", ""):
    raise DataError("the RNN classifier reads one text per example: leave data.text_pair_column "
                    "empty (sentence pairs: configs/bert.py:mode=finetune,dataset=csv)")
  rows, train, valid = labeled_csv.read_splits(data)
  names = labeled_csv.label_set(rows)
  part = train if split == "train" else valid
  if limit > 0:
    part = part.select(range(min(limit, len(part))))
  return LabelledTexts(list(part.texts), labeled_csv.label_ids(part, names, data.path),
                       len(names), names)
