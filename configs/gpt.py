"""GPT (decoder-only Transformer) language model, task "causal_lm".

Launch (from the repository root):
  attnlab train --config=configs/gpt.py --workdir=runs/gpt_nano
  attnlab train --config=configs/gpt.py:size=nano,score=scaled_dot --workdir=runs/gpt_nano
  attnlab train --config=configs/gpt.py:size=small --workdir=runs/gpt_small
  attnlab train --config=configs/gpt.py:size=gpt2,model.dtype=bfloat16,dataset=synthetic_tokens \
      --workdir=runs/gpt2_synthetic                  # GPT-2 small on a GPU, no corpus needed
  attnlab train --config=configs/gpt.py:dataset=addition,num_train_steps=3000 --workdir=runs/gpt_add
  attnlab generate --workdir=runs/gpt_nano --prompt="ROMEO:" --num_tokens=300 --temperature=0.8
  attnlab train --config=configs/gpt.py:dataset=text,data.path=my_corpus.txt --workdir=runs/mine
Fine-tuning a pretrained run (an attnlab GPT run, or a GPT-2 imported with `attnlab import-hf`) on
any text, tokenized with that run's tokenizer:
  attnlab train --config=configs/gpt.py:pretrained=runs/gpt_nano,dataset=text,data.path=my.txt,\
num_train_steps=500,eval_every=50,early_stop_patience=3 --workdir=runs/gpt_nano_mine
  attnlab generate --workdir=runs/gpt_nano_mine --prompt="ROMEO:"
  attnlab import-hf runs/gpt_nano_mine --export_to=out/mine   # for transformers (GPT-2 settings)
The fine-tuning recipe (the defaults whenever pretrained=DIR, or init_from=DIR, is in the arg;
a key given in the arg, before or after it, or as a flag wins): AdamW at a tenth of the from-scratch peak, learning rate 1e-4
with 20 warmup steps and a cosine to 1e-5 (FINETUNE_RECIPE; runlocal=True keeps its 2 warmup
steps); the rest of the optimizer as below. Options:
  finetune.freeze_embeddings=True   the token table (which is also the tied output layer) and the
                                    position table stay as pretrained
  finetune.freeze_layers=N          the lowest N blocks stay as pretrained
  early_stop_patience=P             stop after P evaluations (every eval_every steps) without a
                                    lower validation loss; the best evaluation's checkpoint is
                                    the run's result: generate, view, export and pretrained=
                                    use it (attnlab/train.py)
Frozen parameters get zero updates and no optimizer state. A GPT-2 imported with import-hf
(learned positions, biases, gelu) exports back after fine-tuning; an attnlab GPT exports when
trained with model.position=learned,model.use_bias=True (and the default attention).
A seconds-long check of the whole pipeline:
  attnlab train --config=configs/gpt.py:runlocal=True --workdir=/tmp/gpt_local

The default is the nano setting with nanoGPT's CPU recipe for Shakespeare characters: 4 layers,
4 heads, 128 dims, block 64, batch 12, AdamW lr 1e-3 (100 warmup steps, cosine to 1e-4 at step
2000), betas (0.9, 0.99), weight decay 0.1 on matrices only (as nanoGPT), gradient clip 1.0, no
dropout, no biases. One departure from nanoGPT's model: rotary positions (queries and keys rotated
in every attention layer) instead of a learned position table; `model.position=learned` gives
nanoGPT's architecture exactly (experiments/shakespeare/README.md compares them).
The experiment with plots: python experiments/shakespeare/run.py

Shortcuts in the arg (besides any field; the same names as in the other config files):
  size=nano|small|tiny|gpt2       = model.size (gpt2 = GPT-2 small, 124M: 12 layers, 12 heads,
                                  768 dims, block 1024, learned positions, vocabulary padded to a
                                  multiple of 64, nanoGPT's train_gpt2 optimizer recipe)
  score=NAME                      = model.attention.score (dot, scaled_dot, cosine, general, ...)
  implementation=NAME             = model.attention.implementation (auto, reference, xla, ...)
  mechanism=NAME                  = model.attention.mechanism (full, linear, performer, ...)
  dataset=NAME, or task=NAME      = data.name (tiny_shakespeare, text, addition,
                                  synthetic_tokens, induction)
  tokenizer=char|byte|subword     = data.tokenizer
  pretrained=DIR                  start from run DIR (a causal_lm run, e.g. a GPT-2 imported with
                                  `attnlab import-hf`): sets init_from=DIR and copies DIR's
                                  architecture (PRETRAINED_FIELDS: sizes, positions, the
                                  model.attention subtree, vocabulary) and tokenizer fields; the
                                  text is tokenized with DIR's kept tokenizer. Keys set after it
                                  that differ from DIR are refused in one line (before anything
                                  is written); optimizer, steps, dropout and data stay free, the
                                  optimizer's defaults being the fine-tuning recipe above.
`dataset=text,data.path=FILE_OR_DIR`: your own corpus, a UTF-8 text file or a folder whose *.txt
files are read in sorted order; the last 10% of the characters are held out for validation
(attnlab/data/text_corpus.py), the character vocabulary is built from the first 90% (or is the
pretrained run's); characters it cannot encode are named in one line.
Tiny Shakespeare is read from data.manual_dir, else $ATTNLAB_DATA_DIR/tinyshakespeare/, else
downloaded (see attnlab.data). `synthetic_tokens` is uniform random token ids (data.vocab_size
of them, token-id "text") for throughput measurements without a corpus. `induction` is random
ids (data.vocab_size of them) with a random-length segment copied to a random later offset, for
circuit studies (experiments/induction_heads); evaluation adds copy_loss, the loss on the copied
ids an induction head can predict. The study's recipe (copies of 8..32 ids; with 4..16, 14% of
the targets, a 2-layer model stayed on the uniform plateau for 3000 steps, and the default 2..16
copies fewer still; experiments/induction_heads/README.md):
  attnlab train --config=configs/gpt.py:dataset=induction,model.mlp_ratio=0,model.num_layers=2,data.vocab_size=64,model.d_model=64,data.min_span=8,data.max_span=32,batch_size=32,num_train_steps=3000 --workdir=runs/gpt_induction
"""


