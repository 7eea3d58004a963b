"""Hostile and careless inputs: checkpoint files built to crash or leak, sizes that would exhaust
memory, config keys that are not config, paths with '..', a kill between a checkpoint and its
evaluation, a sweep member without its final record, queries that may see no key, and a run
directory whose metrics.jsonl lines or config.json values are not what attnlab wrote.

Each case gives one line (a UserError subclass; through the CLI: one line on stderr and exit 2),
never a crash, a traceback or a read outside a buffer. End-to-end cases run the CLI in a subprocess,
as a user meets them (marked slow); the unpickler and safetensors reader are fuzzed with a bounded
number of seeded examples.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import re
import shutil
import struct
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from attnlab import errors
from attnlab.attention import core

REPO = pathlib.Path(__file__).resolve().parents[1]


def _cli(*args, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
  """`attnlab <args>` in a subprocess; stdout and stderr as text."""
  return subprocess.run([sys.executable, "-m", "attnlab.cli", *map(str, args)],
                        capture_output=True, text=True, timeout=timeout, **kwargs)


def _one_line(stderr: str) -> str:
  """The only line of stderr that is not a progress log (checked: no traceback)."""
  lines = [l for l in stderr.splitlines() if l.strip() and not l[:8].replace(":", "").isdigit()
           and " was trained for only " not in l]  # the few-training-steps warning of runlocal
  assert len(lines) == 1, stderr
  assert "Traceback" not in stderr, stderr
  return lines[0]


# --------------------------------------------------------------------------------------------------
# 9. A query that may see no key: zero context and zero gradients on every implementation


def _numpy_attention(q, k, v, allowed, scale):
  """softmax(scale q k^T) v over the allowed keys (a query with none: 0) and the gradients of
  sum(context * g) with respect to q, k, v (the softmax backward written out)."""
  logits = scale * q @ np.swapaxes(k, -1, -2)  # [b, h, q, k]
  logits = np.where(allowed, logits, -np.inf)
  row_ok = allowed.any(-1, keepdims=True)
  e = np.where(allowed, np.exp(logits - np.where(row_ok, logits.max(-1, keepdims=True), 0)), 0)
  p = e / np.where(row_ok, e.sum(-1, keepdims=True), 1)  # [b, h, q, k]
  return p @ v, p


def _numpy_grads(q, k, v, p, g, scale):
  dv = np.swapaxes(p, -1, -2) @ g
  dp = g @ np.swapaxes(v, -1, -2)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  return scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, dv


def _implementations():
  impls = ["reference", "xla", "blocked"]
  if jax.default_backend() == "gpu":
    impls.append("cudnn")
  return impls


@pytest.mark.parametrize("mask_kind", ["full", "padding"])
@pytest.mark.parametrize("implementation", _implementations())
def test_query_with_no_allowed_key_gets_zero_context_and_gradients(implementation, mask_kind):
  rng = np.random.default_rng(0)
  b, h, n, d = 2, 2, 6, 8
  dtype = np.float16 if implementation == "cudnn" else np.float32
  q, k, v, g = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(4))
  causal = np.tril(np.ones((n, n), bool))
  if mask_kind == "full":
    # Query 0 may see only key 0 (causal); the mask forbids it. Query 2 may see keys 0..2; the
    # mask allows only keys 3..5, in its future. Query 4 (batch 1) gets none at all.
    mask = np.ones((b, h, n, n), bool)
    mask[:, :, 0, 0] = False
    mask[:, :, 2, :3] = False
    mask[1, :, 4, :] = False
  else:
    # A padding mask [b, 1, 1, k] without key 0 in batch 0: its query 0 sees nothing causally.
    mask = np.ones((b, 1, 1, n), bool)
    mask[0, 0, 0, :2] = False
  allowed = np.broadcast_to(mask, (b, h, n, n)) & causal
  scale = 1.0 / np.sqrt(d)
  want, p = _numpy_attention(q, k, v, allowed, scale)
  want_grads = _numpy_grads(q, k, v, p, g, scale)
  empty = ~allowed.any(-1)  # [b, h, q]
  assert empty.any() and not empty.all()

  def loss(q, k, v):
    context, _ = core.attend(q, k, v, score="scaled_dot", mask=mask, causal=True,
                             implementation=implementation)
    return jnp.sum(context.astype(jnp.float32) * g), context

  args = [jnp.asarray(x, dtype) for x in (q, k, v)]
  (_, context), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*args)
  context = np.asarray(context, np.float32)
  tol = 2e-2 if dtype == np.float16 else 2e-5
  assert np.all(context[empty] == 0)
  np.testing.assert_allclose(context, want, atol=tol, rtol=tol)
  for got, expected in zip(grads, want_grads):
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, expected, atol=tol * 5, rtol=tol * 5)
  assert np.all(np.asarray(grads[0], np.float32)[empty] == 0)  # dq of a query with no key


# --------------------------------------------------------------------------------------------------
# 1-2. pytorch_model.bin with only allowed globals but forged tensor rebuilds; safetensors headers

FIXTURES = REPO / "tests" / "fixtures" / "hf"


def _int(n: int) -> bytes:
  """pickle LONG1 of any int."""
  raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True) if n else b""
  return b"\x8a" + bytes([len(raw)]) + raw


def _str(text: str) -> bytes:
  raw = text.encode()
  return b"X" + struct.pack("<I", len(raw)) + raw


def _tuple(items) -> bytes:
  return b"(" + b"".join(_int(i) for i in items) + b"t"


def _global(module: str, name: str) -> bytes:
  return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _rebuild(key: str, numel: int, offset: int, size, stride, storage="FloatStorage") -> bytes:
  """torch._utils._rebuild_tensor_v2(storage key, offset, size, stride, False, OrderedDict())."""
  pid = b"(" + _str("storage") + _global("torch", storage) + _str(key) + _str("cpu") \
      + _int(numel) + b"tQ"
  hooks = _global("collections", "OrderedDict") + b")R"
  return _global("torch._utils", "_rebuild_tensor_v2") + b"(" + pid + _int(offset) \
      + _tuple(size) + _tuple(stride) + b"\x89" + hooks + b"tR"


def _state_dict_pickle(tensors: dict[str, bytes]) -> bytes:
  """The data.pkl of an OrderedDict {name: rebuild} (protocol 2, as torch writes it)."""
  items = b"".join(_str(name) + rebuild for name, rebuild in tensors.items())
  return b"\x80\x02" + _global("collections", "OrderedDict") + b")R(" + items + b"u."


def _torch_file(path: pathlib.Path, data_pkl: bytes, storages: dict[str, bytes]) -> pathlib.Path:
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("archive/data.pkl", data_pkl)
    z.writestr("archive/byteorder", "little")
    for key, raw in storages.items():
      z.writestr(f"archive/data/{key}", raw)
  return path


# The forged rebuilds the issue found, each with a 4-element float storage: (offset, size, stride).
HOSTILE = {
    "negative_stride": (3, (4096,), (-1,)),
    "negative_offset": (-4095, (4096,), (1,)),
    "zero_stride_huge": (0, (10**6, 10**6), (0, 0)),
    "past_the_end": (2, (2, 2), (2, 1)),
}
STORAGE = np.arange(1, 5, dtype=np.float32)


def _hostile_file(path: pathlib.Path, case: str, name: str = "w") -> pathlib.Path:
  offset, size, stride = HOSTILE[case]
  data = _state_dict_pickle({name: _rebuild("0", STORAGE.size, offset, size, stride)})
  return _torch_file(path, data, {"0": STORAGE.tobytes()})


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_forged_tensor_rebuilds_are_refused_by_name(tmp_path, case):
  from attnlab.interop import torch_pickle  # pylint: disable=g-import-not-at-top
  path = _hostile_file(tmp_path / "pytorch_model.bin", case, name="h.0.attn.c_attn.weight")
  with pytest.raises(errors.TorchFileError) as info:
    torch_pickle.load_state_dict(path)
  message = str(info.value)
  assert "\n" not in message and "tensor 'h.0.attn.c_attn.weight'" in message, message
  assert isinstance(info.value, errors.UserError)


def test_a_compressed_storage_larger_than_the_file_allows_is_not_inflated(tmp_path):
  from attnlab.interop import torch_pickle  # pylint: disable=g-import-not-at-top
  path = tmp_path / "bomb.bin"
  numel = 2 * 2**20  # 8 MiB of zeros, deflated to a few KiB
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
    z.writestr("archive/data.pkl",
               _state_dict_pickle({"w": _rebuild("0", numel, 0, (numel,), (1,))}))
    z.writestr("archive/data/0", bytes(4 * numel))
  assert path.stat().st_size < 100_000
  with pytest.raises(errors.TorchFileError, match="storage '0' holds 8388608 bytes"):
    torch_pickle.load_state_dict(path)


def test_valid_strided_views_read_what_numpy_reads(tmp_path):
  """The checks keep every rebuild a real state dict has: a transposed view, an offset view, a
  scalar, an empty tensor, a broadcast (stride 0) row, read exactly as NumPy indexes them."""
  from attnlab.interop import torch_pickle  # pylint: disable=g-import-not-at-top
  storage = np.arange(12, dtype=np.float32) * 1.5
  cases = {"t": (0, (4, 3), (1, 4)), "offset": (5, (2, 3), (3, 1)), "scalar": (11, (), ()),
           "empty": (12, (0, 3), (3, 1)), "broadcast": (2, (3, 2), (0, 1))}
  data = _state_dict_pickle({n: _rebuild("0", 12, *c) for n, c in cases.items()})
  got = torch_pickle.load_state_dict(_torch_file(tmp_path / "ok.bin", data,
                                                 {"0": storage.tobytes()}))
  for name, (offset, size, stride) in cases.items():
    index = offset + sum(np.arange(n).reshape([-1 if i == j else 1 for j in range(len(size))]) * s
                         for i, (n, s) in enumerate(zip(size, stride)))
    np.testing.assert_array_equal(got[name], storage[np.asarray(index, int)].reshape(size))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["negative_stride", "negative_offset", "zero_stride_huge"])
def test_import_hf_refuses_forged_rebuilds_in_one_line(tmp_path, case):
  folder = tmp_path / "gpt2"
  folder.mkdir()
  shutil.copy(FIXTURES / "gpt2" / "config.json", folder)
  _hostile_file(folder / "pytorch_model.bin", case, name="transformer.wte.weight")
  result = _cli("import-hf", folder, f"--workdir={tmp_path / 'run'}", timeout=120)
  assert result.returncode == 2, result.stderr
  line = _one_line(result.stderr)
  assert line.startswith(f"attnlab import-hf: error: {folder / 'pytorch_model.bin'}: tensor "
                         f"'transformer.wte.weight': ")
  assert not (tmp_path / "run" / "config.json").exists()


def _mutations(rng: np.random.Generator, good: bytes, count: int):
  """Damaged copies of `good`: random bytes, truncations, flipped and inserted bytes."""
  for i in range(count):
    kind = i % 4
    if kind == 0:
      yield rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8).tobytes()
    elif kind == 1:
      yield good[:int(rng.integers(0, len(good)))]
    elif kind == 2:
      data = bytearray(good)
      for at in rng.integers(0, len(data), int(rng.integers(1, 8))):
        data[at] = int(rng.integers(0, 256))
      yield bytes(data)
    else:
      at = int(rng.integers(0, len(good)))
      yield good[:at] + rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes() \
          + good[at:]


def _hostile_number(rng: np.random.Generator) -> int:
  return int(rng.choice([0, 1, 2, 3, -1, -2, -4095, 4, 5, 7, 2**31, 2**63, -2**63, 10**6,
                         int(rng.integers(-50, 50))]))


def test_fuzz_torch_reader(tmp_path):
  """Seeded malformed files: every one loads what a NumPy index of its storage gives (then every
  element lies inside the storage) or raises TorchFileError with one line; never anything else."""
  from attnlab.interop import torch_pickle  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(27)
  storage = np.arange(1, 13, dtype=np.float32)
  good_pickle = _state_dict_pickle({"a": _rebuild("0", 12, 0, (3, 4), (4, 1)),
                                    "b": _rebuild("0", 12, 1, (2, 2), (1, 3))})
  good_zip = _torch_file(tmp_path / "good.bin", good_pickle, {"0": storage.tobytes()}).read_bytes()
  path = tmp_path / "fuzz.bin"
  outcomes = {"loaded": 0, "refused": 0}

  def check(expected=None):
    """`expected`: None (either outcome), "refused", or {name: array} (must load as that)."""
    try:
      tensors = torch_pickle.load_state_dict(path)
    except errors.TorchFileError as e:
      assert "\n" not in str(e), str(e)
      assert expected is None or expected == "refused", str(e)
      outcomes["refused"] += 1
      return
    assert expected != "refused", "a forged rebuild was loaded"
    outcomes["loaded"] += 1
    for name, array in tensors.items():
      assert isinstance(array, np.ndarray)
      if expected is not None:
        np.testing.assert_array_equal(array, expected[name])

  # Whole files and data.pkl damaged at random (zip and raw).
  for data in _mutations(rng, good_zip, 120):
    path.write_bytes(data)
    check()
  for data in _mutations(rng, good_pickle, 200):
    _torch_file(path, data, {"0": storage.tobytes()})
    check()
  for data in _mutations(rng, good_pickle, 40):
    path.write_bytes(data)  # a raw (pre-zip) pickle
    check()
  # Well-formed pickles with hostile offsets, sizes and strides.
  for _ in range(300):
    ndim = int(rng.integers(0, 4))
    offset = _hostile_number(rng)
    size = [abs(_hostile_number(rng)) % 6 if rng.random() < 0.7 else _hostile_number(rng)
            for _ in range(ndim)]
    stride = [abs(_hostile_number(rng)) % 5 if rng.random() < 0.7 else _hostile_number(rng)
              for _ in range(ndim)]
    _torch_file(path, _state_dict_pickle({"x": _rebuild("0", 12, offset, size, stride)}),
                {"0": storage.tobytes()})
    count = int(np.prod(size, dtype=object)) if size else 1
    expected = "refused"
    if offset >= 0 and all(n >= 0 for n in size) and all(s >= 0 for s in stride):
      if count * 4 > 1 << 20:
        expected = "refused" if count * 4 > 1 << 30 else None  # vs. the file-size limit
      elif count == 0:
        expected = {"x": np.zeros(size, np.float32)} if offset <= storage.size else "refused"
      elif offset + sum((n - 1) * s for n, s in zip(size, stride)) < storage.size:
        grids = np.indices(size).astype(object)
        index = offset + sum(g * s for g, s in zip(grids, stride)) if size else offset
        expected = {"x": storage[np.asarray(index, int)]}
    check(expected)
  assert outcomes["loaded"] > 50 and outcomes["refused"] > 300, outcomes


def test_fuzz_safetensors_reader(tmp_path):
  """Seeded damaged safetensors files (random bytes, truncations, flipped bytes, forged header
  fields): each loads with every tensor inside the file, or raises HFError (one line)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  from attnlab.interop import hf  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(28)
  good_path = tmp_path / "good.safetensors"
  save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4),
             "b": np.ones((2, 5), np.int64)}, str(good_path))
  good = good_path.read_bytes()
  length = int.from_bytes(good[:8], "little")
  header = json.loads(good[8:8 + length])
  path = tmp_path / "fuzz.safetensors"

  def forged() -> bytes:
    h = json.loads(json.dumps(header))
    entry = h[str(rng.choice(["a", "b"]))]
    field = str(rng.choice(["shape", "data_offsets", "dtype", "length"]))
    if field == "shape":
      entry["shape"] = [_hostile_number(rng) for _ in range(int(rng.integers(0, 4)))]
    elif field == "data_offsets":
      entry["data_offsets"] = [_hostile_number(rng), _hostile_number(rng)]
    elif field == "dtype":
      entry["dtype"] = str(rng.choice(["F32", "F16", "I8", "Q4", "", "F64"]))
    text = json.dumps(h).encode()
    claimed = len(text) if field != "length" else _hostile_number(rng) % 2**64
    return struct.pack("<Q", claimed) + text + good[8 + length:]

  datas = list(_mutations(rng, good, 160)) + [forged() for _ in range(200)]
  refused = 0
  for data in datas:
    path.write_bytes(data)
    try:
      tensors = hf._read_weight_file(path)  # pylint: disable=protected-access
    except errors.HFError as e:
      assert "\n" not in str(e), str(e)
      refused += 1
      continue
    for array in tensors.values():
      assert array.nbytes <= len(data)
  assert refused > 150


