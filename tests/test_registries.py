"""One shared test set per registry: every entry of a registry gets the same checks.

In the style of optax's ``alias_test.py``: each test is parametrized over all entries of one
registry, so that an entry added to the registry is tested as soon as it is registered.

* inverse methods (``inverses.METHODS``): one float64 check step of ``scale_by_kfac`` on a conv
  and dense layers with biases (dense layers only for ``'low_rank'``, whose state holds at most
  ``woodbury_rows`` rows per factor), with whole factors and, for eigh and low_rank, blocks of
  8, against a dense Kronecker reference built with ``np.kron``: ``(A + sqrt(lam) I)^-1 (x)
  (G + sqrt(lam) I)^-1`` of the block-diagonal parts, or ``(A (x) G + lam I)^-1`` for eigh.
  Every block stack holds the method's own state type, and the method's operator of every
  factor multiplies by the dense damped inverse (eigh: the stored eigendecomposition rebuilds
  the factor);
* layer kinds (``layers.registered()``): the linen and NNX captures give the kind's statistics
  at the layer's path, equal on equal weights; the kind claims the layer's leaves and the layout
  assigns the layer to it; the gradient leaves round-trip through ``to_matrix`` /
  ``from_matrix``, and the ``(d_A, d_G)`` gradient matrix is ``scale_A rows_A^T rows_G`` of the
  captured rows (normalization layers: the per-example gradients average to the gradient);
  statistics of two micro-batches joined along ``example_axes`` equal those of the joined
  batch. A kind registered by the user (a linen ``Projection`` holding ``w``, a subclass of
  ``thor_optax.layers.Dense`` sharing ``DenseStats``) is captured and preconditioned as
  ``nn.Dense`` is;
* aliases (``thor``, ``kfac``, ``skfac``, ``kaisa``, ``spngd``) on dense layers around a
  LayerNorm: (a) ``jax.jit`` of a check step and a plain step equals eager; (b)
  ``optax.inject_hyperparams`` equals the plain alias; (c) ``optax.MultiSteps`` given the joined
  statistics of two micro-batches at the emitted micro-step equals one step on the joined
  batch; (d) ``optax.masked`` preconditions only the mask; (e) orbax restores the state bit for
  bit; (f) bfloat16 parameters give finite bfloat16 updates and a float32 curvature state.

Compilation dominates the cost, so the models are tiny, the float64 runs of one alias share one
compiled program, the programs are compiled without XLA's backend optimizations, and the
checks of one layer kind or alias are made in one test, which reports every failing check:
pytest-xdist would compile again on every worker that ran a part of them.
"""


import contextlib
import dataclasses
import functools
import inspect
import traceback
from typing import Any

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

import thor_optax
from thor_optax import layers as thor_layers
from thor_optax import nnx as thor_nnx
from thor_optax.flax import value_and_grad_with_stats
from thor_optax._src import blocks
from thor_optax._src import inverses
from thor_optax._src import layers as layers_lib
from thor_optax._src.inverses import base as inverse_base
from thor_optax._src.inverses import eigh as eigh_lib
from thor_optax._src.inverses import low_rank as low_rank_lib
from thor_optax._src.static_args import STATIC_ARGS

from reference import F64, block_part, init_params, kron_update, randn, reference_factors
from reference import assert_orbax_round_trip, softmax_ce, stacked, unstack
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)

pytestmark = pytest.mark.usefixtures("fast_compiles")

LAM = 0.05
RTOL = 1e-9
BF16 = jnp.bfloat16
FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)


def _assert_trees_close(got, want, **tol):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float64),
                                                       np.asarray(b, np.float64), **tol),
               got, want)


def _find(tree, cls):
  """The first node of type ``cls`` in ``tree`` (an optimizer state), or ``None``."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls))
  return next((x for x in leaves if isinstance(x, cls)), None)


def _floating(tree):
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


class _Checks:
  """Runs named checks and collects their failures, so that a test reports every failing one."""

  def __init__(self):
    self.failures = []

  @contextlib.contextmanager
  def __call__(self, name):
    try:
      yield
    except AssertionError as e:
      self.failures.append(f"--- {name}:\n{e}")
    except Exception:  # pylint: disable=broad-except (an error in the package: reported too)
      self.failures.append(f"--- {name}:\n{traceback.format_exc(limit=-8)}")

  def assert_all_passed(self):
    if self.failures:
      pytest.fail("\n\n".join(self.failures))


def _jitted(f, *args):
  """``jax.jit(f)(*args)``, compiled without XLA's backend optimizations: each program here runs
  once or twice, so compilation dominates the cost of these tests."""
  return jax.jit(f).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


# ------------------------------------------------------------------------------------------------
# 1. Inverse methods.

ROWS = 3  # examples: the rows behind a dense layer's factors, and woodbury_rows
CONV = dict(kernel_size=(2, 2), strides=(1, 1), padding="VALID")


class Mixed(nn.Module):
  """A conv with bias (``A`` of dim 9 from ``N T = 12`` rows), then dense layers with bias
  (``A`` of dims 17 and 5 from 3 rows); every ``G`` of dim 4."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Conv(4, name="conv", **CONV)(x))
    h = jnp.tanh(nn.Dense(4, name="Dense_0")(h.reshape(h.shape[0], -1)))
    return nn.Dense(4, name="Dense_1")(h)


@pytest.fixture(scope="module")
def mixed():
  model = Mixed()
  x = jnp.asarray(randn(11, (ROWS, 3, 3, 2)))
  y = jnp.asarray([0, 3, 1])
  params = init_params(model, x, seed=11)
  (_, grads), stats = _jitted(value_and_grad_with_stats(model, softmax_ce), params, x, y)
  return params, grads, stats


