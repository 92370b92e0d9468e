"""``clip_by_weight_ratio``: a step no longer than a share of each kernel's norm.

The KL clip (:mod:`kl_clip`) bounds ``lr^2 <u, g>``, the change of the model's outputs that the
curvature *predicts*. Along directions where the damped curvature is tiny (``lambda = 1e-4``
and factors from few rows) a long step is cheap by that measure, and momentum adds up ten such
steps: on the MNIST CNN's learning-rate x damping grid of ``benchmarks/robustness.py`` (KAISA,
lr 0.003, damping 1e-4) the steps of the dense kernels and the second convolution's were 20-30%
of the kernel's norm from the second or third step on (about 3% at the tuned setting), the loss
rose from step 4 and reached 320 (benchmarks/README.md, "Robustness"). This clip bounds the step
itself, layer by layer: each kernel's update ``u`` (after the learning rate and momentum) is
scaled by

    min(1, max_ratio * max(|w|, eps_rms * sqrt(size(w))) / |u|),

a trust region relative to the kernel's own scale (Frobenius norms over one layer's kernel; a
stack of layers, ``nn.scan``, layer by layer). Only leaves of two or more dimensions are
clipped (kernels, convolution kernels, embeddings); biases and normalization scales, often
zero or one at initialization, pass through. ``eps_rms`` lets a
kernel initialized to zeros (a transformer's zero-initialized head) take steps of RMS
``max_ratio * eps_rms`` per entry instead of none.

Unlike ``optax.adaptive_grad_clip`` (Brock et al. 2021), which clips unit by unit (each output
unit's column), the clip is over the whole kernel: unit-wise at the same ratio 0.1 it also fixed
that run but cost KAISA steps at its tuned settings (the MNIST CNN to 95% in 128 steps, mean of
6 seeds, against 110), where the whole-kernel clip never acted (the same steps on every seed).

References:
  You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (LARS), 2017: the
  ratio of update to weight norm per layer, there used to scale the step, here to clip it.
  Brock et al., "High-Performance Large-Scale Image Recognition Without Normalization", ICML
  2021 (adaptive gradient clipping, unit-wise).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from thor_optax._src import blocks
from thor_optax._src import static_args
from thor_optax._src import stats as stats_lib


def _norm(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  # Elementwise squares and a sum (not jnp.linalg.norm): kernels split over a mesh axis with an
  # explicit sharding reduce without a dot product over the sharded axis.
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=True))


def stacked_axes(params: Any, layers: Optional[Any] = None) -> dict[tuple[str, ...], int]:
  """``{module path: number of leading stack axes}`` of the layers the preconditioners lay out
  (``blocks.build_layout``): an ``nn.scan`` stack of ``L`` layers has one, its kernel ``(L,
  d_in, d_out)``; modules no layer kind claims are absent (their leaves count as one layer)."""
  layout = blocks.build_layout(params, None,
                               captured=None if layers is None else layers.kinds)
  return {spec.path: len(spec.stack) - (spec.groups > 1) for spec in layout.layers}


def clip_by_weight_ratio(max_ratio: Any, eps_rms: float = 1e-2, layers: Optional[Any] = None
                         ) -> optax.GradientTransformation:
  """Scales each kernel's update to at most ``max_ratio`` times the kernel's norm.

  Chain it last, after the learning rate (the aliases' ``max_update_ratio``), so that it bounds
  the step that is applied: ``u_l <- u_l * min(1, c * max(|w_l|, eps_rms sqrt(n_l)) / |u_l|)``
  for every layer's kernel ``l`` of ``ndim >= 2`` (``n_l`` entries, Frobenius norms); other
  leaves are unchanged. A stack of layers (``nn.scan``, ``nn.vmap``; laid out as the
  preconditioners lay it out) is clipped layer by layer, as the unrolled layers would be; a
  parameter no layer kind claims is one kernel. Stateless (``optax.EmptyState``).

  Args:
    max_ratio: ``c > 0`` (float or a traced scalar, e.g. from ``optax.inject_hyperparams``):
      the largest step as a share of the kernel's norm, per step.
    eps_rms: ``>= 0``; a kernel's norm counts as at least ``eps_rms`` per entry (RMS), so a
      zero kernel takes steps of RMS up to ``c * eps_rms``.
    layers: ``thor_optax.captured_layers(stats)`` as given to the preconditioner, or ``None``
      (layers claimed from parameter shapes).

  Returns:
    an ``optax.GradientTransformation``; ``update`` needs ``params``.

  Raises:
    TypeError: ``max_ratio`` or ``eps_rms`` not a number (a string, ``None``; at construction).
    ValueError: ``max_ratio`` a number (Python, numpy, 0-d array) that is not finite and
      positive, ``eps_rms`` one negative or not finite, or ``layers`` neither ``None`` nor
      :class:`thor_optax.CapturedLayers` (at construction); ``params`` missing (at
      ``update``).

  Source: module docstring (a layer-wise trust region as in LARS, You et al. 2017).
  """
  static_args.check_number("clip_by_weight_ratio", "max_ratio", max_ratio,
                           lambda v: 0 < v < math.inf, "finite and > 0",
                           advice="Pass None to the alias's max_update_ratio for no clip.")
  static_args.check_number("clip_by_weight_ratio", "eps_rms", eps_rms,
                           lambda v: 0 <= v < math.inf, "finite and >= 0")
  if layers is not None and not isinstance(layers, stats_lib.CapturedLayers):
    raise ValueError(
        f"thor_optax.clip_by_weight_ratio: layers must be None or "
        f"thor_optax.captured_layers(stats), got {type(layers).__name__}; build it from the "
        f"statistics of one capture.")

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("thor_optax.clip_by_weight_ratio needs the parameters: call "
                       "update(updates, state, params).")
    stacked = stacked_axes(params, layers)

    def clip(path, u, w):
      lead = stacked.get(stats_lib.path_keys(path)[:-1], 0)
      if u is None or jnp.ndim(u) - lead < 2:
        return u
      axes = tuple(range(lead, u.ndim))
      limit = max_ratio * jnp.maximum(_norm(w, axes),
                                      eps_rms * math.sqrt(math.prod(u.shape[lead:])))
      norm = _norm(u, axes)
      scale = jnp.where(norm > limit, limit / jnp.where(norm > 0, norm, 1.0), 1.0)
      return (u * scale).astype(u.dtype)

    return jax.tree_util.tree_map_with_path(clip, updates, params,
                                            is_leaf=lambda x: x is None), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
