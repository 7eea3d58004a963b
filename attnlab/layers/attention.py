"""Multi-head attention as a Flax module: projections, score parameters, KV cache, sowing.

The module owns its parameters and delegates the attention itself to the pure functions of
`attnlab.attention` (`attend`), so every score and implementation there is available by name.

Parameters (under the module's scope):
  query_kernel `[d_model, heads*head_dim]`, key_kernel and value_kernel
  `[d_kv, kv_heads*head_dim]` (kv_heads = num_kv_heads, = heads unless grouped-query)
  (+ query_bias, key_bias, value_bias when use_bias), out/kernel `[heads*head_dim, out_features]`
  (+ out/bias), and `score_params` for the parametric scores
  (general: w `[heads, head_dim, head_dim]`; additive: w_q, w_k `[heads, head_dim, d_attn]`,
  v `[heads, d_attn]`; location: w `[heads, head_dim, max_len]`; cosine: beta `[heads, 1, 1]`,
  a learned key strength); talking_heads_logits and talking_heads_weights `[heads, heads]`
  (talking heads); t5_bias `[num_buckets, heads]` (position_bias="t5_bias" without a shared
  table); normalizer_params (softmax_sink: sink `[heads]`); mechanism_params (the mechanism's
  own, e.g. Linformer's projections).

Heads. Grouped-query attention (Ainslie et al. 2023; `num_kv_heads` < num_heads, 1 = multi-query,
Shazeer 2019): keys and values are projected to num_kv_heads heads and each group of
num_heads // num_kv_heads query heads shares one (query head h reads kv head
h // (num_heads // num_kv_heads)); the kv heads are repeated to the query heads only when
attending, so the KV cache holds kv heads only. Talking heads (Shazeer et al. 2020): the logits
are mixed across heads by a learned `[heads, heads]` matrix before the normaliser and the
weights by another after it, l'_g = sum_h l_h P_hg, w'_g = sum_h w_h Q_hg (reference path; both
start at the identity, i.e. as multi-head attention).

Position biases (self-attention): `position_bias` "alibi" (Press et al. 2022, fixed per-head
slopes) or "t5_bias" (Raffel et al. 2020, learned per-head bias of the bucketed relative distance;
the table is the `t5_table` argument when the model shares one across layers, as T5 does, else
this module's own) are added to the scores, computed for the actual lengths (so they extrapolate
past the training length) and, when decoding, for the absolute positions of the cache.
Normalisers (`normalizer`) and mechanisms (`mechanism`) come from attnlab.attention by name: the
layer asks the mechanism registry what a mechanism supports and never branches on its name.

Self-attention (`inputs_kv=None`) runs the three input projections as one matmul (their kernels
concatenated), which is faster on the CPU; cross-attention projects queries and keys/values
separately.

KV cache (decode=True, self-attention only): the Flax "cache" collection holds
  cached_key, cached_value `[batch, kv_heads, max_len, head_dim]` and cache_index `[batch]` int32.
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
Hook sites (attnlab.layers.hooks; the public names in attnlab.analysis.hooks): "q" `[batch,
heads, q_len, head_dim]`, "k", "v" `[batch, kv_heads, k_len, head_dim]` (after rotary, before the
KV cache; a precomputed cross-attention's keys/values are not sites), "pattern" `[batch, heads,
q_len, k_len]` (the weights; cached or edited, they are formed on the reference path, and edited
ones make the context weights @ values), "z" `[batch, q_len, heads, head_dim]` (each head's context
before the output projection, after head_mask).
Head ablation: an optional "head_mask" collection with `scale` `[heads]` and `shift`
`[heads, head_dim]` under the module's path replaces each head's context c_h (before the output
projection) by c_h * scale_h + shift_h (attnlab.analysis.ablation: scale 0 removes a head, shift
its mean output replaces it). Without that collection nothing changes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnlab.attention import core
from attnlab.attention import masks as masks_lib
from attnlab.attention import normalizers
from attnlab.attention import positions as positions_lib
from attnlab.attention import registry
from attnlab.attention import scores as scores_lib
from attnlab.attention.config import AttentionConfig
from attnlab.layers import hooks
from attnlab.layers.dense import Dense
from attnlab.layers.dense import default_kernel_init
from attnlab.layers.dense import matmul

Array = jax.Array
Initializer = Callable[..., Array]

# Scores a MultiHeadAttention accepts (location needs max_len). The names are checked once, where
# the config is read (config_utils.validate); a bad name given to the module directly fails in
# attnlab.attention (scores.get_score_fn, core.choose_implementation), naming the valid ones.
SCORES: tuple[str, ...] = tuple(scores_lib.SCORE_FNS)
# Position biases added to the self-attention scores (attnlab.attention.positions).
POSITION_BIASES: tuple[str, ...] = positions_lib.POSITION_BIASES
# Buckets of the T5 relative position bias (Raffel et al. 2020: 32 buckets, max distance 128).
T5_NUM_BUCKETS = positions_lib.T5_NUM_BUCKETS


def _write_cache(cache: Array, new: Array, index: Array) -> Array:
  """Writes new `[batch, heads, L, d]` into `[batch, heads, max_len, d]` at index `[batch]`."""
  def one(c, n, i):
    # start indices of one dtype, the index's: a literal 0 is int64 under jax_enable_x64
    zero = jnp.zeros_like(i)
    return jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (zero, i, zero))
  return jax.vmap(one)(cache, new, index)


def project_kv(params: Mapping[str, Array], inputs_kv: Array, num_heads: int
               ) -> dict[str, Array]:
  """Keys/values `[batch, kv_heads, k_len, head_dim]` of `inputs_kv` `[batch, k_len, d_kv]` under
  one MultiHeadAttention's `params` (num_heads query heads; the kv heads follow from the kernel
  sizes): pass the result as its `inputs_kv` to skip re-projecting."""
  head_dim = params["query_kernel"].shape[-1] // num_heads
  out = {}
  for name in ("key", "value"):
    kernel = params[f"{name}_kernel"]  # [d_kv, kv_inner]
    x = matmul(inputs_kv.astype(kernel.dtype), kernel)  # [batch, k_len, kv_inner]
    if f"{name}_bias" in params:
      x = x + params[f"{name}_bias"]
    out[name] = core.split_heads(x, kernel.shape[-1] // head_dim)  # [b, kv_heads, k_len, hd]
  return out


def repeat_kv_heads(x: Array, num_heads: int) -> Array:
  """`[batch, kv_heads, len, d]` -> `[batch, num_heads, len, d]`: kv head g serves query heads
  g * group .. (g + 1) * group - 1, group = num_heads // kv_heads (grouped-query attention)."""
  kv_heads = x.shape[-3]
  if kv_heads == num_heads:
    return x
  if kv_heads < 1 or num_heads % kv_heads:
    raise ValueError(f"{kv_heads} key/value heads cannot serve {num_heads} query heads: the "
                     f"query heads must be a multiple of them (num_kv_heads dividing num_heads)")
  return jnp.repeat(x, num_heads // kv_heads, axis=-3)  # [batch, heads, len, d]


def _decode_rows(call: Callable[..., Any], q: Array, k: Array, v: Array, mask: Array,
                 bias: Array | None, offset: Array, need_weights: bool
                 ) -> tuple[Array, Array | None]:
  """A mechanism on a decode chunk of L > 1 queries `[batch, heads, L, d]` against the cache,
  one query at a time (lax.map): each query's mask `[batch, 1|heads, 1, max_len]` is then a key
  mask, which every mechanism takes (the kernelised ones refuse per-query masks)."""
  rows = lambda x: None if x is None else jnp.moveaxis(
      jnp.broadcast_to(x, x.shape[:-2] + (q.shape[2], x.shape[-1]))[..., None, :], -3, 0)
  def one(args):
    i, q_i, mask_i, bias_i = args  # q_i [batch, heads, 1, d]; mask_i [batch, 1|h, 1, max_len]
    return call(q_i, k, v, mask=mask_i, bias=bias_i, q_offset=offset + i)
  context, weights = jax.lax.map(one, (jnp.arange(q.shape[2]), rows(q), rows(mask),
                                       rows(bias)))  # [L, batch, heads, 1, d | max_len]
  context = jnp.moveaxis(context[..., 0, :], 0, -2)  # [batch, heads, L, d]
  if need_weights:
    weights = jnp.moveaxis(weights[..., 0, :], 0, -2)  # [batch, heads, L, max_len]
  return context, weights


def forms_scores(mechanism: registry.Mechanism) -> bool:
  """Whether a mechanism forms the full `[q_len, k_len]` score matrix (talking heads mix it)."""
  return mechanism.supports.scores_matrix


def mix_heads(x: Array, mix: Array) -> Array:
  """Talking heads: `[batch, heads, q, k]` mixed across heads, out_g = sum_h x_h mix[h, g]."""
  return jnp.einsum("bhqk,hg->bgqk", x, mix.astype(x.dtype))  # [batch, heads, q_len, k_len]


class MultiHeadAttention(nn.Module):
  """Multi-head attention with a score chosen by name (see the module docstring)."""
  # Number of (query) heads.
  num_heads: int
  # Total size of the projected queries (heads * head_dim); None: the query features.
  qkv_features: int | None = None
  # Output size; None: the query features.
  out_features: int | None = None
  # What it computes: mechanism and its options, score, implementation, normaliser, kv heads,
  # talking heads (attnlab.attention.config; passed whole from the model config).
  attention: AttentionConfig = AttentionConfig()
  # Dropout on the attention weights (training only; forces the reference path).
  dropout_rate: float = 0.0
  # Whether the projections have biases.
  use_bias: bool = True
  # Look-ahead mask: query i sees keys j <= i only (decoder self-attention).
  causal: bool = False
  # Longest key sequence (needed by the location score and Linformer's projections).
  max_len: int | None = None
  # Hidden size of the additive score (None: head_dim).
  d_attn: int | None = None
  # Rotary position encoding of queries and keys (self-attention only; positions continue from
  # the cache index when decoding).
  rotary: bool = False
  # Initial key strength of the cosine score (None: sqrt(head_dim)).
  cosine_beta: float | None = None
  # Score bias of the self-attention: None, "alibi" or "t5_bias" (attnlab.attention.positions).
  position_bias: str | None = None
  # Seed of the mechanism's fixed random draws (Performer's features, BigBird's random blocks).
  mechanism_seed: int = 0
  # Initialiser of the query/key/value kernels.
  kernel_init: Initializer = default_kernel_init
  # Initialiser of the output kernel (GPT-2 scales it by 1/sqrt(2 * num_layers)).
  out_kernel_init: Initializer = default_kernel_init
  # Compute dtype (None: float32 parameters' dtype).
  dtype: Any = None

  @property
  def kv_heads(self) -> int:
    """Number of key/value heads (attention.num_kv_heads, 0 meaning num_heads)."""
    return self.attention.kv_heads(self.num_heads)

  def _score_params(self, head_dim: int) -> dict[str, Array] | None:
    """The score's parameters (created on first use), per head."""
    if self.attention.score == "cosine":
      beta0 = math.sqrt(head_dim) if self.cosine_beta is None else self.cosine_beta
      return self.param("score_params",
                        lambda rng: {"beta": jnp.full((self.num_heads, 1, 1), beta0, jnp.float32)})
    if self.attention.score not in scores_lib.PARAMETRIC_SCORES:
      return None
    if self.attention.score == "location" and self.max_len is None:
      raise ValueError("the 'location' score needs max_len (the longest key sequence): set "
                       "MultiHeadAttention(max_len=...) / model.max_len in the config")
    return self.param("score_params", lambda rng: scores_lib.init_score_params(
        self.attention.score, rng, head_dim, head_dim, d_attn=self.d_attn or head_dim,
        max_len=self.max_len, num_heads=self.num_heads))

  def _mechanism_options(self) -> dict[str, Any]:
    """The mechanism's options as keyword arguments, with the seed of its random draws."""
    return {**self.attention.option_values(), "rng_seed": self.mechanism_seed}

  def _position_bias(self, q_len: int, k_len: int, offset: Array | None,
                     t5_table: Array | None) -> Any:
    """The additive score bias, or None without a position bias: a lazy positions.AlibiBias /
    T5Bias (the blocked kernel computes it per tile) for queries at 0..q_len-1, an array
    `[batch, heads, q_len, k_len]` for queries at a cache offset `[batch]` (decoding)."""
    if self.position_bias is None:
      return None
    if self.position_bias == "alibi":
      if offset is None:
        return positions_lib.AlibiBias(positions_lib.alibi_slopes(self.num_heads))
      return positions_lib.alibi_bias(q_len, k_len, self.num_heads, causal=self.causal,
                                      q_offset=offset)  # [batch, heads, q_len, k_len]
    if self.position_bias == "t5_bias":
      if t5_table is None:  # this layer's own table
        t5_table = self.param("t5_bias", lambda rng: positions_lib.init_t5_table(
            rng, T5_NUM_BUCKETS, self.num_heads))  # [num_buckets, heads]
      if offset is None:
        return positions_lib.T5Bias(t5_table, bidirectional=not self.causal)
      return positions_lib.t5_bias(t5_table, q_len, k_len, bidirectional=not self.causal,
                                   q_offset=offset)  # [batch, heads, q_len, k_len]
    raise ValueError(f"unknown position_bias {self.position_bias!r}; valid: "
                     f"{', '.join(POSITION_BIASES)}")

  def _normalizer_params(self) -> Any:
    if self.attention.normalizer == "softmax":
      return None
    init = lambda rng: normalizers.init_normalizer_params(self.attention.normalizer, rng, self.num_heads)
    if jax.eval_shape(init, jax.random.key(0)) is None:
      return None
    return self.param("normalizer_params", init)

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Array | Mapping[str, Array] | None = None, *,
               mask: Array | None = None, deterministic: bool = True, decode: bool = False,
               sow_weights: bool | None = None, t5_table: Array | None = None) -> Array:
    """Attends from `inputs_q` `[batch, q_len, d]` to `inputs_kv` `[batch, k_len, d_kv]`.

    Args:
      inputs_q: queries' inputs `[batch, q_len, d]`.
      inputs_kv: keys'/values' inputs; None = self-attention on inputs_q; or precomputed
        {"key", "value"} `[batch, kv_heads, k_len, head_dim]` made by `project_kv` from this
        module's parameters (cross-attention decoding: the encoder side is projected once).
      mask: bool, True = may attend, broadcastable to `[batch, heads, q_len, k_len]`
        (e.g. masks.padding_mask(lengths, k_len) `[batch, 1, 1, k_len]`). In decode mode k_len
        is the cache length max_len.
      deterministic: disables dropout (evaluation, decoding).
      decode: use and update the KV cache (self-attention only; see the module docstring).
      sow_weights: sow `intermediates/attention_weights`; None = when that collection is mutable.
      t5_table: a T5 relative-bias table `[num_buckets, heads]` shared across layers
        (position_bias="t5_bias"); None: this module's own.
    Returns:
      `[batch, q_len, out_features]`.
    """
    d_model = inputs_q.shape[-1]
    inner = self.qkv_features or d_model
    if inner % self.num_heads:
      raise ValueError(f"qkv_features={inner} must be divisible by num_heads={self.num_heads}")
    head_dim = inner // self.num_heads
    kv_heads = self.kv_heads
    kv_inner = kv_heads * head_dim
    dtype = self.dtype or jnp.float32
    self_attention = inputs_kv is None
    precomputed = isinstance(inputs_kv, Mapping)  # {"key", "value"} from project_kv
    kv_dim = d_model if self_attention or precomputed else inputs_kv.shape[-1]
    mechanism = registry.get_mechanism(self.attention.mechanism)
    self._check_mechanism(mechanism, decode and self_attention)

    # Projections. Self-attention: one [d, inner + 2 * kv_inner] matmul over the concatenated
    # kernels.
    size = lambda n: inner if n == "query" else kv_inner
    kernel = lambda n, fan_in: self.param(f"{n}_kernel", self.kernel_init, (fan_in, size(n)),
                                          jnp.float32)  # [fan_in, inner | kv_inner]
    bias = lambda n: self.param(f"{n}_bias", nn.initializers.zeros, (size(n),), jnp.float32)
    x_q = inputs_q.astype(dtype)
    if self_attention:
      w = jnp.concatenate([kernel(n, d_model) for n in ("query", "key", "value")], axis=-1)
      qkv = matmul(x_q, w.astype(dtype))  # [batch, q_len, inner + 2 * kv_inner]
      if self.use_bias:
        qkv = qkv + jnp.concatenate([bias(n) for n in ("query", "key", "value")]).astype(dtype)
      q, k, v = jnp.split(qkv, [inner, inner + kv_inner], axis=-1)  # [batch, len, inner|kv_inner]
    else:  # kernels before biases, query first: the parameter creation order fixes their init
      names = ("query",) if precomputed else ("query", "key", "value")
      kernels = [kernel(n, d_model if n == "query" else kv_dim) for n in names]
      biases = [bias(n) for n in names] if self.use_bias else None
      q = matmul(x_q, kernels[0].astype(dtype))  # [batch, q_len, inner]
      if self.use_bias:
        q = q + biases[0].astype(dtype)
      if not precomputed:
        w_kv = jnp.concatenate(kernels[1:], axis=-1).astype(dtype)  # [d_kv, 2 * kv_inner]
        kv = matmul(inputs_kv.astype(dtype), w_kv)  # [batch, k_len, 2 * kv_inner]
        if self.use_bias:
          kv = kv + jnp.concatenate(biases[1:]).astype(dtype)
        k, v = jnp.split(kv, 2, axis=-1)  # [batch, k_len, kv_inner] each

    qh = core.split_heads(q, self.num_heads)  # [batch, heads, q_len, head_dim]
    if precomputed:
      kh = inputs_kv["key"].astype(dtype)  # [batch, kv_heads, k_len, head_dim]
      vh = inputs_kv["value"].astype(dtype)
    else:
      kh = core.split_heads(k, kv_heads)  # [batch, kv_heads, k_len, head_dim]
      vh = core.split_heads(v, kv_heads)  # [batch, kv_heads, k_len, head_dim]
    offset = None  # absolute position of the first query ([batch]) when decoding
    if decode and self_attention and self.has_variable("cache", "cache_index"):
      offset = self.get_variable("cache", "cache_index")  # [batch]
    if self.rotary and self_attention:
      positions = jnp.arange(q.shape[1])  # [q_len]
      if offset is not None:
        positions = positions + offset[:, None, None]  # [batch, 1, q_len]
      with jax.named_scope("rotary"):  # names its ops in profiles (benchmarks/gpt_train.py)
        qh = positions_lib.rotary(qh, positions)  # positions [q_len] or [batch, 1, q_len]
        kh = positions_lib.rotary(kh, positions)
    # Hook sites (attnlab.layers.hooks; nothing unless cached or intervened on): after rotary,
    # before the KV cache and the repeat of kv heads.
    qh = hooks.hook(self, "q", qh, positions_axis=2, heads_axis=1)  # [batch, heads, q_len, hd]
    if not precomputed:
      kh = hooks.hook(self, "k", kh, positions_axis=2, heads_axis=1)  # [batch, kv_heads, k, hd]
      vh = hooks.hook(self, "v", vh, positions_axis=2, heads_axis=1)  # [batch, kv_heads, k, hd]
    causal = self.causal
    if decode and self_attention:
      kh, vh, cache_mask = self._use_cache(kh, vh)  # [batch, kv_heads, max_len, head_dim]
      if cache_mask is not None:  # None while init creates the cache: plain attention then
        mask = masks_lib.combine(mask, cache_mask)
        causal = False  # cache_mask already holds the look-ahead part
    if mask is not None:
      mask = jnp.asarray(mask)
      if mask.ndim == 3:
        mask = mask[:, None]  # [batch, 1, q_len|1, k_len]
    kh = repeat_kv_heads(kh, self.num_heads)  # [batch, heads, k_len, head_dim]
    vh = repeat_kv_heads(vh, self.num_heads)  # [batch, heads, k_len, head_dim]
    score_bias = None
    if self_attention:
      score_bias = self._position_bias(qh.shape[2], kh.shape[2], offset,
                                       t5_table)  # [(batch,) heads, q_len, k_len]

    if sow_weights is None:
      sow_weights = self.is_mutable_collection("intermediates")
    dropout = self.dropout_rate > 0.0 and not deterministic
    params = self._score_params(head_dim)
    norm_params = self._normalizer_params()
    hook_pattern = hooks.active(self, "pattern")  # cached or edited: the weights are formed
    need_weights = bool(sow_weights) or dropout or hook_pattern
    if self.attention.talking_heads:
      context, weights = self._talking_heads(qh, kh, vh, params=params, mask=mask, causal=causal,
                                             bias=score_bias, normalizer_params=norm_params)
    else:
      options = self._mechanism_options()
      mech_params = self._mechanism_params(mechanism, head_dim, self.max_len or kh.shape[2],
                                           options)
      call = functools.partial(
          mechanism.fn, causal=causal, params=mech_params, return_weights=need_weights,
          score=self.attention.score, score_params=params, normalizer=self.attention.normalizer,
          normalizer_params=norm_params, topk=self.attention.topk,
          implementation="reference" if need_weights else self.attention.implementation, **options)
      if offset is None:
        context, weights = call(qh, kh, vh, mask=mask, bias=score_bias)
      elif qh.shape[2] == 1 or forms_scores(mechanism):
        # [batch]: the queries' first absolute position
        context, weights = call(qh, kh, vh, mask=mask, bias=score_bias, q_offset=offset)
      else:  # a chunk into the cache: one query at a time, each with its own key mask
        context, weights = _decode_rows(call, qh, kh, vh, mask, score_bias, offset,
                                        need_weights)
    # context [batch, heads, q_len, head_dim]; weights [batch, heads, q_len, k_len] or None
    if hook_pattern:
      weights = hooks.hook(self, "pattern", weights, positions_axis=2, heads_axis=1)
      if hooks.intervened(self, "pattern"):  # the context of the edited weights
        context = jnp.matmul(weights, vh.astype(weights.dtype)).astype(context.dtype)
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
    z = jnp.swapaxes(context.astype(dtype), 1, 2)  # [batch, q_len, heads, head_dim]
    z = hooks.hook(self, "z", z, positions_axis=1, heads_axis=2)
    out = z.reshape(z.shape[:2] + (inner,))  # [batch, q_len, inner] (core.merge_heads)
    return Dense(self.out_features or d_model, use_bias=self.use_bias,
                 kernel_init=self.out_kernel_init, dtype=dtype, name="out")(out)

  def _mechanism_params(self, mechanism: Any, head_dim: int, max_len: int,
                        options: dict[str, Any]) -> Any:
    """The mechanism's parameters: the learned ones under `mechanism_params`, the fixed random
    draws it names in `mechanism.fixed` (Performer's features) drawn from `mechanism_seed` on
    every call (never trained, the same in every step and replica)."""
    init = lambda rng: mechanism.init(rng, self.num_heads, head_dim, max_len, **options)
    shapes = jax.eval_shape(init, jax.random.key(0))
    if shapes is None:
      return None
    fixed = mechanism.fixed
    learned = {k: v for k, v in shapes.items() if k not in fixed}
    out = {}
    if learned:
      out.update(self.param("mechanism_params", lambda rng: {
          k: v for k, v in init(rng).items() if k not in fixed}))
    if fixed:
      drawn = init(jax.random.key(self.mechanism_seed))
      out.update({k: jax.lax.stop_gradient(drawn[k]) for k in fixed if k in drawn})
    return out

  def _check_mechanism(self, mechanism: Any, decoding: bool) -> None:
    """ValueError when this module asks what `mechanism` does not support (registry.validate,
    the same check the config gets where it is read; plus KV-cache decoding)."""
    if decoding and not mechanism.supports.cache:
      raise ValueError(
          f"mechanism {mechanism.name!r} does not support KV-cache decoding; generate without "
          f"the cache (use_cache=False) or use a mechanism that supports it "
          f"({', '.join(n for n, m in registry.MECHANISMS.items() if m.supports.cache)})")
    try:
      self.attention.validate(directions=("causal",) if self.causal else ("bidirectional",),
                              position_bias=self.position_bias is not None,
                              where="this layer (causal)" if self.causal else
                              "this layer (bidirectional)")
    except Exception as e:  # ConfigError: a layer built in code gets a ValueError
      raise ValueError(str(e)) from e

  def _talking_heads(self, q: Array, k: Array, v: Array, *, params: Any, mask: Array | None,
                     causal: bool, bias: Array | None,
                     normalizer_params: Any) -> tuple[Array, Array]:
    """Talking-heads attention (Shazeer et al. 2020) on the reference path: logits mixed across
    heads, normalised, weights mixed across heads, then applied to the values."""
    eye = lambda rng: jnp.eye(self.num_heads, dtype=jnp.float32)
    mix_logits = self.param("talking_heads_logits", eye)  # [heads, heads]
    mix_weights = self.param("talking_heads_weights", eye)  # [heads, heads]
    logits = scores_lib.get_score_fn(self.attention.score)(q, k, **(params or {}))  # [b, heads, q, k]
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if bias is not None:
      logits = logits + positions_lib.materialize(bias, *logits.shape[-2:])  # [(b,) h, q, k]
    logits = mix_heads(logits, mix_logits)  # [batch, heads, q_len, k_len]
    q_len, k_len = logits.shape[-2:]
    if causal:
      mask = masks_lib.combine(mask, masks_lib.causal_mask(q_len, k_len, offset=None))
    if mask is not None:
      mask = jnp.broadcast_to(mask, logits.shape)
    if self.attention.normalizer == "softmax":
      weights = core.masked_softmax(logits, mask)  # [batch, heads, q_len, k_len]
    else:
      weights = normalizers.normalize(self.attention.normalizer, logits, mask, params=normalizer_params,
                                      topk=self.attention.topk)  # [batch, heads, q_len, k_len]
    weights = mix_heads(weights, mix_weights)  # [batch, heads, q_len, k_len]
    context = jnp.matmul(weights, v.astype(weights.dtype))  # [batch, heads, q_len, head_dim]
    return context.astype(v.dtype), weights

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
