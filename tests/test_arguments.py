"""Bad arguments give a clear error naming the function and the argument, at construction where
they can be seen then: numpy scalars and 0-d arrays are checked as Python numbers are, strings,
``None`` and other objects are refused, and values traced by ``optax.inject_hyperparams`` pass.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax.flax import value_and_grad_with_stats

T = thor_optax


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(jnp.tanh(nn.Dense(4)(x)))


@pytest.fixture(scope="module")
def setup():
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 5))
  y = jnp.arange(8) % 3
  model = _MLP()
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()
  (_, grads), stats = value_and_grad_with_stats(model, loss)(params, x, y)
  return params, grads, stats


# Numpy scalars and 0-d arrays took no check (learning_rate=np.float32(-0.05) trained
# by gradient ascent).
@pytest.mark.parametrize("wrap", [np.float32, np.float64, np.asarray, jnp.asarray],
                         ids=["f32", "f64", "np0d", "jnp0d"])
@pytest.mark.parametrize("make, value, match", [
    (lambda v: T.thor(v), -0.05, "thor: learning_rate must be finite and >= 0"),
    (lambda v: T.kfac(0.1, damping=v), -1.0, "kfac: damping must be finite and > 0"),
    (lambda v: T.thor(0.1, momentum=v, debias_momentum=True), 1.0, r"momentum must be in \[0"),
    (lambda v: T.kaisa(0.1, weight_decay=v), -1.0, "weight_decay must be finite and >= 0"),
    (lambda v: T.thor(0.1, max_update_ratio=v), -0.1, "max_ratio must be finite and > 0"),
    (lambda v: T.thor(0.1, max_kl=v), -1.0, "scale_by_kl_clip: max_kl must be positive"),
    (lambda v: T.thor(0.1, max_pi=v), 0.5, "max_pi must be finite and >= 1"),
    (lambda v: T.spngd(0.1, min_relative_damping=v), -0.1, "min_relative_damping must be"),
    (lambda v: T.clip_by_weight_ratio(v), -0.1, "clip_by_weight_ratio: max_ratio"),
    (lambda v: T.scale_by_thor(damping=v), float("nan"), "scale_by_thor: damping must be"),
])
def test_numpy_scalars_are_checked_like_python_numbers(wrap, make, value, match):
  with pytest.raises(ValueError, match=match):
    make(wrap(value))


def test_numpy_ints_and_scalars_that_can_train_are_accepted():
  T.thor(np.float32(0.05), np.float64(0.03), momentum=np.float32(0.9), max_kl=np.float32(1e-2),
         max_update_ratio=np.float32(0.1), max_pi=np.int64(5), weight_decay=np.float32(0))
  assert T.CheckSchedule(np.int64(3), min_interval=np.int32(2)).check_steps(7) == [0, 3, 6]


def test_rescale_cap_from_numpy_is_checked(setup):
  params, grads, _ = setup
  tx = T.rescale_weight_norms(lambda shape: np.float32(-1.0))
  with pytest.raises(ValueError, match="rescale_weight_norms: max_norm must return a positive"):
    tx.update(grads, tx.init(params), params)


def test_traced_hyperparameters_still_pass(setup):
  params, grads, stats = setup
  tx = optax.inject_hyperparams(T.thor, static_args=("block_size", "ema_decay",
                                                    "ema_rows_ratio"))(
      learning_rate=0.05, damping=0.03, max_update_ratio=0.3)
  step = jax.jit(lambda g, s, p, c: tx.update(g, s, p, curvature_stats=c))
  updates, _ = step(grads, tx.init(params), params, stats)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


# A damping schedule's Python float was never checked at update time.
@pytest.mark.parametrize("schedule", [optax.constant_schedule(-0.01), lambda c: float("nan")],
                         ids=["constant_negative", "python_nan"])
def test_python_float_damping_from_a_schedule_skips_the_step(setup, schedule):
  params, grads, stats = setup
  tx = T.thor(0.05, damping=schedule)
  updates, state = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  assert int(optax.tree_utils.tree_get(state, "total_notfinite")) == 1
  assert all(not np.any(u) for u in jax.tree.leaves(updates))


# An integer dtype stored int32 inverses.
@pytest.mark.parametrize("dtype", ["int32", jnp.int8, "bool", "not_a_dtype"])
def test_non_floating_dtype_is_refused(dtype):
  with pytest.raises(ValueError, match="scale_by_thor: dtype must be None or a floating-point"):
    T.scale_by_thor(dtype=dtype)
  with pytest.raises(ValueError, match="scale_by_kfac: dtype"):
    T.scale_by_kfac(dtype=dtype)


# A misspelled keyword of update was dropped, so no check step ran.
@pytest.mark.parametrize("keyword, right", [("curvature_stat", "curvature_stats"),
                                            ("stats", "curvature_stats"),
                                            ("gradient_stat", "gradient_stats"),
                                            ("curv_stats", "curvature_stats")])
def test_misspelled_update_keyword_names_the_right_one(setup, keyword, right):
  params, grads, stats = setup
  tx = T.thor(0.05)
  with pytest.raises(ValueError, match=f"'{keyword}'.*did you mean {right}"):
    tx.update(grads, tx.init(params), params, **{keyword: stats})
  tx.update(grads, tx.init(params), params, value=1.0)  # another member's: allowed


# The paper's schedules checked nothing.
@pytest.mark.parametrize("make, error, match", [
    (lambda: T.thor_learning_rate_schedule(-0.05, 100, 2.0), ValueError, "init_value"),
    (lambda: T.thor_learning_rate_schedule(0.1, 0, 2.0), ValueError, "decay_steps must be >= 1"),
    (lambda: T.thor_learning_rate_schedule(0.1, 10, -1.0), ValueError, "power"),
    (lambda: T.thor_learning_rate_schedule(0.1, 10, 2.0, float("nan")), ValueError,
     "end_value"),
    (lambda: T.thor_learning_rate_schedule("0.1", 10, 2.0), TypeError, "init_value"),
    (lambda: T.thor_damping_schedule(float("nan"), 0.5, 10), ValueError, "init_value"),
    (lambda: T.thor_damping_schedule(0.03, -0.5, 10), ValueError, "decay_rate"),
    (lambda: T.thor_damping_schedule(0.03, 0.5, 0), ValueError, "decay_steps"),
    (lambda: T.thor_damping_schedule(0.03, 0.5, 2.5), TypeError, "decay_steps must be an int"),
])
def test_paper_schedules_check_their_arguments(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_paper_schedules_take_numpy_values():
  lr = T.thor_learning_rate_schedule(np.float32(0.1), np.int64(10), 2.0)
  np.testing.assert_allclose(float(lr(5)), 0.025, rtol=1e-6)
  np.testing.assert_allclose(float(T.thor_damping_schedule(0.03, 0.5, 10)(10)), 0.015,
                             rtol=1e-6)


# Strings, None and other objects built, then failed inside JAX at the first update.
@pytest.mark.parametrize("make, error, match", [
    (lambda: T.thor("0.1"), TypeError, "thor: learning_rate must be a number or an optax"),
    (lambda: T.thor(None), TypeError, "thor: learning_rate"),
    (lambda: T.kaisa(0.1, damping="0.03"), TypeError, "kaisa: damping"),
    (lambda: T.thor(0.1, damping=None), TypeError, "thor: damping"),
    (lambda: T.scale_by_thor(None), TypeError, "scale_by_thor: damping"),
    (lambda: T.scale_by_kl_clip(T.scale_by_thor(), 0.1, None), TypeError, "max_kl must be"),
    (lambda: T.clip_by_weight_ratio("0.1"), TypeError, "clip_by_weight_ratio: max_ratio"),
    (lambda: T.clip_by_weight_ratio(0.1, eps_rms=None), TypeError, "eps_rms"),
    (lambda: T.clip_by_weight_ratio(0.1, layers={}), ValueError, "layers must be None or"),
    (lambda: T.rescale_weight_norms(5.0), TypeError, "max_norm must be None or a function"),
    (lambda: T.curvature_budget(None, None, share="0.1"), TypeError, "share must be a number"),
    (lambda: T.CheckSchedule(3, min_interval=None), TypeError, "min_interval must be an int"),
    (lambda: T.CheckSchedule(True), TypeError, "interval must be an int or a callable"),
    (lambda: T.scale_by_thor(trace_thresholds=0.01), TypeError, "trace_thresholds must be a pair"),
    (lambda: T.scale_by_thor(trace_thresholds=(0.01,)), ValueError, "trace_thresholds must be"),
    (lambda: T.thor(0.1, pi_damping="False"), TypeError, "pi_damping must be True or False"),
    (lambda: T.thor(True), TypeError, "learning_rate"),
])
def test_arguments_of_the_wrong_type_are_refused_at_construction(make, error, match):
  with pytest.raises(error, match=match):
    make()


# NaN and infinite intervals; numpy integer intervals.
@pytest.mark.parametrize("args", [(2, float("nan"), 100), (float("nan"), 5, 100),
                                  (2, float("inf"), 100), (2, 5, float("nan"))])
def test_growing_interval_refuses_nan_and_inf(args):
  with pytest.raises(ValueError, match="growing_interval needs finite"):
    T.growing_interval(*args)


def test_check_schedule_names_a_nan_interval():
  with pytest.raises(ValueError, match="CheckSchedule: the interval schedule returned nan"):
    T.CheckSchedule(lambda s: float("nan")).check_steps(10)
  assert T.CheckSchedule(np.int64(4)).check_steps(9) == [0, 4, 8]


# Wrapping something that is not a transform; update without the state.
@pytest.mark.parametrize("make, match", [
    (lambda: T.scale_by_kl_clip(None, 0.1), "preconditioner must be an optax"),
    (lambda: T.scale_by_kl_clip(T.scale_by_thor, 0.1), "function 'scale_by_thor' itself"),
    (lambda: T.scale_by_kl_clip(0.1, T.scale_by_thor()), "order of the signature"),
    (lambda: T.skip_not_finite(optax.sgd), "skip_not_finite: inner .*'sgd' itself"),
])
def test_wrapping_what_is_not_a_transform_is_refused(make, match):
  with pytest.raises(TypeError, match=match):
    make()


def test_update_without_its_state_is_named(setup):
  params, grads, _ = setup
  tx = T.thor(0.05)
  state = tx.init(params)
  for bad in (lambda: tx.update(grads, None, params), lambda: tx.update(grads, params, state)):
    with pytest.raises(TypeError, match="skip_not_finite: update's state must be"):
      bad()
  pre = T.scale_by_thor()
  with pytest.raises(TypeError, match="scale_by_thor: update's state must be the KroneckerState"):
    pre.update(grads, None, params)


# The docstrings say what they raise and where the piece comes from.
@pytest.mark.parametrize("obj", [T.thor_learning_rate_schedule, T.thor_damping_schedule,
                                 T.skip_not_finite, T.CurvatureBudget, T.CheckSchedule,
                                 T.growing_interval], ids=lambda o: o.__name__)
def test_docstrings_have_raises_and_source(obj):
  assert "Raises:" in obj.__doc__ and "Source:" in obj.__doc__


def test_numpy_values_of_python_only_options_and_the_sharding_mesh():
  """Options decided in Python take numpy scalars (before: refused as "traced"); the bias
  correction checks a numpy momentum; ``kronecker_state_sharding`` names a mesh that is not
  a ``Mesh`` (before: ``AttributeError``)."""
  T.kfac(0.1, ema_decay=np.float32(0.9))
  T.scale_by_thor(0.1, ema_decay=np.float32(0.9), ema_rows_ratio=np.float64(2.0))
  with pytest.raises(ValueError, match="momentum must be in"):
    T.scale_by_momentum_bias_correction(np.float32(1.0))
  params = {"Dense_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)}}
  state = T.kfac(0.1).init(params)
  for mesh in (None, jax.devices()):
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
      T.kronecker_state_sharding(state, mesh)
