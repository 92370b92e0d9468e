"""Flax NNX capture (``thor_optax.nnx``) against the linen capture and against ``nnx.grad``.

* the same loss, gradients and statistics as linen on the same architecture and weights: an MLP
  with LayerNorm (empirical, sampled and exact Fisher) and a CNN with Conv + BatchNorm + Dense
  (training mode, eval mode, zero BatchNorm scale);
* ``nnx.Optimizer(model, thor(...), wrt=nnx.Param)`` under ``nnx.jit`` gives the parameters and
  running statistics of the linen path (``tx.update`` + ``optax.apply_updates``) over check
  steps and plain steps, with layers held in an ``nnx.List`` (integer path keys);
* a layer called twice, an ``nnx.LinearGeneral`` and an unused layer are listed in
  ``stats.unhandled`` with their reasons and their gradients pass through the preconditioner;
* BatchNorm running averages and dropout RNG counts after a capture equal those after a plain
  forward pass (eagerly and under ``nnx.jit``), and the gradients equal ``nnx.grad``'s;
* errors: sampled Fisher without ``rng``, a linen module, and a failing layer (named by path);
  the patched classes are restored afterwards.
"""

import functools
import warnings

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax import flax as thor_linen
from thor_optax import nnx as thor_nnx

pytestmark = pytest.mark.usefixtures("fast_compiles")

F32 = dict(rtol=2e-5, atol=2e-6)


def _loss(out, y):
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def _data(n=8, shape=(5,), classes=3, seed=0):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(kx, (n,) + shape),
          jax.random.randint(ky, (n,), 0, classes))


# ----------------------------------------------------------------------------- models


class LinenMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.LayerNorm(name="norm")(nn.Dense(8, name="dense_in")(x)))
    return nn.Dense(3, name="head")(h)


class NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.dense_in = nnx.Linear(5, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.norm(self.dense_in(x))))


class LinenCNN(nn.Module):
  """Conv -> BatchNorm -> relu -> spatial mean -> Dense layers (``layers_0``, ``layers_1``)."""

  def setup(self):
    self.conv = nn.Conv(4, (3, 3), strides=(2, 2), padding="SAME")
    self.bn = nn.BatchNorm(momentum=0.8)
    self.layers = [nn.Dense(6), nn.Dense(3)]

  def __call__(self, x, train=True):
    h = nn.relu(self.bn(self.conv(x), use_running_average=not train))
    h = jnp.tanh(self.layers[0](h.mean(axis=(1, 2))))
    return self.layers[1](h)


class NnxCNN(nnx.Module):

  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 4, (3, 3), strides=(2, 2), padding="SAME", rngs=rngs)
    self.bn = nnx.BatchNorm(4, momentum=0.8, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(4, 6, rngs=rngs), nnx.Linear(6, 3, rngs=rngs)])

  def __call__(self, x, train=True):
    h = nnx.relu(self.bn(self.conv(x), use_running_average=not train))
    h = jnp.tanh(self.layers[0](h.mean(axis=(1, 2))))
    return self.layers[1](h)


def _linen_path(path):
  """NNX path -> linen names: ``('layers', 0, 'kernel')`` -> ``('layers_0', 'kernel')``."""
  out = []
  for key in path:
    if isinstance(key, int):
      out[-1] = f"{out[-1]}_{key}"
    else:
      out.append(key)
  return tuple(out)


def _as_linen_tree(state):
  """An nnx.State (Variables or arrays) as a nested dict under linen names."""
  tree = {}
  for path, leaf in nnx.to_flat_state(state):
    node = tree
    keys = _linen_path(path)
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = leaf[...] if isinstance(leaf, nnx.Variable) else leaf
  return tree


def _load_linen(model, variables):
  """Copies linen ``params`` / ``batch_stats`` into the NNX model's Param / BatchStat."""
  loaded = 0
  for path, node in nnx.iter_graph(model):
    if isinstance(node, (nnx.Param, nnx.BatchStat)):
      tree = variables["params" if isinstance(node, nnx.Param) else "batch_stats"]
      for key in _linen_path(path):
        tree = tree[key]
      assert tree.shape == node.shape, path
      node[...] = tree
      loaded += 1
  assert loaded == len(jax.tree_util.tree_leaves(variables))


