"""A user's own parallel corpus for translation (the translation task's `dataset=anki` and
`dataset=tsv`).

Formats (UTF-8, LF or CRLF line ends, a leading BOM dropped, blank lines skipped; every other
line one sentence pair, each side stripped of surrounding white space and never empty):
  anki  the Anki/manythings.org files (Tatoeba pairs): `English<TAB>Other[<TAB>attribution]`,
        English first, whatever the other language; fields after the second are ignored.
        `data.path` names the `<code>.txt` file, or the downloaded `<code>-eng.zip` itself (its
        one `.txt` member besides `_about.txt` is read). `data.pair=<code>` (fra, spa, deu, cmn,
        jpn, ...: the three-letter name of https://www.manythings.org/anki/<code>-eng.zip) finds
        the file instead: `data.manual_dir` (`<code>.txt` or `anki-<code>-eng/<code>.txt`), else
        $ATTNLAB_DATA_DIR the same way, else the data dir's `anki/<code>-eng/<code>.txt` (an
        earlier download), else a download into that folder.
  tsv   a plain TSV of pairs: `source<TAB>target`, exactly two fields a line, no header line.
Column order is the file's; the translation direction is data.direction: `forward` (first
column -> second: English -> the other language for anki) or `reverse`.

The pairs are shuffled with a fixed seed and cut 80/10/10 into train/validation/test, as
anki_mar_eng's are (`SPLITS`), so a corpus needs at least 10 pairs.
"""

from __future__ import annotations

import os
import pathlib
import re
import urllib.error
import urllib.request
import zipfile

from attnlab.data.builders import base
from attnlab.data.builders.anki_mar_eng import split_pairs
from attnlab.errors import DataError, DatasetNotFoundError

# The corpus formats: data.name -> (names of the two columns, the line the messages show, the
# most tab-separated fields a line may have; None: any, the extra ones ignored).
FORMATS: dict[str, tuple[tuple[str, str], str, int | None]] = {
    "anki": (("english", "other-language"), "English<TAB>Other[<TAB>attribution]", None),
    "tsv": (("source", "target"), "source<TAB>target", 2),
}
# Splits of a corpus, cut 80/10/10 after a shuffle (anki_mar_eng.split_pairs).
SPLITS = ("train", "validation", "test")
# data.direction of a file corpus: forward = first column -> second, reverse = second -> first.
DIRECTIONS = ("forward", "reverse")
# The public home of the Anki files: one zip per language paired with English.
ANKI_HOME = "https://www.manythings.org/anki/"
ANKI_URL = ANKI_HOME + "{code}-eng.zip"
# A few ISO 639-1 codes and the Anki files' three-letter codes, for the hint of a short code.
TWO_LETTER = {"ar": "ara", "de": "deu", "el": "ell", "es": "spa", "fi": "fin", "fr": "fra",
              "he": "heb", "hi": "hin", "hu": "hun", "it": "ita", "ja": "jpn", "ko": "kor",
              "mr": "mar", "nl": "nld", "pl": "pol", "pt": "por", "ru": "rus", "sv": "swe",
              "tr": "tur", "uk": "ukr", "vi": "vie", "zh": "cmn"}
# The largest download and zip member read (the Anki files are a few MB; a larger answer is not
# one of them).
MAX_BYTES = 512 << 20
# Seconds a download may wait for the server.
TIMEOUT_S = 60
_CODE = re.compile(r"[a-z]{3}")


def check_pair_code(code: str) -> str:
  """`code` lower-cased when it can name an Anki file (three letters, not eng), else DataError."""
  code = code.strip().lower()
  if code == "eng":
    raise DataError("data.pair=eng: every Anki file pairs English with another language; name "
                    "the other one (fra, spa, deu, cmn, jpn, ...)")
  if not _CODE.fullmatch(code):
    hint = (f"; did you mean data.pair={TWO_LETTER[code]}?" if code in TWO_LETTER else
            f" such as fra, spa, deu, cmn or jpn (the <code> of {ANKI_URL})")
    raise DataError(f"data.pair={code!r} is not an Anki pair code: the files are named by "
                    f"three-letter codes{hint}")
  return code


