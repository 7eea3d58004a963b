"""Run the cross product of config values and summarise it (mean ± std over seeds).

  attnlab sweep --config=configs/nadaraya_watson.py:runlocal=True --workdir=runs/sweep \
      --sweep=model.kernel=gaussian,learned --sweep=seed=0,1,2 [--parallel=2]
  attnlab sweep --sweep_file=configs/sweeps/nadaraya_watson_kernels.py --workdir=runs/nw_sweep

From Python (the experiments do this; the command line, attnlab/cli/sweep.py, is a thin layer
over it):

  result = sweep.run("configs/nadaraya_watson.py:runlocal=True", {"model.kernel": ["gaussian",
                     "learned"]}, workdir="runs/sweep", seeds=[0, 1, 2])
  result.summary_md.read_text(), result.failed, result.summary()

Each member runs in DIR/<key=value,...>/ (an ordinary run directory: resumable, inspectable,
loadable with attnlab.analysis.load_run; no two members share one, and each is locked while it
trains, as DIR is while the sweep runs). Members that already finished are skipped, so re-running
the command completes an interrupted sweep. At the end DIR/summary.csv and DIR/summary.md hold one
row per setting with the final metrics as mean ± std (sample std, ddof=1) over the `seed` values.

An axis is named by its config key or, as in the config arg, by a shared shortcut of it
(config_utils.SHORTCUTS: `--sweep=score=dot,cosine` is model.attention.score in a GPT config,
in DIR/model.attention.score=dot,...).
A sweep file (configs/sweeps/*.py) defines `get_sweep()` returning {"config": "path.py[:args]"
(relative to the sweep file), "axes": {key: [values]}}; --config and --sweep flags add to it.
With --parallel=N the members run as N concurrent subprocesses (logs in each member's log.txt);
with the default N=1 they run one after another in this process.

A member with `num_seeds=N` (N replicas vmapped in one run, see attnlab/train.py) counts as its N
seeds in the summary. On a cluster, one array task per member:
  attnlab sweep ... --list                          # index and name of every member
  attnlab sweep ... --member_index=$SLURM_ARRAY_TASK_ID   # in task i: run member i only
  attnlab sweep ... --summarize                     # afterwards: summary of the finished members
"""

from __future__ import annotations

import concurrent.futures
import copy
import csv
import dataclasses
import itertools
import logging
import math
import os
import pathlib
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from attnlab import config_utils
from attnlab import rundir
from attnlab.errors import RunStopped
from attnlab.errors import TrainingInterrupted
from attnlab.errors import UserError
from attnlab.errors import error_line

_LOG = logging.getLogger(__name__)

SEED_KEY = "seed"
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
# Bookkeeping fields of metrics.jsonl records that are not metrics.
_NOT_METRICS = ("step", "split", "wall_time", "steps_per_sec")


@dataclasses.dataclass
class Member:
  """One setting of the sweep and its run directory."""
  # "key=value,key=value": also the name of its run directory.
  name: str
  # {config key: value} of this member.
  values: dict[str, Any]
  config: ml_collections.ConfigDict
  workdir: pathlib.Path
  # pending, skipped (already complete), done, failed.
  status: str = "pending"
  # One line saying why a failed member failed.
  error: str = ""


# ---------------------------------------------------------------------------------------------------
# Building the sweep


def split_sweep_arg(text: str) -> tuple[str, str]:
  """"model.score=dot,general" -> ("model.score", "dot,general") (the values still text)."""
  key, eq, values_text = text.partition("=")
  key = key.strip()
  if not eq or not key or not config_utils.split_top_level(values_text):
    raise UserError(f"--sweep={text!r} is not key=value1,value2,...; e.g. --sweep=seed=0,1,2")
  return key, values_text


def parse_axis(key: str, values_text: str, config: ml_collections.ConfigDict) -> list[Any]:
  """"dot,general" -> ["dot", "general"]: the values of axis `key`, typed from the config."""
  values = config_utils.split_top_level(values_text)
  if not values:
    raise UserError(f"sweep axis {key!r} has no values")
  default = config_utils.get_value(config, key)
  return [config_utils.parse_value(key, value, default) for value in values]


