"""Old import path of the data layer's errors, kept so that code written against it still imports;
they are defined in attnlab/errors.py, where attnlab itself imports them from."""

from attnlab.errors import DataError
from attnlab.errors import DataFormatError
from attnlab.errors import DatasetNotFoundError

__all__ = ["DataError", "DataFormatError", "DatasetNotFoundError"]
