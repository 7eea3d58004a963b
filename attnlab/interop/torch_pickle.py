"""Reads a PyTorch state dict file (`torch.save`, zip format) into NumPy arrays without torch.

A `pytorch_model.bin` is a zip archive: `<name>/data.pkl` (a pickle of the state dict) and
`<name>/data/<key>` (the raw bytes of each storage, little-endian). In the pickle every tensor is
a call `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` whose storage is a
persistent id `("storage", torch.FloatStorage, key, location, numel)`. The unpickler here maps
exactly those globals (the rebuild functions, the typed storage classes, OrderedDict) to NumPy
and refuses every other global, so a file cannot run code while it is read.
"""

from __future__ import annotations

import collections
import os
import pickle
import zipfile
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


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple[int, ...],
                    stride: tuple[int, ...], *unused: Any) -> np.ndarray:
  """torch._utils._rebuild_tensor_v2 for a NumPy storage (offset and strides in elements)."""
  size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
  if not size:
    return storage[offset].copy()
  end = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
  if any(n == 0 for n in size):
    return np.zeros(size, storage.dtype)
  if end > storage.size:
    raise TorchFileError(f"a tensor of size {size} reads past its storage of {storage.size} "
                         "elements; the file is damaged")
  item = storage.dtype.itemsize
  view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size,
                                         strides=tuple(s * item for s in stride))
  return np.array(view)  # a contiguous copy


def _rebuild_parameter(data: np.ndarray, *unused: Any) -> np.ndarray:
  return data


# (module, name) -> what the pickle gets instead.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
}


class _Unpickler(pickle.Unpickler):
  """Unpickles a state dict, storages read from the zip archive (see the module docstring)."""

  def __init__(self, file: Any, archive: zipfile.ZipFile, prefix: str):
    super().__init__(file)
    self._archive = archive
    self._prefix = prefix
    self._storages: dict[str, np.ndarray] = {}

  def find_class(self, module: str, name: str) -> Any:
    if (module, name) in _ALLOWED_GLOBALS:
      return _ALLOWED_GLOBALS[(module, name)]
    if module == "torch" and name in STORAGE_DTYPES:
      return np.dtype(STORAGE_DTYPES[name])  # stands for torch.<Name>Storage
    raise TorchFileError(f"refusing to load {module}.{name}: a state dict holds only tensors "
                         f"(convert the checkpoint to model.safetensors if it holds more)")

  def persistent_load(self, pid: Any) -> np.ndarray:
    if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"
            and isinstance(pid[1], np.dtype)):
      raise TorchFileError(f"unknown persistent id {pid!r:.80} in the pickle")
    dtype, key = pid[1], str(pid[2])
    if key not in self._storages:
      try:
        raw = self._archive.read(f"{self._prefix}data/{key}")
      except KeyError:
        raise TorchFileError(f"storage {key} is missing from the archive") from None
      self._storages[key] = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
    return self._storages[key]


def load_state_dict(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
  """{name: array} of a `torch.save`d state dict (zip format), read without torch."""
  path = os.fspath(path)
  if not zipfile.is_zipfile(path):
    raise TorchFileError(f"{path} is not a zip archive: only the zip format of torch.save "
                         f"(PyTorch >= 1.6) can be read without torch; re-save it or convert it "
                         f"to model.safetensors")
  with zipfile.ZipFile(path) as archive:
    pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
    if len(pickles) != 1:
      raise TorchFileError(f"{path} holds {len(pickles)} data.pkl files; expected one "
                           f"(a torch.save archive)")
    prefix = pickles[0][:-len("data.pkl")]
    order = prefix + "byteorder"
    if order in archive.namelist() and archive.read(order).strip() != b"little":
      raise TorchFileError(f"{path} was written on a big-endian machine; not supported")
    with archive.open(pickles[0]) as f:
      try:
        state = _Unpickler(f, archive, prefix).load()
      except TorchFileError as e:
        raise TorchFileError(f"{path}: {e}") from None
      except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise TorchFileError(f"{path}: not a readable state dict ({e})") from None
  if not isinstance(state, dict):
    raise TorchFileError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
  bad = [k for k, v in state.items() if not isinstance(v, np.ndarray)]
  if bad:
    raise TorchFileError(f"{path}: entries that are not tensors: {', '.join(map(str, bad[:5]))}")
  return dict(state)
