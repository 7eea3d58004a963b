"""Tokenizers: one vocabulary type (`Vocab`) with character, byte, word and subword segmentation.

Ids 0..6 are always the special tokens, in this order (the models rely on 0 = padding):
  0 `<pad>`, 1 `<start>`, 2 `<end>`, 3 `<unk>`, 4 `[CLS]`, 5 `[SEP]`, 6 `[MASK]`.

`encode(text, add_start=False, add_end=False) -> list[int]`: tokens outside the vocabulary
become `<unk>` (`unknown(text)` lists them, `unknown_warning` says so in one line); the start/end
tokens are added only when asked.

`decode(ids, stop_at_end=True, skip_special=True) -> str`:
- with `stop_at_end`, the first `<end>` and everything after it are dropped;
- `<pad>`, `<start>` and `<end>` never appear in the text;
- with `skip_special`, `[CLS]`, `[SEP]`, `[MASK]` are dropped too, otherwise written as is;
- `<unk>` is written as "<unk>".
For char and subword tokenizers `decode(encode(text)) == text` whenever every character of
`text` was seen in training (for the byte tokenizer, UTF-8 bytes, always); the word tokenizer joins words with single spaces (lower-cased if
trained so).

`save(path)` writes one self-contained JSON file (the sentencepiece model is embedded);
`load_tokenizer(path)` restores whichever kind was saved. `load_or_train_tokenizer` reuses a
saved tokenizer or trains and saves one; `cached_subword` keeps the subword tokenizers the tasks
train in one cache folder (`data.tokenizer_dir`, default ~/.cache/attnlab/tokenizers) under a
key of their corpus and options. The cache only saves time: a run keeps its own copy
(attnlab.data.assets).
"""

from __future__ import annotations

import base64
import collections
import functools
import hashlib
import io
import itertools
import json
import os
import pathlib
import re
import sys
import unicodedata
from typing import Any, Callable, ClassVar, Iterable, Sequence

import numpy as np
import sentencepiece as spm

from attnlab.errors import DataError

