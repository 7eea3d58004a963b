"""Tokenizers of imported Hugging Face checkpoints (`data.tokenizer=hf`) and bare token ids.

`HFTokenizer(directory)` reads the tokenizer files of a checkpoint folder with the `tokenizers`
library (Hugging Face's Rust tokenizers), in this order of preference:
- `tokenizer.json` (the full pipeline, any model type);
- `vocab.json` + `merges.txt`: GPT-2's byte-level BPE;
- `vocab.txt`: BERT's WordPiece (lower-cased when tokenizer_config.json says `do_lower_case`,
  the default).
It offers what the tasks use of `attnlab.data.tokenizers.Vocab` (encode, decode, id_to_token,
tokens, len, and the ids pad/start/end/unk/cls/sep/mask), but its special ids are the
checkpoint's: GPT-2's `<|endoftext|>` is both start and end; BERT's `[PAD]`, `[UNK]`, `[CLS]`,
`[SEP]`, `[MASK]` keep their ids (0, 100, 101, 102, 103 in the released vocabularies). `encode`
adds no special token; `decode` drops them.

`IdTokenizer(vocab_size)` (`data.tokenizer=ids`) stands in when a checkpoint came without
tokenizer files: text is written as token ids separated by spaces ("464 3290 318"), both ways.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any, Iterable

import numpy as np

from attnlab.errors import DataError

PathLike = str | os.PathLike[str]

# Tokenizer files HFTokenizer reads; an import copies those present into the run directory.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer_config.json", "special_tokens_map.json")
# Special-token roles -> names tried in order (GPT-2, BERT).
_SPECIAL_NAMES = {
    "pad": ("[PAD]", "<pad>", "<|endoftext|>"),
    "start": ("<|endoftext|>", "[CLS]", "<s>"),
    "end": ("<|endoftext|>", "[SEP]", "</s>"),
    "unk": ("[UNK]", "<unk>", "<|endoftext|>"),
    "cls": ("[CLS]", "<|endoftext|>"),
    "sep": ("[SEP]", "<|endoftext|>"),
    "mask": ("[MASK]", "<mask>"),
}

# The largest id a vocabulary of N tokens may have: MAX_ID_SPREAD * N (+ 1024) (its ids run 0..N-1,
# with room for gaps), since HFTokenizer keeps a table of all ids up to the largest.
MAX_ID_SPREAD = 2
# Roles whose tokenizer_config.json key differs from the role name ("bos_token", "eos_token").
_CONFIG_KEYS = {"start": "bos", "end": "eos"}


def has_tokenizer_files(directory: PathLike) -> bool:
  """Whether `directory` holds files HFTokenizer can read."""
  d = pathlib.Path(directory)
  return ((d / "tokenizer.json").is_file()
          or ((d / "vocab.json").is_file() and (d / "merges.txt").is_file())
          or (d / "vocab.txt").is_file())


def copy_files(source: PathLike, target: PathLike) -> list[str]:
  """Copies the TOKENIZER_FILES in `source` into `target` (created); returns their names."""
  source, target = pathlib.Path(source), pathlib.Path(target)
  target.mkdir(parents=True, exist_ok=True)
  names = [n for n in TOKENIZER_FILES if (source / n).is_file()]
  for name in names:
    shutil.copyfile(source / name, target / name)
  return names


def _check_id(i: int, size: int) -> None:
  if not 0 <= i < size:
    raise DataError(f"token id {i} is outside this vocabulary of {size} tokens")


def _flat_ids(ids: Iterable[int] | np.ndarray) -> list[int]:
  return np.asarray(ids if hasattr(ids, "__array__") else list(ids), np.int64).reshape(-1).tolist()


def _read_json(path: pathlib.Path) -> dict[str, Any]:
  if not path.is_file():
    return {}
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    raise DataError(f"{path} is not valid JSON ({' '.join(str(e).split())[:200]}); restore it "
                    f"from the checkpoint") from None
  return data if isinstance(data, dict) else {}


def _token_name(value: Any) -> str | None:
  """A special token entry of tokenizer_config.json / special_tokens_map.json as its text."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