def _exact_damped(A, G, grad, lam):
  """``(A (x) G + lam I)^-1 vec(dW)`` by a dense solve."""
  K = np.kron(A, G)
  return np.linalg.solve(K + lam * np.eye(K.shape[0]), grad.reshape(-1)).reshape(grad.shape)


def _split(F, block_size):
  return F.copy() if block_size is None else block_part(F, block_size)


def _package_order(spec):
  """Rows of the reference's ``[kernel; bias]`` (HWIO order for a conv) in the order of the
  kind's ``(d_A, d_G)`` matrix, where the factor blocks are cut."""
  shape = spec.kernel_shape
  index = np.arange(int(np.prod(shape[:-1]))).reshape(tuple(shape[:-1]) + (1,))
  order = np.asarray(spec.kind.kernel_matrix(index))[:, 0]
  return np.concatenate([order, [order.size]]) if spec.has_bias else order


def _state_type(method):
  """The type a block stack of ``method`` (a group's method) must hold."""
  if isinstance(method, eigh_lib.Eigh):
    return eigh_lib.EighState
  return low_rank_lib.LowRankState if method.rank else inverse_base.InverseBlocks


METHOD_STATES = {"eigh": {eigh_lib.EighState},
                 "low_rank": {low_rank_lib.LowRankState, inverse_base.InverseBlocks}}


# Every method whole; split into blocks of 8 (dims 9 and 17 split, 5 padded) where the blocks'
# state differs most from the whole factors' (a compilation costs more than the checks).
METHOD_CASES = [(name, None) for name in sorted(inverses.METHODS)] + [("eigh", 8),
                                                                      ("low_rank", 8)]


@pytest.mark.parametrize("name,block_size", METHOD_CASES,
                         ids=[f"{n}-{'split' if b else 'whole'}" for n, b in METHOD_CASES])
def test_inverse_method_update_state_and_operator(mixed, name, block_size):
  params, grads, stats = mixed
  kwargs = {}
  if inverses.METHODS[name][1] == "required":  # low_rank: at most ROWS rows per factor
    kwargs = dict(woodbury_rows=ROWS)
    keep = ("Dense_0", "Dense_1")
    params, grads = ({k: t[k] for k in keep} for t in (params, grads))
    stats = thor_optax.CurvatureStats({k: stats.layers[k] for k in keep})
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, block_size=block_size, inverse_method=name,
                                **kwargs)
  updates, state = _jitted(lambda g, c: tx.update(g, tx.init(params), None, curvature_stats=c),
                           grads, stats)
  method = inverses.make(name, kwargs.get("woodbury_rows"))
  rng = np.random.default_rng(0)
  where = f"block_size={block_size}"
  assert jax.tree.structure(updates) == jax.tree.structure(grads)
  layout = blocks.build_layout(params, block_size, lambda b: method.for_block(b).rank)
  assert set(state.blocks) == set(layout.groups), where
  types = set()
  for spec in layout.layers:
    order = _package_order(spec)
    conv = CONV if spec.kind.name == "conv" else None
    A, G = reference_factors(stats.layers[spec.name], spec.has_bias, conv)
    A, G = _split(A[np.ix_(order, order)], block_size), _split(G, block_size)
    grad = stacked(grads[spec.name])[order]
    if name == "eigh":
      update = _exact_damped(A, G, grad, LAM)
    else:
      update = kron_update(A, G, grad, LAM**0.5, LAM**0.5)
    want = unstack(update[np.argsort(order)], params[spec.name])
    for leaf in want:
      np.testing.assert_allclose(updates[spec.name][leaf], want[leaf], rtol=RTOL, atol=1e-12,
                                 err_msg=f"{where} {spec.name}/{leaf}")
    assert np.ptp(np.asarray(updates[spec.name]["kernel"]) / np.asarray(
        grads[spec.name]["kernel"])) > 0.1  # not a scaled gradient

    for slot, F in ((spec.a, A), (spec.g, G)):
      at = f"{where} {spec.name} slot {slot}"
      group_method = method.for_block(slot.block)
      stack = state.blocks[slot.group]["inverse"]
      assert isinstance(stack, _state_type(group_method)), (at, type(stack))
      types.add(type(stack))
      part = jax.tree.map(lambda v, s=slot: v[s.start:s.stop], stack)
      if name == "eigh":
        q, values = np.asarray(part.eigenvectors), np.asarray(part.eigenvalues)
        assert values.min() >= 0.0, at
        rebuilt = scipy.linalg.block_diag(*((q * values[:, None, :]) @ np.swapaxes(q, 1, 2)))
        padded = np.zeros((slot.padded_dim, slot.padded_dim))
        padded[:slot.dim, :slot.dim] = F
        np.testing.assert_allclose(rebuilt, padded, rtol=1e-9, atol=1e-12, err_msg=at)
        continue
      operator = group_method.operator(part)
      inverse = np.linalg.inv(F + LAM**0.5 * np.eye(slot.dim))
      x = rng.standard_normal((slot.dim, 3))
      z = rng.standard_normal((2, slot.dim))
      np.testing.assert_allclose(operator.left(jnp.asarray(x)), inverse @ x, rtol=RTOL,
                                 atol=1e-12, err_msg=at)
      np.testing.assert_allclose(operator.right(jnp.asarray(z)), z @ inverse, rtol=RTOL,
                                 atol=1e-12, err_msg=at)
  assert types == METHOD_STATES.get(name, {inverse_base.InverseBlocks}), where


# ------------------------------------------------------------------------------------------------
# 2. Layer kinds.

KINDS = layers_lib.registered()  # the built-in kinds (user kinds are added by a fixture below)
BATCH, FIRST = 6, 2  # examples of the joined batch and of its first micro-batch


