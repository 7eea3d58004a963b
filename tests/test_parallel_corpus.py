"""Any parallel corpus for translation: dataset=anki (an Anki/manythings file, or data.pair found
locally or downloaded) and dataset=tsv (attnlab/data/parallel_corpus.py and
attnlab/tasks/translation.py).

The corpora are hand-made files of a few lines; downloads go to a local HTTP server (or a port
nothing listens on, for the offline message), never to the network.
"""

import collections
import functools
import http.server
import json
import logging
import math
import pathlib
import re
import socket
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest

from attnlab import config_utils
from attnlab.cli import train as train_cli
from attnlab.data import parallel_corpus
from attnlab.errors import ConfigError, DataError, DataFormatError, DatasetNotFoundError
from attnlab.tasks import translation

REPO = pathlib.Path(__file__).resolve().parents[1]
SEQ2SEQ = REPO / "configs" / "seq2seq.py"
ATTRIBUTION = "CC-BY 2.0 (France) Attribution: tatoeba.org #1 (a) & #2 (b)"
FRENCH = [("Go.", "Va !"), ("Hi.", "Salut !"), ("Run!", "Cours !"), ("Who?", "Qui ?"),
          ("Wow!", "Ça alors !"), ("I see.", "Je vois."), ("I won.", "J'ai gagné."),
          ("Help!", "À l'aide !"), ("Stop!", "Arrête !"), ("Thanks.", "Merci."),
          ("I ran.", "J'ai couru."), ("Go on.", "Continue.")]
CHINESE = [("Hi.", "你好。"), ("Run.", "你用跑的。"), ("Wait!", "等等！"),
           ("Hello!", "你好。"), ("I try.", "让我来。"), ("I won!", "我赢了。"),
           ("Oh no!", "不会吧。"), ("He ran.", "他跑了。"), ("Hop in.", "跳进来。"),
           ("I lost.", "我迷失了。"), ("I quit.", "我退出。"), ("I am sad.", "我很难过。")]
GERMAN = [("ich sehe", "I see"), ("er lief", "he ran"), ("wir gingen", "we went"),
          ("sie kam", "she came"), ("du weißt", "you know"), ("es regnet", "it rains"),
          ("ich kam", "I came"), ("er sah", "he saw"), ("wir sehen", "we see"),
          ("sie lief", "she ran"), ("du kamst", "you came"), ("es schneit", "it snows")]


def _write_anki(path: pathlib.Path, pairs) -> pathlib.Path:
  path.write_text("".join(f"{a}\t{b}\t{ATTRIBUTION}\n" for a, b in pairs), encoding="utf-8")
  return path


def _config(arg: str):
  return config_utils.load_config_file(f"{SEQ2SEQ}:{arg}")


def _reference_splits(pairs, direction="forward"):
  """80/10/10 of the pairs after numpy's permutation with seed 0 (as the module docstring says)."""
  n = len(pairs)
  order = np.random.default_rng(0).permutation(n)
  shuffled = [pairs[i] if direction == "forward" else pairs[i][::-1] for i in order]
  n_val = n_test = n // 10
  n_train = n - n_val - n_test
  return {"train": shuffled[:n_train], "validation": shuffled[n_train:n_train + n_val],
          "test": shuffled[n_train + n_val:]}


def _reference_words(text: str) -> list[str]:
  """Lower-cased words with the punctuation marks split off (the word tokenizer's split)."""
  return re.sub(r"([?.!,¿\"“”;:])", r" \1 ", text).lower().split()


@pytest.fixture()
def corpora(tmp_path):
  tsv = tmp_path / "deu_eng.tsv"
  tsv.write_text("".join(f"{a}\t{b}\n" for a, b in GERMAN), encoding="utf-8")
  return {"fra": _write_anki(tmp_path / "fra.txt", FRENCH),
          "cmn": _write_anki(tmp_path / "cmn.txt", CHINESE), "tsv": tsv}


# ------------------------------------------------------------------------------ reading


@pytest.mark.parametrize("name,direction", [("fra", "forward"), ("cmn", "reverse"),
                                            ("tsv", "forward"), ("tsv", "reverse")])
def test_splits_and_direction_match_the_file(corpora, name, direction):
  pairs = {"fra": FRENCH, "cmn": CHINESE, "tsv": GERMAN}[name]
  dataset = "tsv" if name == "tsv" else "anki"
  task = translation.TranslationTask(_config(
      f"dataset={dataset},data.path={corpora[name]},data.direction={direction},runlocal=True,"
      f"data.tokenizer=char"))
  expected = _reference_splits(pairs, direction)
  for split, rows in expected.items():
    assert [(ex["source"], ex["target"]) for ex in task.examples(split)] == rows, split
  assert len(expected["validation"]) == len(expected["test"]) == 1