from attnlab import config_utils
from attnlab import run_config

# Fields that `pretrained=DIR` copies from DIR/config.json (when DIR's config has them; a group,
# model.attention, with all of its fields).
PRETRAINED_FIELDS = ("model.size", "model.num_layers", "model.num_heads", "model.d_model",
                     "model.block_size", "model.mlp_ratio", "model.position",
                     "model.vocab_multiple", "model.vocab_size", "model.activation",
                     "model.use_bias", "model.layer_norm_epsilon", "model.attention",
                     "data.tokenizer", "data.tokenizer_path", "data.vocab_size")
# Datasets whose token ids come from the pretrained run's tokenizer (others: the run's own data).
TEXT_DATASETS = ("tiny_shakespeare", "text")


def _pretrained_fields(workdir: str) -> dict:
  """{field: value} of PRETRAINED_FIELDS in the causal_lm run `workdir` (its config.json), and
  its data.name when that is not a text dataset (addition, induction: the same ids)."""
  stored = run_config.pretrained_fields(
      workdir, "causal_lm", PRETRAINED_FIELDS + ("data.name",),
      "a GPT (causal_lm) run (configs/gpt.py, or a GPT-2 imported with attnlab import-hf)")
  del stored["task"]
  if stored.get("data.name") in TEXT_DATASETS:
    del stored["data.name"]
  return stored


def _set_pretrained(config, workdir: str) -> None:
  """pretrained=DIR: init_from=DIR and DIR's architecture and tokenizer (PRETRAINED_FIELDS)."""
  config.init_from = workdir
  config_utils.put_fields(config, _pretrained_fields(workdir))  # an imported run's too


# The optimizer defaults of a fine-tuning run (pretrained=DIR or init_from=DIR in the arg): a tenth
# of the from-scratch peak learning rate, a short warmup, cosine to a tenth of the peak. Any key
# given in the arg or as a flag still wins.
FINETUNE_RECIPE = {"optimizer.learning_rate": 1e-4, "optimizer.warmup_steps": 20,
                   "optimizer.end_learning_rate": 1e-5}


