"""TFDS builders: the three real datasets from ../shared/data, bad raw files, downloads, CLI."""

import collections
import dataclasses
import functools
import http.server
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
import tensorflow_datasets as tfds

from attnlab import cli as attnlab_cli
from attnlab import data
from attnlab.data import builders
from attnlab.data.builders import anki_mar_eng, sst2, tiny_shakespeare


@pytest.fixture(scope="module", autouse=True)
def _quiet_tfds():
  tfds.disable_progress_bar()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
  # Tests decide where raw files come from; a developer's environment must not leak in.
  monkeypatch.delenv(builders.DATA_DIR_ENV, raising=False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, shared_data):
  """One TFDS data dir with the three datasets prepared from ../shared/data (done once)."""
  root = tmp_path_factory.mktemp("tfds")
  builders.prepare("tiny_shakespeare", data_dir=root, manual_dir=shared_data / "tinyshakespeare",
                   download=False)
  builders.prepare("anki_mar_eng", data_dir=root, manual_dir=shared_data, download=False)
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(builders.DATA_DIR_ENV, str(shared_data))
    builders.prepare("sst2", data_dir=root, download=False)  # Found via $ATTNLAB_DATA_DIR.
  return root


def _raw_lines(path: pathlib.Path) -> list[str]:
  """The file's non-empty lines without line ends (independent of the code under test)."""
  with open(path, encoding="utf-8", newline="") as f:
    return [line.rstrip("\r\n") for line in f if line.strip()]


# The three datasets built from ../shared/data.

@pytest.mark.slow
def test_anki_split_sizes_and_content(data_dir, shared_data):
  raw = _raw_lines(shared_data / "anki-mar-eng" / "mar.txt")
  pairs = [tuple(line.split("\t")[:2]) for line in raw]
  assert len(pairs) == 33_725
  n_val = n_test = len(pairs) // 10
  splits = {s: data.get_dataset("anki_mar_eng", s, data_dir=data_dir, download=False)
            for s in ("train", "validation", "test")}
  assert {s: len(v) for s, v in splits.items()} == {
      "train": len(pairs) - n_val - n_test, "validation": n_val, "test": n_test}
  seen = collections.Counter((ex["source"], ex["target"]) for v in splits.values() for ex in v)
  assert seen == collections.Counter(pairs)
  # Shuffled with seed 0 before cutting (the file is sorted by length).
  order = np.random.default_rng(0).permutation(len(pairs))
  assert splits["train"][0] == dict(zip(("source", "target"), pairs[order[0]]))
  assert splits["test"][-1] == dict(zip(("source", "target"), pairs[order[-1]]))
  reverse = data.get_dataset("anki_mar_eng", "test", data_dir=data_dir, direction="mr-en")
  forward = splits["test"][5]
  assert reverse[5] == {"source": forward["target"], "target": forward["source"]}


@pytest.mark.slow
def test_sst2_split_sizes_and_rows(data_dir, shared_data):
  train = data.get_dataset("sst2", "train", data_dir=data_dir, download=False)
  val = data.get_dataset("sst2", "validation", data_dir=data_dir, download=False)
  raw_train = _raw_lines(shared_data / "sst2" / "train.tsv")[1:]
  raw_dev = _raw_lines(shared_data / "sst2" / "dev.tsv")[1:]
  assert (len(train), len(val)) == (len(raw_train), len(raw_dev)) == (67_349, 872)
  for i in (0, 1, 33_333, len(raw_train) - 1):
    label, sentence = raw_train[i].split("\t")
    assert train[i] == {"sentence": sentence, "label": int(label), "idx": i}
  label, sentence = raw_dev[-1].split("\t")
  assert val[-1] == {"sentence": sentence, "label": int(label), "idx": len(raw_dev) - 1}
  # train.tsv has CRLF line ends: none may leak into the text.
  assert not any("\r" in ex["sentence"] for ex in train[:2000])
  labels = np.array([int(line.split("\t")[0]) for line in raw_train])
  assert sum(ex["label"] for ex in train) == labels.sum()


