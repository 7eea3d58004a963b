"""BERT pretraining: masked language modelling + next-sentence prediction (task "masked_lm").

Corpus (`data.corpus`): Tiny Shakespeare's training split cut into documents (one speech each, a
list of sentences: `attnlab.data.shakespeare_documents`), optionally with the SST-2 training
sentences as extra single-segment text ("shakespeare+sst2"; the labels are never read).

Tokenizer: a sentencepiece subword vocabulary (`data.vocab_size`) trained on the corpus text,
cached under `data.tokenizer_dir` by a key of its options; fine-tuning builds the same one
(`bert_tokenizer`), so a pretrained encoder and its classifier share their vocabulary.

Examples (`make_pair`, `mask_tokens`), each drawn from a NumPy generator seeded by
(seed, stream, position in the stream), so an epoch is a fresh permutation and the masks and
random partners are redrawn every epoch (dynamic masking):
- pair stream: `[CLS] A [SEP] B [SEP]` with A a sentence that has a successor in its document
  and, with probability 1/2, B that successor (is_next = 1), else a sentence of another random
  document (is_next = 0). The longer side is cut (at its front or back, at random) until the pair
  fits `data.max_len`.
- single stream (with +sst2): `[CLS] sentence [SEP]`, MLM only (its NSP weight is 0); it fills
  `data.single_fraction` of each batch.
Masking: `mask_prob` of the ordinary tokens (never [CLS], [SEP] or padding; the count rounded
stochastically so the expected rate is exact) and at most `max_predictions` per sequence are
chosen; of those 80% become [MASK], 10% a random ordinary token, 10% stay. With
`data.whole_word=True` the choice is made among whole words (a word starts at a piece beginning
with "▁" or at a segment start) and a word is masked with all its pieces.

Loss: cross-entropy over the masked positions only (gathered: the MLM head never sees the rest)
+ NSP cross-entropy on the pooled [CLS] vector. Metrics: mlm_loss, mlm_accuracy, nsp_loss,
nsp_accuracy; evaluation on pairs from the validation split of Tiny Shakespeare with fixed masks.

Plots (`write_plots`): the head view of every layer and head, and the attention of [CLS], for
`data.plot_sentence`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from attnlab import data as data_lib
from attnlab.errors import ConfigError
from attnlab.data import hf_tokenizer
from attnlab.data import tokenizers
from attnlab.models import bert
from attnlab.tasks import register_task
from attnlab.tasks.base import IndexedBatches
from attnlab.tasks.base import Task
from attnlab.tasks.base import ratios
from attnlab.tasks.base import rng_for


# Corpora a pretraining run (and the tokenizer) can use.
CORPORA = ("shakespeare", "shakespeare+sst2")
# Ids below this are special tokens (<pad>, <start>, <end>, <unk>, [CLS], [SEP], [MASK]).
FIRST_ORDINARY_ID = len(tokenizers.SPECIAL_TOKENS)
# Stream ids for rng_for: pairs, single sentences, evaluation.
_PAIR_STREAM, _SINGLE_STREAM, _EVAL_STREAM = 1, 2, 3
# The sentence of the head-view plots (BERT's "it" coreference example).
DEFAULT_PLOT_SENTENCE = "The animal didn't cross the street because it was too tired."


# ---------------------------------------------------------------------------------------------------
# Tokenizer and corpus


def _data_kwargs(data: ml_collections.ConfigDict) -> dict[str, Any]:
  return dict(data_dir=data.data_dir or None, manual_dir=data.manual_dir or None)


def _sst2_split(split: str, limit: int) -> str:
  return f"{split}[:{limit}]" if limit > 0 else split


def corpus_texts(data: ml_collections.ConfigDict) -> tuple[list[list[str]], list[str]]:
  """(Shakespeare training documents, extra single sentences) of `data.corpus`."""
  if data.corpus not in CORPORA:
    raise ConfigError(f"unknown data.corpus {data.corpus!r}; valid corpora: {', '.join(CORPORA)}")
  documents = data_lib.shakespeare_documents("train", **_data_kwargs(data))
  if data.max_documents > 0:
    documents = documents[:data.max_documents]
  extra: list[str] = []
  if data.corpus == "shakespeare+sst2":
    examples = data_lib.get_dataset("sst2", _sst2_split("train", data.max_extra_sentences),
                                    **_data_kwargs(data))
    extra = [ex["sentence"] for ex in examples]
  return documents, extra


# data.tokenizer values: subword (the default: sentencepiece trained on the corpus) or the
# tokenizer of an imported checkpoint, hf (files in data.tokenizer_path) or ids (no files).
TOKENIZER_KINDS = ("subword", "hf", "ids")


def tokenizer_options(data: ml_collections.ConfigDict) -> dict[str, Any]:
  """The data options that determine the vocabulary (compared across pretraining/fine-tuning)."""
  options = {"corpus": data.corpus, "vocab_size": int(data.vocab_size),
             "max_documents": int(data.max_documents),
             "max_extra_sentences": int(data.max_extra_sentences)}
  if data.get("tokenizer", "subword") != "subword":
    options.update(tokenizer=data.tokenizer, tokenizer_path=data.get("tokenizer_path", ""))
  return options


def _tokenizer_dir(data: ml_collections.ConfigDict) -> pathlib.Path:
  if data.tokenizer_dir:
    return pathlib.Path(data.tokenizer_dir).expanduser()
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(cache) / "attnlab" / "bert_tokenizers"


def bert_tokenizer(data: ml_collections.ConfigDict) -> Any:
  """The subword tokenizer of these data options: loaded from the cache or trained and cached.

  Training is deterministic, so a missing cache only costs time, never a different vocabulary.
  With `data.tokenizer=hf` (or `ids`), the tokenizer of an imported checkpoint instead
  (attnlab.data.hf_tokenizer; `data.vocab_size` is then the model's vocabulary size).
  """
  kind = data.get("tokenizer", "subword")
  if kind not in TOKENIZER_KINDS:
    raise ConfigError(f"unknown data.tokenizer {kind!r}; valid: {', '.join(TOKENIZER_KINDS)}")
  if kind != "subword":
    try:
      tokenizer = hf_tokenizer.load(kind, data.get("tokenizer_path", ""), data.vocab_size)
    except data_lib.DataError as e:
      raise ConfigError(str(e)) from None
    if len(tokenizer) > data.vocab_size:
      raise ConfigError(f"data.vocab_size={data.vocab_size} is smaller than the tokenizer's "
                        f"{len(tokenizer)} tokens; set it to the checkpoint's vocabulary size")
    return tokenizer
  options = tokenizer_options(data)
  key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
  path = _tokenizer_dir(data) / f"{key}.json"

  def texts() -> list[str]:
    documents, extra = corpus_texts(data)
    return [s for doc in documents for s in doc] + extra
  return tokenizers.load_or_train_tokenizer(path, "subword", texts,
                                            vocab_size=options["vocab_size"])


def word_start_table(tokenizer: tokenizers.Vocab) -> np.ndarray:
  """bool `[vocab]`: True where a piece begins a word (starts with "▁") or is special.

  For a WordPiece vocabulary (data.tokenizer=hf): every piece but the "##" continuations.
  """
  if tokenizer.kind in ("hf", "ids"):
    return np.array([not t.startswith("##") for t in tokenizer.tokens], bool)  # [vocab]
  table = np.array([t.startswith("\u2581") for t in tokenizer.tokens], bool)  # [vocab]
  table[:FIRST_ORDINARY_ID] = True
  return table


def model_vocab_size(data: ml_collections.ConfigDict, tokenizer: Any) -> int:
  """Rows of the token table: the tokenizer's size, or data.vocab_size for an imported one."""
  return len(tokenizer) if data.get("tokenizer", "subword") == "subword" else int(data.vocab_size)


def special_ids(tokenizer: Any, vocab_size: int) -> dict[str, Any] | None:
  """{cls_id, sep_id, mask_id, ordinary} of an imported tokenizer (PretrainingData's
  `special`); None for attnlab's own vocabularies (ids 0..6 special)."""
  if tokenizer.kind not in ("hf", "ids"):
    return None
  ids = {"cls_id": tokenizer.cls_id, "sep_id": tokenizer.sep_id, "mask_id": tokenizer.mask_id}
  missing = [k[:-3] for k, v in ids.items() if v is None]
  if missing:
    raise ConfigError(f"the tokenizer has no {', '.join(missing)} token, which BERT's pairs and "
                      f"masks need; import a checkpoint whose tokenizer has [CLS], [SEP], [MASK]")
  ordinary = np.zeros((vocab_size,), bool)  # [vocab]
  ordinary[:len(tokenizer)] = True
  ordinary[list(tokenizer.all_special_ids)] = False
  return {**ids, "ordinary": ordinary}


# ---------------------------------------------------------------------------------------------------
# Examples


class MaskedExample(NamedTuple):
  # int32 [max_len] input ids ([MASK] etc. in place), padded with 0.
  tokens: np.ndarray
  # int32 [max_len] segment ids (0 = [CLS] + A + first [SEP], 1 = B + last [SEP]).
  segments: np.ndarray
  # bool [max_len] True = real token.
  valid: np.ndarray
  # int32 [max_predictions] masked positions (0 where unused).
  mlm_positions: np.ndarray
  # int32 [max_predictions] original ids at those positions (0 where unused).
  mlm_labels: np.ndarray
  # float32 [max_predictions] 1 = a real prediction, 0 = padding.
  mlm_weights: np.ndarray
  # int32 [] 1 = B follows A, 0 = B is random (or no B).
  is_next: np.ndarray
  # float32 [] 1 = the example counts for NSP, 0 = single segment.
  nsp_weight: np.ndarray


def truncate_pair(a: list[int], b: list[int], max_tokens: int,
                  rng: np.random.Generator) -> tuple[list[int], list[int]]:
  """Cuts one token at a time from the longer side (front or back at random) until they fit."""
  a, b = list(a), list(b)
  while len(a) + len(b) > max_tokens:
    longer = a if len(a) > len(b) else b
    if rng.random() < 0.5:
      del longer[0]
    else:
      longer.pop()
  return a, b


def make_pair(a: Sequence[int], b: Sequence[int] | None, max_len: int,
              rng: np.random.Generator, *, cls_id: int = tokenizers.CLS_ID,
              sep_id: int = tokenizers.SEP_ID) -> tuple[list[int], list[int]]:
  """(`[CLS] A [SEP] B [SEP]` ids, segment ids), or `[CLS] A [SEP]` when b is None; fits max_len.

  cls_id, sep_id: the tokenizer's ids (`tokenizer.cls_id`; an imported vocabulary has its own).
  """
  if b is None:
    a = list(a)[:max_len - 2]
    return [cls_id, *a, sep_id], [0] * (len(a) + 2)
  a, b = truncate_pair(a, b, max_len - 3, rng)
  ids = [cls_id, *a, sep_id, *b, sep_id]
  return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)


