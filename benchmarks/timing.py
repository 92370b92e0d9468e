"""Wall-clock timing shared by the benchmark scripts."""

from __future__ import annotations

import time
from typing import Any, Callable


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
  """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls, after one warm-up
  (compiling) call; every call is waited for with ``jax.block_until_ready``."""
  import jax  # pylint: disable=import-outside-toplevel  (scaling.py sets XLA flags first)
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  times.sort()
  return 1e3 * times[len(times) // 2]
