"""The interface of an inverse method, and the inverse operators of a factor.

An :class:`InverseMethod` owns, for one block stack (a *group* of ``n`` factor blocks of size
``b``, see ``blocks.BlockLayout``):

* its per-block state (:meth:`InverseMethod.init`): damped inverse blocks, eigendecompositions,
  or a low-rank Woodbury form; a method never stores one form under another's name;
* the refresh of selected blocks, from the blocks' covariances (:meth:`refresh_covariance`) or
  from the rows behind a factor (:meth:`refresh_rows`; :meth:`from_rows` says which, per
  factor, statically);
* its application: :meth:`operator` turns a factor's slice of the state into a value with
  ``left``/``right`` products, and :meth:`precondition` applies a layer's ``A`` and ``G``
  (factor by factor, or jointly for exact damping of ``A (x) G``);
* the diagonal form of a diagonal ``A`` (embeddings): :meth:`diagonal_init`, :meth:`diagonal`,
  :meth:`diagonal_operator`.

``requires`` and ``provides`` declare what a method needs from the other pieces (the factor
accumulator gives ``'covariance'`` and, for the current batch only, ``'rows'``) and what it
gives them (``'factored damping'``: separate damping values for ``A`` and ``G``); the
transform rejects a combination whose needs are not met.

References:
  curvlinops: an inverse is a value with its own ``apply``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from thor_optax._src import blocks
from thor_optax._src import explicit
from thor_optax._src import linalg


class InverseBlocks(NamedTuple):
  """Damped inverse blocks of a group.

  Attributes:
    inverse: ``(n, b, b)`` ``(F_k + d_k I)^-1`` on true dimensions, identity on padding
      (identity before the first refresh).
  """

  inverse: jax.Array


class BlockInverse(NamedTuple):
  """A factor's damped inverse as dense blocks ``(num_blocks, b, b)``."""

  inverse: jax.Array

  def left(self, x: jax.Array) -> jax.Array:
    """``F^-1 x`` for ``x (d, m)``."""
    return blocks.left_multiply(self.inverse, x)

  def right(self, x: jax.Array) -> jax.Array:
    """``x F^-1`` for ``x (m, d)``."""
    return blocks.right_multiply(x, self.inverse)


class DiagonalInverse(NamedTuple):
  """A diagonal factor's damped inverse ``(d,)``."""

  inverse: jax.Array

  def left(self, x: jax.Array) -> jax.Array:
    return self.inverse[:, None] * x

  def right(self, x: jax.Array) -> jax.Array:
    return x * self.inverse[None, :]


