"""What a run directory keeps of its data, so that it reloads, generates and translates without it.

RUN_DIR/assets/ holds
- the run's vocabularies: `<name>.json` for attnlab's char/word/subword tokenizers, a `<name>/`
  folder of tokenizer files for an imported Hugging Face one (a bare-ids tokenizer needs nothing:
  the config's vocab_size rebuilds it);
- `sizes.json`: the numbers the model's shapes were derived from the data (the longest training
  source of a translation corpus, ...).
Tasks fill and read them through `Task.asset_tokenizer` / `Task.asset_size`
(attnlab/tasks/base.py); the trainer writes the folder when a run starts, in one rename, so a
crash never leaves half of it.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

from attnlab.data import hf_tokenizer
from attnlab.data import tokenizers
from attnlab.errors import DataError

# The folder's name inside a run directory.
DIRNAME = "assets"
SIZES_FILE = "sizes.json"


def save(directory: str | os.PathLike, vocabularies: Mapping[str, Any],
         sizes: Mapping[str, int]) -> None:
  """Writes `directory` (replacing it) with the vocabularies and sizes."""
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
