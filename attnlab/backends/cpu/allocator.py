"""Process memory allocator settings that keep XLA:CPU's large buffers in the heap.

XLA:CPU takes each call's temporary buffers from malloc and frees them when the call ends. With
glibc's defaults, buffers of a few MiB come from fresh `mmap`s or are trimmed back to the system at
`free`, so every call faults their pages in again; the cost shows once a call's buffers outgrow
the trim threshold (measured: causal linear attention's forward+backward at 4096 tokens, 4 heads,
took 64 ms with the defaults and 42 ms with these settings, at 1024 tokens 10.6 against 11.2 ms;
experiments/benchmarks/README.md). They change the whole process, so only an entry point applies
them, through `attnlab.backends.cpu.enable` (the trainer, every `attnlab` command; `import
attnlab` leaves the allocator alone): malloc then serves allocations of up to 1 GiB from its heap
and keeps freed memory for the next call (a process's resident memory stays at its peak instead
of shrinking). Both thresholds must move together: either one alone disables glibc's own
adjustment of the other and measured twice as slow. ATTNLAB_MALLOC_TUNING=0 leaves the allocator
alone; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ENV = "ATTNLAB_MALLOC_TUNING"
# mallopt(3) parameters of glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# allocations up to this size come from the heap; freed heap memory above it is returned
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1

_applied: bool | None = None


def keep_freed_memory(environ: dict[str, str] | None = None) -> bool:
  """Applies the settings above (once per process); returns whether they are in effect."""
  global _applied
  if _applied is not None:
    return _applied
  env = os.environ if environ is None else environ
  _applied = False
  if env.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
    return False
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: no mallopt thresholds
      return False
    _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                    and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
  except (OSError, AttributeError):
    _applied = False
  return _applied
