"""RNN encoder-decoder with (or without) attention on a translation task (task "translation").

Launch (from the repository root):
  attnlab train --config=configs/seq2seq.py --workdir=runs/dates              # dates, Bahdanau
  attnlab train --config=configs/seq2seq.py:task=marathi --workdir=runs/marathi
  attnlab train --config=configs/seq2seq.py:task=reverse,data.max_len=30,attention=none \
      --workdir=runs/reverse_none
  attnlab train --config=configs/seq2seq.py:attention=luong,score=general,model.window=local \
      --workdir=runs/dates_luong
A seconds-long check of the whole pipeline:
  attnlab train --config=configs/seq2seq.py:runlocal=True --workdir=/tmp/s2s_local
Translate with a trained run (prints the output, saves the alignment heatmap):
  attnlab translate --workdir=runs/marathi "Rahul is a good boy"
Studies built on it: experiments/dates, experiments/bottleneck, experiments/score_functions,
experiments/marathi (each: README + run.py).

Shortcuts in the arg (besides any field; the same names as in the other config files):
  task=NAME, or dataset=NAME      = data.name (dates, marathi, reverse, copy)
  attention=none|bahdanau|luong   = model.attention
  score=NAME                      = model.score (dot, scaled_dot, cosine, general, additive, ...)

The dataset is chosen in the arg (`task=marathi`, `dataset=marathi` or `data.name=marathi`): it
picks that dataset's defaults (tokenizer, sizes, steps) before the other keys apply. Setting
`--config.data.name` afterwards switches the data but keeps the dates defaults.
"""

from attnlab import config_utils

# Short arg keys (config_utils.SHORTCUTS: one meaning in every config file).
SHORTCUTS = config_utils.shortcut_table("task", "dataset", "attention", "score")

# data.name -> {key: value} applied over the defaults below before the arg.
PRESETS = {
    "dates": {},
    "marathi": {
        "data.tokenizer": "word",
        "data.max_tokens": 12,
        "data.min_count": 2,
        "data.num_eval": 0,
        "data.num_train": 0,
        "data.buckets": (6, 9),
        "data.length_bins": (4, 6, 8, 12),
        "model.embed_dim": 128,
        "model.hidden_dim": 128,
        "model.attn_dim": 128,
        "model.dropout_rate": 0.2,
        "batch_size": 64,
        "num_train_steps": 4000,
        "eval_every": 1000,
        "checkpoint_every": 500,
        "optimizer.learning_rate": 2e-3,
    },
    "reverse": {
        "data.length_bins": (5, 10, 15, 20, 25, 30),
        "data.max_len": 30,
        "model.embed_dim": 16,
        "model.hidden_dim": 64,
        "model.bidirectional": False,
        "num_train_steps": 3000,
        "eval_every": 1000,
        "checkpoint_every": 1000,
    },
}
PRESETS["copy"] = dict(PRESETS["reverse"])

# Overrides of runlocal=True per dataset (after config_utils.RUNLOCAL): tiny model and data.
RUNLOCAL = {
    "data.num_train": 200,
    "data.num_eval": 16,
    "data.eval_batch_size": 16,
    "model.embed_dim": 8,
    "model.hidden_dim": 16,
    "model.attn_dim": 8,
}


