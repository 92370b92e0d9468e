"""scale_by_kl_clip: the factor nu against hand computation, schedules, kwargs, guards, chains."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax.flax import value_and_grad_with_stats

# |g|^2 = 1 + 4 + 0.25 + 1 + 4 + 0 = 10.25.
GRADS = {"a": jnp.array([1.0, 2.0]), "b": {"c": jnp.array([[0.5, -1.0], [2.0, 0.0]])}}
SQ_NORM = 10.25


def _tree_allclose(a, b, **kw):
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, **kw), a, b)


def _fixed(fn):
  """A stateless transform ``g -> fn(g)`` (the inner preconditioner of a test)."""
  return optax.stateless(lambda updates, params: jax.tree_util.tree_map(fn, updates))


def test_nu_matches_hand_computation():
  lr, max_kl = 0.1, 1e-3
  tx = thor_optax.scale_by_kl_clip(optax.scale(3.0), lr, max_kl)
  state = tx.init(GRADS)
  assert int(state.count) == 0 and float(state.scale) == 1.0
  updates, state = tx.update(GRADS, state)
  # u = 3 g, <u, g> = 3 |g|^2, nu = sqrt(kappa / (lr^2 3 |g|^2)) = sqrt(1e-3 / 0.3075).
  nu = np.sqrt(max_kl / (lr**2 * 3.0 * SQ_NORM))
  assert 0.05 < nu < 0.06
  np.testing.assert_allclose(float(state.scale), nu, rtol=1e-6)
  _tree_allclose(updates, jax.tree_util.tree_map(lambda g: 3.0 * nu * g, GRADS), rtol=1e-6)
  assert int(state.count) == 1
  assert state.scale.dtype == jnp.float32 and state.count.dtype == jnp.int32


def test_negative_inner_product_uses_its_absolute_value():
  lr, max_kl = 0.1, 1e-3
  tx = thor_optax.scale_by_kl_clip(optax.scale(-3.0), lr, max_kl)
  updates, state = tx.update(GRADS, tx.init(GRADS))
  nu = np.sqrt(max_kl / (lr**2 * 3.0 * SQ_NORM))
  np.testing.assert_allclose(float(state.scale), nu, rtol=1e-6)
  _tree_allclose(updates, jax.tree_util.tree_map(lambda g: -3.0 * nu * g, GRADS), rtol=1e-6)


def test_small_kl_leaves_update_unchanged():
  # lr^2 <u, g> = 0.01 * 30.75 = 0.3075 < max_kl = 0.5: nu = 1 exactly.
  tx = thor_optax.scale_by_kl_clip(optax.scale(3.0), 0.1, max_kl=0.5)
  updates, state = tx.update(GRADS, tx.init(GRADS))
  assert float(state.scale) == 1.0
  _tree_allclose(updates, jax.tree_util.tree_map(lambda g: 3.0 * g, GRADS), rtol=0, atol=0)


def test_schedule_is_read_at_the_wrappers_count():
  schedule = optax.piecewise_constant_schedule(0.1, {1: 10.0})  # 0.1 at step 0, 1.0 after
  tx = thor_optax.scale_by_kl_clip(optax.scale(3.0), schedule, max_kl=1e-3)
  state = tx.init(GRADS)
  scales = []
  for _ in range(3):
    _, state = tx.update(GRADS, state)
    scales.append(float(state.scale))
  expected = [np.sqrt(1e-3 / (lr**2 * 3.0 * SQ_NORM)) for lr in (0.1, 1.0, 1.0)]
  np.testing.assert_allclose(scales, expected, rtol=1e-6)
  assert int(state.count) == 3


def test_inner_state_advances_like_the_inner_transform():
  inner = optax.trace(decay=0.5)
  tx = thor_optax.scale_by_kl_clip(inner, 0.1, max_kl=1e10)  # no clipping
  state, ref = tx.init(GRADS), inner.init(GRADS)
  for _ in range(2):
    updates, state = tx.update(GRADS, state)
    ref_updates, ref = inner.update(GRADS, ref)
  _tree_allclose(updates, ref_updates, rtol=0, atol=0)
  _tree_allclose(state.inner_state, ref, rtol=0, atol=0)
  _tree_allclose(ref_updates, jax.tree_util.tree_map(lambda g: 1.5 * g, GRADS), rtol=1e-7)


def test_extra_kwargs_reach_the_inner_transform():
  seen = []

  def update_fn(updates, state, params=None, *, factor):
    seen.append(factor)
    return jax.tree_util.tree_map(lambda g: factor * g, updates), state

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn)
  tx = thor_optax.scale_by_kl_clip(inner, 0.1, max_kl=1e-3)
  updates, state = tx.update(GRADS, tx.init(GRADS), None, factor=3.0)
  assert seen == [3.0]
  nu = np.sqrt(1e-3 / (0.1**2 * 3.0 * SQ_NORM))
  np.testing.assert_allclose(float(state.scale), nu, rtol=1e-6)
  _tree_allclose(updates, jax.tree_util.tree_map(lambda g: 3.0 * nu * g, GRADS), rtol=1e-6)
  with pytest.raises(TypeError, match="factor"):
    tx.update(GRADS, state)
  # A plain GradientTransformation inside ignores the extra arguments.
  plain = thor_optax.scale_by_kl_clip(optax.scale(3.0), 0.1, max_kl=1e-3)
  assert isinstance(plain, optax.GradientTransformationExtraArgs)
  plain_updates, _ = plain.update(GRADS, plain.init(GRADS), None, factor=7.0)
  _tree_allclose(plain_updates, updates, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["orthogonal", "zero", "nan", "inf"])
def test_degenerate_denominator_leaves_update_unchanged(case):
  grads = {"w": jnp.array([1.0, 1.0, 0.0])}
  if case == "orthogonal":  # u = (1, -1, 5) is orthogonal to g = (1, 1, 0): <u, g> = 0.
    inner = _fixed(lambda g: jnp.array([1.0, -1.0, 5.0]))
  elif case == "zero":
    grads = {"w": jnp.zeros(3)}
    inner = optax.scale(3.0)
  else:
    grads = {"w": jnp.array([1.0, getattr(jnp, case), 2.0])}
    inner = optax.scale(3.0)
  tx = thor_optax.scale_by_kl_clip(inner, 0.1, max_kl=1e-8)
  updates, state = jax.jit(tx.update)(grads, tx.init(grads))
  expected, _ = inner.update(grads, inner.init(grads))
  assert float(state.scale) == 1.0
  np.testing.assert_array_equal(updates["w"], expected["w"])


def test_overflowing_denominator_gives_nu_one():
  tx = thor_optax.scale_by_kl_clip(optax.scale(3.0), 1e30, max_kl=1e-3)  # lr^2 = inf in f32
  updates, state = tx.update(GRADS, tx.init(GRADS))
  assert float(state.scale) == 1.0
  _tree_allclose(updates, jax.tree_util.tree_map(lambda g: 3.0 * g, GRADS), rtol=0, atol=0)


def test_leaf_dtypes_are_kept_and_bf16_is_summed_in_f32():
  grads = {"a": jnp.full((64,), 0.3, jnp.bfloat16), "b": jnp.ones((2,), jnp.float32)}
  tx = thor_optax.scale_by_kl_clip(optax.scale(2.0), 0.5, max_kl=1e-2)
  updates, state = jax.jit(tx.update)(grads, tx.init(grads))
  assert updates["a"].dtype == jnp.bfloat16 and updates["b"].dtype == jnp.float32
  sq = 64 * float(jnp.asarray(0.3, jnp.bfloat16)) ** 2 + 2.0
  np.testing.assert_allclose(float(state.scale), np.sqrt(1e-2 / (0.25 * 2.0 * sq)), rtol=1e-5)


def test_invalid_max_kl_is_rejected():
  for bad in (0.0, -1e-3, float("nan")):
    with pytest.raises(ValueError, match="max_kl"):
      thor_optax.scale_by_kl_clip(optax.scale(1.0), 0.1, bad)


def test_inject_hyperparams_changes_max_kl_without_retracing():
  tx = optax.inject_hyperparams(thor_optax.scale_by_kl_clip)(
      optax.scale(3.0), learning_rate=0.1, max_kl=1e-3)
  traces = []

  @jax.jit
  def step(state):
    traces.append(1)
    return tx.update(GRADS, state)

  _, state = step(tx.init(GRADS))
  np.testing.assert_allclose(float(state.inner_state.scale),
                             np.sqrt(1e-3 / (0.01 * 3.0 * SQ_NORM)), rtol=1e-6)
  state.hyperparams["max_kl"] = jnp.asarray(4e-3, state.hyperparams["max_kl"].dtype)
  _, state = step(state)
  assert len(traces) == 1
  np.testing.assert_allclose(float(state.inner_state.scale),
                             np.sqrt(4e-3 / (0.01 * 3.0 * SQ_NORM)), rtol=1e-6)


class _Linear(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x)


def _loss(out, y):
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def test_chain_with_kfac_under_jit():
  model = _Linear()
  x = jax.random.normal(jax.random.PRNGKey(0), (12, 4))
  y = jnp.arange(12) % 3
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  (_, grads), stats = jax.jit(value_and_grad_with_stats(model, _loss))(params, x, y)
  pre = thor_optax.scale_by_kfac(0.05, ema_decay=None)
  lr = 0.2

  # max_kl is traced: one compilation serves both calls below.
  @jax.jit
  def update(state, max_kl):
    tx = optax.chain(thor_optax.scale_by_kl_clip(pre, lr, max_kl), optax.sgd(lr))
    return tx.update(grads, state, params, curvature_stats=stats)

  init = optax.chain(thor_optax.scale_by_kl_clip(pre, lr), optax.sgd(lr)).init(params)
  unclipped, state = update(init, 1e10)
  assert float(state[0].scale) == 1.0
  natural = jax.tree_util.tree_map(lambda u: -u / lr, unclipped)
  # The statistics reached scale_by_kfac: the update is not the plain gradient.
  assert not all(np.allclose(n, g) for n, g in zip(jax.tree_util.tree_leaves(natural),
                                                   jax.tree_util.tree_leaves(grads)))
  diag = state[0].inner_state.diagnostics
  assert diag and all(int(d.blocks_refreshed) > 0 for d in diag.values())
  assert int(state[0].count) == 1 and int(state[0].inner_state.count) == 1

  vg = sum(float(jnp.vdot(n, g)) for n, g in zip(jax.tree_util.tree_leaves(natural),
                                                 jax.tree_util.tree_leaves(grads)))
  assert vg > 0  # a damped Fisher inverse is positive definite
  clipped, state = update(init, 0.25 * lr**2 * vg)  # nu = 0.5
  np.testing.assert_allclose(float(state[0].scale), 0.5, rtol=1e-5)
  _tree_allclose(clipped, jax.tree_util.tree_map(lambda u: 0.5 * u, unclipped),
                 rtol=1e-5, atol=1e-8)
