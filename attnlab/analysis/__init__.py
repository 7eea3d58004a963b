"""Analysis of trained runs: reload a run, capture its attention, measure and view it.

  from attnlab import analysis
  run = analysis.load_run("runs/nw")                 # config, task, model, params of the latest checkpoint
  maps = analysis.attention_maps(run, queries, keys, values)   # {module path: weights} sown by the model
  records = analysis.read_metrics("runs/nw")         # metrics.jsonl as a list of dicts

Modules: runs (load_run, attention_maps).
"""

from attnlab.analysis.runs import Run, attention_maps, load_run, read_metrics

__all__ = ["Run", "attention_maps", "load_run", "read_metrics"]
