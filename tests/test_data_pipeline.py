"""Batching: documented shapes and dtypes, padding, buckets, length limits, resumable order."""

import json

import numpy as np
import pytest

from attnlab.data import pipeline
from attnlab.errors import DataError


def _examples(n=37, seed=0, max_len=12):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    src = rng.integers(7, 50, size=rng.integers(1, max_len + 1)).tolist()
    tgt = rng.integers(7, 50, size=rng.integers(2, max_len + 1)).tolist()
    out.append({"source": src, "target": tgt, "label": i % 2, "id": i, "ref": f"r{i}"})
  return out


def _epoch(batcher, num_batches):
  return [next(batcher) for _ in range(num_batches)]


def test_shapes_dtypes_and_padding():
  exs = _examples()
  b = next(pipeline.Batcher(exs, 8, seed=1, pad_to=16))
  assert b["source"].shape == b["target"].shape == (8, 16)
  assert b["source"].dtype == np.int32 and b["source_mask"].dtype == np.bool_
  assert b["source_length"].dtype == np.int32 and b["source_length"].shape == (8,)
  assert b["label"].dtype == np.int32 and b["label"].shape == (8,)
  assert b["ref"].dtype == object and b["example_mask"].all()
  for r in range(8):
    ex = exs[b["id"][r]]
    assert b["ref"][r] == ex["ref"] and b["label"][r] == ex["label"]
    n = len(ex["source"])
    np.testing.assert_array_equal(b["source"][r, :n], ex["source"])
    assert (b["source"][r, n:] == 0).all() and b["source_length"][r] == n
    np.testing.assert_array_equal(b["source_mask"][r], np.arange(16) < n)


def test_epoch_covers_each_example_once_and_pads_last_batch():
  exs = _examples(n=21)
  batcher = pipeline.Batcher(exs, 8, seed=3, drop_remainder=False, num_epochs=1)
  batches = list(batcher)
  assert len(batches) == 3 and batcher.batches_per_epoch == 3
  last = batches[-1]
  np.testing.assert_array_equal(last["example_mask"], np.arange(8) < 5)
  assert (last["source"][5:] == 0).all() and (last["source_length"][5:] == 0).all()
  ids = np.concatenate([b["id"][b["example_mask"]] for b in batches])
  assert sorted(ids.tolist()) == list(range(21))
  assert ids.tolist() != list(range(21))  # Shuffled.
  # Dynamic padding (no pad_to/buckets): the batch's longest sequence.
  for b in batches:
    assert b["target"].shape[1] == b["target_length"].max()


def test_drop_remainder_and_epochs_reshuffle():
  batcher = pipeline.Batcher(_examples(n=21), 8, seed=3, pad_to=12)
  assert batcher.batches_per_epoch == 2
  e0 = [b["id"].tolist() for b in _epoch(batcher, 2)]
  e1 = [b["id"].tolist() for b in _epoch(batcher, 2)]
  assert e0 != e1 and batcher.get_state() == {"epoch": 2, "position": 0, "seed": 3}
  # Each epoch is the permutation drawn from default_rng([seed, epoch]).
  assert sum(e0, []) == np.random.default_rng([3, 0]).permutation(21)[:16].tolist()


def test_same_seed_same_batches_and_no_shuffle():
  a = _epoch(pipeline.Batcher(_examples(), 4, seed=5, pad_to=12), 6)
  b = _epoch(pipeline.Batcher(_examples(), 4, seed=5, pad_to=12), 6)
  c = _epoch(pipeline.Batcher(_examples(), 4, seed=6, pad_to=12), 6)
  assert all((x["source"] == y["source"]).all() for x, y in zip(a, b))
  assert any((x["id"] != y["id"]).any() for x, y in zip(a, c))
  ordered = _epoch(pipeline.Batcher(_examples(), 4, shuffle=False, pad_to=12), 2)
  assert ordered[1]["id"].tolist() == [4, 5, 6, 7]


def test_resume_from_state_gives_same_batches():
  exs = _examples(n=50)
  run = pipeline.Batcher(exs, 6, seed=9, buckets=[4, 8, 12])
  _epoch(run, 11)  # Into the second epoch.
  state = json.loads(json.dumps(run.get_state()))
  expected = _epoch(run, 9)
  resumed = pipeline.Batcher(exs, 6, seed=0, buckets=[4, 8, 12])  # Seed comes from the state.
  resumed.set_state(state)
  got = _epoch(resumed, 9)
  for x, y in zip(expected, got):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_buckets_group_by_length():
  exs = _examples(n=200, max_len=30)
  batcher = pipeline.Batcher(exs, 8, seed=0, buckets=[8, 16, 32], num_epochs=1)
  widths = set()
  for b in batcher:
    longest = max(b["source_length"].max(), b["target_length"].max())
    bucket = min(x for x in (8, 16, 32) if x >= longest)
    assert b["source"].shape[1] == bucket == b["target"].shape[1]
    # Every example of the batch belongs to that bucket (by its longer sequence).
    for r in range(8):
      ex = exs[b["id"][r]]
      assert min(x for x in (8, 16, 32) if x >= max(len(ex["source"]), len(ex["target"]))) == bucket
    widths.add(bucket)
  assert widths == {8, 16, 32}


