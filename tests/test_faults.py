"""The faults a long run meets, through the command line: each gives one clear line and a non-zero
exit (a warning for symbols outside the vocabulary), and a run in progress resumes bit-identically
from its last good checkpoint afterwards.

Disk full and a read-only directory use a tiny tmpfs and a read-only bind mount where the test may
mount (root); elsewhere a subprocess whose checkpoint writes are patched to fail with the same errno.
"""

import asyncio
import contextlib
import errno
import gc
import io
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
import pytest
from etils import epath
from orbax.checkpoint._src.path import async_path

from attnlab import analysis
from attnlab import checkpoint
from attnlab import config_utils
from attnlab import errors
from attnlab import train
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
  records = checkpoint.read_metrics(workdir)
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
    assert not list(ckpt_dir.glob(f"*{checkpoint.TMP_SUFFIX}*"))
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
  lock = workdir / checkpoint.LOCK_FILE
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
  with _warnings_of("attnlab.checkpoint") as warnings:
    _assert_resumes_bit_identically(workdir, reference, checkpoint.finished_steps(workdir)[-1])
  assert f"taking over the stale lock {lock} of pid {first.pid} on host " in " ".join(warnings)
  assert lock.read_text() == ""  # released at the end


def test_lock_is_exclusive_within_a_process_and_released(tmp_path):
  with checkpoint.WorkdirLock(tmp_path):
    data = json.loads((tmp_path / checkpoint.LOCK_FILE).read_text())
    assert data["pid"] == os.getpid()
    with pytest.raises(errors.WorkdirBusyError, match=f"pid {os.getpid()} on host"):
      checkpoint.WorkdirLock(tmp_path).acquire()
  with checkpoint.WorkdirLock(tmp_path):  # free again
    pass


def test_lock_without_flock_checks_the_holder_pid(tmp_path, monkeypatch):
  def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "no locks")
  monkeypatch.setattr(checkpoint.fcntl, "flock", no_flock)
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  holder = {"host": checkpoint.socket.gethostname(), "pid": dead.pid, "since": "earlier"}
  (tmp_path / checkpoint.LOCK_FILE).write_text(json.dumps(holder))
  with _warnings_of("attnlab.checkpoint") as warnings:
    with checkpoint.WorkdirLock(tmp_path):
      assert f"pid {dead.pid}" in " ".join(warnings)  # taken over
      with pytest.raises(errors.WorkdirBusyError, match=f"pid {os.getpid()}"):
        checkpoint.WorkdirLock(tmp_path).acquire()  # this process is alive
  assert not (tmp_path / checkpoint.LOCK_FILE).exists()


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


def test_unretrieved_write_futures_are_not_logged_after_a_refused_write():
  # After a refused save, orbax's other write futures fail too; asyncio would log each as "Future
  # exception was never retrieved" on collection (a second stderr line beside the one error).
  # The filter is on while a Checkpointer is open only: asyncio's own behaviour before and after.
  buffers = {name: io.StringIO() for name in ("asyncio", "absl")}
  handlers = {name: logging.StreamHandler(buffer) for name, buffer in buffers.items()}
  for name, handler in handlers.items():
    logging.getLogger(name).addHandler(handler)
  logger = logging.getLogger("asyncio")
  buffer = buffers["asyncio"]

  def failed_future():
    loop = asyncio.new_event_loop()
    loop.create_future().set_exception(OSError(errno.ENOSPC, "No space left on device"))
    loop.close()
  noise_filter = checkpoint._FailedIoNoiseFilter()  # pylint: disable=protected-access
  try:
    failed_future()
    gc.collect()
    assert "Future exception was never retrieved" in buffer.getvalue()  # what asyncio does
    buffer.truncate(0)
    buffer.seek(0)
    noise_filter.install()
    failed_future()
    gc.collect()
    assert "never retrieved" not in buffer.getvalue()
    logger.error("Task exception was never retrieved")  # asyncio's wording for a task
    assert "never retrieved" not in buffer.getvalue()
    logger.error("another asyncio error")  # other records still pass
    assert "another asyncio error" in buffer.getvalue()
    # orbax's worker thread logs the failure with its traceback through absl: dropped too.
    logging.getLogger("absl").error("Exception in thread: _SignalingThread.run() raised an "
                                    "exception")
    logging.getLogger("absl").error("another absl error")
    assert buffers["absl"].getvalue() == "another absl error\n"
    noise_filter.remove()
    buffer.truncate(0)
    buffer.seek(0)
    failed_future()
    gc.collect()
    assert "Future exception was never retrieved" in buffer.getvalue()  # asyncio's own again
  finally:
    noise_filter.remove()
    for name, handler in handlers.items():
      logging.getLogger(name).removeHandler(handler)


