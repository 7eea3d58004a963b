"""Gold alignments of the synthetic translation tasks and how well attention recovers them.

  gold = gold_alignment("dates", "9 october 1993", "1993-10-09")   # per output token: (sure, possible)
  report = evaluate_alignment(run, num_examples=200)   # {layer path: {bin: {accuracy, aer, ...}}}

Gold links (output token i -> source token positions; the final `<end>` has none):
- copy: i -> i;  reverse: i -> n - 1 - i (sure links).
- dates (character tokens): each character of the ISO output "YYYY-MM-DD" comes from the source
  field that holds its year, month or day, as `attnlab.data.synthetic.DATE_FORMATS` renders it
  (the format is recovered by re-rendering the date in every format). Every character of that
  field is a possible link; the digits of a numeric field, right-aligned with the output digits
  ("93" -> the "93" of "1993", "9" -> the "9" of "09", "9th" -> "9"), are sure links. The "-"
  separators have no gold link and are not scored.

Scores over held-out examples of the run's own task, teacher-forced on the reference output (row
i of a cross-attention is the step producing output token i), from the argmax alignment
A = {(i, argmax_j w_ij)} of the head-averaged weights (and of each head):
- accuracy: the fraction of scored output tokens whose argmax is a possible link;
- AER (Och & Ney 2003): 1 - (|A ∩ S| + |A ∩ P|) / (|A| + |S|), S the sure and P the possible links
  (S ⊆ P), summed over the examples;
per source-length bin (`config.data.length_bins`, or `bins=`) and over all ("all").

`shift=d` scores against the gold links moved d source positions to the right (rows whose link
leaves the source are not scored). A recurrent encoder's state at position j + 1 still carries
token j, so an RNN decoder may learn to attend one position late while translating perfectly:
compare shift=0 with shift=1 before reading a low accuracy as a failure to align.
"""

from __future__ import annotations

import collections
import datetime
import string
from collections.abc import Sequence
from typing import Any

import numpy as np

from attnlab.analysis import capture as capture_lib
from attnlab.data import synthetic

__all__ = ["ALIGNMENT_TASKS", "alignment_counts", "dates_gold", "evaluate_alignment",
           "gold_alignment", "score_counts", "shift_gold", "translation_arrays"]

# data.name values with gold alignments.
ALIGNMENT_TASKS = ("copy", "reverse", "dates")
# Date field -> the part of the ISO output it fills (start, end) in "YYYY-MM-DD".
_FIELD_PART = {
    "yyyy": "year", "yy": "year", "m": "month", "mm": "month", "month": "month", "Month": "month",
    "mon": "month", "Mon": "month", "d": "day", "dd": "day", "dth": "day",
}
_PART_SPAN = {"year": (0, 4), "month": (5, 7), "day": (8, 10)}

Gold = list[tuple[frozenset[int], frozenset[int]]]  # per output token: (sure, possible)


def dates_gold(source: str, target: str) -> Gold:
  """(sure, possible) source character positions of each character of the ISO `target`."""
  date = datetime.date.fromisoformat(target)
  fields = synthetic._date_fields(date)  # pylint: disable=protected-access
  for pattern in synthetic.DATE_FORMATS.values():
    spans, pos = {}, 0
    for literal, name, _, _ in string.Formatter().parse(pattern):
      pos += len(literal)
      if name is not None:
        spans[name] = (pos, pos + len(fields[name]))
        pos += len(fields[name])
    if pattern.format(**fields) == source:
      break
  else:
    raise ValueError(f"{source!r} is no rendering of {target} in attnlab.data.synthetic."
                     f"DATE_FORMATS; dates_gold needs an example of the dates task")
  gold: Gold = [(frozenset(), frozenset())] * len(target)
  for name, (start, end) in spans.items():
    part = _FIELD_PART.get(name)
    if part is None:  # the weekday gives nothing to the output
      continue
    out_start, out_end = _PART_SPAN[part]
    possible = frozenset(range(start, end))
    digits = [j for j in range(start, end) if source[j].isdigit()]
    for k, i in enumerate(range(out_end - 1, out_start - 1, -1)):  # output digits right to left
      sure = frozenset([digits[-1 - k]]) if k < len(digits) else frozenset()
      gold[i] = (sure, possible)
  return gold


def gold_alignment(task: str, source: str | Sequence[Any], target: str | Sequence[Any]) -> Gold:
  """(sure, possible) source positions of each output token of one example of `task`.

  copy/reverse take the token sequences (or strings of one-character tokens); dates the texts.
  """
  if task not in ALIGNMENT_TASKS:
    raise ValueError(f"no gold alignment for task {task!r}; tasks with one: "
                     f"{', '.join(ALIGNMENT_TASKS)}")
  if task == "dates":
    return dates_gold(str(source), str(target))
  n = len(source)
  if len(target) != n:
    raise ValueError(f"{task}: source and target must have as many tokens, got {n} and "
                     f"{len(target)}")
  link = (lambda i: i) if task == "copy" else (lambda i: n - 1 - i)
  return [(frozenset([link(i)]), frozenset([link(i)])) for i in range(n)]


