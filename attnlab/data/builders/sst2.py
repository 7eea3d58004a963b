"""`sst2`: GLUE SST-2 binary sentiment (0 = negative, 1 = positive), train and validation.

Raw files: train.tsv and dev.tsv, a header line naming the columns then `label<TAB>sentence`
rows (GLUE's own zip has the columns the other way round, `sentence<TAB>label`; the header
decides). The sentence column may be called "sentence", "content" or "text". CRLF line ends are
accepted; blank lines are skipped and counted in the dataset's metadata.

Examples: `{"sentence": str, "label": int, "idx": int}` (idx = row number in the file, from 0).
"""

from __future__ import annotations

import pathlib
from typing import Any, Mapping

import numpy as np
import tensorflow_datasets as tfds

from attnlab.data.builders import base
from attnlab.errors import DataFormatError

# Label names, indexed by the label value.
LABELS = ("negative", "positive")
# Header names accepted for the sentence column.
_SENTENCE_COLUMNS = ("sentence", "content", "text")
# Raw file of each split.
SPLIT_FILES = {"train": "train.tsv", "validation": "dev.tsv"}


def parse_tsv(path: pathlib.Path) -> tuple[list[dict[str, Any]], int]:
  """Reads an SST-2 tsv file; returns ([{"sentence", "label", "idx"}], blank lines skipped)."""
  lines, blank = base.read_lines(path)
  if not lines:
    raise DataFormatError(f"{path}: no header line and no rows; expected a header "
                          f"'label<TAB>sentence' followed by rows")
  header_no, header = lines[0]
  columns = [c.strip().lower() for c in header.split("\t")]
  sentence_col = next((columns.index(c) for c in _SENTENCE_COLUMNS if c in columns), None)
  if "label" not in columns or sentence_col is None:
    raise DataFormatError(f"{path}:{header_no}: expected a header with columns 'label' and "
                          f"'sentence' separated by a tab, found {header[:60]!r}")
  label_col = columns.index("label")
  rows = []
  for lineno, line in lines[1:]:
    fields = line.split("\t")
    if len(fields) != len(columns):
      what = "no tab" if len(fields) == 1 else f"{len(fields)} tab-separated fields"
      raise DataFormatError(f"{path}:{lineno}: expected {len(columns)} tab-separated fields "
                            f"({header.strip()!r}), found {what} in {line[:60]!r}")
    label = fields[label_col].strip()
    if label not in ("0", "1"):
      raise DataFormatError(f"{path}:{lineno}: label must be 0 or 1, found {label[:20]!r}")
    sentence = fields[sentence_col].strip()
    if not sentence:
      raise DataFormatError(f"{path}:{lineno}: empty sentence")
    rows.append({"sentence": sentence, "label": int(label), "idx": len(rows)})
  return rows, blank


class Sst2(base.RawFileBuilder, skip_registration=True):
  """GLUE SST-2 sentence sentiment, the labelled train and validation (dev) splits."""

  name = "sst2"
  SOURCE = base.RawSource(
      folder="sst2",
      files=("train.tsv", "dev.tsv"),
      url="https://dl.fbaipublicfiles.com/glue/data/SST-2.zip",
      archive_dir="SST-2",
      # Size and sha256 of SST-2.zip as recorded in TFDS's own GLUE checksums
      # (tensorflow_datasets/url_checksums/glue.txt); the local copy is not that zip.
      size=7_439_277,
      sha256="d67e16fb55739c1b32cdce9877596db1c127dc322d93c082281f64057c16deaa",
  )
  SPLITS = ("train", "validation")
  DESCRIPTION = "Stanford Sentiment Treebank, binary sentence labels, as distributed by GLUE."
  HOMEPAGE = "https://gluebenchmark.com/"
  CITATION = ("@inproceedings{socher2013recursive, title={Recursive deep models for semantic "
              "compositionality over a sentiment treebank}, author={Socher, Richard and others}, "
              "booktitle={EMNLP}, year={2013}}")

  def _features(self) -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({
        "sentence": tfds.features.Text(),
        "label": tfds.features.ClassLabel(names=list(LABELS)),
        "idx": np.int32,
    })

  def _parse(self, paths: dict[str, pathlib.Path]) -> tuple[dict[str, list[dict]], dict]:
    splits, blank = {}, {}
    for split, file in SPLIT_FILES.items():
      splits[split], blank[file] = parse_tsv(paths[file])
    return splits, {"blank_lines_skipped": blank}

  @classmethod
  def to_example(cls, record: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    return {"sentence": base.as_str(record["sentence"]), "label": int(record["label"]),
            "idx": int(record["idx"])}
