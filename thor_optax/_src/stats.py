"""Raw per-layer curvature statistics, as handed from capture to the transforms.

The capture side (``thor_optax.flax``) knows the model; the transforms know the maths. What
passes between them is defined here: for every preconditioned layer, the layer input ``a`` and
the per-example output cotangents ``g``, plus the static metadata a layer kind needs to form its
Kronecker factors. All classes are pytrees whose arrays are leaves and whose metadata is static,
so statistics go through ``jax.jit`` as ordinary arguments and results.

References:
  Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored Approximate Curvature",
  ICML 2015, section 3 (dense ``a``, ``g``).
  Grosse & Martens, "A Kronecker-factored approximate Fisher matrix for convolution layers",
  ICML 2016, section 3 (conv patches).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Union

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseStats:
  """Statistics of one dense layer ``y = x @ kernel (+ bias)``.

  Attributes:
    inputs: layer input ``a``, shape ``(N, ..., d_in)``; axis 0 indexes examples, any further
      leading axes are positions that share the weights (treated as in KFC, see
      ``factors.dense_rows``).
    cotangents: per-example output cotangents ``g = dL_n/dy``, shape ``(S, N, ..., d_out)``,
      where ``S`` is the number of cotangent samples (1 for the empirical Fisher). The Kronecker
      factor ``G`` sums over ``S`` and averages over examples and positions.
  """

  inputs: jax.Array
  cotangents: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvStats:
  """Statistics of one 2-D convolution (NHWC inputs, HWIO kernel, one feature group).

  Attributes:
    inputs: layer input, shape ``(N, H, W, C_in)``.
    cotangents: per-example output cotangents, shape ``(S, N, H_out, W_out, C_out)``.
    kernel_size: ``(k_h, k_w)``.
    strides: ``(s_h, s_w)``.
    padding: ``'SAME'``, ``'VALID'`` or ``((lo_h, hi_h), (lo_w, hi_w))``.
    input_dilation: ``(d_h, d_w)`` (``lhs_dilation`` of ``lax.conv_general_dilated``).
    kernel_dilation: ``(d_h, d_w)`` (``rhs_dilation``).
  """

  inputs: jax.Array
  cotangents: jax.Array
  kernel_size: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
  strides: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
  padding: Union[str, tuple[tuple[int, int], ...]] = dataclasses.field(
      metadata=dict(static=True))
  input_dilation: tuple[int, int] = dataclasses.field(
      default=(1, 1), metadata=dict(static=True))
  kernel_dilation: tuple[int, int] = dataclasses.field(
      default=(1, 1), metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EmbedStats:
  """Statistics of one embedding lookup ``y = embedding[ids]`` (Flax ``nn.Embed``).

  Attributes:
    inputs: integer token ids, shape ``(N, ...)``; axis 0 indexes examples, further axes are
      positions.
    cotangents: per-example output cotangents, shape ``(S, N, ..., features)``.
  """

  inputs: jax.Array
  cotangents: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NormStats:
  """Per-example gradients of a normalization layer's scale and bias (BatchNorm, LayerNorm).

  For ``y = scale * x_hat + bias`` over channels ``C`` (the last axis), the per-example
  gradients are ``scale_grads[s, n] = sum_t x_hat[n, t] * g[s, n, t]`` and ``bias_grads[s, n] =
  sum_t g[s, n, t]``, summed over the positions ``t`` an example covers, with ``g`` the
  per-example output cotangents (scaled like :class:`DenseStats` cotangents). A layer without a
  scale (or bias) has zeros there.

  Attributes:
    scale_grads: ``(S, N, C)``.
    bias_grads: ``(S, N, C)``.
  """

  scale_grads: jax.Array
  bias_grads: jax.Array


LayerStats = Union[DenseStats, ConvStats, EmbedStats, NormStats]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CurvatureStats:
  """All statistics of one forward/backward pass.

  Attributes:
    layers: nested dict mirroring the parameter tree; at every preconditioned layer's module
      path it holds a :class:`DenseStats`, :class:`ConvStats`, :class:`EmbedStats` or
      :class:`NormStats` (for example
      ``layers['Block_0']['Dense_1']`` for ``params['Block_0']['Dense_1']``).
    unhandled: static tuple of ``"path: reason"`` strings naming modules with parameters that
      were not captured; their gradients pass through the transforms unchanged.
  """

  layers: Mapping[str, Any]
  unhandled: tuple[str, ...] = dataclasses.field(
      default=(), metadata=dict(static=True))


def is_layer_stats(x: Any) -> bool:
  """True for a single layer's statistics (a leaf when flattening ``CurvatureStats.layers``)."""
  return isinstance(x, (DenseStats, ConvStats, EmbedStats, NormStats))


def flatten_layer_stats(stats: CurvatureStats | Mapping[str, Any]) -> dict[str, LayerStats]:
  """Flattens statistics to ``{"Block_0/Dense_1": DenseStats, ...}`` keyed by module path.

  Args:
    stats: a :class:`CurvatureStats` or its ``layers`` dict.

  Returns:
    dict from ``/``-joined module path to that layer's statistics.

  Raises:
    TypeError: if a leaf of the tree is not a layer's statistics.
  """
  layers = stats.layers if isinstance(stats, CurvatureStats) else stats
  flat, _ = jax.tree_util.tree_flatten_with_path(layers, is_leaf=is_layer_stats)
  out = {}
  for path, leaf in flat:
    name = "/".join(path_keys(path))
    if not is_layer_stats(leaf):
      raise TypeError(
          f"curvature_stats: entry {name!r} is a {type(leaf).__name__}, expected DenseStats, "
          "ConvStats, EmbedStats or NormStats; build statistics with "
          "thor_optax.flax.value_and_grad_with_stats.")
    out[name] = leaf
  return out


def path_keys(path: tuple[Any, ...]) -> tuple[str, ...]:
  """A pytree key path as plain strings (``(DictKey('a'), DictKey('b'))`` -> ``('a', 'b')``).

  Integer keys (``nnx.List`` items) become digits (``DictKey(0)`` -> ``'0'``). A trailing
  ``GetAttrKey('value')``, the child of a Flax NNX ``Variable`` (an ``nnx.State`` of ``Param``
  leaves, as ``nnx.Optimizer`` passes to ``tx.init``), is dropped, so that a parameter has the
  same path whether it is held by a ``Variable`` or is a plain array (``nnx.as_pure``).
  """
  if (path and isinstance(path[-1], jax.tree_util.GetAttrKey)
      and path[-1].name == "value"):
    path = path[:-1]
  return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)
