"""Damped inverses of stacked factor blocks, batched over a whole group of blocks.

Three methods, all acting on a stack ``(K, b, b)`` at once:

* :func:`cholesky_inverse` of the damped blocks (THOR, K-FAC);
* :func:`eigh_factors`: eigendecomposition of the undamped blocks; the damping is applied to
  the Kronecker product of two factors' eigenvalues when the gradient is preconditioned
  (KAISA's inverse-free evaluation, ``transform.precondition``);
* :func:`woodbury_inverse` from the rows behind a factor when there are fewer rows ``m`` than
  dimensions ``b``: an ``m x m`` Cholesky instead of a ``b x b`` one (SKFAC).

:func:`unitwise_inverse` inverts the damped 2x2 Fisher of every channel of a normalization layer
in closed form (SP-NGD's unit-wise natural gradient).

References:
  Chen et al., THOR, AAAI 2021: factor blocks inverted by Cholesky, ``(A + sqrt(lambda) I)^-1``
  per factor (MindSpore ``thor.py``: ``CholeskyTrsm``, then ``L^-T L^-1``).
  Martens & Grosse, K-FAC, ICML 2015, section 6.3 (factored Tikhonov damping, the pi rule).
  Pauloski et al., "KAISA", SC 2021, and "Convolutional neural network training with
  distributed K-FAC", SC 2020, section 3 (eigendecomposition, damping ``d_G d_A^T + gamma``).
  Tang et al., "SKFAC", CVPR 2021, section 3 (Sherman-Morrison-Woodbury inverse of a
  low-rank factor).
  Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020, section "Unit-wise
  natural gradient" (2x2 per-channel Fisher of batch normalization).
"""

from __future__ import annotations

from typing import Any, Callable

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


def _lapack_safe(fn: Callable[[jax.Array], Any], stack: jax.Array) -> Any:
  """``fn`` over a stack ``(K, b, b)``: batched, but one matrix at a time on CPU.

  jaxlib's CPU LAPACK kernels (``potrf``, ``trsm``, ``syevd``; jax 0.10) split a batch into
  tasks on XLA's intra-op thread pool and block until they finish. When as many batched calls
  run at once as the pool has threads (independent block groups of one step, or one per device
  of a multi-device CPU mesh), every pool thread waits for tasks that no thread is free to run,
  and the program hangs. A batch of one is run inline, so on CPU ``fn`` is mapped over the
  stack (``lax.map``); other platforms get the batched call. The choice is made per platform
  when the function is lowered (``lax.platform_dependent``).

  LAPACK and cuSOLVER factorize float32 and float64 only: a narrower stack (a state kept in
  ``dtype=jnp.bfloat16`` or ``float16``) is factorized in float32 and the results are cast
  back to its dtype.
  """
  if jnp.issubdtype(stack.dtype, jnp.floating) and jnp.finfo(stack.dtype).bits < 32:
    out = _lapack_safe(fn, stack.astype(jnp.float32))
    return jax.tree.map(lambda y: y.astype(stack.dtype), out)

  def one_at_a_time(x):
    return jax.tree.map(lambda y: y[:, 0], jax.lax.map(lambda m: fn(m[None]), x))

  return jax.lax.platform_dependent(stack, cpu=one_at_a_time, default=fn)


def _batched_cholesky_inverse(matrices: jax.Array) -> jax.Array:
  chol = jnp.linalg.cholesky(matrices)
  eye = jnp.broadcast_to(jnp.eye(matrices.shape[-1], dtype=matrices.dtype), matrices.shape)
  return jax.lax.linalg.triangular_solve(chol, eye, left_side=True, lower=True)


def cholesky_inverse(matrices: jax.Array) -> jax.Array:
  """Inverses of a stack of symmetric positive-definite matrices by Cholesky.

  Args:
    matrices: ``(K, b, b)`` SPD.

  Returns:
    ``(K, b, b)`` symmetric inverses ``L^-T L^-1``; non-finite where a factorization failed
    (callers keep the previous inverse there).
  """
  chol_inv = _lapack_safe(_batched_cholesky_inverse, matrices)
  inv = jnp.einsum("kji,kjl->kil", chol_inv, chol_inv)
  return 0.5 * (inv + jnp.swapaxes(inv, -1, -2))


def is_finite_block(x: jax.Array) -> jax.Array:
  """``(K,)`` bool: every entry of block ``k`` of ``x (K, ...)`` is finite."""
  return jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1)


