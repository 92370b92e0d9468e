"""Fault injection: every alias through one bad step, then clean steps; and misuse errors.

Each alias runs under ``optax.inject_hyperparams`` so that a bad learning rate or damping (what
a schedule can produce) enters as data: every fault below is an input of the same two jitted
steps (check and plain) per alias, so the module compiles ten programs.

Faults (the robustness issue's list): a NaN or an Inf in one gradient entry on a check step and
on a plain step, NaN statistics, a damping of 0 or below, a NaN learning rate (each must leave
parameters and the whole optimizer state unchanged, counted in ``total_notfinite``); a damping
of 1e-12 (accepted: the damping floor and the KL clip keep the step bounded); an all-zero batch
on a check step (accepted, but the blocks it zeroed keep their inverses). After each fault the
run goes on with clean steps and must train. Blocks whose statistics vanish next to their
damping or are near-singular once damped keep their inverses (``damping.resolvable``), and so
do blocks whose statistics collapsed since their last refresh (``damping.collapsed``).
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
from thor_optax._src import damping as damping_lib
from thor_optax._src import finite
from thor_optax._src import linalg
from thor_optax._src.inverses import base as base_inverses

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
STATIC = ("block_size", "ema_decay", "ema_rows_ratio", "inverse_period", "adaptive_refresh",
          "max_refresh_interval")


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
  0) keep the inverses they had, and are counted as rejected; the step is finite and training
  recovers."""
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
  # Dense_1's inputs are tanh(Dense_0's bias) for every example: one row repeated. Both
  # layers' A blocks are rejected, their G blocks accepted.
  for layer in ("Dense_0", "Dense_1"):
    _, a_span = _a_blocks(name, layer)
    assert int(new_kron.diagnostics[layer].rejected_blocks) == a_span.stop - a_span.start, (
        name, layer)
  _, _, losses = _train(step, new_params, new_state, x, y, 8)
  assert losses[-1] < losses[0], (name, losses)


def test_resolvable_blocks_lie_between_the_roundoff_of_the_damping_and_one_over_eps():
  """``damping.resolvable``: ``eps d r < tr <= d / eps`` (bounds of ``cond(B + d I)``), ``eps``
  of the dtype the blocks are factorized in (float32 for bfloat16)."""
  eps32, eps64 = float(jnp.finfo(jnp.float32).eps), float(jnp.finfo(jnp.float64).eps)
  d, r = 1e-3, 4.0
  with jax.enable_x64(True):
    for dtype, eps in ((jnp.float32, eps32), (jnp.float64, eps64), (jnp.bfloat16, eps32)):
      tr = jnp.asarray([0.0, 0.5 * eps * d * r, 2 * eps * d * r, 1.0, 0.5 * d / eps,
                        2 * d / eps], dtype)
      got = damping_lib.resolvable(tr, jnp.full_like(tr, d), jnp.full_like(tr, r))
      np.testing.assert_array_equal(np.asarray(got), [False, False, True, True, True, False],
                                    err_msg=str(dtype))


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_all_finite_finds_one_bad_entry_in_any_leaf(bad):
  """The guard's check (``finite.all_finite``) finds one bad entry in a large leaf (checked on
  its own) and in a small one (checked with the others, concatenated), in float32 and bfloat16
  leaves alike; finite entries near float32's largest, whose sum overflows, are finite."""
  leaves = {"large": jnp.ones((300, 200)), "small": jnp.ones((7,)),
            "bf16": jnp.ones((5,), jnp.bfloat16), "ints": jnp.arange(3),
            "empty": jnp.zeros((0,))}
  assert bool(finite.all_finite(leaves))
  assert bool(finite.all_finite({"huge": jnp.full((4,), 3e38, jnp.float32)}))
  for name, index in (("large", (299, 199)), ("small", (3,)), ("bf16", (4,))):
    bad_leaves = {**leaves, name: leaves[name].at[index].set(bad)}
    assert not bool(jax.jit(finite.all_finite)(bad_leaves)), name
  assert bool(finite.all_finite({})) and bool(finite.all_finite({"ints": jnp.arange(3)}))


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_is_finite_block_finds_one_bad_entry_per_block(bad):
  """``linalg.is_finite_block`` (which refreshed inverses are accepted) flags exactly the
  blocks with a bad entry; large finite entries pass, in float16 too (summed in float32)."""
  x = jnp.ones((4, 128, 128)).at[1, 127, 0].set(bad).at[3, 5, 99].set(bad)
  np.testing.assert_array_equal(np.asarray(jax.jit(linalg.is_finite_block)(x)),
                                [True, False, True, False])
  assert bool(linalg.is_finite_block(jnp.full((1, 128, 128), 1e30))[0])
  assert bool(linalg.is_finite_block(jnp.full((1, 128, 128), 6e4, jnp.float16))[0])
  half = jnp.ones((2, 8, 8), jnp.float16).at[0, 1, 1].set(bad)
  np.testing.assert_array_equal(np.asarray(linalg.is_finite_block(half)), [False, True])


