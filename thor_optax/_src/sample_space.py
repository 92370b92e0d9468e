"""Preconditioning in sample space: a plain step from the rows behind the gradient.

A dense layer's gradient matrix is ``X = a^T g / M`` (``a (R, d_A)`` its input rows with the
bias column, ``g (R, d_G)`` its output cotangents, ``M`` loss terms), so the preconditioned
gradient factors through the rows:

    A^-1 X G^-1 = (a A^-1)^T (g G^-1) / M.

Each factor can be applied on either side of the gradient's GEMM: ``A^-1`` to the ``(R, d_A)``
rows costs ``2 R d_A c_A`` FLOPs, to the ``(d_A, d_G)`` matrix ``2 d_A d_G c_A`` (``c_A`` the
stored inverse's cost per entry: the block size for 128-blocks). So ``A^-1`` goes on the rows
when ``R < d_G`` and ``G^-1`` when ``R < d_A`` (:func:`sides`, from static shapes), and the
product of the two sides replaces the gradient's own GEMM, which XLA removes from the backward
pass when the step is jitted as a whole. For an MLP at batch 128 with 128-blocks this is about
five times fewer FLOPs than the block products on ``X`` (784-512 layer: 42 M against 206 M).
Both forms give the same update up to rounding.

A plain step gets the rows from a capture: ``update(grads, state, params,
gradient_stats=stats)``, ``stats`` from ``value_and_grad_with_stats`` on the step's batch with
the empirical Fisher (default). Only layers the statistics list in ``exact_rows`` qualify
(their rows are the gradient's, see :class:`thor_optax.CurvatureStats`), with an inverse method
that applies ``A`` and ``G`` factor by factor (not ``'eigh'``'s exact damping of
``A (x) G``). Under ``axis_name`` the per-replica products are averaged
(``jax.lax.pmean``), as the gradients are.

References:
  Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
  Curvature", ICML 2015, section 3 (the gradient ``a^T g``) and eq. 1
  (``(A (x) G)^-1 vec(X) = vec(A^-1 X G^-1)``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional
import warnings

import jax
import jax.numpy as jnp

from thor_optax._src import blocks
from thor_optax._src import check_step as check_lib
from thor_optax._src import explicit
from thor_optax._src import replicas
from thor_optax._src import stats as stats_lib
from thor_optax._src.layers import base as layer_base


class Sides(NamedTuple):
  """Which factors of a layer a plain step applies to the rows (static).

  Attributes:
    a: ``a A^-1`` on the ``(R, d_A)`` input rows, else ``A^-1 X`` on the gradient matrix.
    g: ``g G^-1`` on the ``(R, d_G)`` cotangent rows, else ``X G^-1``.
  """

  a: bool
  g: bool


def sides(spec: layer_base.LayerSpec, num_rows: int) -> Sides:
  """The cheaper side of each factor for a layer with ``num_rows`` rows ``R`` (per layer of a
  stack).

  Applying ``A^-1`` to the rows costs ``2 R d_A c_A`` FLOPs, to the ``(d_A, d_G)`` matrix
  ``2 d_A d_G c_A`` (``c_A``: the stored inverse's cost per entry, the same either way), so the
  rows win exactly when ``R < d_G``; likewise ``G^-1`` when ``R < d_A``. The product of the two
  sides, ``a'^T g'``, costs what the gradient's GEMM costs, which it replaces.
  """
  return Sides(a=num_rows < spec.g.dim, g=num_rows < spec.a.dim)


def eligible(spec: layer_base.LayerSpec, cfg: Any) -> bool:
  """Whether the layer can be preconditioned from its rows at all (static): a kind whose rows
  give its gradient, both factors in block stacks, one group, and an inverse method applied
  factor by factor."""
  return (spec.kind.gradient_from_rows and spec.a is not None and spec.g is not None
          and spec.groups == 1 and not cfg.method.waits_for_all_blocks)


def layer_update(spec: layer_base.LayerSpec, stats: Any, a_inverse: Any, g_inverse: Any,
                 num_loss_terms: int, dtype: jnp.dtype) -> tuple[jax.Array, Optional[jax.Array]]:
  """``A^-1 X G^-1`` with ``X = a^T g / M`` formed from the rows, each factor applied on its
  cheaper side (:func:`sides`): ``(a A^-1)^T (g G^-1) / M`` when both are narrow in rows.

  Args:
    spec: one layer (run per layer of a stack under ``vmap``).
    stats: its statistics (inputs ``(N, ..., d_in)``, cotangents ``(1, N, ..., d_out)``).
    a_inverse, g_inverse: the factors' stored inverses (values with ``left`` / ``right``).
    num_loss_terms: ``M``.
    dtype: the curvature's dtype.

  Returns:
    ``(u, vg)``: ``u`` ``(d_A, d_G)``, the bias row last, as ``A^-1 X G^-1`` of the gradient
    matrix ``X``; ``vg`` the scalar ``<u, X>`` (what a KL clip needs) in sample space when both
    factors are applied on the rows, ``sum((a A^-1 a^T) * (g G^-1 g^T)) / M^2`` at
    ``2 R^2 (d_A + d_G)`` FLOPs instead of the ``2 R d_A d_G`` of ``X``, else ``None``
    (:func:`inner_product` from ``u``). XLA drops it when unused.
  """
  a0 = spec.kind.input_rows(spec, stats, dtype).rows           # (R, d_A)
  g0 = spec.kind.cotangent_rows(spec, stats, dtype).rows       # (R, d_G)
  a, g = a0, g0
  side = sides(spec, a.shape[0])
  if side.a:
    a = a_inverse.right(a)                                      # a A^-1 (A^-1 symmetric)
  if side.g:
    g = g_inverse.right(g)                                      # g G^-1
  x = jnp.einsum("ri,rj->ij", a, g, out_sharding=explicit.contraction_sharding(a, g))
  m = jnp.asarray(num_loss_terms, dtype)
  x = x / m
  vg = None
  if side.a and side.g:  # <P^T Q, a0^T g0> / M^2 = sum((P a0^T) * (Q g0^T)) / M^2
    # (R x R products of rows: under an explicit mesh that shards the rows, replicated)
    rr = explicit.contraction_sharding(a, a0, g, g0)
    vg = jnp.sum(jnp.einsum("ri,si->rs", a, a0, out_sharding=rr)
                 * jnp.einsum("rj,sj->rs", g, g0, out_sharding=rr)) / (m * m)
  if not side.a:
    x = a_inverse.left(x)
  if not side.g:
    x = g_inverse.right(x)
  return x, vg


def inner_product(spec: layer_base.LayerSpec, stats: Any, u: jax.Array, num_loss_terms: int,
                  dtype: jnp.dtype) -> jax.Array:
  """``<u, X>`` with ``X = a^T g / M`` from the rows: ``sum((a u) * g) / M`` (``2 R d_A d_G``
  FLOPs, those of ``X``; used where a factor is not applied on the rows, or ``u`` is averaged
  across replicas)."""
  a = spec.kind.input_rows(spec, stats, dtype).rows
  g = spec.kind.cotangent_rows(spec, stats, dtype).rows
  return jnp.sum((a @ u) * g) / jnp.asarray(num_loss_terms, dtype)


def layers_with_rows(gradient_stats: stats_lib.CurvatureStats, layout: blocks.BlockLayout,
                     cfg: Any, masked: stats_lib.MaskedModules,
                     updates: Any) -> tuple[blocks.BlockLayout, dict[str, Any]]:
  """The layers a plain step preconditions in sample space, with their statistics.

  Args:
    gradient_stats: the step's statistics (``value_and_grad_with_stats``).
    layout: the gradient tree's layout.
    cfg: the transform's pieces.
    masked: modules that ``optax.masked`` hid from the transform (their statistics are dropped).
    updates: the gradient tree the transform was given. A layer is taken from its rows only if
      its leaves are the arrays the capture returned together with these statistics
      (``stats.is_captured_gradient``: not another batch's, not clipped, not accumulated over
      micro-batches), or under ``axis_name`` (the gradients come ``jax.lax.pmean``-ed, and
      the rows' products are averaged the same way).

  Returns:
    ``(layout, {layer name: statistics})``: the layout with each layer's kind its statistics'
    (as a check step takes it), and the statistics (a stack's flattened to ``(copies, ...)``)
    of the layers listed in ``exact_rows`` that are :func:`eligible`, have at least one
    factor cheaper on the rows (:func:`sides`) and whose gradient leaves are those the
    capture returned with these statistics.

  Raises:
    TypeError: if ``gradient_stats`` is not a :class:`thor_optax.CurvatureStats`.
    ValueError: if the statistics name a layer that is not in the gradients, or do not fit a
      layer's weights (the message names the layer).
  Warns:
    UserWarning: naming the layers whose gradient leaves are not the capture's (a transform
      before this one changed them, or the capture ran in another ``jax.jit``): they are
      preconditioned from their gradients, which is right but forgoes the rows' savings.
  """
  if not isinstance(gradient_stats, stats_lib.CurvatureStats):
    raise TypeError(
        f"gradient_stats must be the CurvatureStats of value_and_grad_with_stats, got "
        f"{type(gradient_stats).__name__}.")
  flat = {name: layer for name, layer in stats_lib.flatten_layer_stats(gradient_stats).items()
          if name not in masked}
  unknown = sorted(set(flat) - {spec.name for spec in layout.layers})
  if unknown:
    raise ValueError(
        f"gradient_stats has statistics for {unknown}, which match no layer in the gradients. "
        "Capture them from the model whose gradients you pass, on the same batch (with "
        "nnx.Optimizer(model, tx, wrt=...), pass the same wrt= to "
        "thor_optax.nnx.value_and_grad_with_stats).")
  layout = check_lib.as_captured(layout, flat)
  leaves = {stats_lib.path_keys(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]}
  pmeaned = bool(replicas.names(cfg.axis_name))
  if pmeaned:  # the rows' products are averaged over it: it must be bound (jax.pmap)
    replicas.check_axis(cfg.axis_name, "a plain step from the rows (update with gradient_stats)")
  chosen: dict[str, Any] = {}
  transformed = []
  for spec in layout.layers:
    stats = flat.get(spec.name)
    if stats is None or spec.name not in gradient_stats.exact_rows or not eligible(spec, cfg):
      continue
    # Under an explicit-sharding mesh: the examples sharded as the check step has them, no
    # feature axis sharded (a model axis's kernels give feature-sharded inputs).
    stats = explicit.align_examples(stats, spec.kind.example_axes)
    if spec.stack:
      stats = spec.flat_stack(stats)
    one = spec.one_layer()
    one_stats = jax.eval_shape(lambda s: jax.tree.map(lambda x: x[0], s), stats) \
        if spec.stack else stats
    spec.kind.check_stats(one, one_stats)  # another model's statistics: an error, first
    if not (pmeaned or all(stats_lib.is_captured_gradient(leaves[spec.path + (name,)],
                                                          flat[spec.name])
                           for name, _ in spec.shapes)):
      transformed.append(spec.name)
      continue
    rows = jax.eval_shape(lambda s, one=one: one.kind.input_rows(one, s, jnp.float32).rows,
                          one_stats).shape[0]
    if any(sides(one, rows)):
      chosen[spec.name] = stats
  if transformed:
    warnings.warn(
        f"gradient_stats: the gradients of {transformed} that reached the preconditioner are "
        "not the arrays value_and_grad_with_stats returned with these statistics in this "
        "trace, so these layers are preconditioned from their gradients: right, but without "
        "the rows' savings. Either a "
        "transform before the preconditioner changed them (gradient clipping, a scale, weight "
        "decay, an accumulation over micro-batches: its effect is kept, and gradient_stats "
        "can be left out), the statistics are another batch's, or the capture was jitted "
        "apart from the update (call value_and_grad_with_stats and tx.update in one jitted "
        "step).", stacklevel=5)
  return layout, chosen
