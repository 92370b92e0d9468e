"""``GroupNorm`` and ``RMSNorm`` (linen and NNX) as normalization layers, against float64
references.

* capture: the ``NormStats`` of ``nn.GroupNorm`` / ``nn.RMSNorm`` and ``nnx.GroupNorm`` /
  ``nnx.RMSNorm`` (channels last, over images and sequences, with and without bias) equal the
  per-example gradients of the layer's scale and bias computed independently, by ``jax.vmap``
  of ``jax.grad`` over one-example batches of the model, and the bias gradients of a layer
  without bias are zeros;
* one ``scale_by_thor`` / ``scale_by_kfac`` update of a model holding the layer: per channel,
  ``(F_c + lambda I)^-1 (g_scale_c, g_bias_c)`` with ``F_c`` the 2x2 Fisher of those
  independent per-example gradients; for a layer without bias (``RMSNorm``, ``use_bias=False``)
  the 1x1 ``g_scale_c / (F_ss + lambda)``, and its damped inverse is
  ``diag(1 / (F_ss + lambda), 1 / lambda)``, also from statistics whose ``bias_grads`` are not
  zero;
* a ``GroupNorm`` whose statistics run over the batch axis (``reduction_axes`` holding 0):
  the captured gradients against ``jax.jacrev`` of the per-example losses of the whole batch,
  as for a training-mode ``BatchNorm``;
* layouts the kind does not support are listed in ``stats.unhandled`` with the reason, and a
  layer without scale and bias is skipped.
"""

import functools

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
from thor_optax import flax as thor_linen
from thor_optax import nnx as thor_nnx

from reference import F64, init_params, randn, squared_error
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)

pytestmark = pytest.mark.usefixtures("fast_compiles")

TIGHT = dict(rtol=1e-10, atol=1e-12)
LAM = 0.05
C = 4  # channels of the normalization layer

# name: (linen layer, NNX layer (num_features, rngs) -> module, input shape, has bias)
CASES = {
    "groupnorm_nhwc": (
        lambda: nn.GroupNorm(num_groups=2, name="norm"),
        lambda c, rngs: nnx.GroupNorm(c, num_groups=2, param_dtype=F64, rngs=rngs),
        (5, 3, 3, 2), True),
    "groupnorm_sequence_no_bias": (
        lambda: nn.GroupNorm(num_groups=None, group_size=1, use_bias=False, name="norm"),
        lambda c, rngs: nnx.GroupNorm(c, num_groups=None, group_size=1, use_bias=False,
                                      param_dtype=F64, rngs=rngs),
        (5, 4, 3), False),
    "rmsnorm_sequence": (
        lambda: nn.RMSNorm(name="norm"),
        lambda c, rngs: nnx.RMSNorm(c, param_dtype=F64, rngs=rngs),
        (5, 4, 3), False),
    "rmsnorm_rank2": (
        lambda: nn.RMSNorm(name="norm"),
        lambda c, rngs: nnx.RMSNorm(c, param_dtype=F64, rngs=rngs),
        (5, 3), False),
}


def _head_input(h):
  """tanh, then the mean over the positions between the batch and channel axes."""
  h = jnp.tanh(h)
  return h.mean(axis=tuple(range(1, h.ndim - 1))) if h.ndim > 2 else h


class LinenNet(nn.Module):
  """``Dense(4) -> norm -> tanh (-> mean over positions) -> Dense(3)``."""
  case: str

  @nn.compact
  def __call__(self, x):
    h = CASES[self.case][0]()(nn.Dense(C, name="dense_in")(x))
    return nn.Dense(3, name="head")(_head_input(h))


