"""scale_by_thor / scale_by_kfac as optax citizens: composition, jit, pytrees, robustness, errors."""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax.flax import value_and_grad_with_stats
from thor_optax._src.static_args import STATIC_ARGS

import reference
from reference import inverse_blocks, stack_field


class _MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(9)(x))
    return nn.Dense(3)(x)


def _loss(out, y):
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


@pytest.fixture(scope="module")
def setup():
  model = _MLP()
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 5))
  y = jnp.arange(16) % 3
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  (loss, grads), stats = jax.jit(value_and_grad_with_stats(model, _loss))(params, x, y)
  return params, grads, stats


def _tree_allclose(a, b, **kw):
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, **kw), a, b)


def _all_finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact))


def test_chain_equals_manual_composition(setup):
  params, grads, stats = setup
  pre = thor_optax.scale_by_thor(0.05, block_size=4)
  tx = optax.chain(pre, optax.add_decayed_weights(1e-2), optax.sgd(0.3, momentum=0.9))
  updates, _ = jax.jit(lambda g, s: tx.update(g, s, params, curvature_stats=stats))(
      grads, tx.init(params))
  natural, _ = pre.update(grads, pre.init(params), params, curvature_stats=stats)
  expected = jax.tree_util.tree_map(lambda n, p: -0.3 * (n + 1e-2 * p), natural, params)
  _tree_allclose(updates, expected, rtol=1e-5, atol=1e-7)
  # The alias with heavy-ball momentum is the same chain without its KL clip, pi rule and
  # damping floor ...
  alias = thor_optax.thor(0.3, 0.05, weight_decay=1e-2, block_size=4, max_kl=None,
                          pi_damping=False, min_relative_damping=0.0, nesterov=False)
  a_updates, _ = alias.update(grads, alias.init(params), params, curvature_stats=stats)
  _tree_allclose(a_updates, expected, rtol=1e-5, atol=1e-7)
  # ... and with its defaults, the chain around the clipped (3e-2), floored preconditioner with
  # the pi rule (pi clipped at 5), with Nesterov momentum: from a zero trace its first step is
  # (1 + 0.9) times the heavy-ball one.
  pre = thor_optax.scale_by_kl_clip(
      thor_optax.scale_by_thor(0.05, block_size=4, pi_damping=True, max_pi=5.0,
                               min_relative_damping=1.0), 0.3, 3e-2)
  natural, pre_state = pre.update(grads, pre.init(params), params, curvature_stats=stats)
  assert float(pre_state.scale) < 1.0  # the clip binds at this learning rate
  expected = jax.tree_util.tree_map(lambda n, p: -0.3 * 1.9 * (n + 1e-2 * p), natural, params)
  alias = thor_optax.thor(0.3, 0.05, weight_decay=1e-2, block_size=4)
  a_updates, _ = alias.update(grads, alias.init(params), params, curvature_stats=stats)
  _tree_allclose(a_updates, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["scale_by_thor", "scale_by_kfac"])
def test_inject_hyperparams_of_the_building_blocks_with_their_static_args(setup, name):
  """The tuples the errors and the README name (``static_args.STATIC_ARGS``) for the
  building blocks: without them a ValueError names them; with them the update is the
  uninjected transform's."""
  params, grads, stats = setup
  factory = getattr(thor_optax, name)
  with pytest.raises(ValueError, match=rf"{name}: \(" + ", ".join(
      f"'{a}'" for a in STATIC_ARGS[name]) + r"\)"):
    optax.inject_hyperparams(factory)(damping=0.05).init(params)
  tx = optax.inject_hyperparams(factory, static_args=STATIC_ARGS[name])(damping=0.05)
  got, _ = jax.jit(lambda s: tx.update(grads, s, params, curvature_stats=stats))(tx.init(params))
  plain = factory(damping=0.05)
  want, _ = jax.jit(lambda s: plain.update(grads, s, params, curvature_stats=stats))(
      plain.init(params))
  _tree_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_inject_hyperparams_changes_lr_and_damping_without_recompiling(setup):
  params, grads, stats = setup
  with pytest.raises(ValueError, match="static_args"):
    optax.inject_hyperparams(thor_optax.thor)(learning_rate=0.1).init(params)
  tx = optax.inject_hyperparams(thor_optax.thor,
                                static_args=("block_size", "ema_decay", "ema_rows_ratio"))(
      learning_rate=0.1, damping=0.05, max_kl=None, min_relative_damping=0.0, ema_decay=None,
      nesterov=False)
  state = tx.init(params)
  traces = []

  @jax.jit
  def step(state):
    traces.append(1)
    return tx.update(grads, state, params, curvature_stats=stats)

  u1, state = step(state)
  dtype = state.hyperparams["learning_rate"].dtype
  state.hyperparams["learning_rate"] = jnp.asarray(0.2, dtype)
  state.hyperparams["damping"] = jnp.asarray(5.0, dtype)
  u2, state = step(state)
  assert len(traces) == 1
  # Heavy-ball momentum: the second update is -lr_2 (P_2 g + 0.9 P_1 g), with
  # P_1 g = -u1 / lr_1; P with the alias's pi rule (max_pi, a number, injected too).
  ref = thor_optax.scale_by_thor(5.0, pi_damping=True, max_pi=5.0)
  natural2, _ = ref.update(grads, ref.init(params), params, curvature_stats=stats)
  expected = jax.tree_util.tree_map(lambda n, a: -0.2 * (n - 0.9 * a / 0.1), natural2, u1)
  _tree_allclose(u2, expected, rtol=1e-4, atol=1e-6)
  # The check at the second step used damping 5.0: same inverses as a fixed-damping run.
  _, ref_state = ref.update(grads, ref.init(params), params, curvature_stats=stats)
  inner = reference.kronecker_state(state)
  _tree_allclose(inverse_blocks(inner), inverse_blocks(ref_state), rtol=1e-5, atol=1e-6)


