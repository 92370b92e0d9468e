"""``scale_by_thor`` and ``scale_by_kfac``: Kronecker-factored natural-gradient preconditioners.

Both are ``optax.GradientTransformationExtraArgs`` built on one mechanism; K-FAC is THOR with the
trace rule switched off, unsplit factors and running averages. ``update`` takes the raw per-layer
statistics as the keyword-only argument ``curvature_stats``:

* with statistics (a *check step*): per factor block, THOR's trace rule decides refresh / keep /
  freeze; the blocks due are formed, damped and inverted (one batched Cholesky per block size,
  only the selected blocks, see ``blocks.masked_block_update``); then the gradient is
  preconditioned;
* without statistics: the gradient is preconditioned with the stored inverses. Nothing else runs,
  so the step costs a first-order step plus two block-diagonal products per layer.

For a layer with kernel gradient ``dW`` (as a ``(d_in (+1 bias row), d_out)`` matrix) the update
is ``(A + d_A I)^-1 dW (G + d_G I)^-1`` with both inverses block-diagonal, i.e.
``((A + d_A I)^-1 (x) (G + d_G I)^-1) vec(dW)`` in row-major ``vec``. Leaves that are not a dense
or conv kernel/bias, and layers that never received statistics, pass through unchanged.

References:
  Chen et al., "THOR, Trace-Based Hardware-Driven Layer-Oriented Natural Gradient Descent
  Computation", AAAI 2021 (split damping sqrt(lambda) per factor, trace rule, 128-blocks).
  Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate Curvature",
  ICML 2015, eq. 1 and section 6.3 (factored damping, pi rule).
  Grosse & Martens, "A Kronecker-factored approximate Fisher matrix for convolution layers",
  ICML 2016 (conv factors).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from thor_optax._src import blocks
from thor_optax._src import factors
from thor_optax._src import inverse
from thor_optax._src import stats as stats_lib
from thor_optax._src import trace

ScalarOrSchedule = Union[float, optax.Schedule]


class LayerDiagnostics(NamedTuple):
  """Per-layer record of the curvature checks (all scalars).

  Attributes:
    blocks_refreshed: number of the layer's factor blocks (``A`` and ``G``) refreshed at its last
      check.
    num_blocks: the layer's total number of factor blocks.
    total_refreshes: block refreshes summed over all checks so far.
    frozen_blocks: blocks in THOR's frozen regime.
    trace_ratio: largest relative damped-trace change among the layer's blocks at the last
      check (0 for blocks refreshed for the first time).
  """

  blocks_refreshed: jax.Array
  num_blocks: jax.Array
  total_refreshes: jax.Array
  frozen_blocks: jax.Array
  trace_ratio: jax.Array


class KroneckerState(NamedTuple):
  """State of :func:`scale_by_thor` / :func:`scale_by_kfac`.

  Per-block arrays are stacked by block size: ``group`` keys such as ``'b128'`` index
  ``(n_blocks, b, b)`` / ``(n_blocks,)`` arrays holding the blocks of every layer's ``A`` and
  ``G`` (see ``blocks.build_layout`` for where each layer's blocks sit).

  Attributes:
    count: int32, number of ``update`` calls (steps); schedules are evaluated at it.
    inverses: ``{group: (n, b, b)}`` damped inverse blocks (identity before the first refresh).
    factors: ``{group: (n, b, b)}`` running-average factor blocks, empty without ``ema_decay``.
    trace_ref: ``{group: (n,)}`` damped trace of each block at its last refresh (0: never).
    frozen: ``{group: (n,)}`` bool, blocks in THOR's frozen regime.
    refreshes: ``{group: (n,)}`` int32, refreshes per block so far.
    diagnostics: ``{layer path: LayerDiagnostics}``.
  """

  count: jax.Array
  inverses: dict[str, jax.Array]
  factors: dict[str, jax.Array]
  trace_ref: dict[str, jax.Array]
  frozen: dict[str, jax.Array]
  refreshes: dict[str, jax.Array]
  diagnostics: dict[str, LayerDiagnostics]


def _state_dtype(tree: Any, dtype: Optional[jnp.dtype]) -> jnp.dtype:
  if dtype is not None:
    return jnp.dtype(dtype)
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.result_type(jnp.float32, *[x.dtype for x in leaves]) if leaves else jnp.float32


def _real_counts(slot: blocks.FactorSlot) -> np.ndarray:
  """``(num_blocks,)`` number of true (unpadded) dimensions per block."""
  starts = np.arange(slot.num_blocks) * slot.block
  return np.clip(slot.dim - starts, 0, slot.block).astype(np.float32)


def _init_state(layout: blocks.BlockLayout, dtype: jnp.dtype, ema: bool) -> KroneckerState:
  inverses, factor_blocks, trace_ref, frozen, refreshes = {}, {}, {}, {}, {}
  for group, (b, n) in layout.groups.items():
    inverses[group] = jnp.broadcast_to(jnp.eye(b, dtype=dtype), (n, b, b))
    if ema:
      factor_blocks[group] = jnp.zeros((n, b, b), dtype)
    trace_ref[group] = jnp.zeros((n,), dtype)
    frozen[group] = jnp.zeros((n,), bool)
    refreshes[group] = jnp.zeros((n,), jnp.int32)
  # A fresh buffer per leaf: a state whose leaves share buffers cannot be donated to jit.
  zero_i = lambda: jnp.zeros((), jnp.int32)
  diagnostics = {
      spec.name: LayerDiagnostics(
          blocks_refreshed=zero_i(),
          num_blocks=jnp.asarray(spec.a.num_blocks + spec.g.num_blocks, jnp.int32),
          total_refreshes=zero_i(), frozen_blocks=zero_i(),
          trace_ratio=jnp.zeros((), dtype))
      for spec in layout.layers
  }
  return KroneckerState(jnp.zeros((), jnp.int32), inverses, factor_blocks, trace_ref, frozen,
                        refreshes, diagnostics)


def _check_state_matches(layout: blocks.BlockLayout, state: KroneckerState) -> None:
  want = {g: (n, b, b) for g, (b, n) in layout.groups.items()}
  have = {g: tuple(x.shape) for g, x in state.inverses.items()}
  if want != have:
    raise ValueError(
        "optimizer state does not match the gradient tree: the gradients' dense/conv kernels "
        f"need factor blocks {want}, the state holds {have}. Was the state initialised with "
        "other parameters?")


def _slice(x: jax.Array, slot: blocks.FactorSlot) -> jax.Array:
  return x[slot.start:slot.stop]


def _layer_factors(spec, layer_stats, dtype):
  """Rows, scales and block traces of a layer's ``A`` and ``G``."""
  factors.check_stats(spec, layer_stats)
  a_rows, a_scale = factors.input_rows(spec, layer_stats, dtype)
  g_rows, g_scale = factors.cotangent_rows(spec, layer_stats, dtype)
  tr_a = blocks.block_traces(a_rows, a_scale, spec.a)
  tr_g = blocks.block_traces(g_rows, g_scale, spec.g)
  return (a_rows, a_scale, tr_a), (g_rows, g_scale, tr_g)


def _curvature_check(state: KroneckerState, layout: blocks.BlockLayout,
                     curvature_stats: Any, damping: jax.Array, *, omega1: float,
                     omega2: float, ema_decay: Optional[float], pi_damping: bool,
                     num_buckets: int) -> KroneckerState:
  """One check: trace rule per block, refresh of the blocks due, diagnostics."""
  dtype = next(iter(state.inverses.values())).dtype if state.inverses else jnp.float32
  by_name = {spec.name: spec for spec in layout.layers}
  flat = stats_lib.flatten_layer_stats(curvature_stats)
  unknown = sorted(set(flat) - set(by_name))
  if unknown:
    raise ValueError(
        f"curvature_stats has statistics for {unknown}, which match no dense/conv kernel in the "
        f"gradients (layers: {sorted(by_name)}). Were they captured from a different model?")
  missing = sorted(set(by_name) - set(flat))
  if missing:
    warnings.warn(
        f"curvature_stats has no statistics for layers {missing}; their gradients pass through "
        "unpreconditioned until statistics arrive.", stacklevel=3)

  sqrt_damping = jnp.sqrt(jnp.asarray(damping, dtype))
  # Per group: damped trace, damping and validity of every block; per factor: its rows.
  trace_now = {g: jnp.zeros((n,), dtype) for g, (_, n) in layout.groups.items()}
  block_damping = {g: jnp.ones((n,), dtype) for g, (_, n) in layout.groups.items()}
  valid = {g: jnp.zeros((n,), bool) for g, (_, n) in layout.groups.items()}
  rows_of = {}  # FactorSlot -> (rows, scale), for every factor with statistics
  for spec in layout.layers:
    if spec.name not in flat:
      continue
    (a_rows, a_scale, tr_a), (g_rows, g_scale, tr_g) = _layer_factors(
        spec, flat[spec.name], dtype)
    finite = jnp.all(jnp.isfinite(tr_a)) & jnp.all(jnp.isfinite(tr_g))
    if pi_damping:
      pi = jnp.sqrt((jnp.sum(tr_a) / spec.a.dim) / (jnp.sum(tr_g) / spec.g.dim))
      pi = jnp.where(jnp.isfinite(pi) & (pi > 0), pi, 1.0)
      d_a, d_g = pi * sqrt_damping, sqrt_damping / pi
    else:
      d_a = d_g = sqrt_damping
    for slot, rows, scale, tr, d in ((spec.a, a_rows, a_scale, tr_a, d_a),
                                     (spec.g, g_rows, g_scale, tr_g, d_g)):
      g = slot.group
      damped = jnp.where(finite, tr + d * _real_counts(slot), 0.0)
      trace_now[g] = trace_now[g].at[slot.start:slot.stop].set(damped)
      block_damping[g] = block_damping[g].at[slot.start:slot.stop].set(d)
      valid[g] = valid[g].at[slot.start:slot.stop].set(finite)
      rows_of[slot] = (rows, scale)

  decision = {
      g: trace.trace_rule(trace_now[g], state.trace_ref[g], state.frozen[g], valid[g],
                          omega1, omega2)
      for g in layout.groups
  }

  # Covariance blocks, formed only for the blocks due (per factor: its rows are its own).
  cov_parts = {g: [] for g in layout.groups}
  for spec in layout.layers:
    for slot in (spec.a, spec.g):
      zeros = jnp.zeros((slot.num_blocks, slot.block, slot.block), dtype)
      if slot not in rows_of:
        cov_parts[slot.group].append(zeros)
        continue
      rows, scale = rows_of[slot]
      mask = _slice(decision[slot.group].refresh, slot)
      cov, _ = blocks.masked_block_update(
          mask, zeros,
          lambda idx, rows=rows, scale=scale, slot=slot: (
              blocks.block_covariances(rows, scale, slot, idx), jnp.ones(idx.shape, bool)),
          num_buckets)
      cov_parts[slot.group].append(cov)

  new_inverses, new_factors, new_ref, new_frozen, new_refreshes = {}, {}, {}, {}, {}
  refreshed_of = {}
  for g, (b, n) in layout.groups.items():
    cov = jnp.concatenate(cov_parts[g], axis=0)
    real = jnp.asarray(layout.real_dims(g), dtype)
    dec = decision[g]
    first = state.trace_ref[g] <= 0
    old = {"inverse": state.inverses[g]}
    if ema_decay is not None:
      old["factor"] = state.factors[g]

    def refresh(idx, cov=cov, real=real, g=g, first=first, dmp=block_damping[g]):
      new = {"factor": jnp.take(cov, idx, axis=0)}
      if ema_decay is not None:
        avg = (ema_decay * jnp.take(state.factors[g], idx, axis=0)
               + (1.0 - ema_decay) * new["factor"])
        new["factor"] = jnp.where(first[idx][:, None, None], new["factor"], avg)
      new["inverse"] = inverse.cholesky_inverse(inverse.damp(new["factor"], dmp[idx], real[idx]))
      if ema_decay is None:
        del new["factor"]
      return new, inverse.is_finite_block(new["inverse"])

    out, refreshed = blocks.masked_block_update(dec.refresh, old, refresh, num_buckets)
    new_inverses[g] = out["inverse"]
    if ema_decay is not None:
      new_factors[g] = out["factor"]
    new_ref[g] = jnp.where(refreshed, trace_now[g], state.trace_ref[g])
    new_frozen[g] = state.frozen[g] | dec.freeze
    new_refreshes[g] = state.refreshes[g] + refreshed.astype(jnp.int32)
    refreshed_of[g] = refreshed

  diagnostics = dict(state.diagnostics)
  for spec in layout.layers:
    if spec.name not in flat:
      continue
    parts = [(slot.group, slot) for slot in (spec.a, spec.g)]
    diagnostics[spec.name] = LayerDiagnostics(
        blocks_refreshed=sum(jnp.sum(_slice(refreshed_of[g], s), dtype=jnp.int32)
                             for g, s in parts),
        num_blocks=state.diagnostics[spec.name].num_blocks,
        total_refreshes=sum(jnp.sum(_slice(new_refreshes[g], s), dtype=jnp.int32)
                            for g, s in parts),
        frozen_blocks=sum(jnp.sum(_slice(new_frozen[g], s), dtype=jnp.int32)
                          for g, s in parts),
        trace_ratio=jnp.maximum(*[jnp.max(_slice(decision[g].ratio, s)) for g, s in parts]),
    )
  return state._replace(inverses=new_inverses, factors=new_factors, trace_ref=new_ref,
                        frozen=new_frozen, refreshes=new_refreshes, diagnostics=diagnostics)


def precondition(updates: Any, inverses: dict[str, jax.Array],
                 layout: blocks.BlockLayout) -> Any:
  """Applies ``A^-1 dW G^-1`` (block-diagonal inverses) to every layer's kernel and bias.

  Args:
    updates: gradient tree (nested dicts with ``kernel``/``bias`` leaves).
    inverses: ``{group: (n, b, b)}`` damped inverse blocks.
    layout: the tree's :class:`blocks.BlockLayout`.

  Returns:
    a tree like ``updates``; leaves outside dense/conv layers are returned as they are.
  """
  new_leaves = {}
  flat = {stats_lib.path_keys(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]}
  for spec in layout.layers:
    kernel = flat[spec.path + ("kernel",)]
    a_inv = _slice(inverses[spec.a.group], spec.a)
    g_inv = _slice(inverses[spec.g.group], spec.g)
    x = factors.kernel_matrix(kernel).astype(a_inv.dtype)
    if spec.has_bias:
      bias = flat[spec.path + ("bias",)]
      x = jnp.concatenate([x, bias[None, :].astype(x.dtype)], axis=0)
    y = blocks.right_multiply(blocks.left_multiply(a_inv, x), g_inv)
    new_leaves[spec.path + ("kernel",)] = factors.kernel_from_matrix(
        y[:spec.d_in], spec.kernel_shape).astype(kernel.dtype)
    if spec.has_bias:
      new_leaves[spec.path + ("bias",)] = y[spec.d_in].astype(bias.dtype)

  def pick(path, leaf):
    return new_leaves.get(stats_lib.path_keys(path), leaf)

  return jax.tree_util.tree_map_with_path(pick, updates)


def _kronecker_preconditioner(
    damping: ScalarOrSchedule,
    block_size: Optional[int],
    trace_thresholds: tuple[float, float],
    ema_decay: Optional[float],
    pi_damping: bool,
    refresh_buckets: int,
    dtype: Optional[jnp.dtype],
) -> optax.GradientTransformationExtraArgs:
  """The shared mechanism behind :func:`scale_by_thor` and :func:`scale_by_kfac`."""
  omega1, omega2 = (float(t) for t in trace_thresholds)
  trace.check_thresholds(omega1, omega2)
  if ema_decay is not None and not 0.0 <= ema_decay < 1.0:
    raise ValueError(f"ema_decay must be in [0, 1) or None, got {ema_decay}")
  if refresh_buckets < 1:
    raise ValueError(f"refresh_buckets must be >= 1, got {refresh_buckets}")
  if isinstance(damping, (int, float)) and not damping > 0:
    raise ValueError(f"damping must be positive, got {damping}")

  def init_fn(params):
    layout = blocks.build_layout(params, block_size)
    return _init_state(layout, _state_dtype(params, dtype), ema_decay is not None)

  def update_fn(updates, state, params=None, *, curvature_stats=None, **extra_args):
    del params, extra_args
    layout = blocks.build_layout(updates, block_size)
    _check_state_matches(layout, state)
    if curvature_stats is not None:
      lam = damping(state.count) if callable(damping) else damping
      state = _curvature_check(state, layout, curvature_stats, lam, omega1=omega1,
                               omega2=omega2, ema_decay=ema_decay, pi_damping=pi_damping,
                               num_buckets=refresh_buckets)
    updates = precondition(updates, state.inverses, layout)
    return updates, state._replace(count=optax.safe_int32_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_thor(
    damping: ScalarOrSchedule = 0.03,
    *,
    block_size: Optional[int] = 128,
    trace_thresholds: tuple[float, float] = (0.01, 0.0),
    ema_decay: Optional[float] = None,
    pi_damping: bool = False,
    refresh_buckets: int = 4,
    dtype: Optional[jnp.dtype] = None,
) -> optax.GradientTransformationExtraArgs:
  """THOR's natural-gradient preconditioner (trace rule, uniform blocks, split damping).

  Call ``update(grads, state, params, curvature_stats=stats)`` on check steps (statistics from
  ``thor_optax.flax.value_and_grad_with_stats``) and ``update(grads, state, params)`` on the
  others; :class:`thor_optax.CheckSchedule` says which is which.

  Args:
    damping: ``lambda``, a positive float or a schedule of the step count; ``sqrt(lambda)`` is
      added to each factor's diagonal (THOR/MindSpore convention; with ``pi_damping``,
      ``pi sqrt(lambda)`` to ``A`` and ``sqrt(lambda) / pi`` to ``G``).
    block_size: THOR's split size ``b`` (rows/columns per diagonal block; the paper's 128), or
      ``None`` to keep every factor whole.
    trace_thresholds: ``(omega1, omega2)`` of the trace rule, ``0 <= omega2 <= omega1``:
      ``(0.01, 0)`` is THOR, ``(0.01, 0.001)`` THOR_stop, ``(0, 0)`` refreshes every block at
      every check.
    ema_decay: if set, a block's factor is the running average ``decay * old + (1 - decay) *
      new`` over its refreshes (stored in the state; doubles its memory). THOR uses ``None``:
      the current batch only.
    pi_damping: split the damping with the pi rule (Martens & Grosse 2015, section 6.3).
    refresh_buckets: number of static budgets a masked refresh chooses from (see
      ``blocks.masked_block_update``); more buckets track the refreshed count more tightly at
      the cost of compile time.
    dtype: dtype of factors and inverses; default: float32, or float64 for float64 parameters.

  Returns:
    an ``optax.GradientTransformationExtraArgs`` with state :class:`KroneckerState`.

  Raises:
    ValueError: on invalid hyperparameters (at construction); in ``update``, when statistics
      name a layer with no kernel in the gradients, do not fit a layer's kernel (the message
      names the layer path and the expected shape), or the state was built for other
      parameters.

  References:
    Chen et al., "THOR", AAAI 2021 (trace rule, hardware-driven split, split damping).
  """
  return _kronecker_preconditioner(damping, block_size, trace_thresholds, ema_decay,
                                   pi_damping, refresh_buckets, dtype)


def scale_by_kfac(
    damping: ScalarOrSchedule = 0.03,
    *,
    ema_decay: Optional[float] = 0.95,
    block_size: Optional[int] = None,
    pi_damping: bool = False,
    dtype: Optional[jnp.dtype] = None,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioner: every block refreshed at every check, whole factors, running average.

  The same transform as :func:`scale_by_thor` with ``trace_thresholds=(0, 0)``; the factor and
  inverse period is the check interval (:class:`thor_optax.CheckSchedule`).

  Args:
    damping: ``lambda`` (float or schedule of the step); ``sqrt(lambda)`` per factor.
    ema_decay: running-average decay of the factors (kfac-pytorch's ``factor_decay``), or
      ``None`` for the current batch only.
    block_size: ``None`` (default) inverts whole factors; an int splits them as THOR does.
    pi_damping: split the damping with the pi rule.
    dtype: dtype of factors and inverses (default float32, float64 for float64 parameters).

  Returns:
    an ``optax.GradientTransformationExtraArgs`` with state :class:`KroneckerState`.

  Raises:
    ValueError: as :func:`scale_by_thor`.

  References:
    Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature", ICML 2015; Grosse & Martens, ICML 2016 (conv layers).
  """
  return _kronecker_preconditioner(damping, block_size, (0.0, 0.0), ema_decay, pi_damping,
                                   1, dtype)
