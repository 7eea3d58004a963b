"""Machinery shared by the TFDS builders: raw-file lookup, line reading, array_record reading.

A builder parses its raw files completely (they are a few MB) before TFDS writes anything, so a
malformed file fails fast with file and line number and leaves no half-written dataset behind.
No TensorFlow is needed: splits are written as `array_record` and read with
`builder.as_data_source`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import pathlib
import shutil
import socket
import urllib.parse
import zipfile
from typing import Any, Callable, ClassVar, Iterator, Mapping

import tensorflow_datasets as tfds
from tensorflow_datasets.core.download.download_manager import NonMatchingChecksumError

from attnlab.errors import DataError, DataFormatError, DatasetNotFoundError

# Environment variable naming a folder laid out like ../shared/data (one sub-folder per dataset).
DATA_DIR_ENV = "ATTNLAB_DATA_DIR"
# Environment variable TFDS reads for its data dir; read again here so a change after import counts.
TFDS_DATA_DIR_ENV = "TFDS_DATA_DIR"
# Storage format of the prepared splits: random access without TensorFlow.
FILE_FORMAT = "array_record"
# Records fetched per array_record read when a split is iterated.
_READ_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class RawSource:
  """Where a dataset's raw files come from.

  Attributes:
    folder: sub-folder of $ATTNLAB_DATA_DIR holding the files, e.g. "sst2".
    files: names of the files the builder reads, e.g. ("train.tsv", "dev.tsv").
    url: public home. A `.zip` is downloaded and extracted, any other file downloaded as is.
    archive_dir: folder inside the extracted archive that holds `files` ("" = its top).
    size: recorded size in bytes of the download; None when not recorded.
    sha256: recorded sha256 of the download; None when not recorded, and then the download
      is not verified (TFDS logs its size and checksum).
  """

  folder: str
  files: tuple[str, ...]
  url: str
  archive_dir: str = ""
  size: int | None = None
  sha256: str | None = None


def data_dir_or_default(data_dir: str | os.PathLike[str] | None) -> str | None:
  """The TFDS data dir: the argument, else $TFDS_DATA_DIR, else None (TFDS's default)."""
  if data_dir is not None:
    return os.fspath(pathlib.Path(data_dir).expanduser())
  return os.environ.get(TFDS_DATA_DIR_ENV) or None


def _missing_message(name: str, source: RawSource, looked: list[str], why: str = "") -> str:
  files = " + ".join(source.files)
  layout = " + ".join(f"{source.folder}/{f}" for f in source.files)
  where = "; ".join(looked)
  return (
      f"{name}: raw data not found ({where}{why}). Get it either (1) online: let attnlab "
      f"download {source.url} (download=True, the default; drop --nodownload), or (2) from a "
      f"local copy: --manual_dir=DIR (get_dataset(..., manual_dir=DIR)) with DIR holding "
      f"{files}, or {DATA_DIR_ENV}=DIR with {layout}."
  )


def _unreachable(url: str, timeout: float = 10.0) -> str | None:
  """Why `url`'s host cannot be reached (a TCP connect within `timeout` s), or None if it can."""
  parts = urllib.parse.urlsplit(url)
  port = parts.port or (443 if parts.scheme == "https" else 80)
  try:
    socket.create_connection((parts.hostname, port), timeout=timeout).close()
  except OSError as e:
    return f"cannot reach {parts.hostname}:{port} to download ({e.strerror or e}); offline?"
  return None


def _complete(folder: pathlib.Path, files: tuple[str, ...]) -> dict[str, pathlib.Path] | None:
  paths = {f: folder / f for f in files}
  return paths if all(p.is_file() for p in paths.values()) else None


def resolve_raw_files(
    name: str,
    source: RawSource,
    *,
    manual_dir: str | os.PathLike[str] | None,
    download: bool,
    dl_manager: Any | None,
) -> tuple[dict[str, pathlib.Path], str]:
  """Finds the raw files: manual_dir, then $ATTNLAB_DATA_DIR/<folder>, then a TFDS download.

  `manual_dir` may hold the files itself or a `<folder>/` sub-folder with them (so the root of a
  ../shared/data-like tree works too). A manual_dir that lacks the files is an error (no silent
  fall-through to the network).

  Returns:
    ({file name: path}, a short description of where they came from).
  """
  if manual_dir is not None:
    base = pathlib.Path(manual_dir).expanduser()
    for folder in (base, base / source.folder):
      if (paths := _complete(folder, source.files)) is not None:
        return paths, f"manual_dir {folder}"
    files = " + ".join(source.files)
    looked = [f"manual_dir {base} has no {files}, nor has {base / source.folder}"]
    raise DatasetNotFoundError(_missing_message(name, source, looked))
  looked = ["no manual_dir given"]
  if env := os.environ.get(DATA_DIR_ENV):
    folder = pathlib.Path(env).expanduser() / source.folder
    if (paths := _complete(folder, source.files)) is not None:
      return paths, f"{DATA_DIR_ENV} {folder}"
    looked.append(f"{DATA_DIR_ENV}: {folder} lacks {' + '.join(source.files)}")
  else:
    looked.append(f"{DATA_DIR_ENV} not set")
  if not download or dl_manager is None:
    raise DatasetNotFoundError(_missing_message(name, source, looked, "; download disabled"))
  if (unreachable := _unreachable(source.url)) is not None:
    # TFDS retries a failing download for minutes: an offline user hears it at once instead.
    raise DatasetNotFoundError(_missing_message(name, source, looked, f"; {unreachable}"))
  try:
    if source.url.endswith(".zip"):
      # TFDS's own extractor needs TensorFlow (tf.io.gfile): download with TFDS, unzip here.
      paths = extract_zip_members(name, pathlib.Path(dl_manager.download(source.url)), source)
    else:
      if len(source.files) != 1:
        raise DataError(f"{name}: a plain download must provide exactly one file")
      paths = {source.files[0]: pathlib.Path(dl_manager.download(source.url))}
  except DataError:
    raise
  except NonMatchingChecksumError as e:
    detail = " ".join(str(e).split())
    raise DataError(f"{name}: the download of {source.url} does not match the recorded size/"
                    f"sha256 ({detail}); delete it from the downloads folder and retry, or use "
                    f"a local copy with --manual_dir") from e
  except Exception as e:  # pylint: disable=broad-except
    why = f"; the download failed ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
    raise DatasetNotFoundError(_missing_message(name, source, looked, why)) from e
  return paths, f"download {source.url}"


def extract_zip_members(name: str, archive: pathlib.Path, source: RawSource
                        ) -> dict[str, pathlib.Path]:
  """Unzips `source.files` (under `source.archive_dir`) next to the archive, once."""
  folder = archive.with_name(archive.name + ".extracted")
  if (paths := _complete(folder, source.files)) is not None:
    return paths
  try:
    with zipfile.ZipFile(archive) as zf:
      members = set(zf.namelist())
      wanted = {f: "/".join(p for p in (source.archive_dir, f) if p) for f in source.files}
      missing = [m for m in wanted.values() if m not in members]
      if missing:
        raise DataError(f"{name}: the archive {source.url} lacks {', '.join(missing)}; point to "
                        f"a local copy with --manual_dir")
      tmp = folder.with_name(folder.name + ".tmp")
      tmp.mkdir(parents=True, exist_ok=True)
      for file, member in wanted.items():
        (tmp / file).write_bytes(zf.read(member))
  except zipfile.BadZipFile as e:
    raise DataError(f"{name}: {archive} (from {source.url}) is not a valid zip ({e}); delete it "
                    f"and retry, or point to a local copy with --manual_dir") from None
  if folder.exists():
    shutil.rmtree(folder)
  tmp.replace(folder)
  return {f: folder / f for f in source.files}


def _decode(path: pathlib.Path, data: bytes | None = None) -> str:
  """The UTF-8 text of a file (or `data`, the bytes of the file `path` names, e.g. a zip member),
  a leading BOM dropped.

  Raises:
    DataFormatError: the file is not valid UTF-8 (the message names file and line).
  """
  data = (path.read_bytes() if data is None else data).removeprefix(b"\xef\xbb\xbf")
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    lineno = data.count(b"\n", 0, e.start) + 1
    line_start = data.rfind(b"\n", 0, e.start) + 1
    raise DataFormatError(
        f"{path}:{lineno}: invalid UTF-8 ({e.reason} at byte {e.start - line_start} of the "
        f"line); re-save the file as UTF-8") from None


def read_lines(path: pathlib.Path, data: bytes | None = None
               ) -> tuple[list[tuple[int, str]], int]:
  """Reads a UTF-8 text file line by line (LF or CRLF ends, a leading BOM dropped); `data`: the
  file's bytes when they do not come from `path` (which the messages name).

  Returns:
    ([(1-based line number, text without its line end)] for the non-blank lines, number of
    blank (empty or whitespace-only) lines skipped).
  """
  pieces = _decode(path, data).split("\n")
  if pieces[-1] == "":
    pieces.pop()  # The text after the final line end is not a line.
  lines, blank = [], 0
  for lineno, text in enumerate(pieces, start=1):
    text = text.removesuffix("\r")
    if text.strip():
      lines.append((lineno, text))
    else:
      blank += 1
  return lines, blank


def read_pairs(path: pathlib.Path, names: tuple[str, str], layout: str,
               max_fields: int | None = None, data: bytes | None = None
               ) -> tuple[list[tuple[str, str]], int]:
  """Reads a file of sentence pairs, one `first<TAB>second` a line (read_lines: UTF-8, LF or CRLF,
  blank lines skipped), each side stripped of surrounding white space.

  Args:
    path: the file.
    names: what the two columns hold, for the messages ("english", "marathi").
    layout: the expected line, for the messages ("english<TAB>marathi").
    max_fields: the most tab-separated fields a line may have (None: any; fields after the second,
      such as the Anki files' attribution, are ignored).
    data: the file's bytes when they do not come from `path` (a zip member; `path` names it).

  Returns:
    ([(first, second)], number of blank lines skipped).

  Raises:
    DataFormatError: one line naming the file and line number of a line without a tab, with too
      many fields, or with an empty side.
  """
  lines, blank = read_lines(path, data)
  pairs = []
  for lineno, line in lines:
    fields = line.split("\t")
    if len(fields) < 2:
      raise DataFormatError(f"{path}:{lineno}: expected '{layout}', found no tab in "
                            f"{line[:60]!r}")
    if max_fields is not None and len(fields) > max_fields:
      raise DataFormatError(f"{path}:{lineno}: expected '{layout}', found {len(fields)} "
                            f"tab-separated fields in {line[:60]!r}")
    first, second = fields[0].strip(), fields[1].strip()
    if not first or not second:
      raise DataFormatError(f"{path}:{lineno}: empty {names[0] if not first else names[1]} side "
                            f"in {line[:60]!r}; each line needs '{layout}'")
    pairs.append((first, second))
  return pairs, blank


def read_text(path: pathlib.Path) -> str:
  """Reads a whole UTF-8 file, CRLF line ends turned into LF, a leading BOM dropped."""
  return _decode(path).replace("\r\n", "\n")


class PreparedSplit(collections.abc.Sequence):
  """Random access to one prepared split: `len`, `[i]`, slices, iteration, `__getitems__`.

  Wraps the TFDS array_record data source and turns each record (bytes for text features)
  into the dataset's documented example dict with `convert`.
  """

  def __init__(self, source: Any, convert: Callable[[Mapping[str, Any]], dict[str, Any]],
               name: str = ""):
    self._source = source
    self._convert = convert
    self.name = name

  def __len__(self) -> int:
    return len(self._source)

  def _index(self, i: int) -> int:
    n = len(self)
    j = i + n if i < 0 else i
    if not 0 <= j < n:
      raise IndexError(f"{self.name}: index {i} out of range for a split of {n} examples")
    return j

  def __getitem__(self, i):  # int -> dict; slice -> list[dict]
    if isinstance(i, slice):
      return self.__getitems__(range(*i.indices(len(self))))
    return self._convert(self._source[self._index(int(i))])

  def __getitems__(self, indices) -> list[dict[str, Any]]:
    indices = [self._index(int(i)) for i in indices]
    if not indices:
      return []
    return [self._convert(r) for r in self._source.__getitems__(indices)]

  def __iter__(self) -> Iterator[dict[str, Any]]:
    for start in range(0, len(self), _READ_CHUNK):
      yield from self.__getitems__(range(start, min(start + _READ_CHUNK, len(self))))

  def __repr__(self) -> str:
    return f"PreparedSplit({self.name}, {len(self)} examples)"


def as_str(value: Any) -> str:
  """A TFDS text feature read back without TensorFlow is bytes: decode it."""
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class _LocalDatasetInfo(tfds.core.DatasetInfo):
  """DatasetInfo of a dataset that TFDS's bucket of pre-computed metadata does not hold.

  TFDS calls `initialize_from_bucket` whenever a builder is made for a data dir that is not yet
  prepared; it creates a temporary directory for the bucket's files first and never removes it,
  so every such builder left an empty `/tmp/tmp*tfds` behind. attnlab's datasets are not in that
  bucket: there is nothing to fetch.
  """

  def initialize_from_bucket(self) -> None:
    return None


class RawFileBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base of attnlab's builders: parse raw text files into array_record splits.

  Not registered with TFDS (one of the names would clash with TFDS's own `tiny_shakespeare`);
  find builders by name with `attnlab.data.builders.get_builder`.

  Subclasses set `name`, `SOURCE`, `SPLITS`, `DESCRIPTION`, `HOMEPAGE`, `CITATION` and define
  `_features`, `_parse` and `to_example`.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  # Where the raw files come from (local copy or public home).
  SOURCE: ClassVar[RawSource]
  # Split names, in the order they are reported.
  SPLITS: ClassVar[tuple[str, ...]]
  # One-paragraph description, homepage and citation written into dataset_info.json.
  DESCRIPTION: ClassVar[str] = ""
  HOMEPAGE: ClassVar[str] = ""
  CITATION: ClassVar[str] = ""
  # Keyword options `to_example` accepts (get_dataset passes them through), with defaults.
  EXAMPLE_OPTIONS: ClassVar[Mapping[str, Any]] = {}

  def __init__(self, *, manual_dir: str | os.PathLike[str] | None = None, download: bool = True,
               **kwargs: Any):
    self._raw_manual_dir = manual_dir
    self._allow_download = download
    kwargs.setdefault("file_format", FILE_FORMAT)
    super().__init__(**kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def url_infos(cls) -> dict[str, Any] | None:
    """The recorded size and sha256 the TFDS download manager checks downloads against."""
    src = cls.SOURCE
    if src.sha256 is None or src.size is None:
      return None
    filename = src.url.rsplit("/", 1)[-1]
    return {src.url: tfds.download.checksums.UrlInfo(
        size=tfds.core.units.Size(src.size), checksum=src.sha256, filename=filename)}

  def _info(self) -> tfds.core.DatasetInfo:
    return _LocalDatasetInfo(
        builder=self,
        description=self.DESCRIPTION,
        features=self._features(),
        homepage=self.HOMEPAGE,
        citation=self.CITATION,
        # Examples keep the order `_parse` gives them (index i in the file = record i).
        disable_shuffling=True,
        metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict]]]:
    paths, origin = resolve_raw_files(
        self.name, self.SOURCE, manual_dir=self._raw_manual_dir,
        download=self._allow_download, dl_manager=dl_manager)
    splits, notes = self._parse(paths)
    for split in self.SPLITS:
      if not splits.get(split):
        raise DataError(f"{self.name}: split {split!r} is empty after reading {origin}; an empty "
                        f"split cannot train or evaluate anything: check the raw files")
    self.info.metadata.update({"origin": origin, **notes})
    return {split: self._generate_examples(splits[split]) for split in self.SPLITS}

  def _generate_examples(self, rows: list[dict[str, Any]]) -> Iterator[tuple[int, dict]]:
    yield from enumerate(rows)

  def _features(self) -> tfds.features.FeaturesDict:
    raise NotImplementedError

  def _parse(self, paths: dict[str, pathlib.Path]) -> tuple[dict[str, list[dict]], dict]:
    """Parses the raw files into {split: [TFDS example]} and notes for the metadata."""
    raise NotImplementedError

  @classmethod
  def check_options(cls, **options: Any) -> None:
    """Raises DataError for a bad EXAMPLE_OPTIONS value (the caller checks the names)."""

  @classmethod
  def to_example(cls, record: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    """Turns a stored record into the documented example dict."""
    raise NotImplementedError
