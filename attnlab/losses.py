"""Losses and their metric sums, shared by the tasks (pure jnp, jit-able)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax import lax

from attnlab import parallel


def ratio(total: jax.Array, count: jax.Array | float) -> jax.Array:
  """total / max(count, 1), the two summed over the devices first where they are per-device values.

  In the data-parallel train step each device holds a slice of the batch (`jax.shard_map`,
  train.make_train_step); a loss written with `ratio` is then the whole batch's, equal on every
  device, and the step needs one all-reduce for all gradients. A count every device holds alike
  (a shape) counts each device's slice. Elsewhere it is plain division.
  """
  count = jnp.asarray(count, jnp.float32)
  axes = tuple(parallel.varying_axes(total) | parallel.varying_axes(count))
  if not axes:
    return total / jnp.maximum(count, 1.0)
  if parallel.varying_axes(count):
    total, count = lax.psum(parallel.vary((total, count), axes), axes)
  else:
    # A count held alike (a shape): each device's, times the devices. Summed by psum, such a
    # constant stayed a second all-reduce in the nano GPT's compiled step (beside the one of the
    # gradients and the loss), one more rendezvous of the devices per step.
    total = lax.psum(parallel.vary(total, axes), axes)
    count = count * math.prod(lax.axis_size(a) for a in axes)
  return total / jnp.maximum(count, 1.0)


def weighted_cross_entropy(logits: jax.Array, labels: jax.Array,
                           weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(sum of weighted CE, sum of weighted correct, sum of weights) over all leading axes."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [...]
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)  # [...]
  return jnp.sum(ce * weights), jnp.sum(correct * weights), jnp.sum(weights)


def sequence_loss(logits: jax.Array, targets: jax.Array,
                  weights: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """(mean cross-entropy over weighted positions, per-position losses `[batch, len]`)."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [batch, len]
  if weights is None:
    return ratio(jnp.sum(losses), losses.size), losses
  weights = weights.astype(losses.dtype)
  return ratio(jnp.sum(losses * weights), jnp.sum(weights)), losses