class NnxNet(nnx.Module):
  """The NNX counterpart of :class:`LinenNet`."""

  def __init__(self, case, d_in, rngs):
    self.dense_in = nnx.Linear(d_in, C, param_dtype=F64, rngs=rngs)
    self.norm = CASES[case][1](C, rngs)
    self.head = nnx.Linear(C, 3, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    return self.head(_head_input(self.norm(self.dense_in(x))))


def _data(case):
  shape = CASES[case][2]
  return jnp.asarray(randn(1, shape)), jnp.asarray(randn(2, (shape[0], 3)))


def _linen_problem(case):
  model = LinenNet(case)
  x, y = _data(case)
  return model, init_params(model, x), x, y


def _nnx_model(case, x):
  """An :class:`NnxNet` with random (float64) norm scale and bias, so neither is trivial."""
  model = NnxNet(case, x.shape[-1], nnx.Rngs(0))
  rng = np.random.default_rng(7)
  model.norm.scale[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(C), F64)
  if CASES[case][3]:
    model.norm.bias[...] = jnp.asarray(0.3 * rng.standard_normal(C), F64)
  return model


def _leaf(x):
  return np.asarray(x[...] if isinstance(x, nnx.Variable) else x)


def _per_example_linen(model, params, x, y):
  """``{leaf: (N, C)}`` gradients of each example's loss (a one-example batch) w.r.t. the norm
  layer's leaves: ``jax.vmap`` of ``jax.grad``."""
  def loss_one(norm, xn, yn):
    out = model.apply({"params": {**params, "norm": norm}}, xn[None])
    return squared_error(out, yn[None])

  return jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))(params["norm"], x, y)