class InverseMethod:
  """One way to invert (or decompose) damped factor blocks; see the module docstring.

  Attributes:
    name: the registry name (``inverse_method=``).
    requires: what the factor accumulator must provide (``'covariance'``, ``'rows'``).
    provides: what the method provides to other pieces (``'factored damping'``).
    rank: ``m > 0`` for a state in low-rank form with room for ``m`` rows (group key
      ``'b{b}r{m}'``), 0 for ``b x b`` blocks.
    waits_for_all_blocks: whether a layer is preconditioned only once every block of its
      factors has been refreshed (``precondition`` then gets ``ready``; else ``True``).
    takes_inverse_power: whether the constructor takes ``inverse_power`` (the power ``p`` of
      ``(A (x) G + lambda I)^-p``; methods that store damped inverses apply ``p = 1`` only).
  """

  name: str = ""
  waits_for_all_blocks: bool = False
  takes_inverse_power: bool = False
  requires: frozenset[str] = frozenset({"covariance"})
  provides: frozenset[str] = frozenset({"factored damping"})
  rank: int = 0

  def describe(self) -> str:
    """How the user asked for it, for error messages."""
    return f"inverse_method={self.name!r}"

  def for_block(self, block: int) -> "InverseMethod":
    """The method of a group of blocks of size ``block`` (a low-rank form where it is
    smaller; default: this method)."""
    del block
    return self

  def init(self, block: int, num_blocks: int, dtype: jnp.dtype) -> NamedTuple:
    """The state of a group before its first refresh (inverse = identity)."""
    eye = jnp.broadcast_to(jnp.eye(block, dtype=dtype), (num_blocks, block, block))
    return InverseBlocks(inverse=eye)

  def from_rows(self, slot: blocks.FactorSlot, num_rows: int, current_batch: bool) -> bool:
    """Whether the factor in ``slot`` is refreshed from its ``num_rows`` rows (static)."""
    del slot, num_rows, current_batch
    return False

  def check_rows(self, layer: str, which: str, slot: blocks.FactorSlot, num_rows: int) -> None:
    """Raises ``ValueError`` naming the layer if a factor's ``num_rows`` do not fit the state
    (the low-rank form's ``m``); default: any number fits."""
    del layer, which, slot, num_rows

  def refresh_covariance(self, covariance: jax.Array, damping: jax.Array, real: jax.Array,
                         sharding: Optional[Any]) -> tuple[NamedTuple, jax.Array]:
    """New state of ``K`` blocks from their covariances ``(K, b, b)`` (undamped), damping
    ``(K,)`` and true dimensions ``(K, b)``; and ``(K,)`` whether each is finite."""
    raise NotImplementedError(f"{self.describe()} does not invert covariance blocks")

  def refresh_rows(self, rows: Any, slot: blocks.FactorSlot, idx: jax.Array,
                   damping: jax.Array, real: jax.Array,
                   sharding: Optional[Any]) -> tuple[NamedTuple, jax.Array]:
    """New state of the blocks ``idx (K,)`` of the factor in ``slot`` from its ``FactorRows``;
    and ``(K,)`` whether each is finite."""
    raise NotImplementedError(f"{self.describe()} does not invert from rows")

  def operator(self, state: NamedTuple) -> Any:
    """The damped inverse of one factor, from its blocks' slice of the group state."""
    return BlockInverse(state.inverse)

  def precondition(self, x: jax.Array, a: Any, g: Any, damping: jax.Array,
                   ready: jax.Array, min_relative_damping: float = 0.0) -> jax.Array:
    """``A^-1 x G^-1`` for a layer's ``(d_A, d_G)`` gradient matrix ``x`` (factor by factor;
    the damping and its floor ``min_relative_damping`` are in the stored inverses already)."""
    del damping, ready, min_relative_damping
    return g.right(a.left(x))

  def diagonal_init(self, dim: int, dtype: jnp.dtype) -> jax.Array:
    """A diagonal factor's stored form before its first refresh (the identity inverse)."""
    return jnp.ones((dim,), dtype)

  def diagonal(self, values: jax.Array, damping: jax.Array) -> jax.Array:
    """A diagonal factor's stored form: the damped inverse ``1 / (values + damping)``."""
    return 1.0 / (values + damping)

  def diagonal_operator(self, stored: jax.Array) -> Any:
    return DiagonalInverse(stored)


def cholesky_refresh(covariance, damping, real, sharding):
  """Damped inverses of covariance blocks by Cholesky, on the devices of ``sharding``."""
  inv = linalg.on_shards(lambda b, d, r: linalg.cholesky_inverse(linalg.damp(b, d, r)),
                         sharding, covariance, damping, real)
  return InverseBlocks(inv), linalg.is_finite_block(inv)


def factor_roots(rows: Any, slot: blocks.FactorSlot, idx: jax.Array) -> jax.Array:
  """``U (K, b, R)`` of the blocks ``idx``: block ``k`` of ``scale rows^T rows`` is
  ``U_k U_k^T`` (SKFAC's low-rank form). Under an explicit-sharding mesh the rows are gathered
  first: ``U``'s row axis is an axis of the ``R x R`` Woodbury cores, which cannot be sharded
  twice."""
  rows_all = explicit.replicate(rows.rows)
  x = jnp.take(blocks.blocked_rows(rows_all, slot), idx, axis=1)  # (R, K, b)
  scale = blocks.block_scale(rows.scale, slot)
  scale = scale if jnp.ndim(scale) == 0 else jnp.take(scale, idx)[:, None, None]
  return jnp.sqrt(scale) * jnp.transpose(x, (1, 2, 0))