SPECIAL_TOKENS = ("<pad>", "<start>", "<end>", "<unk>", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, START_ID, END_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
# Marker of the saved JSON format.
_FORMAT = "attnlab.tokenizer/1"

PathLike = str | os.PathLike[str]


class Vocab:
  """Token <-> id mapping with the fixed special tokens; subclasses define the segmentation."""

  # Name of the segmentation, stored in the saved file ("char", "word", "subword").
  kind: ClassVar[str] = ""
  pad_id: ClassVar[int] = PAD_ID
  start_id: ClassVar[int] = START_ID
  end_id: ClassVar[int] = END_ID
  unk_id: ClassVar[int] = UNK_ID
  cls_id: ClassVar[int] = CLS_ID
  sep_id: ClassVar[int] = SEP_ID
  mask_id: ClassVar[int] = MASK_ID

  def __init__(self, tokens: Sequence[str], **options: Any):
    tokens = list(tokens)
    if tuple(tokens[:len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
      raise DataError(f"a vocabulary must start with the special tokens {SPECIAL_TOKENS}, got "
                      f"{tokens[:len(SPECIAL_TOKENS)]}")
    if len(set(tokens)) != len(tokens):
      dup = [t for t, c in collections.Counter(tokens).items() if c > 1][:5]
      raise DataError(f"vocabulary tokens must be distinct; repeated: {dup}")
    self._tokens = tokens
    self._ids = {t: i for i, t in enumerate(tokens)}
    self.options = dict(options)

  def __len__(self) -> int:
    return len(self._tokens)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({len(self)} tokens, {self.options})"

  @property
  def tokens(self) -> list[str]:
    """All tokens; `tokens[i]` has id i."""
    return list(self._tokens)

  def token_to_id(self, token: str) -> int:
    return self._ids.get(token, UNK_ID)

  def id_to_token(self, i: int) -> str:
    return self._tokens[self._check_id(i)]

  def _check_id(self, i: int) -> int:
    if not 0 <= i < len(self._tokens):
      raise DataError(f"token id {i} is outside this vocabulary of {len(self._tokens)} tokens")
    return i

  # Segmentation, defined by each kind.
  def _encode(self, text: str) -> list[int]:
    return [self._ids.get(t, UNK_ID) for t in self.split(text)]

  def split(self, text: str) -> list[str]:
    """The text as tokens (before the id lookup)."""
    raise NotImplementedError

  def _decode(self, ids: list[int]) -> str:
    raise NotImplementedError

  def unknown(self, text: str) -> list[str]:
    """The tokens of `text` outside the vocabulary, each once, in order: `encode` makes them
    `<unk>` (nothing is dropped)."""
    pieces, ids = self.split(text), self._encode(text)
    return list(dict.fromkeys(p for p, i in zip(pieces, ids) if i == UNK_ID))

  def encode(self, text: str, *, add_start: bool = False, add_end: bool = False) -> list[int]:
    """Token ids of `text`, optionally wrapped in `<start>` ... `<end>`."""
    if not isinstance(text, str):
      raise DataError(f"encode expects a str, got {type(text).__name__}")
    ids = self._encode(text)
    return ([START_ID] if add_start else []) + ids + ([END_ID] if add_end else [])

  def decode(self, ids: Iterable[int] | np.ndarray, *, stop_at_end: bool = True,
             skip_special: bool = True) -> str:
    """Text of `ids` (see the module docstring for how special tokens are handled)."""
    if not hasattr(ids, "__array__") and not isinstance(ids, (list, tuple)):
      ids = list(ids)  # A generator.
    ids = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
    if stop_at_end and END_ID in ids:
      ids = ids[:ids.index(END_ID)]
    drop = {PAD_ID, START_ID, END_ID} | ({CLS_ID, SEP_ID, MASK_ID} if skip_special else set())
    return self._decode([self._check_id(i) for i in ids if i not in drop])

  # Saving.
  def _extra_state(self) -> dict[str, Any]:
    return {}

  def save(self, path: PathLike) -> None:
    """Writes the tokenizer as one JSON file (atomically: a crash never leaves half a file)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": _FORMAT, "kind": self.kind, "options": self.options,
             "tokens": self._tokens, **self._extra_state()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, ensure_ascii=False, indent=0), encoding="utf-8")
    tmp.replace(path)

  @classmethod
  def _from_state(cls, state: dict[str, Any]) -> "Vocab":
    return cls(state["tokens"], **state["options"])

  @classmethod
  def load(cls, path: PathLike) -> "Vocab":
    """Restores a saved tokenizer of whichever kind (same as `load_tokenizer`)."""
    return load_tokenizer(path)


def _count(texts: Iterable[str], split: Callable[[str], list[str]]) -> collections.Counter:
  counts = collections.Counter()
  n = 0
  for text in texts:
    if not isinstance(text, str):
      raise DataError(f"tokenizer training expects str texts, got {type(text).__name__}")
    counts.update(split(text))
    n += 1
  if n == 0:
    raise DataError("tokenizer training got no texts; pass the training split's texts")
  return counts


def _ranked(counts: collections.Counter, min_count: int, max_size: int | None) -> list[str]:
  """Tokens by descending count, ties by token, keeping those seen >= min_count times."""
  kept = sorted((t for t, c in counts.items() if c >= min_count and t not in SPECIAL_TOKENS),
                key=lambda t: (-counts[t], t))
  return kept if max_size is None else kept[:max(0, max_size - len(SPECIAL_TOKENS))]


class CharTokenizer(Vocab):
  """One token per character (nanoGPT-style); characters sorted by code point."""

  kind = "char"

  def split(self, text: str) -> list[str]:
    return list(text)

  def _decode(self, ids: list[int]) -> str:
    return "".join(self._tokens[i] for i in ids)

  @classmethod
  def train(cls, texts: Iterable[str], *, min_count: int = 1) -> "CharTokenizer":
    """Vocabulary of the characters seen at least `min_count` times in `texts`."""
    counts = _count(texts, list)
    chars = sorted(c for c, n in counts.items() if n >= min_count)
    return cls(list(SPECIAL_TOKENS) + chars, min_count=min_count)


# The 256 byte tokens of ByteTokenizer, ids len(SPECIAL_TOKENS) + byte: an ASCII byte is its
# character, any other byte "<0xNN>" (strings no text character or special token can equal).
BYTE_TOKENS = tuple(chr(b) if b < 128 else f"<0x{b:02X}>" for b in range(256))


class ByteTokenizer(Vocab):
  """One token per byte of the text's UTF-8 encoding: a fixed vocabulary of 7 special + 256 byte
  tokens that encodes every text (no `<unk>`) and learns nothing from data, so two runs on
  different corpora share their token ids. On ASCII text a byte is a character."""

  kind = "byte"

  def __init__(self, tokens: Sequence[str] | None = None, **options: Any):
    expected = list(SPECIAL_TOKENS) + list(BYTE_TOKENS)
    if tokens is not None and list(tokens) != expected:
      raise DataError(f"a byte tokenizer holds the {len(SPECIAL_TOKENS)} special tokens and the "
                      f"256 byte tokens in order; this file's {len(tokens)} tokens differ (damaged "
                      f"or edited tokenizer file)")
    super().__init__(expected, **options)

  def split(self, text: str) -> list[str]:
    return [BYTE_TOKENS[b] for b in text.encode("utf-8")]

  def _encode(self, text: str) -> list[int]:
    data = np.frombuffer(text.encode("utf-8"), np.uint8)
    return (data.astype(np.int32) + len(SPECIAL_TOKENS)).tolist()

  def _decode(self, ids: list[int]) -> str:
    # Special tokens as written; each run of bytes between them decoded as UTF-8 (a cut or
    # invalid sequence, as a sampled one can be, becomes U+FFFD).
    offset = len(SPECIAL_TOKENS)
    runs = itertools.groupby(ids, lambda i: i < offset)
    return "".join("".join(self._tokens[i] for i in run) if special else
                   bytes(i - offset for i in run).decode("utf-8", errors="replace")
                   for special, run in runs)

  @classmethod
  def train(cls, texts: Iterable[str] = ()) -> "ByteTokenizer":
    """The byte vocabulary (the same whatever `texts` are; for train_tokenizer's interface)."""
    del texts
    return cls()


@functools.cache
def _word_or_punct() -> re.Pattern:
  """A word, or one punctuation mark, for splitting punctuation off.

  Words may hold combining marks (Unicode categories Mn, Mc, Me): `re`'s `\\w` leaves them out,
  which would cut Devanagari words at every vowel sign ("जातो" into "ज", "ा", "त", "ो").
  Built on first use (a pass over the code points, under a second).
  """
  marks, start = [], None
  for code in range(sys.maxunicode + 2):
    is_mark = code <= sys.maxunicode and unicodedata.category(chr(code)).startswith("M")
    if is_mark and start is None:
      start = code
    elif not is_mark and start is not None:
      marks.append(f"{re.escape(chr(start))}-{re.escape(chr(code - 1))}")
      start = None
  marks = "".join(marks)
  return re.compile(rf"[\w{marks}]+|[^\w\s{marks}]")


class WordTokenizer(Vocab):
  """Words split on white space, optionally lower-cased and with punctuation split off."""

  kind = "word"

  def split(self, text: str) -> list[str]:
    if self.options.get("lower", True):
      text = text.lower()
    if self.options.get("split_punct", True):
      return _word_or_punct().findall(text)
    return text.split()

  def _decode(self, ids: list[int]) -> str:
    return " ".join(self._tokens[i] for i in ids)

  @classmethod
  def train(cls, texts: Iterable[str], *, lower: bool = True, split_punct: bool = True,
            min_count: int = 1, max_size: int | None = None) -> "WordTokenizer":
    """Words seen >= `min_count` times, most frequent first, at most `max_size` tokens in all."""
    splitter = cls(SPECIAL_TOKENS, lower=lower, split_punct=split_punct)
    counts = _count(texts, splitter.split)
    words = _ranked(counts, min_count, max_size)
    return cls(list(SPECIAL_TOKENS) + words, lower=lower, split_punct=split_punct,
               min_count=min_count, max_size=max_size)


# Training texts are cut at line ends into pieces of at most this many characters
# (sentencepiece skips longer "sentences").
_SP_CHUNK_CHARS = 2000


def _sp_chunks(texts: Iterable[str]) -> Iterable[str]:
  for text in texts:
    if not isinstance(text, str):
      raise DataError(f"tokenizer training expects str texts, got {type(text).__name__}")
    start = 0
    while start < len(text):
      end = min(len(text), start + _SP_CHUNK_CHARS)
      if end < len(text):
        cut = text.rfind("\n", start, end)
        end = cut + 1 if cut > start else end
      yield text[start:end]
      start = end


class SubwordTokenizer(Vocab):
  """Subword pieces from a sentencepiece model (unigram or BPE), trained deterministically.

  The model keeps the text as it is (no normalisation, no added leading space, white space
  and line ends kept), so `decode(encode(text)) == text` for characters seen in training (all
  of them with `byte_fallback=True`), and special tokens decode in place without spaces.
  """

  kind = "subword"
  # File name of the sentencepiece model that `train` writes into model_dir.
  MODEL_FILE: ClassVar[str] = "subword.model"

  def __init__(self, tokens: Sequence[str], *, model_proto: bytes, **options: Any):
    super().__init__(tokens, **options)
    self._model_proto = bytes(model_proto)
    self._sp = spm.SentencePieceProcessor(model_proto=self._model_proto)
    if self._sp.get_piece_size() != len(tokens):
      raise DataError("sentencepiece model and token list disagree; the tokenizer file is damaged")

  def split(self, text: str) -> list[str]:
    return self._sp.encode(text, out_type=str)

  def _encode(self, text: str) -> list[int]:
    return list(self._sp.encode(text))

  def _decode(self, ids: list[int]) -> str:
    # Special tokens as written; each run of pieces between them decoded by sentencepiece.
    runs = itertools.groupby(ids, lambda i: i < len(SPECIAL_TOKENS))
    return "".join("".join(self._tokens[i] for i in run) if special else self._sp.decode(list(run))
                   for special, run in runs)

  def _extra_state(self) -> dict[str, Any]:
    return {"model": base64.b64encode(self._model_proto).decode("ascii")}

  @classmethod
  def _from_state(cls, state: dict[str, Any]) -> "SubwordTokenizer":
    return cls(state["tokens"], model_proto=base64.b64decode(state["model"]), **state["options"])

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int, model_dir: PathLike, *,
            model_type: str = "unigram", character_coverage: float = 1.0,
            byte_fallback: bool = False, hard_vocab_limit: bool = True) -> "SubwordTokenizer":
    """Trains sentencepiece on `texts` (the training split) and writes model_dir/subword.model.

    Deterministic: one thread, every input line used, no sampling. `hard_vocab_limit=False`
    makes `vocab_size` an upper bound (a small text gets the pieces it has, no error).
    """
    if model_type not in ("unigram", "bpe"):
      raise DataError(f"subword model_type must be 'unigram' or 'bpe', got {model_type!r}")
    chunks = list(_sp_chunks(texts))
    if not any(c.strip() for c in chunks):
      raise DataError("tokenizer training got no text; pass the training split's texts")
    writer = io.BytesIO()
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(chunks), model_writer=writer, vocab_size=int(vocab_size),
          model_type=model_type, character_coverage=character_coverage,
          byte_fallback=byte_fallback, hard_vocab_limit=hard_vocab_limit,
          normalization_rule_name="identity",
          remove_extra_whitespaces=False, add_dummy_prefix=False, split_digits=False,
          pad_id=PAD_ID, bos_id=START_ID, eos_id=END_ID, unk_id=UNK_ID,
          pad_piece=SPECIAL_TOKENS[PAD_ID], bos_piece=SPECIAL_TOKENS[START_ID],
          eos_piece=SPECIAL_TOKENS[END_ID], unk_piece=SPECIAL_TOKENS[UNK_ID],
          user_defined_symbols=list(SPECIAL_TOKENS[CLS_ID:]),
          num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,
          max_sentence_length=4 * _SP_CHUNK_CHARS + 16, minloglevel=2)
    except RuntimeError as e:
      raise DataError(f"sentencepiece training failed: {' '.join(str(e).split())} (for a "
                      f"small training text pick a smaller vocab_size)") from e
    proto = writer.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=proto)
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    model_dir = pathlib.Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / cls.MODEL_FILE).write_bytes(proto)
    return cls(tokens, model_proto=proto, vocab_size=int(vocab_size), model_type=model_type,
               character_coverage=character_coverage, byte_fallback=byte_fallback)


