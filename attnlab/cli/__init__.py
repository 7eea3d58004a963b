"""The `attnlab` console script: one sub-command per tool, found by name.

Each sub-command lives in its own module with a `main(argv)` function; this
file only maps names to modules, so adding a tool is one line here.
"""

import importlib
import logging
import os
import sys

# sub-command -> (module, one-line help)
COMMANDS = {
    "train": ("attnlab.cli.train", "train or resume a run from a config"),
    "sweep": ("attnlab.cli.sweep", "run the cross product of config values"),
    "inspect": ("attnlab.cli.inspect_run",
                "print a run's config, last metrics and checkpoints (--heads: one line per head)"),
    "generate": ("attnlab.cli.generate", "sample text from a trained language model"),
    "translate": ("attnlab.cli.translate",
                  "translate a sentence with a trained model and plot alignment"),
    "data": ("attnlab.cli.data", "prepare or show a dataset"),
    "import-hf": ("attnlab.cli.import_hf",
                  "import (or export) a Hugging Face GPT-2/BERT checkpoint"),
    "view": ("attnlab.cli.view", "write an interactive HTML page of a run's attention on a text"),
    "plot": ("attnlab.cli.plot", "draw a figure that needs no run (positions: the sinusoidal table)"),
}


def _usage() -> str:
  lines = ["usage: attnlab <command> [flags]", "", "commands:"]
  lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
  return "\n".join(lines)


def main(argv=None) -> int:
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(_usage())
    return 0 if len(argv) >= 2 else 2
  name = argv[1]
  if name not in COMMANDS:
    print(f"attnlab: unknown command {name!r}; valid commands: {', '.join(COMMANDS)}",
          file=sys.stderr)
    return 2
  module = importlib.import_module(COMMANDS[name][0])
  # Each tool sees argv as if it had been started on its own: [prog, flags...].
  return module.main([f"attnlab {name}"] + argv[2:]) or 0


def console() -> None:
  """The `attnlab` console script and `python -m attnlab.cli`: `main`, then the process ends
  with its exit status without the interpreter's teardown. Everything a command writes is
  closed by then (checkpoints, metrics, TensorBoard, figures); what the teardown would add is
  JAX's exit hook, which clears its caches and backends under four garbage collections: 0.5 s
  at the end of every `attnlab train` of the nano GPT. A run of several processes (JAX's
  distributed system) leaves through the usual exit, whose hook also shuts that system down."""
  status = main()
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  jax = sys.modules.get("jax")
  if jax is not None and jax.distributed.is_initialized():
    sys.exit(status)
  os._exit(status)  # pylint: disable=protected-access
