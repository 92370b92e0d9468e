"""Capture, check steps and plain steps under explicit-sharding meshes (``AxisType.Explicit``).

With explicit mesh axes every array's type carries its sharding and JAX rejects, at trace time,
what would leave a result's sharding ambiguous; before this was handled, the first check step
failed with ``ShardingTypeError: All operands should have the same sharding`` in the dense
layer's ones column, even on a 1x1 mesh. Each test runs a check step and a plain step in one
jitted function, in float64, under ``jax.set_mesh``, with no warning allowed (every layer is
preconditioned), and checks which layers were refreshed and that updated parameters keep their
shardings; all but two compare the parameters with the same steps run without a mesh (each
comparison is a second compilation of the steps, which dominates the tests' time):

* linen (``jax.jit``, batch sharded over ``'data'``, parameters replicated): THOR on a model
  with every built-in layer kind (conv, dense, embedding, LayerNorm) on 2 devices, with the
  inversion distributed over the devices (``block_sharding``) and the block stacks kept
  sharded (``kronecker_state_sharding(..., 'data')``); SKFAC (Woodbury from gathered rows,
  summed conv patches) on a 1x1 mesh; THOR and SKFAC plain steps from the rows with kernels
  sharded over ``'model'`` on 2x2;
* NNX: a model whose parameters are sharded as in Flax's NNX sharding guide
  (``nnx.with_partitioning``, ``(None, 'model')`` kernels, layers called with
  ``out_sharding``), trained with ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and
  ``optimizer.update(model, grads, curvature_stats=stats)`` under ``nnx.jit``, token ids
  sharded over ``'data'``: KAISA (eigh, KL clip over kernels split over ``'model'``) on 1x2,
  compared; K-FAC on a 2x1 mesh and SP-NGD (unit-wise LayerNorm Fisher, weight rescaling) on
  1x1, not compared.

Sharded and unsharded runs sum over the batch in different orders: they agree to float64
rounding (measured below 1e-14). The 2 devices are 2 of the 4 host CPU devices that
``conftest.py`` gives every test process (as ``test_sharding.py``).
"""

import warnings

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import thor_optax
from thor_optax import flax as thor_linen
from thor_optax import nnx as thor_nnx

TOL = 1e-12  # float64; different reduction orders only
F64 = dict(param_dtype=jnp.float64)


pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py


def _loss(out, y):
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def _data():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((8, 3, 3, 2)), rng.integers(0, 5, (8, 2)),
          rng.integers(0, 3, 8))


def _mesh(shape, names=("data", "model")):
  devices = jax.devices()[:int(np.prod(shape))]
  return jax.make_mesh(shape, names[:len(shape)],
                       axis_types=(AxisType.Explicit,) * len(shape), devices=devices)


def _max_diff(got, want):
  return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def _kronecker(opt_state):
  """The ``KroneckerState`` inside an alias's state."""
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda s: isinstance(s, thor_optax.KroneckerState))
           if isinstance(s, thor_optax.KroneckerState)]
  assert len(found) == 1
  return found[0]


def _values(tree):
  """``tree`` with every ``nnx.Variable`` replaced by its value (``nnx.Optimizer.opt_state``)."""
  return jax.tree.map(lambda v: v[...] if isinstance(v, nnx.Variable) else v, tree,
                      is_leaf=lambda v: isinstance(v, nnx.Variable))


def _assert_refreshed(state, layers):
  """Exactly ``layers`` are Kronecker-factored, and every one of their blocks was inverted."""
  diagnostics = _kronecker(state).diagnostics
  assert sorted(diagnostics) == sorted(layers)
  for name, d in diagnostics.items():
    assert int(d.total_refreshes) == int(d.num_blocks) > 0, name


# ----------------------------------------------------------------------------- linen


class AllKinds(nn.Module):
  """Conv, dense, embedding and LayerNorm."""

  @nn.compact
  def __call__(self, x, ids):
    h = nn.relu(nn.Conv(3, (2, 2), **F64)(x)).reshape(x.shape[0], -1)
    h = nn.Dense(4, **F64)(h) + nn.Embed(5, 4, **F64)(ids).mean(1)
    return nn.Dense(3, **F64)(jnp.tanh(nn.LayerNorm(**F64)(h)))


