"""`python -m attnlab.cli <command> [flags]`: the `attnlab` console script as a module."""

import sys

from attnlab.cli import main

sys.exit(main())
