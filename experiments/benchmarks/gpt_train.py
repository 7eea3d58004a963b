"""GPT training and generation speed: attnlab's nano GPT beside a PyTorch GPT of the same shape.

Both train the same architecture with the same recipe on the same Tiny Shakespeare batches, timed
in alternating rounds within one process (the machine is shared, so only side-by-side numbers
mean anything); the table reports the median round of each, tokens/s and the ratio. Then
generation: tokens/s of attnlab's KV-cache sampler and of a full forward pass per token.

  pip install -e ".[torch]"           # torch (CPU) for the reference
  python experiments/benchmarks/gpt_train.py                      # nano, 6 rounds x 20 steps
  python experiments/benchmarks/gpt_train.py --rounds=10 --steps=30 --activation=gelu
  python experiments/benchmarks/gpt_train.py --profile=/tmp/gpt_profile   # where the time goes

PyTorch's OpenMP threads run with OMP_WAIT_POLICY=PASSIVE by default here: with libgomp's
default spin-waiting a PyTorch step becomes 10-30x slower whenever any other process uses a core
(measured on the shared 2-core machine), which would make the comparison meaningless there.
`--omp_wait_policy=active` measures the spinning default (fine on an idle machine).

The PyTorch model (written for this benchmark) mirrors attnlab.models.gpt.GPT at the nano size:
4 pre-LN blocks, 4 heads, d_model 128, block 64, no biases, LayerNorm eps 1e-5, learned
positions, tied LM head, GELU (tanh by default, as attnlab's), scaled_dot_product_attention with
is_causal; AdamW (betas 0.9/0.99, weight decay 0.1 on every parameter, as attnlab's trainer),
global-norm clip 1.0, warmup + cosine learning rate. Batch 12 x 64 tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


# ----------------------------------------------------------------------------- PyTorch reference


def torch_gpt(vocab_size: int, num_layers: int, num_heads: int, d_model: int, block_size: int,
              activation: str = "gelu_tanh", seed: int = 0):
  """The PyTorch reference model (same architecture and init as attnlab's GPT)."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top

  approximate = "tanh" if activation == "gelu_tanh" else "none"

  class Block(nn.Module):

    def __init__(self):
      super().__init__()
      self.ln_1 = nn.LayerNorm(d_model, eps=1e-5, bias=False)
      self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
      self.attn_out = nn.Linear(d_model, d_model, bias=False)
      self.ln_2 = nn.LayerNorm(d_model, eps=1e-5, bias=False)
      self.fc = nn.Linear(d_model, 4 * d_model, bias=False)
      self.proj = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x):
      b, t, d = x.shape
      q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)  # [b, t, d] each
      heads = lambda z: z.view(b, t, num_heads, d // num_heads).transpose(1, 2)  # [b, h, t, hd]
      y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
      x = x + self.attn_out(y.transpose(1, 2).contiguous().view(b, t, d))
      return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate=approximate))

  class GPT(nn.Module):

    def __init__(self):
      super().__init__()
      self.token = nn.Embedding(vocab_size, d_model)
      self.position = nn.Embedding(block_size, d_model)
      self.blocks = nn.ModuleList([Block() for _ in range(num_layers)])
      self.ln_f = nn.LayerNorm(d_model, eps=1e-5, bias=False)

    def forward(self, idx):
      pos = torch.arange(idx.shape[1], device=idx.device)
      x = self.token(idx) + self.position(pos)  # [b, t, d]
      for block in self.blocks:
        x = block(x)
      return self.ln_f(x) @ self.token.weight.T  # [b, t, vocab], tied head

  torch.manual_seed(seed)
  model = GPT()
  for name, p in model.named_parameters():
    if p.dim() == 2:
      std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("attn_out.weight", "proj.weight")) else 0.02
      torch.nn.init.normal_(p, 0.0, std)
  return model