class HFTokenizer:
  """The tokenizer files of a Hugging Face checkpoint folder (module docstring)."""

  kind = "hf"

  def __init__(self, directory: PathLike):
    try:
      import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise DataError("reading Hugging Face tokenizer files needs the `tokenizers` package: "
                      "pip install tokenizers (or pip install -e '.[hf]')") from None
    d = pathlib.Path(directory)
    self.directory = d
    config = {**_read_json(d / "tokenizer_config.json"),
              **_read_json(d / "special_tokens_map.json")}
    if not has_tokenizer_files(d):
      raise DataError(f"{d} holds no tokenizer files (tokenizer.json, vocab.json + merges.txt, "
                      f"or vocab.txt); copy them from the checkpoint or use data.tokenizer=ids")
    try:
      if (d / "tokenizer.json").is_file():
        tok = hf_tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
      elif (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        tok = hf_tokenizers.ByteLevelBPETokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
      else:
        tok = hf_tokenizers.BertWordPieceTokenizer(
            str(d / "vocab.txt"), lowercase=bool(config.get("do_lower_case", True)))
    except Exception as e:  # the Rust library raises plain Exceptions for damaged files
      raise DataError(f"cannot read the tokenizer files in {d}: {e}") from None
    self._tok = tok
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1 if vocab else 0
    if size > MAX_ID_SPREAD * len(vocab) + 1024:  # a forged id (up to 2**32 - 1): gigabytes
      raise DataError(f"the tokenizer files in {d} give {len(vocab)} tokens with ids up to {size - 1}; "
                      f"a vocabulary's ids run 0..N-1 (the files are damaged or forged)")
    self._tokens = [""] * size
    for token, i in vocab.items():
      self._tokens[i] = token
    special = {}
    for role, names in _SPECIAL_NAMES.items():
      configured = _token_name(config.get(f"{_CONFIG_KEYS.get(role, role)}_token"))
      candidates = ((configured,) if configured else ()) + names
      special[role] = next((vocab[n] for n in candidates if n in vocab), None)
    self.pad_id, self.start_id, self.end_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        special.values())
    # Ids of every special token (never masked, dropped by decode).
    self.all_special_ids = sorted({i for i in special.values() if i is not None}
                                  | {i for t, i in vocab.items()
                                     if t.startswith("[unused") or t in (
                                         "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                         "<|endoftext|>")})

  def __len__(self) -> int:
    return len(self._tokens)

  def __repr__(self) -> str:
    return f"HFTokenizer({len(self)} tokens, {self.directory})"

  @property
  def tokens(self) -> list[str]:
    """All tokens; `tokens[i]` has id i."""
    return list(self._tokens)

  def token_to_id(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    return self.unk_id if i is None else i

  def id_to_token(self, i: int) -> str:
    _check_id(i, len(self))
    return self._tokens[i]

  def encode(self, text: str, *, add_start: bool = False, add_end: bool = False) -> list[int]:
    """Token ids of `text` (no special tokens unless asked)."""
    if not isinstance(text, str):
      raise DataError(f"encode expects a str, got {type(text).__name__}")
    ids = list(self._tok.encode(text, add_special_tokens=False).ids)
    return ([self.start_id] if add_start else []) + ids + ([self.end_id] if add_end else [])

  def _pieces(self, text: str) -> list[tuple[str, int]]:
    """(the span of `text` each token covers, its id), in order."""
    enc = self._tok.encode(text, add_special_tokens=False)
    return [(text[start:end], i) for (start, end), i in zip(enc.offsets, enc.ids)]

  def split(self, text: str) -> list[str]:
    """The pieces of `text` the tokens cover (for messages; encode gives the ids)."""
    return [piece for piece, _ in self._pieces(text)]

  def unknown(self, text: str) -> list[str]:
    """The pieces of `text` encoded as the unknown token, each once, in order (WordPiece maps a
    word it cannot spell to [UNK]; byte-level BPE spells everything)."""
    if self.unk_id is None:
      return []
    return list(dict.fromkeys(piece for piece, i in self._pieces(text) if i == self.unk_id))

  def decode(self, ids: Iterable[int] | np.ndarray, *, stop_at_end: bool = False,
             skip_special: bool = True) -> str:
    """Text of `ids`; special tokens dropped unless skip_special=False."""
    ids = _flat_ids(ids)
    if stop_at_end and self.end_id in ids:
      ids = ids[:ids.index(self.end_id)]
    for i in ids:
      self.id_to_token(i)
    return self._tok.decode(ids, skip_special_tokens=skip_special)


class IdTokenizer:
  """Text <-> token ids written as space-separated integers (a checkpoint without tokenizer)."""

  kind = "ids"
  pad_id = start_id = end_id = unk_id = cls_id = sep_id = mask_id = None

  def __init__(self, vocab_size: int):
    self.vocab_size = int(vocab_size)
    self.all_special_ids: list[int] = []

  def __len__(self) -> int:
    return self.vocab_size

  @property
  def tokens(self) -> list[str]:
    return [str(i) for i in range(self.vocab_size)]

  def id_to_token(self, i: int) -> str:
    _check_id(i, self.vocab_size)
    return str(i)

  def encode(self, text: str, **unused: Any) -> list[int]:
    """"464 3290 318" -> [464, 3290, 318]."""
    try:
      ids = [int(t) for t in text.split()]
    except ValueError:
      raise DataError(f"this run has no tokenizer (data.tokenizer=ids): give the text as token "
                      f"ids separated by spaces, e.g. '464 3290 318', not {text[:40]!r}; or "
                      f"import the checkpoint again with its tokenizer files") from None
    for i in ids:
      self.id_to_token(i)
    return ids

  def split(self, text: str) -> list[str]:
    return text.split()

  def unknown(self, text: str) -> list[str]:
    """Nothing: `encode` refuses what is not a token id."""
    del text
    return []

  def decode(self, ids: Iterable[int] | np.ndarray, **unused: Any) -> str:
    """[464, 3290] -> " 464 3290" (a leading space, so that it continues a prompt)."""
    return "".join(f" {i}" for i in _flat_ids(ids))


def load(kind: str, path: PathLike | None, vocab_size: int = 0) -> HFTokenizer | IdTokenizer:
  """The tokenizer of `data.tokenizer` = "hf" (files in `path`) or "ids" (`vocab_size` ids)."""
  if kind == "hf":
    if not path:
      raise DataError("data.tokenizer=hf needs data.tokenizer_path: the folder with the "
                      "checkpoint's tokenizer files")
    if not pathlib.Path(path).is_dir():
      raise DataError(f"data.tokenizer_path={path} is not a folder; it must hold the "
                      f"checkpoint's tokenizer files (attnlab import-hf copies them into "
                      f"RUN_DIR/tokenizer)")
    return HFTokenizer(path)
  if kind == "ids":
    if vocab_size < 1:
      raise DataError("data.tokenizer=ids needs model.vocab_size >= 1")
    return IdTokenizer(vocab_size)
  raise DataError(f"unknown Hugging Face tokenizer kind {kind!r}; valid: hf, ids")
