"""Reads a PyTorch state dict file (`torch.save`, zip format) into NumPy arrays without torch.

A `pytorch_model.bin` is a zip archive: `<name>/data.pkl` (a pickle of the state dict) and
`<name>/data/<key>` (the raw bytes of each storage, little-endian). In the pickle every tensor is
a call `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` whose storage is a
persistent id `("storage", torch.FloatStorage, key, location, numel)`. The unpickler here maps
exactly those globals (the rebuild functions, the typed storage classes, OrderedDict) to NumPy
and refuses every other global, so a file cannot run code while it is read. A rebuild is only
recorded while unpickling; `load_state_dict` then checks each tensor by name (offset, sizes and
strides non-negative, its furthest element inside its storage, its bytes bounded by the file's
size) before it copies anything, so a forged file gets one line, never a read past a buffer.
"""

from __future__ import annotations

import collections
import lzma
import math
import operator
import os
import pickle
import struct
import zipfile
import zlib
from typing import Any

import ml_dtypes
import numpy as np

from attnlab.errors import TorchFileError

# torch storage class name -> NumPy dtype.
STORAGE_DTYPES: dict[str, Any] = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


# Bytes one tensor (and one storage) may hold: a state dict's tensors are views of storages that
# the file holds whole, so a tensor larger than the file is a forged size or stride. The factor
# leaves room for a broadcast (stride 0) tensor; the floor for tiny files.
MAX_EXPANSION = 4
MIN_LIMIT_BYTES = 1 << 20
# The bytes all tensors together may hold (tied weights read one storage several times).
MAX_TOTAL_EXPANSION = 16
# The most dimensions a NumPy array has.
MAX_NDIM = 64
# Exceptions a malformed pickle or zip archive raises in the standard library's readers (a
# damaged bzip2 member raises OSError, an lzma one LZMAError).
_READ_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
                AttributeError, OverflowError, RecursionError, MemoryError, LookupError,
                NotImplementedError, RuntimeError, zipfile.BadZipFile, zlib.error, struct.error,
                lzma.LZMAError, OSError)


class _Storage:
  """A storage read from the archive (its elements, little-endian); the pickle cannot alter it."""
  __slots__ = ("key", "array")

  def __init__(self, key: str, array: np.ndarray):
    self.key, self.array = key, array

  def __setstate__(self, state: Any) -> None:
    raise TorchFileError(f"the pickle alters storage {self.key}; a state dict never does")


class _Tensor:
  """A tensor rebuild as the pickle asked for it, checked and copied by `materialize` once its
  name in the state dict is known (nothing is read from the storage before that)."""
  __slots__ = ("args",)

  def __init__(self, args: tuple[Any, ...]):
    self.args = args

  def __setstate__(self, state: Any) -> None:
    raise TorchFileError("the pickle alters a rebuilt tensor; a state dict never does")

  def materialize(self, name: str, limit_bytes: int) -> np.ndarray:
    """The tensor as a contiguous array, after checking that every element it reads lies in its
    storage and that it is not larger than `limit_bytes`; TorchFileError naming `name` if not."""
    def bad(what: str) -> TorchFileError:
      return TorchFileError(f"tensor {name!r}: {what}; the file is damaged or forged")

    if len(self.args) < 4:
      raise bad(f"its rebuild has {len(self.args)} arguments (storage, offset, size, stride "
                f"expected)")
    storage, offset, size, stride = self.args[:4]
    if not isinstance(storage, _Storage):
      raise bad(f"its storage is a {type(storage).__name__}, not a storage of the archive")
    try:
      offset = operator.index(offset)
      size = tuple(operator.index(n) for n in size)
      stride = tuple(operator.index(s) for s in stride)
    except TypeError:
      raise bad("its offset, size and stride are not integers") from None
    array = storage.array
    if len(size) != len(stride):
      raise bad(f"size {size} and stride {stride} have different lengths")
    if len(size) > MAX_NDIM:
      raise bad(f"{len(size)} dimensions, more than the {MAX_NDIM} an array can have")
    if offset < 0 or any(n < 0 for n in size) or any(s < 0 for s in stride):
      raise bad(f"negative offset, size or stride (offset {offset}, size {size}, stride "
                f"{stride})")
    count = math.prod(size)
    if count * array.dtype.itemsize > limit_bytes:
      raise bad(f"size {size} holds {count * array.dtype.itemsize} bytes, more than "
                f"{limit_bytes} allowed for a file of this size")
    if count == 0:
      if offset > array.size:
        raise bad(f"offset {offset} lies past its storage of {array.size} elements")
      try:
        return np.zeros(size, array.dtype)
      except ValueError:  # a dimension past NumPy's limits (2**63, or a product past them)
        raise bad(f"size {size} is larger than an array can be") from None
    furthest = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if furthest >= array.size:
      raise bad(f"size {size} with stride {stride} at offset {offset} reads element {furthest} "
                f"of a storage of {array.size} elements")
    if not size:
      return np.array(array[offset])  # a 0-d array, not a NumPy scalar
    item = array.dtype.itemsize
    # The stride of a length-1 axis is never used (and may be any size): 0.
    view = np.lib.stride_tricks.as_strided(array[offset:], shape=size,
                                           strides=tuple(s * item if n > 1 else 0
                                                         for n, s in zip(size, stride)),
                                           writeable=False)
    return np.array(view)  # a contiguous copy


def _rebuild_tensor(*args: Any) -> _Tensor:
  """torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...), checked later."""
  return _Tensor(args)


def _rebuild_parameter(data: Any, *unused: Any) -> Any:
  return data


# (module, name) -> what the pickle gets instead.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
}