def test_filter_and_truncate():
  exs = _examples(n=40, max_len=12)
  too_long = sum(len(e["source"]) > 6 or len(e["target"]) > 6 for e in exs)
  filtered = pipeline.Batcher(exs, 1, max_length=6, pad_to=6, shuffle=False, num_epochs=1)
  assert filtered.num_filtered == too_long and filtered.batches_per_epoch == 40 - too_long
  kept = [int(b["id"][0]) for b in filtered]
  assert all(len(exs[i]["source"]) <= 6 and len(exs[i]["target"]) <= 6 for i in kept)
  cut = pipeline.Batcher(exs, 40, max_length={"source": 5}, length_policy="truncate",
                         shuffle=False, pad_to={"source": 5, "target": 12})
  b = next(cut)
  assert b["source"].shape == (40, 5) and b["target"].shape == (40, 12)
  for r, ex in enumerate(exs):
    np.testing.assert_array_equal(b["source"][r, :b["source_length"][r]], ex["source"][:5])


def test_permuted_batches_walk_a_fresh_permutation_per_epoch_and_resume():
  arrays = {"x": np.arange(10) * 10, "w": np.ones(10, np.float32)}
  batches = pipeline.permuted_batches(arrays, 4, seed=3)
  seen = [next(batches) for _ in range(5)]  # 20 rows: two epochs
  assert all(b["x"].shape == (4,) and b["w"].dtype == np.float32 for b in seen)
  rows = np.concatenate([b["x"] for b in seen]) // 10
  for epoch in range(2):
    np.testing.assert_array_equal(rows[10 * epoch:10 * (epoch + 1)],
                                  pipeline.rng_for(3, epoch).permutation(10))
  resumed = pipeline.permuted_batches(arrays, 4, seed=3)
  resumed.set_state({"index": 3})
  np.testing.assert_array_equal(next(resumed)["x"], seen[3]["x"])


def test_float_fields():
  reg = [{"x": [], "y": 2.0}, {"x": [0.5, 1.5], "y": -1.0}]
  r = next(pipeline.Batcher(reg, 2, shuffle=False))
  assert r["x"].dtype == np.float32 and r["y"].dtype == np.float32
  np.testing.assert_allclose(r["x"], [[0.0, 0.0], [0.5, 1.5]])
  np.testing.assert_array_equal(r["x_mask"], [[False, False], [True, True]])
  ints = next(pipeline.Batcher([{"t": []}, {"t": [3]}], 2, shuffle=False))
  assert ints["t"].dtype == np.int32 and ints["t_length"].tolist() == [0, 1]


def test_encode_examples():
  out = pipeline.encode_examples([{"a": "xy", "b": 1}], {"a": lambda s: [ord(c) for c in s]},
                                 keep=["b"])
  assert out == [{"b": 1, "a": [120, 121]}]
  with pytest.raises(DataError, match=r"lacks field\(s\) \['c'\]"):
    pipeline.encode_examples([{"a": "x"}], {"c": len})


def test_errors():
  exs = _examples(n=5)
  with pytest.raises(DataError, match="empty split"):
    pipeline.Batcher([], 4)
  with pytest.raises(DataError, match="make no batch of 8"):
    pipeline.Batcher(exs, 8)
  with pytest.raises(DataError, match="longer than pad_to 3"):
    pipeline.Batcher(exs, 2, pad_to=3)
  with pytest.raises(DataError, match="longer than the largest bucket 2"):
    pipeline.Batcher(exs, 2, buckets=[1, 2])
  with pytest.raises(DataError, match="all 5 examples are longer"):
    pipeline.Batcher(exs, 2, max_length=1)
  with pytest.raises(DataError, match="valid: filter, truncate"):
    pipeline.Batcher(exs, 2, length_policy="cut")
  with pytest.raises(DataError, match="example 1 has fields"):
    pipeline.Batcher([{"a": [1]}, {"b": [1]}], 1)
  with pytest.raises(DataError, match="lacks"):
    pipeline.Batcher(exs, 2).set_state({"epoch": 0})