def parse_sweep_arg(text: str, config: ml_collections.ConfigDict) -> tuple[str, list[Any]]:
  """"model.score=dot,general" -> ("model.score", ["dot", "general"]), typed from the config."""
  key, values_text = split_sweep_arg(text)
  return key, parse_axis(key, values_text, config)


def load_sweep_file(path: str | os.PathLike) -> tuple[str | None, dict[str, list[Any]]]:
  """(base config spec with its path made absolute, axes) from a configs/sweeps/*.py file."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise UserError(f"sweep file {str(path)!r} not found; give a configs/sweeps/*.py file")
  sweep = config_utils.run_python_file(str(path), f"attnlab_sweep_{path.stem}", "sweep file",
                                      "get_sweep")
  if not isinstance(sweep, Mapping):
    raise UserError(f"get_sweep() in {str(path)!r} must return a dict, got {type(sweep).__name__}")
  unknown = set(sweep) - {"config", "axes"}
  if unknown or not isinstance(sweep.get("axes", {}), Mapping):
    raise UserError(f"get_sweep() in {str(path)!r} must return {{'config': 'path.py[:args]', "
                    f"'axes': {{key: [values]}}}}; got keys {sorted(sweep)}")
  base = sweep.get("config")
  if base:
    base_path, sep, arg = base.partition(":")
    base = str((path.parent / base_path).resolve()) + sep + arg
  return base, {key: list(values) for key, values in sweep.get("axes", {}).items()}


def _format(value: Any) -> str:
  """`value` as a member's directory name shows it."""
  return str(value).replace(" ", "").replace(os.sep, "_")


def expand(base: ml_collections.ConfigDict, axes: Mapping[str, Sequence[Any]],
           workdir: str | os.PathLike) -> list[Member]:
  """The cross product of `axes` (in their order) applied to copies of `base`."""
  if not axes:
    raise UserError("nothing to sweep: give --sweep=key=value1,value2 (or a --sweep_file)")
  for key, values in axes.items():
    if not values:
      raise UserError(f"sweep axis {key!r} has no values")
  members: dict[str, Member] = {}
  for combo in itertools.product(*axes.values()):
    values = dict(zip(axes, combo))
    config = copy.deepcopy(base)
    config_utils.apply_overrides(config, values)
    name = ",".join(f"{key}={_format(value)}" for key, value in values.items())
    member_dir = pathlib.Path(workdir).absolute() / name
    if name in members:  # two members in one directory would write into each other's run
      raise UserError(f"sweep members {members[name].values} and {values} would share the run "
                      f"directory {member_dir}; give each axis distinct values")
    problem = None
    try:  # a bad value is refused before any member runs (--list too), not when its turn comes
      config_utils.validate(config)
    except UserError as e:
      problem = error_line(e)
    if problem is not None:  # raised outside the handler: error_line shows this line, not e's
      raise UserError(f"sweep member {name}: {problem}")
    members[name] = Member(name, values, config, member_dir)
  return list(members.values())


ConfigSpec = str | os.PathLike | ml_collections.ConfigDict
# {key: [values]}, or {key: "value1,value2"} (text, typed from the base config as --sweep is).
Axes = Mapping[str, Sequence[Any] | str]


