"""Causal (next-token) language modelling with the GPT model (task "causal_lm").

Datasets (config.data.name):
- `tiny_shakespeare`: the 90% / 10% character split of attnlab.data; character tokenizer by
  default (`data.tokenizer=subword` trains a sentencepiece model of `data.vocab_size` pieces on
  the training text, cached under `data.tokenizer_dir`; `byte`: the UTF-8 bytes, a fixed
  vocabulary of 263 ids that encodes any text, so a run pretrained on one corpus fine-tunes on
  any other); a run keeps its tokenizer in RUN_DIR/assets and reads the text only when it trains
  or evaluates. Training batches are
  `batch_size` windows of block_size + 1 tokens at random offsets (nanoGPT's sampler), drawn
  from a generator seeded by (seed, step), so a resumed run sees the same batches. Evaluation covers every
  non-overlapping block_size window of the validation text (or the first `data.eval_windows`).
  A run imported from a Hugging Face checkpoint (attnlab import-hf) uses the checkpoint's
  tokenizer (`data.tokenizer=hf`, files in `data.tokenizer_path`; or `ids`: text written as token
  ids).
- `text`: the user's own corpus, `data.path` a UTF-8 text file or a folder of *.txt files (read
  in sorted order; attnlab.data.text_corpus): the first 90% of its characters train, the last
  10% are the held-out validation text; windows and evaluation as for Tiny Shakespeare. Character
  tokenizer built from the training part (`data.tokenizer=subword`: a sentencepiece model trained
  on it); characters a character vocabulary cannot encode are named in one line.
- `addition`: the synthetic "a+b=c" texts of attnlab.data, one per sequence:
  inputs `<start> a+b=c`, targets `a+b=c <end>`, padded to a fixed length. Evaluation adds the
  exact-answer accuracy: the fraction of validation sums whose greedy continuation after "=" is
  exactly the answer and `<end>`. It is computed in one teacher-forced pass: greedy decoding
  reproduces the answer iff the argmax at every answer position equals the target (each greedy
  step then sees exactly the teacher-forced prefix).
- `induction`: the synthetic task of attnlab.data (`get_dataset("induction")`): block_size + 1
  random ids in [0, data.vocab_size) per sequence, in which a segment of data.min_span ..
  data.max_span ids is copied to a random later offset, drawn from data.seed (-1: the run's
  seed); data.num_train training sequences (each epoch walks a fresh permutation of them drawn
  from (seed, epoch): a resumed run sees the same batches, the replicas of a num_seeds run
  different orders of the same sequences), data.num_eval validation ones.
  Evaluation adds `copy_loss` and `copy_accuracy`: the loss and argmax accuracy on the copied
  ids an induction head can predict (the copy's second to last ids: its first is random given
  what precedes it).
- `synthetic_tokens`: uniform random token ids in [0, data.vocab_size) drawn from the seed (no
  files), sampled in windows like the text; for throughput measurements (the loss stays at
  ln(vocab_size)). Its "text" is token ids separated by spaces (data.tokenizer is ignored).

Starting from a pretrained run (`config.init_from = WORKDIR` of a causal_lm run: an attnlab GPT
run or a GPT-2 imported with `attnlab import-hf`; `configs/gpt.py:pretrained=WORKDIR` sets it and
copies the run's architecture): the text datasets (tiny_shakespeare, text) are tokenized with
that run's tokenizer (its assets folder: an attnlab vocabulary, or the imported GPT-2's byte-level
BPE files), so token ids mean what they meant in pretraining; the other datasets need a run of
the same dataset. The architecture (sizes, positions, model.attention but its implementation, the
vocabulary; the output layer is always tied to the token table) must equal the run's
(`check_pretrained`, before the trainer writes anything, the differing keys in one line), and
`load_pretrained` gives the step-0 parameters that run's latest ones.

Fine-tuning: `frozen` leaves the embeddings (`finetune.freeze_embeddings`) and the lowest
`finetune.freeze_layers` blocks unchanged (attnlab.state.freeze: zero updates, no optimizer
state); configs/gpt.py's docstring has the recipe.

Metrics: loss (mean cross-entropy per target token, nats), perplexity = exp(loss), token
accuracy, for addition exact_match, for induction copy_loss and copy_accuracy.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import checkpoint as checkpoint_lib
from attnlab import data as data_lib
from attnlab import losses as losses_lib
from attnlab import models as models_lib
from attnlab.data import hf_tokenizer
from attnlab.data import assets as assets_lib
from attnlab.data import pipeline
from attnlab.data import text_corpus
from attnlab.data import tokenizers as tok_lib
from attnlab.data.pipeline import IndexedBatches
from attnlab.data.pipeline import rng_for
from attnlab.config_utils import check_choice
from attnlab.errors import ConfigError
from attnlab.layers import sown
from attnlab.models import gpt as gpt_lib
from attnlab.tasks import register_task
from attnlab.tasks.base import Task
from attnlab.tasks.base import data_location

# Datasets this task trains on.
DATASETS = ("tiny_shakespeare", "text", "addition", "synthetic_tokens", "induction")
# Datasets of text read from files, windows drawn from the token stream (`text`: data.path).
TEXT_DATASETS = ("tiny_shakespeare", "text")
# Datasets whose "text" is token ids (the vocabulary is data.vocab_size ids).
ID_DATASETS = ("synthetic_tokens", "induction")
# Model fields that must agree with a pretrained run (absent in an older config: these defaults).
PRETRAINED_MODEL_KEYS = {"mlp_ratio": 4, "position": "rotary", "activation": "gelu_tanh",
                         "use_bias": False, "layer_norm_epsilon": 1e-5, "vocab_size": 0,
                         "vocab_multiple": 1}
# synthetic_tokens: tokens in the training stream (windows are drawn from it as from a text) and
# validation windows.
SYNTHETIC_TRAIN_TOKENS = 1 << 20
SYNTHETIC_EVAL_WINDOWS = 8
# Tokenizers for tiny_shakespeare (addition always uses characters); hf and ids are those of an
# imported checkpoint (attnlab.data.hf_tokenizer), read from data.tokenizer_path.
TOKENIZERS = ("char", "byte", "subword", "hf", "ids")
# Tokenizers that come with the run rather than from the data (the text is read only to train).
PRETRAINED_TOKENIZERS = ("hf", "ids")
# Characters of the addition texts.
ADDITION_ALPHABET = "0123456789+="


def _windows(ids: np.ndarray, starts: np.ndarray, block: int) -> dict[str, np.ndarray]:
  """Inputs and next-token targets `[len(starts), block]` of the windows of `ids` at `starts`."""
  pos = starts[:, None] + np.arange(block)[None, :]  # [windows, block]
  return {"inputs": ids[pos], "targets": ids[pos + 1]}


def _induction_arrays(examples, with_mask: bool = True) -> dict[str, np.ndarray]:
  """inputs / targets `[n, length - 1]` of `induction` examples, with `weights` and (with_mask)
  `copy_mask`: True at the targets ids[dst + 1 .. dst + span - 1]."""
  ids = np.asarray([ex["ids"] for ex in examples], np.int32)  # [n, length]
  out = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
  if with_mask:
    target = np.arange(1, ids.shape[1])[None, :]  # [1, length - 1]: the id each target is
    dst = np.asarray([ex["dst"] for ex in examples])[:, None]  # [n, 1]
    span = np.asarray([ex["span"] for ex in examples])[:, None]
    out["weights"] = np.ones(out["inputs"].shape, np.float32)
    out["answer_mask"] = np.zeros(out["inputs"].shape, bool)
    out["copy_mask"] = ((target > dst) & (target < dst + span)).astype(np.float32)
  return out


def _data_kind(data) -> str:
  """What the token ids of a dataset are: "text" for the text datasets (the tokenizer goes with
  the pretrained run), else the dataset's name."""
  return "text" if data.get("name") in TEXT_DATASETS else data.get("name")


