"""Shared pytest set-up."""

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# ../shared/data beside the repository (see its README); tests read real data from here.
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
  if not SHARED_DATA.is_dir():
    pytest.skip(f"{SHARED_DATA} not found: the shared data folder must sit beside the repository")
  return SHARED_DATA