def get_config(arg: str | None = None):
  """`arg`: key=value,... typed from the defaults below (e.g. "task=reverse,runlocal=True")."""
  dataset = config_utils.check_choice(
      "data.name", config_utils.arg_value(arg, "data.name", "dates", SHORTCUTS), PRESETS,
      "datasets")
  config = config_utils.base_config()
  config.task = "translation"
  config.num_train_steps = 1500
  config.batch_size = 64
  config.log_every = 100
  config.eval_every = 500
  config.checkpoint_every = 500
  config.optimizer.name = "adam"
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 100
  config.optimizer.schedule = "cosine"
  config.optimizer.end_learning_rate = 1e-4
  config.optimizer.grad_clip = 1.0

  # Model family (attnlab.models.TRANSLATION_MODELS): seq2seq = the RNN, or transformer.
  config.model.name = "seq2seq"
  # Recurrent cell: gru or lstm.
  config.model.cell = "gru"
  # Stacked recurrent layers in the encoder and in the decoder.
  config.model.num_layers = 1
  # Encoder reads both ways (states concatenated).
  config.model.bidirectional = True
  # Size of the source and target token embeddings.
  config.model.embed_dim = 32
  # Size of each recurrent layer (per direction in the encoder).
  config.model.hidden_dim = 64
  # none (the last encoder state is the only view of the source) | bahdanau | luong.
  config.model.attention = "bahdanau"
  # Score function: dot, scaled_dot, cosine, general, additive, location.
  config.model.score = "additive"
  # global (all positions) | local (local-p window of half-width D) | hard (one sampled position).
  config.model.window = "global"
  # Hidden size of the additive score and of the local-p position predictor (0: hidden_dim).
  config.model.attn_dim = 0
  # Half-width D of the local-p window.
  config.model.local_half_width = 3
  # Luong: feed the previous attentional state into the next step.
  config.model.input_feeding = True
  # Initial (trainable) key strength of the cosine score.
  config.model.cosine_beta = 5.0
  # Dropout on embeddings, between layers and before the output layer.
  config.model.dropout_rate = 0.0
  # Weight of the REINFORCE loss that trains hard attention's scores (unused otherwise).
  config.model.reinforce_weight = 1.0

  # Dataset: dates (synthetic), marathi (anki_mar_eng), reverse, copy (synthetic).
  config.data.name = dataset
  # Tokenizer of source and target: char, word (punctuation split off) or subword (sentencepiece).
  config.data.tokenizer = "char"
  # Subword vocabulary size, or the word vocabulary's cap (0: subword 4000, words uncapped).
  config.data.tokenizer_size = 0
  # Words seen fewer times in training become <unk> (word tokenizer).
  config.data.min_count = 1
  # Lower-case words (word tokenizer).
  config.data.lower = True
  # Training examples (synthetic: generated; marathi: the first N of the split, 0 = all).
  config.data.num_train = 50000
  # Evaluation examples (synthetic: generated; marathi: the first N of the split, 0 = all).
  config.data.num_eval = 1000
  # Seed of the synthetic data (fixed, so runs with different seeds see the same examples).
  config.data.seed = 0
  # reverse/copy: fewest and most symbols per sequence.
  config.data.min_len = 1
  # reverse/copy: most symbols per sequence.
  config.data.max_len = 10
  # reverse/copy: alphabet size.
  config.data.symbols = 10
  # marathi: en-mr (English -> Marathi) or mr-en.
  config.data.direction = "en-mr"
  # Drop pairs with more whitespace-separated words (punctuation counted) on either side (0: keep).
  config.data.max_tokens = 0
  # Padded lengths to group training batches by (): pad everything to the longest.
  config.data.buckets = ()
  # Upper edges of source-length bins for per-length metrics, e.g. (5, 10, 15) (): none.
  config.data.length_bins = ()
  # Split evaluated during training.
  config.data.eval_split = "validation"
  # Examples per evaluation and decoding batch.
  config.data.eval_batch_size = 250
  # TFDS data dir of prepared real datasets ("": $TFDS_DATA_DIR or ~/tensorflow_datasets).
  config.data.data_dir = ""
  # Folder with the raw files of a real dataset ("": $ATTNLAB_DATA_DIR, else download).
  config.data.manual_dir = ""

  config.decode = config_utils.ConfigDict()
  # 1: greedy decoding; > 1: beam search with this many beams.
  config.decode.beam_size = 1
  # GNMT length penalty alpha of beam search (0: none).
  config.decode.length_penalty = 0.0
  # Most output tokens, <end> included (0: the longest training target + 1).
  config.decode.max_len = 0

  config_utils.apply_overrides(config, PRESETS[dataset])
  return config_utils.finalize(config, arg, runlocal=RUNLOCAL, shortcuts=SHORTCUTS)
