"""Head roles in a BERT pretrained on IMDB (issue #50): what do its heads attend to?

  PYTHONPATH=$PWD nice -n 10 python experiments/head_roles/run.py --workdir=/work/runs/head_roles
  PYTHONPATH=$PWD python experiments/head_roles/run.py --workdir=/work/runs/head_roles \
      --publish_dir=experiments/head_roles          # again once trained: copies the outputs here

Pretraining (WORKDIR/pretrain, an ordinary attnlab run of configs/bert.py: the same command
resumes it from its last checkpoint, or skips it when it is finished): `PRETRAIN`, then
`--steps` and `--pretrain_args` (which win). A 4-layer, 128-dim encoder with 4 heads of 32 dims
(BERT-Tiny's width at BERT-Mini's depth and head count: 16 heads to look at, about a third of
BERT-Mini's compute), masked language modelling with whole-word masking and next-sentence
prediction on the 24,500 training reviews of IMDB (attnlab.data.imdb_corpus, in SST-2's
writing), in the vocabulary learned on SST-2's rebuilt training sentences: the `imdb_sst2vocab`
arm of experiments/bert_sst2, shorter. Its held-out MLM and NSP accuracy (500 held-out reviews)
go to the results, so that a reader knows how trained the model is.

Measurement (attnlab.analysis.roles; its docstring defines every number):
  categories  per head, the mean attention to the previous word, the next word, [CLS], [SEP] and
              punctuation, over `--num_sentences` sentences of the held-out reviews (5 words or
              more that fit data.max_len with [CLS] and [SEP], evenly spaced over all such
              sentences), each fed alone as `[CLS] sentence [SEP]`; word level (attention to a
              word summed over its pieces, from a word averaged over them, as Clark et al. 2019
              do) and token level; each with its chance level, the score of uniform attention.
  pronouns    per head, the share of the hand-written sentences of `--pronouns` (antecedent
              marked) in which the pronoun's most-attended word is its antecedent, among all the
              words and among the marked candidate nouns; baselines: a uniformly random choice,
              the nearest candidate before the pronoun. The first sentence is the seed's "the
              animal did n't cross the street because it was too tired ." (it -> animal).
`--sentences=PATH` measures the categories on the sentences of a text file instead (one per
line, words split by spaces, in the run's writing: lower case, SST-2's tokenisation).

Outputs in WORKDIR: results.json (every number, per layer and head), results.md (the tables),
head_roles.png (one heatmap per category, layers x heads, word level) and it_attention.png
(the seed sentence: where "it" looks, every head); with `--publish_dir` they are copied there.
The measurement takes under a minute and is simply repeated by a re-run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
# experiments/benchmarks/machine.py: the CPU and the load a figure came from (as the benchmarks
# import it)
sys.path.append(str(REPO / "experiments" / "benchmarks"))
import machine  # pylint: disable=g-bad-import-order,wrong-import-position
CONFIG_FILE = REPO / "configs" / "bert.py"
PRONOUNS_FILE = pathlib.Path(__file__).resolve().parent / "pronouns.txt"
# The pretraining run (before --steps and --pretrain_args, which win): BERT-Tiny's width (128,
# MLP 512) with 4 layers of 4 heads; IMDB in SST-2's vocabulary, NSP, whole-word masking; AdamW
# 1e-3 (BERT-Tiny's rate in experiments/bert_sst2), a tenth of the steps warm-up, linear decay.
PRETRAIN = ("mode=pretrain,size=tiny,model.num_layers=4,model.num_heads=4,data.corpus=imdb,"
            "data.vocab_corpus=sst2_sentences,data.pair_task=nsp,data.whole_word=True,"
            "batch_size=64,optimizer.learning_rate=1e-3,eval_every=500,checkpoint_every=250,"
            "log_every=50")
# The head-view sentence of the pretraining run's plots, in SST-2's writing (set on the config:
# the quote of "n't" would open a quoted value in a config arg).
PLOT_SENTENCE = "the animal did n't cross the street because it was too tired ."
# Held-out sentences shorter than this (in words) are not measured.
MIN_WORDS = 5
# Sentences per captured batch (padded to data.max_len: one compiled forward pass).
BATCH = 64


def pretrain_config(args):
  """The pretraining config: PRETRAIN, the step count, --pretrain_args; checked."""
  from attnlab import config_utils  # pylint: disable=g-import-not-at-top
  parts = [PRETRAIN, f"num_train_steps={args.steps}",
           f"optimizer.warmup_steps={max(1, args.steps // 10)}"]
  if args.manual_dir:
    parts.append(f"data.manual_dir={pathlib.Path(args.manual_dir).absolute()}")
  if args.pretrain_args.strip(","):
    parts.append(args.pretrain_args.strip(","))
  config = config_utils.load_config_file(f"{CONFIG_FILE}:{','.join(parts)}")
  config.data.plot_sentence = PLOT_SENTENCE
  config_utils.validate(config)
  return config


# ------------------------------------------------------------------------------ text


def heldout_sentences(config, path: str = "") -> list[list[str]]:
  """The sentences (as word lists) to choose from: the file `path`'s lines with words, else the
  held-out IMDB reviews' sentences of MIN_WORDS words or more (reviews the pretraining never
  read), in order."""
  from attnlab.data import imdb_corpus  # pylint: disable=g-import-not-at-top
  from attnlab.errors import DataError  # pylint: disable=g-import-not-at-top
  from attnlab.tasks import base, masked_lm  # pylint: disable=g-import-not-at-top
  if path:
    source = pathlib.Path(path)
    if not source.is_file():
      raise DataError(f"--sentences: no such file {source}")
    sentences = [line.split() for line in source.read_text(encoding="utf-8").splitlines()
                 if line.split()]
    if not sentences:
      raise DataError(f"--sentences: {source} holds no sentence")
    return sentences
  data = config.data
  documents = imdb_corpus.imdb_corpus(**base.data_location(data), max_documents=data.max_documents,
                                      drop_seen=masked_lm.heldout_unseen(data)).heldout
  sentences = [s.split() for doc in documents for s in doc if len(s.split()) >= MIN_WORDS]
  if not sentences:
    raise DataError("the held-out reviews hold no sentence of 5 words or more")
  return sentences


def evenly(items: list, count: int) -> list:
  """`count` of `items` (all when fewer) at evenly spaced indices, the first and the last among
  them."""
  if len(items) <= count:
    return list(items)
  return [items[i] for i in np.linspace(0, len(items) - 1, count).round().astype(int)]


def encode(run, sentences: list[list[str]]):
  """(ids, word units, spans, token units) of the sentences that fit data.max_len."""
  from attnlab.analysis import roles  # pylint: disable=g-import-not-at-top
  tok, max_len = run.task.tokenizer, run.config.data.max_len
  kept = []
  for words in sentences:
    try:
      ids, units, spans = roles.bert_words(tok, words, max_len)
    except ValueError:
      continue  # too long for the model's training length
    kept.append((ids, units, spans, [tok.id_to_token(int(i)) for i in ids], words))
  return kept


def capture_rows(run, id_rows: list[np.ndarray]) -> list[np.ndarray]:
  """Per row, the encoder's weights `[layers, heads, n, n]` of its n real tokens."""
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  max_len = run.config.data.max_len
  out = []
  for start in range(0, len(id_rows), BATCH):
    chunk = id_rows[start:start + BATCH]
    ids = np.zeros((BATCH, max_len), np.int32)  # one shape: one compiled pass
    ids[:, :2] = [run.task.tokenizer.cls_id, run.task.tokenizer.sep_id]  # filler rows
    for i, row in enumerate(chunk):
      ids[i] = 0
      ids[i, :len(row)] = row
    maps = analysis.capture_batch(run, {"tokens": ids})
    paths = [p for p in maps if p.startswith("encoder/")]
    stacked = np.stack([maps[p] for p in paths], axis=1)  # [batch, layers, heads, len, len]
    for i, row in enumerate(chunk):
      n = len(row)
      out.append(np.ascontiguousarray(stacked[i, :, :, :n, :n], np.float32))
  return out


