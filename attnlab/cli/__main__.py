"""`python -m attnlab.cli <command> [flags]`: the `attnlab` console script as a module."""

from attnlab.cli import console

console()
