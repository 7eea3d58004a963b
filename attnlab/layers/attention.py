"""Multi-head attention as a Flax module: projections, score parameters, KV cache, sowing.

The module owns its parameters and delegates the attention itself to the pure functions of
`attnlab.attention` (`attend`), so every score and implementation there is available by name.

Parameters (under the module's scope):
  query_kernel `[d_model, heads*head_dim]`, key_kernel and value_kernel `[d_kv, heads*head_dim]`
  (+ query_bias, key_bias, value_bias when use_bias), out/kernel `[heads*head_dim, out_features]`
  (+ out/bias), and `score_params` for the parametric scores
  (general: w `[heads, head_dim, head_dim]`; additive: w_q, w_k `[heads, head_dim, d_attn]`,
  v `[heads, d_attn]`; location: w `[heads, head_dim, max_len]`; cosine: beta `[heads, 1, 1]`,
  a learned key strength).

Self-attention (`inputs_kv=None`) runs the three input projections as one matmul (their kernels
concatenated), which is faster on the CPU; cross-attention projects queries and keys/values
separately.

KV cache (decode=True, self-attention only): the Flax "cache" collection holds
  cached_key, cached_value `[batch, heads, max_len, head_dim]` and cache_index `[batch]` int32.
Initialise it with `model.init(rng, tokens_of_length_max_len, decode=True)` (or
`jax.eval_shape` of it; the cache starts zeroed and is not filled by init), then call with
`decode=True, mutable=["cache"]` on chunks of any length L: the chunk's keys/values are written at
`cache_index`, the queries attend to every filled position before them (and, if causal, none after),
and cache_index advances by L. A prompt is one chunk; each generated token is one more. Every cache
leaf has a leading batch axis, so beam search can reorder it like any other state. Cross-attention
ignores `decode` (its keys are the encoder outputs, passed on every call).

Attention weights: when `sow_weights` is True, or left None and the "intermediates" collection is
mutable (e.g. `apply(..., mutable=["intermediates"])`), the reference path runs and the weights
`[batch, heads, q_len, k_len]` are sown under `intermediates/attention_weights`. Otherwise the
chosen `implementation` runs without materialising weights when it can ("auto" picks the fused
kernel for dot/scaled_dot). Attention dropout (dropout_rate > 0, training) also needs the weights,
so it runs the reference path.
Head ablation: an optional "head_mask" collection with `scale` `[heads]` and `shift`
`[heads, head_dim]` under the module's path replaces each head's context c_h (before the output
projection) by c_h * scale_h + shift_h (attnlab.analysis.ablation: scale 0 removes a head, shift
its mean output replaces it). Without that collection nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab.attention import core
from attnlab.attention import masks as masks_lib
from attnlab.attention import positional
from attnlab.attention import scores as scores_lib
from attnlab.layers.dense import Dense
from attnlab.layers.dense import default_kernel_init
from attnlab.layers.dense import matmul

Array = jax.Array
Initializer = Callable[..., Array]

# Scores a MultiHeadAttention accepts (location needs max_len). The names are checked once, where
# the config is read (config_utils.validate); a bad name given to the module directly fails in
# attnlab.attention (scores.get_score_fn, core.choose_implementation), naming the valid ones.
SCORES: tuple[str, ...] = tuple(scores_lib.SCORE_FNS)


def _write_cache(cache: Array, new: Array, index: Array) -> Array:
  """Writes new `[batch, heads, L, d]` into `[batch, heads, max_len, d]` at index `[batch]`."""
  def one(c, n, i):
    return jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (0, i, 0))
  return jax.vmap(one)(cache, new, index)


def project_kv(params: Mapping[str, Array], inputs_kv: Array, num_heads: int
               ) -> dict[str, Array]:
  """Keys/values `[batch, heads, k_len, head_dim]` of `inputs_kv` `[batch, k_len, d_kv]` under
  one MultiHeadAttention's `params`: pass the result as its `inputs_kv` to skip re-projecting."""
  out = {}
  for name in ("key", "value"):
    kernel = params[f"{name}_kernel"]  # [d_kv, inner]
    x = matmul(inputs_kv.astype(kernel.dtype), kernel)  # [batch, k_len, inner]
    if f"{name}_bias" in params:
      x = x + params[f"{name}_bias"]
    out[name] = core.split_heads(x, num_heads)  # [batch, heads, k_len, head_dim]
  return out


