"""Losses and their metric sums, shared by the tasks (pure jnp, jit-able)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


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
    return jnp.mean(losses), losses
  weights = weights.astype(losses.dtype)
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0), losses
