"""The `attnlab` console script's end (attnlab.cli.console, issue #51): the process leaves with
the command's exit status and everything it printed, without the interpreter's teardown (JAX's
exit hook took 0.5 s of every run's end)."""

import subprocess
import sys
import textwrap

import pytest

# A command run through `console` in a fresh process, with an exit hook of its own that prints a
# line if the interpreter's teardown runs, and a buffered line printed before the command.
SCRIPT = textwrap.dedent("""
    import atexit, sys
    atexit.register(lambda: print("TEARDOWN RAN", flush=True))
    print("before the command")  # left in stdout's buffer (a pipe): console must flush it
    sys.argv = ["attnlab", *sys.argv[1:]]
    from attnlab.cli import console
    console()
""")


@pytest.mark.parametrize("args, status, stream, expected", [
    (["help"], 0, "stdout", "usage: attnlab <command>"),
    (["no-such-command"], 2, "stderr", "attnlab: unknown command 'no-such-command'"),
    (["inspect", "--workdir=/nonexistent/run"], 2, "stderr", "/nonexistent/run does not exist"),
])
def test_console_exits_with_the_status_and_output_and_skips_the_teardown(args, status, stream,
                                                                         expected):
  proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True,
                        timeout=120, check=False)
  assert proc.returncode == status, (proc.stdout, proc.stderr)
  assert proc.stdout.startswith("before the command\n")
  assert expected in getattr(proc, stream)
  assert "TEARDOWN RAN" not in proc.stdout + proc.stderr


def test_python_m_attnlab_cli_goes_through_console():
  proc = subprocess.run([sys.executable, "-m", "attnlab.cli", "help"], capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 0 and proc.stdout.startswith("usage: attnlab <command>")