# ------------------------------------------------------------------------------ measurement


def pretraining_summary(workdir: pathlib.Path) -> dict:
  """The last held-out evaluation of the pretraining run and its held-out curve."""
  from attnlab import rundir  # pylint: disable=g-import-not-at-top
  records = rundir.read_metrics(workdir)
  evals = {r["step"]: r for r in records if r.get("split") == "eval"}
  last = evals[max(evals)] if evals else {}
  return {"step": last.get("step"), "mlm_accuracy": last.get("mlm_accuracy"),
          "nsp_accuracy": last.get("nsp_accuracy"),
          "curve": [[s, evals[s].get("mlm_accuracy"), evals[s].get("nsp_accuracy")]
                    for s in sorted(evals)]}


def measure(run, sentences: list[list[str]], count: int, marked) -> dict:
  """Every number of the study (module docstring) as plain lists: the categories on `count` of
  the sentences that fit data.max_len, evenly spaced over them; the pronouns on `marked`."""
  from attnlab.analysis import roles  # pylint: disable=g-import-not-at-top
  from attnlab.errors import DataError  # pylint: disable=g-import-not-at-top
  rows = evenly(encode(run, sentences), count)
  if not rows:
    raise DataError("no sentence to measure fits the model's data.max_len")
  weights = capture_rows(run, [r[0] for r in rows])
  words = roles.head_roles(weights, [r[1] for r in rows], [r[2] for r in rows])
  tokens = roles.head_roles(weights, [r[3] for r in rows])
  out = {"sentences": len(rows), "tokens": int(sum(len(r[0]) for r in rows)),
         "words": int(sum(len(r[4]) for r in rows)),
         "word": {k: v.tolist() for k, v in words.items()},
         "word_chance": roles.uniform_roles([r[1] for r in rows], [r[2] for r in rows]),
         "token": {k: v.tolist() for k, v in tokens.items()},
         "token_chance": roles.uniform_roles([r[3] for r in rows]),
         "examples": [" ".join(r[4]) for r in rows[:3]]}
  # Pronouns: every marked sentence must fit (a hand-written set: none is dropped silently).
  encoded = []
  for number, s in enumerate(marked, 1):
    try:
      encoded.append(roles.bert_words(run.task.tokenizer, s.words, run.config.data.max_len))
    except ValueError as e:
      raise DataError(f"pronoun sentence {number}: {e}") from None
  p_weights = capture_rows(run, [e[0] for e in encoded])
  scores = roles.antecedent_scores(p_weights, [e[2] for e in encoded], marked)
  out["pronoun"] = {k: v.tolist() for k, v in scores.items() if not k.startswith("hits_")}
  # Candidates accuracy on the sentences whose antecedent is the nearest candidate before the
  # pronoun, and on the others: a head that picks by position alone scores 1 on one and 0 on the
  # other, one that follows the sentence's meaning scores on both.
  nearest = np.array([s.nearest_candidate() == s.antecedent for s in marked])
  hits = scores["hits_candidates"]  # [sentences, layers, heads]
  out["pronoun"]["candidates_nearest"] = hits[nearest].mean(0).tolist()
  out["pronoun"]["candidates_not_nearest"] = hits[~nearest].mean(0).tolist()
  out["pronoun"]["hits_candidates"] = hits.astype(int).tolist()
  out["pronoun_split"] = {"nearest": int(nearest.sum()), "not_nearest": int((~nearest).sum())}
  out["pronoun_baselines"] = roles.antecedent_baselines(marked)
  out["pronoun_sentences"] = len(marked)
  # The seed's sentence (the first one): the word-level row of its pronoun, every head.
  first, (_, units, spans) = marked[0], encoded[0]
  row = roles.word_attention(p_weights[0], spans)[..., first.pronoun + 1, :]  # [L, H, units]
  out["seed"] = {"sentence": " ".join(first.words), "pronoun": first.words[first.pronoun],
                 "antecedent": first.words[first.antecedent], "units": units,
                 "pronoun_unit": first.pronoun + 1, "antecedent_unit": first.antecedent + 1,
                 "row": row.tolist()}
  return out


