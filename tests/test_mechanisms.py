"""Attention mechanisms after 2017 against NumPy written from each paper's formula.

Position biases (ALiBi, T5), normalisers (softmax_sink, sigmoid, sparsemax, top-k), efficient
mechanisms (linear, Performer, Linformer, sliding window, BigBird) and the registry. Shapes are
tiny; the jitted functions are shared at module level.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import errors
from attnlab.attention import blocked
from attnlab.attention import core
from attnlab.attention import efficient
from attnlab.attention import normalizers
from attnlab.attention import positions
from attnlab.attention import registry

TOL = dict(rtol=2e-5, atol=2e-5)
GRAD_TOL = dict(rtol=2e-4, atol=2e-4)


def rand(seed, *shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------------- NumPy references


def np_masked_softmax(x, allowed):
  """float64 softmax over allowed entries; rows with none are zeros."""
  x = np.where(allowed, np.asarray(x, np.float64), -np.inf)
  mx = np.max(x, -1, keepdims=True)
  e = np.where(allowed, np.exp(x - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
  den = e.sum(-1, keepdims=True)
  return e / np.where(den > 0, den, 1.0)


def np_attention(q, k, v, *, bias=None, allowed=None, causal=False):
  """softmax(q kᵀ / sqrt(d) + bias) v over the allowed keys (end-aligned causal)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  ok = np.ones(s.shape, bool) if allowed is None else np.broadcast_to(allowed, s.shape)
  if causal:
    q_len, k_len = s.shape[-2:]
    ok = ok & (np.arange(k_len)[None] <= np.arange(q_len)[:, None] + max(k_len - q_len, 0))
  return np_masked_softmax(s, ok) @ v


def np_alibi(q_len, k_len, slopes, q_offset=0):
  i = np.arange(q_len)[:, None] + q_offset
  j = np.arange(k_len)[None, :]
  return -np.asarray(slopes)[:, None, None] * np.abs(i - j)[None]  # [heads, q, k]


def np_t5_bucket(rel, bidirectional, num_buckets=32, max_distance=128):
  """Raffel et al. 2020's bucketing, one relative position (key - query) at a time."""
  n = -rel
  ret = 0
  if bidirectional:
    num_buckets //= 2
    if n < 0:
      ret += num_buckets
    n = abs(n)
  else:
    n = max(n, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return ret + n
  val = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                        * (num_buckets - max_exact))
  return ret + min(val, num_buckets - 1)


def np_elu1(x):
  x = np.asarray(x, np.float64)
  return np.where(x > 0, x + 1.0, np.exp(x))


def np_linear_attention(q, k, v, causal=False, key_valid=None):
  """Katharopoulos et al. 2020 eq. 2 with sim(q, k) = phi(q)ᵀ phi(k), quadratic form."""
  a = np_elu1(q) @ np.swapaxes(np_elu1(k), -1, -2)  # [..., q, k]
  q_len, k_len = a.shape[-2:]
  if causal:
    a = a * (np.arange(k_len)[None] <= np.arange(q_len)[:, None] + max(k_len - q_len, 0))
  if key_valid is not None:
    a = a * key_valid
  den = a.sum(-1, keepdims=True)
  return (a / np.where(den > 0, den, 1.0)) @ np.asarray(v, np.float64)


# ----------------------------------------------------------------------------- ALiBi