def test_a_failed_factorization_keeps_the_inverse():
  """A block whose damped covariance is not positive definite (Cholesky gives NaN) keeps the
  inverse it had and is not counted as refreshed; the other block is refreshed."""
  good = 2.0 * jnp.eye(4)
  bad = -jnp.eye(4)  # damped by 0.1: still negative definite
  old = jnp.stack([3.0 * jnp.eye(4), 5.0 * jnp.eye(4)])
  cov = jnp.stack([bad, good])
  damping, real = jnp.full((2,), 0.1), jnp.ones((2, 4))
  new, done = blocks_lib.masked_block_update(
      jnp.array([True, True]), old,
      lambda idx: (lambda inv, ok: (inv.inverse, ok))(*base_inverses.cholesky_refresh(
          cov[idx], damping[idx], real[idx], None)))
  np.testing.assert_array_equal(np.asarray(done), [False, True])
  np.testing.assert_allclose(np.asarray(new[0]), 3.0 * np.eye(4))
  np.testing.assert_allclose(np.asarray(new[1]), np.eye(4) / 2.1, rtol=1e-6)


def _thor_first_check(x, damping):
  """``scale_by_thor`` (no floor, no clip; 4-blocks) on a fresh state: (state, updates)."""
  params = Net().init(jax.random.PRNGKey(0), x)["params"]
  y = jnp.zeros((x.shape[0],), jnp.int32)
  (_, grads), stats = value_and_grad_with_stats(Net(), softmax_ce)(params, x, y)
  tx = thor_optax.scale_by_thor(damping, block_size=4)
  updates, state = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  return state, updates


def test_near_singular_blocks_keep_their_inverses():
  """Two examples give rank-2 factors; with the floor off and lambda = 1e-16 (d = 1e-8 per
  factor) the condition bound of Dense_0's A blocks (inputs of size 1) exceeds 1 / eps of
  float32: they are not refreshed (they keep the identity) and are counted in
  ``rejected_blocks``; every other block is refreshed or rejected, and the update is finite.
  Inverting them would have been meaningless: the float32 inverse of block 0 of Dense_0's A
  is off from the float64 one by more than the float64 one's own size."""
  x, _ = _data(n=2)
  state, updates = _thor_first_check(x, 1e-16)
  _assert_all_finite(updates, "updates")
  spec = blocks_lib.build_layout(Net().init(jax.random.PRNGKey(0), x)["params"], 4).layer(
      "Dense_0")
  span = slice(spec.a.start, spec.a.stop)
  np.testing.assert_array_equal(
      np.asarray(state.blocks[spec.a.group]["record"].refreshes[span]), [0, 0, 0])
  np.testing.assert_array_equal(np.asarray(state.blocks[spec.a.group]["inverse"].inverse[span]),
                                np.broadcast_to(np.eye(4), (3, 4, 4)))
  assert int(state.diagnostics["Dense_0"].rejected_blocks) >= 3
  for layer, d in state.diagnostics.items():
    assert int(d.blocks_refreshed) + int(d.rejected_blocks) == int(d.num_blocks), layer
  # The premise: block 0 of Dense_0's A (inputs 0-3 of two examples) is not invertible in
  # float32 at that damping.
  rows = np.asarray(x[:, :4], np.float64)
  block = rows.T @ rows / 2 + 1e-8 * np.eye(4)
  exact = np.linalg.inv(block)
  f32 = np.asarray(linalg.cholesky_inverse(jnp.asarray(block[None], jnp.float32))[0])
  assert not np.all(np.isfinite(f32)) or np.abs(f32 - exact).max() > np.abs(exact).max()


