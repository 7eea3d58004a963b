"""Turn a local Hugging Face GPT-2 or BERT checkpoint folder into an attnlab run directory.

  attnlab import-hf path/to/gpt2 --workdir=runs/gpt2
  attnlab generate --workdir=runs/gpt2 --prompt="Hello" --num_tokens=20 --temperature=0
  attnlab import-hf path/to/bert --workdir=runs/bert_hf
  attnlab train --config=configs/bert.py:mode=finetune,pretrained=runs/bert_hf --workdir=runs/ft
  attnlab import-hf runs/gpt2 --export_to=out/gpt2   (the reverse: a run -> config.json +
                                                      model.safetensors for transformers)

The folder holds config.json (model_type gpt2 or bert) and model.safetensors or
pytorch_model.bin (read without torch), and optionally the tokenizer files, which are copied
into the run (see attnlab.interop.hf). Nothing is downloaded.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from attnlab.cli import tool


def _define_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  flags.DEFINE_string("workdir", None, "Run directory to create from the checkpoint.",
                      flag_values=fv)
  flags.DEFINE_bool("overwrite", False, "Replace a run already in --workdir.", flag_values=fv)
  flags.DEFINE_string("export_to", None, "Instead of importing: write the run directory given "
                      "as PATH as a Hugging Face checkpoint into this folder.", flag_values=fv)
  return fv


def main(argv: Sequence[str] | None = None) -> int:
  """`attnlab import-hf` / `python -m attnlab.cli.import_hf`: returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  prog = tool.prog_name(argv, "attnlab.cli.import_hf")
  fv = _define_flags()
  paths = [a for a in argv[1:] if not a.startswith("-")]
  message = tool.parse_flags(fv, [argv[0]] + [a for a in argv[1:] if a.startswith("-")])
  if message is None and len(paths) != 1:
    message = ("give one PATH: the checkpoint folder (config.json + model.safetensors or "
               "pytorch_model.bin), e.g. attnlab import-hf path/to/gpt2 --workdir=runs/gpt2")
  if message is None and not fv.workdir and not fv.export_to:
    message = "--workdir is required: the run directory to create"

  def body() -> None:
    from attnlab.interop import hf  # pylint: disable=g-import-not-at-top  (imports JAX)
    if fv.export_to:
      out = hf.export(paths[0], fv.export_to)
      print(f"exported {paths[0]} to {out} (config.json, model.safetensors)")
      return
    workdir = hf.import_checkpoint(paths[0], fv.workdir, overwrite=fv.overwrite)
    print(f"imported {paths[0]} into {workdir}")
  return tool.launch(prog, message, body)


if __name__ == "__main__":
  sys.exit(main())
