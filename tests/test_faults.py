"""The faults a long run meets, through the command line: each gives one clear line and a non-zero
exit (a warning for symbols outside the vocabulary), and a run in progress resumes bit-identically
from its last good checkpoint afterwards.

Disk full and a read-only directory use a tiny tmpfs and a read-only bind mount where the test may
mount (root); elsewhere a subprocess whose checkpoint writes are patched to fail with the same errno.
"""

import contextlib
import errno
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from attnlab import analysis
from attnlab import checkpoint
from attnlab import config_utils
from attnlab import errors
from attnlab import rundir
from attnlab import train
from attnlab.cli import tool
from attnlab.cli import train as train_cli
from attnlab.cli import translate as translate_cli
from attnlab.data import tokenizers

REPO = pathlib.Path(__file__).resolve().parents[1]
NW = str(REPO / "configs" / "nadaraya_watson.py")
# 40 steps with a checkpoint every 2: the run lasts long enough to be hit mid-way.
LONG = "runlocal=True,write_plots=False,num_train_steps=40,log_every=2,eval_every=0," \
       "keep_checkpoints=3"
SPEC = f"{NW}:{LONG},checkpoint_every=2"


def _cli(*args, **kwargs) -> subprocess.CompletedProcess:
  """`attnlab <args>` in a subprocess; stdout and stderr as text."""
  return subprocess.run([sys.executable, "-m", "attnlab.cli", *map(str, args)], 
                        capture_output=True, text=True, timeout=300, **kwargs)


def _one_line(stderr: str) -> str:
  """The last line of stderr, checked to be the only line that is not a progress log."""
  lines = [l for l in stderr.splitlines() if l.strip() and not l[:8].replace(":", "").isdigit()]
  assert len(lines) == 1, stderr
  assert "Traceback" not in stderr, stderr
  return lines[0]


def _start_train(workdir: pathlib.Path, log: pathlib.Path, prelude: str = "") -> subprocess.Popen:
  """`attnlab train --config=SPEC --workdir=workdir` in the background (after `prelude` code)."""
  code = (f"import sys\n{prelude}\nfrom attnlab import cli\n"
          f"sys.exit(cli.main(['attnlab', 'train', {'--config=' + SPEC!r}, "
          f"{'--workdir=' + str(workdir)!r}]))")
  with open(log, "w") as f:
    return subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def _warnings_of(name: str):
  """The messages logged by logger `name` inside the block (attnlab's loggers do not propagate)."""
  messages = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: messages.append(record.getMessage())
  logger = logging.getLogger(name)
  logger.addHandler(handler)
  try:
    yield messages
  finally:
    logger.removeHandler(handler)


