"""``scale_by_kl_clip``: KAISA's KL clip of a preconditioned update.

A natural-gradient step ``-lr * u`` with ``u = F^-1 g`` changes the model's output
distribution by ``KL ~ 1/2 lr^2 u^T F u = 1/2 lr^2 u^T g``. KL clipping bounds that change:
the preconditioned update is scaled by

    nu = min(1, sqrt(max_kl / |lr^2 * <u, g>|)),

where ``<u, g>`` is the inner product over the whole parameter tree (kfac-pytorch drops the
factor 1/2, as done here). ``nu`` is 1 when the step is already small, or when ``<u, g>`` is 0
or not finite (nothing to measure the step by).

References:
  Pauloski et al., "KAISA: An Adaptive Second-Order Optimizer Framework for Deep Neural
  Networks", SC 2021, and its implementation kfac-pytorch (``kl_clip``, default 0.001).
  Ba, Grosse & Martens, "Distributed Second-Order Optimization using Kronecker-Factored
  Approximations", ICLR 2017, section 5 (KL-clipping).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from thor_optax._src import static_args
from thor_optax._src import stats as stats_lib

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]


class KLClipState(NamedTuple):
  """State of :func:`scale_by_kl_clip`.

  Attributes:
    count: int32 scalar, number of ``update`` calls; a learning-rate schedule is read at it.
    inner_state: the wrapped preconditioner's state.
    scale: float32 scalar, the factor ``nu`` in ``(0, 1]`` applied at the last ``update``
      (1 before the first), for diagnostics.
  """

  count: jax.Array
  inner_state: optax.OptState
  scale: jax.Array


def _at_least_float32(tree: Any) -> Any:
  """Casts every leaf to ``promote_types(dtype, float32)`` (bf16/f16 inner products in f32)."""
  return jax.tree_util.tree_map(
      lambda x: jnp.asarray(x).astype(jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)),
      tree)


def tree_inner_product(updates: Any, grads: Any, skip: frozenset[str] = frozenset()
                       ) -> jax.Array:
  """``sum_leaves sum(u * g)`` in float32 or wider, leaving out the leaves of the layers (module
  paths) in ``skip``."""
  # Elementwise products and sums, not ``optax.tree_utils.tree_vdot``: a dot product over an
  # axis sharded with an explicit sharding (a kernel split over a model axis) is rejected.
  flat_u = jax.tree_util.tree_flatten_with_path(_at_least_float32(updates))[0]
  flat_g = jax.tree_util.tree_leaves(_at_least_float32(grads))
  vg = jnp.zeros((), jnp.float32)
  for (path, u), g in zip(flat_u, flat_g):
    if not skip or stats_lib.layer_name(stats_lib.path_keys(path)[:-1]) not in skip:
      vg = vg + jnp.sum(u * g)
  return vg.astype(jnp.promote_types(vg.dtype, jnp.float32))


def clip_factor(vg: jax.Array, learning_rate: Any, max_kl: Any) -> jax.Array:
  """The KL-clip factor ``nu = min(1, sqrt(max_kl / |lr^2 vg|))``.

  Args:
    vg: scalar ``<u, g>`` of the preconditioned update and the gradient
      (:func:`tree_inner_product`, plus what the preconditioner computed from rows).
    learning_rate: scalar ``lr`` (array or float).
    max_kl: scalar bound ``kappa`` on ``lr^2 <u, g>`` (dimensionless, a KL in nats up to the
      factor 2 that kfac-pytorch drops).

  Returns:
    scalar ``nu`` (``vg``'s dtype) in ``(0, 1]``; exactly 1 when the denominator
    ``|lr^2 vg|`` is 0 or not finite.
  """
  lr = jnp.asarray(learning_rate, vg.dtype)
  denom = jnp.abs(lr * lr * vg)
  ok = jnp.isfinite(denom) & (denom > 0)
  ratio = jnp.asarray(max_kl, vg.dtype) / jnp.where(ok, denom, 1.0)
  nu = jnp.minimum(1.0, jnp.sqrt(ratio))
  return jnp.where(ok & jnp.isfinite(nu), nu, 1.0).astype(vg.dtype)


def scale_by_kl_clip(
    preconditioner: optax.GradientTransformation,
    learning_rate: ScalarOrSchedule,
    max_kl: float = 1e-3,
) -> optax.GradientTransformationExtraArgs:
  """Wraps a preconditioner and scales its update by KAISA's KL-clip factor ``nu``.

  ``update(grads, state, params=None, **extra_args)`` runs ``preconditioner.update(grads,
  inner_state, params, **extra_args)`` (extra arguments such as ``curvature_stats=`` are
  forwarded; a plain ``GradientTransformation`` ignores them) to get ``u``, then returns
  ``nu * u`` with ``nu = min(1, sqrt(max_kl / |lr^2 * sum_leaves sum(u * grads)|))``, or
  ``nu = 1`` when that denominator is 0 or not finite. Each leaf keeps its dtype.

  Put it directly around the preconditioner and before the learning rate, momentum and weight
  decay (as :func:`thor_optax.kaisa` does): ``grads`` must be the raw gradient and ``u`` the
  preconditioned one. ``learning_rate`` is only read here (it is the step size the chain
  applies later), not applied.

  With ``gradient_stats=`` (a plain step from the rows, :func:`thor_optax.scale_by_thor`) the
  preconditioner reports ``<u, g>`` of each layer it preconditioned from its rows, computed from
  the rows (sample space), and those layers' gradient leaves are not read here: their kernel
  gradients are never formed.

  The inner product and the scale run over every leaf of the tree; kfac-pytorch restricts both
  to the layers it preconditions, so leaves the preconditioner passes through unchanged
  (biases of unregistered layers, normalization layers without statistics) add their
  ``|g|^2`` to the sum here.

  Args:
    preconditioner: the transform producing ``u`` from the gradient, e.g.
      :func:`thor_optax.scale_by_kfac`.
    learning_rate: float, scalar array or optax schedule of the step; a schedule is read at
      this wrapper's own step count (``KLClipState.count``, which counts ``update`` calls
      like the schedule of ``optax.sgd`` does).
    max_kl: bound ``kappa > 0`` (kfac-pytorch's ``kl_clip``, default 0.001). May be a traced
      scalar under ``optax.inject_hyperparams``.

  Returns:
    an ``optax.GradientTransformationExtraArgs`` with state :class:`KLClipState`.

  Raises:
    TypeError: at construction, if ``preconditioner`` is not an optax transformation (e.g. the
      constructor itself, not called, or the arguments swapped), or ``learning_rate`` or
      ``max_kl`` is not a number (or a schedule, for the rate); in ``update``, if the state is
      not a :class:`KLClipState` (``None``, or the parameters in its place).
    ValueError: at construction, if ``max_kl`` is a number (Python, numpy, 0-d array) that is
      not positive, or ``learning_rate`` one that is negative or not finite.

  References:
    Pauloski et al., "KAISA", SC 2021 (kfac-pytorch ``kl_clip``); Ba, Grosse & Martens,
    "Distributed Second-Order Optimization using Kronecker-Factored Approximations",
    ICLR 2017 (KL-clipping).
  """
  static_args.check_transform("scale_by_kl_clip", "preconditioner", preconditioner)
  static_args.check_number("scale_by_kl_clip", "learning_rate", learning_rate,
                           lambda v: 0 <= v < math.inf, "finite and >= 0", schedule=True)
  static_args.check_number("scale_by_kl_clip", "max_kl", max_kl, lambda v: v > 0, "positive",
                           advice="For no KL clip use the preconditioner without this wrapper "
                           "(the aliases: max_kl=None).")
  inner = optax.with_extra_args_support(preconditioner)

  def init_fn(params):
    return KLClipState(count=jnp.zeros([], jnp.int32), inner_state=inner.init(params),
                       scale=jnp.ones([], jnp.float32))

  def update_fn(updates, state, params=None, **extra_args):
    static_args.check_state("scale_by_kl_clip", state, ("count", "inner_state"), "KLClipState")
    from_rows = {}  # <u, g> of the layers the preconditioner took from their rows
    if getattr(extra_args.get("gradient_stats"), "exact_rows", ()):
      extra_args = {**extra_args, "inner_products": from_rows}
    precond, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    vg = tree_inner_product(precond, updates, frozenset(from_rows))
    vg = sum(from_rows.values(), vg)  # (promotes: float64 rows keep float64)
    nu = clip_factor(vg, lr, max_kl)
    clipped = jax.tree_util.tree_map(lambda u: u * nu.astype(jnp.asarray(u).dtype), precond)
    new_state = KLClipState(count=optax.safe_int32_increment(state.count),
                            inner_state=inner_state, scale=nu.astype(jnp.float32))
    return clipped, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
