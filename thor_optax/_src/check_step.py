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

import collections.abc
import dataclasses
import math
import warnings
from typing import Any, NamedTuple, Optional

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src import blocks
from thor_optax._src import damping as damping_lib
from thor_optax._src import explicit
from thor_optax._src import finite as finite_lib
from thor_optax._src import layers as layers_lib
from thor_optax._src import replicas
from thor_optax._src import stats as stats_lib
from thor_optax._src.layers import base as layer_base


class BlockRecord(NamedTuple):
  """What every block stack records, whatever its pieces.

  Attributes:
    trace_ref: ``(n,)`` damped trace of each block at its last factor refresh (0: never).
    refreshes: ``(n,)`` int32, inversions of each block so far.
    damping_ref: ``(n,)`` ``lambda`` at each block's last factor refresh (0: never), so that
      ``trace_ref`` can be judged at a later ``lambda`` (``damping.collapsed``).
  """

  trace_ref: jax.Array
  refreshes: jax.Array
  damping_ref: jax.Array


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
      batch), one row repeated (``A``), near-singular once damped (``damping.resolvable``), or
      collapsed to under 10% of their damped trace at the block's last refresh (a reference
      halved at each such rejection; ``damping.collapsed``: a batch the model fits almost
      exactly).
      A check step whose statistics are not finite is skipped whole by the aliases' guard.
  """

  blocks_refreshed: jax.Array
  num_blocks: jax.Array
  total_refreshes: jax.Array
  frozen_blocks: jax.Array
  trace_ratio: jax.Array
  rejected_blocks: jax.Array


# The integer fields of LayerDiagnostics, in the order of Diagnostics.counts' last axis.
_COUNTS = ("blocks_refreshed", "total_refreshes", "frozen_blocks", "rejected_blocks")


@struct.dataclass
class Diagnostics(collections.abc.Mapping):
  """The per-layer record of a ``KroneckerState``, read as ``{layer path: LayerDiagnostics}``.

  Stored as three arrays over the layers, in ``names`` order, so that a check step writes
  them in a few kernels: one scalar leaf per layer and field was one kernel each for XLA to
  compile (15 of the MNIST MLP's check step, 35 of a small ResNet's). A ``flax.struct``
  dataclass: a pytree (keys ``counts``, ``num_blocks``, ``trace_ratio``) that Flax's
  serialization and orbax store like any other.

  Attributes:
    names: the layer paths (static: part of the pytree's structure).
    counts: ``(L, 4)`` int32: per layer ``blocks_refreshed``, ``total_refreshes``,
      ``frozen_blocks``, ``rejected_blocks`` (see :class:`LayerDiagnostics`).
    num_blocks: ``(L,)`` int32, each layer's number of factor blocks.
    trace_ratio: ``(L,)``, each layer's largest trace ratio at its last check.

  ``diagnostics[name]`` is that layer's :class:`LayerDiagnostics`; leading axes (a state of
  ``jax.pmap``, one per device) are kept: ``counts[..., i, k]``.

  Raises:
    KeyError: naming the layer and the layers there are, for a layer path not in ``names``.

  Source: ours; the trace ratio is that of THOR's trace rule (Chen et al., AAAI 2021).
  """

  names: tuple[str, ...] = struct.field(pytree_node=False)
  counts: Any
  num_blocks: Any
  trace_ratio: Any

  @classmethod
  def zeros(cls, num_blocks: dict[str, int], dtype: jnp.dtype) -> "Diagnostics":
    """No check yet, for the layers ``{path: number of factor blocks}``."""
    names = tuple(num_blocks)
    return cls(names, jnp.zeros((len(names), len(_COUNTS)), jnp.int32),
               jnp.asarray([num_blocks[n] for n in names], jnp.int32).reshape(len(names)),
               jnp.zeros((len(names),), dtype))

  def __getitem__(self, name: str) -> "LayerDiagnostics":
    if name not in self.names:
      raise KeyError(f"no diagnostics for layer {name!r}; the layers are {list(self.names)}")
    i = self.names.index(name)
    fields = {f: self.counts[..., i, k] for k, f in enumerate(_COUNTS)}
    return LayerDiagnostics(num_blocks=self.num_blocks[..., i],
                            trace_ratio=self.trace_ratio[..., i], **fields)

  def __iter__(self):
    return iter(self.names)

  def __len__(self) -> int:
    return len(self.names)


class StackInputs(NamedTuple):
  """A block stack's inputs at a check step.

  Attributes:
    trace: ``(n,)`` damped trace of every block (0 where no valid statistics).
    damping: ``(n,)`` damping added to every block (1 where none).
    valid: ``(n,)`` bool, blocks with finite statistics at this check, resolvable next to their
      damping (``damping.resolvable``) and not collapsed since their last refresh
      (``damping.collapsed``, applied by :func:`without_collapsed`).
    rows: ``{slot: FactorRows}`` of the factors in the stack that have statistics.
    slots: every factor slot of the stack, in block order.
    forms: ``{slot: () -> rows}`` of the factors whose rows are formed where they are used
      (``LayerFactors.form_a``, ``form_g``; :func:`formed`).
  """

  trace: jax.Array
  damping: jax.Array
  valid: jax.Array
  rows: dict
  slots: tuple
  forms: dict


def check_step(state: Any, layout: blocks.BlockLayout, curvature_stats: Any, lam: jax.Array,
               cfg: Any, masked: stats_lib.MaskedModules = stats_lib.MaskedModules()
               ) -> tuple[Any, jax.Array]:
  """One check step on a ``KroneckerState``: refresh the blocks due, side curvature and
  diagnostics (``lam``: ``lambda`` at this step; ``masked``: modules ``optax.masked`` hid).

  Returns ``(new state, finite)``: ``finite``, a bool scalar, says whether the statistics the
  step read are finite: every layer's factor traces (sums of squares of all its rows: finite
  exactly when the rows are, or overflowing) and the side curvature's statistics. Blocks and
  side curvature with non-finite statistics keep what they had either way."""
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
  stacks = dict(state.blocks)
  for group, i in inputs.items():
    inputs[group], record = without_collapsed(i, stacks[group]["record"], lam)
    stacks[group] = {**stacks[group], "record": record}
  invert_now = cfg.accumulator.inverts_now(state.accumulator, state.count)
  new_blocks, refreshed, ratio = {}, {}, {}
  for group in layout.groups:
    new_blocks[group], refreshed[group], ratio[group] = refresh_stack(
        group, stacks[group], inputs[group], layout, cfg, invert_now, state.count, lam)
  side, side_only = {}, []
  for spec in layout.layers:
    if spec.name in state.layers and spec.name in flat:
      side_inputs = factors[spec.name] if spec.name in factors else replicas.mean(
          side_statistics(spec, flat[spec.name], dtype), cfg.axis_name)
      if spec.name not in factors:
        side_only.append(side_inputs)
      side[spec.name] = side_refresh(spec, flat[spec.name], state.layers[spec.name],
                                     side_inputs, lam, cfg)
  finite = finite_lib.all_finite(side_only)
  for f in factors.values():
    finite = finite & jnp.all(f.finite)
  diagnostics = layer_diagnostics(
      [spec for spec in layout.layers if spec.name in factors], state.diagnostics, new_blocks,
      refreshed, ratio, {g: i.valid for g, i in inputs.items()}, cfg.policy)
  return state._replace(
      blocks=new_blocks, layers={**state.layers, **side}, diagnostics=diagnostics,
      accumulator=cfg.accumulator.update_global(state.accumulator, invert_now, state.count)
  ), finite


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
  with jax.ensure_compile_time_eval():  # concrete under jit: the probe is a constant
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


def _sums(*vectors: jax.Array) -> tuple[jax.Array, ...]:
  """The sums of equally long ``(n,)`` vectors, in one (variadic) reduction."""
  zero = jnp.zeros((), vectors[0].dtype)
  return jax.lax.reduce(vectors, (zero,) * len(vectors),
                        lambda u, v: tuple(x + y for x, y in zip(u, v)), (0,))


def _rows(rows: layer_base.FactorRows) -> int:
  """The number of rows behind a factor (per copy)."""
  return rows.rows.shape[-2]


def layer_factors(spec: layer_base.LayerSpec, stats: Any, dtype: jnp.dtype, cfg: Any,
                  key: Any, sqrt_damping: jax.Array, deferred: bool = True
                  ) -> layer_base.LayerFactors:
  """A Kronecker-factored layer's factor rows (or diagonal ``A``), damping and validity; for a
  stack of layers, every field has the stack (flattened) on a leading axis.

  The rows are this replica's; traces and a diagonal ``A`` are averaged across replicas
  (``cfg.axis_name``), so the damping and validity are those of the whole batch. With
  ``deferred`` (not under the ``vmap`` of a stack) the rows are formed again in the branches
  that multiply them out (``LayerFactors.form_a``, ``form_g``), and ``A``'s traces come from
  its kind's ``input_moments`` where it has them (a convolution's patches are never formed
  for the traces alone)."""
  if spec.stack:
    one = spec.one_layer()
    return jax.vmap(lambda s: layer_factors(one, s, dtype, cfg, key, sqrt_damping,
                                            deferred=False))(stats)
  spec.kind.check_stats(spec, stats)
  kw = dict(sampling=cfg.sampling, key=key)
  g = spec.kind.cotangent_rows(spec, stats, dtype, **kw)
  a = spec.kind.input_rows(spec, stats, dtype, **kw)
  moments = None if spec.a is None else spec.kind.input_moments(spec, stats, dtype,
                                                                sampling=cfg.sampling)
  form_a = form_g = None
  if deferred:
    if isinstance(a, layer_base.FactorRows):
      form_a = lambda: spec.kind.input_rows(spec, stats, dtype, **kw).rows  # pylint: disable=unnecessary-lambda-assignment
    form_g = lambda: spec.kind.cotangent_rows(spec, stats, dtype, **kw).rows  # pylint: disable=unnecessary-lambda-assignment
  num_replicas = replicas.replica_count(cfg.axis_name)  # rows behind a factor: every replica's
  for slot, which, r in ((spec.a, "A", a), (spec.g, "G", g)):
    if slot is not None:
      cfg.group_method(slot.group).check_rows(spec.name, which, slot,
                                              num_replicas * r.rows.shape[0])
  tr_g = blocks.block_traces(g.rows, g.scale, spec.g)
  # Rows that are all one row (an all-zero batch behind a bias, one example repeated) give a
  # rank-one A that says nothing of the inputs' spread: the A blocks keep their inverses (a
  # zero trace marks them not valid in gather). tr(A) - s R |mean row|^2 is the spread.
  mean_row = None
  if spec.a is not None:
    squares, sums = moments or (None, None)
    tr_a, dim_a = blocks.block_traces(a.rows, a.scale, spec.a, squares), spec.a.dim
    if num_replicas * _rows(a) > 1:  # every replica's rows: one device's batch
      mean_row = jnp.mean(a.rows, axis=-2) if sums is None else sums / _rows(a)
  else:  # a diagonal A: its values
    tr_a, dim_a = jnp.sum(a, keepdims=True), a.shape[0]
    a = replicas.mean(a, cfg.axis_name)
  tr_a, tr_g, mean_row = replicas.mean((tr_a, tr_g, mean_row), cfg.axis_name)
  # One variadic reduction gives the layer's sums, its operands zero-padded to one length: on
  # XLA:CPU each sum was a kernel of its own, and two for a long one (the mean row's d_A).
  parts = [tr_a, jnp.concatenate([tr_a, tr_g.astype(tr_a.dtype)])]
  if mean_row is not None:  # s R |mean row|^2, per copy
    scale = jnp.asarray(a.scale, tr_a.dtype)[..., None] * _rows(a)
    parts.append((scale * jnp.square(mean_row)).reshape(-1))
  length = max(p.shape[0] for p in parts)
  total, everything, *mean_total = _sums(*(jnp.pad(p, (0, length - p.shape[0])) for p in parts))
  # Traces are sums of squares: their sum is finite exactly when every trace is (or it
  # overflows, which rejects the statistics too).
  finite = jnp.isfinite(everything)
  if mean_row is not None:
    spread = total - mean_total[0]
    tr_a = jnp.where(spread <= _ONE_ROW_TOLERANCE * total, jnp.zeros_like(tr_a), tr_a)
  d_a, d_g = damping_lib.split_damping(tr_a, dim_a, tr_g, spec.g.dim, sqrt_damping,
                                       cfg.damping.pi_damping, cfg.damping.max_pi)
  return layer_base.LayerFactors(a, g, tr_a, tr_g, d_a, d_g, finite, form_a, form_g)


def _real_counts(slot: blocks.FactorSlot) -> np.ndarray:
  """``(num_blocks,)`` number of true (unpadded) dimensions per block."""
  starts = np.arange(slot.blocks_per_copy) * slot.block
  return np.tile(np.clip(slot.dim - starts, 0, slot.block).astype(np.float32), slot.copies)


def _per_block(value: jax.Array, slot: blocks.FactorSlot) -> jax.Array:
  """A layer's scalar, or a stack's ``(C,)`` / ``(C, blocks_per_copy)`` values, as
  ``(num_blocks,)``."""
  value = jnp.asarray(value)
  if value.ndim == 1 and slot.copies > 1 and value.shape[0] == slot.copies:
    value = jnp.repeat(value, slot.blocks_per_copy)
  return jnp.broadcast_to(value.reshape(-1) if value.ndim > 1 else value, (slot.num_blocks,))


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
  inverses; blocks of no layer with statistics have trace 0, damping 1 and are not valid.

  The layers' values are concatenated in block order and the floor, the validity and the
  damped traces computed once per stack: computed slot by slot and scattered into the stack,
  they were a handful of small kernels per factor, each compiled on its own by XLA."""
  parts = {g: [] for g in layout.groups}
  forms = {g: {} for g in layout.groups}
  for spec in layout.layers:
    if spec.name not in factors:
      continue
    f = factors[spec.name]
    for slot, form in ((spec.a, f.form_a), (spec.g, f.form_g)):
      if form is not None:
        forms[slot.group][slot] = form
    for slot, r, tr, d in ((spec.a, f.a, f.a_traces, f.d_a), (spec.g, f.g, f.g_traces, f.d_g)):
      if slot is not None:
        parts[slot.group].append((slot, r, tr, d, f.finite))
  out = {}
  for group, (_, n) in layout.groups.items():
    tr, d, ok, real, spanned = _stack_values(parts[group], n, dtype, num_replicas)
    real_dims = jnp.asarray(real, dtype)
    d = damping_lib.floored(d, tr, jnp.asarray(spanned, dtype), min_relative_damping)
    # A block whose statistics vanish next to its damping (an all-zero batch, units that did
    # not fire) says nothing of its curvature, and one that is near-singular once damped
    # cannot be inverted: either keeps the inverse it has, like a non-finite one.
    ok = ok & damping_lib.resolvable(tr, d, real_dims)
    slots = tuple(sorted((s for spec in layout.layers for s in spec.slots if s.group == group),
                         key=lambda s: s.start))
    out[group] = StackInputs(jnp.where(ok, tr + d * real_dims, 0.0), d, ok,
                             {p[0]: p[1] for p in parts[group]}, slots, forms[group])
  return out