class ConvNet(nn.Module):

  @nn.compact
  def __call__(self, x, ids):
    del ids
    h = nn.relu(nn.Conv(3, (2, 2), **F64)(x))
    return nn.Dense(3, **F64)(h.reshape(x.shape[0], -1))


def _linen_steps(model, tx, mesh=None, block_axis=None):
  """A check step then a plain step in one jitted function: ``(params, opt_state)``."""
  x, ids, y = _data()
  params = model.init(jax.random.PRNGKey(1), x, ids)["params"]
  capture = thor_linen.value_and_grad_with_stats(model, _loss)

  def steps(params, state, x, ids, y):
    (_, grads), stats = capture(params, x, y, ids=ids)
    assert not stats.unhandled
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    params = optax.apply_updates(params, updates)
    grads = jax.grad(lambda p: _loss(model.apply({"params": p}, x, ids), y))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  if mesh is None:
    return jax.jit(steps)(params, tx.init(params), x, ids, y)
  with jax.set_mesh(mesh):
    state = tx.init(params)
    if block_axis is not None:
      state = jax.device_put(state, thor_optax.kronecker_state_sharding(state, mesh, block_axis))
    # Flax linen's Embed gathers with the ids' sharding, which it cannot resolve for sharded
    # ids: the ids stay replicated.
    args = (jax.device_put(params, P()), state, jax.device_put(x, P("data")),
            jax.device_put(ids, P()), jax.device_put(y, P("data")))
    return jax.jit(steps)(*args)


def test_linen_every_layer_kind_two_devices_with_distributed_inversion():
  mesh = _mesh((2,), ("data",))

  def tx(block_sharding=None):
    return thor_optax.thor(0.1, 0.03, block_size=4, block_sharding=block_sharding)

  with jax.enable_x64(True), warnings.catch_warnings():
    warnings.simplefilter("error")
    want, _ = _linen_steps(AllKinds(), tx())
    got, state = _linen_steps(AllKinds(), tx(NamedSharding(mesh, P("data"))), mesh,
                              block_axis="data")
  assert _max_diff(got, want) < TOL
  _assert_refreshed(state, ["Conv_0", "Dense_0", "Dense_1", "Embed_0"])
  assert sorted(_kronecker(state).layers) == ["Embed_0", "LayerNorm_0"]
  inverse = _kronecker(state).blocks["b4"]["inverse"].inverse
  assert inverse.shape[0] % 2 == 0
  assert jax.typeof(inverse).sharding.spec[0] == "data"  # still sharded after the steps
  assert jax.typeof(got["Dense_0"]["kernel"]).sharding.spec == P(None, None)
  # The steps return the state laid out as kronecker_state_sharding says, spec for spec (a
  # state placed with P() and returned as P(None, None) compiled the step a second time).
  placed = thor_optax.kronecker_state_sharding(state, mesh, block_axis="data")
  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(placed)):
    assert jax.typeof(leaf).sharding.spec == sharding.spec


class Wide(nn.Module):
  """Layers wider than the batch of 8 on both sides: both factors are applied to the rows.
  ``classes=4``: every layer's outputs split over a model axis of 2."""
  classes: int = 3

  @nn.compact
  def __call__(self, x, ids):
    del ids
    h = jnp.tanh(nn.Dense(16, **F64)(x.reshape(x.shape[0], -1)))
    return nn.Dense(self.classes, **F64)(nn.Dense(12, **F64)(h))


def _check_then_rows(model, loss, tx):
  """``steps(params, state, x, ids, y) -> (params, state)``: a check step, then a plain step
  from the rows (``gradient_stats=``)."""
  capture = thor_linen.value_and_grad_with_stats(model, loss)

  def steps(params, state, x, ids, y):
    for stats_as in ("curvature_stats", "gradient_stats"):
      (_, grads), stats = capture(params, x, y, ids=ids)
      updates, state = tx.update(grads, state, params, **{stats_as: stats})
      params = optax.apply_updates(params, updates)
    return params, state

  return steps


