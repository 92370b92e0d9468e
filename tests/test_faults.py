"""Fault injection: every alias through one bad step, then clean steps; and misuse errors.

Each alias runs under ``optax.inject_hyperparams`` so that a bad learning rate or damping (what
a schedule can produce) enters as data: every fault below is an input of the same two jitted
steps (check and plain) per alias, so the module compiles ten programs.

Faults (the robustness issue's list): a NaN or an Inf in one gradient entry on a check step and
on a plain step, NaN statistics, a damping of 0 or below, a NaN learning rate (each must leave
parameters and the whole optimizer state unchanged, counted in ``total_notfinite``); a damping
of 1e-12 (accepted: the damping floor and the KL clip keep the step bounded); an all-zero batch
on a check step (accepted, but the blocks it zeroed keep their inverses). After each fault the
run goes on with clean steps and must train.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax.flax import value_and_grad_with_stats
from thor_optax._src import blocks as blocks_lib

from reference import softmax_ce

LR, LAM = 0.1, 0.03
NAN, INF = float("nan"), float("inf")
ALIASES = {
    "thor": (thor_optax.thor, dict(block_size=4)),
    "kfac": (thor_optax.kfac, {}),
    "skfac": (thor_optax.skfac, {}),
    "kaisa": (thor_optax.kaisa, dict(inverse_period=2)),
    "spngd": (thor_optax.spngd, {}),
}
STATIC = ("block_size", "ema_decay", "inverse_period", "adaptive_refresh", "max_refresh_interval")


class Net(nn.Module):
  """Two dense layers (8 -> 8 -> 4): with block_size 4 every THOR factor has 2+ blocks."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="Dense_1")(jnp.tanh(nn.Dense(8, name="Dense_0")(x)))


def _data(seed=0, n=16):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 8)).astype(np.float32)
  y = (np.abs(x[:, :4]).argmax(axis=1)).astype(np.int32)  # learnable labels
  return jnp.asarray(x), jnp.asarray(y)


def _poison_grads(grads, value):
  """``grads`` plus ``value`` (0, NaN or Inf) in one entry of the last kernel."""
  kernel = grads["Dense_1"]["kernel"]
  return {**grads, "Dense_1": {**grads["Dense_1"], "kernel": kernel.at[0, 1].add(value)}}


def _poison_stats(stats, value):
  return jax.tree.map(
      lambda a: a + value if jnp.issubdtype(jnp.asarray(a).dtype, jnp.inexact) else a, stats)


@functools.lru_cache(maxsize=None)
def _runner(name):
  """(tx, step) of one alias: ``step(params, state, x, y, grad_fault, stats_fault, lr,
  damping, check)``, jitted with ``check`` static."""
  factory, settings = ALIASES[name]
  static = tuple(a for a in STATIC if a in inspect.signature(factory).parameters)
  tx = optax.inject_hyperparams(factory, static_args=static)(
      learning_rate=LR, damping=LAM, **settings)
  capture = value_and_grad_with_stats(Net(), softmax_ce)

  @functools.partial(jax.jit, static_argnames="check")
  def step(params, state, x, y, grad_fault, stats_fault, lr, damping, check):
    (loss, grads), stats = capture(params, x, y)
    grads = _poison_grads(grads, grad_fault)
    state = state._replace(hyperparams={**state.hyperparams, "learning_rate": lr,
                                        "damping": damping})
    extra = dict(curvature_stats=_poison_stats(stats, stats_fault)) if check else {}
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state, loss

  return tx, step


def _clean(step, params, state, x, y, check):
  return step(params, state, x, y, 0.0, 0.0, LR, LAM, check=check)


def _train(step, params, state, x, y, steps):
  """Clean steps, a check step every other one; the losses."""
  losses = []
  for i in range(steps):
    params, state, loss = _clean(step, params, state, x, y, i % 2 == 0)
    losses.append(float(loss))
  return params, state, losses


def _guard(state):
  return state.inner_state  # inject_hyperparams -> the alias's skip_not_finite state


def _assert_tree_equal(a, b, what):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def _assert_all_finite(tree, what):
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact)), what


