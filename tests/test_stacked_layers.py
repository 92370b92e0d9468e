"""A stack of layers scanned by ``nn.scan`` (parameters ``(L, ...)``) is preconditioned layer by
layer, exactly as the same layers unrolled.

The scanned model's blocks are ``nn.remat``-ed (the way deep transformers are written): the
capture reads perturbations and records inputs through each layer's params scope, so both pass
through the lifted transforms; the core treats a module whose leaves share leading axes as a
stack of layers (``LayerSpec.stack``), with factors, side curvature (``LayerNorm``'s unit-wise
Fisher) and preconditioning per layer. Float64; thor, skfac, kaisa and spngd, so blocked
Cholesky, Woodbury from rows, eigh, the trace rule and the adaptive refresh each meet a stack.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
from thor_optax._src import blocks

import reference
from reference import float64_mode, init_params, randn, softmax_ce  # pylint: disable=unused-import

L = 3


class Block(nn.Module):
  """Dense -> tanh -> LayerNorm, a scan body ``(carry, x) -> (carry, y)``."""

  @nn.compact
  def __call__(self, h, _):
    return nn.LayerNorm()(jnp.tanh(nn.Dense(6)(h))), None


class Scanned(nn.Module):
  """``L`` blocks under ``nn.scan(nn.remat(Block))``, then a dense head."""

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=L)
    h, _ = stack(name="layers")(x, None)
    return nn.Dense(3)(h)


class Unrolled(nn.Module):
  """The same blocks called one after another."""

  @nn.compact
  def __call__(self, x):
    h = x
    for i in range(L):
      h, _ = Block(name=f"b{i}")(h, None)
    return nn.Dense(3, name="Dense_0")(h)


def _unrolled_params(scanned):
  return {"Dense_0": scanned["Dense_0"],
          **{f"b{i}": jax.tree.map(lambda v, i=i: v[i], scanned["layers"]) for i in range(L)}}


def _train(model, params, tx, x, y, steps=2):
  capture = reference.capture(model, softmax_ce)
  state = tx.init(params)
  for _ in range(steps):
    (_, grads), stats = capture(params, x, y)
    assert stats.unhandled == ()
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  return params, state


OPTIMIZERS = {
    "thor": lambda: thor_optax.thor(0.1, 0.03, block_size=4),
    "skfac": lambda: thor_optax.skfac(0.1, 0.03),
    "kaisa": lambda: thor_optax.kaisa(0.1, 0.03),
    "spngd": lambda: thor_optax.spngd(0.1, 0.03),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_scanned_stack_equals_unrolled_layers(name):
  x, y = jnp.asarray(randn(1, (8, 6))), jnp.arange(8) % 3
  params = init_params(Scanned(), x)
  assert params["layers"]["Dense_0"]["kernel"].shape == (L, 6, 6)
  tx = OPTIMIZERS[name]()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every layer preconditioned: no warning
    scanned, state = _train(Scanned(), params, tx, x, y)
    unrolled, _ = _train(Unrolled(), _unrolled_params(params), tx, x, y)
  np.testing.assert_allclose(scanned["Dense_0"]["kernel"], unrolled["Dense_0"]["kernel"],
                             rtol=0, atol=1e-13)
  for i in range(L):
    for got, want in zip(jax.tree.leaves(jax.tree.map(lambda v, i=i: v[i], scanned["layers"])),
                         jax.tree.leaves(unrolled[f"b{i}"])):
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
              zip(jax.tree.leaves(scanned), jax.tree.leaves(params)))
  assert moved > 1e-3  # the comparison is not between two untouched trees


def test_stack_is_claimed_per_layer_from_shapes():
  shapes = {"layers": {"Dense_0": {"kernel": jnp.zeros((L, 6, 5)), "bias": jnp.zeros((L, 5))},
                       "LayerNorm_0": {"scale": jnp.zeros((L, 5)), "bias": jnp.zeros((L, 5))}},
            "head": {"kernel": jnp.zeros((5, 2))}}
  layout = blocks.build_layout(shapes, 4)
  dense = layout.layer("layers/Dense_0")
  assert dense.stack == (L,) and dense.kernel_shape == (6, 5) and dense.has_bias
  assert dense.a.copies == L and dense.a.num_blocks == L * 2  # A: 7 -> two 4-blocks per layer
  assert dense.g.num_blocks == L * 2
  assert layout.layer("layers/LayerNorm_0").stack == (L,)
  assert layout.layer("head").stack == ()


def test_statistics_without_the_stack_axes_are_rejected():
  x, y = jnp.asarray(randn(1, (8, 6))), jnp.arange(8) % 3
  params = init_params(Scanned(), x)
  (_, grads), stats = reference.capture(Scanned(), softmax_ce)(params, x, y)
  layers = dict(stats.layers)
  layers["layers"] = {**layers["layers"], "Dense_0": jax.tree.map(
      lambda v: v[0], layers["layers"]["Dense_0"])}
  tx = thor_optax.thor(0.1, 0.03)
  with pytest.raises(ValueError, match="'layers/Dense_0' is a stack of layers"):
    tx.update(grads, tx.init(params), params,
              curvature_stats=thor_optax.CurvatureStats(layers=layers))
