"""Transposed convolutions, ``nn.ConvTranspose`` and ``nnx.ConvTranspose``: captured as the
convolutions they are.

Flax computes a transposed convolution (``transpose_kernel=False``, its default) as
``lax.conv_transpose``, which is ``lax.conv_general_dilated`` with the same kernel ``(k...,
C_in, C_out)``, unit window strides, the input dilated by the layer's strides
(``lhs_dilation``) and padded by

* ``'SAME'`` / ``'VALID'``: per spatial dimension, with ``k' = (k - 1) d + 1`` the dilated
  kernel's span and ``s`` the stride, ``'SAME'``: ``(k' - 1, s - 1)`` if ``s > k' - 1``, else
  ``(ceil((k' + s - 2) / 2), floor((k' + s - 2) / 2))``; ``'VALID'``: ``(k' - 1, s - 1 +
  max(k' - s, 0))`` (``lax``'s ``_conv_transpose_padding``);
* explicit pads ``((lo, hi), ...)``: those pads as they are.

So the layer is a :class:`~thor_optax._src.layers.conv.Conv` on the dilated input, and its
statistics are :class:`~thor_optax._src.layers.conv.ConvStats` with ``strides`` ones,
``input_dilation`` the layer's strides and those explicit pads: the factors (im2col patches of
the dilated input, KFC), the kernel matrix and every transform are the convolution's, and the
optimizer's layout from shapes (a rank-4 kernel is a 2-D convolution) is already the right one.
Of 1-D and 3-D ones, as of convolutions, those without bias need
``layers=thor_optax.captured_layers(stats)``.

Not captured (listed with the reason): ``transpose_kernel=True`` (a spatially flipped kernel
with its channel axes swapped), masked kernels, and ``'CIRCULAR'`` or other string paddings.

References:
  Dumoulin & Visin, "A guide to convolution arithmetic for deep learning", 2016, section 4
  (a transposed convolution as a convolution of the zero-dilated input).
  Grosse & Martens, "A Kronecker-factored approximate Fisher matrix for convolution layers",
  ICML 2016 (the factors).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
from flax import nnx
from flax.linen import linear

from thor_optax._src.layers import base
from thor_optax._src.layers import conv


def transpose_padding(span: int, stride: int, mode: str) -> tuple[int, int]:
  """The ``(lo, hi)`` padding of the dilated input of a transposed convolution with string
  padding ``'SAME'`` or ``'VALID'``, for a kernel of dilated span ``span`` and stride ``stride``
  (as ``lax.conv_transpose`` computes it)."""
  if mode == "SAME":
    total = span + stride - 2
    lo = span - 1 if stride > span - 1 else math.ceil(total / 2)
  else:  # VALID
    total = span + stride - 2 + max(span - stride, 0)
    lo = span - 1
  return lo, total - lo


class ConvTranspose(conv.Conv):
  """The ``'conv_transpose'`` kind: ``nn.ConvTranspose`` / ``nnx.ConvTranspose`` (and their
  subclasses) with ``transpose_kernel=False`` and 1-3 spatial dimensions, a ``kernel``
  ``(k..., C_in, C_out)`` and an optional ``bias`` ``(C_out,)``.

  The layer is captured as the convolution it is, of the input dilated by its strides (module
  docstring): its statistics are :class:`~thor_optax._src.layers.conv.ConvStats` (``strides``
  ones, ``input_dilation`` the layer's strides, explicit pads), so the kernel matrix
  ``(C_in prod(k...) (+1), C_out)`` and the factors (``A`` from im2col patches of the dilated
  input, ``G`` from the output cotangents) are :class:`~thor_optax._src.layers.conv.Conv`'s,
  which also claims the kernel and checks the statistics: this kind only plans the capture.

  Listed in ``CurvatureStats.unhandled`` instead of captured: ``transpose_kernel=True``, masked
  kernels, string paddings other than ``'SAME'`` / ``'VALID'`` (``'CIRCULAR'``), pads Flax does
  not accept, more than 3 spatial dimensions, an input without a batch axis, a layer called
  more than once per forward pass or inside a loop over its weights, and a subclass
  overriding ``__call__`` or ``param``.

  Raises:
    ValueError: as :class:`~thor_optax._src.layers.conv.Conv`, whose checks its statistics go
      through.

  Source: Grosse & Martens, KFC, ICML 2016 (the factors); Dumoulin & Visin, "A guide to
  convolution arithmetic for deep learning", 2016 (a transposed convolution as a convolution
  of the zero-dilated input).
  """

  name = "conv_transpose"
  linen_modules = (nn.ConvTranspose,)
  nnx_modules = (nnx.ConvTranspose,)

  def plan(self, module, methods, input_shape) -> base.Plan:
    del methods
    kernel_size = conv.kernel_size_of(module)
    nsp = len(kernel_size)
    if not 1 <= nsp <= 3:
      return base.Plan(None, f"{nsp}-D transposed convolution (1-D, 2-D and 3-D are supported)")
    if module.transpose_kernel:
      return base.Plan(None, "transpose_kernel=True (a flipped kernel; False, Flax's default, "
                             "is supported)")
    if getattr(module, "mask", None) is not None:
      return base.Plan(None, "masked transposed convolution")
    if len(input_shape) < nsp + 2:
      return base.Plan(None, f"transposed conv input of shape {input_shape} has no batch axis")
    strides = conv._settings(module.strides, nsp)  # pylint: disable=protected-access
    kernel_dilation = conv._settings(  # pylint: disable=protected-access
        module.kernel_dilation, nsp)
    padding = module.padding
    if isinstance(padding, str) and padding.upper() in ("SAME", "VALID"):
      spans = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]
      pads = tuple(transpose_padding(k, s, padding.upper()) for k, s in zip(spans, strides))
    elif isinstance(padding, str):
      return base.Plan(None, f"padding={padding!r} (SAME, VALID and explicit pads are "
                             "supported for transposed convolutions)")
    else:
      pads = _explicit_pads(padding, nsp)
      if pads is None:
        return base.Plan(None, f"padding={padding!r} (not a padding Flax accepts for {nsp} "
                               "dimensions)")
    return base.Plan(dict(
        kernel_size=tuple(int(k) for k in kernel_size), strides=(1,) * nsp, padding=pads,
        input_dilation=strides, kernel_dilation=kernel_dilation, feature_group_count=1))

  def claim(self, path, shapes) -> Optional[base.Claim]:
    """``None``: the kernel is claimed by :class:`~thor_optax._src.layers.conv.Conv`, whose
    layout it has (this kind only plans the capture)."""
    del path, shapes
    return None

  def claim_captured(self, path, shapes, hint) -> Optional[base.Claim]:
    del path, shapes, hint
    return None


def _explicit_pads(padding: Any, nsp: int) -> Optional[tuple[tuple[int, int], ...]]:
  try:
    pads = linear.canonicalize_padding(padding, nsp)
  except ValueError:
    return None
  if isinstance(pads, str):
    return None
  return tuple((int(lo), int(hi)) for lo, hi in pads)
