"""Einsum layers ``y = einsum(equation, x, kernel) (+ bias)``: ``nn.Einsum`` and ``nnx.Einsum``.

An equation that is a matrix product of the input by the kernel at every position is a dense
layer: its letters fall into positions ``P`` (input and output, not the kernel; the first is the
example axis), contracted axes ``C`` (input and kernel) and output features ``F`` (kernel and
output). The kernel, its axes permuted to ``(C..., F...)``, is the ``(d_in, d_out)`` matrix;
the input, permuted to ``(P..., C...)``, gives the rows of ``A`` and the output cotangents,
permuted to ``(P..., F...)``, those of ``G``: the factors are :mod:`dense`'s. Gemma's query
projection ``'BTD,NDH->BTNH'`` has ``C = D`` and ``F = (N, H)``.

Other equations are listed with the reason: kernel axes that are also positions (a kernel per
head, ``'BTNH,NHD->BTND'``), axes summed out of the input or the kernel alone, an ``einsum_str``
given at call time (not visible to the capture's plan), or an ellipsis in the kernel.

Shapes alone cannot say which kernel axes are contracted, so an einsum kernel is laid out only
from the capture's statistics: give the optimizer ``layers=thor_optax.captured_layers(stats)``
(the first check step otherwise raises, saying so).

References:
  Martens & Grosse, K-FAC, ICML 2015, section 3 (dense factors).
  Eschenhagen et al., NeurIPS 2023 (K-FAC-expand/reduce over the positions sharing a weight).
"""

from __future__ import annotations

import dataclasses
import math
import string
from typing import Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src.layers import base
from thor_optax._src.layers import dense


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EinsumStats:
  """Statistics of one einsum layer, flattened to a dense layer's.

  Attributes:
    inputs: ``(N, P..., d_in)``: the input with its contracted axes moved last (in the
      kernel's order) and flattened.
    cotangents: ``(S, N, P..., d_out)``: per-loss-term output cotangents, positions in the
      input's order, output features (in the kernel's order) flattened last.
    kernel_perm: the kernel's axes in ``(contracted..., features...)`` order (static).
    in_axes: the number of contracted axes (static).
    bias_perm: the bias's axes (the output features in the output's order) in the kernel's
      order (static).
    num_terms: the ``M`` loss terms ``A`` divides by when the leading axis is not them (static):
      rows that do not regroup to ``M`` (a graph network's nodes under a per-graph loss, a
      language model whose loss drops the last position, an ensemble member's share of the
      terms); ``None`` (default): the leading axis.

  Source: Martens & Grosse, K-FAC, ICML 2015 (dense ``a`` and ``g``); Eschenhagen et al.,
  NeurIPS 2023 (positions sharing the kernel); the permutations are this project's.
  """

  inputs: jax.Array
  cotangents: jax.Array
  kernel_perm: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  in_axes: int = dataclasses.field(default=1, metadata=dict(static=True))
  bias_perm: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  num_terms: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))


