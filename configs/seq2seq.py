"""RNN encoder-decoder with (or without) attention on a translation task (task "translation").

Launch (from the repository root):
  attnlab train --config=configs/seq2seq.py --workdir=runs/dates              # dates, Bahdanau
  attnlab train --config=configs/seq2seq.py:task=marathi --workdir=runs/marathi
  attnlab train --config=configs/seq2seq.py:task=reverse,data.max_len=30,attention=none \
      --workdir=runs/reverse_none
  attnlab train --config=configs/seq2seq.py:attention=luong,score=general,model.window=local \
      --workdir=runs/dates_luong
  attnlab train --config=configs/seq2seq.py:preset=gnmt,model.num_layers=4 --workdir=runs/gnmt4
  attnlab train --config=configs/seq2seq.py:preset=gnmt,decode.beam_size=4,\
decode.length_penalty=0.6,decode.coverage_penalty=0.2 --workdir=runs/gnmt          # GNMT's beam
Any parallel corpus (configs/_translation.py; docs/guide.md, "Your own parallel corpus"):
  attnlab train --config=configs/seq2seq.py:dataset=anki,data.pair=fra --workdir=runs/fra
  attnlab train --config=configs/seq2seq.py:dataset=anki,data.path=cmn.txt,\
data.target_tokenizer=char --workdir=runs/cmn
  attnlab train --config=configs/seq2seq.py:dataset=tsv,data.path=pairs.tsv,data.direction=reverse \
      --workdir=runs/mine
A seconds-long check of the whole pipeline:
  attnlab train --config=configs/seq2seq.py:runlocal=True --workdir=/tmp/s2s_local
Translate with a trained run (prints the output, saves the alignment heatmap):
  attnlab translate --workdir=runs/marathi "Rahul is a good boy"
Studies built on it: experiments/dates, experiments/bottleneck, experiments/score_functions,
experiments/marathi, experiments/gnmt (each: README + run.py).

Shortcuts in the arg (besides any field; the same names as in the other config files):
  task=NAME, or dataset=NAME      = data.name (dates, marathi, reverse, copy, anki, tsv)
  attention=none|bahdanau|luong   = model.attention
  score=NAME                      = model.score (dot, scaled_dot, cosine, general, additive, ...)
  preset=gnmt                     = GNMT's stack (Wu et al. 2016): model.cell=lstm,
                                    model.num_layers=8, model.bidirectional=True,
                                    model.bidirectional_layers=1 (bottom encoder layer only),
                                    model.residual_start=3, model.attention_from=bottom; keys after
                                    it in the arg win, e.g. preset=gnmt,model.num_layers=4

The dataset is chosen in the arg (`task=marathi`, `dataset=marathi` or `data.name=marathi`): it
picks that dataset's defaults (tokenizer, sizes, steps) before the other keys apply. Setting
`--config.data.name` afterwards switches the data but keeps the dates defaults. The `data.*` and
`decode.*` fields, shared with configs/transformer.py, are documented in
configs/_translation.py's translation_groups.
"""

from attnlab import config_utils

# configs/_translation.py: the data groups shared with configs/transformer.py
_translation = config_utils.config_helper(__file__, "_translation")

# preset=NAME -> the model fields it sets (each also settable on its own, after it in the arg).
MODEL_PRESETS = {
    # Wu et al. 2016 (GNMT), section 3: 8 LSTM layers in encoder and decoder, the bottom encoder
    # layer bidirectional, residual connections from the third layer on, and the attention queried
    # by the bottom decoder layer with its context fed to every layer above.
    "gnmt": {
        "model.cell": "lstm",
        "model.num_layers": 8,
        "model.bidirectional": True,
        "model.bidirectional_layers": 1,
        "model.residual_start": 3,
        "model.attention_from": "bottom",
    },
}


def _set_preset(config, name: str) -> None:
  """preset=NAME: the model fields of MODEL_PRESETS[NAME]."""
  preset = MODEL_PRESETS[config_utils.check_choice("preset", name, MODEL_PRESETS, "presets")]
  config_utils.apply_overrides(config, preset)


# Short arg keys (config_utils.SHORTCUTS: one meaning in every config file; preset is this file's).
SHORTCUTS = config_utils.shortcut_table("task", "dataset", "attention", "score",
                                        preset=_set_preset)

# data.name -> {key: value} applied over the defaults below (and the data set's data fields of
# _translation.TRANSLATION_DATA) before the arg.
PRESETS = {
    "marathi": {
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
        "model.embed_dim": 16,
        "model.hidden_dim": 64,
        "model.bidirectional": False,
        "num_train_steps": 3000,
        "eval_every": 1000,
        "checkpoint_every": 1000,
    },
}
PRESETS["copy"] = PRESETS["reverse"]
# A corpus of real sentences gets the Marathi model.
PRESETS["anki"] = PRESETS["tsv"] = PRESETS["marathi"]

# Overrides of runlocal=True (after config_utils.RUNLOCAL): tiny model and data.
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
  config = config_utils.base_config()
  dataset = _translation.translation_groups(config, arg, SHORTCUTS)
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
  # Bottom encoder layers that read both ways when bidirectional (0: all; GNMT: 1).
  config.model.bidirectional_layers = 0
  # First layer (1-based) whose input is added to its output, in encoder and decoder: layer i+1
  # reads x_i + layer_i(x_i) (0: no residuals; GNMT: 3).
  config.model.residual_start = 0
  # Decoder layer whose state queries the attention: top (context fed to the bottom layer) |
  # bottom (GNMT: context fed to every layer above it and to the output layer too).
  config.model.attention_from = "top"
  # Size of the source and target token embeddings.
  config.model.embed_dim = 32
  # Size of each recurrent layer (per direction in the encoder).
  config.model.hidden_dim = 64
  # none (the last encoder state is the only view of the source) | bahdanau | luong.
  config.model.attention = "bahdanau"
  # Score function: dot, scaled_dot, cosine, general, additive, location.
  config.model.score = "additive"
  # global (all positions) | local (local-p window of half-width D) | local_m (local-m: the window
  # of half-width D at p_t = t, clipped to the source) | hard (one sampled position).
  config.model.window = "global"
  # Hidden size of the additive score and of the local-p position predictor (0: hidden_dim).
  config.model.attn_dim = 0
  # Half-width D of the local-p and local-m windows.
  config.model.local_half_width = 3
  # Luong: feed the previous attentional state into the next step.
  config.model.input_feeding = True
  # What attention reads from the encoder states h: states (keys and values are h) | projected
  # (separate key and value transforms: key = W_k h, value = W_v h).
  config.model.attention_values = "states"
  # Initial (trainable) key strength of the cosine score.
  config.model.cosine_beta = 5.0
  # Dropout on embeddings, between layers and before the output layer.
  config.model.dropout_rate = 0.0
  # Weight of the REINFORCE loss that trains hard attention's scores (unused otherwise).
  config.model.reinforce_weight = 1.0
  # Compute dtype: the RNN models compute in float32 only (model.name=transformer takes bfloat16
  # and float16; attnlab/precision.py).
  config.model.dtype = "float32"

  config_utils.apply_overrides(config, PRESETS.get(dataset, {}))
  return config_utils.finalize(config, arg, runlocal=RUNLOCAL, shortcuts=SHORTCUTS)