def test_echoes_of_a_refused_write_are_dropped_after_the_checkpointer_closed(tmp_path, monkeypatch):
  # orbax's other write tasks of a refused save can be collected after the run closed its
  # Checkpointer (seen under load): asyncio's "Task exception was never retrieved" for them is
  # dropped then too, and only for the directory whose write failed.
  def refuse(self, step, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory))
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", refuse)
  echoes = checkpoint._ECHOES  # pylint: disable=protected-access
  monkeypatch.setattr(echoes, "directories", frozenset())
  refused, other = tmp_path / "refused", tmp_path / "other"
  with checkpoint.Checkpointer(refused) as ckpt:
    with pytest.raises(errors.CheckpointWriteError):
      ckpt.save(1, {"w": np.zeros(2)}, {})

  def failed_task(directory):
    async def write():
      raise ValueError(f'Failed writing: "{directory}/1.orbax-checkpoint-tmp/d/0": No space left')
    loop = asyncio.new_event_loop()
    task = loop.create_task(write())
    loop.run_until_complete(asyncio.wait([task]))  # done, its exception never retrieved
    loop.close()
  def failed_orbax_writes():
    # As CI saw them: orbax's own path code refused (a bare "[Errno ..]" naming no directory), in a
    # plain task and under asyncio.gather (asyncio calls that one a _GatheringFuture).
    async def write():
      await async_path.write_text(epath.Path(tmp_path / "missing" / "meta.json"), "{}")
    loop = asyncio.new_event_loop()
    task, gathered = loop.create_task(write()), asyncio.gather(loop.create_task(write()))
    loop.run_until_complete(asyncio.wait([task, gathered]))
    loop.close()
  buffer = io.StringIO()
  handler = logging.StreamHandler(buffer)
  logging.getLogger("asyncio").addHandler(handler)
  try:
    with monkeypatch.context() as before_any_failure:
      before_any_failure.setattr(echoes, "directories", frozenset())
      failed_orbax_writes()
      gc.collect()
    logged = buffer.getvalue()  # what asyncio prints of them: kept while no checkpoint I/O failed
    assert "Task exception was never retrieved" in logged, logged
    assert "_GatheringFuture exception was never retrieved" in logged, logged
    buffer.truncate(0)
    buffer.seek(0)
    failed_task(refused)
    failed_orbax_writes()
    gc.collect()
    assert buffer.getvalue() == ""
    failed_task(other)
    gc.collect()
    assert "Task exception was never retrieved" in buffer.getvalue()
    assert str(other) in buffer.getvalue()
  finally:
    logging.getLogger("asyncio").removeHandler(handler)


class _RaisesWhenCollected:
  def __init__(self, exc: BaseException):
    self.exc = exc

  def __del__(self):
    raise self.exc  # Python hands it to sys.unraisablehook


def _print_errors():
  """Sends the closed-loop error and three near misses through both hooks."""
  for exc in (RuntimeError("Event loop is closed"), RuntimeError("Event loop is closed."),
              ValueError("Event loop is closed"), RuntimeError("something else")):
    sys.excepthook(type(exc), exc, None)
    _RaisesWhenCollected(exc)


def test_closed_loop_tracebacks_are_dropped_and_other_errors_kept(capsys, monkeypatch):
  # tensorstore's threads print "Event loop is closed" through sys.excepthook (PyErr_Print) or
  # sys.unraisablehook while a refused save unwinds; only that exact error is dropped, and only
  # while the filter is installed.
  monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
  monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
  noise_filter = checkpoint._FailedIoNoiseFilter()  # pylint: disable=protected-access
  noise_filter.install()
  _print_errors()
  err = capsys.readouterr().err
  assert "RuntimeError: Event loop is closed\n" not in err
  assert err.count("RuntimeError: Event loop is closed.\n") == 2
  assert err.count("ValueError: Event loop is closed\n") == 2
  assert err.count("RuntimeError: something else\n") == 2
  noise_filter.remove()
  assert sys.excepthook is sys.__excepthook__ and sys.unraisablehook is sys.__unraisablehook__
  _print_errors()
  assert capsys.readouterr().err.count("RuntimeError: Event loop is closed\n") == 2


def test_noise_filter_lives_while_a_checkpointer_is_open(tmp_path, capsys, monkeypatch):
  def previous_except(exc_type, exc, tb):
    print(f"previous: {exc}", file=sys.stderr)
  monkeypatch.setattr(sys, "excepthook", previous_except)
  monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
  closed = RuntimeError("Event loop is closed")
  with checkpoint.Checkpointer(tmp_path / "a") as first:
    assert sys.excepthook is not previous_except
    sys.excepthook(RuntimeError, closed, None)
    sys.excepthook(RuntimeError, RuntimeError("other"), None)  # chained to the previous hook
    assert capsys.readouterr().err == "previous: other\n"
    second = checkpoint.Checkpointer(tmp_path / "b")
    first.close()  # out of order: the second one's hooks stay, and still filter
    sys.excepthook(RuntimeError, closed, None)
    assert capsys.readouterr().err == ""
    second.close()
  assert sys.excepthook is previous_except and sys.unraisablehook is sys.__unraisablehook__
  sys.excepthook(RuntimeError, closed, None)
  assert capsys.readouterr().err == "previous: Event loop is closed\n"

  # A hook installed over an open Checkpointer's keeps working after it closes (the closed one
  # passes everything on).
  third = checkpoint.Checkpointer(tmp_path / "c")
  below = sys.excepthook

  def later_hook(exc_type, exc, tb):
    print("later", file=sys.stderr)
    below(exc_type, exc, tb)
  sys.excepthook = later_hook
  third.close()
  assert sys.excepthook is later_hook
  sys.excepthook(RuntimeError, closed, None)
  assert capsys.readouterr().err == "later\nprevious: Event loop is closed\n"


def test_a_checkpointer_dropped_without_close_takes_its_filter_with_it(tmp_path, monkeypatch):
  # A Checkpointer nobody closes (e.g. `Checkpointer(d).steps()`) must not keep dropping asyncio's
  # and absl's records, nor keep its exception hooks, once it is gone.
  monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
  monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
  loggers = [logging.getLogger(name) for name in ("asyncio", "absl")]
  before = [list(logger.filters) for logger in loggers]
  assert checkpoint.Checkpointer(tmp_path / "a").steps() == []
  gc.collect()
  assert [list(logger.filters) for logger in loggers] == before
  assert sys.excepthook is sys.__excepthook__ and sys.unraisablehook is sys.__unraisablehook__