def _local_copy(code: str, folder: pathlib.Path) -> pathlib.Path | None:
  for path in (folder / f"{code}.txt", folder / f"anki-{code}-eng" / f"{code}.txt"):
    if path.is_file():
      return path
  return None


def cache_folder(data_dir: str | os.PathLike | None) -> pathlib.Path:
  """Where the Anki downloads go: <data dir>/anki (the data dir: `data_dir`, else
  $TFDS_DATA_DIR, else ~/tensorflow_datasets, as for the prepared real datasets)."""
  root = base.data_dir_or_default(data_dir) or os.path.join("~", "tensorflow_datasets")
  return pathlib.Path(root).expanduser() / "anki"


def anki_file(code: str, *, data_dir: str | os.PathLike | None = None,
              manual_dir: str | os.PathLike | None = None, download: bool = True
              ) -> pathlib.Path:
  """The `<code>.txt` of the Anki pair `code` (module docstring: local copies, then the cache,
  then a download); DataError, one line, when there is none and it cannot be downloaded."""
  code = check_pair_code(code)
  if manual_dir:
    folder = pathlib.Path(manual_dir).expanduser()
    if (path := _local_copy(code, folder)) is not None:
      return path
    raise DatasetNotFoundError(f"data.pair={code}: data.manual_dir={folder} has neither {code}.txt "
                               f"nor anki-{code}-eng/{code}.txt; put the file there, or leave "
                               f"data.manual_dir empty to download {ANKI_URL.format(code=code)}")
  if (env := os.environ.get(base.DATA_DIR_ENV)) and \
      (path := _local_copy(code, pathlib.Path(env).expanduser())) is not None:
    return path
  folder = cache_folder(data_dir) / f"{code}-eng"
  if (folder / f"{code}.txt").is_file():
    return folder / f"{code}.txt"
  url = ANKI_URL.format(code=code)
  instead = (f"download {url} where you are online and give data.path=FILE (the zip, or "
             f"{code}.txt), or put {code}.txt in {folder}")
  if not download:
    raise DatasetNotFoundError(f"data.pair={code}: {code}.txt not found and downloading is off; "
                               f"{instead}")
  if (unreachable := base._unreachable(url)) is not None:  # pylint: disable=protected-access
    raise DatasetNotFoundError(f"data.pair={code}: {unreachable}; {instead}")
  folder.mkdir(parents=True, exist_ok=True)
  archive = folder / f"{code}-eng.zip"
  try:
    _fetch(url, archive)
  except urllib.error.HTTPError as e:
    if e.code in (404, 410):
      raise DataError(f"unknown Anki pair code data.pair={code}: {url} does not exist (HTTP "
                      f"{e.code}); the codes are the three-letter names listed on {ANKI_HOME}"
                      ) from None
    raise DatasetNotFoundError(f"data.pair={code}: the download of {url} failed (HTTP {e.code} "
                               f"{e.reason}); {instead}") from None
  except (OSError, ValueError) as e:  # URLError, a timeout, a full disk, a too large answer
    raise DatasetNotFoundError(f"data.pair={code}: the download of {url} failed "
                               f"({' '.join(str(e).split())[:200]}); {instead}") from None
  text = folder / f"{code}.txt"
  tmp = text.with_name(text.name + ".tmp")
  tmp.write_bytes(_zip_member(archive, url)[1])
  tmp.replace(text)
  return text


def _fetch(url: str, dest: pathlib.Path) -> None:
  """Downloads `url` into `dest` (written in one rename; at most MAX_BYTES)."""
  from attnlab import __version__  # pylint: disable=g-import-not-at-top
  # The site refuses some clients that do not name themselves.
  request = urllib.request.Request(url, headers={"User-Agent": f"attnlab/{__version__}"})
  tmp = dest.with_name(dest.name + ".part")
  try:
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response, open(tmp, "wb") as out:
      size = 0
      while chunk := response.read(1 << 20):
        size += len(chunk)
        if size > MAX_BYTES:
          raise ValueError(f"the answer is larger than {MAX_BYTES >> 20} MB, which no Anki file is")
        out.write(chunk)
    tmp.replace(dest)
  finally:
    tmp.unlink(missing_ok=True)


