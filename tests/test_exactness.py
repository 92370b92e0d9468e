"""Float64 exactness of the Kronecker factors and of the preconditioned update.

* deep linear networks: ``A (x) G`` of each layer *is* that layer's block of the Gauss-Newton
  matrix (K-FAC is exact there);
* one example, empirical Fisher: ``A (x) G = vec(dW) vec(dW)^T``;
* the update of dense/conv layers, with and without bias, against the dense NumPy formula
  ``kron((A + sqrt(lam) I)^-1, (G + sqrt(lam) I)^-1) vec(dW)`` with ``A`` and ``G`` from an
  independent NumPy reference (explicit im2col loops, the kernel's own HWIO order);
* THOR's split: block-diagonal factors with identity padding;
* steps without statistics reuse the stored inverses.
"""

import jax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import thor_optax
from thor_optax._src import blocks
from thor_optax._src import linalg

import reference
from reference import F64, init_params, randn, softmax_ce, squared_error
from reference import block_part as _block_part
from reference import kron_update as _kron_update
from reference import reference_factors as _reference_factors
from reference import stacked as _stacked
from reference import unstack as _unstack
from reference import inverse_blocks
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)

pytestmark = pytest.mark.usefixtures("fast_compiles")


RTOL = 1e-9
LAM = 0.05


def _package_factors(params, stats, names):
  """``{name: (A, G)}`` as the package forms them: ``scale * rows^T rows``."""
  layout = blocks.build_layout(params, None)

  @jax.jit
  def run(layers):
    out = {}
    for name in names:
      spec = layout.layer(name)
      a_rows, a_scale = spec.kind.input_rows(spec, layers[name], F64)
      g_rows, g_scale = spec.kind.cotangent_rows(spec, layers[name], F64)
      out[name] = (a_scale * a_rows.T @ a_rows, g_scale * g_rows.T @ g_rows)
    return out

  return jax.tree.map(np.asarray, run({name: stats.layers[name] for name in names}))


# ------------------------------------------------------------------------------------------------
# 1. Deep linear networks: K-FAC equals the Gauss-Newton diagonal blocks.


class DeepLinear(nn.Module):
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate((4, 3, 2)):
      x = nn.Dense(width, use_bias=self.use_bias, name=f"Dense_{i}")(x)
    return x


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
def test_deep_linear_kfac_equals_gauss_newton_blocks(use_bias):
  n, names = 6, ("Dense_0", "Dense_1", "Dense_2")
  model = DeepLinear(use_bias)
  x = jnp.asarray(randn(1, (n, 5)))
  y = jnp.asarray(randn(2, (n, 2)))
  params = init_params(model, x, seed=1)
  run = reference.capture(model, squared_error, fisher_type="exact", likelihood="squared_error")
  _, stats = run(params, x, y)
  assert stats.layers["Dense_2"].cotangents.shape == (2, n, 2)  # K = 2 output directions
  fac = _package_factors(params, stats, names)

  def outputs(mats):
    p = dict(params)
    for name in names:
      d_in = params[name]["kernel"].shape[0]
      p[name] = {"kernel": mats[name][:d_in]}
      if use_bias:
        p[name]["bias"] = mats[name][d_in]
    return model.apply({"params": p}, x)  # (N, K)

  mats = {name: jnp.asarray(_stacked(params[name])) for name in names}
  jac = jax.jit(jax.jacobian(outputs))(mats)  # {name: (N, K, d_in (+1), d_out)}
  for name in names:
    d_rows, d_out = mats[name].shape
    assert fac[name][0].shape == (d_rows, d_rows) and fac[name][1].shape == (d_out, d_out)
    J = np.asarray(jac[name]).reshape(n, 2, -1)  # row-major vec of [kernel; bias]
    ggn = np.einsum("nkp,nkq->pq", J, J) / n
    assert np.abs(ggn).max() > 1e-3
    np.testing.assert_allclose(np.kron(*fac[name]), ggn, rtol=RTOL, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# 2. One example, empirical Fisher: A (x) G is the outer product of the gradient.


class SmallMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(4, name="Dense_0")(x))
    h = jnp.tanh(nn.Dense(3, use_bias=False, name="Dense_1")(h))
    return nn.Dense(3, name="Dense_2")(h)