def test_alibi_slopes_powers_of_two_and_interleaving():
  np.testing.assert_allclose(positions.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
  np.testing.assert_allclose(positions.alibi_slopes(4), 2.0 ** (-2.0 * np.arange(1, 5)))
  # H = 6: the 4 slopes of 4 heads, then every other slope of 8 heads (2^-1, 2^-3)
  np.testing.assert_allclose(positions.alibi_slopes(6),
                             [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
  # H = 12: the 8 slopes of 8 heads, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (odd ones of 16)
  np.testing.assert_allclose(positions.alibi_slopes(12),
                             list(2.0 ** -np.arange(1, 9)) + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="num_heads"):
    positions.alibi_slopes(0)


def test_alibi_bias_is_float64_under_x64():
  # 12 heads: slopes 2^-0.5 ... are not exact in float32 (a rounding of ~1e-8 relative)
  want = -np.abs(np.arange(40)[None, :] - np.arange(40)[:, None])[None] * (
      2.0 ** -np.concatenate([np.arange(1, 9), [0.5, 1.5, 2.5, 3.5]]))[:, None, None]
  with jax.enable_x64(True):
    got = positions.alibi_bias(40, 40, 12, causal=False)
    lazy = positions.AlibiBias(positions.alibi_slopes(12)).materialize(40, 40)
  for bias in (got, lazy):
    assert bias.dtype == np.float64
    np.testing.assert_allclose(bias, want, rtol=1e-14)
  assert positions.alibi_bias(4, 4, 12, causal=False).dtype == np.float32  # x64 off


def test_alibi_bias_values_offsets_and_extrapolation():
  slopes = positions.alibi_slopes(4)
  got = positions.alibi_bias(5, 7, 4, causal=False)
  np.testing.assert_allclose(got, np_alibi(5, 7, slopes))
  assert got[0, 2, 0] == -0.25 * 2  # hand-made: head 0 slope 1/4, distance 2
  got = positions.alibi_bias(1, 9, 4, causal=True, q_offset=jnp.array([3, 8]))
  assert got.shape == (2, 4, 1, 9)
  np.testing.assert_allclose(got[1], np_alibi(1, 9, slopes, q_offset=8))
  # any length: a pure function of (q_len, k_len)
  long = positions.alibi_bias(300, 300, 4, causal=True)
  np.testing.assert_allclose(long[3, 299, 0], -slopes[3] * 299, rtol=1e-6)


# ----------------------------------------------------------------------------- T5


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_against_numpy(bidirectional):
  rel = np.array([0, 1, -1, 5, -5, 7, -7, 8, -8, 9, -9, 15, -15, 16, -16, 20, -20, 33, -50,
                  64, -64, 127, -127, 128, -128, 500, -500, -10000])
  got = np.asarray(positions.t5_relative_bucket(rel, bidirectional=bidirectional))
  want = [np_t5_bucket(int(r), bidirectional) for r in rel]
  np.testing.assert_array_equal(got, want)
  if bidirectional:  # hand-picked: past keys in the lower half, future keys in the upper half
    assert list(got[:5]) == [0, 17, 1, 21, 5]
    assert got[-1] == 15 and got[list(rel).index(500)] == 31
  else:  # future keys all share bucket 0; far past keys share the last bucket
    assert got[1] == got[3] == 0 and got[-1] == 31
    assert got[list(rel).index(-20)] == 16 + int(math.log(20 / 16) / math.log(8) * 16)


def test_t5_bias_gathers_table_and_extrapolates():
  table = rand(0, 32, 3)
  got = positions.t5_bias(table, 4, 6, bidirectional=True, q_offset=1)
  want = np.empty((3, 4, 6))
  for i in range(4):
    for j in range(6):
      want[:, i, j] = table[np_t5_bucket(j - (i + 1), True)]
  np.testing.assert_allclose(got, want)
  long = jax.jit(lambda t: positions.t5_bias(t, 400, 400, bidirectional=False))(table)
  assert long.shape == (3, 400, 400) and np.all(np.isfinite(long))
  np.testing.assert_allclose(long[:, 399, 0], table[31])


# ----------------------------------------------------------------------------- biases in attend


@pytest.fixture(scope="module")
def qkv():
  b, h, s, d = 2, 4, 40, 8
  return rand(1, b, h, s, d), rand(2, b, h, s, d), rand(3, b, h, s, d)


def _attend_bias(impl, causal):
  if impl == "blocked":
    return jax.jit(lambda q, k, v, bias: blocked.blocked_attention(
        q, k, v, bias=bias, causal=causal, block_q=16, block_k=8))
  return jax.jit(lambda q, k, v, bias: core.attend(
      q, k, v, bias=bias, causal=causal, implementation=impl, return_weights=False)[0])


@pytest.mark.parametrize("impl", ["reference", "xla", "blocked"])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_and_t5_in_attend_match_numpy(qkv, impl, causal):
  q, k, v = qkv
  fn = _attend_bias(impl, causal)
  slopes = positions.alibi_slopes(4)
  got = fn(q, k, v, positions.AlibiBias(slopes))
  np.testing.assert_allclose(got, np_attention(q, k, v, bias=np_alibi(40, 40, slopes),
                                               causal=causal), **TOL)
  table = rand(4, 32, 4)
  got = fn(q, k, v, positions.T5Bias(table, bidirectional=not causal))
  want_bias = np.asarray(positions.t5_bias(table, 40, 40, bidirectional=not causal))
  np.testing.assert_allclose(got, np_attention(q, k, v, bias=want_bias, causal=causal), **TOL)


def test_alibi_slope_zero_equals_no_bias(qkv):
  q, k, v = qkv
  for impl in ("reference", "blocked"):
    fn = _attend_bias(impl, True)
    zero = fn(q, k, v, positions.AlibiBias(np.zeros(4, np.float32)))
    none = fn(q, k, v, None)
    np.testing.assert_allclose(zero, none, **TOL)


def test_bias_gradients_of_blocked_kernel_match_dense_formula(qkv):
  """d/d(table, slopes, q, k, v) of the blocked kernel with a recomputed bias == autodiff of
  the dense formula (einsum + bias + softmax) written here."""
  q, k, v = (x[:, :, :24] for x in qkv)
  ct = rand(5, *q.shape)
  table, slopes = rand(6, 32, 4), positions.alibi_slopes(4)

  def dense(q, k, v, bias_arr):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(8) + bias_arr
    allowed = np.arange(24)[None] <= np.arange(24)[:, None]
    s = jnp.where(allowed, s, -1e30)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)

  def dense_t5(q, k, v, table):
    rel = np.arange(24)[None] - np.arange(24)[:, None]
    buckets = np.vectorize(lambda r: np_t5_bucket(r, False))(rel)
    return dense(q, k, v, jnp.moveaxis(table[buckets], -1, 0))

  def dense_alibi(q, k, v, slopes):
    return dense(q, k, v, -slopes[:, None, None] * np.abs(np.arange(24)[:, None]
                                                         - np.arange(24)[None]))

  def kernel_t5(q, k, v, table):
    return blocked.blocked_attention(q, k, v, causal=True, block_q=8, block_k=8,
                                     bias=positions.T5Bias(table, bidirectional=False))

  def kernel_alibi(q, k, v, slopes):
    return blocked.blocked_attention(q, k, v, causal=True, block_q=8, block_k=16,
                                     bias=positions.AlibiBias(slopes))

  for ref, ker, p in ((dense_t5, kernel_t5, table), (dense_alibi, kernel_alibi, slopes)):
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * ct), argnums=(0, 1, 2, 3)))(
        q, k, v, p)
    g_ker = jax.jit(jax.grad(lambda *a: jnp.sum(ker(*a) * ct), argnums=(0, 1, 2, 3)))(
        q, k, v, p)
    for a, b in zip(g_ref, g_ker):
      np.testing.assert_allclose(b, a, **GRAD_TOL)



def test_bias_gradients_of_blocked_kernel_with_offset_padding_and_ragged_tiles():
  """The same gradients (table, slopes, q, k, v) where the tiles do not divide the lengths, the
  queries are the last 10 of 13 positions (causal with an offset: q_offset=3 in the bias), and
  the second batch element's last 4 keys are padding: autodiff of the dense formula here."""
  q, k, v = rand(11, 2, 4, 10, 8), rand(12, 2, 4, 13, 8), rand(13, 2, 4, 13, 8)
  ct = rand(14, *q.shape)
  table, slopes = rand(15, 32, 4), positions.alibi_slopes(4)
  valid = np.arange(13)[None] < np.array([13, 9])[:, None]  # [batch, k_len]
  rel = np.arange(13)[None] - (np.arange(10)[:, None] + 3)  # key - query position [10, 13]
  allowed = (rel <= 0)[None, None] & valid[:, None, None, :]  # [batch, 1, 10, 13]

  def dense(q, k, v, bias_arr):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(8) + bias_arr
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(jnp.where(allowed, s, -1e30), -1), v)

  buckets = np.vectorize(lambda r: np_t5_bucket(r, False))(rel)
  refs = {"t5": lambda q, k, v, t: dense(q, k, v, jnp.moveaxis(t[buckets], -1, 0)),
          "alibi": lambda q, k, v, a: dense(q, k, v, -a[:, None, None] * np.abs(rel))}
  recipes = {"t5": lambda t: positions.T5Bias(t, bidirectional=False, q_offset=3),
             "alibi": lambda a: positions.AlibiBias(a, q_offset=3)}
  for name, p in (("t5", table), ("alibi", slopes)):
    kernel = lambda q, k, v, p, name=name: blocked.blocked_attention(
        q, k, v, causal=True, mask=valid[:, None, None, :], block_q=4, block_k=5,
        bias=recipes[name](p))
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3)))(
        q, k, v, p) for f in (refs[name], kernel)]
    for a, b in zip(*grads):
      np.testing.assert_allclose(b, a, **GRAD_TOL)

