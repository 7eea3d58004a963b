"""Errors raised by the data layer; each message is one line that says how to fix it."""


class DataError(ValueError):
  """Bad data or a bad data request (malformed file, empty split, unknown name)."""


class DataFormatError(DataError):
  """A raw dataset file does not have the expected format; the message names file and line."""


class DatasetNotFoundError(DataError, FileNotFoundError):
  """A dataset's raw file is neither available locally nor downloadable."""