def test_anki_zip_and_crlf_and_blank_lines(tmp_path):
  lines = [f"{a}\t{b}\t{ATTRIBUTION}" for a, b in FRENCH]
  lines.insert(3, "   ")  # a blank line, skipped
  archive = tmp_path / "fra-eng.zip"
  with zipfile.ZipFile(archive, "w") as zf:
    zf.writestr("_about.txt", "about the file")
    zf.writestr("fra.txt", ("\r\n".join(lines) + "\r\n").encode("utf-8"))
  data = _config(f"dataset=anki,data.path={archive}").data
  splits = parallel_corpus.load_splits(data)
  assert sorted(sum(splits.values(), [])) == sorted(FRENCH)


# ------------------------------------------------------------------------------ tokenizers


def test_word_source_char_target_for_chinese(corpora):
  task = translation.TranslationTask(_config(
      f"dataset=anki,data.path={corpora['cmn']},runlocal=True,data.target_tokenizer=char,"
      f"data.min_count=1"))
  train = _reference_splits(CHINESE)["train"]
  # Source: words of the training sentences; target: their characters, in code-point order.
  words = sorted({w for en, _ in train for w in _reference_words(en)})
  assert sorted(task.src_tok.tokens[7:]) == words
  assert task.tgt_tok.tokens[7:] == sorted({c for _, zh in train for c in zh})
  for en, zh in train:
    assert task.src_tok.split(task.prepare_text(en, "source")) == _reference_words(en)
    ids = task.encode_target(zh)
    assert ids[0] == task.tgt_tok.start_id and ids[-1] == task.tgt_tok.end_id
    assert [task.tgt_tok.id_to_token(i) for i in ids[1:-1]] == list(zh)
    assert task.tgt_tok.decode(ids) == zh
  # The char target is scored per character, white space ignored.
  assert task.bleu_tokenize(["我很难过。"]) == "none"
  assert task._bleu_tokens("我 很") == "我   很"


def test_word_tokens_of_chinese_get_a_warning(corpora, caplog):
  with caplog.at_level(logging.WARNING, logger="attnlab.tasks.translation"):
    task = translation.TranslationTask(_config(
        f"dataset=anki,data.path={corpora['cmn']},runlocal=True,data.min_count=1"))
  assert task.tokenizer_kind("target") == "word"
  [record] = [r for r in caplog.records if "without spaces" in r.getMessage()]
  assert "data.target_tokenizer=char" in record.getMessage()


def test_subword_tokenizers_round_trip_and_pick_the_bleu_tokenizer(corpora):
  task = translation.TranslationTask(_config(
      f"dataset=anki,data.path={corpora['cmn']},runlocal=True,data.source_tokenizer=word,"
      f"data.target_tokenizer=subword,data.tokenizer_size=29,data.min_count=1"))
  assert task.tgt_tok.kind == "subword" and len(task.tgt_tok) == 29
  for _, zh in _reference_splits(CHINESE)["train"]:
    pieces = task.tgt_tok.split(zh)
    assert "".join(pieces) == zh  # the pieces cover the text, nothing added
    assert task.tgt_tok.decode(task.encode_target(zh)) == zh
  assert task.bleu_tokenize([zh for _, zh in CHINESE]) == "zh"
  assert task.bleu_tokenize(["猫が好きです。"]) == "char"  # kana: Japanese
  assert task.bleu_tokenize([fr for _, fr in FRENCH]) == "13a"
  explicit = translation.TranslationTask(_config(
      f"dataset=anki,data.path={corpora['fra']},runlocal=True,data.tokenizer=char,"
      f"data.bleu_tokenize=char"))
  assert explicit.bleu_tokenize(["Je vois."]) == "char"


def _reference_bleu(hyps: list[list[str]], refs: list[list[str]]) -> float:
  """Corpus BLEU (Papineni et al. 2002) of tokenised sentences, one reference each, in percent."""
  matches, totals = [0] * 4, [0] * 4
  for hyp, ref in zip(hyps, refs):
    for n in range(1, 5):
      h = collections.Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
      r = collections.Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
      matches[n - 1] += sum(min(c, r[g]) for g, c in h.items())
      totals[n - 1] += max(len(hyp) - n + 1, 0)
  c, r = sum(map(len, hyps)), sum(map(len, refs))
  brevity = 1.0 if c >= r else math.exp(1 - r / c)
  return 100 * brevity * math.exp(sum(math.log(m / t) for m, t in zip(matches, totals)) / 4)