def _wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if condition():
      return
    assert proc.poll() is None, f"the run ended before {what}"
    time.sleep(0.01)
  raise AssertionError(f"no {what} within {timeout}s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The final parameters of SPEC's run, uninterrupted."""
  workdir = tmp_path_factory.mktemp("reference")
  config = config_utils.load_config_file(f"{NW}:{LONG},checkpoint_every=0")
  return train.train_and_evaluate(config, workdir)


def _assert_resumes_bit_identically(workdir: pathlib.Path, reference, from_step: int) -> None:
  assert train_cli.main(["attnlab train", f"--config={SPEC}", f"--workdir={workdir}"]) == 0
  run = analysis.load_run(workdir)
  assert run.step == 40
  for name in reference.params:
    np.testing.assert_array_equal(np.asarray(run.params[name]), np.asarray(reference.params[name]))
  records = rundir.read_metrics(workdir)
  steps = [r["step"] for r in records if r["split"] == "train"]
  assert steps == list(range(2, 41, 2)), f"metrics not redone cleanly from step {from_step}"


# ---------------------------------------------------------------------------------------------------
# 1. A config file that fails to import


def test_config_file_with_a_syntax_error(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config(:\n")
  result = _cli("train", f"--config={bad}", f"--workdir={tmp_path / 'run'}")
  assert result.returncode == 2
  line = _one_line(result.stderr)
  assert line == f"attnlab train: error: config file {str(bad)!r} failed to import: line 1: " \
                 f"SyntaxError: invalid syntax"
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_config_and_sweep_files_that_fail_when_run(tmp_path, capsys):
  bad = tmp_path / "bad_body.py"
  bad.write_text("import os\n\ndef get_config(arg=None):\n  return undefined_name\n")
  assert train_cli.main(["attnlab train", f"--config={bad}", f"--workdir={tmp_path}"]) == 2
  assert capsys.readouterr().err.strip() == (
      f"attnlab train: error: config file {str(bad)!r} failed in get_config(): line 4: "
      f"NameError: name 'undefined_name' is not defined")
  sweep_file = tmp_path / "sweep.py"
  sweep_file.write_text("x = 1\ny = [\n")
  from attnlab.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  assert sweep_cli.main(["attnlab sweep", f"--sweep_file={sweep_file}",
                         f"--workdir={tmp_path}"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"attnlab sweep: error: sweep file {str(sweep_file)!r} failed to import: "
                        f"line 2: SyntaxError: ") and "\n" not in err


# ---------------------------------------------------------------------------------------------------
# 2. Disk full, directory turned read-only


def _can_mount(tmp_path: pathlib.Path) -> bool:
  if os.geteuid() != 0 or not shutil.which("mount"):
    return False
  probe = tmp_path / "probe"
  probe.mkdir()
  ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                      capture_output=True).returncode == 0
  if ok:
    subprocess.run(["umount", str(probe)], check=True)
  probe.rmdir()
  return ok


def _fill(directory: pathlib.Path) -> pathlib.Path:
  """Writes a file into `directory` until its file system is full; returns the file."""
  filler = directory / "filler"
  with open(filler, "wb", buffering=0) as f:
    try:
      while True:
        f.write(b"x" * 4096)
    except OSError as e:
      assert e.errno == errno.ENOSPC
  return filler


# A failing write as orbax meets it, for machines where the test cannot mount a file system.
PATCHED_SAVE = """
import errno, os
from attnlab import checkpoint
_save = checkpoint.ocp.CheckpointManager.save
def save(self, step, *args, **kwargs):
  if step > 4:
    raise OSError(errno.{code}, os.strerror(errno.{code}), str(self.directory))
  return _save(self, step, *args, **kwargs)
checkpoint.ocp.CheckpointManager.save = save
"""


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["disk_full", "read_only"])
def test_refused_writes_stop_the_run_and_it_resumes(tmp_path, reference, fault):
  mounted = _can_mount(tmp_path)
  disk = tmp_path / "disk"
  disk.mkdir()
  workdir = disk / "run"
  ckpt_dir = workdir / "checkpoints"
  code = "ENOSPC" if fault == "disk_full" else "EROFS"
  undo, proc = [], None
  try:
    if mounted:
      subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
      undo.append(["umount", str(disk)])
      proc = _start_train(workdir, tmp_path / "train.log")
      _wait_for(lambda: checkpoint.finished_steps(workdir), proc, "first checkpoint")
      if fault == "disk_full":
        filler = _fill(disk)
      else:
        subprocess.run(["mount", "--bind", str(ckpt_dir), str(ckpt_dir)], check=True)
        undo.insert(0, ["umount", str(ckpt_dir)])
        # The remount is refused (busy) while the run holds a file open for writing there: retry.
        for _ in range(40):
          if subprocess.run(["mount", "-o", "remount,ro,bind", str(ckpt_dir)]).returncode == 0:
            break
          time.sleep(0.05)
        else:
          pytest.fail(f"could not remount {ckpt_dir} read-only")
    else:
      proc = _start_train(workdir, tmp_path / "train.log", PATCHED_SAVE.format(code=code))
    assert proc.wait(timeout=300) == 1
    line = _one_line((tmp_path / "train.log").read_text())
    last = checkpoint.finished_steps(workdir)[-1]
    assert line.startswith(f"attnlab train: could not write checkpoint step ")
    assert f"in {ckpt_dir} ({os.strerror(getattr(errno, code))}); training stopped: the last " \
           f"good checkpoint is step {last} in {ckpt_dir}; " in line, line
    assert last < 40
    # Make room (or writable), then the same command resumes from the last good checkpoint; a
    # half-written checkpoint (removed at once, or by the restart where a writer thread of the
    # refused save outlived the removal) is gone.
    if mounted and fault == "disk_full":
      filler.unlink()
    elif mounted:
      subprocess.run(undo.pop(0), check=True)
    _assert_resumes_bit_identically(workdir, reference, last)
    assert not list(ckpt_dir.glob(f"*{ocp.utils.TMP_DIR_SUFFIX}*"))
  finally:
    if proc is not None and proc.poll() is None:
      proc.kill()
      proc.wait()
    for command in undo:
      subprocess.run(command, check=False)


# ---------------------------------------------------------------------------------------------------
# 3. Two runs on one workdir


@pytest.mark.slow
def test_second_run_on_a_busy_workdir_is_refused_and_a_dead_holder_taken_over(tmp_path, reference):
  workdir = tmp_path / "run"
  first = _start_train(workdir, tmp_path / "first.log")
  lock = workdir / rundir.LOCK_FILE
  holder = lambda: lock.is_file() and f'"pid": {first.pid}' in lock.read_text()
  _wait_for(holder, first, "lock held by the first run")
  first.send_signal(signal.SIGSTOP)  # it holds the lock, whatever the second one takes to start
  try:
    second = _cli("train", f"--config={SPEC}", f"--workdir={workdir}")
  except BaseException:
    first.kill()
    raise
  finally:
    first.send_signal(signal.SIGCONT)
  assert second.returncode == 2
  line = _one_line(second.stderr)
  assert line.startswith(f"attnlab train: error: workdir {workdir} is in use by another run "
                         f"(pid {first.pid} on host ")
  assert "use another --workdir" in line

  # The holder dies without a word (SIGKILL): its lock file is stale and the next run takes over.
  _wait_for(lambda: checkpoint.finished_steps(workdir), first, "first checkpoint")
  first.kill()
  first.wait(timeout=60)
  assert f'"pid": {first.pid}' in lock.read_text()
  with _warnings_of("attnlab.rundir") as warnings:
    _assert_resumes_bit_identically(workdir, reference, checkpoint.finished_steps(workdir)[-1])
  assert f"taking over the stale lock {lock} of pid {first.pid} on host " in " ".join(warnings)
  assert lock.read_text() == ""  # released at the end


def test_lock_is_exclusive_within_a_process_and_released(tmp_path):
  with rundir.WorkdirLock(tmp_path):
    data = json.loads((tmp_path / rundir.LOCK_FILE).read_text())
    assert data["pid"] == os.getpid()
    with pytest.raises(errors.WorkdirBusyError, match=f"pid {os.getpid()} on host"):
      rundir.WorkdirLock(tmp_path).acquire()
  with rundir.WorkdirLock(tmp_path):  # free again
    pass


def test_lock_without_flock_checks_the_holder_pid(tmp_path, monkeypatch):
  def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "no locks")
  monkeypatch.setattr(rundir.fcntl, "flock", no_flock)
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  holder = {"host": rundir.socket.gethostname(), "pid": dead.pid, "since": "earlier"}
  (tmp_path / rundir.LOCK_FILE).write_text(json.dumps(holder))
  with _warnings_of("attnlab.rundir") as warnings:
    with rundir.WorkdirLock(tmp_path):
      assert f"pid {dead.pid}" in " ".join(warnings)  # taken over
      with pytest.raises(errors.WorkdirBusyError, match=f"pid {os.getpid()}"):
        rundir.WorkdirLock(tmp_path).acquire()  # this process is alive
  assert not (tmp_path / rundir.LOCK_FILE).exists()


def test_sweep_members_never_share_a_directory(tmp_path):
  result = _cli("sweep", f"--config={NW}:runlocal=True", f"--workdir={tmp_path / 'sweep'}",
                "--sweep=seed=0,0", "--parallel=2")
  assert result.returncode == 2
  line = _one_line(result.stderr)
  assert line == (f"attnlab sweep: error: sweep members {{'seed': 0}} and {{'seed': 0}} would "
                  f"share the run directory {tmp_path / 'sweep' / 'seed=0'}; give each axis "
                  f"distinct values")
  assert not (tmp_path / "sweep").exists()


# ---------------------------------------------------------------------------------------------------
# 4. A damaged checkpoint in `attnlab inspect`


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
  """A runlocal run with checkpoints 10 and 20."""
  workdir = tmp_path_factory.mktemp("local")
  train.train_and_evaluate(config_utils.load_config_file(f"{NW}:runlocal=True,write_plots=False"),
                           workdir)
  return workdir


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["every_file", "array_data"])
def test_inspect_marks_damaged_checkpoints(local_run, tmp_path, damage):
  workdir = tmp_path / "run"
  shutil.copytree(local_run, workdir)
  newest = workdir / "checkpoints" / "20"
  for path in newest.rglob("*"):
    if path.is_file() and (damage == "every_file" or path.parent.name == "d"):
      path.write_bytes(b"garbage")
  result = _cli("inspect", f"--workdir={workdir}")
  assert result.returncode == 1
  assert "checkpoints: 10, 20 (damaged) (of 20 steps; complete)\n" in result.stdout
  assert "  checkpoint 20 is damaged: file " + str(newest) in result.stdout
  line = _one_line(result.stderr)
  assert line.startswith(f"attnlab inspect: error: checkpoint 20 of {workdir} is damaged (file "
                         f"{newest}")
  assert line.endswith("; the newest good checkpoint is step 10 (a resumed run starts from it)")


