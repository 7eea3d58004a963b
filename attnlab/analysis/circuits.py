"""Weight-level circuit analysis: each head's QK and OV matrices, composition between heads.

  from attnlab.analysis import circuits
  w = circuits.head_weights(run)             # W_Q, W_K, W_V `[layers, heads, d, head_dim]`, W_O, biases
  qk = w.qk(1, 0)                            # W_Q^h W_K^h^T `[d_model, d_model]` of head 1.0
  ov = w.ov(0, 1)                            # W_V^h W_O^h `[d_model, d_model]` of head 0.1
  comp = circuits.composition_scores(w, "q") # [layers, heads, layers, heads]: sender -> receiver
  base = circuits.random_baseline(w.d_model, w.head_dim, "q")   # the same score, Gaussian weights
  print(w.notes)                             # what these matrices leave out for this model

Row-vector convention (x @ W, as the model computes): a head's query of residual vector x is
x W_Q^h (+ b_Q^h), so the score of query x_i on key x_j is x_i (W_Q^h W_K^h^T) x_j^T (+ bias
terms): QK^h = W_Q^h W_K^h^T. What it adds to the residual stream, per unit of attention, is
x_j W_V^h W_O^h: OV^h = W_V^h W_O^h, both `[d_model, d_model]` and of rank <= head_dim. W_O^h is
the head's rows of the output projection. Grouped-query attention: W_K^h and W_V^h are those of
the kv head h // (heads // kv_heads) that query head h shares with its group.
The "general" score's matrix (q W k^T) is folded in: QK^h = W_Q^h W^h W_K^h^T.

LayerNorm folding (`fold_ln=True`, the default, as is usual for these scores): each block reads
the residual stream through ln_1, x -> (x - mean) * r * gamma + beta with a per-token 1 / std r.
The scale gamma is folded into the reading weights (W_Q <- diag(gamma) W_Q, same for K and V) and
beta into their biases (b_Q <- beta W_Q + b_Q); since every reader of the residual stream centres
it first, the writing weights are centred (W_O's rows and b_O minus their mean over d_model).
What stays out: the per-token 1 / std r (it rescales q, k and v of each token). `fold_ln=False`
gives the raw kernels.

Composition scores (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"):
how much a later head B reads what an earlier head A writes, as the Frobenius norm of the
product of their matrices over the product of the norms,
  C(W_A, W_B) = ||W_A W_B||_F / (||W_A||_F ||W_B||_F)         (row-vector order: A's output first)
  Q-composition:  W_A = OV^A, W_B = QK^B      (A's output forms B's queries)
  K-composition:  W_A = OV^A, W_B = QK^B^T    (A's output forms B's keys)
  V-composition:  W_A = OV^A, W_B = OV^B      (A's output is moved on by B)
for every A in a layer below B's. The scores are scale-free (scaled_dot's 1 / sqrt(d) cancels) and
computed from the low-rank factors (never a d_model x d_model matrix per pair), one sender
layer at a time. `random_baseline` is the mean of the same score over draws of
i.i.d. Gaussian factors of the same shapes (W_V, W_O, W_Q, W_K): a score near it means no more
composition than chance for matrices of these sizes.

What the weights cannot show (each listed in `HeadWeights.notes` for the model at hand):
  positions: rotary rotates q and k by their positions (QK is the score at relative distance 0
  only); ALiBi and T5 biases are added to the scores and are in no weight matrix; learned and
  sinusoidal position embeddings are part of the residual stream, so they are in x.
  scores: cosine normalises q and k (QK gives the direction only); additive and location scores
  are not bilinear (QK is not their score); talking heads mix the heads' scores and weights.
  biases: the affine terms x_i W_Q b_K^T + b_Q W_K^T x_j^T + b_Q b_K^T of the score and b_V W_O of
  the output (a constant per head when rows sum to 1) are kept in `b_q`, `b_k`, `b_v`, `b_o` and
  left out of QK, OV and the scores.
  mechanisms: the matrices are parameters, so they exist whatever the mechanism; a mechanism
  without explicit attention weights (linear, Performer, Linformer) still has QK and OV, though
  its scores do not go through a softmax of x_i QK x_j^T.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.analysis import hooks as hooks_lib

__all__ = ["COMPOSITIONS", "HeadWeights", "composition_scores", "head_weights", "model_notes",
           "random_baseline", "top_compositions"]

Array = jax.Array

# The kinds of composition (module docstring).
COMPOSITIONS = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class HeadWeights:
  """Each head's projection matrices, float64 numpy (module docstring for the convention)."""
  # Queries `[layers, heads, d_model, head_dim]`.
  w_q: np.ndarray
  # Keys and values `[layers, heads, d_model, head_dim]` (the kv head of each query head).
  w_k: np.ndarray
  w_v: np.ndarray
  # Each head's rows of the output projection `[layers, heads, head_dim, d_model]`.
  w_o: np.ndarray
  # Biases `[layers, heads, head_dim]` (zeros without biases; with fold_ln, beta's share added).
  b_q: np.ndarray
  b_k: np.ndarray
  b_v: np.ndarray
  # The output projection's bias `[layers, d_model]`.
  b_o: np.ndarray
  # Key/value heads per layer (= heads unless grouped-query).
  kv_heads: int
  # Whether ln_1's scale and bias are folded in and the writing weights centred.
  fold_ln: bool
  # What the matrices leave out for this model, one line each (module docstring).
  notes: tuple[str, ...] = ()

  @property
  def num_layers(self) -> int:
    return self.w_q.shape[0]

  @property
  def num_heads(self) -> int:
    return self.w_q.shape[1]

  @property
  def d_model(self) -> int:
    return self.w_q.shape[2]

  @property
  def head_dim(self) -> int:
    return self.w_q.shape[3]

  def qk(self, layer: int, head: int) -> np.ndarray:
    """QK = W_Q^h W_K^h^T `[d_model, d_model]`: x_i QK x_j^T is the score's bilinear part."""
    return self.w_q[layer, head] @ self.w_k[layer, head].T

  def ov(self, layer: int, head: int) -> np.ndarray:
    """OV = W_V^h W_O^h `[d_model, d_model]`: x_j OV is what key j adds per unit of weight."""
    return self.w_v[layer, head] @ self.w_o[layer, head]


