"""Print a run's config, last metrics and checkpoint steps.

  attnlab inspect --workdir=runs/nw            config, last metrics per split, checkpoint steps
  attnlab inspect --workdir=runs/nw --step=50  also restores checkpoint 50 and lists its parameters
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence

from absl import flags

from attnlab import checkpoint
from attnlab import config_utils
from attnlab import main as main_lib


def _define_flags() -> flags.FlagValues:
  flag_values = flags.FlagValues()
  flags.DEFINE_string("workdir", None, "Run directory to inspect.", flag_values=flag_values)
  flags.DEFINE_integer("step", None, "Also restore this checkpoint and summarise its parameters.",
                       flag_values=flag_values)
  return flag_values


def _checkpoint_steps(workdir: pathlib.Path) -> list[int]:
  """Finished checkpoint steps, read from the directory names (no JAX needed)."""
  directory = workdir / checkpoint.CHECKPOINT_DIR
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def _format_record(record: dict) -> str:
  values = [f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
            if k not in ("step", "split", "wall_time")]
  return ", ".join(values)


def describe(workdir: str | pathlib.Path, step: int | None = None) -> str:
  """The text `attnlab inspect` prints."""
  workdir = pathlib.Path(workdir).absolute()
  config = checkpoint.read_config(workdir)
  lines = [f"run: {workdir}", "config:"]
  lines += [f"  {key} = {value!r}" for key, value in sorted(config_utils.flatten(config).items())]
  records = checkpoint.read_metrics(workdir)
  last = checkpoint.last_records(records)
  lines.append(f"metrics ({len(records)} records in {checkpoint.METRICS_FILE}):")
  if not last:
    lines.append("  none yet")
  for split, record in sorted(last.items()):
    lines.append(f"  {split} @ step {record['step']}: {_format_record(record)}")
  steps = _checkpoint_steps(workdir)
  complete = checkpoint.is_complete(workdir, config.num_train_steps)
  lines.append(f"checkpoints: {', '.join(map(str, steps)) or 'none'} "
               f"(of {config.num_train_steps} steps; {'complete' if complete else 'not complete'})")
  if step is not None:
    from attnlab import analysis  # pylint: disable=g-import-not-at-top  (imports JAX)
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    run = analysis.load_run(workdir, step)
    at_step = [r for r in records if r["step"] == step]
    for record in at_step:
      lines.append(f"metrics @ step {step} ({record['split']}): {_format_record(record)}")
    lines.append(f"parameters @ step {run.step}:")
    leaves = jax.tree_util.tree_flatten_with_path(run.params)[0]
    for path, leaf in leaves:
      array = np.asarray(leaf)
      lines.append(f"  {jax.tree_util.keystr(path)}: {array.dtype}{list(array.shape)} "
                   f"mean={array.mean():.5g} std={array.std():.5g}")
    if not leaves:
      lines.append("  (none: the model has no trainable parameters)")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """`attnlab inspect` / `python -m attnlab.inspect_run`: returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  prog = main_lib.prog_name(argv, "attnlab.inspect_run")
  flag_values = _define_flags()
  message = main_lib.parse_flags(flag_values, argv)
  if message is None and not flag_values.workdir:
    message = "--workdir is required: the run directory to inspect"
  if message is not None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return main_lib.USAGE_ERROR
  main_lib.setup_logging()

  def body() -> None:
    print(describe(flag_values.workdir, flag_values.step))
  return main_lib.run_tool(prog, body)


if __name__ == "__main__":
  sys.exit(main())