@pytest.mark.slow
def test_inspect_verify_restores_every_checkpoint(local_run, capsys):
  from attnlab.cli import inspect_run  # pylint: disable=g-import-not-at-top
  assert inspect_run.main(["attnlab inspect", f"--workdir={local_run}", "--verify"]) == 0
  assert "checkpoints: 10, 20 (of 20 steps; complete)\n  all restored into the model\n" in \
      capsys.readouterr().out
  assert inspect_run.main(["attnlab inspect", f"--workdir={local_run}"]) == 0
  assert "checkpoints: 10, 20 (of 20 steps; complete)\n  all complete and readable\n" in \
      capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# 5. Symbols outside the vocabulary


@pytest.mark.slow
def test_generate_warns_about_prompt_symbols_outside_the_vocabulary(tmp_path):
  gpt = REPO / "configs" / "gpt.py"
  config = config_utils.load_config_file(
      f"{gpt}:runlocal=True,dataset=addition,num_train_steps=1,write_plots=False")
  train.train_and_evaluate(config, tmp_path)
  result = _cli("generate", f"--workdir={tmp_path}", "--prompt=€€€1+2=", "--temperature=0",
                "--num_tokens=3")
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("€€€1+2=")
  # Beside the warning that the run trained one step, one line about the prompt.
  lines = result.stderr.splitlines()
  few = [l for l in lines if "trained for only 1 steps" in l]
  assert len(few) == 1 and few[0].startswith("attnlab generate: warning: ")
  assert _one_line("\n".join(l for l in lines if l not in few)) == (
      "attnlab generate: warning: the prompt has 1 character outside the vocabulary of the run: "
      "'€' (3 times); it was encoded as <unk>, which the model reads as 'unknown'")


