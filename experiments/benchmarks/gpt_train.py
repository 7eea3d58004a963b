"""GPT training and generation speed: attnlab's nano GPT beside a PyTorch GPT of the same shape.

Both train the same architecture with the same recipe on the same Tiny Shakespeare batches. Each
runs in its own process (so neither's idle thread pool spins on the other's time) and the
timing rounds alternate between them (the machine is shared, so only side-by-side numbers mean
anything); the table reports the median round of each, tokens/s and the ratio. Then generation:
tokens/s of attnlab's KV-cache sampler and of a full forward pass per token.

  pip install -e ".[torch]"           # torch (CPU) for the reference
  python experiments/benchmarks/gpt_train.py                      # nano, 10 rounds x 20 steps
  python experiments/benchmarks/gpt_train.py --rounds=16 --steps=30 --activation=gelu
  python experiments/benchmarks/gpt_train.py --profile=/tmp/gpt_profile   # where the time goes
  python experiments/benchmarks/gpt_train.py --position=learned               # nanoGPT's positions
  python experiments/benchmarks/gpt_train.py --rounds=0 --gen_tokens=0 --twin_steps=2000
      # no timing: train the PyTorch model 2000 steps on attnlab's batches (seed 0) and print its
      # loss on attnlab's full validation set, an independent check of attnlab's training result

PyTorch runs with its default OpenMP settings. Its spin-waiting threads make a PyTorch step
10-30x slower whenever another process keeps a core busy (measured on the shared 2-core
machine); `--omp_wait_policy=passive` avoids that collapse at some cost on an idle machine.

The PyTorch model (written for this benchmark) mirrors attnlab.models.gpt.GPT at the nano size:
4 pre-LN blocks, 4 heads, d_model 128, block 64, no biases, LayerNorm eps 1e-5, rotary positions
(half-split pairs, base 10000, on queries and keys; or a learned table with --position=learned),
tied LM head, GELU (tanh by default, as attnlab's), scaled_dot_product_attention with is_causal;
AdamW (betas 0.9/0.99, weight decay 0.1 on matrices only, following the config's
optimizer.decay), global-norm clip 1.0, warmup + cosine learning rate. Batch 12 x 64 tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import statistics
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- PyTorch reference


def torch_gpt(vocab_size: int, num_layers: int, num_heads: int, d_model: int, block_size: int,
              activation: str = "gelu_tanh", position: str = "rotary", seed: int = 0):
  """The PyTorch reference model (same architecture and init as attnlab's GPT)."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top

  approximate = "tanh" if activation == "gelu_tanh" else "none"
  if position not in ("rotary", "learned"):
    raise ValueError(f"the PyTorch reference supports positions rotary and learned, not {position!r}")
  head_dim = d_model // num_heads
  half = head_dim // 2
  inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) * 2.0 / head_dim)  # [half]
  angle = torch.arange(block_size, dtype=torch.float32)[:, None] * inv_freq  # [block, half]
  cos_table, sin_table = torch.cos(angle), torch.sin(angle)

  def rotate(z):  # [b, h, t, hd]: pair (j, j + hd/2) turned by position / 10000^(2j/hd)
    t = z.shape[2]
    cos, sin = cos_table[:t], sin_table[:t]
    z1, z2 = z[..., :half], z[..., half:]
    return torch.cat([z1 * cos - z2 * sin, z2 * cos + z1 * sin], dim=-1)

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
      q, k, v = heads(q), heads(k), heads(v)
      if position == "rotary":
        q, k = rotate(q), rotate(k)
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.attn_out(y.transpose(1, 2).contiguous().view(b, t, d))
      return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate=approximate))

  class GPT(nn.Module):

    def __init__(self):
      super().__init__()
      self.token = nn.Embedding(vocab_size, d_model)
      if position == "learned":
        self.position = nn.Embedding(block_size, d_model)
      self.blocks = nn.ModuleList([Block() for _ in range(num_layers)])
      self.ln_f = nn.LayerNorm(d_model, eps=1e-5, bias=False)

    def forward(self, idx):
      x = self.token(idx)  # [b, t, d]
      if position == "learned":
        x = x + self.position(torch.arange(idx.shape[1], device=idx.device))
      for block in self.blocks:
        x = block(x)
      return self.ln_f(x) @ self.token.weight.T  # [b, t, vocab], tied head

  torch.manual_seed(seed)
  model = GPT()
  for name, p in model.named_parameters():
    if p.dim() == 2:
      residual_out = name.endswith(("attn_out.weight", "proj.weight"))
      std = 0.02 / math.sqrt(2 * num_layers) if residual_out else 0.02
      torch.nn.init.normal_(p, 0.0, std)
  return model


