"""Convolutions with 1, 2 or 3 spatial dimensions, grouped or not: ``nn.Conv`` and ``nnx.Conv``.

Inputs are channels-last ``(N, spatial..., C_in)``, the kernel ``(k..., C_in / G, C_out)`` with
``G = feature_group_count``. Factors (KFC, Grosse & Martens 2016, eq. 3 and section 3.1): with
``a_{n,t}`` the im2col patch of output position ``t`` (``T`` output positions per example, the
product of the output's spatial sizes; a ones column for the bias) and ``g_{s,n,t}`` the output
cotangents,

    A = (1/N) sum_{n,t} a_{n,t} a_{n,t}^T,   G = (1/(N T)) sum_{s,n,t} g_{s,n,t} g_{s,n,t}^T,

or fewer rows with SKFAC's reduce-sum or spatial subsampling (:class:`ConvSampling`).

The kernel is a ``(d_in, C_out)`` matrix in the order of the patches' features:

* 2-D, ``(k_h, k_w, C_in, C_out)`` -> ``(C_in k_h k_w, C_out)``, channel-major: the order of
  ``lax.conv_general_dilated_patches`` and of THOR's reference (MindSpore's ``OIHW`` weights
  reshaped to ``(C_out, C_in k_h k_w)``), which fixes which entries a THOR block of ``A`` holds;
* 1-D and 3-D, ``(k..., C_in, C_out)`` -> ``(k... C_in, C_out)``, the kernel's own row-major
  order: the matrix a ``DenseGeneral`` kernel of the same shape is (the layout a bias-carrying
  1-D/3-D kernel gets from its shapes alone, see below).

Grouped convolutions (``feature_group_count = G``; depthwise: ``G = C_in``): group ``g`` maps
input channels ``[g C_in / G, (g + 1) C_in / G)`` to output channels ``[g C_out / G, ...)``, so
the layer is ``G`` independent convolutions, and it gets one Kronecker pair per group: ``A_g``
from that group's patches (``(C_in / G) k... (+1)``) and ``G_g`` from that group's output
cotangents (``C_out / G``). The optimizer lays the layer out as a stack of ``G`` layers
(``Claim.groups``): the block stacks hold every group's factors as the blocks of ``G`` copies,
and the check step and the preconditioning run the ungrouped maths per group under
``jax.vmap`` after :meth:`LayerKind.split_groups` splits the channels (parameters:
``kernel[..., g C_out / G : ...]``; statistics: the input and cotangent channels). A depthwise
``3 x 3`` convolution with bias thus has ``C`` blocks of ``A`` of dimension 10 (padded to 16) and
``C`` blocks of ``G`` of dimension 1: ``O(C)`` small inversions.

Layout from parameter shapes (``tx.init``): a rank-4 kernel is claimed as a 2-D convolution with
one group. Shapes do not show the number of groups, and a 1-D or 3-D kernel is claimed as what
its shape also is: with a bias ``(C_out,)`` a ``DenseGeneral`` kernel (same factor sizes, same
kernel matrix), without one a stack of dense layers (1-D) or of 2-D convolutions (3-D). For
these layers pass the capture's layout, ``layers=thor_optax.captured_layers(stats)``: the
statistics record the number of spatial dimensions and of groups (:meth:`Conv.hint`), from
which :meth:`Conv.claim_captured` claims the kernel exactly. Without it the check step raises
a ``ValueError`` saying so.

Not captured (listed with the reason): masked convolutions, ``'CIRCULAR'`` / ``'REFLECT'``
padding, and ``'CAUSAL'`` padding with input dilation.

References:
  Grosse & Martens, "A Kronecker-factored approximate Fisher matrix for convolution layers",
  ICML 2016.
  Tang et al., "SKFAC", CVPR 2021 (reduce-sum and spatial subsampling).
  Chen et al., "THOR", AAAI 2021 (MindSpore reference: ``OIHW`` weights, 2-D convolutions).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Union

import flax.linen as nn
from flax import nnx
from flax.linen import linear
import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src import explicit
from thor_optax._src.layers import base
from thor_optax._src.layers import dense


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvStats:
  """Statistics of one convolution (channels-last inputs, kernel ``(k..., C_in / G, C_out)``).

  Attributes:
    inputs: layer input, shape ``(N, spatial..., C_in)`` (``(N, H, W, C_in)`` in 2-D).
    cotangents: per-example output cotangents, shape ``(S, N, out spatial..., C_out)``.
    kernel_size: ``(k...)``, one size per spatial dimension (``(k_h, k_w)`` in 2-D).
    strides: one stride per spatial dimension.
    padding: ``'SAME'``, ``'SAME_LOWER'``, ``'VALID'`` or ``((lo, hi), ...)`` per spatial
      dimension (the padding of ``lax.conv_general_dilated``).
    input_dilation: one per spatial dimension (``lhs_dilation``); ``None``: ones.
    kernel_dilation: one per spatial dimension (``rhs_dilation``); ``None``: ones.
    feature_group_count: ``G``, the number of groups (``C_in`` for a depthwise convolution).
    num_terms: the ``M`` loss terms ``A`` divides by (``'expand'``) when they are not the ``N``
      examples (static): a loss per position (``M = N T``), an ensemble member's share of the
      terms; ``None`` (default): ``N``.

  Source: Grosse & Martens, KFC, ICML 2016 (``A`` from the input's im2col patches, ``G`` from
  the cotangents at every output position); the settings are those of
  ``lax.conv_general_dilated``.
  """

  inputs: jax.Array
  cotangents: jax.Array
  kernel_size: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  strides: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  padding: Union[str, tuple[tuple[int, int], ...]] = dataclasses.field(
      metadata=dict(static=True))
  input_dilation: Optional[tuple[int, ...]] = dataclasses.field(
      default=None, metadata=dict(static=True))
  kernel_dilation: Optional[tuple[int, ...]] = dataclasses.field(
      default=None, metadata=dict(static=True))
  feature_group_count: int = dataclasses.field(default=1, metadata=dict(static=True))
  num_terms: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))


CONV_SAMPLING_MODES = ("expand", "reduce_sum", "spatial_subsample")


@dataclasses.dataclass(frozen=True)
class ConvSampling:
  """How a conv layer's ``T`` output positions per example become factor rows.

  With ``a_{n,t}`` the im2col patch (bias ones column last) and ``g_{j,n,t}`` cotangent sample
  ``j`` of example ``n`` at output position ``t`` (``T``: the product of the output's spatial
  sizes, ``H_out W_out`` in 2-D; for a grouped convolution, per group):

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
            "conv_statistics='spatial_subsample' needs spatial_samples (ConvSampling's "
            "num_positions), a positive Python int (positions kept per example; it fixes array "
            f"shapes, so under optax.inject_hyperparams name it in static_args), got {s!r}.")
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
    num_positions_total: ``T`` (static), the output positions in row-major order of the
      output's spatial axes (``(H_out, W_out)`` in 2-D).
    s: positions kept per example (static), ``1 <= s <= T``.

  Returns:
    ``(N, s)`` int32 indices into the flattened output grid (strided: increasing).

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


