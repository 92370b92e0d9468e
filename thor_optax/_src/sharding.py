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

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from thor_optax._src import transform


def _boxed_sharding(box: Any, mesh: Mesh, rules: Any) -> NamedSharding:
  """The ``NamedSharding`` of a ``nn.Partitioned`` / ``nn.LogicallyPartitioned`` leaf."""
  if isinstance(box, nn.LogicallyPartitioned):
    spec = nn.logical_to_mesh_axes(box.names, rules if rules is not None else box.rules)
  else:
    spec = box.get_partition_spec()
  missing = [a for entry in spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,)) if a not in mesh.shape]
  if missing:
    raise ValueError(
        f"kronecker_state_sharding: an optimizer state leaf boxed as {type(box).__name__} "
        f"with names {box.names} is sharded as {spec}, but {missing} are not axes of the mesh "
        f"{dict(mesh.shape)}.")
  return NamedSharding(mesh, spec)


class _LikeParams:
  """Whether a state subtree has the parameters' structure and shapes (of two leaves or more);
  ``shardings``: the parameters' own, spelled out to every axis."""

  def __init__(self, params: Any, mesh: Mesh):
    self.structure = None if params is None else jax.tree.structure(params)
    self.shapes = [tuple(p.shape) for p in jax.tree.leaves(params)]

    def sharding(p):
      placed = getattr(p, "sharding", None)
      spec = tuple(placed.spec) if isinstance(placed, NamedSharding) else ()
      return NamedSharding(mesh, PartitionSpec(*spec, *[None] * (len(p.shape) - len(spec))))

    self.shardings = None if params is None else jax.tree.map(sharding, params)

  def __call__(self, x: Any) -> bool:
    if (self.structure is None or self.structure.num_leaves < 2
        or isinstance(x, (transform.KroneckerState, nn.Partitioned))):
      return False
    return (jax.tree.structure(x) == self.structure
            and [tuple(getattr(v, "shape", ())) for v in jax.tree.leaves(x)] == self.shapes)


def kronecker_state_sharding(opt_state: Any, mesh: Mesh, block_axis: Optional[str] = None,
                             rules: Any = None, *, params: Any = None) -> Any:
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
    rules: logical axis rules ``((logical name, mesh axis), ...)`` for leaves boxed as
      ``nn.LogicallyPartitioned``; ``None``: the box's own rules, else those of the enclosing
      ``flax.linen.logical_axis_rules`` (names without a rule are not sharded, as in Flax).
    params: the parameters as placed on ``mesh`` (arrays, or ``jax.ShapeDtypeStruct`` s with a
      ``NamedSharding``; keyword only): the state's parameter-shaped subtrees are sharded like
      them. ``None`` (default): replicated.

  Leaves outside the ``KroneckerState`` nodes that are boxed like parameters
  (``nn.Partitioned``, ``nn.LogicallyPartitioned``: e.g. the momentum of :func:`thor_optax.thor`
  for parameters that ``model.init`` returned boxed) get their parameters' sharding (names as
  mesh axes; logical names resolved by ``rules``), inside the same box; other leaves are
  replicated, unless ``params`` is given: a subtree of the state with the parameters' structure
  and shapes (a momentum, Adam's moments in a chain) then gets their shardings, for parameters
  sharded without a box (``jax.device_put(params, ...)``). A ``KroneckerState``
  holds no parameter-shaped leaf, so Flax's recipe,
  ``nn.logical_to_mesh_sharding(nn.get_partition_spec(jax.eval_shape(tx.init, params)), mesh,
  rules)``, gives the same shardings as ``block_axis=None`` (that recipe reads every box's names
  as logical names: its ``rules`` must also map the mesh axis names of ``nn.Partitioned`` boxes,
  e.g. ``("model", "model")``).

  Under an explicit-sharding mesh (``AxisType.Explicit``), ``jax.device_put`` the state with
  these shardings: ``update`` returns every leaf with the sharding it was given (a state whose
  block stacks are sharded is gathered for the step and sharded again; the aliases' non-finite
  guard lays out the other leaves, such as a momentum replicated here for parameters sharded
  without a box, which the momentum's own update would shard like its gradient).

  Returns:
    a pytree of ``jax.sharding.NamedSharding`` with the structure of ``opt_state`` (boxes
    included).

  Raises:
    TypeError: if ``mesh`` is not a ``jax.sharding.Mesh`` (``None``, a list of devices).
    ValueError: if ``block_axis`` is not an axis of ``mesh``, or a boxed leaf is sharded over
      an axis that is not in ``mesh``.

  Source: Pauloski et al., "KAISA: An Adaptive Second-Order Optimizer Framework for Deep Neural
  Networks", SC 2021 (COMM-OPT, MEM-OPT, HYBRID-OPT and ``grad_worker_fraction``); the boxed
  leaves' shardings are Flax's (the box's ``get_partition_spec``, ``nn.logical_to_mesh_axes``).
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f"kronecker_state_sharding: mesh must be a jax.sharding.Mesh (e.g. "
                    f"jax.make_mesh((n,), ('data',))), got {type(mesh).__name__}.")
  if block_axis is not None and block_axis not in mesh.shape:
    raise ValueError(f"block_axis {block_axis!r} is not an axis of the mesh "
                     f"{dict(mesh.shape)}.")
  # Specs spelled out to every axis, as a step's outputs come back under an explicit-sharding
  # mesh: a state placed with P() where the step returns P(None, None) would compile the step
  # a second time for its own output.
  def replicated(leaf):
    return NamedSharding(mesh, PartitionSpec(*[None] * getattr(leaf, "ndim", 0)))

  def stack(leaf):
    n = leaf.shape[0] if getattr(leaf, "ndim", 0) else 0
    if block_axis and n and n % mesh.shape[block_axis] == 0:
      return NamedSharding(mesh, PartitionSpec(block_axis, *[None] * (leaf.ndim - 1)))
    return replicated(leaf)

  like_params = _LikeParams(params, mesh)

  def node(x):
    if isinstance(x, nn.Partitioned):  # boxed like a parameter: sharded as the parameter
      return x.replace_boxed(_boxed_sharding(x, mesh, rules))
    if like_params(x):
      return like_params.shardings
    if not isinstance(x, transform.KroneckerState):
      return replicated(x)
    # Every leaf of a block stack has the block index on axis 0; the rest is replicated.
    everything = jax.tree.map(replicated, x)
    return everything._replace(blocks=jax.tree.map(stack, x.blocks))

  def is_node(x):
    return isinstance(x, (transform.KroneckerState, nn.Partitioned)) or like_params(x)

  return jax.tree.map(node, opt_state, is_leaf=is_node)
