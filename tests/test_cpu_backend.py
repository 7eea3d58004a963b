"""attnlab.backends.cpu: importing attnlab changes nothing in the process; `enable` (called by the
trainer and the command-line entry points) applies the CPU tuning.

The allocator settings are observed through glibc itself: `mallinfo2` tells whether a 64 MiB
block came from a fresh `mmap` (glibc's defaults: above its largest dynamic threshold, 32 MiB)
or from the heap, and whether freeing it gave the memory back (`enable` keeps it).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from attnlab.cli import tool as main_lib
from attnlab import train
from attnlab.backends import cpu
from attnlab.config_utils import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]

# What a process looks like after importing the library: the allocator (a 64 MiB block from
# mmap, its memory returned at free), the tuning variables of os.environ, JAX's device settings
# and whether JAX started;
# after running a Dense layer and attention through it; and after cpu.enable() (the control).
_PROBE = r"""
import ctypes, json, os, sys
MODULES = ("attnlab", "attnlab.attention", "attnlab.attention.blocked", "attnlab.layers",
           "attnlab.models", "attnlab.backends", "attnlab.backends.cpu", "attnlab.parallel",
           "attnlab.train", "attnlab.cli.tool")

class MallInfo2(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
      "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def malloc_probe(size=64 << 20):
  before = libc.mallinfo2()
  p = libc.malloc(size)
  during = libc.mallinfo2()
  libc.free(p)
  after = libc.mallinfo2()
  return {"mmapped": during.hblkhd - before.hblkhd, "kept_free": after.fordblks - before.fordblks}

# the variables that tune the allocator, XLA, JAX and the thread pools (importing jax itself sets
# TF_CPP_MIN_LOG_LEVEL: not ours)
TUNING = ("MALLOC_", "GLIBC_TUNABLES", "XLA_", "JAX_", "ATTNLAB_", "OMP_", "MKL_", "OPENBLAS_")
tuning = lambda: {k: v for k, v in os.environ.items() if k.startswith(TUNING)}
environ = tuning()
import importlib
for name in MODULES:
  importlib.import_module(name)
import jax
from jax._src import xla_bridge
result = {"imported": malloc_probe(), "environ_changed": sorted(
              set(environ.items()) ^ set(tuning().items())),
          "jax_started": xla_bridge.backends_are_initialized(),
          "num_cpu_devices": jax.config.jax_num_cpu_devices}
import jax.numpy as jnp
from attnlab import layers
from attnlab.attention import core
x = jnp.ones((2, 256, 16), jnp.float32)  # [batch, len, features]: attend's blocked path
layers.Dense(16).init(jax.random.key(0), x)
jax.block_until_ready(core.attend(x, x, x, causal=True, return_weights=False)[0])
result["ran"] = malloc_probe()
from attnlab.backends import cpu
result["enabled"] = cpu.enable().allocator
result["after_enable"] = malloc_probe()
print(json.dumps(result))
"""

_GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None


def _probe(**env) -> dict:
  env = {**{k: v for k, v in os.environ.items()
            if k not in ("ATTNLAB_MALLOC_TUNING", "XLA_FLAGS")}, **env}
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, check=True, capture_output=True,
                       text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def _untouched(probe: dict) -> bool:
  return probe["mmapped"] >= 64 << 20 and probe["kept_free"] < 1 << 20


@pytest.mark.skipif(not _GLIBC, reason="glibc's malloc only")
def test_importing_attnlab_changes_nothing_in_the_process():
  """Importing attnlab and its library modules (models, layers, attention, the trainer, the
  command-line module, the CPU backend itself) leaves glibc's allocator, the environment's tuning
  variables and JAX's devices as they were, and so does running a layer and attention; cpu.enable() then
  keeps a freed 64 MiB block in the heap (the probe sees the settings when they are made)."""
  result = _probe()
  assert _untouched(result["imported"]), result
  assert result["environ_changed"] == []
  assert not result["jax_started"] and result["num_cpu_devices"] == -1  # JAX's own default
  assert _untouched(result["ran"]), result
  assert result["enabled"]
  assert result["after_enable"]["mmapped"] == 0, result
  assert result["after_enable"]["kept_free"] >= 63 << 20, result


@pytest.mark.skipif(not _GLIBC, reason="glibc's malloc only")
def test_enable_leaves_the_allocator_alone_when_told():
  result = _probe(ATTNLAB_MALLOC_TUNING="0")
  assert not result["enabled"]
  assert _untouched(result["after_enable"]), result


def test_launch_switches_the_tuning_on_before_the_tool_runs(monkeypatch):
  """Every `attnlab` command (and `python -m attnlab.cli <tool>`) ends in attnlab.cli.tool.launch: it calls
  cpu.enable() before the tool's body; a usage error returns first."""
  calls = []
  monkeypatch.setattr(cpu, "enable", lambda config=None: calls.append(("enable", config)))
  assert main_lib.launch("attnlab x", None, lambda: calls.append(("body", None))) == 0
  assert calls == [("enable", None), ("body", None)]
  calls.clear()
  assert main_lib.launch("attnlab x", "bad flag", lambda: None) == main_lib.USAGE_ERROR
  assert calls == []


class _Stop(Exception):
  pass


def test_the_trainer_enables_the_tuning_with_its_config(monkeypatch, tmp_path):
  """train_and_evaluate hands its config to cpu.enable before anything touches a device."""
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  seen = []

  def enable(config=None):
    seen.append(config)
    raise _Stop()
  monkeypatch.setattr(cpu, "enable", enable)
  config = config_utils.load_config_file(f"{REPO / 'configs' / 'nadaraya_watson.py'}:runlocal=True")
  with pytest.raises(_Stop):
    train.train_and_evaluate(config, tmp_path / "run")
  assert seen == [config]


def test_enable_refuses_a_device_count_jax_does_not_run(monkeypatch):
  """After JAX started (conftest starts it with one CPU device), an explicit mesh.cpu_devices
  other than the running count is one ConfigError; 1 and the automatic -1 keep what runs."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cpu.allocator, "keep_freed_memory", lambda: False)  # this process as it is
  config = lambda n: ml_collections.ConfigDict({"batch_size": 12, "mesh": {"cpu_devices": n}})
  assert cpu.enable(config(1)).cpu_devices is None
  assert cpu.enable(config(-1)).cpu_devices is None
  assert cpu.enable().cpu_devices is None
  with pytest.raises(ConfigError, match="mesh.cpu_devices=3 but JAX already started"):
    cpu.enable(config(3))


def test_the_xla_flag_is_added_once_and_never_over_the_users():
  """xla_flags.set_flags: on an Intel CPU, adds the YNNPACK flag to XLA_FLAGS (after the user's
  other flags), once; on another CPU only when ATTNLAB_XLA_TUNING=1; never when the user names
  the flag or XLA_FLAGS names a flags file, when ATTNLAB_XLA_TUNING=0, for a jaxlib whose
  flags were not checked, or once JAX has started."""
  flags = cpu.xla_flags
  flag = f"--{flags.YNN_FLAG}={flags.YNN_FUSION}"
  intel, amd = "GenuineIntel", "AuthenticAMD"
  env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
  assert flags.set_flags(env, (0, 10), started=False, vendor=intel) == flag
  assert env["XLA_FLAGS"] == f"--xla_cpu_enable_fast_math=false {flag}"
  assert flags.set_flags(env, (0, 10), started=False, vendor=intel) is None  # there: once
  assert env["XLA_FLAGS"] == f"--xla_cpu_enable_fast_math=false {flag}"
  env = {}
  assert flags.set_flags(env, (0, 11), started=False, vendor=intel) == flag
  assert env["XLA_FLAGS"] == flag
  env = {"ATTNLAB_XLA_TUNING": "1"}
  assert flags.set_flags(env, (0, 10), started=False, vendor=amd) == flag
  own = {"XLA_FLAGS": f"--{flags.YNN_FLAG}=dot"}
  for kept, version, started, vendor in (
      ({}, (0, 10), False, amd), ({}, (0, 10), False, ""), (own, (0, 10), False, intel),
      ({"ATTNLAB_XLA_TUNING": "0"}, (0, 10), False, intel), ({}, (0, 99), False, intel),
      ({}, (), False, intel), ({}, (0, 10), True, intel),
      ({"ATTNLAB_XLA_TUNING": "1"}, (0, 10), True, amd),
      ({"XLA_FLAGS": "/home/me/xla_flags.txt"}, (0, 10), False, intel)):  # a flags file
    before = dict(kept)
    assert flags.set_flags(kept, version, started=started, vendor=vendor) is None, (kept, vendor)
    assert kept == before


def test_cpu_vendor_reads_cpuinfo(tmp_path):
  info = tmp_path / "cpuinfo"
  info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n\n"
                  "processor\t: 1\nvendor_id\t: GenuineIntel\n")
  assert cpu.cpuinfo.vendor(str(info)) == "GenuineIntel"
  info.write_text("processor\t: 0\nmodel name\t: some CPU\n")
  assert cpu.cpuinfo.vendor(str(info)) == ""
  assert cpu.cpuinfo.vendor(str(tmp_path / "absent")) == ""


_YNN_PROBE = r"""
import json, os, re
from attnlab.backends import cpu
added = cpu.enable().xla_flag
import jax, jax.numpy as jnp, numpy as np
f = lambda x, w: (jnp.tanh(x @ w) @ w.T).sum(axis=-1)
rng = np.random.default_rng(0)
x, w = (rng.normal(size=s).astype(np.float32) for s in ((64, 128), (128, 128)))
text = jax.jit(f).lower(x, w).compile().as_text()
entry = text[text.index("ENTRY"):]
print(json.dumps({"added": added, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                  "ynn": len(re.findall(r'"kind":"__ynn_fusion"', entry)),
                  "loops": len(re.findall(r"kind=kLoop", entry)),
                  "values": np.asarray(f(x, w)).tolist()}))
"""


def test_enable_gives_ynnpack_the_matmuls_alone():
  """In a fresh process with the flag asked for (ATTNLAB_XLA_TUNING=1, what an Intel CPU gets by
  default), cpu.enable() before JAX starts adds it (and this jaxlib knows it: XLA stops a
  process on an unknown flag), and XLA:CPU then hands each of the two matmuls of
  tanh(x @ w) @ wᵀ to YNNPACK on its own, the tanh and the sum in XLA's loops; with
  ATTNLAB_XLA_TUNING=0 XLA_FLAGS stays empty. Both values equal NumPy's."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "ATTNLAB_XLA_TUNING")}
  run = lambda **extra: json.loads(subprocess.run(
      [sys.executable, "-c", _YNN_PROBE], env={**env, **extra}, check=True, capture_output=True,
      text=True).stdout.strip().splitlines()[-1])
  if cpu.xla_flags.set_flags({}, started=False, vendor="GenuineIntel") is None:
    pytest.skip("this jaxlib's flags were not checked (xla_flags.CHECKED_JAXLIB)")
  tuned, untouched = run(ATTNLAB_XLA_TUNING="1"), run(ATTNLAB_XLA_TUNING="0")
  assert untouched["added"] is None and untouched["xla_flags"] == ""
  if untouched["ynn"] == 0:
    pytest.skip("XLA:CPU uses no YNNPACK here")
  assert tuned["added"] and tuned["added"] in tuned["xla_flags"]
  assert tuned["ynn"] == 2 and tuned["loops"] >= 1, tuned
  rng = np.random.default_rng(0)
  x, w = (rng.normal(size=s).astype(np.float64) for s in ((64, 128), (128, 128)))
  expected = (np.tanh(x @ w) @ w.T).sum(axis=-1)  # [64], values of order 10-100
  for probe in (tuned, untouched):
    np.testing.assert_allclose(probe["values"], expected, rtol=1e-3, atol=1e-2)