def ones(value: Optional[tuple[int, ...]], num_spatial: int) -> tuple[int, ...]:
  """A per-dimension setting of :class:`ConvStats` (``None``: ones)."""
  return (1,) * num_spatial if value is None else tuple(int(v) for v in value)


def conv_patches(stats: "ConvStats") -> jax.Array:
  """im2col patches of a conv layer's input (one feature group: the whole input).

  Gathered from the input, dilated and padded by one ``lax.pad`` (interior padding is the
  input dilation; negative pads crop), at static indices: pure data movement,
  ``O(N T C_in prod(k...))``. (``lax.conv_general_dilated_patches`` computes the same array as
  a convolution with an identity kernel, ``O(C^2 prod(k...)^2)`` multiply-adds per position,
  which dominated a check step on CPU.)

  Args:
    stats: the layer's :class:`ConvStats`; ``inputs`` has shape ``(N, spatial..., C_in)``.

  Returns:
    ``(N, out spatial..., C_in prod(k...))``. Features of a 2-D convolution are channel-major,
    ``(C_in, k_h, k_w)`` (the order of ``lax.conv_general_dilated_patches``), those of 1-D and
    3-D ones row-major, ``(k..., C_in)`` (the kernel's own order); ``Conv.kernel_matrix``
    matches either.
  """
  x = stats.inputs
  nsp = x.ndim - 2
  ks, strides = tuple(stats.kernel_size), tuple(stats.strides)
  kdil = ones(stats.kernel_dilation, nsp)
  idil = ones(stats.input_dilation, nsp)
  span = tuple((k - 1) * d + 1 for k, d in zip(ks, kdil))
  pads = stats.padding
  if isinstance(pads, str):  # (lax allows string padding only without input dilation)
    pads = jax.lax.padtype_to_pads(x.shape[1:-1], span, strides, pads)
  x = jax.lax.pad(x, jnp.zeros((), x.dtype),
                  ((0, 0, 0),) + tuple((int(lo), int(hi), d - 1)
                                       for (lo, hi), d in zip(pads, idil)) + ((0, 0, 0),))
  out = tuple((x.shape[1 + i] - span[i]) // strides[i] + 1 for i in range(nsp))
  # One gather with static indices: position o and tap k of dimension i read o s_i + k d_i.
  # XLA fuses it with the padding (and what follows) into one kernel; prod(k...) slices and
  # their stack were a kernel each on XLA:CPU (and 2.6x the time for a 3x3 kernel).
  index = []
  for i in range(nsp):
    shape = [1] * (2 * nsp)
    shape[i], shape[nsp + i] = out[i], ks[i]
    pos = np.arange(out[i])[:, None] * strides[i] + np.arange(ks[i])[None, :] * kdil[i]
    index.append(pos.reshape(shape))
  patches = x[(slice(None),) + tuple(index)]  # (N, out..., k..., C)
  if nsp == 2:  # (N, H', W', C, k_h, k_w): channel-major
    patches = jnp.moveaxis(patches, -1, 3)
  return patches.reshape(patches.shape[:1 + nsp] + (-1,))


def patch_moments(stats: "ConvStats", dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, int]:
  """``(sums of squares, sums, T)``: the column sums of :func:`conv_patches` (over examples and
  positions), ``(C_in prod(k...),)`` each, without forming the patches, and the number ``T``
  of output positions.

  Each patch entry is one entry of the padded input (or a zero of the padding), so squaring
  and summing over examples commute with taking patches: the column sums are those of the
  patches of the one-example inputs ``sum_n x_n^2`` and ``sum_n x_n``. Cost ``O(N H W C_in)``
  plus one example's patches, where the patches themselves are ``prod(k...)`` times the
  input.
  """
  x = stats.inputs.astype(dtype)
  both = jnp.stack([jnp.sum(jnp.square(x), axis=0), jnp.sum(x, axis=0)])
  patches = conv_patches(dataclasses.replace(stats, inputs=both))
  sums = jnp.sum(patches.reshape(2, -1, patches.shape[-1]), axis=1)
  return sums[0], sums[1], int(np.prod(patches.shape[1:-1]))


def kernel_size_of(module: Any) -> tuple[int, ...]:
  """A conv module's ``kernel_size`` as a tuple (Flax accepts an int for 1-D)."""
  size = module.kernel_size
  return (size,) if isinstance(size, int) else tuple(size)


def _settings(x: Any, nsp: int) -> tuple[int, ...]:
  """A module's strides or dilation as one int per spatial dimension (Flax's broadcast)."""
  if x is None:
    return (1,) * nsp
  if isinstance(x, int):
    return (x,) * nsp
  return tuple(int(v) for v in x)


def _padding(padding: Any, kernel_size: tuple[int, ...], kernel_dilation: tuple[int, ...],
             input_dilation: tuple[int, ...]) -> tuple[Any, str]:
  """A module's padding as ``ConvStats.padding``, or ``(None, reason)``."""
  nsp = len(kernel_size)
  if isinstance(padding, str):
    mode = padding.upper()
    if mode in ("SAME", "SAME_LOWER", "VALID"):
      return mode, ""
    if mode == "CAUSAL" and nsp == 1 and input_dilation == (1,):
      # Flax pads the input on the left by the dilated kernel's span, then runs VALID.
      return (((kernel_size[0] - 1) * kernel_dilation[0], 0),), ""
    return None, (f"padding={padding!r} (SAME, VALID, explicit pads and CAUSAL without input "
                  "dilation are supported)")
  try:
    pads = linear.canonicalize_padding(padding, nsp)
  except ValueError:
    return None, f"padding={padding!r} (not a padding Flax accepts for {nsp} dimensions)"
  return tuple((int(lo), int(hi)) for lo, hi in pads), ""


def _check_subsample(spec: base.LayerSpec, sampling: ConvSampling,
                     out_shape: tuple[int, ...]) -> int:
  s, t = sampling.num_positions, int(np.prod(out_shape))
  if s > t:
    raise ValueError(
        f"conv layer {spec.name!r}: spatial_subsample keeps num_positions={s} positions per "
        f"example, but its output has only T = {' * '.join(map(str, out_shape))} = {t}.")
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
  """The ``'conv'`` kind: ``nn.Conv`` / ``nnx.Conv`` (and their subclasses) with 1, 2 or 3
  spatial dimensions and ``G`` feature groups, a ``kernel`` ``(k..., C_in / G, C_out)`` and an
  optional ``bias`` ``(C_out,)``.

  As a matrix, per group, the kernel is ``((C_in / G) prod(k...) (+1), C_out / G)`` (a bias
  row last): channel-major ``(C_in k_h k_w, C_out)`` in 2-D, row-major in 1-D and 3-D
  (:meth:`kernel_matrix`). ``A`` is built from the input's im2col patches and ``G`` from the
  output cotangents at the ``T`` output positions, as :class:`ConvSampling` says (KFC's
  expand, SKFAC's reduce-sum or spatial subsampling; module docstring). Statistics:
  :class:`ConvStats`, also those of ``ConvTranspose`` layers. From parameter shapes it
  claims only a rank-4 kernel, as a 2-D convolution with one group.

  Listed in ``CurvatureStats.unhandled`` instead of captured: masked convolutions,
  ``'CIRCULAR'`` / ``'REFLECT'`` padding, ``'CAUSAL'`` padding other than 1-D without input
  dilation, more than 3 spatial dimensions, an input without a batch axis, a layer called more
  than once per forward pass or inside a loop over its weights, and a subclass overriding
  ``__call__`` or ``param``.

  Raises:
    ValueError: naming the layer, at a check step: statistics that are not :class:`ConvStats`,
      were captured with other spatial dimensions or groups than the layout (laid out from
      shapes, not ``captured_layers``), are not floating point, or whose inputs, cotangents
      or ``kernel_size`` do not fit the kernel (:meth:`check_stats`); under
      ``'reduce_sum'`` / ``'spatial_subsample'``, cotangents over other output positions than
      the patches', or more positions kept than the output has (:meth:`input_rows`).

  Source: Grosse & Martens, KFC, ICML 2016; Tang et al., SKFAC, CVPR 2021 (reduce-sum,
  spatial subsampling).
  """

  name = "conv"
  stats_type = ConvStats
  example_axes = {"inputs": 0, "cotangents": 1}
  linen_modules = (nn.Conv,)
  nnx_modules = (nnx.Conv,)
  he_rescaled = True

  def plan(self, module, methods, input_shape) -> base.Plan:
    del methods
    kernel_size = kernel_size_of(module)
    nsp = len(kernel_size)
    if not 1 <= nsp <= 3:
      return base.Plan(None, f"{nsp}-D convolution (1-D, 2-D and 3-D are supported)")
    if getattr(module, "mask", None) is not None:
      return base.Plan(None, "masked convolution")
    kernel_dilation = _settings(module.kernel_dilation, nsp)
    input_dilation = _settings(module.input_dilation, nsp)
    padding, reason = _padding(module.padding, kernel_size, kernel_dilation, input_dilation)
    if padding is None:
      return base.Plan(None, reason)
    if len(input_shape) < nsp + 2:
      return base.Plan(None, f"conv input of shape {input_shape} has no batch axis")
    return base.Plan(dict(
        kernel_size=tuple(int(k) for k in kernel_size), strides=_settings(module.strides, nsp),
        padding=padding, input_dilation=input_dilation, kernel_dilation=kernel_dilation,
        feature_group_count=int(module.feature_group_count)))

  def make_stats(self, inputs, cotangents, **meta) -> ConvStats:
    # Fold any extra leading batch axes into N (flax convs accept them).
    k = len(meta["kernel_size"]) + 1
    inputs = inputs.reshape((-1,) + inputs.shape[-k:])
    cotangents = cotangents.reshape((cotangents.shape[0], -1) + cotangents.shape[-k:])
    return ConvStats(inputs=inputs, cotangents=cotangents, **meta)

  def claim(self, path: tuple[str, ...],
            shapes: Mapping[str, tuple[int, ...]]) -> Optional[base.Claim]:
    """From shapes alone: a rank-4 kernel, a 2-D convolution with one group (see the module
    docstring for other ranks and grouped convolutions)."""
    del path
    kernel = shapes.get("kernel")
    if kernel is None or len(kernel) != 4 or not base.bias_fits(shapes, kernel[-1:]):
      return None
    has_bias = shapes.get("bias") == (kernel[-1],)
    return base.Claim(a_dim=int(np.prod(kernel[:-1])) + int(has_bias), g_dim=kernel[-1])

  def claim_captured(self, path, shapes, hint) -> Optional[base.Claim]:
    """With the capture's ``(spatial dimensions, feature groups)``: a kernel of rank
    ``spatial + 2``, bias or not; ``groups`` Kronecker pairs (``Claim.groups``) of dimensions
    ``prod(k...) C_in / G (+1)`` and ``C_out / G``. ``in_axes`` is a ``DenseGeneral``'s for
    1-D and 3-D kernels (their layout coincides with one), ``None`` in 2-D (as :meth:`claim`)."""
    del path
    num_spatial, groups = hint
    kernel = shapes.get("kernel")
    if kernel is None or len(kernel) != num_spatial + 2 or not set(shapes) <= {"kernel", "bias"}:
      return None
    if not base.bias_fits(shapes, kernel[-1:]) or kernel[-1] % groups:
      return None
    return base.Claim(a_dim=int(np.prod(kernel[:-1])) + int("bias" in shapes),
                      g_dim=kernel[-1] // groups,
                      in_axes=None if num_spatial == 2 else len(kernel) - 1, groups=groups)

  def per_loss_term(self, stats, num_terms, weight_sharing):
    """Unchanged, with ``num_terms`` set when the loss has other terms than the ``N`` examples:
    ``A`` divides by ``M`` in every ``conv_statistics`` mode (``A = (1/M) sum`` of the expanded
    patches, as a dense layer's, which ``'reduce_sum'`` equals on ``1 x 1`` maps and
    ``'spatial_subsample'`` estimates without bias)."""
    del weight_sharing
    return dataclasses.replace(
        stats, num_terms=base.terms_divisor(stats.inputs.shape[0], num_terms))

  def hint(self, stats: ConvStats) -> tuple:
    return (len(stats.kernel_size), int(stats.feature_group_count))

  def split_groups(self, tree, groups, axis):
    """The channels split into the groups (the default), and the statistics of one group
    marked as an ungrouped convolution."""
    out = super().split_groups(tree, groups, axis)
    if isinstance(out, ConvStats):
      out = dataclasses.replace(out, feature_group_count=1)
    return out

  def check_stats(self, spec, stats) -> None:
    super().check_stats(spec, stats)
    nsp = len(spec.kernel_shape) - 2
    if len(stats.kernel_size) != nsp or stats.feature_group_count != 1:
      raise ValueError(
          f"{dense.where(spec)}: the capture took a {len(stats.kernel_size)}-D convolution "
          f"with feature_group_count={stats.feature_group_count}, but the optimizer laid the "
          f"layer out from its parameter shapes alone as a {nsp}-D convolution with one group"
          f"{f' stack {spec.stack}' if spec.stack else ''} (shapes do not show the number of "
          "groups or of spatial dimensions). Give the optimizer the capture's layout: "
          "layers=thor_optax.captured_layers(stats), with stats from jax.eval_shape of the "
          "capture.")
    dense.check_cotangents(spec, stats)
    c_in = spec.kernel_shape[-2]
    if stats.inputs.ndim != nsp + 2:
      raise ValueError(f"{dense.where(spec)}: inputs must be (N, {nsp} spatial axes, {c_in}), "
                       f"got shape {stats.inputs.shape}.")
    if tuple(stats.kernel_size) != tuple(spec.kernel_shape[:nsp]):
      raise ValueError(f"{dense.where(spec)}: kernel_size {stats.kernel_size} does not match "
                       "the kernel.")
    dense.check_inputs(spec, stats, c_in)

  def kernel_matrix(self, kernel: jax.Array) -> jax.Array:
    """The kernel as a ``(d_in, C_out)`` matrix in the order of :func:`conv_patches`: 2-D
    ``(k_h, k_w, C_in, C_out)`` -> ``(C_in k_h k_w, C_out)``; 1-D / 3-D: row-major."""
    if kernel.ndim == 4:
      return jnp.transpose(kernel, (2, 0, 1, 3)).reshape(-1, kernel.shape[-1])
    return kernel.reshape(-1, kernel.shape[-1])

  def kernel_from_matrix(self, matrix: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if len(shape) != 4:
      return matrix.reshape(shape)
    kh, kw, cin, cout = shape
    return jnp.transpose(matrix.reshape(cin, kh, kw, cout), (1, 2, 0, 3))

  def input_rows(self, spec, stats, dtype, *, sampling=None, key=None) -> base.FactorRows:
    """Rows of ``A``: ``'expand'`` ``(N T, d)`` and ``1 / M``; ``'reduce_sum'`` ``(N, d)``
    (summed patches, bias entry ``T``) and ``1 / (M T)``; ``'spatial_subsample'`` ``(N s, d)``
    and ``T / (M s)``, with ``d = C_in prod(k...) (+1)`` (of one group, per group) and ``M``
    the loss terms (``N`` for a loss per example, else ``num_terms``).

    Raises:
      ValueError: if ``'spatial_subsample'`` asks for more positions than the output has, or the
        cotangents' spatial shape differs from the patches' (naming the layer).
    """
    sampling = sampling or ConvSampling()
    n = stats.inputs.shape[0]
    m = base.a_divisor(stats, n)  # the loss terms (N for a loss per example)
    patches = conv_patches(stats)
    if sampling.mode == "expand":
      rows = patches.reshape(-1, patches.shape[-1]).astype(dtype)
      rows = dense.with_ones(rows) if spec.has_bias else rows
      return base.FactorRows(rows, jnp.asarray(1.0 / m, dtype))
    t = _conv_positions(spec, stats, patches.shape[1:-1])
    x = patches.reshape(n, t, patches.shape[-1]).astype(dtype)
    if sampling.mode == "reduce_sum":
      rows = jnp.sum(x, axis=1)
      if spec.has_bias:
        rows = jnp.concatenate([rows, jnp.full_like(rows[:, :1], t)], axis=1)
      return base.FactorRows(rows, jnp.asarray(1.0 / (m * t), dtype))
    s = _check_subsample(spec, sampling, patches.shape[1:-1])
    idx = subsample_positions(key, n, t, s)
    rows = jnp.take_along_axis(x, idx[:, :, None], axis=1).reshape(n * s, x.shape[-1])
    rows = dense.with_ones(rows) if spec.has_bias else rows
    return base.FactorRows(rows, jnp.asarray(t / (m * s), dtype))

  def input_moments(self, spec, stats, dtype, *, sampling=None):
    """``'expand'``: the column moments of :meth:`input_rows`' rows from
    :func:`patch_moments` (the bias column's: ``R`` and ``R``), without forming the patches;
    the other modes: ``None`` (their rows are few)."""
    if (sampling or ConvSampling()).mode != "expand":
      return None
    squares, sums, t = patch_moments(stats, dtype)
    if not spec.has_bias:
      return squares, sums
    count = jnp.full((1,), stats.inputs.shape[0] * t, dtype)
    return jnp.concatenate([squares, count]), jnp.concatenate([sums, count])

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
    s = _check_subsample(spec, sampling, stats.cotangents.shape[2:-1])
    idx = subsample_positions(key, n, t, s)
    rows = explicit.flatten_rows(jnp.take_along_axis(g, idx[None, :, :, None], axis=2))
    return base.FactorRows(rows, jnp.asarray(1.0 / (n * s), dtype))
