"""``inverse_method='low_rank'``: factors kept as ``U``, an ``m x m`` core and a damping (SKFAC).

A block ``F_k = U_k U_k^T`` with ``U_k (b, m)`` (zero columns pad fewer rows, exactly) is stored
as ``U_k``, the core inverse ``C_k = (U_k^T U_k + d_k I_m)^-1`` and ``d_k``, and applied as
``F_k^-1 x = (x - U_k C_k U_k^T x) / d_k`` in ``O(b m)`` per column: no ``b x b`` array at all.
Groups where that form is not smaller (``m (b + m) >= b^2``) keep dense Woodbury inverses. The
method needs the current batch's rows, at most ``woodbury_rows`` of them per factor.

References:
  Tang et al., "SKFAC", CVPR 2021, section 3.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from thor_optax._src import blocks
from thor_optax._src import linalg
from thor_optax._src.inverses import base
from thor_optax._src.inverses import woodbury


class LowRankState(NamedTuple):
  """A low-rank group's Woodbury form.

  Attributes:
    u: ``(n, b, m)`` each block's scaled rows ``U`` (zeros before the first refresh).
    core: ``(n, m, m)`` core inverses ``(U^T U + d I)^-1`` (identity before).
    damping: ``(n,)`` each block's damping ``d`` (1 before, so the inverse starts as identity).
  """

  u: jax.Array
  core: jax.Array
  damping: jax.Array

  def left(self, x: jax.Array) -> jax.Array:
    """``blockdiag(F_k^-1) x`` for ``x (d, cols)``."""
    return blocks.left_multiply_low_rank(self.u, self.core, self.damping, x)

  def right(self, x: jax.Array) -> jax.Array:
    """``x blockdiag(F_k^-1)`` for ``x (rows, d)``."""
    return blocks.right_multiply_low_rank(x, self.u, self.core, self.damping)


class LowRank(woodbury.Woodbury):
  """Low-rank Woodbury form (:class:`LowRankState`) for groups where it is smaller.

  Args:
    woodbury_rows: ``m``, the rows a factor may have (a positive int).
  """

  name = "low_rank"

  def __init__(self, woodbury_rows: int):
    super().__init__(woodbury_rows)

  @property
  def rank(self) -> int:
    return self.woodbury_rows

  def for_block(self, block):
    if blocks.saves_memory(block, self.woodbury_rows):
      return self
    return woodbury.Woodbury()

  def init(self, block, num_blocks, dtype):
    m = self.woodbury_rows
    return LowRankState(u=jnp.zeros((num_blocks, block, m), dtype),
                        core=jnp.broadcast_to(jnp.eye(m, dtype=dtype), (num_blocks, m, m)),
                        damping=jnp.ones((num_blocks,), dtype))

  def check_rows(self, layer: str, which: str, slot: blocks.FactorSlot, num_rows: int) -> None:
    """Raises ``ValueError`` naming the layer if a factor has more rows than ``m``."""
    if num_rows > self.woodbury_rows:
      raise ValueError(
          f"layer {layer!r}: factor {which} (dim {slot.dim}) has {num_rows} rows in these "
          f"statistics, but its low-rank state holds at most woodbury_rows="
          f"{self.woodbury_rows}; pass woodbury_rows >= {num_rows} (the examples x positions x "
          "samples behind the factor), or woodbury_rows=None for dense inverses.")

  def refresh_rows(self, rows, slot, idx, damping, real, sharding):
    del real
    u = base.factor_roots(rows, slot, idx)
    u = jnp.pad(u, ((0, 0), (0, 0), (0, self.woodbury_rows - u.shape[-1])))
    core = linalg.on_shards(linalg.woodbury_core_inverse, sharding, u, damping)
    ok = linalg.is_finite_block(u) & linalg.is_finite_block(core)
    return LowRankState(u, core, damping), ok

  def operator(self, state):
    return state