def unknown_warning(tokenizer: Vocab, text: str, what: str = "the input") -> str | None:
  """One line naming the symbols of `text` that `tokenizer` cannot represent (None if there are
  none), e.g. "the prompt has 1 character outside the vocabulary of the run: '€' (3 times); it
  was encoded as <unk>, ..."."""
  unknown = tokenizer.unknown(text)
  if not unknown:
    return None
  counts = collections.Counter(t for t in tokenizer.split(text) if t in set(unknown))
  shown = ", ".join(f"{t!r}" + (f" ({counts[t]} times)" if counts[t] > 1 else "")
                    for t in unknown[:10])
  more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
  one = len(unknown) == 1
  noun = {"char": "character", "word": "word"}.get(tokenizer.kind, "symbol")
  unk = tokenizer.id_to_token(tokenizer.unk_id)  # "<unk>", or an imported vocabulary's "[UNK]"
  return (f"{what} has {len(unknown)} {noun}{'' if one else 's'} outside the vocabulary of the "
          f"run: {shown}{more}; {'it was' if one else 'they were'} encoded as {unk}, which the "
          f"model reads as 'unknown'")


# kind -> tokenizer class; the one place a tokenizer kind is registered.
TOKENIZERS: dict[str, type[Vocab]] = {
    CharTokenizer.kind: CharTokenizer,
    WordTokenizer.kind: WordTokenizer,
    SubwordTokenizer.kind: SubwordTokenizer,
    ByteTokenizer.kind: ByteTokenizer,
}


