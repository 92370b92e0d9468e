"""``rescale_weight_norms``: SP-NGD's rescaling of kernel norms after each step.

SP-NGD trains without weight decay; instead, after each update, the weights of convolution and
fully connected layers are rescaled to the norm their He initialization has in expectation:
with ``Var(w_ij) = 2 / fan_in`` a kernel of ``fan_in * d_out`` entries has
``E ||W||_F^2 = 2 d_out``. Here the norm is capped at ``sqrt(2 d_out)``: a kernel whose new
value ``W + dW`` is longer is shrunk onto the sphere, a shorter one is left alone. Biases and
the parameters of normalization layers are not rescaled.

References:
  Osawa et al., "Scalable and Practical Natural Gradient for Large-Scale and Large-Batch
  Deep Learning", TPAMI 2020 (weight rescaling), and its implementation chainerkfac
  (``NormalizeWeightUR``).
  He et al., "Delving Deep into Rectifiers", ICCV 2015 (the initialization's variance).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from thor_optax._src import blocks
from thor_optax._src import static_args
from thor_optax._src import stats as stats_lib


def he_norm(shape: tuple[int, ...]) -> float:
  """``sqrt(2 d_out)`` with ``d_out = shape[-1]``: the expected Frobenius norm of a He-normal
  kernel of ``shape`` (dense ``(d_in, d_out)``, conv HWIO)."""
  return math.sqrt(2.0 * shape[-1])


def rescaled_weights(params: Any, layers: Optional[Any] = None) -> dict[tuple[str, ...], int]:
  """``{key path: number of leading stack axes}`` of the weights whose norm is capped: the
  weight leaf of every layer the preconditioners lay out (``blocks.build_layout``; with
  ``layers``, the captured ones) whose kind is ``he_rescaled`` (dense and convolution kernels).
  An ``nn.scan`` / ``nn.vmap`` stack of ``L`` layers, kernel ``(L, d_in, d_out)``, has one
  stack axis: each of its layers is capped on its own, as the unrolled layers would be."""
  layout = blocks.build_layout(params, None,
                               captured=None if layers is None else layers.kinds)
  return {spec.path + (spec.kind.weight,): len(spec.stack) - (spec.groups > 1)
          for spec in layout.layers if spec.kind.he_rescaled}


def rescale_weight_norms(
    max_norm: Optional[Callable[[tuple[int, ...]], float]] = None,
    layers: Optional[Any] = None,
) -> optax.GradientTransformation:
  """Caps the Frobenius norm of every kernel after the step (SP-NGD's weight rescaling).

  For the weight of every layer whose kind is He-rescaled (the registered layer kinds with
  ``he_rescaled``: dense ``(d_in, d_out)`` and conv HWIO ``(k_h, k_w, C_in, C_out)`` kernels): with
  ``w = param + update`` and the cap ``c = max_norm(param.shape)`` (default
  ``sqrt(2 * shape[-1])``), if ``||w||_F > c`` the update becomes ``(c / ||w||_F) * w - param``, so
  that the new parameter ``param + update`` has norm ``c`` (up to rounding); otherwise the update is
  unchanged. Other leaves (biases, normalization scales and offsets, embeddings, rank-1 ``kernel``
  leaves) are unchanged, as are kernels whose ``w`` is not finite. Norms are computed in at least
  float32; the update keeps its dtype. A stack of layers (``nn.scan``, ``nn.vmap``: a kernel
  ``(L, d_in, d_out)``, laid out as the preconditioners lay it out) is capped layer by layer, each
  at ``max_norm`` of one layer's shape, as the unrolled layers would be.

  Put it last in the chain, after the learning rate and momentum (its updates are the final
  parameter increments), e.g. ``optax.chain(scale_by_kfac(...), optax.sgd(lr, 0.9),
  rescale_weight_norms())``; it replaces weight decay.

  Args:
    max_norm: ``shape -> cap`` (a positive float; the shape is the kernel's, a tuple of ints),
      or ``None`` for ``sqrt(2 d_out)`` with ``d_out = shape[-1]``.
    layers: ``thor_optax.captured_layers(stats)`` as given to the preconditioner, or ``None``
      (layers claimed from parameter shapes).

  Returns:
    a stateless ``optax.GradientTransformation`` (state ``optax.EmptyState``).

  Raises:
    TypeError: at construction, if ``max_norm`` is neither ``None`` nor callable (a number:
      pass ``lambda shape: c``); in ``update``, if it returns no number.
    ValueError: at construction, if ``layers`` is neither ``None`` nor
      :class:`thor_optax.CapturedLayers`; in ``update``, if ``params`` is ``None``, or if
      ``max_norm`` returns a number (Python, numpy, 0-d array) that is not positive.

  References:
    Osawa et al., "Scalable and Practical Natural Gradient", TPAMI 2020; chainerkfac
    ``NormalizeWeightUR``.
  """
  if max_norm is not None and not callable(max_norm):
    raise TypeError(
        f"thor_optax.rescale_weight_norms: max_norm must be None or a function shape -> cap, "
        f"got {type(max_norm).__name__} {max_norm!r}; for one cap c of every kernel pass "
        f"lambda shape: c.")
  if layers is not None and not isinstance(layers, stats_lib.CapturedLayers):
    raise ValueError(
        f"thor_optax.rescale_weight_norms: layers must be None or "
        f"thor_optax.captured_layers(stats), got {type(layers).__name__}; build it from the "
        f"statistics of one capture.")
  cap_of = he_norm if max_norm is None else max_norm

  def init_fn(params):
    del params
    return optax.EmptyState()

  def rescale(weights, path, update, param):
    if update is None or stats_lib.path_keys(path) not in weights:
      return update
    lead = weights[stats_lib.path_keys(path)]
    shape = tuple(int(s) for s in jnp.shape(param)[lead:])
    cap = cap_of(shape)
    number = static_args.real_value(cap)
    if number is None and not isinstance(cap, (jax.Array, np.ndarray)):
      raise TypeError(f"thor_optax.rescale_weight_norms: max_norm must return a positive "
                      f"number, got {type(cap).__name__} {cap!r} for the kernel at "
                      f"{jax.tree_util.keystr(path)} of shape {shape}.")
    if number is not None and not number > 0:
      raise ValueError(f"thor_optax.rescale_weight_norms: max_norm must return a positive "
                       f"number, got {cap!r} for the kernel at {jax.tree_util.keystr(path)} "
                       f"of shape {shape}.")
    update = jnp.asarray(update)
    param = jnp.asarray(param)
    dtype = jnp.promote_types(jnp.promote_types(param.dtype, update.dtype), jnp.float32)
    p, w = param.astype(dtype), param.astype(dtype) + update.astype(dtype)
    norm = jnp.sqrt(jnp.sum(w * w, axis=tuple(range(lead, w.ndim)), keepdims=True))
    cap = jnp.asarray(cap, dtype)
    shrink = jnp.isfinite(norm) & (norm > cap)
    rescaled = (cap / jnp.where(shrink, norm, 1.0)) * w - p
    return jnp.where(shrink, rescaled.astype(update.dtype), update)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
          "rescale_weight_norms needs the current parameters: pass params to update, e.g. "
          "tx.update(grads, state, params).")
    weights = rescaled_weights(params, layers)
    new_updates = jax.tree_util.tree_map_with_path(
        functools.partial(rescale, weights), updates, params, is_leaf=lambda x: x is None)
    return new_updates, state

  return optax.GradientTransformation(init_fn, update_fn)