def test_state_survives_flatten_unflatten_and_jit(setup):
  params, grads, stats = setup
  tx = thor_optax.thor(0.1, block_size=4)
  _, state = jax.jit(lambda s: tx.update(grads, s, params, curvature_stats=stats))(
      tx.init(params))
  leaves, treedef = jax.tree_util.tree_flatten(state)
  restored = jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])
  u1, s1 = jax.jit(tx.update)(grads, state, params)
  u2, s2 = jax.jit(tx.update)(grads, restored, params)
  _tree_allclose(u1, u2, rtol=0, atol=0)
  _tree_allclose(s1, s2, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_non_finite_statistics_leave_state_finite_and_inverses_unchanged(setup, bad):
  params, grads, stats = setup
  tx = thor_optax.scale_by_thor(0.05, block_size=4, trace_thresholds=(0.0, 0.0))
  update = jax.jit(lambda s, st: tx.update(grads, s, params, curvature_stats=st))
  _, state = update(tx.init(params), stats)
  layer = stats.layers["Dense_0"]
  poisoned_layer = thor_optax.DenseStats(inputs=layer.inputs.at[3, 2].set(bad),
                                         cotangents=layer.cotangents)
  poisoned = thor_optax.CurvatureStats(layers={**stats.layers, "Dense_0": poisoned_layer})
  updates, after = update(state, poisoned)
  assert _all_finite(after)
  # The update says so (NaN everywhere), for a guard to skip the step without reading the
  # statistics again; the same statistics made finite give a finite update.
  assert all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(updates))
  assert _all_finite(update(state, stats)[0])
  # Dense_0's blocks are kept, Dense_1's are refreshed again (thresholds 0).
  assert int(after.diagnostics["Dense_0"].blocks_refreshed) == 0
  assert int(after.diagnostics["Dense_1"].blocks_refreshed) > 0
  _tree_allclose(inverse_blocks(after), inverse_blocks(state), rtol=0, atol=0)  # same stats for Dense_1


def test_non_finite_gradients_leave_state_finite(setup):
  params, grads, stats = setup
  tx = thor_optax.thor(0.1, block_size=4)
  _, state = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  bad_grads = jax.tree_util.tree_map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  _, after = jax.jit(tx.update)(bad_grads, state, params)
  kron = reference.kronecker_state(after)
  assert _all_finite(kron)
  _tree_allclose(inverse_blocks(kron), inverse_blocks(reference.kronecker_state(state)),
                 rtol=0, atol=0)