def test_tiny_shakespeare_nanogpt_split(data_dir, shared_data):
  raw = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
  cut = int(len(raw) * 0.9)
  train = data.get_dataset("tiny_shakespeare", "train", data_dir=data_dir, download=False)
  val = data.get_dataset("tiny_shakespeare", "validation", data_dir=data_dir, download=False)
  assert len(train) == len(val) == 1
  assert train[0]["text"] == raw[:cut] and val[0]["text"] == raw[cut:]
  assert len(train[0]["text"]) == 1_003_854


def test_shakespeare_documents(data_dir):
  docs = data.shakespeare_documents("train", data_dir=data_dir, download=False)
  assert docs[0] == ["Before we proceed any further, hear me speak."]
  assert docs[1] == ["Speak, speak."]
  assert all(isinstance(s, str) and s for d in docs for s in d)
  assert sum(len(d) >= 2 for d in docs) > 1000


def test_split_documents_small():
  text = "KING:\nGo now. Stay!\nWhy?\n\nQUEEN:\nNo.\n\n\nFOOL:\n"
  assert tiny_shakespeare.split_documents(text) == [["Go now.", "Stay!", "Why?"], ["No."]]


def test_prepared_once_and_reused(data_dir, shared_data):
  before = sorted(p.stat().st_mtime_ns for p in (data_dir / "sst2").rglob("*.array_record*"))
  builders.prepare("sst2", data_dir=data_dir, download=False)  # No raw files needed now.
  after = sorted(p.stat().st_mtime_ns for p in (data_dir / "sst2").rglob("*.array_record*"))
  assert before == after and len(before) == 2
  info = json.loads(next((data_dir / "sst2").rglob("metadata.json")).read_text())
  assert info["origin"].startswith(builders.DATA_DIR_ENV)


def test_preparing_leaves_no_temporary_directory(monkeypatch, tmp_path, shared_data):
  # TFDS's lookup of pre-computed metadata made an empty temporary directory per builder of an
  # unprepared data dir and never removed it.
  temp = tmp_path / "temp"
  temp.mkdir()
  monkeypatch.setattr("tempfile.tempdir", str(temp))
  builders.prepare("tiny_shakespeare", data_dir=tmp_path / "tfds",
                   manual_dir=shared_data / "tinyshakespeare", download=False)
  assert list((tmp_path / "tfds").rglob("*.array_record*"))
  assert not list(temp.iterdir())


def test_tfds_data_dir_env(monkeypatch, tmp_path, shared_data):
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
  ds = data.get_dataset("tiny_shakespeare", "validation", manual_dir=shared_data, download=False)
  assert len(ds[0]["text"]) == 111_540
  assert list(tmp_path.glob("tiny_shakespeare/nanogpt/1.0.0/*.array_record*"))


def test_random_access_api(data_dir):
  ds = data.get_dataset("sst2", "validation", data_dir=data_dir)
  assert ds[-1] == ds[len(ds) - 1]
  assert ds[2:5] == [ds[2], ds[3], ds[4]]
  assert sum(1 for _ in ds) == len(ds)
  with pytest.raises(IndexError):
    ds[len(ds)]
  sliced = data.get_dataset("sst2", "train[:10]", data_dir=data_dir)
  assert len(sliced) == 10 and sliced[3] == data.get_dataset("sst2", "train", data_dir=data_dir)[3]


def test_no_tensorflow_import(tmp_path, shared_data):
  """Prepare and read through the console entry point in a fresh process: TF never imported.

  (TFDS and etils only probe whether TensorFlow is installed, with importlib.util.find_spec.)
  """
  code = (
      "import sys\n"
      "from attnlab import cli\n"
      f"rc = cli.main(['attnlab', 'data', 'show', 'tiny_shakespeare', '--data_dir={tmp_path}', "
      f"'--manual_dir={shared_data}', '--nodownload', '--split=validation'])\n"
      "assert not [m for m in sys.modules if m.split('.')[0] == 'tensorflow'], 'TF imported'\n"
      "sys.exit(rc)\n")
  env = dict(os.environ)
  env.pop(builders.DATA_DIR_ENV, None)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "splits: train=1 validation=1" in proc.stdout


