"""Dense layers ``y = x @ kernel (+ bias)``: Flax ``nn.Dense`` and ``nnx.Linear``.

Factors (Martens & Grosse 2015, eq. 1; K-FAC-expand over positions, Eschenhagen et al. 2023):
for inputs ``(N, ..., d_in)`` whose middle axes are ``T`` positions sharing the weights and a
mean loss of ``M`` terms,

    A = (1/M) sum_{n,t} a_{n,t} a_{n,t}^T,   G = (1/(N T)) sum_{s,n,t} g_{s,n,t} g_{s,n,t}^T,

with a ones column appended to ``a`` for the bias and ``g`` the cotangents of one loss term.
``M = N`` (a loss per example) is KFC's convolution rule (Grosse & Martens 2016); ``M = N T`` (a
loss per position, language modelling) gives exactly the curvature of the batch flattened to
``(N T, d_in)``. The capture regroups the example axis to ``M`` (:meth:`Dense.per_loss_term`),
so the factors read ``M`` from the statistics' leading axis. The kernel gradient is already the
``(d_in, d_out)`` matrix (bias row appended).

References:
  Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate Curvature",
  ICML 2015, section 3.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

from thor_optax._src.layers import base


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseStats:
  """Statistics of one dense layer ``y = x @ kernel (+ bias)``.

  Attributes:
    inputs: layer input ``a``, shape ``(N, ..., d_in)``; axis 0 indexes examples, any further
      leading axes are positions that share the weights.
    cotangents: output cotangents of one loss term ``g = M dL/dy`` (``M`` loss terms), shape
      ``(S, N, ..., d_out)``, where ``S`` is the number of cotangent samples (1 for the
      empirical Fisher). ``G`` sums over ``S`` and averages over examples and positions;
      ``A`` divides by ``N``, the leading axis, which the capture makes the number of loss
      terms (a per-position loss: ``(N T, 1, d)``), or by ``num_terms``.
    num_terms: the ``M`` loss terms ``A`` divides by when the leading axis is not them (static):
      rows that do not regroup to ``M`` (a graph network's nodes under a per-graph loss, a
      language model whose loss drops the last position, an ensemble member's share of the
      terms); ``None`` (default): the leading axis.

  Source: Martens & Grosse, K-FAC, ICML 2015 (``a``, ``g`` and ``A = E[a a^T]``,
  ``G = E[g g^T]``); Eschenhagen et al., NeurIPS 2023 (positions sharing the weight, ``M``
  loss terms: K-FAC-expand and -reduce).
  """

  inputs: jax.Array
  cotangents: jax.Array
  num_terms: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))


def join_positions(arrays: list[jax.Array], example_axis: int) -> jax.Array:
  """Arrays ``(..., N, P_i..., d)`` (``N`` on ``example_axis``) joined along one positions axis,
  ``(..., N, sum_i prod(P_i), d)``."""
  return jnp.concatenate(
      [x.reshape(x.shape[:example_axis + 1] + (-1, x.shape[-1])) for x in arrays],
      axis=example_axis + 1)


def with_ones(rows: jax.Array) -> jax.Array:
  """``(R, d)`` rows with a ones column appended (the bias input)."""
  return jnp.concatenate([rows, jnp.ones_like(rows[:, :1])], axis=1)


def check_cotangents(spec: base.LayerSpec, stats) -> None:
  """Raises ``ValueError`` naming the layer unless cotangents are ``(S, N, ..., d_out)``
  floating-point values."""
  g = stats.cotangents
  _check_float(spec, "cotangents", g)
  if g.ndim < 2 or g.shape[-1] != spec.d_out:
    raise ValueError(
        f"{where(spec)}: cotangents must have shape (S, N, ..., {spec.d_out}), got {g.shape}.")


def check_inputs(spec: base.LayerSpec, stats, c_in: int) -> None:
  """Raises ``ValueError`` naming the layer unless inputs are ``(N, ..., c_in)`` floating-point
  values with the cotangents' ``N``."""
  a, g = stats.inputs, stats.cotangents
  _check_float(spec, "inputs", a)
  if a.shape[-1] != c_in:
    raise ValueError(f"{where(spec)}: inputs have trailing dimension {a.shape[-1]}, expected "
                     f"{c_in}.")
  if g.shape[1] != a.shape[0]:
    raise ValueError(
        f"{where(spec)}: cotangents have {g.shape[1]} examples on axis 1, inputs {a.shape[0]} "
        "on axis 0.")


def _check_float(spec: base.LayerSpec, field: str, x: jax.Array) -> None:
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    raise ValueError(
        f"{where(spec)}: {field} have dtype {x.dtype}; the curvature is formed from "
        "floating-point statistics. Pass the statistics as value_and_grad_with_stats returns "
        "them (not cast to integers).")


def where(spec: base.LayerSpec) -> str:
  """The start of an error message about a layer's statistics."""
  return (f"the statistics (curvature_stats or gradient_stats) for layer {spec.name!r} "
          f"({spec.kind.weight} shape {spec.kernel_shape})")