def test_chinese_bleu_counts_characters(corpora):
  """The auto tokenizer of a Chinese subword target (zh) scores character n-grams."""
  task = translation.TranslationTask(_config(
      f"dataset=anki,data.path={corpora['cmn']},runlocal=True,data.target_tokenizer=subword,"
      f"data.tokenizer_size=29,data.min_count=1"))
  refs = ["我们明天早上去北京看朋友", "他昨天晚上在家里看书"]
  hyps = ["我们明天去北京看朋友", "他昨天晚上在家看书了"]
  expected = _reference_bleu([list(h) for h in hyps], [list(r) for r in refs])
  assert 20 < expected < 90
  assert task._bleu(hyps, refs) == pytest.approx(expected, rel=1e-6)
  # Scored as one "word" per sentence (13a), the same output would get 0.
  assert task._bleu(hyps, refs, "13a") == 0.0


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("kind,text,message", [
    ("anki", "Go.\tVa !\nHi. Salut !\n", r"bad\.txt:2: expected 'English<TAB>Other"),
    ("anki", "Go.\tVa !\n\n\nHi.\t \tCC\n", r"bad\.txt:4: empty other-language side"),
    ("tsv", "a\tb\n\tc\n", r"bad\.txt:2: empty source side"),
    ("tsv", "a\tb\nc\td\te\n", r"bad\.txt:2: expected 'source<TAB>target', found 3 tab-separated"),
    ("tsv", "a\tb\nc\td\n", r"holds 2 sentence pairs; .* needs at least 10"),
    ("tsv", "\n \n", r"holds no sentence pairs"),
])
def test_malformed_files_name_file_and_line(tmp_path, kind, text, message):
  path = tmp_path / "bad.txt"
  path.write_text(text, encoding="utf-8")
  with pytest.raises(DataError, match=message) as info:
    parallel_corpus.load_splits(_config(f"dataset={kind},data.path={path}").data)
  assert "\n" not in str(info.value)