# ------------------------------------------------------------------------------ outputs


CATEGORY_NAMES = ("previous", "next", "[CLS]", "[SEP]", "punctuation")


def tables(result: dict) -> str:
  """results.md: the per-head table (word level), the token-level table, the seed sentence."""
  m = result["measure"]
  pre = result["pretraining"]
  layers = len(m["word"]["previous"])
  heads = len(m["word"]["previous"][0])
  base = m["pronoun_baselines"]
  split = m["pronoun_split"]
  lines = [f"Pretraining: {result['config_summary']}; held-out MLM accuracy "
           f"{100 * pre['mlm_accuracy']:.1f}%, NSP {100 * pre['nsp_accuracy']:.1f}% at step "
           f"{pre['step']}.", "",
           f"Categories: mean attention per head over {m['sentences']} held-out sentences "
           f"({m['words']} words, {m['tokens']} tokens with [CLS] and [SEP]), word level. "
           f"Pronoun: share of the {m['pronoun_sentences']} marked sentences whose pronoun's "
           "most-attended word is its antecedent (among all words / among the candidate nouns).",
           f"The candidates' accuracy is also split: the {split['nearest']} sentences whose "
           f"antecedent is the nearest candidate before the pronoun, and the "
           f"{split['not_nearest']} others.",
           "", "| layer | head | previous | next | [CLS] | [SEP] | punctuation | antecedent, all "
           "words | antecedent, candidates | candidates: nearest / others | weight on "
           "antecedent |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  chance = m["word_chance"]
  lines.append("| chance | (uniform) | " + " | ".join(f"{chance[c]:.3f}" for c in CATEGORY_NAMES)
               + f" | {base['all']:.3f} | {base['candidates']:.3f} (nearest candidate: "
               f"{base['nearest_candidate']:.3f}) | nearest-candidate rule: 1 / 0 | - |")
  for l in range(layers):
    for h in range(heads):
      cells = [f"{m['word'][c][l][h]:.3f}" for c in CATEGORY_NAMES]
      cells += [f"{m['pronoun'][k][l][h]:.3f}" for k in ("all", "candidates")]
      cells.append(f"{m['pronoun']['candidates_nearest'][l][h]:.2f} / "
                   f"{m['pronoun']['candidates_not_nearest'][l][h]:.2f}")
      cells.append(f"{m['pronoun']['weight'][l][h]:.3f}")
      lines.append(f"| {l} | {h} | " + " | ".join(cells) + " |")
  lines += ["", "Token level (word pieces; attention to each piece, from each piece):", "",
            "| layer | head | " + " | ".join(CATEGORY_NAMES) + " |",
            "|---|---|" + "---|" * len(CATEGORY_NAMES)]
  lines.append("| chance | (uniform) | " + " | ".join(
      f"{m['token_chance'][c]:.3f}" for c in CATEGORY_NAMES) + " |")
  for l in range(layers):
    for h in range(heads):
      lines.append(f"| {l} | {h} | " + " | ".join(f"{m['token'][c][l][h]:.3f}"
                                                   for c in CATEGORY_NAMES) + " |")
  seed = m["seed"]
  units = seed["units"]
  target, pronoun_unit = seed["antecedent_unit"], seed["pronoun_unit"]
  lines += ["", f"Seed sentence \"{seed['sentence']}\": attention from "
            f"\"{seed['pronoun']}\" (word level), per head:", "",
            f"| layer | head | weight on \"{seed['antecedent']}\" | most-attended unit, itself excluded (weight) |",
            "|---|---|---|---|"]
  for l in range(layers):
    for h in range(heads):
      row = np.asarray(seed["row"][l][h])
      order = [j for j in np.argsort(-row, kind="stable") if j != pronoun_unit]
      lines.append(f"| {l} | {h} | {row[target]:.3f} | {units[order[0]]} ({row[order[0]]:.3f}) |")
  return "\n".join(lines) + "\n"


def figures(result: dict, workdir: pathlib.Path) -> None:
  from attnlab import plotting  # pylint: disable=g-import-not-at-top
  from attnlab.analysis import roles  # pylint: disable=g-import-not-at-top
  m = result["measure"]
  base = m["pronoun_baselines"]
  panels = {c: m["word"][c] for c in CATEGORY_NAMES}
  panels["antecedent, all words"] = m["pronoun"]["all"]
  panels["antecedent, candidates"] = m["pronoun"]["candidates"]
  chance = {**m["word_chance"], "antecedent, all words": base["all"],
            "antecedent, candidates": base["candidates"]}
  pre = result["pretraining"]
  roles.plot_head_roles(panels, chance, path=workdir / "head_roles.png", title=(
      f"Head roles, BERT {result['config_summary']} (held-out MLM "
      f"{100 * pre['mlm_accuracy']:.1f}%): {m['sentences']} held-out IMDB sentences, "
      f"{m['pronoun_sentences']} pronoun sentences"))
  seed = m["seed"]
  row = np.asarray(seed["row"])  # [layers, heads, units]
  layers, heads = row.shape[:2]
  plotting.attention_heatmap(
      row.reshape(layers * heads, -1), x_labels=seed["units"],
      y_labels=[f"L{l} H{h}" for l in range(layers) for h in range(heads)],
      title=f"attention from \"{seed['pronoun']}\": {seed['sentence']}", xlabel="word",
      ylabel="layer, head", path=workdir / "it_attention.png")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "head_roles"))
  parser.add_argument("--steps", type=int, default=5000, help="pretraining steps")
  parser.add_argument("--pretrain_args", default="", help="extra configs/bert.py key=value,...")
  parser.add_argument("--manual_dir", default=str(REPO.parent / "shared" / "data"),
                      help="folder with the raw data (SST-2 for the overlap check and vocabulary)")
  parser.add_argument("--num_sentences", type=int, default=400,
                      help="held-out sentences the categories are measured on")
  parser.add_argument("--sentences", default="", help="a text file of sentences to measure "
                      "instead of the held-out reviews (one per line)")
  parser.add_argument("--pronouns", default=str(PRONOUNS_FILE),
                      help="marked pronoun sentences (attnlab.analysis.roles.parse_marked)")
  parser.add_argument("--publish_dir", default="", help="also copy the outputs here")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.num_sentences < 1:
    parser.error("need --steps >= 1 and --num_sentences >= 1")

  # pylint: disable=g-import-not-at-top  (JAX is imported only once the flags are parsed)
  from attnlab import analysis, rundir, train
  from attnlab.analysis import roles
  from attnlab.cli import tool
  tool.setup_logging()
  config = pretrain_config(args)  # a bad key: one line, before anything runs
  marked = roles.read_marked(args.pronouns)
  workdir = pathlib.Path(args.workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  pretrain_dir = workdir / "pretrain"
  started, uptime_before = time.time(), machine.uptime()
  print(f"uptime before: {uptime_before}", flush=True)
  timings_path = workdir / "timings.json"
  timings = json.loads(timings_path.read_text()) if timings_path.is_file() else {}
  if rundir.is_complete(pretrain_dir, config.num_train_steps):
    print(f"pretraining: finished ({config.num_train_steps} steps), skipped", flush=True)
  else:
    print(f"pretraining: {config.num_train_steps} steps in {pretrain_dir}", flush=True)
    start = time.time()
    try:
      train.train_and_evaluate(config, pretrain_dir)
    finally:  # an interrupted session's seconds count too
      timings["pretrain_s"] = timings.get("pretrain_s", 0.0) + time.time() - start
      timings_path.write_text(json.dumps(timings, indent=1) + "\n")
  start = time.time()
  run = analysis.load_run(pretrain_dir)
  sentences = heldout_sentences(run.config, args.sentences)
  result = {"pretraining": pretraining_summary(pretrain_dir),
            "config_summary": (f"{run.config.model.num_layers} layers x "
                               f"{run.config.model.num_heads} heads, d={run.config.model.d_model}, "
                               f"{run.step} steps of {run.config.batch_size} on "
                               f"{run.config.data.corpus}"),
            "checkpoint_step": run.step,
            "measure": measure(run, sentences, args.num_sentences, marked)}
  timings["measure_s"] = time.time() - start
  timings_path.write_text(json.dumps(timings, indent=1) + "\n")
  result.update({"seconds": timings, "uptime_before": uptime_before,
                 "uptime_after": machine.uptime(),
                 "wall_s_this_invocation": time.time() - started, "cpu": machine.cpu_line(),
                 "cpus": os.cpu_count(), "pronouns_file": str(args.pronouns)})
  text = tables(result)
  (workdir / "results.json").write_text(json.dumps(result, indent=1) + "\n")
  (workdir / "results.md").write_text(text)
  figures(result, workdir)
  if args.publish_dir:
    target = pathlib.Path(args.publish_dir)
    target.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "results.md", "head_roles.png", "it_attention.png"):
      shutil.copyfile(workdir / name, target / name)
    if (pretrain_dir / "head_view.png").is_file():
      shutil.copyfile(pretrain_dir / "head_view.png", target / "head_view.png")
  print(text)
  print(f"uptime after: {result['uptime_after']}\nwall time this invocation: "
        f"{result['wall_s_this_invocation']:.0f} s (pretraining, all invocations: "
        f"{timings.get('pretrain_s', 0.0):.0f} s; measurement {timings['measure_s']:.0f} s)")
  return 0


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config arg: one line, status 2
