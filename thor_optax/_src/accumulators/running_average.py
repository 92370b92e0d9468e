"""K-FAC's and KAISA's factors: running averages kept in the state, inverted every
``inverse_period`` steps.

At a check step each recomputed block's factor becomes ``decay * old + (1 - decay) * new``
(``new`` for a block never refreshed), and is marked *stale* (newer than its inverse); the
stale blocks are inverted when at least ``inverse_period`` steps have passed since the last
inversion (KAISA's decoupled factor and inverse update periods). ``decay=0`` keeps the newest
factor, which SP-NGD's adaptive refresh compares against.

References:
  Martens & Grosse, K-FAC, ICML 2015, section 5 (running averages of the factors).
  Pauloski et al., "KAISA", SC 2021 (``factor_decay``, ``inv_update_steps``).
"""

from __future__ import annotations

from math import inf
import numbers
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src import static_args
from thor_optax._src.accumulators import base

Period = Union[int, Callable[[jax.Array], jax.Array]]


class FactorState(NamedTuple):
  """Per-block state of the running average.

  Attributes:
    factor: ``(n, b, b)`` stored factor blocks (zeros before the first refresh).
    stale: ``(n,)`` bool, stored factor newer than its inverse.
  """

  factor: jax.Array
  stale: jax.Array


class InversePeriodState(NamedTuple):
  """Global state of the running average.

  Attributes:
    next_inverse: int32, the step from which the next check step inverts.
  """

  next_inverse: jax.Array


def period_steps(period: Period, count: jax.Array) -> jax.Array:
  """An int or a schedule of the step, as an int32 number of steps ``>= 1``."""
  value = period(count) if callable(period) else period
  return jnp.maximum(1, jnp.round(jnp.asarray(value, jnp.float32))).astype(jnp.int32)


def _python_or_numpy_real(value) -> bool:
  """A Python or numpy real scalar (not a bool, not an array that a trace may make abstract)."""
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


class RunningAverage(base.FactorAccumulator):
  """Running averages with EMA decay ``decay`` (0: newest only), inverted every
  ``inverse_period`` steps (an int ``>= 1`` or a schedule of the step).

  ``rows_ratio``: ``None`` averages every block; a number ``k > 0`` averages only the blocks
  formed from fewer than ``k`` rows per dimension (``rows < k * min(d, b)``), the others
  replace their stored factor. A sample covariance of ``R`` rows in ``d`` dimensions has rank
  at most ``R``, and for ``R >= k d`` its eigenvalues stay above about ``(1 - 1/sqrt(k))^2``
  times their mean (Marchenko-Pastur, isotropic rows: 1/4 for ``k = 4``), so such a block is
  well conditioned from one batch; a block from fewer rows is near-singular and needs the
  directions earlier batches saw."""

  provides = frozenset({"covariance", "stored factors"})
  stores_factors = True

  def __init__(self, decay: float, inverse_period: Period, rows_ratio: Optional[float] = None):
    static = ("It decides the state's layout and the inversion steps in Python, so it cannot "
              "be a traced value: " + static_args.hint())
    if not _python_or_numpy_real(decay):
      raise ValueError(f"ema_decay must be a Python float in [0, 1) or None, got {decay!r}. "
                       + static)
    if not 0.0 <= decay < 1.0:
      raise ValueError(f"ema_decay must be in [0, 1) or None, got {decay}")
    if isinstance(inverse_period, bool) or not (
        callable(inverse_period)
        or (isinstance(inverse_period, numbers.Integral) and inverse_period >= 1)):
      raise ValueError(f"inverse_period must be an int >= 1 or a schedule of the step, got "
                       f"{inverse_period!r}. " + static)
    if rows_ratio is not None and not (_python_or_numpy_real(rows_ratio)
                                       and 0 < rows_ratio < inf):
      raise ValueError(f"ema_rows_ratio must be None or a positive Python number, got "
                       f"{rows_ratio!r}. It decides in Python which blocks are averaged: "
                       + static_args.hint())
    self.decay, self.inverse_period, self.rows_ratio = float(decay), inverse_period, rows_ratio

  def describe(self) -> str:
    return "stored factors (ema_decay, an inverse_period other than 1, or adaptive_refresh)"

  def replaces(self, rows, block):
    return self.rows_ratio is not None and rows >= self.rows_ratio * block

  def init(self, block, num_blocks, dtype):
    return FactorState(factor=jnp.zeros((num_blocks, block, block), dtype),
                       stale=jnp.zeros((num_blocks,), bool))

  def init_global(self):
    return InversePeriodState(next_inverse=jnp.zeros((), jnp.int32))

  def inverts_now(self, state, count):
    return count >= state.next_inverse

  def blend(self, old, new, first):
    """``decay * old + (1 - decay) * new``; ``new`` where ``first``."""
    first = first.reshape(first.shape + (1,) * (new.ndim - first.ndim))
    return jnp.where(first, new, self.decay * old + (1.0 - self.decay) * new)

  def accumulate(self, covariance, update, never, state, invert_now):
    factor = jnp.where(update[:, None, None], self.blend(state.factor, covariance, never),
                       state.factor)
    stale = state.stale | update
    return base.Accumulated(source=factor, invert=stale & invert_now, factor_set=update,
                            state=FactorState(factor, stale))

  def after_inversion(self, state, refreshed):
    return FactorState(state.factor, state.stale & ~refreshed)

  def update_global(self, state, invert_now, count):
    return InversePeriodState(jnp.where(invert_now, count + period_steps(self.inverse_period,
                                                                        count),
                                        state.next_inverse))