def pretraining_mismatch(pretrain, config) -> list[str]:
  """"key: value in the pretraining run, value here" for each architecture or data key in which
  a causal_lm config differs from the pretraining run's (module docstring)."""
  diffs = []
  a, b = (models_lib.config_dims("gpt", c.model) for c in (pretrain, config))
  for key in a:
    if a[key] != b[key]:
      diffs.append(f"model.{key}: {a[key]!r} in the pretraining run, {b[key]!r} here")
  for key, default in PRETRAINED_MODEL_KEYS.items():
    a, b = pretrain.model.get(key, default), config.model.get(key, default)
    if a != b:
      diffs.append(f"model.{key}: {a!r} in the pretraining run, {b!r} here")
  diffs += models_lib.attention_mismatch(pretrain.model, config.model)
  a, b = _data_kind(pretrain.data), _data_kind(config.data)
  if a != b:
    diffs.append(f"data.name: {pretrain.data.get('name')!r} in the pretraining run, "
                 f"{config.data.get('name')!r} here (text datasets: {', '.join(TEXT_DATASETS)})")
  keys = ("tokenizer",) if b == "text" else ("vocab_size",) if b in ID_DATASETS else ()
  for key in keys:
    if pretrain.data.get(key) != config.data.get(key):
      diffs.append(f"data.{key}: {pretrain.data.get(key)!r} in the pretraining run, "
                   f"{config.data.get(key)!r} here")
  return diffs


