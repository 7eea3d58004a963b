"""Masks against NumPy references; combine, validation errors, jit/vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.attention import masks


def np_causal(q_len, k_len, offset):
  return np.array([[j <= i + offset for j in range(k_len)] for i in range(q_len)])


def np_local(q_len, k_len, window):
  return np.array([[abs(i - j) <= window for j in range(k_len)] for i in range(q_len)])


def test_padding_mask_from_lengths_and_valid():
  lengths = jnp.array([2, 4, 0])
  want = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
  got = masks.padding_mask(lengths, 4)
  assert got.shape == (3, 1, 1, 4) and got.dtype == jnp.bool_
  np.testing.assert_array_equal(got[:, 0, 0], want)
  np.testing.assert_array_equal(masks.padding_mask(jnp.asarray(want)), got)


def test_padding_mask_with_query_side_padding():
  k_valid = np.array([[1, 1, 0], [1, 1, 1]], bool)
  q_valid = np.array([[1, 0], [1, 1]], bool)
  got = masks.padding_mask(k_valid, q_valid=q_valid)
  assert got.shape == (2, 1, 2, 3)
  want = q_valid[:, None, :, None] & k_valid[:, None, None, :]
  np.testing.assert_array_equal(got, want)


def test_padding_mask_errors():
  with pytest.raises(ValueError, match="needs k_len"):
    masks.padding_mask(jnp.array([1, 2]))
  with pytest.raises(ValueError, match="integer lengths .* or a bool valid array"):
    masks.padding_mask(jnp.array([1.0, 2.0]), 3)
  with pytest.raises(ValueError, match="k_len=5 does not match"):
    masks.padding_mask(jnp.ones((2, 3), bool), 5)
  with pytest.raises(ValueError, match="q_valid must be a bool array"):
    masks.padding_mask(jnp.array([1, 2]), 3, q_valid=jnp.array([1, 2]))


@pytest.mark.parametrize("q_len,k_len,offset,eff", [
    (4, None, 0, 0), (3, 5, 0, 0), (3, 5, None, 2), (5, 3, None, 0), (2, 4, 1, 1)])
def test_causal_mask(q_len, k_len, offset, eff):
  got = masks.causal_mask(q_len, k_len, offset=offset)
  k_len = q_len if k_len is None else k_len
  assert got.shape == (1, 1, q_len, k_len)
  np.testing.assert_array_equal(got[0, 0], np_causal(q_len, k_len, eff))


def test_causal_mask_traced_and_batched_offset():
  # decoding one query against a KV cache of 6 slots at a traced position
  fn = jax.jit(lambda pos: masks.causal_mask(1, 6, offset=pos))
  np.testing.assert_array_equal(fn(3)[0, 0], np_causal(1, 6, 3))
  got = masks.causal_mask(2, 4, offset=jnp.array([0, 2]))
  assert got.shape == (2, 1, 2, 4)
  np.testing.assert_array_equal(got[0, 0], np_causal(2, 4, 0))
  np.testing.assert_array_equal(got[1, 0], np_causal(2, 4, 2))


def test_local_mask():
  got = masks.local_mask(4, 6, 1)
  assert got.shape == (1, 1, 4, 6)
  np.testing.assert_array_equal(got[0, 0], np_local(4, 6, 1))
  np.testing.assert_array_equal(masks.local_mask(3, 3, 0)[0, 0], np.eye(3, dtype=bool))
  with pytest.raises(ValueError, match="window must be >= 0"):
    masks.local_mask(3, 3, -1)


def test_combine():
  assert masks.combine() is None
  assert masks.combine(None, None) is None
  pad = masks.padding_mask(jnp.array([2, 3]), 3)  # [2, 1, 1, 3]
  causal = masks.causal_mask(3)  # [1, 1, 3, 3]
  got = masks.combine(pad, None, causal)
  assert got.shape == (2, 1, 3, 3)
  np.testing.assert_array_equal(got, np.asarray(pad) & np.asarray(causal))
  np.testing.assert_array_equal(masks.combine(None, causal), causal)
  with pytest.raises(ValueError, match=r"masks do not broadcast together.*\(2, 3\).*\(4, 3\)"):
    masks.combine(jnp.ones((2, 3), bool), jnp.ones((4, 3), bool))


def test_check_mask():
  logits_shape = (2, 4, 3, 5)
  ok = masks.check_mask(jnp.ones((2, 1, 1, 5), jnp.int32), logits_shape)
  assert ok.dtype == jnp.bool_ and ok.shape == (2, 1, 1, 5)
  # the 4-D masks of this module also fit single-head 3-D and 2-D logits
  assert masks.check_mask(masks.padding_mask(jnp.array([1, 2]), 5), (2, 3, 5)).shape == (2, 1, 5)
  assert masks.check_mask(masks.causal_mask(3, 5), (3, 5)).shape == (3, 5)
  with pytest.raises(ValueError) as err:
    masks.check_mask(jnp.ones((2, 1, 4, 5), bool), logits_shape)
  assert "(2, 1, 4, 5)" in str(err.value) and "(2, 4, 3, 5)" in str(err.value)
  assert "expected a bool mask broadcastable to [..., q_len, k_len]" in str(err.value)
  with pytest.raises(ValueError, match=r"mask of shape \(3, 3, 5\) does not broadcast"):
    masks.check_mask(jnp.ones((3, 3, 5), bool), (2, 3, 5))  # would grow the logits
  with pytest.raises(ValueError, match="mask must be boolean"):
    masks.check_mask(jnp.zeros((3, 5)), (3, 5))


def test_masks_under_jit_and_vmap():
  lengths = jnp.array([1, 3])
  fn = jax.jit(lambda n: masks.combine(masks.padding_mask(n, 4), masks.local_mask(4, 4, 1),
                                       masks.causal_mask(4)))
  want = (np.arange(4)[None, None, None, :] < np.array([1, 3])[:, None, None, None]) \
      & np_local(4, 4, 1) & np_causal(4, 4, 0)
  np.testing.assert_array_equal(fn(lengths), want)
  per_example = jax.vmap(lambda n: masks.padding_mask(n, 4))(lengths)  # [2, 1, 1, 4]
  np.testing.assert_array_equal(per_example, masks.padding_mask(lengths, 4))
