"""An RNN text classifier with last, mean or attention pooling (task "rnn_classification").

Embedding -> GRU or LSTM layers (bidirectional by default) over the tokens -> pooling -> Dense:
`pooling=last` (the final state), `mean` (the mean state over the real tokens) or `attention`
(Yang et al. 2016's word attention: u_t = tanh(W h_t + b), alpha_t = softmax_t(u_t . u_w) with a
learned context vector u_w, pooled = sum_t alpha_t h_t; attnlab/models/rnn_classifier.py).

Launch (from the repository root; SST-2 from $ATTNLAB_DATA_DIR or
`--config.data.manual_dir=../shared/data`, else downloaded):
  attnlab train --config=configs/classify.py --workdir=runs/rnn_sst2                # attention
  attnlab train --config=configs/classify.py:pooling=last,cell=lstm --workdir=runs/rnn_sst2_last
  attnlab train --config=configs/classify.py:dataset=cue_word --workdir=runs/rnn_cue  # no files
  attnlab train --config=configs/classify.py:dataset=csv,data.path=mine.csv --workdir=runs/rnn_mine
  attnlab view --workdir=runs/rnn_sst2 --text="a gorgeous , witty , seductive movie ."
A seconds-long check of the whole pipeline (the data set stays the one named):
  attnlab train --config=configs/classify.py:runlocal=True,dataset=cue_word --workdir=/tmp/cls
The study (last vs mean vs attention pooling on SST-2): experiments/sst2_rnn/README.md.

Shortcuts in the arg (besides any field):
  dataset=NAME, or task=NAME   = data.name: sst2 (default), cue_word (synthetic: filler words
                                 and one cue word that decides the label) or csv (your file
                                 data.path: a header row, columns sentence,label or those named
                                 by data.text_column / data.label_column; docs/guide.md, "Your
                                 own labels"); picks its defaults
  tokenizer=word|char          = data.tokenizer (char also sets data.max_len=256)
  pooling=last|mean|attention  = model.pooling
  cell=gru|lstm                = model.cell
"""

from attnlab import config_utils

# Short arg keys: the shared dataset/task/tokenizer and this family's own.
SHORTCUTS = config_utils.shortcut_table("dataset", "task", "tokenizer", pooling="model.pooling",
                                        cell="model.cell")
DATASETS = ("sst2", "cue_word", "csv")
# data.name -> {key: value} applied over the defaults below before the arg.
PRESETS = {
    "sst2": {},
    "csv": {},
    "cue_word": {"data.num_train": 4000, "data.num_eval": 500, "data.max_len": 32,
                 "data.buckets": (), "num_train_steps": 600, "eval_every": 200,
                 "checkpoint_every": 200},
}
# data.tokenizer -> {key: value}, applied after the data set's presets.
TOKENIZER_PRESETS = {"word": {}, "char": {"data.max_len": 256, "data.buckets": (64, 128)}}
# Overrides of runlocal=True (after config_utils.RUNLOCAL), per data set.
RUNLOCAL = {"model.embed_dim": 16, "model.hidden_dim": 16, "data.eval_batch_size": 64}
RUNLOCAL_DATA = {"sst2": {"data.num_train": 200, "data.num_eval": 40}, "csv": {},
                 "cue_word": {"data.num_train": 400, "data.num_eval": 64}}


def get_config(arg: str | None = None):
  """`arg`: key=value,... with the shortcuts dataset, tokenizer, pooling, cell (module docstring)."""
  dataset = config_utils.check_choice(
      "data.name", config_utils.arg_value(arg, "data.name", "sst2", SHORTCUTS), DATASETS,
      "datasets")
  tokenizer = config_utils.check_choice(
      "data.tokenizer", config_utils.arg_value(arg, "data.tokenizer", "word", SHORTCUTS),
      TOKENIZER_PRESETS, "tokenizers")

  config = config_utils.base_config()
  config.task = "rnn_classification"
  config.num_train_steps = 1000
  config.batch_size = 64
  config.log_every = 100
  config.eval_every = 500
  config.checkpoint_every = 500
  config.optimizer.name = "adam"
  config.optimizer.learning_rate = 2e-3
  config.optimizer.warmup_steps = 100
  config.optimizer.schedule = "cosine"
  config.optimizer.end_learning_rate = 1e-4
  config.optimizer.grad_clip = 1.0

  model = config.model
  # Recurrent cell: gru or lstm.
  model.cell = "gru"
  # Stacked recurrent layers.
  model.num_layers = 1
  # A second RNN reads the sentence right to left; the two directions' states are concatenated.
  model.bidirectional = True
  # Size of the token embeddings.
  model.embed_dim = 64
  # Size of each recurrent layer (per direction).
  model.hidden_dim = 64
  # How the states become one vector: last (the final state; bidirectional: [forward h_T;
  # backward h_1]), mean (over the real tokens) or attention (Yang et al. 2016, context vector u_w).
  model.pooling = "attention"
  # Size of u_t = tanh(W h_t + b) and of the context vector u_w (0: the states' size).
  model.attn_dim = 0
  # Dropout on the embeddings, between recurrent layers and on the pooled vector.
  model.dropout_rate = 0.2
  # Compute dtype: the RNN computes in float32 only.
  model.dtype = "float32"

  data = config.data
  # Data set (attnlab.data.labelled): sst2 (GLUE SST-2), cue_word (synthetic, no files) or csv
  # (your labelled file: the csv keys below).
  data.name = dataset
  # Tokens: word (lower-cased, punctuation split off) or char.
  data.tokenizer = tokenizer
  # Tokens seen fewer times in the training texts become <unk>.
  data.min_count = 1
  # Tokens per text: longer texts are cut, shorter ones padded with 0 (SST-2's longest training
  # sentence has 52 words, 268 characters).
  data.max_len = 64
  # Shorter padded lengths of training batches: each batch is padded to the smallest of these
  # (and max_len) that holds its longest text, the texts grouped by it (one compile per length).
  data.buckets = (16, 32)
  # Training examples: the first N of the split (0 = all; cue_word: N generated).
  data.num_train = 0
  # Evaluation examples: the first N of the validation split (0 = all; cue_word: N generated).
  data.num_eval = 0
  # Texts per evaluation batch.
  data.eval_batch_size = 256
  # TFDS data dir of the prepared datasets ("" = $TFDS_DATA_DIR or ~/tensorflow_datasets).
  data.data_dir = ""
  # Folder with the raw files (e.g. ../shared/data; "" = $ATTNLAB_DATA_DIR, else download).
  data.manual_dir = ""
  # Your labelled file (dataset=csv): data.path, data.text_column, data.label_column, ...
  config_utils.add_labeled_file(data, pairs=False)
  # The synthetic cue_word task's options (attnlab.data.synthetic.cue_word; data.name=cue_word).
  data.cue_word = config_utils.ConfigDict({
      # Seed of the generated examples (fixed: runs of different seeds see the same data).
      "seed": 0,
      # Fewest words per sentence.
      "min_len": 5,
      # Most words per sentence.
      "max_len": 20,
      # Number of filler words.
      "vocab_size": 50,
      # Number of classes (labels 0..num_classes - 1).
      "num_classes": 2,
      # Cue words of each class.
      "cues_per_class": 3,
  })

  config_utils.apply_overrides(config, {**PRESETS[dataset], **TOKENIZER_PRESETS[tokenizer]})
  return config_utils.finalize(config, arg, runlocal={**RUNLOCAL, **RUNLOCAL_DATA[dataset]},
                               shortcuts=SHORTCUTS)
