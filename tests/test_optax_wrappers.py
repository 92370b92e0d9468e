"""The preconditioners inside optax's wrappers and Flax's TrainState, and the errors users hit.

Each test compares against the same computation done without the wrapper (or on one whole
batch), so a wrapper that drops the statistics, refreshes at the wrong step or mixes up layers
fails it.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax.flax import TrainState
from thor_optax.flax import value_and_grad_with_stats

import reference

pytestmark = pytest.mark.usefixtures("fast_compiles")


class _ConvNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    x = nn.relu(nn.Dense(6)(x.reshape(x.shape[0], -1)))
    return nn.Dense(3)(x)


class _Shared(nn.Module):
  """A LayerNorm applied twice (weight sharing of a normalization layer): captured by neither
  path, named in ``unhandled``."""

  @nn.compact
  def __call__(self, x):
    shared = nn.LayerNorm()
    x = nn.tanh(shared(nn.tanh(shared(nn.Dense(5)(x)))))
    return nn.Dense(3)(x)


def _loss(out, y):
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def _data(n, seed=0):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.normal(kx, (n, 6, 6, 2)), jax.random.randint(ky, (n,), 0, 3)


@pytest.fixture(scope="module")
def conv_setup():
  model = _ConvNet()
  x, y = _data(16)
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  capture = jax.jit(value_and_grad_with_stats(model, _loss))
  (_, grads), stats = capture(params, x, y)
  return model, params, grads, stats, capture


def _assert_trees_close(a, b, **kw):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, **kw), a, b)


def _kronecker(opt_state):
  return optax.tree_utils.tree_get(opt_state, "diagnostics")


def test_multi_steps_combines_micro_batches_and_refreshes_once_per_emitted_step():
  """k micro-batches with their statistics joined equal one step on the whole batch."""
  model = _ConvNet()
  k, n = 4, 8
  x, y = _data(k * n, seed=3)
  params = model.init(jax.random.PRNGKey(1), x[:n])["params"]
  capture = jax.jit(value_and_grad_with_stats(model, _loss))
  make = lambda: thor_optax.thor(0.2, 0.05, block_size=8, trace_thresholds=(0.0, 0.0))

  # Reference: two optimizer steps on whole batches of k * n examples.
  ref_tx = make()
  ref_params, ref_state = params, ref_tx.init(params)
  ref_update = jax.jit(lambda g, s, p, st: ref_tx.update(g, s, p, curvature_stats=st))
  for _ in range(2):
    (_, grads), stats = capture(ref_params, x, y)
    updates, ref_state = ref_update(grads, ref_state, ref_params, stats)
    ref_params = optax.apply_updates(ref_params, updates)

  # The same two steps as 2 k micro-steps through optax.MultiSteps.
  tx = optax.MultiSteps(make(), every_k_schedule=k)
  check = jax.jit(lambda g, s, p, st: tx.update(g, s, p, curvature_stats=st))
  plain = jax.jit(lambda g, s, p: tx.update(g, s, p))
  ms_params, ms_state = params, tx.init(params)
  micro_stats = []
  for micro_step in range(2 * k):
    i = micro_step % k
    (_, grads), stats = capture(ms_params, x[i * n:(i + 1) * n], y[i * n:(i + 1) * n])
    micro_stats.append(stats)
    if i == k - 1:  # the emitted micro-step: the whole batch's statistics, once
      updates, ms_state = check(grads, ms_state, ms_params,
                                thor_optax.concatenate_stats(*micro_stats))
      micro_stats = []
    else:
      updates, ms_state = plain(grads, ms_state, ms_params)
    ms_params = optax.apply_updates(ms_params, updates)

  _assert_trees_close(ms_params, ref_params, rtol=2e-4, atol=2e-6)
  diagnostics = _kronecker(ms_state.inner_opt_state)
  ref_diagnostics = _kronecker(ref_state)
  for name, diag in diagnostics.items():
    # Two emitted steps refreshed every block twice: no refresh was counted per micro-step.
    assert int(diag.total_refreshes) == 2 * int(diag.num_blocks), name
    assert int(diag.total_refreshes) == int(ref_diagnostics[name].total_refreshes)
  # A micro-step without statistics does not factorize anything.
  state0 = tx.init(params)
  plain_jaxpr = str(jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(grads, state0))
  check_jaxpr = str(jax.make_jaxpr(lambda g, s, st: tx.update(g, s, params, curvature_stats=st))(
      grads, state0, stats))
  assert "cholesky" in check_jaxpr and "cholesky" not in plain_jaxpr


def test_concatenate_stats_joins_examples_and_rejects_other_models(conv_setup):
  model, params, _, _, capture = conv_setup
  x, y = _data(12, seed=5)
  (_, _), whole = capture(params, x, y)
  (_, _), first = capture(params, x[:4], y[:4])
  (_, _), rest = capture(params, x[4:], y[4:])
  joined = thor_optax.concatenate_stats(first, rest)
  _assert_trees_close(joined, whole, rtol=1e-5, atol=1e-6)
  other = thor_optax.CurvatureStats({"Dense_1": first.layers["Dense_1"]})
  with pytest.raises(ValueError, match="micro-batch 1 has statistics for layers"):
    thor_optax.concatenate_stats(first, other)
  with pytest.raises(ValueError, match="at least one"):
    thor_optax.concatenate_stats()
  with pytest.raises(TypeError, match=r"concatenate_stats\(\*stats_list\)"):
    thor_optax.concatenate_stats([first, rest])  # before: nested layers '0/layers/...'


@pytest.mark.parametrize("prefix", [False, True], ids=["labels per leaf", "labels per module"])
def test_partition_thor_on_conv_adam_elsewhere(conv_setup, prefix):
  _, params, grads, stats, _ = conv_setup
  labels = jax.tree_util.tree_map_with_path(
      lambda path, _: "thor" if "Conv" in jax.tree_util.keystr(path) else "adam", params)
  if prefix:  # optax takes labels that are a prefix of the tree
    labels = {name: "thor" if "Conv" in name else "adam" for name in params}
  # No KL clip: it scales the update by an inner product over the leaves it is given, which
  # differ between the partition and the whole model; the preconditioner itself is per layer.
  thor = thor_optax.thor(0.1, 0.05, block_size=8, max_kl=None)
  tx = optax.partition({"thor": thor, "adam": optax.adam(1e-2)}, labels)
  state = tx.init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the Dense layers' statistics are ignored, not warned about
    updates, state = jax.jit(lambda g, s: tx.update(g, s, params, curvature_stats=stats))(
        grads, state)
  # Conv: THOR's update on the whole model, restricted to the conv layer (it is per layer).
  full, _ = jax.jit(lambda g: thor.update(g, thor.init(params), params,
                                          curvature_stats=stats))(grads)
  _assert_trees_close(updates["Conv_0"], full["Conv_0"], rtol=1e-5, atol=1e-7)
  # Dense layers: Adam's update.
  adam = optax.adam(1e-2)
  adam_updates, _ = adam.update(grads, adam.init(params), params)
  for name in ("Dense_0", "Dense_1"):
    _assert_trees_close(updates[name], adam_updates[name], rtol=1e-6, atol=1e-8)
  # Only the conv layer has curvature state.
  assert set(_kronecker(state.inner_states["thor"])) == {"Conv_0"}


@pytest.mark.parametrize("prefix", [False, True], ids=["mask per leaf", "mask per module"])
def test_masked_preconditions_only_the_mask(conv_setup, prefix):
  """``optax.masked`` with a mask of the whole tree, or of a prefix of it (one boolean per
  module, which optax accepts; before, the check step then took Dense_0's statistics for a
  layer of another model)."""
  _, params, grads, stats, _ = conv_setup
  mask = {name: jax.tree_util.tree_map(lambda _: name != "Dense_0", sub)
          for name, sub in params.items()}
  if prefix:
    mask = {name: name != "Dense_0" for name in params}
  pre = thor_optax.scale_by_thor(0.05, block_size=8)
  tx = optax.masked(pre, mask)
  updates, state = jax.jit(lambda g: tx.update(g, tx.init(params), params,
                                               curvature_stats=stats))(grads)
  _assert_trees_close(updates["Dense_0"], grads["Dense_0"], rtol=0, atol=0)
  full, _ = jax.jit(lambda g: pre.update(g, pre.init(params), params,
                                         curvature_stats=stats))(grads)
  for name in ("Conv_0", "Dense_1"):
    _assert_trees_close(updates[name], full[name], rtol=1e-5, atol=1e-7)
  assert set(state.inner_state.diagnostics) == {"Conv_0", "Dense_1"}


def test_tree_map_params_maps_the_momentum_and_keeps_the_curvature_state(conv_setup):
  _, params, grads, stats, _ = conv_setup
  tx = thor_optax.thor(0.1, 0.05, block_size=8)
  _, state = jax.jit(lambda g: tx.update(g, tx.init(params), params,
                                         curvature_stats=stats))(grads)
  mapped = optax.tree_map_params(tx, lambda p: jnp.full_like(p, 7.0), state)
  momentum = optax.tree_utils.tree_get(mapped, "trace")
  assert jax.tree_util.tree_structure(momentum) == jax.tree_util.tree_structure(params)
  assert all(bool(jnp.all(m == 7.0)) for m in jax.tree_util.tree_leaves(momentum))
  kron = reference.kronecker_state(state)
  assert kron is not None
  _assert_trees_close(reference.kronecker_state(mapped), kron, rtol=0, atol=0)  # unchanged
  # transform_non_params sees each curvature field as a whole (e.g. one sharding per field).
  specs = optax.tree_map_params(tx, lambda p: "param", state, transform_non_params=lambda _: "x")
  assert set(reference.kronecker_state(specs)) == {"x"}
  assert set(jax.tree_util.tree_leaves(optax.tree_utils.tree_get(specs, "trace"))) == {"param"}
  # Inside optax.masked too (it passes the placeholder through).
  masked = optax.masked(thor_optax.scale_by_thor(0.05, block_size=8),
                        jax.tree_util.tree_map(lambda _: True, params))
  optax.tree_map_params(masked, lambda p: p, masked.init(params))


def test_train_state_passes_statistics(conv_setup):
  model, params, grads, stats, _ = conv_setup
  tx = thor_optax.thor(0.1, 0.05, block_size=8)
  state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  step = jax.jit(lambda s, g, st: s.apply_gradients(grads=g, curvature_stats=st))
  new = step(state, grads, stats)
  updates, opt_state = jax.jit(lambda g: tx.update(g, tx.init(params), params,
                                                   curvature_stats=stats))(grads)
  # The two programs compile the float32 Cholesky inverses differently (one also applies the
  # updates): they agree to float32 rounding, about 1e-5 relative on the worst-conditioned block
  # and 1e-8 absolute on updates of up to 0.07 (a step without the statistics: up to 6e-2).
  _assert_trees_close(new.params, optax.apply_updates(params, updates), rtol=1e-6, atol=1e-7)
  _assert_trees_close(new.opt_state, opt_state, rtol=1e-4, atol=1e-8)
  assert new.tx is tx and int(new.step) == 1
  # A plain step: the stored inverses, no refresh.
  plain = jax.jit(lambda s, g: s.apply_gradients(grads=g))(new, grads)
  updates2, _ = jax.jit(lambda g, s, p: tx.update(g, s, p))(grads, opt_state, new.params)
  _assert_trees_close(plain.params, optax.apply_updates(new.params, updates2),
                      rtol=1e-6, atol=1e-7)
  assert int(_kronecker(plain.opt_state)["Conv_0"].total_refreshes) == int(
      _kronecker(new.opt_state)["Conv_0"].total_refreshes)


def test_statistics_of_no_layer_are_an_error(conv_setup):
  _, params, grads, _, _ = conv_setup
  tx = thor_optax.scale_by_thor(0.05, block_size=8)
  with pytest.raises(ValueError, match="holds no layer statistics.*Conv_0"):
    tx.update(grads, tx.init(params), params, curvature_stats=thor_optax.CurvatureStats({}))


def test_layers_the_capture_cannot_precondition_are_named():
  model = _Shared()
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 5))
  y = jnp.arange(8) % 3
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  (_, grads), stats = value_and_grad_with_stats(model, _loss)(params, x, y)
  tx = thor_optax.scale_by_thor(0.05, block_size=4)
  with pytest.warns(UserWarning, match=r"LayerNorm_0: called 2 times.*optax.partition"):
    updates, _ = jax.jit(lambda g: tx.update(g, tx.init(params), params,
                                             curvature_stats=stats))(grads)
  _assert_trees_close(updates["LayerNorm_0"], grads["LayerNorm_0"], rtol=0, atol=0)
  for name in ("Dense_0", "Dense_1"):
    assert not np.allclose(updates[name]["kernel"], grads[name]["kernel"])
