"""SP-NGD's adaptive refresh: each block has its own interval, lengthened while it stays similar.

At a check step a block whose next refresh step has come forms its new covariance ``X`` and
compares it with its stored factor ``X'``: if ``||X - X'||_F / ||X'||_F < tol`` the block is
*similar*: nothing is stored or inverted and its interval doubles (capped at
``max_refresh_interval``); otherwise ``X`` is accumulated and inverted and the interval resets
to 1. The block is next due ``interval`` steps later; blocks not due cost neither a covariance
nor an inversion. Needs the stored factors of a running-average accumulator.

References:
  Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020, section "Adaptive
  frequency to refresh statistics" (the rule above is our reading of it).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from thor_optax._src import static_args
from thor_optax._src.refresh import base


class AdaptiveState(NamedTuple):
  """Per-block state of the adaptive refresh.

  Attributes:
    next_refresh: ``(n,)`` int32, the step from which a block is due again.
    refresh_interval: ``(n,)`` int32, each block's current interval in steps.
  """

  next_refresh: jax.Array
  refresh_interval: jax.Array


class Adaptive(base.RefreshPolicy):
  """SP-NGD's adaptive interval with tolerance ``tol`` and cap ``max_refresh_interval``."""

  requires = frozenset({"stored factors"})

  def __init__(self, tol: float, max_refresh_interval: int):
    for name, value in (("adaptive_refresh", tol), ("max_refresh_interval", max_refresh_interval)):
      if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(
            f"{name} must be a Python number, got {value!r}. It decides in Python which blocks "
            "a check refreshes, so it cannot be a traced value: " + static_args.hint())
    if not tol > 0:
      raise ValueError(f"adaptive_refresh must be a positive tolerance or None, got {tol}")
    if max_refresh_interval < 1:
      raise ValueError(f"max_refresh_interval must be >= 1, got {max_refresh_interval}")
    self.tol, self.max_refresh_interval = tol, int(max_refresh_interval)

  def describe(self) -> str:
    return f"adaptive_refresh={self.tol}"

  def init(self, num_blocks, dtype):
    del dtype
    return AdaptiveState(next_refresh=jnp.zeros((num_blocks,), jnp.int32),
                         refresh_interval=jnp.ones((num_blocks,), jnp.int32))

  def select(self, trace_now, trace_ref, state, valid, count):
    ratio = base.trace_change(trace_now, trace_ref, jnp.zeros_like(valid), valid)
    return base.Selection(refresh=valid & (count >= state.next_refresh), ratio=ratio,
                          state=state)

  def confirm(self, selected, covariance, factor, never, state, count):
    n = factor.shape[0]
    change = (jnp.linalg.norm((covariance - factor).reshape(n, -1), axis=1)
              / jnp.maximum(jnp.linalg.norm(factor.reshape(n, -1), axis=1),
                            jnp.finfo(factor.dtype).tiny))
    similar = ~never & (change < self.tol)
    interval = jnp.where(
        selected, jnp.where(similar, jnp.minimum(2 * state.refresh_interval,
                                                 self.max_refresh_interval), 1),
        state.refresh_interval)
    next_refresh = jnp.where(selected, count + interval, state.next_refresh)
    return selected & ~similar, AdaptiveState(next_refresh, interval)