def _linen_variables(model, x, seed=1, zero_scale=False, **kwargs):
  """Linen variables with random parameters (norm scales around 1) and running statistics."""
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x, **kwargs)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(variables)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  new = []
  for (path, leaf), key in zip(leaves, keys):
    name = jax.tree_util.keystr(path[-1:], simple=True)
    noise = 0.3 * jax.random.normal(key, leaf.shape, leaf.dtype)
    if name in ("scale", "var"):
      leaf = jnp.zeros_like(leaf) if (zero_scale and name == "scale") else 1.0 + 0.5 * jnp.abs(
          noise)
    else:
      leaf = leaf + noise
    new.append(leaf)
  return treedef.unflatten(new)


def _assert_tree_close(actual, expected, **tol):
  assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol),
      actual, expected)


# ----------------------------------------------------------------------------- 1. NNX == linen


@pytest.mark.parametrize("fisher_type", ["empirical", "sampled", "exact"])
def test_mlp_layernorm_matches_linen(fisher_type):
  x, y = _data()
  linen_model = LinenMLP()
  variables = _linen_variables(linen_model, x)
  model = NnxMLP(nnx.Rngs(0))
  _load_linen(model, variables)
  kwargs = {} if fisher_type == "empirical" else dict(
      likelihood="softmax_cross_entropy", num_samples=2)
  rng = jax.random.PRNGKey(7) if fisher_type == "sampled" else None

  capture_l = thor_linen.value_and_grad_with_stats(linen_model, _loss, fisher_type=fisher_type,
                                                   **kwargs)
  (loss_l, grads_l), stats_l = jax.jit(lambda p: capture_l(p, x, y, rng=rng))(
      variables["params"])
  capture = thor_nnx.value_and_grad_with_stats(_loss, fisher_type=fisher_type, **kwargs)
  (loss_n, grads_n), stats_n = nnx.jit(lambda m: capture(m, x, y, rng=rng))(model)

  np.testing.assert_allclose(loss_n, loss_l, **F32)
  _assert_tree_close(_as_linen_tree(grads_n), grads_l, **F32)
  _assert_tree_close(stats_n, stats_l, **F32)  # same layers, kinds and static metadata
  assert stats_n.unhandled == ()
  assert isinstance(stats_n.layers["norm"], thor_optax.NormStats)
  samples = {"empirical": 1, "sampled": 2, "exact": 3}[fisher_type]
  assert stats_n.layers["head"].cotangents.shape == (samples, 8, 3)
  # grads are exactly what nnx.grad gives (structure and values).
  reference = nnx.grad(lambda m: _loss(m(x), y))(model)
  assert jax.tree_util.tree_structure(grads_n) == jax.tree_util.tree_structure(reference)
  _assert_tree_close(grads_n, reference, **F32)


@pytest.mark.parametrize("case", ["train", "eval", "zero_scale"])
def test_cnn_batchnorm_matches_linen(case):
  x, y = _data(n=6, shape=(6, 6, 2))
  train = case != "eval"
  linen_model = LinenCNN()
  variables = _linen_variables(linen_model, x, zero_scale=case == "zero_scale")
  model = NnxCNN(nnx.Rngs(0))
  _load_linen(model, variables)

  capture_l = thor_linen.value_and_grad_with_stats(linen_model, _loss)
  (loss_l, grads_l), stats_l, mutated = jax.jit(lambda p, bs: capture_l(
      p, x, y, model_state={"batch_stats": bs}, mutable=["batch_stats"], train=train))(
          variables["params"], variables["batch_stats"])
  capture = thor_nnx.value_and_grad_with_stats(_loss)
  (loss_n, grads_n), stats_n = nnx.jit(lambda m: capture(m, x, y, train=train))(model)

  np.testing.assert_allclose(loss_n, loss_l, **F32)
  _assert_tree_close(_as_linen_tree(grads_n), grads_l, **F32)
  stats_n_linen_names = dict(stats_n.layers)
  stats_n_linen_names.update({f"layers_{i}": layer
                              for i, layer in stats_n.layers["layers"].items()})
  del stats_n_linen_names["layers"]
  _assert_tree_close(stats_n_linen_names, stats_l.layers, **F32)
  assert isinstance(stats_n.layers["conv"], thor_optax.ConvStats)
  assert stats_n.layers["conv"].strides == (2, 2)
  bn = stats_n.layers["bn"]
  # x_hat is never formed as (y - bias) / scale: with a zero scale the per-example scale
  # gradients are finite and not all zero.
  assert np.all(np.isfinite(bn.scale_grads)) and np.abs(bn.scale_grads).max() > 1e-3
  # running statistics: updated as linen's mutable apply updates them (unchanged in eval mode).
  _assert_tree_close(_as_linen_tree(nnx.state(model, nnx.BatchStat)),
                     mutated["batch_stats"], **F32)


