"""Print a run's config, last metrics and checkpoint steps, and check the checkpoints.

  attnlab inspect --workdir=runs/nw            config, last metrics per split, checkpoint steps
  attnlab inspect --workdir=runs/nw --step=50  also restores checkpoint 50 and lists its parameters
  attnlab inspect --workdir=runs/nw --step=latest   the same for the newest checkpoint
  attnlab inspect --workdir=runs/nw --verify   also restores every checkpoint into the model
  attnlab inspect --workdir=runs/gpt --heads   also one line per head of a GPT run (the newest
                                               checkpoint, or --step): detector scores, sink
                                               metrics, strongest composition
                                               (attnlab.analysis.head_report)

Every listed checkpoint is checked: it reads back whole, every array as orbax stored it
(checkpoint.Checkpointer.check); `--verify` restores each one into the model as a resumed run
would. A bad checkpoint is marked in the list ("20 (damaged)"), described below it, and the command
exits with status 1 after one line on stderr naming it and the newest good checkpoint (the one a
resumed run starts from).
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence

from absl import flags

from attnlab import checkpoint
from attnlab import config_utils
from attnlab.cli import tool
from attnlab import rundir
from attnlab.errors import DamagedCheckpoints
from attnlab.errors import UserError


def _define_flags() -> flags.FlagValues:
  flag_values = tool.tool_flags("Run directory to inspect.")
  flags.DEFINE_string("step", None, "Also restore this checkpoint (a step number, or 'latest') "
                      "and summarise its parameters.", flag_values=flag_values)
  flags.DEFINE_bool("verify", False, "Restore every checkpoint into the model (slower: builds the "
                    "task), beyond checking that its files are complete and readable.",
                    flag_values=flag_values)
  flags.DEFINE_bool("heads", False, "Also print one line per attention head of a GPT run "
                    "(--step's checkpoint, else the newest): previous-token, duplicate-token and "
                    "induction scores, first-token (sink) weight, strongest composition.",
                    flag_values=flag_values)
  return flag_values


def check_checkpoints(workdir: pathlib.Path, config, steps: list[int],
                      verify: bool = False) -> dict[int, str]:
  """{step: what is wrong} for the damaged checkpoints among `steps` (empty: all good)."""
  if not steps:
    return {}
  bad = {}
  with checkpoint.Checkpointer(workdir / checkpoint.CHECKPOINT_DIR, read_only=True) as ckpt:
    for step in steps:
      problem = ckpt.check(step)
      if problem is not None:
        bad[step] = problem
    good = [step for step in steps if step not in bad]
    if verify and good:
      from attnlab import state  # pylint: disable=g-import-not-at-top  (imports JAX)
      from attnlab import tasks  # pylint: disable=g-import-not-at-top
      abstract = state.restore_target(tasks.build_task(config))
      for step in good:
        try:
          ckpt.restore(step, abstract)
        except checkpoint.CheckpointError as e:
          bad[step] = str(e)
  return bad


def _format_record(record: dict) -> str:
  values = [f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
            if k not in ("step", "split", "wall_time")]
  return ", ".join(values)


def describe(workdir: str | pathlib.Path, step: int | str | None = None,
             verify: bool = False, heads: bool = False) -> str:
  """The text `attnlab inspect` prints.

  Raises:
    DamagedCheckpoints: a checkpoint is damaged (its `report` is the text, with the bad ones marked).
    UserError: `heads` for a run that is not a GPT.
  """
  workdir = pathlib.Path(tool.resolve_path(workdir))
  config = rundir.read_config(workdir)
  lines = [f"run: {workdir}", "config:"]
  lines += [f"  {key} = {value!r}" for key, value in sorted(config_utils.flatten(config).items())]
  # Bad lines are listed here and left out (the report goes on from the other records).
  records, problems = rundir.scan_metrics(workdir)
  last = rundir.last_records(records)
  lines.append(f"metrics ({len(records)} records in {rundir.METRICS_FILE}):")
  if not last:
    lines.append("  none yet")
  for split, record in sorted(last.items()):
    lines.append(f"  {split} @ step {record['step']}: {_format_record(record)}")
  lines += [f"  left out: {problem}" for problem in problems]
  steps = checkpoint.finished_steps(workdir)
  bad = check_checkpoints(workdir, config, steps, verify)
  complete = rundir.is_complete(workdir, config.num_train_steps, records)
  listed = [f"{s} (damaged)" if s in bad else str(s) for s in steps]
  stop = rundir.early_stop(records)
  status = (f"stopped early at step {stop['step']}; the result is the best evaluation's "
            f"checkpoint, step {stop['best_step']}") if stop else (
                "complete" if complete else "not complete")
  lines.append(f"checkpoints: {', '.join(listed) or 'none'} "
               f"(of {config.num_train_steps} steps; {status})")
  if steps and not bad:
    lines.append(f"  all {'restored into the model' if verify else 'complete and readable'}")
  for bad_step, problem in sorted(bad.items()):
    lines.append(f"  checkpoint {bad_step} is damaged: {problem}")
  if step is not None:
    from attnlab import analysis  # pylint: disable=g-import-not-at-top  (imports JAX)
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    run = analysis.load_run(workdir, step)
    at_step = [r for r in records if r["step"] == run.step]
    for record in at_step:
      lines.append(f"metrics @ step {run.step} ({record['split']}): {_format_record(record)}")
    lines.append(f"parameters @ step {run.step}:")
    leaves = jax.tree_util.tree_flatten_with_path(run.params)[0]
    for path, leaf in leaves:
      array = np.asarray(leaf)
      lines.append(f"  {jax.tree_util.keystr(path)}: {array.dtype}{list(array.shape)} "
                   f"mean={array.mean():.5g} std={array.std():.5g}")
    if not leaves:
      lines.append("  (none: the model has no trainable parameters)")
  if heads and not bad:
    lines.append(_heads(workdir, "latest" if step is None else step))
  if bad:
    good = [s for s in steps if s not in bad]
    newest = (f"the newest good checkpoint is step {good[-1]} (a resumed run starts from it)"
              if good else "no checkpoint is good (a resumed run starts from step 0)")
    names = ", ".join(map(str, sorted(bad)))
    raise DamagedCheckpoints(
        f"checkpoint{'s' if len(bad) > 1 else ''} {names} of {workdir} "
        f"{'are' if len(bad) > 1 else 'is'} damaged ({bad[max(bad)]}); {newest}",
        "\n".join(lines))
  return "\n".join(lines)


def _heads(workdir: pathlib.Path, step: int | str) -> str:
  """The per-head table of checkpoint `step` of a GPT run (analysis.head_report)."""
  # pylint: disable=g-import-not-at-top  (these import JAX)
  from attnlab import analysis
  from attnlab.analysis import head_report
  from attnlab.analysis import hooks
  # pylint: enable=g-import-not-at-top
  run = analysis.load_run(workdir, step)
  try:
    hooks.sites(run.model)
  except (ValueError, TypeError):
    raise UserError(f"--heads needs a GPT (causal_lm) run; {workdir} is a {run.config.task!r} run "
                    "(hook sites are declared for the GPT family only)") from None
  report = head_report.head_report(run)
  text = head_report.format_report(report)
  return f"heads @ step {run.step}:\n" + "\n".join("  " + line for line in text.splitlines())


def _check(fv: flags.FlagValues) -> str | None:
  if not fv.workdir:
    return "--workdir is required: the run directory to inspect"
  return None if fv.step is None else tool.step_error(fv.step)


def main(argv: Sequence[str] | None = None) -> int:
  """`attnlab inspect` / `python -m attnlab.cli.inspect_run`: returns the exit status."""
  flag_values = _define_flags()
  prog, message = tool.parse_tool(argv, "attnlab.cli.inspect_run", flag_values, _check)

  def body() -> int:
    step = flag_values.step
    try:
      print(describe(flag_values.workdir, int(step) if step and step.isdigit() else step,
                     flag_values.verify, flag_values.heads))
    except DamagedCheckpoints as e:
      print(e.report)
      print(f"{prog}: error: {e}", file=sys.stderr)
      return e.exit_code
    return 0
  return tool.launch(prog, message, body)


if __name__ == "__main__":
  sys.exit(main())