def _zip_member(archive: pathlib.Path, origin: str | os.PathLike) -> tuple[str, bytes]:
  """(name, bytes) of the one `.txt` member of an Anki zip but `_about.txt` (DataError
  otherwise)."""
  try:
    with zipfile.ZipFile(archive) as zf:
      members = [info for info in zf.infolist() if not info.is_dir()
                 and info.filename.lower().endswith(".txt")
                 and not pathlib.PurePosixPath(info.filename).name.startswith("_")]
      if len(members) != 1:
        names = ", ".join(info.filename for info in members) or "none"
        raise DataError(f"{origin}: an Anki zip holds one <code>.txt file besides _about.txt, "
                        f"this one {len(members)} ({names}); give the .txt file as data.path")
      if members[0].file_size > MAX_BYTES:
        raise DataError(f"{origin}: {members[0].filename} unpacks to {members[0].file_size} bytes, "
                        f"more than the {MAX_BYTES >> 20} MB read from a zip")
      return members[0].filename, zf.read(members[0])
  except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError) as e:
    raise DataError(f"{origin} is not a readable zip ({e}); delete it and download it again, or "
                    f"give the unpacked .txt file") from None


def corpus_file(data) -> pathlib.Path:
  """The file of a `dataset=anki|tsv` data config (`data.path`, or anki's `data.pair`); DataError,
  one line, when it is missing or both or neither are given."""
  kind, path, pair = data.name, str(data.get("path", "")), str(data.get("pair", ""))
  if kind == "tsv" and pair:
    raise DataError("data.pair names an Anki file (dataset=anki); dataset=tsv reads data.path")
  if kind == "anki" and path and pair:
    raise DataError(f"dataset=anki: give data.path or data.pair, not both (data.path={path}, "
                    f"data.pair={pair})")
  if kind == "anki" and pair:
    return anki_file(pair, data_dir=data.get("data_dir") or None,
                     manual_dir=data.get("manual_dir") or None)
  if not path:
    need = ("data.path=FILE (an Anki <code>.txt, or its <code>-eng.zip) or data.pair=CODE (fra, "
            "spa, cmn, ...: downloaded)" if kind == "anki" else
            "data.path=FILE: a UTF-8 TSV of 'source<TAB>target' lines")
    raise DataError(f"dataset={kind} needs {need}")
  file = pathlib.Path(path).expanduser()
  if not file.is_file():
    why = "is a folder" if file.is_dir() else "does not exist"
    raise DatasetNotFoundError(f"data.path={file} {why}; give the corpus file "
                               f"({FORMATS[kind][1]} lines)")
  return file


def read_pairs(kind: str, path: pathlib.Path) -> list[tuple[str, str]]:
  """The pairs of a corpus file of format `kind` (anki: a zip too), in the file's column order."""
  names, layout, max_fields = FORMATS[kind]
  data = None
  if kind == "anki" and path.suffix.lower() == ".zip":
    member, data = _zip_member(path, path)
    path = path / member  # what the messages name: the zip, then the member
  pairs, _ = base.read_pairs(path, names, layout, max_fields, data)
  if not pairs:
    raise DataError(f"{path} holds no sentence pairs; each line needs '{layout}'")
  return pairs


def load_splits(data) -> dict[str, list[tuple[str, str]]]:
  """{split: [(source, target)]} of a `dataset=anki|tsv` data config: the file's pairs shuffled and
  cut 80/10/10, each in data.direction (module docstring)."""
  if data.name not in FORMATS:
    raise DataError(f"unknown corpus format {data.name!r}; valid formats: {', '.join(FORMATS)}")
  direction = data.get("direction", "forward")
  if direction not in DIRECTIONS:
    raise DataError(f"data.direction={direction!r} does not apply to dataset={data.name}; valid: "
                    f"forward (first column -> second) or reverse")
  path = corpus_file(data)
  pairs = read_pairs(data.name, path)
  if len(pairs) < 10:
    raise DataError(f"{path} holds {len(pairs)} sentence pairs; the 80/10/10 split into train, "
                    f"validation and test needs at least 10")
  splits = split_pairs(pairs)
  if direction == "reverse":
    splits = {name: [(b, a) for a, b in rows] for name, rows in splits.items()}
  return splits
