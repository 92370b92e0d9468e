"""Transposed convolutions (``nn.ConvTranspose``, ``nnx.ConvTranspose``) against explicit
Kronecker products, float64.

The reference does not use the package's padding rule: for each case it searches the padding
``((lo, hi), ...)`` under which a convolution of the input dilated by the strides reproduces
the layer's output, then builds the factors from the NumPy loop im2col of ``test_conv_kinds``
(which also checks that its patches times the kernel are the layer's output and that they pair
with the cotangents into the kernel gradient).
"""

import itertools

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
import thor_optax.nnx

import reference
from reference import F64, randn, squared_error
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)
from test_conv_kinds import N, TRANSFORMS, _check, _run, reference_updates

pytestmark = pytest.mark.usefixtures("fast_compiles")

CASES = {
    # name: (input spatial shape, C_in, C_out, ConvTranspose settings)
    "2d_same_stride2": ((3, 2), 2, 3, dict(kernel_size=(3, 3), strides=(2, 2), padding="SAME")),
    "2d_valid_stride1x2": ((2, 3), 1, 2, dict(kernel_size=(2, 3), strides=(1, 2),
                                              padding="VALID")),
    "1d_valid_stride3_dilated": ((3,), 2, 2, dict(kernel_size=(2,), strides=(3,),
                                                  padding="VALID", kernel_dilation=(2,))),
    "1d_same_kernel_below_stride": ((3,), 1, 2, dict(kernel_size=(2,), strides=(3,),
                                                     padding="SAME")),
    "2d_explicit": ((2, 3), 2, 2, dict(kernel_size=(2, 2), strides=(2, 1),
                                       padding=((1, 0), (0, 2)))),
}


class LinenConvT(nn.Module):
  settings: dict
  features: int
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    y = nn.ConvTranspose(self.features, use_bias=self.use_bias, name="conv", **self.settings)(x)
    return jnp.tanh(y).mean(axis=tuple(range(1, y.ndim - 1)))


class NNXConvT(nnx.Module):

  def __init__(self, c_in, c_out, settings, use_bias):
    self.conv = nnx.ConvTranspose(c_in, c_out, use_bias=use_bias, param_dtype=F64,
                                  rngs=nnx.Rngs(0), **settings)

  def __call__(self, x):
    y = self.conv(x)
    return jnp.tanh(y).mean(axis=tuple(range(1, y.ndim - 1)))


_CHANNELS_LAST = {1: ("NHC", "HIO", "NHC"), 2: ("NHWC", "HWIO", "NHWC"),
                  3: ("NHWDC", "HWDIO", "NHWDC")}


def _as_conv(x, params, conv_out, settings):
  """The im2col settings of the convolution of the dilated input that is the layer, its
  padding found by trying every ``lo`` per dimension (``hi`` follows from the output size)."""
  nsp = x.ndim - 2
  strides = settings["strides"]
  kdil = settings.get("kernel_dilation", (1,) * nsp)
  spans = [(k - 1) * d + 1 for k, d in zip(settings["kernel_size"], kdil)]
  dilated = [(s - 1) * st + 1 for s, st in zip(x.shape[1:-1], strides)]
  total = [o - 1 + sp - d for o, sp, d in zip(conv_out.shape[1:-1], spans, dilated)]
  found = []
  for los in itertools.product(*[range(-sp, sp + st) for sp, st in zip(spans, strides)]):
    pads = tuple((lo, t - lo) for lo, t in zip(los, total))
    y = jax.lax.conv_general_dilated(x, params["kernel"], (1,) * nsp, pads,
                                     lhs_dilation=strides, rhs_dilation=kdil,
                                     dimension_numbers=_CHANNELS_LAST[nsp])
    y = y + params.get("bias", 0.0)
    if y.shape == conv_out.shape and np.allclose(y, conv_out, rtol=0, atol=1e-12):
      found.append(pads)
  assert len(found) == 1, found
  return dict(kernel_size=settings["kernel_size"], padding=found[0], input_dilation=strides,
              kernel_dilation=kdil)