# ----------------------------------------------------------------------------- 2. optimizer


def test_nnx_optimizer_under_jit_matches_linen_steps():
  x, y = _data(n=8, shape=(6, 6, 2))
  linen_model = LinenCNN()
  variables = _linen_variables(linen_model, x)
  model = NnxCNN(nnx.Rngs(0))
  _load_linen(model, variables)
  make_tx = lambda: thor_optax.thor(0.1, 0.05, weight_decay=1e-3)
  is_check = [True, False, True, False, False]

  # linen: tx.update + optax.apply_updates.
  tx = make_tx()
  params, batch_stats = variables["params"], variables["batch_stats"]
  opt_state = tx.init(params)
  capture_l = thor_linen.value_and_grad_with_stats(linen_model, _loss)

  @jax.jit
  def linen_check(params, batch_stats, opt_state):
    (loss, grads), stats, mutated = capture_l(params, x, y, model_state={
        "batch_stats": batch_stats}, mutable=["batch_stats"])
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), mutated["batch_stats"], opt_state, loss

  @jax.jit
  def linen_plain(params, batch_stats, opt_state):
    def loss_fn(p):
      out, mutated = linen_model.apply({"params": p, "batch_stats": batch_stats}, x,
                                       mutable=["batch_stats"])
      return _loss(out, y), mutated["batch_stats"]
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), batch_stats, opt_state, loss

  linen_losses = []
  for check in is_check:
    step = linen_check if check else linen_plain
    params, batch_stats, opt_state, loss = step(params, batch_stats, opt_state)
    linen_losses.append(loss)

  # NNX: nnx.Optimizer.update under nnx.jit.
  optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
  capture_n = thor_nnx.value_and_grad_with_stats(_loss)

  @nnx.jit
  def nnx_check(model, optimizer):
    (loss, grads), stats = capture_n(model, x, y)
    optimizer.update(model, grads, curvature_stats=stats)
    return loss

  @nnx.jit
  def nnx_plain(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: _loss(m(x), y))(model)
    optimizer.update(model, grads)
    return loss

  nnx_losses = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for check in is_check:
      nnx_losses.append((nnx_check if check else nnx_plain)(model, optimizer))
  # every layer of the gradients found its statistics (no "no statistics" warning).
  assert not [w for w in caught if "statistics" in str(w.message)], [str(w.message)
                                                                      for w in caught]

  np.testing.assert_allclose(np.array(nnx_losses), np.array(linen_losses), **F32)
  # the steps changed every kernel by more than the tolerance ...
  for name, layer in params.items():
    if "kernel" in layer:
      assert float(np.abs(layer["kernel"] - variables["params"][name]["kernel"]).max()) > 1e-2
  # ... and both paths end at the same parameters and running statistics.
  _assert_tree_close(_as_linen_tree(nnx.state(model, nnx.Param)), params, rtol=1e-4, atol=1e-5)
  _assert_tree_close(_as_linen_tree(nnx.state(model, nnx.BatchStat)), batch_stats,
                     rtol=1e-4, atol=1e-5)
  # every layer, the nnx.List ones included, was preconditioned: its blocks were refreshed at
  # the checks, and the BatchNorm's unit-wise inverse moved from its initial value.
  kron = _kronecker_state(optimizer.opt_state)
  assert set(kron.diagnostics) == {"conv", "layers/0", "layers/1"}
  for name, diag in kron.diagnostics.items():
    assert int(diag.total_refreshes) >= int(diag.num_blocks) > 0, name
  initial = _kronecker_state(make_tx().init(nnx.state(model, nnx.Param)))
  assert float(np.abs(kron.layers["bn"].inverse - initial.layers["bn"].inverse).max()) > 1e-3