class KindNet(nn.Module):
  """The layer ``layer`` of one kind (a ``Dense`` before a normalization layer), then a head."""

  kind: str

  @nn.compact
  def __call__(self, x):
    if self.kind == "dense":
      h = nn.Dense(4, name="layer")(x)
    elif self.kind == "conv":
      h = nn.Conv(4, (3, 3), padding="SAME", name="layer")(x).mean(axis=(1, 2))
    elif self.kind == "conv_transpose":
      h = nn.ConvTranspose(4, (3, 3), strides=(2, 2), name="layer")(x).mean(axis=(1, 2))
    elif self.kind == "embed":
      h = nn.Embed(7, 4, name="layer")(x).mean(axis=1)
    elif self.kind == "dense_general":
      h = nn.DenseGeneral((2, 2), name="layer")(x).reshape(x.shape[0], 4)
    elif self.kind == "einsum":  # the contracted axis in the kernel's middle
      h = nn.Einsum((2, 3, 2), "nd,hdk->nhk", name="layer")(x).reshape(x.shape[0], 4)
    elif self.kind == "norm":
      h = nn.LayerNorm(name="layer")(nn.Dense(4, name="pre")(x))
    elif self.kind == "matmul":  # a module of no Flax class, its kernel applied transposed
      h = TransposedDense(4, name="layer")(x)
    elif self.kind == "channel_affine":  # a layer norm of no Flax class, leaves gamma / beta
      h = HandLayerNorm(name="layer")(nn.Dense(4, name="pre")(x))
    elif self.kind == "lookup":  # an embedding of no Flax class, its table named wte
      h = TableLookup(name="layer")(x).mean(axis=1)
    else:
      raise ValueError(f"no test layer of kind {self.kind!r}: add one to KindNet and NnxKindNet")
    return nn.Dense(3, name="head")(jnp.tanh(h))


class TransposedDense(nn.Module):
  """``x @ kernel.T + bias``, the kernel stored ``(features, d_in)`` (GPT-2's ``Conv1D``)."""

  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.normal(), (self.features, x.shape[-1]))
    return x @ kernel.T + self.param("bias", nn.initializers.zeros, (self.features,))


class HandLayerNorm(nn.Module):
  """``gamma * (x - mean) / std + beta`` over the last axis, written by hand."""

  @nn.compact
  def __call__(self, x):
    gamma = self.param("gamma", nn.initializers.ones, (x.shape[-1],))
    beta = self.param("beta", nn.initializers.zeros, (x.shape[-1],))
    return gamma * (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5) \
        + beta


class TableLookup(nn.Module):
  """``wte[ids] * 2``: a ``(7, 4)`` table of no Flax class, looked up and scaled."""

  @nn.compact
  def __call__(self, ids):
    return jnp.take(self.param("wte", nn.initializers.normal(1.0), (7, 4)), ids, axis=0) * 2.0


class NnxTableLookup(nnx.Module):
  """:class:`TableLookup` in NNX (attribute ``wte``)."""

  def __init__(self):
    self.wte = nnx.Param(jnp.zeros((7, 4), F64))

  def __call__(self, ids):
    return self.wte[...][ids] * 2.0


class NnxHandLayerNorm(nnx.Module):
  """:class:`HandLayerNorm` in NNX (attributes ``gamma``, ``beta``)."""

  def __init__(self, features):
    self.gamma = nnx.Param(jnp.ones((features,), F64))
    self.beta = nnx.Param(jnp.zeros((features,), F64))

  def __call__(self, x):
    return self.gamma[...] * (x - x.mean(-1, keepdims=True)) / jnp.sqrt(
        x.var(-1, keepdims=True) + 1e-5) + self.beta[...]


class NnxTransposedDense(nnx.Module):
  """:class:`TransposedDense` in NNX (attributes ``kernel``, ``bias``)."""

  def __init__(self, d_in, features, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (features, d_in), F64))
    self.bias = nnx.Param(jnp.zeros((features,), F64))

  def __call__(self, x):
    return x @ self.kernel[...].T + self.bias[...]


class NnxKindNet(nnx.Module):
  """:class:`KindNet` in Flax NNX, with the same attribute names (paths)."""

  def __init__(self, kind, rngs):
    kw = dict(param_dtype=F64, rngs=rngs)
    self.kind = kind
    if kind == "dense":
      self.layer = nnx.Linear(3, 4, **kw)
    elif kind == "conv":
      self.layer = nnx.Conv(2, 4, (3, 3), padding="SAME", **kw)
    elif kind == "conv_transpose":
      self.layer = nnx.ConvTranspose(2, 4, (3, 3), strides=(2, 2), **kw)
    elif kind == "embed":
      self.layer = nnx.Embed(7, 4, **kw)
    elif kind == "dense_general":
      self.layer = nnx.LinearGeneral(3, (2, 2), **kw)
    elif kind == "einsum":
      self.layer = nnx.Einsum("nd,hdk->nhk", (2, 3, 2), (2, 2), **kw)
    elif kind == "norm":
      self.pre = nnx.Linear(3, 4, **kw)
      self.layer = nnx.LayerNorm(4, **kw)
    elif kind == "matmul":
      self.layer = NnxTransposedDense(3, 4, rngs)
    elif kind == "channel_affine":
      self.pre = nnx.Linear(3, 4, **kw)
      self.layer = NnxHandLayerNorm(4)
    elif kind == "lookup":
      self.layer = NnxTableLookup()
    else:
      raise ValueError(f"no test layer of kind {kind!r}: add one to KindNet and NnxKindNet")
    self.head = nnx.Linear(4, 3, **kw)

  def __call__(self, x):
    if self.kind in ("dense", "matmul"):
      h = self.layer(x)
    elif self.kind in ("conv", "conv_transpose"):
      h = self.layer(x).mean(axis=(1, 2))
    elif self.kind in ("embed", "lookup"):
      h = self.layer(x).mean(axis=1)
    elif self.kind in ("dense_general", "einsum"):
      h = self.layer(x).reshape(x.shape[0], 4)
    else:
      h = self.layer(self.pre(x))
    return self.head(jnp.tanh(h))