def test_mismatched_statistics_name_the_layer(setup):
  params, grads, stats = setup
  tx = thor_optax.scale_by_thor()
  state = tx.init(params)
  layer = stats.layers["Dense_1"]
  wrong = thor_optax.DenseStats(inputs=layer.inputs[:, :4], cotangents=layer.cotangents)
  with pytest.raises(ValueError, match=r"'Dense_1'.*expected 9"):
    tx.update(grads, state, params,
              curvature_stats=thor_optax.CurvatureStats({**stats.layers, "Dense_1": wrong}))
  other = thor_optax.CurvatureStats({**stats.layers, "Conv_7": layer})
  with pytest.raises(ValueError, match="Conv_7.*different model"):
    tx.update(grads, state, params, curvature_stats=other)
  bad_g = thor_optax.DenseStats(inputs=layer.inputs, cotangents=layer.cotangents[..., :2])
  with pytest.raises(ValueError, match=r"'Dense_1'.*\(S, N, \.\.\., 3\)"):
    tx.update(grads, state, params,
              curvature_stats=thor_optax.CurvatureStats({**stats.layers, "Dense_1": bad_g}))


def test_state_from_other_parameters_is_rejected(setup):
  params, grads, _ = setup
  tx = thor_optax.scale_by_thor(block_size=4)
  other = {"Dense_0": {"kernel": jnp.zeros((7, 2))}}
  with pytest.raises(ValueError, match="does not match the gradient tree"):
    tx.update(grads, tx.init(other), params)


def test_damping_schedule_is_read_at_the_step_count(setup):
  params, grads, stats = setup
  schedule = optax.piecewise_constant_schedule(0.01, {1: 100.0})  # 0.01 at step 0, 1 after
  tx = thor_optax.scale_by_thor(schedule, block_size=None, trace_thresholds=(0.0, 0.0))
  fixed = thor_optax.scale_by_thor(1.0, block_size=None, trace_thresholds=(0.0, 0.0))
  state = tx.init(params)
  _, state = tx.update(grads, state, params)  # step 0 without statistics
  _, state = tx.update(grads, state, params, curvature_stats=stats)  # check at step 1
  _, ref = fixed.update(grads, fixed.init(params), params, curvature_stats=stats)
  _tree_allclose(inverse_blocks(state), inverse_blocks(ref), rtol=1e-5)


def test_steps_before_the_first_statistics_pass_the_gradient_and_count_no_refresh(setup):
  """A check step whose statistics are missing cannot be detected (the schedule is host-side):
  the README documents that the held inverses, the identity before any check, are applied and
  the diagnostics record no refresh."""
  params, grads, _ = setup
  tx = thor_optax.scale_by_thor(0.03, block_size=4)
  state = tx.init(params)
  for _ in range(2):
    updates, state = tx.update(grads, state, params)
    _tree_allclose(updates, grads, rtol=0.0)
  for name, d in state.diagnostics.items():
    assert int(d.total_refreshes) == 0 and int(d.blocks_refreshed) == 0, name


def test_ema_averages_factors_over_refreshes(setup):
  params, grads, stats = setup
  decay = 0.75
  tx = thor_optax.scale_by_kfac(0.05, ema_decay=decay)
  no_ema = thor_optax.scale_by_kfac(0.05, ema_decay=None)
  layer = stats.layers["Dense_0"]
  stats2 = thor_optax.CurvatureStats(
      {**stats.layers, "Dense_0": thor_optax.DenseStats(2 * layer.inputs, layer.cotangents)})
  _, s = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  _, s = tx.update(grads, s, params, curvature_stats=stats2)
  _, f1 = no_ema.update(grads, no_ema.init(params), params, curvature_stats=stats)
  # Factors are stored only with EMA; rebuild the expected average from single-batch runs.
  ema_tx = thor_optax.scale_by_kfac(0.05, ema_decay=0.0)
  _, a = ema_tx.update(grads, ema_tx.init(params), params, curvature_stats=stats)
  _, b = ema_tx.update(grads, ema_tx.init(params), params, curvature_stats=stats2)
  factors = lambda state: stack_field(state, "accumulator", "factor")
  for g in factors(s):
    np.testing.assert_allclose(factors(s)[g], decay * factors(a)[g] + (1 - decay) * factors(b)[g],
                               rtol=1e-5, atol=1e-6)
  assert not factors(f1), "no factor storage without EMA"


