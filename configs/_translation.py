"""The translation task's data and decode groups, shared by configs/seq2seq.py and
configs/transformer.py so that the RNN and the Transformer read identical data (a helper module
of the config files, not a config file: `import _translation` there)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnlab.config_utils import ConfigDict
from attnlab.config_utils import Shortcut
from attnlab.config_utils import arg_value
from attnlab.config_utils import check_choice


# data.name -> the data fields that differ from the defaults in `translation_groups`.
TRANSLATION_DATA: dict[str, dict[str, Any]] = {
    "dates": {},
    "marathi": {"tokenizer": "word", "max_tokens": 12, "min_count": 2, "num_eval": 0,
                "num_train": 0, "buckets": (6, 9), "length_bins": (4, 6, 8, 12)},
    "reverse": {"length_bins": (5, 10, 15, 20, 25, 30), "max_len": 30},
}
TRANSLATION_DATA["copy"] = TRANSLATION_DATA["reverse"]
# Any parallel corpus (attnlab/data/parallel_corpus.py): an Anki/manythings file (data.path, or
# data.pair downloaded) or a plain TSV (data.path); the real-language defaults of marathi.
TRANSLATION_DATA["anki"] = {**TRANSLATION_DATA["marathi"], "direction": "forward"}
TRANSLATION_DATA["tsv"] = {**TRANSLATION_DATA["marathi"], "direction": "forward"}


def translation_groups(config: ConfigDict, arg: str | None,
                       shortcuts: Mapping[str, Shortcut]) -> str:
  """Fills `config.data` for the data set `arg` names (default dates) and adds `config.decode`.

  The data set is read from `arg` first (data.name, or a shortcut of it) because it picks the data
  defaults (TRANSLATION_DATA); the caller applies its own per-data-set presets and then `finalize`.
  Returns the data set's name.
  """
  dataset = check_choice("data.name", arg_value(arg, "data.name", "dates", shortcuts),
                         TRANSLATION_DATA, "datasets")
  config.data = ConfigDict({
      # Dataset: dates (synthetic), marathi (anki_mar_eng), reverse, copy (synthetic), anki (an
      # Anki/manythings file: data.path or data.pair), tsv (a file of source<TAB>target lines).
      "name": dataset,
      # anki: the Anki file (<code>.txt, English<TAB>Other[<TAB>attribution] lines, or its
      # <code>-eng.zip); tsv: the file of source<TAB>target lines (no header).
      "path": "",
      # anki: the three-letter code of the language paired with English (fra, spa, deu, cmn,
      # jpn, ...): the file is found in data.manual_dir or $ATTNLAB_DATA_DIR, or downloaded from
      # manythings.org/anki into the data dir ("": data.path).
      "pair": "",
      # Tokenizer of source and target: char, word (punctuation split off) or subword
      # (sentencepiece).
      "tokenizer": "char",
      # Tokenizer of the source only ("": data.tokenizer); e.g. word for English.
      "source_tokenizer": "",
      # Tokenizer of the target only ("": data.tokenizer); char or subword for a script written
      # without spaces (Chinese, Japanese).
      "target_tokenizer": "",
      # Subword vocabulary size, or the word vocabulary's cap (0: subword 4000, words uncapped).
      "tokenizer_size": 0,
      # Words seen fewer times in training become <unk> (word tokenizer).
      "min_count": 1,
      # Lower-case words (word tokenizer).
      "lower": True,
      # Training examples (synthetic: generated; marathi, anki, tsv: the first N of the split,
      # 0 = all).
      "num_train": 50000,
      # Evaluation examples (synthetic: generated; marathi, anki, tsv: the first N of the split,
      # 0 = all).
      "num_eval": 1000,
      # Seed of the synthetic data (fixed, so runs with different seeds see the same examples).
      "seed": 0,
      # reverse/copy: fewest symbols per sequence.
      "min_len": 1,
      # reverse/copy: most symbols per sequence.
      "max_len": 10,
      # reverse/copy: alphabet size.
      "symbols": 10,
      # marathi: en-mr (English -> Marathi) or mr-en; anki, tsv: forward (first column ->
      # second; anki: English -> the other language) or reverse.
      "direction": "en-mr",
      # Drop pairs with more whitespace-separated words (punctuation counted) on either side
      # (0: keep).
      "max_tokens": 0,
      # Padded lengths to group training batches by (): pad everything to the longest.
      "buckets": (),
      # Upper edges of source-length bins for per-length metrics, e.g. (5, 10, 15) (): none.
      "length_bins": (),
      # sacrebleu tokenizer of BLEU ("": the target tokenizer's tokens for char and word; for
      # subword the text with 13a, or zh / char when the references are Chinese / Japanese);
      # 13a, intl, zh, char, none, ja-mecab or ko-mecab (the last two need their packages).
      "bleu_tokenize": "",
      # Split evaluated during training.
      "eval_split": "validation",
      # Examples per evaluation and decoding batch.
      "eval_batch_size": 250,
      # TFDS data dir of prepared real datasets ("": $TFDS_DATA_DIR or ~/tensorflow_datasets).
      "data_dir": "",
      # Folder with the raw files of a real dataset ("": $ATTNLAB_DATA_DIR, else download).
      "manual_dir": "",
      **TRANSLATION_DATA[dataset],
  })
  config.decode = ConfigDict({
      # 1: greedy decoding; > 1: beam search with this many beams.
      "beam_size": 1,
      # GNMT length penalty alpha of beam search: hypotheses rank by log P / lp, lp = ((5 + |Y|) /
      # 6) ** alpha (0: none).
      "length_penalty": 0.0,
      # GNMT coverage penalty beta of beam search: + beta * sum over source positions of
      # log(min(attention received, 1)) (0: none). The RNN's attention weights, the
      # Transformer's cross-attention of model.weights_layer averaged over heads.
      "coverage_penalty": 0.0,
      # Most output tokens, <end> included (0: the longest training target + 1).
      "max_len": 0,
  })
  return dataset