def test_a_block_whose_statistics_collapsed_keeps_its_inverse():
  """Inputs 0-3 scaled by 1e-12 (units that do not fire): block 0 of Dense_0's A has a trace
  below the roundoff of its damping and keeps the identity; the other A blocks are refreshed."""
  x, _ = _data()
  x = x.at[:, :4].multiply(1e-12)
  state, updates = _thor_first_check(x, LAM)
  _assert_all_finite(updates, "updates")
  spec = blocks_lib.build_layout(Net().init(jax.random.PRNGKey(0), x)["params"], 4).layer(
      "Dense_0")
  refreshes = np.asarray(state.blocks[spec.a.group]["record"].refreshes[spec.a.start:
                                                                            spec.a.stop])
  np.testing.assert_array_equal(refreshes, [0, 1, 1])
  assert int(state.diagnostics["Dense_0"].rejected_blocks) == 1
  assert int(state.diagnostics["Dense_1"].rejected_blocks) == 0


def test_collapsed_compares_damped_traces_with_the_reference_at_the_damping_of_now():
  """``damping.collapsed``: below 10% of the damped trace at the last refresh, scaled down by
  ``lambda``'s fall since (never up), and never for a block not refreshed yet."""
  assert damping_lib.COLLAPSE_RATIO == 0.1
  ref = jnp.asarray([10.0, 10.0, 10.0, 0.0])
  now = jnp.asarray([0.99, 1.01, 0.99, 0.0])
  got = damping_lib.collapsed(now, ref, jnp.asarray(0.1), jnp.asarray([0.1, 0.1, 0.1, 0.0]))
  np.testing.assert_array_equal(np.asarray(got), [True, False, True, False])
  # lambda 100x lower than at the last refresh: the reference is 100x lower.
  low = jnp.asarray([0.05, 0.0101, 0.0099, 0.0])
  got = damping_lib.collapsed(low, ref, jnp.asarray(1e-3), jnp.full((4,), 0.1))
  np.testing.assert_array_equal(np.asarray(got), [False, False, True, False])
  # lambda higher than at the last refresh: the reference stays.
  got = damping_lib.collapsed(now, ref, jnp.asarray(10.0), jnp.full((4,), 0.1))
  np.testing.assert_array_equal(np.asarray(got), [True, False, True, False])


def _thor_checks(tx, x, y, scales, apply=True):
  """``tx`` (THOR, 4-blocks) through one check step per entry of ``scales``, the cotangents of
  the statistics multiplied by it; the states after each (``apply=False``: the parameters stay
  at their initial values, so the statistics are the same at every check but for the scale)."""
  net = Net()
  params = net.init(jax.random.PRNGKey(0), x)["params"]
  capture = value_and_grad_with_stats(net, softmax_ce)

  @jax.jit
  def check(params, state, scale):
    (_, grads), stats = capture(params, x, y)
    stats = jax.tree.map(lambda s: dataclasses.replace(s, cotangents=s.cotangents * scale),
                         stats, is_leaf=lambda s: hasattr(s, "cotangents"))
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates) if apply else params, state

  state, states = tx.init(params), []
  for scale in scales:
    params, state = check(params, state, scale)
    states.append(state)
  return states


