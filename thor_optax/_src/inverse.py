"""Damped inverses of stacked factor blocks: one batched Cholesky for a whole group.

References:
  Chen et al., THOR, AAAI 2021: factor blocks inverted by Cholesky, ``(A + sqrt(lambda) I)^-1``
  per factor (MindSpore ``thor.py``: ``CholeskyTrsm``, then ``L^-T L^-1``).
  Martens & Grosse, K-FAC, ICML 2015, section 6.3 (factored Tikhonov damping, the pi rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def damp(blocks: jax.Array, damping: jax.Array, real: jax.Array) -> jax.Array:
  """Adds ``damping`` to the true diagonal and 1 to the padded diagonal of each block.

  Args:
    blocks: ``(K, b, b)`` symmetric PSD blocks (zero on padded rows/columns).
    damping: ``(K,)`` per-block damping (the value added to the factor's diagonal).
    real: ``(K, b)``, 1 on true dimensions and 0 on identity padding.

  Returns:
    ``(K, b, b)`` blocks ``F_k + diag(damping_k * real_k + (1 - real_k))``, whose inverse is the
    damped inverse on the true dimensions and the identity on the padding.
  """
  diag = damping[:, None] * real + (1.0 - real)
  return blocks + diag[:, :, None] * jnp.eye(blocks.shape[-1], dtype=blocks.dtype)


def cholesky_inverse(matrices: jax.Array) -> jax.Array:
  """Inverses of a stack of symmetric positive-definite matrices by Cholesky.

  Args:
    matrices: ``(K, b, b)`` SPD.

  Returns:
    ``(K, b, b)`` symmetric inverses ``L^-T L^-1``; non-finite where a factorization failed
    (callers keep the previous inverse there).
  """
  chol = jnp.linalg.cholesky(matrices)
  eye = jnp.broadcast_to(jnp.eye(matrices.shape[-1], dtype=matrices.dtype), matrices.shape)
  chol_inv = jax.lax.linalg.triangular_solve(chol, eye, left_side=True, lower=True)
  inv = jnp.einsum("kji,kjl->kil", chol_inv, chol_inv)
  return 0.5 * (inv + jnp.swapaxes(inv, -1, -2))


def is_finite_block(x: jax.Array) -> jax.Array:
  """``(K,)`` bool: every entry of block ``k`` of ``x (K, ...)`` is finite."""
  return jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1)
