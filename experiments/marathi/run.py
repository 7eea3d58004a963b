"""English -> Marathi with Bahdanau attention (the attention-NMT tutorial's model) on anki_mar_eng.

  ATTNLAB_DATA_DIR=../shared/data python experiments/marathi/run.py [--workdir=runs/marathi] \
      [--seeds=0] [--beam_size=4] [--arg=num_train_steps=4000] [--parallel=1]

1. Trains configs/seq2seq.py:task=marathi (word tokens, pairs of <= 12 words, bidirectional GRU
   encoder, Bahdanau additive attention) for each seed through the sweep runner
   (WORKDIR/seed=N/, resumable; finished members are skipped).
2. Reloads each run and decodes the held-out *test* split: corpus BLEU (sacrebleu over words) and
   exact match, greedy and with beam search.
3. Writes WORKDIR/results.md (metrics + sample translations) and heatmaps of the first seed for a
   handful of test sentences and "Rahul is a good boy" to WORKDIR/figures/.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

CONFIG = REPO / "configs" / "seq2seq.py"
EXTRA_SENTENCES = ("Rahul is a good boy.",)
NUM_HEATMAPS = 5


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=str(REPO / "runs" / "marathi"))
  parser.add_argument("--seeds", default="0")
  parser.add_argument("--beam_size", type=int, default=4)
  parser.add_argument("--parallel", type=int, default=1)
  parser.add_argument("--arg", default="", help="extra key=value,... for configs/seq2seq.py")
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir).absolute()
  spec = f"{CONFIG}:task=marathi" + (f",{args.arg}" if args.arg else "")

  from attnlab import sweep  # pylint: disable=g-import-not-at-top
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  tool.setup_logging()  # the members' progress on stderr
  start = time.time()
  status = sweep.run(spec, seeds=args.seeds, workdir=workdir, parallel=args.parallel).report(
      "run.py")
  print(f"sweep finished in {time.time() - start:.0f} s (status {status})")

  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top
  rows, samples = [], []
  for n, seed in enumerate(args.seeds.split(",")):
    member = workdir / f"seed={seed}"
    run = analysis.load_run(member)
    greedy, records = run.task.evaluate_split(run.params, "test", beam_size=1)
    beam, _ = run.task.evaluate_split(run.params, "test", beam_size=args.beam_size)
    rows.append(f"| {seed} | {run.step} | {len(records)} | {greedy['ce']:.3f} | "
                f"{greedy['bleu']:.2f} | {beam['bleu']:.2f} | {greedy['exact_match']:.3f} | "
                f"{beam['exact_match']:.3f} |")
    print(rows[-1])
    if n:
      continue
    short = [r for r in records if len(r["source"].split()) <= 8][:NUM_HEATMAPS]
    sentences = [r["source"] for r in short] + list(EXTRA_SENTENCES)
    for i, t in enumerate(run.task.translate(run.params, sentences, beam_size=args.beam_size)):
      plt.close(run.task.plot_alignment(t, workdir / "figures" / f"marathi_{i}.png"))
      reference = short[i]["reference"] if i < len(short) else ""
      samples.append(f"| {t.source} | {reference} | {t.text} |")
  table = "\n".join([
      f"Config: `configs/seq2seq.py:task=marathi{',' + args.arg if args.arg else ''}`; "
      f"test split of anki_mar_eng (pairs of <= 12 words).",
      "",
      f"| seed | steps | test pairs | test CE | BLEU greedy | BLEU beam {args.beam_size} | "
      f"exact match greedy | exact match beam |",
      "|---|---|---|---|---|---|---|---|",
      *rows,
      "",
      f"Sample translations (seed {args.seeds.split(',')[0]}, beam {args.beam_size}):",
      "",
      "| English | reference | model |",
      "|---|---|---|",
      *samples,
  ])
  (workdir / "results.md").write_text(table + "\n")
  print(table)
  return status


if __name__ == "__main__":
  from attnlab.cli import tool  # pylint: disable=g-import-not-at-top
  sys.exit(tool.run_tool("run.py", main))  # a bad config or axis: one line, status 2