@pytest.mark.slow
def test_translate_warns_about_input_symbols_outside_the_vocabulary(tmp_path, capsys):
  seq2seq = REPO / "configs" / "seq2seq.py"
  config = config_utils.load_config_file(
      f"{seq2seq}:runlocal=True,num_train_steps=1,eval_every=0,write_plots=False")
  train.train_and_evaluate(config, tmp_path)
  capsys.readouterr()
  assert translate_cli.main(["attnlab translate", f"--workdir={tmp_path}",
                             f"--output={tmp_path / 'a.png'}", "9 october 1993",
                             "9 octobre 1993 ¤¤"]) == 0
  warnings = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
  assert "trained for only 1 steps" in warnings.pop(0)  # the run trained one step
  assert warnings == [
      "attnlab translate: warning: the input '9 octobre 1993 ¤¤' has 1 character outside the "
      "vocabulary of the run: '¤' (2 times); it was encoded as <unk>, which the model reads as "
      "'unknown'"]


def test_unknown_lists_what_becomes_unk_for_every_tokenizer(tmp_path):
  char = tokenizers.CharTokenizer.train(["hello world"])
  assert char.unknown("hello €€ wörld") == ["€", "ö"]
  word = tokenizers.WordTokenizer.train(["rahul is a good boy ."])
  assert word.unknown("Rahul is a great boy, great!") == ["great", ",", "!"]
  subword = tokenizers.SubwordTokenizer.train(["hello world this is a test "] * 20, 20, tmp_path)
  assert subword.unknown("hello € world") == ["€"]
  assert [subword.unk_id in subword.encode(t) for t in ("hello € world", "hello")] == [True, False]
  assert tokenizers.unknown_warning(char, "hello") is None


