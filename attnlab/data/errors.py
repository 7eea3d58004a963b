"""Errors raised by the data layer; each message is one line that says how to fix it.

DataError is a config_utils.UserError, so every command-line tool prints it as one line (no
traceback) and exits non-zero.
"""

from attnlab.config_utils import UserError


class DataError(UserError):
  """Bad data or a bad data request (malformed file, empty split, unknown name)."""


class DataFormatError(DataError):
  """A raw dataset file does not have the expected format; the message names file and line."""


class DatasetNotFoundError(DataError, FileNotFoundError):
  """A dataset's raw file is neither available locally nor downloadable."""
