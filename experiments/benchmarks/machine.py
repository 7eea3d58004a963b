"""The machine a benchmark ran on, for its header: figures from different CPUs are not compared.

  cpu_line() -> "CPU: Intel(R) Xeon(R) Processor ... x 2; AVX-512: yes (bf16: no); AMX: no"
               (x N: the cores this process may run on; "x 2 of 16" under `taskset -c 0,1`)
  uptime()   -> `uptime`'s line (the load a figure was measured under)
"""

from __future__ import annotations

import os
import subprocess

from attnlab.backends.cpu import cpuinfo


def cores() -> str:
  """"N": the CPUs this process may run on; "N of M" where that is fewer than the machine has."""
  total = os.cpu_count() or 1
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:  # no affinity call on this platform
    usable = total
  return str(usable) if usable == total else f"{usable} of {total}"


def cpu_line(path: str = cpuinfo.CPUINFO) -> str:
  """The CPU model (/proc/cpuinfo's model name), the cores in use (`cores`), and the AVX-512
  (with AVX512_BF16) and AMX flags; the platform's processor name where /proc/cpuinfo is
  absent."""
  model, flags = cpuinfo.model(path), cpuinfo.flags(path)
  if not model and not flags:
    import platform  # pylint: disable=g-import-not-at-top
    return f"CPU: {platform.processor() or platform.machine()} x {cores()}"
  yes = lambda b: "yes" if b else "no"
  return (f"CPU: {model or 'unknown'} x {cores()}; AVX-512: {yes('avx512f' in flags)} "
          f"(bf16: {yes('avx512_bf16' in flags)}); AMX: {yes('amx_tile' in flags)}")


def uptime() -> str:
  """`uptime`'s line; the load averages alone where the command is missing."""
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
  except OSError:
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
  print(cpu_line())
