"""Normalization layers ``y = scale * x_hat + bias``: ``nn.BatchNorm``, ``nn.LayerNorm``,
``nn.GroupNorm``, ``nn.RMSNorm`` and NNX's (``nnx.BatchNorm``, ``nnx.LayerNorm``,
``nnx.GroupNorm``, ``nnx.RMSNorm``).

Their curvature is SP-NGD's unit-wise natural gradient: per channel ``c`` the 2x2 empirical
Fisher of ``(scale_c, bias_c)``, ``F_c = (1/M) sum_{s,m} [gs, gb]^T [gs, gb]`` from the
gradients of the ``M`` loss terms, ``gs = sum_t x_hat g``, ``gb = sum_t g`` over each term's
positions ``t`` (an example's for a loss per example, one token's for a loss per token:
:func:`per_term_grads`), damped by ``lambda`` and
inverted in closed form. It is side curvature (:class:`UnitwiseState`), refreshed at every check
step; nothing lives in the block stacks. Under data parallelism (``axis_name``) the Fisher of
each replica's examples is averaged across replicas before it is damped and inverted
(:meth:`Norm.side_statistics`).

Capture records ``x_hat`` (the input normalized, before scale and bias) instead of the raw
input (:attr:`Norm.normalized_input`), as the output of a copy of the layer without its affine
map (:meth:`Norm.unit_affine`); only scale and bias over the last axis are supported. What
``x_hat`` is, per module:

* ``BatchNorm``: ``(x - mean) / sqrt(var + eps)`` with the batch's statistics (training) or the
  running averages;
* ``LayerNorm``: the same over each example's ``reduction_axes``;
* ``GroupNorm``: the same over each group of ``C / num_groups`` channels (and the example's
  other ``reduction_axes``, by default all but the batch axis); its per-channel scale and bias
  act after the normalization, always over the last axis (channels last, the only layout Flax's
  ``GroupNorm`` has);
* ``RMSNorm``: ``x / sqrt(mean(x^2) + eps)`` over ``reduction_axes``; it has a scale and no bias.

A layer holds the leaves its class has and its ``use_scale`` / ``use_bias`` keep
(:meth:`Norm.affine_leaves`; ``RMSNorm`` has no ``use_bias``). The Fisher of a layer without a
bias (or scale) is built with zeros for the missing gradients (:meth:`Norm.side_statistics`),
so its damped inverse is ``diag(1 / (F_ss + lambda), 1 / lambda)`` and the scale's update is the
1x1 unit-wise natural gradient ``g_s / (F_ss + lambda)``.

References:
  Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020, section "Unit-wise
  natural gradient".
  Ioffe & Szegedy, "Batch Normalization", ICML 2015, section 3 (``y = scale * x_hat + bias``).
  Wu & He, "Group Normalization", ECCV 2018, eq. 1-3 (per-channel affine after group statistics).
  Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019, eq. 4 (scale only).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

from thor_optax._src import explicit
from thor_optax._src import linalg
from thor_optax._src.layers import base

_LEAVES = ("scale", "bias")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NormStats:
  """Per-loss-term gradients of a normalization layer's scale and bias (BatchNorm, LayerNorm,
  GroupNorm, RMSNorm).

  For ``y = scale * x_hat + bias`` over channels ``C`` (the last axis), the gradients are
  ``scale_grads[s, m] = sum_t x_hat[t] * g[s, t]`` and ``bias_grads[s, m] = sum_t g[s, t]``,
  summed over the positions ``t`` of loss term ``m`` (an example's for a loss per example, one
  token's for a loss per token: :func:`per_term_grads`), with ``g`` the per-term output
  cotangents (scaled like :class:`DenseStats` cotangents). A layer without a scale (or bias) has
  zeros there. The Fisher averages over the rows (:func:`unitwise_fisher`).

  Attributes:
    scale_grads: ``(S, N, C)``: ``N`` rows, the ``M`` loss terms (or rows scaled so that the
      mean over them is ``(1/M) sum`` over the terms, :func:`per_term_grads`).
    bias_grads: ``(S, N, C)``.

  Source: Osawa et al., SP-NGD, TPAMI 2020, section "Unit-wise Natural Gradient" (the
  per-channel Fisher of ``(scale_c, bias_c)`` from per-example gradients).
  """

  scale_grads: jax.Array
  bias_grads: jax.Array


class UnitwiseState(NamedTuple):
  """A normalization layer's unit-wise curvature in the optimizer state.

  Attributes:
    inverse: ``(C, 2, 2)`` damped inverse Fisher per channel (identity before the first check).
  """

  inverse: jax.Array


class StoredUnitwiseState(NamedTuple):
  """:class:`UnitwiseState` plus the accumulator's stored (running-average) Fisher.

  Attributes:
    inverse: as :class:`UnitwiseState`.
    fisher: ``(C, 2, 2)`` stored per-channel Fisher (zeros before the first check).
  """

  inverse: jax.Array
  fisher: jax.Array


def unitwise_fisher(scale_grads: jax.Array, bias_grads: jax.Array) -> jax.Array:
  """``(C, 2, 2)`` per-channel empirical Fisher, the mean over the ``N`` rows of ``(S, N, C)``
  per-term gradients (:func:`per_term_grads`)."""
  g = jnp.stack([scale_grads, bias_grads], axis=-1)  # (S, N, C, 2)
  return jnp.einsum("snci,sncj->cij", g, g,
                    out_sharding=explicit.contraction_sharding(g)) / g.shape[1]


def per_term_grads(grads: jax.Array, num_terms: int, weight_sharing: str) -> jax.Array:
  """``(S, K, C)`` gradient rows whose unit-wise Fisher (:func:`unitwise_fisher`, which divides
  by ``K``) is ``(1/M) sum`` over the ``M`` loss terms, from the per-position gradient
  contributions ``grads`` ``(S, N, P..., C)`` of ``N`` examples with positions ``P``.

  A loss term's gradient of a scale or bias is the sum of the contributions of its positions:

  * K-FAC-expand (``'auto'`` with more terms than examples: a loss per token): the ``N P``
    rows, examples major, summed in ``M`` consecutive groups when they split into them (``M =
    N T``: one position per term, so an LM's norm gets the per-token Fisher its dense layers
    get; ``M = N``: one example per term), else kept and scaled by ``sqrt(N P / M)`` (a loss
    that drops the last position);
  * K-FAC-reduce (``'auto'`` with at most as many terms as examples): each example's positions
    summed (SP-NGD's per-example gradients), the examples summed in ``M`` groups when they
    split into them (windows folded into the batch), else scaled by ``sqrt(N / M)``.

  For a loss per example (``M = N``) both give the per-example gradients. Before, the positions
  were always summed per example and divided by ``N``: for a loss per token that is ``T`` times
  the expanded Fisher (per-sequence sums of ``T`` per-token gradients).

  Source: Osawa et al., SP-NGD, TPAMI 2020 (per-example unit-wise Fisher); Eschenhagen et al.,
  NeurIPS 2023 (expand and reduce over the positions sharing a weight); the grouping is this
  project's, as :func:`~thor_optax._src.layers.base.regroup_examples`'.
  """
  s, n, c = grads.shape[0], grads.shape[1], grads.shape[-1]
  mode = base.resolve_weight_sharing(weight_sharing, num_terms, n)
  rows = grads.reshape(s, -1, c) if mode == "expand" else grads.reshape(s, n, -1, c).sum(2)
  k = rows.shape[1]
  if k >= num_terms and k % num_terms == 0:
    return rows.reshape(s, num_terms, k // num_terms, c).sum(2)
  return rows * jnp.sqrt(jnp.asarray(k / num_terms, rows.dtype))


def unitwise_inverse(fisher: jax.Array, damping: jax.Array) -> jax.Array:
  """Closed-form ``(F_c + damping I)^-1`` of ``(C, 2, 2)`` blocks (non-finite if singular):
  ``[[a, b], [b, c]]^-1 = [[c, -b], [-b, a]] / (a c - b^2)``."""
  a = fisher[:, 0, 0] + damping
  c = fisher[:, 1, 1] + damping
  b = 0.5 * (fisher[:, 0, 1] + fisher[:, 1, 0])
  det = a * c - b * b
  inv = jnp.stack([jnp.stack([c, -b], -1), jnp.stack([-b, a], -1)], -2)
  return inv / det[:, None, None]


def _canonical_axes(axes: Any, ndim: int) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(sorted({int(a) % ndim for a in axes}))


class Affine(NamedTuple):
  """The affine map of a normalization module class.

  Attributes:
    leaves: the parameters the class can hold, of ``('scale', 'bias')``; each has a
      ``use_<leaf>`` flag on the module.
    axes: the attribute naming the axes its scale and bias are over (``'axis'``,
      ``'feature_axes'``), or ``None`` where they are always over the last axis (linen's
      ``GroupNorm``).
  """

  leaves: tuple[str, ...]
  axes: Optional[str]


# The classes of the normalization kind (isinstance order: a subclass gets its base's entry).
AFFINE: tuple[tuple[type, Affine], ...] = (
    (nn.BatchNorm, Affine(_LEAVES, "axis")),
    (nn.LayerNorm, Affine(_LEAVES, "feature_axes")),
    (nn.GroupNorm, Affine(_LEAVES, None)),
    (nn.RMSNorm, Affine(("scale",), "feature_axes")),
    (nnx.BatchNorm, Affine(_LEAVES, "axis")),
    (nnx.LayerNorm, Affine(_LEAVES, "feature_axes")),
    (nnx.GroupNorm, Affine(_LEAVES, "feature_axis")),
    (nnx.RMSNorm, Affine(("scale",), "feature_axes")),
)

_UNIT = {"scale": 1, "bias": 0}  # the identity affine map


class Norm(base.LayerKind):
  """The ``'norm'`` kind: ``BatchNorm``, ``LayerNorm``, ``GroupNorm`` and ``RMSNorm``, linen
  and NNX (and their subclasses), with a rank-1 ``scale`` and/or ``bias`` ``(C,)`` over the
  last axis.

  No Kronecker factors (its claim has ``a_dim = g_dim = None``): the parameters are the ``C``
  pairs ``(scale_c, bias_c)``, each preconditioned by its damped 2x2 Fisher,
  ``(C, 2, 2)`` inverses kept as side curvature (module docstring). Capture records ``x_hat``
  (:meth:`unit_affine`) and the statistics are the per-term gradients, :class:`NormStats`.
  From parameter shapes it claims a module whose leaves are only ``scale`` and/or ``bias`` of
  one rank-1 shape.

  Listed in ``CurvatureStats.unhandled`` instead of captured: scale and bias over axes other
  than the last, an input without a batch axis, a layer called more than once per forward pass
  or inside a loop over its weights, and a subclass overriding ``__call__`` or ``param``; a
  layer with neither scale nor bias is skipped silently.

  Raises:
    ValueError: at a check step, naming the layer, for statistics that are not
      :class:`NormStats`, or whose ``scale_grads`` and ``bias_grads`` are not both
      ``(S, N, C)``.
    TypeError: from :meth:`affine`, for a module of none of the classes of :data:`AFFINE` (a
      subclass kind matching other classes without overriding it).

  Source: Osawa et al., SP-NGD, TPAMI 2020, section "Unit-wise Natural Gradient".
  """

  name = "norm"
  stats_type = NormStats
  example_axes = {"scale_grads": 1, "bias_grads": 1}
  linen_modules = tuple(cls for cls, _ in AFFINE if issubclass(cls, nn.Module))
  nnx_modules = tuple(cls for cls, _ in AFFINE if issubclass(cls, nnx.Module))
  weight = "scale"
  normalized_input = True

  def affine(self, module: Any) -> Affine:
    """The :class:`Affine` of ``module``'s class (a subclass of this kind matching other
    classes overrides it).

    Raises:
      TypeError: for a module of none of the classes of :data:`AFFINE`.
    """
    found = next((a for cls, a in AFFINE if isinstance(module, cls)), None)
    if found is None:
      raise TypeError(f"{type(module).__name__} is not a normalization class the {self.name!r} "
                      "kind knows the scale and bias of; override Norm.affine for it")
    return found

  def affine_leaves(self, module: Any) -> tuple[str, ...]:
    """The parameters ``module`` holds: those of its class that its ``use_scale`` /
    ``use_bias`` keep (``('scale',)`` for an ``RMSNorm``, ``()`` for a layer without any)."""
    return tuple(leaf for leaf in self.affine(module).leaves if getattr(module, f"use_{leaf}"))

  def unit_affine(self, module: Any, dtype: Any, meta: Mapping[str, Any]) -> Any:
    """A copy of ``module`` whose output is ``x_hat``: linen, an unbound clone without scale and
    bias (``use_scale=False`` and, where the class has one, ``use_bias=False``) computing in
    ``dtype``; NNX, a clone (its own variables) with scale ones and bias zeros, whose output
    dtype is the layer's (``meta``: unused)."""
    del meta
    if isinstance(module, nn.Module):
      off = {f"use_{leaf}": False for leaf in self.affine(module).leaves}
      return module.clone(parent=None, dtype=dtype, **off)
    plain = nnx.clone(module)
    for leaf in self.affine_leaves(module):
      var = getattr(plain, leaf)
      var[...] = jnp.full_like(var[...], _UNIT[leaf])
    return plain

  def plan(self, module, methods, input_shape) -> base.Plan:
    del methods
    leaves = self.affine_leaves(module)
    if not leaves:
      return base.Plan(None)  # no parameters, nothing to precondition
    ndim = len(input_shape)
    if ndim < 2:
      return base.Plan(None, f"normalization input of shape {input_shape} has no batch axis")
    name = self.affine(module).axes
    if name is not None:
      feature_axes = _canonical_axes(getattr(module, name), ndim)
      if feature_axes != (ndim - 1,):
        return base.Plan(None, f"{name}={feature_axes} on a rank-{ndim} input: only scale and "
                         "bias over the last axis are supported")
    return base.Plan(dict(has_scale="scale" in leaves, has_bias="bias" in leaves))

  def make_stats(self, inputs, cotangents, *, has_scale: bool, has_bias: bool) -> NormStats:
    """Per-position scale and bias gradients ``(S, N, P..., C)`` from ``x_hat (N, P..., C)``
    and ``g (S, N, P..., C)``; :meth:`per_loss_term` sums them per loss term."""
    dtype = jnp.promote_types(inputs.dtype, cotangents.dtype)
    g = cotangents.astype(dtype)
    zeros = jnp.zeros(g.shape, dtype)
    scale_grads = inputs.astype(dtype)[None] * g if has_scale else zeros
    bias_grads = g if has_bias else zeros
    return NormStats(scale_grads=scale_grads, bias_grads=bias_grads)

  def per_loss_term(self, stats, num_terms, weight_sharing):
    """The gradients summed per loss term, ``(S, K, C)`` (:func:`per_term_grads`)."""
    return dataclasses.replace(
        stats, scale_grads=per_term_grads(stats.scale_grads, num_terms, weight_sharing),
        bias_grads=per_term_grads(stats.bias_grads, num_terms, weight_sharing))

  def claim(self, path: tuple[str, ...],
            shapes: Mapping[str, tuple[int, ...]]) -> Optional[base.Claim]:
    del path
    if not shapes or not set(shapes) <= set(_LEAVES):
      return None
    if any(len(s) != 1 for s in shapes.values()) or len(set(shapes.values())) != 1:
      return None
    return base.Claim(a_dim=None, g_dim=None)

  def channels(self, spec: base.LayerSpec) -> int:
    return next(s for name, s in spec.shapes)[0]

  def check_stats(self, spec, stats) -> None:
    c = self.channels(spec)
    where = (f"the statistics (curvature_stats or gradient_stats) for normalization layer "
             f"{spec.name!r} ({c} channels)")
    if type(stats) not in (NormStats, self.stats_type):  # (a subclass kind's own, too)
      raise ValueError(f"{where}: got {type(stats).__name__}, expected NormStats.")
    for name in ("scale_grads", "bias_grads"):
      shape = getattr(stats, name).shape
      if len(shape) != 3 or shape[-1] != c:
        raise ValueError(f"{where}: {name} must have shape (S, N, {c}), got {shape}.")
    if stats.scale_grads.shape != stats.bias_grads.shape:
      raise ValueError(f"{where}: scale_grads {stats.scale_grads.shape} and bias_grads "
                       f"{stats.bias_grads.shape} differ.")

  def side_init(self, spec, dtype, method, accumulator):
    del method
    c = self.channels(spec)
    eye = jnp.broadcast_to(jnp.eye(2, dtype=dtype), (c, 2, 2))
    if accumulator.stores_factors:
      return StoredUnitwiseState(eye, jnp.zeros((c, 2, 2), dtype))
    return UnitwiseState(eye)

  def side_statistics(self, spec, stats, dtype):
    """The ``(C, 2, 2)`` unit-wise Fisher of the statistics' examples (:func:`unitwise_fisher`).

    The gradients of a leaf the layer does not have (an ``RMSNorm``'s or ``use_bias=False``
    layer's bias) are taken as zeros whatever the statistics hold, so such a layer's Fisher is
    ``[[F_ss, 0], [0, 0]]`` and its damped inverse ``diag(1 / (F_ss + lambda), 1 / lambda)``:
    the scale's 1x1 damped inverse.
    """
    self.check_stats(spec, stats)
    grads = [stats.scale_grads.astype(dtype), stats.bias_grads.astype(dtype)]
    grads = [g if leaf is not None and spec.shape(leaf) is not None else jnp.zeros_like(g)
             for leaf, g in zip(self.leaf_names(spec.hint), grads)]
    return unitwise_fisher(*grads)

  def side_refresh(self, spec, stats, state, factors, damping, method, accumulator):
    """The damped 2x2 inverses from this check's Fisher (``factors``: the
    :meth:`side_statistics` averaged across replicas; ``None``: from ``stats``), kept where not
    finite."""
    del method
    dtype = state.inverse.dtype
    fisher = (self.side_statistics(spec, stats, dtype) if factors is None
              else factors.astype(dtype))
    if accumulator.stores_factors:
      fisher = accumulator.blend(state.fisher, fisher, jnp.all(state.fisher == 0))
    inv = unitwise_inverse(fisher, damping)
    ok = (linalg.is_finite_block(inv) & linalg.is_finite_block(fisher))[:, None, None]
    inverse = jnp.where(ok, inv, state.inverse)
    if accumulator.stores_factors:
      return StoredUnitwiseState(inverse, jnp.where(ok, fisher, state.fisher))
    return UnitwiseState(inverse)

  def side_precondition(self, spec, leaves, state, dtype):
    c = self.channels(spec)
    names = self.leaf_names(spec.hint)  # (scale, bias)
    v = jnp.stack([leaves[name].astype(dtype) if name in leaves
                   else jnp.zeros((c,), dtype) for name in names], -1)
    y = jnp.einsum("cij,cj->ci", state.inverse, v)
    return {name: y[:, i].astype(leaves[name].dtype)
            for i, name in enumerate(names) if name in leaves}
