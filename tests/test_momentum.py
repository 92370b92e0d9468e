"""Momentum SGD with bias correction (``scale_by_momentum_bias_correction``, ``debias_momentum``)
against the explicit recurrence in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax


def _corrected_sgd(lr, beta, nesterov):
  return optax.chain(optax.sgd(lr, momentum=beta, nesterov=nesterov),
                     thor_optax.scale_by_momentum_bias_correction(beta, nesterov))


def _run(tx, grads):
  params = {"w": jnp.zeros(grads.shape[1:])}
  state = tx.init(params)
  out = []
  for g in grads:
    updates, state = tx.update({"w": jnp.asarray(g)}, state, params)
    out.append(np.asarray(updates["w"]))
  return np.stack(out)


@pytest.mark.parametrize("nesterov", [False, True])
def test_matches_the_explicit_recurrence(nesterov):
  lr, beta = 0.3, 0.9
  grads = np.random.default_rng(0).standard_normal((30, 4, 3))
  m, expected = np.zeros((4, 3)), []
  for t, g in enumerate(grads, start=1):
    m = g + beta * m
    step = g + beta * m if nesterov else m
    expected.append(-lr * step / (1 - beta ** (t + 1 if nesterov else t)))
  with jax.enable_x64(True):
    got = _run(_corrected_sgd(lr, beta, nesterov), jnp.asarray(grads, jnp.float64))
  np.testing.assert_allclose(got, np.stack(expected), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("nesterov", [False, True])
def test_a_steady_gradient_takes_the_steady_step_from_the_first_update(nesterov):
  lr, beta = 0.1, 0.9
  grads = np.tile(np.array([[1.0, -2.0], [0.5, 3.0]]), (25, 1, 1))
  steady = -lr * grads[0] / (1 - beta)
  with jax.enable_x64(True):
    corrected = _run(_corrected_sgd(lr, beta, nesterov), jnp.asarray(grads))
    plain = _run(optax.sgd(lr, momentum=beta, nesterov=nesterov), jnp.asarray(grads))
  np.testing.assert_allclose(corrected, np.broadcast_to(steady, grads.shape), rtol=1e-12)
  # optax.sgd alone starts at (1 - beta) of it (heavy-ball) or (1 - beta^2) (Nesterov).
  np.testing.assert_allclose(plain[0], steady * (1 - beta ** (2 if nesterov else 1)),
                             rtol=1e-12)


def test_zero_momentum_is_plain_sgd_and_bad_momentum_is_rejected():
  grads = np.random.default_rng(1).standard_normal((5, 3))
  np.testing.assert_allclose(_run(_corrected_sgd(0.2, 0.0, False), jnp.asarray(grads)),
                             -0.2 * grads, rtol=1e-6)
  for bad in (1.0, -0.1):
    with pytest.raises(ValueError, match="scale_by_momentum_bias_correction: momentum"):
      thor_optax.scale_by_momentum_bias_correction(bad)


def test_thor_debias_momentum_scales_its_first_step_and_keeps_the_trace():
  """``thor(debias_momentum=True)``: the first update is 1 / (1 - 0.9^2) times the default's
  (Nesterov), the momentum trace the same; with ``optax.inject_hyperparams`` the momentum may
  be traced."""
  params = {"Dense_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros((2,))}}
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5), params)
  out = {}
  for debias in (False, True):
    tx = thor_optax.thor(0.1, 0.03, debias_momentum=debias)
    updates, state = tx.update(grads, tx.init(params), params)
    trace = next(s for s in jax.tree.leaves(
        state, is_leaf=lambda s: isinstance(s, optax.TraceState))
        if isinstance(s, optax.TraceState)).trace
    out[debias] = updates, trace
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b / 0.19, rtol=1e-5),
               out[True][0], out[False][0])
  jax.tree.map(np.testing.assert_array_equal, out[True][1], out[False][1])
  injected = optax.inject_hyperparams(
      thor_optax.thor, static_args=("block_size", "ema_decay", "ema_rows_ratio"))(
      learning_rate=0.1, damping=0.03, momentum=0.9, debias_momentum=True)
  updates, _ = jax.jit(injected.update)(grads, injected.init(params), params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), updates, out[True][0])
