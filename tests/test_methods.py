"""The seed papers' options of one transform, against dense float64 references.

* ``'eigh'`` (KAISA): the update is ``(A (x) G + lambda I)^-1 vec(dW)`` exactly, whole or split,
  and ``(A (x) G + lambda I)^-p vec(dW)`` with ``inverse_power=p``;
* ``'woodbury'`` / ``'auto'`` (SKFAC): the same update as Cholesky, with ``m x m`` solves where
  a factor has fewer rows than dimensions;
* decoupled inverse period (KAISA) and SP-NGD's adaptive refresh: which blocks are refreshed
  when, and the inverse of the averaged factor;
* normalization layers: per-channel ``(F_c + lambda I)^-1`` on ``(scale_c, bias_c)``;
* embeddings: diagonal ``A`` of token frequencies with a full ``G``.
"""

import contextlib
import dataclasses

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

import thor_optax
from thor_optax._src import blocks
from thor_optax._src.layers import conv

import reference
from reference import F64, block_part, init_params, kron_update, randn, reference_factors
from reference import softmax_ce, stacked, unstack
from reference import inverse_blocks, stack_field
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)

pytestmark = pytest.mark.usefixtures("fast_compiles")

LAM = 0.05
RTOL = 1e-9


class Wide(nn.Module):
  """``A`` of dims 11 and 6, ``G`` of dims 6 and 3; with 7 examples, ``A_0`` has rank 7 < 11."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(6, name="Dense_0")(x))
    return nn.Dense(3, use_bias=False, name="Dense_1")(h)


@pytest.fixture(scope="module")
def wide():
  model = Wide()
  x = jnp.asarray(randn(5, (7, 10)))
  y = jnp.asarray([0, 1, 2, 0, 1, 2, 2])
  params = init_params(model, x, seed=5)
  (_, grads), stats = reference.capture(model, softmax_ce)(params, x, y)
  return params, grads, stats


def _check(tx, params, grads, stats, state=None):
  state = jax.jit(tx.init)(params) if state is None else state
  return jax.jit(lambda g, s, c: tx.update(g, s, None, curvature_stats=c))(grads, state, stats)


def _exact_damped(A, G, grad, lam):
  """``(A (x) G + lam I)^-1 vec(dW)`` by a dense solve."""
  K = np.kron(A, G)
  return np.linalg.solve(K + lam * np.eye(K.shape[0]), grad.reshape(-1)).reshape(grad.shape)


@pytest.mark.parametrize("block_size", [None, 4], ids=["whole", "split"])
def test_eigh_damps_the_kronecker_product_exactly(wide, block_size):
  params, grads, stats = wide
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, block_size=block_size,
                                inverse_method="eigh")
  # Before any statistics the transform passes gradients through.
  passed, _ = tx.update(grads, tx.init(params), None)
  jax.tree.map(np.testing.assert_array_equal, passed, grads)
  updates, state = _check(tx, params, grads, stats)
  for name in ("Dense_0", "Dense_1"):
    A, G = reference_factors(stats.layers[name], "bias" in params[name])
    if block_size:
      A, G = block_part(A, block_size), block_part(G, block_size)
    want = unstack(_exact_damped(A, G, stacked(grads[name]), LAM), params[name])
    split_damped = unstack(kron_update(A, G, stacked(grads[name]), LAM**0.5, LAM**0.5),
                           params[name])
    assert np.abs(want["kernel"] - split_damped["kernel"]).max() > 1e-3  # not the same damping
    for leaf in want:
      np.testing.assert_allclose(updates[name][leaf], want[leaf], rtol=RTOL, atol=1e-12)
  assert all(float(v.min()) >= 0.0 for v in stack_field(state, "inverse", "eigenvalues").values())
  # A step without statistics reuses the eigendecompositions.
  again, _ = jax.jit(lambda g, s: tx.update(g, s, None))(grads, state)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-12), again, updates)


@pytest.mark.parametrize("block_size", [None, 64], ids=["whole", "padded"])
def test_eigh_floor_is_relative_to_the_factors_own_eigenvalues(wide, block_size):
  """``min_relative_damping``: each factor's eigenvalues floored at ``rho`` times the mean of
  its own ``d`` eigenvalues, whatever the block's padding (a 64-block padded the mean down by
  ``d / 64`` before, and the update moved by up to 60%)."""
  params, grads, stats = wide
  rho = 0.5
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, block_size=block_size,
                                inverse_method="eigh", min_relative_damping=rho)
  updates, _ = _check(tx, params, grads, stats)
  for name in ("Dense_0", "Dense_1"):
    A, G = reference_factors(stats.layers[name], "bias" in params[name])
    (wa, qa), (wg, qg) = np.linalg.eigh(A), np.linalg.eigh(G)
    wa, wg = np.maximum(wa, rho * wa.mean()), np.maximum(wg, rho * wg.mean())
    grad = stacked(grads[name])
    want = qa @ ((qa.T @ grad @ qg) / (wa[:, None] * wg[None, :] + LAM)) @ qg.T
    for leaf, value in unstack(want, params[name]).items():
      np.testing.assert_allclose(updates[name][leaf], value, rtol=RTOL, atol=1e-12)


def _exact_power(A, G, grad, lam, power):
  """``(A (x) G + lam I)^-power vec(dW)`` from a dense eigendecomposition."""
  w, q = np.linalg.eigh(np.kron(A, G) + lam * np.eye(A.shape[0] * G.shape[0]))
  return (q @ ((q.T @ grad.reshape(-1)) * w ** -power)).reshape(grad.shape)


@pytest.mark.parametrize("block_size", [None, 4], ids=["whole", "split"])
@pytest.mark.parametrize("power", [0.5, 0.25])
def test_eigh_inverse_power_is_the_damped_kronecker_products_power(wide, block_size, power):
  params, grads, stats = wide
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, block_size=block_size,
                                inverse_method="eigh", inverse_power=power)
  updates, _ = _check(tx, params, grads, stats)
  for name in ("Dense_0", "Dense_1"):
    A, G = reference_factors(stats.layers[name], "bias" in params[name])
    if block_size:
      A, G = block_part(A, block_size), block_part(G, block_size)
    want = unstack(_exact_power(A, G, stacked(grads[name]), LAM, power), params[name])
    inverse = unstack(_exact_damped(A, G, stacked(grads[name]), LAM), params[name])
    assert np.abs(want["kernel"] - inverse["kernel"]).max() > 1e-2  # not the inverse
    for leaf in want:
      np.testing.assert_allclose(updates[name][leaf], want[leaf], rtol=RTOL, atol=1e-12)


def test_inverse_power_under_inject_hyperparams_must_be_static(wide):
  params = wide[0]
  with pytest.raises(ValueError, match="pass 'inverse_power' in static_args"):
    optax.inject_hyperparams(thor_optax.kaisa, static_args=("ema_decay", "inverse_period"))(
        learning_rate=0.1, inverse_power=0.5).init(params)
  static = ("ema_decay", "inverse_period", "inverse_power")
  state = optax.inject_hyperparams(thor_optax.kfac, static_args=static)(
      learning_rate=0.1, inverse_method="eigh", inverse_power=0.5).init(params)
  assert "inverse_power" not in state.hyperparams


def test_thor_alias_passes_inverse_power_to_eigh(wide):
  params, grads, stats = wide
  kwargs = dict(block_size=4, inverse_method="eigh", max_kl=None, momentum=0.0,
                skip_not_finite=False, min_relative_damping=0.0, ema_decay=None)
  tx = thor_optax.thor(1.0, LAM, inverse_power=0.5, **kwargs)
  root, _ = jax.jit(lambda g, s, p, c: tx.update(g, s, p, curvature_stats=c))(
      grads, tx.init(params), params, stats)
  A, G = reference_factors(stats.layers["Dense_1"], False)
  A, G = block_part(A, 4), block_part(G, 4)
  want = -_exact_power(A, G, stacked(grads["Dense_1"]), LAM, 0.5)
  np.testing.assert_allclose(root["Dense_1"]["kernel"], want, rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("method", ["woodbury", "auto"])
@pytest.mark.parametrize("block_size,pi", [(None, False), (4, False), (None, True)],
                         ids=["whole", "split", "pi"])
def test_woodbury_equals_cholesky(wide, method, block_size, pi):
  params, grads, stats = wide
  kwargs = dict(ema_decay=None, block_size=block_size, pi_damping=pi)
  ref, _ = _check(thor_optax.scale_by_kfac(LAM, **kwargs), params, grads, stats)
  got, state = _check(thor_optax.scale_by_kfac(LAM, inverse_method=method, **kwargs), params,
                      grads, stats)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-8, atol=1e-12), got, ref)
  # And the dense formula, for the unsplit, sqrt(lambda) case.
  if block_size is None and not pi:
    for name in ("Dense_0", "Dense_1"):
      A, G = reference_factors(stats.layers[name], "bias" in params[name])
      want = unstack(kron_update(A, G, stacked(grads[name]), LAM**0.5, LAM**0.5), params[name])
      for leaf in want:
        np.testing.assert_allclose(got[name][leaf], want[leaf], rtol=RTOL, atol=1e-12)
  # Every block refreshed: whole, A and G; split by 4, A (dim 11) in 3 blocks and G (6) in 2.
  assert int(state.diagnostics["Dense_0"].blocks_refreshed) == (2 if block_size is None else 5)


def _cholesky_sizes(tx, params, grads, stats):
  """Matrix sizes of every Cholesky factorization in the update's jaxpr."""
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(lambda g, s, c: tx.update(g, s, None, curvature_stats=c))(
      grads, state, stats)
  sizes = set()

  def walk(jpr):
    for eqn in jpr.eqns:
      if eqn.primitive.name == "cholesky":
        sizes.add(eqn.invars[0].aval.shape[-1])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return sizes


