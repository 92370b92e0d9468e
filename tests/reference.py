"""Shared helpers of the float64 dense-reference tests (test_exactness.py, test_factors.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from thor_optax.flax import value_and_grad_with_stats

F64 = jnp.float64


@pytest.fixture(autouse=True, scope="module")
def float64_mode():
  """Dense references in float64, for the importing module's tests only."""
  with jax.enable_x64(True):
    yield


def randn(seed, shape):
  """Standard normal NumPy draws (float64)."""
  return np.random.default_rng(seed).standard_normal(shape)


def init_params(model, *args, seed=0):
  """float64 parameters of the model's shapes, drawn with NumPy (no compilation)."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args))["params"]
  rng = np.random.default_rng(100 + seed)

  def draw(leaf):
    scale = 1.0 / np.sqrt(np.prod(leaf.shape[:-1])) if len(leaf.shape) > 1 else 0.3
    return jnp.asarray(scale * rng.standard_normal(leaf.shape), F64)

  return jax.tree.map(draw, shapes)


def capture(model, loss_fn, **kwargs):
  """Jitted ``value_and_grad_with_stats``."""
  return jax.jit(value_and_grad_with_stats(model, loss_fn, **kwargs))


def squared_error(out, y):
  """``0.5 ||out - y||^2`` per example, averaged over examples."""
  return 0.5 * jnp.sum((out - y) ** 2, axis=-1).mean()


def softmax_ce(out, y):
  """Softmax cross-entropy with integer labels, averaged over examples."""
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