def test_linen_plain_step_from_the_rows_on_a_data_mesh():
  """``gradient_stats=`` with rows sharded over ``data``: the KL clip's ``R x R`` inner products
  of the rows (a ``ShardingTypeError`` before) come out replicated, and the steps equal the
  unsharded ones."""
  x, ids, y = _data()
  model = Wide()
  tx = thor_optax.thor(0.1, 0.03, block_size=4, max_kl=1e-6)  # a clip that binds
  steps = _check_then_rows(model, _loss, tx)
  with jax.enable_x64(True), warnings.catch_warnings():
    warnings.simplefilter("error")
    params = model.init(jax.random.PRNGKey(1), x, ids)["params"]
    want, want_state = jax.jit(steps)(params, tx.init(params), x, ids, y)
    with jax.set_mesh(_mesh((2,), ("data",))):
      args = (jax.device_put(params, P()), tx.init(params), jax.device_put(x, P("data")),
              jax.device_put(ids, P()), jax.device_put(y, P("data")))
      got, got_state = jax.jit(steps)(*args)
  assert _max_diff(got, want) < TOL
  scale = optax.tree_utils.tree_get(want_state, "scale")
  assert float(scale) < 1.0  # the clip bound
  np.testing.assert_allclose(float(optax.tree_utils.tree_get(got_state, "scale")), float(scale),
                             rtol=1e-12)


def _one_hot_loss(out, y):
  """Cross-entropy without a gather (an explicit mesh rejects one on feature-sharded logits)."""
  return -jnp.mean(jnp.sum(jax.nn.log_softmax(out) * jax.nn.one_hot(y, out.shape[-1]), -1))


@pytest.mark.parametrize("name", ["thor", "skfac"])
def test_linen_plain_step_from_the_rows_with_model_sharded_kernels(name):
  """Kernels ``(None, 'model')`` on a 2x2 mesh give the next layer feature-sharded inputs: a
  plain step from the rows raised ``ShardingTypeError`` (the ones column of the bias input
  sliced the sharded feature axis); the rows are now laid out as a check step lays them out,
  and the steps equal the unsharded ones. The state is placed as ``kronecker_state_sharding``
  says, the momentum replicated (thor) or, with ``params=``, sharded like the parameters
  (skfac): the step returns it so (the non-finite guard's ``cond`` raised on a replicated
  momentum, which came back sharded like its gradient)."""
  x, ids, y = _data()
  model = Wide(classes=4)
  tx = getattr(thor_optax, name)(0.1, 0.03)
  steps = _check_then_rows(model, _one_hot_loss, tx)
  with jax.enable_x64(True), warnings.catch_warnings():
    warnings.simplefilter("error")
    params = model.init(jax.random.PRNGKey(1), x, ids)["params"]
    want, _ = jax.jit(steps)(params, tx.init(params), x, ids, y)
    mesh = _mesh((2, 2))
    with jax.set_mesh(mesh):
      sharded = jax.tree.map(lambda a: jax.device_put(a, P(*(None,) * (a.ndim - 1), "model")),
                             params)
      state = tx.init(sharded)
      # skfac: the momentum sharded like the parameters (params=); thor: replicated.
      placed = thor_optax.kronecker_state_sharding(
          state, mesh, "data", params=sharded if name == "skfac" else None)
      got, state = jax.jit(steps)(sharded, jax.device_put(state, placed),
                                  jax.device_put(x, P("data")), jax.device_put(ids, P()),
                                  jax.device_put(y, P("data")))
  assert _max_diff(got, want) < TOL
  assert jax.typeof(got["Dense_1"]["kernel"]).sharding.spec == P(None, "model")
  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(placed)):
    assert jax.typeof(leaf).sharding.spec == sharding.spec
  momentum = [s.spec for s in jax.tree.leaves(placed) if "model" in s.spec]
  assert len(momentum) == (6 if name == "skfac" else 0)  # 3 kernels and 3 biases


def test_linen_skfac_one_by_one_mesh():
  """Woodbury inverses from the gathered rows, conv patches summed per example."""
  with jax.enable_x64(True), warnings.catch_warnings():
    warnings.simplefilter("error")
    tx = thor_optax.skfac(0.1, 0.03, inverse_method="woodbury")
    want, _ = _linen_steps(ConvNet(), tx)
    got, state = _linen_steps(ConvNet(), tx, _mesh((1, 1)))
  assert _max_diff(got, want) < TOL
  _assert_refreshed(state, ["Conv_0", "Dense_0"])