def test_a_check_whose_cotangents_collapsed_keeps_the_g_inverses():
  """A check step whose output cotangents are 100x smaller than at the last (a batch the model
  fits almost exactly; ``G``'s trace 1e-4 of the last): every ``G`` block keeps its inverse and
  is counted as rejected, the ``A`` blocks are refreshed; cotangents 2x smaller (``G``'s trace
  25% of the last, 50% of the reference the rejection halved) are taken. Before the rule, such
  a check took a CNN from a loss of 0.0000 to 69 on the next step (``damping.collapsed``)."""
  x, y = _data()
  # lambda 1e-8: the G blocks' statistics dominate their damping (1e-4 per factor).
  tx = thor_optax.scale_by_thor(1e-8, block_size=4, trace_thresholds=(0.0, 0.0))
  first, collapsed, taken = _thor_checks(tx, x, y, [1.0, 1e-2, 0.5])
  layout = blocks_lib.build_layout(Net().init(jax.random.PRNGKey(0), x)["params"], 4)
  spec = {name: layout.layer(name) for name in ("Dense_0", "Dense_1")}
  for name, s in spec.items():
    g = slice(s.g.start, s.g.stop)
    group = s.g.group
    np.testing.assert_array_equal(np.asarray(collapsed.blocks[group]["inverse"].inverse[g]),
                                  np.asarray(first.blocks[group]["inverse"].inverse[g]))
    np.testing.assert_array_equal(np.asarray(collapsed.blocks[group]["record"].refreshes[g]),
                                  np.ones(g.stop - g.start))
    np.testing.assert_array_equal(np.asarray(taken.blocks[group]["record"].refreshes[g]),
                                  2 * np.ones(g.stop - g.start))
    d = collapsed.diagnostics[name]
    assert int(d.rejected_blocks) == g.stop - g.start, name
    assert int(d.blocks_refreshed) == s.a.stop - s.a.start, name
    assert int(taken.diagnostics[name].rejected_blocks) == 0, name


def test_statistics_that_stay_low_are_taken_once_the_halved_reference_reaches_them():
  """Cotangents 10x smaller at every check after the first (``G``'s trace about 1% of the
  first's, and the same at each check): each rejection halves the block's reference
  (``damping.COLLAPSE_DECAY``), so the ``G`` blocks are rejected at the checks where they are
  below 10% of it and taken at the first where they are not, as a NumPy replay of the rule
  from the recorded traces says; then they are refreshed at every check."""
  x, y = _data()
  tx = thor_optax.scale_by_thor(1e-8, block_size=4, trace_thresholds=(0.0, 0.0))
  states = _thor_checks(tx, x, y, [1.0] + [0.1] * 7, apply=False)
  layout = blocks_lib.build_layout(Net().init(jax.random.PRNGKey(0), x)["params"], 4)
  for name in ("Dense_0", "Dense_1"):
    g = layout.layer(name).g
    sl = slice(g.start, g.stop)
    record = lambda state: state.blocks[g.group]["record"]  # pylint: disable=cell-var-from-loop
    first = np.asarray(record(states[0]).trace_ref[sl])
    low = np.asarray(record(states[-1]).trace_ref[sl])  # taken by then: the trace of now
    ref, refreshes, expected = first.copy(), np.ones_like(first), []
    for _ in states[1:]:
      rejected = low < damping_lib.COLLAPSE_RATIO * ref
      ref = np.where(rejected, ref * damping_lib.COLLAPSE_DECAY, low)
      refreshes = refreshes + ~rejected
      expected.append(refreshes.copy())
    got = [np.asarray(record(s).refreshes[sl]) for s in states[1:]]
    np.testing.assert_array_equal(np.stack(got), np.stack(expected))
    # The premise: rejected at two checks or more, then taken.
    assert np.all(np.stack(expected)[1] == 1) and np.all(np.stack(expected)[-1] > 1), name
    assert np.all((low / first > 0.01) & (low / first < 0.02)), name  # 1% and the damping's


def test_lowering_the_damping_is_not_a_collapse():
  """``lambda`` lowered 1e6-fold between two checks (a schedule) with the same statistics: the
  damped traces of blocks the damping dominated fall far below 1% of the last, yet every block
  is refreshed, none rejected (the reference is judged at the damping of now)."""
  x, y = _data()
  tx = thor_optax.scale_by_thor(lambda count: jnp.where(count < 1, 100.0, 1e-4), block_size=4,
                                trace_thresholds=(0.0, 0.0))
  first, second = _thor_checks(tx, x, y, [1.0, 1.0])
  group = next(iter(second.blocks))
  ratio = second.blocks[group]["record"].trace_ref / first.blocks[group]["record"].trace_ref
  assert float(jnp.min(ratio)) < 1e-2  # the premise: without the rescaling, collapsed
  for name, d in second.diagnostics.items():
    assert int(d.rejected_blocks) == 0, name
    assert int(d.blocks_refreshed) == int(d.num_blocks), name


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


