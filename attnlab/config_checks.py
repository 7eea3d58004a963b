"""The checks of a finished config, the one place they are made (`validate`, which
config_utils.validate and the trainer call): the common fields, the data lengths, the RNN's
score and implementation, and the Transformer families' attention subtree through
attnlab.attention.registry's one validation. Each failure is one ConfigError line saying what to
change.
"""

from __future__ import annotations

from attnlab.config_utils import ConfigDict
from attnlab.config_utils import check_choice
from attnlab.errors import ConfigError


OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("cosine", "linear", "constant")
# Values of optimizer.decay: which parameters weight decay applies to.
DECAYS = ("all", "matrices")
# Values of model.dtype, the compute dtype (attnlab.precision; parameters stay float32).
DTYPES = ("float32", "bfloat16", "float16")
# Values of matmul_precision, the train step's Dense products (attnlab.precision).
MATMUL_PRECISIONS = ("auto", "float32", "bfloat16")


def validate(config: ConfigDict) -> None:
  """Checks the common fields and the attention score and implementation names (the one place
  they are checked); raises ConfigError saying what to change."""
  def need(ok: bool, message: str) -> None:
    if not ok:
      raise ConfigError(message)
  for key in ("task", "seed", "num_train_steps", "batch_size", "log_every", "eval_every",
              "checkpoint_every", "keep_checkpoints", "optimizer"):
    need(key in config, f"config has no field {key!r}; start config files from "
                        f"attnlab.config_utils.base_config()")
  # The comparisons below need the types of the defaults (a config built in code, not through
  # set_value, may hold "x" where an int belongs).
  data = config.to_dict()
  from attnlab import run_config  # pylint: disable=g-import-not-at-top
  run_config.check_types(data, run_config.run_defaults(data))
  need(bool(config.task), "config.task is empty; set it to a registered task name")
  at_end = " (0: only at the end)"
  for key, least, note in (("num_train_steps", 0, ""), ("batch_size", 1, ""), ("log_every", 1, ""),
                           ("eval_every", 0, at_end), ("checkpoint_every", 0, at_end),
                           ("eval_batches", 0, " (0: the whole split)"),
                           ("keep_checkpoints", 1, "")):
    need(config.get(key, least) >= least, f"{key} must be >= {least}{note}, got {config[key]}")
  patience = config.get("early_stop_patience", 0)
  need(patience >= 0, f"early_stop_patience must be >= 0 (0: no early stopping), got {patience}")
  need(patience == 0 or config.eval_every > 0,
       f"early_stop_patience={patience} counts evaluations, but eval_every=0 evaluates only at the "
       f"end; set eval_every > 0")
  num_seeds = config.get("num_seeds", 1)
  need(isinstance(num_seeds, int) and num_seeds >= 1,
       f"num_seeds must be an int >= 1 (1: an ordinary run), got {num_seeds!r}")
  mesh = config.get("mesh")
  if mesh is not None:
    data, fsdp = mesh.get("data", -1), mesh.get("fsdp", 1)
    need(data == -1 or data >= 1, f"mesh.data must be -1 (all devices) or >= 1, got {data}")
    need(fsdp >= 1, f"mesh.fsdp must be >= 1 (1: parameters replicated), got {fsdp}")
    cpu = mesh.get("cpu_devices", -1)
    need(cpu >= -1, f"mesh.cpu_devices must be >= -1 (-1: automatic, 0: one per core, 1: one "
         f"device), got {cpu}")
  opt = config.optimizer
  check_choice("optimizer.name", opt.name, OPTIMIZERS, "optimizers")
  check_choice("optimizer.schedule", opt.schedule, SCHEDULES, "schedules")
  need(opt.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {opt.warmup_steps}")
  need(opt.weight_decay == 0 or opt.name == "adamw",
       f"optimizer.weight_decay={opt.weight_decay} is only used by adamw; set optimizer.name=adamw "
       f"or optimizer.weight_decay=0")
  check_choice("optimizer.decay", opt.get("decay", "all"), DECAYS)
  check_choice("matmul_precision", config.get("matmul_precision", "float32"), MATMUL_PRECISIONS)
  _validate_lengths(config.get("data"))
  _validate_attention(config.get("model"))
  model = config.get("model")
  if isinstance(model, ConfigDict) and "dtype" in model:
    check_choice("model.dtype", model.dtype, DTYPES, "dtypes")
  if isinstance(model, ConfigDict) and isinstance(model.get("attention"), ConfigDict):
    validate_attention_tree(model, config.task)


def _validate_lengths(data: ConfigDict | None) -> None:
  """data.buckets (padded lengths) and data.length_bins (upper edges of source-length bins): ints
  >= 1, the bins increasing (their defaults are empty, so check_types cannot check the items)."""
  if not isinstance(data, ConfigDict):
    return
  for key, what in (("buckets", "padded lengths, e.g. (16, 32, 64)"),
                    ("length_bins", "increasing upper edges of source lengths, e.g. (5, 10, 15)")):
    values = data.get(key)
    if not values:
      continue
    if (not isinstance(values, (list, tuple))
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)):
      raise ConfigError(f"data.{key} must be ints >= 1 ({what}), got {values!r:.80}")
    if key == "length_bins" and any(a >= b for a, b in zip(values, values[1:])):
      raise ConfigError(f"data.length_bins must increase ({what}), got {tuple(values)!r:.80}")


