"""Mixed precision: the compute dtype of a model (`config.model.dtype`) and dynamic loss scaling.

One policy for every family that supports it (GPT, BERT, the Transformer):

- parameters and optimizer state: float32, whatever the compute dtype. The modules create their
  parameters in float32 and cast them to the compute dtype where they are used, so gradients
  arrive in float32 and optax updates float32 arrays; a checkpoint holds float32 only, and a run
  trained in one dtype loads (load_run) and resumes (allow_config_change) in another.
- compute: `model.dtype` = float32 (default), bfloat16 or float16: every Dense, embedding and
  attention matmul runs on inputs and kernels cast to it, and the residual stream is held in it.
- in float32 always: the attention softmax (attnlab.attention: masked_softmax and the blocked
  kernel compute in at least float32), the layer-norm statistics (attnlab.layers.LayerNorm;
  flax's LayerNorm reduces in float32), the logits a model returns and so the losses and metrics.
- matmul precision (`config.matmul_precision`, float32 models): the train step's Dense products
  on bfloat16 operands, accumulated in float32 (`jax.default_matmul_precision("bfloat16")`
  around the step's trace, which attnlab.backends.cpu.matmul honours on the CPU). `auto`, the
  default, asks for it where it pays: a CPU with bfloat16 dot instructions (AVX512_BF16 or AMX),
  where the nano GPT's step is 1.2x faster (2000 steps: validation loss 1.784 against 1.782);
  elsewhere JAX's default stands.
  Only the train step: evaluation, generation and analysis compute in float32, so a run's
  evaluation records measure the float32 model. `float32` never rounds; `bfloat16` always.
- float16 only (its 5-bit exponent flushes small gradients to zero): dynamic loss scaling. The
  loss is multiplied by a scale S before differentiation and the gradients divided by S after;
  a step whose gradients are not finite applies no update and halves S; after
  `LOSS_SCALE_PERIOD` finite steps in a row S doubles. The scale lives in the optimizer state
  (`LossScaleState`, wrapped around the optimizer's own by `wrap_optimizer`), so it is saved in
  every checkpoint and a resumed float16 run is bit-identical to an uninterrupted one.
  bfloat16 has float32's exponent range and needs no scaling.

The loss scaling is written here (about 40 lines) rather than taken from a library: optax has no
loss scaler (only `apply_if_finite`), and DeepMind's `jmp` has had no release since 2023.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from attnlab.config_checks import MATMUL_PRECISIONS
from attnlab.config_utils import check_choice
from attnlab.errors import ConfigError

# model.dtype values -> the compute dtype.
DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
                          "float16": jnp.float16}
# Model families whose modules compute in model.dtype (the others are float32 only).
FAMILIES: tuple[str, ...] = ("gpt", "bert", "transformer")
# Dynamic loss scaling of float16 runs: first scale, finite steps before it doubles, the factor
# it grows and shrinks by, and the least scale (below 1 a scaled loss gains nothing).
LOSS_SCALE_INIT = 2.0 ** 15
LOSS_SCALE_PERIOD = 2000
LOSS_SCALE_FACTOR = 2.0
LOSS_SCALE_MIN = 1.0


def dtype_name(model_config: Any) -> str:
  """`model.dtype` of a config's model group ("float32" when the key is absent: older runs)."""
  if model_config is None or not hasattr(model_config, "get"):
    return "float32"
  return model_config.get("dtype", "float32") or "float32"


def compute_dtype(model_config: Any, family: str) -> Any:
  """The compute dtype a family's `from_config` passes to its model: None for float32 (the
  modules' default, so float32 models are exactly those of before), else jnp.bfloat16 or
  jnp.float16. ConfigError for a family that computes in float32 only."""
  name = dtype_name(model_config)
  if name not in DTYPES:
    raise ConfigError(f"unknown model.dtype {name!r}; valid dtypes: {', '.join(DTYPES)}")
  if name == "float32":
    return None
  if family not in FAMILIES:
    raise ConfigError(f"model.dtype={name} is not supported by the {family} model (it computes "
                      f"in float32); mixed precision is for the {', '.join(FAMILIES)} models: "
                      f"set model.dtype=float32")
  return DTYPES[name]


