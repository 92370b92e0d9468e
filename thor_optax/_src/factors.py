"""Kronecker factors per layer kind, as scaled row matrices.

Each factor is returned as ``(rows, scale)`` with ``F = scale * rows^T rows``; the covariance is
never formed here, so the trace test can read block traces in ``O(R d)`` and only the blocks
due for a refresh are multiplied out (``blocks.block_covariances``).

Conventions (KFC, Grosse & Martens 2016, eq. 3 and section 3.1): for a layer applied at ``T``
positions per example (conv output locations, or extra leading axes of a dense input) and
``N`` examples,

    A = (1/N)     sum_{n,t} a_{n,t} a_{n,t}^T          (``T`` times the mean patch covariance)
    G = (1/(N T)) sum_{s,n,t} g_{s,n,t} g_{s,n,t}^T    (mean cotangent covariance, sum over the
                                                         ``S`` cotangent samples)

With ``T = 1`` (a plain dense layer) these are ``E[a a^T]`` and ``E[g g^T]``, and ``A (x) G`` is
K-FAC's approximation of the Fisher block (Martens & Grosse 2015, eq. 1). A bias is the last
column of ``a``, fixed at one.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from thor_optax._src import blocks
from thor_optax._src import stats as stats_lib


def _with_ones(rows: jax.Array) -> jax.Array:
  return jnp.concatenate([rows, jnp.ones((rows.shape[0], 1), rows.dtype)], axis=1)


def conv_patches(stats: stats_lib.ConvStats) -> jax.Array:
  """im2col patches of a conv layer's input.

  Built from ``k_h * k_w`` strided slices of the padded input: pure data movement, ``O(N H' W'
  C k_h k_w)``. (``lax.conv_general_dilated_patches`` computes the same array as a convolution
  with an identity kernel, ``O(C^2 k_h^2 k_w^2)`` multiply-adds per position, which dominated
  a curvature check on CPU; it is kept only for input dilation.)

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


def kernel_matrix(kernel: jax.Array) -> jax.Array:
  """A dense ``(d_in, d_out)`` or conv HWIO kernel as a ``(d_in, d_out)`` matrix.

  Conv kernels ``(k_h, k_w, C_in, C_out)`` become ``(C_in * k_h * k_w, C_out)`` in the patch
  order of :func:`conv_patches`.
  """
  if kernel.ndim == 2:
    return kernel
  return jnp.transpose(kernel, (2, 0, 1, 3)).reshape(-1, kernel.shape[-1])


def kernel_from_matrix(matrix: jax.Array, kernel_shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`kernel_matrix`."""
  if len(kernel_shape) == 2:
    return matrix.reshape(kernel_shape)
  kh, kw, cin, cout = kernel_shape
  return jnp.transpose(matrix.reshape(cin, kh, kw, cout), (1, 2, 0, 3))


def check_stats(spec: blocks.LayerSpec, stats: stats_lib.LayerStats) -> None:
  """Checks that a layer's statistics fit its kernel.

  Raises:
    ValueError: naming the layer path and the expected shapes, if the statistics are of the
      wrong kind or their trailing dimensions do not match the kernel.
  """
  where = f"curvature_stats for layer {spec.name!r} (kernel shape {spec.kernel_shape})"
  want = stats_lib.DenseStats if spec.kind == "dense" else stats_lib.ConvStats
  if not isinstance(stats, want):
    raise ValueError(f"{where}: got {type(stats).__name__}, expected {want.__name__}.")
  a, g = stats.inputs, stats.cotangents
  c_in = spec.kernel_shape[0] if spec.kind == "dense" else spec.kernel_shape[2]
  if spec.kind == "conv":
    if a.ndim != 4:
      raise ValueError(f"{where}: inputs must be (N, H, W, {c_in}), got shape {a.shape}.")
    if tuple(stats.kernel_size) != tuple(spec.kernel_shape[:2]):
      raise ValueError(f"{where}: kernel_size {stats.kernel_size} does not match the kernel.")
  if a.shape[-1] != c_in:
    raise ValueError(f"{where}: inputs have trailing dimension {a.shape[-1]}, expected {c_in}.")
  if g.ndim < 2 or g.shape[-1] != spec.d_out:
    raise ValueError(
        f"{where}: cotangents must have shape (S, N, ..., {spec.d_out}), got {g.shape}.")
  if g.shape[1] != a.shape[0]:
    raise ValueError(
        f"{where}: cotangents have {g.shape[1]} examples on axis 1, inputs {a.shape[0]} on "
        "axis 0.")


def input_rows(spec: blocks.LayerSpec, stats: stats_lib.LayerStats,
               dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
  """``(rows, scale)`` with ``A = scale * rows^T rows``.

  Returns:
    rows of shape ``(N T, d_in (+1))`` and the scalar ``1 / N``.
  """
  if spec.kind == "conv":
    x = conv_patches(stats)
  else:
    x = stats.inputs
  n = stats.inputs.shape[0]
  rows = x.reshape(-1, x.shape[-1]).astype(dtype)
  if spec.has_bias:
    rows = _with_ones(rows)
  return rows, jnp.asarray(1.0 / n, dtype)


def cotangent_rows(spec: blocks.LayerSpec, stats: stats_lib.LayerStats,
                   dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
  """``(rows, scale)`` with ``G = scale * rows^T rows``.

  Returns:
    rows of shape ``(S N T, d_out)`` and the scalar ``1 / (N T)``.
  """
  g = stats.cotangents
  n_positions = int(np.prod(g.shape[1:-1]))
  rows = g.reshape(-1, g.shape[-1]).astype(dtype)
  return rows, jnp.asarray(1.0 / n_positions, dtype)