# Registry errors.

def test_unknown_name_split_option(data_dir):
  with pytest.raises(data.DataError, match="valid names: anki_mar_eng, tiny_shakespeare, sst2, "
                                           "listops, imdb_bytes, pathfinder, da"):
    data.get_dataset("imdb", "train")
  with pytest.raises(data.DataError, match="valid splits: train, validation "):
    data.get_dataset("sst2", "test", data_dir=data_dir)
  with pytest.raises(data.DataError, match="valid options: direction"):
    data.get_dataset("anki_mar_eng", "train", data_dir=data_dir, reverse=True)
  with pytest.raises(data.DataError, match="valid: en-mr, mr-en"):
    data.get_dataset("anki_mar_eng", "train", data_dir=data_dir, direction="en-fr")


# Bad raw files: each case in its own small folder.

def _prepare_bad(tmp_path, name, files: dict[str, bytes]):
  manual = tmp_path / "raw"
  manual.mkdir(parents=True)
  for file, content in files.items():
    (manual / file).write_bytes(content)
  return builders.prepare(name, data_dir=tmp_path / "tfds", manual_dir=manual, download=False)


def test_missing_file_names_path_and_both_ways(tmp_path):
  with pytest.raises(data.DatasetNotFoundError) as e:
    data.get_dataset("sst2", "train", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "nope")
  msg = str(e.value)
  assert str(tmp_path / "nope") in msg and "train.tsv + dev.tsv" in msg
  assert "https://dl.fbaipublicfiles.com/glue/data/SST-2.zip" in msg and "--manual_dir" in msg
  assert "ATTNLAB_DATA_DIR" in msg and "\n" not in msg
  with pytest.raises(FileNotFoundError, match=r"download disabled.*input\.txt"):
    data.get_dataset("tiny_shakespeare", "train", data_dir=tmp_path / "tfds", download=False)
  assert not list((tmp_path / "tfds").rglob("*.array_record*"))


def test_env_dir_without_the_file(tmp_path, monkeypatch):
  monkeypatch.setenv(builders.DATA_DIR_ENV, str(tmp_path))
  with pytest.raises(data.DatasetNotFoundError, match=f"{tmp_path / 'anki-mar-eng'} lacks mar.txt"):
    data.get_dataset("anki_mar_eng", "train", data_dir=tmp_path / "tfds", download=False)


def test_line_without_tab(tmp_path):
  lines = "".join(f"Hi {i}.\tनमस्कार {i}.\n" for i in range(20)) + "no tab here\n"
  with pytest.raises(data.DataFormatError, match=r"mar\.txt:21: expected 'english<TAB>marathi'"):
    _prepare_bad(tmp_path, "anki_mar_eng", {"mar.txt": lines.encode()})


def test_sst2_bad_rows(tmp_path):
  dev = b"label\tsentence\n1\tfine .\n"
  with pytest.raises(data.DataFormatError, match=r"train\.tsv:3: expected 2 tab-separated fields"):
    _prepare_bad(tmp_path, "sst2", {"train.tsv": b"label\tsentence\n0\tbad .\nno tab\n",
                                    "dev.tsv": dev})
  with pytest.raises(data.DataFormatError, match=r"dev\.tsv:2: label must be 0 or 1"):
    _prepare_bad(tmp_path / "b", "sst2", {"train.tsv": b"label\tsentence\n0\tbad .\n",
                                          "dev.tsv": b"label\tsentence\n7\tfine .\n"})
  with pytest.raises(data.DataFormatError, match=r"train\.tsv:1: expected a header"):
    _prepare_bad(tmp_path / "c", "sst2", {"train.tsv": b"0\tbad .\n", "dev.tsv": dev})