def model_notes(model: Any) -> tuple[str, ...]:
  """One line per thing the weight-level scores of `model` leave out (module docstring)."""
  attention = model.attention
  notes = []
  position = getattr(model, "position", "learned")
  if position == "rotary":
    notes.append("rotary positions: q and k are rotated by their positions, so QK is the score's "
                 "bilinear form at relative distance 0 only")
  elif position in ("alibi", "t5_bias"):
    notes.append(f"{position} positions: a per-head bias added to the scores, held by no weight "
                 "matrix, is left out of QK and the composition scores")
  if attention.score == "cosine":
    notes.append("cosine score: q and k are normalised, so QK gives the direction of the score "
                 "only (its scale is the learned key strength)")
  elif attention.score in ("additive", "location"):
    notes.append(f"{attention.score} score: not bilinear in q and k, so QK = W_Q W_K^T is not "
                 "its score (Q- and K-composition are about the projections only)")
  if attention.talking_heads:
    notes.append("talking heads: scores and weights are mixed across heads, so a head's QK and "
                 "OV are not the whole of what it does")
  from attnlab.attention import registry  # pylint: disable=g-import-not-at-top
  try:
    mechanism = registry.get_mechanism(attention.mechanism)
  except Exception:  # pylint: disable=broad-except  (a plugin not loaded: no note)
    mechanism = None
  if mechanism is not None and not explicit_weights(mechanism):
    notes.append(f"mechanism {attention.mechanism!r} forms no attention weights of its own; QK "
                 "and OV are its parameters all the same (its scores are not a softmax of "
                 "x_i QK x_j^T)")
  if getattr(model, "use_bias", False):
    notes.append("biases: the affine score and output terms (b_q, b_k, b_v, b_o) are left out "
                 "of QK, OV and the composition scores")
  return tuple(notes)


def explicit_weights(mechanism: Any) -> bool:
  """Whether a registry Mechanism forms its attention weights as scores through a normaliser
  (it forms the full score matrix, or takes an additive score bias, which needs the scores'
  entries); False for the kernelised or projected ones (linear, Performer, Linformer), whose
  weights are formed only when asked for."""
  return bool(mechanism.supports.scores_matrix or mechanism.supports.bias)


