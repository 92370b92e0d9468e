"""Boxed parameters (``nn.with_partitioning``, ``nn.with_logical_partitioning``), as
``model.init`` returns them for sharded linen models.

A boxed leaf's tree path ends in ``.value`` (``nn.Partitioned`` is a pytree node). Before this
was handled, the capture listed ``'Conv_0/kernel: module kind not supported'`` for every boxed
kernel (so the check step warned that those "layers" were not preconditioned), and
``optax.masked`` hid a bias-free boxed layer under the name ``'Dense_0/kernel'``, so its
statistics were rejected as matching no layer. Here:

* capture from boxed parameters lists nothing as unhandled, in an ``nn.scan`` stack too;
  ``tx.init`` / ``tx.update`` (a check step, then a plain step, with THOR) give boxed updates
  equal to the unboxed ones (float64, below 1e-12), with the same layers preconditioned and no
  warning;
* ``optax.masked`` over boxed parameters hides a bias-free boxed layer by its module name;
* the optimizer state is sharded like the parameters: ``kronecker_state_sharding`` gives the
  momentum the boxed parameters' shardings (logical names through ``rules``), the same as Flax's
  recipe (``nn.logical_to_mesh_sharding(nn.get_partition_spec(jax.eval_shape(tx.init,
  params)), mesh, rules)``), and a jitted plain step on a 2-device mesh keeps it so.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import thor_optax
from thor_optax import flax as thor_linen

# Flax's recipe reads every box's names as logical names, so mesh axis names need a rule too.
RULES = (("hidden", "model"), ("channels", None), ("model", "model"))
F64 = dict(param_dtype=jnp.float64)


pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py


class Boxed(nn.Module):
  """Conv (logical names), dense (mesh axes), LayerNorm and an unboxed head."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    h = nn.Conv(4, (2, 2), kernel_init=nn.with_logical_partitioning(
        init, (None, None, "channels", "hidden")), **F64)(x)
    h = nn.Dense(4, kernel_init=nn.with_partitioning(init, (None, "model")),
                 bias_init=nn.with_partitioning(nn.initializers.zeros_init(), ("model",)),
                 **F64)(nn.relu(h).reshape(x.shape[0], -1))
    h = nn.LayerNorm(scale_init=nn.with_partitioning(nn.initializers.ones_init(), (None,)),
                     **F64)(h)
    return nn.Dense(3, **F64)(jnp.tanh(h))


def _loss(out, y):
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def _data():
  rng = np.random.default_rng(0)
  return rng.standard_normal((8, 3, 3, 2)), rng.integers(0, 3, 8)


def _boxed_params():
  x, _ = _data()
  return Boxed().init(jax.random.PRNGKey(0), x)["params"]


def _is_box(x):
  return isinstance(x, nn.Partitioned)


def _max_diff(got, want):
  return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def _kronecker(opt_state):
  return next(s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda s: isinstance(s, thor_optax.KroneckerState))
              if isinstance(s, thor_optax.KroneckerState))


def test_boxed_updates_equal_unboxed():
  model = Boxed()
  capture = thor_linen.value_and_grad_with_stats(model, _loss)
  tx = thor_optax.thor(0.1, 0.03, block_size=4)

  def two_steps(params, x, y):
    """A check step and a plain step: ``(updates of each, opt_state, stats)``."""
    (_, grads), stats = capture(params, x, y)
    state = tx.init(params)
    first, state = tx.update(grads, state, params, curvature_stats=stats)
    grads = jax.grad(lambda p: _loss(model.apply({"params": p}, x), y))(params)
    second, state = tx.update(grads, state, optax.apply_updates(params, first))
    return (first, second), state, stats

  def both(boxed, x, y):
    return two_steps(boxed, x, y), two_steps(nn.unbox(boxed), x, y)

  with jax.enable_x64(True), warnings.catch_warnings():
    warnings.simplefilter("error")
    boxed = _boxed_params()
    got, want = jax.jit(both)(boxed, *_data())
  (updates, state, stats), (plain_updates, plain_state, plain_stats) = got, want
  assert stats.unhandled == plain_stats.unhandled == ()
  assert sorted(stats.layers) == ["Conv_0", "Dense_0", "Dense_1", "LayerNorm_0"]
  for step in updates:  # boxed like the parameters
    assert jax.tree_util.tree_structure(step) == jax.tree_util.tree_structure(boxed)
    assert isinstance(step["Dense_0"]["kernel"], nn.Partitioned)
  assert _max_diff(nn.unbox(updates), plain_updates) < 1e-12
  assert _max_diff(nn.unbox(updates[0]), jax.tree.map(jnp.zeros_like, plain_updates[0])) > 1e-3
  diagnostics = _kronecker(state).diagnostics
  assert sorted(diagnostics) == sorted(_kronecker(plain_state).diagnostics) == [
      "Conv_0", "Dense_0", "Dense_1"]
  assert all(int(d.total_refreshes) == int(d.num_blocks) > 0 for d in diagnostics.values())
  assert sorted(_kronecker(state).layers) == ["LayerNorm_0"]


class ScannedBlock(nn.Module):
  """A residual block of two bias-free dense layers with logically partitioned kernels."""

  @nn.compact
  def __call__(self, h, _):
    def dense(name):
      return nn.Dense(6, use_bias=False, name=name, **F64, kernel_init=nn.with_logical_partitioning(
          nn.initializers.lecun_normal(), ("embed", "hidden")))
    return h + dense("out")(jnp.tanh(dense("in")(h))), None


class ScannedBoxed(nn.Module):
  """MaxText's layer stack: ``nn.scan`` over an ``nn.remat``-ed block, the stack axis named in
  the boxes by ``metadata_params={nn.PARTITION_NAME: 'layers'}``."""

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(nn.remat(ScannedBlock), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=2,
                    metadata_params={nn.PARTITION_NAME: "layers"})
    h, _ = stack(name="layers")(x, None)
    return nn.Dense(3, **F64, name="head")(h)