def torch_trainer(model, lr: float, warmup: int, total: int, end_lr: float, weight_decay: float,
                  betas: tuple[float, float], clip: float):
  """A train-step closure step(x, y) -> loss for the PyTorch model."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top

  opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)

  def lr_at(step: int) -> float:
    if step < warmup:
      return lr * step / warmup
    frac = min((step - warmup) / max(total - warmup, 1), 1.0)
    return end_lr + 0.5 * (lr - end_lr) * (1 + math.cos(math.pi * frac))

  counter = [0]

  def step(x, y):
    for group in opt.param_groups:
      group["lr"] = lr_at(counter[0])
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    counter[0] += 1
    return loss

  return step


# ----------------------------------------------------------------------------- attnlab side


def _load_gpt_config(arg: str):
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  return config_utils.load_config_file(f"{REPO / 'configs' / 'gpt.py'}:{arg}")


def attnlab_trainer(args):
  """(config, task, step(batch) -> loss, batches) for attnlab's nano GPT through the real trainer."""
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab import tasks, train  # pylint: disable=g-import-not-at-top

  arg = f"size={args.size},model.activation={args.activation},implementation={args.implementation}"
  if args.data_dir:
    arg += f",data.manual_dir={args.data_dir}"
  config = _load_gpt_config(arg)
  task = tasks.build_task(config)
  schedule = train.make_schedule(config.optimizer, config.num_train_steps)
  tx = train.make_optimizer(config.optimizer, schedule)
  init_rng, train_rng = train.run_keys(config.seed)
  state = [train.create_train_state(task, tx, init_rng)]
  train_step = train.make_train_step(task, tx, schedule)
  iterator = task.train_iterator()
  batches = [next(iterator) for _ in range(args.steps)]

  def step(batch):
    state[0], metrics = train_step(state[0], batch, train_rng)
    return metrics["loss"]

  def run(n: int) -> None:
    loss = None
    for batch in batches[:n]:
      loss = step(batch)
    jax.block_until_ready(loss)

  return config, task, run, batches


def profile_steps(run, steps: int, directory: str) -> list[tuple[str, float]]:
  """Runs `steps` steps under jax.profiler; returns (op kind, ms per step) sorted by time."""
  import collections  # pylint: disable=g-import-not-at-top
  import glob  # pylint: disable=g-import-not-at-top
  import gzip  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  with jax.profiler.trace(directory, create_perfetto_trace=True):
    run(steps)
  path = sorted(glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True),
                key=os.path.getmtime)[-1]
  events = json.load(gzip.open(path))["traceEvents"]
  totals: collections.Counter = collections.Counter()
  for e in events:
    name = e.get("name", "")
    if e.get("ph") != "X" or name.startswith(("$", "Thunk", "Pjit", "Common", "end:")):
      continue
    totals[re.sub(r"\.\d+$", "", name)] += e["dur"]
  return [(k, v / steps / 1e3) for k, v in totals.most_common()]


# ----------------------------------------------------------------------------- generation