def head_weights(run: Any, *, fold_ln: bool = True) -> HeadWeights:
  """The QK/OV factors of every head of a GPT run (a loaded run or a (model, params) pair)."""
  model, params = hooks_lib._unpack(run)  # pylint: disable=protected-access
  hooks_lib.sites(model)  # ValueError for a family without hook sites
  heads = model.num_heads
  kv_heads = model.attention.kv_heads(heads)
  group = heads // kv_heads
  f64 = lambda a: np.asarray(a, np.float64)
  out: dict[str, list[np.ndarray]] = {k: [] for k in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k",
                                                      "b_v", "b_o")}
  for layer in range(model.num_layers):
    block = params[f"block_{layer}"]
    attn = block["self_attention"]
    d = attn["query_kernel"].shape[0]
    head_dim = attn["query_kernel"].shape[1] // heads
    kv_of = np.arange(heads) // group  # query head -> its kv head
    split = lambda kernel, n: f64(kernel).reshape(d, n, head_dim).transpose(1, 0, 2)  # [n, d, hd]
    zeros = lambda n: np.zeros((n, head_dim))
    bias = lambda name, n: (f64(attn[name]).reshape(n, head_dim) if name in attn else zeros(n))
    w_q = split(attn["query_kernel"], heads)
    w_k = split(attn["key_kernel"], kv_heads)[kv_of]
    w_v = split(attn["value_kernel"], kv_heads)[kv_of]
    b_q, b_k, b_v = bias("query_bias", heads), bias("key_bias", kv_heads)[kv_of], bias(
        "value_bias", kv_heads)[kv_of]
    if model.attention.score == "general":  # q W k^T: W folded into the queries
      w = f64(attn["score_params"]["w"])
      w = np.broadcast_to(w, (heads,) + w.shape[-2:])  # [heads, hd, hd]
      w_q, b_q = np.einsum("hdk,hke->hde", w_q, w), np.einsum("hk,hke->he", b_q, w)
    w_o = f64(attn["out"]["kernel"]).reshape(heads, head_dim, -1)  # [heads, hd, d]
    b_o = f64(attn["out"]["bias"]) if "bias" in attn["out"] else np.zeros(w_o.shape[-1])
    if fold_ln:
      ln = block["ln_1"]
      gamma = f64(ln["scale"])
      beta = f64(ln["bias"]) if "bias" in ln else np.zeros_like(gamma)
      b_q, b_k, b_v = (b + np.einsum("d,hdk->hk", beta, w) for b, w in
                       ((b_q, w_q), (b_k, w_k), (b_v, w_v)))
      w_q, w_k, w_v = (gamma[None, :, None] * w for w in (w_q, w_k, w_v))
      w_o = w_o - w_o.mean(-1, keepdims=True)
      b_o = b_o - b_o.mean()
    for key, value in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v), ("w_o", w_o), ("b_q", b_q),
                       ("b_k", b_k), ("b_v", b_v), ("b_o", b_o)):
      out[key].append(value)
  return HeadWeights(**{k: np.stack(v) for k, v in out.items()}, kv_heads=kv_heads,
                     fold_ln=fold_ln, notes=model_notes(model))


# ------------------------------------------------------------------------------- composition


def _factors(w: HeadWeights, which: str) -> tuple[np.ndarray, np.ndarray]:
  """(L `[layers * heads, d, hd]`, R `[layers * heads, hd, d]`) with matrix = L @ R per head."""
  flat = lambda a: a.reshape((-1,) + a.shape[2:])
  if which == "ov":
    return flat(w.w_v), flat(w.w_o)
  if which == "qk":
    return flat(w.w_q), np.swapaxes(flat(w.w_k), 1, 2)
  if which == "qk_t":
    return flat(w.w_k), np.swapaxes(flat(w.w_q), 1, 2)
  raise ValueError(which)


@jax.jit
def _scores(l1: Array, r1: Array, l2: Array, r2: Array) -> Array:
  """C(L1[a] R1[a], L2[b] R2[b]) for every a, b: `[A, B]`.

  ||L1 R1 L2 R2||_F^2 = tr(M^T G1 M G2) = sum((G1 M) * (M G2)) with M = R1 L2 `[r, s]`,
  G1 = L1^T L1, G2 = R2 R2^T (both symmetric); ||L R||_F^2 = sum(G_L * G_R)."""
  g1 = jnp.einsum("adr,adt->art", l1, l1)  # [A, r, r]
  h1 = jnp.einsum("ard,atd->art", r1, r1)  # [A, r, r]
  g2 = jnp.einsum("bds,bdu->bsu", l2, l2)  # [B, s, s]
  h2 = jnp.einsum("bsd,bud->bsu", r2, r2)  # [B, s, s]
  m = jnp.einsum("ard,bds->abrs", r1, l2)  # [A, B, r, s]
  prod = jnp.sum(jnp.einsum("art,abts->abrs", g1, m) * jnp.einsum("abrt,bts->abrs", m, h2),
                 axis=(-2, -1))  # [A, B]
  norm1 = jnp.sum(g1 * h1, axis=(-2, -1))  # [A]
  norm2 = jnp.sum(g2 * h2, axis=(-2, -1))  # [B]
  denom = jnp.sqrt(jnp.maximum(norm1[:, None] * norm2[None, :], 0.0))
  return jnp.where(denom > 0, jnp.sqrt(jnp.maximum(prod, 0.0)) / jnp.where(denom > 0, denom, 1.0),
                   0.0)


