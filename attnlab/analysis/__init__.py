"""Analysis of trained runs: reload a run, capture its attention, measure and view it.

  from attnlab import analysis
  run = analysis.load_run("runs/nw")                 # config, task, model, params of the latest checkpoint
  maps = analysis.attention_maps(run, queries, keys, values)   # {module path: weights} sown by the model
  records = analysis.read_metrics("runs/nw")         # metrics.jsonl as a list of dicts
  cap = analysis.capture_text(run, "9 october 1993")  # every layer's weights of one example
  rows = analysis.head_table(cap)                    # entropy, offsets, special mass per head
  report = analysis.evaluate_alignment(run)          # argmax alignment accuracy / AER (synthetic)
  result = analysis.head_ablation(run)               # the task's loss with each head removed
  logits, cache = analysis.run_with_cache(run, tokens, ["blocks.0.attn.pattern"])   # any family
  logits = analysis.run_with_hooks(run, tokens, [analysis.Intervention("blocks.1.attn.z", "zero")])
  grid = analysis.patch_sweep(run, clean, corrupted, metric, site="resid_pre")   # [layers, len]
  text = analysis.generate_with_hooks(run, prompt, [iv], num_tokens=50)   # edits at every step
  scores = analysis.detect_heads(run)                # previous-token, duplicate-token, induction
  layers = analysis.logit_lens(run, tokens)          # [layers + 1, batch, len, vocab]
  dla = analysis.logit_attribution(run, tokens)      # per component and head; sums to the logits
  grid = analysis.attribution_patch(run, clean, corrupted, metric, site="attn.z", over="head")
  w = analysis.head_weights(run); w.qk(1, 0); w.ov(0, 1)   # per-head QK and OV matrices
  comp = analysis.composition_scores(w, "k")        # [layers, heads, layers, heads] K-composition
  grid = analysis.path_patch(run, clean, corrupted, metric, receivers=[(1, 0)], receiver_input="q")
  sinks = analysis.sink_metrics(run)                # first-token weight, sink rate, sink mass
  scores = analysis.head_roles(weights, units, spans)   # Clark et al.: previous, next, [CLS], ...

Modules: runs (load_run, attention_maps), capture (Capture, capture, capture_text,
capture_batch), metrics (entropy, offsets, special-token mass, rollout, head_table), alignment
(gold alignments of copy/reverse/dates, evaluate_alignment), ablation (head_ablation,
plot_head_ablation), hooks (the hook-site table, run_with_cache, run_with_hooks, Intervention,
patch_sweep), detectors (previous-token, duplicate-token and induction scores), lens (logit
lens, direct logit attribution, attribution patching), circuits (QK/OV matrices, Q/K/V
composition scores and their random baseline), paths (path patching), sinks (attention-sink
metrics), roles (head roles after Clark et al. 2019: attention to the previous/next word,
[CLS], [SEP], punctuation against uniform attention, and from a pronoun to its antecedent, on
word-level weights), head_report (the per-head table of `attnlab inspect --heads` and the viewer).
"""

from attnlab.analysis.ablation import AblationResult, head_ablation, plot_head_ablation
from attnlab.analysis.alignment import evaluate_alignment, gold_alignment
from attnlab.analysis.capture import Capture, capture, capture_batch, capture_text
from attnlab.analysis.circuits import (HeadWeights, composition_scores, head_weights,
                                       random_baseline)
from attnlab.analysis.detectors import (chance_scores, detect_heads, duplicate_token_score,
                                        induction_score, previous_token_score,
                                        repeated_random_tokens)
from attnlab.analysis.hooks import (Intervention, generate_with_hooks, patch_sweep, run_with_cache,
                                    run_with_hooks)
from attnlab.analysis.lens import (LogitAttribution, attribution_patch, logit_attribution,
                                   logit_lens)
from attnlab.analysis.metrics import (attention_rollout, entropy, head_table, mean_abs_offset,
                                      mean_offset, normalized_entropy, special_token_mass)
from attnlab.analysis.roles import antecedent_scores, head_roles, uniform_roles, word_attention
from attnlab.analysis.sinks import SinkMetrics, first_token_score, sink_metrics, sink_rate
from attnlab.analysis.paths import path_patch
from attnlab.analysis.runs import Run, attention_maps, few_steps_warning, load_run, read_metrics

__all__ = ["AblationResult", "Capture", "HeadWeights", "Intervention", "LogitAttribution", "Run",
           "SinkMetrics", "composition_scores", "first_token_score", "head_weights", "path_patch",
           "random_baseline", "sink_metrics", "sink_rate",
           "attention_maps", "attention_rollout", "attribution_patch", "capture", "capture_batch", "capture_text", "chance_scores",
           "detect_heads", "duplicate_token_score", "entropy", "evaluate_alignment", "few_steps_warning", "generate_with_hooks",
           "gold_alignment", "head_ablation", "head_table", "induction_score", "load_run", "logit_attribution", "logit_lens",
           "mean_abs_offset", "mean_offset", "normalized_entropy", "patch_sweep",
           "plot_head_ablation", "previous_token_score", "read_metrics", "repeated_random_tokens",
           "run_with_cache", "run_with_hooks", "special_token_mass",
           "antecedent_scores", "head_roles", "uniform_roles", "word_attention"]