@pytest.mark.parametrize("max_pi", [None, 1.2, 1.0])
def test_pi_damping_matches_formula(setup, max_pi):
  params, grads, stats = setup
  lam = 0.05
  tx = thor_optax.scale_by_kfac(lam, ema_decay=0.0, pi_damping=True, max_pi=max_pi)
  _, s = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  layer = stats.layers["Dense_1"]
  a = np.concatenate([np.asarray(layer.inputs), np.ones((16, 1))], 1)
  g = np.asarray(layer.cotangents[0])
  fa, fg = a.T @ a / 16, g.T @ g / 16
  pi = np.sqrt((np.trace(fa) / fa.shape[0]) / (np.trace(fg) / fg.shape[0]))
  assert not 1 / 1.2 <= pi <= 1.2, f"the clip at 1.2 must bind, pi = {pi}"
  pi = pi if max_pi is None else np.clip(pi, 1 / max_pi, max_pi)  # 1: the equal split
  want_a = np.linalg.inv(fa + pi * np.sqrt(lam) * np.eye(10))
  want_g = np.linalg.inv(fg + np.sqrt(lam) / pi * np.eye(3))
  # Whole factors: A of Dense_1 (dim 10) and G (dim 3) are single unpadded blocks.
  np.testing.assert_allclose(inverse_blocks(s)["b10"][-1], want_a, rtol=2e-3, atol=1e-4)
  np.testing.assert_allclose(inverse_blocks(s)["b3"][-1], want_g, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("max_pi", [None, 1.2])
def test_spngd_clips_pi_like_its_preconditioner(setup, max_pi):
  """``spngd`` forwards ``max_pi`` to its pi rule (default 5, as ``thor``'s): with the clip,
  the floor, the KL clip, momentum and the rescaling off, its first step is ``-lr`` times
  ``scale_by_kfac``'s with the same pi rule, and the clip at 1.2 binds here (the test above)."""
  params, grads, stats = setup
  assert inspect.signature(thor_optax.spngd).parameters["max_pi"].default == 5.0
  lam, lr = 0.05, 0.3
  pre = thor_optax.scale_by_kfac(lam, ema_decay=None, pi_damping=True, max_pi=max_pi,
                                 adaptive_refresh=None)
  natural, _ = pre.update(grads, pre.init(params), params, curvature_stats=stats)
  alias = thor_optax.spngd(lr, lam, momentum=0.0, adaptive_refresh=None, rescale_weights=False,
                           max_kl=None, min_relative_damping=0.0, max_pi=max_pi)
  updates, _ = alias.update(grads, alias.init(params), params, curvature_stats=stats)
  _tree_allclose(updates, jax.tree_util.tree_map(lambda n: -lr * n, natural), rtol=1e-5,
                 atol=1e-7)
  if max_pi is not None:  # the clip changes the step
    unclipped = thor_optax.spngd(lr, lam, momentum=0.0, adaptive_refresh=None,
                                 rescale_weights=False, max_kl=None, min_relative_damping=0.0,
                                 max_pi=None)
    other, _ = unclipped.update(grads, unclipped.init(params), params, curvature_stats=stats)
    assert not np.allclose(updates["Dense_1"]["kernel"], other["Dense_1"]["kernel"], rtol=1e-3)


def test_max_pi_below_one_or_not_finite_is_refused():
  for bad in (0.5, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="max_pi must be finite and >= 1"):
      thor_optax.scale_by_thor(0.1, pi_damping=True, max_pi=bad)


def test_thor_alias_passes_max_pi(setup):
  params, grads, stats = setup
  pre = thor_optax.scale_by_thor(0.05, block_size=4, ema_decay=0.95, ema_rows_ratio=4.0,
                                 pi_damping=True, max_pi=1.2, min_relative_damping=0.1)
  # A floor below the damping of both factors, else the floor hides pi.
  alias = thor_optax.thor(1.0, 0.05, momentum=0.0, block_size=4, max_kl=None,
                          pi_damping=True, max_pi=1.2, min_relative_damping=0.1)
  want, _ = pre.update(grads, pre.init(params), params, curvature_stats=stats)
  got, _ = alias.update(grads, alias.init(params), params, curvature_stats=stats)
  _tree_allclose(got, jax.tree.map(lambda u: -u, want), rtol=1e-6, atol=1e-7)
  unclipped = thor_optax.thor(1.0, 0.05, momentum=0.0, block_size=4, max_kl=None,
                              max_pi=None, min_relative_damping=0.1)
  other, _ = unclipped.update(grads, unclipped.init(params), params, curvature_stats=stats)
  assert not np.allclose(other["Dense_1"]["kernel"], got["Dense_1"]["kernel"], rtol=1e-4)


def test_thor_alias_splits_damping_by_pi_except_for_eigh(setup):
  params, grads, stats = setup
  kw = dict(momentum=0.0, block_size=4, max_kl=None)

  def first_update(**options):
    tx = thor_optax.thor(1.0, 0.05, **kw, **options)
    return tx.update(grads, tx.init(params), params, curvature_stats=stats)[0]

  _tree_allclose(first_update(),
                 first_update(pi_damping=True, max_pi=5.0, min_relative_damping=1.0),
                 rtol=1e-6, atol=1e-7)
  # With a floor below both factors' damping (here the default floor hides pi): the rule.
  default = first_update(min_relative_damping=0.1)
  _tree_allclose(default, first_update(pi_damping=True, max_pi=5.0, min_relative_damping=0.1),
                 rtol=1e-6, atol=1e-7)
  equal = first_update(pi_damping=False, min_relative_damping=0.1)
  assert not np.allclose(equal["Dense_1"]["kernel"], default["Dense_1"]["kernel"], rtol=1e-4)
  # eigh damps A (x) G exactly: the default builds (pi_damping=True would raise) and splits
  # nothing.
  _tree_allclose(first_update(inverse_method="eigh"),
                 first_update(inverse_method="eigh", pi_damping=False), rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="pi_damping"):
    thor_optax.thor(1.0, 0.05, inverse_method="eigh", pi_damping=True)


def test_layers_without_statistics_pass_through(setup):
  params, grads, stats = setup
  tx = thor_optax.scale_by_thor(0.05, block_size=4)
  partial = thor_optax.CurvatureStats({"Dense_1": stats.layers["Dense_1"]})
  with pytest.warns(UserWarning, match="Dense_0"):
    updates, _ = tx.update(grads, tx.init(params), params, curvature_stats=partial)
  _tree_allclose(updates["Dense_0"], grads["Dense_0"], rtol=0, atol=0)
  assert not np.allclose(updates["Dense_1"]["kernel"], grads["Dense_1"]["kernel"])


def test_fresh_state_can_be_donated(setup):
  params, grads, stats = setup
  tx = thor_optax.thor(0.1, block_size=4)
  # A plain step passes the diagnostics through, so every leaf of the state is an input.
  step = jax.jit(lambda s: tx.update(grads, s, params)[1], donate_argnums=0)
  state = step(tx.init(params))  # raises if two leaves of the state share a buffer
  assert int(reference.kronecker_state(state).count) == 1


@pytest.mark.parametrize("make, pieces, inverse_fields", [
    (lambda: thor_optax.scale_by_thor(0.1, block_size=4), {"inverse", "record", "policy"},
     ("inverse",)),
    (lambda: thor_optax.scale_by_kfac(0.1), {"inverse", "record", "accumulator"}, ("inverse",)),
    (lambda: thor_optax.scale_by_kfac(0.1, inverse_method="eigh", ema_decay=None),
     {"inverse", "record"}, ("eigenvectors", "eigenvalues")),
    (lambda: thor_optax.scale_by_kfac(0.1, adaptive_refresh=0.1),
     {"inverse", "record", "policy", "accumulator"}, ("inverse",)),
])
def test_state_holds_only_what_the_pieces_need(setup, make, pieces, inverse_fields):
  params, grads, stats = setup
  tx = make()
  state = tx.init(params)
  for group, stack in state.blocks.items():
    assert set(stack) == pieces, group
    assert stack["inverse"]._fields == inverse_fields
    n = stack["record"].trace_ref.shape[0]
    assert all(leaf.shape[0] == n for leaf in jax.tree.leaves(stack)), group
  assert bool(jax.tree.leaves(state.accumulator)) == ("accumulator" in pieces)
  # The check step keeps the structure (nothing is added or dropped).
  _, after = tx.update(grads, state, params, curvature_stats=stats)
  assert jax.tree.structure(after) == jax.tree.structure(state)


def test_pieces_that_do_not_fit_are_rejected_naming_both():
  with pytest.raises(ValueError, match=r"inverse_method='woodbury' needs rows.*stored factors"
                     ) as woodbury:
    thor_optax.scale_by_kfac(0.1, inverse_method="woodbury", ema_decay=0.9)
  with pytest.raises(ValueError, match=r"pi_damping=True needs factored damping.*'eigh'") as pi:
    thor_optax.scale_by_thor(0.1, inverse_method="eigh", pi_damping=True)
  # Only the conflicting piece is named (not the refresh policy or the damping, which fit), and
  # the message says which options to change.
  assert "EveryCheck" not in str(woodbury.value) and "pi_damping" not in str(woodbury.value)
  assert "leave ema_decay=None" in str(woodbury.value)
  assert "TraceRule" not in str(pi.value) and "set pi_damping=False" in str(pi.value)
  with pytest.raises(ValueError, match=r"needs woodbury_rows"):
    thor_optax.scale_by_thor(0.1, inverse_method="low_rank")