def _kind_inputs(kind):
  if kind in ("embed", "lookup"):
    return jnp.asarray(np.random.default_rng(3).integers(0, 7, (BATCH, 3)))
  shape = (BATCH, 4, 4, 2) if kind.startswith("conv") else (BATCH, 3)
  return jnp.asarray(randn(3, shape))


def _load(model, params):
  """Copies linen parameters into the NNX model's ``nnx.Param`` variables (same paths)."""
  loaded = 0
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param):
      leaf = params
      for key in path:
        leaf = leaf[key]
      assert leaf.shape == node.shape, path
      node[...] = leaf
      loaded += 1
  assert loaded == len(jax.tree.leaves(params))


def _kind_ids(kinds):
  return [kind.name for kind in kinds]


def _kind_run(kind):
  """One kind's layer in :class:`KindNet`: params, the batch's gradients and statistics from
  linen and from NNX (on the same weights), and the statistics of its two micro-batches."""
  model = KindNet(kind.name)
  x = _kind_inputs(kind.name)
  y = jnp.asarray(np.arange(BATCH) % 3)
  params = init_params(model, x, seed=4)
  capture = functools.partial(_jitted, value_and_grad_with_stats(model, softmax_ce))
  (_, grads), stats = capture(params, x, y)
  parts = [capture(params, x[s], y[s])[1] for s in (slice(0, FIRST), slice(FIRST, None))]
  nnx_model = NnxKindNet(kind.name, nnx.Rngs(0))
  _load(nnx_model, params)
  graphdef, state = nnx.split(nnx_model)

  def nnx_capture(state, x, y):
    (_, grads), stats = thor_nnx.value_and_grad_with_stats(softmax_ce)(
        nnx.merge(graphdef, state), x, y)
    return grads, stats

  nnx_grads, nnx_stats = _jitted(nnx_capture, state, x, y)
  return params, grads, stats, nnx_grads, nnx_stats, parts


@pytest.mark.parametrize("kind", KINDS, ids=_kind_ids(KINDS))
def test_layer_kind(kind):
  """Capture (linen and NNX), claim and layout, the gradient matrix, micro-batches.

  One test per kind, its checks reported together: they share the captures, and pytest-xdist
  would capture again on every worker that ran a part of them.
  """
  params, grads, stats, nnx_grads, nnx_stats, (first, rest) = _kind_run(kind)
  check = _Checks()
  # The kind that reads the statistics and claims the parameters: the kind itself, but for a
  # kind that only plans the capture (a transposed convolution is a convolution).
  capture_only = kind.name == "conv_transpose"
  kind = layers_lib.kind_named("conv") if capture_only else kind

  with check("capture: linen and NNX give the kind's statistics at the layer's path"):
    assert stats.unhandled == () and nnx_stats.unhandled == ()
    layer = stats.layers["layer"]
    assert type(layer) is kind.stats_type and type(nnx_stats.layers["layer"]) is kind.stats_type
    assert layers_lib.kind_of_stats(layer) is kind
    assert not capture_only or layer.input_dilation == (2, 2)
    arrays = [np.asarray(getattr(layer, f)) for f in kind.example_axes]
    assert all(np.abs(a).max() > 1e-3 for a in arrays if a.dtype.kind == "f")
    # The same statistics (every layer, static metadata included) and gradients from both.
    _assert_trees_close(nnx_stats, stats, rtol=1e-12, atol=1e-14)
    _assert_trees_close(nnx.to_pure_dict(nnx_grads), grads, rtol=1e-12, atol=1e-14)

  shapes = {name: tuple(leaf.shape) for name, leaf in params["layer"].items()}
  captured = thor_optax.captured_layers(stats)
  spec = blocks.build_layout(params, None, captured=captured.kinds).layer("layer")
  with check("claim: the kind claims the layer's leaves, the layout assigns it the layer"):
    assert captured.kinds["layer"] == (kind.name, kind.hint(stats.layers["layer"]))
    claim = kind.claim_captured(("layer",), shapes, kind.hint(stats.layers["layer"]))
    assert claim is not None
    # An einsum's contracted axes are in its equation only; that a kernel is applied
    # transposed, or that a table of another name is looked up, in the traced call only.
    if kind.name not in ("einsum", "matmul", "lookup"):
      assert kind.claim(("layer",), shapes) == claim
      assert layers_lib.claim(("layer",), shapes) == (kind, claim)
      shape_only = blocks.build_layout(params, None).layer("layer")
      assert dataclasses.replace(shape_only, hint=spec.hint) == spec
    assert spec.kind is kind and spec.path == ("layer",)
    assert (claim.a_dim is None) == (spec.a is None)
    assert (claim.g_dim is None) == (spec.g is None)
    kind.check_stats(spec, stats.layers["layer"])  # the captured statistics fit the layer

  with check("gradients: to_matrix / from_matrix, and the matrix from the captured rows"):
    _check_gradient_matrix(kind, spec, grads["layer"], stats.layers["layer"], shapes)

  with check("micro-batches: concatenate_stats joins them along example_axes"):
    joined = thor_optax.concatenate_stats(first, rest)
    # example_axes names every array field of the statistics.
    fields = {f.name for f in dataclasses.fields(kind.stats_type)}
    arrays = {f for f in fields if isinstance(getattr(joined.layers["layer"], f), jax.Array)}
    optional = set(kind.example_axes) - arrays  # a tied embedding's fields, here None
    assert arrays <= set(kind.example_axes)
    assert all(getattr(joined.layers["layer"], f) is None for f in optional)
    for field, axis in kind.example_axes.items():
      if field in optional:
        continue
      assert getattr(first.layers["layer"], field).shape[axis] == FIRST
      assert getattr(joined.layers["layer"], field).shape[axis] == BATCH
    _assert_trees_close(joined, stats, rtol=1e-10, atol=1e-13)

  check.assert_all_passed()


