"""``inverse_method='auto'``: per factor, Woodbury when it has fewer rows than block
dimensions, Cholesky otherwise (SKFAC's choice, made from static shapes).

A factor of the current batch with ``m < b`` rows is inverted by Woodbury (an ``m x m``
Cholesky); every other factor, and every factor of an accumulator that keeps no rows (running
average, inverse period, adaptive refresh), by a batched ``b x b`` Cholesky. Both give dense
damped inverse blocks; with ``woodbury_rows=m`` the groups whose low-rank form is smaller keep
it (:mod:`.low_rank`, which then needs the current batch's rows).

References:
  Tang et al., "SKFAC", CVPR 2021.
"""

from __future__ import annotations

from thor_optax._src.inverses import base
from thor_optax._src.inverses import woodbury


class Auto(woodbury.Woodbury):
  """Woodbury or Cholesky per factor; see the module docstring."""

  name = "auto"

  @property
  def requires(self) -> frozenset[str]:
    return frozenset({"covariance", "rows"} if self.woodbury_rows else {"covariance"})

  def from_rows(self, slot, num_rows, current_batch):
    return current_batch and num_rows < slot.block

  def refresh_covariance(self, covariance, damping, real, sharding):
    return base.cholesky_refresh(covariance, damping, real, sharding)