def _kronecker_state(opt_state):
  is_state = lambda s: isinstance(s, thor_optax.KroneckerState)
  leaves = jax.tree_util.tree_leaves(nnx.as_pure(opt_state), is_leaf=is_state)
  return next(s for s in leaves if is_state(s))


# ----------------------------------------------------------------------------- 3. unhandled


class Gain(nnx.Module):
  """A module of no registered kind: one learned gain for all features (a scalar; a gain per
  feature is a ``'channel_affine'`` layer)."""

  def __init__(self, features, rngs):
    del features, rngs
    self.gain = nnx.Param(jnp.ones(()))

  def __call__(self, x):
    return x * self.gain[...]


class Odd(nnx.Module):

  def __init__(self, rngs):
    self.first = nnx.Linear(4, 4, rngs=rngs)
    self.shared = nnx.LayerNorm(4, rngs=rngs)  # applied twice: sharing a norm is not supported
    self.general = Gain(4, rngs)
    self.unused = nnx.Linear(4, 4, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.first(x))
    h = jnp.tanh(self.shared(jnp.tanh(self.shared(h))))
    return self.head(self.general(h))


def test_shared_and_unsupported_layers_are_unhandled_and_pass_through():
  x, y = _data(shape=(4,))
  model = Odd(nnx.Rngs(0))
  (loss, grads), stats = thor_nnx.value_and_grad_with_stats(_loss)(model, x, y)

  assert stats.unhandled == (
      "general: module kind not supported (parameter 'gain' passes through unpreconditioned; "
      "thor_optax.register_layer_kind can take it)",
      "shared: called 2 times per forward pass (shared layer): weight sharing of a 'norm' "
      "layer is not preconditioned",
      "unused: not called in the forward pass, or called where its variables cannot be "
      "written: inside a raw jax transform (jax.lax.scan, jax.checkpoint) instead of its nnx "
      "counterpart, or closed over by the function of an nnx transform (nnx.scan, nnx.vmap, "
      "nnx.remat; pass the layer as an argument, with in_axes=None for one applied at every "
      "step, to have it captured)",
  )
  assert set(stats.layers) == {"first", "head"}
  ref_loss, reference = nnx.value_and_grad(lambda m: _loss(m(x), y))(model)
  np.testing.assert_allclose(loss, ref_loss, **F32)
  _assert_tree_close(grads, reference, **F32)
  assert float(jnp.abs(grads["shared"]["scale"][...]).max()) > 0

  tx = thor_optax.scale_by_thor(damping=0.1, block_size=None)
  state = tx.init(nnx.state(model, nnx.Param))  # Variables, as nnx.Optimizer passes them
  with pytest.warns(UserWarning, match="shared"):
    updates, _ = jax.jit(functools.partial(tx.update, curvature_stats=stats))(
        nnx.as_pure(grads), state, nnx.as_pure(nnx.state(model, nnx.Param)))
  pure = nnx.as_pure(grads)
  for name in ("shared", "general", "unused"):
    _assert_tree_close(updates[name], pure[name], rtol=0, atol=0)
  for name in ("first", "head"):
    assert float(jnp.abs(updates[name]["kernel"] - pure[name]["kernel"]).max()) > 1e-4


@pytest.mark.parametrize("alias", ["kfac", "thor"])
def test_aliases_take_a_state_initialised_from_variables(alias):
  """``tx.init(nnx.state(model, nnx.Param))`` (``nnx.Variable`` leaves, as above) updated with
  pure arrays: the aliases' ``skip_not_finite`` guard chose between the new state and the old
  one's Variables, which JAX no longer converts implicitly (a deep ``ValueError`` before; found
  by the h_llm audit). Now the step equals the one from a state initialised from pure arrays."""
  x, y = _data()
  model = NnxMLP(nnx.Rngs(0))
  (_, grads), stats = thor_nnx.value_and_grad_with_stats(_loss)(model, x, y)
  tx = getattr(thor_optax, alias)(0.1, 0.1)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  step = jax.jit(functools.partial(tx.update, curvature_stats=stats))
  updates, state = step(nnx.as_pure(grads), tx.init(nnx.state(model, nnx.Param)), params)
  want, want_state = step(nnx.as_pure(grads), tx.init(params), params)
  _assert_tree_close(updates, want, rtol=0, atol=0)
  _assert_tree_close(nnx.as_pure(state), want_state, rtol=0, atol=0)


