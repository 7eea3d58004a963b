"""GPT-style decoder-only language model, and text generation with a KV cache.

Model: token + position embeddings -> `num_layers` pre-LN causal TransformerBlocks -> final
LayerNorm -> logits through the transposed token table (the LM head is tied to the embedding).
Residual-output kernels start at std 0.02 / sqrt(2 * num_layers) (GPT-2). mlp_ratio = 0 builds
an attention-only GPT (no MLP, no ln_2 in the blocks), as the circuit studies use.

Hook sites (attnlab.layers.hooks; their public names and shapes: attnlab.analysis.hooks.SITES):
"embedded" (the embeddings' output) and "resid_final" (the final LayerNorm's output, what the
unembedding reads) here, the blocks' and attention layers' own below them.

Attention: `attention` (an attnlab.attention.config.AttentionConfig, the config's
`model.attention` subtree: mechanism and its options, score, implementation, normaliser, kv
heads, talking heads) goes whole to every block's MultiHeadAttention, which asks
attnlab.attention.registry what a mechanism supports. `position` alibi / t5_bias add a bias to
the scores instead of a position table (T5's table is one `t5_bias` parameter shared by the
layers), so the model runs at lengths past block_size.

Generation (`generate`) runs through `attnlab.decoding.sample` (temperature 0 = greedy) with a
step function over one of two states:

- KV cache (use_cache=True): the prompt minus its last token fills the cache in one call (a
  prefill); each step then feeds one token, so it costs one position, not the whole prefix. The
  learned position table has `block_size` rows, so when the cache is full the last
  `keep` tokens (default block_size // 2) are re-encoded into a fresh cache and generation goes
  on: each new token then sees between `keep` and block_size - 1 earlier tokens. For a small
  model the prefill and the refills are one forward pass of max(keep, prompt length - 1) tokens
  in the step's program (run at the first step, and when a row's cache is full), so the program
  compiles one chunk's pass, not two: 0.5 s less of a nano GPT's 3 s to its first sampled
  token. A model whose extra tokens would cost more (PREFILL_IN_STEP_FLOPS: GPT-2 small with a
  short prompt) keeps the prefill before the loop.
- No cache (use_cache=False): every step runs the full forward pass over the last block_size
  tokens (the sliding window of nanoGPT's sampler).

While prompt + generated tokens fit in block_size the two give identical logits, hence
identical tokens under greedy decoding (tests/test_gpt.py checks); beyond it their contexts
differ as described.

Interventions (attnlab.layers.hooks; `generate(..., interventions=tree)`, built and checked by
attnlab.analysis.hooks.generate_with_hooks) apply to every forward pass of either state: with
the cache, an edited key or value is what the cache stores, so later steps read the edit as the
full forward pass would; greedy decoding then gives the tokens of the uncached loop.

A mechanism without KV-cache decoding in its registry entry (e.g. bigbird) generates without
the cache by default (`use_cache=None`); asking for the cache with it is a clear error.

Prompts of different lengths go in one batch (a ragged batch): each row is padded after its
tokens, every cache row writes and counts positions from its own length, and rows restart their
full caches independently, so each row is continued as it would be alone.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnlab import decoding
from attnlab import models as models_lib
from attnlab import precision
from attnlab.errors import ConfigError
from attnlab.attention.config import AttentionConfig
from attnlab.layers import Embeddings
from attnlab.layers import LayerNorm
from attnlab.layers import POSITION_BIASES
from attnlab.layers import POSITIONS
from attnlab.layers import T5_NUM_BUCKETS
from attnlab.layers import TransformerBlock
from attnlab.layers import get_activation
from attnlab.layers import hooks

Array = jax.Array


def size_config(name: str) -> dict[str, int]:
  """The hyperparameters of size `name`; raises ValueError listing the valid sizes."""
  return models_lib.size_config("gpt", name)


class GPT(nn.Module):
  """Decoder-only Transformer: tokens `[batch, len]` -> next-token logits `[batch, len, vocab]`."""
  # Number of token ids.
  vocab_size: int
  # Number of Transformer blocks.
  num_layers: int = 4
  # Attention heads per block.
  num_heads: int = 4
  # Residual stream width.
  d_model: int = 128
  # Longest context (rows of the position table, cache length).
  block_size: int = 64
  # MLP hidden size = mlp_ratio * d_model (0: no MLP, an attention-only GPT).
  mlp_ratio: int = 4
  # Dropout on embeddings and residual branches (training only).
  dropout_rate: float = 0.0
  # Dropout on the attention weights (training only; forces the reference attention path).
  attention_dropout_rate: float = 0.0
  # The attention config, handed whole to every block (attnlab.attention.config).
  attention: AttentionConfig = AttentionConfig()
  # Position encoding: learned, sinusoidal, rotary, none, alibi, t5_bias (score biases: the
  # model then runs at any length, past block_size).
  position: str = "learned"
  # MLP activation: gelu_tanh, gelu, relu.
  activation: str = "gelu_tanh"
  # Biases in Dense layers and LayerNorms (nanoGPT's recipe: none).
  use_bias: bool = False
  # LayerNorm epsilon (GPT-2: 1e-5).
  layer_norm_epsilon: float = 1e-5
  # Compute dtype (None: float32).
  dtype: Any = None

  def setup(self):
    check_config(self)
    init = nn.initializers.normal(stddev=0.02)
    out_init = nn.initializers.normal(stddev=0.02 / math.sqrt(2 * self.num_layers))
    bias = self.position if self.position in POSITION_BIASES else None
    self.embed = Embeddings(self.vocab_size, self.d_model, self.block_size,
                            position="none" if bias else self.position,
                            dropout_rate=self.dropout_rate, embedding_init=init, dtype=self.dtype)
    # T5's relative-bias table, shared by every layer (as in T5).
    self.t5_table = (self.param("t5_bias", _init_t5_table, T5_NUM_BUCKETS, self.num_heads)
                     if bias == "t5_bias" else None)  # [num_buckets, heads]
    self.blocks = [
        TransformerBlock(
            num_heads=self.num_heads, mlp_dim=self.mlp_ratio * self.d_model,
            dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
            attention=self.attention, causal=True,
            norm_position="pre", activation=self.activation, use_bias=self.use_bias,
            layer_norm_epsilon=self.layer_norm_epsilon, max_len=self.block_size,
            rotary=self.position == "rotary", position_bias=bias, mechanism_seed=i, kernel_init=init, out_kernel_init=out_init,
            dtype=self.dtype, name=f"block_{i}")
        for i in range(self.num_layers)]
    self.ln_f = LayerNorm(epsilon=self.layer_norm_epsilon, use_bias=self.use_bias, dtype=self.dtype)

  def __call__(self, tokens: Array, *, deterministic: bool = True, decode: bool = False,
               sow_weights: bool | None = None) -> Array:
    """tokens `[batch, len]` -> logits `[batch, len, vocab]` (float32).

    deterministic: False enables dropout (needs a "dropout" rng).
    decode: KV-cache mode (see the module docstring and init_cache); len may be 1 or a chunk.
    sow_weights: sow every block's attention weights (None: when "intermediates" is mutable).
    """
    x = self.embed(tokens, deterministic=deterministic, decode=decode)  # [batch, len, d]
    x = hooks.hook(self, "embedded", x)  # [batch, len, d]
    for block in self.blocks:
      x = block(x, deterministic=deterministic, decode=decode, sow_weights=sow_weights,
                t5_table=self.t5_table)
    x = self.ln_f(x)  # [batch, len, d]
    x = hooks.hook(self, "resid_final", x)  # [batch, len, d]
    return self.embed.attend(x).astype(jnp.float32)  # [batch, len, vocab]


def _init_t5_table(rng: Array, num_buckets: int, num_heads: int) -> Array:
  from attnlab.attention import positions  # pylint: disable=g-import-not-at-top
  return positions.init_t5_table(rng, num_buckets, num_heads)  # [num_buckets, heads]


def check_config(model: GPT) -> None:
  """Raises ValueError (listing the valid choices) for a GPT that cannot be built.

  The attention config is checked by attnlab.attention.registry.validate (where the config is
  read, and again by each attention layer).
  """
  get_activation(model.activation)
  if model.position not in POSITIONS + POSITION_BIASES:
    raise ValueError(f"unknown position encoding {model.position!r}; valid: "
                     f"{', '.join(POSITIONS + POSITION_BIASES)}")
  model.attention.kv_heads(model.num_heads)  # ValueError unless num_kv_heads divides num_heads
  for name in ("vocab_size", "num_layers", "num_heads", "d_model", "block_size"):
    if getattr(model, name) < 1:
      raise ValueError(f"{name} must be >= 1, got {getattr(model, name)}")
  if model.mlp_ratio < 0:
    raise ValueError(f"mlp_ratio must be >= 0 (0: no MLP, attention-only), got {model.mlp_ratio}")
  if model.d_model % model.num_heads:
    raise ValueError(f"d_model={model.d_model} must be divisible by num_heads={model.num_heads}")
  if not model.layer_norm_epsilon > 0:
    raise ValueError(f"layer_norm_epsilon must be > 0, got {model.layer_norm_epsilon}")
  for name in ("dropout_rate", "attention_dropout_rate"):
    if not 0.0 <= getattr(model, name) < 1.0:
      raise ValueError(f"{name} must be in [0, 1), got {getattr(model, name)}")


def from_config(model_cfg: Any, vocab_size: int) -> GPT:
  """The GPT of `config.model`: size preset, explicit dims (0 = from the size) and options.

  Keys an imported checkpoint's config adds (absent = the default): model.layer_norm_epsilon
  (1e-5) and model.vocab_size (0 = the tokenizer's size, `vocab_size`); model.dtype (float32)
  is the compute dtype (attnlab.precision).
  """
  dims = models_lib.config_dims("gpt", model_cfg)
  fields = ("mlp_ratio", "dropout_rate", "attention_dropout_rate", "position", "activation",
            "use_bias")
  try:
    model = GPT(vocab_size=vocab_size, **dims, **{key: model_cfg[key] for key in fields},
                attention=models_lib.attention_config(model_cfg),
                layer_norm_epsilon=model_cfg.get("layer_norm_epsilon", 1e-5),
                dtype=precision.compute_dtype(model_cfg, "gpt"))
    check_config(model)
  except ValueError as e:
    raise ConfigError(f"config.model: {e}") from None
  return model


# ------------------------------------------------------------------------------ fine-tuning

# Top-level parameters that are the embeddings: the token table (also the tied output layer),
# the learned position table (both under "embed") and T5's shared relative-bias table.
EMBEDDING_PARAMS = ("embed", "t5_bias")


def frozen_mask(params: Any, *, embeddings: bool, layers: int) -> Any:
  """A pytree like `params` (a GPT's, or several replicas' with a leading axis): True at the
  embeddings (EMBEDDING_PARAMS) when `embeddings`, and at every parameter of blocks 0 ..
  layers - 1 (the lowest `layers`); False elsewhere (the upper blocks, the final LayerNorm)."""
  def frozen(path, leaf) -> bool:
    del leaf
    top = str(getattr(path[0], "key", path[0]))
    if top in EMBEDDING_PARAMS:
      return embeddings
    return top.startswith("block_") and int(top[len("block_"):]) < layers
  return jax.tree_util.tree_map_with_path(frozen, params)


def check_freeze_layers(layers: int, num_layers: int) -> None:
  """ConfigError for a finetune.freeze_layers the model cannot honour (configs/gpt.py)."""
  if not 0 <= layers <= num_layers:
    raise ConfigError(f"finetune.freeze_layers={layers} must be between 0 and the model's "
                      f"{num_layers} blocks (0: none frozen)")


# ------------------------------------------------------------------------------ KV cache


def supports_cache(model: GPT) -> bool:
  """Whether the model's attention mechanism supports KV-cache decoding (its registry entry)."""
  from attnlab.attention import registry  # pylint: disable=g-import-not-at-top
  return bool(registry.get_mechanism(model.attention.mechanism).supports.cache)


def init_cache(model: GPT, batch_size: int) -> Any:
  """A zeroed KV cache (the "cache" collection) for `batch_size` sequences of block_size."""
  tokens = jnp.zeros((batch_size, model.block_size), jnp.int32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, decode=True))["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _variables(params: Any, interventions: Any = None, **collections: Any) -> dict[str, Any]:
  """The variables of an apply: params, an "interventions" collection when one is given."""
  out = {"params": params, **collections}
  if interventions:
    out[hooks.INTERVENTIONS] = interventions
  return out


def decode_chunk(model: GPT, params: Any, cache: Any, tokens: Array,
                 interventions: Any = None) -> tuple[Array, Any]:
  """Feeds `tokens` `[batch, L]` after what the cache holds: (logits `[batch, L, vocab]`, cache).
  interventions: an "interventions" collection (attnlab.layers.hooks) applied to the chunk."""
  logits, variables = model.apply(_variables(params, interventions, cache=cache), tokens,
                                  decode=True, mutable=["cache"])
  return logits, variables["cache"]


# rows [batch, len] with entry i[b] of row b set to token[b].
_set_at = jax.vmap(lambda row, i, token: row.at[i].set(token))


def _rows_where(rows: Array, new: Any, old: Any) -> Any:
  """`new` in the batch rows where `rows` `[batch]` is True, else `old` (trees, batch first)."""
  return jax.tree.map(lambda a, b: jnp.where(rows.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                      new, old)


def _set_cache_lengths(cache: Any, lengths: Array) -> Any:
  """The cache with every row's write index and position counter at `lengths` `[batch]`: what
  follows overwrites the padding a shorter prompt left in the cache after its own tokens."""
  def set_leaf(path, leaf):
    name = getattr(path[-1], "key", None)
    return lengths.astype(leaf.dtype) if name in ("cache_index", "position") else leaf
  return jax.tree_util.tree_map_with_path(set_leaf, cache)


# A prompt's prefill runs in the refill's pass of max(keep, context) tokens (one chunk pass less
# to compile: 0.5 s of a nano GPT's first sample on 2 CPU cores) when the tokens it adds to the
# context cost at most this many FLOPs (2 per parameter and token: milliseconds on a CPU core).
# A nano GPT's 27 extra tokens are 0.04 GFLOP; GPT-2 small's ~500 are 125 GFLOP (0.5 s a call on
# 2 CPU cores), so it keeps a prefill of its own.
PREFILL_IN_STEP_FLOPS = 2e9


def _prefill_in_step(params: Any, keep: int, context: int) -> bool:
  """Whether `generate` fills a context of `context` tokens in the refill's pass (see above)."""
  extra = max(0, keep - context)
  return 2 * sum(x.size for x in jax.tree.leaves(params)) * extra <= PREFILL_IN_STEP_FLOPS


def _cached_step_fn(model: GPT, params: Any, keep: int, width: int, interventions: Any = None):
  """step_fn(state, token) for decoding.sample; state {cache, window, length, prefill}. One
  forward pass of `width` (>= keep) tokens refills a full cache and, for the rows whose
  `prefill` is set, fills the prompt's context at the first step."""
  block = model.block_size

  def rebuild(state):
    """A fresh cache of each chosen row's first window tokens, `length` of them: a row whose
    cache is full restarts from its last `keep` tokens, a row at its first step (`prefill`)
    takes its prompt's context; the others are left as they are (a ragged batch fills its rows
    at different steps). The pass runs over `width` tokens; what follows a row's `length`
    is overwritten, never attended (as after a ragged prompt's prefill)."""
    full = state["length"] >= block  # [batch]
    window = state["window"]  # [batch, block]
    kept = jnp.zeros_like(window).at[:, :keep].set(window[:, block - keep:])
    window = jnp.where(full[:, None], kept, window)
    length = jnp.where(full, keep, state["length"])
    fresh = jax.tree.map(jnp.zeros_like, state["cache"])
    _, cache = decode_chunk(model, params, fresh, window[:, :width], interventions)
    rebuilt = {"cache": _set_cache_lengths(cache, length), "window": window, "length": length,
               "prefill": jnp.zeros_like(state["prefill"])}
    return _rows_where(full | state["prefill"], rebuilt, state)

  def step_fn(state, token):
    chosen = jnp.any((state["length"] >= block) | state["prefill"])
    state = jax.lax.cond(chosen, rebuild, lambda s: s, state)
    logits, cache = decode_chunk(model, params, state["cache"], token[:, None],
                                 interventions)  # [batch, 1, vocab]
    n = state["length"]  # [batch]
    window = _set_at(state["window"], n, token)  # [batch, block]
    return logits[:, 0], {"cache": cache, "window": window, "length": n + 1,
                          "prefill": state["prefill"]}, ()

  return step_fn


def _uncached_step_fn(model: GPT, params: Any, interventions: Any = None):
  """step_fn(state, token) running the full forward pass over the last block_size tokens."""
  block = model.block_size

  def step_fn(state, token):
    window, n = state["window"], state["length"]  # [batch, block], [batch]
    full = n >= block  # [batch]
    window = jnp.where(full[:, None], jnp.roll(window, -1, axis=1), window)  # drop the oldest
    n = jnp.where(full, n - 1, n)
    window = _set_at(window, n, token)  # [batch, block]
    logits = model.apply(_variables(params, interventions), window)  # [batch, block, vocab]
    last = jnp.take_along_axis(logits, n[:, None, None], axis=1)[:, 0]  # [batch, vocab]
    return last, {"window": window, "length": n + 1}, ()

  return step_fn


@functools.partial(jax.jit, static_argnames=("model", "num_tokens", "top_k", "top_p",
                                             "use_cache", "keep", "end_id", "banned_ids",
                                             "prefill_in_step"))
def _generate(model: GPT, params: Any, prompt: Array, lengths: Array, rng: Array,
              temperature: Array, *, num_tokens: int, top_k: int | None, top_p: float | None,
              use_cache: bool, keep: int, end_id: int | None,
              banned_ids: tuple[int, ...] = (), interventions: Any = None,
              prefill_in_step: bool = False) -> decoding.Decoded:
  """prompt `[batch, len]`: row b's tokens first, lengths[b] of them, then padding.
  prefill_in_step: the cache takes the prompt's context in the refill's pass
  (`_prefill_in_step`)."""
  batch, length = prompt.shape
  # The last token of each prompt is its first input; the tokens before it are its context.
  start = jnp.take_along_axis(prompt, (lengths - 1)[:, None], axis=1)[:, 0]  # [batch]
  context = prompt[:, :-1]  # [batch, len - 1]: a shorter row's tail here is overwritten later
  window = jnp.zeros((batch, model.block_size), jnp.int32).at[:, :length - 1].set(context)
  state = {"window": window, "length": lengths - 1}
  if use_cache:
    cache = init_cache(model, batch)
    # The context's cache filled at the first step, in the refill's pass (`_cached_step_fn`), or
    # before the loop in a pass of its own (a model for which keep tokens cost more).
    in_step = length > 1 and prefill_in_step
    if length > 1 and not in_step:
      _, cache = decode_chunk(model, params, cache, context, interventions)
      cache = _set_cache_lengths(cache, lengths - 1)
    state.update(cache=cache, prefill=(lengths > 1) & in_step)
    width = max(keep, length - 1) if in_step else keep
    step_fn = _cached_step_fn(model, params, keep, width, interventions)
  else:
    step_fn = _uncached_step_fn(model, params, interventions)
  return decoding.sample(step_fn, state, start, rng, num_steps=num_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, end_id=end_id,
                         banned_ids=banned_ids)


def generate(model: GPT, params: Any, prompt: Any, rng: Array, *, num_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             use_cache: bool | None = None, keep: int | None = None,
             end_id: int | None = None, banned_ids: Any = (),
             interventions: Any = None) -> decoding.Decoded:
  """Continues each prompt row by `num_tokens` tokens (jit-compiled, one scan).

  Args:
    model, params: a GPT and its parameters.
    prompt: int token ids `[batch, len]` (or `[len]`), or a list of prompts of any lengths
      >= 1 (a ragged batch: each row is continued as if it were alone). Only the last
      block_size tokens of each are used.
    rng: JAX key for sampling.
    num_tokens: tokens to generate.
    temperature: 0 = greedy; otherwise softmax(logits / temperature) after top-k/top-p.
    top_k, top_p: optional filters (decoding.filter_logits).
    use_cache: KV-cache decoding or a full forward pass per token; None: the cache when the
      attention mechanism supports it (`supports_cache`).
    keep: tokens kept when the cache is full (default block_size // 2; 1 <= keep < block_size).
    end_id: stop a row at this token (the rest is padding 0).
    banned_ids: token ids never sampled (special tokens the training text never holds).
    interventions: an "interventions" collection (attnlab.layers.hooks) applied to every
      forward pass: the prefill, each step, each cache refill (or each uncached step);
      attnlab.analysis.hooks.generate_with_hooks builds and checks it from Interventions.
  Returns:
    decoding.Decoded with tokens `[batch, num_tokens]`.
  """
  if use_cache is None:
    use_cache = supports_cache(model)
  elif use_cache and not supports_cache(model):
    raise ConfigError(f"mechanism {model.attention.mechanism!r} does not support KV-cache "
                      f"decoding; "
                      f"generate without it (use_cache=False, attnlab generate --nouse_cache)")
  prompt, lengths = _prompt_rows(prompt, model.block_size)
  keep = model.block_size // 2 if keep is None else int(keep)
  if not 1 <= keep < model.block_size:
    raise ValueError(f"keep must be in [1, block_size={model.block_size}), got {keep}")
  if isinstance(temperature, (int, float)) and not temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
  return _generate(model, params, prompt, lengths, rng, jnp.asarray(temperature, jnp.float32),
                   num_tokens=int(num_tokens), top_k=top_k, top_p=top_p, use_cache=use_cache,
                   keep=keep, end_id=end_id, banned_ids=tuple(sorted(int(i) for i in banned_ids)),
                   interventions=interventions or None,
                   prefill_in_step=_prefill_in_step(params, keep, prompt.shape[1] - 1))


def _prompt_rows(prompt: Any, block_size: int) -> tuple[Array, Array]:
  """(prompts `[batch, len]` padded after their tokens, lengths `[batch]`) of a `generate` prompt:
  an array `[batch, len]` or `[len]`, or a list of 1-D prompts; each cropped to its last
  block_size tokens."""
  nested = isinstance(prompt, (list, tuple)) and any(np.ndim(row) for row in prompt)
  if nested:
    rows = [np.asarray(row, np.int32) for row in prompt]
  else:
    array = np.asarray(prompt, np.int32)
    if array.ndim not in (1, 2):
      raise ValueError(f"prompt must be token ids [batch, len] or [len], or a list of prompts; "
                       f"got shape {array.shape}")
    rows = [array] if array.ndim == 1 else list(array)
  for i, row in enumerate(rows):
    if row.ndim != 1 or row.size < 1:
      raise ValueError(f"prompt {i} must be a non-empty list of token ids; got shape "
                       f"{row.shape}. An empty text prompt can start from a newline")
  rows = [row[-block_size:] for row in rows]
  lengths = np.array([len(row) for row in rows], np.int32)
  padded = np.zeros((len(rows), lengths.max()), np.int32)
  for i, row in enumerate(rows):
    padded[i, :len(row)] = row
  return jnp.asarray(padded), jnp.asarray(lengths)
