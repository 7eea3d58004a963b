"""A user's own plain-text corpus for language modelling (GPT's `dataset=text,data.path=...`).

`data.path` is a UTF-8 text file, or a folder whose `*.txt` files are read in sorted order of
their names (not its sub-folders) and joined, a newline added after a file that does not end with
one. CRLF line ends become LF and a leading BOM is dropped (as for Tiny Shakespeare). The first
90% of the characters are the training text, the last 10% (VALIDATION_FRACTION) the held-out
validation text, cut at the same place as Tiny Shakespeare's split.
"""

from __future__ import annotations

import os
import pathlib

from attnlab.data.builders import base
from attnlab.errors import DataError

# The held-out tail of the text (its last 10% of characters).
VALIDATION_FRACTION = 0.1
# Files a folder contributes.
PATTERN = "*.txt"


def corpus_files(path: str | os.PathLike) -> list[pathlib.Path]:
  """The files of `path` (a file, or a folder's *.txt in sorted order); DataError (one line)
  when there are none."""
  if not str(path):
    raise DataError("dataset=text needs data.path: a UTF-8 text file, or a folder of *.txt files")
  path = pathlib.Path(os.path.expanduser(str(path)))
  if path.is_file():
    return [path]
  if path.is_dir():
    files = sorted(p for p in path.glob(PATTERN) if p.is_file())
    if not files:
      raise DataError(f"data.path={path} is a folder without {PATTERN} files; put the text in "
                      f"*.txt files there, or give one text file")
    return files
  raise DataError(f"data.path={path} does not exist; give a UTF-8 text file, or a folder of "
                  f"{PATTERN} files")


def read_corpus(path: str | os.PathLike) -> str:
  """The whole text of `path` (module docstring); DataError when it is empty or not UTF-8."""
  parts = []
  for file in corpus_files(path):
    text = base.read_text(file)  # DataFormatError naming the line of bad UTF-8
    parts.append(text if not text or text.endswith("\n") else text + "\n")
  text = "".join(parts)
  if not text:
    raise DataError(f"data.path={path} holds no text (empty file{'s' if len(parts) > 1 else ''}); "
                    f"give a file with the corpus")
  return text


def split_corpus(text: str) -> tuple[str, str]:
  """(training text: the first 90% of the characters, validation text: the last 10%)."""
  cut = int((1 - VALIDATION_FRACTION) * len(text))
  return text[:cut], text[cut:]