def _check_gradient_matrix(kind, spec, leaves, layer_stats, shapes):
  """The gradient leaves round-trip through the ``(d_A, d_G)`` matrix, which is, for the
  empirical Fisher with one sample, ``scale_A rows_A^T rows_G``: ``(1/N) sum a g^T`` over
  examples and positions (normalization layers: the per-example gradients average to it)."""
  n = BATCH
  if spec.g is None:  # side curvature only
    assert kind.name in ("norm", "channel_affine")
    for name, field in zip(kind.leaf_names(spec.hint), ("scale_grads", "bias_grads")):
      per_example = np.asarray(getattr(layer_stats, field))
      assert per_example.shape == (1, n) + shapes[name]
      np.testing.assert_allclose(per_example[0].mean(0), leaves[name], rtol=1e-10, atol=1e-14)
    return
  matrix = kind.to_matrix(spec, leaves, F64)
  d_a = spec.a.dim if spec.a is not None else spec.kernel_shape[0]
  assert matrix.shape == (d_a, spec.g.dim)
  back = kind.from_matrix(spec, matrix, leaves)
  assert set(back) == set(leaves)
  for name in leaves:
    assert back[name].dtype == leaves[name].dtype
    np.testing.assert_array_equal(back[name], leaves[name])
  g_rows, _ = kind.cotangent_rows(spec, layer_stats, F64)
  if spec.a is not None:
    a_rows, a_scale = kind.input_rows(spec, layer_stats, F64)
  else:  # a diagonal A (embedding): one-hot rows of the ids
    ids = np.asarray(layer_stats.inputs).reshape(-1)
    a_rows, a_scale = np.eye(d_a)[ids], 1.0 / n
    np.testing.assert_allclose(kind.input_rows(spec, layer_stats, F64),
                               np.diag(a_rows.T @ a_rows) / n, rtol=1e-14)
  a_rows, g_rows = np.asarray(a_rows), np.asarray(g_rows)
  assert a_rows.shape == (g_rows.shape[0], d_a) and g_rows.shape[1] == spec.g.dim
  np.testing.assert_allclose(matrix, float(a_scale) * a_rows.T @ g_rows, rtol=1e-10,
                             atol=1e-14)


# A layer kind of the user's own: a linen module holding its weight as ``w``.


@jax.custom_vjp
def fused_matmul(x, w):
  """``x @ w`` with a backward pass of its own (as a Pallas kernel would have)."""
  return x @ w


fused_matmul.defvjp(lambda x, w: (x @ w, (x, w)),
                    lambda res, g: (g @ res[1].T, jnp.einsum("...i,...j->ij", res[0], g)))


class Projection(nn.Module):
  """``y = x @ w`` with ``w`` of shape ``(d_in, features)``, by :func:`fused_matmul`: no built-in
  kind takes it (the ``'matmul'`` kind does not see through a ``custom_vjp``)."""

  features: int

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
    return fused_matmul(x, w)


class ProjectionKind(thor_layers.Dense):
  """Dense factors for :class:`Projection` (weight ``w``, no bias), with ``DenseStats``."""

  name = "projection"
  weight = "w"
  linen_modules = (Projection,)
  nnx_modules = ()

  def claim(self, path, shapes):
    del path
    w = shapes.get("w")
    if set(shapes) != {"w"} or len(w) != 2:
      return None
    return thor_layers.Claim(a_dim=w[0], g_dim=w[1])


class ProjectionNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="head")(jnp.tanh(Projection(4, name="proj")(x)))


@pytest.fixture
def projection_kind():
  kind = thor_optax.register_layer_kind(ProjectionKind())
  try:
    yield kind
  finally:
    thor_optax.unregister_layer_kind(kind)
  assert kind not in layers_lib.registered()


def _projection_batch():
  model = ProjectionNet()
  x = jnp.asarray(randn(7, (5, 6)))
  y = jnp.asarray([0, 1, 2, 0, 1])
  return model, x, y, init_params(model, x, seed=7)


def test_user_kind_is_unhandled_until_registered():
  model, x, y, params = _projection_batch()
  (_, _), stats = value_and_grad_with_stats(model, softmax_ce)(params, x, y)
  assert set(stats.layers) == {"head"}
  (reason,) = stats.unhandled
  assert reason.startswith("proj: Projection holds a weight 'w', but its call is not a matrix "
                           "product of its input by it: it applies custom_vjp_call"), reason
  assert [spec.name for spec in blocks.build_layout(params, None).layers] == ["head"]