def alignment_counts(weights: Any, gold: Gold) -> dict[str, int]:
  """Counts of the argmax alignment of `weights` `[>= len(gold) rows, src_len]` against `gold`.

  Only rows with a possible link are scored. Returns scored (|A|), correct (|A ∩ P|),
  sure_hits (|A ∩ S|) and sure (|S|).
  """
  w = np.asarray(weights)
  if w.ndim != 2 or w.shape[0] < len(gold):
    raise ValueError(f"weights must be [rows >= {len(gold)}, src_len], got shape {w.shape}")
  counts = {"scored": 0, "correct": 0, "sure_hits": 0, "sure": 0}
  for i, (sure, possible) in enumerate(gold):
    counts["sure"] += len(sure)
    if not possible:
      continue
    j = int(np.argmax(w[i]))
    counts["scored"] += 1
    counts["correct"] += j in possible
    counts["sure_hits"] += j in sure
  return counts


def score_counts(counts: dict[str, int]) -> dict[str, float]:
  """accuracy = |A ∩ P| / |A| and AER = 1 - (|A ∩ S| + |A ∩ P|) / (|A| + |S|)."""
  a, s = counts["scored"], counts["sure"]
  return {"accuracy": counts["correct"] / a if a else float("nan"),
          "aer": 1.0 - (counts["sure_hits"] + counts["correct"]) / (a + s) if a + s
                 else float("nan"),
          "positions": a}


def translation_arrays(task, examples: Sequence[dict[str, str]]) -> dict[str, np.ndarray]:
  """Raw {"source", "target"} examples as one 0-padded batch in the task's training format."""
  src, src_len = capture_lib.pad_ids([task.encode_source(ex["source"]) for ex in examples])
  tgt, tgt_len = capture_lib.pad_ids([task.encode_target(ex["target"]) for ex in examples])
  return {"source": src, "target": tgt, "source_length": src_len, "target_length": tgt_len,
          "example_mask": np.ones((len(examples),), bool),
          "source_mask": np.arange(src.shape[1])[None] < src_len[:, None],
          "target_mask": np.arange(tgt.shape[1])[None] < tgt_len[:, None]}


def shift_gold(gold: Gold, shift: int, src_len: int) -> Gold:
  """`gold` with every source position moved by `shift`; links moved off the source (outside
  0..src_len-1) are dropped, so a row left without one is not scored."""
  def moved(links: frozenset[int]) -> frozenset[int]:
    return frozenset(j + shift for j in links if 0 <= j + shift < src_len)
  return [(moved(sure), moved(possible)) for sure, possible in gold]


def evaluate_alignment(run, *, num_examples: int = 200, split: str | None = None,
                       bins: Sequence[int] | None = None, shift: int = 0
                       ) -> dict[str, dict[str, Any]]:
  """Alignment accuracy and AER of every cross-attention layer of a translation run.

  Args:
    run: a loaded translation run (attnlab.analysis.load_run) on copy, reverse or dates.
    num_examples: how many examples of the held-out split to score (the first ones).
    split: the split (default config.data.eval_split).
    bins: upper edges of source-length bins (default config.data.length_bins; () = none).
    shift: score against the gold links moved this many source positions (module docstring).
  Returns:
    {layer path: {"all": {accuracy, aer, positions, examples}, "len_01_05": {...}, ...,
    "head_accuracy": [accuracy of each head's own argmax over all examples]}}.
  """
  if run.config.task != "translation":
    raise ValueError(f"alignment needs a translation run, got task {run.config.task!r}")
  name = run.config.data.name
  if name not in ALIGNMENT_TASKS:
    raise ValueError(f"no gold alignment for data.name={name!r}; tasks with one: "
                     f"{', '.join(ALIGNMENT_TASKS)}")
  task = run.task
  split = split or run.config.data.eval_split
  examples = task.examples(split)[:num_examples]
  if not examples:
    raise ValueError(f"split {split!r} has no examples")
  if name == "dates" and run.config.data.tokenizer != "char":
    raise ValueError("dates gold alignments are per character: the run needs data.tokenizer=char")
  arrays = translation_arrays(task, examples)
  maps = capture_lib.capture_batch(
      run, {k: arrays[k] for k in ("source", "source_length", "target", "target_length")})
  cross = {p: w for p, w in maps.items() if capture_lib.layer_info(run, p)[1] == "cross"}
  bin_list, low = [("all", 1, 10 ** 9)], 1
  for high in map(int, run.config.data.length_bins if bins is None else bins):
    bin_list.append((f"len_{low:02d}_{high:02d}", low, high))
    low = high + 1
  golds = []
  for ex, s_len in zip(examples, arrays["source_length"]):
    src, tgt = ex["source"], ex["target"]
    if name != "dates":  # copy/reverse: gold links between tokens, not characters
      src, tgt = (task.src_tok.split(task.prepare_text(src, "source")),
                  task.tgt_tok.split(task.prepare_text(tgt, "target")))
    golds.append(shift_gold(gold_alignment(name, src, tgt), shift, int(s_len)))
  report = {}
  for path, w in cross.items():  # [batch, heads, t, s]
    totals = {label: collections.Counter() for label, _, _ in bin_list}
    head_totals = [collections.Counter() for _ in range(w.shape[1])]
    for i, gold in enumerate(golds):
      s_len = int(arrays["source_length"][i])
      counts = alignment_counts(w[i].mean(axis=0)[:, :s_len], gold)
      for label, shortest, longest in bin_list:
        if shortest <= s_len <= longest:
          totals[label].update(counts, examples=1)
      for h, head_total in enumerate(head_totals):
        head_total.update(alignment_counts(w[i, h, :, :s_len], gold))
    report[path] = {label: {**score_counts(t), "examples": t["examples"]}
                    for label, t in totals.items() if t["examples"]}
    report[path]["head_accuracy"] = [score_counts(t)["accuracy"] for t in head_totals]
  return report
