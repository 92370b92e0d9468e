"""Weights shared over the iterations of a lifted loop: K-FAC-reduce over the iterations.

A recurrent cell under ``nn.RNN`` / ``nn.scan`` / ``nnx.scan`` (``variable_broadcast='params'``)
applies one set of weights at every time step, and a layer broadcast into ``nn.vmap`` /
``nnx.vmap`` applies them at every mapped index: a linear layer with weights shared over the
``T`` iterations (Eschenhagen et al., NeurIPS 2023). Its per-iteration inputs and output
cotangents live inside the loop, which returns only what the model returns, so they cannot be
recorded row by row; what crosses the loop boundary is the gradient of whatever the loop body
closes over, summed over the iterations. The capture therefore gives such a layer three zero
channels that the loop body reads as loop invariants (through the layer's ``params`` scope in
linen, as ``nnx.Param`` variables in NNX):

* ``cotangents``, added to the layer's output: its gradient is ``sum_t g_t`` ``(N, ..., d_out)``;
* ``inputs``, passed with the layer's input through :func:`tap`, the identity whose backward pass
  gives this channel the input itself: its gradient is ``sum_t a_t`` ``(N, ..., d_in)``;
* ``steps``, through the same :func:`tap`, whose backward pass gives it 1: its gradient is
  ``T``.

These are exactly K-FAC-reduce's sufficient statistics (Eschenhagen et al. 2023, section 3.2:
per example, inputs averaged and cotangents summed over the shared dimension): :func:`stats`
builds the layer kind's statistics from ``a_bar = sum_t a_t / T`` and
``g_hat = sqrt(N / M) sum_t g_t`` (``M`` loss terms), the same as ``reduce_positions`` gives
for rows that were recorded. One backward pass, no extra memory beyond the layer's own
residuals. K-FAC-expand needs every iteration's rows, which do not leave the loop, so a
capture with ``weight_sharing='expand'`` lists such a layer with that reason, and ``'auto'``
uses reduce for it (expand for positions inside one call).

Only kinds whose statistics are linear in the recorded input (:attr:`LayerKind.reduces_steps`:
dense, ``DenseGeneral``, einsum) are taken; a normalization layer or an embedding inside a
loop is listed with the reason.

References:
  Eschenhagen, Immer, Turner, Schneider & Hennig, "Kronecker-Factored Approximate Curvature for
  Modern Neural Network Architectures", NeurIPS 2023, sections 2.2 and 3.2.
  kfac-jax ``tracer.py``: zero perturbations of layer outputs give output cotangents in one vjp.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from thor_optax._src.layers import base as layer_base


class StepChannels(NamedTuple):
  """The zero channels of a layer shared over a loop's iterations (and, as the ``jax.vjp``
  gives them back, their gradients: the sums over the iterations).

  Attributes:
    inputs: ``(N, ..., d_in)`` zeros shaped like one iteration's input; gradient
      ``sum_t a_t``.
    cotangents: ``(N, ..., d_out)`` zeros shaped like one iteration's output; gradient
      ``sum_t g_t``.
    steps: ``()`` float32 zero; gradient ``T``, the number of iterations.
  """

  inputs: jax.Array
  cotangents: jax.Array
  steps: jax.Array


def channels(input_shape: tuple[int, ...], out: jax.ShapeDtypeStruct) -> StepChannels:
  """Zero :class:`StepChannels` for a layer whose one iteration sees inputs of
  ``input_shape`` and gives ``out``."""
  return StepChannels(jnp.zeros(input_shape, out.dtype), jnp.zeros(out.shape, out.dtype),
                      jnp.zeros((), jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap(dtype: Any, y: jax.Array, x: jax.Array, inputs: jax.Array,
         steps: jax.Array) -> jax.Array:
  del dtype, x, inputs, steps
  return y


def _tap_fwd(dtype, y, x, inputs, steps):
  del dtype, inputs, steps
  return y, x


def _tap_bwd(dtype, x, ct):
  x = jax.lax.stop_gradient(x)
  # 1 for this iteration, computed from x so that under a vmap it is mapped like x and the
  # transpose sums it over the mapped axis (a constant would count one iteration).
  v = x.reshape(-1)[0]
  one = jnp.where(v == v, 1.0, 1.0).astype(jnp.float32)
  return ct, jnp.zeros_like(x), x.astype(dtype), one


_tap.defvjp(_tap_fwd, _tap_bwd)


def tap(y: jax.Array, x: jax.Array, ch: StepChannels) -> jax.Array:
  """One iteration's output ``y`` with the channels attached: ``y + ch.cotangents``, which is
  ``y``; in the backward pass ``ch.inputs`` receives ``x`` (the iteration's input, its own
  cotangent untouched) and ``ch.steps`` 1, so that the loop sums them over its iterations.

  Raises:
    ValueError: if ``x`` is not shaped like ``ch.inputs``.
  """
  if tuple(x.shape) != tuple(ch.inputs.shape):
    raise ValueError(f"thor_optax capture: a layer shared over a loop's iterations got input "
                     f"{x.shape} where its first call had {ch.inputs.shape}.")
  return _tap(np.dtype(ch.inputs.dtype), y, x, ch.inputs, ch.steps) + ch.cotangents


def plan(kind: layer_base.LayerKind, plan_: layer_base.Plan, over: str, stack: tuple[int, ...],
         weight_sharing: str) -> layer_base.Plan:
  """The plan of a layer whose weights ``over`` (``'nn.scan'``, ``'nnx.vmap'``, ...) applies at
  every iteration: unchanged (captured, K-FAC-reduce over the iterations) when the kind
  :attr:`~LayerKind.reduces_steps`, the layer is not itself one of a stack and the capture's
  ``weight_sharing`` is not ``'expand'``; else listed with the reason."""
  if plan_.meta is None:
    return plan_
  what = (f"its weights are shared by every iteration of {over} (a recurrent cell, or a layer "
          "mapped over a dimension)")
  if not kind.reduces_steps:
    return layer_base.Plan(None, f"{what}: a {kind.name!r} layer is folded over the iterations "
                           "only for kinds whose statistics are linear in the input (dense, "
                           "DenseGeneral, einsum)")
  if stack:
    return layer_base.Plan(None, f"{what} and stacked {stack}: not preconditioned")
  if weight_sharing == "expand":
    return layer_base.Plan(None, (
        f"{what}: weight_sharing='expand' needs every iteration's rows, which do not leave "
        "the loop; use weight_sharing='auto' or 'reduce' (K-FAC-reduce over the iterations)"))
  return plan_


def stats(kind: layer_base.LayerKind, meta: dict, sums: StepChannels, cotangents: jax.Array,
          num_terms: int) -> Any:
  """The kind's statistics of a layer shared over ``T`` iterations (K-FAC-reduce).

  Args:
    kind: the layer's kind (:attr:`~LayerKind.reduces_steps`).
    meta: the static metadata of its statistics (the plan's).
    sums: the channels' gradients: ``inputs`` ``sum_t a_t`` ``(N, ..., d_in)``, ``steps`` ``T``.
    cotangents: ``sum_t g_t`` per cotangent sample, ``(S, N, ..., d_out)``, per loss term as
      the capture scales every layer's.
    num_terms: ``M``, the loss terms.

  Returns:
    ``kind.make_stats(a_bar, g_hat)`` with ``a_bar = sum_t a_t / T`` and
    ``g_hat = sqrt(N / M) sum_t g_t``, then the kind's reduce of any positions inside one
    iteration (:meth:`LayerKind.per_loss_term`).
  """
  n = sums.inputs.shape[0]
  a_bar = sums.inputs / sums.steps.astype(sums.inputs.dtype)
  g_hat = cotangents * jnp.sqrt(jnp.asarray(n / num_terms, cotangents.dtype))
  return kind.per_loss_term(kind.make_stats(a_bar, g_hat, **meta), n, "reduce")