# --------------------------------------------------------------------------------------------------
# 3. Sizes of an imported config.json, checked before anything is built


def _gpt2_folder(tmp_path: pathlib.Path, **changes) -> pathlib.Path:
  folder = tmp_path / "gpt2"
  shutil.copytree(FIXTURES / "gpt2", folder, dirs_exist_ok=True)
  config = json.loads((folder / "config.json").read_text())
  config.update(changes)
  (folder / "config.json").write_text(json.dumps(config))
  return folder


@pytest.mark.slow
def test_import_hf_refuses_a_billion_layers_at_once(tmp_path):
  folder = _gpt2_folder(tmp_path, n_layer=10**9)
  result = _cli("import-hf", folder, f"--workdir={tmp_path / 'run'}", timeout=60)
  assert result.returncode == 2, result.stderr
  assert "n_layer=1000000000" in _one_line(result.stderr)


@pytest.mark.parametrize("changes, expected", [
    ({"n_head": 0}, "n_head=0; it must be a positive integer"),
    ({"n_head": 3}, "n_head=3, which does not divide n_embd=32"),
    ({"n_embd": -32}, "n_embd=-32; it must be a positive integer"),
    ({"n_layer": 3}, "n_layer=3 but the weights in "),
    ({"n_layer": 1}, "hold layers 0..1"),
    ({"vocab_size": 10**12}, "more than the 1e+10 import-hf takes"),
    ({"n_positions": 2.5}, "n_positions=2.5; it must be a positive integer"),
])
def test_imported_config_sizes_get_one_line(tmp_path, capsys, changes, expected):
  from attnlab.cli import import_hf  # pylint: disable=g-import-not-at-top
  folder = _gpt2_folder(tmp_path, **changes)
  status = import_hf.main(["attnlab import-hf", str(folder), f"--workdir={tmp_path / 'run'}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, err
  assert expected in err[0], err[0]


# --------------------------------------------------------------------------------------------------
# A trained tiny run shared by the CLI cases below (each copies it before changing anything)

NW = str(REPO / "configs" / "nadaraya_watson.py")
NW_ARGS = "runlocal=True,write_plots=False"


@pytest.fixture(scope="module")
def nw_run(tmp_path_factory):
  """A runlocal Nadaraya-Watson run: 20 steps, checkpoints and evaluations at 10 and 20."""
  from attnlab import config_utils, train  # pylint: disable=g-import-not-at-top
  workdir = tmp_path_factory.mktemp("nw") / "run"
  train.train_and_evaluate(config_utils.load_config_file(f"{NW}:{NW_ARGS}"), workdir)
  return workdir


@pytest.fixture(scope="module")
def translation_run(tmp_path_factory):
  """A runlocal dates translation run (RNN seq2seq, character tokens) at its initial step 0,
  written as `attnlab train` writes a run (config, assets, checkpoint), without its training."""
  # pylint: disable=g-import-not-at-top
  from attnlab import checkpoint, config_utils, rundir, state as state_lib, tasks
  from attnlab.data import assets
  # pylint: enable=g-import-not-at-top
  workdir = tmp_path_factory.mktemp("dates") / "run"
  config = config_utils.load_config_file(f"{REPO / 'configs' / 'seq2seq.py'}:runlocal=True")
  task = tasks.build_task(config)
  task.save_assets(workdir / assets.DIRNAME)
  params = task.init(jax.random.key(0))
  tx = state_lib.make_optimizer(config.optimizer, state_lib.make_schedule(
      config.optimizer, config.num_train_steps))
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=tx.init(params))
  rundir.write_config(workdir, config)
  with checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR) as ckpt:
    ckpt.save(0, state, {"index": 0})
  return workdir


