"""The errors of the data layer, defined in attnlab/errors.py (where new code imports them from)."""

from attnlab.errors import DataError
from attnlab.errors import DataFormatError
from attnlab.errors import DatasetNotFoundError

__all__ = ["DataError", "DataFormatError", "DatasetNotFoundError"]