class Dense(base.LayerKind):
  """The ``'dense'`` kind: ``nn.Dense`` / ``nnx.Linear`` (and their subclasses).

  The weight is a rank-2 ``kernel`` ``(d_in, d_out)`` with an optional ``bias`` ``(d_out,)``; as
  the matrix the factors act on it is the kernel with a bias as an extra last row,
  ``(d_in (+1), d_out)``. ``A`` sums ``a a^T`` over the ``N T`` input rows (a ones column for
  the bias) divided by the ``M`` loss terms, ``G`` averages ``g g^T`` over examples and
  positions, summed over the ``S`` cotangent samples (module docstring). Statistics:
  :class:`DenseStats`; several calls of one layer in a forward pass join as positions
  (:meth:`make_shared_stats`), as do a recurrent cell's iterations (K-FAC-reduce). From
  parameter shapes it claims any rank-2 ``kernel`` whose ``bias``, if any, is ``(d_out,)``.

  Listed in ``CurvatureStats.unhandled`` instead of captured: a call on a 1-D input (a model
  for one example, ``vmap``-ped over the batch), several calls or loop iterations the capture
  cannot fold (inside a lifted transform, on different numbers of examples, a stacked layer,
  ``weight_sharing='expand'`` over a loop), and a subclass overriding ``__call__`` or
  ``param``.

  Raises:
    ValueError: at a check step (:meth:`check_stats`), naming the layer, for statistics that
      are not :class:`DenseStats`, not floating point, whose inputs' last axis is not
      ``d_in`` or whose cotangents are not ``(S, N, ..., d_out)`` with the inputs' ``N``.

  Source: Martens & Grosse, K-FAC, ICML 2015 (the factors); Grosse & Martens, ICML 2016 and
  Eschenhagen et al., NeurIPS 2023 (positions sharing the weight).
  """

  name = "dense"
  stats_type = DenseStats
  example_axes = {"inputs": 0, "cotangents": 1}
  linen_modules = (nn.Dense,)
  nnx_modules = (nnx.Linear,)
  he_rescaled = True
  shares_weights = True
  reduces_steps = True
  gradient_from_rows = True

  def plan(self, module, methods, input_shape) -> base.Plan:
    """Captured when the input has an example axis: ``(N, ..., d_in)``. A 1-D input is one
    example (a per-example model under ``jax.vmap`` / ``nnx.vmap`` over the batch): listed,
    since its rows would have no example axis."""
    del module, methods
    if len(input_shape) < 2:
      return base.Plan(None, f"dense input of shape {tuple(input_shape)} has no batch axis (a "
                             "model written for one example and vmapped over the batch: call "
                             "it on the batch instead)")
    return base.Plan(meta={})

  def make_shared_stats(self, methods, inputs, cotangents, **meta):
    """Every call's positions side by side: inputs ``(N, P_1 + P_2 + ..., d_in)``,
    cotangents ``(S, N, P_1 + P_2 + ..., d_out)``."""
    del methods
    parts = [self.make_stats(x, g, **meta) for x, g in zip(inputs, cotangents)]
    return dataclasses.replace(
        parts[0], inputs=join_positions([p.inputs for p in parts], 0),
        cotangents=join_positions([p.cotangents for p in parts], 1))

  def claim(self, path: tuple[str, ...],
            shapes: Mapping[str, tuple[int, ...]]) -> Optional[base.Claim]:
    del path
    kernel = shapes.get("kernel")
    if kernel is None or len(kernel) != 2 or not base.bias_fits(shapes, kernel[-1:]):
      return None
    has_bias = shapes.get("bias") == (kernel[-1],)
    return base.Claim(a_dim=kernel[0] + int(has_bias), g_dim=kernel[1])

  def check_stats(self, spec, stats) -> None:
    super().check_stats(spec, stats)
    check_cotangents(spec, stats)
    check_inputs(spec, stats, spec.kernel_shape[0])

  def output_positions(self, meta, out_ndim):
    """Every axis between the examples and the output features ``(N, P..., d_out)``."""
    del meta
    return tuple(range(1, out_ndim - 1))

  def per_loss_term(self, stats, num_terms, weight_sharing):
    inputs, cotangents, divisor = base.fold_positions(stats.inputs, stats.cotangents,
                                                      num_terms, 1, weight_sharing)
    return dataclasses.replace(stats, inputs=inputs, cotangents=cotangents, num_terms=divisor)

  def input_rows(self, spec, stats, dtype, *, sampling=None, key=None) -> base.FactorRows:
    """``(N T, d_in (+1))`` rows with scale ``1 / M``: ``M`` the loss terms, the leading axis
    after :meth:`per_loss_term` or the statistics' ``num_terms``."""
    del sampling, key
    x = stats.inputs
    rows = x.reshape(-1, x.shape[-1]).astype(dtype)
    if spec.has_bias:
      rows = with_ones(rows)
    return base.FactorRows(rows, jnp.asarray(1.0 / base.a_divisor(stats, x.shape[0]), dtype))
