"""THOR's trace rule: which factor blocks are refreshed, kept stale, or frozen for good.

At a check step, every factor block ``F_j`` (a diagonal block of ``A`` or ``G``) compares
its damped trace now with the damped trace it had when it was last refreshed:

    ratio_j = | tr(F_j + d_j I) - tr(F_j' + d_j' I) | / tr(F_j' + d_j' I)

  * ``ratio_j >= omega1``          refresh: recompute the covariance block and its inverse;
  * ``omega2 <= ratio_j < omega1`` keep: reuse the stale inverse;
  * ``ratio_j < omega2``           freeze: never refresh this block again.

Thresholds ``(0, 0)`` refresh every block at every check (THOR_NT, i.e. plain K-FAC);
``(0.01, 0)`` is THOR; ``(0.01, 0.001)`` is THOR_stop. A block never refreshed (reference trace
0) is always refreshed. The paper's refresh interval is open, ``(omega1, inf)``; using
``>= omega1`` makes ``omega1 = 0`` mean "always refresh", which the paper's THOR_NT setting
intends.

The trace cannot see a block whose covariance turns without changing its trace. The input of a
layer after a LayerNorm or RMSNorm has a trace pinned by the normalization: every row of
``LayerNorm(x)`` with unit scale has squared norm ``d``, so each ``A`` block of a pre-LN
transformer's attention and MLP inputs keeps its trace while its covariance changes, and the
rule never refreshes it after its first check (measured on ``benchmarks/lm.py``: the 9 such
blocks of its 53 were refreshed at the first of 46 checks only). ``max_stale_checks = K`` (not
in the paper) bounds that: a live block skipped at ``K`` checks in a row is refreshed at the
next one, whatever its trace; ``K = 0`` refreshes every block at every check.

Block traces cost ``O(R d)`` from the layer's rows (``blocks.block_traces``), so the decision is
made before any covariance is formed.

References:
  Chen et al., "THOR", AAAI 2021, section "Trace-based update rule" (MindSpore docs
  ``thor/intro.md``, eq. for Delta and Figure 4's settings).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src.refresh import base


class TraceDecision(NamedTuple):
  """Outcome of the trace rule for a stack of ``n`` blocks (all fields ``(n,)``).

  Attributes:
    refresh: blocks to recompute.
    freeze: blocks that enter the frozen regime at this check.
    ratio: relative damped-trace change (0 where the block was never refreshed or is frozen).
  """

  refresh: jax.Array
  freeze: jax.Array
  ratio: jax.Array


def trace_rule(trace_now: jax.Array, trace_ref: jax.Array, frozen: jax.Array,
               valid: jax.Array, omega1: float, omega2: float) -> TraceDecision:
  """Applies THOR's three regimes per block.

  Args:
    trace_now: ``(n,)`` damped traces at this check.
    trace_ref: ``(n,)`` damped traces at each block's last refresh (0: never refreshed).
    frozen: ``(n,)`` bool, blocks already frozen.
    valid: ``(n,)`` bool, blocks whose statistics are finite at this check (others are left
      alone: not refreshed, not frozen).
    omega1: refresh threshold (``>= 0``).
    omega2: freeze threshold (``0 <= omega2 <= omega1``).

  Returns:
    :class:`TraceDecision`.
  """
  never = trace_ref <= 0
  ratio = base.trace_change(trace_now, trace_ref, frozen, valid)
  live = valid & ~frozen
  refresh = live & (never | (ratio >= omega1))
  freeze = live & ~never & (ratio < omega2)
  return TraceDecision(refresh=refresh, freeze=freeze, ratio=ratio)


def check_thresholds(omega1: float, omega2: float) -> None:
  """Raises ValueError unless ``0 <= omega2 <= omega1``."""
  if not (0.0 <= omega2 <= omega1):
    raise ValueError(
        f"trace thresholds must satisfy 0 <= omega2 <= omega1, got omega1={omega1}, "
        f"omega2={omega2}")


def check_max_stale(max_stale_checks) -> None:
  """Raises ValueError unless ``max_stale_checks`` is ``None`` or a Python int ``>= 0``."""
  if max_stale_checks is None:
    return
  if (isinstance(max_stale_checks, (bool, np.bool_))
      or not isinstance(max_stale_checks, numbers.Integral) or max_stale_checks < 0):
    raise ValueError(
        "thor_optax (refresh/trace_rule.py): max_stale_checks must be None or a Python int "
        f">= 0 (checks a block may be skipped in a row; under optax.inject_hyperparams list "
        f"it in static_args), got {max_stale_checks!r}")


class TraceRuleState(NamedTuple):
  """The trace rule's per-block state.

  Attributes:
    frozen: ``(n,)`` bool, blocks in THOR's frozen regime.
  """

  frozen: jax.Array


class BoundedTraceRuleState(NamedTuple):
  """The trace rule's per-block state with ``max_stale_checks``.

  Attributes:
    frozen: ``(n,)`` bool, blocks in THOR's frozen regime.
    skipped: ``(n,)`` int32, checks in a row at which each live block was not selected.
  """

  frozen: jax.Array
  skipped: jax.Array


class TraceRule(base.RefreshPolicy):
  """THOR's trace rule with thresholds ``(omega1, omega2)`` and an optional bound on how many
  checks in a row a live block may be skipped (``max_stale_checks``; validated on
  construction)."""

  def __init__(self, omega1: float, omega2: float, max_stale_checks: Optional[int] = None):
    check_thresholds(omega1, omega2)
    check_max_stale(max_stale_checks)
    self.omega1, self.omega2 = float(omega1), float(omega2)
    self.max_stale_checks = max_stale_checks

  def describe(self) -> str:
    bound = ("" if self.max_stale_checks is None
             else f", max_stale_checks={self.max_stale_checks}")
    return f"trace_thresholds=({self.omega1}, {self.omega2}){bound}"

  def init(self, num_blocks, dtype):
    del dtype
    frozen = jnp.zeros((num_blocks,), bool)
    if self.max_stale_checks is None:
      return TraceRuleState(frozen=frozen)
    return BoundedTraceRuleState(frozen=frozen, skipped=jnp.zeros((num_blocks,), jnp.int32))

  def select(self, trace_now, trace_ref, state, valid, count):
    del count
    d = trace_rule(trace_now, trace_ref, state.frozen, valid, self.omega1, self.omega2)
    frozen = state.frozen | d.freeze
    if self.max_stale_checks is None:
      return base.Selection(refresh=d.refresh, ratio=d.ratio,
                            state=TraceRuleState(frozen=frozen))
    live = valid & ~frozen
    refresh = d.refresh | (live & (state.skipped >= self.max_stale_checks))
    # A selected block starts over; a live block left alone counts one more skipped check;
    # a block with invalid statistics at this check, or frozen, keeps its count.
    skipped = jnp.where(refresh, 0, jnp.where(live, state.skipped + 1, state.skipped))
    return base.Selection(refresh=refresh, ratio=d.ratio,
                          state=BoundedTraceRuleState(frozen=frozen, skipped=skipped))

  def frozen(self, state, num_blocks):
    del num_blocks
    return state.frozen
