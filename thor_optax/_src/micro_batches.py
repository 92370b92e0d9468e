"""Statistics of micro-batches combined into those of the whole batch (gradient accumulation).

With ``optax.MultiSteps`` a batch of ``k n`` examples arrives as ``k`` micro-batches of ``n``;
``MultiSteps`` averages their gradients and calls the inner optimizer's ``update`` at every
micro-step, keeping its new state only at the ``k``-th (the emitted step). A preconditioner that
received statistics at every micro-step would therefore factorize ``k`` times and keep only the
last micro-batch's curvature. Instead, keep each micro-batch's statistics, join them with
:func:`concatenate_stats` and pass them once, at the emitted micro-step; the other micro-steps
call ``update`` without statistics (a plain step, no factorization).

The captured statistics are per example (a layer's inputs ``(N, ...)`` and its per-example output
cotangents ``(S, N, ...)``, ``N`` times those of a mean loss), so joining them along the example
axis gives exactly the statistics of the whole batch: the factors are the averages over all
``k n`` examples.

References:
  Martens & Grosse, K-FAC, ICML 2015, section 5 (factors as expectations over examples).
  optax ``MultiSteps`` (``optax/_src/wrappers.py``): the inner update runs every micro-step and
  its state is kept only when the step is emitted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from thor_optax._src import layers as layers_lib
from thor_optax._src import stats as stats_lib


def _join_layer(name: str, parts: list, depth: int = 0) -> stats_lib.LayerStats:
  """One layer's statistics from several micro-batches, joined along the example axis (after
  the ``depth`` leading axes of a stack of layers)."""
  kind = type(parts[0])
  if any(type(p) is not kind for p in parts):
    raise ValueError(f"concatenate_stats: layer {name!r} has statistics of different kinds "
                     f"{sorted({type(p).__name__ for p in parts})} across micro-batches.")
  axes = {key: axis + depth  # the layer kind's example axes, after a stack's
          for key, axis in layers_lib.kind_of_stats(parts[0]).example_axes.items()}
  static = {f.name: getattr(parts[0], f.name) for f in dataclasses.fields(kind)
            if f.name not in axes and f.name != "num_terms"}
  for i, part in enumerate(parts[1:], start=1):
    other = {key: getattr(part, key) for key in static}
    if other != static:
      raise ValueError(f"concatenate_stats: layer {name!r}: micro-batch {i} has metadata "
                       f"{other}, micro-batch 0 has {static}.")
    for key, axis in axes.items():
      if (getattr(parts[0], key) is None) != (getattr(part, key) is None):
        raise ValueError(f"concatenate_stats: layer {name!r}: {key} is None in one "
                         "micro-batch only.")
      if getattr(part, key) is None:  # an optional field (a tied embedding's), absent
        continue
      want, got = getattr(parts[0], key).shape, getattr(part, key).shape
      if want[:axis] + want[axis + 1:] != got[:axis] + got[axis + 1:]:
        raise ValueError(
            f"concatenate_stats: layer {name!r}: {key} of micro-batch {i} has shape {got}, "
            f"expected {want} up to axis {axis} (the examples).")
  arrays = {key: jnp.concatenate([getattr(p, key) for p in parts], axis=axis)
            for key, axis in axes.items() if getattr(parts[0], key) is not None}
  if any(getattr(p, "num_terms", None) for p in parts):  # loss terms other than the rows: add
    key, axis = next(iter(axes.items()))
    static["num_terms"] = sum(p.num_terms or getattr(p, key).shape[axis] for p in parts)
  return kind(**arrays, **static)


def concatenate_stats(*stats: stats_lib.CurvatureStats) -> stats_lib.CurvatureStats:
  """The statistics of a batch from those of its micro-batches.

  Args:
    *stats: one :class:`CurvatureStats` per micro-batch, all captured from the same model with
      the same Fisher type and ``loss_reduction``. Per layer, arrays are joined along the
      example axis: inputs ``(N_i, ...)`` -> ``(sum N_i, ...)``, cotangents and normalization
      gradients ``(S, N_i, ...)`` -> ``(S, sum N_i, ...)``.

  Returns:
    a :class:`CurvatureStats` equal to the statistics of the concatenated batch (factors average
    over all its examples); ``unhandled`` is the union of the micro-batches' notes,
    ``exact_rows`` the layers exact in every micro-batch and ``num_loss_terms`` their sum (the
    gradient of the micro-batches' mean loss is ``a^T g / sum M_i``) when ``exact_rows`` is
    not empty, else 1 (the transforms read it only for layers in ``exact_rows``). A layer's
    ``num_terms``, if any micro-batch sets it, becomes the sum of the micro-batches' terms.

  Raises:
    TypeError: if a list or tuple of statistics is passed as one argument, or an argument is
      not a tree of layer statistics (:func:`thor_optax._src.stats.flatten_layer_stats`).
    ValueError: if no statistics are given, the micro-batches' layers differ, or a layer's
      kind, static metadata or per-example shapes differ between micro-batches (the message
      names the layer path).

  Source: Martens & Grosse, K-FAC, ICML 2015 (the factors are expectations over examples, so
  joining the examples gives the batch's); optax ``MultiSteps`` (the micro-steps it calls
  ``update`` on).
  """
  if not stats:
    raise ValueError("concatenate_stats needs the statistics of at least one micro-batch.")
  if any(isinstance(s, (list, tuple)) for s in stats):
    raise TypeError("concatenate_stats takes each micro-batch's statistics as its own argument: "
                    "concatenate_stats(*stats_list), not concatenate_stats(stats_list).")
  flats = [stats_lib.flatten_layer_stats(s) for s in stats]
  names = list(flats[0])
  for i, flat in enumerate(flats[1:], start=1):
    if set(flat) != set(names):
      raise ValueError(
          f"concatenate_stats: micro-batch {i} has statistics for layers {sorted(flat)}, "
          f"micro-batch 0 for {sorted(names)}; capture every micro-batch from the same model.")
  whole = [s for s in stats if isinstance(s, stats_lib.CurvatureStats)]
  stacked = whole[0].stacked if whole else ()
  depths = dict(stacked)

  def join(path, *parts):
    name = stats_lib.layer_name(stats_lib.path_keys(path))
    return _join_layer(name, list(parts), depths.get(name, 0))

  layers = jax.tree_util.tree_map_with_path(
      join, *[s.layers if isinstance(s, stats_lib.CurvatureStats) else s for s in stats],
      is_leaf=stats_lib.is_layer_stats)
  notes = tuple(sorted({note for s in stats for note in getattr(s, "unhandled", ())}))
  exact = (set.intersection(*(set(s.exact_rows) for s in whole))
           if len(whole) == len(stats) else set())
  return stats_lib.CurvatureStats(
      layers=layers, unhandled=notes, exact_rows=tuple(sorted(exact)),
      num_loss_terms=sum(s.num_loss_terms for s in whole) if exact else 1, stacked=stacked)