def prepare(config: ConfigSpec | None = None, axes: Axes | None = None, *,
            sweep_file: str | os.PathLike | None = None,
            seeds: Sequence[int] | str | None = None, num_seeds: int | None = None,
            overrides: Mapping[str, Any] | None = None
            ) -> tuple[ml_collections.ConfigDict, dict[str, list[Any]]]:
  """(base config, axes by full config key) of the sweep `run` runs with these arguments.

  Nothing runs. An axis may be named by a shared shortcut (config_utils.SHORTCUTS, e.g. `score`
  for model.score) where the base config has the field it stands for, as in a config arg.
  """
  base_spec, file_axes = load_sweep_file(sweep_file) if sweep_file else (None, {})
  spec = base_spec if config is None else config
  if isinstance(spec, ml_collections.ConfigDict):
    base = copy.deepcopy(spec)  # the caller's config stays as it is
  elif spec:
    base = config_utils.load_config_file(os.fspath(spec))
  else:
    raise UserError("give the base config: --config=configs/<family>.py[:args] or a "
                    "--sweep_file whose get_sweep() names one")
  fixed = dict(overrides or {})
  if num_seeds is not None:
    fixed["num_seeds"] = num_seeds
  config_utils.apply_overrides(base, fixed)
  fields = config_utils.flatten(base)
  swept: dict[str, list[Any]] = {}
  for key, values in [*file_axes.items(), *(axes or {}).items()]:
    if not isinstance(values, (str, Sequence)):
      raise UserError(f"sweep axis {key!r}: give a list of values or 'value1,value2' text, got "
                      f"{values!r}")
    if key in config_utils.SHORTCUTS:
      target = config_utils.shortcut_target(base, config_utils.SHORTCUTS[key])
      key = target if target in fields else key
    swept[key] = parse_axis(key, values, base) if isinstance(values, str) else list(values)
  if seeds is not None:
    if SEED_KEY in swept:
      raise UserError(f"the seeds are given twice: as seeds= and as the sweep axis {SEED_KEY!r}")
    swept[SEED_KEY] = (parse_axis(SEED_KEY, seeds, base) if isinstance(seeds, str)
                       else list(seeds))
  return base, swept


# ---------------------------------------------------------------------------------------------------
# Running


def _run_inprocess(member: Member) -> None:
  from attnlab import train  # pylint: disable=g-import-not-at-top  (imports JAX)
  try:
    train.train_and_evaluate(member.config, member.workdir)
    member.status = "done"
  except TrainingInterrupted:
    member.status, member.error = "failed", "interrupted"
    raise
  except (UserError, RunStopped) as e:
    member.status, member.error = "failed", error_line(e)
  except Exception as e:  # a crash in one member must not lose the others
    _LOG.exception("member %s crashed", member.name)
    member.status, member.error = "failed", f"{type(e).__name__}: {error_line(e)}"


