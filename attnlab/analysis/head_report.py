"""One table of every head of a GPT run: detector scores, sink metrics, strongest composition.

  from attnlab.analysis import head_report
  report = head_report.head_report(run)        # a loaded GPT run, or (model, params)
  print(head_report.format_report(report))     # what `attnlab inspect --workdir=RUN --heads` prints
  rows = head_report.view_columns(run, capture, rows)   # the viewer's per-head table, extended

Columns: the previous-token, duplicate-token and induction scores (attnlab.analysis.detectors),
the mean weight on the first token and, for normalizer=softmax_sink, the learned sink's mass
(attnlab.analysis.sinks), all on the same random tokens repeated twice; and each head's largest
Q-, K- or V-composition score as a receiver (attnlab.analysis.circuits: kind, sender head,
score), next to the score of Gaussian weights of the same shapes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnlab.analysis import circuits
from attnlab.analysis import detectors
from attnlab.analysis import hooks as hooks_lib
from attnlab.analysis import sinks

__all__ = ["HeadReport", "format_report", "head_report", "view_columns"]

# Short column names of the detector scores.
_DETECTORS = (("previous_token", "prev"), ("duplicate_token", "dup"), ("induction", "induct"))


@dataclasses.dataclass(frozen=True)
class HeadReport:
  """Per-head numbers of one run (numpy `[layers, heads]` unless noted)."""
  # {"previous_token", "duplicate_token", "induction"}.
  detectors: dict[str, np.ndarray]
  sinks: sinks.SinkMetrics
  # {"q", "k", "v": [layers, heads, layers, heads]} (sender, receiver).
  compositions: dict[str, np.ndarray]
  # The random-matrix baseline of each kind of composition.
  baseline: dict[str, float]
  # What the weight-level scores leave out (circuits.model_notes).
  notes: tuple[str, ...]
  # The random tokens the pattern-level columns ran on: `batch` rows of seq_len ids, twice.
  seq_len: int
  batch: int
  seed: int

  def rows(self) -> list[dict[str, Any]]:
    """One dict per head: layer, head, the detector scores, first_token (and sink_mass), the
    strongest composition as a receiver (top_composition "Q 0.1", top_score)."""
    layers, heads = self.sinks.first_token.shape
    out = []
    for l in range(layers):
      for h in range(heads):
        row: dict[str, Any] = {"layer": l, "head": h}
        row.update({name: float(self.detectors[name][l, h]) for name, _ in _DETECTORS})
        row["first_token"] = float(self.sinks.first_token[l, h])
        if self.sinks.sink_mass is not None:
          row["sink_mass"] = float(self.sinks.sink_mass[l, h])
        top = circuits.top_compositions(self.compositions, l, h)
        row["top_composition"] = f"{top[0][0].upper()} {top[0][1]}.{top[0][2]}" if top else None
        row["top_score"] = top[0][3] if top else None
        out.append(row)
    return out


def head_report(run: Any, *, seq_len: int | None = None, batch: int = 8,
                seed: int = 0) -> HeadReport:
  """The per-head numbers of a GPT run (module docstring): one forward pass of `batch` random
  sequences of `seq_len` ids repeated twice (default: half the block size, at most 50) for the
  detectors and sinks, and the composition scores of the weights."""
  model, _ = hooks_lib._unpack(run)  # pylint: disable=protected-access
  hooks_lib.sites(model)  # ValueError for a family without hook sites
  seq_len = seq_len or min(model.block_size // 2, 50)
  tokens = detectors.repeated_random_tokens(model.vocab_size, seq_len, batch, seed)
  scores = detectors.detect_heads(run, tokens=tokens)
  sink = sinks.sink_metrics(run, tokens)
  weights = circuits.head_weights(run)
  comps = {kind: circuits.composition_scores(weights, kind) for kind in circuits.COMPOSITIONS}
  base = {kind: circuits.random_baseline(weights.d_model, weights.head_dim, kind)
          for kind in circuits.COMPOSITIONS}
  return HeadReport(detectors=scores, sinks=sink, compositions=comps, baseline=base,
                    notes=weights.notes, seq_len=seq_len, batch=batch, seed=seed)


def _cell(value: Any, width: int) -> str:
  if value is None:
    return "-".rjust(width)
  if isinstance(value, float):
    return f"{value:.3f}".rjust(width)
  return str(value).rjust(width)


def format_report(report: HeadReport) -> str:
  """The text table of `report`: a header saying what the numbers ran on, one line per head."""
  rows = report.rows()
  s = report.sinks
  n_heads = s.first_token.size
  over = int(np.sum(s.first_token > s.threshold))
  lines = [f"detectors and sinks: {report.batch} random sequences of {report.seq_len} ids "
           f"repeated twice (seed {report.seed})",
           f"sink rate (Gu et al. 2024): {s.rate:.3f} = {over} of {n_heads} heads with first > "
           f"{s.threshold:g} (normalizer {s.normalizer})",
           "composition baseline (Gaussian weights of these shapes): "
           + ", ".join(f"{k.upper()} {v:.3f}" for k, v in report.baseline.items()),
           "columns: prev, dup, induct = previous-token, duplicate-token, induction scores; first "
           "= mean weight of the queries 1.. on the first token"
           + ("; sink = weight on the learned sink" if s.sink_mass is not None else ""),
           "top comp = the largest Q/K/V composition into this head (kind, sender layer.head), "
           "score = its score"]
  lines += [f"note: {note}" for note in report.notes + ((s.note,) if s.note else ())]
  columns = [("head", "head", 6)] + [(name, short, 7) for name, short in _DETECTORS]
  columns.append(("first_token", "first", 7))
  if s.sink_mass is not None:
    columns.append(("sink_mass", "sink", 7))
  columns += [("top_composition", "top comp", 9), ("top_score", "score", 7)]
  lines.append(" ".join(short.rjust(width) for _, short, width in columns))
  for row in rows:
    row = dict(row, head=f"{row['layer']}.{row['head']}")
    lines.append(" ".join(_cell(row[name], width) for name, _, width in columns))
  return "\n".join(lines)


_GPT_LAYER = re.compile(r"^block_(\d+)/self_attention$")


def view_columns(run: Any, capture: Any, rows: Sequence[Mapping[str, Any]]
                 ) -> list[dict[str, Any]]:
  """The viewer's per-head rows (metrics.head_table(capture)) with detector and sink columns:
  first_token (and sink_mass under softmax_sink) of the viewed example, for every self-attention
  layer of any run; prev_token, dup_token and induction (on random tokens, as head_report) for
  a GPT run. Other rows get None in those columns."""
  model = getattr(run, "model", None)
  per_layer: dict[str, dict[str, np.ndarray]] = {}
  softmax_sink = getattr(getattr(model, "attention", None), "normalizer", "") == "softmax_sink"
  for path, weights in capture.weights.items():
    if capture.kind.get(path) in ("self", "causal"):
      cols = {"first_token": sinks.first_token_score(weights)}
      if softmax_sink:
        cols["sink_mass"] = sinks.sink_mass(weights)
      per_layer[path] = cols
  scores = None
  try:
    is_gpt = hooks_lib.family(model) == "gpt"  # the detectors read a causal LM
  except (ValueError, TypeError):
    is_gpt = False
  if is_gpt:
    scores = detectors.detect_heads(run)
  names = ["first_token"] + (["sink_mass"] if softmax_sink else [])
  if scores is not None:
    names += ["prev_token", "dup_token", "induction"]
  out = []
  for row in rows:
    row = dict(row)
    path, head = row.get("layer"), row.get("head")
    values = {name: None for name in names}
    for name, column in per_layer.get(path, {}).items():
      values[name] = float(column[head])
    match = _GPT_LAYER.match(str(path))
    if scores is not None and match:
      layer = int(match.group(1))
      for name, key in (("prev_token", "previous_token"), ("dup_token", "duplicate_token"),
                        ("induction", "induction")):
        values[name] = float(scores[key][layer, head])
    row.update(values)
    out.append(row)
  return out