def _validate_attention(model: ConfigDict | None) -> None:
  """Checks the RNN family's model.score and model.implementation (the Transformer families'
  attention subtree: validate_attention_tree)."""
  if not isinstance(model, ConfigDict) or isinstance(model.get("attention"), ConfigDict):
    return
  if "score" not in model and "implementation" not in model:
    return
  # Imported here: reading a config file stays free of JAX.
  from attnlab.attention import core  # pylint: disable=g-import-not-at-top
  from attnlab.attention import scores  # pylint: disable=g-import-not-at-top
  score, implementation = model.get("score"), model.get("implementation")
  if score is not None:
    check_choice("model.score", score, scores.SCORE_FNS, "scores")
  if implementation is None:
    return
  check_choice("model.implementation", implementation, core.IMPLEMENTATIONS, "implementations")
  if implementation not in ("auto", "reference") and score not in (None, *core.FAST_SCORES):
    raise ConfigError(f"model.implementation={implementation} supports only the scores "
                      f"{', '.join(core.FAST_SCORES)}, not {score!r}; use implementation=auto "
                      f"or reference for other scores")


# The self-attention directions each task's model runs (a mechanism must support all of them):
# GPT is causal, BERT bidirectional, the Transformer both (encoder and decoder).
TASK_DIRECTIONS: dict[str, tuple[str, ...]] = {
    "causal_lm": ("causal",), "masked_lm": ("bidirectional",),
    "classification": ("bidirectional",), "long_range": ("bidirectional",),
    "translation": ("bidirectional", "causal")}
# How the errors name a task's model.
_TASK_MODELS = {"causal_lm": "GPT (causal)", "masked_lm": "BERT (bidirectional)",
                "classification": "BERT (bidirectional)",
                "long_range": "the long-range classifier (a BERT encoder)",
                "translation": "the Transformer (a causal decoder)"}


def validate_attention_tree(model: ConfigDict, task: str) -> None:
  """Checks `model.attention` (and model.position's bias) with attnlab.attention.registry's one
  validation; ConfigError with one line saying what to change."""
  # pylint: disable=g-import-not-at-top
  from attnlab.attention import config as attention_lib
  from attnlab.attention import positions
  position = model.get("position")
  if position is not None:
    check_choice("model.position", position,
                 positions.EMBEDDING_POSITIONS + positions.POSITION_BIASES, "positions")
  try:
    attention_lib.validate_tree(
        model.attention, directions=TASK_DIRECTIONS.get(task, ()),
        num_heads=model.get("num_heads", 0), position_bias=position in positions.POSITION_BIASES,
        attention_dropout=model.get("attention_dropout_rate", 0.0) > 0,
        where=_TASK_MODELS.get(task, ""))
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f"model.attention: {e}") from None