def test_user_kind_registration_rules(projection_kind):
  assert layers_lib.registered() == (projection_kind,) + KINDS  # tried first
  assert projection_kind.stats_type is thor_optax.DenseStats  # shared: same example axes

  class OtherAxes(ProjectionKind):
    name = "projection_other_axes"
    example_axes = {"inputs": 0, "cotangents": 0}

  with pytest.raises(ValueError, match="example_axes"):
    thor_optax.register_layer_kind(OtherAxes())
  with pytest.raises(ValueError, match="taken"):
    thor_optax.register_layer_kind(ProjectionKind())
  with pytest.raises(TypeError, match="LayerKind instance"):
    thor_optax.register_layer_kind(ProjectionKind)
  # Attributes of the wrong type are named when the kind is registered (before: errors from
  # isinstance or dataclasses at the first capture).
  bad = {"linen_modules": (Projection(4),), "nnx_modules": Projection, "stats_type": None,
         "weight": 0, "example_axes": {"rows": 0}}
  for attr, value in bad.items():
    wrong = type("Wrong", (ProjectionKind,), {"name": "wrong", attr: value})()
    with pytest.raises(TypeError, match=attr):
      thor_optax.register_layer_kind(wrong)
  assert layers_lib.registered() == (projection_kind,) + KINDS


@pytest.mark.parametrize("claim,weight,match", [
    (lambda w: thor_layers.Claim(a_dim=w[1], g_dim=w[0]), "w", "must give a_dim=6, g_dim=4"),
    (lambda w: (w[0], w[1]), "w", "must return a thor_optax.layers.Claim"),
    (lambda w: thor_layers.Claim(a_dim=w[0], g_dim=w[1]), "kernel", "weight leaf 'kernel'")])
def test_user_kind_claims_that_do_not_fit_are_named(claim, weight, match):
  """A claim with swapped dimensions, one that is not a ``Claim``, or a ``weight`` naming no
  leaf: an error naming the kind and the layer when the optimizer lays it out (before: a
  ``lax.cond`` shape mismatch, an ``AttributeError``, ``len(None)``)."""

  class Bad(ProjectionKind):
    name = "projection_bad"

    def claim(self, path, shapes):
      w = shapes.get("w")
      return None if set(shapes) != {"w"} else claim(w)

  kind = Bad()
  kind.weight = weight
  thor_optax.register_layer_kind(kind)
  try:
    model, x, _, params = _projection_batch()
    with pytest.raises((TypeError, ValueError), match=match):
      thor_optax.thor(0.1).init(params)
  finally:
    thor_optax.unregister_layer_kind(kind)


def test_user_kind_is_captured_and_preconditioned_as_dense(projection_kind):
  model, x, y, params = _projection_batch()
  (_, grads), stats = _jitted(value_and_grad_with_stats(model, softmax_ce), params, x, y)
  assert stats.unhandled == ()
  assert type(stats.layers["proj"]) is thor_optax.DenseStats
  np.testing.assert_array_equal(stats.layers["proj"].inputs, x)
  assert stats.layers["proj"].cotangents.shape == (1, 5, 4)
  layout = blocks.build_layout(params, None)
  assert {spec.name: spec.kind.name for spec in layout.layers} == {"head": "dense",
                                                                   "proj": "projection"}
  assert layout.layer("proj").a.dim == 6 and not layout.layer("proj").has_bias

  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None)
  updates, state = _jitted(lambda g, c: tx.update(g, tx.init(params), None, curvature_stats=c),
                           grads, stats)
  assert int(state.diagnostics["proj"].blocks_refreshed) == 2
  d = LAM**0.5
  A, G = reference_factors(stats.layers["proj"], False)
  np.testing.assert_allclose(A, np.asarray(x).T @ np.asarray(x) / 5, rtol=1e-12)
  want = kron_update(A, G, np.asarray(grads["proj"]["w"]), d, d)
  np.testing.assert_allclose(updates["proj"]["w"], want, rtol=RTOL, atol=1e-12)
  A, G = reference_factors(stats.layers["head"], True)
  want = unstack(kron_update(A, G, stacked(grads["head"]), d, d), params["head"])
  for leaf in want:
    np.testing.assert_allclose(updates["head"][leaf], want[leaf], rtol=RTOL, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# 3. Aliases.

LR = 0.1
MAX_KL = 1e-3
# Each alias with small settings. Under inject_hyperparams the learning rate and the damping are
# injected; block_size is static, and so are the settings that the pieces validate or branch on
# in Python when they are built (decays, periods, tolerances, caps).
ALIASES = {
    "thor": (thor_optax.thor, dict(block_size=2)),  # every factor in 2 blocks
    "kfac": (thor_optax.kfac, dict(ema_decay=0.9)),
    "skfac": (thor_optax.skfac, {}),  # auto inversion
    "kaisa": (thor_optax.kaisa, dict(inverse_period=2, max_kl=MAX_KL)),
    "spngd": (thor_optax.spngd, {}),
}
NAMES = list(ALIASES)
MICRO = 2  # examples per micro-batch; the joined batch has 2 MICRO


class AliasNet(nn.Module):
  """Dense layers around a LayerNorm (unit-wise in SP-NGD). Every Kronecker factor has
  dimension 4: one block stack, the cheapest programs to compile (biases, convs and stacks of
  several block sizes are tested above, each alias's conv options in test_methods.py and
  test_conv_sampling.py)."""

  dtype: Any = F64

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=self.dtype, param_dtype=self.dtype)
    h = nn.Dense(4, use_bias=False, name="Dense_0", **kw)(x)
    h = jnp.tanh(nn.LayerNorm(name="norm", **kw)(h))
    return nn.Dense(4, use_bias=False, name="Dense_1", **kw)(h)


def _make(name):
  factory, settings = ALIASES[name]
  return factory(LR, LAM, **settings)


def _steps(tx, grads, stats, params):
  """A check step from the initial state, then a plain step."""
  u1, s1 = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  u2, s2 = tx.update(grads, s1, params)
  return u1, s1, u2, s2


def _alias_inputs(dtype):
  x = jnp.asarray(randn(9, (2 * MICRO, 4)), dtype)
  return x, jnp.asarray(np.arange(2 * MICRO) % 4, jnp.int32)