def without_collapsed(inputs: StackInputs, record: BlockRecord, lam: jax.Array
                      ) -> tuple[StackInputs, BlockRecord]:
  """A stack's inputs with the blocks whose statistics collapsed since their last refresh
  (``damping.collapsed``) marked not valid, so that they keep their inverses, and its record
  with those blocks' reference traces lowered by ``damping.COLLAPSE_DECAY``: statistics that
  stay low are taken after a few checks."""
  gone = damping_lib.collapsed(inputs.trace, record.trace_ref, lam, record.damping_ref)
  record = record._replace(trace_ref=jnp.where(gone, damping_lib.COLLAPSE_DECAY, 1.0)
                           * record.trace_ref)
  return (inputs._replace(trace=jnp.where(gone, 0.0, inputs.trace), valid=inputs.valid & ~gone),
          record)


def _stack_values(parts: list, n: int, dtype: jnp.dtype, num_replicas: int) -> tuple:
  """One stack's ``(n,)`` traces, damping and finiteness, concatenated in block order from
  ``parts`` (``(slot, rows, traces, damping, finite)`` of the factors with statistics; trace 0,
  damping 1, not finite elsewhere), and its static ``(n,)`` true dimensions and dimensions
  spanned by the rows per block (numpy)."""
  real = np.zeros((n,), np.float32)
  spanned = np.ones((n,), np.float32)
  traces, damping, finite = [], [], []

  def fill(count):  # blocks of no layer with statistics
    if count > 0:
      traces.append(jnp.zeros((count,), dtype))
      damping.append(jnp.ones((count,), dtype))
      finite.append(jnp.zeros((count,), bool))

  position = 0
  for slot, r, tr, d, ok in sorted(parts, key=lambda p: p[0].start):
    fill(slot.start - position)
    real[slot.start:slot.stop] = _real_counts(slot)
    spanned[slot.start:slot.stop] = np.minimum(real[slot.start:slot.stop],
                                               num_replicas * r.rows.shape[-2])
    traces.append(_per_block(tr, slot).astype(dtype))
    damping.append(_per_block(d, slot).astype(dtype))
    finite.append(_per_block(ok, slot))
    position = slot.stop
  fill(n - position)
  return (*(jnp.concatenate(x) for x in (traces, damping, finite)), real, spanned)


