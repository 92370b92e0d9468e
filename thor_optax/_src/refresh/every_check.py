"""K-FAC's refresh policy: every block with finite statistics is recomputed at every check step.

References:
  Martens & Grosse, K-FAC, ICML 2015 (factors and inverses refreshed every ``T`` steps).
"""

from __future__ import annotations

import jax.numpy as jnp

from thor_optax._src.refresh import base


class EveryCheck(base.RefreshPolicy):
  """Recomputes every valid block at every check step (THOR's trace rule with ``(0, 0)``)."""

  def select(self, trace_now, trace_ref, state, valid, count):
    del count
    ratio = base.trace_change(trace_now, trace_ref, jnp.zeros_like(valid), valid)
    return base.Selection(refresh=valid, ratio=ratio, state=state)
