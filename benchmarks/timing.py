"""Wall-clock timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
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
  return 1e3 * statistics.median(times)


def interleaved_ms(fns: dict[str, Callable[[], Any]], repeats: int,
                   rounds: int = 5) -> dict[str, float]:
  """Median wall time in milliseconds of each of ``fns`` (name -> zero-argument call), timed
  in ``rounds`` alternating rounds of ``repeats`` calls each after one warm-up call apiece, so
  that a change in the machine's load during the measurement touches every function alike."""
  import jax  # pylint: disable=import-outside-toplevel
  for fn in fns.values():
    jax.block_until_ready(fn())
  times: dict[str, list] = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times[name].append(time.perf_counter() - t0)
  return {name: 1e3 * statistics.median(t) for name, t in times.items()}