# --------------------------------------------------------------------------------------------------
# 4. A run's config.json with keys that are not config fields


@pytest.mark.slow
@pytest.mark.parametrize("key", ["__class__", "to_dict"])
def test_reserved_keys_in_a_run_config_get_one_line(nw_run, tmp_path, key):
  workdir = tmp_path / "run"
  shutil.copytree(nw_run, workdir)
  config = json.loads((workdir / "config.json").read_text())
  config["model"][key] = {"x": 1}
  (workdir / "config.json").write_text(json.dumps(config))
  result = _cli("inspect", f"--workdir={workdir}")
  assert result.returncode == 2, result.stderr
  assert _one_line(result.stderr) == (
      f"attnlab inspect: error: {workdir / 'config.json'}: config key 'model.{key}' "
      + ("is not a config field (a field name is an identifier that does not start with '_'); "
         if key.startswith("_") else "is reserved (a method of the config object); ")
      + "remove it from the config")


# --------------------------------------------------------------------------------------------------
# 5. Inputs bounded by what the model takes; decoding bounded


@pytest.mark.slow
def test_translate_refuses_an_input_longer_than_the_model_takes(translation_run, tmp_path):
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  task = analysis.load_run(translation_run).task
  limit = task.max_source_len()
  assert limit == 4 * task.src_width
  result = _cli("translate", f"--workdir={translation_run}", f"--output={tmp_path / 'a.png'}",
                "9" * 10_000, timeout=60)
  assert result.returncode == 2, result.stderr
  assert _one_line(result.stderr) == (
      f"attnlab translate: error: the input has 10000 source tokens but this model reads at most "
      f"{limit} (4 x the longest training source, {task.src_width}); shorten it or split it into "
      f"sentences")
  result = _cli("view", f"--workdir={translation_run}", f"--text={'9' * (limit + 1)}",
                f"--out={tmp_path / 'v.html'}", timeout=60)
  assert result.returncode == 2, result.stderr
  assert f"has {limit + 1} source tokens but this model reads at most {limit}" in \
      _one_line(result.stderr)


