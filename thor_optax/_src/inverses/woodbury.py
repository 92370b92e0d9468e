"""``inverse_method='woodbury'``: damped inverse blocks from the rows behind a factor (SKFAC).

A factor ``F = scale rows^T rows`` with ``m`` rows has blocks ``U_k U_k^T``, ``U_k (b, m)``;
``(U U^T + d I_b)^-1 = (I_b - U (U^T U + d I_m)^-1 U^T) / d`` costs one ``m x m`` Cholesky
instead of a ``b x b`` one. The rows exist only for the current batch's factor, so the method
needs an accumulator that provides them (no running average, inverse period or adaptive
refresh). With ``woodbury_rows=m``, the groups whose low-rank form is smaller
(``m (b + m) < b^2``) keep it instead of dense blocks (:mod:`.low_rank`).

References:
  Tang et al., "SKFAC", CVPR 2021, section 3 (Sherman-Morrison-Woodbury inverse).
"""

from __future__ import annotations

from typing import Optional

from thor_optax._src import blocks
from thor_optax._src import linalg
from thor_optax._src.inverses import base


def woodbury_refresh(rows, slot, idx, damping, real, sharding):
  """Dense damped inverses of the blocks ``idx`` of a factor from its rows."""
  u = base.factor_roots(rows, slot, idx)
  inv = linalg.on_shards(linalg.woodbury_inverse, sharding, u, damping, real)
  return base.InverseBlocks(inv), linalg.is_finite_block(inv)


class Woodbury(base.InverseMethod):
  """Dense damped inverse blocks, every factor inverted from its rows.

  Attributes:
    woodbury_rows: ``m`` (a positive int) to keep groups in low-rank form where smaller, or
      ``None``.
  """

  name = "woodbury"
  requires = frozenset({"rows"})

  def __init__(self, woodbury_rows: Optional[int] = None):
    self.woodbury_rows = woodbury_rows

  def describe(self) -> str:
    rows = f" with woodbury_rows={self.woodbury_rows}" if self.woodbury_rows else ""
    return f"inverse_method={self.name!r}{rows}"

  def for_block(self, block):
    from thor_optax._src.inverses import low_rank  # pylint: disable=import-outside-toplevel
    if self.woodbury_rows and blocks.saves_memory(block, self.woodbury_rows):
      return low_rank.LowRank(self.woodbury_rows)
    return self

  def from_rows(self, slot, num_rows, current_batch):
    del slot, num_rows, current_batch
    return True

  def refresh_rows(self, rows, slot, idx, damping, real, sharding):
    return woodbury_refresh(rows, slot, idx, damping, real, sharding)
