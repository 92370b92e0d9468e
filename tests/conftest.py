"""Four host CPU devices in every test process, so the sharding tests have a mesh without a GPU.

The flag is read when JAX's CPU backend starts, which happens at the first device use, after
this file is imported; single-device tests run on device 0 as before.
"""

import os

import pytest

NUM_HOST_DEVICES = 4

_flag = f"--xla_force_host_platform_device_count={NUM_HOST_DEVICES}"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()


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