# Short arg keys (config_utils.SHORTCUTS: one meaning in every config file). Under runlocal=True,
# finalize applies them again after the runlocal overrides, so a pretrained run's fields win.
SHORTCUTS = config_utils.shortcut_table("size", "score", "implementation", "mechanism",
                                        "dataset", "task", "tokenizer", pretrained=_set_pretrained)


def get_config(arg: str | None = None):
  """`arg`: key=value,... typed from the defaults below (e.g. "size=small,score=cosine")."""
  # The size picks some defaults (gpt2: nanoGPT's GPT-2 recipe); finalize applies the whole arg.
  size = config_utils.arg_value(arg, "model.size", "nano", SHORTCUTS)
  gpt2 = size == "gpt2"
  # Fine-tuning a pretrained run (pretrained=DIR, or init_from=DIR in the arg): FINETUNE_RECIPE.
  finetuning = bool(config_utils.arg_value(arg, "pretrained", "")
                    or config_utils.arg_value(arg, "init_from", ""))
  config = config_utils.base_config()
  config.task = "causal_lm"
  config.num_train_steps = 2000
  # Sequences (windows of block_size tokens) per step.
  config.batch_size = 12
  config.log_every = 50
  config.eval_every = 250
  # Periodic evaluations on the first 16 batches of validation windows (512 windows, about a
  # third of Shakespeare's validation text); the last one on all of it.
  config.eval_batches = 16
  config.checkpoint_every = 500
  # Workdir of a causal_lm run whose weights and tokenizer start this model ("" = from scratch;
  # the pretrained= shortcut also copies its architecture).
  config.init_from = ""
  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 100
  config.optimizer.schedule = "cosine"
  config.optimizer.end_learning_rate = 1e-4
  config.optimizer.weight_decay = 0.1
  config.optimizer.decay = "matrices"
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.99
  config.optimizer.grad_clip = 1.0
  if gpt2:  # nanoGPT's config/train_gpt2.py (its batch of 12 x 1024 tokens without accumulation)
    config.num_train_steps = 600_000
    config.log_every = 10
    config.eval_every = 2000
    config.checkpoint_every = 2000
    config.optimizer.learning_rate = 6e-4
    config.optimizer.warmup_steps = 2000
    config.optimizer.end_learning_rate = 6e-5
    config.optimizer.b2 = 0.95
  if finetuning:
    for key, value in FINETUNE_RECIPE.items():
      group, field = key.split(".")
      config[group][field] = value
  # Fine-tuning: parameters the optimizer leaves unchanged (zero updates, no optimizer state).
  config.finetune = config_utils.ConfigDict()
  # Freeze the token table (which is also the tied output layer) and the position table.
  config.finetune.freeze_embeddings = False
  # Freeze the lowest N Transformer blocks (0: none; at most model.num_layers).
  config.finetune.freeze_layers = 0

  # Size preset: nano (4 layers, 4 heads, 128 dims, block 64), small (6, 6, 384, 256), tiny,
  # gpt2 (GPT-2 small: 12, 12, 768, 1024).
  config.model.size = "nano"
  # Number of Transformer blocks (0: from the size).
  config.model.num_layers = 0
  # Attention heads per block (0: from the size).
  config.model.num_heads = 0
  # Residual stream width (0: from the size).
  config.model.d_model = 0
  # Context length in tokens (0: from the size).
  config.model.block_size = 0
  # MLP hidden size as a multiple of d_model (0: no MLP, an attention-only GPT for circuit
  # studies).
  config.model.mlp_ratio = 4
  # Position encoding: learned, sinusoidal, rotary (queries and keys rotated in attention), none,
  # alibi (Press et al. 2022) or t5_bias (Raffel et al. 2020; one table shared by the layers):
  # the last two are biases on the scores that extrapolate past block_size.
  config.model.position = "learned" if gpt2 else "rotary"
  # Round the vocabulary up to a multiple of this (GPT-2: 50257 -> 50304, faster matmuls).
  config.model.vocab_multiple = 64 if gpt2 else 1
  # Compute dtype: float32, bfloat16 or float16 (loss-scaled); parameters, softmax, layer-norm
  # statistics and losses stay float32 (attnlab/precision.py).
  config.model.dtype = "float32"
  # The attention, one subtree (attnlab.attention.config): mechanism and its options, score,
  # implementation, normaliser, kv heads (GQA/MQA), talking heads, plugins.
  config_utils.add_attention(config.model, arg)
  # MLP activation: gelu_tanh (fast on CPU), gelu (exact), relu.
  config.model.activation = "gelu_tanh"
  # Biases in Dense layers and LayerNorms.
  config.model.use_bias = False
  # Dropout on embeddings and residual branches.
  config.model.dropout_rate = 0.0
  # Dropout on the attention weights (runs the reference attention path while training).
  config.model.attention_dropout_rate = 0.0

  # Dataset: tiny_shakespeare, text (your files, data.path), addition, synthetic_tokens (random
  # ids, for throughput) or induction (random ids with a segment copied to a random later offset).
  config.data.name = "tiny_shakespeare"
  # text: a UTF-8 text file, or a folder of *.txt files (sorted); the last 10% held out.
  config.data.path = ""
  # Tokenizer for tiny_shakespeare and text: char, byte (UTF-8 bytes: a fixed vocabulary of 263
  # ids for any text) or subword (sentencepiece); addition is always char.
  config.data.tokenizer = "char"
  # Subword vocabulary size (tokenizer=subword); token ids of synthetic_tokens and induction
  # (GPT-2's 50257 with size=gpt2).
  config.data.vocab_size = 50257 if gpt2 else 1024
  # Where subword tokenizers are cached ("": ~/.cache/attnlab/tokenizers).
  config.data.tokenizer_dir = ""
  # Folder holding tinyshakespeare/input.txt ("": $ATTNLAB_DATA_DIR, else download).
  config.data.manual_dir = ""
  # TFDS data dir for the prepared dataset ("": $TFDS_DATA_DIR or ~/tensorflow_datasets).
  config.data.data_dir = ""
  # Sequences per evaluation batch. 32: the nano GPT's whole validation split took 1.4 s in
  # batches of 32 against 2.3 s in batches of 128 on a 2-core CPU (experiments/benchmarks, #51).
  config.data.eval_batch_size = 32
  # Validation windows to evaluate (0: every non-overlapping window of the validation text).
  config.data.eval_windows = 0
  # addition, induction: training sums / sequences.
  config.data.num_train = 100_000
  # addition, induction: validation sums (exact-answer accuracy) / sequences (copy_loss).
  config.data.num_eval = 1000
  # addition: fewest digits per operand.
  config.data.min_digits = 1
  # addition: most digits per operand.
  config.data.max_digits = 3
  # induction: fewest ids in the copied segment (>= 2).
  config.data.min_span = 2
  # induction: most ids in the copied segment (2 * max_span <= block_size + 1).
  config.data.max_span = 16
  # addition, induction: data seed (-1: the run's seed).
  config.data.seed = -1

  config.generate = config_utils.ConfigDict()
  # Prompt of the sample written after training (sample.txt, attention.png); "": "ROMEO:" for
  # tiny_shakespeare, "12+34=" for addition.
  config.generate.prompt = ""
  # Tokens to generate for that sample.
  config.generate.num_tokens = 300
  # Sampling temperature (0 = greedy).
  config.generate.temperature = 0.8
  # Keep only the top_k most likely tokens when sampling (0: all).
  config.generate.top_k = 0

  runlocal = {
      "model.size": "tiny",
      "optimizer.warmup_steps": 2,
      "data.eval_windows": 64,
      "data.num_train": 2000,
      "data.num_eval": 64,
      "generate.num_tokens": 40,
  }
  return config_utils.finalize(config, arg, runlocal=runlocal, shortcuts=SHORTCUTS)
