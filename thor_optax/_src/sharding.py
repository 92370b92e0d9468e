"""Shardings of the curvature state on a device mesh: where the inverses live.

Data parallelism needs nothing from this package: jit a training step on a ``jax.sharding.Mesh``
with the batch sharded over a data axis, and the compiler reduces the gradients and the
curvature statistics (their covariance contractions run over the sharded batch) across the
devices. What remains a choice is the *curvature* work and memory, the trade-off of KAISA's
``grad_worker_fraction``:

* the inversion work is divided by the transform's ``block_sharding`` option: every stack of
  factor blocks due for inversion is sharded over the devices, so each inverts ``K / D`` blocks;
* where the inverses are kept is the sharding of the optimizer state, given by
  :func:`kronecker_state_sharding`. Replicated block stacks (``block_axis=None``, KAISA's
  COMM-OPT) are gathered to every device once per refresh, and each device preconditions every
  layer locally. Block stacks sharded over ``block_axis`` (MEM-OPT) keep ``1 / D`` of the
  second-order state per device; each device preconditions the gradient blocks it owns and the
  compiler gathers the preconditioned gradient (more communication per step). On a 2-D mesh
  ``("replica", "shard")``, ``block_axis="shard"`` is KAISA's HYBRID-OPT with
  ``grad_worker_fraction = 1 / mesh.shape["shard"]``.

References:
  Pauloski et al., "KAISA: An Adaptive Second-Order Optimizer Framework for Deep Neural
  Networks", SC 2021 (COMM-OPT, MEM-OPT, HYBRID-OPT, ``grad_worker_fraction``).
  Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020 (each layer's inverse
  computed by one owner device, results all-gathered).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from thor_optax._src import transform


def kronecker_state_sharding(opt_state: Any, mesh: Mesh,
                             block_axis: Optional[str] = None) -> Any:
  """A pytree of ``NamedSharding`` for an optimizer state holding :class:`KroneckerState`\\ s.

  Use it as the ``out_shardings`` (and ``in_shardings``) of the optimizer state in a jitted
  training step, or with ``jax.device_put`` after ``tx.init``.

  Args:
    opt_state: the optimizer state (any optax state; ``KroneckerState`` nodes are found at any
      depth, e.g. inside ``optax.chain`` or :func:`thor_optax.scale_by_kl_clip`), or its
      ``jax.eval_shape``.
    mesh: the device mesh.
    block_axis: ``None`` replicates everything (COMM-OPT). A mesh axis name shards axis 0 (the
      block index, ``n`` blocks of a group) of every per-block stack over that axis (MEM-OPT,
      or HYBRID-OPT on a 2-D mesh); a stack whose ``n`` is not a multiple of the axis size is
      replicated, as are all other leaves (step counts, diagnostics, embeddings' diagonals,
      normalization layers' 2x2 blocks).

  Returns:
    a pytree of ``jax.sharding.NamedSharding`` with the structure of ``opt_state``.

  Raises:
    ValueError: if ``block_axis`` is not an axis of ``mesh``.
  """
  if block_axis is not None and block_axis not in mesh.shape:
    raise ValueError(f"block_axis {block_axis!r} is not an axis of the mesh "
                     f"{dict(mesh.shape)}.")
  replicated = NamedSharding(mesh, PartitionSpec())
  blocked = NamedSharding(mesh, PartitionSpec(block_axis))

  def stack(leaf):
    n = leaf.shape[0] if getattr(leaf, "ndim", 0) else 0
    return blocked if block_axis and n and n % mesh.shape[block_axis] == 0 else replicated

  def node(x):
    if not isinstance(x, transform.KroneckerState):
      return replicated
    # Every leaf of a block stack has the block index on axis 0; the rest is replicated.
    everything = jax.tree.map(lambda _: replicated, x)
    return everything._replace(blocks=jax.tree.map(stack, x.blocks))

  return jax.tree.map(node, opt_state,
                      is_leaf=lambda x: isinstance(x, transform.KroneckerState))
