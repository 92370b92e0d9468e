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
column of ``a``, fixed at one. An embedding's input is the one-hot vector of its token, so its
``A`` is diagonal: the token counts per example (:func:`embedding_frequencies`).

Conv layers can trade these exact-over-positions factors for fewer rows (SKFAC, Tang et al.,
CVPR 2021): :class:`ConvSampling` picks ``'expand'`` (the factors above, ``N T`` rows),
``'reduce_sum'`` (one row per example: patches and cotangents summed over positions) or
``'spatial_subsample'`` (``s`` of the ``T`` positions per example, rescaled to be unbiased).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import jax
import jax.numpy as jnp

from thor_optax._src import blocks
from thor_optax._src import stats as stats_lib


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


def _with_ones(rows: jax.Array) -> jax.Array:
  return jnp.concatenate([rows, jnp.ones((rows.shape[0], 1), rows.dtype)], axis=1)


def _check_subsample(spec: blocks.LayerSpec, sampling: ConvSampling, t: int) -> int:
  s = sampling.num_positions
  if s > t:
    raise ValueError(
        f"conv layer {spec.name!r}: spatial_subsample keeps num_positions={s} positions per "
        f"example, but its output has only T = H_out * W_out = {t}.")
  return s


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
  """Checks that a layer's statistics fit its weight.

  Args:
    spec: the layer (dense, conv or embedding).
    stats: its statistics: :class:`~stats_lib.DenseStats`, :class:`~stats_lib.ConvStats` or
      :class:`~stats_lib.EmbedStats` (integer ids ``(N, ...)``, cotangents
      ``(S, N, ..., features)``).

  Raises:
    ValueError: naming the layer path and the expected shapes, if the statistics are of the
      wrong kind, embedding ids are not integers, or the trailing dimensions do not match the
      weight.
  """
  where = f"curvature_stats for layer {spec.name!r} ({spec.param} shape {spec.kernel_shape})"
  want = {"dense": stats_lib.DenseStats, "conv": stats_lib.ConvStats,
          "embed": stats_lib.EmbedStats}[spec.kind]
  if not isinstance(stats, want):
    raise ValueError(f"{where}: got {type(stats).__name__}, expected {want.__name__}.")
  a, g = stats.inputs, stats.cotangents
  if g.ndim < 2 or g.shape[-1] != spec.d_out:
    raise ValueError(
        f"{where}: cotangents must have shape (S, N, ..., {spec.d_out}), got {g.shape}.")
  if spec.kind == "embed":
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"{where}: inputs must be integer token ids, got dtype {a.dtype}.")
    if tuple(g.shape[1:-1]) != tuple(a.shape):
      raise ValueError(
          f"{where}: cotangents must have shape (S, *ids.shape, {spec.d_out}) = "
          f"(S, {', '.join(map(str, a.shape))}, {spec.d_out}), got {g.shape}.")
    return
  c_in = spec.kernel_shape[0] if spec.kind == "dense" else spec.kernel_shape[2]
  if spec.kind == "conv":
    if a.ndim != 4:
      raise ValueError(f"{where}: inputs must be (N, H, W, {c_in}), got shape {a.shape}.")
    if tuple(stats.kernel_size) != tuple(spec.kernel_shape[:2]):
      raise ValueError(f"{where}: kernel_size {stats.kernel_size} does not match the kernel.")
  if a.shape[-1] != c_in:
    raise ValueError(f"{where}: inputs have trailing dimension {a.shape[-1]}, expected {c_in}.")
  if g.shape[1] != a.shape[0]:
    raise ValueError(
        f"{where}: cotangents have {g.shape[1]} examples on axis 1, inputs {a.shape[0]} on "
        "axis 0.")


def check_norm_stats(unit: blocks.UnitSpec, stats: stats_lib.LayerStats) -> None:
  """Checks a normalization layer's statistics against its ``C`` channels.

  Raises:
    ValueError: naming the layer path and the expected shape ``(S, N, C)``, if ``stats`` is not
      a :class:`~stats_lib.NormStats` or its gradients have another shape.
  """
  where = f"curvature_stats for normalization layer {unit.name!r} ({unit.channels} channels)"
  if not isinstance(stats, stats_lib.NormStats):
    raise ValueError(f"{where}: got {type(stats).__name__}, expected NormStats.")
  for name in ("scale_grads", "bias_grads"):
    shape = getattr(stats, name).shape
    if len(shape) != 3 or shape[-1] != unit.channels:
      raise ValueError(f"{where}: {name} must have shape (S, N, {unit.channels}), got {shape}.")
  if stats.scale_grads.shape != stats.bias_grads.shape:
    raise ValueError(f"{where}: scale_grads {stats.scale_grads.shape} and bias_grads "
                     f"{stats.bias_grads.shape} differ.")


def embedding_frequencies(spec: blocks.LayerSpec, stats: stats_lib.EmbedStats,
                          dtype: jnp.dtype) -> jax.Array:
  """An embedding's diagonal input factor: token counts per example.

  The input of an embedding is the one-hot vector of its id, so ``A = (1/N) sum_{n,t} e_id
  e_id^T`` is diagonal, ``A_vv = (number of occurrences of token v) / N``; it sums to ``T``,
  the positions per example (THOR: the embedding's ``A`` is the token-frequency vector).

  Args:
    spec: the embedding layer (``kernel_shape = (vocab, features)``).
    stats: its :class:`~stats_lib.EmbedStats`; ``inputs`` are ids ``(N, ...)``.
    dtype: dtype of the result.

  Returns:
    ``(vocab,)`` the diagonal of ``A``; ids outside ``[0, vocab)`` are not counted.
  """
  ids = stats.inputs.reshape(-1)
  counts = jnp.zeros((spec.kernel_shape[0],), dtype).at[ids].add(1.0, mode="drop")
  return counts / stats.inputs.shape[0]


