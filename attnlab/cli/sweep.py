"""`attnlab sweep`: the cross product of config values, run and summarised (attnlab.sweep).

  attnlab sweep --config=configs/nadaraya_watson.py:runlocal=True --workdir=runs/sweep \
      --sweep=model.kernel=gaussian,learned --sweep=seed=0,1,2 [--parallel=2]
  attnlab sweep --sweep_file=configs/sweeps/nadaraya_watson_kernels.py --workdir=runs/nw_sweep
  attnlab sweep ... --list                          # index and name of every member
  attnlab sweep ... --member_index=$SLURM_ARRAY_TASK_ID   # in task i: run member i only
  attnlab sweep ... --summarize                     # afterwards: summary of the finished members

The flags are the arguments of attnlab.sweep.run; that module's docstring describes the sweep
directory, sweep files, parallel members and the summary.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from attnlab import rundir
from attnlab.cli import tool
from attnlab.sweep import expand
from attnlab.sweep import prepare
from attnlab.sweep import run
from attnlab.sweep import split_sweep_arg


def _define_flags(argv: Sequence[str]) -> flags.FlagValues:
  fv = tool.run_flags(
      argv, "Base config: configs/<family>.py[:key=value,...]; --config.<field>=<value> "
      "overrides apply to every member.", "Sweep directory; member i runs in DIR/<key=value,...>/.")
  flags.DEFINE_multi_string("sweep", [], "key=value1,value2,... (repeat for a cross product); key "
                            "may be a shared shortcut such as score or dataset.", flag_values=fv)
  flags.DEFINE_string("sweep_file", None, "A configs/sweeps/*.py file with get_sweep().",
                      flag_values=fv)
  flags.DEFINE_integer("parallel", 1, "Members to run at once (>1: as subprocesses).",
                       flag_values=fv)
  flags.DEFINE_string("member", None, "Internal: run the member whose config.json is in this "
                      "directory (used by --parallel).", flag_values=fv)
  flags.DEFINE_integer("member_index", None, "Run only member i (0-based, in --list order) and "
                       "write no summary: one cluster array task per member, e.g. "
                       "--member_index=$SLURM_ARRAY_TASK_ID.", flag_values=fv)
  flags.DEFINE_bool("list", False, "Print the index and name of every member and exit.",
                    flag_values=fv)
  flags.DEFINE_bool("summarize", False, "Run nothing; write the summary of the finished members "
                    "(after the array tasks are done).", flag_values=fv)
  return fv


def main(argv: Sequence[str] | None = None) -> int:
  """`attnlab sweep` / `python -m attnlab.cli.sweep`: returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  fv = _define_flags(argv)
  prog, message = tool.parse_tool(
      argv, "attnlab.cli.sweep", fv,
      lambda fv: None if fv.workdir or fv.member else "--workdir is required: the sweep directory")

  def body() -> int:
    if fv.member:
      from attnlab import train  # pylint: disable=g-import-not-at-top
      train.train_and_evaluate(rundir.read_config(fv.member), fv.member)
      return 0
    axes = dict(split_sweep_arg(text) for text in fv.sweep)  # typed by `prepare`
    if fv.list:
      members = expand(*prepare(fv.config, axes, sweep_file=fv.sweep_file), fv.workdir)
      for i, member in enumerate(members):
        print(f"{i}\t{member.name}")
      print(f"{len(members)} members: array task indices 0-{len(members) - 1}", file=sys.stderr)
      return 0
    result = run(fv.config, axes, workdir=fv.workdir, sweep_file=fv.sweep_file,
                 parallel=fv.parallel, member_index=fv.member_index, summarize_only=fv.summarize)
    return result.report(prog, summary=fv.member_index is None)
  return tool.launch(prog, message, body)


if __name__ == "__main__":
  sys.exit(main())
