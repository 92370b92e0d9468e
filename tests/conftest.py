"""Four host CPU devices in every test process, so the sharding tests have a mesh without a GPU.

The flag is read when JAX's CPU backend starts, which happens at the first device use, after
this file is imported; single-device tests run on device 0 as before.
"""

import os
import shutil
import tempfile

import pytest

NUM_HOST_DEVICES = 4

_flag = f"--xla_force_host_platform_device_count={NUM_HOST_DEVICES}"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# JAX's persistent compilation cache, in one directory for this run's workers and the
# subprocesses they start (notebooks, the checkpoint resume): tests compile the same programs
# many times (each test jits its own lambdas around the same update, a resumed run compiles the
# steps of the run before it), and the cache keys on the compiled program, so a repeat costs a
# file read instead of a compile.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="thor_optax_jax_cache_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture
def fast_compiles():
  """XLA's cheaper optimization levels for a test's compilations (they dominate the time of
  tests that compile steps several times), restored afterwards. Use with
  ``pytestmark = pytest.mark.usefixtures("fast_compiles")``."""
  import jax  # pylint: disable=import-outside-toplevel  (after the flag above is set)
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)



def pytest_unconfigure(config):
  """Removes the compilation cache this run made (in the main process, after its workers)."""
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
  if (not hasattr(config, "workerinput") and os.path.basename(cache).startswith(
      "thor_optax_jax_cache_") and os.path.dirname(cache) == tempfile.gettempdir()):
    shutil.rmtree(cache, ignore_errors=True)