# Tokens of the end-of-run sample (prompt first) whose attention attention.png shows.
PLOT_TOKENS = 32


@register_task("causal_lm")
class CausalLMTask(Task):
  """Next-token prediction with attnlab.models.gpt.GPT (see the module docstring)."""

  def __init__(self, config, assets=None):
    super().__init__(config, assets)
    d = config.data
    check_choice("data.name", d.name, DATASETS)
    check_choice("data.tokenizer", d.tokenizer, TOKENIZERS)
    try:
      if d.name == "synthetic_tokens":
        self._setup_synthetic(d)
      elif d.name == "induction":
        self._setup_induction(d)
      elif d.name in TEXT_DATASETS:
        self._setup_text(d)
      else:
        self._setup_addition(d)
    except data_lib.DataError as e:  # missing files, bad options: one line for the user
      raise ConfigError(f"causal_lm data ({d.name}): {e}") from e
    vocab_size = config.model.get("vocab_size", 0) or len(self.tokenizer)
    if vocab_size < len(self.tokenizer):
      raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's "
                        f"{len(self.tokenizer)} tokens; raise it or set 0 (the tokenizer's size)")
    multiple = config.model.get("vocab_multiple", 1)
    if multiple < 1:
      raise ConfigError(f"model.vocab_multiple must be >= 1 (1: no padding), got {multiple}")
    vocab_size = -(-vocab_size // multiple) * multiple  # rows past the tokenizer's are never seen
    self.model = gpt_lib.from_config(config.model, vocab_size)
    self.block_size = self.model.block_size
    gpt_lib.check_freeze_layers(self._freezing()[1], self.model.num_layers)
    if self.seq_len > self.block_size:
      raise ConfigError(f"addition texts need {self.seq_len} positions but model.block_size is "
                        f"{self.block_size}; lower data.max_digits or raise model.block_size")

  # ---------------------------------------------------------------------------- data

  def _setup_text(self, d) -> None:
    # The text is read on first use (training, evaluation): a reloaded run keeps its tokenizer
    # (assets), so it generates text without the dataset.
    self.train_ids = self.val_ids = None
    self.seq_len = 0  # windows of block_size
    kept = self._pretrained_tokenizer()
    if kept is not None:  # config.init_from's: ids mean what they meant in pretraining
      build = lambda: kept
    elif d.tokenizer in PRETRAINED_TOKENIZERS:
      build = lambda: hf_tokenizer.load(d.tokenizer, d.get("tokenizer_path", ""),
                                        self.config.model.get("vocab_size", 0))
    elif d.tokenizer == "char":
      build = lambda: tok_lib.CharTokenizer.train([self._texts()[0]])
    elif d.tokenizer == "byte":  # a fixed vocabulary: the text is not read to build it
      build = tok_lib.ByteTokenizer
    else:
      # A text corpus's cache entry is named by its absolute path (edit the files: a new
      # data.tokenizer_dir, or delete the cached one).
      options = {"vocab_size": d.vocab_size}
      if d.name == "text":
        options["path"] = str(pathlib.Path(d.get("path", "")).expanduser().absolute())
      build = lambda: tok_lib.cached_subword(d.name, options, lambda: [self._texts()[0]],
                                             d.tokenizer_dir)
    self.tokenizer = self.asset_tokenizer("tokenizer", build)

  def _setup_synthetic(self, d) -> None:
    # Token ids are drawn in _text_ids; "text" is written as ids (hf_tokenizer.IdTokenizer).
    if d.vocab_size < 2:
      raise ConfigError(f"synthetic_tokens needs data.vocab_size >= 2, got {d.vocab_size}")
    self.train_ids = self.val_ids = None
    self.seq_len = 0  # windows of block_size
    self.tokenizer = self.asset_tokenizer("tokenizer", lambda: hf_tokenizer.IdTokenizer(
        d.vocab_size))

  def _setup_induction(self, d) -> None:
    # Sequences of block_size + 1 ids from attnlab.data's `induction` task, written as ids.
    if d.vocab_size < 2:
      raise ConfigError(f"induction needs data.vocab_size >= 2, got {d.vocab_size}")
    self.train_ids = self.val_ids = None
    self.seq_len = 0  # sequences of block_size, like windows
    self.tokenizer = self.asset_tokenizer("tokenizer", lambda: hf_tokenizer.IdTokenizer(
        d.vocab_size))
    block = models_lib.config_dims("gpt", self.config.model)["block_size"]
    options = {"seed": d.seed if d.seed >= 0 else self.config.seed, "length": block + 1,
               "vocab_size": d.vocab_size, "min_span": d.get("min_span", 2),
               "max_span": d.get("max_span", 16)}
    self.induction_train = data_lib.get_dataset("induction", "train", num_examples=d.num_train,
                                                **options)
    self.induction_val = _induction_arrays(data_lib.get_dataset(
        "induction", "validation", num_examples=d.num_eval, **options))

  def _pretrained_tokenizer(self) -> Any | None:
    """The tokenizer kept by the run config.init_from (None: no such run, or it keeps none, as an
    import without tokenizer files: then the data options build it)."""
    init_from = self.config.get("init_from", "")
    if not init_from:
      return None
    kept = pathlib.Path(init_from).expanduser() / assets_lib.DIRNAME
    return assets_lib.load_tokenizer(kept, "tokenizer") if kept.is_dir() else None

  def _texts(self) -> tuple[str, str]:
    """(training text, validation text) of Tiny Shakespeare or of data.path (`text`)."""
    if self.config.data.name == "text":
      return text_corpus.split_corpus(text_corpus.read_corpus(self.config.data.get("path", "")))
    return tuple(data_lib.get_dataset("tiny_shakespeare", split,
                                      **data_location(self.config.data))[0]["text"]
                 for split in ("train", "validation"))

  def _text_ids(self) -> None:
    """Reads and encodes the text on first use (draws the ids of synthetic_tokens)."""
    if self.seq_len or self.train_ids is not None:
      return
    if self.config.data.name == "synthetic_tokens":
      rng = np.random.default_rng([self.config.seed, 1])
      vocab, block = len(self.tokenizer), self.block_size
      self.train_ids = rng.integers(0, vocab, max(SYNTHETIC_TRAIN_TOKENS, 4 * block), np.int32)
      self.val_ids = rng.integers(0, vocab, SYNTHETIC_EVAL_WINDOWS * block + 1, np.int32)
      return
    try:
      train_text, val_text = self._texts()
    except data_lib.DataError as e:
      raise ConfigError(f"causal_lm data ({self.config.data.name}): {e}") from e
    train_ids = np.asarray(self.tokenizer.encode(train_text), np.int32)
    val_ids = np.asarray(self.tokenizer.encode(val_text), np.int32)
    if isinstance(self.tokenizer, tok_lib.Vocab) and self.tokenizer.kind == "char" and (
        np.any(train_ids == tok_lib.UNK_ID) or np.any(val_ids == tok_lib.UNK_ID)):
      self._check_characters(train_text, val_text)  # names the characters (one encoding pass)
    self.train_ids, self.val_ids = train_ids, val_ids

  def _check_characters(self, train_text: str, val_text: str) -> None:
    """ConfigError naming the characters of the text the character vocabulary lacks."""
    for part, text in (("training", train_text), ("validation", val_text)):
      unknown = self.tokenizer.unknown(text)
      if unknown:
        shown = " ".join(repr(c) for c in unknown[:20])
        more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
        whose = (f"the pretrained run's ({self.config.init_from})" if self.config.get("init_from")
                 else "this run's (built from the training part, the first 90%)")
        raise ConfigError(
            f"causal_lm data ({self.config.data.name}): the {part} text has {len(unknown)} "
            f"character{'s' if len(unknown) > 1 else ''} outside {whose} character vocabulary: "
            f"{shown}{more}; remove or replace {'them' if len(unknown) > 1 else 'it'} in the text")

  def validation_ids(self) -> np.ndarray:
    """Token ids `[n]` of the validation text of Tiny Shakespeare (or `text`) (read on first use, as for training;
    a reloaded run reads the dataset here)."""
    if self.seq_len or self.config.data.name == "induction":
      raise ValueError(f"validation_ids is the Tiny Shakespeare text's; this task reads "
                       f"{self.config.data.name} (see eval_batches)")
    self._text_ids()
    return self.val_ids

  def _setup_addition(self, d) -> None:
    if d.tokenizer in PRETRAINED_TOKENIZERS:
      raise ConfigError(f"data.tokenizer={d.tokenizer} works with tiny_shakespeare only; the "
                        f"addition texts use their own character tokenizer")
    seed = d.seed if d.seed >= 0 else self.config.seed
    self.tokenizer = tok_lib.CharTokenizer.train([ADDITION_ALPHABET])
    # <start> + a (max_digits) + "+" + b + "=" + sum (max_digits + 1); targets end with <end>.
    self.seq_len = 3 * d.max_digits + 4
    options = {"seed": seed, "min_digits": d.min_digits, "max_digits": d.max_digits}
    self.addition_train = self._encode_addition(
        data_lib.get_dataset("addition", "train", num_examples=d.num_train, **options))
    self.addition_val = self._encode_addition(
        data_lib.get_dataset("addition", "validation", num_examples=d.num_eval, **options))

  def _encode_addition(self, examples) -> dict[str, np.ndarray]:
    n, length = len(examples), self.seq_len
    inputs = np.zeros((n, length), np.int32)  # [n, len]
    targets = np.zeros((n, length), np.int32)
    weights = np.zeros((n, length), np.float32)
    answer = np.zeros((n, length), bool)
    for i, ex in enumerate(examples):
      ids = self.tokenizer.encode(ex["text"])
      inputs[i, :len(ids) + 1] = [self.tokenizer.start_id] + ids
      targets[i, :len(ids) + 1] = ids + [self.tokenizer.end_id]
      weights[i, :len(ids) + 1] = 1.0
      answer[i, len(self.tokenizer.encode(ex["source"])):len(ids) + 1] = True  # digits + <end>
    return {"inputs": inputs, "targets": targets, "weights": weights, "answer_mask": answer}

  def train_iterator(self) -> IndexedBatches:
    size, seed, block = self.config.batch_size, self.config.seed, self.block_size
    if self.config.data.name == "induction":
      # Every epoch walks a fresh permutation of the sequences drawn from (seed, epoch), so the
      # replicas of a num_seeds run (each its own config.seed) see different orders.
      examples = self.induction_train
      return IndexedBatches(lambda index: _induction_arrays(
          [examples[int(r)] for r in pipeline.permuted_rows(index, size, len(examples), seed)],
          with_mask=False))
    self._text_ids()
    if self.seq_len == 0:
      ids = self.train_ids
      if len(ids) <= block + 1:
        raise ConfigError(f"the training text has {len(ids)} tokens, too few for block_size "
                          f"{block}")

      return IndexedBatches(lambda index: _windows(
          ids, rng_for(seed, index).integers(0, len(ids) - block, size=size), block))

    # A fresh permutation of the training sums per epoch.
    arrays = {k: v for k, v in self.addition_train.items() if k != "answer_mask"}
    return pipeline.permuted_batches(arrays, size, seed)

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """Validation batches with per-position `weights` (0 on padding positions)."""
    size = self.config.data.eval_batch_size
    if self.config.data.name == "induction":
      return pipeline.ordered_batches(self.induction_val, size)
    self._text_ids()
    if self.seq_len == 0:
      block, ids = self.block_size, self.val_ids
      count = (len(ids) - 1) // block
      if self.config.data.eval_windows > 0:
        count = min(count, self.config.data.eval_windows)
      arrays = {**_windows(ids, np.arange(count) * block, block),
                "weights": np.ones((count, block), np.float32),
                "answer_mask": np.zeros((count, block), bool)}
    else:
      arrays = self.addition_val
    return pipeline.ordered_batches(arrays, size)

  # ---------------------------------------------------------------------------- model

  def init(self, rng: jax.Array) -> Any:
    tokens = jnp.zeros((1, self.block_size), jnp.int32)
    # jit: one compilation instead of one per operation of an eager init
    return jax.jit(self.model.init)(rng, tokens)["params"]

  def _freezing(self) -> tuple[bool, int]:
    """(finetune.freeze_embeddings, finetune.freeze_layers); (False, 0) without the group."""
    finetune = self.config.get("finetune") or {}
    return bool(finetune.get("freeze_embeddings", False)), int(finetune.get("freeze_layers", 0))

  def frozen(self):
    """The embeddings (finetune.freeze_embeddings: the token table, which is also the output
    layer, and the position table) and the lowest finetune.freeze_layers blocks; None when
    neither is set (gpt.frozen_mask)."""
    embeddings, layers = self._freezing()
    if not (embeddings or layers):
      return None
    return lambda params: gpt_lib.frozen_mask(params, embeddings=embeddings, layers=layers)

  @classmethod
  def check_pretrained(cls, config, pretrained_config) -> None:
    """A causal_lm run with this model's architecture and a dataset whose token ids mean the
    same (module docstring), else ConfigError naming the differing keys in one line."""
    task = pretrained_config.get("task")
    if task != "causal_lm":
      raise ConfigError(f"config.init_from={config.init_from} is a {task!r} run; a causal_lm run "
                        f"is needed (configs/gpt.py, or a GPT-2 imported with attnlab import-hf)")
    diffs = pretraining_mismatch(pretrained_config, config)
    if diffs:
      raise ConfigError(f"config.init_from={config.init_from} does not fit this model: "
                        f"{'; '.join(diffs)}; leave these keys to the pretrained run "
                        f"(configs/gpt.py:pretrained={config.init_from} copies them)")

  def load_pretrained(self, params, pretrained_config, pretrained_params):
    """The parameters of the run `config.init_from` (its latest checkpoint), every leaf of the
    same path, shape and dtype as `params`."""
    CausalLMTask.check_pretrained(self.config, pretrained_config)
    flat = lambda tree: {jax.tree_util.keystr(path): leaf for path, leaf
                         in jax.tree_util.tree_flatten_with_path(tree)[0]}
    diffs = checkpoint_lib.signature_diffs(checkpoint_lib.tree_signature(pretrained_params),
                                           checkpoint_lib.tree_signature(params), "pretrained")
    if diffs:
      raise ConfigError(f"config.init_from={self.config.init_from}: its parameters do not fit "
                        f"this model ({'; '.join(diffs[:3])}); fine-tune with "
                        f"configs/gpt.py:pretrained={self.config.init_from}")
    source = flat(pretrained_params)
    paths, tree = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree_util.tree_unflatten(
        tree, [np.array(source[jax.tree_util.keystr(path)]) for path, _ in paths])

  def loss_fn(self, params, batch, rng):
    deterministic = rng is None
    rngs = None if deterministic else {"dropout": rng}
    logits = self.model.apply({"params": params}, batch["inputs"], deterministic=deterministic,
                              rngs=rngs)  # [batch, len, vocab]
    loss, _ = losses_lib.sequence_loss(logits, batch["targets"], batch.get("weights"))
    return loss, {"perplexity": jnp.exp(loss)}

  def metric_sums(self, params, batch, rng=None) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Token-weighted loss and accuracy (+ exact_match per answer for addition)."""
    del rng  # evaluation only (training uses loss_fn)
    logits = self.model.apply({"params": params}, batch["inputs"])  # [batch, len, vocab]
    weights = batch["weights"]  # [batch, len]
    _, losses = losses_lib.sequence_loss(logits, batch["targets"], weights)
    correct = (jnp.argmax(logits, axis=-1) == batch["targets"])  # [batch, len]
    answer = batch["answer_mask"]  # [batch, len]
    has_answer = jnp.any(answer, axis=-1)  # [batch]
    exact = jnp.all(correct | ~answer, axis=-1) & has_answer  # [batch]
    tokens = jnp.sum(weights)
    sums = {"loss": (jnp.sum(losses * weights), tokens),
            "token_accuracy": (jnp.sum(correct * weights), tokens)}
    if self.seq_len:
      sums["exact_match"] = (jnp.sum(exact), jnp.sum(has_answer))
    if "copy_mask" in batch:  # induction: the copied ids an induction head can predict
      copied = batch["copy_mask"] * weights  # [batch, len]
      sums["copy_loss"] = (jnp.sum(losses * copied), jnp.sum(copied))
      sums["copy_accuracy"] = (jnp.sum(correct * copied), jnp.sum(copied))
    return sums

  def finish_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
    return {"loss": metrics["loss"], "perplexity": float(np.exp(metrics["loss"])),
            **{k: v for k, v in metrics.items() if k != "loss"}}

  # ---------------------------------------------------------------------------- text

  @property
  def default_prompt(self) -> str:
    """A prompt that suits the dataset."""
    if self.config.data.name in ID_DATASETS:
      return "0"
    if self.config.data.name == "text":
      return "\n"
    return "12+34=" if self.seq_len else "ROMEO:"

  def encode_prompt(self, text: str) -> np.ndarray:
    """Token ids `[len]` of a prompt (addition prompts get the leading <start>)."""
    ids = self.tokenizer.encode(text)
    if self.seq_len:
      ids = [self.tokenizer.start_id] + ids
    if not ids:
      ids = self.tokenizer.encode("\n") or [self.tokenizer.start_id]
    return np.asarray(ids, np.int32)

  def decode(self, ids: Any) -> str:
    """Text of generated ids (stops at <end>)."""
    return self.tokenizer.decode(np.asarray(ids).tolist())

  def sample_text(self, params, prompt: str, *, num_tokens: int, temperature: float,
                  top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                  use_cache: bool | None = None) -> str:
    """The prompt's continuation as text (temperature 0 = greedy; use_cache None: the KV cache
    when the attention mechanism supports it)."""
    return self.sample_texts(params, [prompt], num_tokens=num_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed, use_cache=use_cache)[0]

  def sample_texts(self, params, prompts: list[str], *, num_tokens: int, temperature: float,
                   top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                   use_cache: bool | None = None) -> list[str]:
    """The continuations of several prompts, of any lengths, sampled as one batch."""
    return self.sample_rows(params, prompts, num_tokens=num_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, use_cache=use_cache)[0]

  def sample_rows(self, params, prompts: list[str], *, num_tokens: int, temperature: float,
                  top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                  use_cache: bool = True) -> tuple[list[str], list[int]]:
    """(continuations, tokens generated in each): `num_tokens`, or fewer where an addition
    answer ended with <end>. Special tokens the training text never holds (padding, <start>,
    [CLS], [SEP], [MASK], <end> in a text stream, <unk> of a character vocabulary, ids past the
    tokenizer's) are never sampled:
    an undertrained model would otherwise pick them, and the text would lose them."""
    end_id = self.tokenizer.end_id if self.seq_len else None
    out = gpt_lib.generate(self.model, params, [self.encode_prompt(p) for p in prompts],
                           jax.random.key(seed), num_tokens=num_tokens, temperature=temperature,
                           top_k=top_k, top_p=top_p, use_cache=use_cache, end_id=end_id,
                           banned_ids=self._banned_ids())
    counts = [int(n) for n in np.asarray(out.lengths)]
    return [self.decode(row) for row in out.tokens], counts

  def _banned_ids(self) -> tuple[int, ...]:
    """Ids `sample_rows` never samples (see there); none of an imported tokenizer's specials."""
    banned = set(range(len(self.tokenizer), self.model.vocab_size))
    if isinstance(self.tokenizer, tok_lib.Vocab):
      banned |= {tok_lib.PAD_ID, tok_lib.START_ID, tok_lib.CLS_ID, tok_lib.SEP_ID, tok_lib.MASK_ID}
      if not self.seq_len:
        banned.add(tok_lib.END_ID)
      if self.tokenizer.kind in ("char", "byte"):  # every character (byte) has its own id
        banned.add(tok_lib.UNK_ID)
    return tuple(sorted(banned))

  def write_plots(self, params, workdir: pathlib.Path) -> None:
    """sample.txt (a generated continuation) and attention.png (every layer and head on the
    sample's first PLOT_TOKENS tokens). The attention capture is compiled, and matplotlib
    imported, on a second thread while the sample is generated, so that the trainer's wait for
    the plots, drawn beside its final evaluation, is not one thread's work end to end."""
    workdir = pathlib.Path(workdir)
    length = min(self.block_size, PLOT_TOKENS)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="attnlab-capture") as pool:
      capture = pool.submit(self._compile_capture, params, length)
      g = self.config.generate
      prompt = g.prompt or self.default_prompt
      text = self.sample_text(params, prompt, num_tokens=g.num_tokens, temperature=g.temperature,
                              top_k=g.top_k or None, seed=self.config.seed)
      (workdir / "sample.txt").write_text(prompt + text + "\n", encoding="utf-8")
      capture = capture.result()
    from attnlab import plotting  # pylint: disable=g-import-not-at-top  (matplotlib)
    ids = self.encode_prompt(prompt + text)[:length]
    # Padded to the compiled length: causal attention's first rows do not see the padding.
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(ids)] = ids
    inter = capture(params, jnp.asarray(padded))["intermediates"]
    weights = sown.stack_layers(sown.sown_values(inter))  # [layers, heads, length, length]
    weights = np.asarray(weights)[:, :, :len(ids), :len(ids)]
    labels = [repr(self.tokenizer.id_to_token(int(i)))[1:-1] for i in ids]
    plotting.attention_grid(weights, x_labels=labels, y_labels=labels,
                            title=f"GPT self-attention ({models_lib.score_name(self.config.model)})",
                            path=workdir / "attention.png")

  def _compile_capture(self, params, length: int):
    """The compiled program giving the model's sown intermediates (the attention weights) for
    `params` and ids `[1, length]`; imports matplotlib (attnlab.plotting) meanwhile."""
    from attnlab import plotting  # pylint: disable=g-import-not-at-top,unused-import
    capture = jax.jit(
        lambda p, x: self.model.apply({"params": p}, x, mutable=["intermediates"])[1])
    return capture.lower(params, jax.ShapeDtypeStruct((1, length), jnp.int32)).compile()