def refresh_stack(group: str, stack: dict, inputs: StackInputs, layout: blocks.BlockLayout,
                  cfg: Any, invert_now: jax.Array, count: jax.Array,
                  lam: jax.Array) -> tuple[dict, Any, Any]:
  """One block stack at a check step (``lam``: ``lambda`` now): ``(new stack, (n,) refreshed,
  (n,) trace change)``."""
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
    # A stored factor newer than its inverse waits for a check that has its layer's statistics:
    # without them the block has no damping here (a layer left out of curvature_stats, its
    # statistics not finite or rejected), and it keeps the inverse it has, as promised.
    inverse, refreshed = blocks.masked_block_update(
        acc.invert & inputs.valid, inverse, lambda idx: method.refresh_covariance(
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
                              record.refreshes + refreshed.astype(jnp.int32),
                              jnp.where(factor_set, lam, record.damping_ref))
  if policy_state is not None:
    new["policy"] = policy_state
  return new, refreshed, choice.ratio


def formed(inputs: StackInputs, slot: blocks.FactorSlot) -> jax.Array:
  """A factor's rows, formed here where they can be (``StackInputs.forms``): called inside the
  branch that multiplies out the blocks due, the rows' construction runs only with it."""
  form = inputs.forms.get(slot)
  return inputs.rows[slot].rows if form is None else form()


# Factors whose covariance blocks all together cost fewer FLOPs than this are multiplied out
# whole, all in one branch per stack, when any of their blocks is due: each branch (each budget
# of a costlier factor) is code that XLA compiles.
_WHOLE_COVARIANCE_FLOPS = 1 << 27


def covariances(inputs: StackInputs, from_rows: dict, selected: jax.Array, b: int,
                dtype: jnp.dtype, cfg: Any) -> jax.Array:
  """``(n, b, b)`` covariance blocks of the stack: the selected blocks of every factor with
  statistics (not inverted from rows) multiplied out, zeros elsewhere, averaged across replicas
  (``cfg.axis_name``).

  Skipped blocks cost nothing: the costly factors' blocks due are multiplied out in the
  smallest budget that holds them (``blocks.masked_block_update``); the cheap factors, together
  under ``_WHOLE_COVARIANCE_FLOPS``, are multiplied out whole in one branch when any of their
  blocks is due."""
  whole, total = [], 0
  for slot in inputs.slots:
    if slot in inputs.rows and slot not in from_rows:
      flops = 2 * inputs.rows[slot].rows.shape[-2] * slot.num_blocks * b * b
      if total + flops < _WHOLE_COVARIANCE_FLOPS:
        whole.append(slot)
        total += flops
  in_whole = np.zeros(selected.shape, bool)
  for slot in whole:
    in_whole[slot.start:slot.stop] = True
  due_whole = selected & jnp.asarray(in_whole)

  def multiply_whole():
    return jnp.concatenate([
        blocks.block_covariances(formed(inputs, s), inputs.rows[s].scale, s,
                                 jnp.arange(s.num_blocks)).astype(dtype) for s in whole])

  cheap, offset = {}, 0
  if whole:  # one array: a zeros branch of one kernel, not one per factor
    covs = jax.lax.cond(jnp.any(due_whole), multiply_whole, lambda: jnp.zeros(
        (sum(s.num_blocks for s in whole), b, b), dtype))
    for s in whole:
      cheap[s], offset = covs[offset:offset + s.num_blocks], offset + s.num_blocks
  parts = []
  for slot in inputs.slots:
    if slot in cheap:
      parts.append(cheap[slot])
    elif slot in inputs.rows and slot not in from_rows:
      r = inputs.rows[slot]
      # Batched on every platform: in a loop, the rows (an im2col of a convolution) would be
      # laid out in memory, where each budget's branch fuses their layout into its GEMM.
      cov, _ = blocks.masked_block_update(
          selected[slot.start:slot.stop], jnp.zeros((slot.num_blocks, b, b), dtype),
          lambda idx, r=r, slot=slot: (blocks.block_covariances(formed(inputs, slot), r.scale,
                                                                slot, idx),
                                       jnp.ones(idx.shape, bool)),
          cfg.num_buckets, batched=True)
      parts.append(cov)
    else:
      parts.append(jnp.zeros((slot.num_blocks, b, b), dtype))
  cov = jnp.concatenate(parts, axis=0)
  if whole:  # the cheap factors' blocks that are not due: zeros
    keep = due_whole | ~jnp.asarray(in_whole)
    cov = jnp.where(keep[:, None, None], cov, jnp.zeros((), dtype))
  return replicas.mean(cov, cfg.axis_name)


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


def layer_diagnostics(specs: list, old: Diagnostics, stacks: dict, refreshed: dict,
                      ratio: dict, valid: dict, policy: Any) -> Diagnostics:
  """The diagnostics after a check step: those of the layers ``specs`` (the layers with
  statistics) summed over each layer's factor blocks, the others' as they were (``valid``:
  per block stack, the blocks whose statistics were accepted).

  Per block stack, one product with the static ``(L, n)`` matrix of which layer each block
  belongs to gives every layer's counts at once, and one reduction their largest trace
  ratios: summed layer by layer, slot by slot, the small slices and sums were kernels that
  XLA compiled one by one (0.9 s of the MNIST MLP's check-step compile on a 2-core CPU), and a
  segment sum and max were six. ``total_refreshes`` adds this check's refreshes to the old
  count."""
  num = len(old.names)
  index = {name: i for i, name in enumerate(old.names)}
  sums = jnp.zeros((num, 3), jnp.float32)  # blocks refreshed, frozen, rejected
  ratios = None
  for group, done in refreshed.items():
    n = done.shape[0]
    member = np.zeros((num, n), np.float32)
    for spec in specs:
      for s in spec.slots:
        if s.group == group:
          member[index[spec.name], s.start:s.stop] = 1.0
    per_block = jnp.stack([done, policy.frozen(stacks[group].get("policy"), n),
                           ~valid[group]], axis=1).astype(jnp.float32)
    # Counts of at most n blocks: exact in float32 at the highest precision.
    sums = sums + jnp.matmul(member, per_block, precision=jax.lax.Precision.HIGHEST)
    top = jnp.max(jnp.where(member > 0, ratio[group][None, :], -jnp.inf), axis=1)
    ratios = top if ratios is None else jnp.maximum(ratios, top)
  if ratios is None:
    return old
  sums = jnp.round(sums).astype(jnp.int32)
  counts = jnp.stack([sums[:, 0], old.counts[:, 1] + sums[:, 0], sums[:, 1], sums[:, 2]],
                     axis=1)
  checked = np.zeros((num,), bool)
  checked[[index[spec.name] for spec in specs]] = True
  return Diagnostics(
      old.names, jnp.where(checked[:, None], counts, old.counts), old.num_blocks,
      jnp.where(checked, ratios.astype(old.trace_ratio.dtype), old.trace_ratio))


def statistics_by_layer(curvature_stats: Any, layout: blocks.BlockLayout,
                        masked: stats_lib.MaskedModules) -> dict[str, Any]:
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
        "layers of the other partitions are ignored; with nnx.Optimizer(model, tx, wrt=...), "
        "pass the same wrt= to thor_optax.nnx.value_and_grad_with_stats). A layer whose "
        "parameter shapes do not show how the model applies it (an nn.Einsum kernel, a kernel "
        "applied transposed such as GPT-2's Conv1D) needs the "
        "capture's layout: layers=thor_optax.captured_layers(stats).")
  flat = {name: (layout.layer(name).flat_stack(layer) if layout.layer(name).stack else layer)
          for name, layer in flat.items()}
  silent = {name: why for name, why in reasons.items()
            if name not in by_name and name not in masked}
  missing = {name: reasons.get(name, "no statistics were passed for it")
             for name in sorted(by_name - set(flat)) if name not in masked}
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
