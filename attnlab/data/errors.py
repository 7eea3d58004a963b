"""Errors raised by the data layer (defined in attnlab/errors.py, importable from here too).

DataError is a UserError, so every command-line tool prints it as one line (no traceback) and exits
non-zero.
"""

from attnlab.errors import DataError
from attnlab.errors import DataFormatError
from attnlab.errors import DatasetNotFoundError
from attnlab.errors import UserError

__all__ = ["DataError", "DataFormatError", "DatasetNotFoundError", "UserError"]