def torch_trainer(model, lr: float, warmup: int, total: int, end_lr: float, weight_decay: float,
                  betas: tuple[float, float], clip: float, decay: str = "matrices"):
  """A train-step closure step(x, y) -> loss for the PyTorch model.

  decay: "matrices" puts weight decay on parameters with >= 2 dims only, "all" on every one.
  """
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top

  params = list(model.parameters())
  decayed = [p for p in params if p.dim() >= 2 or decay == "all"]
  kept = [p for p in params if not (p.dim() >= 2 or decay == "all")]
  opt = torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                           {"params": kept, "weight_decay": 0.0}], lr=lr, betas=betas)

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
  """(config, task, run(n), batches): attnlab's GPT stepped by the real trainer's train step."""
  import jax  # pylint: disable=g-import-not-at-top
  from attnlab import tasks, train  # pylint: disable=g-import-not-at-top
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top
  from attnlab.backends import cpu as cpu_backend  # pylint: disable=g-import-not-at-top

  cpu_backend.enable()  # the allocator settings, as the trainer (one device: no split here)
  arg = (f"size={args.size},model.activation={args.activation},model.position={args.position},"
         f"implementation={args.implementation}")
  if args.data_dir:
    arg += f",data.manual_dir={args.data_dir}"
  config = _load_gpt_config(arg)
  task = tasks.build_task(config)
  schedule = train.make_schedule(config.optimizer, config.num_train_steps)
  tx = train.make_optimizer(config.optimizer, schedule)
  init_rng, train_rng = train.run_keys(config.seed)
  state = [state_lib.create_train_state(task, tx, init_rng)]
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

  def hlo_text() -> str:
    """The optimized HLO of the train step (maps profiled op names to model code)."""
    return train_step.lower(state[0], batches[0], train_rng).compile().as_text()

  run.hlo_text = hlo_text
  return config, task, run, batches


# where-the-time-goes categories, in table order
CATEGORIES = ("matmuls (dense layers, LM head)", "attention (score and context matmuls)",
              "softmax (attention and loss)", "layer norm", "GELU", "rotary / positions",
              "copies and transposes", "optimizer (AdamW, clip, schedule)", "other")


def _categorize(kind: str, op_name: str, rank: int) -> str:
  """Category of one XLA op from its fusion kind, its op_name metadata and its output rank."""
  import re  # pylint: disable=g-import-not-at-top
  path = op_name.split(";")[0]
  if "jvp(" not in path:
    return CATEGORIES[7]
  if kind in ("copy", "wrapped_copy", "transpose_copy_fusion", "copy_bitcast_fusion",
              "bitcast_copy_fusion") or path.endswith(("/cond", "/transpose")):
    return CATEGORIES[6]
  if re.search(r"/(ln_\d|ln_f|ln)/", path + "/"):
    return CATEGORIES[3]
  if "rotary" in path or "/embed/" in path + "/":
    return CATEGORIES[5]
  is_dot = path.endswith("dot_general") or kind == "dot" or "convolution" in kind
  if "self_attention" in path and "/out/" not in path:
    if is_dot:
      return CATEGORIES[1] if rank >= 3 else CATEGORIES[0]
    if "rope" in path or "rot" in path.rsplit("/", 1)[-1]:
      return CATEGORIES[5]
    return CATEGORIES[2]
  if is_dot:
    return CATEGORIES[0]
  if "/mlp/" in path:
    return CATEGORIES[4]
  if re.search(r"jvp\(\)|take_along_axis|log_softmax|logsumexp", path):
    return CATEGORIES[2]
  return CATEGORIES[8]