@pytest.fixture(scope="module")
def alias_data():
  """float64 params; gradients and statistics of the joined batch and of its two halves."""
  model = AliasNet()
  x, y = _alias_inputs(F64)
  params = init_params(model, x, seed=9)
  capture = functools.partial(_jitted, value_and_grad_with_stats(model, softmax_ce))
  (_, grads), stats = capture(params, x, y)
  halves = []
  for part in (slice(0, MICRO), slice(MICRO, None)):
    (_, part_grads), part_stats = capture(params, x[part], y[part])
    halves.append((part_grads, part_stats))
  return params, grads, stats, halves


def _poison(grads, value):
  """``grads`` with ``value`` (NaN, Inf) in one entry of the last layer's kernel."""
  return {**grads, "Dense_1": {**grads["Dense_1"],
                               "kernel": grads["Dense_1"]["kernel"].at[0, 1].set(value)}}


def _mask(params):
  return {layer: jax.tree.map(lambda _, keep=layer != "Dense_0": keep, sub)
          for layer, sub in params.items()}


def _wrapped_runs(name, params, grads, stats, halves):
  """Every float64 run of one alias, from one jitted program (a compilation costs far more than
  the steps): the alias's check and plain steps, the same under inject_hyperparams, two
  MultiSteps micro-steps (the joined statistics at the second) and a check step under
  optax.masked."""
  (g_a, st_a), (g_b, st_b) = halves
  factory, settings = ALIASES[name]
  tx = _make(name)
  static = STATIC_ARGS[name]  # the documented tuple (the errors and the README name it)
  inject = optax.inject_hyperparams(factory, static_args=static)(
      learning_rate=LR, damping=LAM, **settings)
  # (MultiSteps averages the gradients in float32 unless told otherwise.)
  multi = optax.MultiSteps(_make(name), every_k_schedule=2, accumulator_dtype=F64)
  masked = optax.masked(_make(name), _mask(params))

  def run(params, grads, stats, g_a, g_b, st_a, st_b):
    out = dict(plain=_steps(tx, grads, stats, params), inject=_steps(inject, grads, stats, params))
    state = multi.init(params)
    first, state = multi.update(g_a, state, params)  # a plain micro-step
    second, state = multi.update(g_b, state, params,
                                 curvature_stats=thor_optax.concatenate_stats(st_a, st_b))
    out["multi"] = (first, second, state)
    out["masked"] = masked.update(grads, masked.init(params), params, curvature_stats=stats)
    # Non-finite steps after the check step: a NaN gradient on a plain step, an Inf on a check
    # step, a NaN learning rate; then a clean plain step.
    _, s1 = out["plain"][:2]
    nan_grads = _poison(grads, jnp.nan)
    bad_plain = tx.update(nan_grads, s1, params)
    bad_check = tx.update(_poison(grads, jnp.inf), s1, params, curvature_stats=stats)
    after = tx.update(grads, bad_check[1], params)
    _, is1 = out["inject"][:2]
    nan_lr = is1._replace(hyperparams={**is1.hyperparams,
                                       "learning_rate": jnp.asarray(jnp.nan, F64)})
    bad_lr = inject.update(grads, nan_lr, params)
    out["not_finite"] = (bad_plain, bad_check, after, bad_lr)
    return out

  return _jitted(run, params, grads, stats, g_a, g_b, st_a, st_b)


