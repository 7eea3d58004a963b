"""Sinusoidal and rotary position encodings against NumPy loops; the heatmap plot."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.attention import positions as positions_lib


def np_sinusoidal(length, dim, base=10000.0):
  out = np.zeros((length, dim))
  for i in range(length):
    for c in range(dim):
      j = c // 2
      angle = i / base ** (2 * j / dim)
      out[i, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
  return out


@pytest.mark.parametrize("length,dim,base", [(7, 8, 10000.0), (5, 7, 10000.0), (4, 6, 100.0)])
def test_sinusoidal_matches_numpy(length, dim, base):
  got = positions_lib.sinusoidal(length, dim, base)
  assert got.shape == (length, dim) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, np_sinusoidal(length, dim, base), rtol=1e-6, atol=1e-6)


def test_sinusoidal_properties_dtype_and_jit():
  enc = np.asarray(positions_lib.sinusoidal(50, 16))
  np.testing.assert_allclose(enc[0, 0::2], 0.0, atol=1e-7)  # sin(0)
  np.testing.assert_allclose(enc[0, 1::2], 1.0, atol=1e-7)  # cos(0)
  np.testing.assert_allclose(enc[:, 0::2] ** 2 + enc[:, 1::2] ** 2, 1.0, atol=1e-6)
  assert positions_lib.sinusoidal(3, 4, dtype=jnp.bfloat16).dtype == jnp.bfloat16
  jitted = jax.jit(lambda x: x + positions_lib.sinusoidal(6, 4))(jnp.zeros((2, 6, 4)))
  np.testing.assert_allclose(jitted[1], np_sinusoidal(6, 4), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="dim >= 1"):
    positions_lib.sinusoidal(3, 0)
  for length, dim in ((3.5, 4), (3, 2.5), (True, 4)):  # np.arange(3.5) would give 4 rows
    with pytest.raises(ValueError, match="integers"):
      positions_lib.sinusoidal(length, dim)


def test_plot_sinusoidal(tmp_path):
  from matplotlib.figure import Figure
  from attnlab import plotting  # pylint: disable=g-import-not-at-top

  path = tmp_path / "plots" / "pe.png"
  fig = plotting.plot_sinusoidal(20, 8, path=path)
  assert isinstance(fig, Figure)
  assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  image = fig.axes[0].images[0].get_array()
  np.testing.assert_allclose(np.asarray(image), np_sinusoidal(20, 8), rtol=1e-6, atol=1e-6)
  assert fig.axes[0].get_xlabel() == "dimension" and fig.axes[0].get_ylabel() == "position"
  other = Figure()
  ax = other.add_subplot(1, 1, 1)
  assert plotting.plot_sinusoidal(5, 4, ax=ax) is other


def np_rotary(x, positions, base=10000.0):
  """Rotates pair (x[j], x[j + d/2]) at position p by p / base^(2j/d), one pair at a time."""
  x = np.asarray(x, np.float64)
  out = np.empty_like(x)
  half = x.shape[-1] // 2
  for idx in np.ndindex(*x.shape[:-2]):
    for i, p in enumerate(positions):
      for j in range(half):
        theta = p / base ** (2 * j / x.shape[-1])
        a, b = x[idx + (i, j)], x[idx + (i, j + half)]
        out[idx + (i, j)] = a * math.cos(theta) - b * math.sin(theta)
        out[idx + (i, j + half)] = b * math.cos(theta) + a * math.sin(theta)
  return out


def test_rotary_matches_numpy_and_keeps_norms():
  x = np.random.default_rng(0).normal(size=(2, 3, 5, 8)).astype(np.float32)
  positions = np.array([0, 1, 2, 7, 30])
  got = np.asarray(positions_lib.rotary(jnp.asarray(x), jnp.asarray(positions)))
  np.testing.assert_allclose(got, np_rotary(x, positions), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  np.testing.assert_array_equal(got[..., 0, :], x[..., 0, :])  # position 0 is not turned


def test_rotary_scores_depend_only_on_the_position_difference():
  rng = np.random.default_rng(1)
  q, k = rng.normal(size=(2, 16)).astype(np.float32)
  rot = lambda v, p: np.asarray(positions_lib.rotary(jnp.asarray(v)[None], jnp.asarray([p])))[0]
  scores = [float(rot(q, i) @ rot(k, j)) for i, j in ((5, 2), (13, 10), (40, 37))]
  np.testing.assert_allclose(scores, scores[0], rtol=1e-4)
  assert abs(float(rot(q, 5) @ rot(k, 1)) - scores[0]) > 1e-3  # another offset, another score
  with pytest.raises(ValueError, match="even"):
    positions_lib.rotary(jnp.zeros((3, 5)), jnp.arange(3))
