"""A stack of layers scanned by ``nn.scan`` (parameters ``(L, ...)``) is preconditioned layer by
layer, exactly as the same layers unrolled.

The scanned model's blocks are ``nn.remat``-ed (the way deep transformers are written): the
capture reads perturbations and records inputs through each layer's params scope, so both pass
through the lifted transforms; the core treats a module whose leaves share leading axes as a
stack of layers (``LayerSpec.stack``), with factors, side curvature (``LayerNorm``'s unit-wise
Fisher) and preconditioning per layer. Float64; thor, skfac, kaisa and spngd, so blocked
Cholesky, Woodbury from rows, eigh, the trace rule and the adaptive refresh each meet a stack.

The same holds for Flax NNX's "scan over layers" (a stack made by ``nnx.vmap``, run by
``nnx.scan`` over an ``nnx.remat``-ed body): the capture hands each lifted layer copy its
perturbation and takes its input back through ``nnx.Param``-typed channel variables. A layer
whose one set of weights is applied at every iteration (a recurrent cell) is weight sharing over
the iterations: ``test_recurrent_layers.py``.
"""

import functools
import warnings

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
import thor_optax.nnx
from thor_optax._src import blocks

import reference
from reference import float64_mode, init_params, randn, softmax_ce  # pylint: disable=unused-import

pytestmark = pytest.mark.usefixtures("fast_compiles")

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

  @jax.jit
  def step(params, state):
    (_, grads), stats = capture(params, x, y)
    assert stats.unhandled == ()
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return jax.tree.map(lambda p, u: p + u, params, updates), state

  state = tx.init(params)
  for _ in range(steps):
    params, state = step(params, state)
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
  if name == "spngd":  # kernels above SP-NGD's cap sqrt(2 d_out): every layer is rescaled
    params["layers"]["Dense_0"]["kernel"] = 4.0 * params["layers"]["Dense_0"]["kernel"]
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
  if name == "spngd":  # started at 1.4 to 1.7 times the cap, each layer ends within it
    norms = np.linalg.norm(params["layers"]["Dense_0"]["kernel"], axis=(1, 2))
    assert np.all(norms > 1.4 * np.sqrt(12))
    norms = np.linalg.norm(scanned["layers"]["Dense_0"]["kernel"], axis=(1, 2))
    assert np.all(norms <= np.sqrt(12) * (1 + 1e-12))


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


def test_micro_batches_of_a_stack_join_after_the_stack_axes():
  """``concatenate_stats`` of micro-batches of 3 and 5 examples equals the whole batch's
  statistics for the stacked dense and norm layers (before: joined along the stack axis, or
  rejected for unequal sizes)."""
  x, y = jnp.asarray(randn(2, (8, 6))), jnp.arange(8) % 3
  params = init_params(Scanned(), x)
  capture = reference.capture(Scanned(), softmax_ce)
  (_, _), whole = capture(params, x, y)
  assert dict(whole.stacked) == {"layers/Dense_0": 1, "layers/LayerNorm_0": 1}
  parts = [capture(params, x[:3], y[:3])[1], capture(params, x[3:], y[3:])[1]]
  joined = thor_optax.concatenate_stats(*parts)
  assert jax.tree.structure(joined) == jax.tree.structure(whole)
  for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(whole)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------------------------ NNX


class NNXBlock(nnx.Module):
  """``Linear -> tanh -> LayerNorm`` in float64."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(6, 6, param_dtype=jnp.float64, rngs=rngs)
    self.norm = nnx.LayerNorm(6, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, h):
    return self.norm(jnp.tanh(self.linear(h)))


class NNXScanned(nnx.Module):
  """``L`` blocks created by ``nnx.vmap`` and run by ``nnx.scan`` over ``nnx.remat``."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NNXBlock(rngs)

    self.layers = make(rngs)
    self.head = nnx.Linear(6, 3, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(h, block):
      return block(h)

    return self.head(body(x, self.layers))


class NNXUnrolled(nnx.Module):
  """The same blocks in an ``nnx.List``, called one after another."""

  def __init__(self, rngs: nnx.Rngs):
    self.layers = nnx.List([NNXBlock(rngs) for _ in range(L)])
    self.head = nnx.Linear(6, 3, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    for block in self.layers:
      x = block(x)
    return self.head(x)


def _train_nnx(model, tx, x, y, steps=2):
  """``steps`` jitted check steps (NNX's functional loop: split once, merge in the step)."""
  capture = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @functools.partial(jax.jit, compiler_options=reference.FAST_COMPILE)
  def step(params, state):
    (_, grads), stats = capture(nnx.merge(graphdef, params, rest), x, y)
    assert stats.unhandled == ()
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return jax.tree.map(lambda p, u: p + u, params, updates), state, stats

  state = tx.init(params)
  for _ in range(steps):
    params, state, stats = step(params, state)
  return params, stats


@pytest.mark.parametrize("name", ["kaisa", "thor"])
def test_nnx_scanned_stack_equals_unrolled_layers(name):
  x, y = jnp.asarray(randn(1, (8, 6))), jnp.arange(8) % 3
  scanned, unrolled = NNXScanned(nnx.Rngs(0)), NNXUnrolled(nnx.Rngs(1))
  start = jax.tree.map(np.asarray, nnx.state(scanned, nnx.Param))  # a copy
  assert start["layers"]["linear"]["kernel"].shape == (L, 6, 6)
  for i in range(L):
    nnx.update(unrolled.layers[i], jax.tree.map(lambda v, i=i: jnp.asarray(v[i]),
                                                start["layers"]))
  nnx.update(unrolled.head, jax.tree.map(jnp.asarray, start["head"]))
  tx = OPTIMIZERS[name]()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every layer preconditioned: no warning
    got, stats = _train_nnx(scanned, tx, x, y)
    want, _ = _train_nnx(unrolled, tx, x, y)
  assert stats.layers["layers"]["linear"].inputs.shape == (L, 8, 6)
  np.testing.assert_allclose(got["head"]["kernel"][...], want["head"]["kernel"][...],
                             rtol=0, atol=1e-13)
  for i in range(L):
    for a, b in zip(jax.tree.leaves(jax.tree.map(lambda v, i=i: v[i], got["layers"])),
                    jax.tree.leaves(want["layers"][i])):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
              zip(jax.tree.leaves(got), jax.tree.leaves(start)))
  assert moved > 1e-3
