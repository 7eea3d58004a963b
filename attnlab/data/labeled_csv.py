"""A user's own labelled examples in a CSV or TSV file (BERT fine-tuning's `dataset=csv`).

The file (`data.path`) is UTF-8 text (a leading BOM dropped, CRLF line ends read as LF) with a
header row that names the columns, then one example per row. Python's `csv` module reads it:
a field that holds the delimiter, a quote or a line end is written in double quotes, a quote
inside it doubled (`"He said ""no"", then left"`), as spreadsheets and pandas write them.
- The delimiter: `data.delimiter`, or from the extension when it is "" (`.tsv`, `.tab`: tab;
  `.csv`: comma; any other extension needs the key). Names `comma`, `tab`, `semicolon`, `pipe`
  or one character.
- Columns (names as in the header, surrounding spaces ignored): `data.text_column`, the text;
  `data.text_pair_column`, a second text for sentence pairs ("" = single sentences);
  `data.label_column`, the label (any string: surrounding spaces are dropped, `1` and `01` are two
  labels). Other columns are ignored.
- Every row has as many fields as the header; its texts and label are not empty. Blank lines
  are skipped.

The label set is every distinct label of the training file, sorted as strings (`label_set`: so
`10` comes before `2`); a label's index in it is the class id. Validation rows are a second file of
the same columns (`data.valid_path`; a label it holds must be in the training file), or a
held-out fraction of the training file (`holdout_split`: `data.valid_fraction` of the rows,
picked by a NumPy permutation seeded with `data.valid_seed`, so the same file and keys give the
same split). Every problem is a DataError of one line naming the file and the line.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from attnlab.data.builders import base
from attnlab.errors import DataError

# data.delimiter names -> the character; "" picks it from the extension (EXTENSIONS).
DELIMITERS = {"comma": ",", "tab": "\t", "semicolon": ";", "pipe": "|"}
EXTENSIONS = {".csv": ",", ".tsv": "\t", ".tab": "\t"}
# At most this many classes (a label column of free text would make a classifier this wide).
MAX_CLASSES = 10_000


@dataclasses.dataclass(frozen=True)
class Columns:
  """The column names a labelled file is read with (config keys data.*_column)."""
  # The text (sentence A).
  text: str
  # The label.
  label: str
  # The second text (sentence B); "" = single sentences.
  pair: str = ""


@dataclasses.dataclass
class LabeledRows:
  """The examples of one file, in file order."""
  # The file they were read from.
  path: pathlib.Path
  # The text of each row.
  texts: list[str]
  # The second text of each row (None: single sentences).
  pairs: list[str] | None
  # The label of each row (surrounding spaces dropped).
  labels: list[str]
  # The 1-based line of the file where each row starts.
  lines: list[int]

  def __len__(self) -> int:
    return len(self.texts)

  def select(self, indices: Sequence[int]) -> "LabeledRows":
    """The rows at `indices`, in that order."""
    pick = lambda values: [values[i] for i in indices]
    return LabeledRows(self.path, pick(self.texts), None if self.pairs is None else
                       pick(self.pairs), pick(self.labels), pick(self.lines))


def delimiter_of(path: str | os.PathLike, delimiter: str = "") -> str:
  """The delimiter character: `delimiter` (a name of DELIMITERS or one character), else the
  one of the extension of `path`; DataError when neither gives one."""
  if delimiter:
    char = DELIMITERS.get(delimiter, delimiter)
    if len(char) != 1 or char in "\"\r\n":
      raise DataError(f"data.delimiter={delimiter!r} is not a delimiter; give one character or "
                      f"one of {', '.join(DELIMITERS)}")
    return char
  suffix = pathlib.Path(path).suffix.lower()
  if suffix not in EXTENSIONS:
    raise DataError(f"{path}: cannot tell the delimiter from the extension {suffix or '(none)'!r}"
                    f"; name the file .csv or .tsv, or set data.delimiter (e.g. comma, tab)")
  return EXTENSIONS[suffix]


def _existing_file(path: str | os.PathLike, key: str) -> pathlib.Path:
  if not str(path):
    raise DataError(f"dataset=csv needs {key}: a CSV or TSV file with a header row (e.g. "
                    f"{key}=train.csv)")
  file = pathlib.Path(os.path.expanduser(str(path)))
  if file.is_dir():
    raise DataError(f"{key}={path} is a folder; give a CSV or TSV file with a header row")
  if not file.is_file():
    raise DataError(f"{key}={path} does not exist; give a CSV or TSV file with a header row")
  return file


def _header_index(path: pathlib.Path, header: list[str], column: str, key: str,
                  delimiter: str) -> int:
  """The index of `column` in the header row, else DataError listing the header's columns."""
  names = [name.strip() for name in header]
  found = [i for i, name in enumerate(names) if name == column.strip()]
  if len(found) == 1:
    return found[0]
  if found:
    raise DataError(f"{path}, line 1 (the header): the column {column!r} ({key}) appears "
                    f"{len(found)} times; give the columns distinct names")
  hint = ""
  others = [name for name, c in DELIMITERS.items() if c != delimiter and len(names) == 1
            and c in names[0]]
  if others:
    hint = (f" (with the delimiter {delimiter!r} the header is one column: set "
            f"data.delimiter={others[0]}?)")
  columns = ", ".join(repr(name) for name in names)
  raise DataError(f"{path}, line 1 (the header): no column {column!r} ({key}); its columns: "
                  f"{columns}; set {key} to one of them{hint}")


