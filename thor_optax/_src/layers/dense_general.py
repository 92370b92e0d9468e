"""General dense layers over several axes: ``nn.DenseGeneral`` and ``nnx.LinearGeneral``.

The query, key, value and output projections of ``nn.MultiHeadDotProductAttention`` and
``nnx.MultiHeadAttention`` are such layers: a query kernel ``(d, H, h)`` maps the last input
axis to ``H`` heads of ``h`` features, the output kernel ``(H, h, d)`` contracts the two last
input axes. As a matrix the kernel is ``(d_in, d_out)`` with ``d_in`` the product of the
contracted input axes (its leading ``in_axes`` axes) and ``d_out`` that of the output feature
axes (its other axes), both in the kernel's row-major order: the layer is then a dense layer,
and its factors are :mod:`dense`'s,

    A = (1/M) sum_{n,t} a_{n,t} a_{n,t}^T,   G = (1/(N T)) sum_{s,n,t} g_{s,n,t} g_{s,n,t}^T,

with ``a`` the contracted input axes flattened (a ones entry for a bias shaped like the output
axes) and ``g`` the output feature axes flattened, over the ``T`` positions (every other input
axis, e.g. the sequence) that share the kernel; ``M`` loss terms (K-FAC-expand).

Shapes alone do not tell a kernel without bias ``(d, H, h)`` from a stack of ``d`` dense
kernels ``(H, h)``: a layout from parameter shapes claims a kernel as this kind only when a
bias shaped like its trailing axes sits beside it. The capture records ``in_axes`` in the
statistics (:attr:`DenseGeneralStats.in_axes`), and ``layers=thor_optax.captured_layers(stats)``
lays out bias-less kernels exactly.

Not captured (listed with the reason): ``batch_dims`` / ``batch_axis`` (a kernel per batch
index), and a contraction over the example axis 0.

References:
  Martens & Grosse, K-FAC, ICML 2015, section 3 (dense factors).
  Eschenhagen et al., "Kronecker-Factored Approximate Curvature for Modern Neural Network
  Architectures", NeurIPS 2023 (K-FAC-expand over the positions sharing a weight).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

from thor_optax._src.layers import base
from thor_optax._src.layers import dense


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseGeneralStats:
  """Statistics of one ``DenseGeneral`` / ``LinearGeneral`` layer, flattened to a dense layer's.

  Attributes:
    inputs: ``(N, ..., d_in)``: the layer input with its contracted axes moved last (in the
      kernel's order) and flattened; the other axes are examples and positions.
    cotangents: ``(S, N, ..., d_out)``: per-loss-term output cotangents with the output
      feature axes flattened (see :class:`thor_optax.DenseStats`).
    in_axes: number of contracted input axes, the kernel's leading axes (static).
    out_axes: number of output feature axes, the kernel's trailing axes (static).
    num_terms: the ``M`` loss terms ``A`` divides by when the leading axis is not them (static):
      rows that do not regroup to ``M`` (a graph network's nodes under a per-graph loss, a
      language model whose loss drops the last position, an ensemble member's share of the
      terms); ``None`` (default): the leading axis.

  Source: Martens & Grosse, K-FAC, ICML 2015 (dense ``a`` and ``g``); Eschenhagen et al.,
  NeurIPS 2023 (the other input axes as positions sharing the kernel); the flattening is this
  project's.
  """

  inputs: jax.Array
  cotangents: jax.Array
  in_axes: int = dataclasses.field(default=1, metadata=dict(static=True))
  out_axes: int = dataclasses.field(default=1, metadata=dict(static=True))
  num_terms: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))


def _axes(axes, ndim: int) -> tuple[int, ...]:
  """Flax's canonical form of an ``axis`` argument: a sorted tuple, negatives wrapped (Flax's
  ``_normalize_axes`` sorts them, so ``axis=(-1, -2)`` builds the kernel ``(in[-2], in[-1],
  ...)``: the input rows must be flattened in that order)."""
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(sorted(int(a) % ndim for a in axes))


class DenseGeneral(dense.Dense):
  """The ``'dense_general'`` kind: ``nn.DenseGeneral`` / ``nnx.LinearGeneral`` (and their
  subclasses), a ``kernel`` ``(contracted..., features...)`` with an optional ``bias``
  ``(features...)``.

  As a matrix the kernel is ``(d_in (+1), d_out)``, ``d_in`` the product of its ``in_axes``
  contracted axes and ``d_out`` that of its feature axes (a bias row last); the factors are
  :class:`~thor_optax._src.layers.dense.Dense`'s over those flattened axes, every other input
  axis being a position (module docstring). Statistics: :class:`DenseGeneralStats`. From
  parameter shapes it claims only a kernel of rank >= 3 beside a bias equal to its trailing
  axes; a kernel without bias needs ``layers=thor_optax.captured_layers(stats)``.

  Listed in ``CurvatureStats.unhandled`` instead of captured: ``batch_dims`` / ``batch_axis``
  (a kernel per batch index), an ``axis`` that contracts the example axis 0, and, as for
  :class:`~thor_optax._src.layers.dense.Dense`, several calls or loop iterations the capture
  cannot fold and a subclass overriding ``__call__`` or ``param``.

  Raises:
    ValueError: at a check step, naming the layer, for statistics that are not
      :class:`DenseGeneralStats`, not floating point, whose inputs' last axis is not ``d_in``
      or whose cotangents are not ``(S, N, ..., d_out)`` with the inputs' ``N``.

  Source: Martens & Grosse, K-FAC, ICML 2015 (the factors); Eschenhagen et al., NeurIPS 2023
  (K-FAC-expand and -reduce over the positions sharing the kernel).
  """

  name = "dense_general"
  stats_type = DenseGeneralStats
  linen_modules = (nn.DenseGeneral,)
  nnx_modules = (nnx.LinearGeneral,)
  he_rescaled = False  # SP-NGD's sqrt(2 d_out) cap reads d_out from the last axis only

  def plan(self, module, methods, input_shape) -> base.Plan:
    del methods
    ndim = len(input_shape)
    if isinstance(module, nnx.Module):
      batch, features = dict(module.batch_axis), module.out_features
    else:
      batch, features = module.batch_dims, module.features
    if batch:
      return base.Plan(None, "batch_dims / batch_axis (a kernel per batch index) are not "
                       "supported; register a layer kind for it (thor_optax.register_layer_kind)")
    axis = _axes(module.axis, ndim)
    if 0 in axis:
      return base.Plan(None, f"axis={module.axis} contracts the example axis 0 of its rank-"
                       f"{ndim} input; only axes after the examples can be contracted")
    out_axes = 1 if isinstance(features, int) else len(tuple(features))
    return base.Plan(dict(axis=axis, out_axes=out_axes))

  def make_stats(self, inputs, cotangents, *, axis: tuple[int, ...],
                 out_axes: int) -> DenseGeneralStats:
    """Contracted axes moved last and flattened; output feature axes flattened."""
    moved = jnp.moveaxis(inputs, axis, tuple(range(inputs.ndim - len(axis), inputs.ndim)))
    keep = moved.shape[:inputs.ndim - len(axis)]
    g_keep = cotangents.shape[:cotangents.ndim - out_axes]
    return DenseGeneralStats(
        inputs=moved.reshape(keep + (-1,)),
        cotangents=cotangents.reshape(g_keep + (-1,)),
        in_axes=len(axis), out_axes=out_axes)

  def output_positions(self, meta, out_ndim):
    """The axes between the examples and the ``out_axes`` output feature axes."""
    return tuple(range(1, out_ndim - meta["out_axes"]))

  def claim(self, path: tuple[str, ...],
            shapes: Mapping[str, tuple[int, ...]]) -> Optional[base.Claim]:
    """From shapes alone: a kernel of rank >= 3 whose trailing axes a bias repeats."""
    del path
    kernel, bias = shapes.get("kernel"), shapes.get("bias")
    if kernel is None or bias is None or len(kernel) < 3 or set(shapes) != {"kernel", "bias"}:
      return None
    if not 0 < len(bias) < len(kernel) or tuple(kernel[len(kernel) - len(bias):]) != bias:
      return None
    return self._claim(kernel, len(kernel) - len(bias), True)

  def claim_captured(self, path, shapes, hint) -> Optional[base.Claim]:
    """With the capture's ``(in_axes, out_axes)``: any kernel of that rank, bias or not."""
    del path
    in_axes, out_axes = hint
    kernel = shapes.get("kernel")
    if kernel is None or len(kernel) != in_axes + out_axes:
      return None
    bias = shapes.get("bias")
    if bias is not None and bias != tuple(kernel[in_axes:]):
      return None
    return self._claim(kernel, in_axes, bias is not None)

  def hint(self, stats: DenseGeneralStats) -> tuple:
    return (stats.in_axes, stats.out_axes)

  @staticmethod
  def _claim(kernel: tuple[int, ...], in_axes: int, has_bias: bool) -> base.Claim:
    return base.Claim(a_dim=math.prod(kernel[:in_axes]) + int(has_bias),
                      g_dim=math.prod(kernel[in_axes:]), in_axes=in_axes)

  def check_stats(self, spec, stats) -> None:
    base.LayerKind.check_stats(self, spec, stats)
    dense.check_cotangents(spec, stats)
    dense.check_inputs(spec, stats, spec.d_in)