def test_choose_implementation_with_bias_and_normalizers():
  choose = core.choose_implementation
  big = dict(q_len=512, k_len=512, backend="cpu", blocked_available=True)
  assert choose("scaled_dot", False, **big) == "blocked"
  assert choose("scaled_dot", False, bias=positions.AlibiBias(np.ones(2)), **big) == "blocked"
  assert choose("scaled_dot", False, bias=np.zeros((2, 512, 512)), **big) == "reference"
  assert choose("scaled_dot", False, normalizer="sigmoid", **big) == "reference"
  assert choose("scaled_dot", False, bias=np.zeros(1), backend="gpu", dtype=jnp.bfloat16,
                head_dim=64) == "reference"  # half precision with a bias: off cudnn
  assert choose("scaled_dot", False, bias=np.zeros(1), backend="gpu", dtype=jnp.float32,
                head_dim=64) == "xla"
  with pytest.raises(ValueError, match="softmax normalizer"):
    choose("scaled_dot", False, "blocked", normalizer="sparsemax")
  with pytest.raises(ValueError, match="AlibiBias"):
    choose("scaled_dot", False, "blocked", bias=np.zeros(1))


# ----------------------------------------------------------------------------- normalisers


def np_sparsemax_bisect(z):
  """Euclidean projection onto the simplex by bisection on tau: sum max(z - tau, 0) = 1."""
  z = np.asarray(z, np.float64)
  lo, hi = z.max() - 1.0, z.max()
  for _ in range(200):
    tau = 0.5 * (lo + hi)
    lo, hi = (tau, hi) if np.maximum(z - tau, 0).sum() > 1 else (lo, tau)
  return np.maximum(z - 0.5 * (lo + hi), 0)


def np_normalize(name, x, allowed, sink=None, k=2):
  """Row-by-row NumPy reference of each normaliser (rows with no allowed key: zeros)."""
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  heads = x.shape[-3]
  for idx in np.ndindex(x.shape[:-1]):
    ok = np.broadcast_to(allowed, x.shape)[idx]
    if not ok.any():
      continue
    z = x[idx][ok]
    if name == "softmax":
      w = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    elif name == "softmax_sink":
      s = sink[idx[-2] % heads]
      w = np.exp(z) / (np.exp(s) + np.exp(z).sum())
    elif name == "sigmoid":
      w = 1.0 / (1.0 + np.exp(-(z - np.log(ok.sum()))))
    elif name == "sparsemax":
      w = np_sparsemax_bisect(z)
    elif name == "topk":
      keep = z >= np.sort(z)[::-1][min(k, z.size) - 1]
      w = np.where(keep, np.exp(z - z.max()), 0.0)
      w = w / w.sum()
    out[idx][ok] = w
  return out


@pytest.fixture(scope="module")
def logits_and_mask():
  x = rand(7, 2, 3, 5, 9) * 2.0
  allowed = np.random.default_rng(8).random((2, 1, 5, 9)) > 0.4
  allowed[0, 0, 2] = False  # a fully masked row
  allowed[1, 0, 4] = True  # a full row
  return x, allowed


NORM_NAMES = ["softmax", "softmax_sink", "sigmoid", "sparsemax", "topk"]
_normalize_jit = jax.jit(normalizers.normalize, static_argnames=("name", "topk"))


@pytest.mark.parametrize("name", NORM_NAMES)
def test_normalizers_match_numpy_with_masks(logits_and_mask, name):
  x, allowed = logits_and_mask
  sink = np.array([0.0, 1.5, -2.0], np.float32)
  params = {"sink": sink} if name == "softmax_sink" else None
  got = _normalize_jit(name, x, allowed, params=params, topk=2)
  want = np_normalize(name, x, allowed, sink=sink, k=2)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got)[0, :, 2] == 0)  # fully masked row: all zeros
  assert np.all(np.asarray(got)[~np.broadcast_to(allowed, x.shape)] == 0)
  # gradients exist and are finite everywhere, zero on the fully masked row
  g = jax.jit(jax.grad(lambda x: jnp.sum(normalizers.normalize(
      name, x, allowed, params=params, topk=2) * x)))(x)
  assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[0, :, 2] == 0)


@pytest.mark.parametrize("name", NORM_NAMES)
def test_normalizers_of_no_keys_give_empty_weights(name):
  # k_len 0 (no keys), with or without a mask: weights of shape [..., q_len, 0], no error
  x = np.zeros((2, 3, 4, 0), np.float32)
  for mask in (None, np.ones((2, 1, 4, 0), bool)):
    assert normalizers.normalize(name, x, mask).shape == (2, 3, 4, 0)


def test_normalizers_hand_made():
  # sparsemax([1, 0.5, -1]): support {1, 0.5}, tau = (1.5 - 1) / 2
  np.testing.assert_allclose(normalizers.sparsemax(jnp.array([1.0, 0.5, -1.0])),
                             [0.75, 0.25, 0.0], atol=1e-7)
  np.testing.assert_allclose(normalizers.sparsemax(jnp.array([3.0, 0.0])), [1.0, 0.0])
  # softmax plus one: two zero logits and the zero sink -> 1/3 each, the row sums to 2/3
  np.testing.assert_allclose(normalizers.softmax_sink(jnp.zeros((1, 1, 2))), [[[1 / 3, 1 / 3]]],
                             rtol=1e-6)
  # sigmoid with b = -log n: zero logits give 1 / (1 + n)
  np.testing.assert_allclose(normalizers.sigmoid(jnp.zeros((4,))), np.full(4, 1 / 5), rtol=1e-6)
  # top-2 of [1, 3, 2]: softmax over {3, 2}
  e = np.exp([3.0, 2.0]) / np.exp([3.0, 2.0]).sum()
  np.testing.assert_allclose(normalizers.topk_softmax(jnp.array([1.0, 3.0, 2.0]), k=2),
                             [0.0, e[0], e[1]], rtol=1e-6)


@pytest.mark.parametrize("name", NORM_NAMES)
def test_normalizers_without_a_mask_give_zeros_for_a_row_of_minus_inf_logits(name):
  # no mask, one row all -inf (e.g. an additive -inf bias): zeros and finite gradients, the
  # other row as NumPy (softmax used to return NaN here, through jax.nn.softmax)
  x = np.array([[[-np.inf] * 4, [0.3, -1.2, 2.0, 0.5]]], np.float32)  # [heads=1, q=2, k=4]
  params = {"sink": np.array([0.7], np.float32)} if name == "softmax_sink" else None
  got = normalizers.normalize(name, x, params=params, topk=2)
  want = np_normalize(name, x, np.isfinite(x), sink=np.array([0.7]), k=2)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got)[0, 0] == 0)
  g = jax.grad(lambda y: jnp.sum(normalizers.normalize(name, y, params=params, topk=2)
                                 * jnp.arange(4.0)))(jnp.asarray(x))
  assert np.all(np.isfinite(g))