def test_single_example_empirical_fisher_is_gradient_outer_product():
  names = ("Dense_0", "Dense_1", "Dense_2")
  model = SmallMLP()
  x = jnp.asarray(randn(3, (1, 5)))
  y = jnp.asarray([2])
  params = init_params(model, x, seed=2)
  (_, grads), stats = reference.capture(model, softmax_ce)(params, x, y)
  fac = _package_factors(params, stats, names)
  for name in names:
    v = _stacked(grads[name]).reshape(-1)
    assert np.abs(v).max() > 1e-3
    np.testing.assert_allclose(np.kron(*fac[name]), np.outer(v, v), rtol=RTOL, atol=1e-14)


# ------------------------------------------------------------------------------------------------
# 3. and 5. One update of dense and conv layers, with and without bias; a step without stats.

CONVS = {
    "conv_b": dict(kernel_size=(3, 3), strides=(1, 1), padding="SAME"),
    "conv_nb": dict(kernel_size=(2, 3), strides=(2, 1), padding=((0, 1), (1, 0)),
                    kernel_dilation=(1, 2)),
}


class Mixed(nn.Module):
  """Conv with bias, conv without, dense with bias, dense without."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Conv(3, use_bias=True, name="conv_b", **CONVS["conv_b"])(x))
    h = jnp.tanh(nn.Conv(2, use_bias=False, name="conv_nb", **CONVS["conv_nb"])(h))
    h = jnp.tanh(nn.Dense(5, use_bias=True, name="dense_b")(h.reshape(h.shape[0], -1)))
    return nn.Dense(3, use_bias=False, name="dense_nb")(h)


@pytest.fixture(scope="module")
def mixed_run():
  model = Mixed()
  x = jnp.asarray(randn(4, (4, 5, 5, 2)))
  y = jnp.asarray([0, 2, 1, 2])
  params = init_params(model, x, seed=4)
  (_, grads), stats = reference.capture(model, softmax_ce)(params, x, y)
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None)
  state = jax.jit(tx.init)(params)
  assert jax.tree.leaves(inverse_blocks(state))[0].dtype == F64
  check = jax.jit(lambda g, s, c: tx.update(g, s, None, curvature_stats=c))
  plain = jax.jit(lambda g, s: tx.update(g, s, None))
  updates, state1 = check(grads, state, stats)
  updates2, state2 = plain(grads, state1)
  scaled, _ = plain(jax.tree.map(lambda g: -3.0 * np.asarray(g), grads), state1)
  return dict(params=params, grads=grads, stats=stats, updates=updates, state1=state1,
              updates2=updates2, state2=state2, scaled=scaled)


@pytest.mark.parametrize("name", ["conv_b", "conv_nb", "dense_b", "dense_nb"])
def test_update_matches_dense_kronecker_formula(mixed_run, name):
  params, grads, stats, updates = (mixed_run[k] for k in ("params", "grads", "stats", "updates"))
  has_bias = name.endswith("_b")
  assert ("bias" in params[name]) == has_bias
  A, G = _reference_factors(stats.layers[name], has_bias, CONVS.get(name))
  grad = _stacked(grads[name])
  assert A.shape[0] == grad.shape[0] and G.shape[0] == grad.shape[1]
  d = np.sqrt(LAM)
  want = _unstack(_kron_update(A, G, grad, d, d), params[name])
  got = updates[name]
  assert set(got) == set(want)
  for leaf in want:
    assert got[leaf].shape == want[leaf].shape and got[leaf].dtype == F64
    np.testing.assert_allclose(got[leaf], want[leaf], rtol=RTOL, atol=1e-13)
  # The curvature is not negligible: the update differs from a scaled gradient.
  ratio = np.asarray(got["kernel"]) / np.asarray(grads[name]["kernel"])
  assert np.ptp(ratio) > 0.1


def test_update_tree_is_complete(mixed_run):
  assert (jax.tree.structure(mixed_run["updates"])
          == jax.tree.structure(mixed_run["grads"]))
  assert int(mixed_run["state1"].count) == 1
  for name in ("conv_b", "conv_nb", "dense_b", "dense_nb"):
    assert int(mixed_run["state1"].diagnostics[name].blocks_refreshed) == 2


def test_step_without_stats_reuses_stored_inverses(mixed_run):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-13, atol=1e-15),
               mixed_run["updates2"], mixed_run["updates"])
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, -3.0 * v, rtol=1e-12, atol=1e-15),
               mixed_run["scaled"], mixed_run["updates"])
  state1, state2 = mixed_run["state1"], mixed_run["state2"]
  jax.tree.map(np.testing.assert_array_equal, inverse_blocks(state2), inverse_blocks(state1))
  assert int(state2.count) == 2
  for name in ("conv_b", "dense_nb"):
    assert (int(state2.diagnostics[name].total_refreshes)
            == int(state1.diagnostics[name].total_refreshes) == 2)


# ------------------------------------------------------------------------------------------------
# 4. THOR's split: block-diagonal factors, identity padding.


class Wide(nn.Module):
  """``A`` of dims 11 (blocks 4, 4, 3 + pad) and 6 (4, 2 + pad); ``G`` 6 and 3 (one block)."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(6, name="Dense_0")(x))
    return nn.Dense(3, use_bias=False, name="Dense_1")(h)