# composition kind -> the receiver's matrix
_RECEIVER = {"q": "qk", "k": "qk_t", "v": "ov"}


def _check_kind(kind: str) -> None:
  if kind not in COMPOSITIONS:
    raise ValueError(f"unknown composition {kind!r}; valid: {', '.join(COMPOSITIONS)}")


def composition_scores(weights: Any, kind: str = "q") -> np.ndarray:
  """`[layers, heads, layers, heads]` float64: [l_A, h_A, l_B, h_B] is the `kind` ("q", "k" or
  "v") composition score of sender head A into receiver head B (module docstring); NaN where B's
  layer is not above A's. `weights`: a HeadWeights, a loaded run or a (model, params) pair."""
  _check_kind(kind)
  w = weights if isinstance(weights, HeadWeights) else head_weights(weights)
  l1, r1 = _factors(w, "ov")
  l2, r2 = _factors(w, _RECEIVER[kind])
  layers, heads = w.num_layers, w.num_heads
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  scores = np.full((layers, heads, layers, heads), np.nan)
  receivers = tuple(f32(a) for a in (l2, r2))  # every head: one compiled shape for all layers
  for layer in range(layers - 1):  # one sender layer at a time: [heads, all heads, r, r]
    senders = slice(layer * heads, (layer + 1) * heads)
    block = np.asarray(_scores(f32(l1[senders]), f32(r1[senders]), *receivers), np.float64)
    scores[layer, :, layer + 1:] = block.reshape(heads, layers, heads)[:, layer + 1:]
  return scores


def random_baseline(d_model: int, head_dim: int, kind: str = "q", *, draws: int = 200,
                    seed: int = 0) -> float:
  """The mean `kind` composition score of heads whose W_Q, W_K, W_V `[d_model, head_dim]` and W_O
  `[head_dim, d_model]` are i.i.d. Gaussian (any scale: the score is scale-free), over `draws`
  independent pairs of heads. The same for the three kinds (the receiver's matrix has the same
  law in each)."""
  _check_kind(kind)
  if min(d_model, head_dim, draws) < 1:
    raise ValueError(f"d_model, head_dim and draws must be >= 1; got {d_model}, {head_dim}, "
                     f"{draws}")
  return _baseline(d_model, head_dim, draws, seed)


@functools.lru_cache(maxsize=64)
def _baseline(d_model: int, head_dim: int, draws: int, seed: int) -> float:
  """The baseline of every kind: QK = W_Q W_K^T, QK^T = W_K W_Q^T and OV = W_V W_O all have the
  law of X Y^T for independent Gaussian X, Y `[d_model, head_dim]`."""
  keys = jax.random.split(jax.random.key(seed), 4)
  shape = (draws, d_model, head_dim)
  v_a, o_a = jax.random.normal(keys[0], shape), jax.random.normal(keys[1], shape)
  x_b, y_b = jax.random.normal(keys[2], shape), jax.random.normal(keys[3], shape)
  one = lambda v, o, x, y: _scores(v[None], o.T[None], x[None], y.T[None])[0, 0]
  return float(jnp.mean(jax.vmap(one)(v_a, o_a, x_b, y_b)))


def top_compositions(scores: dict[str, np.ndarray], layer: int, head: int, n: int = 1
                     ) -> list[tuple[str, int, int, float]]:
  """The `n` largest composition scores of receiver head (layer, head) over its senders and the
  kinds in `scores` ({kind: composition_scores(...)}): [(kind, sender layer, sender head,
  score)], largest first."""
  found = []
  for kind, grid in scores.items():
    column = grid[:, :, layer, head]  # [layers, heads]
    for l_a, h_a in zip(*np.nonzero(np.isfinite(column))):
      found.append((kind, int(l_a), int(h_a), float(column[l_a, h_a])))
  return sorted(found, key=lambda t: -t[3])[:n]
