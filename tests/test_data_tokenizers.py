"""Tokenizers: special ids, round trips, decode rules, save/load, subword reuse on resume."""

import json

import numpy as np
import pytest

from attnlab.data import tokenizers as tok
from attnlab.errors import DataError

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\n"
        "Resolved. resolved.\n\nFirst Citizen:\nFirst, you know Caius Marcius is chief enemy to "
        "the people.\n")
SPECIALS = ["<pad>", "<start>", "<end>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def shakespeare(shared_data):
  text = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  return text[:40_000], text[-3_000:]


@pytest.fixture(scope="module")
def subword(tmp_path_factory, shakespeare):
  return tok.SubwordTokenizer.train([shakespeare[0]], 300, tmp_path_factory.mktemp("spm"))


def test_special_ids_fixed():
  char = tok.CharTokenizer.train([TEXT])
  word = tok.WordTokenizer.train([TEXT])
  for v in (char, word):
    assert v.tokens[:7] == SPECIALS
    ids = (v.pad_id, v.start_id, v.end_id, v.unk_id, v.cls_id, v.sep_id, v.mask_id)
    assert ids == tuple(range(7))


def test_special_ids_subword(subword):
  assert subword.tokens[:7] == SPECIALS and len(subword) == 300
  assert subword.pad_id == 0


def test_char_round_trip_and_vocab():
  v = tok.CharTokenizer.train([TEXT])
  assert v.tokens[7:] == sorted(set(TEXT))
  ids = v.encode(TEXT)
  assert len(ids) == len(TEXT) and v.decode(ids) == TEXT
  assert [v.tokens[i] for i in ids[:5]] == list("First")


def test_char_unknown_and_decode_rules():
  v = tok.CharTokenizer.train(["abc"])
  assert v.encode("abz") == [7, 8, v.unk_id]
  ids = v.encode("ab", add_start=True, add_end=True)
  assert ids == [v.start_id, 7, 8, v.end_id]
  assert v.decode(ids + [9, 9, v.pad_id]) == "ab"  # Stops at <end>.
  assert v.decode(ids + [9], stop_at_end=False) == "abc"
  assert v.decode([v.cls_id, 7, v.sep_id, 8, v.pad_id, v.pad_id]) == "ab"
  assert v.decode([v.cls_id, 7, v.mask_id, v.unk_id], skip_special=False) == "[CLS]a[MASK]<unk>"
  assert v.decode(np.array([[7, 8], [9, 0]], dtype=np.int32)) == "abc"
  with pytest.raises(DataError, match="outside this vocabulary of 10 tokens"):
    v.decode([10])


def test_word_options():
  v = tok.WordTokenizer.train([TEXT], min_count=2)
  words = v.split("Speak, speak!")
  assert words == ["speak", ",", "speak", "!"]
  counts = {}
  for w in v.split(TEXT):
    counts[w] = counts.get(w, 0) + 1
  assert set(v.tokens[7:]) == {w for w, c in counts.items() if c >= 2}
  assert v.tokens[7] == max(counts, key=lambda w: (counts[w], -ord(w[0])))  # Most frequent first.
  assert v.encode("hear famish")[1] == v.unk_id  # Seen once: below min_count.
  assert v.decode(v.encode("first , you speak .")) == "first , you speak ."
  raw = tok.WordTokenizer.train([TEXT], lower=False, split_punct=False, max_size=12)
  assert raw.split("Speak, speak.") == ["Speak,", "speak."] and len(raw) == 12


def test_word_split_keeps_combining_marks():
  """Vowel signs and accents stay inside their words; punctuation after them still splits off."""
  v = tok.WordTokenizer.train(["मी घरी जातो आहे."])
  assert v.split("मी घरी जातो आहे.") == ["मी", "घरी", "जातो", "आहे", "."]
  assert sorted(v.tokens[7:]) == sorted(["मी", "घरी", "जातो", "आहे", "."])
  assert v.split("Cafe\u0301, nai\u0308ve!") == ["cafe\u0301", ",", "nai\u0308ve", "!"]
  assert v.decode(v.encode("घरी जातो .")) == "घरी जातो ."


def test_subword_round_trip_and_determinism(subword, shakespeare, tmp_path):
  train_text, held_out = shakespeare
  seen = set(train_text)
  held_out = "".join(c for c in held_out if c in seen)
  for text in (train_text[:5000], held_out, "  two  spaces\nand lines\n\n"):
    ids = subword.encode(text)
    assert subword.decode(ids) == text
    assert subword.unk_id not in ids
  assert len(subword.encode(held_out)) < 0.75 * len(held_out)  # Real subwords, not characters.
  again = tok.SubwordTokenizer.train([train_text], 300, tmp_path)
  assert again.tokens == subword.tokens
  assert (tmp_path / tok.SubwordTokenizer.MODEL_FILE).stat().st_size > 0


def test_subword_decode_rules(subword):
  ids = subword.encode("hear me speak")
  text = subword.decode([subword.cls_id] + ids + [subword.sep_id, subword.end_id, 50],
                        skip_special=False)
  assert text == "[CLS]hear me speak[SEP]"
  assert subword.decode(ids[:1] + [subword.mask_id] + ids[1:]) == "hear me speak"
  pieces = [subword.id_to_token(i) for i in ids]
  assert "".join(pieces).replace("\u2581", " ") == "hear me speak"
  k = pieces.index("\u2581me")
  assert subword.decode(ids[:k] + [subword.unk_id] + ids[k:]) == "hear<unk> me speak"


@pytest.mark.parametrize("kind", ["char", "word", "subword"])
def test_save_load(kind, tmp_path, subword):
  v = subword if kind == "subword" else tok.train_tokenizer(kind, [TEXT])
  v.save(tmp_path / "tok.json")
  back = tok.load_tokenizer(tmp_path / "tok.json")
  assert type(back) is type(v) and back.tokens == v.tokens and back.options == v.options
  assert back.encode(TEXT) == v.encode(TEXT) and len(back) == len(v)
  assert tok.Vocab.load(tmp_path / "tok.json").tokens == v.tokens


def test_load_or_train_reuses_saved(tmp_path):
  path = tmp_path / "workdir" / "tokenizer.json"
  first = tok.load_or_train_tokenizer(path, "subword", [TEXT * 3], vocab_size=60)
  assert path.is_file() and (path.parent / "subword.model").is_file()

  def must_not_read():
    raise AssertionError("a resumed run must not retrain")

  again = tok.load_or_train_tokenizer(path, "subword", must_not_read, vocab_size=60)
  assert again.tokens == first.tokens
  with pytest.raises(DataError, match="holds a subword tokenizer but a char one"):
    tok.load_or_train_tokenizer(path, "char", must_not_read)


def test_errors(tmp_path):
  with pytest.raises(DataError, match="valid kinds: char, word, subword"):
    tok.train_tokenizer("bpe", [TEXT])
  with pytest.raises(DataError, match="not found"):
    tok.load_tokenizer(tmp_path / "missing.json")
  (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
  with pytest.raises(DataError, match="not a saved attnlab tokenizer"):
    tok.load_tokenizer(tmp_path / "bad.json")
  with pytest.raises(DataError, match="smaller vocab_size"):
    tok.SubwordTokenizer.train(["tiny text"], 5000, tmp_path)
  with pytest.raises(DataError, match="no texts"):
    tok.CharTokenizer.train([])
  with pytest.raises(DataError, match="expects a str"):
    tok.CharTokenizer.train(["ab"]).encode(["a", "b"])
