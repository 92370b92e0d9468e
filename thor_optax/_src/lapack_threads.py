"""Threads of the LAPACK library that JAX's CPU backend calls: one, so that its idle workers do not
spin on the cores XLA's own thread pool needs.

On CPU, jaxlib runs the factorizations of a check step (Cholesky, triangular solves, eigh) through
the LAPACK that SciPy links (``scipy.linalg.cython_lapack``; the OpenBLAS of SciPy's wheels). After
each call, OpenBLAS keeps its worker threads busy-waiting for new work for about ``2**28`` cycles
(``OPENBLAS_THREAD_TIMEOUT``'s default; OpenBLAS issue 5171), about 0.1 s. During that time they
hold the cores that XLA's thread pool runs the next steps on. Measured on the MNIST MLP of
``benchmarks/mnist.py`` (2-core CPU, checks every 5 to 50 steps): THOR's plain steps took 7-8 ms
for up to about 12 steps after each check against 4.1 ms with one LAPACK thread, and the check
step itself 17-20 ms against 11-14 ms (benchmarks/README.md, "The default run"). On one thread a
128-block takes tens of microseconds (SciPy's ``spotrf`` 36 us, ``strsm`` for its inverse 61-75 us),
and jaxlib calls one block at a time on CPU (``linalg.lapack_safe``), so more threads gain little.

The limit is process-wide (a C library's setting): SciPy's own ``scipy.linalg`` calls in the same
process run on one thread too while it holds. :func:`limit_lapack_threads` leaves it to the user
(the optimizers never change it), as ``threadpoolctl`` does.

References:
  threadpoolctl (https://github.com/joblib/threadpoolctl): finds the loaded BLAS / LAPACK
  libraries and sets their thread counts.
  OpenBLAS issue 5171, "perf report shows most cycles spent in blas_thread_server".
"""

from __future__ import annotations

import os

import threadpoolctl


def _scipy_libraries() -> threadpoolctl.ThreadpoolController:
  """The loaded BLAS / LAPACK libraries that SciPy ships (its wheels put them in ``scipy.libs``
  beside the package); all BLAS libraries if SciPy links a shared one (conda, system packages),
  which then also serves NumPy."""
  import scipy  # a dependency of jax; imported here, when the limit is asked for
  import scipy.linalg.cython_lapack  # noqa: F401  (loads the library jaxlib calls)
  site = os.path.dirname(os.path.dirname(os.path.abspath(scipy.__file__)))
  # Listed after the import: threadpoolctl sees the libraries loaded when it is created.
  blas = threadpoolctl.ThreadpoolController().select(user_api="blas")
  shipped = [lib for lib in blas.lib_controllers
             if os.path.abspath(lib.filepath).startswith(os.path.join(site, "scipy"))]
  return blas.select(filepath=[lib.filepath for lib in shipped]) if shipped else blas


def limit_lapack_threads(num_threads: int = 1) -> threadpoolctl.ThreadpoolLimiter:
  """Limits the LAPACK library that JAX's CPU backend calls to ``num_threads`` threads.

  Call it once before training on CPU (it changes nothing on GPU or TPU, whose factorizations do
  not go through it). The returned limiter restores the previous thread counts on
  ``restore_original_limits()`` or at the end of a ``with`` block::

    thor_optax.limit_lapack_threads()            # for the whole process
    with thor_optax.limit_lapack_threads():      # or for a block
      train()

  Args:
    num_threads: threads for the library (``>= 1``); 1 stops its idle workers from spinning on
      the cores XLA's thread pool uses.

  Returns:
    a ``threadpoolctl.ThreadpoolLimiter`` over the libraries it limited: the OpenBLAS that SciPy's
    wheels ship (what ``scipy.linalg.cython_lapack``, and through it jaxlib, calls), or every
    loaded BLAS library if SciPy links a shared one. ``limiter.get_original_num_threads()``
    gives the counts before.

  Raises:
    ValueError: if ``num_threads`` is not an int ``>= 1``.

  Source: OpenBLAS issue 5171 (idle workers busy-wait ``2**OPENBLAS_THREAD_TIMEOUT`` cycles);
  measured in benchmarks/README.md, "The default run" (THOR's plain step 1.6-1.9x SGD's instead of
  2.6-2.8x in the MNIST MLP's training loop).
  """
  if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
    raise ValueError(
        f"thor_optax.limit_lapack_threads: num_threads must be an int >= 1, got {num_threads!r}.")
  return _scipy_libraries().limit(limits=num_threads)