# ----------------------------------------------------------------------------- NNX


class NnxNet(nnx.Module):
  """Kernels sharded over ``'model'`` as in Flax's NNX sharding guide; ``sharded=False``: the
  same values without sharding metadata, for the run without a mesh."""

  def __init__(self, rngs, sharded=True):
    self.sharded = sharded
    box = nnx.with_partitioning if sharded else (lambda init, names: init)
    init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
    self.embed = nnx.Embed(5, 18, rngs=rngs, **F64)
    self.hidden = nnx.Linear(18, 4, kernel_init=box(init, (None, "model")),
                             bias_init=box(zeros, ("model",)), rngs=rngs, **F64)
    self.norm = nnx.LayerNorm(4, rngs=rngs, **F64)
    self.head = nnx.Linear(4, 3, kernel_init=box(init, ("model", None)), rngs=rngs, **F64)

  def _out(self, *spec):
    return dict(out_sharding=P(*spec)) if self.sharded else {}

  def __call__(self, x, ids):
    h = x.reshape(x.shape[0], -1) + self.embed(ids, **self._out("data", None, None)).mean(1)
    h = jnp.tanh(self.norm(self.hidden(h)))
    return self.head(h, **self._out("data", None))  # contracts the 'model' axis


def _nnx_steps(tx, mesh=None):
  """A check step then a plain step with ``nnx.Optimizer``: ``(model, optimizer)``."""
  capture = thor_nnx.value_and_grad_with_stats(_loss)

  @nnx.jit
  def steps(model, optimizer, x, ids, y):
    (_, grads), stats = capture(model, x, y, ids=ids)
    assert sorted(stats.layers) == ["embed", "head", "hidden", "norm"]
    optimizer.update(model, grads, curvature_stats=stats)
    grads = nnx.grad(lambda m: _loss(m(x, ids), y))(model)
    optimizer.update(model, grads)

  def run(*batch):
    model = NnxNet(nnx.Rngs(0), sharded=mesh is not None)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    steps(model, optimizer, *batch)
    return model, optimizer

  if mesh is None:
    return run(*_data())
  with jax.set_mesh(mesh):
    return run(*(jax.device_put(a, P("data")) for a in _data()))


def _nnx_run(tx, mesh, compare):
  """The steps on ``mesh``; with ``compare``, also without a mesh, asserting equal parameters
  (a compilation more; otherwise the parameters must have moved and be finite)."""
  with jax.enable_x64(True), warnings.catch_warnings():
    warnings.simplefilter("error")
    want = _nnx_steps(tx)[0] if compare else NnxNet(nnx.Rngs(0), sharded=False)
    model, optimizer = _nnx_steps(tx, mesh)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  diff = _max_diff(params, nnx.to_pure_dict(nnx.state(want, nnx.Param)))
  assert diff < TOL if compare else np.isfinite(diff) and diff > 1e-4
  # the updated kernels keep the sharding of their parameters
  assert jax.typeof(model.hidden.kernel[...]).sharding.spec == P(None, "model")
  assert jax.typeof(model.head.kernel[...]).sharding.spec == P("model", None)
  _assert_refreshed(_values(optimizer.opt_state), ["embed", "head", "hidden"])
  return optimizer


def test_nnx_kaisa_model_axis_of_two_devices_equals_unsharded():
  _nnx_run(thor_optax.kaisa(0.1, 0.03, block_size=4), _mesh((1, 2)), compare=True)


def test_nnx_kfac_data_axis_of_two_devices():
  _nnx_run(thor_optax.kfac(0.1, 0.03, block_size=4), _mesh((2, 1)), compare=False)


def test_nnx_spngd_one_by_one_mesh():
  optimizer = _nnx_run(thor_optax.spngd(0.1, 0.03, block_size=4), _mesh((1, 1)),
                       compare=False)
  assert sorted(_kronecker(_values(optimizer.opt_state)).layers) == ["embed", "norm"]