def parse(equation: str, in_ndim: int, kernel_ndim: int) -> tuple[Optional[dict], str]:
  """``(meta, '')`` for an equation that is a matrix product per position, else
  ``(None, reason)``. ``meta``: ``x_perm`` (input axes to ``(P..., C...)``), ``y_perm``
  (output axes to ``(P..., F...)``), ``kernel_perm``, ``in_axes``, ``bias_perm``."""
  equation = equation.replace(" ", "")
  if equation.count("->") != 1 or equation.count(",") != 1:
    return None, f"einsum {equation!r} is not 'input,kernel->output'"
  lhs, out = equation.split("->")
  x, k = lhs.split(",")
  if "..." in k:
    return None, f"einsum {equation!r} has an ellipsis in the kernel"
  if "..." in x:
    fill = "".join(c for c in string.ascii_letters if c not in equation)
    fill = fill[:in_ndim - (len(x) - 3)]
    x, out = x.replace("...", fill), out.replace("...", fill)
  if len(x) != in_ndim or len(k) != kernel_ndim:
    return None, f"einsum {equation!r} does not fit a rank-{in_ndim} input"
  shared = [c for c in k if c in x and c in out]
  if shared:
    return None, (f"einsum {equation!r}: kernel axes {''.join(shared)} are also positions (a "
                  "kernel per index); register a layer kind for it")
  summed = [c for c in k + x if c not in out and (c not in k or c not in x)]
  if summed:
    return None, f"einsum {equation!r} sums axes {''.join(summed)} of one operand alone"
  positions = [c for c in x if c not in k]
  if not positions or positions[0] != x[0]:
    return None, f"einsum {equation!r} contracts the example axis (the input's first)"
  contracted = [c for c in k if c in x]
  features = [c for c in k if c in out]
  out_features = [c for c in out if c in k]
  return dict(x_perm=tuple(x.index(c) for c in positions + contracted),
              y_perm=tuple(out.index(c) for c in positions + features),
              kernel_perm=tuple(k.index(c) for c in contracted + features),
              in_axes=len(contracted),
              bias_perm=tuple(out_features.index(c) for c in features)), ""


def flattened(inputs: jax.Array, cotangents: jax.Array, x_perm: tuple[int, ...],
              y_perm: tuple[int, ...], in_axes: int) -> tuple[jax.Array, jax.Array]:
  """``(inputs (N, P..., d_in), cotangents (S, N, P..., d_out))`` of a matrix product per
  position: the input's axes permuted by ``x_perm`` to ``(P..., C...)`` and its ``in_axes``
  contracted ones flattened last; the cotangents' (after their leading ``S``) by ``y_perm`` to
  ``(P..., F...)`` and the features flattened last."""
  x = jnp.transpose(inputs, x_perm)
  keep = x.shape[:x.ndim - in_axes]
  g = jnp.transpose(cotangents, (0,) + tuple(1 + p for p in y_perm))
  return x.reshape(keep + (-1,)), g.reshape(g.shape[:1] + keep + (-1,))