# ----------------------------------------------------------------------------- 4. model state


class BNDropout(nnx.Module):

  def __init__(self, rngs):
    self.dense = nnx.Linear(3, 6, rngs=rngs)
    self.bn = nnx.BatchNorm(6, momentum=0.8, rngs=rngs)
    self.drop = nnx.Dropout(0.3, rngs=rngs)
    self.head = nnx.Linear(6, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.drop(nnx.relu(self.bn(self.dense(x)))))


def test_running_stats_and_rngs_as_after_plain_call():
  x, y = _data(shape=(3,), classes=2)
  model = BNDropout(nnx.Rngs(0, dropout=1))
  plain = nnx.clone(model)
  capture = thor_nnx.value_and_grad_with_stats(_loss)
  mean_before = model.bn.mean[...]

  def state_of(m):
    return nnx.as_pure(nnx.state(m, nnx.BatchStat, nnx.RngCount))

  (loss, grads), _ = capture(model, x, y)
  ref_loss, ref_grads = nnx.value_and_grad(lambda m: _loss(m(x), y))(plain)
  np.testing.assert_allclose(loss, ref_loss, **F32)
  _assert_tree_close(grads, ref_grads, **F32)  # same dropout mask
  _assert_tree_close(state_of(model), state_of(plain), **F32)
  assert float(jnp.abs(model.bn.mean[...] - mean_before).max()) > 1e-3
  assert int(model.drop.rngs.count[...]) == 1

  @nnx.jit
  def capture_step(m):
    (loss, _), stats = capture(m, x, y)
    return loss, stats

  @nnx.jit
  def plain_step(m):
    return _loss(m(x), y)

  for _ in range(2):
    loss, stats = capture_step(model)
    np.testing.assert_allclose(loss, plain_step(plain), **F32)
  _assert_tree_close(state_of(model), state_of(plain), **F32)
  assert int(model.drop.rngs.count[...]) == 3
  assert set(stats.layers) == {"dense", "bn", "head"}


# ----------------------------------------------------------------------------- 5. errors


def test_errors():
  x, y = _data()
  model = NnxMLP(nnx.Rngs(0))
  with pytest.raises(ValueError, match="rng"):
    thor_nnx.value_and_grad_with_stats(
        _loss, fisher_type="sampled", likelihood="softmax_cross_entropy")(model, x, y)
  # Not one key (before: errors from inside jax.random naming no argument).
  for rng in (0, nnx.Rngs(0), jax.random.split(jax.random.PRNGKey(0), 3),
              jax.random.split(jax.random.key(0), 3)):
    with pytest.raises(ValueError, match="rng must be one PRNG key"):
      thor_nnx.value_and_grad_with_stats(
          _loss, fisher_type="sampled", likelihood="softmax_cross_entropy")(model, x, y,
                                                                             rng=rng)
  with pytest.raises(ValueError, match="likelihood"):
    thor_nnx.value_and_grad_with_stats(_loss, fisher_type="exact")
  with pytest.raises(TypeError, match="thor_optax.flax"):
    thor_nnx.value_and_grad_with_stats(_loss)(LinenMLP(), x, y)


class FloatIds(nnx.Module):

  def __init__(self, rngs):
    self.blocks = nnx.List([nnx.Embed(5, 3, rngs=rngs)])

  def __call__(self, x):
    return self.blocks[0](x)


def test_failing_layer_is_named_and_classes_restored():
  originals = {cls: cls.__call__ for cls in (nnx.Linear, nnx.Conv, nnx.Embed, nnx.BatchNorm,
                                             nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm)}
  attend = nnx.Embed.attend
  with pytest.raises(ValueError, match="integer") as info:
    thor_nnx.value_and_grad_with_stats(_loss)(FloatIds(nnx.Rngs(0)), jnp.ones((4, 2)),
                                             jnp.zeros((4,), jnp.int32))
  assert any("blocks/0" in note for note in getattr(info.value, "__notes__", ())), info.value
  for cls, call in originals.items():
    assert cls.__call__ is call, cls
  assert nnx.Embed.attend is attend