def categorize_ops(hlo_text: str, per_op: dict[str, float]) -> list[tuple[str, float]]:
  """Sums per-op ms (keyed by HLO instruction name) into CATEGORIES using the optimized HLO."""
  import re  # pylint: disable=g-import-not-at-top
  info = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\S+?)(?:\{[^}]*\})? .*?"
                 r"metadata=\{op_name=\"([^\"]*)\"", line)
    if m:
      dims = re.search(r"\[([\d,]*)\]", m.group(2))
      rank = len([d for d in dims.group(1).split(",") if d]) if dims else 0
      info[m.group(1)] = (rank, m.group(3))
  totals = dict.fromkeys(CATEGORIES, 0.0)
  for name, ms in per_op.items():
    rank, op_name = info.get(name, (0, ""))
    kind = re.sub(r"\.\d+$", "", name)
    totals[_categorize(kind, op_name, rank) if op_name else CATEGORIES[8]] += ms
  return list(totals.items())


def profile_steps(run, steps: int, directory: str) -> list[tuple[str, float]]:
  """Runs `steps` steps under jax.profiler; returns (op kind, ms per step) sorted by time.

  `profile_steps.per_op` holds the ms per step of every HLO instruction name afterwards.
  """
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
  per_op: collections.Counter = collections.Counter()
  for e in events:
    name = e.get("name", "")
    if e.get("ph") != "X" or name.startswith(("$", "Thunk", "Pjit", "Common", "end:", "Threadpool",
                                              "Slinky", "while", "conditional", "call")):
      continue
    totals[re.sub(r"\.\d+$", "", name)] += e["dur"]
    per_op[name] += e["dur"] / steps / 1e3
  profile_steps.per_op = dict(per_op)
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


# ----------------------------------------------------------------------------- workers


def _jax_worker(conn, args) -> None:
  """attnlab in its own process: builds, then answers run / generate / profile requests."""
  config, task, run, batches = attnlab_trainer(args)
  run(3)  # compile and warm up
  m = task.model
  spec = {"batches": [(b["inputs"], b["targets"]) for b in batches],
          "vocab": len(task.tokenizer), "layers": m.num_layers, "heads": m.num_heads,
          "d_model": m.d_model, "block": m.block_size, "position": m.position,
          "batch": config.batch_size, "optimizer": config.optimizer.to_dict(),
          "num_steps": config.num_train_steps, "seed": config.seed}
  if args.twin_steps:
    iterator = task.train_iterator()  # the batches of an attnlab run with the same seed
    spec["twin_batches"] = [(b["inputs"], b["targets"])
                            for b in (next(iterator) for _ in range(args.twin_steps))]
    spec["val_batches"] = [(b["inputs"], b["targets"], b["weights"]) for b in task.eval_batches()]
  conn.send(spec)
  while True:
    cmd, value = conn.recv()
    if cmd == "run":
      start = time.perf_counter()
      run(value)
      conn.send(time.perf_counter() - start)
    elif cmd == "generate":
      conn.send(generation_speed(task, value, args.gen_repeats))
    elif cmd == "profile":
      rows = profile_steps(run, args.steps, value)
      conn.send((rows, categorize_ops(run.hlo_text(), profile_steps.per_op)))
    else:
      conn.send(None)
      return