def generation_speed(task, num_tokens: int, repeats: int) -> dict[str, float]:
  """Tokens/s of KV-cache sampling and of a full forward pass per token (batch 1)."""
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab.models import gpt  # pylint: disable=g-import-not-at-top

  params = task.init(jax.random.key(0))
  prompt = task.encode_prompt("ROMEO:")
  out = {}
  for use_cache in (True, False):
    def once():
      res = gpt.generate(task.model, params, prompt, jax.random.key(1), num_tokens=num_tokens,
                         temperature=0.8, use_cache=use_cache)
      jax.block_until_ready(res.tokens)
    once()  # compile
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      once()
      times.append(time.perf_counter() - start)
    out["cache" if use_cache else "no_cache"] = num_tokens / statistics.median(times)
  return out


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", default="nano", help="GPT size preset (configs/gpt.py)")
  parser.add_argument("--activation", default="gelu_tanh", choices=["gelu_tanh", "gelu"],
                      help="MLP activation of both models")
  parser.add_argument("--implementation", default="auto", help="attnlab attention implementation")
  parser.add_argument("--rounds", type=int, default=6, help="alternating timing rounds")
  parser.add_argument("--steps", type=int, default=20, help="train steps per round")
  parser.add_argument("--gen_tokens", type=int, default=500, help="tokens to generate")
  parser.add_argument("--gen_repeats", type=int, default=3, help="timed generation runs")
  parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data"),
                      help="folder with tinyshakespeare/input.txt ('' = $ATTNLAB_DATA_DIR)")
  parser.add_argument("--profile", default="", help="write a jax.profiler trace here and print "
                      "the time per XLA op kind")
  parser.add_argument("--skip_torch", action="store_true", help="time attnlab only")
  parser.add_argument("--omp_wait_policy", default="passive", choices=["passive", "active", ""],
                      help="OMP_WAIT_POLICY for PyTorch's OpenMP threads (unless already set in "
                      "the environment; '' = libgomp's default). With the default spin-waiting, "
                      "PyTorch slows down 10-30x whenever another process uses a core")
  args = parser.parse_args(argv)
  if args.omp_wait_policy and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()  # read when torch loads

  config, task, jax_run, batches = attnlab_trainer(args)
  m = config.model
  batch_size, block = config.batch_size, task.block_size
  tokens_per_step = batch_size * block
  print(f"nano GPT: {task.model.num_layers} layers, {task.model.num_heads} heads, "
        f"d_model {task.model.d_model}, block {block}, batch {batch_size}, vocab "
        f"{len(task.tokenizer)}, activation {m.activation}, attention {m.implementation}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")

  runners = {"attnlab": jax_run}
  if not args.skip_torch:
    import torch  # pylint: disable=g-import-not-at-top
    opt = config.optimizer
    model = torch_gpt(len(task.tokenizer), task.model.num_layers, task.model.num_heads,
                      task.model.d_model, block, activation=m.activation)
    torch_step = torch_trainer(model, opt.learning_rate, opt.warmup_steps, config.num_train_steps,
                               opt.end_learning_rate, opt.weight_decay, (opt.b1, opt.b2),
                               opt.grad_clip)
    torch_batches = [(torch.from_numpy(b["inputs"].astype(np.int64)),
                      torch.from_numpy(b["targets"].astype(np.int64))) for b in batches]

    def torch_run(n: int) -> None:
      for x, y in torch_batches[:n]:
        torch_step(x, y)
    runners["pytorch"] = torch_run
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}")

  for run in runners.values():
    run(3)  # compile / warm up
  times: dict[str, list[float]] = {name: [] for name in runners}
  for r in range(args.rounds):
    order = list(runners) if r % 2 == 0 else list(reversed(runners))
    for name in order:
      start = time.perf_counter()
      runners[name](args.steps)
      times[name].append((time.perf_counter() - start) / args.steps)
  print(f"\ntraining, {args.rounds} alternating rounds of {args.steps} steps (median; min-max):")
  print("| implementation | ms/step | tokens/s |")
  print("|---|---|---|")
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f"| {name} | {med * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}) | "
          f"{tokens_per_step / med:,.0f} |")
  if "pytorch" in times:
    ratio = statistics.median(times["pytorch"]) / statistics.median(times["attnlab"])
    per_round = [t / a for a, t in zip(times["attnlab"], times["pytorch"])]
    print(f"speed ratio pytorch/attnlab ms per step: {ratio:.2f} (per round "
          f"{min(per_round):.2f}-{max(per_round):.2f}; > 1 means attnlab is faster)")

  if args.gen_tokens:
    speed = generation_speed(task, args.gen_tokens, args.gen_repeats)
    print(f"\ngeneration of {args.gen_tokens} tokens, batch 1 (median of {args.gen_repeats}):")
    print("| sampler | tokens/s | ms/token |")
    print("|---|---|---|")
    for name, tps in speed.items():
      label = "KV cache" if name == "cache" else "full forward pass per token"
      print(f"| {label} | {tps:,.0f} | {1e3 / tps:.2f} |")
    print(f"KV cache speed-up: {speed['cache'] / speed['no_cache']:.1f}x")

  if args.profile:
    print(f"\nattnlab train step, time per XLA op kind (profile in {args.profile}):")
    rows = profile_steps(jax_run, args.steps, args.profile)
    total = sum(ms for _, ms in rows)
    for kind, ms in rows[:15]:
      print(f"  {ms:7.2f} ms  {100 * ms / total:5.1f}%  {kind}")
    print(f"  {total:7.2f} ms  total op time per step (ops on both cores summed)")
  print(f"load average at end {os.getloadavg()[0]:.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
