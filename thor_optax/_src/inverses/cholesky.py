"""``inverse_method='cholesky'``: damped inverse blocks by batched Cholesky (THOR, K-FAC).

Each refreshed block ``F_k`` becomes ``(F_k + d_k I)^-1 = L^-T L^-1`` with ``d_k`` the factor's
damping (``sqrt(lambda)``, or pi-scaled) and the identity on padded dimensions; one batched
factorization per group inverts every due block of every layer.

References:
  Chen et al., "THOR", AAAI 2021 (MindSpore ``thor.py``: ``CholeskyTrsm``).
  Martens & Grosse, K-FAC, ICML 2015, section 6.3 (factored Tikhonov damping).
"""

from __future__ import annotations

from thor_optax._src.inverses import base


class Cholesky(base.InverseMethod):
  """Dense damped inverse blocks (:class:`~thor_optax._src.inverses.base.InverseBlocks`)."""

  name = "cholesky"

  def refresh_covariance(self, covariance, damping, real, sharding):
    return base.cholesky_refresh(covariance, damping, real, sharding)