def load_tokenizer(path: PathLike) -> Vocab:
  """Restores a tokenizer saved with `save`, whichever kind it is."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise DataError(f"tokenizer file {path} not found; train one (load_or_train_tokenizer) first")
  try:
    state = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DataError(f"{path}: not a saved tokenizer ({e})") from None
  if not isinstance(state, dict) or state.get("format") != _FORMAT:
    raise DataError(f"{path}: not a saved attnlab tokenizer (format {_FORMAT} expected)")
  kind = state.get("kind")
  if kind not in TOKENIZERS:
    raise DataError(f"{path}: unknown tokenizer kind {kind!r}; valid kinds: "
                    f"{', '.join(TOKENIZERS)}")
  return TOKENIZERS[kind]._from_state(state)


def train_tokenizer(kind: str, texts: Iterable[str], *, model_dir: PathLike | None = None,
                    **options: Any) -> Vocab:
  """Trains a tokenizer of `kind` ("char", "word", "subword"; subword needs model_dir)."""
  if kind not in TOKENIZERS:
    raise DataError(f"unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZERS)}")
  if kind == SubwordTokenizer.kind:
    if model_dir is None:
      raise DataError("a subword tokenizer needs model_dir (where its model is saved)")
    if "vocab_size" not in options:
      raise DataError("a subword tokenizer needs vocab_size")
    return SubwordTokenizer.train(texts, options.pop("vocab_size"), model_dir, **options)
  try:
    return TOKENIZERS[kind].train(texts, **options)
  except TypeError as e:
    raise DataError(f"bad option for a {kind} tokenizer: {e}") from None


def load_or_train_tokenizer(path: PathLike, kind: str,
                            texts: Iterable[str] | Callable[[], Iterable[str]],
                            **options: Any) -> Vocab:
  """Loads the tokenizer saved at `path` (a resumed run) or trains one on `texts` and saves it.

  `texts` may be a function returning the texts, so a resumed run does not read them at all.
  A saved tokenizer of another kind is an error (the run's vocabulary must not change).
  """
  path = pathlib.Path(path)
  if path.is_file():
    tokenizer = load_tokenizer(path)
    if tokenizer.kind != kind:
      raise DataError(f"{path} holds a {tokenizer.kind} tokenizer but a {kind} one was asked "
                      f"for; use another workdir or delete the file")
    return tokenizer
  texts = texts() if callable(texts) else texts
  tokenizer = train_tokenizer(kind, texts, model_dir=path.parent, **options)
  tokenizer.save(path)
  return tokenizer


def cache_dir(directory: PathLike | None = None) -> pathlib.Path:
  """The tokenizer cache: `directory` when given, else $XDG_CACHE_HOME/attnlab/tokenizers."""
  if directory:
    return pathlib.Path(directory).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "attnlab" / "tokenizers"


def cached_subword(corpus: str, options: dict[str, Any],
                   texts: Iterable[str] | Callable[[], Iterable[str]],
                   directory: PathLike | None = None, *,
                   hard_vocab_limit: bool = True) -> "SubwordTokenizer":
  """The subword tokenizer of `corpus` (a name) with `options` (vocab_size and whatever else
  selects the texts): from the cache, or trained on `texts` and cached. Training is
  deterministic, so a missing cache costs time only, never a different vocabulary.
  `hard_vocab_limit=False`: vocab_size is an upper bound (SubwordTokenizer.train)."""
  keyed = {"corpus": corpus, **options}
  if not hard_vocab_limit:
    keyed["hard_vocab_limit"] = False
  key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode())
  path = cache_dir(directory) / f"{corpus}_subword_{key.hexdigest()[:16]}.json"
  extra = {} if hard_vocab_limit else {"hard_vocab_limit": False}
  return load_or_train_tokenizer(path, "subword", texts, vocab_size=int(options["vocab_size"]),
                                 **extra)
