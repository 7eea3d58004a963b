"""XLA:CPU compiler flags that attnlab sets for the process, before JAX starts.

One today: which operations XLA:CPU hands to its YNNPACK library. By default (jaxlib 0.10-0.11)
YNNPACK takes the matmuls and also fuses reductions and elementwise operations around them into
its own graphs; `individual_dot` gives it the matmuls alone and leaves the rest to XLA's own
loops. Measured on the nano GPT's training step (2 cores, experiments/benchmarks/README.md,
"Issue #51, fourth pass"): on an Intel Xeon (model 207, AVX-512 with AMX) 44.9 ms against
53.8-55.7 ms for the default, XLA's own matmuls in between (46.9-47.6 ms); on an AMD EPYC
(AVX-512) no gain: six alternating pairs within the noise, the flag 0.5 ms (1.5%) slower in their
median. So it is set on Intel CPUs only (/proc/cpuinfo's vendor_id GenuineIntel).

XLA reads its flags from the XLA_FLAGS environment variable once, when JAX starts its first
backend, and stops the process on a flag name it does not know. So the flag is added only:
  - before JAX has started (a later change would do nothing),
  - when XLA_FLAGS does not already name it (the user's value wins) and is not the name of a
    flags file (XLA reads a value that does not start with "--" as one, and stops the process
    when it cannot open it: a flag appended there would break the user's setting),
  - for the jaxlib versions where it was checked to exist (CHECKED_JAXLIB),
  - on an Intel CPU, unless ATTNLAB_XLA_TUNING says otherwise: 0 never, 1 on any CPU.
Like the allocator settings it changes the whole process, so only an entry point applies it,
through `attnlab.backends.cpu.enable`.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys

from attnlab.backends.cpu import cpuinfo

_LOG = logging.getLogger(__name__)

ENV = "ATTNLAB_XLA_TUNING"
YNN_FLAG = "xla_cpu_experimental_ynn_fusion_type"
YNN_FUSION = "individual_dot"
# (major, minor) versions of jaxlib whose XLA has YNN_FLAG and YNN_FUSION (checked by hand)
CHECKED_JAXLIB = ((0, 10), (0, 11))


def _jaxlib_version() -> tuple[int, ...]:
  """(major, minor) of the installed jaxlib, read from its metadata (nothing imported); ()
  when unknown."""
  try:
    text = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return ()
  parts = []
  for piece in text.split(".")[:2]:
    digits = "".join(c for c in piece if c.isdigit())
    if not digits:
      break
    parts.append(int(digits))
  return tuple(parts)


def backend_started(unknown: bool = True) -> bool:
  """Whether JAX has created its backends (XLA_FLAGS and the CPU device count are then fixed);
  `unknown`: the answer where this jax version cannot tell."""
  if "jax" not in sys.modules:  # JAX cannot have started
    return False
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return unknown


def set_flags(environ: dict[str, str] | None = None, jaxlib_version: tuple[int, ...] | None = None,
              started: bool | None = None, vendor: str | None = None) -> str | None:
  """Adds `--YNN_FLAG=YNN_FUSION` to XLA_FLAGS under the conditions of the module docstring;
  returns the flag added, or None when XLA_FLAGS was left as it was. `environ` (default
  os.environ), `jaxlib_version`, `started` and `vendor` (default `cpuinfo.vendor()`): for tests."""
  env = os.environ if environ is None else environ
  mode = env.get(ENV, "").strip().lower()
  if mode in ("0", "off", "false", "no"):
    return None
  if mode not in ("1", "on", "true", "yes") and (
      cpuinfo.vendor() if vendor is None else vendor) != "GenuineIntel":
    return None
  current = env.get("XLA_FLAGS", "").strip()
  if YNN_FLAG in current or (current and not current.startswith("--")):  # theirs, or a file
    return None
  version = _jaxlib_version() if jaxlib_version is None else jaxlib_version
  if tuple(version[:2]) not in CHECKED_JAXLIB:
    return None
  if backend_started() if started is None else started:
    return None
  flag = f"--{YNN_FLAG}={YNN_FUSION}"
  env["XLA_FLAGS"] = f"{current} {flag}".strip()
  _LOG.info("XLA_FLAGS += %s (YNNPACK takes the matmuls alone; ATTNLAB_XLA_TUNING=0 leaves it "
            "out)", flag)
  return flag
