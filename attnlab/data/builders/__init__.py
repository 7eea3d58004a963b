"""Registry of the real datasets: TFDS builders that need no TensorFlow.

`prepare(name)` parses the raw files once into `<data_dir>/<name>/...` as array_record (reused
afterwards); `load_split(name, split)` prepares if needed and returns random access to the split.
The data dir is the `data_dir` argument, else $TFDS_DATA_DIR, else TFDS's default
(~/tensorflow_datasets). Raw files: `manual_dir`, else $ATTNLAB_DATA_DIR/<folder>/, else a
download from the public home (see `base.resolve_raw_files`). Generated datasets (listops,
pathfinder: `generated.GeneratedBuilder`) read no files; their sizes are builder configs
(`config=` of `prepare` / `load_split`: runlocal, cpu, paper, or a `custom_config(...)`).
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow_datasets as tfds

from attnlab.data.builders.anki_mar_eng import AnkiMarEng
from attnlab.data.builders.base import (DATA_DIR_ENV, PreparedSplit, RawFileBuilder, RawSource,
                                        data_dir_or_default)
from attnlab.data.builders.imdb_bytes import ImdbBytes
from attnlab.data.builders.listops import Listops
from attnlab.data.builders.pathfinder import Pathfinder
from attnlab.data.builders.sst2 import Sst2
from attnlab.data.builders.tiny_shakespeare import TinyShakespeare, split_documents
from attnlab.errors import DataError

# name -> builder class; the one place a real dataset is registered.
BUILDERS: dict[str, type[RawFileBuilder]] = {
    cls.name: cls for cls in (AnkiMarEng, TinyShakespeare, Sst2, Listops, ImdbBytes, Pathfinder)
}

PathLike = str | os.PathLike[str]
# A builder config: the name of one of the builder's BUILDER_CONFIGS, or a config object (e.g.
# `Listops.custom_config(...)`); None = the builder's first (default) config.
BuilderConfig = str | tfds.core.BuilderConfig | None


def builder_class(name: str) -> type[RawFileBuilder]:
  """The builder class registered as `name`; DataError listing the valid names otherwise."""
  try:
    return BUILDERS[name]
  except KeyError:
    raise DataError(f"unknown real dataset {name!r}; valid names: {', '.join(BUILDERS)}") from None


def get_builder(name: str, *, data_dir: PathLike | None = None, manual_dir: PathLike | None = None,
                download: bool = True, config: BuilderConfig = None) -> RawFileBuilder:
  """A builder for `name` writing to / reading from `data_dir` (see module docstring); `config`
  picks one of its builder configs (sizes of the generated and LRA datasets)."""
  cls = builder_class(name)
  kwargs = {}
  if config is not None:
    names = [c.name for c in cls.BUILDER_CONFIGS]
    if isinstance(config, str) and config not in names:
      raise DataError(f"{name}: unknown config {config!r}; valid configs: "
                      f"{', '.join(names) or 'none'}")
    kwargs["config"] = config
  return cls(data_dir=data_dir_or_default(data_dir), manual_dir=manual_dir, download=download,
             **kwargs)


def prepare(name: str, *, data_dir: PathLike | None = None, manual_dir: PathLike | None = None,
            download: bool = True, force: bool = False,
            config: BuilderConfig = None) -> RawFileBuilder:
  """Prepares `name` unless already prepared (`force=True` re-reads the raw files)."""
  builder = get_builder(name, data_dir=data_dir, manual_dir=manual_dir, download=download,
                        config=config)
  mode = (tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS if force
          else tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS)
  # A no-op when the data dir already holds the prepared dataset (and force is off).
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(download_mode=mode))
  return builder


def load_split(name: str, split: str, *, data_dir: PathLike | None = None,
               manual_dir: PathLike | None = None, download: bool = True,
               config: BuilderConfig = None, **options: Any) -> PreparedSplit:
  """Random access to a prepared split of `name` (prepared first if needed).

  `options` are the builder's example options (`EXAMPLE_OPTIONS`, e.g. anki_mar_eng's
  `direction`); unknown ones raise DataError listing the valid ones.
  """
  cls = builder_class(name)
  unknown = sorted(set(options) - set(cls.EXAMPLE_OPTIONS))
  if unknown:
    valid = ", ".join(cls.EXAMPLE_OPTIONS) or "none"
    raise DataError(f"{name}: unknown option(s) {', '.join(unknown)}; valid options: {valid}")
  cls.check_options(**options)
  if split.split("[", 1)[0] not in cls.SPLITS:
    raise DataError(f"{name}: unknown split {split!r}; valid splits: "
                    f"{', '.join(cls.SPLITS)} (TFDS slices such as 'train[:10%]' work too)")
  builder = prepare(name, data_dir=data_dir, manual_dir=manual_dir, download=download,
                    config=config)
  try:
    source = builder.as_data_source(split=split)
  except (ValueError, KeyError) as e:  # A malformed slice, e.g. 'train[:abc]'.
    raise DataError(f"{name}: cannot read split {split!r}: {' '.join(str(e).split())}") from e
  if len(source) == 0:
    raise DataError(f"{name}: split {split!r} has no examples; an empty split cannot train or "
                    f"evaluate anything (check the slice)")
  kwargs = {**cls.EXAMPLE_OPTIONS, **options}
  return PreparedSplit(source, lambda record: cls.to_example(record, **kwargs), f"{name}/{split}")


def shakespeare_documents(split: str = "train", *, data_dir: PathLike | None = None,
                          manual_dir: PathLike | None = None,
                          download: bool = True) -> list[list[str]]:
  """Tiny Shakespeare `split` as documents of sentences (one speech each) for BERT pretraining."""
  text = load_split("tiny_shakespeare", split, data_dir=data_dir, manual_dir=manual_dir,
                    download=download)[0]["text"]
  return split_documents(text)


__all__ = [
    "AnkiMarEng", "BUILDERS", "DATA_DIR_ENV", "ImdbBytes", "Listops", "Pathfinder",
    "PreparedSplit", "RawFileBuilder", "RawSource", "Sst2", "TinyShakespeare", "builder_class",
    "get_builder", "load_split", "prepare", "shakespeare_documents", "split_documents",
]
