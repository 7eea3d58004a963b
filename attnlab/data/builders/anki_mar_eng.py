"""`anki_mar_eng`: English-Marathi sentence pairs (Tatoeba via manythings.org/anki).

Raw file: mar.txt, one pair a line, `english<TAB>marathi[<TAB>attribution]` (the downloaded file
has a third attribution column, the local copy in ../shared/data has two). The file is sorted by
length, so the pairs are shuffled with a fixed seed before being cut into train/validation/test
(80/10/10, validation and test rounded down).

Examples: `{"source": str, "target": str}`, English -> Marathi by default, Marathi -> English
with `direction="mr-en"`.
"""

from __future__ import annotations

import pathlib
from typing import Any, Mapping

import numpy as np
import tensorflow_datasets as tfds

from attnlab.data.builders import base
from attnlab.errors import DataError

# Seed of the shuffle that precedes the split; changing it needs a new VERSION.
SPLIT_SEED = 0
# Fractions of the pairs in validation and test (rounded down); train takes the rest.
VALIDATION_FRACTION = 0.1
TEST_FRACTION = 0.1
# Translation directions get_dataset accepts.
DIRECTIONS = ("en-mr", "mr-en")


def parse_pairs(path: pathlib.Path) -> tuple[list[tuple[str, str]], int]:
  """Reads `english<TAB>marathi[<TAB>...]` lines; returns (pairs, blank lines skipped)."""
  return base.read_pairs(path, ("english", "marathi"), "english<TAB>marathi")


def split_pairs(pairs: list[tuple[str, str]], seed: int = SPLIT_SEED
                ) -> dict[str, list[tuple[str, str]]]:
  """Shuffles with `seed`, then train = first n - n_val - n_test, validation, test = last n_test."""
  n = len(pairs)
  n_val, n_test = int(n * VALIDATION_FRACTION), int(n * TEST_FRACTION)
  order = np.random.default_rng(seed).permutation(n)
  shuffled = [pairs[i] for i in order]
  n_train = n - n_val - n_test
  return {"train": shuffled[:n_train], "validation": shuffled[n_train:n_train + n_val],
          "test": shuffled[n_train + n_val:]}


class AnkiMarEng(base.RawFileBuilder, skip_registration=True):
  """English-Marathi pairs from the Anki/Tatoeba mar-eng file, shuffled then split 80/10/10."""

  name = "anki_mar_eng"
  SOURCE = base.RawSource(
      folder="anki-mar-eng",
      files=("mar.txt",),
      url="https://www.manythings.org/anki/mar-eng.zip",
      # No recorded size/sha256: manythings.org rebuilds the zip as Tatoeba grows, so the
      # download is not verified (TFDS logs the size and sha256 it got).
      size=None,
      sha256=None,
  )
  SPLITS = ("train", "validation", "test")
  DESCRIPTION = ("English-Marathi sentence pairs from Tatoeba (manythings.org/anki mar-eng), "
                 f"shuffled with seed {SPLIT_SEED} and split 80/10/10.")
  HOMEPAGE = "https://www.manythings.org/anki/"
  CITATION = "Tatoeba (https://tatoeba.org), CC-BY 2.0 FR; pairs collected by manythings.org."
  EXAMPLE_OPTIONS = {"direction": "en-mr"}

  def _features(self) -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({"en": tfds.features.Text(), "mr": tfds.features.Text()})

  def _parse(self, paths: dict[str, pathlib.Path]) -> tuple[dict[str, list[dict]], dict]:
    pairs, blank = parse_pairs(paths["mar.txt"])
    splits = split_pairs(pairs)
    rows = {k: [{"en": en, "mr": mr} for en, mr in v] for k, v in splits.items()}
    return rows, {"blank_lines_skipped": {"mar.txt": blank}, "num_pairs": len(pairs)}

  @classmethod
  def check_options(cls, direction: str = "en-mr", **options: Any) -> None:
    if direction not in DIRECTIONS:
      raise DataError(f"anki_mar_eng: unknown direction {direction!r}; valid: "
                      f"{', '.join(DIRECTIONS)}")

  @classmethod
  def to_example(cls, record: Mapping[str, Any], direction: str = "en-mr",
                 **options: Any) -> dict[str, Any]:
    en, mr = base.as_str(record["en"]), base.as_str(record["mr"])
    return {"source": en, "target": mr} if direction == "en-mr" else {"source": mr, "target": en}