class _Unpickler(pickle.Unpickler):
  """Unpickles a state dict, storages read from the zip archive (see the module docstring)."""

  def __init__(self, file: Any, archive: zipfile.ZipFile, prefix: str, limit_bytes: int,
               total_limit_bytes: int):
    super().__init__(file)
    self._archive = archive
    self._prefix = prefix
    # The most bytes one storage, and all storages together, may hold (declared sizes, checked
    # before a compressed storage is inflated).
    self._limit_bytes = limit_bytes
    self._total_limit_bytes = total_limit_bytes
    self._storage_bytes = 0
    self._storages: dict[str, _Storage] = {}

  def find_class(self, module: str, name: str) -> Any:
    if (module, name) in _ALLOWED_GLOBALS:
      return _ALLOWED_GLOBALS[(module, name)]
    if module == "torch" and name in STORAGE_DTYPES:
      return np.dtype(STORAGE_DTYPES[name])  # stands for torch.<Name>Storage
    raise TorchFileError(f"refusing to load {module}.{name}: a state dict holds only tensors "
                         f"(convert the checkpoint to model.safetensors if it holds more)")

  def persistent_load(self, pid: Any) -> _Storage:
    if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"
            and isinstance(pid[1], np.dtype)):
      raise TorchFileError(f"unknown persistent id {pid!r:.80} in the pickle")
    dtype, key = pid[1], str(pid[2])
    if key not in self._storages:
      member = f"{self._prefix}data/{key}"
      try:
        info = self._archive.getinfo(member)
      except KeyError:
        raise TorchFileError(f"storage {key!r:.80} is missing from the archive") from None
      self._storage_bytes += info.file_size
      if info.file_size > self._limit_bytes or self._storage_bytes > self._total_limit_bytes:
        raise TorchFileError(f"storage {key!r:.80} holds {info.file_size} bytes (the storages "
                             f"so far {self._storage_bytes}), more than a file of this size "
                             f"allows ({self._limit_bytes} each, {self._total_limit_bytes} in "
                             f"all); the file is damaged or forged")
      raw = self._archive.read(member)
      if len(raw) % dtype.itemsize:
        raise TorchFileError(f"storage {key!r:.80} has {len(raw)} bytes, not a whole number of "
                             f"{dtype.itemsize}-byte elements")
      self._storages[key] = _Storage(key, np.frombuffer(raw, dtype=dtype.newbyteorder("<")))
    return self._storages[key]


def load_state_dict(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
  """{name: array} of a `torch.save`d state dict (zip format), read without torch.

  Every tensor is checked before its storage is read: non-negative offset, sizes and strides, its
  furthest element inside the storage, and no more bytes than a limit derived from the file's
  size (MAX_EXPANSION; MAX_TOTAL_EXPANSION for all tensors together). Raises TorchFileError (one
  line, naming the file and the tensor) for anything else.
  """
  path = os.fspath(path)
  try:
    is_zip = zipfile.is_zipfile(path)
  except OSError as e:
    raise TorchFileError(f"{path} cannot be read ({e.strerror or e})") from None
  if not is_zip:
    raise TorchFileError(f"{path} is not a zip archive: only the zip format of torch.save "
                         f"(PyTorch >= 1.6) can be read without torch; re-save it or convert it "
                         f"to model.safetensors")
  file_size = os.path.getsize(path)
  limit = MAX_EXPANSION * file_size + MIN_LIMIT_BYTES
  total_limit = MAX_TOTAL_EXPANSION * file_size + MIN_LIMIT_BYTES
  # Errors are raised outside their handlers, so that the line naming the file is the innermost
  # one (the one the command-line tools print).
  problem = None
  try:
    state = _read_archive(path, limit, total_limit)
  except TorchFileError as e:
    problem = str(e)
  except _READ_ERRORS as e:
    problem = f"not a readable state dict ({' '.join(str(e).split())[:200] or type(e).__name__})"
  if problem is not None:
    raise TorchFileError(f"{path}: {problem}")
  if not isinstance(state, dict):
    raise TorchFileError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
  bad = [str(k) for k, v in state.items() if not isinstance(v, _Tensor)]
  if bad:
    raise TorchFileError(f"{path}: entries that are not tensors: {', '.join(bad[:5])}")
  bad = [repr(k) for k in state if not isinstance(k, str)]
  if bad:
    raise TorchFileError(f"{path}: tensor names that are not strings: {', '.join(bad[:5]):.200}")
  tensors, total = {}, 0
  for name, tensor in state.items():
    try:
      tensors[name] = array = tensor.materialize(str(name), limit)
    except TorchFileError as e:
      problem = str(e)
    if problem is not None:
      raise TorchFileError(f"{path}: {problem}")
    total += array.nbytes
    if total > total_limit:
      raise TorchFileError(f"{path}: the tensors up to {str(name)!r} hold {total} bytes, more "
                           f"than {total_limit} allowed for a file of this size; the file is "
                           f"damaged or forged")
  return tensors


def _read_archive(path: str, limit: int, total_limit: int) -> Any:
  """The unpickled data.pkl of a torch.save archive (tensors not yet materialized)."""
  with zipfile.ZipFile(path) as archive:
    pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
    if len(pickles) != 1:
      raise TorchFileError(f"{len(pickles)} data.pkl files; expected one (a torch.save archive)")
    prefix = pickles[0][:-len("data.pkl")]
    order = prefix + "byteorder"
    if order in archive.namelist() and archive.read(order).strip() != b"little":
      raise TorchFileError("written on a big-endian machine; not supported")
    if archive.getinfo(pickles[0]).file_size > limit:
      raise TorchFileError(f"data.pkl holds {archive.getinfo(pickles[0]).file_size} bytes, more "
                           f"than {limit} allowed for a file of this size")
    with archive.open(pickles[0]) as f:
      return _Unpickler(f, archive, prefix, limit, total_limit).load()