def test_translate_at_the_limit_decodes_a_bounded_number_of_steps(translation_run, tmp_path):
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  from attnlab.cli import view  # pylint: disable=g-import-not-at-top
  run = analysis.load_run(translation_run)
  limit = run.task.max_source_len()
  [t] = run.task.translate(run.params, ["1" * limit], beam_size=1)
  assert len(t.output_tokens) <= 2 * limit + 2
  assert t.weights.shape[1] == limit
  # view's teacher-forced target is bounded too (before anything runs).
  longest = run.task.max_target_len()
  with pytest.raises(errors.UserError, match=f"the target has {longest + 1} tokens with <start> "
                     f"and <end> but this model reads at most {longest}; shorten it"):
    view.view_text(run, "1 2", target="1" * (longest - 1), out=tmp_path / "v.html")


def test_weight_index_shards_stay_in_the_folder(tmp_path):
  from attnlab.interop import hf  # pylint: disable=g-import-not-at-top
  (tmp_path / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"w": "../elsewhere/model.safetensors"}}))
  with pytest.raises(errors.HFError, match="names the shard '../elsewhere/model.safetensors', "
                     "which is not a file name in"):
    hf.read_weights(tmp_path)


@pytest.mark.slow
def test_generate_and_translate_bound_their_decoding_flags(tmp_path):
  result = _cli("generate", f"--workdir={tmp_path}", "--num_tokens=1000000000", timeout=60)
  assert result.returncode == 2
  assert _one_line(result.stderr) == ("attnlab generate: error: --num_tokens must be between 1 "
                                      "and 100000, got 1000000000")
  result = _cli("translate", f"--workdir={tmp_path}", "--beam_size=100000", "hello", timeout=60)
  assert result.returncode == 2
  assert "--beam_size must be between 1 (greedy) and 64" in _one_line(result.stderr)


# --------------------------------------------------------------------------------------------------
# 6. A workdir path with '..'


@pytest.mark.slow
def test_inspect_resolves_a_workdir_with_dotdot(nw_run, tmp_path):
  shutil.copytree(nw_run, tmp_path / "run_b")
  (tmp_path / "run_a").mkdir()
  result = _cli("inspect", f"--workdir={tmp_path}/run_a/../run_b")
  assert result.returncode == 0, result.stderr
  assert "checkpoints: 10, 20 (of 20 steps; complete)\n  all complete and readable\n" in \
      result.stdout
  assert f"run: {tmp_path.resolve() / 'run_b'}\n" in result.stdout


def test_every_tool_resolves_its_path_flags(tmp_path):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  fv = tool.tool_flags("w")
  flags.DEFINE_string("export_to", None, "e", flag_values=fv)
  assert tool.parse_flags(fv, ["prog", f"--workdir={tmp_path}/a/../b",
                               f"--export_to={tmp_path}/./c//d"]) is None
  assert fv.workdir == str(tmp_path.resolve() / "b")
  assert fv.export_to == str(tmp_path.resolve() / "c" / "d")


# --------------------------------------------------------------------------------------------------
# 7. A kill between a checkpoint and its evaluation

KILL_ARGS = f"{NW_ARGS},num_train_steps=8,log_every=2,checkpoint_every=4,eval_every=4"
# kill -9 of the run right after checkpoint 4 is saved, before step 4 is evaluated.
KILL_AFTER_SAVE = """
import os, signal
from attnlab import checkpoint
_save = checkpoint.Checkpointer.save
def save(self, step, *args, **kwargs):
  _save(self, step, *args, **kwargs)
  if step == 4:
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.Checkpointer.save = save
"""


def _eval_records(workdir: pathlib.Path) -> dict[int, dict]:
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  return {r["step"]: {k: v for k, v in r.items() if k != "wall_time"}
          for r in rundir.read_metrics(workdir) if r["split"] == "eval"}


