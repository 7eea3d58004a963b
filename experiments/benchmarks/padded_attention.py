"""Attention over padded batches: the fused CPU kernel against attnlab's tile loops, side by side.

  python experiments/benchmarks/padded_attention.py [--seq=512,1024] [--batch=8] [--heads=8]
      [--head-dim=64] [--reps=6]

Each batch element keeps a random number of its S keys (S/4..S, seed 0) and hides the rest with
a padding mask `[batch, 1, 1, S]`, as BERT's and the long-range classifiers' batches do; not
causal, float32. Contenders: `fused` is `blocked_attention` as `attend()` calls it (on an AVX-512
CPU the fused kernel of attnlab.backends.cpu.fused_kernel, which skips each row's padded keys at the
end), `loops` the same call with the one-device tiles given explicitly (the pure-JAX tile loops,
which skip the key tiles the mask hides completely). Forward and forward+backward (gradient of the
sum), best of --reps calls after a warm-up, the contenders' order rotating from round to round;
the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.attention import blocked
from attnlab.backends import cpu as cpu_backend
from attnlab.backends.cpu import fused_kernel


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seq", default="512,1024")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--reps", type=int, default=6)
  args = p.parse_args()
  cpu_backend.enable()  # the allocator settings, as the trainer and `attnlab` commands
  b, h, d = args.batch, args.heads, args.head_dim
  print(f"padded attention: B={b} H={h} D={d} float32, best of {args.reps}; fused kernel: "
        f"{fused_kernel.unavailable_reason() or 'available'}")
  print("load average before: %.2f %.2f %.2f" % os.getloadavg())
  print("|    S |    pass | fused ms | loops ms | fused speed-up |")
  print("|------|---------|----------|----------|----------------|")
  for s in (int(x) for x in args.seq.split(",")):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, h, s, d), dtype=np.float32)) for _ in range(3))
    lengths = rng.integers(s // 4, s + 1, size=(b, 1, 1, 1))
    mask = jnp.asarray(np.arange(s)[None, None, None, :] < lengths)
    settings = {"fused": {}, "loops": {"tiles": blocked.ONE_DEVICE_TILES}}
    calls = {}
    for name, kw in settings.items():
      attend = lambda q, k, v, kw=kw: blocked.blocked_attention(q, k, v, mask=mask, **kw)
      calls[name] = {
          "fwd": jax.jit(attend),
          "fwd+bwd": jax.jit(jax.grad(lambda q, k, v, f=attend: jnp.sum(f(q, k, v)),
                                      argnums=(0, 1, 2)))}
    for pass_ in ("fwd", "fwd+bwd"):
      times = {name: [] for name in calls}
      for name in calls:  # warm-up: compile
        jax.block_until_ready(calls[name][pass_](q, k, v))
      names = list(calls)
      for round_ in range(args.reps):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
          start = time.perf_counter()
          jax.block_until_ready(calls[name][pass_](q, k, v))
          times[name].append(time.perf_counter() - start)
      fused, loops = (1e3 * min(times[n]) for n in ("fused", "loops"))
      print(f"| {s:4d} | {pass_:>7} | {fused:8.1f} | {loops:8.1f} | {loops / fused:13.2f}x |")
  print("load average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
  main()
