"""Hostile and careless inputs: checkpoint files built to crash or leak, sizes that would exhaust
memory, config keys that are not config, paths with '..', a kill between a checkpoint and its
evaluation, a sweep member without its final record, and queries that may see no key.

Each case gives one line (a UserError subclass; through the CLI: one line on stderr and exit 2),
never a crash, a traceback or a read outside a buffer. End-to-end cases run the CLI in a subprocess,
as a user meets them (marked slow); the unpickler and safetensors reader are fuzzed with a bounded
number of seeded examples.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import errors
from attnlab.attention import core

REPO = pathlib.Path(__file__).resolve().parents[1]


def _cli(*args, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
  """`attnlab <args>` in a subprocess; stdout and stderr as text."""
  return subprocess.run([sys.executable, "-m", "attnlab.cli", *map(str, args)],
                        capture_output=True, text=True, timeout=timeout, **kwargs)


def _one_line(stderr: str) -> str:
  """The only line of stderr that is not a progress log (checked: no traceback)."""
  lines = [l for l in stderr.splitlines() if l.strip() and not l[:8].replace(":", "").isdigit()]
  assert len(lines) == 1, stderr
  assert "Traceback" not in stderr, stderr
  return lines[0]


# ---------------------------------------------------------------------------------------------------
# 9. A query that may see no key: zero context and zero gradients on every implementation


def _numpy_attention(q, k, v, allowed, scale):
  """softmax(scale q k^T) v over the allowed keys (a query with none: 0) and the gradients of
  sum(context * g) with respect to q, k, v (the softmax backward written out)."""
  logits = scale * q @ np.swapaxes(k, -1, -2)  # [b, h, q, k]
  logits = np.where(allowed, logits, -np.inf)
  row_ok = allowed.any(-1, keepdims=True)
  e = np.where(allowed, np.exp(logits - np.where(row_ok, logits.max(-1, keepdims=True), 0)), 0)
  p = e / np.where(row_ok, e.sum(-1, keepdims=True), 1)  # [b, h, q, k]
  return p @ v, p


def _numpy_grads(q, k, v, p, g, scale):
  dv = np.swapaxes(p, -1, -2) @ g
  dp = g @ np.swapaxes(v, -1, -2)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  return scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, dv


def _implementations():
  impls = ["reference", "xla", "blocked"]
  if jax.default_backend() == "gpu":
    impls.append("cudnn")
  return impls


@pytest.mark.parametrize("mask_kind", ["full", "padding"])
@pytest.mark.parametrize("implementation", _implementations())
def test_query_with_no_allowed_key_gets_zero_context_and_gradients(implementation, mask_kind):
  rng = np.random.default_rng(0)
  b, h, n, d = 2, 2, 6, 8
  dtype = np.float16 if implementation == "cudnn" else np.float32
  q, k, v, g = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(4))
  causal = np.tril(np.ones((n, n), bool))
  if mask_kind == "full":
    # Query 0 may see only key 0 (causal); the mask forbids it. Query 2 may see keys 0..2; the
    # mask allows only keys 3..5, in its future. Query 4 (batch 1) gets none at all.
    mask = np.ones((b, h, n, n), bool)
    mask[:, :, 0, 0] = False
    mask[:, :, 2, :3] = False
    mask[1, :, 4, :] = False
  else:
    # A padding mask [b, 1, 1, k] without key 0 in batch 0: its query 0 sees nothing causally.
    mask = np.ones((b, 1, 1, n), bool)
    mask[0, 0, 0, :2] = False
  allowed = np.broadcast_to(mask, (b, h, n, n)) & causal
  scale = 1.0 / np.sqrt(d)
  want, p = _numpy_attention(q, k, v, allowed, scale)
  want_grads = _numpy_grads(q, k, v, p, g, scale)
  empty = ~allowed.any(-1)  # [b, h, q]
  assert empty.any() and not empty.all()

  def loss(q, k, v):
    context, _ = core.attend(q, k, v, score="scaled_dot", mask=mask, causal=True,
                             implementation=implementation)
    return jnp.sum(context.astype(jnp.float32) * g), context

  args = [jnp.asarray(x, dtype) for x in (q, k, v)]
  (_, context), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*args)
  context = np.asarray(context, np.float32)
  tol = 2e-2 if dtype == np.float16 else 2e-5
  assert np.all(context[empty] == 0)
  np.testing.assert_allclose(context, want, atol=tol, rtol=tol)
  for got, expected in zip(grads, want_grads):
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, expected, atol=tol * 5, rtol=tol * 5)
  assert np.all(np.asarray(grads[0], np.float32)[empty] == 0)  # dq of a query with no key
