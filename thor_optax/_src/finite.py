"""``skip_not_finite``: a step whose gradient, statistics or update is not finite changes
nothing.

``optax.apply_if_finite`` skips a step whose *gradient* has a NaN or an Inf, and gives up after
``max_consecutive_errors`` such steps. A second-order optimizer can also turn a finite gradient
into a non-finite update (a NaN learning rate or damping from a schedule, an inverse that
overflowed), and a check step can bring non-finite curvature statistics with a finite
gradient, so this wrapper runs the inner update, then keeps its result only if the gradient
and the update are finite; otherwise it returns zero updates and the inner state as it was
(momentum, curvature blocks, counts), and never gives up. Non-finite statistics
(``curvature_stats=``) reach it as a non-finite update: this package's curvature transforms
return NaN updates from a check step whose statistics are not finite, judged by the block
traces they compute anyway, so the guard does not read the statistics again (reducing over
every one of them took 26 of the 308 kernels of the MNIST MLP's check step).
Its state is optax's own ``ApplyIfFiniteState``, so the counters read as they do under
``optax.apply_if_finite``.

Every alias of this package (``thor``, ``kfac``, ``skfac``, ``kaisa``, ``spngd``) wraps its
chain in it unless built with ``skip_not_finite=False``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from thor_optax._src import explicit
from thor_optax._src import static_args
from thor_optax._src import stats as stats_lib


# Leaves of at least this many entries are checked each on its own (a reduction that reads
# them once); smaller ones together, concatenated (copying them costs little).
_OWN_REDUCTION = 1 << 15


def all_finite(tree: Any) -> jax.Array:
  """Bool scalar: every entry of every inexact leaf of ``tree`` is finite (True if none).

  XLA compiles a reduction per leaf shape as its own kernel, so a check of every leaf on its
  own made the guard a sizeable share of a check step's compile time on CPU. Small leaves
  (biases, scales, block traces) are therefore checked in one reduction over their
  concatenation, ``sum(0 * x)``: 0 if every entry is finite and NaN if any is not
  (``0 * inf`` is NaN), whatever the entries' size; large leaves, each on its own."""
  leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
  leaves = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
  # Leaves typed with an explicit-sharding mesh keep their own reduction too: flattening them
  # into one array would need a sharding for it (or gathering them).
  own = [x.size >= _OWN_REDUCTION or explicit.explicit_mesh(x) is not None for x in leaves]
  large = [jnp.all(jnp.isfinite(x)) for x, o in zip(leaves, own) if o]
  small = [x for x, o in zip(leaves, own) if not o]
  if small:
    dtype = jnp.result_type(*small)
    flat = jnp.concatenate([jnp.ravel(x).astype(dtype) for x in small])
    large.append(jnp.isfinite(jnp.sum(flat * 0)))
  return jnp.all(jnp.stack(large)) if large else jnp.asarray(True)


def _gradient_finite(grads: Any, gradient_stats: Any) -> jax.Array:
  """Whether the gradient is finite, outside the layers a plain step may precondition from
  their rows (``gradient_stats.exact_rows``). Those are judged by their update alone, which is
  not finite when their rows are not: their kernel gradient is not read, so under jit its GEMM
  is never computed."""
  exact = frozenset(getattr(gradient_stats, "exact_rows", ()))
  if not exact:
    return all_finite(grads)
  flat, _ = jax.tree_util.tree_flatten_with_path(grads)
  return all_finite([leaf for path, leaf in flat
                     if stats_lib.layer_name(stats_lib.path_keys(path)[:-1]) not in exact])