def test_a_per_example_model_vmapped_over_the_batch_lists_its_dense_layers():
  """``nnx.vmap(..., in_axes=(None, 0))`` over the batch of a model written for one example:
  inside the vmap a Linear sees one example, ``(d_in,)``, with no example axis for its rows.
  Its layers are listed with the reason (they crashed the check step before), and a check step
  leaves their gradients as they are."""

  class OneExample(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(6, 8, rngs=rngs)
      self.b = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  class Batched(nnx.Module):
    def __init__(self, rngs):
      self.net = OneExample(rngs)

    def __call__(self, x):
      return nnx.vmap(lambda m, xi: m(xi), in_axes=(None, 0))(self.net, x)

  loss_fn = lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean()  # noqa
  model = Batched(nnx.Rngs(0))
  x, y = jax.random.normal(jax.random.key(0), (5, 6)), jnp.arange(5) % 3
  (_, grads), stats = thor_nnx.value_and_grad_with_stats(loss_fn)(model, x, y)
  assert thor_optax.captured_layers(stats).kinds == {}
  assert sorted(note.split(":")[0] for note in stats.unhandled) == ["net/a", "net/b"]
  assert all("has no batch axis" in note for note in stats.unhandled)
  tx = thor_optax.scale_by_thor(0.05)
  params = nnx.state(model, nnx.Param)
  with pytest.warns(UserWarning, match="preconditions none of the model's layers"):
    updates, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  jax.tree.map(np.testing.assert_array_equal, updates, grads)


def test_a_frozen_backbone_with_wrt():
  """``nnx.Optimizer(model, tx, wrt=filter)`` freezing a backbone, with the same ``wrt=`` given
  to the capture: the gradients and statistics hold the head only, the backbone does not move,
  and the head's update is the one it gets when the whole model trains (THOR preconditions
  layer by layer). Without ``wrt=`` the error names it."""

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.backbone = nnx.Linear(12, 32, rngs=rngs)
      self.head = nnx.Linear(32, 5, rngs=rngs)

    def __call__(self, x):
      return self.head(jnp.tanh(self.backbone(x)))

  loss_fn = lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean()  # noqa
  x, y = jax.random.normal(jax.random.key(0), (16, 12)), jnp.arange(16) % 5
  head_only = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("backbone")))
  tx = thor_optax.scale_by_thor(0.05, block_size=16)
  updates = {}
  for wrt in (nnx.Param, head_only):
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=wrt)
    capture = thor_nnx.value_and_grad_with_stats(loss_fn, wrt=wrt)

    @nnx.jit
    def step(model, opt, x, y, capture=capture):
      (_, grads), stats = capture(model, x, y)
      return opt.update(model, grads, curvature_stats=stats, gradient_stats=stats), stats

    before = np.asarray(model.backbone.kernel[...])
    updates[wrt], stats = step(model, opt, x, y)
    moved = not np.array_equal(before, np.asarray(model.backbone.kernel[...]))
    assert moved == (wrt is nnx.Param)
  assert set(stats.layers) == {"head"} and stats.exact_rows == ("head",)
  got, want = nnx.to_pure_dict(updates[head_only]), nnx.to_pure_dict(updates[nnx.Param])
  assert set(got) == {"head"}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **F32), got["head"], want["head"])
  model = Model(nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=head_only)
  (_, grads), stats = thor_nnx.value_and_grad_with_stats(loss_fn)(model, x, y)
  with pytest.raises(ValueError, match=r"pass the same wrt= to"):
    opt.update(model, nnx.state(grads, head_only), curvature_stats=stats)


# ----------------------------------------------------------------------------- 6. user patterns


class _Patterns(nnx.Module):
  """Three linears; ``mode`` routes the middle one through a raw JAX transform, ties its
  kernel to the first's, or applies dropout with call-time ``rngs``."""

  def __init__(self, mode, rngs):
    self.mode = mode
    self.a = nnx.Linear(5, 5, rngs=rngs)
    self.b = nnx.Linear(5, 5, rngs=rngs)
    self.o = nnx.Linear(5, 3, rngs=rngs)
    self.drop = nnx.Dropout(0.5)
    if mode == "tied":
      self.b.kernel = self.a.kernel

  def __call__(self, x, rngs=None):
    h = jnp.tanh(self.a(x))
    if self.mode == "checkpoint":
      h = jax.checkpoint(lambda v: jnp.tanh(self.b(v)))(h)
    elif self.mode == "scan":
      h, _ = jax.lax.scan(lambda v, _: (jnp.tanh(self.b(v)), None), h, None, length=2)
    elif self.mode == "dropout":
      h = self.drop(jnp.tanh(self.b(h)), rngs=rngs)
    else:
      h = jnp.tanh(self.b(h))
    return self.o(h)