def mask_tokens(ids: Sequence[int], rng: np.random.Generator, *, vocab_size: int,
                mask_prob: float = 0.15, max_predictions: int = 20,
                word_starts: np.ndarray | None = None, mask_id: int = tokenizers.MASK_ID,
                ordinary: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """BERT's masking of one sequence.

  Args:
    ids: the sequence (special tokens included; they are never chosen).
    rng: NumPy generator.
    vocab_size: random replacements are drawn from the ordinary ids [7, vocab_size).
    mask_prob: expected fraction of ordinary tokens chosen (stochastic rounding of the count).
    max_predictions: cap on the number chosen.
    word_starts: bool `[vocab]` (word_start_table) for whole-word masking; None = per piece.
    mask_id: the tokenizer's [MASK] id.
    ordinary: bool `[vocab]`, True = an ordinary token (may be chosen, or drawn as a random
      replacement); None = the ids >= 7 (attnlab's vocabularies).
  Returns:
    (masked ids int32 `[len]`, chosen positions int32 `[n]` ascending, their original ids `[n]`).
  """
  ids = np.asarray(ids, np.int32)  # [len]
  if ordinary is None:
    candidates = np.flatnonzero(ids >= FIRST_ORDINARY_ID)  # [num_candidates]
  else:
    candidates = np.flatnonzero(ordinary[ids])  # [num_candidates]
  # Group candidates into words: a new word at a word-start piece or after a non-candidate.
  words: list[list[int]] = []
  for pos in candidates:
    starts = (word_starts is None or bool(word_starts[ids[pos]]) or not words
              or words[-1][-1] != pos - 1)
    if starts:
      words.append([int(pos)])
    else:
      words[-1].append(int(pos))
  target = int(np.floor(len(candidates) * mask_prob + rng.random()))
  target = min(target, max_predictions)
  chosen: list[int] = []
  for w in rng.permutation(len(words)):
    if len(chosen) >= target:
      break
    if len(chosen) + len(words[w]) > target:
      continue
    chosen.extend(words[w])
  positions = np.sort(np.asarray(chosen, np.int32))  # [n]
  labels = ids[positions]  # [n]
  masked = ids.copy()
  u = rng.random(len(positions))  # [n]
  if ordinary is None:
    random_ids = rng.integers(FIRST_ORDINARY_ID, vocab_size, len(positions))  # [n]
  else:
    random_ids = np.flatnonzero(ordinary)[rng.integers(0, int(ordinary.sum()), len(positions))]
  masked[positions] = np.where(u < 0.8, mask_id,
                               np.where(u < 0.9, random_ids, labels))
  return masked, positions, labels


def pack_example(ids: list[int], segments: list[int], rng: np.random.Generator, *,
                 max_len: int, is_next: int, nsp_weight: float, vocab_size: int,
                 mask_prob: float, max_predictions: int,
                 word_starts: np.ndarray | None, mask_id: int = tokenizers.MASK_ID,
                 ordinary: np.ndarray | None = None) -> MaskedExample:
  """Masks a sequence and pads it to fixed-size arrays."""
  masked, positions, labels = mask_tokens(ids, rng, vocab_size=vocab_size, mask_prob=mask_prob,
                                          max_predictions=max_predictions,
                                          word_starts=word_starts, mask_id=mask_id,
                                          ordinary=ordinary)
  n, length = len(positions), len(ids)
  pad = lambda x, size, dtype: np.pad(np.asarray(x, dtype), (0, size - len(x)))
  return MaskedExample(
      tokens=pad(masked, max_len, np.int32), segments=pad(segments, max_len, np.int32),
      valid=np.arange(max_len) < length, mlm_positions=pad(positions, max_predictions, np.int32),
      mlm_labels=pad(labels, max_predictions, np.int32),
      mlm_weights=pad(np.ones(n), max_predictions, np.float32),
      is_next=np.asarray(is_next, np.int32), nsp_weight=np.asarray(nsp_weight, np.float32))


def stack_examples(examples: Sequence[MaskedExample]) -> dict[str, np.ndarray]:
  """A batch dict: every field stacked along a new leading axis."""
  return {field: np.stack([getattr(ex, field) for ex in examples])
          for field in MaskedExample._fields}


class PretrainingData:
  """Encoded documents and the two example streams (module docstring)."""

  def __init__(self, documents: Sequence[Sequence[Sequence[int]]],
               singles: Sequence[Sequence[int]], *, vocab_size: int, max_len: int,
               mask_prob: float = 0.15, max_predictions: int = 20,
               word_starts: np.ndarray | None = None, special: dict[str, Any] | None = None):
    """documents: encoded sentences per document; singles: encoded extra sentences;
    special: {cls_id, sep_id, mask_id, ordinary} of the tokenizer (`special_ids`; None: attnlab's
    fixed ids)."""
    self.documents = [list(map(list, doc)) for doc in documents if len(doc)]
    self.singles = [list(s) for s in singles if len(s)]
    # (document, sentence) of every sentence with a successor in its document.
    self.anchors = [(d, s) for d, doc in enumerate(self.documents) for s in range(len(doc) - 1)]
    if not self.anchors:
      raise ConfigError("the pretraining corpus has no document with two sentences, so no "
                        "next-sentence pair can be built; use more documents (data.max_documents)")
    if len(self.documents) < 2:
      raise ConfigError("random next-sentence partners need at least two documents")
    self.options = dict(vocab_size=vocab_size, max_len=max_len, mask_prob=mask_prob,
                        max_predictions=max_predictions, word_starts=word_starts)
    self.special = dict(special or {})

  def pair_example(self, anchor: int, rng: np.random.Generator) -> MaskedExample:
    """The pair of anchor `anchor`: real successor or random partner with probability 1/2."""
    d, s = self.anchors[anchor]
    a = self.documents[d][s]
    if rng.random() < 0.5:
      b, is_next = self.documents[d][s + 1], 1
    else:
      other = int(rng.integers(len(self.documents) - 1))
      other += other >= d  # any document but d
      doc = self.documents[other]
      b, is_next = doc[int(rng.integers(len(doc)))], 0
    ids, segments = make_pair(a, b, self.options["max_len"], rng, **self._pair_ids())
    return self._pack(ids, segments, rng, is_next=is_next, nsp_weight=1.0)

  def single_example(self, index: int, rng: np.random.Generator) -> MaskedExample:
    """`[CLS] sentence [SEP]` of extra sentence `index`, MLM only."""
    ids, segments = make_pair(self.singles[index], None, self.options["max_len"], rng,
                              **self._pair_ids())
    return self._pack(ids, segments, rng, is_next=0, nsp_weight=0.0)

  def _pair_ids(self) -> dict[str, int]:
    return {k: self.special[k] for k in ("cls_id", "sep_id") if k in self.special}

  def _pack(self, ids, segments, rng, **kw) -> MaskedExample:
    opts = self.options
    masking = {k: self.special[k] for k in ("mask_id", "ordinary") if k in self.special}
    return pack_example(ids, segments, rng, max_len=opts["max_len"], vocab_size=opts["vocab_size"],
                        mask_prob=opts["mask_prob"], max_predictions=opts["max_predictions"],
                        word_starts=opts["word_starts"], **masking, **kw)

  def stream(self, kind: int, position: int, seed: int) -> MaskedExample:
    """Example `position` of a stream: epoch = position // size walks a fresh permutation; the
    generator depends on the position itself, so masks and partners change every epoch."""
    size = len(self.anchors) if kind == _PAIR_STREAM else len(self.singles)
    epoch, offset = divmod(position, size)
    index = int(rng_for(seed, kind, epoch).permutation(size)[offset])
    rng = rng_for(seed, kind, epoch, offset, 1)
    if kind == _PAIR_STREAM:
      return self.pair_example(index, rng)
    return self.single_example(index, rng)

  def batch(self, index: int, batch_size: int, num_single: int, seed: int) -> dict[str, np.ndarray]:
    """Training batch `index`: batch_size - num_single pairs, then num_single single sentences."""
    num_pairs = batch_size - num_single
    examples = [self.stream(_PAIR_STREAM, index * num_pairs + j, seed) for j in range(num_pairs)]
    examples += [self.stream(_SINGLE_STREAM, index * num_single + j, seed)
                 for j in range(num_single)]
    return stack_examples(examples)


# ---------------------------------------------------------------------------------------------------
# Losses and plots shared with classification


def weighted_cross_entropy(logits: jax.Array, labels: jax.Array,
                           weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(sum of weighted CE, sum of weighted correct, sum of weights) over all leading axes."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [...]
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)  # [...]
  return jnp.sum(ce * weights), jnp.sum(correct * weights), jnp.sum(weights)


def model_kwargs(config: ml_collections.ConfigDict, vocab_size: int) -> dict[str, Any]:
  """Encoder hyperparameters of `config.model` (checked) as keyword arguments of the BERT models."""
  m = config.model
  if config.data.max_len > m.max_len:
    raise ConfigError(f"data.max_len={config.data.max_len} exceeds model.max_len={m.max_len} "
                      "(rows of the position table); lower data.max_len or raise model.max_len")
  if config.data.max_len < 8:
    raise ConfigError(f"data.max_len must be >= 8, got {config.data.max_len}")
  return dict(vocab_size=vocab_size, num_layers=m.num_layers, d_model=m.d_model,
              num_heads=m.num_heads, mlp_dim=m.mlp_dim, max_len=m.max_len,
              dropout_rate=m.dropout_rate, attention_dropout_rate=m.attention_dropout_rate,
              score=m.score, implementation=m.implementation, activation=m.activation,
              norm_position=m.norm_position,
              # Written by attnlab import-hf; absent from older configs (BERT's values).
              layer_norm_epsilon=m.get("layer_norm_epsilon", 1e-12),
              type_vocab_size=m.get("type_vocab_size", bert.NUM_SEGMENTS))


def encode_sentence(tokenizer: tokenizers.Vocab, sentence: str,
                    max_len: int) -> tuple[np.ndarray, list[str]]:
  """(ids `[1, n]` of `[CLS] sentence [SEP]`, the n token labels) for plots."""
  ids, _ = make_pair(tokenizer.encode(sentence), None, max_len, np.random.default_rng(0),
                     cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id)
  labels = [tokenizer.id_to_token(i).replace("\u2581", "_") for i in ids]
  return np.asarray([ids], np.int32), labels


def stacked_attention(intermediates: Any) -> np.ndarray:
  """The encoder's sown weights as `[layers, heads, q_len, k_len]` (first example of the batch)."""
  blocks = intermediates["encoder"]
  names = sorted(blocks, key=lambda n: int(n.split("_")[-1]))
  return np.stack([np.asarray(blocks[n]["self_attention"]["attention_weights"][0][0])
                   for n in names])


def plot_head_views(apply_fn, tokenizer: tokenizers.Vocab, sentence: str, max_len: int,
                    workdir: pathlib.Path, title: str) -> dict[str, pathlib.Path]:
  """Head view (every layer and head) and [CLS] attention for one sentence, saved as PNGs.

  apply_fn(tokens) runs the model with "intermediates" mutable and returns its intermediates.
  Returns {"head_view": path, "cls_attention": path}.
  """
  from attnlab import plotting  # pylint: disable=g-import-not-at-top  (matplotlib import is slow)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ids, labels = encode_sentence(tokenizer, sentence, max_len)
  weights = stacked_attention(apply_fn(jnp.asarray(ids)))  # [layers, heads, n, n]
  layers, heads = weights.shape[:2]
  workdir = pathlib.Path(workdir)
  paths = {"head_view": workdir / "head_view.png", "cls_attention": workdir / "cls_attention.png"}
  fig = plotting.attention_grid(weights, x_labels=labels, y_labels=labels,
                                title=f"{title}: {sentence}", path=paths["head_view"])
  plt.close(fig)
  cls_rows = weights[:, :, 0, :].reshape(layers * heads, -1)  # [layers * heads, n]
  row_names = [f"L{l} H{h}" for l in range(layers) for h in range(heads)]
  fig = plotting.attention_heatmap(cls_rows, x_labels=labels, y_labels=row_names,
                                   title=f"{title}: attention of [CLS]", ylabel="layer, head",
                                   path=paths["cls_attention"])
  plt.close(fig)
  return paths


# ---------------------------------------------------------------------------------------------------
# The task


@register_task("masked_lm")
class MaskedLMTask(Task):
  """BERT pretraining (module docstring). Data are built on first use, so reloading a run for
  analysis (attnlab.analysis.load_run) needs only the cached tokenizer."""

  def __init__(self, config: ml_collections.ConfigDict):
    super().__init__(config)
    data = config.data
    if not 0.0 < data.mask_prob < 1.0:
      raise ConfigError(f"data.mask_prob must be in (0, 1), got {data.mask_prob}")
    if data.max_predictions < 1:
      raise ConfigError(f"data.max_predictions must be >= 1, got {data.max_predictions}")
    if not 0.0 <= data.single_fraction < 1.0:
      raise ConfigError(f"data.single_fraction must be in [0, 1), got {data.single_fraction}")
    self.tokenizer = bert_tokenizer(data)
    self.vocab_size = model_vocab_size(data, self.tokenizer)
    self.model = bert.BertForPretraining(**model_kwargs(config, self.vocab_size))
    self.num_single = (int(round(config.batch_size * data.single_fraction))
                       if data.corpus == "shakespeare+sst2" else 0)
    if self.num_single >= config.batch_size:
      raise ConfigError("data.single_fraction leaves no next-sentence pair in a batch; lower it")
    self._train_data: PretrainingData | None = None
    self._eval_batches: list[dict[str, np.ndarray]] | None = None

  # ---- data
  def _encode_docs(self, documents):
    return [[self.tokenizer.encode(s) for s in doc] for doc in documents]

  def _data_options(self) -> dict[str, Any]:
    data = self.config.data
    return dict(vocab_size=self.vocab_size, max_len=data.max_len, mask_prob=data.mask_prob,
                max_predictions=data.max_predictions,
                word_starts=word_start_table(self.tokenizer) if data.whole_word else None,
                special=special_ids(self.tokenizer, self.vocab_size))

  @property
  def train_data(self) -> PretrainingData:
    if self._train_data is None:
      documents, extra = corpus_texts(self.config.data)
      singles = [self.tokenizer.encode(s) for s in extra]
      self._train_data = PretrainingData(self._encode_docs(documents), singles,
                                         **self._data_options())
    return self._train_data

  def init(self, rng: jax.Array) -> Any:
    max_len, p = self.config.data.max_len, self.config.data.max_predictions
    tokens = jnp.zeros((1, max_len), jnp.int32)
    return self.model.init(rng, tokens, tokens, tokens != 0,
                           jnp.zeros((1, p), jnp.int32))["params"]

  def train_iterator(self) -> IndexedBatches:
    data, seed = self.train_data, self.config.seed
    return IndexedBatches(lambda i: data.batch(i, self.config.batch_size, self.num_single, seed))

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """Fixed pairs (and masks) from the validation split of Tiny Shakespeare."""
    if self._eval_batches is None:
      data = self.config.data
      documents = data_lib.shakespeare_documents("validation", **_data_kwargs(data))
      held_out = PretrainingData(self._encode_docs(documents), [], **self._data_options())
      n, size = data.num_eval_examples, data.eval_batch_size
      examples = [held_out.pair_example(i % len(held_out.anchors),
                                        rng_for(data.eval_seed, _EVAL_STREAM, i))
                  for i in range(n)]
      self._eval_batches = [stack_examples(examples[i:i + size]) for i in range(0, n, size)]
    return self._eval_batches

  # ---- loss (evaluation: Task.evaluate, weighted by the prediction counts, not by batch)
  def metric_sums(self, params, batch, rng=None):
    deterministic = rng is None
    mlm_logits, nsp_logits = self.model.apply(
        {"params": params}, batch["tokens"], batch["segments"], batch["valid"],
        batch["mlm_positions"], deterministic=deterministic,
        rngs=None if deterministic else {"dropout": rng})  # [b, P, vocab], [b, 2]
    mlm = weighted_cross_entropy(mlm_logits, batch["mlm_labels"], batch["mlm_weights"])
    nsp = weighted_cross_entropy(nsp_logits, batch["is_next"], batch["nsp_weight"])
    return {"mlm_loss": (mlm[0], mlm[2]), "mlm_accuracy": (mlm[1], mlm[2]),
            "nsp_loss": (nsp[0], nsp[2]), "nsp_accuracy": (nsp[1], nsp[2])}

  def loss_fn(self, params, batch, rng):
    metrics = ratios(self.metric_sums(params, batch, rng))
    return metrics["mlm_loss"] + metrics["nsp_loss"], metrics

  def finish_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
    return {**metrics, "loss": metrics["mlm_loss"] + metrics["nsp_loss"]}

  def write_plots(self, params, workdir: pathlib.Path) -> None:
    def apply_fn(tokens):
      _, state = self.model.apply({"params": params}, tokens, mutable=["intermediates"])
      return state["intermediates"]
    plot_head_views(apply_fn, self.tokenizer, self.config.data.plot_sentence,
                    self.config.data.max_len, workdir, "pretrained BERT")