@pytest.mark.slow
def test_a_kill_between_save_and_evaluation_loses_no_record(tmp_path):
  from attnlab import config_utils, train  # pylint: disable=g-import-not-at-top
  reference = tmp_path / "reference"
  train.train_and_evaluate(config_utils.load_config_file(f"{NW}:{KILL_ARGS}"), reference)
  workdir = tmp_path / "run"
  code = (f"import sys\n{KILL_AFTER_SAVE}\nfrom attnlab import cli\n"
          f"sys.exit(cli.main(['attnlab', 'train', '--config={NW}:{KILL_ARGS}', "
          f"'--workdir={workdir}']))")
  killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
  assert killed.returncode == -9, killed.stderr
  assert (workdir / "checkpoints" / "4").is_dir() and 4 not in _eval_records(workdir)
  result = _cli("train", f"--config={NW}:{KILL_ARGS}", f"--workdir={workdir}")
  assert result.returncode == 0, result.stderr
  assert sorted(_eval_records(workdir)) == [4, 8]
  assert _eval_records(workdir) == _eval_records(reference)


# --------------------------------------------------------------------------------------------------
# 8. `sweep --summarize` over a member without its final evaluation record


@pytest.mark.slow
def test_sweep_summary_names_members_without_their_final_record(nw_run, tmp_path):
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  sweep_dir = tmp_path / "sweep"
  for seed in (0, 1):  # the shared run stands for both members: summarize reads their metrics
    shutil.copytree(nw_run, sweep_dir / f"seed={seed}")
  metrics = sweep_dir / "seed=1" / rundir.METRICS_FILE
  records = rundir.read_metrics(metrics.parent)
  metrics.write_text("".join(json.dumps(r) + "\n" for r in records
                             if not (r["split"] == "eval" and r["step"] == 20)))
  result = _cli("sweep", f"--config={NW}:{NW_ARGS}", f"--workdir={sweep_dir}", "--sweep=seed=0,1",
                "--summarize")
  assert result.returncode == 0, result.stderr
  assert _one_line(result.stderr) == (
      "attnlab sweep: warning: member seed=1 has no final evaluation record (its last evaluation "
      "is at step 10 of 20); it is left out of the summary's means")
  final = {k: v for k, v in rundir.last_records(records)["eval"].items()}
  table = result.stdout
  assert "| seeds | failed | incomplete | eval/test_mse |" in table
  row = [l for l in table.splitlines() if l.startswith("| 1 | 0 | 1 |")]
  assert row and f"{final['test_mse']:.4g}" in row[0].split("|")[4], table
  assert "`seed=1` (its last evaluation is at step 10 of 20)" in table


# --------------------------------------------------------------------------------------------------
# 10. Values of the wrong type or size in a stranger's files: one line, no traceback, no gigabytes


def _torch_case(tmp_path: pathlib.Path, case: str) -> pathlib.Path:
  storage = {"0": STORAGE.tobytes()}
  if case == "int_name":
    return _torch_file(tmp_path / "t.bin", b"\x80\x02" + _global("collections", "OrderedDict")
                       + b")R(" + _int(7) + _rebuild("0", 4, 0, (4,), (1,)) + b"u.", storage)
  if case in ("65_dims", "empty_2**63", "empty_too_big"):
    size = {"65_dims": (1,) * 65, "empty_2**63": (0, 2**63),
            "empty_too_big": (2**62, 2**62, 0)}[case]
    data = _state_dict_pickle({"w": _rebuild("0", 4, 0, size, (1,) * len(size))})
    return _torch_file(tmp_path / "t.bin", data, storage)
  # A storage member compressed with lzma or bzip2, its compressed bytes damaged.
  compression = {"lzma": zipfile.ZIP_LZMA, "bzip2": zipfile.ZIP_BZIP2}[case]
  path = tmp_path / "t.bin"
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("archive/data.pkl", _state_dict_pickle({"w": _rebuild("0", 256, 0, (256,), (1,))}))
    z.writestr("archive/data/0", np.arange(256, dtype=np.float32).tobytes(),
               compress_type=compression)
    info = z.getinfo("archive/data/0")
  data = bytearray(path.read_bytes())
  start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
  for i in range(start + 8, start + 20):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))
  return path


@pytest.mark.parametrize("case, expected", [
    ("int_name", "tensor names that are not strings: 7"),
    ("65_dims", "65 dimensions, more than the 64"),
    ("empty_2**63", "is larger than an array can be"),
    ("empty_too_big", "is larger than an array can be"),
    ("lzma", "not a readable state dict"),
    ("bzip2", "not a readable state dict"),
])
def test_torch_reader_refuses_what_numpy_cannot_hold(tmp_path, case, expected):
  from attnlab.interop import torch_pickle  # pylint: disable=g-import-not-at-top
  path = _torch_case(tmp_path, case)
  with pytest.raises(errors.TorchFileError) as info:
    torch_pickle.load_state_dict(path)
  assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def _safetensors_file(path: pathlib.Path, dtype: str, itemsize: int) -> None:
  header = json.dumps({"x": {"dtype": dtype, "shape": [4], "data_offsets": [0, 4 * itemsize]}})
  path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(4 * itemsize))


@pytest.mark.parametrize("changes, expected", [
    ({"model_type": ["gpt2"]}, "unsupported model_type ['gpt2']"),
    ({"activation_function": ["gelu"]}, "activation ['gelu'] of config.json is not supported"),
    ({"layer_norm_epsilon": "abc"}, "layer_norm_epsilon='abc'; it must be a number >= 0"),
    ({"resid_pdrop": True}, "resid_pdrop=True; it must be a number >= 0"),
    ({"attn_pdrop": float("nan")}, "attn_pdrop=nan; it must be a number >= 0"),
])
def test_imported_config_values_of_the_wrong_type_get_one_line(tmp_path, changes, expected):
  from attnlab.interop import hf  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.HFError, match=None) as info:
    hf.load_checkpoint(_gpt2_folder(tmp_path, **changes))
  assert expected in str(info.value), str(info.value)


def test_imported_config_nulls_read_as_the_defaults(tmp_path):
  from attnlab.interop import hf  # pylint: disable=g-import-not-at-top
  _, config, _ = hf.load_checkpoint(_gpt2_folder(tmp_path, layer_norm_epsilon=None,
                                                 resid_pdrop=None))
  assert config.model.layer_norm_epsilon == 1e-5 and config.model.dropout_rate == 0.0


