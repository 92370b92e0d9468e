"""2-D convolutions (NHWC inputs, HWIO kernel, one feature group): ``nn.Conv`` and ``nnx.Conv``.

Factors (KFC, Grosse & Martens 2016, eq. 3 and section 3.1): with ``a_{n,t}`` the im2col patch
of output position ``t`` (``T = H_out W_out`` positions per example, a ones column for the bias)
and ``g_{s,n,t}`` the output cotangents,

    A = (1/N) sum_{n,t} a_{n,t} a_{n,t}^T,   G = (1/(N T)) sum_{s,n,t} g_{s,n,t} g_{s,n,t}^T,

or fewer rows with SKFAC's reduce-sum or spatial subsampling (:class:`ConvSampling`). The kernel
``(k_h, k_w, C_in, C_out)`` is the ``(C_in k_h k_w, C_out)`` matrix in the patches' order.

References:
  Grosse & Martens, "A Kronecker-factored approximate Fisher matrix for convolution layers",
  ICML 2016.
  Tang et al., "SKFAC", CVPR 2021 (reduce-sum and spatial subsampling).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Union

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src import explicit
from thor_optax._src.layers import base
from thor_optax._src.layers import dense


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


CONV_SAMPLING_MODES = ("expand", "reduce_sum", "spatial_subsample")


@dataclasses.dataclass(frozen=True)
class ConvSampling:
  """How a conv layer's ``T`` output positions per example become factor rows.

  With ``a_{n,t}`` the im2col patch (bias ones column last) and ``g_{j,n,t}`` cotangent sample
  ``j`` of example ``n`` at output position ``t`` (``T = H_out W_out``):

  * ``'expand'`` (KFC, Grosse & Martens 2016): every position is a row, ``A = (1/N) sum_{n,t}
    a a^T`` and ``G = (1/(N T)) sum_{j,n,t} g g^T``; ``N T`` and ``S N T`` rows.
  * ``'reduce_sum'`` (SKFAC, Tang et al., CVPR 2021): one row per example, ``a_hat_n =
    sum_t a_{n,t}`` (its bias entry is ``T``) and ``g_hat_{j,n} = sum_t g_{j,n,t}``, with
    ``A = (1/(N T)) sum_n a_hat a_hat^T`` and ``G = (1/(N T)) sum_{j,n} g_hat g_hat^T``;
    ``N`` and ``S N`` rows. Sums divided by ``N T`` make these the expand factors exactly when
    the activations are constant over positions (``a_hat a_hat^T = T^2 a a^T``, for ``A``)
    and the cotangents are spatially uncorrelated (KFC's SUD assumption: the cross terms
    ``g_t g_u^T``, ``t != u``, vanish in expectation, for ``G``); on ``1 x 1`` output maps
    (``T = 1``) they are the expand factors. SKFAC's official MindSpore code uses
    means (``(1/T) sum_t``) instead of sums for both, which differs from these by a factor
    ``T`` on each factor (``T^2`` on ``A (x) G``, so a fixed damping acts differently).
  * ``'spatial_subsample'``: ``s = num_positions`` positions ``P_n`` per example (see
    :func:`subsample_positions`; the same positions for ``A`` and ``G``), ``A = (T/s) (1/N)
    sum_n sum_{t in P_n} a a^T`` and ``G = (1/(N s)) sum_{j,n} sum_{t in P_n} g g^T``,
    unbiased estimates of the expand factors under random positions; ``N s`` and ``S N s``
    rows. With ``s = T`` and strided positions this is ``'expand'``.

  Dense layers and embeddings ignore it.

  Attributes:
    mode: one of ``'expand'``, ``'reduce_sum'``, ``'spatial_subsample'``.
    num_positions: ``s``, positions kept per example (a static positive int); used only by
      ``'spatial_subsample'``, which needs it.

  Raises:
    ValueError: on an unknown ``mode``, or ``'spatial_subsample'`` without a positive integer
      ``num_positions``.
  """

  mode: str = "expand"
  num_positions: Optional[int] = None

  def __post_init__(self):
    if self.mode not in CONV_SAMPLING_MODES:
      raise ValueError(
          f"ConvSampling: unknown mode {self.mode!r}; expected one of {CONV_SAMPLING_MODES}.")
    if self.mode == "spatial_subsample":
      s = self.num_positions
      if (not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1):
        raise ValueError(
            "ConvSampling: mode 'spatial_subsample' needs num_positions, a positive Python int "
            f"(positions kept per example; it fixes array shapes), got {s!r}.")
      object.__setattr__(self, "num_positions", int(s))


def subsample_positions(key: Optional[jax.Array], num_examples: int, num_positions_total: int,
                        s: int) -> jax.Array:
  """Output positions kept per example by ``'spatial_subsample'``.

  Args:
    key: ``None`` for evenly strided positions ``t_k = floor(k T / s)``, ``k < s``, the same for
      every example; otherwise a PRNG key: each example draws ``s`` distinct positions
      uniformly without replacement (one permutation per example). The same key gives the same
      positions, so calling this once per factor with one key pairs ``A`` and ``G``.
    num_examples: ``N`` (static).
    num_positions_total: ``T = H_out W_out`` (static), positions in row-major
      ``(H_out, W_out)`` order.
    s: positions kept per example (static), ``1 <= s <= T``.

  Returns:
    ``(N, s)`` int32 indices into the flattened ``H_out W_out`` grid (strided: increasing).

  Raises:
    ValueError: if ``s`` is not in ``[1, T]``.
  """
  n, t = int(num_examples), int(num_positions_total)
  if not 1 <= s <= t:
    raise ValueError(f"subsample_positions: need 1 <= s <= T, got s={s}, T={t}.")
  if key is None:
    strided = (np.arange(s) * t) // s
    return jnp.broadcast_to(jnp.asarray(strided, jnp.int32), (n, s))
  keys = jax.random.split(key, n)
  perms = jax.vmap(lambda k: jax.random.permutation(k, t))(keys)
  return perms[:, :s].astype(jnp.int32)


def conv_patches(stats: "ConvStats") -> jax.Array:
  """im2col patches of a conv layer's input.

  Built from ``k_h * k_w`` strided slices of the padded input: pure data movement, ``O(N H' W'
  C k_h k_w)``. (``lax.conv_general_dilated_patches`` computes the same array as a convolution
  with an identity kernel, ``O(C^2 k_h^2 k_w^2)`` multiply-adds per position, which dominated
  a check step on CPU; it is kept only for input dilation.)

  Args:
    stats: the layer's :class:`ConvStats`; ``inputs`` has shape ``(N, H, W, C_in)``.

  Returns:
    ``(N, H_out, W_out, C_in * k_h * k_w)``, features ordered channel-major ``(C_in, k_h, k_w)``
    (the order of ``lax.conv_general_dilated_patches``); ``kernel_matrix`` matches it.
  """
  x = stats.inputs
  if tuple(stats.input_dilation) != (1, 1):
    return jax.lax.conv_general_dilated_patches(
        x, filter_shape=stats.kernel_size, window_strides=stats.strides,
        padding=stats.padding, lhs_dilation=stats.input_dilation,
        rhs_dilation=stats.kernel_dilation, dimension_numbers=("NHWC", "HWIO", "NHWC"))
  (kh, kw), (sh, sw), (dh, dw) = stats.kernel_size, stats.strides, stats.kernel_dilation
  span = ((kh - 1) * dh + 1, (kw - 1) * dw + 1)
  pads = stats.padding
  if isinstance(pads, str):
    pads = jax.lax.padtype_to_pads(x.shape[1:3], span, (sh, sw), pads)
  x = jnp.pad(x, ((0, 0), tuple(pads[0]), tuple(pads[1]), (0, 0)))
  h_out = (x.shape[1] - span[0]) // sh + 1
  w_out = (x.shape[2] - span[1]) // sw + 1
  taps = [
      jax.lax.slice(x, (0, i * dh, j * dw, 0),
                    (x.shape[0], i * dh + (h_out - 1) * sh + 1,
                     j * dw + (w_out - 1) * sw + 1, x.shape[3]),
                    (1, sh, sw, 1))
      for i in range(kh) for j in range(kw)
  ]
  patches = jnp.stack(taps, axis=-1)  # (N, H', W', C, k_h k_w): channel-major
  return patches.reshape(patches.shape[:3] + (-1,))


def _pair(x: Any) -> tuple[int, ...]:
  if x is None:
    return (1, 1)
  if isinstance(x, int):
    return (x, x)
  return tuple(int(v) for v in x)


def _padding(padding: Any) -> tuple[Any, str]:
  """A module's padding as ``ConvStats.padding``, or ``(None, reason)``."""
  if isinstance(padding, str):
    if padding.upper() not in ("SAME", "VALID"):
      return None, f"padding={padding!r} (SAME, VALID or explicit pads are supported)"
    return padding.upper(), ""
  if isinstance(padding, int):
    return ((padding, padding),) * 2, ""
  return tuple((p, p) if isinstance(p, int) else (int(p[0]), int(p[1])) for p in padding), ""


