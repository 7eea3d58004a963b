"""What /proc/cpuinfo says about this machine's CPU: its vendor, model and instruction-set flags.

Read without importing JAX. Where there is no /proc/cpuinfo (not Linux) both are empty, and
what depends on them (the Intel XLA flag, the fused kernel's AVX-512, the bfloat16 matmuls)
stays off.
"""

from __future__ import annotations

import functools

CPUINFO = "/proc/cpuinfo"


def _field(name: str, cpuinfo: str) -> str:
  """The first value of `name` in `cpuinfo` ("" where the file or the field is absent)."""
  try:
    with open(cpuinfo, encoding="utf-8", errors="replace") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == name:
          return value.strip()
  except OSError:
    pass
  return ""


def vendor(cpuinfo: str = CPUINFO) -> str:
  """vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where there is none."""
  return _field("vendor_id", cpuinfo)


def model(cpuinfo: str = CPUINFO) -> str:
  """The first CPU's model name, spaces collapsed, or "" where there is none."""
  return " ".join(_field("model name", cpuinfo).split())


@functools.lru_cache(maxsize=8)
def flags(cpuinfo: str = CPUINFO) -> frozenset[str]:
  """The first CPU's instruction-set flags ("avx512f", "avx512_bf16", "amx_bf16", ...)."""
  return frozenset(_field("flags", cpuinfo).split())