@pytest.mark.parametrize("mode", ["checkpoint", "scan", "tied"])
def test_layers_the_capture_cannot_take_are_listed_with_exact_gradients(mode):
  """A layer inside a raw ``jax.checkpoint`` / ``jax.lax.scan`` of a closure, and two layers
  holding one ``nnx.Param``, are listed and their gradients are ``nnx.grad``'s (before: a
  ``TraceContextError`` naming an internal class; tied kernels gave two independent layers
  and a misleading error at the update)."""
  x, y = _data()
  model = _Patterns(mode, nnx.Rngs(0))
  want = nnx.grad(lambda m: _loss(m(x), y))(nnx.clone(model))
  (_, grads), stats = thor_nnx.value_and_grad_with_stats(_loss)(model, x, y)
  listed = ("a", "b") if mode == "tied" else ("b",)
  assert sorted(stats.layers) == sorted({"a", "b", "o"} - set(listed))
  assert [note.split(":")[0] for note in stats.unhandled] == list(listed)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(nnx.to_pure_dict(want))):
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
  optimizer = nnx.Optimizer(model, thor_optax.thor(0.05), wrt=nnx.Param)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # the listed layers' note
    optimizer.update(model, grads, curvature_stats=stats)


class _SharedTables(nnx.Module):
  """Layers on inputs no example changes (learned latents, a ``(T, T)`` bucket table broadcast
  after the layer) and a linear on noise the model draws per example from its own rngs."""

  def __init__(self, rngs):
    self.latents = nnx.Param(jax.random.normal(rngs.params(), (6, 3)))
    self.latent_proj = nnx.Linear(3, 3, rngs=rngs)
    self.buffer = nnx.Variable(jax.random.normal(rngs.params(), (7, 3)))  # not trained
    self.buffer_proj = nnx.Linear(3, 3, rngs=rngs)
    self.bias = nnx.Embed(5, 2, rngs=rngs)
    self.noise_proj = nnx.Linear(4, 6, rngs=rngs)
    self.head = nnx.Linear(6 + 2 * 25, 3, rngs=rngs)
    self.rngs = rngs

  def __call__(self, x):
    n = x.shape[0]
    h = jnp.einsum("ld,ntd->nl", self.latent_proj(self.latents[...]), x)
    h = h + jnp.einsum("ld,ntd->nl", self.buffer_proj(self.buffer[...]), x)[:, :6]
    buckets = jnp.clip(jnp.arange(5)[None] - jnp.arange(5)[:, None], -2, 2) + 2
    bias = jnp.broadcast_to(self.bias(buckets)[None], (n, 5, 5, 2)).reshape(n, -1)
    h = h + self.noise_proj(jax.random.normal(self.rngs.noise(), (n, 4)))
    return self.head(jnp.concatenate([h, bias], axis=-1))


def test_layers_on_inputs_shared_by_every_example_are_listed():
  """As linen's (tests/test_capture_layers.py): before, the latents' projection and the bias
  table were taken with their first axis for the examples, silently. A buffer (an
  ``nnx.Variable`` that is not a parameter) is the same for every example too; only the RNG
  streams of the model's state make an input per example."""
  model = _SharedTables(nnx.Rngs(0, noise=1))
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 5, 3))
  (_, _), stats = thor_nnx.value_and_grad_with_stats(_loss)(model, x, jnp.arange(4) % 3)
  listed = dict(note.split(": ", 1) for note in stats.unhandled)
  for name, shape in (("latent_proj", (6, 3)), ("buffer_proj", (7, 3)), ("bias", (5, 5))):
    assert listed[name].startswith(f"applied to an input of shape {shape} that depends on no "
                                   "example"), listed
  assert sorted(stats.layers) == ["head", "noise_proj"]


