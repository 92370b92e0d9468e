"""The preconditioning every step runs: the stored curvature applied to the gradient tree.

For a Kronecker-factored layer the kind maps its gradient leaves to the ``(d_A, d_G)`` matrix
``X`` (bias row last), the inverse method applies ``A^-1 X G^-1`` with each factor's stored
inverse (block-diagonal, low-rank or diagonal), or ``(A (x) G + lambda I)^-1 vec(X)`` for eigh,
and the kind maps the result back. Layers with side curvature only (normalization layers) are
preconditioned by their kind. Leaves outside every layer pass through unchanged.

References:
  Martens & Grosse, K-FAC, ICML 2015, eq. 1 (``(A (x) G)^-1 vec(X) = vec(A^-1 X G^-1)``).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from thor_optax._src import blocks
from thor_optax._src import explicit
from thor_optax._src import replicas
from thor_optax._src import sample_space
from thor_optax._src import stats as stats_lib


def _slot_blocks(state: Any, slot: blocks.FactorSlot) -> Any:
  """The stored per-block inverse state of the factor in ``slot`` (``(num_blocks, ...)``)."""
  return jax.tree.map(lambda v: v[slot.start:slot.stop], state.blocks[slot.group]["inverse"])


def layer_update(spec: Any, leaves: dict, blocks_of: dict, side: Any, cfg: Any,
                 lam: jax.Array, dtype: jnp.dtype, ready: Any, rows: Any = None,
                 num_loss_terms: int = 1) -> dict:
  """One layer's preconditioned gradient leaves (run per layer of a stack under ``vmap``).

  Args:
    spec: the layer's ``LayerSpec`` (one layer).
    leaves: ``{leaf name: gradient}``.
    blocks_of: ``{'a': ..., 'g': ...}`` the per-block inverse state of its factors.
    side: its side curvature state, or ``None``.
    cfg, lam, dtype, ready: as in :func:`precondition`.
    rows: the layer's statistics when it is preconditioned in sample space (its kernel and
      bias gradients are then not read), else ``None``.
    num_loss_terms: ``M`` of those statistics.

  Returns:
    the new leaves; with ``rows``, ``(u, vg)`` instead: the ``(d_A, d_G)`` update matrix and
    ``<u, X>`` when computed in sample space (``sample_space.layer_update``).
  """
  if spec.g is None:
    return spec.kind.side_precondition(spec, leaves, side, dtype)
  a = (cfg.group_method(spec.a.group).operator(blocks_of["a"]) if spec.a is not None
       else spec.kind.a_operator(spec, side, cfg.method))
  g = cfg.group_method(spec.g.group).operator(blocks_of["g"])
  if rows is not None:
    return sample_space.layer_update(spec, rows, a, g, num_loss_terms, dtype)
  x = spec.kind.to_matrix(spec, leaves, dtype)
  y = cfg.method.precondition(x, a, g, jnp.asarray(lam, dtype), ready,
                              cfg.damping.min_relative_damping)
  return spec.kind.from_matrix(spec, y, leaves)


def _ready(state: Any, spec: Any) -> jax.Array:
  """Whether every block of the layer has been refreshed at least once."""
  return jnp.all(jnp.stack([
      jnp.all(state.blocks[s.group]["record"].refreshes[s.start:s.stop] > 0)
      for s in spec.slots]))


def precondition(updates: Any, state: Any, layout: blocks.BlockLayout, cfg: Any,
                 lam: jax.Array, dtype: jnp.dtype, rows: Optional[dict] = None,
                 num_loss_terms: int = 1, inner_products: Optional[dict] = None) -> Any:
  """Applies the stored curvature of ``state`` (a ``KroneckerState``) to a gradient tree.

  Args:
    updates: gradient tree; the leaves of every layer in ``layout`` are preconditioned.
    state: the transform's state.
    layout: the tree's :class:`blocks.BlockLayout`.
    cfg: the transform's pieces (inverse method per group).
    lam: ``lambda`` at this step (eigh adds it to the eigenvalue products).
    dtype: the curvature's dtype (gradients are cast to it and back).
    rows: ``{layer name: statistics}`` of the layers preconditioned in sample space
      (``sample_space.layers_with_rows``; a stack's flattened to ``(copies, ...)``), whose
      gradient leaves are then not read; ``None``: every layer from its gradient.
    num_loss_terms: ``M`` of those statistics.
    inner_products: a dict to fill, or ``None``: for each layer preconditioned from its rows,
      ``<u, g>`` of its update and its gradient (float32 or wider scalar, summed over a
      stack; averaged across replicas under ``axis_name``), computed from the rows so that
      a KL clip need not form the gradient (``kl_clip.scale_by_kl_clip``).

  Returns:
    a tree like ``updates``; under an explicit-sharding mesh every preconditioned leaf has the
    sharding of the gradient leaf it replaces.
  """
  flat = {stats_lib.path_keys(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]}
  new_leaves = {}
  for spec in layout.layers:
    given = {name: flat[spec.path + (name,)] for name, _ in spec.shapes}
    # Explicit shardings (a kernel sharded over a model axis): the block-diagonal products need
    # whole rows and columns, so the leaves are gathered, and the results laid out as they were.
    leaves = {name: explicit.replicate(leaf) for name, leaf in given.items()}
    ready = (_ready(state, spec) if cfg.method.waits_for_all_blocks and spec.g is not None
             else True)
    blocks_of = {which: _slot_blocks(state, slot) for which, slot in (("a", spec.a), ("g", spec.g))
                 if slot is not None}
    side = state.layers.get(spec.name)
    one = spec.one_layer()
    layer_rows = (rows or {}).get(spec.name)

    def apply(leaves, blocks_of, side, layer_rows, one=one):
      if layer_rows is None:
        return layer_update(one, leaves, blocks_of, side, cfg, lam, dtype, ready), None
      u, vg = layer_update(one, leaves, blocks_of, side, cfg, lam, dtype, ready, layer_rows,
                           num_loss_terms)
      u = replicas.mean(u, cfg.axis_name)
      new = one.kind.from_matrix(one, u, leaves)
      if inner_products is None:
        return new, None
      if replicas.names(cfg.axis_name) or vg is None:  # <mean u, X> from this replica's rows
        vg = replicas.mean(sample_space.inner_product(one, layer_rows, u, num_loss_terms, dtype),
                           cfg.axis_name)
      return new, vg

    if spec.stack:
      new, vg = jax.vmap(apply)(spec.flat_stack(leaves), jax.tree.map(
          lambda v, c=spec.copies: v.reshape((c, -1) + v.shape[1:]), blocks_of), side,
          layer_rows)
      new = spec.unflat_stack(new, leaves)
      vg = None if vg is None else jnp.sum(vg)
    else:
      new, vg = apply(leaves, blocks_of, side, layer_rows)
    if vg is not None:
      inner_products[spec.name] = vg
    new_leaves.update({spec.path + (name,): explicit.reshard_like(leaf, given[name])
                       for name, leaf in new.items()})

  def pick(path, leaf):
    return new_leaves.get(stats_lib.path_keys(path), leaf)

  return jax.tree_util.tree_map_with_path(pick, updates)
