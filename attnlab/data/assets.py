"""What a run directory keeps of its data, so that it reloads, generates and translates without it.

RUN_DIR/assets/ holds
- the run's vocabularies: `<name>.json` for attnlab's char/word/subword tokenizers, a `<name>/`
  folder of tokenizer files for an imported Hugging Face one (a bare-ids tokenizer needs nothing:
  the config's vocab_size rebuilds it);
- `sizes.json`: the numbers the model's shapes were derived from the data (the longest training
  source of a translation corpus, ...);
- `labels.json` (only where a task has some): named lists of strings, such as the class names of
  a classifier trained on the user's own labels, in the order of its outputs.
Tasks fill and read them through `Task.asset_tokenizer` / `Task.asset_size` / `Task.asset_labels`
(attnlab/tasks/base.py); the trainer writes the folder when a run starts, in one rename, so a
crash never leaves half of it.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from attnlab.data import hf_tokenizer
from attnlab.data import tokenizers
from attnlab.errors import DataError

# The folder's name inside a run directory.
DIRNAME = "assets"
SIZES_FILE = "sizes.json"
LABELS_FILE = "labels.json"
# At most this many names in one list of labels.json (a classifier's width comes from it).
MAX_LABELS = 10_000
# At most this many characters in one name.
MAX_LABEL_CHARS = 1_000


def save(directory: str | os.PathLike, vocabularies: Mapping[str, Any],
         sizes: Mapping[str, int], labels: Mapping[str, Sequence[str]] | None = None) -> None:
  """Writes `directory` (replacing it) with the vocabularies, sizes and lists of labels."""
  directory = pathlib.Path(directory)
  tmp = directory.with_name(directory.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  for name, tokenizer in vocabularies.items():
    if isinstance(tokenizer, hf_tokenizer.HFTokenizer):
      (tmp / name).mkdir()
      for file in hf_tokenizer.TOKENIZER_FILES:
        if (tokenizer.directory / file).is_file():
          shutil.copy2(tokenizer.directory / file, tmp / name / file)
    elif isinstance(tokenizer, tokenizers.Vocab):
      tokenizer.save(tmp / f"{name}.json")
  (tmp / SIZES_FILE).write_text(json.dumps({k: int(v) for k, v in sizes.items()}, indent=1))
  if labels:
    (tmp / LABELS_FILE).write_text(
        json.dumps({k: [str(x) for x in v] for k, v in labels.items()}, indent=1,
                   ensure_ascii=False), encoding="utf-8")
  if directory.exists():
    shutil.rmtree(directory)
  os.replace(tmp, directory)


def load_tokenizer(directory: str | os.PathLike, name: str) -> Any | None:
  """The vocabulary `name` kept in `directory`, or None when it holds none of that name."""
  directory = pathlib.Path(directory)
  if (directory / name).is_dir():
    return hf_tokenizer.HFTokenizer(directory / name)
  if (directory / f"{name}.json").is_file():
    return tokenizers.load_tokenizer(directory / f"{name}.json")
  return None


def load_sizes(directory: str | os.PathLike) -> dict[str, int]:
  """The sizes kept in `directory` ({} when it has none)."""
  path = pathlib.Path(directory) / SIZES_FILE
  if not path.is_file():
    return {}
  try:
    sizes = json.loads(path.read_text(encoding="utf-8"))
    problem = None if isinstance(sizes, dict) and all(type(v) is int for v in sizes.values()) \
        else "not a JSON object of integers"
  except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting
    problem = " ".join(str(e).split())[:200]
  if problem is not None:
    raise DataError(f"{path} is damaged ({problem}); delete {path.parent} to rebuild it from the "
                    f"data")
  return dict(sizes)


def load_labels(directory: str | os.PathLike) -> dict[str, list[str]]:
  """The lists of labels kept in `directory` ({} when it has none); DataError (one line) when the
  file is not a JSON object of lists of distinct strings within MAX_LABELS and MAX_LABEL_CHARS."""
  path = pathlib.Path(directory) / LABELS_FILE
  if not path.is_file():
    return {}
  try:
    labels = json.loads(path.read_text(encoding="utf-8"))
    problem = None if isinstance(labels, dict) and all(
        isinstance(v, list) and len(v) <= MAX_LABELS and len(set(v)) == len(v)
        and all(isinstance(x, str) and len(x) <= MAX_LABEL_CHARS for x in v)
        for v in labels.values()) else (
            f"not a JSON object of lists of at most {MAX_LABELS} distinct strings")
  except (ValueError, RecursionError, TypeError) as e:  # JSON, UTF-8, nesting, unhashable items
    problem = " ".join(str(e).split())[:200]
  if problem is not None:
    raise DataError(f"{path} is damaged ({problem}); delete {path.parent} to rebuild it from the "
                    f"data")
  return {k: list(v) for k, v in labels.items()}
