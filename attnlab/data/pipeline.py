"""Batching: numpy batches from encoded examples, deterministic and resumable.

`Batcher(examples, batch_size, ...)` iterates over batches (dicts of numpy arrays) built from a
random-access sequence of encoded examples (dicts). Each field of an example is one of:
- a token sequence (list / tuple / 1-D array of ints or floats), e.g. "source", "target",
  "inputs", "targets", "segment_ids". In the batch, field `f` gives
    `f`         int32 (float32 for float sequences) [batch, length], padded with 0 (= `<pad>`)
    `f_mask`    bool [batch, length], True at real tokens
    `f_length`  int32 [batch], number of real tokens;
- a scalar (int / float / bool), e.g. "label": `f` int32 / float32 / bool [batch];
- a string, e.g. a reference translation kept for BLEU: `f` object array [batch].
Every batch also has `example_mask` bool [batch]: False only at the padding rows that fill up
the last batch of an epoch when `drop_remainder=False`. `length` is `pad_to` (fixed), the
smallest of `buckets` that holds the longest sequence of the batch, or, with neither, that
longest sequence (one new shape per batch: slow under jit, fine for eval in plain numpy).

Order: each epoch is a permutation drawn from `np.random.default_rng([seed, epoch])`; with
buckets, examples are grouped by bucket (in that shuffled order) and the batches then shuffled.
`get_state()` returns `{"epoch", "position", "seed"}` (JSON-serialisable; position = batches
already served in this epoch) and `set_state(state)` continues with exactly the same batches.

grain's MapDataset would give shuffling and a checkpointable iterator too, but not bucketing
by length, and a resumed bucketed run must see the same batches; this small numpy
implementation does both, needs no worker processes (2 CPU cores) and keeps the state readable.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from attnlab.errors import DataError

# What a length limit or padding length may be: one for every sequence field, or per field.
LengthSpec = int | Mapping[str, int] | None
# Key of the per-row validity mask in every batch.
EXAMPLE_MASK = "example_mask"
# Length policies for sequences longer than max_length.
LENGTH_POLICIES = ("filter", "truncate")


def encode_examples(examples: Iterable[Mapping[str, Any]],
                    encoders: Mapping[str, Callable[[Any], Any]], *,
                    keep: Sequence[str] = ()) -> list[dict[str, Any]]:
  """Encodes each example's fields: `{k: ex[k] for k in keep} | {f: encoders[f](ex[f])}`.

  e.g. `encode_examples(ds, {"source": src.encode, "target": lambda t: tgt.encode(t,
  add_start=True, add_end=True)})`; a field in both `encoders` and `keep` comes out encoded.
  """
  out = []
  for n, ex in enumerate(examples):
    missing = [f for f in (*encoders, *keep) if f not in ex]
    if missing:
      raise DataError(f"example {n} lacks field(s) {missing}; it has {sorted(ex)}")
    row = {k: ex[k] for k in keep}
    row.update({f: fn(ex[f]) for f, fn in encoders.items()})
    out.append(row)
  if not out:
    raise DataError("encode_examples got no examples; an empty split cannot train or evaluate")
  return out


def rng_for(seed: int, *keys: int) -> np.random.Generator:
  """A NumPy generator determined by (seed, *keys), for host-side data order and sampling."""
  return np.random.default_rng([seed, *keys])


class IndexedBatches:
  """A resumable iterator over `batch_fn(0), batch_fn(1), ...`; its state is the next index.

  For data that can be produced from the batch index alone (synthetic tasks, or a permutation of
  an in-memory dataset seeded by (seed, epoch)): resuming is exact by construction.
  """

  def __init__(self, batch_fn: Callable[[int], Any], start: int = 0):
    self._batch_fn = batch_fn
    self._index = start

  def __iter__(self) -> IndexedBatches:
    return self

  def __next__(self) -> Any:
    batch = self._batch_fn(self._index)
    self._index += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"index": self._index}

  def set_state(self, state: dict[str, Any]) -> None:
    if "index" not in state:
      raise ValueError(f"IndexedBatches state must be {{'index': int}}, got {state!r}")
    self._index = int(state["index"])


def permuted_rows(index: int, batch_size: int, num_rows: int, seed: int) -> np.ndarray:
  """int64 `[batch_size]` rows of batch `index` when every epoch walks a fresh permutation of the
  `num_rows` rows (drawn from `rng_for(seed, epoch)`); a batch may span two epochs."""
  rows: list[int] = []
  position = index * batch_size
  while len(rows) < batch_size:
    epoch, offset = divmod(position + len(rows), num_rows)
    perm = rng_for(seed, epoch).permutation(num_rows)
    rows.extend(perm[offset:offset + batch_size - len(rows)])
  return np.asarray(rows)


def permuted_batches(arrays: Mapping[str, np.ndarray], batch_size: int,
                     seed: int) -> IndexedBatches:
  """Batches `{name: array[rows]}` of in-memory arrays (one row per example) in the epoch
  permutations of `permuted_rows`: resumable from the batch index alone."""
  num_rows = len(next(iter(arrays.values())))
  return IndexedBatches(lambda index: {
      name: value[permuted_rows(index, batch_size, num_rows, seed)]
      for name, value in arrays.items()})


def ordered_batches(arrays: Mapping[str, np.ndarray],
                    batch_size: int) -> list[dict[str, np.ndarray]]:
  """In-memory arrays (one row per example) cut in order into batches of `batch_size` rows (the
  last one may be shorter): evaluation batches."""
  num_rows = len(next(iter(arrays.values())))
  return [{name: value[start:start + batch_size] for name, value in arrays.items()}
          for start in range(0, num_rows, batch_size)]


def _kind(value: Any) -> str:
  if isinstance(value, str):
    return "str"
  if isinstance(value, (bool, np.bool_, numbers.Number)) or (
      isinstance(value, np.ndarray) and value.ndim == 0):
    return "scalar"
  if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1):
    return "seq"
  return "other"


def _seq_dtype(values: Iterable[Any]) -> np.dtype:
  """float32 if the first non-empty sequence holds floats, else int32."""
  for value in values:
    arr = np.asarray(value)
    if arr.size:
      return np.dtype(np.float32) if arr.dtype.kind == "f" else np.dtype(np.int32)
  return np.dtype(np.int32)


def _scalar_dtype(value: Any) -> np.dtype:
  kind = np.asarray(value).dtype.kind
  return np.dtype({"b": np.bool_, "f": np.float32}.get(kind, np.int32))


def _per_field(spec: LengthSpec, fields: Sequence[str], what: str) -> dict[str, int]:
  if spec is None:
    return {}
  if isinstance(spec, Mapping):
    unknown = sorted(set(spec) - set(fields))
    if unknown:
      raise DataError(f"{what} names unknown sequence field(s) {unknown}; sequence fields: "
                      f"{list(fields)}")
    out = {f: int(v) for f, v in spec.items()}
  else:
    out = {f: int(spec) for f in fields}
  if any(v < 1 for v in out.values()):
    raise DataError(f"{what} must be >= 1, got {spec}")
  return out


class Batcher:
  """Iterator of numpy batches over `examples` (see the module docstring for the arrays)."""

  def __init__(self, examples: Sequence[Mapping[str, Any]], batch_size: int, *, seed: int = 0,
               shuffle: bool = True, num_epochs: int | None = None, drop_remainder: bool = True,
               pad_to: LengthSpec = None, buckets: Sequence[int] | None = None,
               max_length: LengthSpec = None, length_policy: str = "filter"):
    """Checks every example once and fixes the fields, lengths and filtering.

    Args:
      examples: random-access sequence of encoded examples, all with the same fields.
      batch_size: rows per batch.
      seed: seed of the epoch permutations.
      shuffle: False keeps the order of `examples` (buckets still group).
      num_epochs: stop after this many epochs; None = forever.
      drop_remainder: drop the last incomplete batch of an epoch (of each bucket); False pads it
        to `batch_size` rows with `example_mask` False.
      pad_to: fixed padded length (int for all sequence fields, or {field: length}).
      buckets: increasing padded lengths to choose from per batch (exclusive with pad_to).
      max_length: longest allowed sequence (int or {field: length}).
      length_policy: "filter" drops examples with a longer sequence, "truncate" keeps their
        first max_length ids.
    """
    if batch_size < 1:
      raise DataError(f"batch_size must be >= 1, got {batch_size}")
    if length_policy not in LENGTH_POLICIES:
      raise DataError(f"unknown length_policy {length_policy!r}; valid: "
                      f"{', '.join(LENGTH_POLICIES)}")
    if pad_to is not None and buckets is not None:
      raise DataError("give pad_to (one fixed length) or buckets (a few lengths), not both")
    if num_epochs is not None and num_epochs < 1:
      raise DataError(f"num_epochs must be >= 1 or None, got {num_epochs}")
    if len(examples) == 0:
      raise DataError("Batcher got no examples; an empty split cannot train or evaluate anything")
    self._examples = examples
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.num_epochs = num_epochs
    self.drop_remainder = bool(drop_remainder)
    self._length_policy = length_policy

    first = examples[0]
    self._kinds = {f: _kind(v) for f, v in first.items()}
    bad = {f: type(first[f]).__name__ for f, k in self._kinds.items() if k == "other"}
    if bad:
      raise DataError(f"fields must be token sequences, scalars or strings; got {bad}")
    self.seq_fields = [f for f, k in self._kinds.items() if k == "seq"]
    self._max_len = _per_field(max_length, self.seq_fields, "max_length")
    self._pad_to = _per_field(pad_to, self.seq_fields, "pad_to")
    if pad_to is not None and set(self._pad_to) != set(self.seq_fields):
      raise DataError(f"pad_to must give a length for every sequence field {self.seq_fields}")
    self._buckets = None
    if buckets is not None:
      self._buckets = np.asarray(sorted({int(b) for b in buckets}), dtype=np.int64)
      if len(self._buckets) == 0 or self._buckets[0] < 1:
        raise DataError(f"buckets must be lengths >= 1, got {list(buckets)}")

    lengths, kept = self._scan()
    self._lengths = lengths  # [num_examples, num_seq_fields], after truncation
    self._kept = kept  # indices of the examples that passed the length filter
    self.num_filtered = len(examples) - len(kept)
    if len(kept) == 0:
      raise DataError(f"all {len(examples)} examples are longer than max_length {max_length}; "
                      f"raise max_length or use length_policy='truncate'")
    self._dtypes = {f: _scalar_dtype(first[f]) for f, k in self._kinds.items() if k == "scalar"}
    for f in self.seq_fields:
      self._dtypes[f] = _seq_dtype(self._examples[int(i)][f] for i in kept)
    self._epoch, self._position = 0, 0
    self._cached_epoch, self._cached_batches = -1, []
    if not self._batches_of(0):
      raise DataError(f"{len(kept)} examples make no batch of {self.batch_size} with "
                      f"drop_remainder=True{' per bucket' if buckets is not None else ''}; "
                      f"use a smaller batch_size or drop_remainder=False")

  # Checking and grouping.
  def _scan(self) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.zeros((len(self._examples), len(self.seq_fields)), dtype=np.int64)
    keep = np.ones(len(self._examples), dtype=bool)
    fields = set(self._kinds)
    for i, ex in enumerate(self._examples):
      if set(ex) != fields:
        raise DataError(f"example {i} has fields {sorted(ex)}, the first has {sorted(fields)}")
      for j, f in enumerate(self.seq_fields):
        if _kind(ex[f]) != "seq":
          raise DataError(f"example {i} field {f!r} is not a token sequence "
                          f"({type(ex[f]).__name__})")
        n = len(ex[f])
        limit = self._max_len.get(f)
        if limit is not None and n > limit:
          if self._length_policy == "filter":
            keep[i] = False
          n = limit
        lengths[i, j] = n
    for j, f in enumerate(self.seq_fields):
      longest = int(lengths[keep, j].max()) if keep.any() else 0
      if f in self._pad_to and longest > self._pad_to[f]:
        raise DataError(f"field {f!r} has a sequence of {longest} tokens, longer than pad_to "
                        f"{self._pad_to[f]}; set max_length (with length_policy 'filter' or "
                        f"'truncate') or a larger pad_to")
      if self._buckets is not None and longest > self._buckets[-1]:
        raise DataError(f"field {f!r} has a sequence of {longest} tokens, longer than the "
                        f"largest bucket {self._buckets[-1]}; set max_length or add a bucket")
    return lengths, np.flatnonzero(keep)

  def _batches_of(self, epoch: int) -> list[np.ndarray]:
    """Index arrays of the batches of `epoch`, in serving order."""
    if epoch == self._cached_epoch:
      return self._cached_batches
    rng = rng_for(self.seed, epoch)
    order = rng.permutation(self._kept) if self.shuffle else self._kept.copy()
    if self._buckets is None:
      groups = [order]
    else:
      longest = self._lengths[order].max(axis=1) if self.seq_fields else np.ones(len(order))
      bucket = np.searchsorted(self._buckets, longest)  # [num_kept]
      groups = [order[bucket == b] for b in range(len(self._buckets))]
    batches = []
    for group in groups:
      for start in range(0, len(group), self.batch_size):
        chunk = group[start:start + self.batch_size]
        if len(chunk) == self.batch_size or (len(chunk) and not self.drop_remainder):
          batches.append(chunk)
    if self._buckets is not None and self.shuffle:
      batches = [batches[k] for k in rng.permutation(len(batches))]
    self._cached_epoch, self._cached_batches = epoch, batches
    return batches

  @property
  def batches_per_epoch(self) -> int:
    return len(self._batches_of(self._epoch))

  # Iteration.
  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    while True:
      if self.num_epochs is not None and self._epoch >= self.num_epochs:
        raise StopIteration
      batches = self._batches_of(self._epoch)
      if self._position < len(batches):
        break
      self._epoch, self._position = self._epoch + 1, 0
    indices = batches[self._position]
    self._position += 1
    if self._position == len(batches):  # The state after an epoch's last batch is (epoch + 1, 0).
      self._epoch, self._position = self._epoch + 1, 0
    return self._collate(indices)

  def _padded_length(self, f: str, longest: int) -> int:
    if f in self._pad_to:
      return self._pad_to[f]
    if self._buckets is not None:
      return int(self._buckets[np.searchsorted(self._buckets, longest)])
    return max(longest, 1)

  def _collate(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    if hasattr(self._examples, "__getitems__"):
      rows = self._examples.__getitems__([int(i) for i in indices])
    else:
      rows = [self._examples[int(i)] for i in indices]
    n, size = len(rows), self.batch_size
    lengths = self._lengths[indices]  # [n, num_seq_fields]
    batch: dict[str, np.ndarray] = {}
    for f, kind in self._kinds.items():
      if kind == "str":
        batch[f] = np.array([r[f] for r in rows] + [""] * (size - n), dtype=object)  # [batch]
      elif kind == "scalar":
        values = np.zeros((size,), dtype=self._dtypes[f])  # [batch]
        values[:n] = [r[f] for r in rows]
        batch[f] = values
    for j, f in enumerate(self.seq_fields):
      width = self._padded_length(f, int(lengths[:, j].max()))
      ids = np.zeros((size, width), dtype=self._dtypes[f])  # [batch, length]
      for r, row in enumerate(rows):
        k = int(lengths[r, j])
        ids[r, :k] = np.asarray(row[f][:k])
      length = np.zeros((size,), dtype=np.int32)  # [batch]
      length[:n] = lengths[:, j]
      batch[f] = ids
      batch[f"{f}_mask"] = np.arange(width)[None, :] < length[:, None]  # [batch, length]
      batch[f"{f}_length"] = length
    batch[EXAMPLE_MASK] = np.arange(size) < n  # [batch]
    return batch

  # Checkpointing.
  def get_state(self) -> dict[str, int]:
    """Where the iterator stands: {"epoch", "position", "seed"} (JSON-serialisable ints)."""
    return {"epoch": int(self._epoch), "position": int(self._position), "seed": self.seed}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Continues from a `get_state()` result (its seed replaces the configured one)."""
    missing = [k for k in ("epoch", "position", "seed") if k not in state]
    if missing:
      raise DataError(f"Batcher state lacks {missing}; expected the dict get_state() returns")
    epoch, position, seed = (int(state[k]) for k in ("epoch", "position", "seed"))
    if epoch < 0 or position < 0:
      raise DataError(f"Batcher state has a negative epoch or position: {dict(state)}")
    if seed != self.seed:
      self.seed, self._cached_epoch = seed, -1
    num_batches = len(self._batches_of(epoch))
    if position > num_batches:
      raise DataError(f"Batcher state position {position} is beyond the {num_batches} batches of "
                      f"an epoch: the data or batch settings changed since it was saved")
    self._epoch, self._position = epoch, position