def matmul_precision(config: Any) -> str | None:
  """The `jax.default_matmul_precision` of `config`'s train step: "float32", "bfloat16", or None
  (JAX's default). `auto` is "bfloat16" for a float32 model of one seed on a CPU backend whose
  CPU has bfloat16 dot instructions, else None (several seeds are vmapped, and under vmap the
  products run from float32 copies: the rounding would only cost, 12% on the nano GPT's step);
  a config without the field (a run written before it) is float32, as it trained."""
  name = check_choice("matmul_precision", config.get("matmul_precision", "float32") or "float32",
                      MATMUL_PRECISIONS)
  if name != "auto":
    return name
  if (dtype_name(config.get("model")) != "float32" or jax.default_backend() != "cpu"
      or int(config.get("num_seeds", 1) or 1) > 1):  # vmapped seeds: see backends/cpu/matmul.py
    return None
  from attnlab.backends.cpu import matmul  # pylint: disable=g-import-not-at-top
  return "bfloat16" if matmul.native_bf16() else None


def matmul_scope(name: str | None) -> contextlib.AbstractContextManager:
  """The context to trace a train step in for `matmul_precision`'s answer `name`."""
  return contextlib.nullcontext() if name is None else jax.default_matmul_precision(name)


def needs_loss_scale(config: Any) -> bool:
  """Whether a run of `config` scales its loss (float16 compute)."""
  return dtype_name(config.get("model")) == "float16"


# ------------------------------------------------------------------------------ loss scaling


class LossScaleState(NamedTuple):
  """Optimizer state of a float16 run: the loss scale, the finite steps since it last changed,
  and the wrapped optimizer's own state."""
  # [] float32: the factor the loss is multiplied by before differentiation.
  scale: jax.Array
  # [] int32: finite steps in a row since the scale last changed.
  good_steps: jax.Array
  # The state of the optimizer it wraps.
  inner: Any


def all_finite(tree: Any) -> jax.Array:
  """[] bool: every element of every leaf is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def dynamic_loss_scale(tx: optax.GradientTransformation, *, init_scale: float = LOSS_SCALE_INIT,
                       period: int = LOSS_SCALE_PERIOD, factor: float = LOSS_SCALE_FACTOR,
                       min_scale: float = LOSS_SCALE_MIN) -> optax.GradientTransformation:
  """`tx` that takes unscaled gradients (`value_and_grad` divides them by the scale), skips the
  update of a step whose gradients are not finite, and adjusts the scale (module docstring)."""
  def init(params: Any) -> LossScaleState:
    return LossScaleState(jnp.asarray(init_scale, jnp.float32), jnp.zeros((), jnp.int32),
                          tx.init(params))

  def update(grads: Any, state: LossScaleState, params: Any = None) -> tuple[Any, LossScaleState]:
    finite = all_finite(grads)
    updates, inner = tx.update(grads, state.inner, params)
    keep = lambda new, old: jnp.where(finite, new, old)
    updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
    inner = jax.tree.map(keep, inner, state.inner)
    grow = finite & (state.good_steps + 1 >= period)
    scale = jnp.where(finite, jnp.where(grow, state.scale * factor, state.scale),
                      jnp.maximum(state.scale / factor, min_scale))
    good_steps = jnp.where(finite & ~grow, state.good_steps + 1, 0).astype(jnp.int32)
    return updates, LossScaleState(scale.astype(jnp.float32), good_steps, inner)

  return optax.GradientTransformation(init, update)


def wrap_optimizer(tx: optax.GradientTransformation, config: Any) -> optax.GradientTransformation:
  """The run's optimizer: `tx`, inside dynamic loss scaling when `config` computes in float16."""
  return dynamic_loss_scale(tx) if needs_loss_scale(config) else tx


def loss_scale(opt_state: Any) -> jax.Array | None:
  """The current loss scale of an optimizer state made by `wrap_optimizer` (None: unscaled)."""
  return opt_state.scale if isinstance(opt_state, LossScaleState) else None


def value_and_grad(loss_fn: Callable[..., tuple[jax.Array, Any]], opt_state: Any
                   ) -> Callable[..., tuple[tuple[jax.Array, Any], Any]]:
  """`jax.value_and_grad(loss_fn, has_aux=True)`, the loss scaled by the state's loss scale
  before differentiation and the returned loss and gradients unscaled (a plain value_and_grad
  when the state has no scale). The gradients may be inf/NaN on an overflowing float16 step:
  the optimizer made by `wrap_optimizer` then skips it."""
  scale = loss_scale(opt_state)
  if scale is None:
    return jax.value_and_grad(loss_fn, has_aux=True)

  def scaled(*args: Any) -> tuple[jax.Array, Any]:
    loss, aux = loss_fn(*args)
    return loss * scale.astype(loss.dtype), aux

  def fn(*args: Any) -> tuple[tuple[jax.Array, Any], Any]:
    (loss, aux), grads = jax.value_and_grad(scaled, has_aux=True)(*args)
    inverse = 1.0 / scale
    grads = jax.tree.map(lambda g: (g * inverse.astype(g.dtype)), grads)
    return (loss * inverse.astype(loss.dtype), aux), grads

  return fn