def eigh_factors(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Eigendecomposition of a stack of symmetric PSD factor blocks, eigenvalues clamped at 0.

  Args:
    blocks: ``(K, b, b)`` undamped factor blocks (zero on padded rows/columns).

  Returns:
    ``(values, vectors)``: ``(K, b)`` eigenvalues ``>= 0`` and ``(K, b, b)`` orthonormal
    eigenvectors (columns), ``blocks[k] = vectors[k] @ diag(values[k]) @ vectors[k].T``.
  """
  sym = 0.5 * (blocks + jnp.swapaxes(blocks, -1, -2))
  values, vectors = _lapack_safe(jnp.linalg.eigh, sym)
  return jnp.maximum(values, 0.0), vectors


def woodbury_core_inverse(u: jax.Array, damping: jax.Array) -> jax.Array:
  """The ``m x m`` cores ``C = (U^T U + d I_m)^-1`` of the Woodbury identity, batched.

  With them ``(U U^T + d I_b)^-1 = (I_b - U C U^T) / d``, which can be applied to a vector in
  ``O(b m)`` without forming the ``b x b`` inverse (``blocks.left_multiply_low_rank``).

  Args:
    u: ``(K, b, m)``, the factor block is ``U U^T``.
    damping: ``(K,)`` values ``d > 0`` added to the factor blocks' diagonals.

  Returns:
    ``(K, m, m)`` symmetric core inverses; non-finite where the Cholesky factorization failed.
  """
  m = u.shape[-1]
  core = jnp.einsum("kbi,kbj->kij", u, u) + damping[:, None, None] * jnp.eye(m, dtype=u.dtype)
  return cholesky_inverse(core)


def woodbury_inverse(u: jax.Array, damping: jax.Array, real: jax.Array) -> jax.Array:
  """Damped inverses ``(U U^T + d I)^-1`` of low-rank blocks by Sherman-Morrison-Woodbury.

  ``(U U^T + d I_b)^-1 = (I_b - U (U^T U + d I_m)^-1 U^T) / d``: one batched ``m x m``
  Cholesky instead of a ``b x b`` one, ``O(b m^2 + b^2 m + m^3)`` per block; cheaper than
  :func:`cholesky_inverse` when ``m < b``.

  Args:
    u: ``(K, b, m)``, the factor block is ``U U^T`` (for ``F = scale * X^T X`` with rows
      ``X (m, b)``, ``U = sqrt(scale) X^T``); padded rows of ``U`` are zero.
    damping: ``(K,)`` value added to each block's true diagonal (``> 0``).
    real: ``(K, b)``, 1 on true dimensions, 0 on identity padding.

  Returns:
    ``(K, b, b)`` the same inverse as ``cholesky_inverse(damp(U U^T, damping, real))``:
    the damped inverse on true dimensions, the identity on padding; non-finite where the
    factorization failed.
  """
  d = damping[:, None, None]
  core_inv = woodbury_core_inverse(u, damping)
  inv = (jnp.eye(u.shape[1], dtype=u.dtype) - jnp.einsum("kbi,kij,kcj->kbc", u, core_inv, u)) / d
  mask = real[:, :, None] * real[:, None, :]
  return inv * mask + (1.0 - real)[:, :, None] * jnp.eye(u.shape[1], dtype=u.dtype)


def unitwise_fisher(scale_grads: jax.Array, bias_grads: jax.Array) -> jax.Array:
  """Per-channel 2x2 empirical Fisher of a normalization layer's ``(scale, bias)``.

  Args:
    scale_grads: ``(S, N, C)`` per-example gradients of the scale.
    bias_grads: ``(S, N, C)`` per-example gradients of the bias.

  Returns:
    ``(C, 2, 2)``: ``F_c = (1/N) sum_{s,n} [g_scale, g_bias]^T [g_scale, g_bias]`` at channel c.
  """
  g = jnp.stack([scale_grads, bias_grads], axis=-1)  # (S, N, C, 2)
  return jnp.einsum("snci,sncj->cij", g, g) / g.shape[1]


def unitwise_inverse(fisher: jax.Array, damping: jax.Array) -> jax.Array:
  """Closed-form inverses of damped 2x2 blocks, ``(F_c + damping I)^-1``.

  ``[[a, b], [b, c]]^-1 = [[c, -b], [-b, a]] / (a c - b^2)``.

  Args:
    fisher: ``(C, 2, 2)`` symmetric PSD blocks.
    damping: scalar added to both diagonal entries (``> 0``).

  Returns:
    ``(C, 2, 2)`` inverses (non-finite where a block is singular).
  """
  a = fisher[:, 0, 0] + damping
  c = fisher[:, 1, 1] + damping
  b = 0.5 * (fisher[:, 0, 1] + fisher[:, 1, 0])
  det = a * c - b * b
  inv = jnp.stack([jnp.stack([c, -b], -1), jnp.stack([-b, a], -1)], -2)
  return inv / det[:, None, None]
