"""``scale_by_thor`` and ``scale_by_kfac``: Kronecker-factored natural-gradient preconditioners.

Both are ``optax.GradientTransformationExtraArgs`` built on one mechanism; the methods of the
seed papers are options of it, not separate code paths:

* THOR: trace rule per factor block, uniform 128-blocks, current-batch factors, Cholesky;
* K-FAC / KAISA: every block at every check, whole factors, running averages, optionally
  ``inverse_method='eigh'`` (exact damping of ``A (x) G``) and an ``inverse_period`` decoupled
  from the statistics steps;
* SKFAC: ``inverse_method='woodbury'`` / ``'auto'`` (an ``m x m`` solve when a factor has fewer
  rows ``m`` than dimensions) and ``conv_statistics='reduce_sum'`` / ``'spatial_subsample'``;
* SP-NGD: ``adaptive_refresh`` (each block's own refresh interval, lengthened while the block
  stays similar), pi damping, unit-wise 2x2 Fisher for normalization layers.

``update`` takes the raw per-layer statistics as the keyword-only argument ``curvature_stats``:

* with statistics (a *statistics step*): per factor block the refresh policy (THOR's trace rule,
  SP-NGD's adaptive interval) selects the blocks due; their covariances are formed, averaged into
  the stored factors if any, and inverted (one batched Cholesky or eigendecomposition per block
  size, only the selected blocks, see ``blocks.masked_block_update``) when the inverse period
  says so; normalization layers and embeddings' diagonal ``A`` are refreshed; then the gradient
  is preconditioned;
* without statistics: the gradient is preconditioned with the stored inverses. Nothing else runs,
  so the step costs a first-order step plus two block-diagonal products per layer.

For a layer with kernel gradient ``dW`` (as a ``(d_in (+1 bias row), d_out)`` matrix) the update
is ``(A + d_A I)^-1 dW (G + d_G I)^-1`` with both inverses block-diagonal, i.e.
``((A + d_A I)^-1 (x) (G + d_G I)^-1) vec(dW)`` in row-major ``vec``; with ``'eigh'`` it is
``Q_A [(Q_A^T dW Q_G) / (d_A d_G^T + lambda)] Q_G^T``, i.e. ``(A (x) G + lambda I)^-1 vec(dW)``.
An embedding's ``A`` is the diagonal of token frequencies. A normalization layer's
``(scale_c, bias_c)`` gradient is multiplied by its channel's damped 2x2 Fisher inverse. Leaves
outside these layers, and layers that never received statistics, pass through unchanged.

References:
  Chen et al., "THOR, Trace-Based Hardware-Driven Layer-Oriented Natural Gradient Descent
  Computation", AAAI 2021 (split damping sqrt(lambda) per factor, trace rule, 128-blocks,
  diagonal ``A`` for embeddings).
  Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
  Curvature", ICML 2015, eq. 1 and section 6.3 (factored damping, pi rule).
  Grosse & Martens, "A Kronecker-factored approximate Fisher matrix for convolution layers",
  ICML 2016 (conv factors).
  Pauloski et al., "KAISA", SC 2021, and SC 2020 (eigendecomposition, decoupled factor and
  inverse update steps).
  Tang et al., "SKFAC", CVPR 2021 (Woodbury inversion, conv reduce-sum and subsampling).
  Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020 (unit-wise natural
  gradient, adaptive refresh frequency, empirical Fisher).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, NamedTuple, Optional, Union

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
Period = Union[int, Callable[[jax.Array], jax.Array]]
INVERSE_METHODS = ("cholesky", "eigh", "woodbury", "auto")


class LayerDiagnostics(NamedTuple):
  """Per-layer record of the curvature checks (all scalars).

  Attributes:
    blocks_refreshed: number of the layer's factor blocks (``A`` and ``G``) whose inverse was
      refreshed at its last statistics step.
    num_blocks: the layer's total number of factor blocks.
    total_refreshes: block inverse refreshes summed over all statistics steps so far.
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
  ``G`` (see ``blocks.build_layout`` for where each layer's blocks sit). Fields that an option
  does not use are empty dicts.

  Attributes:
    count: int32, number of ``update`` calls (steps); schedules are evaluated at it.
    inverses: ``{group: (n, b, b)}`` damped inverse blocks (identity before the first refresh);
      with ``inverse_method='eigh'`` the blocks' eigenvectors. Low-rank groups are not here.
    eigenvalues: ``{group: (n, b)}`` the blocks' eigenvalues (``'eigh'`` only).
    woodbury_u: ``{group: (n, b, m)}`` for the low-rank groups (``woodbury_rows=m``): each
      block's scaled rows ``U`` (zero-padded to ``m`` columns), ``F = U U^T``; zeros before the
      first refresh.
    woodbury_core: ``{group: (n, m, m)}`` the core inverses ``(U^T U + d I)^-1``.
    woodbury_damping: ``{group: (n,)}`` each block's damping ``d`` (1 before the first refresh,
      so that the inverse ``(I - U C U^T) / d`` starts as the identity).
    factors: ``{group: (n, b, b)}`` stored factor blocks (with ``ema_decay``, an
      ``inverse_period`` or ``adaptive_refresh``).
    trace_ref: ``{group: (n,)}`` damped trace of each block at its last factor refresh (0:
      never).
    frozen: ``{group: (n,)}`` bool, blocks in THOR's frozen regime.
    refreshes: ``{group: (n,)}`` int32, inverse refreshes per block so far.
    stale: ``{group: (n,)}`` bool, stored factor newer than its inverse (stored factors only).
    next_refresh: ``{group: (n,)}`` int32, step from which a block is due again
      (``adaptive_refresh`` only).
    refresh_interval: ``{group: (n,)}`` int32, each block's current interval in steps
      (``adaptive_refresh`` only).
    next_inverse: int32, step from which the next statistics step inverts (``inverse_period``).
    diagonal: ``{layer path: (vocab,)}`` embeddings' diagonal ``A``: damped inverse (ones
      before the first refresh), or its eigenvalues with ``'eigh'``.
    diagonal_factors: ``{layer path: (vocab,)}`` stored diagonal factors (as ``factors``).
    unitwise: ``{layer path: (C, 2, 2)}`` normalization layers' damped inverse per-channel
      Fisher (identity before the first refresh).
    unitwise_factors: ``{layer path: (C, 2, 2)}`` stored per-channel Fisher (as ``factors``).
    diagnostics: ``{layer path: LayerDiagnostics}`` for every Kronecker-factored layer.
  """

  count: jax.Array
  inverses: dict[str, jax.Array]
  eigenvalues: dict[str, jax.Array]
  woodbury_u: dict[str, jax.Array]
  woodbury_core: dict[str, jax.Array]
  woodbury_damping: dict[str, jax.Array]
  factors: dict[str, jax.Array]
  trace_ref: dict[str, jax.Array]
  frozen: dict[str, jax.Array]
  refreshes: dict[str, jax.Array]
  stale: dict[str, jax.Array]
  next_refresh: dict[str, jax.Array]
  refresh_interval: dict[str, jax.Array]
  next_inverse: jax.Array
  diagonal: dict[str, jax.Array]
  diagonal_factors: dict[str, jax.Array]
  unitwise: dict[str, jax.Array]
  unitwise_factors: dict[str, jax.Array]
  diagnostics: dict[str, LayerDiagnostics]


@dataclasses.dataclass(frozen=True, eq=False)
class _Config:
  """Validated options shared by ``init`` and ``update`` (see :func:`scale_by_kfac`)."""

  damping: ScalarOrSchedule
  block_size: Optional[int]
  omega1: float
  omega2: float
  ema_decay: Optional[float]
  pi_damping: bool
  num_buckets: int
  inverse_method: str
  sampling: factors.ConvSampling
  subsample_key: Optional[jax.Array]
  inverse_period: Period
  adaptive_refresh: Optional[float]
  max_refresh_interval: int
  dtype: Optional[jnp.dtype]
  woodbury_rows: Optional[int] = None
  block_sharding: Optional[jax.sharding.NamedSharding] = None

  def layout(self, tree: Any) -> blocks.BlockLayout:
    return blocks.build_layout(tree, self.block_size, self.woodbury_rows)

  @property
  def eigh(self) -> bool:
    return self.inverse_method == "eigh"

  @property
  def store_factors(self) -> bool:
    """Whether factors outlive a statistics step (running average, decoupling, adaptivity)."""
    every_step = isinstance(self.inverse_period, int) and self.inverse_period == 1
    return self.ema_decay is not None or self.adaptive_refresh is not None or not every_step

  @property
  def decay(self) -> float:
    return 0.0 if self.ema_decay is None else self.ema_decay


def _state_dtype(tree: Any, dtype: Optional[jnp.dtype]) -> jnp.dtype:
  if dtype is not None:
    return jnp.dtype(dtype)
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.result_type(jnp.float32, *[x.dtype for x in leaves]) if leaves else jnp.float32


def _real_counts(slot: blocks.FactorSlot) -> np.ndarray:
  """``(num_blocks,)`` number of true (unpadded) dimensions per block."""
  starts = np.arange(slot.num_blocks) * slot.block
  return np.clip(slot.dim - starts, 0, slot.block).astype(np.float32)


def _init_state(layout: blocks.BlockLayout, dtype: jnp.dtype, cfg: _Config) -> KroneckerState:
  # A fresh buffer per leaf: a state whose leaves share buffers cannot be donated to jit.
  zeros = lambda shape, dt=dtype: jnp.zeros(shape, dt)
  per_group = lambda make: {g: make(b, n) for g, (b, n) in layout.groups.items()}
  eye = lambda b, n: jnp.broadcast_to(jnp.eye(b, dtype=dtype), (n, b, b))
  store = cfg.store_factors
  adaptive = cfg.adaptive_refresh is not None
  embeds = [spec for spec in layout.layers if spec.kind == "embed"]
  diagnostics = {
      spec.name: LayerDiagnostics(
          blocks_refreshed=zeros((), jnp.int32),
          num_blocks=jnp.asarray(sum(s.num_blocks for s in spec.slots), jnp.int32),
          total_refreshes=zeros((), jnp.int32), frozen_blocks=zeros((), jnp.int32),
          trace_ratio=zeros(()))
      for spec in layout.layers
  }
  dense = lambda make: {g: make(b, n) for g, (b, n) in layout.groups.items()
                        if g not in layout.ranks}
  low_rank = lambda make: {g: make(b, n, layout.ranks[g]) for g, (b, n) in layout.groups.items()
                           if g in layout.ranks}
  return KroneckerState(
      count=zeros((), jnp.int32),
      inverses=dense(eye),
      eigenvalues=dense(lambda b, n: zeros((n, b))) if cfg.eigh else {},
      woodbury_u=low_rank(lambda b, n, m: zeros((n, b, m))),
      woodbury_core=low_rank(lambda b, n, m: jnp.broadcast_to(jnp.eye(m, dtype=dtype),
                                                              (n, m, m))),
      woodbury_damping=low_rank(lambda b, n, m: jnp.ones((n,), dtype)),
      factors=per_group(lambda b, n: zeros((n, b, b))) if store else {},
      trace_ref=per_group(lambda b, n: zeros((n,))),
      frozen=per_group(lambda b, n: zeros((n,), bool)),
      refreshes=per_group(lambda b, n: zeros((n,), jnp.int32)),
      stale=per_group(lambda b, n: zeros((n,), bool)) if store else {},
      next_refresh=per_group(lambda b, n: zeros((n,), jnp.int32)) if adaptive else {},
      refresh_interval=per_group(lambda b, n: jnp.ones((n,), jnp.int32)) if adaptive else {},
      next_inverse=zeros((), jnp.int32),
      diagonal={s.name: (zeros if cfg.eigh else jnp.ones)((s.kernel_shape[0],), dtype)
                for s in embeds},
      diagonal_factors={s.name: zeros((s.kernel_shape[0],)) for s in embeds} if store else {},
      unitwise={u.name: jnp.broadcast_to(jnp.eye(2, dtype=dtype), (u.channels, 2, 2))
                for u in layout.units},
      unitwise_factors={u.name: zeros((u.channels, 2, 2)) for u in layout.units}
      if store else {},
      diagnostics=diagnostics,
  )


def _check_state_matches(layout: blocks.BlockLayout, state: KroneckerState) -> None:
  want = {g: (n, b, layout.ranks.get(g, b)) for g, (b, n) in layout.groups.items()}
  have = {g: tuple(x.shape) for g, x in {**state.inverses, **state.woodbury_u}.items()}
  want_units = {u.name: (u.channels, 2, 2) for u in layout.units}
  have_units = {name: tuple(x.shape) for name, x in state.unitwise.items()}
  if want != have or want_units != have_units:
    raise ValueError(
        "optimizer state does not match the gradient tree: the gradients' layers need factor "
        f"blocks {want} and normalization blocks {want_units}, the state holds {have} and "
        f"{have_units}. Was the state initialised with other parameters?")


def _slice(x: jax.Array, slot: blocks.FactorSlot) -> jax.Array:
  return x[slot.start:slot.stop]


def _state_dtype_of(state: KroneckerState) -> jnp.dtype:
  """The dtype of the curvature state (every group has a ``trace_ref``)."""
  return next(iter(state.trace_ref.values())).dtype if state.trace_ref else jnp.float32


def _period_steps(period: Period, count: jax.Array) -> jax.Array:
  """An int or a schedule of the step, as an int32 number of steps ``>= 1``."""
  value = period(count) if callable(period) else period
  return jnp.maximum(1, jnp.round(jnp.asarray(value, jnp.float32))).astype(jnp.int32)


def _split_damping(tr_a: jax.Array, dim_a: int, tr_g: jax.Array, dim_g: int,
                   sqrt_damping: jax.Array, pi_damping: bool) -> tuple[jax.Array, jax.Array]:
  """Values added to ``A`` and ``G``: ``sqrt(lambda)`` each, or pi-scaled."""
  if not pi_damping:
    return sqrt_damping, sqrt_damping
  pi = jnp.sqrt((jnp.sum(tr_a) / dim_a) / (jnp.sum(tr_g) / dim_g))
  pi = jnp.where(jnp.isfinite(pi) & (pi > 0), pi, 1.0)
  return pi * sqrt_damping, sqrt_damping / pi


def _blend(old: jax.Array, new: jax.Array, first: jax.Array, decay: float) -> jax.Array:
  """Running average ``decay * old + (1 - decay) * new``; ``new`` where ``first``."""
  first = first.reshape(first.shape + (1,) * (new.ndim - first.ndim))
  return jnp.where(first, new, decay * old + (1.0 - decay) * new)


def _uses_woodbury(cfg: _Config, rows: jax.Array, slot: blocks.FactorSlot) -> bool:
  """Static choice per factor: Woodbury for ``'woodbury'``, or ``'auto'`` with ``m < b``."""
  if cfg.inverse_method == "woodbury":
    return True
  return cfg.inverse_method == "auto" and not cfg.store_factors and rows.shape[0] < slot.block


def _on_shards(fn: Callable[..., Any], sharding: Optional[jax.sharding.NamedSharding],
               *stacks: jax.Array) -> Any:
  """``fn(*stacks)`` for stacks of blocks ``(K, ...)``, each device computing its share.

  With ``sharding`` (a ``NamedSharding`` whose spec names the mesh axes of the block axis),
  the stacks are padded to a multiple of the number of devices along those axes (with copies
  of their first block; the padding's results are dropped) and ``fn`` runs under
  ``jax.shard_map`` on ``ceil(K / D)`` blocks per device (KAISA's layer-wise distribution of
  the inversion work; THOR's uniform blocks make the shares even). The results are gathered
  where the optimizer state's sharding puts them. ``None`` runs ``fn`` as is.
  """
  if sharding is None:
    return fn(*stacks)
  spec = jax.sharding.PartitionSpec(sharding.spec[0] if sharding.spec else None)
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  devices = int(np.prod([sharding.mesh.shape[a] for a in axes if a is not None]))
  k = stacks[0].shape[0]
  pad = -k % devices
  padded = [jnp.concatenate([x, jnp.repeat(x[:1], pad, axis=0)]) if pad else x for x in stacks]
  out = jax.shard_map(fn, mesh=sharding.mesh, in_specs=spec, out_specs=spec)(*padded)
  return jax.tree.map(lambda y: y[:k], out)


def _block_factor_roots(rows, scale, slot, idx):
  """``U (K, b, R)`` of the factor blocks ``idx``: block ``k`` of ``scale * rows^T rows`` is
  ``U_k U_k^T`` (SKFAC's low-rank form)."""
  x = jnp.take(blocks.blocked_rows(rows, slot), idx, axis=1)  # (R, K, b)
  return jnp.sqrt(scale) * jnp.transpose(x, (1, 2, 0))


def _woodbury_blocks(rows, scale, slot, idx, damping, real, sharding):
  """Damped inverses ``(K, b, b)`` of the factor blocks ``idx`` from the factor's rows, and
  whether each is finite (the ``fn`` of ``blocks.masked_block_update``)."""
  u = _block_factor_roots(rows, scale, slot, idx)
  inv = _on_shards(inverse.woodbury_inverse, sharding, u, damping, real)
  return inv, inverse.is_finite_block(inv)


def _low_rank_blocks(rows, scale, slot, idx, damping, sharding):
  """Woodbury form ``{u (K, b, m), core (K, m, m), damping (K,)}`` of the factor blocks
  ``idx`` from the factor's ``R <= m`` rows (zero columns pad ``U`` to ``m``: ``U U^T`` and the
  inverse are unchanged), and whether each is finite."""
  u = _block_factor_roots(rows, scale, slot, idx)
  u = jnp.pad(u, ((0, 0), (0, 0), (0, slot.rank - u.shape[-1])))
  core = _on_shards(inverse.woodbury_core_inverse, sharding, u, damping)
  out = {"u": u, "core": core, "damping": damping}
  return out, inverse.is_finite_block(u) & inverse.is_finite_block(core)


def _check_low_rank_rows(spec: blocks.LayerSpec, slot: blocks.FactorSlot,
                         rows: jax.Array) -> None:
  if rows.shape[0] > slot.rank:
    which = "A" if slot is spec.a else "G"
    raise ValueError(
        f"layer {spec.name!r}: factor {which} (dim {slot.dim}) has {rows.shape[0]} rows in "
        f"these statistics, but its low-rank state holds at most woodbury_rows={slot.rank}; "
        f"pass woodbury_rows >= {rows.shape[0]} (the examples x positions x samples behind "
        "the factor), or woodbury_rows=None for dense inverses.")


def _refresh_embeddings(state, embeds, cfg):
  """Embeddings' diagonal ``A`` (token frequencies), refreshed at every statistics step.

  ``embeds`` maps a layer path to ``(frequencies (vocab,), damping added to A)``.
  """
  diagonal, stored = dict(state.diagonal), dict(state.diagonal_factors)
  for name, (freq, d_a) in embeds.items():
    if cfg.store_factors:
      old = state.diagonal_factors[name]
      freq = _blend(old, freq, jnp.all(old == 0), cfg.decay)
    new = freq if cfg.eigh else 1.0 / (freq + d_a)
    ok = jnp.all(jnp.isfinite(new))
    diagonal[name] = jnp.where(ok, new, state.diagonal[name])
    if cfg.store_factors:
      stored[name] = jnp.where(ok, freq, state.diagonal_factors[name])
  return diagonal, stored


def _refresh_units(state, layout, flat, damping, cfg, dtype):
  """Normalization layers' damped 2x2 Fisher inverses, refreshed at every statistics step."""
  unitwise, stored = dict(state.unitwise), dict(state.unitwise_factors)
  for unit in layout.units:
    if unit.name not in flat:
      continue
    layer = flat[unit.name]
    factors.check_norm_stats(unit, layer)
    fisher = inverse.unitwise_fisher(layer.scale_grads.astype(dtype),
                                     layer.bias_grads.astype(dtype))
    if cfg.store_factors:
      old = state.unitwise_factors[unit.name]
      fisher = _blend(old, fisher, jnp.all(old == 0), cfg.decay)
    inv = inverse.unitwise_inverse(fisher, damping)
    ok = inverse.is_finite_block(inv) & inverse.is_finite_block(fisher)
    unitwise[unit.name] = jnp.where(ok[:, None, None], inv, state.unitwise[unit.name])
    if cfg.store_factors:
      stored[unit.name] = jnp.where(ok[:, None, None], fisher, state.unitwise_factors[unit.name])
  return unitwise, stored


def _layer_statistics(curvature_stats: Any, layout: blocks.BlockLayout,
                      masked: frozenset[str]) -> dict[str, stats_lib.LayerStats]:
  """The statistics of a check step by layer name, validated against the gradient tree.

  Statistics of modules that ``optax.masked`` / ``optax.partition`` hid from this transform
  (``masked``) are dropped: the whole model's statistics may be passed to every member.

  Raises:
    ValueError: if the statistics hold no layer at all while the gradients have layers, or name
      a layer that is not a dense/conv/embedding/normalization layer of the gradients.
  Warns:
    UserWarning: naming each layer of the gradients without statistics (with the capture's
      reason, e.g. a shared layer) and each captured-but-unsupported module; their gradients
      pass through as they are.
  """
  by_name = {spec.name for spec in layout.layers} | {unit.name for unit in layout.units}
  flat = stats_lib.flatten_layer_stats(curvature_stats)
  reasons = dict(note.split(": ", 1) for note in getattr(curvature_stats, "unhandled", ())
                 if ": " in note)
  if not flat and by_name:
    raise ValueError(
        f"curvature_stats holds no layer statistics, but the gradients have layers "
        f"{sorted(by_name)}. Pass the statistics returned by value_and_grad_with_stats for the "
        "same model and batch, or call update without curvature_stats on a plain step."
        + (f" The capture preconditions none of the model's layers: {reasons}."
           if reasons else ""))
  flat = {name: layer for name, layer in flat.items() if name not in masked}
  unknown = sorted(set(flat) - by_name)
  if unknown:
    raise ValueError(
        f"curvature_stats has statistics for {unknown}, which match no dense/conv/embedding "
        f"or normalization layer in the gradients (layers: "
        f"{sorted(spec.name for spec in layout.layers)}, normalization: "
        f"{sorted(unit.name for unit in layout.units)}). Were they captured from a different "
        "model? Capture them from the model whose gradients you pass (inside optax.masked / optax.partition, layers of the "
        "other partitions are ignored).")
  silent = {name: why for name, why in reasons.items()
            if name not in by_name and name not in masked}
  missing = {name: reasons.get(name, "no statistics were passed for it")
             for name in sorted(by_name - set(flat) - masked)}
  if missing or silent:
    notes = "; ".join(f"{name}: {why}" for name, why in {**missing, **silent}.items())
    warnings.warn(
        f"curvature_stats: layers not preconditioned ({notes}). Their gradients pass through as "
        "they are; to train them with another optimizer, use optax.partition.", stacklevel=4)
  return flat


def _curvature_check(state: KroneckerState, layout: blocks.BlockLayout, curvature_stats: Any,
                     damping: jax.Array, cfg: _Config,
                     masked: frozenset[str] = frozenset()) -> KroneckerState:
  """One statistics step: refresh policy per block, factors, inverses due, diagnostics."""
  dtype = _state_dtype_of(state)
  flat = _layer_statistics(curvature_stats, layout, masked)
  count = state.count
  key = (None if cfg.subsample_key is None
         else jax.random.fold_in(cfg.subsample_key, count))
  damping = jnp.asarray(damping, dtype)
  sqrt_damping = jnp.sqrt(damping)

  # Per group: damped trace, damping and validity of every block; per factor: its rows.
  trace_now = {g: jnp.zeros((n,), dtype) for g, (_, n) in layout.groups.items()}
  block_damping = {g: jnp.ones((n,), dtype) for g, (_, n) in layout.groups.items()}
  valid = {g: jnp.zeros((n,), bool) for g, (_, n) in layout.groups.items()}
  rows_of = {}  # FactorSlot -> (rows, scale), for every factor with statistics
  embeds = {}  # embedding path -> (token frequencies, damping of A)
  for spec in layout.layers:
    if spec.name not in flat:
      continue
    layer = flat[spec.name]
    factors.check_stats(spec, layer)
    g_rows, g_scale = factors.cotangent_rows(spec, layer, dtype, sampling=cfg.sampling, key=key)
    tr_g = blocks.block_traces(g_rows, g_scale, spec.g)
    parts = [(spec.g, g_rows, g_scale, tr_g)]
    if spec.a is not None:
      a_rows, a_scale = factors.input_rows(spec, layer, dtype, sampling=cfg.sampling, key=key)
      tr_a = blocks.block_traces(a_rows, a_scale, spec.a)
      parts.insert(0, (spec.a, a_rows, a_scale, tr_a))
    else:  # embedding: diagonal A, refreshed in _refresh_embeddings
      freq = factors.embedding_frequencies(spec, layer, dtype)
      tr_a = jnp.sum(freq, keepdims=True)
    finite = jnp.all(jnp.isfinite(tr_a)) & jnp.all(jnp.isfinite(tr_g))
    a_dim = spec.a.dim if spec.a is not None else spec.kernel_shape[0]
    d_a, d_g = _split_damping(tr_a, a_dim, tr_g, spec.g.dim, sqrt_damping, cfg.pi_damping)
    if spec.a is None:
      embeds[spec.name] = (freq, d_a)
    for slot, rows, scale, tr in parts:
      d = d_a if slot is spec.a else d_g
      g = slot.group
      damped = jnp.where(finite, tr + d * jnp.asarray(_real_counts(slot), dtype), 0.0)
      trace_now[g] = trace_now[g].at[slot.start:slot.stop].set(damped)
      block_damping[g] = block_damping[g].at[slot.start:slot.stop].set(d)
      valid[g] = valid[g].at[slot.start:slot.stop].set(finite)
      rows_of[slot] = (rows, scale)

  decision = {
      g: trace.trace_rule(trace_now[g], state.trace_ref[g], state.frozen[g], valid[g],
                          cfg.omega1, cfg.omega2)
      for g in layout.groups
  }
  selected = {g: decision[g].refresh for g in layout.groups}
  if cfg.adaptive_refresh is not None:
    selected = {g: sel & (count >= state.next_refresh[g]) for g, sel in selected.items()}

  # Per factor: covariance blocks of the selected blocks, or (Woodbury) their inverses.
  cov_parts = {g: [] for g in layout.groups}
  woodbury = {g: np.zeros((n,), bool) for g, (_, n) in layout.groups.items()}
  woodbury_out = []  # (slot, inverses or low-rank form, refreshed) per Woodbury factor
  for spec in layout.layers:
    for slot in spec.slots:
      if slot.rank:  # low-rank Woodbury form: no b x b array at all
        if slot in rows_of:
          rows, scale = rows_of[slot]
          _check_low_rank_rows(spec, slot, rows)
          dmp = _slice(block_damping[slot.group], slot)
          old = {"u": _slice(state.woodbury_u[slot.group], slot),
                 "core": _slice(state.woodbury_core[slot.group], slot),
                 "damping": _slice(state.woodbury_damping[slot.group], slot)}
          part, done = blocks.masked_block_update(
              _slice(selected[slot.group], slot), old,
              lambda idx, rows=rows, scale=scale, slot=slot, dmp=dmp:
              _low_rank_blocks(rows, scale, slot, idx, dmp[idx], cfg.block_sharding),
              cfg.num_buckets)
          woodbury_out.append((slot, part, done))
        continue
      zeros = jnp.zeros((slot.num_blocks, slot.block, slot.block), dtype)
      cov_parts[slot.group].append(zeros)
      if slot not in rows_of:
        continue
      rows, scale = rows_of[slot]
      mask = _slice(selected[slot.group], slot)
      if _uses_woodbury(cfg, rows, slot):
        woodbury[slot.group][slot.start:slot.stop] = True
        real = jnp.asarray(layout.real_dims(slot.group)[slot.start:slot.stop], dtype)
        dmp = _slice(block_damping[slot.group], slot)
        inv, done = blocks.masked_block_update(
            mask, _slice(state.inverses[slot.group], slot),
            lambda idx, rows=rows, scale=scale, slot=slot, dmp=dmp, real=real:
            _woodbury_blocks(rows, scale, slot, idx, dmp[idx], real[idx], cfg.block_sharding),
            cfg.num_buckets)
        woodbury_out.append((slot, inv, done))
        continue
      cov, _ = blocks.masked_block_update(
          mask, zeros,
          lambda idx, rows=rows, scale=scale, slot=slot: (
              blocks.block_covariances(rows, scale, slot, idx), jnp.ones(idx.shape, bool)),
          cfg.num_buckets)
      cov_parts[slot.group][-1] = cov

  new = {name: {} for name in ("inverses", "eigenvalues", "woodbury_u", "woodbury_core",
                               "woodbury_damping", "factors", "trace_ref", "frozen",
                               "refreshes", "stale", "next_refresh", "refresh_interval")}
  refreshed_of = {}
  do_invert = count >= state.next_inverse
  for g, (b, n) in layout.groups.items():
    if g in layout.ranks:  # current-batch factors only (validated): set where refreshed
      refreshed = jnp.zeros((n,), bool)
      low = {k: getattr(state, f"woodbury_{k}")[g] for k in ("u", "core", "damping")}
      for slot, part, done in woodbury_out:
        if slot.group == g:
          low = {k: v.at[slot.start:slot.stop].set(part[k]) for k, v in low.items()}
          refreshed = refreshed.at[slot.start:slot.stop].set(done)
      for k, v in low.items():
        new[f"woodbury_{k}"][g] = v
      new["trace_ref"][g] = jnp.where(refreshed, trace_now[g], state.trace_ref[g])
      new["frozen"][g] = state.frozen[g] | decision[g].freeze
      new["refreshes"][g] = state.refreshes[g] + refreshed.astype(jnp.int32)
      refreshed_of[g] = refreshed
      continue
    cov = jnp.concatenate(cov_parts[g], axis=0)
    real = jnp.asarray(layout.real_dims(g), dtype)
    sel = selected[g] & ~jnp.asarray(woodbury[g])
    never = state.trace_ref[g] <= 0
    if cfg.store_factors:
      old = state.factors[g]
      update = sel
      if cfg.adaptive_refresh is not None:
        change = (jnp.linalg.norm((cov - old).reshape(n, -1), axis=1)
                  / jnp.maximum(jnp.linalg.norm(old.reshape(n, -1), axis=1),
                                jnp.finfo(dtype).tiny))
        similar = ~never & (change < cfg.adaptive_refresh)
        update = sel & ~similar
        interval = jnp.where(
            sel, jnp.where(similar, jnp.minimum(2 * state.refresh_interval[g],
                                                cfg.max_refresh_interval), 1),
            state.refresh_interval[g])
        new["refresh_interval"][g] = interval
        new["next_refresh"][g] = jnp.where(sel, count + interval, state.next_refresh[g])
      new["factors"][g] = jnp.where(update[:, None, None], _blend(old, cov, never, cfg.decay),
                                    old)
      source = new["factors"][g]
      stale = state.stale[g] | update
      invert = stale & do_invert
      factor_set = update
    else:
      source, invert = cov, sel

    def refresh(idx, source=source, real=real, dmp=block_damping[g]):
      blk = jnp.take(source, idx, axis=0)
      if cfg.eigh:
        values, vectors = _on_shards(inverse.eigh_factors, cfg.block_sharding, blk)
        out = {"inverses": vectors, "eigenvalues": values}
        return out, inverse.is_finite_block(vectors) & inverse.is_finite_block(values)
      inv = _on_shards(lambda b, d, r: inverse.cholesky_inverse(inverse.damp(b, d, r)),
                       cfg.block_sharding, blk, dmp[idx], real[idx])
      return {"inverses": inv}, inverse.is_finite_block(inv)

    old_inv = {"inverses": state.inverses[g]}
    if cfg.eigh:
      old_inv["eigenvalues"] = state.eigenvalues[g]
    if woodbury[g].all():  # static: every block of the group came from its rows above
      out, refreshed = old_inv, jnp.zeros((n,), bool)
    else:
      out, refreshed = blocks.masked_block_update(invert, old_inv, refresh, cfg.num_buckets)
    inverses = out["inverses"]
    for slot, inv, done in woodbury_out:
      if slot.group == g:
        inverses = inverses.at[slot.start:slot.stop].set(inv)
        refreshed = refreshed.at[slot.start:slot.stop].set(done)
    new["inverses"][g] = inverses
    if cfg.eigh:
      new["eigenvalues"][g] = out["eigenvalues"]
    if cfg.store_factors:
      new["stale"][g] = stale & ~refreshed
    else:
      factor_set = refreshed
    new["trace_ref"][g] = jnp.where(factor_set, trace_now[g], state.trace_ref[g])
    new["frozen"][g] = state.frozen[g] | decision[g].freeze
    new["refreshes"][g] = state.refreshes[g] + refreshed.astype(jnp.int32)
    refreshed_of[g] = refreshed

  diagnostics = dict(state.diagnostics)
  for spec in layout.layers:
    if spec.name not in flat:
      continue
    parts = [(slot.group, slot) for slot in spec.slots]
    total = lambda arrays: sum(jnp.sum(_slice(arrays[g], s), dtype=jnp.int32) for g, s in parts)
    diagnostics[spec.name] = LayerDiagnostics(
        blocks_refreshed=total(refreshed_of),
        num_blocks=state.diagnostics[spec.name].num_blocks,
        total_refreshes=total(new["refreshes"]),
        frozen_blocks=total(new["frozen"]),
        trace_ratio=jnp.max(jnp.stack([jnp.max(_slice(decision[g].ratio, s))
                                       for g, s in parts])),
    )
  diagonal, diagonal_factors = _refresh_embeddings(state, embeds, cfg)
  unitwise, unitwise_factors = _refresh_units(state, layout, flat, damping, cfg, dtype)
  next_inverse = state.next_inverse
  if cfg.store_factors:
    next_inverse = jnp.where(do_invert, count + _period_steps(cfg.inverse_period, count),
                             next_inverse)
  if cfg.adaptive_refresh is None:
    new["next_refresh"], new["refresh_interval"] = state.next_refresh, state.refresh_interval
  if not cfg.store_factors:
    new["factors"], new["stale"] = state.factors, state.stale
  if not cfg.eigh:
    new["eigenvalues"] = state.eigenvalues
  return state._replace(**new, next_inverse=next_inverse, diagonal=diagonal,
                        diagonal_factors=diagonal_factors, unitwise=unitwise,
                        unitwise_factors=unitwise_factors, diagnostics=diagnostics)


def _pad_to(x: jax.Array, rows: int, cols: int) -> jax.Array:
  """Zero-pads a matrix to ``(rows, cols)``."""
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def _low_rank(state: KroneckerState, slot: blocks.FactorSlot) -> tuple[jax.Array, ...]:
  """A low-rank factor's ``(U, core, damping)`` blocks."""
  return tuple(_slice(getattr(state, f"woodbury_{k}")[slot.group], slot)
               for k in ("u", "core", "damping"))


def _inverse_times(state: KroneckerState, slot: blocks.FactorSlot, x: jax.Array) -> jax.Array:
  """``F^-1 x`` with a factor's stored damped inverse (dense blocks or low-rank form)."""
  if slot.rank:
    return blocks.left_multiply_low_rank(*_low_rank(state, slot), x)
  return blocks.left_multiply(_slice(state.inverses[slot.group], slot), x)


def _times_inverse(state: KroneckerState, slot: blocks.FactorSlot, x: jax.Array) -> jax.Array:
  """``x F^-1`` with a factor's stored damped inverse (dense blocks or low-rank form)."""
  if slot.rank:
    return blocks.right_multiply_low_rank(x, *_low_rank(state, slot))
  return blocks.right_multiply(x, _slice(state.inverses[slot.group], slot))


def _precondition_matrix(x: jax.Array, spec: blocks.LayerSpec, state: KroneckerState,
                         eigh: bool, damping: jax.Array) -> jax.Array:
  """The natural gradient of one layer's ``(d_A, d_out)`` gradient matrix."""
  if not eigh:
    if spec.a is None:
      y = state.diagonal[spec.name][:, None] * x
    else:
      y = _inverse_times(state, spec.a, x)
    return _times_inverse(state, spec.g, y)
  g_blocks = _slice(state.inverses[spec.g.group], spec.g)
  # Exact damping of A (x) G in the factors' eigenbases (KAISA). The rotation runs in padded
  # coordinates: a block's eigenvalues are sorted, so those of its identity padding are not
  # at the end, and each eigenvalue must stay with its own eigenvector column.
  d_g = _slice(state.eigenvalues[spec.g.group], spec.g).reshape(-1)
  if spec.a is None:
    d_a, y = state.diagonal[spec.name], _pad_to(x, x.shape[0], spec.g.padded_dim)
  else:
    q_a = _slice(state.inverses[spec.a.group], spec.a)
    d_a = _slice(state.eigenvalues[spec.a.group], spec.a).reshape(-1)
    y = _pad_to(x, spec.a.padded_dim, spec.g.padded_dim)
    y = blocks.left_multiply(jnp.swapaxes(q_a, -1, -2), y)
  y = blocks.right_multiply(y, g_blocks)
  y = y / (d_a[:, None] * d_g[None, :] + damping)
  y = blocks.right_multiply(y, jnp.swapaxes(g_blocks, -1, -2))
  if spec.a is not None:
    y = blocks.left_multiply(q_a, y)
  y = y[:x.shape[0], :x.shape[1]]
  ready = jnp.all(jnp.stack([jnp.all(_slice(state.refreshes[s.group], s) > 0)
                             for s in spec.slots]))
  return jnp.where(ready, y, x)


def precondition(updates: Any, state: KroneckerState, layout: blocks.BlockLayout,
                 eigh: bool = False, damping: jax.Array | float = 0.0) -> Any:
  """Applies the stored curvature to every preconditioned layer of a gradient tree.

  Args:
    updates: gradient tree (nested dicts with ``kernel``/``bias``/``embedding``/``scale``
      leaves).
    state: the transform's state (inverses, or eigendecompositions with ``eigh``).
    layout: the tree's :class:`blocks.BlockLayout`.
    eigh: whether ``state.inverses`` hold eigenvectors (``inverse_method='eigh'``).
    damping: ``lambda`` added to the eigenvalue products (``eigh`` only).

  Returns:
    a tree like ``updates``; other leaves are returned as they are.
  """
  new_leaves = {}
  flat = {stats_lib.path_keys(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]}
  dtype = _state_dtype_of(state)
  for spec in layout.layers:
    kernel = flat[spec.path + (spec.param,)]
    x = factors.kernel_matrix(kernel).astype(dtype)
    if spec.has_bias:
      bias = flat[spec.path + ("bias",)]
      x = jnp.concatenate([x, bias[None, :].astype(x.dtype)], axis=0)
    y = _precondition_matrix(x, spec, state, eigh, jnp.asarray(damping, dtype))
    new_leaves[spec.path + (spec.param,)] = factors.kernel_from_matrix(
        y[:spec.d_in], spec.kernel_shape).astype(kernel.dtype)
    if spec.has_bias:
      new_leaves[spec.path + ("bias",)] = y[spec.d_in].astype(bias.dtype)
  for unit in layout.units:
    names = [name for name, has in (("scale", unit.has_scale), ("bias", unit.has_bias)) if has]
    leaves = {name: flat[unit.path + (name,)] for name in names}
    v = jnp.stack([leaves[name].astype(dtype) if name in leaves
                   else jnp.zeros((unit.channels,), dtype) for name in ("scale", "bias")], -1)
    y = jnp.einsum("cij,cj->ci", state.unitwise[unit.name], v)
    for i, name in enumerate(("scale", "bias")):
      if name in leaves:
        new_leaves[unit.path + (name,)] = y[:, i].astype(leaves[name].dtype)

  def pick(path, leaf):
    return new_leaves.get(stats_lib.path_keys(path), leaf)

  return jax.tree_util.tree_map_with_path(pick, updates)


def _validate(cfg: _Config) -> None:
  trace.check_thresholds(cfg.omega1, cfg.omega2)
  if cfg.ema_decay is not None and not 0.0 <= cfg.ema_decay < 1.0:
    raise ValueError(f"ema_decay must be in [0, 1) or None, got {cfg.ema_decay}")
  if cfg.num_buckets < 1:
    raise ValueError(f"refresh_buckets must be >= 1, got {cfg.num_buckets}")
  if isinstance(cfg.damping, (int, float)) and not cfg.damping > 0:
    raise ValueError(f"damping must be positive, got {cfg.damping}")
  if cfg.inverse_method not in INVERSE_METHODS:
    raise ValueError(f"inverse_method must be one of {INVERSE_METHODS}, got "
                     f"{cfg.inverse_method!r}")
  if cfg.inverse_method == "woodbury" and cfg.store_factors:
    raise ValueError(
        "inverse_method='woodbury' inverts the current batch's low-rank factor, so it cannot be "
        "combined with ema_decay, an inverse_period other than 1, or adaptive_refresh (their "
        "factors are full rank); use inverse_method='auto' or 'cholesky'.")
  if cfg.eigh and cfg.pi_damping:
    raise ValueError("inverse_method='eigh' damps A (x) G exactly; pi_damping does not apply.")
  if isinstance(cfg.inverse_period, bool) or not (
      callable(cfg.inverse_period)
      or (isinstance(cfg.inverse_period, int) and cfg.inverse_period >= 1)):
    raise ValueError(
        f"inverse_period must be an int >= 1 or a schedule of the step, got "
        f"{cfg.inverse_period!r}")
  if cfg.adaptive_refresh is not None and not cfg.adaptive_refresh > 0:
    raise ValueError(f"adaptive_refresh must be a positive tolerance or None, got "
                     f"{cfg.adaptive_refresh}")
  if cfg.max_refresh_interval < 1:
    raise ValueError(f"max_refresh_interval must be >= 1, got {cfg.max_refresh_interval}")
  if cfg.woodbury_rows is not None:
    if cfg.inverse_method not in ("woodbury", "auto") or cfg.store_factors:
      raise ValueError(
          "woodbury_rows keeps the current batch's low-rank factors in Woodbury form: it needs "
          "inverse_method='woodbury' or 'auto', and no ema_decay, inverse_period other than 1 "
          "or adaptive_refresh (their factors are full rank).")
    blocks.build_layout({}, cfg.block_size, cfg.woodbury_rows)  # validates the value


def _is_params_placeholder(params: Any) -> bool:
  """Whether ``init`` was called by ``optax.tree_map_params`` (one opaque object, no leaves)."""
  return type(params).__name__ == "_ParamsPlaceholder" and not jax.tree_util.tree_leaves(params)


def _placeholder_state() -> KroneckerState:
  """The state ``init`` gives ``optax.tree_map_params``'s placeholder.

  The curvature state holds no copy of the parameter tree, so every field is a non-parameter
  field: each is a single leaf here, a prefix of the real field, so ``tree_map_params`` keeps
  the real field (or applies ``transform_non_params`` to it as a whole).
  """
  return KroneckerState(*(jnp.zeros((), jnp.int32) for _ in KroneckerState._fields))


def _masked_modules(updates: Any) -> frozenset[str]:
  """Module paths (``'Block_0/Dense_1'``) with a leaf that ``optax.masked`` replaced."""
  flat, _ = jax.tree_util.tree_flatten_with_path(
      updates, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  return frozenset("/".join(stats_lib.path_keys(path[:-1])) for path, leaf in flat
                   if isinstance(leaf, optax.MaskedNode))


def _kronecker_preconditioner(cfg: _Config) -> optax.GradientTransformationExtraArgs:
  """The shared mechanism behind :func:`scale_by_thor` and :func:`scale_by_kfac`."""
  _validate(cfg)

  def init_fn(params):
    if _is_params_placeholder(params):
      return _placeholder_state()
    layout = cfg.layout(params)
    return _init_state(layout, _state_dtype(params, cfg.dtype), cfg)

  def update_fn(updates, state, params=None, *, curvature_stats=None, **extra_args):
    del params, extra_args
    layout = cfg.layout(updates)
    _check_state_matches(layout, state)
    lam = cfg.damping(state.count) if callable(cfg.damping) else cfg.damping
    if curvature_stats is not None:
      state = _curvature_check(state, layout, curvature_stats, lam, cfg,
                               _masked_modules(updates))
    updates = precondition(updates, state, layout, cfg.eigh, lam)
    return updates, state._replace(count=optax.safe_int32_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _conv_sampling(conv_statistics: str, spatial_samples: Optional[int]) -> factors.ConvSampling:
  return factors.ConvSampling(mode=conv_statistics, num_positions=spatial_samples)


def scale_by_thor(
    damping: ScalarOrSchedule = 0.03,
    *,
    block_size: Optional[int] = 128,
    trace_thresholds: tuple[float, float] = (0.01, 0.0),
    ema_decay: Optional[float] = None,
    pi_damping: bool = False,
    refresh_buckets: int = 4,
    inverse_method: str = "cholesky",
    conv_statistics: str = "expand",
    spatial_samples: Optional[int] = None,
    subsample_key: Optional[jax.Array] = None,
    inverse_period: Period = 1,
    dtype: Optional[jnp.dtype] = None,
    woodbury_rows: Optional[int] = None,
    block_sharding: Optional[jax.sharding.NamedSharding] = None,
) -> optax.GradientTransformationExtraArgs:
  """THOR's natural-gradient preconditioner (trace rule, uniform blocks, split damping).

  Call ``update(grads, state, params, curvature_stats=stats)`` on check steps (statistics from
  ``thor_optax.flax.value_and_grad_with_stats``) and ``update(grads, state, params)`` on the
  others; :class:`thor_optax.CheckSchedule` says which is which.

  Args:
    damping: ``lambda``, a positive float or a schedule of the step count; ``sqrt(lambda)`` is
      added to each factor's diagonal (THOR/MindSpore convention; with ``pi_damping``,
      ``pi sqrt(lambda)`` to ``A`` and ``sqrt(lambda) / pi`` to ``G``; with
      ``inverse_method='eigh'``, ``lambda`` to the eigenvalues of ``A (x) G``). Normalization
      layers' 2x2 Fisher blocks get ``lambda``.
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
    inverse_method: ``'cholesky'`` (damped inverse per block), ``'eigh'`` (eigendecomposition,
      exact damping of ``A (x) G``; KAISA), ``'woodbury'`` (``m x m`` solve from the ``m`` rows
      behind a factor; SKFAC; needs current-batch factors) or ``'auto'`` (Woodbury for factors
      with fewer rows than block dimensions, Cholesky otherwise).
    conv_statistics: ``'expand'`` (all im2col patches; KFC), ``'reduce_sum'`` (patches and
      cotangents summed over positions per example) or ``'spatial_subsample'``
      (``spatial_samples`` positions per example); see ``factors.ConvSampling``.
    spatial_samples: positions per example for ``'spatial_subsample'``.
    subsample_key: PRNG key for random subsampling (folded with the step count); ``None``
      takes evenly strided positions.
    inverse_period: steps between inversions (an int, or a schedule of the step): a statistics
      step inverts only when at least this many steps passed since the last inversion; the
      factors of the steps between are averaged into the stored factors (KAISA's decoupled
      ``inv_update_steps``).
    dtype: dtype of factors and inverses; default: float32, or float64 for float64 parameters.
    block_sharding: ``None``, or a ``jax.sharding.NamedSharding`` whose spec names the mesh
      axis of a block stack's leading axis, e.g. ``NamedSharding(mesh, PartitionSpec("data"))``:
      every stack of blocks due for inversion is split over those devices
      (``jax.shard_map``), so each device factorizes ``ceil(K / D)`` blocks instead of all
      ``K`` (KAISA's layer-wise distribution of the inversion work, THOR's uniform blocks
      making the shares even). Where the results go is the
      sharding of the optimizer state: replicated gathers every inverse to every device
      (KAISA's COMM-OPT), sharded leaves each device its share (MEM-OPT); see
      :func:`thor_optax.kronecker_state_sharding`.
    woodbury_rows: ``m`` (static int) or ``None``. With ``inverse_method='woodbury'`` or
      ``'auto'``, every factor block of size ``b`` with ``m (b + m) < b^2`` (the low-rank form
      is smaller) keeps ``U (b, m)``, the ``m x m`` core inverse and its damping in the state
      instead of a dense ``b x b`` inverse, and preconditions with ``(x - U C U^T x) / d`` in
      ``O(b m)`` per column (SKFAC). ``m`` bounds the rows behind such a factor (examples x
      positions for ``A``, x cotangent samples for ``G``; after a conv's ``reduce_sum``, the
      examples): fewer rows are zero-padded exactly, more raise a ``ValueError`` naming the
      layer.

  Returns:
    an ``optax.GradientTransformationExtraArgs`` with state :class:`KroneckerState`.

  Raises:
    ValueError: on invalid hyperparameters or combinations (at construction); in ``update``,
      when statistics name a layer with no weights in the gradients, do not fit a layer's
      weights (the message names the layer path and the expected shape), have more rows than
      ``woodbury_rows``, or the state was built for other parameters.

  References:
    Chen et al., "THOR", AAAI 2021 (trace rule, hardware-driven split, split damping).
  """
  return _kronecker_preconditioner(_Config(
      damping=damping, block_size=block_size, omega1=float(trace_thresholds[0]),
      omega2=float(trace_thresholds[1]), ema_decay=ema_decay, pi_damping=pi_damping,
      num_buckets=refresh_buckets, inverse_method=inverse_method,
      sampling=_conv_sampling(conv_statistics, spatial_samples), subsample_key=subsample_key,
      inverse_period=inverse_period, adaptive_refresh=None, max_refresh_interval=1,
      dtype=dtype, woodbury_rows=woodbury_rows, block_sharding=block_sharding))


def scale_by_kfac(
    damping: ScalarOrSchedule = 0.03,
    *,
    ema_decay: Optional[float] = 0.95,
    block_size: Optional[int] = None,
    pi_damping: bool = False,
    inverse_method: str = "cholesky",
    conv_statistics: str = "expand",
    spatial_samples: Optional[int] = None,
    subsample_key: Optional[jax.Array] = None,
    inverse_period: Period = 1,
    adaptive_refresh: Optional[float] = None,
    max_refresh_interval: int = 64,
    dtype: Optional[jnp.dtype] = None,
    woodbury_rows: Optional[int] = None,
    block_sharding: Optional[jax.sharding.NamedSharding] = None,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioner: every block refreshed at every statistics step, whole factors.

  The same transform as :func:`scale_by_thor` with ``trace_thresholds=(0, 0)``. The factor
  period is the interval between statistics steps (a host-side
  :class:`thor_optax.CheckSchedule`); ``inverse_period`` decouples the inversions from it.

  SP-NGD's adaptive refresh (``adaptive_refresh=tol``): every factor block has its own interval
  ``k`` (starting at 1 step). At a statistics step, a block whose next refresh step has come
  forms its new covariance ``X`` and compares it with its last refreshed value ``X'``: if
  ``||X - X'||_F / ||X'||_F < tol`` the block is *similar*: nothing is stored or inverted and
  its interval doubles (capped at ``max_refresh_interval``); otherwise ``X`` is refreshed and
  inverted and the interval resets to 1. The block is next due ``k`` steps later; blocks not due
  cost neither a covariance nor an inversion.

  Args:
    damping: ``lambda`` (float or schedule of the step); see :func:`scale_by_thor`.
    ema_decay: running-average decay of the factors (kfac-pytorch's ``factor_decay``), or
      ``None`` for the current batch only.
    block_size: ``None`` (default) inverts whole factors; an int splits them as THOR does.
    pi_damping: split the damping with the pi rule.
    inverse_method, conv_statistics, spatial_samples, subsample_key, inverse_period: see
      :func:`scale_by_thor`.
    adaptive_refresh: SP-NGD's tolerance ``tol`` on the relative Frobenius change, or ``None``
      to refresh every block at every statistics step.
    max_refresh_interval: cap on a block's adaptive interval, in steps.
    dtype: dtype of factors and inverses (default float32, float64 for float64 parameters).
    woodbury_rows, block_sharding: see :func:`scale_by_thor`.

  Returns:
    an ``optax.GradientTransformationExtraArgs`` with state :class:`KroneckerState`.

  Raises:
    ValueError: as :func:`scale_by_thor`.

  References:
    Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature", ICML 2015; Grosse & Martens, ICML 2016 (conv layers); Pauloski et al.,
    KAISA, SC 2021 (eigh, decoupled periods); Osawa et al., SP-NGD, TPAMI 2020, section
    "Adaptive frequency to refresh statistics" (rule above: our reading of it).
  """
  return _kronecker_preconditioner(_Config(
      damping=damping, block_size=block_size, omega1=0.0, omega2=0.0, ema_decay=ema_decay,
      pi_damping=pi_damping, num_buckets=1 if adaptive_refresh is None else 4,
      inverse_method=inverse_method,
      sampling=_conv_sampling(conv_statistics, spatial_samples), subsample_key=subsample_key,
      inverse_period=inverse_period, adaptive_refresh=adaptive_refresh,
      max_refresh_interval=max_refresh_interval, dtype=dtype, woodbury_rows=woodbury_rows,
      block_sharding=block_sharding))
