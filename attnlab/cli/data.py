"""`attnlab data`: prepare a dataset or show a few of its examples and its split sizes.

  attnlab data list
  attnlab data prepare tiny_shakespeare --manual_dir=../shared/data/tinyshakespeare
  attnlab data prepare sst2 --data_dir=/tmp/tfds --nodownload --force
  attnlab data show anki_mar_eng --split=validation --examples=5
  attnlab data show dates --num_examples=100 --seed=1
  attnlab data show listops --config=paper --split=test

Bad input prints one line to stderr and returns 2 (a file that cannot be read or written: 1).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from attnlab.data import builders, dataset_names, synthetic
from attnlab.errors import DataError

# Longest string shown for one field of an example.
_MAX_SHOWN_CHARS = 160


class _UsageError(Exception):
  """A command-line mistake (reported in one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):

  def error(self, message: str):  # One line instead of usage + message + SystemExit.
    raise _UsageError(f"{self.prog}: {message} (see --help)")


def _parser(prog: str) -> argparse.ArgumentParser:
  parser = _Parser(prog=prog, description="Prepare or show a dataset.")
  sub = parser.add_subparsers(dest="command", metavar="{list,prepare,show}", parser_class=_Parser)
  sub.add_parser("list", help="list the dataset names")
  for command, help_ in (("prepare", "prepare a real dataset (TFDS, array_record) and show it"),
                         ("show", "print a few examples and the split sizes")):
    p = sub.add_parser(command, help=help_)
    p.add_argument("name", help=f"one of: {', '.join(dataset_names())}")
    p.add_argument("--data_dir", default=None,
                   help="TFDS data dir for prepared datasets (default: $TFDS_DATA_DIR)")
    p.add_argument("--manual_dir", default=None,
                   help="folder holding a local copy of the raw files")
    p.add_argument("--nodownload", action="store_true",
                   help="never download; fail unless a local copy is found")
    p.add_argument("--split", default=None, help="split to show examples of (default: the first)")
    p.add_argument("--config", default=None,
                   help="builder config of a real dataset, e.g. the size of listops, pathfinder "
                        "(runlocal, cpu, paper) or imdb_bytes (full, runlocal); default: its first")
    p.add_argument("--examples", type=int, default=3, help="how many examples to print")
    p.add_argument("--num_examples", type=int, default=1000,
                   help="synthetic tasks: examples per split")
    p.add_argument("--seed", type=int, default=0, help="synthetic tasks: seed")
    if command == "prepare":
      p.add_argument("--force", action="store_true",
                     help="re-read the raw files even if the dataset is already prepared")
  return parser


def _short(value: Any) -> Any:
  if isinstance(value, str) and len(value) > _MAX_SHOWN_CHARS:
    return f"{value[:_MAX_SHOWN_CHARS]}... [{len(value):,} chars]"
  return value


def _print_examples(split: str, examples: Sequence[dict], count: int) -> None:
  for i in range(min(count, len(examples))):
    print(f"{split}[{i}]: {({k: _short(v) for k, v in examples[i].items()})}")


def _show_real(args: argparse.Namespace, prepare: bool) -> None:
  cls = builders.builder_class(args.name)
  split = args.split or cls.SPLITS[0]
  if split not in cls.SPLITS:
    raise DataError(f"{args.name}: unknown split {split!r}; valid splits: {', '.join(cls.SPLITS)}")
  builder = builders.prepare(args.name, data_dir=args.data_dir, manual_dir=args.manual_dir,
                             download=not args.nodownload, force=prepare and args.force,
                             config=args.config)
  info = builder.info
  metadata = dict(info.metadata or {})
  print(f"{args.name}: prepared in {builder.data_dir} (raw files from "
        f"{metadata.get('origin', 'unknown')})")
  sizes = " ".join(f"{s}={info.splits[s].num_examples:,}" for s in cls.SPLITS)
  print(f"splits: {sizes}")
  for key, value in metadata.items():
    if key != "origin":
      print(f"{key}: {value}")
  examples = builders.load_split(args.name, split, data_dir=args.data_dir,
                                 manual_dir=args.manual_dir, download=not args.nodownload,
                                 config=args.config)
  _print_examples(split, examples, args.examples)


def _show_synthetic(args: argparse.Namespace) -> None:
  split = args.split or synthetic.SPLITS[0]
  examples = synthetic.get_synthetic(args.name, split, num_examples=args.num_examples,
                                     seed=args.seed)
  print(f"{args.name}: synthetic, nothing to prepare (seed {args.seed})")
  print("splits: " + " ".join(f"{s}={args.num_examples:,}" for s in synthetic.SPLITS))
  _print_examples(split, examples, args.examples)


def _run(args: argparse.Namespace) -> None:
  if args.command == "list":
    print("real datasets: " + ", ".join(builders.BUILDERS))
    print("synthetic tasks: " + ", ".join(synthetic.SYNTHETIC))
    return
  if args.examples < 0:
    raise _UsageError(f"--examples must be >= 0, got {args.examples}")
  if args.name in synthetic.SYNTHETIC:
    if args.manual_dir or args.data_dir:
      raise _UsageError(f"{args.name} is synthetic: it reads no files (drop --manual_dir and "
                        f"--data_dir)")
    _show_synthetic(args)
  elif args.name in builders.BUILDERS:
    _show_real(args, prepare=args.command == "prepare")
  else:
    raise DataError(f"unknown dataset {args.name!r}; valid names: {', '.join(dataset_names())}")


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `attnlab data ...`; argv = [prog, command, ...]. Returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  prog = argv[0] if argv else "attnlab data"
  try:
    try:
      args = _parser(prog).parse_args(argv[1:])
    except SystemExit as e:  # --help printed its text.
      return int(e.code or 0)
    if args.command is None:
      raise _UsageError(f"{prog}: give a command: list, prepare or show (see --help)")
    if args.command != "list":
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
      tfds.disable_progress_bar()
    _run(args)
  except _UsageError as e:  # the parser's messages start with its prog; _run's get this one's
    message = str(e)
    print(message if message.startswith(prog) else f"{prog}: error: {message}", file=sys.stderr)
    return 2
  except (DataError, OSError) as e:  # bad input exits 2 like the other tools; I/O failures 1
    print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2 if isinstance(e, DataError) else 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
