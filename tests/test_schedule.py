"""Host-side check schedules and the paper's learning-rate/damping schedule shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax


def test_fixed_interval_is_mindspore_frequency():
  is_check = thor_optax.CheckSchedule(5)
  assert [s for s in range(23) if is_check(s)] == [0, 5, 10, 15, 20]
  assert thor_optax.CheckSchedule(1).check_steps(4) == [0, 1, 2, 3]


def test_growing_interval_dense_early_sparse_late():
  interval = thor_optax.growing_interval(2, 50, transition_steps=1000)
  np.testing.assert_allclose(float(interval(0)), 2.0)
  np.testing.assert_allclose(float(interval(1000)), 50.0, rtol=1e-5)
  np.testing.assert_allclose(float(interval(5000)), 50.0, rtol=1e-5)
  steps = thor_optax.CheckSchedule(interval).check_steps(3000)
  gaps = np.diff(steps)
  assert steps[:3] == [0, 2, 4]
  assert np.all(np.diff(gaps) >= 0), "intervals never shrink"
  assert gaps[-1] == 50
  # Queries in any order agree with the enumeration.
  is_check = thor_optax.CheckSchedule(interval)
  assert sorted(s for s in reversed(range(3000)) if is_check(s)) == steps


@pytest.mark.parametrize("bad", [dict(start=0, end=5, transition_steps=10),
                                 dict(start=5, end=2, transition_steps=10),
                                 dict(start=1, end=2, transition_steps=0)])
def test_growing_interval_rejects_bad_arguments(bad):
  with pytest.raises(ValueError):
    thor_optax.growing_interval(**bad)


def test_check_schedule_rejects_bad_interval():
  with pytest.raises(ValueError):
    thor_optax.CheckSchedule(0)
  with pytest.raises(TypeError):
    thor_optax.CheckSchedule("10")
  with pytest.raises(ValueError, match="min_interval"):
    thor_optax.CheckSchedule(5, min_interval=0)


def test_min_interval_floors_the_growing_interval():
  interval = thor_optax.growing_interval(1, 20, transition_steps=100)
  steps = thor_optax.CheckSchedule(interval, min_interval=6).check_steps(400)
  gaps = np.diff(steps)
  assert steps[:4] == [0, 6, 12, 18] and gaps.min() == 6
  assert gaps[-1] == 20  # above the floor, THOR's interval as it was
  unfloored = np.diff(thor_optax.CheckSchedule(interval).check_steps(400))
  assert unfloored[0] == 1


def _matmuls(count):
  """A compiled function of ``count`` chained 64 x 64 matrix products: ``count * 2 * 64^3``
  FLOPs."""
  w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)), jnp.float32)

  def fn(x):
    for _ in range(count):
      x = jnp.tanh(x @ w)
    return x

  return jax.jit(fn).lower(w)


def test_curvature_budget_from_xla_flops():
  plain, check = _matmuls(1).compile(), _matmuls(3)  # a lowered function is compiled here
  budget = thor_optax.curvature_budget(check, plain, share=0.1)
  gemm = 2 * 64 ** 3
  np.testing.assert_allclose(budget.plain_flops, gemm, rtol=0.05)  # (+ the tanh)
  np.testing.assert_allclose(budget.check_flops, 3 * gemm, rtol=0.05)
  # (C - P)(1 - s) / (s P) = 2 * 0.9 / 0.1 = 18 steps; then the checks take 2 / 20 = 10%.
  assert budget.min_interval == 18
  assert budget.spent(18) <= 0.1 < budget.spent(17)
  assert thor_optax.curvature_budget(check, plain, share=0.5).min_interval == 2
  assert thor_optax.curvature_budget(plain, check, share=0.1).min_interval == 1  # no extra
  with pytest.raises(ValueError, match="share must be in"):
    thor_optax.curvature_budget(check, plain, share=1.0)
  with pytest.raises(TypeError, match="must be a compiled step function"):
    thor_optax.curvature_budget(lambda x: x, plain, share=0.1)


def test_paper_schedule_shapes():
  lr = thor_optax.thor_learning_rate_schedule(0.1, decay_steps=100, power=2.0)
  np.testing.assert_allclose([float(lr(s)) for s in (0, 50, 100, 200)],
                             [0.1, 0.1 * 0.25, 0.0, 0.0], atol=1e-7)
  damping = thor_optax.thor_damping_schedule(0.03, decay_rate=0.5, decay_steps=10)
  np.testing.assert_allclose([float(damping(s)) for s in (0, 10, 15)],
                             [0.03, 0.015, 0.03 * 0.5 ** 1.5], rtol=1e-6)
