"""Transformer encoder-decoder on a translation task (task "translation", model.name=transformer).

Launch (from the repository root):
  attnlab train --config=configs/transformer.py --workdir=runs/tf_dates               # dates
  attnlab train --config=configs/transformer.py:task=marathi --workdir=runs/tf_marathi
  attnlab train --config=configs/transformer.py:task=reverse --workdir=runs/tf_reverse
  attnlab train --config=configs/transformer.py:dataset=anki,data.pair=spa --workdir=runs/tf_spa
  attnlab train --config=configs/transformer.py:dataset=tsv,data.path=pairs.tsv \
      --workdir=runs/tf_mine
  attnlab train --config=configs/transformer.py:size=tiny,score=additive,\
model.position=learned,model.share_embeddings=target --workdir=runs/tf_dates_variant
A seconds-long check of the whole pipeline:
  attnlab train --config=configs/transformer.py:runlocal=True --workdir=/tmp/tf_local
Translate with a trained run (prints the output, saves the cross-attention heatmap):
  attnlab translate --workdir=runs/tf_marathi "Rahul is a good boy"
Per-layer, per-head attention grids of a sentence pair:
  python experiments/rnn_vs_transformer/run.py --heatmaps=runs/tf_marathi

Shortcuts in the arg (besides any field; the same names as in the other config files):
  task=NAME, or dataset=NAME      = data.name (dates, marathi, reverse, copy, anki, tsv)
  size=tiny|small|medium|base     = model.size
  score=NAME                      = model.attention.score (dot, scaled_dot, cosine, general, ...)
  implementation=NAME             = model.attention.implementation (auto, reference, xla, ...)
  mechanism=NAME                  = model.attention.mechanism (full, linear, performer, ...)

The dataset is chosen in the arg (`task=marathi`, `dataset=marathi` or `data.name=marathi`): it
picks that dataset's data settings, the same as configs/seq2seq.py's (both come from
configs/_translation.py's translation_groups, which documents the `data.*` and `decode.*` fields), then
this file's model and training defaults for that dataset, then the other keys of the arg.
"""

from attnlab import config_utils

# configs/_translation.py: the data groups shared with configs/seq2seq.py
_translation = config_utils.config_helper(__file__, "_translation")

# Short arg keys (config_utils.SHORTCUTS: one meaning in every config file).
SHORTCUTS = config_utils.shortcut_table("task", "dataset", "size", "score", "implementation",
                                        "mechanism")

# data.name -> {key: value} applied over the defaults below before the arg.
PRESETS = {
    "marathi": {
        "model.size": "medium",
        "model.dropout_rate": 0.1,
        "batch_size": 64,
        "num_train_steps": 8000,
        "eval_every": 2000,
        "checkpoint_every": 1000,
        "optimizer.learning_rate": 1e-3,
        "optimizer.warmup_steps": 400,
    },
    "reverse": {
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
    "model.size": "tiny",
    "optimizer.warmup_steps": 2,
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
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 200
  config.optimizer.schedule = "cosine"
  config.optimizer.end_learning_rate = 1e-5
  config.optimizer.grad_clip = 1.0

  # Model family (attnlab.models.TRANSLATION_MODELS).
  config.model.name = "transformer"
  # Size preset (attnlab.models.transformer.SIZES: tiny, small, medium, base) for the fields at 0.
  config.model.size = "small"
  # Encoder blocks (0: from size).
  config.model.num_layers = 0
  # Decoder blocks (0: as many as the encoder).
  config.model.num_decoder_layers = 0
  # Attention heads (0: from size).
  config.model.num_heads = 0
  # Model width d_model (0: from size).
  config.model.d_model = 0
  # Hidden size of the position-wise MLPs (0: from size).
  config.model.mlp_dim = 0
  # Position encoding: sinusoidal, learned, rotary (queries and keys rotated in self-attention),
  # alibi or t5_bias (score biases of the self-attentions; T5: one table per stack, shared by
  # its layers).
  config.model.position = "sinusoidal"
  # The attention, one subtree (attnlab.attention.config): mechanism of the self-attentions and
  # its options, score and normaliser of every attention, implementation, kv heads, plugins.
  config_utils.add_attention(config.model, arg)
  # none | target (target table = output layer) | all (one table for source, target and output).
  config.model.share_embeddings = "none"
  # LayerNorm placement: pre or post (Vaswani et al.).
  config.model.norm_position = "pre"
  # MLP activation: relu, gelu, gelu_tanh.
  config.model.activation = "relu"
  # Dropout on embeddings and residual branches.
  config.model.dropout_rate = 0.0
  # Dropout on the attention weights.
  config.model.attention_dropout_rate = 0.0
  # Longest source/target: position tables and KV cache (0: max(64, 2 * longest source + 2)).
  config.model.max_len = 0
  # Decoder layer whose head-averaged cross-attention the task plots and beam search's coverage
  # penalty (decode.coverage_penalty) sums (-1: the last).
  config.model.weights_layer = -1
  # Compute dtype: float32, bfloat16 or float16 (loss-scaled); parameters, softmax, layer-norm
  # statistics and losses stay float32 (attnlab/precision.py).
  config.model.dtype = "float32"

  config_utils.apply_overrides(config, PRESETS.get(dataset, {}))
  return config_utils.finalize(config, arg, runlocal=RUNLOCAL, shortcuts=SHORTCUTS)
