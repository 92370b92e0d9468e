"""``scale_by_thor`` and ``scale_by_kfac``: Kronecker-factored natural-gradient preconditioners.

Both are ``optax.GradientTransformationExtraArgs`` built on one mechanism; the methods of the
seed papers are options of it, not separate code paths:

* THOR: trace rule per factor block, uniform 128-blocks, current-batch factors, Cholesky;
* K-FAC / KAISA: every block at every check, whole factors, running averages, optionally
  ``inverse_method='eigh'`` (exact damping of ``A (x) G``) and an ``inverse_period`` decoupled
  from the check steps;
* SKFAC: ``inverse_method='woodbury'`` / ``'auto'`` (an ``m x m`` solve when a factor has fewer
  rows ``m`` than dimensions) and ``conv_statistics='reduce_sum'`` / ``'spatial_subsample'``;
* SP-NGD: ``adaptive_refresh`` (each block's own refresh interval, lengthened while the block
  stays similar), pi damping, unit-wise 2x2 Fisher for normalization layers.

``update`` takes the raw per-layer statistics as the keyword-only argument ``curvature_stats``:

* with statistics (a *check step*, ``check_step.py``): per factor block the refresh policy
  (``refresh/``: THOR's trace rule, K-FAC's every check, SP-NGD's adaptive interval) selects the
  blocks due; their covariances are formed, accumulated by the factor accumulator
  (``accumulators/``: current batch, or running average with an inverse period) and inverted by
  the inverse method (``inverses/``: one batched Cholesky or eigendecomposition per block
  size, only the selected blocks, see ``blocks.masked_block_update``); layer kinds
  (``layers/``) refresh their side curvature (normalization layers, embeddings' diagonal
  ``A``); then the gradient is preconditioned;
* without statistics (a *plain step*): the gradient is preconditioned with the stored inverses
  (``precondition.py``). Nothing else runs, so the step costs a first-order step plus two
  block-diagonal products per layer;
* a plain step given its batch's statistics as ``gradient_stats=`` (no refresh) applies each
  factor of a dense layer to the layer's rows instead where that is cheaper, i.e. when the
  batch has fewer rows than the other factor's dimension (``sample_space.py``): the same
  update, about ``d / R`` times fewer FLOPs for the products, and the kernel gradient's GEMM
  is replaced by the product of the preconditioned rows.

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

import collections.abc
import dataclasses
import math
import numbers
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from flax import serialization as flax_serialization

from thor_optax._src import blocks
from thor_optax._src import check_step as check_lib
from thor_optax._src import damping as damping_lib
from thor_optax._src import explicit
from thor_optax._src import inverses
from thor_optax._src import precondition as precondition_lib
from thor_optax._src import replicas
from thor_optax._src import sample_space
from thor_optax._src import static_args
from thor_optax._src import stats as stats_lib
from thor_optax._src.accumulators import current_batch
from thor_optax._src.accumulators import running_average
from thor_optax._src.layers import conv
from thor_optax._src.refresh import adaptive
from thor_optax._src.refresh import every_check
from thor_optax._src.refresh import trace_rule

ScalarOrSchedule = Union[float, optax.Schedule]
Period = running_average.Period
LayerDiagnostics = check_lib.LayerDiagnostics
Diagnostics = check_lib.Diagnostics
BlockRecord = check_lib.BlockRecord


@jax.tree_util.register_pytree_with_keys_class
class FactorDims:
  """The factor dimensions the state was initialised for: part of the pytree's structure, no
  array leaves (so checkpoints and shardings are unchanged, and a state restored into
  ``tx.init(params)``'s structure keeps them).

  Block stacks of two models can have the same shapes when the factors differ in size (``G``
  of 12 and of 10 outputs both fill one 128-block); ``update`` compares these dimensions with
  the gradients' and names the layer that differs.

  Attributes:
    dims: ``((layer path, (d_A, d_G, copies)), ...)`` sorted by path, for every
      Kronecker-factored layer (``d_A = 0`` where ``A`` is kept elsewhere, an embedding's
      diagonal; ``copies``: layers of an ``nn.scan`` stack).
  """

  def __init__(self, dims: tuple[tuple[str, tuple[int, int, int]], ...]):
    self.dims = tuple(dims)

  @classmethod
  def of(cls, layout: blocks.BlockLayout) -> "FactorDims":
    return cls(tuple((spec.name, (0 if spec.a is None else spec.a.dim, spec.g.dim,
                                  spec.g.copies))
                     for spec in layout.layers if spec.g is not None))

  def tree_flatten_with_keys(self):
    return (), self.dims

  @classmethod
  def tree_unflatten(cls, dims, children):
    del children
    return cls(dims)

  def __repr__(self):
    return f"FactorDims({dict(self.dims)})"


# flax.serialization (msgpack checkpoints, flax's TrainState) stores nothing for it and keeps the
# target's.
flax_serialization.register_serialization_state(
    FactorDims, lambda dims: {}, lambda target, state: target)


class KroneckerState(NamedTuple):
  """State of :func:`scale_by_thor` / :func:`scale_by_kfac`: only what the chosen pieces need.

  Attributes:
    count: int32, number of ``update`` calls (steps); schedules are evaluated at it.
    blocks: ``{group: stack}`` per block stack (``'b128'``: the ``(n, b, b)`` blocks of size
      ``b`` of every layer's ``A`` and ``G``, see ``blocks.build_layout``; ``'b785r64'``: blocks
      in low-rank form). Each stack is a dict of its pieces' states, every leaf with the block
      index on axis 0: ``'inverse'`` (the inverse method's: ``InverseBlocks(inverse)``,
      ``EighState(eigenvectors, eigenvalues)`` or ``LowRankState(u, core, damping)``),
      ``'record'`` (:class:`BlockRecord`: ``trace_ref``, ``refreshes``, ``damping_ref``), and
      where the pieces keep state ``'policy'`` (``TraceRuleState(frozen)``,
      ``BoundedTraceRuleState(frozen, skipped)``, ``AdaptiveState(next_refresh,
      refresh_interval)``) and ``'accumulator'`` (``FactorState(factor, stale)``).
    layers: ``{layer path: state}`` side curvature of layer kinds: an embedding's diagonal
      ``A`` (``DiagonalState``), a normalization layer's unit-wise Fisher (``UnitwiseState``),
      each with the stored factor when the accumulator keeps factors.
    accumulator: the factor accumulator's global state (``InversePeriodState(next_inverse)``
      for running averages, ``optax.EmptyState()`` for the current batch).
    diagnostics: :class:`Diagnostics`, read as ``{layer path: LayerDiagnostics}``, for every
      Kronecker-factored layer.
    factor_dims: :class:`FactorDims`, static (no leaves): the factor dimensions of every
      Kronecker-factored layer, checked against the gradients' at every ``update``.
  """

  count: jax.Array
  blocks: dict[str, dict[str, Any]]
  layers: dict[str, Any]
  accumulator: Any
  diagnostics: Diagnostics
  factor_dims: Any = FactorDims(())


# What to choose when a piece needs what the others do not provide (``Curvature``'s check).
_PIECE_ADVICE = {
    "rows": ("Woodbury and low-rank inverses invert the current batch's rows: leave ema_decay="
             "None, inverse_period=1 and adaptive_refresh=None, or choose inverse_method="
             "'cholesky' (or 'auto', which picks Woodbury only where rows are kept)."),
    "stored factors": ("adaptive_refresh compares each factor with its stored running average: "
                       "set ema_decay (e.g. 0.95), or leave adaptive_refresh=None."),
    "factored damping": ("pi_damping splits the damping between A and G, which inverse_method="
                         "'eigh' does not (it damps the Kronecker product exactly, KAISA): set "
                         "pi_damping=False, or choose inverse_method='cholesky'."),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Curvature:
  """The pieces of a Kronecker preconditioner, validated on construction.

  Attributes:
    damping_schedule: ``lambda``, a float or a schedule of the step.
    block_size: THOR's split size, or ``None``.
    method: the inverse method (``inverses/``).
    policy: the refresh policy (``refresh/``).
    accumulator: the factor accumulator (``accumulators/``).
    damping: the damping piece (``pi_damping``).
    sampling: conv statistics (``layers.conv.ConvSampling``).
    subsample_key: PRNG key of random spatial subsampling, or ``None``.
    num_buckets: static budgets of a masked refresh (``refresh_buckets``).
    dtype: dtype of the curvature, or ``None`` (from the parameters).
    block_sharding: ``NamedSharding`` of the inversion work, or ``None``.
    axis_name: the mapped axis (or tuple of axes) across which check steps average the
      curvature statistics (``replicas.py``), or ``None``.
    layers: the capture's layout (:class:`thor_optax.CapturedLayers`), or ``None`` to claim
      layers from parameter shapes alone.

  Raises:
    ValueError: if a piece needs what no other piece provides (naming both), or on an invalid
      ``refresh_buckets`` or ``axis_name``, or both ``axis_name`` and ``block_sharding``
      (``damping``, ``dtype`` and ``trace_thresholds`` are checked by the constructors,
      :func:`_check_arguments`).
  """

  damping_schedule: ScalarOrSchedule
  block_size: Optional[int]
  method: inverses.InverseMethod
  policy: Any
  accumulator: Any
  damping: damping_lib.FactoredDamping
  sampling: conv.ConvSampling
  subsample_key: Optional[jax.Array]
  num_buckets: int
  dtype: Optional[jnp.dtype]
  block_sharding: Optional[jax.sharding.NamedSharding]
  axis_name: Optional[replicas.AxisName] = None
  layers: Optional[stats_lib.CapturedLayers] = None

  def __post_init__(self):
    replicas.validate(self.axis_name)
    if self.block_sharding is not None and (
        not isinstance(self.block_sharding, jax.sharding.NamedSharding)
        or not self.block_sharding.spec or self.block_sharding.spec[0] is None):
      raise ValueError(
          f"block_sharding must be None or a jax.sharding.NamedSharding whose spec names the "
          f"mesh axes that divide the blocks on its first entry, e.g. NamedSharding(mesh, "
          f"PartitionSpec('data')); got {self.block_sharding!r}.")
    if replicas.names(self.axis_name) and self.block_sharding is not None:
      raise ValueError(
          f"axis_name={self.axis_name!r} and block_sharding cannot be combined: block_sharding "
          "divides the inversions over a mesh with jax.shard_map under jax.jit, which cannot "
          "run inside the mapped axis that axis_name names (jax.pmap). Under pmap every replica "
          "inverts every block due; to divide that work, jit the step on a mesh with sharded "
          "arrays instead (README, 'Scaling out').")
    if (isinstance(self.num_buckets, bool) or not isinstance(self.num_buckets, numbers.Integral)
        or self.num_buckets < 1):
      raise ValueError(
          f"thor_optax.scale_by_thor: refresh_buckets must be an int >= 1 (the number of "
          f"static budgets of a masked refresh; 1 compiles the shortest step), got "
          f"{self.num_buckets!r}; " + static_args.hint())
    if self.layers is not None and not isinstance(self.layers, stats_lib.CapturedLayers):
      raise ValueError(
          f"layers must be None or thor_optax.captured_layers(stats), got "
          f"{type(self.layers).__name__}; build it from the statistics of one capture.")
    blocks.build_layout({}, self.block_size)  # validates block_size
    pieces = (self.method, self.policy, self.accumulator, self.damping)
    for piece in pieces:
      others = [p for p in pieces if p is not piece]
      missing = piece.requires - frozenset().union(*(p.provides for p in others))
      for need in sorted(missing):
        slot = {"factored damping": self.method}.get(need, self.accumulator)
        culprits = [slot] if slot is not piece else others
        raise ValueError(
            f"{piece.describe()} needs {need}, which "
            f"{' / '.join(p.describe() for p in culprits)} "
            "cannot provide. "
            + _PIECE_ADVICE.get(need, ""))

  def layout(self, tree: Any) -> blocks.BlockLayout:
    """The static layout of a parameter or gradient tree."""
    return blocks.build_layout(tree, self.block_size,
                               lambda block: self.method.for_block(block).rank,
                               None if self.layers is None else self.layers.kinds)

  def group_method(self, group: str) -> inverses.InverseMethod:
    """The inverse method of a block stack (``'b128'``, ``'b785r64'``)."""
    block = int(group[1:].split("r")[0])
    return self.method.for_block(block)

  def lam(self, count: jax.Array) -> Any:
    """``lambda`` at step ``count``."""
    s = self.damping_schedule
    return s(count) if callable(s) else s


def _state_dtype(tree: Any, dtype: Optional[jnp.dtype]) -> jnp.dtype:
  if dtype is not None:
    return jnp.dtype(dtype)
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.result_type(jnp.float32, *[x.dtype for x in leaves]) if leaves else jnp.float32


def init_state(layout: blocks.BlockLayout, dtype: jnp.dtype, cfg: Curvature) -> KroneckerState:
  """The state before the first step: identity inverses, nothing refreshed."""
  # A fresh buffer per leaf: a state whose leaves share buffers cannot be donated to jit.
  stacks = {}
  for group, (b, n) in layout.groups.items():
    stack = {"inverse": cfg.group_method(group).init(b, n, dtype),
             "record": BlockRecord(jnp.zeros((n,), dtype), jnp.zeros((n,), jnp.int32),
                                   jnp.zeros((n,), dtype))}
    pieces = {"policy": cfg.policy.init(n, dtype), "accumulator": cfg.accumulator.init(b, n, dtype)}
    stacks[group] = {**stack, **{k: v for k, v in pieces.items() if v is not None}}
  side = {spec.name: _stacked(spec.kind.side_init(spec.one_layer(), dtype, cfg.method,
                                                  cfg.accumulator), spec.copies, spec.stack)
          for spec in layout.layers}
  diagnostics = check_lib.Diagnostics.zeros(
      {spec.name: sum(s.num_blocks for s in spec.slots)
       for spec in layout.layers if spec.g is not None}, dtype)
  return KroneckerState(count=jnp.zeros((), jnp.int32), blocks=stacks,
                        layers={k: v for k, v in side.items() if v is not None},
                        accumulator=cfg.accumulator.init_global(), diagnostics=diagnostics,
                        factor_dims=FactorDims.of(layout))


def _stacked(tree: Any, copies: int, stack: tuple[int, ...]) -> Any:
  """One layer's state repeated for every layer of a stack, ``(copies, ...)`` (as is for a
  single layer)."""
  if not stack:
    return tree
  return jax.tree.map(lambda x: jnp.repeat(x[None], copies, axis=0), tree)


def _check_state_matches(layout: blocks.BlockLayout, state: KroneckerState,
                         cfg: Curvature) -> None:
  def shapes(s):
    return jax.tree.map(lambda x: tuple(x.shape), (s.blocks, s.layers))

  want_layers = sorted(spec.name for spec in layout.layers if spec.g is not None)
  if sorted(state.diagnostics) != want_layers:
    extra = sorted(set(state.diagnostics) - set(want_layers))
    lacking = sorted(set(want_layers) - set(state.diagnostics))
    raise ValueError(
        "optimizer state does not match the gradient tree: the state was initialised for the "
        f"layers {sorted(state.diagnostics)}, the gradients have the layers {want_layers} "
        f"(only in the state: {extra}; only in the gradients: {lacking}). Initialise the "
        "state with tx.init(params) of the model whose gradients you pass (a renamed module "
        "or another model gives other layer paths).")
  want_dims = FactorDims.of(layout)
  if isinstance(state.factor_dims, FactorDims) and state.factor_dims.dims != want_dims.dims:
    have, need = dict(state.factor_dims.dims), dict(want_dims.dims)
    name = next(k for k in sorted(need) if have.get(k) != need[k])
    describe = lambda d: f"A {d[0]} x {d[0]}, G {d[1]} x {d[1]}" + (
        f" for each of {d[2]} stacked layers" if d[2] > 1 else "")
    raise ValueError(
        f"optimizer state does not match the gradient tree: layer {name!r} has Kronecker "
        f"factors {describe(need[name])} in the gradients, but the state was initialised for "
        f"{describe(have[name])} (another model with the same layer names: a different "
        "number of inputs or outputs). Initialise the state with tx.init(params) of the model "
        "whose gradients you pass.")
  want = shapes(jax.eval_shape(lambda: init_state(layout, jnp.float32, cfg)))
  have = shapes(state)
  if want[0] == have[0] and sorted(want[1]) == sorted(have[1]):
    name = next((k for k in sorted(want[1]) if want[1][k] != have[1][k]), None)
    if name is not None:
      leaf_shapes = lambda tree: [tuple(x) for x in jax.tree.leaves(
          tree, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))]
      raise ValueError(
          f"optimizer state does not match the gradient tree: layer {name!r} needs side "
          f"curvature of shapes {leaf_shapes(want[1][name])} (from its parameters in the "
          f"gradients), but the state holds {leaf_shapes(have[1][name])} (a parameter of "
          "another size under the same name). Initialise the state with tx.init(params) of "
          "the model whose gradients you pass.")
  if want != have:
    raise ValueError(
        "optimizer state does not match the gradient tree: the gradients' layers need the "
        f"block stacks {{group: (block, blocks)}} {layout.groups} and side curvature for "
        f"{sorted(want[1])}, the state "
        f"holds {({g: jax.tree.leaves(stack)[0].shape[0] for g, stack in state.blocks.items()})} "
        f"blocks and side curvature for {sorted(state.layers)}. "
        "Was the state initialised with other parameters?")


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


def _masked_modules(updates: Any) -> stats_lib.MaskedModules:
  """The modules with a leaf or a subtree that ``optax.masked`` replaced."""
  flat, _ = jax.tree_util.tree_flatten_with_path(
      updates, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  return stats_lib.MaskedModules(frozenset(stats_lib.path_keys(path) for path, leaf in flat
                                           if isinstance(leaf, optax.MaskedNode)))


def _nan_unless(ok: jax.Array, updates: Any) -> Any:
  """``updates`` if ``ok``, else NaN updates, so that the aliases' non-finite guard skips and
  counts the step."""
  return jax.tree.map(lambda u: jnp.where(ok, u, jnp.full_like(u, jnp.nan))
                      if jnp.issubdtype(jnp.result_type(u), jnp.inexact) else u, updates)


def _reject_step(ok: jax.Array, updates: Any, state: KroneckerState,
                 given: KroneckerState) -> tuple[Any, KroneckerState]:
  """Unless ``ok`` (a damping from a schedule that is finite and positive): NaN updates and the
  curvature state as it was given (nothing refreshed)."""
  state = jax.tree.map(lambda new, old: jax.lax.select(ok, new, old), state, given)
  return _nan_unless(ok, updates), state


def _check_arguments(where: str, damping: Any, dtype: Any,
                     trace_thresholds: Any = (0.0, 0.0)) -> None:
  """The constructors' checks of ``damping``, ``dtype`` and ``trace_thresholds``.

  Raises:
    TypeError: ``damping`` neither a number nor a schedule (a string, ``None``);
      ``trace_thresholds`` not a pair of numbers.
    ValueError: ``damping`` a number (Python, numpy, 0-d array) that is not finite and
      positive; ``dtype`` not a floating-point dtype; ``trace_thresholds`` of another length,
      or with an entry negative or not finite.
  """
  static_args.check_number(where, "damping", damping, lambda v: 0 < v < math.inf,
                           "finite and > 0", schedule=True)
  if dtype is not None:
    try:
      floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      raise ValueError(
          f"thor_optax.{where}: dtype must be None or a floating-point dtype (jnp.float32, "
          f"jnp.float64, jnp.bfloat16) for the factors and inverses, got {dtype!r}.")
  if isinstance(trace_thresholds, (str, bytes)) or not isinstance(
      trace_thresholds, collections.abc.Sequence):
    raise TypeError(
        f"thor_optax.{where}: trace_thresholds must be a pair (omega1, omega2), e.g. (0.01, 0.0) "
        f"(THOR) or (0.0, 0.0) (every block at every check), got "
        f"{type(trace_thresholds).__name__} {trace_thresholds!r}.")
  if len(trace_thresholds) != 2:
    raise ValueError(
        f"thor_optax.{where}: trace_thresholds must be a pair (omega1, omega2) with 0 <= omega2 "
        f"<= omega1, e.g. (0.01, 0.0), got {len(trace_thresholds)} values "
        f"{tuple(trace_thresholds)!r}.")
  for name, value in zip(("trace_thresholds[0] (omega1)", "trace_thresholds[1] (omega2)"),
                         trace_thresholds):
    static_args.check_number(where, name, value, lambda v: 0 <= v < math.inf,
                             "finite and >= 0")


def kronecker_preconditioner(cfg: Curvature, name: str = "scale_by_thor"
                             ) -> optax.GradientTransformationExtraArgs:
  """The transform of a set of pieces: ``update(..., curvature_stats=)`` runs a check step.

  ``name`` (the constructor's) heads the messages of ``update``'s errors.
  """

  def init_fn(params):
    if _is_params_placeholder(params):
      return _placeholder_state()
    return init_state(cfg.layout(params), _state_dtype(params, cfg.dtype), cfg)

  def update_fn(updates, state, params=None, *, curvature_stats=None, gradient_stats=None,
                inner_products=None, **extra_args):
    # curvature_stats: a check step; gradient_stats: a plain step from the rows (sample space);
    # inner_products: a dict the layers preconditioned from their rows report <u, g> in (for
    # scale_by_kl_clip, which then need not form their gradients).
    del params
    static_args.check_update_keywords(name, extra_args)
    static_args.check_state(name, state, ("count", "blocks", "layers", "diagnostics"),
                            "KroneckerState")
    layout = cfg.layout(updates)
    _check_state_matches(layout, state, cfg)
    given = state
    # A state laid out with explicit shardings (block stacks sharded over a mesh axis,
    # kronecker_state_sharding's MEM-OPT) is gathered for the step (slices of a layer's blocks
    # need not fall on shard boundaries) and returned laid out as it came. A state restored as
    # numpy arrays (jax.device_get, flax.serialization) becomes jax arrays (an eager step's
    # in-place updates are written `.at[...]`).
    state = jax.tree.map(lambda x: explicit.replicate(jnp.asarray(x)), state)
    lam = cfg.lam(state.count)
    stats_finite = None
    if curvature_stats is not None:
      state, stats_finite = check_lib.check_step(state, layout, curvature_stats, lam, cfg,
                                                 _masked_modules(updates))
    rows, num_loss_terms = None, 1
    if gradient_stats is not None:
      layout, rows = sample_space.layers_with_rows(gradient_stats, layout, cfg,
                                                   _masked_modules(updates), updates)
      num_loss_terms = gradient_stats.num_loss_terms
    updates = precondition_lib.precondition(updates, state, layout, cfg, lam,
                                            check_lib.state_dtype(state), rows, num_loss_terms,
                                            inner_products if rows else None)
    state = jax.tree.map(explicit.reshard_like, state, given)
    if callable(cfg.damping_schedule) or not isinstance(lam, numbers.Real):
      # A schedule's value (a Python float too) or a traced one: checked here (a constant
      # number was checked at construction).
      lam_value = jnp.asarray(lam)
      updates, state = _reject_step(jnp.isfinite(lam_value) & (lam_value > 0), updates, state,
                                    given)
    if stats_finite is not None:
      # Statistics that are not finite refreshed nothing (their blocks kept their inverses);
      # the update says so, so that a guard skips the step without reading them again.
      updates = _nan_unless(stats_finite, updates)
    return updates, state._replace(count=optax.safe_int32_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _accumulator(ema_decay: Optional[float], inverse_period: Period,
                 adaptive_refresh: Optional[float], rows_ratio: Optional[float] = None) -> Any:
  """Current-batch factors, unless factors must outlive a check step."""
  every_step = isinstance(inverse_period, int) and not isinstance(inverse_period, bool) \
      and inverse_period == 1
  if ema_decay is None and adaptive_refresh is None and every_step:
    return current_batch.CurrentBatch()
  return running_average.RunningAverage(0.0 if ema_decay is None else ema_decay, inverse_period,
                                        rows_ratio)


def scale_by_thor(
    damping: ScalarOrSchedule = 0.03,
    *,
    block_size: Optional[int] = 128,
    trace_thresholds: tuple[float, float] = (0.01, 0.0),
    max_stale_checks: Optional[int] = None,
    ema_decay: Optional[float] = None,
    ema_rows_ratio: Optional[float] = None,
    pi_damping: bool = False,
    max_pi: Optional[float] = None,
    min_relative_damping: float = 0.0,
    refresh_buckets: int = 2,
    inverse_method: str = "cholesky",
    inverse_power: Optional[float] = None,
    conv_statistics: str = "expand",
    spatial_samples: Optional[int] = None,
    subsample_key: Optional[jax.Array] = None,
    inverse_period: Period = 1,
    dtype: Optional[jnp.dtype] = None,
    woodbury_rows: Optional[int] = None,
    block_sharding: Optional[jax.sharding.NamedSharding] = None,
    axis_name: Optional[replicas.AxisName] = None,
    layers: Optional[stats_lib.CapturedLayers] = None,
) -> optax.GradientTransformationExtraArgs:
  """THOR's natural-gradient preconditioner (trace rule, uniform blocks, split damping).

  Call ``update(grads, state, params, curvature_stats=stats)`` on check steps (statistics from
  ``thor_optax.flax.value_and_grad_with_stats``) and ``update(grads, state, params)`` on the
  others; :class:`thor_optax.CheckSchedule` says which is which. A plain step may pass its
  batch's statistics as ``update(grads, state, params, gradient_stats=stats)``: nothing is
  refreshed, and every dense layer whose batch has fewer rows ``R`` (examples x positions) than
  a factor's other dimension gets that factor applied to its ``(R, d)`` rows instead of the
  ``(d_A, d_G)`` gradient (``(a A^-1)^T (g G^-1) / M``, the same update; about ``d / R``
  times fewer FLOPs, and under ``jax.jit`` the layer's kernel gradient is never computed).
  Only layers listed in the statistics' ``exact_rows`` (empirical Fisher, positions not
  reduced) and inverse methods applied factor by factor (not ``'eigh'``) qualify; the others
  use the gradient. Under ``axis_name`` the products are averaged across replicas. The
  statistics must be those of exactly the gradient passed (under ``optax.MultiSteps``, the
  micro-batches' joined with :func:`thor_optax.concatenate_stats`): the update is computed from
  them, not from ``grads``. A check step takes them too, as ``update(grads, state, params,
  curvature_stats=stats, gradient_stats=stats)``: it refreshes the blocks due from
  ``curvature_stats``, then preconditions from the rows with the refreshed inverses (the MNIST
  MLP's check step, batch 128: 11.7 ms against 14.4, ``benchmarks/check_step.py``).

  A check step whose statistics are not finite (a layer's factor rows, a normalization layer's
  per-example gradients) refreshes nothing from them and returns NaN updates, as does a step
  whose damping from a schedule is not finite and positive: the aliases' guard
  (:func:`thor_optax.skip_not_finite`) then skips and counts the step; used alone, wrap this
  transform in it or in ``optax.apply_if_finite``.

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
    max_stale_checks: ``None`` (the paper's rule, the default here) or a Python int ``K >= 0``:
      a block that is not frozen and was skipped at ``K`` checks in a row is refreshed at the
      next one, whatever its trace. The trace of a layer's input after a LayerNorm or RMSNorm
      is pinned by the normalization (``d`` per row at unit scale), so the rule alone refreshes
      such ``A`` blocks only once (``refresh/trace_rule.py``). Adds an ``(n,)`` int32 count per
      block stack to the state (``BoundedTraceRuleState``). Anything else raises
      ``ValueError``. Evidence (benchmarks/README.md, "Which of THOR's approximations costs steps"):
      on the language model of ``benchmarks/lm.py`` (seed 0) ``K = 1`` with :func:`thor`'s defaults
      was at 3.567 bits per character at step 100 against 3.602 and ended level (3.331
      against 3.326), ``K = 3`` ended behind (3.363); on the MNIST models ``K = 1`` cost steps
      (MLP: 92% in 70 steps instead of 65, means of 6 seeds), so no alias sets it.
    ema_decay: if set, a block's factor is the running average ``decay * old + (1 - decay) *
      new`` over its refreshes (stored in the state; doubles its memory); a block the trace
      rule skips keeps its factor. THOR's paper uses ``None`` (the default here): the current
      batch only. The :func:`thor` alias uses 0.95 with ``ema_rows_ratio=4``.
    ema_rows_ratio: with ``ema_decay``, average only the blocks formed from fewer than this
      many rows per dimension (``rows < ratio * min(d, b)``, rows: examples x positions, of
      all replicas; static), and let the others take the current batch's factor; ``None``:
      average every block. A block from ``R >= 4 d`` rows is well conditioned on its own
      (Marchenko-Pastur, isotropic rows: eigenvalues above about a quarter of their mean), one
      from fewer is near-singular. Side curvature (an embedding's diagonal ``A``, a
      normalization layer's 2x2 Fisher) is averaged at every refresh. A value that is not
      ``None`` or a positive Python number raises ``ValueError``. Evidence (README, "Which of
      THOR's approximations costs steps"): on the MNIST models, where the dense layers' blocks
      see 128 rows, averaging saved steps on every target; on the language model, whose blocks
      see 1,024 rows, averaging every block cost steps and final loss, averaging none did not.
    pi_damping: split the damping with the pi rule (Martens & Grosse 2015, section 6.3).
    max_pi: with ``pi_damping``, ``pi`` is clipped to ``[1 / max_pi, max_pi]`` (``None``, the
      default: the rule as published; 1: the equal split). A convolution's factors can differ
      in scale by 1e9, and the unclipped rule then gives it the gradient scaled by
      ``1 / lambda`` (``damping.py``; :func:`thor` for measured values). A Python number
      below 1 or not finite raises ``ValueError``.
    min_relative_damping: floor ``rho >= 0`` on each block's damping, relative to its mean
      eigenvalue: a factor block ``B`` of dimension ``d`` formed from ``R`` rows gets at least
      ``rho tr(B) / min(R, d)`` (eigh: each factor's eigenvalues are floored at ``rho`` times
      their mean before ``lambda`` is added to their products). It bounds what a stale inverse
      of a singular current-batch factor does to new gradients when ``lambda`` is small; 0
      (default): none, the papers' damping. The aliases use 0.1, :func:`thor` 1
      (benchmarks/README.md, "Robustness").
    refresh_buckets: the number of static budgets a masked refresh chooses from
      (``blocks.masked_block_update``: with 2, half of the blocks or all of them, whichever
      holds the blocks due, of a factor for its covariances and of a stack for its inversions);
      more buckets track the refreshed count more tightly at the cost of compile time, each
      budget being a copy of the refresh in the compiled step. They apply to the covariances
      of the blocks due, and on GPU and TPU (or with ``block_sharding``) to their inversions
      too; on CPU the blocks due are inverted one at a time, as many as are due. Default 2
      (4 before): on a ResNet-50 (bfloat16, 224 x 224, batch 256, one H200) the check step
      compiled in 46.6 s with 2 budgets and 62.4 with 1
      against 83.0 with 4 (the plain step: 34.7-38.3 s; the runs differ in what XLA had
      autotuned before), and a check with 1 of the 654 blocks due ran in 61.2 ms (1 budget:
      67.2) against 63.1 with 5 due under 4 budgets; on the CPU (32 x 32, batch 8) the check
      compiled in 31.9 s against 39.1 (1 budget: 28.3) and ran as fast, and on the MNIST
      models compile and check times did not move (benchmarks/README.md, "On a GPU").
      Anything but an int ``>= 1`` raises ``ValueError``.
    inverse_method: ``'cholesky'`` (damped inverse per block), ``'eigh'`` (eigendecomposition,
      exact damping of ``A (x) G``; KAISA), ``'woodbury'`` (``m x m`` solve from the ``m`` rows
      behind a factor; SKFAC; needs current-batch factors) or ``'auto'`` (Woodbury for factors
      with fewer rows than block dimensions, Cholesky otherwise).
    inverse_power: ``p`` in ``(A (x) G + lambda I)^-p vec(X)``: ``None`` (default) for the
      natural gradient (``p = 1``), or a Python number in ``(0, 1]``. Values other than 1 need
      ``inverse_method='eigh'``; ``0.5`` is the square root of the preconditioner (Shampoo's
      and Adam's power). A normalization layer's unit-wise Fisher blocks keep ``p = 1``. It is
      fixed when the transform is built: with ``optax.inject_hyperparams`` pass it in
      ``static_args``. See ``thor_optax/_src/inverses/eigh.py`` for the measurement behind it.
    conv_statistics: ``'expand'`` (all im2col patches; KFC), ``'reduce_sum'`` (patches and
      cotangents summed over positions per example) or ``'spatial_subsample'``
      (``spatial_samples`` positions per example); see ``thor_optax.layers.ConvSampling``.
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
      layer. With ``axis_name``, the rows of all replicas together count.
    axis_name: ``None``, or the name of the mapped axis the step runs under (a ``str``, or a
      tuple of names for several axes), e.g. ``'batch'`` for ``jax.pmap(train_step,
      axis_name='batch')`` (Flax's ImageNet example), or a ``jax.shard_map`` mesh axis. Every
      check step then averages the curvature across the ``D`` replicas before deciding and
      inverting anything (KAISA's factor all-reduce; SP-NGD's data-parallel statistics):
      ``jax.lax.pmean`` of the ``(num_blocks,)`` block traces of every factor, the ``(n, b,
      b)`` covariance blocks of every block stack, an embedding's ``(vocab,)`` diagonal ``A``
      and a normalization layer's ``(C, 2, 2)`` unit-wise Fisher; ``jax.lax.all_gather(...,
      tiled=True)`` of the ``(R, d)`` rows behind a factor inverted from its rows (Woodbury,
      low-rank form: ``(D R, d)`` rows, scale divided by ``D``). A replica's factors average
      over its ``N`` examples (the statistics are per example, so capture them with a
      per-replica mean loss and ``jax.lax.pmean`` the gradients, as usual), so the average is
      the whole batch's factor: each replica computes what one device computes on the
      concatenated batch, and the trace rule, adaptive refresh, pi damping and inversions are
      identical on every replica, which keep identical parameters. Plain steps communicate
      nothing. ``axis_name=()`` keeps each replica's own curvature (no averaging, no check).
      Not needed under ``jax.jit`` with sharded arrays (see ``block_sharding``, which cannot
      be combined with it): the compiler reduces the statistics itself.
    layers: ``None`` (default) lays out every module a registered layer kind claims from its
      parameter shapes alone (at ``init``, which sees nothing else); or
      :func:`thor_optax.captured_layers` of the statistics of one capture, which lays out
      exactly the layers the capture takes, as it takes them: needed where shapes are
      ambiguous (a kernel without bias of ``nn.DenseGeneral`` / ``nnx.LinearGeneral``, such
      as attention projections with ``use_bias=False``, of ``nn.Einsum``, or of a 1-D or 3-D
      convolution, which a shape-only layout takes for a stack of dense layers; the first
      check step then raises, saying so), and it keeps the state to the captured layers.

  Returns:
    an ``optax.GradientTransformationExtraArgs`` with state :class:`KroneckerState`.
    Parameters and gradients may be boxed (``nn.Partitioned`` / ``nn.LogicallyPartitioned``
    leaves, NNX ``Variable`` objects): layers are found by module path as for plain arrays, and
    the updates have the gradients' tree structure, boxes included. Under an explicit-sharding
    mesh (``AxisType.Explicit``) every update has its gradient's sharding and the state keeps
    the layout it was given (see :func:`thor_optax.kronecker_state_sharding`).

  Raises:
    TypeError: at construction, when ``damping`` is neither a number nor a schedule (a string,
      ``None``), ``trace_thresholds`` is not a pair of numbers or ``pi_damping`` not a bool; in
      ``update``, when ``gradient_stats`` is not a ``CurvatureStats``, or the state is not a
      :class:`KroneckerState` (``None``, or the parameters in its place).
    ValueError: on invalid hyperparameters or combinations (at construction, e.g. an
      ``axis_name`` that is not a string or tuple of strings, a ``dtype`` that is not
      floating-point, a number out of its range: checked alike for Python and numpy scalars
      and 0-d arrays, while values traced by ``optax.inject_hyperparams`` pass); in
      ``update``, for a keyword that misspells ``curvature_stats`` or ``gradient_stats``
      (``curvature_stat=``, ``stats=``: other unknown keywords are left to the other members
      of a chain), or
      when statistics (``curvature_stats`` or ``gradient_stats``) name a layer with no weights
      in the gradients, do not fit a layer's
      weights (the message names the layer path and the expected shape), have more rows than
      ``woodbury_rows``, or the state was built for other parameters; in a check step traced
      inside a named mapped axis (``jax.pmap``, which always binds one, ``jax.shard_map``, a
      named ``jax.vmap``) without ``axis_name`` (message starting ``thor_optax:``, naming the
      bound axes and the ``axis_name=`` to pass: the replicas would otherwise each invert
      their own shard's curvature and drift apart), or with an ``axis_name`` that is not bound
      there. The first check asks JAX for the bound axes through
      ``jax.extend.core.unsafe_get_axis_names_DO_NOT_USE``, the only query JAX offers; were it
      ever removed, that check is skipped silently, so pass ``axis_name`` under ``pmap``.

  References:
    Chen et al., "THOR", AAAI 2021 (trace rule, hardware-driven split, split damping).
    Pauloski et al., "KAISA", SC 2021 (factors all-reduced across data-parallel workers);
    Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020 (data-parallel
    Kronecker factors and unit-wise Fisher, reduced across processes): ``axis_name``.
  """
  _check_arguments("scale_by_thor", damping, dtype, trace_thresholds)
  return kronecker_preconditioner(Curvature(
      damping_schedule=damping, block_size=block_size,
      method=inverses.make(inverse_method, woodbury_rows, inverse_power),
      policy=trace_rule.TraceRule(*trace_thresholds, max_stale_checks),
      accumulator=_accumulator(ema_decay, inverse_period, None, ema_rows_ratio),
      damping=damping_lib.FactoredDamping(pi_damping, min_relative_damping, max_pi),
      sampling=conv.ConvSampling(conv_statistics, spatial_samples),
      subsample_key=subsample_key, num_buckets=refresh_buckets, dtype=dtype,
      block_sharding=block_sharding, axis_name=axis_name, layers=layers), "scale_by_thor")


def scale_by_kfac(
    damping: ScalarOrSchedule = 0.03,
    *,
    ema_decay: Optional[float] = 0.95,
    block_size: Optional[int] = None,
    pi_damping: bool = False,
    max_pi: Optional[float] = None,
    min_relative_damping: float = 0.0,
    inverse_method: str = "cholesky",
    inverse_power: Optional[float] = None,
    conv_statistics: str = "expand",
    spatial_samples: Optional[int] = None,
    subsample_key: Optional[jax.Array] = None,
    inverse_period: Period = 1,
    adaptive_refresh: Optional[float] = None,
    max_refresh_interval: int = 64,
    dtype: Optional[jnp.dtype] = None,
    woodbury_rows: Optional[int] = None,
    block_sharding: Optional[jax.sharding.NamedSharding] = None,
    axis_name: Optional[replicas.AxisName] = None,
    layers: Optional[stats_lib.CapturedLayers] = None,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioner: every block refreshed at every check step, whole factors.

  The same transform as :func:`scale_by_thor` with ``trace_thresholds=(0, 0)``. The factor
  period is the interval between check steps (a host-side
  :class:`thor_optax.CheckSchedule`); ``inverse_period`` decouples the inversions from it.

  SP-NGD's adaptive refresh (``adaptive_refresh=tol``): every factor block has its own interval
  ``k`` (starting at 1 step). At a check step, a block whose next refresh step has come
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
    max_pi: clip of ``pi``; see :func:`scale_by_thor`.
    min_relative_damping: floor on each block's damping; see :func:`scale_by_thor`.
    inverse_method, inverse_power, conv_statistics, spatial_samples, subsample_key,
      inverse_period: see :func:`scale_by_thor`.
    adaptive_refresh: SP-NGD's tolerance ``tol`` on the relative Frobenius change, or ``None``
      to refresh every block at every check step.
    max_refresh_interval: cap on a block's adaptive interval, in steps.
    dtype: dtype of factors and inverses (default float32, float64 for float64 parameters).
    woodbury_rows, block_sharding, axis_name, layers: see :func:`scale_by_thor`
      (``axis_name``: the mapped axis of ``jax.pmap`` across which check steps average the
      curvature statistics; ``layers``: the capture's layout, ``captured_layers(stats)``).

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
  _check_arguments("scale_by_kfac", damping, dtype)
  if isinstance(max_refresh_interval, numbers.Integral) and max_refresh_interval < 1:
    raise ValueError(f"max_refresh_interval must be >= 1, got {max_refresh_interval}")
  return kronecker_preconditioner(Curvature(
      damping_schedule=damping, block_size=block_size,
      method=inverses.make(inverse_method, woodbury_rows, inverse_power),
      policy=(every_check.EveryCheck() if adaptive_refresh is None
              else adaptive.Adaptive(adaptive_refresh, max_refresh_interval)),
      accumulator=_accumulator(ema_decay, inverse_period, adaptive_refresh),
      damping=damping_lib.FactoredDamping(pi_damping, min_relative_damping, max_pi,
                                          "scale_by_kfac"),
      sampling=conv.ConvSampling(conv_statistics, spatial_samples),
      subsample_key=subsample_key, num_buckets=1 if adaptive_refresh is None else 4,
      dtype=dtype, block_sharding=block_sharding, axis_name=axis_name, layers=layers),
      "scale_by_kfac")