class Einsum(dense.Dense):
  """The ``'einsum'`` kind: ``nn.Einsum`` / ``nnx.Einsum`` (and their subclasses) whose
  ``einsum_str`` is a matrix product of the input by the ``kernel`` at every position, with an
  optional ``bias`` over the output features.

  As a matrix the kernel, its axes permuted to ``(C..., F...)`` (contracted, then output
  features), is ``(prod(C) (+1), prod(F))`` (a bias row last); the factors are
  :class:`~thor_optax._src.layers.dense.Dense`'s over the flattened ``C`` and ``F`` axes, the
  other input axes being positions (module docstring). Statistics: :class:`EinsumStats`. It
  claims no kernel from parameter shapes alone (they do not say which axes are contracted):
  pass ``layers=thor_optax.captured_layers(stats)``.

  Listed in ``CurvatureStats.unhandled`` instead of captured: an ``einsum_str`` given at call
  time, an equation that is not ``'input,kernel->output'`` or does not fit the input's rank,
  an ellipsis in the kernel, kernel axes that are also positions, axes summed out of one
  operand alone, a contraction over the example axis, and, as for
  :class:`~thor_optax._src.layers.dense.Dense`, several calls or loop iterations the capture
  cannot fold and a subclass overriding ``__call__`` or ``param``.

  Raises:
    ValueError: at a check step, naming the layer, for statistics that are not
      :class:`EinsumStats`, not floating point, whose inputs' last axis is not ``prod(C)`` or
      whose cotangents are not ``(S, N, ..., prod(F))`` with the inputs' ``N``.

  Source: Martens & Grosse, K-FAC, ICML 2015 (the factors); Eschenhagen et al., NeurIPS 2023
  (K-FAC-expand and -reduce over the positions sharing the kernel).
  """

  name = "einsum"
  stats_type = EinsumStats
  linen_modules = (nn.Einsum,)
  nnx_modules = (nnx.Einsum,)
  he_rescaled = False

  def plan(self, module, methods, input_shape) -> base.Plan:
    del methods
    if module.einsum_str is None:
      return base.Plan(None, "einsum_str given at call time; set it on the module so the "
                       "capture can read the equation")
    shape = module.kernel_shape if isinstance(module, nnx.Module) else module.shape
    meta, reason = parse(module.einsum_str, len(input_shape), len(tuple(shape)))
    return base.Plan(meta, reason)

  def make_stats(self, inputs, cotangents, *, x_perm, y_perm, kernel_perm, in_axes,
                 bias_perm) -> EinsumStats:
    """Inputs to ``(P..., C...)`` and cotangents to ``(S, P..., F...)``, flattened last."""
    x, g = flattened(inputs, cotangents, x_perm, y_perm, in_axes)
    return EinsumStats(inputs=x, cotangents=g, kernel_perm=kernel_perm, in_axes=in_axes,
                       bias_perm=bias_perm)

  def output_positions(self, meta, out_ndim):
    """The output axes of the equation's positions ``P`` after the example axis."""
    del out_ndim
    return tuple(meta["y_perm"][1:len(meta["x_perm"]) - meta["in_axes"]])

  def hint(self, stats: EinsumStats) -> tuple:
    return (stats.kernel_perm, stats.in_axes, stats.bias_perm)

  def claim(self, path, shapes) -> Optional[base.Claim]:
    """Never from shapes alone (which kernel axes are contracted is in the equation)."""
    del path, shapes
    return None

  def claim_captured(self, path, shapes, hint) -> Optional[base.Claim]:
    del path
    kernel_perm, in_axes, bias_perm = hint[:3]
    weight, bias_name = self.leaf_names(hint)
    kernel, bias = shapes.get(weight), shapes.get(bias_name)
    if kernel is None or len(kernel) != len(kernel_perm) or set(shapes) - {weight, bias_name}:
      return None
    permuted = tuple(kernel[i] for i in kernel_perm)
    features = permuted[in_axes:]
    if bias is not None and tuple(bias[i] for i in bias_perm) != features:
      return None
    return base.Claim(a_dim=math.prod(permuted[:in_axes]) + int(bias is not None),
                      g_dim=math.prod(features), in_axes=in_axes)

  def matrix_dims(self, spec: base.LayerSpec) -> tuple[int, int]:
    kernel_perm, in_axes = spec.hint[:2]
    permuted = [spec.kernel_shape[i] for i in kernel_perm]
    return math.prod(permuted[:in_axes]), math.prod(permuted[in_axes:])

  def to_matrix(self, spec, leaves, dtype) -> jax.Array:
    kernel_perm, _, bias_perm = spec.hint[:3]
    weight, bias_name = self.leaf_names(spec.hint)
    x = jnp.transpose(leaves[weight], kernel_perm).reshape(spec.d_in, spec.d_out)
    x = x.astype(dtype)
    if spec.has_bias:
      bias = jnp.transpose(leaves[bias_name], bias_perm).reshape(1, -1)
      x = jnp.concatenate([x, bias.astype(dtype)], axis=0)
    return x

  def from_matrix(self, spec, matrix, leaves) -> dict[str, jax.Array]:
    kernel_perm, in_axes, bias_perm = spec.hint[:3]
    weight, bias_name = self.leaf_names(spec.hint)
    permuted = tuple(spec.kernel_shape[i] for i in kernel_perm)
    kernel = jnp.transpose(matrix[:spec.d_in].reshape(permuted), np.argsort(kernel_perm))
    out = {weight: kernel.astype(leaves[weight].dtype)}
    if spec.has_bias:
      features = permuted[in_axes:]
      bias = matrix[spec.d_in].reshape(features)
      out[bias_name] = jnp.transpose(bias, np.argsort(bias_perm)).astype(
          leaves[bias_name].dtype)
    return out

  def check_stats(self, spec, stats) -> None:
    base.LayerKind.check_stats(self, spec, stats)
    dense.check_cotangents(spec, stats)
    dense.check_inputs(spec, stats, spec.d_in)
