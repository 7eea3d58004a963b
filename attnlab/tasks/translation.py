"""Sequence-to-sequence translation (task "translation"): dates, Marathi, any parallel corpus,
reverse, copy.

Data (`config.data.name`):
  dates    synthetic human-readable dates -> ISO dates (no files), character tokens;
  marathi  anki_mar_eng English -> Marathi (or `data.direction="mr-en"`), word or subword tokens;
  anki     any Anki/manythings file, `English<TAB>Other[<TAB>attribution]` lines: `data.path`, or
           `data.pair=<code>` (fra, spa, cmn, ...) found locally or downloaded; English -> the
           other language (`data.direction=forward`) or back (`reverse`);
  tsv      a plain TSV of `source<TAB>target` lines (`data.path`), forward or reverse likewise;
  reverse  synthetic random symbol strings -> the same reversed (`data.min_len..max_len` symbols);
  copy     the same, unchanged.
anki and tsv (attnlab.data.parallel_corpus) are shuffled and cut 80/10/10 as marathi is.
Source and target each get their own tokenizer (`data.tokenizer`, or `data.source_tokenizer` /
`data.target_tokenizer` for one side: char for a script without spaces), trained on the training
split (deterministic) and kept in the run's assets, so a reloaded run translates without the data.
Targets are `<start> tokens <end>`; the decoder reads target[:-1] and predicts target[1:] (teacher
forcing).

Model (`config.model.name`): module `attnlab.models.<name>` provides
`from_config(model_config, src_vocab_size, tgt_vocab_size, max_src_len)` returning a
Flax module with
  __call__(src [b, s], src_lengths [b], tgt_in [b, t], *, deterministic) -> (logits [b, t, V], aux)
      aux["attention_weights"] [b, t, s] (aux["log_prob"] [b, t] for sampled attention: REINFORCE);
  encode(src, src_lengths) -> decoder state (pytree, batch-first leaves);
  decode_step(state, tokens [b]) -> (logits [b, V], state, attention weights [b, s]),
so the RNN (`seq2seq`) and a Transformer share this task and `attnlab.decoding`.

Metrics: training/teacher-forced `ce`, `token_accuracy`, `seq_accuracy`; evaluation adds, on the
decoded output (greedy, or beam search with `config.decode.beam_size` > 1, ranked with GNMT's
`decode.length_penalty` and `decode.coverage_penalty`, attnlab.decoding.beam_search), `exact_match`,
`decoded_token_accuracy` (position-wise matches / max(output, reference) length) and corpus
`bleu` (sacrebleu over the target tokenizer's tokens: characters for dates/reverse/copy, words for
Marathi; detokenized text with the 13a tokenizer for subwords, or sacrebleu's zh / char tokenizer
when the references are Chinese / Japanese; `data.bleu_tokenize` names one for any tokenizer), and
the same per source-length bin when `config.data.length_bins` is set (`exact_match_len_01_05`, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import sacrebleu

from attnlab import data as data_lib
from attnlab import decoding
from attnlab import losses
from attnlab import models
from attnlab.attention import core as attn_core
from attnlab.config_utils import check_choice
from attnlab.errors import ConfigError
from attnlab.data import parallel_corpus
from attnlab.data import pipeline
from attnlab.data import tokenizers
from attnlab.tasks import register_task
from attnlab.tasks.base import Task
from attnlab.tasks.base import data_location
from attnlab.tasks.base import pad_rows

_LOG = logging.getLogger(__name__)

# data.name -> the dataset of attnlab.data it reads.
DATASETS = {"dates": "dates", "marathi": "anki_mar_eng", "reverse": "reverse", "copy": "copy",
            "anki": "anki", "tsv": "tsv"}
SYNTHETIC = ("dates", "reverse", "copy")
# A user's own corpus file (attnlab.data.parallel_corpus).
FILE_DATASETS = tuple(parallel_corpus.FORMATS)
TOKENIZER_KINDS = ("char", "word", "subword")
# data.bleu_tokenize: "" (auto: TranslationTask.bleu_tokenize) or one of sacrebleu's tokenizers
# that need no download (its spm/flores ones fetch a model).
BLEU_TOKENIZERS = ("13a", "intl", "zh", "char", "none", "ja-mecab", "ko-mecab")
# Auto BLEU of a subword target: references with at least this share of CJK characters (of those
# not white space) are scored with sacrebleu's zh tokenizer (char with kana: Japanese).
CJK_SHARE = 0.3
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_KANA = re.compile(r"[\u3040-\u30ff]")
# Punctuation the word tokenizer separates from words (as the attention-NMT tutorial does).
_PUNCT = re.compile(r"([?.!,¿\"“”;:])")
# Examples drawn for write_plots' heatmaps.
NUM_PLOTS = 4
# translate and view take a source (or target) up to this many times the longest of training
# (unless the model's position table holds fewer): decoding runs up to twice the source's length,
# and its memory grows with source length x steps (a 10,000-character input took 15 GB).
MAX_INPUT_FACTOR = 4


def cjk_share(texts: Sequence[str]) -> float:
  """The share of Chinese characters and kana among the characters of `texts` (white space not
  counted)."""
  text = "".join("".join(t.split()) for t in texts)
  return len(_CJK.findall(text)) / len(text) if text else 0.0


def separate_punctuation(text: str) -> str:
  """Puts spaces around punctuation so that a whitespace word split keeps it apart."""
  return " ".join(_PUNCT.sub(r" \1 ", text).split())


@dataclasses.dataclass
class Translation:
  """One decoded input."""
  # The input text.
  source: str
  # Source tokens as the model saw them (unknown ones as <unk>).
  source_tokens: list[str]
  # Output tokens up to and including <end> (when produced).
  output_tokens: list[str]
  # The output as text.
  text: str
  # [len(output_tokens), len(source_tokens)] attention weights of each output step.
  weights: np.ndarray


def _token_label(token: str) -> str:
  return "\u2423" if token == " " else token


@register_task("translation")
class TranslationTask(Task):
  """Encoder-decoder training with padding-masked cross-entropy; decoding metrics incl. BLEU."""

  def __init__(self, config, assets=None):
    super().__init__(config, assets)
    dc = config.data
    check_choice("data.name", dc.name, DATASETS, "datasets")
    check_choice("data.tokenizer", dc.tokenizer, TOKENIZER_KINDS, "kinds")
    for side in ("source", "target"):
      if dc.get(f"{side}_tokenizer", ""):
        check_choice(f"data.{side}_tokenizer", dc[f"{side}_tokenizer"], TOKENIZER_KINDS, "kinds")
    self._bleu_tokenize = dc.get("bleu_tokenize", "")
    if self._bleu_tokenize:
      check_choice("data.bleu_tokenize", self._bleu_tokenize, BLEU_TOKENIZERS,
                   "sacrebleu tokenizers")
      try:
        sacrebleu.BLEU(tokenize=self._bleu_tokenize)
      except Exception as e:  # pylint: disable=broad-except  (mecab's packages missing)
        raise ConfigError(f"data.bleu_tokenize={self._bleu_tokenize} cannot be used here "
                          f"({' '.join(str(e).split())[:200]}); install what it needs or pick "
                          f"another: {', '.join(BLEU_TOKENIZERS[:5])}") from None
    if dc.name in FILE_DATASETS:
      check_choice("data.direction", dc.get("direction", "forward"), parallel_corpus.DIRECTIONS,
                   f"directions of dataset={dc.name}")
    # The corpus file's splits (anki, tsv), read on first use.
    self._file_splits: dict[str, list[tuple[str, str]]] | None = None
    # Raw and encoded examples by split, read on first use (a reloaded run needs none).
    self._examples: dict[str, list[dict[str, str]]] = {}
    self._encoded: dict[str, list[dict[str, Any]]] = {}
    self.src_tok = self.asset_tokenizer("source", lambda: self._train_tokenizer(
        [ex["source"] for ex in self.examples("train")], "source"))
    self.tgt_tok = self.asset_tokenizer("target", lambda: self._train_tokenizer(
        [ex["target"] for ex in self.examples("train")], "target"))
    longest = lambda field: max(len(ex[field]) for ex in self.encoded("train"))
    self.max_src_len = self.asset_size("max_src_len", lambda: longest("source"))
    self.max_tgt_len = self.asset_size("max_tgt_len", lambda: longest("target"))  # <start>...<end>
    self._buckets = None
    if dc.buckets:
      self._buckets = tuple(sorted(set(dc.buckets) | {max(self.max_src_len, self.max_tgt_len)}))
    # The widest padded source a training batch can have (a bucket may exceed max_src_len).
    self.src_width = self.max_src_len if self._buckets is None else min(
        b for b in self._buckets if b >= self.max_src_len)
    self.model = _build_model(config.model, len(self.src_tok), len(self.tgt_tok),
                              self.src_width)
    self._decode_fns: dict[tuple[int, int, float, float], Any] = {}
    self.penalties()  # decode.length_penalty and coverage_penalty checked once, here

  # ----------------------------------------------------------------------------------- data

  def examples(self, split: str) -> list[dict[str, str]]:
    """The {"source", "target"} texts of one split (read on first use)."""
    if split not in self._examples:
      self._examples[split] = self._load(split)
    return self._examples[split]

  def encoded(self, split: str) -> list[dict[str, Any]]:
    """The examples of one split as token ids (target: <start> ... <end>)."""
    if split not in self._encoded:
      self._encoded[split] = [{"source": self.encode_source(ex["source"]),
                               "target": self.encode_target(ex["target"])}
                              for ex in self.examples(split)]
    return self._encoded[split]

  def _load(self, split: str) -> list[dict[str, str]]:
    """The raw {"source", "target"} examples of one split, length-filtered."""
    dc = self.config.data
    name = DATASETS[dc.name]
    if dc.name in SYNTHETIC:
      count = dc.num_train if split == "train" else dc.num_eval
      options: dict[str, Any] = {"num_examples": count, "seed": dc.seed}
      if dc.name != "dates":
        options.update(min_len=dc.min_len, max_len=dc.max_len, vocab_size=dc.symbols)
      examples = list(data_lib.get_dataset(name, split, **options))
    elif dc.name in FILE_DATASETS:
      if self._file_splits is None:
        self._file_splits = parallel_corpus.load_splits(dc)
      if split not in self._file_splits:
        raise ConfigError(f"dataset={dc.name} has no split {split!r}; valid splits: "
                          f"{', '.join(parallel_corpus.SPLITS)}")
      examples = [{"source": a, "target": b} for a, b in self._file_splits[split]]
      if split == "train" and dc.num_train > 0:
        examples = examples[:dc.num_train]
    else:
      examples = list(data_lib.get_dataset(name, split, direction=dc.direction,
                                           **data_location(dc)))
      if split == "train" and dc.num_train > 0:
        examples = examples[:dc.num_train]
    if dc.max_tokens > 0:
      # Filtered on whitespace words so the choice does not depend on the tokenizer.
      n = len(examples)
      words = lambda text: len(separate_punctuation(text).split())
      examples = [ex for ex in examples
                  if max(words(ex["source"]), words(ex["target"])) <= dc.max_tokens]
      _LOG.info("%s/%s: kept %d of %d pairs with <= %d words", dc.name, split, len(examples), n,
                dc.max_tokens)
    if split != "train" and dc.name not in SYNTHETIC and dc.num_eval > 0:
      examples = examples[:dc.num_eval]
    return [{"source": ex["source"], "target": ex["target"]} for ex in examples]

  def tokenizer_kind(self, side: str) -> str:
    """The tokenizer kind of "source" or "target": data.<side>_tokenizer, else data.tokenizer."""
    return self.config.data.get(f"{side}_tokenizer", "") or self.config.data.tokenizer

  def prepare_text(self, text: str, side: str = "source") -> str:
    """`text` as the `side` tokenizer sees it (punctuation split off for word tokens)."""
    return separate_punctuation(text) if self.tokenizer_kind(side) == "word" else text

  def _train_tokenizer(self, texts: list[str], side: str) -> tokenizers.Vocab:
    dc = self.config.data
    kind = self.tokenizer_kind(side)
    texts = [self.prepare_text(t, side) for t in texts]
    if kind == "char":
      return tokenizers.CharTokenizer.train(texts)
    if kind == "word":
      if cjk_share(texts) >= CJK_SHARE:
        _LOG.warning("the %s text is mostly Chinese or Japanese, written without spaces: a word "
                     "tokenizer takes whole sentences as words; set data.%s_tokenizer=char (or "
                     "subword)", side, side)
      return tokenizers.WordTokenizer.train(texts, lower=dc.lower, split_punct=False,
                                            min_count=dc.min_count,
                                            max_size=dc.tokenizer_size or None)
    import tempfile  # pylint: disable=g-import-not-at-top
    with tempfile.TemporaryDirectory() as model_dir:
      return tokenizers.SubwordTokenizer.train(texts, dc.tokenizer_size or 4000, model_dir)

  def encode_source(self, text: str) -> list[int]:
    return self.src_tok.encode(self.prepare_text(text, "source"))

  def encode_target(self, text: str) -> list[int]:
    """`<start>` + the target tokens of `text` + `<end>`, as the training targets are encoded."""
    return self.tgt_tok.encode(self.prepare_text(text, "target"), add_start=True, add_end=True)

  def _pad_lengths(self) -> dict[str, int]:
    return {"source": self.max_src_len, "target": self.max_tgt_len}

  def train_iterator(self) -> pipeline.Batcher:
    return pipeline.Batcher(self.encoded("train"), self.config.batch_size, seed=self.config.seed,
                            pad_to=None if self._buckets else self._pad_lengths(),
                            buckets=self._buckets)

  def _eval_arrays(self, split: str) -> dict[str, np.ndarray]:
    """The whole split padded to the training lengths (longer inputs are cut)."""
    batches = list(pipeline.Batcher(
        self.encoded(split), self.config.data.eval_batch_size, shuffle=False, num_epochs=1,
        drop_remainder=False, pad_to=self._pad_lengths(), max_length=self._pad_lengths(),
        length_policy="truncate"))
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

  # ----------------------------------------------------------------------------------- model

  def init(self, rng: jax.Array) -> Any:
    src = jnp.zeros((2, self.max_src_len), jnp.int32)
    tgt = jnp.zeros((2, self.max_tgt_len - 1), jnp.int32)
    lengths = jnp.full((2,), self.max_src_len, jnp.int32)

    def init(rng):
      rngs = {"params": rng, "sample": jax.random.fold_in(rng, 1),
              "dropout": jax.random.fold_in(rng, 2)}
      return self.model.init(rngs, src, lengths, tgt)["params"]
    return jax.jit(init)(rng)

  def loss_fn(self, params, batch, rng):
    src, src_len = batch["source"], batch["source_length"]  # [b, s], [b]
    tgt = batch["target"]  # [b, t + 1]: <start> ... <end>
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # [b, t]
    rows = batch["example_mask"]  # [b]
    valid = batch["target_mask"][:, 1:] & rows[:, None]  # [b, t]
    train = rng is not None
    rngs = {"dropout": jax.random.fold_in(rng, 0), "sample": jax.random.fold_in(rng, 1)} \
        if train else {}
    logits, aux = self.model.apply({"params": params}, src, src_len, tgt_in,
                                   deterministic=not train, rngs=rngs)  # [b, t, vocab]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tgt_out)
    num_tokens = jnp.sum(valid)
    ce = losses.ratio(jnp.sum(nll * valid), num_tokens)
    correct = jnp.argmax(logits, axis=-1) == tgt_out  # [b, t]
    seq_ok = jnp.all(correct | ~valid, axis=1) & rows  # [b]
    metrics = {
        "ce": ce,
        "token_accuracy": losses.ratio(jnp.sum(correct & valid), num_tokens),
        "seq_accuracy": losses.ratio(jnp.sum(seq_ok), jnp.sum(rows)),
    }
    loss = ce
    weight = self.config.model.get("reinforce_weight", 0.0)
    if train and "log_prob" in aux and weight > 0:
      # Sampled (hard) attention: REINFORCE with reward = -per-sequence CE, baseline = batch mean.
      per_seq = jnp.sum(nll * valid, axis=1) / jnp.maximum(jnp.sum(valid, axis=1), 1)  # [b]
      reward = -per_seq
      baseline = jnp.sum(reward * rows) / jnp.maximum(jnp.sum(rows), 1)
      rl = attn_core.reinforce_loss(aux["log_prob"], reward, baseline, valid=valid)
      metrics["reinforce"] = rl
      loss = loss + weight * rl
    return loss, metrics

  def metric_sums(self, params, batch, rng=None):
    """The teacher-forced metrics of `loss_fn`, each weighted by the batch's real examples."""
    loss, metrics = self.loss_fn(params, batch, rng)
    rows = jnp.sum(batch["example_mask"])
    return {name: (value * rows, rows) for name, value in {**metrics, "loss": loss}.items()}

  # ----------------------------------------------------------------------------------- decoding

  def penalties(self, length_penalty: float | None = None,
                coverage_penalty: float | None = None) -> tuple[float, float]:
    """Beam search's (alpha, beta): the arguments, else the run's decode.length_penalty and
    decode.coverage_penalty (0 for runs written before the key). ConfigError (one line) for a
    negative or non-finite weight, or a coverage penalty on a model without attention weights."""
    decode = self.config.decode
    alpha = decode.get("length_penalty", 0.0) if length_penalty is None else length_penalty
    beta = decode.get("coverage_penalty", 0.0) if coverage_penalty is None else coverage_penalty
    for key, value in (("length_penalty", alpha), ("coverage_penalty", beta)):
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"decode.{key}={value!r} must be a number >= 0 (0: none)")
    if beta and self.config.model.get("attention") == "none":
      raise ConfigError("decode.coverage_penalty sums attention weights, and model.attention=none "
                        "has none; set decode.coverage_penalty=0 or train with an attention")
    return float(alpha), float(beta)

  def _decoder(self, beam_size: int, max_len: int, length_penalty: float = 0.0,
               coverage_penalty: float = 0.0):
    """jit(params, src, src_len) -> (tokens [b, max_len], weights [b, max_len, s]) of the best."""
    key = (beam_size, max_len, length_penalty, coverage_penalty)
    if key not in self._decode_fns:
      model, end_id = self.model, self.tgt_tok.end_id

      def run(params, src, src_len):
        state = model.apply({"params": params}, src, src_len, method="encode")
        step_fn = lambda s, tokens: model.apply({"params": params}, s, tokens,
                                                method="decode_step")
        start = jnp.full((src.shape[0],), self.tgt_tok.start_id, jnp.int32)
        if beam_size <= 1:
          out = decoding.greedy(step_fn, state, start, max_len=max_len, end_id=end_id)
          return out.tokens, out.aux
        # The coverage penalty sums the attention over the real source positions.
        mask = (jnp.arange(src.shape[1])[None, :] < src_len[:, None]) if coverage_penalty else None
        out = decoding.beam_search(step_fn, state, start, beam_size=beam_size, max_len=max_len,
                                   end_id=end_id, length_penalty=length_penalty,
                                   coverage_penalty=coverage_penalty, coverage_mask=mask)
        return out.tokens[:, 0], out.aux[:, 0]

      self._decode_fns[key] = jax.jit(run)
    return self._decode_fns[key]

  def _max_decode_len(self) -> int:
    # Tokens after <start>, <end> included.
    return self.config.decode.max_len or self.max_tgt_len - 1

  def decode_arrays(self, params, src: np.ndarray, src_len: np.ndarray,
                    beam_size: int | None = None, max_len: int | None = None,
                    batch_size: int | None = None, length_penalty: float | None = None,
                    coverage_penalty: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decodes padded sources: (tokens [n, max_len], weights [n, max_len, s]).

    Runs in batches of `batch_size` rows (default data.eval_batch_size), the last one padded, so
    every call with the same source width reuses one compiled decoder. The beam search's penalties
    default to the run's (`penalties`).
    """
    beam_size = self.config.decode.beam_size if beam_size is None else beam_size
    max_len = max_len or self._max_decode_len()
    decoding.check_decode_len(self.model, max_len)
    fn = self._decoder(beam_size, max_len, *self.penalties(length_penalty, coverage_penalty))
    size = batch_size or self.config.data.eval_batch_size
    tokens, weights = [], []
    for start in range(0, len(src), size):
      rows = min(size, len(src) - start)
      s, n = pad_rows((src[start:start + size], src_len[start:start + size]), size)
      t, w = jax.device_get(fn(params, s, n))
      tokens.append(t[:rows])
      weights.append(w[:rows])
    return np.concatenate(tokens), np.concatenate(weights)

  def _output_ids(self, row: np.ndarray) -> list[int]:
    """Decoded ids up to and including the first <end>."""
    ids = [int(i) for i in row]
    if self.tgt_tok.end_id in ids:
      ids = ids[:ids.index(self.tgt_tok.end_id) + 1]
    return ids

  def max_source_len(self) -> int:
    """The most source tokens `translate` and `view` take: the padded training width for the
    location score (its positions are learned), else MAX_INPUT_FACTOR x that width, within the
    model's position table (a Transformer's max_len)."""
    if models.score_name(self.config.model) == "location":
      return self.src_width
    return min(MAX_INPUT_FACTOR * self.src_width,
               getattr(self.model, "max_decode_len", None) or MAX_INPUT_FACTOR * self.src_width)

  def max_target_len(self) -> int:
    """The most target tokens (<start> ... <end>) a teacher-forced target may have."""
    return min(MAX_INPUT_FACTOR * self.max_tgt_len,
               getattr(self.model, "max_decode_len", None) or MAX_INPUT_FACTOR * self.max_tgt_len)

  def check_source(self, ids: Sequence[int], what: str = "the input") -> None:
    """ValueError (one line naming the limit) for a source this model cannot take."""
    if not ids:
      raise ValueError("cannot translate an empty input; give at least one token")
    limit = self.max_source_len()
    if len(ids) > limit:
      why = ("its location score has learned positions for the training sources"
             if models.score_name(self.config.model) == "location" else
             f"{MAX_INPUT_FACTOR} x the longest training source, {self.src_width}")
      raise ValueError(f"{what} has {len(ids)} source tokens but this model reads at most "
                       f"{limit} ({why}); shorten it or split it into sentences")

  def translate(self, params, texts: Sequence[str], beam_size: int | None = None,
                length_penalty: float | None = None, coverage_penalty: float | None = None
                ) -> list[Translation]:
    """Translates raw source texts; returns the outputs and their attention weights (beam search's
    penalties: the arguments, else the run's decode.length_penalty and decode.coverage_penalty).

    Raises ValueError for an input longer than `max_source_len` tokens (decoding is bounded by
    twice that in steps, and runs data.eval_batch_size inputs at a time).
    """
    encoded = [self.encode_source(t) for t in texts]
    for i, ids in enumerate(encoded):
      self.check_source(ids, "the input" if len(texts) == 1 else f"input {i + 1}")
    longest = max(len(ids) for ids in encoded)
    src = np.zeros((len(texts), longest), np.int32)
    for i, ids in enumerate(encoded):
      src[i, :len(ids)] = ids
    src_len = np.array([len(ids) for ids in encoded], np.int32)
    # Inputs longer than the training data may need longer outputs (up to what the model holds).
    max_len = max(self._max_decode_len(), 2 * longest + 2)
    max_len = min(max_len, getattr(self.model, "max_decode_len", max_len))
    tokens, weights = self.decode_arrays(
        params, src, src_len, beam_size, max_len,
        batch_size=min(len(texts), self.config.data.eval_batch_size),
        length_penalty=length_penalty, coverage_penalty=coverage_penalty)
    return [self._translation(text, encoded[i], tokens[i], weights[i])
            for i, text in enumerate(texts)]

  def _translation(self, source: str, src_ids: list[int], tokens: np.ndarray,
                   weights: np.ndarray) -> Translation:
    """One decoded row (tokens [max_len], weights [max_len, s]) as a Translation."""
    ids = self._output_ids(tokens)
    return Translation(source=source,
                       source_tokens=[self.src_tok.id_to_token(j) for j in src_ids],
                       output_tokens=[self.tgt_tok.id_to_token(j) for j in ids],
                       text=self.tgt_tok.decode(ids),
                       weights=np.asarray(weights[:len(ids), :len(src_ids)]))

  # ----------------------------------------------------------------------------------- evaluation

  def _bleu_tokens(self, text: str) -> str:
    """Text as BLEU gets it: the target tokenizer's tokens joined by spaces for char and word
    tokens (as decode writes words: lower-cased, punctuation apart), the text for subwords."""
    if self.tokenizer_kind("target") == "subword":
      return text
    return " ".join(self.tgt_tok.split(self.prepare_text(text, "target")))

  def bleu_tokenize(self, refs: Sequence[str] = ()) -> str:
    """The sacrebleu tokenizer BLEU uses: data.bleu_tokenize, else "none" for char and word tokens
    (`_bleu_tokens` has split them), else for subwords "zh" when at least CJK_SHARE of the
    references' characters are Chinese ("char" when kana show Japanese), else "13a"."""
    if self._bleu_tokenize:
      return self._bleu_tokenize
    if self.tokenizer_kind("target") != "subword":
      return "none"
    if refs and cjk_share(refs) >= CJK_SHARE:
      return "char" if any(_KANA.search(r) for r in refs) else "zh"
    return "13a"

  def _bleu(self, hyps: list[str], refs: list[str], tokenize: str | None = None) -> float:
    if not hyps:
      return float("nan")
    tokenize = tokenize or self.bleu_tokenize(refs)
    # force: the texts may be tokenized on purpose (tokenize="none" scores the tokens as given).
    return float(sacrebleu.corpus_bleu(hyps, [refs], tokenize=tokenize, force=True).score)

  def evaluate_split(self, params, split: str | None = None, beam_size: int | None = None,
                     rows: Sequence[int] | None = None
                     ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Metrics of one split and one record per example (source, reference, output, correct).

    `rows`: indices into the split; only those examples are scored and decoded (in that order),
    e.g. a fixed sample for an expensive beam search. ValueError for an index outside the split.
    """
    split = split or self.config.data.eval_split
    arrays = self._eval_arrays(split)  # every batch padded to eval_batch_size rows
    examples = self.examples(split)
    if rows is not None:
      index = np.asarray(rows, dtype=np.int64).reshape(-1)  # [num_rows]
      if index.size == 0 or index.min() < 0 or index.max() >= len(examples):
        raise ValueError(f"rows must be one or more indices in 0..{len(examples) - 1} (the "
                         f"examples of split {split!r}); got {index.tolist()[:5]}...")
      arrays = {name: value[index] for name, value in arrays.items()}
      examples = [examples[int(i)] for i in index]
    result = self.mean_metrics(
        params, pipeline.ordered_batches(arrays, self.config.data.eval_batch_size))
    n = len(examples)
    tokens, _ = self.decode_arrays(params, arrays["source"][:n], arrays["source_length"][:n],
                                   beam_size)
    records = []
    for i, ex in enumerate(examples):
      ids = self._output_ids(tokens[i])
      ref_ids = [int(j) for j in arrays["target"][i, 1:arrays["target_length"][i]]]  # ... <end>
      hyp_body = [j for j in ids if j != self.tgt_tok.end_id]
      ref_body = [j for j in ref_ids if j != self.tgt_tok.end_id]
      matches = sum(a == b for a, b in zip(hyp_body, ref_body))
      output = self.tgt_tok.decode(ids)
      records.append({
          "source": ex["source"], "reference": ex["target"], "output": output,
          "source_length": int(arrays["source_length"][i]),
          "exact": ids == ref_ids,
          "token_matches": matches / max(len(hyp_body), len(ref_body), 1),
          "bleu_hyp": self._bleu_tokens(output),
          "bleu_ref": self._bleu_tokens(ex["target"]),
      })
    # One tokenizer for the split and its bins (chosen from all of the split's references).
    tokenize = self.bleu_tokenize([r["bleu_ref"] for r in records])
    result.update(self._decoded_metrics(records, tokenize))
    for low, high in self._length_bins():
      part = [r for r in records if low <= r["source_length"] <= high]
      if part:
        for name, value in self._decoded_metrics(part, tokenize).items():
          result[f"{name}_len_{low:02d}_{high:02d}"] = value
    return result, records

  def _decoded_metrics(self, records: list[dict[str, Any]], tokenize: str) -> dict[str, float]:
    return {
        "exact_match": float(np.mean([r["exact"] for r in records])),
        "decoded_token_accuracy": float(np.mean([r["token_matches"] for r in records])),
        "bleu": self._bleu([r["bleu_hyp"] for r in records], [r["bleu_ref"] for r in records],
                           tokenize),
    }

  def _length_bins(self) -> list[tuple[int, int]]:
    """(low, high) source lengths of each bin: 1..edge 0, edge 0 + 1..edge 1, ..."""
    edges = [int(high) for high in self.config.data.length_bins]
    return list(zip([1] + [high + 1 for high in edges], edges))

  def evaluate(self, params) -> dict[str, float]:
    return self.evaluate_split(params)[0]

  # ----------------------------------------------------------------------------------- plots

  def plot_alignment(self, translation: Translation, path=None, title: str | None = None):
    """Heatmap of one translation: source tokens across, output tokens down; saved if `path`."""
    import matplotlib  # pylint: disable=g-import-not-at-top
    from attnlab import plotting  # pylint: disable=g-import-not-at-top  (matplotlib)
    title = title or f"{translation.source} -> {translation.text}"
    with matplotlib.rc_context({"font.family": plotting.font_family(title)}):
      return plotting.attention_heatmap(
          translation.weights, x_labels=[_token_label(t) for t in translation.source_tokens],
          y_labels=[_token_label(t) for t in translation.output_tokens], title=title,
          xlabel="source", ylabel="output", path=path)

  def write_plots(self, params, workdir: pathlib.Path) -> None:
    """attention_<i>.png: heatmaps of the first few evaluation examples."""
    if self.config.model.get("attention") == "none":
      return
    split = self.config.data.eval_split
    arrays = self._eval_arrays(split)
    examples = self.examples(split)[:NUM_PLOTS]
    # A batch shaped like evaluate's, so its compiled decoder is reused.
    tokens, weights = self.decode_arrays(params, arrays["source"][:len(examples)],
                                         arrays["source_length"][:len(examples)])
    for i, example in enumerate(examples):
      src_ids = [int(j) for j in arrays["source"][i, :arrays["source_length"][i]]]
      t = self._translation(example["source"], src_ids, tokens[i], weights[i])
      self.plot_alignment(t, pathlib.Path(workdir) / f"attention_{i}.png")


def _build_model(model_config, src_vocab_size: int, tgt_vocab_size: int, max_src_len: int):
  name = model_config.get("name", "seq2seq")
  if name not in models.TRANSLATION_MODELS:
    raise ConfigError(f"model.name={name!r} cannot translate; valid models: "
                      f"{', '.join(models.TRANSLATION_MODELS)} (the RNN model is seq2seq)")
  return models.from_config(name)(model_config, src_vocab_size, tgt_vocab_size, max_src_len)