def test_split_update_uses_block_diagonal_factors():
  b = 4
  model = Wide()
  x = jnp.asarray(randn(5, (7, 10)))
  y = jnp.asarray([0, 1, 2, 0, 1, 2, 2])
  params = init_params(model, x, seed=5)
  (_, grads), stats = reference.capture(model, softmax_ce)(params, x, y)
  # refresh_buckets=1: with thresholds (0, 0) every block is refreshed, so the other refresh
  # budgets would only cost compile time.
  tx = thor_optax.scale_by_thor(LAM, block_size=b, trace_thresholds=(0.0, 0.0),
                                refresh_buckets=1)
  state = jax.jit(tx.init)(params)
  updates, state = jax.jit(lambda g, s, c: tx.update(g, s, None, curvature_stats=c))(
      grads, state, stats)

  layout = blocks.build_layout(params, b)
  d = np.sqrt(LAM)
  for name in ("Dense_0", "Dense_1"):
    spec = layout.layer(name)
    A, G = _reference_factors(stats.layers[name], spec.has_bias)
    A_b, G_b = _block_part(A, b), _block_part(G, b)
    assert not np.allclose(A_b, A)  # the split drops real off-diagonal blocks
    want = _unstack(_kron_update(A_b, G_b, _stacked(grads[name]), d, d), params[name])
    for leaf in want:
      np.testing.assert_allclose(updates[name][leaf], want[leaf], rtol=RTOL, atol=1e-13)
    # The stored inverse blocks: damped inverse on true dims, identity on the padding.
    for slot, F in ((spec.a, A_b), (spec.g, G_b)):
      inv = np.asarray(inverse_blocks(state)[slot.group][slot.start:slot.stop])
      dense = scipy.linalg.block_diag(*np.asarray(inv))
      want_inv = np.eye(slot.padded_dim)
      want_inv[:slot.dim, :slot.dim] = np.linalg.inv(F + d * np.eye(slot.dim))
      np.testing.assert_allclose(dense, want_inv, rtol=RTOL, atol=1e-13)
  assert layout.layer("Dense_0").a.num_blocks == 3 and layout.layer("Dense_0").a.dim == 11
  assert layout.layer("Dense_1").g.num_blocks == 1 and layout.layer("Dense_1").g.block == 4