def test_sparsemax_of_large_logits_is_shift_invariant():
  # sparsemax(z + c) = sparsemax(z): rows of logits near 1e3..1e5 still sum to 1 and match the
  # float64 NumPy projection of the same float32 inputs (the unshifted cumulative sums in
  # float32 were off by up to ~1e-2 at 1e5)
  z = rand(51, 3, 9)
  allowed = np.random.default_rng(52).random((3, 9)) > 0.3
  allowed[:, 0] = True
  for c in (1e3, 1e4, 1e5):
    x = z + np.float32(c)
    for mask in (None, allowed):
      ok = np.ones(x.shape, bool) if mask is None else allowed
      want = np.zeros(x.shape)
      for r in range(3):
        want[r, ok[r]] = np_sparsemax_bisect(x[r, ok[r]])
      got = np.asarray(normalizers.sparsemax(x, mask))
      np.testing.assert_allclose(got, want, atol=1e-5)
      np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)


def test_sparsemax_jacobian_and_sink_gradient():
  # Martins & Astudillo 2016, eq. 13: J = diag(s) - s sᵀ / |S| with s the support indicator
  z = jnp.array([0.9, 0.7, -0.3, 0.6])
  p = np.asarray(normalizers.sparsemax(z))
  s = (p > 0).astype(np.float64)
  np.testing.assert_allclose(jax.jit(jax.jacobian(normalizers.sparsemax))(z),
                             np.diag(s) - np.outer(s, s) / s.sum(), atol=1e-6)
  # d/d sink of sum(w * c) against NumPy central differences of the formula
  x, c = rand(9, 2, 3, 4), rand(10, 2, 3, 4)
  sink = np.array([0.3, -0.4], np.float32)

  def np_loss(sink):
    e = np.exp(x.astype(np.float64))
    w = e / (np.exp(sink)[:, None, None] + e.sum(-1, keepdims=True))
    return (w * c).sum()

  eps = 1e-5
  fd = [(np_loss(sink + eps * np.eye(2)[h]) - np_loss(sink - eps * np.eye(2)[h])) / (2 * eps)
        for h in range(2)]
  g = jax.jit(jax.grad(lambda s: jnp.sum(normalizers.softmax_sink(x, sink=s) * c)))(sink)
  np.testing.assert_allclose(g, fd, rtol=1e-4, atol=1e-6)


def test_attend_with_normalizers_and_unknown_name(qkv):
  q, k, v = (x[:1, :2, :6] for x in qkv)
  for name in NORM_NAMES:
    params = normalizers.init_normalizer_params(name, jax.random.PRNGKey(0), 2)
    ctx, w = core.attend(q, k, v, causal=True, normalizer=name, normalizer_params=params,
                         topk=2)
    s = np.asarray(q, np.float64) @ np.swapaxes(k, -1, -2) / np.sqrt(8)
    allowed = np.tril(np.ones((6, 6), bool))
    want_w = np_normalize(name, s, allowed, sink=np.zeros(2), k=2)
    np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ctx, want_w @ v, rtol=1e-5, atol=1e-5)
  with pytest.raises(errors.UserError, match="valid normalizers: softmax, softmax_sink"):
    core.attend(q, k, v, normalizer="entmax")


# ----------------------------------------------------------------------------- linear attention


_linear = jax.jit(efficient.linear_attention, static_argnames=("causal", "chunk_size"))


@pytest.mark.parametrize("causal,fused_bytes", [(False, efficient.FUSED_FEATURE_BYTES),
                                                (True, efficient.FUSED_FEATURE_BYTES),
                                                (True, 0)])
def test_linear_attention_matches_quadratic_numpy(monkeypatch, causal, fused_bytes):
  monkeypatch.setattr(efficient, "FUSED_FEATURE_BYTES", fused_bytes)  # 0: features in the scan
  linear = jax.jit(lambda *a, **kw: efficient.linear_attention(*a, **kw),  # a trace of its own
                   static_argnames=("causal", "chunk_size"))
  q, k, v = rand(11, 2, 3, 37, 4), rand(12, 2, 3, 37, 4), rand(13, 2, 3, 37, 5)
  key_valid = np.arange(37)[None, :] < np.array([37, 20])[:, None]  # [batch, k_len]
  want = np_linear_attention(q, k, v, causal, key_valid[:, None, None, :])
  # chunks that do and do not divide the length, one chunk, and chunks in several scan steps
  assert 37 // 2 > efficient.CHUNK_GROUP
  for chunk in (8, 10, 64, 2):
    got = linear(q, k, v, causal=causal, mask=key_valid, chunk_size=chunk)
    np.testing.assert_allclose(got, want, **TOL)
  w = efficient.linear_attention_weights(q, k, causal=causal, mask=key_valid)
  np.testing.assert_allclose(w @ v, want, **TOL)