def _torch_worker(conn, args, spec) -> None:
  """The PyTorch reference in its own process (its OpenMP threads never see attnlab's)."""
  if args.omp_wait_policy:
    os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()  # read when torch loads
  import torch  # pylint: disable=g-import-not-at-top
  opt = spec["optimizer"]

  def build():
    model = torch_gpt(spec["vocab"], spec["layers"], spec["heads"], spec["d_model"],
                      spec["block"], activation=args.activation, position=spec["position"])
    step = torch_trainer(model, opt["learning_rate"], opt["warmup_steps"], spec["num_steps"],
                         opt["end_learning_rate"], opt["weight_decay"], (opt["b1"], opt["b2"]),
                         opt["grad_clip"], decay=opt.get("decay", "all"))
    return model, step

  as_long = lambda a: torch.from_numpy(np.asarray(a).astype(np.int64))
  batches = [(as_long(x), as_long(y)) for x, y in spec["batches"]]
  model, step = build()

  def run(n: int) -> None:
    for x, y in batches[:n]:
      step(x, y)

  def validate() -> float:
    """Trains a fresh model on spec["twin_batches"]; its token-weighted full validation loss."""
    import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
    fresh, fresh_step = build()
    for x, y in spec["twin_batches"]:
      fresh_step(as_long(x), as_long(y))
    total, count = 0.0, 0.0
    with torch.no_grad():
      for x, y, w in spec["val_batches"]:
        logits = fresh(as_long(x))  # [b, t, vocab]
        losses = F.cross_entropy(logits.transpose(1, 2), as_long(y), reduction="none")  # [b, t]
        total += float((losses * torch.from_numpy(w)).sum())
        count += float(w.sum())
    return total / count

  run(3)  # warm up
  conn.send(f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
            f"{os.environ.get('OMP_WAIT_POLICY', '(unset: libgomp default)')}")
  while True:
    cmd, value = conn.recv()
    if cmd == "run":
      start = time.perf_counter()
      run(value)
      conn.send(time.perf_counter() - start)
    elif cmd == "validate":
      conn.send(validate())
    else:
      conn.send(None)
      return


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", default="nano", help="GPT size preset (configs/gpt.py)")
  parser.add_argument("--activation", default="gelu_tanh", choices=["gelu_tanh", "gelu"],
                      help="MLP activation of both models")
  parser.add_argument("--implementation", default="auto", help="attnlab attention implementation")
  parser.add_argument("--position", default="rotary", choices=["rotary", "learned"],
                      help="position encoding of both models")
  parser.add_argument("--twin_steps", type=int, default=0,
                      help="also train the PyTorch model this many steps on attnlab's batches "
                      "and print its full validation loss (0: skip)")
  parser.add_argument("--rounds", type=int, default=10, help="alternating timing rounds")
  parser.add_argument("--steps", type=int, default=20, help="train steps per round")
  parser.add_argument("--gen_tokens", type=int, default=500, help="tokens to generate")
  parser.add_argument("--gen_repeats", type=int, default=3, help="timed generation runs")
  parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data"),
                      help="folder with tinyshakespeare/input.txt ('' = $ATTNLAB_DATA_DIR)")
  parser.add_argument("--profile", default="", help="write a jax.profiler trace here and print "
                      "the time per XLA op kind")
  parser.add_argument("--skip_torch", action="store_true", help="time attnlab only")
  parser.add_argument("--omp_wait_policy", default="", choices=["passive", "active", ""],
                      help="OMP_WAIT_POLICY of the PyTorch process ('' = libgomp's default)")
  args = parser.parse_args(argv)

  import multiprocessing  # pylint: disable=g-import-not-at-top
  ctx = multiprocessing.get_context("spawn")
  workers = {}
  jax_conn, child = ctx.Pipe()
  workers["attnlab"] = (ctx.Process(target=_jax_worker, args=(child, args)), jax_conn)
  workers["attnlab"][0].start()
  spec = jax_conn.recv()
  tokens_per_step = spec["batch"] * spec["block"]
  print(f"GPT {args.size}: {spec['layers']} layers, {spec['heads']} heads, d_model "
        f"{spec['d_model']}, block {spec['block']}, batch {spec['batch']}, vocab {spec['vocab']}, "
        f"activation {args.activation}, attention {args.implementation}; {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at start")
  print("attnlab and PyTorch each run in their own process; rounds alternate between them")
  if not args.skip_torch:
    torch_conn, child = ctx.Pipe()
    workers["pytorch"] = (ctx.Process(target=_torch_worker, args=(child, args, spec)), torch_conn)
    workers["pytorch"][0].start()
    print(torch_conn.recv())

  if args.twin_steps and args.skip_torch:
    parser.error("--twin_steps needs the PyTorch model; drop --skip_torch")
  times: dict[str, list[float]] = {name: [] for name in workers}
  for r in range(args.rounds):
    order = list(workers) if r % 2 == 0 else list(reversed(workers))
    for name in order:
      conn = workers[name][1]
      conn.send(("run", args.steps))
      times[name].append(conn.recv() / args.steps)
  if args.rounds:
    print(f"\ntraining, {args.rounds} alternating rounds of {args.steps} steps (median; min-max):")
    print("| implementation | ms/step | tokens/s |")
    print("|---|---|---|")
    for name, ts in times.items():
      med = statistics.median(ts)
      print(f"| {name} | {med * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}) | "
            f"{tokens_per_step / med:,.0f} |")
  if "pytorch" in times and args.rounds:
    ratio = statistics.median(times["pytorch"]) / statistics.median(times["attnlab"])
    per_round = [t / a for a, t in zip(times["attnlab"], times["pytorch"])]
    print(f"speed ratio pytorch/attnlab ms per step: {ratio:.2f} (per round "
          f"{min(per_round):.2f}-{max(per_round):.2f}; > 1 means attnlab is faster)")
  if args.twin_steps:
    workers["pytorch"][1].send(("validate", None))
    print(f"\nPyTorch model after {args.twin_steps} steps on attnlab's seed-{spec['seed']} "
          f"batches: full validation loss {workers['pytorch'][1].recv():.4f}")
  if "pytorch" in workers:
    workers["pytorch"][1].send(("stop", None))
    workers["pytorch"][1].recv()

  if args.gen_tokens:
    jax_conn.send(("generate", args.gen_tokens))
    speed = jax_conn.recv()
    print(f"\ngeneration of {args.gen_tokens} tokens, batch 1 (median of {args.gen_repeats}):")
    print("| sampler | tokens/s | ms/token |")
    print("|---|---|---|")
    for name, tps in speed.items():
      label = "KV cache" if name == "cache" else "full forward pass per token"
      print(f"| {label} | {tps:,.0f} | {1e3 / tps:.2f} |")
    print(f"KV cache speed-up: {speed['cache'] / speed['no_cache']:.1f}x")

  if args.profile:
    jax_conn.send(("profile", args.profile))
    rows, categories = jax_conn.recv()
    print(f"\nattnlab train step, time per XLA op kind (profile in {args.profile}):")
    total = sum(ms for _, ms in rows)
    for kind, ms in rows[:15]:
      print(f"  {ms:7.2f} ms  {100 * ms / total:5.1f}%  {kind}")
    print(f"  {total:7.2f} ms  total op time per step (ops on both cores summed)")
    print(f"\nwhere the time goes ({args.position} positions; op time per step, from the "
          "HLO op_name metadata of each profiled op):")
    print("| part | ms/step | share |")
    print("|---|---|---|")
    cat_total = sum(ms for _, ms in categories)
    for name, ms in categories:
      print(f"| {name} | {ms:.2f} | {100 * ms / max(cat_total, 1e-9):.1f}% |")
    print(f"| total op time | {cat_total:.2f} | 100% |")
  jax_conn.send(("stop", None))
  jax_conn.recv()
  for process, _ in workers.values():
    process.join()
  print(f"load average at end {os.getloadavg()[0]:.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