def test_scanned_boxed_stack_equals_unboxed():
  """Captured and preconditioned as the unboxed stack. Before: each boxed layer of the stack
  was listed as "called 2 times per forward pass (shared layer) inside a lifted transform" (the
  scan's second trace of its body counted as a call: the boxes hid the parameters' shapes from
  the stack's placement)."""
  model = ScannedBoxed()
  capture = thor_linen.value_and_grad_with_stats(model, _loss)
  tx = thor_optax.thor(0.1, 0.03, block_size=4)

  def update(params, x, y):
    (_, grads), stats = capture(params, x, y)
    return tx.update(grads, tx.init(params), params, curvature_stats=stats)[0], stats

  rng = np.random.default_rng(1)
  x, y = rng.standard_normal((8, 4, 6)), rng.integers(0, 3, (8, 4))
  with jax.enable_x64(True):
    boxed = model.init(jax.random.PRNGKey(0), x)["params"]
    assert isinstance(boxed["layers"]["in"]["kernel"], nn.LogicallyPartitioned)
    (updates, stats), (want, plain_stats) = jax.jit(
        lambda p: (update(p, x, y), update(nn.unbox(p), x, y)))(boxed)
  assert stats.unhandled == plain_stats.unhandled == ()
  assert sorted(stats.layers) == ["head", "layers"]
  assert _max_diff(nn.unbox(updates), want) < 1e-12
  assert _max_diff(nn.unbox(updates)["layers"], jax.tree.map(jnp.zeros_like,
                                                              want["layers"])) > 1e-3


def test_masked_boxed_layer_without_bias():
  """``optax.masked`` hides ``Dense_0`` (a boxed kernel, no bias) by its module name."""

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      h = nn.Dense(4, use_bias=False, kernel_init=nn.with_partitioning(
          nn.initializers.lecun_normal(), (None, "model")))(x)
      return nn.Dense(3)(jnp.tanh(h))

  model = Net()
  x, y = np.ones((8, 5), np.float32), np.arange(8) % 3
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  mask = {"Dense_0": {"kernel": nn.Partitioned(False, (None, "model"))},
          "Dense_1": {"kernel": True, "bias": True}}
  tx = optax.masked(thor_optax.scale_by_thor(0.03, block_size=4), mask)
  capture = thor_linen.value_and_grad_with_stats(model, _loss)

  def step(params):
    (_, grads), stats = capture(params, x, y)
    return tx.update(grads, tx.init(params), params, curvature_stats=stats), grads

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    (updates, state), grads = jax.jit(step)(params)
  assert sorted(state.inner_state.diagnostics) == ["Dense_1"]
  np.testing.assert_array_equal(updates["Dense_0"]["kernel"].value,
                                grads["Dense_0"]["kernel"].value)  # passed through
  assert not np.allclose(updates["Dense_1"]["kernel"], grads["Dense_1"]["kernel"])


def _without_trailing_none(spec):
  spec = list(spec)
  while spec and spec[-1] is None:
    spec.pop()
  return spec


def test_state_sharded_like_boxed_params_on_a_mesh():
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
  model = Boxed()
  tx = thor_optax.thor(0.1, 0.03, block_size=4)
  with jax.enable_x64(True):
    params = _boxed_params()
    abstract = jax.eval_shape(tx.init, params)
    ours = thor_optax.kronecker_state_sharding(abstract, mesh, rules=RULES)
    flax_recipe = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
    leaves = jax.tree.leaves(abstract)
    assert all(a.is_equivalent_to(b, leaf.ndim) for a, b, leaf in
               zip(jax.tree.leaves(ours), jax.tree.leaves(flax_recipe), leaves, strict=True))
    # Spelled out to every axis (as a step returns them), Flax's recipe shortens them.
    assert all(len(s.spec) == leaf.ndim for s, leaf in zip(jax.tree.leaves(ours), leaves))
    specs = [P(*_without_trailing_none(s.spec)) for s in jax.tree.leaves(ours)]
    momentum = jax.tree.leaves(abstract, is_leaf=_is_box)
    boxes = [b for b in momentum if _is_box(b)]
    assert len(boxes) == 4  # the momentum of the four boxed parameters
    with nn.logical_axis_rules(RULES):  # rules from the context
      assert jax.tree.leaves(thor_optax.kronecker_state_sharding(abstract, mesh)) == \
          jax.tree.leaves(ours)
    sharded = {P(None, None, None, "model"), P(None, "model"), P("model")}
    assert sharded <= set(specs) <= sharded | {P()}

    params_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(params), mesh, RULES)
    x, y = _data()
    state = jax.device_put(tx.init(params), ours)
    params = jax.device_put(params, params_sharding)

    def plain(params, state):
      grads = jax.grad(lambda p: _loss(model.apply({"params": p}, x), y))(params)
      return tx.update(grads, state, params)

    updates, state = jax.jit(plain, out_shardings=(params_sharding, ours))(params, state)
  trace = next(s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(
      s, optax.TraceState)) if isinstance(s, optax.TraceState)).trace  # the momentum
  kernel = trace["Dense_0"]["kernel"]
  assert isinstance(kernel, nn.Partitioned)
  assert kernel.value.sharding.shard_shape(kernel.value.shape) == (36, 2)
  assert trace["Conv_0"]["kernel"].value.sharding.spec == P(None, None, None, "model")
  with pytest.raises(ValueError, match=r"\['model'\] are not axes of the mesh"):
    thor_optax.kronecker_state_sharding(abstract, Mesh(np.array(jax.devices()[:1]), ("data",)))
