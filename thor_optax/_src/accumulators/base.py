"""The interface of a factor accumulator: what a check step's covariances become.

An accumulator takes the covariances of the blocks a check step recomputes and gives the source
the inverse method inverts and the blocks to invert (:meth:`FactorAccumulator.accumulate`). It
declares what it provides to the other pieces: ``'covariance'`` always; ``'rows'`` when the
factor is the current batch's (so Woodbury can invert from the rows behind it); ``'stored
factors'`` when factors outlive the check step. Its per-block state lives in the block stack
(``state.blocks[group]['accumulator']``), its global state in ``KroneckerState.accumulator``.
"""

from __future__ import annotations

import abc

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax


class Accumulated(NamedTuple):
  """What :meth:`FactorAccumulator.accumulate` gives (fields ``(n, ...)``).

  Attributes:
    source: ``(n, b, b)`` the blocks the inverse method inverts.
    invert: ``(n,)`` bool, the blocks to invert now.
    factor_set: ``(n,)`` bool, blocks whose factor changed (their reference trace is reset)
      once the inversions are known; ``None``: those actually inverted.
    state: per-block state after accumulation (``None``: stateless).
  """

  source: jax.Array
  invert: jax.Array
  factor_set: Optional[jax.Array]
  state: Any


class FactorAccumulator(abc.ABC):
  """Turns a check step's covariances into the factors that are inverted."""

  provides: frozenset[str] = frozenset({"covariance"})
  requires: frozenset[str] = frozenset()
  stores_factors: bool = False

  def describe(self) -> str:
    return type(self).__name__

  def init(self, block: int, num_blocks: int, dtype: jnp.dtype) -> Optional[NamedTuple]:
    """Per-block state of a stack (``None``: stateless)."""
    del block, num_blocks, dtype
    return None

  def init_global(self) -> NamedTuple:
    """State shared by every stack (``optax.EmptyState()``: none)."""
    return optax.EmptyState()

  def replaces(self, rows: int, block: int) -> bool:
    """Whether a block of dimension ``block`` formed from ``rows`` rows replaces its stored
    factor instead of being averaged into it (static; stateless accumulators: always)."""
    del rows, block
    return True

  def inverts_now(self, state: Any, count: jax.Array) -> jax.Array:
    """Whether this check step inverts at all (scalar bool)."""
    del state, count
    return jnp.asarray(True)

  @abc.abstractmethod
  def accumulate(self, covariance: jax.Array, update: jax.Array, never: jax.Array, state: Any,
                 invert_now: jax.Array) -> Accumulated:
    """The factors to invert from the covariances ``(n, b, b)`` of the blocks in ``update``
    (``never``: blocks whose new covariance replaces the stored factor: never refreshed, or
    formed from enough rows, :meth:`replaces`)."""

  def after_inversion(self, state: Any, refreshed: jax.Array) -> Any:
    """Per-block state once the blocks in ``refreshed`` are inverted."""
    del refreshed
    return state

  def update_global(self, state: NamedTuple, invert_now: jax.Array,
                    count: jax.Array) -> NamedTuple:
    del invert_now, count
    return state

  def blend(self, old: jax.Array, new: jax.Array, first: jax.Array) -> jax.Array:
    """A stored factor after one more observation (side curvature); default: ``new``."""
    del old, first
    return new