def _keep_if(accept: jax.Array, new: Any, old: Any) -> Any:
  """``new`` if ``accept`` else ``old`` (trees of one structure).

  Leaves the step passed through (the same array in both) are kept as they are. Large changed
  leaves (momentum, inverse blocks) get a select each, which XLA fuses into the kernel that
  computes them; the small ones (counts, traces, records, diagnostics: most of a check step's
  leaves) are chosen together in one ``lax.cond``: a select per small leaf made the guard a
  sizeable share of a check step's compile time on CPU, and a ``cond`` over the large ones
  would copy them (a plain step of the MNIST MLP took 16% longer). (``lax.select`` keeps typed
  PRNG keys; ``jnp.where`` would turn them into their key data.) A leaf whose dtype the step
  changed is kept in the new dtype."""
  new_leaves, treedef = jax.tree_util.tree_flatten(new)
  old_leaves = treedef.flatten_up_to(old)
  leaves = list(new_leaves)
  small = []
  for i, (n, o) in enumerate(zip(new_leaves, old_leaves)):
    if n is o:
      continue
    if not isinstance(o, (jax.Array, np.ndarray, np.generic)) and hasattr(o, "__jax_array__"):
      # An array wrapper (an ``nnx.Variable`` of a state made by ``tx.init(nnx.state(model,
      # nnx.Param))`` and updated with pure arrays): JAX no longer converts it implicitly.
      old_leaves[i] = o = jnp.asarray(o)
    if jnp.result_type(o) != jnp.result_type(n):
      # The step changed a leaf's dtype (bfloat16 momentum given a float32 rate or momentum
      # promotes to float32): the kept leaf takes the new dtype, as without the guard.
      old_leaves[i] = o = jnp.asarray(o).astype(jnp.result_type(n))
    # Under an explicit-sharding mesh each leaf keeps the sharding it was given (momentum
    # placed replicated comes back from the step sharded like its gradient).
    leaves[i] = new_leaves[i] = n = explicit.reshard_like(n, o)
    if jnp.size(n) >= _OWN_REDUCTION:
      leaves[i] = jax.lax.select(accept, n, o)
    else:
      small.append(i)
  if small:
    picked = jax.lax.cond(accept, lambda: [new_leaves[i] for i in small],
                          lambda: [old_leaves[i] for i in small])
    for i, leaf in zip(small, picked):
      leaves[i] = leaf
  return jax.tree_util.tree_unflatten(treedef, leaves)


def skip_not_finite(inner: optax.GradientTransformation
                    ) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that a step with a non-finite gradient, statistics or update changes
  nothing.

  Args:
    inner: any optax transformation (extra arguments such as ``curvature_stats=`` are passed
      through to it).

  Returns:
    an ``optax.GradientTransformationExtraArgs`` whose state is ``optax.ApplyIfFiniteState``:
    ``notfinite_count`` (int32 scalar: consecutive skipped steps, 0 after an accepted one),
    ``last_finite`` (bool scalar: whether the last step was accepted), ``total_notfinite``
    (int32 scalar: skipped steps in all) and ``inner_state``. A skipped step returns updates of
    zeros (shapes and dtypes of the gradient) and ``inner_state`` unchanged.

  With ``gradient_stats=`` (a plain step preconditioned in sample space) the gradient leaves of
  the layers listed in the statistics' ``exact_rows`` are judged by their update alone: it is
  computed from the layer's rows (or from its gradient), so it is not finite when they are
  not, and their kernel gradient, not read, is then never computed under jit. Every other
  gradient leaf, and the whole update, are checked as always.

  On a check step non-finite statistics (``curvature_stats=``) skip the step as a non-finite
  gradient does: this package's curvature transforms (``scale_by_thor``, ``scale_by_kfac``,
  ...) return NaN updates from them, which the update check catches.

  Unlike ``optax.apply_if_finite`` the update is checked too, and the wrapper never gives up:
  read ``notfinite_count`` (e.g. ``optax.tree_utils.tree_get(opt_state, 'notfinite_count')``)
  to stop a run whose steps keep failing.

  Raises:
    TypeError: at construction, if ``inner`` is not an optax transformation (e.g. the
      constructor ``optax.sgd`` itself, not called); in ``update``, if the state is not the
      ``optax.ApplyIfFiniteState`` that ``init`` returned (``None``, or the parameters passed
      in its place: ``update(grads, opt_state, params)`` in this order).

  Source: ``optax.apply_if_finite`` (its state and semantics), extended to the update, so that
  it also catches what the second-order step adds: non-finite curvature statistics, damping
  or damped inverses of the preconditioners (THOR, Chen et al., AAAI 2021; K-FAC, Martens &
  Grosse, ICML 2015, section 6.3 for the damping).
  """
  static_args.check_transform("skip_not_finite", "inner", inner)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return optax.ApplyIfFiniteState(
        notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.asarray(True),
        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    static_args.check_state("skip_not_finite", state,
                            ("notfinite_count", "total_notfinite", "inner_state"),
                            "optax.ApplyIfFiniteState")
    new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
    finite = _gradient_finite(updates, extra_args.get("gradient_stats")) & all_finite(new_updates)
    inner_state = _keep_if(finite, new_inner, state.inner_state)
    new_updates = jax.tree_util.tree_map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)),
                                         new_updates)
    return new_updates, optax.ApplyIfFiniteState(
        notfinite_count=jnp.where(finite, 0, optax.safe_int32_increment(state.notfinite_count)),
        last_finite=finite,
        total_notfinite=jnp.where(finite, state.total_notfinite,
                                  optax.safe_int32_increment(state.total_notfinite)),
        inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