def _check_subsample(spec: base.LayerSpec, sampling: ConvSampling, t: int) -> int:
  s = sampling.num_positions
  if s > t:
    raise ValueError(
        f"conv layer {spec.name!r}: spatial_subsample keeps num_positions={s} positions per "
        f"example, but its output has only T = H_out * W_out = {t}.")
  return s


def _conv_positions(spec: base.LayerSpec, stats: ConvStats, patch_hw: tuple[int, ...]) -> int:
  """``T`` of a conv layer, checking that its cotangents cover the patches' output grid."""
  g_hw = tuple(stats.cotangents.shape[2:-1])
  if g_hw != tuple(patch_hw):
    raise ValueError(
        f"conv layer {spec.name!r}: cotangents cover output positions {g_hw}, but the inputs "
        f"and conv settings give {tuple(patch_hw)}.")
  return int(np.prod(patch_hw))


class Conv(base.LayerKind):
  """``nn.Conv`` / ``nnx.Conv`` with 2 spatial dimensions: a rank-4 HWIO ``kernel``."""

  name = "conv"
  stats_type = ConvStats
  example_axes = {"inputs": 0, "cotangents": 1}
  linen_modules = (nn.Conv,)
  nnx_modules = (nnx.Conv,)
  he_rescaled = True

  def plan(self, module, methods, input_shape) -> base.Plan:
    del methods
    kernel_size = module.kernel_size
    kernel_size = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
    if len(kernel_size) != 2:
      return base.Plan(None, f"{len(kernel_size)}-D convolution (only 2-D is supported)")
    if module.feature_group_count != 1:
      return base.Plan(None, f"feature_group_count={module.feature_group_count} (only 1 is "
                       "supported)")
    if getattr(module, "mask", None) is not None:
      return base.Plan(None, "masked convolution")
    padding, reason = _padding(module.padding)
    if padding is None:
      return base.Plan(None, reason)
    if len(input_shape) < 4:
      return base.Plan(None, f"conv input of shape {input_shape} has no batch axis")
    return base.Plan(dict(
        kernel_size=tuple(int(k) for k in kernel_size), strides=_pair(module.strides),
        padding=padding, input_dilation=_pair(module.input_dilation),
        kernel_dilation=_pair(module.kernel_dilation)))

  def make_stats(self, inputs, cotangents, **meta) -> ConvStats:
    # Fold any extra leading batch axes into N (flax convs accept them).
    inputs = inputs.reshape((-1,) + inputs.shape[-3:])
    cotangents = cotangents.reshape((cotangents.shape[0], -1) + cotangents.shape[-3:])
    return ConvStats(inputs=inputs, cotangents=cotangents, **meta)

  def claim(self, path: tuple[str, ...],
            shapes: Mapping[str, tuple[int, ...]]) -> Optional[base.Claim]:
    del path
    kernel = shapes.get("kernel")
    if kernel is None or len(kernel) != 4 or not base.bias_fits(shapes, kernel[-1:]):
      return None
    has_bias = shapes.get("bias") == (kernel[-1],)
    return base.Claim(a_dim=int(np.prod(kernel[:-1])) + int(has_bias), g_dim=kernel[-1])

  def check_stats(self, spec, stats) -> None:
    super().check_stats(spec, stats)
    dense.check_cotangents(spec, stats)
    c_in = spec.kernel_shape[2]
    if stats.inputs.ndim != 4:
      raise ValueError(f"{dense.where(spec)}: inputs must be (N, H, W, {c_in}), got shape "
                       f"{stats.inputs.shape}.")
    if tuple(stats.kernel_size) != tuple(spec.kernel_shape[:2]):
      raise ValueError(f"{dense.where(spec)}: kernel_size {stats.kernel_size} does not match "
                       "the kernel.")
    dense.check_inputs(spec, stats, c_in)

  def kernel_matrix(self, kernel: jax.Array) -> jax.Array:
    """``(k_h, k_w, C_in, C_out)`` -> ``(C_in k_h k_w, C_out)``, the order of :func:`conv_patches`."""
    return jnp.transpose(kernel, (2, 0, 1, 3)).reshape(-1, kernel.shape[-1])

  def kernel_from_matrix(self, matrix: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    kh, kw, cin, cout = shape
    return jnp.transpose(matrix.reshape(cin, kh, kw, cout), (1, 2, 0, 3))

  def input_rows(self, spec, stats, dtype, *, sampling=None, key=None) -> base.FactorRows:
    """Rows of ``A``: ``'expand'`` ``(N T, d)`` and ``1 / N``; ``'reduce_sum'`` ``(N, d)``
    (summed patches, bias entry ``T``) and ``1 / (N T)``; ``'spatial_subsample'`` ``(N s, d)``
    and ``T / (N s)``, with ``d = C_in k_h k_w (+1)``.

    Raises:
      ValueError: if ``'spatial_subsample'`` asks for more positions than the output has, or the
        cotangents' spatial shape differs from the patches' (naming the layer).
    """
    sampling = sampling or ConvSampling()
    n = stats.inputs.shape[0]
    patches = conv_patches(stats)
    if sampling.mode == "expand":
      rows = patches.reshape(-1, patches.shape[-1]).astype(dtype)
      rows = dense.with_ones(rows) if spec.has_bias else rows
      return base.FactorRows(rows, jnp.asarray(1.0 / n, dtype))
    t = _conv_positions(spec, stats, patches.shape[1:3])
    x = patches.reshape(n, t, patches.shape[-1]).astype(dtype)
    if sampling.mode == "reduce_sum":
      rows = jnp.sum(x, axis=1)
      if spec.has_bias:
        rows = jnp.concatenate([rows, jnp.full_like(rows[:, :1], t)], axis=1)
      return base.FactorRows(rows, jnp.asarray(1.0 / (n * t), dtype))
    s = _check_subsample(spec, sampling, t)
    idx = subsample_positions(key, n, t, s)
    rows = jnp.take_along_axis(x, idx[:, :, None], axis=1).reshape(n * s, x.shape[-1])
    rows = dense.with_ones(rows) if spec.has_bias else rows
    return base.FactorRows(rows, jnp.asarray(t / (n * s), dtype))

  def cotangent_rows(self, spec, stats, dtype, *, sampling=None, key=None) -> base.FactorRows:
    """Rows of ``G``: ``'expand'`` ``(S N T, d_out)`` and ``1 / (N T)``; ``'reduce_sum'``
    ``(S N, d_out)`` and ``1 / (N T)``; ``'spatial_subsample'`` ``(S N s, d_out)`` and
    ``1 / (N s)`` (the positions of :meth:`input_rows` for the same ``key``)."""
    sampling = sampling or ConvSampling()
    if sampling.mode == "expand":
      return super().cotangent_rows(spec, stats, dtype)
    g = stats.cotangents
    n_samples, n, c = g.shape[0], g.shape[1], g.shape[-1]
    t = int(np.prod(g.shape[2:-1]))
    g = g.reshape(n_samples, n, t, c).astype(dtype)
    if sampling.mode == "reduce_sum":
      rows = explicit.flatten_rows(jnp.sum(g, axis=2))
      return base.FactorRows(rows, jnp.asarray(1.0 / (n * t), dtype))
    s = _check_subsample(spec, sampling, t)
    idx = subsample_positions(key, n, t, s)
    rows = explicit.flatten_rows(jnp.take_along_axis(g, idx[None, :, :, None], axis=2))
    return base.FactorRows(rows, jnp.asarray(1.0 / (n * s), dtype))
