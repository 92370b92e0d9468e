"""Data parallelism under ``jax.pmap``: every replica refreshes the curvature of the whole batch.

Under ``jax.pmap(train_step, axis_name='batch')`` (or ``jax.shard_map`` over a mesh axis, or a
named ``jax.vmap``) each replica captures the statistics of its own shard of the batch. The user
averages the gradients (``jax.lax.pmean(grads, 'batch')``); the curvature must be averaged too,
or every replica preconditions the common gradient with its own shard's curvature and the
replicas' parameters drift apart. With ``axis_name`` a check step averages what the curvature
is built from, once, where it is formed (``check_step.py``):

* the block traces of every factor (``(num_blocks,)``, so the trace rule, SP-NGD's adaptive
  refresh, the pi damping and the validity of a block are decided identically everywhere) and an
  embedding's diagonal ``A`` (``(vocab,)``): ``jax.lax.pmean``;
* the covariance blocks ``(n, b, b)`` of a block stack: ``jax.lax.pmean`` (KAISA's factor
  all-reduce);
* the rows ``(R, d)`` behind a factor inverted from its rows (Woodbury, low-rank form): gathered
  with ``jax.lax.all_gather(..., tiled=True)`` into the ``(D R, d)`` rows of the whole batch,
  their scale divided by the number of replicas ``D``; the choice between rows and covariances
  (``inverse_method='auto'``) and ``woodbury_rows`` see those ``D R`` rows;
* side curvature without block factors (a normalization layer's ``(C, 2, 2)`` unit-wise Fisher,
  ``LayerKind.side_statistics``): ``jax.lax.pmean``.

Each replica's factors are averages over its ``N`` examples (per-example cotangents, see
``value_and_grad_with_stats``), and every replica has the same ``N`` (``pmap`` maps equal
shards), so the mean over replicas is the factor of the whole batch of ``D N`` examples: a
replica's step equals one device's step on the concatenated batch, up to the order of floating
point sums. The damping and the inversions then run on identical inputs on every replica.

Without ``axis_name``, a check step inside a named axis raises a ``ValueError`` (see
:func:`check_axis`); ``axis_name=()`` keeps each replica's own curvature deliberately.

References:
  Pauloski et al., "KAISA: An Adaptive Second-Order Optimizer Framework for Deep Neural
  Networks", SC 2021 (each worker computes the factors of its local batch; the factors are
  all-reduced, so every worker holds the same ones before the inversions are distributed).
  Osawa et al., "Scalable and Practical Natural Gradient for Large-Scale Deep Learning", TPAMI
  2020, distributed implementation (each process forms the Kronecker factors and unit-wise
  Fisher of its local mini-batch; they are reduced across the data-parallel processes).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import jax

from thor_optax._src.layers import base as layer_base

AxisName = Union[str, tuple[str, ...]]


def names(axis_name: Optional[AxisName]) -> tuple[str, ...]:
  """The mapped axes to average over: ``()`` for ``None`` or ``()``."""
  if axis_name is None:
    return ()
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def validate(axis_name: Any) -> Optional[AxisName]:
  """``axis_name`` as given, after checking its type.

  Raises:
    ValueError: unless it is ``None``, a string or a tuple of strings.
  """
  if axis_name is None or isinstance(axis_name, str):
    return axis_name
  if isinstance(axis_name, tuple) and all(isinstance(n, str) for n in axis_name):
    return axis_name
  raise ValueError(
      f"axis_name must be None, the name of the mapped axis (a str, e.g. 'batch' as in "
      f"jax.pmap(..., axis_name='batch')) or a tuple of names, got {axis_name!r}.")


def _bound_axis_names() -> Optional[list]:
  """The named axes bound where this is traced, or ``None`` if JAX offers no way to ask.

  JAX has no public query for this; ``jax.extend.core`` exposes its internal one under a name
  that warns against use. It is used defensively: if it ever disappears, the check is skipped.
  """
  try:
    from jax.extend import core as jex_core  # pylint: disable=import-outside-toplevel
    query = getattr(jex_core, "unsafe_get_axis_names_DO_NOT_USE", None)
    if query is None:
      from jax._src import core  # pylint: disable=import-outside-toplevel
      query = core.unsafe_get_axis_names
    return list(query())
  except Exception:  # pylint: disable=broad-except
    return None


def check_axis(axis_name: Optional[AxisName],
               step: str = "the check step (update with curvature_stats)") -> None:
  """Checks, while a step that averages across replicas is traced (``step``, for the message:
  a check step, or a plain step from the rows), that ``axis_name`` fits the mapped axes
  around it.

  Raises:
    ValueError: if ``axis_name`` is ``None`` but the step runs inside a named axis (``jax.pmap``,
      which always binds one, ``jax.shard_map``, a ``jax.vmap`` with ``axis_name``): the
      replicas would precondition with their own shards' curvature and drift apart; or if
      ``axis_name`` names an axis that is not bound here.
  """
  if axis_name is None:
    bound = _bound_axis_names()
    if bound:
      named = [n for n in bound if not str(n).startswith("_")]
      hint = (f"axis_name={named[0]!r}" if len(named) == 1 else
              f"axis_name={tuple(named)!r}" if named else
              "axis_name='batch' and name the pmap's axis: jax.pmap(..., axis_name='batch')")
      raise ValueError(
          f"thor_optax: a check step (update with curvature_stats) runs inside the mapped axes "
          f"{bound} (jax.pmap, jax.shard_map or a named jax.vmap), but the optimizer was built "
          "without axis_name: every replica would invert the curvature of its own shard of "
          "the batch, and the replicas' parameters would drift apart. Pass "
          f"{hint} to the optimizer (e.g. thor_optax.thor(..., {hint.split(' and ')[0]})) to "
          "average the curvature statistics across replicas, as the gradients are with "
          "jax.lax.pmean; or axis_name=() to keep each replica's own curvature on purpose.")
    return
  for name in names(axis_name):
    try:
      jax.lax.axis_size(name)
    except NameError:
      bound = _bound_axis_names()
      raise ValueError(
          f"thor_optax: the optimizer was built with axis_name={axis_name!r}, but no mapped "
          f"axis {name!r} is bound where {step} runs"
          + (f" (bound: {bound})" if bound is not None else "") +
          f". Run it inside jax.pmap(..., axis_name={name!r}) (or "
          f"jax.shard_map over a mesh axis {name!r}); on one device, or under jax.jit with "
          "sharded arrays (where the compiler reduces the statistics itself), build the "
          "optimizer without axis_name.") from None


def replica_count(axis_name: Optional[AxisName]) -> int:
  """``D``, the number of replicas along the axes (1 without any)."""
  return math.prod(jax.lax.axis_size(n) for n in names(axis_name))


def mean(tree: Any, axis_name: Optional[AxisName]) -> Any:
  """``tree``'s arrays averaged across the replicas (``jax.lax.pmean``); unchanged without axes."""
  axes = names(axis_name)
  return jax.lax.pmean(tree, axes) if axes and tree is not None else tree


def gather_rows(rows: layer_base.FactorRows,
                axis_name: Optional[AxisName]) -> layer_base.FactorRows:
  """The rows of the whole batch behind a factor: ``(D R, d)`` from every replica's ``(R, d)``
  (``(C, D R, d)`` from ``(C, R, d)`` for a stack of ``C`` layers).

  ``scale rows^T rows`` of the result is the mean of the replicas' factors (the scale is divided
  by ``D``): the factor of the whole batch. Unchanged without axes.
  """
  axes = names(axis_name)
  if not axes:
    return rows
  everyone = jax.lax.all_gather(rows.rows, axes, axis=rows.rows.ndim - 2, tiled=True)
  return layer_base.FactorRows(everyone, rows.scale / replica_count(axis_name))


def fold_in(key: Optional[jax.Array], axis_name: Optional[AxisName]) -> Optional[jax.Array]:
  """A PRNG key of this replica (random conv subsampling draws other positions on each one)."""
  axes = names(axis_name)
  if key is None or not axes:
    return key
  return jax.random.fold_in(key, jax.lax.axis_index(axes))