@pytest.mark.parametrize("fused_bytes", [0, efficient.FUSED_FEATURE_BYTES])
def test_linear_causal_chunked_equals_quadratic_form_with_gradients(monkeypatch, fused_bytes):
  """Features made whole, or inside the rematerialised scan steps (FUSED_FEATURE_BYTES = 0)."""
  monkeypatch.setattr(efficient, "FUSED_FEATURE_BYTES", fused_bytes)
  q, k, v = rand(14, 1, 2, 30, 4), rand(15, 1, 2, 30, 4), rand(16, 1, 2, 30, 4)
  ct = rand(17, 1, 2, 30, 4)

  def quadratic(q, k, v):  # Katharopoulos eq. 2 with a causal mask, plain jnp
    a = jnp.einsum("...qd,...kd->...qk", jax.nn.elu(q) + 1, jax.nn.elu(k) + 1)
    a = jnp.where(np.tril(np.ones((30, 30), bool)), a, 0.0)
    return (a / a.sum(-1, keepdims=True)) @ v

  assert 30 // 3 > efficient.CHUNK_GROUP

  def chunked(q, k, v):  # 10 chunks of 3: two scan steps of CHUNK_GROUP chunks, padded
    return efficient.linear_attention(q, k, v, causal=True, chunk_size=3)

  g_quad = jax.jit(jax.grad(lambda *a: jnp.sum(quadratic(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
  g_chunk = jax.jit(jax.grad(lambda *a: jnp.sum(chunked(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(jax.jit(chunked)(q, k, v), jax.jit(quadratic)(q, k, v), **TOL)
  for a, b in zip(g_quad, g_chunk):
    np.testing.assert_allclose(b, a, **GRAD_TOL)


def test_linear_attention_decoding_and_empty_rows():
  q, k, v = rand(18, 2, 1, 1, 4), rand(19, 2, 1, 9, 4), rand(20, 2, 1, 9, 4)
  got = _linear(q, k, v, causal=True)  # one query, end-aligned: sees every key
  np.testing.assert_allclose(got, np_linear_attention(q, k, v), **TOL)
  none = np.zeros((2, 9), bool)
  out = _linear(q, k, v, mask=none)
  assert np.all(np.asarray(out) == 0)
  g = jax.jit(jax.grad(lambda q: jnp.sum(efficient.linear_attention(q, k, v, mask=none))))(q)
  assert np.all(np.isfinite(g))
  with pytest.raises(ValueError, match="key padding mask"):
    efficient.linear_attention(q, k, v, mask=np.ones((2, 1, 3, 9), bool))


# ----------------------------------------------------------------------------- Performer


def test_performer_features_are_orthogonal_gaussian_rows():
  w = np.asarray(efficient.performer_features(jax.random.PRNGKey(0), 12, 8), np.float64)
  assert w.shape == (12, 8)
  block = w[:8] / np.linalg.norm(w[:8], axis=1, keepdims=True)
  np.testing.assert_allclose(block @ block.T, np.eye(8), atol=1e-5)  # orthogonal within a block
  other = efficient.performer_features(jax.random.PRNGKey(1), 12, 8)
  assert not np.allclose(w, other)  # redraw by rng


def test_performer_orthogonalisation_matches_numpy_qr_and_calls_no_lapack():
  """Gram-Schmidt's Q equals NumPy's QR with R's diagonal made positive (random and badly
  conditioned blocks); the features' program has no custom call (XLA:CPU's batched LAPACK QR
  blocked the thread pool of two CPU devices)."""
  rng = np.random.default_rng(0)
  g = rng.normal(size=(3, 16, 16))
  g[2, :, 0] = g[2, :, 1] + 1e-3 * rng.normal(size=16)  # two nearly parallel columns
  q_np, r_np = np.linalg.qr(g)
  want = q_np * np.sign(np.diagonal(r_np, axis1=-2, axis2=-1))[..., None, :]
  got = np.asarray(efficient._orthonormal_columns(jnp.asarray(g, jnp.float32)), np.float64)
  np.testing.assert_allclose(got, want, atol=2e-3)  # the near-parallel pair: cond ~ 1e4
  np.testing.assert_allclose(got[:2], want[:2], atol=1e-5)
  eye = np.broadcast_to(np.eye(16), got.shape)
  np.testing.assert_allclose(np.swapaxes(got, -1, -2) @ got, eye, atol=1e-5)
  hlo = jax.jit(efficient.performer_features, static_argnums=(1, 2)).lower(
      jax.random.PRNGKey(0), 64, 16).as_text()
  assert "custom_call" not in hlo


def test_performer_estimate_converges_to_softmax():
  """Mean |performer - softmax attention| shrinks as the feature count m grows (FAVOR+ is an
  unbiased estimator whose error falls as 1/sqrt(m)), below 0.01 at m = 4096 (about 0.004
  measured; 0.03 at m = 64). Orthogonal features without the QR sign fix stalled at 0.011."""
  b, h, s, d = 1, 2, 24, 8
  q, k, v = rand(21, b, h, s, d) * 0.5, rand(22, b, h, s, d) * 0.5, rand(23, b, h, s, d)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)  # three feature draws per m

  @jax.jit
  def both(keys, m_like):
    def one(key):
      feats = efficient.performer_features(key, m_like.shape[0], d)
      return tuple(efficient.performer_attention(q, k, v, features=feats, causal=c)
                   for c in (False, True))
    return jax.vmap(one)(keys)

  errs = {}
  for m in (64, 256, 4096):
    outs = both(keys, jnp.zeros(m))
    errs[m] = [float(np.mean(np.abs(np.asarray(o) - np_attention(q, k, v, causal=c))))
               for o, c in zip(outs, (False, True))]
  print("performer mean |error| by m (non-causal, causal):", errs)
  for c in (0, 1):  # non-causal, causal
    assert errs[4096][c] < errs[256][c] < errs[64][c], errs
    assert errs[4096][c] < 0.01, errs
    assert errs[64][c] > 4 * errs[4096][c], errs  # ~ 1/sqrt(m): 8x in expectation


def test_performer_weights_and_mask():
  q, k, v = rand(24, 2, 2, 10, 4), rand(25, 2, 2, 10, 4), rand(26, 2, 2, 10, 4)
  feats = efficient.performer_features(jax.random.PRNGKey(3), 16, 4)
  valid = np.arange(10)[None] < np.array([10, 6])[:, None]

  @jax.jit
  def run(q, k, v):
    return [(efficient.performer_weights(q, k, features=feats, causal=c, mask=valid),
             efficient.performer_attention(q, k, v, features=feats, causal=c, mask=valid,
                                           chunk_size=4)) for c in (False, True)]

  for w, ctx in run(q, k, v):
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.asarray(w)[1, :, :, 6:] == 0)
    np.testing.assert_allclose(ctx, np.asarray(w) @ v, **TOL)


@pytest.mark.parametrize("fused_bytes", [0, efficient.FUSED_FEATURE_BYTES])
def test_performer_causal_scan_matches_numpy_with_gradients(monkeypatch, fused_bytes):
  """The causal scan, with the features made whole or (FUSED_FEATURE_BYTES = 0) a group of
  chunks at a time inside the rematerialised steps: values against FAVOR+'s quadratic form in
  NumPy, gradients against the weights path."""
  monkeypatch.setattr(efficient, "FUSED_FEATURE_BYTES", fused_bytes)
  q, k, v = rand(32, 2, 2, 30, 4), rand(33, 2, 2, 30, 4), rand(34, 2, 2, 30, 3)
  ct = rand(35, 2, 2, 30, 3)
  feats = efficient.performer_features(jax.random.PRNGKey(4), 16, 4)
  valid = np.arange(30)[None] < np.array([30, 17])[:, None]  # [batch, k_len]
  assert 30 // 3 > efficient.CHUNK_GROUP  # chunks of 3: two scan steps, the last one padded

  def np_phi(x, c):  # exp(wᵀx' - |x'|²/2 - c) / sqrt(m) + 1e-6, x' = x / d^(1/4)
    x = np.asarray(x, np.float64) / 4 ** 0.25
    proj = x @ np.asarray(feats, np.float64).T
    return np.exp(proj - 0.5 * (x * x).sum(-1, keepdims=True) - c(proj)) / 4.0 + 1e-6

  phi_q = np_phi(q, lambda p: p.max(-1, keepdims=True))
  # the keys' stabiliser: the max over the unpadded keys only
  phi_k = np_phi(k, lambda p: np.where(valid[:, None, :, None], p, -np.inf).max(
      axis=(-1, -2), keepdims=True))
  a = phi_q @ np.swapaxes(phi_k, -1, -2) * np.tril(np.ones((30, 30)))
  a = a * valid[:, None, None, :]
  want = (a / a.sum(-1, keepdims=True)) @ np.asarray(v, np.float64)

  def scan(q, k, v):
    return efficient.performer_attention(q, k, v, features=feats, causal=True, mask=valid,
                                         chunk_size=3)

  def quadratic(q, k, v):
    return efficient.performer_weights(q, k, features=feats, causal=True, mask=valid) @ v

  np.testing.assert_allclose(jax.jit(scan)(q, k, v), want, **TOL)
  g_scan = jax.jit(jax.grad(lambda *a: jnp.sum(scan(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
  g_quad = jax.jit(jax.grad(lambda *a: jnp.sum(quadratic(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
  for got, ref in zip(g_scan, g_quad):
    np.testing.assert_allclose(got, ref, **GRAD_TOL)


@pytest.mark.parametrize("fused_bytes", [0, efficient.FUSED_FEATURE_BYTES])
@pytest.mark.parametrize("causal", [False, True])
def test_performer_padded_keys_change_nothing(monkeypatch, fused_bytes, causal):
  """Padded keys must not contribute: their values (here large) must not move the keys'
  stabiliser, which the 1e-6 feature floor does not cancel."""
  monkeypatch.setattr(efficient, "FUSED_FEATURE_BYTES", fused_bytes)
  q, k, v = rand(40, 2, 2, 30, 4), rand(41, 2, 2, 30, 4), rand(42, 2, 2, 30, 3)
  feats = efficient.performer_features(jax.random.PRNGKey(5), 16, 4)
  valid = np.arange(30)[None] < np.array([30, 20])[:, None]  # [batch, k_len]
  run = lambda k: efficient.performer_attention(q, k, v, features=feats, causal=causal,
                                                mask=valid, chunk_size=3)
  garbage = k.copy()
  garbage[1, :, 20:] = 6.0  # padded keys only

  def np_phi(x, c):  # exp(wᵀx' - |x'|²/2 - c) / sqrt(m) + 1e-6, x' = x / d^(1/4)
    x = np.asarray(x, np.float64) / 4 ** 0.25
    proj = x @ np.asarray(feats, np.float64).T
    return np.exp(proj - 0.5 * (x * x).sum(-1, keepdims=True) - c(proj)) / 4.0 + 1e-6

  phi_q = np_phi(q, lambda p: p.max(-1, keepdims=True))
  phi_k = np_phi(k[:, :, :20], lambda p: p.max(axis=(-1, -2), keepdims=True))  # unpadded keys
  a = phi_q[1] @ np.swapaxes(phi_k[1], -1, -2)  # batch 1: [heads, 30, 20]
  if causal:
    a = a * np.tril(np.ones((30, 30)))[:, :20]
  want = (a / a.sum(-1, keepdims=True)) @ np.asarray(v[1, :, :20], np.float64)
  np.testing.assert_allclose(run(garbage)[1], want, **TOL)
  np.testing.assert_allclose(run(garbage), run(k), **TOL)
  w = efficient.performer_weights(q, garbage, features=feats, causal=causal, mask=valid)
  np.testing.assert_allclose(np.asarray(w)[1] @ v[1], want, **TOL)


@pytest.mark.parametrize("fn", ["linear", "performer", "linformer"])
def test_kernelised_3d_inputs_take_a_batch_key_mask(fn):
  """q, k, v `[batch, len, d]` (no heads axis) with a `[batch, k_len]` mask: the output is
  `[batch, len, d]`, each row attending to its own unpadded keys, as with a heads axis."""
  q, k, v = rand(43, 2, 5, 4), rand(44, 2, 5, 4), rand(45, 2, 5, 4)
  valid = np.arange(5)[None] < np.array([2, 5])[:, None]
  feats = efficient.performer_features(jax.random.PRNGKey(6), 8, 4)
  proj = efficient.init_linformer_projections(jax.random.PRNGKey(7), 5, 3)
  run = {"linear": lambda q, k, v: efficient.linear_attention(q, k, v, mask=valid),
         "performer": lambda q, k, v: efficient.performer_attention(q, k, v, features=feats,
                                                                    mask=valid),
         "linformer": lambda q, k, v: efficient.linformer_attention(q, k, v, mask=valid,
                                                                    **proj)}[fn]
  got = run(q, k, v)
  assert got.shape == (2, 5, 4)
  np.testing.assert_allclose(got, run(q[:, None], k[:, None], v[:, None])[:, 0], **TOL)
  if fn == "linear":  # elu + 1 features, NumPy
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    a = phi(q.astype(np.float64)) @ np.swapaxes(phi(k.astype(np.float64)), -1, -2)
    a = a * valid[:, None, :]
    np.testing.assert_allclose(got, (a / a.sum(-1, keepdims=True)) @ v, **TOL)


def test_sparsemax_minus_inf_logit_with_a_mask():
  """An allowed -inf logit (e.g. an additive -inf bias) next to a masked key: the row is still
  the simplex projection of its allowed logits (Martins & Astudillo 2016, Alg. 1)."""
  z = np.array([[-np.inf, -50.0, 0.0, -np.inf], [-np.inf, -np.inf, 1.0, -np.inf],
                [-np.inf, 0.3, 0.1, -2.0]], np.float32)
  allowed = np.array([[1, 1, 0, 1], [1, 1, 0, 1], [1, 1, 1, 0]], bool)
  # NumPy: sort-based closed form over the finite allowed logits; -inf ones get 0
  want = np.zeros(z.shape)
  for r in range(3):
    idx = np.nonzero(allowed[r] & np.isfinite(z[r]))[0]
    if idx.size:
      s = -np.sort(-z[r, idx].astype(np.float64))
      ks = np.arange(1, s.size + 1)
      k_z = ks[1 + ks * s > np.cumsum(s)][-1]
      want[r, idx] = np.maximum(z[r, idx] - (np.cumsum(s)[k_z - 1] - 1) / k_z, 0)
  got = normalizers.sparsemax(z, allowed)
  np.testing.assert_allclose(got, want, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got)[[0, 2]].sum(-1), 1.0, rtol=1e-6)
  assert np.all(np.asarray(got)[1] == 0)  # no finite allowed logit: zeros, not NaN
  g = jax.grad(lambda x: jnp.sum(normalizers.sparsemax(x, allowed) * jnp.arange(4.0)))(
      jnp.where(jnp.isinf(z), -1e4, z))
  assert np.all(np.isfinite(g))


# ----------------------------------------------------------------------------- Linformer


def test_linformer_matches_numpy_with_gradients():
  q, k, v = rand(27, 2, 2, 12, 4), rand(28, 2, 2, 12, 4), rand(29, 2, 2, 12, 3)
  e, f = rand(30, 16, 5), rand(31, 16, 5)  # max_len 16 >= k_len 12, r = 5
  valid = np.arange(12)[None] < np.array([12, 7])[:, None]

  def np_linformer(q, k, v, e, f):  # Wang et al. eq. 7 with E_i = eᵀ, F_i = fᵀ
    vm = valid[:, None, :, None]
    kp = np.swapaxes(e[:12], 0, 1) @ np.where(vm, k, 0.0)  # [b, h, r, d]
    vp = np.swapaxes(f[:12], 0, 1) @ np.where(vm, v, 0.0)
    s = q @ np.swapaxes(kp, -1, -2) / np.sqrt(4)
    return np_masked_softmax(s, np.ones(s.shape, bool)) @ vp

  got = efficient.linformer_attention(q, k, v, proj_k=e, proj_v=f, mask=valid)
  np.testing.assert_allclose(got, np_linformer(*(x.astype(np.float64) for x in (q, k, v, e, f))),
                             **TOL)
  w = efficient.linformer_weights(q, k, proj_k=e, proj_v=f, mask=valid)
  np.testing.assert_allclose(w @ v, got, **TOL)
  # gradient in E against NumPy central differences (a few entries)
  ct = rand(32, *got.shape)
  g = jax.grad(lambda e: jnp.sum(efficient.linformer_attention(q, k, v, proj_k=e, proj_v=f,
                                                               mask=valid) * ct))(jnp.asarray(e))
  e64 = e.astype(np.float64)
  for idx in [(0, 0), (3, 2), (11, 4), (13, 1)]:
    d = np.zeros_like(e64)
    d[idx] = 1e-5
    fd = ((np_linformer(q, k, v, e64 + d, f) - np_linformer(q, k, v, e64 - d, f)) * ct).sum()
    np.testing.assert_allclose(g[idx], fd / 2e-5, rtol=1e-3, atol=1e-5)
  with pytest.raises(ValueError, match="max_len"):
    efficient.linformer_attention(q, k, v, proj_k=e[:8], proj_v=f[:8])


# ----------------------------------------------------------------------------- block-sparse


def test_sliding_window_and_bigbird_masks():
  m = np.asarray(efficient.sliding_window_mask(6, 6, 1, causal=False))[0, 0]
  np.testing.assert_array_equal(m, np.abs(np.arange(6)[:, None] - np.arange(6)[None]) <= 1)
  m = np.asarray(efficient.sliding_window_mask(6, 6, 2, causal=True))[0, 0]
  d = np.arange(6)[:, None] - np.arange(6)[None]
  np.testing.assert_array_equal(m, (d >= 0) & (d <= 2))
  bb = np.asarray(efficient.bigbird_mask(64, 64, block=8, num_global=1, num_random=2,
                                         rng_seed=5))[0, 0]
  blocks = bb[::8, ::8]
  assert blocks[0].all() and blocks[:, 0].all()  # global block sees and is seen by all
  a = np.arange(8)
  assert blocks[np.abs(a[:, None] - a[None]) <= 1].all()  # window of 3 blocks
  random_only = blocks & ~((np.abs(a[:, None] - a[None]) <= 1) | (a[:, None] < 1) | (a[None] < 1))
  assert (random_only.sum(1)[1:] <= 2).all() and random_only.sum() > 0
  np.testing.assert_array_equal(bb, np.repeat(np.repeat(blocks, 8, 0), 8, 1))
  same = efficient.bigbird_mask(64, 64, block=8, num_global=1, num_random=2, rng_seed=5)
  np.testing.assert_array_equal(bb, np.asarray(same)[0, 0])  # fixed by the seed
  causal = np.asarray(efficient.bigbird_mask(64, 64, block=8, causal=True))[0, 0]
  assert not np.any(np.triu(causal, 1))


@pytest.mark.parametrize("causal", [False, True])
def test_bigbird_draws_its_random_blocks_outside_the_window_and_globals(causal):
  """Every query block gets exactly num_random random key blocks where that many lie outside its
  window (|a - b| <= 1) and the global blocks, all of them where fewer do, and none after it
  when causal. Drawn among all key blocks, the draws landed on window or global blocks (#47:
  (128, 128, block 16, 1 global, 2 random, seed 0) gave [0, 0, 1, 2, 0, 1, 1, 1])."""
  cases = [(128, 128, 16, 1, 2, 0), (90, 90, 16, 1, 4, 2), (64, 96, 8, 2, 3, 1)]
  cases += [(1024, 1024, 64, 1, 3, seed) for seed in range(10)]
  for q_len, k_len, block, num_global, num_random, seed in cases:
    table = efficient.bigbird_blocks(q_len, k_len, block=block, num_global=num_global,
                                     num_random=num_random, rng_seed=seed, causal=causal)
    nq, nk = -(-q_len // block), -(-k_len // block)
    assert table.shape == (nq, nk)
    a = np.arange(nq)[:, None] + max(k_len - q_len, 0) // block  # among the key blocks
    b = np.arange(nk)[None, :]
    fixed = (np.abs(a - b) <= 1) | (a < num_global) | (b < num_global)  # [q_blocks, k_blocks]
    free = ~fixed & (b <= a) if causal else ~fixed
    random_blocks = table & ~fixed
    case = (q_len, k_len, block, num_global, num_random, seed)
    assert table[fixed].all(), case
    assert not (random_blocks & ~free).any(), case  # causal: none after the query block
    np.testing.assert_array_equal(random_blocks.sum(1),
                                  np.minimum(num_random, free.sum(1)), err_msg=str(case))


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_equals_reference_attention_with_same_mask(causal):
  b, h, s, d = 2, 2, 90, 8  # 90: the last 16-block is partial
  q, k, v = rand(33, b, h, s, d), rand(34, b, h, s, d), rand(35, b, h, s, d)
  valid = np.arange(s)[None] < np.array([90, 50])[:, None]
  pad = valid[:, None, None, :]
  ct = rand(36, b, h, s, d)
  cases = [
      (efficient.sliding_window_mask(s, s, 12, causal=causal),
       lambda q, k, v: efficient.sliding_window_attention(q, k, v, window=12, causal=causal,
                                                          mask=pad, block=16)),
      (efficient.bigbird_mask(s, s, block=16, num_global=1, num_random=1, causal=causal),
       lambda q, k, v: efficient.bigbird_attention(q, k, v, block=16, causal=causal, mask=pad)),
  ]
  for pattern, fn in cases:
    allowed = np.asarray(pattern) & pad
    np.testing.assert_allclose(jax.jit(fn)(q, k, v),
                               np_attention(q, k, v, allowed=allowed, causal=causal), **TOL)
    ref = lambda q, k, v: core.attend(q, k, v, mask=allowed, causal=causal,
                                      implementation="reference")[0]
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
    g_fn = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
    for a, g in zip(g_ref, g_fn):
      np.testing.assert_allclose(g, a, **GRAD_TOL)


# ----------------------------------------------------------------------------- registry


def test_registry_names_and_error():
  assert tuple(registry.MECHANISMS) == ("full", "linear", "performer", "linformer",
                                        "sliding_window", "bigbird")
  assert registry.POSITIONS_BIAS == ("alibi", "t5_bias")
  with pytest.raises(errors.UserError, match="valid mechanisms: full, linear, performer"):
    registry.get_mechanism("reformer")
  assert not registry.get_mechanism("linformer").supports.causal


@pytest.mark.parametrize("name", list(registry.MECHANISMS))
def test_every_mechanism_context_equals_its_weights_times_values(name):
  mech = registry.get_mechanism(name)
  b, h, s, d = 2, 2, 48, 8
  q, k, v = rand(37, b, h, s, d), rand(38, b, h, s, d), rand(39, b, h, s, d)
  params = mech.init(jax.random.PRNGKey(0), h, d, 64, num_features=32, projected_len=8)
  pad = (np.arange(s)[None] < np.array([48, 30])[:, None])[:, None, None, :]
  opts = dict(window=8, block=16)
  for causal in [c for c in (False, True) if (mech.supports.causal if c else True)]:

    @jax.jit
    def both(q, k, v, causal=causal):
      return (mech.fn(q, k, v, mask=pad, causal=causal, params=params, return_weights=True,
                      **opts),
              mech.fn(q, k, v, mask=pad, causal=causal, params=params, **opts))

    (ctx, w), (fast, none) = both(q, k, v)
    assert none is None and w.shape == (b, h, s, s)
    np.testing.assert_allclose(ctx, np.asarray(w) @ v, **TOL)
    np.testing.assert_allclose(fast, ctx, **TOL)
    assert np.all(np.asarray(w)[1, :, :, 30:] == 0)  # padded keys get no weight
  if not mech.supports.causal:
    with pytest.raises(ValueError, match="not causal"):
      mech.fn(q, k, v, causal=True, params=params)
  if not mech.supports.bias:
    with pytest.raises(ValueError, match="position bias"):
      mech.fn(q, k, v, params=params, bias=positions.AlibiBias(np.ones(h)))


def test_mechanisms_under_vmap_and_jit():
  q, k, v = rand(40, 3, 2, 16, 4), rand(41, 3, 2, 16, 4), rand(42, 3, 2, 16, 4)
  f = jax.jit(jax.vmap(lambda q, k, v: efficient.linear_attention(q, k, v, causal=True,
                                                                  chunk_size=4)))
  np.testing.assert_allclose(f(q, k, v), np_linear_attention(q, k, v, causal=True), **TOL)
  g = jax.jit(jax.vmap(lambda q, k, v: core.attend(
      q, k, v, bias=positions.AlibiBias(positions.alibi_slopes(2)), causal=True)[0]))
  np.testing.assert_allclose(g(q, k, v), np_attention(
      q, k, v, bias=np_alibi(16, 16, positions.alibi_slopes(2)), causal=True), **TOL)


def test_decoding_one_query_equals_the_full_rows():
  """KV-cache decoding: query p alone (q_offset = p) sees what row p of the full causal
  computation sees, for ALiBi (bias array with a [batch] offset) and the sliding window."""
  b, h, s, d = 2, 2, 12, 4
  q, k, v = rand(43, b, h, s, d), rand(44, b, h, s, d), rand(45, b, h, s, d)
  pos = np.array([7, 3])  # each sequence's current position
  rows = q[np.arange(b), :, pos][:, :, None]  # [b, h, 1, d]
  slopes = positions.alibi_slopes(h)
  full = np_attention(q, k, v, bias=np_alibi(s, s, slopes), causal=True)
  bias = positions.alibi_bias(1, s, h, causal=True, q_offset=pos)  # [b, h, 1, s]
  visible = np.arange(s)[None, None, None, :] <= pos[:, None, None, None]
  got = core.attend(rows, k, v, bias=bias, mask=visible)[0]
  np.testing.assert_allclose(got[:, :, 0], full[np.arange(b), :, pos], **TOL)
  window = registry.get_mechanism("sliding_window")
  full = np_attention(q, k, v, allowed=np.asarray(efficient.sliding_window_mask(
      s, s, 3, causal=True)), causal=True)
  got = window.fn(rows, k, v, causal=True, window=3, q_offset=pos)[0]
  np.testing.assert_allclose(got[:, :, 0], full[np.arange(b), :, pos], **TOL)


def test_repeat_kv_heads_maps_groups_and_refuses_a_non_divisor():
  """Grouped-query attention: kv head g serves query heads g*group .. (g+1)*group - 1; a kv-head
  count that does not divide the query heads is refused (it used to return too few heads)."""
  from attnlab.layers import attention as attention_layer  # pylint: disable=g-import-not-at-top
  x = np.arange(2 * 2 * 1 * 1, dtype=np.float32).reshape(2, 2, 1, 1)  # [batch, kv_heads=2, 1, 1]
  got = np.asarray(attention_layer.repeat_kv_heads(jnp.asarray(x), 6))
  np.testing.assert_array_equal(got[..., 0, 0], [[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]])
  for kv_heads, heads in ((4, 6), (8, 4)):
    with pytest.raises(ValueError, match="multiple"):
      attention_layer.repeat_kv_heads(jnp.zeros((1, kv_heads, 1, 1)), heads)