def test_damaged_import_files_get_one_line(tmp_path):
  from attnlab.interop import hf  # pylint: disable=g-import-not-at-top
  folder = _gpt2_folder(tmp_path)
  (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
  with pytest.raises(errors.HFError, match="config.json is not valid JSON"):
    hf.read_hf_config(folder)
  (folder / "model.safetensors").rename(folder / "shard.safetensors")
  for text in (b'{"weight_map": {"a": "\xff"}}', b"[" * 100_000):
    (folder / "model.safetensors.index.json").write_bytes(text)
    with pytest.raises(errors.HFError, match="not a weight index"):
      hf.read_weights(folder)
  (folder / "model.safetensors.index.json").unlink()
  for dtype in ("F8_E4M3", "F8_E5M2"):  # in the header's dtypes, but NumPy has no float8
    _safetensors_file(folder / "model.safetensors", dtype, 1)
    with pytest.raises(errors.HFError, match="not a readable safetensors file"):
      hf.read_weights(folder)


def test_layer_indices_too_long_for_int_get_one_line(tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  from attnlab.interop import hf  # pylint: disable=g-import-not-at-top
  folder = _gpt2_folder(tmp_path)
  tensors = load_file(str(folder / "model.safetensors"))
  tensors["transformer.h." + "9" * 5000 + ".x"] = tensors["transformer.wpe.weight"][:1]
  save_file(tensors, str(folder / "model.safetensors"))
  with pytest.raises(errors.HFError, match="n_layer=2 but the weights in .* hold 3 layers"):
    hf.load_checkpoint(folder)


def test_a_forged_layer_count_is_refused_without_counting_to_it(tmp_path):
  """n_layer = 4e8 with n_embd = 1 implies 1e10 parameters, which the size check lets through;
  comparing the layers the weights hold with 0..n_layer-1 must not build that range (37 GB)."""
  import tracemalloc  # pylint: disable=g-import-not-at-top
  from attnlab.interop import hf  # pylint: disable=g-import-not-at-top
  folder = _gpt2_folder(tmp_path, n_embd=1, n_head=1, vocab_size=1, n_positions=1, n_inner=None,
                        n_layer=1_000_000)  # 94 MB before the fix: measurable, yet harmless
  tracemalloc.start()
  try:
    with pytest.raises(errors.HFError, match="n_layer=1000000 but the weights"):
      hf.load_checkpoint(folder)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 20 * 2**20, peak


def _word_level_tokenizer(folder: pathlib.Path, vocab: dict[str, int]) -> pathlib.Path:
  folder.mkdir()
  (folder / "tokenizer.json").write_text(json.dumps({
      "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
      "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
      "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
  return folder


def test_tokenizer_files_with_forged_ids_or_nesting_get_one_line(tmp_path):
  from attnlab.data import hf_tokenizer  # pylint: disable=g-import-not-at-top
  # One id of 2**32 - 1 in a 270-byte file would make a 34 GB table; 10**7 (80 MB) stands for it.
  folder = _word_level_tokenizer(tmp_path / "sparse", {"[UNK]": 0, "a": 10**7})
  with pytest.raises(errors.DataError, match="give 2 tokens with ids up to 10000000"):
    hf_tokenizer.HFTokenizer(folder)
  folder = _word_level_tokenizer(tmp_path / "nested", {"[UNK]": 0, "a": 1})
  assert len(hf_tokenizer.HFTokenizer(folder)) == 2
  (folder / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
  with pytest.raises(errors.DataError, match="tokenizer_config.json is not valid JSON"):
    hf_tokenizer.HFTokenizer(folder)


@pytest.mark.parametrize("text", [b"[1, 2]", b'{"a": "x"}', b'{"a": null}', b'{"a": "\xff"}',
                                  b"[" * 100_000],
                         ids=["list", "str", "null", "not_utf8", "nested"])
def test_damaged_sizes_file_gets_one_line(tmp_path, text):
  from attnlab.data import assets  # pylint: disable=g-import-not-at-top
  (tmp_path / assets.SIZES_FILE).write_bytes(text)
  with pytest.raises(errors.DataError, match="is damaged"):
    assets.load_sizes(tmp_path)


def test_checkpoint_meta_of_the_wrong_shape_is_a_damaged_checkpoint(tmp_path):
  from attnlab import checkpoint  # pylint: disable=g-import-not-at-top
  directory = tmp_path / checkpoint.CHECKPOINT_DIR
  (directory / "\u00b2").mkdir(parents=True)  # "²".isdigit(), but int("²") fails
  (directory / "\u0661").mkdir()  # Arabic-Indic one: int() reads it as 1, no checkpoint 1 is there
  assert checkpoint.finished_steps(tmp_path) == []
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(1, {"w": np.arange(4, dtype=np.float32)}, {"index": 0})
  assert checkpoint.finished_steps(tmp_path) == [1]
  meta_file = directory / "1" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  abstract = {"w": jax.ShapeDtypeStruct((4,), np.float32)}
  for forged in ({**meta, "tree": ["x"]}, {k: v for k, v in meta.items() if k != "data_iterator"}):
    meta_file.write_text(json.dumps(forged))
    with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
      assert "lacks the fields of a checkpoint" in ckpt.check(1)
      with pytest.raises(errors.CorruptCheckpointError, match="checkpoint step 1 is unreadable"):
        ckpt.restore(1, abstract)
  meta_file.write_text("[" * 100_000 + "]" * 100_000)
  with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
    assert "is not readable JSON (RecursionError" in ckpt.check(1)


# --------------------------------------------------------------------------------------------------
# 11. A run directory from elsewhere: metrics.jsonl lines and config.json values of the wrong type


def _hand_made_run(path: pathlib.Path, metrics: bytes = b"", spec: str = f"{NW}:{NW_ARGS}",
                   **changes) -> pathlib.Path:
  """A run directory without checkpoints: the config.json `spec` builds, with `changes`
  ({"group__key": value} for nested keys), and `metrics` as its metrics.jsonl."""
  from attnlab import config_utils, run_config, rundir  # pylint: disable=g-import-not-at-top
  config = run_config.to_jsonable(config_utils.load_config_file(spec))
  for key, value in changes.items():
    *groups, leaf = key.split("__")
    node = config
    for group in groups:
      node = node[group]
    node[leaf] = value
  path.mkdir(parents=True)
  (path / rundir.CONFIG_FILE).write_text(json.dumps(config))
  (path / rundir.METRICS_FILE).write_bytes(metrics)
  return path


def _record(step: int, split: str, **values) -> bytes:
  return json.dumps({"step": step, "split": split, "mse": 0.5, **values}).encode() + b"\n"


# Line 2 of each file (the others are good; the last one was cut short by a kill).
BAD_METRICS_LINES = {
    "not_utf8": (b'{"step": 10, "split": "eval", "mse": "\xff"}\n', "it is not UTF-8 text"),
    "step_str": (b'{"step": "x", "split": "eval"}\n', "'step' is 'x', not a step number"),
    "split_list": (b'{"step": 10, "split": ["eval"]}\n', "'split' is ['eval'], not a split name"),
    "per_seed": (b'{"step": 10, "split": "eval", "per_seed": {"mse": "x"}}\n',
                 "'per_seed' is {'mse': 'x'}, not {name: [a number per seed]}"),
    "metric_str": (b'{"step": 10, "split": "eval", "mse": "low"}\n',
                   "'mse' is 'low', not a number"),
    "metric_null": (b'{"step": 10, "split": "eval", "mse": null}\n', "'mse' is None, not a number"),
    "seeds": (b'{"step": 10, "split": "eval", "seeds": [0, "1"]}\n', "'seeds' is [0, '1'], not"),
    "list": (b"[10, 20]\n", "it is a JSON list, not a record"),
    "not_json": (b"step 10\n", "it is not JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_METRICS_LINES))
def test_bad_metrics_lines_are_named_and_never_dropped_by_a_resume(tmp_path, case):
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  line, problem = BAD_METRICS_LINES[case]
  text = _record(5, "train") + line + _record(20, "eval") + b'{"step": 25, "spl'
  workdir = _hand_made_run(tmp_path / "run", text)
  records = rundir.read_metrics(workdir)
  assert [(r["step"], r["split"]) for r in records] == [(5, "train"), (20, "eval")]
  assert rundir.is_complete(workdir, 20) and not rundir.is_complete(workdir, 30)
  assert rundir.last_records(records)["eval"]["step"] == 20
  _, problems = rundir.scan_metrics(workdir)
  assert len(problems) == 1 and problems[0].startswith(
      f"{workdir / rundir.METRICS_FILE} line 2: {problem}"), problems
  # A resume rewrites the file: it refuses, and keeps every byte, rather than drop line 2.
  with pytest.raises(errors.MetricsError, match=f"line 2: {re.escape(problem)}.*the file is "
                     "left as it is: fix or delete that line"):
    rundir.truncate_metrics(workdir, 5)
  assert (workdir / rundir.METRICS_FILE).read_bytes() == text


def test_inspect_and_sweep_summaries_name_bad_metrics_lines(tmp_path, capsys):
  from attnlab import checkpoint, sweep  # pylint: disable=g-import-not-at-top
  from attnlab.cli import inspect_run  # pylint: disable=g-import-not-at-top
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  bad = b'{"step": 20, "split": "eval", "mse": 0.1, "per_seed": {"mse": [0.1, "x"]}}\n'
  workdir = _hand_made_run(tmp_path / "run", _record(10, "eval") + bad
                           + b'{"step": "x", "split": "eval"}\n')
  status = inspect_run.main(["attnlab inspect", f"--workdir={workdir}"])
  out = capsys.readouterr().out
  assert status == 0, out
  path = workdir / rundir.METRICS_FILE
  assert (f"metrics (1 records in metrics.jsonl):\n  eval @ step 10: mse=0.5\n"
          f"  left out: {path} line 2: 'per_seed' is {{'mse': [0.1, 'x']}}, not {{name: [a number "
          f"per seed]}}\n  left out: {path} line 3: 'step' is 'x', not a step number (an int >= 0)"
          f"\ncheckpoints: none (of 20 steps; not complete)") in out
  assert sweep.final_metrics_per_seed(workdir) == [{"eval/mse": 0.5}]


@pytest.mark.parametrize("spec, changes, expected", [
    (None, {"num_train_steps": "x"}, "config key 'num_train_steps' is 'x' (str), but expects an "
     "int (like "),
    (None, {"optimizer__learning_rate": "fast"}, "config key 'optimizer.learning_rate' is 'fast' "
     "(str), but expects a number (like "),
    (None, {"runlocal": 1}, "config key 'runlocal' is 1 (int), but expects a bool (true or false)"),
    (None, {"seed": True}, "config key 'seed' is True (bool), but expects an int (like 0)"),
    (None, {"mesh__data": None}, "config key 'mesh.data' is None (NoneType), but expects an int"),
    (None, {"optimizer": [1]}, "config key 'optimizer' is [1] (list), but expects a group of "
     "fields (a JSON object)"),
    (None, {"model__kernel": {"a": 1}}, "config key 'model.kernel' is {'a': 1} (dict), but "
     "expects a string (like 'learned')"),
    ("seq2seq.py:data.name=reverse", {"data__length_bins": [5, "x"]},
     "config key 'data.length_bins[1]' is 'x' (str), but expects an int (like 5)"),
    ("transformer.py", {"model__num_heads": 2.5}, "config key 'model.num_heads' is 2.5 (float), "
     "but expects an int"),
], ids=["int", "float", "bool", "bool_for_int", "none", "group", "dict_for_str", "list_item",
        "family_field"])
def test_run_config_values_of_the_wrong_type_get_one_line(tmp_path, capsys, spec, changes,
                                                          expected):
  from attnlab import checkpoint, config_utils  # pylint: disable=g-import-not-at-top
  from attnlab.cli import inspect_run  # pylint: disable=g-import-not-at-top
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  spec = f"{REPO / 'configs' / spec}" if spec else f"{NW}:{NW_ARGS}"
  workdir = _hand_made_run(tmp_path / "run", spec=spec, **changes)
  with pytest.raises(errors.CheckpointError) as info:
    rundir.read_config(workdir)
  assert str(info.value).startswith(f"{workdir / 'config.json'}: {expected}"), str(info.value)
  assert str(info.value).endswith("; write a value of that type there")
  status = inspect_run.main(["attnlab inspect", f"--workdir={workdir}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1 and "Traceback" not in err[0], err
  assert err[0].startswith(f"attnlab inspect: error: {workdir / 'config.json'}: {expected}")
  # validate (a config built in code, not through set_value) says the same.
  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  with pytest.raises(errors.ConfigError, match=re.escape(expected)):
    config_utils.validate(config)


def test_run_config_values_that_fit_their_defaults_read(tmp_path):
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  # An int where a float is expected reads (as --config.x=1 does); a wrong type beside them does
  # not, so that this test fails where no type is checked.
  workdir = _hand_made_run(tmp_path / "a", optimizer__learning_rate=1, data__x_max=10)
  assert rundir.read_config(workdir).optimizer.learning_rate == 1
  workdir = _hand_made_run(tmp_path / "b", optimizer__learning_rate=1, data__x_max="10")
  with pytest.raises(errors.CheckpointError, match="config key 'data.x_max' is '10' \\(str\\)"):
    rundir.read_config(workdir)


# --------------------------------------------------------------------------------------------------
# 12. A wrong path in the config: refused before the run directory is made; a start that stopped
#     before its first checkpoint does not block the corrected command


BERT = str(REPO / "configs" / "bert.py")
FINETUNE = f"{BERT}:mode=finetune,runlocal=True,write_plots=False"


def _pretraining_run(path: pathlib.Path, spec: str = f"{BERT}:mode=pretrain,runlocal=True",
                     finished: bool = True) -> pathlib.Path:
  """A run directory with the config.json of `spec` and, with `finished`, a finished checkpoint at
  step 4 as orbax marks one, its final step directory (empty: the check before the workdir lists
  the finished steps, it reads no arrays)."""
  from attnlab import checkpoint, config_utils, rundir  # pylint: disable=g-import-not-at-top
  path.mkdir(parents=True)
  rundir.write_config(path, config_utils.load_config_file(spec))
  if finished:
    (path / checkpoint.CHECKPOINT_DIR / "4").mkdir(parents=True)
  return path


def _bad_init_from(tmp_path: pathlib.Path, case: str) -> str:
  path = tmp_path / "pretrain"
  if case == "file":
    path.write_text("weights")
  elif case == "no_config":
    path.mkdir()
  elif case == "bad_json":
    _pretraining_run(path)
    (path / "config.json").write_text("{")
  elif case == "other_task":
    _pretraining_run(path, f"{NW}:{NW_ARGS}")
  elif case == "other_size":
    _pretraining_run(path, f"{BERT}:mode=pretrain,runlocal=True,model.num_layers=3")
  elif case == "no_checkpoint":
    _pretraining_run(path, finished=False)
  return str(path)


@pytest.mark.parametrize("case, expected", [
    ("missing", "config.init_from={path} does not exist: give the --workdir of the run to start "
     "from, or set init_from=\"\" to start from scratch"),
    ("file", "config.init_from={path} is not a folder: "),
    ("no_config", "config.init_from={path} has no config.json, so it is not a run directory: "),
    ("bad_json", "config.init_from={path}: {path}/config.json is not valid JSON"),
    ("other_task", "config.init_from={path} is a 'regression' run; a masked_lm run is needed"),
    ("other_size", "config.init_from={path} does not fit this model: model.num_layers: 3 in the "
     "pretraining run, 2 here"),
    ("no_checkpoint", "config.init_from={path} holds no finished checkpoint (in "
     "{path}/checkpoints); let that run save one, or give another run"),
], ids=["missing", "file", "no_config", "bad_json", "other_task", "other_size", "no_checkpoint"])
def test_a_bad_init_from_is_refused_before_the_workdir_is_made(tmp_path, case, expected):
  from attnlab import config_utils, train  # pylint: disable=g-import-not-at-top
  init_from = _bad_init_from(tmp_path, case)
  config = config_utils.load_config_file(f"{FINETUNE},init_from={init_from}")
  workdir = tmp_path / "finetune"
  with pytest.raises(errors.ConfigError) as info:
    train.train_and_evaluate(config, workdir)
  assert str(info.value).startswith(expected.format(path=init_from)), str(info.value)
  assert not workdir.exists()  # no config.json, assets or lock to block the corrected command


def test_a_fitting_init_from_passes_the_early_check(tmp_path):
  from attnlab import config_utils, state  # pylint: disable=g-import-not-at-top
  config = config_utils.load_config_file(f"{FINETUNE},init_from={_pretraining_run(tmp_path / 'p')}")
  state.check_init_from(config)  # no error: the check is not stricter than the run itself


def test_bad_init_from_through_the_cli_is_one_line_and_writes_nothing(tmp_path, capsys):
  from attnlab.cli import train as train_cli  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "W"
  status = train_cli.main(["attnlab train", f"--config={FINETUNE}",
                           "--config.init_from=/tmp/does/not/exist", f"--workdir={workdir}"])
  err = _one_line(capsys.readouterr().err)
  assert status == 2 and err.startswith(
      "attnlab train: error: config.init_from=/tmp/does/not/exist does not exist"), err
  assert not workdir.exists()


def test_a_missing_manual_dir_is_refused_before_the_workdir_is_made(tmp_path):
  from attnlab import config_utils, train  # pylint: disable=g-import-not-at-top
  config = config_utils.load_config_file(f"{FINETUNE},data.manual_dir={tmp_path / 'nodata'}")
  with pytest.raises(errors.ConfigError, match=f"data.manual_dir={tmp_path / 'nodata'} does "
                     "not exist: give the folder with the raw data files"):
    train.train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_a_sweep_member_with_a_bad_init_from_is_refused_before_any_member_dir(tmp_path):
  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.UserError, match="sweep member seed=0: config.init_from=/tmp/does/"
                     "not/exist does not exist"):
    sweep.run(f"{FINETUNE},init_from=/tmp/does/not/exist", {"seed": [0, 1]},
              workdir=tmp_path / "sweep")
  assert not list((tmp_path / "sweep").glob("seed=*"))


def test_a_start_that_saved_no_checkpoint_does_not_block_the_corrected_run(tmp_path, monkeypatch):
  from attnlab import checkpoint, config_utils, rundir, tasks, train  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "run"

  def gone(self):
    raise errors.DataError("the training data is not where data.x_max says")
  with monkeypatch.context() as patch:  # a data error after the workdir is prepared
    config = config_utils.load_config_file(f"{NW}:{NW_ARGS}")
    patch.setattr(tasks.get_task(config.task), "train_iterator", gone)
    with pytest.raises(errors.DataError):
      train.train_and_evaluate(config, workdir)
  assert (workdir / rundir.CONFIG_FILE).is_file() and not checkpoint.finished_steps(workdir)
  stale = workdir / "assets" / "stale_vocabulary.json"  # the earlier config's assets
  stale.parent.mkdir(exist_ok=True)
  stale.write_text("{}")
  # The corrected command (another config) trains in the same workdir, with its own assets.
  fixed = config_utils.load_config_file(f"{NW}:{NW_ARGS},data.x_max=9.0")
  state = train.train_and_evaluate(fixed, workdir)
  assert int(state.step) == fixed.num_train_steps
  assert rundir.read_config(workdir).data.x_max == 9.0 and not stale.exists()
  # Once a checkpoint is saved, a changed config is refused as before.
  with pytest.raises(errors.ConfigMismatchError, match=r"data.x_max: 9.0 -> 8.0"):
    train.train_and_evaluate(config_utils.load_config_file(f"{NW}:{NW_ARGS},data.x_max=8.0"),
                             workdir)