# (fault, check step?, gradient fault, statistics fault, learning rate, damping)
SKIPPED_FAULTS = [
    ("NaN gradient, plain step", False, NAN, 0.0, LR, LAM),
    ("Inf gradient, plain step", False, INF, 0.0, LR, LAM),
    ("NaN gradient, check step", True, NAN, 0.0, LR, LAM),
    ("Inf gradient, check step", True, INF, 0.0, LR, LAM),
    ("NaN statistics", True, 0.0, NAN, LR, LAM),
    ("damping 0 from a schedule, check step", True, 0.0, 0.0, LR, 0.0),
    ("damping 0 from a schedule, plain step", False, 0.0, 0.0, LR, 0.0),
    ("negative damping from a schedule", True, 0.0, 0.0, LR, -0.01),
    ("NaN learning rate from a schedule", False, 0.0, 0.0, NAN, LAM),
]


@pytest.mark.parametrize("name", list(ALIASES))
def test_bad_steps_change_nothing_and_training_recovers(name):
  """Each fault on a trained state: parameters and the whole optimizer state unchanged, the
  skip counted; then clean steps train (the loss falls below the fault's)."""
  tx, step = _runner(name)
  x, y = _data()
  params = Net().init(jax.random.PRNGKey(0), x)["params"]
  params, state, losses = _train(step, params, tx.init(params), x, y, 4)
  for fault, check, g_fault, s_fault, lr, lam in SKIPPED_FAULTS:
    new_params, new_state, loss = step(params, state, x, y, g_fault, s_fault, lr, lam,
                                       check=check)
    _assert_tree_equal(new_params, params, f"{name}: {fault}: parameters changed")
    _assert_tree_equal(_guard(new_state).inner_state, _guard(state).inner_state,
                       f"{name}: {fault}: optimizer state changed")
    assert int(_guard(new_state).total_notfinite) == int(_guard(state).total_notfinite) + 1, (
        name, fault)
    assert not bool(_guard(new_state).last_finite), (name, fault)
    after, after_state, after_losses = _train(step, new_params, new_state, x, y, 6)
    _assert_all_finite((after, after_state), f"{name}: after {fault}")
    assert bool(_guard(after_state).last_finite), (name, fault)
    assert after_losses[-1] < float(loss), (name, fault, float(loss), after_losses)


@pytest.mark.parametrize("name", list(ALIASES))
def test_tiny_damping_step_is_bounded_by_the_floor_and_the_kl_clip(name):
  """A damping of 1e-12 on a check step is accepted (it is positive), but the damping floor
  and the KL clip keep the step within a few times the step at the default damping (measured:
  at most 5.6x, for kfac; without them 19-120x for thor, skfac, kfac and kaisa), and training
  goes on."""
  tx, step = _runner(name)
  x, y = _data()
  params = Net().init(jax.random.PRNGKey(0), x)["params"]
  params, state, _ = _train(step, params, tx.init(params), x, y, 4)

  def moved(damping):
    new_params, new_state, _ = step(params, state, x, y, 0.0, 0.0, LR, damping, check=True)
    assert bool(_guard(new_state).last_finite), name
    return new_params, new_state, max(float(jnp.max(jnp.abs(a - b))) for a, b in
                                      zip(jax.tree.leaves(new_params), jax.tree.leaves(params)))

  new_params, new_state, tiny = moved(1e-12)
  assert 0 < tiny < 8 * moved(LAM)[2], (name, tiny, moved(LAM)[2])
  _, _, losses = _train(step, new_params, new_state, x, y, 6)
  assert np.isfinite(losses).all() and losses[-1] < losses[0] * 1.5, (name, losses)


@pytest.mark.parametrize("name", ["thor", "skfac", "kfac"])
def test_all_zero_batch_keeps_the_inverses_it_cannot_inform(name):
  """An all-zero batch on a check step: the first layer's A blocks (inputs all zero, trace
  0) keep the inverses they had; the step is finite and training recovers."""
  tx, step = _runner(name)
  x, y = _data()
  params = Net().init(jax.random.PRNGKey(0), x)["params"]
  params, state, _ = _train(step, params, tx.init(params), x, y, 4)
  kron = _find_kronecker(state)
  new_params, new_state, _ = step(params, state, jnp.zeros_like(x), y, 0.0, 0.0, LR, LAM,
                                  check=True)
  new_kron = _find_kronecker(new_state)
  _assert_all_finite((new_params, new_state), name)
  group, span = _a_blocks(name, "Dense_0")
  _assert_tree_equal(jax.tree.map(lambda v: v[span], new_kron.blocks[group]["inverse"]),
                     jax.tree.map(lambda v: v[span], kron.blocks[group]["inverse"]),
                     f"{name}: the zero batch replaced Dense_0's A inverse")
  _, _, losses = _train(step, new_params, new_state, x, y, 8)
  assert losses[-1] < losses[0], (name, losses)