def _run_subprocess(member: Member) -> None:
  env = dict(os.environ)
  package_root = str(pathlib.Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
  log_path = member.workdir / "log.txt"
  with open(log_path, "a") as log:
    result = subprocess.run([sys.executable, "-m", "attnlab.cli.sweep",
                             f"--member={member.workdir}"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
  if result.returncode == 0:
    member.status = "done"
  else:
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    member.status = "failed"
    member.error = f"exit status {result.returncode}: {lines[-1] if lines else ''} (see {log_path})"


def _to_run(members: Sequence[Member]) -> list[Member]:
  """Prepares the members' run directories (what their configs point at is checked and a changed
  config refused before anything runs or is written) and marks the complete ones skipped;
  returns the others."""
  from attnlab import train  # pylint: disable=g-import-not-at-top  (imports JAX)
  for member in members:
    problem = None
    try:
      train.check_inputs(member.config, member.workdir)
    except UserError as e:
      problem = error_line(e)
    if problem is not None:  # raised outside the handler: error_line shows this line, not e's
      raise UserError(f"sweep member {member.name}: {problem}")
  for member in members:
    rundir.prepare_workdir(member.workdir, member.config)
  todo = []
  for member in members:
    if rundir.is_complete(member.workdir, member.config.num_train_steps):
      member.status = "skipped"
      _LOG.info("%s: complete, skipped", member.name)
    else:
      todo.append(member)
  return todo


def run_sweep(base: ml_collections.ConfigDict, axes: Mapping[str, Sequence[Any]],
              workdir: str | os.PathLike, parallel: int = 1, *,
              member_index: int | None = None, summarize_only: bool = False,
              inprocess: bool | None = None) -> list[Member]:
  """Runs every member that is not complete yet; writes the summary; returns the members.

  `member_index=i` runs member i only (one cluster array task per member) and writes no summary;
  `summarize_only=True` runs nothing and writes the summary of the members that finished.
  `inprocess`: run the members one after another in this process (default when parallel=1) or
  each in a subprocess, `parallel` at a time (default when parallel>1).
  """
  if parallel < 1:
    raise UserError(f"parallel={parallel}: give the number of members to run at once (>= 1)")
  if inprocess is None:
    inprocess = parallel == 1
  elif inprocess and parallel > 1:
    raise UserError(f"parallel={parallel} runs members as subprocesses; in this process they run "
                    f"one at a time (parallel=1)")
  workdir = pathlib.Path(workdir).absolute()
  members = expand(base, axes, workdir)
  if summarize_only:
    for member in members:
      if rundir.is_complete(member.workdir, member.config.num_train_steps):
        member.status = "skipped"
    write_summary(workdir, members, list(axes))
    return members
  if member_index is not None:
    if not 0 <= member_index < len(members):
      raise UserError(f"--member_index={member_index} is out of range: the sweep has "
                      f"{len(members)} members, indices 0..{len(members) - 1} (see --list)")
    for member in _to_run([members[member_index]]):
      _LOG.info("member %d/%d: %s", member_index, len(members), member.name)
      _run_inprocess(member)
    return members
  with rundir.WorkdirLock(workdir):  # one sweep at a time in DIR
    _run_members(members, axes, workdir, parallel, inprocess)
  return members


def _run_members(members: list[Member], axes: Mapping[str, Sequence[Any]],
                 workdir: pathlib.Path, parallel: int, inprocess: bool) -> None:
  """Runs the members that are not complete (in this process, or `parallel` subprocesses)."""
  todo = _to_run(members)
  _LOG.info("sweep %s: %d members, %d to run", workdir, len(members), len(todo))
  try:
    if inprocess:
      for i, member in enumerate(todo, 1):
        _LOG.info("[%d/%d] %s", i, len(todo), member.name)
        _run_inprocess(member)
    else:
      with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        for member, _ in zip(todo, pool.map(_run_subprocess, todo)):
          _LOG.info("%s: %s %s", member.name, member.status, member.error)
  finally:
    write_summary(workdir, members, list(axes))


@dataclasses.dataclass
class SweepResult:
  """What `run` did: the sweep directory, its members (each with its status) and its summary."""
  workdir: pathlib.Path
  # The swept keys in order (the summary has one row per setting of those other than `seed`).
  keys: list[str]
  members: list[Member]

  @property
  def summary_csv(self) -> pathlib.Path:
    return self.workdir / SUMMARY_CSV

  @property
  def summary_md(self) -> pathlib.Path:
    return self.workdir / SUMMARY_MD

  @property
  def failed(self) -> list[Member]:
    return [m for m in self.members if m.status == "failed"]

  @property
  def status(self) -> int:
    """0 when no member failed, else 1 (the exit status of `attnlab sweep`)."""
    return 1 if self.failed else 0

  def report(self, prog: str, *, summary: bool = True) -> int:
    """Prints what `attnlab sweep` prints (the summary table on stdout, a line per failed member
    on stderr, each starting with `prog`); returns `status`."""
    if summary:
      print(self.summary_md.read_text())
      for name, what in incomplete_members(self.members).items():
        print(f"{prog}: warning: member {name} has no final evaluation record ({what}); it is "
              f"left out of the summary's means", file=sys.stderr)
    for member in self.failed:
      print(f"{prog}: member {member.name} failed: {member.error}", file=sys.stderr)
    return self.status

  def summary(self) -> list[dict[str, Any]]:
    """The summary's rows as `summarize` gives them (metric: (mean, std))."""
    return summarize(self.members, self.keys)


def run(config: ConfigSpec | None = None, axes: Axes | None = None, *,
        workdir: str | os.PathLike, sweep_file: str | os.PathLike | None = None,
        seeds: Sequence[int] | str | None = None, num_seeds: int | None = None,
        overrides: Mapping[str, Any] | None = None, parallel: int = 1,
        inprocess: bool | None = None, member_index: int | None = None,
        summarize_only: bool = False) -> SweepResult:
  """Runs a sweep in `workdir` and writes its summary (what `attnlab sweep` does).

  Args:
    config: the base config: "configs/<family>.py[:key=value,...]" or a ConfigDict (copied); None
      when `sweep_file` names one.
    axes: {config key: [values]} or {config key: "value1,value2"} (text typed from the config);
      the members are their cross product, in this order (after the sweep file's axes). A key
      may be a shared shortcut (`prepare`).
    workdir: the sweep directory; member i runs in workdir/<key=value,...>/.
    sweep_file: a configs/sweeps/*.py file (get_sweep(): base config and axes); `config` and
      `axes` add to it as --config and --sweep do.
    seeds: the `seed` axis, last ([0, 1, 2] or "0,1,2"); the summary is mean ± std over it.
    num_seeds: N replicas vmapped in each member run (config.num_seeds); each counts as a seed.
    overrides: {config key: value} set in the base config before the axes.
    parallel, inprocess: see `run_sweep` (default: one member at a time, in this process).
    member_index, summarize_only: run member i only (no summary), or summarize only.

  Returns:
    The members with their status (pending, skipped, done, failed) and the summary's paths.

  Raises:
    UserError: a bad config, axis or value (nothing has run then).
  """
  base, swept = prepare(config, axes, sweep_file=sweep_file, seeds=seeds, num_seeds=num_seeds,
                        overrides=overrides)
  members = run_sweep(base, swept, workdir, parallel, member_index=member_index,
                      summarize_only=summarize_only, inprocess=inprocess)
  return SweepResult(pathlib.Path(workdir).absolute(), list(swept), members)


# ---------------------------------------------------------------------------------------------------
# Summary


def final_metrics_per_seed(workdir: str | os.PathLike) -> list[dict[str, float]]:
  """{"eval/<name>": value} of the last evaluation (of a run that early stopping ended, its best
  one: the run's result) and "train/loss" of the last train log, for each replica of the run: one
  dict, or N for a run with num_seeds=N."""
  records = rundir.read_metrics(workdir)
  last = rundir.last_records(records)
  stop = rundir.early_stop(records)
  best = [r for r in records if stop and r["split"] == "eval" and r["step"] == stop["best_step"]]
  if best:
    last["eval"] = best[-1]
  per_seed = {split: r["per_seed"] for split, r in last.items()
              if isinstance(r.get("per_seed"), Mapping)}
  if not per_seed:  # a run of one replica: its records' values
    per_seed = {split: {name: [value] for name, value in record.items()
                        if name not in _NOT_METRICS and isinstance(value, (int, float))}
                for split, record in last.items()}
  count = max((len(v) for values in per_seed.values() for v in values.values()), default=1)
  replicas: list[dict[str, float]] = [{} for _ in range(count)]
  for split, values in sorted(per_seed.items()):
    for name, series in values.items():
      if split == "eval" or name == "loss":
        for i, value in enumerate(series):
          replicas[i][f"{split}/{name}"] = float(value)
  return replicas


def _mean_std(values: list[float]) -> tuple[float, float]:
  mean = sum(values) / len(values)
  if len(values) < 2:
    return mean, math.nan
  return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def incomplete_members(members: Sequence[Member]) -> dict[str, str]:
  """{name: what is missing} of the members that did not fail but whose final evaluation record
  is missing from their metrics.jsonl (not run yet, interrupted, or the record lost): the
  summary leaves them out of its means and names them."""
  missing = {}
  for member in members:
    steps = member.config.num_train_steps
    if member.status == "failed" or rundir.is_complete(member.workdir, steps):
      continue
    last = rundir.last_records(rundir.read_metrics(member.workdir)).get("eval")
    missing[member.name] = (f"its last evaluation is at step {last['step']} of {steps}" if last
                            else "it has no evaluation record")
  return missing


def summarize(members: Sequence[Member], keys: Sequence[str]) -> list[dict[str, Any]]:
  """One row per setting of the non-seed keys: {key: value, "seeds": n, "failed": n,
  "incomplete": n, "<metric>": (mean, std)} over the complete members of that setting (each
  replica of a num_seeds=N member counts as one seed); a member without its final evaluation
  record counts as incomplete, not as a seed (`incomplete_members`)."""
  group_keys = [key for key in keys if key != SEED_KEY]
  groups: dict[tuple, list[Member]] = {}
  for member in members:
    groups.setdefault(tuple(member.values[k] for k in group_keys), []).append(member)
  missing = incomplete_members(members)
  rows = []
  for setting, group in groups.items():
    finished = [m for m in group if m.status in ("done", "skipped") and m.name not in missing]
    per_member = [metrics for m in finished for metrics in final_metrics_per_seed(m.workdir)]
    row: dict[str, Any] = {**dict(zip(group_keys, setting)), "seeds": len(per_member),
                           "failed": sum(m.status == "failed" for m in group),
                           "incomplete": sum(m.name in missing for m in group)}
    for name in sorted(set().union(*per_member)):
      row[name] = _mean_std([metrics[name] for metrics in per_member if name in metrics])
    rows.append(row)
  return rows


def _fmt_number(x: float) -> str:
  return "" if math.isnan(x) else f"{x:.4g}"


def _fmt_mean_std(mean: float, std: float) -> str:
  """"0.1234 ± 0.01" as summary.md shows it (no ± with a single seed)."""
  return _fmt_number(mean) + ("" if math.isnan(mean) or math.isnan(std) else f" ± {std:.2g}")


def write_summary(workdir: str | os.PathLike, members: Sequence[Member],
                  keys: Sequence[str]) -> tuple[pathlib.Path, pathlib.Path]:
  """Writes DIR/summary.csv (mean and std columns) and DIR/summary.md; returns their paths."""
  workdir = pathlib.Path(workdir)
  rows = summarize(members, keys)
  missing = incomplete_members(members)
  group_keys = [key for key in keys if key != SEED_KEY]
  metric_names = sorted({k for row in rows for k in row} - set(group_keys)
                        - {"seeds", "failed", "incomplete"})
  csv_path, md_path = workdir / SUMMARY_CSV, workdir / SUMMARY_MD
  # The incomplete column only when a member lacks its final record (a finished sweep has none).
  header = [*group_keys, "seeds", "failed"] + (["incomplete"] if missing else [])
  lines = ["| " + " | ".join(header + metric_names) + " |",
           "|" + "---|" * (len(header) + len(metric_names))]
  with open(csv_path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(header + [f"{name}_{s}" for name in metric_names for s in ("mean", "std")])
    for row in rows:
      cells = [row[k] for k in header]
      stats = [row.get(name, (math.nan, math.nan)) for name in metric_names]
      writer.writerow(cells + [_fmt_number(x) for mean_std in stats for x in mean_std])
      md_cells = [*map(str, cells), *(_fmt_mean_std(mean, std) for mean, std in stats)]
      lines.append("| " + " | ".join(md_cells) + " |")
  seeds = f" over `{SEED_KEY}`" if SEED_KEY in keys else ""
  if any(m.config.get("num_seeds", 1) > 1 for m in members):
    seeds += " and over the replicas of each `num_seeds` run"
  note = ""
  if missing:
    note = ("\nLeft out of the means, their final evaluation record missing (`incomplete`): "
            + "; ".join(f"`{name}` ({what})" for name, what in missing.items())
            + ". Run the sweep again to complete them.\n")
  md_path.write_text(f"# Sweep {workdir.name}\n\nFinal metrics, mean ± std (ddof=1){seeds}; "
                     f"`seeds` counts finished members.\n\n" + "\n".join(lines) + "\n" + note)
  return csv_path, md_path