def test_auto_picks_woodbury_by_shape(wide):
  params, grads, stats = wide
  kw = dict(ema_decay=None)
  # 7 rows: A of Dense_0 (dim 11) gets a 7 x 7 core; the factors of dims 6 and 3 stay Cholesky.
  assert _cholesky_sizes(thor_optax.scale_by_kfac(LAM, inverse_method="auto", **kw),
                         params, grads, stats) == {7, 6, 3}
  assert _cholesky_sizes(thor_optax.scale_by_kfac(LAM, **kw), params, grads, stats) == {11, 6, 3}
  # With running averages the factor is not low-rank: auto falls back to Cholesky.
  assert _cholesky_sizes(thor_optax.scale_by_kfac(LAM, inverse_method="auto"),
                         params, grads, stats) == {11, 6, 3}


class Wider(nn.Module):
  """``A`` of dims 21 and 6: with 5 examples the first is far from full rank."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(6, name="Dense_0")(x))
    return nn.Dense(3, name="Dense_1")(h)


@pytest.fixture(scope="module")
def wider():
  model = Wider()
  x = jnp.asarray(randn(6, (5, 20)))
  y = jnp.asarray([0, 1, 2, 0, 1])
  params = init_params(model, x, seed=6)
  (_, grads), stats = reference.capture(model, softmax_ce)(params, x, y)
  return model, params, grads, stats


def _state_size(state):
  return sum(np.size(leaf) for leaf in jax.tree.leaves(state))


@pytest.mark.parametrize("block_size,group", [(None, "b21r6"), (16, "b16r6")],
                         ids=["whole", "split"])
def test_low_rank_state_equals_dense_inverses(wider, block_size, group):
  """``woodbury_rows=6`` for 5 rows: ``A`` of ``Dense_0`` kept as ``U (b, 6)`` and a 6 x 6 core."""
  _, params, grads, stats = wider
  kw = dict(ema_decay=None, block_size=block_size)
  dense = thor_optax.scale_by_kfac(LAM, **kw)
  low = thor_optax.scale_by_kfac(LAM, inverse_method="auto", woodbury_rows=6, **kw)
  want, dense_state = _check(dense, params, grads, stats)
  got, state = _check(low, params, grads, stats)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12), got, want)
  n_blocks = 1 if block_size is None else 2
  b = 21 if block_size is None else 16
  assert state.blocks[group]["inverse"].u.shape == (n_blocks, b, 6)
  assert state.blocks[group]["inverse"].core.shape == (n_blocks, 6, 6)
  assert not any(g.startswith(f"b{b}") for g in inverse_blocks(state))  # no b x b inverse stored
  assert _state_size(state) < _state_size(dense_state)
  # The rows, zero-padded from 5 to 6 columns: U U^T is the factor's (block-diagonal part).
  A, _ = reference_factors(stats.layers["Dense_0"], True)
  u = np.asarray(state.blocks[group]["inverse"].u)
  assert np.all(u[:, :, 5] == 0)
  np.testing.assert_allclose(scipy.linalg.block_diag(*(u @ np.swapaxes(u, 1, 2)))[:21, :21],
                             A if block_size is None else block_part(A, 16), rtol=1e-10)
  # A step without statistics uses the low-rank form too, and no b x b Cholesky is compiled.
  plain = jax.jit(lambda g, s, tx: tx.update(g, s, None)[0], static_argnums=2)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12),
               plain(grads, state, low), plain(grads, dense_state, dense))
  assert b not in _cholesky_sizes(low, params, grads, stats)


def test_low_rank_rows_overflow_names_the_layer(wider):
  _, params, grads, stats = wider
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, inverse_method="woodbury", woodbury_rows=4)
  with pytest.raises(ValueError, match=r"'Dense_0'.*5 rows.*woodbury_rows=4"):
    tx.update(grads, tx.init(params), None, curvature_stats=stats)


def test_low_rank_state_before_statistics_is_identity(wider):
  _, params, grads, _ = wider
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, inverse_method="woodbury", woodbury_rows=6)
  passed, _ = tx.update(grads, tx.init(params), None)
  jax.tree.map(np.testing.assert_array_equal, passed, grads)


def _batch_stats(model, params, seed, n=7):
  x = jnp.asarray(randn(seed, (n, 10)))
  y = jnp.asarray(np.arange(n) % 3)
  (_, grads), stats = reference.capture(model, softmax_ce)(params, x, y)
  return grads, stats


def test_decoupled_inverse_period_inverts_the_running_average(wide):
  params, grads, _ = wide
  decay, period = 0.5, 3
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=decay, inverse_period=period)
  state = jax.jit(tx.init)(params)
  step = jax.jit(lambda g, s, c: tx.update(g, s, None, curvature_stats=c))
  inverses, ema = [], None
  for t in range(5):
    _, stats = _batch_stats(Wide(), params, 20 + t)
    _, state = step(grads, state, stats)
    A, _ = reference_factors(stats.layers["Dense_0"], True)
    ema = A if ema is None else decay * ema + (1 - decay) * A
    if t == period:
      ema_at_period = ema.copy()
    inverses.append(np.asarray(inverse_blocks(state)["b11"][0]))
  # Inversions at steps 0 and 3 only; the factor is averaged at every statistics step.
  for t in (1, 2):
    np.testing.assert_array_equal(inverses[t], inverses[0])
  assert np.abs(inverses[3] - inverses[0]).max() > 1e-3
  np.testing.assert_array_equal(inverses[4], inverses[3])
  np.testing.assert_allclose(inverses[3], np.linalg.inv(ema_at_period + LAM**0.5 * np.eye(11)),
                             rtol=1e-9)
  np.testing.assert_allclose(state.blocks["b11"]["accumulator"].factor[0], ema, rtol=1e-12)
  assert int(state.accumulator.next_inverse) == 2 * period
  assert int(state.diagnostics["Dense_0"].total_refreshes) == 4  # 2 inversions x (A, G)


def test_stale_factor_of_a_layer_without_statistics_waits_for_them(wide):
  """An inverting check whose statistics leave out ``Dense_0`` keeps its inverse (its stored
  average is newer than it, but the check has no damping for it); the next inverting check with
  its statistics inverts the average with ``sqrt(lambda)``. Before, the left-out blocks were
  inverted with the filler damping 1."""
  params, grads, _ = wide
  decay, period = 0.5, 2
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=decay, inverse_period=period)
  state = jax.jit(tx.init)(params)
  step = jax.jit(lambda g, s, c: tx.update(g, s, None, curvature_stats=c))
  ema = None
  for t in range(5):
    _, stats = _batch_stats(Wide(), params, 40 + t)
    if t == 2:  # an inverting check without Dense_0
      stats = dataclasses.replace(stats, layers={"Dense_1": stats.layers["Dense_1"]})
      kept = np.asarray(inverse_blocks(state)["b11"][0])
    else:
      A, _ = reference_factors(stats.layers["Dense_0"], True)
      ema = A if ema is None else decay * ema + (1 - decay) * A
    with pytest.warns(UserWarning, match="no statistics") if t == 2 else contextlib.nullcontext():
      _, state = step(grads, state, stats)
    if t == 2:
      np.testing.assert_array_equal(inverse_blocks(state)["b11"][0], kept)
  # Inverted again at step 4, the next inverting check, from the average of steps 0, 1, 3, 4.
  np.testing.assert_allclose(inverse_blocks(state)["b11"][0],
                             np.linalg.inv(ema + LAM**0.5 * np.eye(11)), rtol=1e-9)
  assert int(state.diagnostics["Dense_0"].total_refreshes) == 4  # steps 0 and 4 x (A, G)
  assert int(state.blocks["b11"]["record"].refreshes[0]) == 2


def test_inverse_period_schedule_equals_int(wide):
  params, grads, stats = wide
  runs = []
  for period in (2, lambda count: 2.0 + 0.0 * count):
    tx = thor_optax.scale_by_kfac(LAM, inverse_period=period)
    state = tx.init(params)
    step = jax.jit(lambda g, s, c, tx=tx: tx.update(g, s, None, curvature_stats=c))
    for _ in range(3):
      _, state = step(grads, state, stats)
    runs.append(state)
  jax.tree.map(np.testing.assert_array_equal, runs[0], runs[1])


def test_adaptive_refresh_lengthens_and_resets_intervals(wide):
  params, grads, stats = wide
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, adaptive_refresh=0.05,
                                max_refresh_interval=4)
  step = jax.jit(lambda g, s, c: tx.update(g, s, None, curvature_stats=c))
  state = jax.jit(tx.init)(params)
  log = []
  for t in range(12):
    _, state = step(grads, state, stats)  # the same statistics: every due block is similar
    log.append((int(state.blocks["b11"]["record"].refreshes[0]), int(state.blocks["b11"]["policy"].next_refresh[0]),
                int(state.blocks["b11"]["policy"].refresh_interval[0])))
  # Refreshed once at step 0; due again at 1 (interval 2), 3 (4), 7 (4, capped), 11.
  assert [r for r, _, _ in log] == [1] * 12
  assert [n for _, n, _ in log] == [1, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11, 15]
  assert [k for _, _, k in log] == [1, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4]
  inv_before = np.asarray(inverse_blocks(state)["b11"][0])
  # Steps 12-14 are not due: even very different statistics change nothing.
  _, big = _batch_stats(Wide(), params, 40)
  big = jax.tree.map(lambda a: 3.0 * a, big)
  for _ in range(3):
    _, state = step(grads, state, big)
  np.testing.assert_array_equal(inverse_blocks(state)["b11"][0], inv_before)
  # Step 15 is due and the change is large: refreshed, interval back to 1.
  _, state = step(grads, state, big)
  assert int(state.blocks["b11"]["record"].refreshes[0]) == 2
  assert int(state.blocks["b11"]["policy"].refresh_interval[0]) == 1 and int(state.blocks["b11"]["policy"].next_refresh[0]) == 16
  A, _ = reference_factors(big.layers["Dense_0"], True)
  np.testing.assert_allclose(inverse_blocks(state)["b11"][0], np.linalg.inv(A + LAM**0.5 * np.eye(11)),
                             rtol=1e-9)


# ------------------------------------------------------------------------------------------------
# Normalization layers and embeddings, with statistics given directly.


def _norm_setup(seed=0, s=2, n=5, c=4):
  rng = np.random.default_rng(seed)
  params = {
      "Dense_0": {"kernel": jnp.asarray(rng.standard_normal((3, c)))},
      "BatchNorm_0": {"scale": jnp.ones((c,), F64), "bias": jnp.zeros((c,), F64)},
      "LayerNorm_0": {"scale": jnp.ones((c,), F64)},
  }
  grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape)), params)
  norm = lambda: thor_optax.NormStats(
      scale_grads=jnp.asarray(rng.standard_normal((s, n, c))),
      bias_grads=jnp.asarray(rng.standard_normal((s, n, c))))
  ln = norm()
  ln = thor_optax.NormStats(scale_grads=ln.scale_grads, bias_grads=jnp.zeros((s, n, c), F64))
  stats = thor_optax.CurvatureStats(layers={
      "Dense_0": thor_optax.DenseStats(inputs=jnp.asarray(rng.standard_normal((n, 3))),
                                       cotangents=jnp.asarray(rng.standard_normal((1, n, c)))),
      "BatchNorm_0": norm(),
      "LayerNorm_0": ln,
  })
  return params, grads, stats


def test_normalization_layers_get_unit_wise_natural_gradient():
  params, grads, stats = _norm_setup()
  layout = blocks.build_layout(params, None)
  assert [s.name for s in layout.layers if s.kind.name == "norm"] == ["BatchNorm_0", "LayerNorm_0"]
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None)
  updates, state = _check(tx, params, grads, stats)
  bn = stats.layers["BatchNorm_0"]
  for c in range(4):
    v = np.stack([np.asarray(bn.scale_grads)[..., c].ravel(),
                  np.asarray(bn.bias_grads)[..., c].ravel()], 1)  # (S N, 2)
    F = v.T @ v / 5
    want = np.linalg.solve(F + LAM * np.eye(2),
                           [grads["BatchNorm_0"]["scale"][c], grads["BatchNorm_0"]["bias"][c]])
    np.testing.assert_allclose([updates["BatchNorm_0"]["scale"][c],
                                updates["BatchNorm_0"]["bias"][c]], want, rtol=RTOL)
  gs = np.asarray(stats.layers["LayerNorm_0"].scale_grads)
  want = np.asarray(grads["LayerNorm_0"]["scale"]) / ((gs**2).sum(axis=(0, 1)) / 5 + LAM)
  np.testing.assert_allclose(updates["LayerNorm_0"]["scale"], want, rtol=RTOL)
  assert set(updates["LayerNorm_0"]) == {"scale"}
  # Non-finite statistics keep the previous inverse.
  bad = thor_optax.CurvatureStats(layers={**stats.layers, "BatchNorm_0": thor_optax.NormStats(
      scale_grads=bn.scale_grads.at[0, 0, 1].set(jnp.nan), bias_grads=bn.bias_grads)})
  bad_updates, state2 = _check(tx, params, grads, bad, state)
  # A normalization layer's statistics are judged too: the update is NaN, for the guard.
  assert all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(bad_updates))
  np.testing.assert_array_equal(state2.layers["BatchNorm_0"].inverse[1], state.layers["BatchNorm_0"].inverse[1])
  assert np.abs(state2.layers["BatchNorm_0"].inverse[0] - state.layers["BatchNorm_0"].inverse[0]).max() == 0


def test_normalization_statistics_of_wrong_shape_name_the_layer():
  params, grads, stats = _norm_setup()
  wrong = thor_optax.CurvatureStats(layers={**stats.layers, "BatchNorm_0": thor_optax.NormStats(
      scale_grads=jnp.zeros((1, 5, 3)), bias_grads=jnp.zeros((1, 5, 3)))})
  tx = thor_optax.scale_by_kfac(LAM)
  with pytest.raises(ValueError, match="BatchNorm_0.*4"):
    tx.update(grads, tx.init(params), None, curvature_stats=wrong)


def _embed_setup(v=7, d=3, n=4, t=3, seed=1):
  rng = np.random.default_rng(seed)
  params = {"Embed_0": {"embedding": jnp.asarray(rng.standard_normal((v, d)))}}
  grads = {"Embed_0": {"embedding": jnp.asarray(rng.standard_normal((v, d)))}}
  ids = jnp.asarray(rng.integers(0, v - 1, (n, t)))  # the last token never occurs
  cts = jnp.asarray(rng.standard_normal((1, n, t, d)))
  stats = thor_optax.CurvatureStats(layers={"Embed_0": thor_optax.EmbedStats(ids, cts)})
  freq = np.bincount(np.asarray(ids).ravel(), minlength=v) / n
  g = np.asarray(cts).reshape(-1, d)
  return params, grads, stats, freq, g.T @ g / (n * t)


@pytest.mark.parametrize("method", ["cholesky", "eigh"])
def test_embedding_has_diagonal_input_factor(method):
  params, grads, stats, freq, G = _embed_setup()
  assert freq[-1] == 0 and freq.sum() == 3  # T positions per example
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, inverse_method=method)
  updates, state = _check(tx, params, grads, stats)
  grad = np.asarray(grads["Embed_0"]["embedding"])
  if method == "eigh":
    want = _exact_damped(np.diag(freq), G, grad, LAM)
  else:
    want = kron_update(np.diag(freq), G, grad, LAM**0.5, LAM**0.5)
  np.testing.assert_allclose(updates["Embed_0"]["embedding"], want, rtol=RTOL)
  assert int(state.diagnostics["Embed_0"].num_blocks) == 1  # only G is in the block stacks


def test_conv_statistics_options_reach_the_factors():
  """``reduce_sum`` + ``auto``: conv factors from summed patches, inverted by Woodbury."""
  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      h = jnp.tanh(nn.Conv(3, (3, 3), padding="SAME", name="conv")(x))
      return nn.Dense(3, name="head")(h.reshape(h.shape[0], -1))

  net = Net()
  x = jnp.asarray(randn(8, (4, 5, 5, 2)))
  y = jnp.asarray([0, 2, 1, 2])
  params = init_params(net, x, seed=8)
  (_, grads), stats = reference.capture(net, softmax_ce)(params, x, y)
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, inverse_method="auto",
                                conv_statistics="reduce_sum")
  assert _cholesky_sizes(tx, params, grads, stats) >= {4}  # 4 rows behind conv A (dim 19)
  updates, _ = _check(tx, params, grads, stats)
  spec = blocks.build_layout(params, None).layer("conv")
  sampling = conv.ConvSampling("reduce_sum")
  a_rows, _ = spec.kind.input_rows(spec, stats.layers["conv"], F64, sampling=sampling)
  g_rows, _ = spec.kind.cotangent_rows(spec, stats.layers["conv"], F64, sampling=sampling)
  assert a_rows.shape == (4, 19) and g_rows.shape == (4, 3)  # one row per example
  # Independent reference: loop im2col in the kernel's HWIO order, sums over the T = 25
  # positions, bias entry T, both factors divided by N T.
  n, t = 4, 25
  patches = reference.im2col_rows(np.asarray(stats.layers["conv"].inputs), (3, 3), (1, 1), "SAME")
  a_hat = np.concatenate([patches.reshape(n, t, -1).sum(1), np.full((n, 1), t)], axis=1)
  g_hat = np.asarray(stats.layers["conv"].cotangents).reshape(n, t, 3).sum(1)
  A, G = a_hat.T @ a_hat / (n * t), g_hat.T @ g_hat / (n * t)
  want = unstack(kron_update(A, G, stacked(grads["conv"]), LAM**0.5, LAM**0.5), params["conv"])
  for leaf in want:
    np.testing.assert_allclose(updates["conv"][leaf], want[leaf], rtol=1e-8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(inverse_method="qr"), "inverse_method"),
    (dict(inverse_method="woodbury"), "woodbury"),  # with the default ema_decay
    (dict(inverse_method="eigh", pi_damping=True), "pi_damping"),
    (dict(inverse_power=0.5), "needs inverse_method='eigh'"),  # with 'cholesky'
    (dict(inverse_method="eigh", inverse_power=0.0), r"inverse_power must be None or a Python"),
    (dict(inverse_method="eigh", inverse_power=1.5), "inverse_power must be"),
    (dict(inverse_period=0), "inverse_period"),
    (dict(adaptive_refresh=0.0), "adaptive_refresh"),
    (dict(conv_statistics="mean"), "mode"),
    (dict(conv_statistics="spatial_subsample"), "num_positions"),
    (dict(woodbury_rows=8), "woodbury_rows"),  # with inverse_method='cholesky'
    (dict(inverse_method="auto", woodbury_rows=8), "woodbury_rows"),  # with ema_decay
    (dict(inverse_method="auto", ema_decay=None, woodbury_rows=0), "woodbury_rows"),
])
def test_invalid_options_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    thor_optax.scale_by_kfac(LAM, **kwargs)
