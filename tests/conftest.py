"""Shared pytest set-up."""

import contextlib
import importlib.util
import logging
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# Scripts and CLIs the tests start in a subprocess import attnlab from this checkout, installed
# or not (one place for every test that runs one).
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def pytest_configure(config):
  """Starts JAX's backends with JAX's own device count before any test runs. The trainer's
  default `mesh.cpu_devices=-1` splits a CPU-only process into one device per core only while
  JAX has not started; tests that train in this process therefore run on one device whatever test
  happens to come first (tests of the split start fresh processes: test_parallel.py)."""
  del config
  import jax  # pylint: disable=g-import-not-at-top
  jax.devices()
  # The tests compare float32 results with float64 NumPy references, with margins set for exact
  # float32 products. A GPU multiplies float32 in TF32 by default (about 1e-3 relative error: 84
  # tests failed on an H200); full precision there keeps the margins meaningful.
  if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")
  # The tests' own compiles go to the persistent compilation cache too, as the trainer's runs do
  # (the user's cache folder; ATTNLAB_COMPILATION_CACHE=0 turns it off): a second suite run loads
  # the programs that took 0.1 s or more to compile instead of compiling them again.
  from attnlab import parallel  # pylint: disable=g-import-not-at-top
  parallel.enable_compilation_cache()


# ../shared/data beside the repository (see its README); tests read real data from here.
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
  if not SHARED_DATA.is_dir():
    pytest.skip(f"{SHARED_DATA} not found: the shared data folder must sit beside the repository")
  return SHARED_DATA


@pytest.fixture(scope="session")
def numbered_corpus():
  """numbered_corpus(seed, num_documents) -> (documents, owner): documents of 1-4 sentences whose
  sentence g is [7 + g, 7 + g], and owner[7 + g] = (document, index), so a pair's sentences can
  be identified."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  def make(seed: int, num_documents: int):
    rng = np.random.default_rng(seed)
    documents, owner, g = [], {}, 0
    for d in range(num_documents):
      doc = []
      for _ in range(int(rng.integers(1, 5))):
        doc.append([7 + g, 7 + g])
        owner[7 + g] = (d, len(doc) - 1)
        g += 1
      documents.append(doc)
    return documents, owner
  return make


@pytest.fixture(autouse=True)
def _attnlab_logs_reach_caplog(monkeypatch):
  """Each test starts with the "attnlab" logger propagating to the root logger, where caplog
  listens: attnlab.cli.tool.setup_logging (run in this process by an earlier test of a command or
  a study script) turns propagation off so that a command prints each line once."""
  monkeypatch.setattr(logging.getLogger("attnlab"), "propagate", True)


@pytest.fixture(scope="session")
def recording_pretrained_load():
  """A context manager: inside it, the causal LM's `load_pretrained` records each step-0
  parameter tree it returns (a host copy) in the list it yields."""
  @contextlib.contextmanager
  def recording():
    import jax  # pylint: disable=g-import-not-at-top
    from attnlab.tasks import causal_lm  # pylint: disable=g-import-not-at-top
    load, step0 = causal_lm.CausalLMTask.load_pretrained, []

    def recorded(self, params, pretrained_config, pretrained_params):
      out = load(self, params, pretrained_config, pretrained_params)
      step0.append(jax.device_get(out))
      return out
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(causal_lm.CausalLMTask, "load_pretrained", recorded)
      yield step0
  return recording


def load_script(path: pathlib.Path, name: str):
  """A study script (experiments/*/run.py, not a package) imported as module `name`."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="session")
def script_loader():
  """`load_script` for tests: `study = script_loader(SCRIPT, "name")`."""
  return load_script