def test_call_time_rngs_and_call_errors():
  """``model(x, rngs=nnx.Rngs(...))``: captured, with the streams advanced as by a plain call
  (before: ``TraceContextError``). A model keyword ``rng`` hidden by the capture's, a second
  positional input, a module given as the loss, a dataclass output JAX cannot trace: errors
  saying what to do."""
  x, y = _data()
  model = _Patterns("dropout", nnx.Rngs(0))
  plain, captured = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)
  want = _loss(nnx.clone(model)(x, rngs=plain), y)
  (loss, _), stats = thor_nnx.value_and_grad_with_stats(_loss)(model, x, y, rngs=captured)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  assert int(captured.dropout.count[...]) == int(plain.dropout.count[...]) == 1
  assert sorted(stats.layers) == ["a", "b", "o"]

  class TakesRng(nnx.Module):
    def __init__(self):
      self.l = nnx.Linear(5, 3, rngs=nnx.Rngs(0))

    def __call__(self, v, rng=None):
      return self.l(v)

  with pytest.raises(ValueError, match="takes a keyword 'rng'"):
    thor_nnx.value_and_grad_with_stats(_loss)(TakesRng(), x, y, rng=jax.random.PRNGKey(0))

  class TwoInputs(TakesRng):
    def __call__(self, a, b):
      return self.l(a + b)

  with pytest.raises(TypeError, match="Pass the others as keywords"):
    thor_nnx.value_and_grad_with_stats(_loss)(TwoInputs(), x, y)
  with pytest.raises(TypeError, match="takes the loss function"):
    thor_nnx.value_and_grad_with_stats(model)
  with pytest.raises(TypeError, match="for an NNX model use thor_optax.nnx"):
    thor_linen.value_and_grad_with_stats(model, _loss)

  class Out:  # a plain dataclass-like output, not a pytree
    def __init__(self, logits):
      self.logits = logits

  class Plain(TakesRng):
    def __call__(self, v):
      return Out(self.l(v))

  with pytest.raises(ValueError, match="outputs hold a value JAX cannot trace"):
    thor_nnx.value_and_grad_with_stats(lambda o, t: _loss(o.logits, t), num_loss_terms=8)(
        Plain(), x, y)


def test_bridge_wrappers_are_listed_as_such():
  """A linen model inside ``nnx.bridge.ToNNX`` (NNX capture) and an NNX model inside
  ``nnx.bridge.ToLinen`` (linen capture): their layers are listed as inside a bridge, with
  exact gradients (before: "module kind not supported ... register_layer_kind", though both
  are built-in kinds)."""
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel
  x, y = _data()
  wrapped = bridge.ToNNX(LinenMLP(), rngs=nnx.Rngs(0))
  bridge.lazy_init(wrapped, x)
  (_, grads), stats = thor_nnx.value_and_grad_with_stats(_loss)(wrapped, x, y)
  want = nnx.grad(lambda m: _loss(m(x), y))(nnx.clone(wrapped))
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(nnx.to_pure_dict(want))):
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
  assert not stats.layers and stats.unhandled
  assert all("inside an nnx.bridge wrapper, whose linen layers" in n for n in stats.unhandled)
  linen = bridge.ToLinen(NnxMLP, args=())
  params = linen.init(jax.random.PRNGKey(0), x)["params"]
  (_, _), stats = thor_linen.value_and_grad_with_stats(linen, _loss)(params, x, y)
  assert not stats.layers and stats.unhandled
  assert all("whose NNX layers" in n for n in stats.unhandled), stats.unhandled


def test_wrt_selecting_variables_that_are_not_params_is_an_error():
  """``wrt`` selecting a trainable ``nnx.Variable`` of the user's (as ``nnx.Optimizer`` and
  ``nnx.grad`` accept): the capture differentiates ``nnx.Param`` only, so it says so (before:
  that gradient was dropped and the optimizer failed with a pytree structure error)."""

  class Temperature(nnx.Variable):
    pass

  class Scaled(nnx.Module):
    def __init__(self):
      self.l = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
      self.t = Temperature(jnp.array(1.5))

    def __call__(self, v):
      return self.l(v) / self.t[...]

  x, y = _data()
  with pytest.raises(ValueError, match=r"wrt selects variables that are not nnx.Param \(t\)"):
    thor_nnx.value_and_grad_with_stats(_loss, wrt=nnx.Any(nnx.Param, Temperature))(
        Scaled(), x, y)
  (_, grads), _ = thor_nnx.value_and_grad_with_stats(
      _loss, wrt=nnx.All(nnx.Param, nnx.PathContains("l")))(Scaled(), x, y)
  assert sorted(grads["l"]) == ["bias", "kernel"]