def test_crlf_glue_column_order_and_blank_lines(tmp_path):
  train = b"sentence\tlabel\r\nbad .\t0\r\n\r\ngood .\t1\r\n  \r\n"
  builder = _prepare_bad(tmp_path, "sst2", {"train.tsv": train,
                                            "dev.tsv": b"\nlabel\tcontent\n1\tfine .\n"})
  assert builder.info.splits["train"].num_examples == 2
  assert builder.info.metadata["blank_lines_skipped"] == {"train.tsv": 2, "dev.tsv": 1}
  rows = data.get_dataset("sst2", "train", data_dir=tmp_path / "tfds")
  assert list(rows) == [{"sentence": "bad .", "label": 0, "idx": 0},
                        {"sentence": "good .", "label": 1, "idx": 1}]


def test_crlf_text_and_blank_lines_counted_for_anki(tmp_path):
  lines = b"".join(f"Hi {i}.\tनमस्कार {i}.\r\n".encode() for i in range(12))
  lines += b"\r\n\n"
  builder = _prepare_bad(tmp_path, "anki_mar_eng", {"mar.txt": lines})
  assert builder.info.metadata["blank_lines_skipped"] == {"mar.txt": 2}
  ex = data.get_dataset("anki_mar_eng", "train", data_dir=tmp_path / "tfds")
  assert len(ex) == 10 and not any("\r" in e["target"] for e in ex)


def test_invalid_utf8_reports_line(tmp_path):
  with pytest.raises(data.DataFormatError, match=r"mar\.txt:3: invalid UTF-8"):
    _prepare_bad(tmp_path, "anki_mar_eng", {"mar.txt": b"a\tb\nc\td\ne\t\xff\xfe\n"})
  with pytest.raises(data.DataFormatError, match=r"input\.txt:2: invalid UTF-8"):
    _prepare_bad(tmp_path / "b", "tiny_shakespeare", {"input.txt": b"ok\nbad \xc3(\n"})


def test_empty_split_is_an_error(tmp_path):
  with pytest.raises(data.DataError, match=r"split 'validation' is empty"):
    _prepare_bad(tmp_path, "sst2", {"train.tsv": b"label\tsentence\n0\tbad .\n",
                                    "dev.tsv": b"label\tsentence\r\n\r\n"})
  with pytest.raises(data.DataError, match=r"split 'validation' is empty"):
    _prepare_bad(tmp_path / "b", "anki_mar_eng", {"mar.txt": b"a\tb\nc\td\n"})  # 2 pairs: 0 val
  assert not list(tmp_path.rglob("*.array_record*"))


# The download path, against a local HTTP server (no network needed).

@pytest.fixture()
def http_root(tmp_path):
  root = tmp_path / "www"
  root.mkdir()
  handler = functools.partial(_QuietHandler, directory=str(root))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                            daemon=True)
  thread.start()
  yield root, f"http://127.0.0.1:{server.server_address[1]}"
  server.shutdown()
  server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):

  def log_message(self, *args):
    pass


def test_download_verifies_recorded_checksum(http_root, tmp_path, monkeypatch, shared_data):
  root, url = http_root
  (root / "input.txt").write_bytes((shared_data / "tinyshakespeare" / "input.txt").read_bytes())
  cls = tiny_shakespeare.TinyShakespeare
  monkeypatch.setattr(cls, "SOURCE", dataclasses.replace(cls.SOURCE, url=f"{url}/input.txt"))
  ds = data.get_dataset("tiny_shakespeare", "validation", data_dir=tmp_path / "ok")
  assert len(ds[0]["text"]) == 111_540
  monkeypatch.setattr(cls, "SOURCE", dataclasses.replace(cls.SOURCE, sha256="0" * 64))
  with pytest.raises(data.DataError, match="does not match the recorded size/sha256"):
    data.get_dataset("tiny_shakespeare", "train", data_dir=tmp_path / "bad")