def test_a_refused_save_raises_one_error_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch):
  # orbax's write of the arrays refused (as a full disk refuses it): one CheckpointWriteError naming
  # the step and the reason; the earlier checkpoint stays the newest, and no partial checkpoint
  # outlives the next save (removed at once, or by orbax when the directory is opened again).
  async def refuse(self, directory, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
  directory = tmp_path / "checkpoints"
  state = {"w": np.arange(3, dtype=np.float32)}
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(1, state, {"index": 1})
    with monkeypatch.context() as patch:
      patch.setattr(ocp.StandardCheckpointHandler, "async_save", refuse)
      with pytest.raises(errors.CheckpointWriteError) as info:
        ckpt.save(2, state, {"index": 2})
    assert str(info.value) == f"could not write checkpoint step 2 in {directory} (No space left " \
                              f"on device)" and info.value.errno == errno.ENOSPC
    assert ckpt.steps() == [1] and checkpoint.finished_steps(tmp_path) == [1]
  with checkpoint.Checkpointer(directory) as ckpt:  # the run started again
    ckpt.save(3, state, {"index": 3})
    assert ckpt.steps() == [1, 3]
  assert not list(directory.glob(f"*{ocp.utils.TMP_DIR_SUFFIX}*"))


class _RaisesWhenCollected:
  def __init__(self, exc: BaseException):
    self.exc = exc

  def __del__(self):
    raise self.exc  # Python hands it to sys.unraisablehook


def test_the_tools_leave_orbax_failure_reports_to_their_one_line(monkeypatch, capsys):
  # A failed checkpoint read or write makes orbax's threads log it through absl (with a traceback),
  # asyncio log the futures that failed with it, and tensorstore report "Event loop is closed" for
  # the reads and writes still running; the command-line tools say it in one line, so their set-up
  # keeps those quiet, and attnlab's messages and every other error on.
  for name in ("absl", "asyncio", "attnlab"):
    monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
  monkeypatch.setattr(logging.getLogger("attnlab"), "handlers", [])
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  tool.setup_logging()
  assert not logging.getLogger("absl").isEnabledFor(logging.ERROR)
  assert not logging.getLogger("asyncio").isEnabledFor(logging.ERROR)
  assert logging.getLogger("attnlab.checkpoint").isEnabledFor(logging.WARNING)
  capsys.readouterr()
  for exc in (RuntimeError("Event loop is closed"), RuntimeError("Event loop is closed."),
              ValueError("Event loop is closed"), RuntimeError("something else")):
    _RaisesWhenCollected(exc)
  err = capsys.readouterr().err
  assert "RuntimeError: Event loop is closed\n" not in err
  assert "RuntimeError: Event loop is closed.\n" in err and "RuntimeError: something else\n" in err
  assert "ValueError: Event loop is closed\n" in err