def test_block_helpers_against_dense_inverse():
  b, dim, m = 4, 11, 3
  rng = np.random.default_rng(6)
  rows = rng.standard_normal((20, dim))
  F = rows.T @ rows / 20
  slot = blocks.FactorSlot(dim=dim, block=b, start=0, num_blocks=3)
  F_blocks = blocks.block_covariances(jnp.asarray(rows), 1.0 / 20, slot, jnp.arange(3))
  real = np.ones((3, b))
  real[2, 3] = 0.0  # padded edge
  damping = np.array([0.3, 0.5, 0.7])
  x = rng.standard_normal((dim, m))
  z = rng.standard_normal((m, dim))

  @jax.jit
  def run(F_blocks, damping, real, x, z):
    inv = linalg.cholesky_inverse(linalg.damp(F_blocks, damping, real))
    return inv, blocks.left_multiply(inv, x), blocks.right_multiply(z, inv)

  inv, left, right = (np.asarray(v) for v in run(F_blocks, jnp.asarray(damping),
                                                 jnp.asarray(real), jnp.asarray(x),
                                                 jnp.asarray(z)))
  # Blocks of F with zero padding.
  np.testing.assert_allclose(scipy.linalg.block_diag(*np.asarray(F_blocks))[:dim, :dim], _block_part(F, b), rtol=1e-12,
                             atol=1e-14)
  np.testing.assert_array_equal(np.asarray(F_blocks)[2, 3], 0.0)
  # Dense block-diagonal damped matrix on the true dims; its inverse.
  M = _block_part(F, b) + np.diag(np.repeat(damping, b)[:dim])
  M_inv = np.linalg.inv(M)
  np.testing.assert_allclose(scipy.linalg.block_diag(*np.asarray(inv))[:dim, :dim], M_inv, rtol=RTOL, atol=1e-13)
  # The padded dimension is the identity and decoupled.
  np.testing.assert_allclose(inv[2, 3], np.eye(b)[3], rtol=0, atol=1e-14)
  np.testing.assert_allclose(inv[2, :, 3], np.eye(b)[3], rtol=0, atol=1e-14)
  np.testing.assert_allclose(left, M_inv @ x, rtol=RTOL, atol=1e-13)
  np.testing.assert_allclose(right, z @ M_inv, rtol=RTOL, atol=1e-13)
  assert left.shape == (dim, m) and right.shape == (m, dim)


class WithSmallOutput(nn.Module):
  """10 -> 20 -> 3: at block size 8, factors of 11, 20 and 21 dimensions (8 full blocks) and
  one of 3, the output layer's ``G``."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="Dense_1")(jnp.tanh(nn.Dense(20, name="Dense_0")(x)))


def test_a_small_factor_padded_into_the_full_block_stack_is_exact():
  """A factor smaller than the block size, next to enough full blocks, is one identity-padded
  block of the full size, in the same stack (one inversion in the compiled steps): the update
  is still the dense block-diagonal formula, and its stored inverse the damped ``3 x 3``
  inverse with identity on the padding."""
  b = 8
  model = WithSmallOutput()
  x = jnp.asarray(randn(7, (9, 10)))
  y = jnp.asarray([0, 1, 2, 0, 1, 2, 2, 1, 0])
  params = init_params(model, x, seed=7)
  layout = blocks.build_layout(params, b)
  assert layout.groups == {"b8": (8, 9)}
  small = layout.layer("Dense_1").g
  assert (small.dim, small.block, small.num_blocks) == (3, 8, 1)
  (_, grads), stats = reference.capture(model, softmax_ce)(params, x, y)
  tx = thor_optax.scale_by_thor(LAM, block_size=b, trace_thresholds=(0.0, 0.0),
                                refresh_buckets=1)
  updates, state = jax.jit(lambda g, s, c: tx.update(g, s, None, curvature_stats=c))(
      grads, jax.jit(tx.init)(params), stats)
  d = np.sqrt(LAM)
  for name in ("Dense_0", "Dense_1"):
    spec = layout.layer(name)
    A, G = _reference_factors(stats.layers[name], spec.has_bias)
    want = _unstack(_kron_update(_block_part(A, b), _block_part(G, b), _stacked(grads[name]),
                                 d, d), params[name])
    for leaf in want:
      np.testing.assert_allclose(updates[name][leaf], want[leaf], rtol=RTOL, atol=1e-13)
  _, G = _reference_factors(stats.layers["Dense_1"], True)
  inv = np.asarray(inverse_blocks(state)["b8"][small.start])
  want_inv = np.eye(b)
  want_inv[:3, :3] = np.linalg.inv(G + d * np.eye(3))
  np.testing.assert_allclose(inv, want_inv, rtol=RTOL, atol=1e-13)


@pytest.mark.parametrize("factors, padded", [
    ([(9, 1), (4, 1)], False),                # no full blocks: small blocks stay small
    ([(512, 1), (10, 1)], True),              # 1 small next to 4 full blocks
    ([(512, 1), (10, 2)], False),             # 2 small (a stack of 2 copies): more than 1/4
    ([(256, 1), (129, 2), (64, 1)], True),    # 6 full blocks, 1 small
])
def test_small_factors_join_the_full_blocks_only_when_few(factors, padded):
  assert blocks._pads_small_factors(factors, 128) is padded  # pylint: disable=protected-access
  assert blocks._pads_small_factors(factors, None) is False  # pylint: disable=protected-access