def test_download_zip_with_attribution_column(http_root, tmp_path, monkeypatch):
  root, url = http_root
  with zipfile.ZipFile(root / "mar-eng.zip", "w") as zf:
    zf.writestr("mar.txt", "".join(f"Go {i}.\tजा {i}.\tCC-BY 2.0 (France) #{i}\n"
                                   for i in range(30)))
    zf.writestr("_about.txt", "about")
  cls = anki_mar_eng.AnkiMarEng
  monkeypatch.setattr(cls, "SOURCE", dataclasses.replace(cls.SOURCE, url=f"{url}/mar-eng.zip"))
  splits = {s: data.get_dataset("anki_mar_eng", s, data_dir=tmp_path / "tfds")
            for s in ("train", "validation", "test")}
  assert [len(v) for v in splits.values()] == [24, 3, 3]
  assert all(ex["target"].startswith("जा ") and "CC-BY" not in ex["target"]
             for v in splits.values() for ex in v)


def test_download_failure_names_both_ways(http_root, tmp_path, monkeypatch):
  _, url = http_root
  cls = sst2.Sst2
  monkeypatch.setattr(cls, "SOURCE", dataclasses.replace(cls.SOURCE, url=f"{url}/SST-2.zip"))
  with pytest.raises(data.DatasetNotFoundError, match=r"download failed.*404.*--manual_dir"):
    data.get_dataset("sst2", "train", data_dir=tmp_path / "tfds")


def test_unreachable_host_fails_at_once(tmp_path, monkeypatch):
  # A port nobody listens on (bound, then closed): the builder says so without TFDS's retries.
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
  cls = tiny_shakespeare.TinyShakespeare
  monkeypatch.delenv("ATTNLAB_DATA_DIR", raising=False)
  monkeypatch.setattr(cls, "SOURCE",
                      dataclasses.replace(cls.SOURCE, url=f"http://127.0.0.1:{port}/input.txt"))
  # "cannot reach" comes from the connect check, before TFDS's downloader ("download failed").
  with pytest.raises(data.DatasetNotFoundError,
                     match=rf"cannot reach 127.0.0.1:{port} to download.*--manual_dir"):
    data.get_dataset("tiny_shakespeare", "train", data_dir=tmp_path / "tfds")


# The `attnlab data` command.

def test_cli_prepare_and_show(tmp_path, shared_data, capsys):
  rc = attnlab_cli.main(["attnlab", "data", "prepare", "anki_mar_eng", f"--data_dir={tmp_path}",
                         f"--manual_dir={shared_data / 'anki-mar-eng'}", "--nodownload"])
  out = capsys.readouterr().out
  assert rc == 0
  assert "splits: train=26,981 validation=3,372 test=3,372" in out
  assert out.count("train[") == 3
  rc = attnlab_cli.main(["attnlab", "data", "show", "anki_mar_eng", f"--data_dir={tmp_path}",
                         "--split=test", "--examples=2", "--nodownload"])
  out = capsys.readouterr().out
  assert rc == 0 and out.count("test[") == 2
  rc = attnlab_cli.main(["attnlab", "data", "show", "addition", "--examples=1", "--seed=3"])
  out = capsys.readouterr().out
  assert rc == 0 and "train[0]: {'source': '" in out and "splits: train=1,000" in out


@pytest.mark.parametrize("argv, status, needle", [
    (["show", "imdb"], 2, "valid names: anki_mar_eng"),
    (["prepare", "sst2", "--manual_dir=/nonexistent", "--nodownload"], 2, "/nonexistent"),
    (["show", "sst2", "--split=test"], 2, "valid splits: train, validation"),
    (["prepare"], 2, "required: name"),
    (["frobnicate"], 2, "invalid choice"),
    (["show", "sst2", "--examples=-1"], 2, "attnlab data: error: --examples must be >= 0, got -1"),
])
def test_cli_bad_input_one_line(argv, status, needle, capsys, tmp_path):
  rc = attnlab_cli.main(["attnlab", "data", *argv, *([f"--data_dir={tmp_path}"]
                                                     if len(argv) > 1 else [])])
  err = capsys.readouterr().err.strip()
  assert rc == status
  assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
