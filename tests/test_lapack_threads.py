"""``thor_optax.limit_lapack_threads``: the LAPACK library jaxlib calls on CPU (SciPy's) goes to the
threads asked for and back; other BLAS libraries (NumPy's own OpenBLAS) are left alone."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
import scipy
import scipy.linalg.cython_lapack  # noqa: F401  (loaded, as jaxlib loads it)
import threadpoolctl

import thor_optax

SCIPY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(scipy.__file__))),
                         "scipy")


def _threads() -> dict:
  """filepath -> num_threads of every loaded BLAS library."""
  return {lib["filepath"]: lib["num_threads"] for lib in threadpoolctl.threadpool_info()
          if lib["user_api"] == "blas"}


def _scipy_shipped(threads: dict) -> list:
  return [path for path in threads if os.path.abspath(path).startswith(SCIPY_DIR)]


def test_limits_scipys_lapack_and_restores_it():
  before = _threads()
  shipped = _scipy_shipped(before)
  assert shipped, f"no BLAS library under {SCIPY_DIR} among {list(before)}"
  limiter = thor_optax.limit_lapack_threads()
  try:
    during = _threads()
    assert all(during[path] == 1 for path in shipped), during
    # NumPy's own OpenBLAS (numpy.libs) keeps its threads: host-side NumPy is not slowed.
    others = [path for path in before if path not in shipped]
    assert all(during[path] == before[path] for path in others), (before, during)
    assert limiter.get_original_num_threads()["blas"] == max(before[p] for p in shipped)
    # jaxlib's Cholesky (through that library) still factorizes exactly.
    a = np.array([[4.0, 2.0], [2.0, 3.0]], np.float32)
    np.testing.assert_allclose(np.asarray(jnp.linalg.cholesky(a)), np.linalg.cholesky(a),
                               rtol=1e-6)
  finally:
    limiter.restore_original_limits()
  assert _threads() == before


def test_as_a_context_manager():
  before = _threads()
  shipped = _scipy_shipped(before)
  with thor_optax.limit_lapack_threads():
    assert all(_threads()[path] == 1 for path in shipped)
  assert _threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_rejects_counts_that_are_not_positive_ints(bad):
  with pytest.raises(ValueError, match=r"limit_lapack_threads: num_threads must be an int >= 1"):
    thor_optax.limit_lapack_threads(bad)