def _find_kronecker(state):
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(
      s, thor_optax.KroneckerState)) if isinstance(s, thor_optax.KroneckerState)]
  assert len(found) == 1
  return found[0]


def _a_blocks(name, layer):
  """(group, slice) of ``layer``'s A blocks in alias ``name``'s state (its block size)."""
  params = Net().init(jax.random.PRNGKey(0), _data()[0])["params"]
  spec = blocks_lib.build_layout(params, ALIASES[name][1].get("block_size")).layer(layer)
  return spec.a.group, slice(spec.a.start, spec.a.stop)


# ------------------------------------------------------------------------------------------
# Misuse: each raises (or warns) naming the setting or the layer and what to do.


def _setup(out=4):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(out, name="Dense_1")(jnp.tanh(nn.Dense(8, name="Dense_0")(x)))

  x, y = _data()
  model = M()
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  (_, grads), stats = value_and_grad_with_stats(model, softmax_ce)(params, x, y % out)
  return params, grads, stats


def test_state_of_other_layer_names_is_named():
  params, grads, stats = _setup()
  renamed = {f"Renamed_{k}": v for k, v in params.items()}
  tx = thor_optax.thor(LR)
  for extra in (dict(curvature_stats=stats), {}):
    with pytest.raises(ValueError, match=r"initialised for the layers \['Renamed_Dense_0'"):
      tx.update(grads, tx.init(renamed), params, **extra)


def test_integer_statistics_are_rejected():
  params, grads, stats = _setup()
  as_int = jax.tree.map(lambda a: a.astype(jnp.int32), stats)
  tx = thor_optax.thor(LR)
  with pytest.raises(ValueError, match="'Dense_.*floating-point statistics"):
    tx.update(grads, tx.init(params), params, curvature_stats=as_int)


@pytest.mark.parametrize("factory", [thor_optax.thor, thor_optax.kfac, thor_optax.skfac,
                                     thor_optax.kaisa, thor_optax.spngd])
@pytest.mark.parametrize("kwargs, message", [
    (dict(learning_rate=NAN), "learning_rate must be finite and >= 0, got nan"),
    (dict(learning_rate=-0.1), "learning_rate must be finite and >= 0, got -0.1"),
    (dict(damping=INF), "damping must be finite and > 0, got inf"),
    (dict(damping=0.0), "damping must be finite and > 0, got 0.0"),
    (dict(momentum=NAN), r"momentum must be in \[0, 1\), got nan"),
    (dict(momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
    (dict(min_relative_damping=-0.1), "min_relative_damping must be finite and >= 0"),
])
def test_settings_that_cannot_train_are_rejected(factory, kwargs, message):
  kwargs = {"learning_rate": LR, **kwargs}
  with pytest.raises(ValueError, match=message):
    factory(**kwargs)


@pytest.mark.parametrize("name", ["kfac", "kaisa"])
def test_inject_hyperparams_without_static_args_names_them(name):
  params, grads, stats = _setup()
  tx = optax.inject_hyperparams(getattr(thor_optax, name))(learning_rate=LR)
  with pytest.raises(ValueError, match=r"static_args=\('ema_decay', 'inverse_period'\)"):
    tx.init(params)


def test_layer_without_statistics_warns_that_it_keeps_its_inverses():
  params, grads, stats = _setup()
  tx = thor_optax.scale_by_thor()
  partial = dataclasses.replace(
      stats, layers={k: v for k, v in stats.layers.items() if k != "Dense_0"})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx.update(grads, tx.init(params), params, curvature_stats=partial)
  text = " ".join(str(w.message) for w in caught)
  assert "['Dense_0'] keep the inverses they have" in text, text
  assert "pass through" not in text, text
