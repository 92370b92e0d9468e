"""``inverse_method='eigh'``: eigendecompositions with exact damping of ``A (x) G`` (KAISA).

A refresh stores each block's eigenvectors and eigenvalues (clamped at 0) of the *undamped*
factor; a layer's gradient ``X`` is preconditioned by
``Q_A [(Q_A^T X Q_G) / (d_A d_G^T + lambda)] Q_G^T``, i.e. ``(A (x) G + lambda I)^-1 vec(X)``.
The damping acts on the Kronecker product, so a method splitting it between the factors (the pi
rule) does not apply. A diagonal ``A`` (embeddings) is its own eigenbasis. A layer is
preconditioned once all of its blocks have been decomposed at least once.

With ``inverse_power=p`` the eigenvalues are raised to ``-p`` instead of ``-1``:
``(A (x) G + lambda I)^-p vec(X)``, ``p = 1/2`` being the square root of the natural gradient's
preconditioner (what Shampoo's ``L^-1/4 X R^-1/4`` is for its own factors, and Adam's
``1 / sqrt(v)`` for a diagonal). It costs nothing more: the same eigendecompositions, one
power in place of a division. Why (benchmarks/README.md, "Long training"): on the MNIST MLP
over 2,200 steps THOR's natural gradient (``p = 1``) stops improving its test accuracy once the
training loss is near zero (best 0.936 over 6 seeds, Adam 0.950), and ``p = 1/2`` at four
times the rate reaches 0.949.

References:
  Pauloski et al., "KAISA", SC 2021, and "Convolutional neural network training with
  distributed K-FAC", SC 2020, section 3 (damping ``d_G d_A^T + gamma``).
  Gupta et al., "Shampoo", ICML 2018 (inverse roots of Kronecker factors); Amari et al., "When
  does preconditioning help or hurt generalization?", ICLR 2021 (interpolating between the
  gradient and the natural gradient, ``F^-p`` for ``0 <= p <= 1``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from thor_optax._src import blocks
from thor_optax._src import damping as damping_lib
from thor_optax._src import linalg
from thor_optax._src.inverses import base


class EighState(NamedTuple):
  """A group's eigendecompositions.

  Attributes:
    eigenvectors: ``(n, b, b)`` orthonormal eigenvectors (columns; identity before the first
      refresh).
    eigenvalues: ``(n, b)`` eigenvalues ``>= 0`` (zeros before the first refresh).
  """

  eigenvectors: jax.Array
  eigenvalues: jax.Array


class EigenBlocks(NamedTuple):
  """A factor's eigendecomposition: ``(num_blocks, b, b)`` vectors, ``(num_blocks, b)`` values."""

  eigenvectors: jax.Array
  eigenvalues: jax.Array


class EigenDiagonal(NamedTuple):
  """A diagonal factor ``(d,)``: its values are its eigenvalues, its basis the identity."""

  eigenvalues: jax.Array


def _pad_to(x: jax.Array, rows: int, cols: int) -> jax.Array:
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


class Eigh(base.InverseMethod):
  """Eigendecompositions (:class:`EighState`); exact damping of ``A (x) G``.

  Attributes:
    inverse_power: ``p`` in ``(A (x) G + lambda I)^-p`` (a float in ``(0, 1]``; 1: the
      natural gradient).
  """

  name = "eigh"
  provides = frozenset()
  waits_for_all_blocks = True
  takes_inverse_power = True

  def __init__(self, inverse_power: float = 1.0):
    self.inverse_power = inverse_power

  def describe(self) -> str:
    power = f" with inverse_power={self.inverse_power}" if self.inverse_power != 1.0 else ""
    return f"inverse_method={self.name!r}{power}"

  def init(self, block, num_blocks, dtype):
    eye = jnp.broadcast_to(jnp.eye(block, dtype=dtype), (num_blocks, block, block))
    return EighState(eye, jnp.zeros((num_blocks, block), dtype))

  def refresh_covariance(self, covariance, damping, real, sharding):
    del damping, real
    values, vectors = linalg.on_shards(linalg.eigh_factors, sharding, covariance)
    ok = linalg.is_finite_block(vectors) & linalg.is_finite_block(values)
    return EighState(vectors, values), ok

  def operator(self, state):
    return EigenBlocks(state.eigenvectors, state.eigenvalues)

  def precondition(self, x, a, g, damping, ready, min_relative_damping=0.0):
    # The rotation runs in padded coordinates: a block's eigenvalues are sorted, so those of its
    # identity padding are not at the end, and each eigenvalue must stay with its column.
    q_g = g.eigenvectors
    d_g = g.eigenvalues.reshape(-1)
    padded_g = q_g.shape[0] * q_g.shape[1]
    if isinstance(a, EigenDiagonal):
      d_a, y = a.eigenvalues, _pad_to(x, x.shape[0], padded_g)
    else:
      q_a = a.eigenvectors
      d_a = a.eigenvalues.reshape(-1)
      y = _pad_to(x, q_a.shape[0] * q_a.shape[1], padded_g)
      y = blocks.left_multiply(jnp.swapaxes(q_a, -1, -2), y)
    y = blocks.right_multiply(y, q_g)
    d_a = damping_lib.floored_eigenvalues(d_a, min_relative_damping, x.shape[0])
    d_g = damping_lib.floored_eigenvalues(d_g, min_relative_damping, x.shape[1])
    damped = d_a[:, None] * d_g[None, :] + damping
    y = y / damped if self.inverse_power == 1.0 else y * damped ** -self.inverse_power
    y = blocks.right_multiply(y, jnp.swapaxes(q_g, -1, -2))
    if not isinstance(a, EigenDiagonal):
      y = blocks.left_multiply(q_a, y)
    y = y[:x.shape[0], :x.shape[1]]
    return jnp.where(ready, y, x)

  def diagonal_init(self, dim, dtype):
    return jnp.zeros((dim,), dtype)

  def diagonal(self, values, damping):
    del damping
    return values

  def diagonal_operator(self, stored):
    return EigenDiagonal(stored)