class MultiHeadAttention(nn.Module):
  """Multi-head attention with a score chosen by name (see the module docstring)."""
  # Number of heads.
  num_heads: int
  # Total size of the projected queries/keys/values (heads * head_dim); None: the query features.
  qkv_features: int | None = None
  # Output size; None: the query features.
  out_features: int | None = None
  # Score function name (attnlab.attention.scores.SCORE_FNS).
  score: str = "scaled_dot"
  # attend() implementation: auto, reference, xla (jax.nn.dot_product_attention) or blocked.
  implementation: str = "auto"
  # Dropout on the attention weights (training only; forces the reference path).
  dropout_rate: float = 0.0
  # Whether the projections have biases.
  use_bias: bool = True
  # Look-ahead mask: query i sees keys j <= i only (decoder self-attention).
  causal: bool = False
  # Longest key sequence (needed by the location score).
  max_len: int | None = None
  # Hidden size of the additive score (None: head_dim).
  d_attn: int | None = None
  # Rotary position encoding of queries and keys (self-attention only; positions continue from
  # the cache index when decoding).
  rotary: bool = False
  # Initial key strength of the cosine score (None: sqrt(head_dim)).
  cosine_beta: float | None = None
  # Initialiser of the query/key/value kernels.
  kernel_init: Initializer = default_kernel_init
  # Initialiser of the output kernel (GPT-2 scales it by 1/sqrt(2 * num_layers)).
  out_kernel_init: Initializer = default_kernel_init
  # Compute dtype (None: float32 parameters' dtype).
  dtype: Any = None

  def _score_params(self, head_dim: int) -> dict[str, Array] | None:
    """The score's parameters (created on first use), per head."""
    if self.score == "cosine":
      beta0 = math.sqrt(head_dim) if self.cosine_beta is None else self.cosine_beta
      return self.param("score_params",
                        lambda rng: {"beta": jnp.full((self.num_heads, 1, 1), beta0, jnp.float32)})
    if self.score not in scores_lib.PARAMETRIC_SCORES:
      return None
    if self.score == "location" and self.max_len is None:
      raise ValueError("the 'location' score needs max_len (the longest key sequence): set "
                       "MultiHeadAttention(max_len=...) / model.max_len in the config")
    return self.param("score_params", lambda rng: scores_lib.init_score_params(
        self.score, rng, head_dim, head_dim, d_attn=self.d_attn or head_dim,
        max_len=self.max_len, num_heads=self.num_heads))

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array | Mapping[str, Array] | None = None, *,
               mask: Array | None = None, deterministic: bool = True, decode: bool = False,
               sow_weights: bool | None = None) -> Array:
    """Attends from `inputs_q` `[batch, q_len, d]` to `inputs_kv` `[batch, k_len, d_kv]`.

    Args:
      inputs_q: queries' inputs `[batch, q_len, d]`.
      inputs_kv: keys'/values' inputs; None = self-attention on inputs_q; or precomputed
        {"key", "value"} `[batch, heads, k_len, head_dim]` made by `project_kv` from this
        module's parameters (cross-attention decoding: the encoder side is projected once).
      mask: bool, True = may attend, broadcastable to `[batch, heads, q_len, k_len]`
        (e.g. masks.padding_mask(lengths, k_len) `[batch, 1, 1, k_len]`). In decode mode k_len
        is the cache length max_len.
      deterministic: disables dropout (evaluation, decoding).
      decode: use and update the KV cache (self-attention only; see the module docstring).
      sow_weights: sow `intermediates/attention_weights`; None = when that collection is mutable.
    Returns:
      `[batch, q_len, out_features]`.
    """
    d_model = inputs_q.shape[-1]
    inner = self.qkv_features or d_model
    if inner % self.num_heads:
      raise ValueError(f"qkv_features={inner} must be divisible by num_heads={self.num_heads}")
    head_dim = inner // self.num_heads
    dtype = self.dtype or jnp.float32
    self_attention = inputs_kv is None
    precomputed = isinstance(inputs_kv, Mapping)  # {"key", "value"} from project_kv
    kv_dim = d_model if self_attention or precomputed else inputs_kv.shape[-1]

    # Projections. Self-attention: one [d, 3 * inner] matmul over the concatenated kernels.
    kernel = lambda n, fan_in: self.param(f"{n}_kernel", self.kernel_init, (fan_in, inner),
                                          jnp.float32)  # [fan_in, inner]
    bias = lambda n: self.param(f"{n}_bias", nn.initializers.zeros, (inner,), jnp.float32)
    x_q = inputs_q.astype(dtype)
    if self_attention:
      w = jnp.concatenate([kernel(n, d_model) for n in ("query", "key", "value")], axis=-1)
      qkv = matmul(x_q, w.astype(dtype))  # [batch, q_len, 3 * inner]
      if self.use_bias:
        qkv = qkv + jnp.concatenate([bias(n) for n in ("query", "key", "value")]).astype(dtype)
      q, k, v = jnp.split(qkv, 3, axis=-1)  # [batch, len, inner] each
    else:  # kernels before biases, query first: the parameter creation order fixes their init
      names = ("query",) if precomputed else ("query", "key", "value")
      kernels = [kernel(n, d_model if n == "query" else kv_dim) for n in names]  # [., inner]
      biases = [bias(n) for n in names] if self.use_bias else None
      q = matmul(x_q, kernels[0].astype(dtype))  # [batch, q_len, inner]
      if self.use_bias:
        q = q + biases[0].astype(dtype)
      if not precomputed:
        w_kv = jnp.concatenate(kernels[1:], axis=-1).astype(dtype)  # [d_kv, 2 * inner]
        kv = matmul(inputs_kv.astype(dtype), w_kv)  # [batch, k_len, 2 * inner]
        if self.use_bias:
          kv = kv + jnp.concatenate(biases[1:]).astype(dtype)
        k, v = jnp.split(kv, 2, axis=-1)  # [batch, k_len, inner] each

    qh = core.split_heads(q, self.num_heads)  # [batch, heads, q_len, head_dim]
    if precomputed:
      kh = inputs_kv["key"].astype(dtype)  # [batch, heads, k_len, head_dim]
      vh = inputs_kv["value"].astype(dtype)
    else:
      kh = core.split_heads(k, self.num_heads)  # [batch, heads, k_len, head_dim]
      vh = core.split_heads(v, self.num_heads)  # [batch, heads, k_len, head_dim]
    if self.rotary and self_attention:
      positions = jnp.arange(q.shape[1])  # [q_len]
      if decode and self.has_variable("cache", "cache_index"):
        positions = positions + self.get_variable("cache", "cache_index")[:, None, None]
      with jax.named_scope("rotary"):  # names its ops in profiles (benchmarks/gpt_train.py)
        qh = positional.rotary(qh, positions)  # positions [q_len] or [batch, 1, q_len]
        kh = positional.rotary(kh, positions)
    causal = self.causal
    if decode and self_attention:
      kh, vh, cache_mask = self._use_cache(kh, vh)
      if cache_mask is not None:  # None while init creates the cache: plain attention then
        mask = masks_lib.combine(mask, cache_mask)
        causal = False  # cache_mask already holds the look-ahead part
    if mask is not None:
      mask = jnp.asarray(mask)
      if mask.ndim == 3:
        mask = mask[:, None]  # [batch, 1, q_len|1, k_len]

    if sow_weights is None:
      sow_weights = self.is_mutable_collection("intermediates")
    dropout = self.dropout_rate > 0.0 and not deterministic
    params = self._score_params(head_dim)
    need_weights = bool(sow_weights) or dropout
    implementation = "reference" if need_weights else self.implementation
    context, weights = core.attend(
        qh, kh, vh, score=self.score, params=params, mask=mask, causal=causal,
        implementation=implementation, return_weights=need_weights)
    # context [batch, heads, q_len, head_dim]; weights [batch, heads, q_len, k_len] or None
    if sow_weights:
      self.sow("intermediates", "attention_weights", weights)
    if dropout:
      dropped = nn.Dropout(rate=self.dropout_rate)(weights, deterministic=False)
      context = jnp.matmul(dropped, vh.astype(dropped.dtype))  # [batch, heads, q_len, head_dim]
    if self.has_variable("head_mask", "scale"):
      # Head ablation (attnlab.analysis.ablation): each head's context * scale + shift; absent
      # unless the caller passes a "head_mask" collection, so it costs nothing otherwise.
      scale = self.get_variable("head_mask", "scale")  # [heads]
      shift = self.get_variable("head_mask", "shift")  # [heads, head_dim]
      context = (context * scale[:, None, None].astype(context.dtype)
                 + shift[:, None, :].astype(context.dtype))
    out = core.merge_heads(context.astype(dtype))  # [batch, q_len, inner]
    return Dense(self.out_features or d_model, use_bias=self.use_bias,
                 kernel_init=self.out_kernel_init, dtype=dtype, name="out")(out)

  def _use_cache(self, kh: Array, vh: Array) -> tuple[Array, Array, Array | None]:
    """Writes this chunk's keys/values into the cache; returns (keys, values, mask) to attend to.

    While the cache is being created (init), returns the chunk itself and no mask.
    """
    initialized = self.has_variable("cache", "cached_key")
    batch, heads, length, head_dim = kh.shape
    cached_key = self.variable("cache", "cached_key", jnp.zeros, kh.shape, kh.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, vh.shape, vh.dtype)
    cache_index = self.variable("cache", "cache_index", jnp.zeros, (batch,), jnp.int32)
    if not initialized:
      return kh, vh, None
    max_len = cached_key.value.shape[2]
    if cached_key.value.shape[:2] != (batch, heads) or cached_key.value.shape[3] != head_dim:
      raise ValueError(f"KV cache of shape {cached_key.value.shape} does not fit keys "
                       f"{kh.shape}; initialise the cache with the decoding batch size")
    if length > max_len:
      raise ValueError(f"a decode chunk of {length} tokens exceeds the cache length {max_len}")
    index = cache_index.value  # [batch]
    cached_key.value = _write_cache(cached_key.value, kh, index)
    cached_value.value = _write_cache(cached_value.value, vh, index)
    cache_index.value = index + length
    if self.causal:
      # key j visible to query i (absolute position index + i) iff j <= index + i
      mask = masks_lib.causal_mask(length, max_len, offset=index)  # [batch, 1, L, max_len]
    else:
      valid = jnp.arange(max_len)[None, :] < (index + length)[:, None]  # [batch, max_len]
      mask = valid[:, None, None, :]  # [batch, 1, 1, max_len]
    return cached_key.value, cached_value.value, mask