@pytest.mark.parametrize("make", [thor_optax.scale_by_thor, lambda: thor_optax.thor(LR)],
                         ids=["scale_by_thor", "thor"])
def test_state_of_a_model_with_other_factor_sizes_is_named(make):
  """A state for 12 outputs meets gradients of 10: the same layer names, and for
  ``scale_by_thor`` the same block stacks (both ``G`` fit one 128-block), so only the factor
  dimensions the state keeps in its structure tell them apart."""
  params, grads, stats = _setup(out=10)
  other, _, _ = _setup(out=12)
  tx = make()
  state = tx.init(other)
  if isinstance(state, thor_optax.KroneckerState):  # the premise: no array shape differs
    shapes = lambda s: [x.shape for x in jax.tree.leaves(s)]
    assert shapes(state) == shapes(tx.init(params))
  for extra in (dict(curvature_stats=stats), {}):
    with pytest.raises(ValueError, match=r"layer 'Dense_1' has Kronecker factors A 9 x 9, G 10 x "
                       r"10 in the gradients, but the state was initialised for A 9 x 9, G 12 x "
                       r"12"):
      jax.jit(functools.partial(tx.update, **extra))(grads, state, params)


def test_state_of_a_norm_of_other_size_is_named():
  """A LayerNorm of 8 features in the state, of 6 in the gradients: the block stacks are the
  same, only the layer's unit-wise side curvature differs."""
  model = nn.Sequential([nn.Dense(6), nn.LayerNorm(), nn.Dense(3)])
  params = model.init(jax.random.PRNGKey(0), jnp.ones((2, 5)))["params"]
  other = dict(params, layers_1={"scale": jnp.ones(8), "bias": jnp.zeros(8)})
  tx = thor_optax.spngd(LR)
  with pytest.raises(ValueError, match=r"layer 'layers_1' needs side curvature of shapes "
                     r"\[\(6, 2, 2\).*but the state holds \[\(8, 2, 2\)"):
    tx.update(params, tx.init(other), params)


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
  with pytest.raises(ValueError, match=rf"{name}: \('ema_decay', 'inverse_period'\)"):
    tx.init(params)


def test_inject_hyperparams_of_woodbury_rows_says_to_make_it_static():
  """``woodbury_rows`` fixes the state's shapes; traced by inject_hyperparams, the error says to
  pass it in ``static_args`` (before: only that it must be an int), with which it trains."""
  params, _, _ = _setup()
  with pytest.raises(ValueError, match="woodbury_rows must be .* pass it in static_args"):
    optax.inject_hyperparams(thor_optax.skfac)(LR, woodbury_rows=8).init(params)
  optax.inject_hyperparams(thor_optax.skfac, static_args=("woodbury_rows",))(
      LR, woodbury_rows=8).init(params)


def test_inject_hyperparams_of_spngd_names_its_static_args():
  """SP-NGD's adaptive refresh decides in Python which blocks a check refreshes: traced, its
  settings raise a ValueError naming the static_args, with which the update is spngd's."""
  params, grads, stats = _setup()
  with pytest.raises(ValueError, match=r"spngd: \('adaptive_refresh', 'max_refresh_interval'\)"):
    optax.inject_hyperparams(thor_optax.spngd)(learning_rate=LR).init(params)
  tx = optax.inject_hyperparams(
      thor_optax.spngd, static_args=("adaptive_refresh", "max_refresh_interval"))(
          learning_rate=LR)
  got, _ = jax.jit(lambda s: tx.update(grads, s, params, curvature_stats=stats))(
      tx.init(params))
  plain = thor_optax.spngd(learning_rate=LR)
  want, _ = plain.update(grads, plain.init(params), params, curvature_stats=stats)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got, want)


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