def _per_example_nnx(model, x, y):
  """:func:`_per_example_linen` for an NNX model (functional ``split`` / ``merge``)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_one(p, xn, yn):
    return squared_error(nnx.merge(graphdef, p, rest, copy=True)(xn[None]), yn[None])

  per = jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))(params, x, y)
  return {leaf: v for leaf, v in per["norm"].items()}


def _check_stats(layer, per, has_bias, n):
  assert isinstance(layer, thor_optax.NormStats)
  assert layer.scale_grads.shape == layer.bias_grads.shape == (1, n, C)
  scale = _leaf(per["scale"])
  assert np.abs(scale).max() > 1e-3  # the comparison is not between zeros
  np.testing.assert_allclose(layer.scale_grads[0], scale, **TIGHT)
  if has_bias:
    np.testing.assert_allclose(layer.bias_grads[0], _leaf(per["bias"]), **TIGHT)
  else:
    assert "bias" not in per
    np.testing.assert_array_equal(layer.bias_grads, np.zeros((1, n, C)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_linen_stats_are_per_example_gradients(case):
  model, params, x, y = _linen_problem(case)
  capture = thor_linen.value_and_grad_with_stats(model, squared_error)

  @jax.jit
  def run(params, x, y):
    return capture(params, x, y), _per_example_linen(model, params, x, y)

  ((_, grads), stats), per = run(params, x, y)
  assert stats.unhandled == ()
  assert set(stats.layers) == {"dense_in", "norm", "head"}
  _check_stats(stats.layers["norm"], per, CASES[case][3], x.shape[0])
  # the mean loss's gradient is the mean of the per-example ones
  np.testing.assert_allclose(grads["norm"]["scale"], _leaf(per["scale"]).mean(0), **TIGHT)


@pytest.mark.parametrize("case", sorted(CASES))
def test_nnx_stats_are_per_example_gradients(case):
  x, y = _data(case)
  model = _nnx_model(case, x)
  capture = thor_nnx.value_and_grad_with_stats(squared_error)

  @nnx.jit
  def run(model, x, y):
    return capture(model, x, y), _per_example_nnx(model, x, y)

  ((_, grads), stats), per = run(model, x, y)
  assert stats.unhandled == ()
  assert set(stats.layers) == {"dense_in", "norm", "head"}
  _check_stats(stats.layers["norm"], per, CASES[case][3], x.shape[0])
  np.testing.assert_allclose(_leaf(grads["norm"]["scale"]), _leaf(per["scale"]).mean(0),
                             **TIGHT)


# ------------------------------------------------------------------------------------------------
# One update against the dense per-channel reference.


def _reference(per, grads, has_bias, n):
  """Per channel ``(F_c + lambda I)^-1 g_c`` (2x2) or ``g_s / (F_ss + lambda)`` (no bias), with
  ``F_c`` from the independent per-example gradients; and the expected ``(C, 2, 2)`` damped
  inverses."""
  gs = _leaf(per["scale"])
  if not has_bias:
    f_ss = (gs**2).sum(0) / n
    inverse = np.zeros((C, 2, 2))
    inverse[:, 0, 0], inverse[:, 1, 1] = 1 / (f_ss + LAM), 1 / LAM
    return {"scale": _leaf(grads["scale"]) / (f_ss + LAM)}, inverse
  v = np.stack([gs, _leaf(per["bias"])], -1)  # (N, C, 2)
  fisher = np.einsum("nci,ncj->cij", v, v) / n
  inverse = np.linalg.inv(fisher + LAM * np.eye(2))
  g = np.stack([_leaf(grads["scale"]), _leaf(grads["bias"])], -1)
  want = np.stack([np.linalg.solve(fisher[c] + LAM * np.eye(2), g[c]) for c in range(C)])
  return {"scale": want[:, 0], "bias": want[:, 1]}, inverse


TRANSFORMS = {
    "thor": lambda: thor_optax.scale_by_thor(LAM),
    "kfac": lambda: thor_optax.scale_by_kfac(LAM),
}


def _check_update(updates, state, grads, per, has_bias, n):
  want, inverse = _reference(per, grads, has_bias, n)
  assert set(updates) == set(want)
  for leaf, value in want.items():
    assert np.abs(_leaf(updates[leaf]) - _leaf(grads[leaf])).max() > 1e-3  # preconditioned
    np.testing.assert_allclose(_leaf(updates[leaf]), value, **TIGHT)
  np.testing.assert_allclose(state.layers["norm"].inverse, inverse, **TIGHT)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("case", ["groupnorm_nhwc", "rmsnorm_sequence"])
def test_linen_update_is_unit_wise_natural_gradient(case, transform):
  model, params, x, y = _linen_problem(case)
  capture = thor_linen.value_and_grad_with_stats(model, squared_error)
  tx = TRANSFORMS[transform]()

  @jax.jit
  def run(params, x, y):
    (_, grads), stats = capture(params, x, y)
    updates, state = tx.update(grads, tx.init(params), params, curvature_stats=stats)
    return grads, updates, state, _per_example_linen(model, params, x, y)

  grads, updates, state, per = run(params, x, y)
  _check_update(updates["norm"], state, grads["norm"], per, CASES[case][3], x.shape[0])


@pytest.mark.parametrize("case", ["groupnorm_nhwc", "groupnorm_sequence_no_bias",
                                  "rmsnorm_rank2"])
def test_nnx_update_is_unit_wise_natural_gradient(case):
  x, y = _data(case)
  model = _nnx_model(case, x)
  capture = thor_nnx.value_and_grad_with_stats(squared_error)
  tx = thor_optax.scale_by_thor(LAM)

  @nnx.jit
  def run(model, x, y):
    (_, grads), stats = capture(model, x, y)
    params = nnx.state(model, nnx.Param)
    updates, state = tx.update(grads, tx.init(params), params, curvature_stats=stats)
    return grads, updates, state, _per_example_nnx(model, x, y)

  grads, updates, state, per = run(model, x, y)
  _check_update(updates["norm"], state, grads["norm"], per, CASES[case][3], x.shape[0])


def test_layer_without_bias_gets_the_scale_only_inverse():
  """Statistics of a bias-less layer whose ``bias_grads`` are not zero (given by hand) still
  give the scale's 1x1 damped inverse: the Fisher takes the missing leaf's gradients as zeros."""
  model, params, x, y = _linen_problem("rmsnorm_sequence")
  (_, grads), stats = jax.jit(thor_linen.value_and_grad_with_stats(model, squared_error))(
      params, x, y)
  layer = stats.layers["norm"]
  noisy = thor_optax.CurvatureStats(
      layers={**stats.layers, "norm": thor_optax.NormStats(
          scale_grads=layer.scale_grads, bias_grads=jnp.asarray(randn(3, layer.bias_grads.shape)))},
      unhandled=stats.unhandled)
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None)
  update = jax.jit(lambda g, c: tx.update(g, tx.init(params), None, curvature_stats=c))
  updates, state = update(grads, noisy)
  f_ss = (np.asarray(layer.scale_grads[0]) ** 2).sum(0) / x.shape[0]
  np.testing.assert_allclose(updates["norm"]["scale"], grads["norm"]["scale"] / (f_ss + LAM),
                             **TIGHT)
  np.testing.assert_allclose(state.layers["norm"].inverse[:, 0, 0], 1 / (f_ss + LAM), **TIGHT)
  np.testing.assert_allclose(state.layers["norm"].inverse[:, 1, 1], 1 / LAM, **TIGHT)
  np.testing.assert_array_equal(state.layers["norm"].inverse[:, 0, 1], 0.0)
  # the same update as from the captured statistics (zero bias_grads)
  same, _ = update(grads, stats)
  np.testing.assert_allclose(same["norm"]["scale"], updates["norm"]["scale"], **TIGHT)


# ------------------------------------------------------------------------------------------------
# Statistics over the batch axis; unsupported layouts.


class BatchGroupNorm(nn.Module):
  """``Dense(4) -> GroupNorm over (batch, positions, group) -> tanh -> mean -> Dense(3)``."""

  @nn.compact
  def __call__(self, x):
    h = nn.GroupNorm(num_groups=2, reduction_axes=(0, 1, 2), name="norm")(
        nn.Dense(C, name="dense_in")(x))
    return nn.Dense(3, name="head")(_head_input(h))


def test_groupnorm_over_the_batch_is_captured_like_batchnorm():
  model = BatchGroupNorm()
  x, y = jnp.asarray(randn(4, (5, 4, 3))), jnp.asarray(randn(5, (5, 3)))
  params = init_params(model, x)
  capture = thor_linen.value_and_grad_with_stats(model, squared_error)

  def per_example_losses(norm):  # the whole batch: statistics over all N examples
    out = model.apply({"params": {**params, "norm": norm}}, x)
    return 0.5 * jnp.sum((out - y) ** 2, axis=-1)

  @jax.jit
  def run(params, x, y):
    return capture(params, x, y), jax.jacrev(per_example_losses)(params["norm"])

  ((_, grads), stats), jac = run(params, x, y)
  assert stats.unhandled == ()
  _check_stats(stats.layers["norm"], jac, True, x.shape[0])
  # ... and not the per-example gradients of one-example batches (the batch statistics count)
  per = jax.jit(functools.partial(_per_example_linen, model))(params, x, y)
  assert np.abs(_leaf(per["scale"]) - _leaf(jac["scale"])).max() > 1e-3


class OtherLinen(nn.Module):
  """An RMSNorm over two feature axes (unsupported) and norms without parameters."""

  @nn.compact
  def __call__(self, x):
    h = nn.RMSNorm(reduction_axes=(1, 2), feature_axes=(1, 2), name="rms_12")(x)
    h = nn.RMSNorm(use_scale=False, name="rms_plain")(h)
    h = nn.GroupNorm(num_groups=2, use_scale=False, use_bias=False, name="gn_plain")(h)
    return nn.Dense(2, name="head")(h.mean(axis=1))


class OtherNnx(nnx.Module):

  def __init__(self, rngs):
    self.rms_first = nnx.RMSNorm(4, feature_axes=1, reduction_axes=1, param_dtype=F64,
                                 rngs=rngs)
    self.gn_plain = nnx.GroupNorm(2, num_groups=1, use_scale=False, use_bias=False, rngs=rngs)
    self.head = nnx.Linear(2, 2, param_dtype=F64, rngs=rngs)

  def __call__(self, x):  # x (N, 4, 2): the RMSNorm's scale acts over axis 1
    return self.head(self.gn_plain(self.rms_first(x)).mean(axis=1))


def test_unsupported_layouts_are_listed():
  x, y = jnp.asarray(randn(6, (3, 4, 2))), jnp.asarray(randn(7, (3, 2)))
  model = OtherLinen()
  params = init_params(model, x)

  @jax.jit
  def run(params, x, y):
    ref = jax.value_and_grad(lambda p: squared_error(model.apply({"params": p}, x), y))(params)
    return thor_linen.value_and_grad_with_stats(model, squared_error)(params, x, y), ref

  ((loss, grads), stats), (ref_loss, ref_grads) = run(params, x, y)
  unhandled = dict(s.split(": ", 1) for s in stats.unhandled)
  assert set(unhandled) == {"rms_12"}
  assert "feature_axes=(1, 2)" in unhandled["rms_12"] and "last axis" in unhandled["rms_12"]
  assert set(stats.layers) == {"head"}  # rms_plain and gn_plain have no parameters
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-14)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), grads, ref_grads)

  nnx_model = OtherNnx(nnx.Rngs(0))
  (_, _), stats = nnx.jit(thor_nnx.value_and_grad_with_stats(squared_error))(nnx_model, x, y)
  unhandled = dict(s.split(": ", 1) for s in stats.unhandled)
  assert set(unhandled) == {"rms_first"}
  assert "feature_axes=(1,)" in unhandled["rms_first"]
  assert set(stats.layers) == {"head"}