def test_config_and_file_errors(tmp_path, corpora, capsys):
  load = lambda arg: parallel_corpus.load_splits(_config(arg).data)
  with pytest.raises(DatasetNotFoundError, match=r"data.path=.*nope.txt does not exist"):
    load(f"dataset=tsv,data.path={tmp_path / 'nope.txt'}")
  with pytest.raises(DataError, match="dataset=anki needs data.path=FILE .* or data.pair=CODE"):
    load("dataset=anki")
  with pytest.raises(DataError, match="not both"):
    load(f"dataset=anki,data.path={corpora['fra']},data.pair=fra")
  with pytest.raises(DataError, match="did you mean data.pair=fra"):
    load("dataset=anki,data.pair=fr")
  with pytest.raises(DataError, match="three-letter codes such as fra"):
    load("dataset=anki,data.pair=fr3nch")
  with pytest.raises(ConfigError, match="data.direction.*forward, reverse"):
    translation.TranslationTask(_config(f"dataset=tsv,data.path={corpora['tsv']},"
                                        f"data.direction=en-mr"))
  with pytest.raises(ConfigError, match="data.target_tokenizer.*char, word, subword"):
    translation.TranslationTask(_config(f"dataset=tsv,data.path={corpora['tsv']},"
                                        f"data.target_tokenizer=chars"))
  with pytest.raises(ConfigError, match="data.bleu_tokenize.*13a, intl, zh, char"):
    translation.TranslationTask(_config(f"dataset=tsv,data.path={corpora['tsv']},"
                                        f"data.bleu_tokenize=flores200"))
  # The trainer: one line and exit status 2.
  bad = tmp_path / "bad.tsv"
  bad.write_text("a\tb\nno tab here\n", encoding="utf-8")
  rc = train_cli.main(["attnlab train", f"--config={SEQ2SEQ}:dataset=tsv,data.path={bad},"
                       f"runlocal=True", f"--workdir={tmp_path / 'run'}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and f"{bad}:2: expected 'source<TAB>target'" in err[0]


# ------------------------------------------------------------------------------ data.pair


@pytest.fixture()
def anki_server(tmp_path):
  """A local HTTP server holding fra-eng.zip (an Anki zip: fra.txt and _about.txt); yields the
  URL pattern of parallel_corpus.ANKI_URL for it."""
  root = tmp_path / "site"
  root.mkdir()
  with zipfile.ZipFile(root / "fra-eng.zip", "w") as zf:
    zf.writestr("_about.txt", "about the file")
    zf.writestr("fra.txt", "".join(f"{a}\t{b}\t{ATTRIBUTION}\n" for a, b in FRENCH))

  class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # pylint: disable=arguments-differ
      pass

  server = http.server.ThreadingHTTPServer(
      ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}/{{code}}-eng.zip"
  server.shutdown()
  server.server_close()


def test_pair_downloads_into_the_data_dir_once(tmp_path, anki_server, monkeypatch):
  monkeypatch.setattr(parallel_corpus, "ANKI_URL", anki_server)
  monkeypatch.delenv("ATTNLAB_DATA_DIR", raising=False)
  data = _config(f"dataset=anki,data.pair=FRA,data.data_dir={tmp_path / 'data'}").data
  assert parallel_corpus.load_splits(data) == _reference_splits(FRENCH)
  cached = tmp_path / "data" / "anki" / "fra-eng" / "fra.txt"
  assert cached.is_file()
  # The next call reads the cached file.
  fetch = parallel_corpus._fetch
  monkeypatch.setattr(parallel_corpus, "_fetch", lambda url, dest: pytest.fail("downloaded"))
  assert parallel_corpus.anki_file("fra", data_dir=tmp_path / "data") == cached
  # An unknown code: the site answers 404.
  monkeypatch.setattr(parallel_corpus, "_fetch", fetch)
  with pytest.raises(DataError, match=r"unknown Anki pair code data.pair=xyz: .*xyz-eng.zip does "
                                      r"not exist \(HTTP 404\)"):
    parallel_corpus.anki_file("xyz", data_dir=tmp_path / "data")


def test_pair_from_a_local_copy_of_the_shared_layout(tmp_path, monkeypatch):
  (tmp_path / "anki-fra-eng").mkdir()
  _write_anki(tmp_path / "anki-fra-eng" / "fra.txt", FRENCH)
  monkeypatch.setattr(parallel_corpus, "_fetch", lambda url, dest: pytest.fail("downloaded"))
  assert parallel_corpus.anki_file("fra", manual_dir=tmp_path) == \
      tmp_path / "anki-fra-eng" / "fra.txt"
  monkeypatch.setenv("ATTNLAB_DATA_DIR", str(tmp_path))
  assert parallel_corpus.anki_file("fra", data_dir=tmp_path / "d") == \
      tmp_path / "anki-fra-eng" / "fra.txt"
  with pytest.raises(DatasetNotFoundError, match=r"data.manual_dir=.* has neither spa.txt"):
    parallel_corpus.anki_file("spa", manual_dir=tmp_path)


def test_offline_pair_is_one_line(tmp_path, monkeypatch):
  with socket.socket() as s:  # a port nothing listens on once this socket is closed
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  monkeypatch.setattr(parallel_corpus, "ANKI_URL", f"http://127.0.0.1:{port}/{{code}}-eng.zip")
  monkeypatch.delenv("ATTNLAB_DATA_DIR", raising=False)
  with pytest.raises(DatasetNotFoundError) as info:
    parallel_corpus.anki_file("spa", data_dir=tmp_path)
  message = str(info.value)
  assert "\n" not in message
  assert f"cannot reach 127.0.0.1:{port}" in message and "offline?" in message
  assert "give data.path=FILE" in message


# ------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_train_writes_bleu_and_translate_needs_no_data(tmp_path):
  """A few steps on a Chinese-like Anki file (word source, character target), the file deleted,
  then `python -m attnlab.cli translate` on the run directory in a fresh process."""
  corpus = _write_anki(tmp_path / "cmn.txt", CHINESE)
  workdir = tmp_path / "run"
  arg = (f"dataset=anki,data.path={corpus},data.target_tokenizer=char,data.min_count=1,"
         f"runlocal=True,num_train_steps=3,eval_every=0,data.buckets=()")
  assert train_cli.main(["attnlab train", f"--config={SEQ2SEQ}:{arg}",
                         f"--workdir={workdir}"]) == 0
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  [final] = [r for r in records if r["split"] == "eval"]
  assert 0 <= final["bleu"] <= 100 and np.isfinite(final["loss"])
  assert (workdir / "attention_0.png").is_file()
  assert {p.name for p in (workdir / "assets").iterdir()} >= {"source.json", "target.json"}
  corpus.unlink()
  png = tmp_path / "hi.png"
  out = subprocess.run([sys.executable, "-m", "attnlab.cli", "translate", f"--workdir={workdir}",
                        f"--output={png}", "I won!"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr
  [line] = out.stdout.strip().splitlines() or [""]
  # The output is written in the target's characters (or is empty after a few steps).
  assert set(line) <= set("".join(zh for _, zh in CHINESE)), line
  assert png.is_file() and png.stat().st_size > 0
