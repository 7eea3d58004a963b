"""Synthetic tasks: reproducible by seed, requested lengths, correct targets."""

import datetime
import re

import pytest

from attnlab import data
from attnlab.data import synthetic

_MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august",
           "september", "october", "november", "december"]


def _parse_date(text: str) -> datetime.date:
  """Independent reader of the human-readable forms (day first, yy -> 1950..2049)."""
  t = text.lower().replace(",", " ").replace(" of ", " ")
  t = re.sub(r"(\d+)(st|nd|rd|th)\b", r"\1", t)
  words = [w for w in re.split(r"[\s/.]+", t) if w and w not in (
      "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")]
  month = next((i + 1 for w in words for i, m in enumerate(_MONTHS) if w in (m, m[:3])), None)
  numbers = [int(w) for w in words if w.isdigit()]
  if month is None:
    day, month, year = numbers
  else:
    day, year = numbers
  if year < 100:
    year += 1900 if year >= 50 else 2000
  return datetime.date(year, month, day)


@pytest.mark.parametrize("name", ["dates", "reverse", "copy", "addition", "induction"])
def test_reproducible_by_seed(name):
  a = data.get_dataset(name, "train", num_examples=50, seed=7)
  b = data.get_dataset(name, "train", num_examples=80, seed=7)  # Example i ignores num_examples.
  c = data.get_dataset(name, "train", num_examples=50, seed=8)
  v = data.get_dataset(name, "validation", num_examples=50, seed=7)
  assert len(a) == 50 and list(a) == b[:50]
  assert list(a) != list(c) and list(a) != list(v)
  assert a[-1] == a[49] and a[3:6] == [a[3], a[4], a[5]]


def test_dates_targets_match_sources():
  ds = data.get_dataset("dates", "train", num_examples=400, seed=0)
  formats_seen = set()
  for ex in ds:
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", ex["target"])
    assert _parse_date(ex["source"]).isoformat() == ex["target"], ex
    weekday = datetime.date.fromisoformat(ex["target"]).strftime("%A").lower()
    named = re.findall(r"[a-z]+day", ex["source"].lower())
    assert named in ([], [weekday]), ex  # a weekday, where written, is the date's
    formats_seen.add(re.sub(r"\d", "9", ex["source"].split()[0] if " " in ex["source"]
                            else ex["source"]))
  years = [int(ex["target"][:4]) for ex in ds]
  assert 1950 <= min(years) and max(years) <= 2049
  assert len(formats_seen) > 10  # Many formats, not one.


def test_dates_format_subset():
  ds = data.get_dataset("dates", "test", num_examples=30, formats=["dd/mm/yy"])
  assert all(re.fullmatch(r"\d\d/\d\d/\d\d", ex["source"]) for ex in ds)
  with pytest.raises(data.DataError, match="valid: weekday_d_month_yyyy"):
    data.get_dataset("dates", "train", formats=["yyyy"])


@pytest.mark.parametrize("min_len, max_len", [(1, 1), (3, 9), (40, 50)])
def test_reverse_and_copy_lengths(min_len, max_len):
  rev = data.get_dataset("reverse", "train", num_examples=300, min_len=min_len, max_len=max_len,
                         vocab_size=5)
  cp = data.get_dataset("copy", "train", num_examples=300, min_len=min_len, max_len=max_len,
                        vocab_size=5)
  lengths = [len(ex["source"]) for ex in rev]
  assert min(lengths) == min_len and max(lengths) == max_len
  assert all(ex["target"] == ex["source"][::-1] for ex in rev)
  assert all(ex["target"] == ex["source"] for ex in cp)
  assert set("".join(ex["source"] for ex in rev)) <= set("abcde")


def test_reverse_with_word_vocab():
  ds = data.get_dataset("reverse", "validation", num_examples=50, min_len=2, max_len=4,
                        vocab=["red", "green", "blue"])
  for ex in ds:
    tokens = ex["source"].split(" ")
    assert 2 <= len(tokens) <= 4 and set(tokens) <= {"red", "green", "blue"}
    assert ex["target"].split(" ") == tokens[::-1]


def test_addition():
  ds = data.get_dataset("addition", "train", num_examples=300, min_digits=2, max_digits=5)
  for ex in ds:
    m = re.fullmatch(r"([1-9]\d{1,4})\+([1-9]\d{1,4})=", ex["source"])
    assert m, ex
    assert int(ex["target"]) == int(m[1]) + int(m[2])
    assert ex["text"] == ex["source"] + ex["target"]
  assert {len(re.match(r"\d+", ex["source"])[0]) for ex in ds} == {2, 3, 4, 5}


def test_induction_copies_a_segment_to_a_random_later_offset():
  ds = data.get_dataset("induction", "train", num_examples=300, seed=1, length=40,
                        vocab_size=50, min_span=3, max_span=8)
  offsets, spans = set(), set()
  for ex in ds:
    ids, src, dst, span = ex["ids"], ex["src"], ex["dst"], ex["span"]
    assert len(ids) == 40 and all(0 <= i < 50 for i in ids)
    assert 3 <= span <= 8 and src + span <= dst and dst + span <= 40
    assert ids[dst:dst + span] == ids[src:src + span]  # the copy is where it says
    offsets.add(dst - src)
    spans.add(span)
  assert len(offsets) > 15 and spans == set(range(3, 9))  # no fixed offset, every span
  with pytest.raises(data.DataError, match="length=10 must be >= 2 \\* max_span"):
    data.get_dataset("induction", "train", length=10, max_span=8)
  with pytest.raises(data.DataError, match="min_span <= max_span"):
    data.get_dataset("induction", "train", min_span=1)


def test_bad_options():
  with pytest.raises(data.DataError, match="valid options: num_examples, seed, min_len"):
    data.get_dataset("reverse", "train", length=5)
  with pytest.raises(data.DataError, match="min_len <= max_len"):
    data.get_dataset("copy", "train", min_len=5, max_len=2)
  with pytest.raises(data.DataError, match="empty split"):
    data.get_dataset("addition", "train", num_examples=0)
  with pytest.raises(data.DataError, match="valid splits: train, validation, test"):
    data.get_dataset("dates", "dev")
  with pytest.raises(data.DataError, match="vocab_size must be in 1..62"):
    synthetic.reverse(vocab_size=100)
