"""THOR's and SKFAC's factors: the current batch's covariances, nothing stored between checks.

References:
  Chen et al., "THOR", AAAI 2021 (factors of the current batch only).
"""

from __future__ import annotations

from thor_optax._src.accumulators import base


class CurrentBatch(base.FactorAccumulator):
  """Inverts the covariances of the blocks recomputed at this check step; stores no factor."""

  provides = frozenset({"covariance", "rows"})

  def accumulate(self, covariance, update, never, state, invert_now):
    del never, invert_now
    return base.Accumulated(source=covariance, invert=update, factor_set=None, state=state)