def read_labeled(path: str | os.PathLike, columns: Columns, *, delimiter: str = "",
                 key: str = "data.path") -> LabeledRows:
  """The examples of the file `path` (module docstring); `key` names the config key that gave
  it, for the messages. DataError, one line with the file and line, for any problem."""
  file = _existing_file(path, key)
  char = delimiter_of(file, delimiter)
  text = base.read_text(file)  # DataFormatError naming the line of bad UTF-8
  if not text.strip():
    raise DataError(f"{file} is empty; write a header row naming the columns (e.g. "
                    f"sentence,label) and then one example per row")
  reader = csv.reader(text.splitlines(keepends=True), delimiter=char)
  wanted = [("text", columns.text, "data.text_column"),
            ("label", columns.label, "data.label_column")]
  if columns.pair:
    wanted.append(("pair", columns.pair, "data.text_pair_column"))
  header, index, width = None, {}, 0
  rows: dict[str, list[str]] = {"text": [], "pair": [], "label": []}
  lines: list[int] = []
  line = 1
  try:
    for fields in reader:
      start, line = line, reader.line_num + 1
      if not fields or (len(fields) == 1 and not fields[0].strip()):
        continue  # a blank line
      if header is None:
        header, width = fields, len(fields)
        index = {name: _header_index(file, header, column, k, char) for name, column, k in wanted}
        continue
      if len(fields) != width:
        spans = (f" (a double quote opened on line {start} runs to line {reader.line_num}: "
                 f"close it, or double a quote inside a quoted field)"
                 if reader.line_num > start else "")
        raise DataError(f"{file}, line {start}: {len(fields)} field(s) where the header has "
                        f"{width}; quote a field that holds the delimiter {char!r}{spans}")
      for name, column, _ in wanted:
        value = fields[index[name]].strip() if name == "label" else fields[index[name]]
        if not value.strip():
          what = "label" if name == "label" else "text"
          raise DataError(f"{file}, line {start}: empty {what} in column {column!r}; fill it in "
                          f"or remove the line")
        rows[name].append(value)
      lines.append(start)
  except csv.Error as e:
    raise DataError(f"{file}, line {reader.line_num}: not readable as CSV ({e})") from None
  if not lines:
    raise DataError(f"{file} has a header row but no examples; add one example per row below it")
  return LabeledRows(file, rows["text"], rows["pair"] if columns.pair else None, rows["label"],
                     lines)


def label_set(rows: LabeledRows) -> tuple[str, ...]:
  """The distinct labels of the training rows, sorted as strings; DataError for fewer than two
  or more than MAX_CLASSES."""
  labels = tuple(sorted(set(rows.labels)))
  if len(labels) < 2:
    raise DataError(f"{rows.path}: every example has the label {labels[0]!r}; a classifier needs "
                    f"at least two labels (is data.label_column the right column?)")
  if len(labels) > MAX_CLASSES:
    raise DataError(f"{rows.path}: {len(labels)} distinct labels, more than {MAX_CLASSES}; is "
                    f"data.label_column the label column?")
  return labels


def label_ids(rows: LabeledRows, labels: Sequence[str],
              training_file: str | os.PathLike | None = None) -> np.ndarray:
  """int32 `[n]`: each row's index in `labels`; DataError naming the line of a label that is not
  in them (`training_file`: where they came from, for the message)."""
  ids = {label: i for i, label in enumerate(labels)}
  out = np.zeros((len(rows),), np.int32)  # [n]
  for i, (label, line) in enumerate(zip(rows.labels, rows.lines)):
    if label not in ids:
      shown = ", ".join(repr(x) for x in labels[:20]) + (", ..." if len(labels) > 20 else "")
      source = f" of the training file {training_file}" if training_file else ""
      raise DataError(f"{rows.path}, line {line}: label {label!r} is not one of the "
                      f"{len(labels)} labels{source} ({shown}); a validation label must occur "
                      f"in the training file")
    out[i] = ids[label]
  return out


def holdout_split(num_rows: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(training row indices, validation row indices), each ascending: round(fraction * num_rows)
  rows (at least 1, leaving at least 1) picked by `default_rng(seed).permutation(num_rows)`."""
  if not 0.0 < fraction < 1.0:
    raise DataError(f"data.valid_fraction must be in (0, 1), got {fraction}; or give a validation "
                    f"file as data.valid_path")
  if num_rows < 2:
    raise DataError(f"{num_rows} example(s) cannot be split into training and validation rows; "
                    f"add examples, or give a validation file as data.valid_path")
  count = min(num_rows - 1, max(1, int(round(fraction * num_rows))))
  order = np.random.default_rng(seed).permutation(num_rows)  # [num_rows]
  return np.sort(order[count:]), np.sort(order[:count])


def columns_of(data: Any) -> Columns:
  """The columns of a `dataset=csv` data config (data.text_column, text_pair_column, label_column;
  a config without text_pair_column reads single sentences)."""
  return Columns(text=data.text_column, label=data.label_column,
                 pair=data.get("text_pair_column", ""))


def read_splits(data: Any) -> tuple[LabeledRows, LabeledRows, LabeledRows]:
  """(every row of data.path, its training rows, the validation rows): those of data.valid_path,
  else the held-out `data.valid_fraction` of data.path (`holdout_split` with data.valid_seed).
  DataError (one line: file and line) for a malformed file."""
  columns = columns_of(data)
  delimiter = data.get("delimiter", "")
  rows = read_labeled(data.get("path", ""), columns, delimiter=delimiter)
  if data.get("valid_path", ""):
    valid = read_labeled(data.valid_path, columns, delimiter=delimiter, key="data.valid_path")
    return rows, rows, valid
  train_rows, valid_rows = holdout_split(len(rows), data.valid_fraction, data.valid_seed)
  return rows, rows.select(train_rows), rows.select(valid_rows)
