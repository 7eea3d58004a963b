"""Sample text from a trained language model (a causal_lm run).

  attnlab generate --workdir=runs/gpt_nano --prompt="ROMEO:" --num_tokens=300 --temperature=0.8
  attnlab generate --workdir=runs/gpt_nano --prompt="ROMEO:" --temperature=0 (greedy)
  attnlab generate --workdir=runs/gpt_nano --top_k=10 --top_p=0.9 --seed=3 --step=1000
  attnlab generate --workdir=runs/gpt_add --prompt="12+345=" --temperature=0
  attnlab generate --workdir=runs/gpt_nano --prompt="ROMEO:" --prompt="O, be" (one batch)

Restores the run's checkpoint (latest by default) with attnlab.analysis.load_run, encodes the
prompt with the run's tokenizer, and samples with the KV cache (attnlab.models.gpt.generate).
Prints the prompt followed by exactly --num_tokens generated tokens (special tokens that the
training text never holds are never sampled; an addition answer that ends with <end> sooner is
named on stderr), with a warning first when the run trained for very few steps; several --prompt flags are sampled as one batch
(prompts of any lengths) and printed in order, a blank line between them. Characters (or words,
subword symbols) of a prompt outside the run's vocabulary are fed to the model as <unk>, with a
warning naming them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence

from absl import flags

from attnlab.cli import tool
from attnlab.errors import UserError

_LOG = logging.getLogger("attnlab.cli.generate")  # not __name__: it is __main__ under python -m


def _define_flags() -> flags.FlagValues:
  fv = tool.tool_flags("Run directory of a causal_lm run.", step=True)
  flags.DEFINE_multi_string("prompt", [], "Text to continue (default: the dataset's usual "
                            "prompt); give it several times to sample several texts as one batch.",
                            flag_values=fv)
  flags.DEFINE_integer("num_tokens", 300, "Tokens to generate.", flag_values=fv)
  flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.", flag_values=fv)
  flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens only (0: all).",
                       flag_values=fv)
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set with this probability "
                     "(1: all).", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "Sampling seed.", flag_values=fv)
  flags.DEFINE_bool("use_cache", True, "Use the KV cache (--nouse_cache runs a full forward pass "
                    "per token); left out: the cache when the run's attention mechanism supports "
                    "it.", flag_values=fv)
  flags.DEFINE_bool("timing", False, "Print tokens/s to stderr.", flag_values=fv)
  return fv


# The most tokens one call generates per prompt, and the most prompts in one batch: decoding keeps
# every token ([prompts, num_tokens]) and runs num_tokens steps (a prompt longer than the model's
# block_size is cut to its last block_size tokens, as the model reads it).
MAX_NEW_TOKENS = 100_000
MAX_PROMPTS = 256


def _check(fv: flags.FlagValues) -> str | None:
  if not fv.workdir:
    return "--workdir is required: the run directory of a causal_lm run (attnlab train ...)"
  if not 1 <= fv.num_tokens <= MAX_NEW_TOKENS:
    return f"--num_tokens must be between 1 and {MAX_NEW_TOKENS}, got {fv.num_tokens}"
  if len(fv.prompt) > MAX_PROMPTS:
    return f"at most {MAX_PROMPTS} --prompt flags are sampled as one batch, got {len(fv.prompt)}"
  if not fv.temperature >= 0:  # NaN too
    return f"--temperature must be >= 0 (0 = greedy), got {fv.temperature}"
  if fv.top_k < 0:
    return f"--top_k must be >= 0 (0: no top-k filter), got {fv.top_k}"
  if not 0.0 < fv.top_p <= 1.0:
    return f"--top_p must be in (0, 1], got {fv.top_p}"
  return tool.step_error(fv.step)


def generate_text(workdir: str, prompt: str = "", **options) -> tuple[str, str, float]:
  """(prompt used, generated text, seconds spent generating incl. compilation); `options` as
  for `generate_texts`."""
  prompts, texts, seconds = generate_texts(workdir, [prompt], **options)
  return prompts[0], texts[0], seconds


def generate_texts(workdir: str, prompts: Sequence[str], *, num_tokens: int = 300,
                   temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                   step: str | int = "latest", use_cache: bool | None = None,
                   warn: Callable[[str], None] | None = None
                   ) -> tuple[list[str], list[str], float]:
  """(prompts used, generated texts, seconds spent generating incl. compilation): the prompts
  (an empty one: the dataset's usual prompt) are continued as one batch.

  `warn` (default: a logged warning) gets the line naming a prompt's symbols that are not in the
  run's vocabulary, if any.
  """
  from attnlab.data import tokenizers  # pylint: disable=g-import-not-at-top
  from attnlab import analysis  # pylint: disable=g-import-not-at-top  (imports JAX)
  if not 1 <= num_tokens <= MAX_NEW_TOKENS or not 1 <= len(prompts) <= MAX_PROMPTS:
    raise UserError(f"generate takes 1 to {MAX_PROMPTS} prompts and 1 to {MAX_NEW_TOKENS} tokens; "
                    f"got {len(prompts)} prompts and num_tokens={num_tokens}")
  run = analysis.load_run(workdir, step)
  task = run.task
  if not hasattr(task, "sample_texts"):
    raise UserError(f"{workdir} is a {run.config.task!r} run; attnlab generate needs a causal_lm "
                    "run (configs/gpt.py)")
  prompts = [prompt or task.default_prompt for prompt in prompts]
  for i, prompt in enumerate(prompts):
    what = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
    message = tokenizers.unknown_warning(task.tokenizer, prompt, what)
    if message is not None:
      (warn or _LOG.warning)(message)
  few = analysis.few_steps_warning(run)
  if few is not None:
    (warn or _LOG.warning)(few)
  start = time.perf_counter()
  texts, counts = task.sample_rows(run.params, prompts, num_tokens=num_tokens,
                                   temperature=temperature, top_k=top_k or None,
                                   top_p=top_p if top_p < 1.0 else None, seed=seed,
                                   use_cache=use_cache)
  for i, count in enumerate(counts):
    if count < num_tokens:
      what = "the text" if len(prompts) == 1 else f"text {i + 1}"
      (warn or _LOG.warning)(f"{what} stopped after {count} of {num_tokens} tokens: the model "
                             f"wrote <end>, the end of an answer in this dataset")
  return prompts, texts, time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
  """`attnlab generate` / `python -m attnlab.cli.generate`: returns the exit status."""
  fv = _define_flags()
  prog, message = tool.parse_tool(argv, "attnlab.cli.generate", fv, _check)

  def body() -> None:
    prompts, texts, seconds = generate_texts(
        fv.workdir, fv.prompt or [""], num_tokens=fv.num_tokens, temperature=fv.temperature,
        top_k=fv.top_k, top_p=fv.top_p, seed=fv.seed, step=fv.step,
        use_cache=fv.use_cache if fv["use_cache"].present else None,
        warn=lambda message: print(f"{prog}: warning: {message}", file=sys.stderr))
    print("\n\n".join(prompt + text for prompt, text in zip(prompts, texts)))
    if fv.timing:
      print(f"{fv.num_tokens} tokens in {seconds:.2f} s (including compilation)", file=sys.stderr)
  return tool.launch(prog, message, body)


if __name__ == "__main__":
  sys.exit(main())