@pytest.mark.parametrize("name", NAMES)
def test_alias_in_jit_optax_wrappers_and_checkpoints(name, alias_data, tmp_path):
  """(a) jit equals eager; (b) inject_hyperparams; (c) MultiSteps; (d) masked; (e) orbax;
  (f) non-finite steps skipped.

  One test per alias: its runs share one compilation, which dominates the cost, and pytest-xdist
  would compile it again on every worker that ran a part of them.
  """
  params, grads, stats, halves = alias_data
  runs = _wrapped_runs(name, params, grads, stats, halves)
  u1, s1, u2, s2 = runs["plain"]
  check = _Checks()

  with check("(a) jax.jit equals eager"):
    with jax.disable_jit():  # every operation on its own, control flow in Python
      eager = _steps(_make(name), grads, stats, params)
    _assert_trees_close(eager, (u1, s1, u2, s2), rtol=1e-10, atol=1e-14)
    # The check step preconditioned (not momentum SGD on the raw gradient) and refreshed every
    # layer's blocks; the plain step refreshed nothing.
    assert not np.allclose(u1["Dense_1"]["kernel"], -LR * grads["Dense_1"]["kernel"], rtol=1e-3)
    before, after = _find(s1, thor_optax.KroneckerState), _find(s2, thor_optax.KroneckerState)
    assert set(before.diagnostics) == {"Dense_0", "Dense_1"} and "norm" in before.layers
    for layer, diag in before.diagnostics.items():
      assert int(diag.total_refreshes) == int(diag.num_blocks) > 0, layer
      assert int(after.diagnostics[layer].total_refreshes) == int(diag.total_refreshes), layer
    assert int(after.count) == 2

  with check("(b) optax.inject_hyperparams"):
    i1, is1, i2, is2 = runs["inject"]
    assert {"learning_rate", "damping"} <= set(is1.hyperparams)
    assert is2.hyperparams["learning_rate"].dtype == F64
    _assert_trees_close((i1, i2), (u1, u2), rtol=1e-12, atol=1e-15)
    _assert_trees_close((is1.inner_state, is2.inner_state), (s1, s2), rtol=1e-12, atol=1e-15)

  with check("(c) optax.MultiSteps with the joined statistics"):
    first, second, state = runs["multi"]
    assert all(not np.any(leaf) for leaf in jax.tree.leaves(first))
    _assert_trees_close(second, u1, rtol=1e-9, atol=1e-13)
    _assert_trees_close(state.inner_opt_state, s1, rtol=1e-9, atol=1e-13)
    assert int(state.gradient_step) == 1

  with check("(d) optax.masked"):
    updates, state = runs["masked"]
    # Masked out: the inner update of optax.masked, i.e. the gradient.
    np.testing.assert_array_equal(updates["Dense_0"]["kernel"], grads["Dense_0"]["kernel"])
    inner = _find(state, thor_optax.KroneckerState)
    assert set(inner.diagnostics) == {"Dense_1"} and set(inner.layers) == {"norm"}
    assert all(int(d.total_refreshes) == int(d.num_blocks) for d in inner.diagnostics.values())
    # The masked-in layers get the whole model's update, layer by layer; but a KL clip
    # measures the masked-in update only: u = -lr nu P g with nu from the masked-in <P g, g>.
    kept = [layer for layer in params if layer != "Dense_0"]
    want = {layer: u1[layer] for layer in kept}
    clip = _find(s1, thor_optax.KLClipState)
    factory, settings = ALIASES[name]
    max_kl = settings.get("max_kl", inspect.signature(factory).parameters["max_kl"].default)
    if name == "kaisa":
      assert float(clip.scale) < 0.9  # the clip binds at kaisa's 1e-3
    if clip is not None and float(clip.scale) < 1.0:
      # The whole model's step was clipped: nu^2 = max_kl / (lr^2 <P g, g>) with P g =
      # -u / (lr nu), so nu = max_kl / (lr |<u, g>|), in float64 (the state keeps nu in
      # float32).
      vdot = lambda a, b: sum(float(np.vdot(x, y)) for x, y in zip(jax.tree.leaves(a),
                                                                  jax.tree.leaves(b)))
      nu_full = max_kl / (LR * abs(vdot(u1, grads)))
      np.testing.assert_allclose(float(clip.scale), nu_full, rtol=1e-6)
      natural = jax.tree.map(lambda u: -np.asarray(u) / (LR * nu_full), want)
      nu = min(1.0, (max_kl / abs(LR**2 * vdot(natural, {k: grads[k] for k in kept})))**0.5)
      assert abs(nu - nu_full) > 1e-3
      want = jax.tree.map(lambda n: -LR * nu * n, natural)
    _assert_trees_close({layer: updates[layer] for layer in kept}, want, rtol=1e-9, atol=1e-13)

  with check("(e) orbax save and restore"):
    target = jax.eval_shape(_make(name).init, params)
    assert_orbax_round_trip(s2, target, tmp_path / "state")

  with check("(f) a non-finite gradient or update changes nothing, and is counted"):
    bad_plain, bad_check, after, bad_lr = runs["not_finite"]
    for updates, state in (bad_plain, bad_check):
      assert all(not np.any(leaf) for leaf in jax.tree.leaves(updates))
      assert isinstance(state, optax.ApplyIfFiniteState)
      assert (int(state.total_notfinite), int(state.notfinite_count)) == (1, 1)
      assert not bool(state.last_finite)
      _assert_trees_close(state.inner_state, s1.inner_state, rtol=0, atol=0)
    # The clean step after a skipped one is the plain step that would have come without it.
    _assert_trees_close(after[0], u2, rtol=0, atol=0)
    assert (int(after[1].total_notfinite), int(after[1].notfinite_count)) == (1, 0)
    _, is1 = runs["inject"][:2]
    assert all(not np.any(leaf) for leaf in jax.tree.leaves(bad_lr[0]))
    _assert_trees_close(bad_lr[1].inner_state.inner_state, is1.inner_state.inner_state,
                        rtol=0, atol=0)
    assert int(bad_lr[1].inner_state.total_notfinite) == 1

  check.assert_all_passed()


def _f32_ce(logits, labels):  # the loss in float32, as mixed-precision training does
  return softmax_ce(logits.astype(jnp.float32), labels)


@pytest.fixture(scope="module")
def bf16_data(alias_data):
  """bfloat16 params (the float64 ones rounded), gradients and statistics, with x64 off."""
  with jax.enable_x64(False):
    x, y = _alias_inputs(BF16)
    params = jax.tree.map(lambda p: jnp.asarray(p, BF16), alias_data[0])
    capture = value_and_grad_with_stats(AliasNet(dtype=BF16), _f32_ce)
    (_, grads), stats = _jitted(capture, params, x, y)
  return params, grads, stats


@pytest.mark.parametrize("name", NAMES)
def test_alias_bfloat16_parameters(name, bf16_data):
  """(g) bfloat16 parameters: finite bfloat16 updates and a float32 curvature state."""
  params, grads, stats = bf16_data
  assert {x.dtype for x in jax.tree.leaves((params, grads, stats.layers))} == {jnp.dtype(BF16)}
  with jax.enable_x64(False):
    u1, s1, u2, s2 = _jitted(functools.partial(_steps, _make(name)), grads, stats, params)
  for updates in (u1, u2):
    assert {x.dtype for x in jax.tree.leaves(updates)} == {jnp.dtype(BF16)}
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(updates))
  assert not np.allclose(np.asarray(u1["Dense_1"]["kernel"], np.float32),
                         -LR * np.asarray(grads["Dense_1"]["kernel"], np.float32), rtol=0.05)
  for state in (s1, s2):
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in _floating(state))
    pre = _find(state, thor_optax.KroneckerState)
    assert {x.dtype for x in _floating(pre)} == {jnp.dtype(jnp.float32)}
    assert all(int(d.total_refreshes) > 0 for d in pre.diagnostics.values())
