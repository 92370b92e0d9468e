"""Damping of a layer's two Kronecker factors: ``sqrt(lambda)`` each, or split by the pi rule.

THOR (and MindSpore's implementation) adds ``sqrt(lambda)`` to the diagonal of both ``A`` and
``G``; the pi rule of K-FAC adds ``pi sqrt(lambda)`` to ``A`` and ``sqrt(lambda) / pi`` to ``G``
with ``pi = sqrt((tr A / d_A) / (tr G / d_G))``. Either needs an inverse method that damps the
factors separately (``'factored damping'``); eigh damps ``A (x) G`` exactly instead.

References:
  Chen et al., "THOR", AAAI 2021 (split damping).
  Martens & Grosse, K-FAC, ICML 2015, section 6.3 (factored Tikhonov damping, the pi rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_damping(tr_a: jax.Array, dim_a: int, tr_g: jax.Array, dim_g: int,
                  sqrt_damping: jax.Array, pi_damping: bool) -> tuple[jax.Array, jax.Array]:
  """Values added to ``A`` and ``G``: ``sqrt(lambda)`` each, or pi-scaled.

  Args:
    tr_a: block traces of ``A`` (any shape; summed), ``dim_a`` its dimension.
    tr_g: block traces of ``G``, ``dim_g`` its dimension.
    sqrt_damping: ``sqrt(lambda)`` (scalar).
    pi_damping: whether to apply the pi rule (``pi = 1`` where it is not finite or positive).

  Returns:
    ``(d_A, d_G)`` scalars.
  """
  if not pi_damping:
    return sqrt_damping, sqrt_damping
  pi = jnp.sqrt((jnp.sum(tr_a) / dim_a) / (jnp.sum(tr_g) / dim_g))
  pi = jnp.where(jnp.isfinite(pi) & (pi > 0), pi, 1.0)
  return pi * sqrt_damping, sqrt_damping / pi


class FactoredDamping:
  """The damping piece of a transform: ``pi_damping`` needs factor-wise damping."""

  provides: frozenset[str] = frozenset()

  def __init__(self, pi_damping: bool):
    self.pi_damping = bool(pi_damping)
    self.requires = frozenset({"factored damping"} if pi_damping else ())

  def describe(self) -> str:
    return f"pi_damping={self.pi_damping}"
