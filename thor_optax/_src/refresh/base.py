"""The interface of a refresh policy: which factor blocks a check step recomputes.

A policy sees, per block stack, the damped trace of every block now and at its last refresh
(``trace_ref``, 0 for never), and chooses the blocks to recompute (:meth:`RefreshPolicy.select`);
a policy that compares covariances (SP-NGD's adaptive interval) confirms the choice once the
covariances are formed (:meth:`RefreshPolicy.confirm`). Its per-block state lives in the block
stack (``state.blocks[group]['policy']``) and holds only what the policy needs.

Every policy reports the relative damped-trace change of each block (:func:`trace_change`), the
quantity of THOR's trace rule, for the diagnostics.
"""

from __future__ import annotations

import abc

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp


def trace_change(trace_now: jax.Array, trace_ref: jax.Array, frozen: jax.Array,
                 valid: jax.Array) -> jax.Array:
  """``(n,)`` ``|tr_now - tr_ref| / tr_ref`` (0 where never refreshed, frozen or not valid)."""
  never = trace_ref <= 0
  safe_ref = jnp.where(never, 1.0, trace_ref)
  ratio = jnp.abs(trace_now - trace_ref) / safe_ref
  return jnp.where(never | frozen | ~valid, 0.0, ratio)


class Selection(NamedTuple):
  """A policy's choice at one check step (fields ``(n,)``).

  Attributes:
    refresh: blocks to recompute.
    ratio: relative damped-trace change (:func:`trace_change`).
    state: the policy's per-block state after the choice (``None`` for a stateless policy).
  """

  refresh: jax.Array
  ratio: jax.Array
  state: Any


class RefreshPolicy(abc.ABC):
  """Chooses the blocks a check step recomputes.

  Attributes:
    requires: what other pieces must provide (``'stored factors'``: a factor accumulator that
      keeps the factors between check steps).
    provides: what the policy provides.
  """

  requires: frozenset[str] = frozenset()
  provides: frozenset[str] = frozenset()

  def describe(self) -> str:
    return type(self).__name__

  def init(self, num_blocks: int, dtype: jnp.dtype) -> Optional[NamedTuple]:
    """The per-block state of a stack of ``num_blocks`` (``None``: stateless)."""
    del num_blocks, dtype
    return None

  @abc.abstractmethod
  def select(self, trace_now: jax.Array, trace_ref: jax.Array, state: Any, valid: jax.Array,
             count: jax.Array) -> Selection:
    """The blocks to recompute from the damped traces ``(n,)``; ``valid``: finite statistics."""

  def confirm(self, selected: jax.Array, covariance: jax.Array, factor: jax.Array,
              never: jax.Array, state: Any, count: jax.Array) -> tuple[jax.Array, Any]:
    """The selected blocks whose stored factor is replaced, given their new covariances
    ``(n, b, b)`` and the stored factors; default: all of them."""
    del covariance, factor, never, count
    return selected, state

  def frozen(self, state: Any, num_blocks: int) -> jax.Array:
    """``(n,)`` bool, blocks never to be refreshed again (diagnostics)."""
    del state
    return jnp.zeros((num_blocks,), bool)