def input_rows(spec: blocks.LayerSpec, stats: stats_lib.LayerStats, dtype: jnp.dtype, *,
               sampling: ConvSampling = ConvSampling(),
               key: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """``(rows, scale)`` with ``A = scale * rows^T rows``.

  Args:
    spec: the layer.
    stats: its :class:`~stats_lib.DenseStats` or :class:`~stats_lib.ConvStats`.
    dtype: dtype of the rows and scale (inputs are cast before any sum).
    sampling: conv statistics mode (see :class:`ConvSampling`); dense layers ignore it.
    key: PRNG key for random ``'spatial_subsample'`` positions (``None``: strided); pass the
      key given to :func:`cotangent_rows` so both factors see the same positions.

  Returns:
    rows and scalar scale; with ``T`` positions per example (dense: the product of the middle
    input axes) and ``d = d_in (+1)``: ``'expand'`` ``(N T, d)`` and ``1 / N``;
    ``'reduce_sum'`` ``(N, d)`` (summed patches, bias entry ``T``) and ``1 / (N T)``;
    ``'spatial_subsample'`` ``(N s, d)`` and ``T / (N s)``. Leading dimensions are static.

  Raises:
    ValueError: if ``'spatial_subsample'`` asks for more positions than a conv output has
      (naming the layer), or the conv cotangents' spatial shape differs from the patches'.
  """
  n = stats.inputs.shape[0]
  if spec.kind != "conv" or sampling.mode == "expand":
    x = conv_patches(stats) if spec.kind == "conv" else stats.inputs
    rows = x.reshape(-1, x.shape[-1]).astype(dtype)
    if spec.has_bias:
      rows = _with_ones(rows)
    return rows, jnp.asarray(1.0 / n, dtype)
  patches = conv_patches(stats)
  t = _conv_positions(spec, stats, patches.shape[1:3])
  x = patches.reshape(n, t, patches.shape[-1]).astype(dtype)
  if sampling.mode == "reduce_sum":
    rows = jnp.sum(x, axis=1)
    if spec.has_bias:
      rows = jnp.concatenate([rows, jnp.full((n, 1), t, dtype)], axis=1)
    return rows, jnp.asarray(1.0 / (n * t), dtype)
  s = _check_subsample(spec, sampling, t)
  idx = subsample_positions(key, n, t, s)
  rows = jnp.take_along_axis(x, idx[:, :, None], axis=1).reshape(n * s, x.shape[-1])
  if spec.has_bias:
    rows = _with_ones(rows)
  return rows, jnp.asarray(t / (n * s), dtype)


def cotangent_rows(spec: blocks.LayerSpec, stats: stats_lib.LayerStats, dtype: jnp.dtype, *,
                   sampling: ConvSampling = ConvSampling(),
                   key: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """``(rows, scale)`` with ``G = scale * rows^T rows``.

  Args:
    spec: the layer.
    stats: its statistics; ``cotangents`` has shape ``(S, N, ..., d_out)``.
    dtype: dtype of the rows and scale (cotangents are cast before any sum).
    sampling: conv statistics mode (see :class:`ConvSampling`); other layers ignore it.
    key: PRNG key for random ``'spatial_subsample'`` positions (``None``: strided); the key
      given to :func:`input_rows`, so both factors see the same positions.

  Returns:
    rows and scalar scale: ``'expand'`` ``(S N T, d_out)`` and ``1 / (N T)``; ``'reduce_sum'``
    ``(S N, d_out)`` (cotangents summed over positions) and ``1 / (N T)``;
    ``'spatial_subsample'`` ``(S N s, d_out)`` and ``1 / (N s)``. Leading dimensions are static.

  Raises:
    ValueError: if ``'spatial_subsample'`` asks for more positions than a conv output has,
      naming the layer.
  """
  g = stats.cotangents
  if spec.kind != "conv" or sampling.mode == "expand":
    n_positions = int(np.prod(g.shape[1:-1]))
    rows = g.reshape(-1, g.shape[-1]).astype(dtype)
    return rows, jnp.asarray(1.0 / n_positions, dtype)
  n_samples, n, c = g.shape[0], g.shape[1], g.shape[-1]
  t = int(np.prod(g.shape[2:-1]))
  g = g.reshape(n_samples, n, t, c).astype(dtype)
  if sampling.mode == "reduce_sum":
    return jnp.sum(g, axis=2).reshape(n_samples * n, c), jnp.asarray(1.0 / (n * t), dtype)
  s = _check_subsample(spec, sampling, t)
  idx = subsample_positions(key, n, t, s)
  rows = jnp.take_along_axis(g, idx[None, :, :, None], axis=2).reshape(n_samples * n * s, c)
  return rows, jnp.asarray(1.0 / (n * s), dtype)


def _conv_positions(spec: blocks.LayerSpec, stats: stats_lib.ConvStats,
                    patch_hw: tuple[int, ...]) -> int:
  """``T`` of a conv layer, checking that its cotangents cover the patches' output grid."""
  g_hw = tuple(stats.cotangents.shape[2:-1])
  if g_hw != tuple(patch_hw):
    raise ValueError(
        f"conv layer {spec.name!r}: cotangents cover output positions {g_hw}, but the inputs "
        f"and conv settings give {tuple(patch_hw)}.")
  return int(np.prod(patch_hw))
