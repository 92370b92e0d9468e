"""The check step: what ``update(..., curvature_stats=stats)`` does before preconditioning.

Top to bottom (:func:`check_step`):

1. the statistics are matched to the layers of the gradient tree (:func:`statistics_by_layer`);
2. every Kronecker-factored layer's kind gives the rows of its factors; their block traces and
   the factors' damping are gathered per block stack (:func:`gather`);
3. per block stack (:func:`refresh_stack`) the refresh policy chooses the blocks due (THOR's
   trace rule, K-FAC's every check, SP-NGD's adaptive interval); the factor accumulator turns
   their covariances into the factors to invert (current batch, or running average with an
   inverse period); the inverse method refreshes only those blocks, batched over the stack
   (``blocks.masked_block_update``), or from the rows behind a factor (Woodbury);
4. side curvature (an embedding's diagonal ``A``, a normalization layer's unit-wise Fisher) is
   refreshed by its layer kind, and the per-layer diagnostics are recorded.

Under ``jax.pmap`` with ``axis_name`` (``replicas.py``) what the curvature is built from is
averaged across the replicas where it is formed, and nowhere else: block traces and an
embedding's diagonal ``A`` (:func:`layer_factors`), covariance blocks (:func:`covariances`),
the rows of factors inverted from rows (:func:`refresh_stack`, gathered) and side statistics
(:func:`check_step`); every later decision and inversion sees identical inputs on every replica.

References:
  Chen et al., "THOR", AAAI 2021 (trace rule, split damping, 128-blocks).
  Martens & Grosse, K-FAC, ICML 2015; Pauloski et al., KAISA, SC 2021; Tang et al., SKFAC,
  CVPR 2021; Osawa et al., SP-NGD, TPAMI 2020.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src import blocks
from thor_optax._src import damping as damping_lib
from thor_optax._src import explicit
from thor_optax._src import layers as layers_lib
from thor_optax._src import replicas
from thor_optax._src import stats as stats_lib
from thor_optax._src.layers import base as layer_base


class BlockRecord(NamedTuple):
  """What every block stack records, whatever its pieces.

  Attributes:
    trace_ref: ``(n,)`` damped trace of each block at its last factor refresh (0: never).
    refreshes: ``(n,)`` int32, inversions of each block so far.
  """

  trace_ref: jax.Array
  refreshes: jax.Array


class LayerDiagnostics(NamedTuple):
  """Per-layer record of the check steps (all scalars).

  Attributes:
    blocks_refreshed: number of the layer's factor blocks (``A`` and ``G``) whose inverse was
      refreshed at its last check step.
    num_blocks: the layer's total number of factor blocks.
    total_refreshes: block inverse refreshes summed over all check steps so far.
    frozen_blocks: blocks in THOR's frozen regime.
    trace_ratio: largest relative damped-trace change among the layer's blocks at the last
      check (0 for blocks refreshed for the first time).
    rejected_blocks: the layer's factor blocks whose statistics at the last check were
      rejected, so that they kept their inverses: vanishing next to their damping (an all-zero
      batch), one row repeated (``A``), or near-singular once damped (``damping.resolvable``).
      A check step whose statistics are not finite is skipped whole by the aliases' guard.
  """

  blocks_refreshed: jax.Array
  num_blocks: jax.Array
  total_refreshes: jax.Array
  frozen_blocks: jax.Array
  trace_ratio: jax.Array
  rejected_blocks: jax.Array


class StackInputs(NamedTuple):
  """A block stack's inputs at a check step.

  Attributes:
    trace: ``(n,)`` damped trace of every block (0 where no valid statistics).
    damping: ``(n,)`` damping added to every block (1 where none).
    valid: ``(n,)`` bool, blocks with finite statistics at this check, resolvable next to their
      damping (``damping.resolvable``).
    rows: ``{slot: FactorRows}`` of the factors in the stack that have statistics.
    slots: every factor slot of the stack, in block order.
  """

  trace: jax.Array
  damping: jax.Array
  valid: jax.Array
  rows: dict
  slots: tuple


def check_step(state: Any, layout: blocks.BlockLayout, curvature_stats: Any, lam: jax.Array,
               cfg: Any, masked: frozenset[str] = frozenset()) -> Any:
  """One check step on a ``KroneckerState``: refresh the blocks due, side curvature and
  diagnostics (``lam``: ``lambda`` at this step; ``masked``: modules ``optax.masked`` hid)."""
  replicas.check_axis(cfg.axis_name)
  dtype = state_dtype(state)
  layout = as_captured(layout, stats_lib.flatten_layer_stats(curvature_stats))
  flat = statistics_by_layer(curvature_stats, layout, masked)
  kinds = {spec.name: spec.kind for spec in layout.layers}
  flat = {name: explicit.align_examples(s, kinds[name].example_axes) for name, s in flat.items()}
  key = None if cfg.subsample_key is None else replicas.fold_in(
      jax.random.fold_in(cfg.subsample_key, state.count), cfg.axis_name)
  lam = jnp.asarray(lam, dtype)
  factors = {spec.name: layer_factors(spec, flat[spec.name], dtype, cfg, key, jnp.sqrt(lam))
             for spec in layout.layers if spec.name in flat and spec.g is not None}
  inputs = gather(layout, factors, dtype, cfg.damping.min_relative_damping,
                  replicas.replica_count(cfg.axis_name))
  invert_now = cfg.accumulator.inverts_now(state.accumulator, state.count)
  new_blocks, refreshed, ratio = {}, {}, {}
  for group in layout.groups:
    new_blocks[group], refreshed[group], ratio[group] = refresh_stack(
        group, state.blocks[group], inputs[group], layout, cfg, invert_now, state.count)
  side = {}
  for spec in layout.layers:
    if spec.name in state.layers and spec.name in flat:
      side_inputs = factors[spec.name] if spec.name in factors else replicas.mean(
          side_statistics(spec, flat[spec.name], dtype), cfg.axis_name)
      side[spec.name] = side_refresh(spec, flat[spec.name], state.layers[spec.name],
                                     side_inputs, lam, cfg)
  diagnostics = {**state.diagnostics, **layer_diagnostics(
      [spec for spec in layout.layers if spec.name in factors], state.diagnostics, new_blocks,
      refreshed, ratio, {g: i.valid for g, i in inputs.items()}, cfg.policy)}
  return state._replace(
      blocks=new_blocks, layers={**state.layers, **side}, diagnostics=diagnostics,
      accumulator=cfg.accumulator.update_global(state.accumulator, invert_now, state.count))


def as_captured(layout: blocks.BlockLayout, flat: dict[str, Any]) -> blocks.BlockLayout:
  """The layout with each layer's kind the one its statistics come from.

  A layout made from parameter shapes alone may take a layer for another kind than the
  capture's (an ``nn.Einsum`` kernel with a bias for a ``DenseGeneral`` one). That is harmless
  when both give the same factors and the same gradient matrix (the plain steps use the
  layout's kind): the check step then uses the statistics' kind. Otherwise the layer's kind
  raises, saying to pass ``layers=thor_optax.captured_layers(stats)``.

  Raises:
    ValueError: naming the layer, if its statistics' kind lays it out differently.
  """
  specs = []
  for spec in layout.layers:
    stats = flat.get(spec.name)
    kind = None if stats is None else layers_lib.kind_of_stats(stats)
    if kind is None or type(stats) is spec.kind.stats_type:  # kinds may share a stats type
      specs.append(spec)
      continue
    captured = _same_layout(spec, kind, kind.hint(stats))
    if captured is None:
      layer_base.LayerKind.check_stats(spec.kind, spec, stats)  # raises, saying what to do
    specs.append(captured)
  return dataclasses.replace(layout, layers=tuple(specs))


def _same_layout(spec: layer_base.LayerSpec, kind: layer_base.LayerKind,
                 hint: tuple) -> Optional[layer_base.LayerSpec]:
  """``spec`` as ``kind`` with ``hint`` would lay the layer out, if that is ``spec``'s layout:
  the same factor dimensions, no side curvature, and the same gradient matrix (checked on a
  probe of distinct values); else ``None``."""
  claim = kind.claim_captured(spec.path, dict(spec.shapes), hint)
  no_side = all(type(k).side_init is layer_base.LayerKind.side_init for k in (kind, spec.kind))
  if claim is None or not no_side or claim.groups != spec.groups or (
      claim.a_dim, claim.g_dim) != (spec.a and spec.a.dim, spec.g and spec.g.dim):
    return None
  other = dataclasses.replace(spec, kind=kind, in_axes=claim.in_axes, hint=tuple(hint))
  size = 0
  probe = {}
  for name, shape in spec.shapes:
    probe[name] = np.arange(size, size + math.prod(shape), dtype=np.float32).reshape(shape)
    size += math.prod(shape)
  mine = np.asarray(spec.kind.to_matrix(spec, probe, jnp.float32))
  theirs = np.asarray(kind.to_matrix(other, probe, jnp.float32))
  return other if mine.shape == theirs.shape and np.array_equal(mine, theirs) else None


def state_dtype(state: Any) -> jnp.dtype:
  """The dtype of a ``KroneckerState``'s curvature (float32 if it holds none)."""
  records = [stack["record"].trace_ref for stack in state.blocks.values()]
  floats = [x for x in records + jax.tree.leaves(state.layers)
            if jnp.issubdtype(x.dtype, jnp.floating)]
  return floats[0].dtype if floats else jnp.float32


def side_statistics(spec: layer_base.LayerSpec, stats: Any, dtype: jnp.dtype) -> Any:
  """What a layer without block factors builds its side curvature from (its kind's
  ``side_statistics``; per layer of a stack, under ``vmap``)."""
  one = spec.one_layer()
  fn = lambda s: spec.kind.side_statistics(one, s, dtype)  # pylint: disable=unnecessary-lambda-assignment
  return jax.vmap(fn)(stats) if spec.stack else fn(stats)


def side_refresh(spec: layer_base.LayerSpec, stats: Any, state: Any, factors: Any,
                 lam: jax.Array, cfg: Any) -> Any:
  """A layer's side curvature after a check step (per layer of a stack, under ``vmap``)."""
  one = spec.one_layer()

  def refresh(stats, state, factors):
    return spec.kind.side_refresh(one, stats, state, factors, lam, cfg.method, cfg.accumulator)

  return jax.vmap(refresh)(stats, state, factors) if spec.stack else refresh(stats, state, factors)


# Relative spread of a factor's rows below which they count as one row repeated (float32 sums
# of identical rows differ from R times their mean by a few ulps).
_ONE_ROW_TOLERANCE = 1e-5


def layer_factors(spec: layer_base.LayerSpec, stats: Any, dtype: jnp.dtype, cfg: Any,
                  key: Any, sqrt_damping: jax.Array) -> layer_base.LayerFactors:
  """A Kronecker-factored layer's factor rows (or diagonal ``A``), damping and validity; for a
  stack of layers, every field has the stack (flattened) on a leading axis.

  The rows are this replica's; traces and a diagonal ``A`` are averaged across replicas
  (``cfg.axis_name``), so the damping and validity are those of the whole batch."""
  if spec.stack:
    one = spec.one_layer()
    return jax.vmap(lambda s: layer_factors(one, s, dtype, cfg, key, sqrt_damping))(stats)
  spec.kind.check_stats(spec, stats)
  kw = dict(sampling=cfg.sampling, key=key)
  g = spec.kind.cotangent_rows(spec, stats, dtype, **kw)
  a = spec.kind.input_rows(spec, stats, dtype, **kw)
  num_replicas = replicas.replica_count(cfg.axis_name)  # rows behind a factor: every replica's
  for slot, which, r in ((spec.a, "A", a), (spec.g, "G", g)):
    if slot is not None:
      cfg.group_method(slot.group).check_rows(spec.name, which, slot,
                                              num_replicas * r.rows.shape[0])
  tr_g = blocks.block_traces(g.rows, g.scale, spec.g)
  if spec.a is not None:
    tr_a, dim_a = blocks.block_traces(a.rows, a.scale, spec.a), spec.a.dim
    mean_row = jnp.mean(a.rows, axis=0)
  else:  # a diagonal A: its values
    tr_a, dim_a = jnp.sum(a, keepdims=True), a.shape[0]
    a = replicas.mean(a, cfg.axis_name)
    mean_row = None
  tr_a, tr_g, mean_row = replicas.mean((tr_a, tr_g, mean_row), cfg.axis_name)
  if mean_row is not None and a.rows.shape[0] > 1:
    # Rows that are all one row (an all-zero batch behind a bias, one example repeated) give
    # a rank-one A that says nothing of the inputs' spread: the A blocks keep their inverses
    # (a zero trace marks them not valid in gather). tr(A) - s R |mean row|^2 is the spread.
    total = jnp.sum(tr_a)
    spread = total - a.scale * a.rows.shape[0] * jnp.sum(mean_row * mean_row)
    tr_a = jnp.where(spread <= _ONE_ROW_TOLERANCE * total, jnp.zeros_like(tr_a), tr_a)
  finite = jnp.all(jnp.isfinite(tr_a)) & jnp.all(jnp.isfinite(tr_g))
  d_a, d_g = damping_lib.split_damping(tr_a, dim_a, tr_g, spec.g.dim, sqrt_damping,
                                       cfg.damping.pi_damping, cfg.damping.max_pi)
  return layer_base.LayerFactors(a, g, tr_a, tr_g, d_a, d_g, finite)


def _real_counts(slot: blocks.FactorSlot) -> np.ndarray:
  """``(num_blocks,)`` number of true (unpadded) dimensions per block."""
  starts = np.arange(slot.blocks_per_copy) * slot.block
  return np.tile(np.clip(slot.dim - starts, 0, slot.block).astype(np.float32), slot.copies)


def _per_block(value: jax.Array, slot: blocks.FactorSlot) -> jax.Array:
  """A layer's scalar, or a stack's ``(C,)`` / ``(C, blocks_per_copy)`` values, per block."""
  if jnp.ndim(value) == 1 and slot.copies > 1 and value.shape[0] == slot.copies:
    return jnp.repeat(value, slot.blocks_per_copy)
  return value.reshape(-1) if jnp.ndim(value) > 1 else value


def gather(layout: blocks.BlockLayout, factors: dict[str, layer_base.LayerFactors],
           dtype: jnp.dtype, min_relative_damping: Any,
           num_replicas: int = 1) -> dict[str, StackInputs]:
  """Per block stack: damped traces, damping and validity of every block, and factor rows.

  Each block's damping is at least ``min_relative_damping`` times its mean eigenvalue over the
  dimensions its rows can span (``damping.floored``): a block of ``d`` dimensions formed from
  ``R`` rows (``num_replicas`` times a replica's) has at most ``min(R, d)`` nonzero
  eigenvalues, so its trace is shared among those.

  A block is valid if its statistics are finite (all of its layer's) and resolvable next to its
  damping (``damping.resolvable``: not vanishing, not near-singular); an ``A`` whose rows are
  one row repeated has zero traces here (:func:`layer_factors`). Invalid blocks keep their
  inverses."""
  trace = {g: jnp.zeros((n,), dtype) for g, (_, n) in layout.groups.items()}
  damping = {g: jnp.ones((n,), dtype) for g, (_, n) in layout.groups.items()}
  valid = {g: jnp.zeros((n,), bool) for g, (_, n) in layout.groups.items()}
  rows = {g: {} for g in layout.groups}
  for spec in layout.layers:
    if spec.name not in factors:
      continue
    f = factors[spec.name]
    for slot, r, tr, d in ((spec.a, f.a, f.a_traces, f.d_a), (spec.g, f.g, f.g_traces, f.d_g)):
      if slot is None:
        continue
      tr, d, finite = (_per_block(v, slot) for v in (tr, d, f.finite))
      real = jnp.asarray(_real_counts(slot), dtype)
      spanned = jnp.minimum(real, num_replicas * r.rows.shape[-2])
      d = damping_lib.floored(d, tr, spanned, min_relative_damping)
      # A block whose statistics vanish next to its damping (an all-zero batch, units that
      # did not fire) says nothing of its curvature, and one that is near-singular once damped
      # cannot be inverted: either keeps the inverse it has, like a non-finite one.
      finite = finite & damping_lib.resolvable(tr, d, real)
      damped = jnp.where(finite, tr + d * real, 0.0)
      g, span = slot.group, slice(slot.start, slot.stop)
      trace[g] = trace[g].at[span].set(damped)
      damping[g] = damping[g].at[span].set(d)
      valid[g] = valid[g].at[span].set(finite)
      rows[g][slot] = r
  slots = {g: tuple(sorted((s for spec in layout.layers for s in spec.slots if s.group == g),
                          key=lambda s: s.start)) for g in layout.groups}
  return {g: StackInputs(trace[g], damping[g], valid[g], rows[g], slots[g])
          for g in layout.groups}


def refresh_stack(group: str, stack: dict, inputs: StackInputs, layout: blocks.BlockLayout,
                  cfg: Any, invert_now: jax.Array, count: jax.Array) -> tuple[dict, Any, Any]:
  """One block stack at a check step: ``(new stack, (n,) refreshed, (n,) trace change)``."""
  method = cfg.group_method(group)
  b, n = layout.groups[group]
  record = stack["record"]
  choice = cfg.policy.select(inputs.trace, record.trace_ref, stack.get("policy"), inputs.valid,
                             count)
  num_replicas = replicas.replica_count(cfg.axis_name)  # rows behind a factor: every replica's
  from_rows = {slot: replicas.gather_rows(r, cfg.axis_name) for slot, r in inputs.rows.items()
               if method.from_rows(slot, num_replicas * r.rows.shape[-2],
                                   "rows" in cfg.accumulator.provides)}
  row_mask = np.zeros((n,), bool)
  for slot in from_rows:
    row_mask[slot.start:slot.stop] = True
  new = dict(stack)
  inverse, refreshed, factor_set = stack["inverse"], jnp.zeros((n,), bool), None
  policy_state = choice.state
  if method.rank == 0 and not row_mask.all():  # some blocks are inverted from covariances
    never = record.trace_ref <= 0
    selected = choice.refresh & ~jnp.asarray(row_mask)
    cov = covariances(inputs, from_rows, selected, b, record.trace_ref.dtype, cfg)
    accumulated = stack.get("accumulator")
    update, policy_state = cfg.policy.confirm(
        selected, cov, getattr(accumulated, "factor", None), never, choice.state, count)
    # Static: blocks whose rows make them well conditioned take the new covariance as they
    # take it at their first refresh (accumulators/running_average.py, rows_ratio).
    replaced = np.zeros((n,), bool)
    for slot, r in inputs.rows.items():
      replaced[slot.start:slot.stop] = cfg.accumulator.replaces(
          num_replicas * r.rows.shape[-2], min(slot.dim, b))
    acc = cfg.accumulator.accumulate(cov, update, never | jnp.asarray(replaced), accumulated,
                                     invert_now)
    real = jnp.asarray(layout.real_dims(group), record.trace_ref.dtype)
    inverse, refreshed = blocks.masked_block_update(
        acc.invert, inverse, lambda idx: method.refresh_covariance(
            jnp.take(acc.source, idx, axis=0), inputs.damping[idx], real[idx],
            cfg.block_sharding), cfg.num_buckets, batched=cfg.block_sharding is not None)
    if acc.state is not None:
      new["accumulator"] = cfg.accumulator.after_inversion(acc.state, refreshed)
    factor_set = acc.factor_set
  for slot, rows in from_rows.items():
    inverse, refreshed = refresh_from_rows(method, slot, rows, inverse, refreshed,
                                           choice.refresh, inputs, layout, cfg)
  factor_set = refreshed if factor_set is None else factor_set
  new["inverse"] = inverse
  new["record"] = BlockRecord(jnp.where(factor_set, inputs.trace, record.trace_ref),
                              record.refreshes + refreshed.astype(jnp.int32))
  if policy_state is not None:
    new["policy"] = policy_state
  return new, refreshed, choice.ratio


# A factor whose covariance blocks all together cost fewer FLOPs than this is multiplied out
# whole when any of its blocks is due (one budget): each budget is a branch that XLA compiles.
_WHOLE_COVARIANCE_FLOPS = 1 << 27


def covariances(inputs: StackInputs, from_rows: dict, selected: jax.Array, b: int,
                dtype: jnp.dtype, cfg: Any) -> jax.Array:
  """``(n, b, b)`` covariance blocks of the stack: the selected blocks of every factor with
  statistics (not inverted from rows) multiplied out, zeros elsewhere, averaged across replicas
  (``cfg.axis_name``); skipped blocks cost nothing (``blocks.masked_block_update``)."""
  parts = []
  for slot in inputs.slots:
    zeros = jnp.zeros((slot.num_blocks, b, b), dtype)
    if slot not in inputs.rows or slot in from_rows:
      parts.append(zeros)
      continue
    r = inputs.rows[slot]
    # Batched on every platform: in a loop, the rows (an im2col of a convolution) would be
    # laid out in memory, where each budget's branch fuses their layout into its GEMM.
    flops = 2 * r.rows.shape[-2] * slot.num_blocks * b * b
    cov, _ = blocks.masked_block_update(
        selected[slot.start:slot.stop], zeros,
        lambda idx, r=r, slot=slot: (blocks.block_covariances(r.rows, r.scale, slot, idx),
                                     jnp.ones(idx.shape, bool)),
        cfg.num_buckets if flops >= _WHOLE_COVARIANCE_FLOPS else 1, batched=True)
    parts.append(cov)
  return replicas.mean(jnp.concatenate(parts, axis=0), cfg.axis_name)


def refresh_from_rows(method: Any, slot: blocks.FactorSlot, rows: Any, inverse: Any,
                      refreshed: jax.Array, selected: jax.Array, inputs: StackInputs,
                      layout: blocks.BlockLayout, cfg: Any) -> tuple[Any, jax.Array]:
  """The selected blocks of one factor inverted from its rows (Woodbury, low-rank form)."""
  span = slice(slot.start, slot.stop)
  dtype = inputs.damping.dtype
  real = jnp.asarray(layout.real_dims(slot.group)[span], dtype)
  damping = inputs.damping[span]
  part, done = blocks.masked_block_update(
      selected[span], jax.tree.map(lambda v: v[span], inverse),
      lambda idx: method.refresh_rows(rows, slot, idx, damping[idx], real[idx],
                                      cfg.block_sharding), cfg.num_buckets,
      batched=cfg.block_sharding is not None)
  inverse = jax.tree.map(lambda v, p: v.at[span].set(p), inverse, part)
  return inverse, refreshed.at[span].set(done)


def layer_diagnostics(specs: list, old: dict, stacks: dict, refreshed: dict, ratio: dict,
                      valid: dict, policy: Any) -> dict[str, LayerDiagnostics]:
  """The diagnostics of the layers ``specs`` after a check step, each summed over the layer's
  factor blocks (``valid``: per block stack, the blocks whose statistics were accepted).

  One segment sum (and one segment max) per block stack gives every layer's values at once:
  summed layer by layer, slot by slot, the small slices and sums were kernels that XLA
  compiled one by one, 0.9 s of the MNIST MLP's check-step compile on a 2-core CPU."""
  num = len(specs)
  counts = jnp.zeros((num, 4), jnp.int32)
  ratios = None
  for group, done in refreshed.items():
    n = done.shape[0]
    ids = np.full((n,), num)  # blocks of no layer here go to a dropped segment
    for i, spec in enumerate(specs):
      for s in spec.slots:
        if s.group == group:
          ids[s.start:s.stop] = i
    per_block = jnp.stack([done, stacks[group]["record"].refreshes,
                           policy.frozen(stacks[group].get("policy"), n), ~valid[group]],
                          axis=1).astype(jnp.int32)
    counts = counts + jax.ops.segment_sum(per_block, ids, num + 1)[:num]
    top = jax.ops.segment_max(ratio[group], ids, num + 1)[:num]
    ratios = top if ratios is None else jnp.maximum(ratios, top)
  return {spec.name: LayerDiagnostics(
      blocks_refreshed=counts[i, 0], num_blocks=old[spec.name].num_blocks,
      total_refreshes=counts[i, 1], frozen_blocks=counts[i, 2], trace_ratio=ratios[i],
      rejected_blocks=counts[i, 3]) for i, spec in enumerate(specs)}


def statistics_by_layer(curvature_stats: Any, layout: blocks.BlockLayout,
                        masked: frozenset[str]) -> dict[str, Any]:
  """The statistics of a check step by layer name, validated against the gradient tree.

  Statistics of modules that ``optax.masked`` / ``optax.partition`` hid from this transform
  (``masked``) are dropped: the whole model's statistics may be passed to every member.

  Statistics of a stack of layers (``nn.scan``) come with the stack axes first; they are
  flattened to one leading axis, ``(copies, ...)``.

  Raises:
    ValueError: if the statistics hold no layer at all while the gradients have layers (unless
      the capture listed why it could take none: then a warning, and no layer is refreshed),
      name a layer that no registered kind claimed in the gradients, or lack a stack's axes.
  Warns:
    UserWarning: naming each layer of the gradients without statistics (with the capture's
      reason, e.g. a shared layer), which keeps the inverses it has, and each
      captured-but-unsupported module, whose gradients pass through as they are.
  """
  by_name = {spec.name for spec in layout.layers}
  flat = stats_lib.flatten_layer_stats(curvature_stats)
  reasons = dict(note.split(": ", 1) for note in getattr(curvature_stats, "unhandled", ())
                 if ": " in note)
  if not flat and by_name and reasons:  # a capture that could precondition none of the layers
    warnings.warn(
        "curvature_stats: the capture preconditions none of the model's layers, so this "
        "optimizer is its base one (the gradients pass through the curvature unchanged): "
        + "; ".join(f"{name}: {why}" for name, why in sorted(reasons.items())), stacklevel=5)
    return {}
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
    kinds = {spec.name: spec.kind.name for spec in layout.layers}
    raise ValueError(
        f"curvature_stats has statistics for {unknown}, which match no layer in the gradients "
        f"(layers and their kinds: {kinds}). Were they captured from a different model? Capture "
        "them from the model whose gradients you pass (inside optax.masked / optax.partition, "
        "layers of the other partitions are ignored). A layer whose parameter shapes do not "
        "show how the model applies it (an nn.Einsum kernel) needs the capture's layout: "
        "layers=thor_optax.captured_layers(stats).")
  flat = {name: (layout.layer(name).flat_stack(layer) if layout.layer(name).stack else layer)
          for name, layer in flat.items()}
  silent = {name: why for name, why in reasons.items()
            if name not in by_name and name not in masked}
  missing = {name: reasons.get(name, "no statistics were passed for it")
             for name in sorted(by_name - set(flat) - masked)}
  if missing or silent:
    notes = "; ".join(f"{name}: {why}" for name, why in {**missing, **silent}.items())
    kept, passed = sorted(missing), sorted(silent)
    warnings.warn(
        f"curvature_stats: no statistics for some layers ({notes}). "
        + (f"{kept} keep the inverses they have (the identity until a check step gives them "
           "statistics): their blocks are not refreshed at this step. " if kept else "")
        + (f"{passed} are not preconditioned: their gradients pass through as they are. "
           if passed else "")
        + "To train a layer with another optimizer, use optax.partition.", stacklevel=5)
  return flat