def _problem(name, use_bias):
  spatial, c_in, c_out, settings = CASES[name]
  x = jnp.asarray(randn(1, (N,) + spatial + (c_in,)))
  y = jnp.asarray(randn(2, (N, c_out)))
  model = LinenConvT(settings, c_out, use_bias)
  return model, reference.init_params(model, x), x, y, settings


def _check_against_reference(stats, x, conv_out, params, grads, got, settings):
  assert stats.unhandled == ()
  layer = stats.layers["conv"]
  assert isinstance(layer, thor_optax.ConvStats)  # the convolution of the dilated input
  assert layer.input_dilation == tuple(settings["strides"])
  assert layer.strides == (1,) * (x.ndim - 2)
  as_conv = _as_conv(x, params, conv_out, settings)
  assert layer.padding == as_conv["padding"]
  want = reference_updates(x, conv_out, layer.cotangents, params, grads, as_conv)
  for method in TRANSFORMS:
    _check(got[method], want[method], grads)


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_linen_updates_are_explicit_kronecker_products(name, use_bias):
  model, params, x, y, settings = _problem(name, use_bias)
  capture = thor_optax.flax.value_and_grad_with_stats(model, squared_error)
  conv_t = nn.ConvTranspose(y.shape[-1], use_bias=use_bias, **settings)
  grads, stats, got, conv_out = _run(lambda p: capture(p, x, y), params,
                                     lambda p: conv_t.apply({"params": p["conv"]}, x))
  _check_against_reference(stats, x, conv_out, params["conv"], grads["conv"],
                           {m: got[m]["conv"] for m in TRANSFORMS}, settings)


@pytest.mark.parametrize("name", ["2d_same_stride2", "1d_valid_stride3_dilated"])
def test_nnx_updates_are_explicit_kronecker_products(name):
  _, params, x, y, settings = _problem(name, True)
  _, c_in, c_out, _ = CASES[name]
  model = NNXConvT(c_in, c_out, settings, True)
  nnx.update(model, nnx.State(jax.tree.map(jnp.asarray, params)))
  graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
  capture = thor_optax.nnx.value_and_grad_with_stats(squared_error)

  def merged(p):
    return nnx.merge(graphdef, p, rest)

  grads, stats, got, conv_out = _run(lambda p: capture(merged(p), x, y), param_state,
                                     lambda p: merged(p).conv(x))
  pure_grads = nnx.to_pure_dict(grads)["conv"]
  _check_against_reference(stats, x, conv_out, params["conv"], pure_grads,
                           {m: nnx.to_pure_dict(nnx.State(got[m]))["conv"] for m in TRANSFORMS},
                           settings)


def test_the_layout_from_shapes_is_the_convolutions():
  """A 2-D transposed conv with the optimizer laid out from parameter shapes alone (no
  ``layers=``): the update is the captured layout's, under jit."""
  model, params, x, y, _ = _problem("2d_same_stride2", True)
  capture = thor_optax.flax.value_and_grad_with_stats(model, squared_error)
  (_, grads), stats = capture(params, x, y)
  updates = []
  for layers in (None, thor_optax.captured_layers(stats)):
    tx = thor_optax.scale_by_thor(1e-2, block_size=4, layers=layers)
    update = jax.jit(lambda g, s, st, tx=tx: tx.update(g, s, None, curvature_stats=st)[0])
    updates.append(update(grads, tx.init(params), stats))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-13), *updates)


@pytest.mark.parametrize("settings,reason", [
    (dict(kernel_size=(3, 3), strides=(2, 2), transpose_kernel=True), "transpose_kernel=True"),
    (dict(kernel_size=(3, 3), padding="CIRCULAR"), "padding='CIRCULAR'"),
])
def test_unsupported_settings_are_listed(settings, reason):
  model = LinenConvT(settings, 2, True)
  x = jnp.asarray(randn(0, (N, 3, 3, 2)))
  params = reference.init_params(model, x)
  (_, _), stats = thor_optax.flax.value_and_grad_with_stats(model, squared_error)(
      params, x, jnp.asarray(randn(1, (N, 2))))
  assert stats.layers == {} or "conv" not in stats.layers
  assert any(note.startswith("conv: ") and reason in note for note in stats.unhandled)
