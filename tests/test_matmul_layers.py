"""Modules of no Flax layer class whose call is a product by their own kernel (the ``'matmul'``
kind): Hugging Face's GPT-2 ``Conv1D`` (kernel stored ``(d_out, d_in)``, transposed before the
product), hand-written ``x @ self.param('kernel', ...)`` layers, and weights of rank 3 or more:
the ``Einsum`` of Flax's Gemma example, a MaxText-style ``DenseGeneral``, an ``nnx.vmap`` stack.

References are the same models written with ``nn.Dense``, ``nn.Einsum`` or ``nn.DenseGeneral``
(kernels transposed or renamed where the module stores them so), whose factors the dense-reference
tests check against explicit Kronecker products; float64. Calls that do more than the product are
listed with the reason.
"""

import functools
import math

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
from thor_optax.flax import value_and_grad_with_stats
import thor_optax.nnx

import reference
from reference import F64, float64_mode, randn, softmax_ce  # pylint: disable=unused-import

pytestmark = pytest.mark.usefixtures("fast_compiles")

N, T, D, K = 3, 4, 5, 3
DAMPING = 0.01


class Conv1D(nn.Module):
  """GPT-2's dense layer as Hugging Face writes it: kernel ``(features, d_in)``, cast and
  transposed, ``lax.dot_general``, the bias added after."""
  features: int
  use_bias: bool = True
  dtype: jnp.dtype = F64

  @nn.compact
  def __call__(self, inputs):
    inputs = jnp.asarray(inputs, self.dtype)
    kernel = self.param("kernel", nn.initializers.normal(0.2), (self.features, inputs.shape[-1]))
    kernel = jnp.asarray(kernel.transpose(), self.dtype)
    y = jax.lax.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())))
    if self.use_bias:
      y = y + jnp.asarray(self.param("bias", nn.initializers.zeros, (self.features,)), self.dtype)
    return y


class Projection(nn.Module):
  """A hand-written projection ``x @ kernel``, kernel ``(d_in, features)``, no bias."""
  features: int

  @nn.compact
  def __call__(self, x):
    return x @ self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))


def layer(features, name, kind, use_bias=True):
  """A ``Conv1D`` (``kind='conv1d'``), a :class:`Projection` (``'projection'``, no bias) or the
  ``nn.Dense`` they equal (``'dense'``)."""
  if kind == "conv1d":
    return Conv1D(features, use_bias=use_bias, name=name)
  if kind == "projection":
    return Projection(features, name=name)
  return nn.Dense(features, use_bias=use_bias, name=name, param_dtype=F64)


class Mixed(nn.Module):
  """Conv1D with and without bias (a square one), a projection, ``tanh`` between them."""
  kind: str = "conv1d"

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(layer(6, "c_fc", self.kind)(x))
    h = jnp.tanh(layer(6, "c_sq", self.kind)(h))
    h = jnp.tanh(layer(4, "proj", "projection" if self.kind != "dense" else "dense",
                       use_bias=False)(h))
    return layer(K, "head", self.kind, use_bias=False)(h)


class Block(nn.Module):
  """A residual MLP block, ``(carry, _) -> (carry, None)``."""
  kind: str

  @nn.compact
  def __call__(self, h, _):
    return h + layer(D, "c_proj", self.kind)(jnp.tanh(layer(8, "c_fc", self.kind)(h))), None


class Scanned(nn.Module):
  """``nn.scan(nn.remat(Block))`` over two layers, and a layer called twice (shared)."""
  kind: str = "conv1d"

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=2)
    h, _ = stack(self.kind, name="blocks")(x, None)
    shared = layer(D, "shared", self.kind)
    return layer(K, "head", self.kind)(jnp.tanh(shared(h)) + shared(jnp.flip(h, 1)))


class Cell(nn.RNNCellBase):
  """``c' = tanh(ih(x) + hh(c))`` with Conv1D or Dense layers."""
  kind: str

  @nn.compact
  def __call__(self, c, x):
    c = jnp.tanh(layer(4, "ih", self.kind)(x) + layer(4, "hh", self.kind)(c))
    return c, c

  def initialize_carry(self, rng, input_shape):
    return jnp.zeros(input_shape[:-1] + (4,), F64)

  @property
  def num_feature_axes(self):
    return 1


class Recurrent(nn.Module):
  """``nn.RNN`` over a cell of Conv1D layers (one weight at every time step)."""
  kind: str = "conv1d"

  @nn.compact
  def __call__(self, x):
    return layer(K, "head", self.kind)(nn.RNN(Cell(self.kind), name="rnn")(x))


def as_dense(tree):
  """A tree of the Conv1D models' leaves (parameters or updates) as the ``nn.Dense`` model's:
  every Conv1D kernel transposed (on its last two axes, after a stack's)."""
  def convert(path, leaf):
    names = [str(getattr(k, "key", k)) for k in path]
    return jnp.swapaxes(leaf, -1, -2) if names[-1] == "kernel" and names[-2] != "proj" else leaf
  return jax.tree_util.tree_map_with_path(convert, tree)


TRANSFORMS = reference.layout_transforms(DAMPING)
_assert_close = reference.assert_trees_close


def _update(model, params, x, y, make_tx, captured):
  return reference.captured_update(model, params, x, y, softmax_ce, make_tx, captured, jit=True)


def _batch(seed, shape=(N, T, D)):
  x = jnp.asarray(randn(seed, shape))
  y = jnp.asarray(np.random.default_rng(seed + 1).integers(0, K, shape[:-1]))
  return x, y


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_conv1d_and_projection_equal_the_dense_model(name):
  x, y = _batch(0)
  params = reference.init_params(Mixed(), x)
  got, grads, stats = _update(Mixed(), params, x, y, TRANSFORMS[name], captured=True)
  assert not stats.unhandled
  kinds = {k: type(v).__name__ for k, v in stats.layers.items()}
  assert kinds == {"c_fc": "MatmulStats", "c_sq": "MatmulStats", "proj": "DenseStats",
                   "head": "MatmulStats"}
  want, _, _ = _update(Mixed("dense"), as_dense(params), x, y, TRANSFORMS[name], captured=False)
  _assert_close(as_dense(got), want)
  assert float(jnp.abs(got["c_fc"]["kernel"] + grads["c_fc"]["kernel"]).max()) > 1e-2


class SimpleDense(nn.Module):
  """Flax's guide style with ``setup``: ``jnp.dot(x, self.w) + self.b``, leaves ``w``, ``b``."""
  in_features: int
  features: int

  def setup(self):
    self.w = self.param("w", nn.initializers.lecun_normal(), (self.in_features, self.features))
    self.b = self.param("b", nn.initializers.zeros, (self.features,))

  def __call__(self, x):
    return jnp.dot(x, self.w) + self.b


class Named(nn.Module):
  dense: bool = False

  @nn.compact
  def __call__(self, x):
    first = (nn.Dense(6, param_dtype=F64, name="first") if self.dense
             else SimpleDense(D, 6, name="first"))
    return nn.Dense(K, param_dtype=F64, name="head")(jnp.tanh(first(x)))


def test_weights_of_other_names_equal_the_dense_model():
  """Leaves ``w`` / ``b`` applied as stored: :class:`MatmulStats` naming them; the update
  equals ``nn.Dense``'s on the same values (``kernel`` / ``bias``)."""
  x, y = _batch(3)
  params = reference.init_params(Named(), x)
  got, _, stats = _update(Named(), params, x, y, TRANSFORMS["thor_b4"], captured=True)
  assert not stats.unhandled
  first = stats.layers["first"]
  assert (type(first).__name__, first.kernel_perm, first.weight, first.bias) == (
      "MatmulStats", (0, 1), "w", "b")
  renamed = {**params, "first": {"kernel": params["first"]["w"], "bias": params["first"]["b"]}}
  want, _, _ = _update(Named(True), renamed, x, y, TRANSFORMS["thor_b4"], captured=False)
  _assert_close({**got, "first": {"kernel": got["first"]["w"], "bias": got["first"]["b"]}},
                want)


@pytest.mark.parametrize("model", [Scanned, Recurrent])
def test_scanned_shared_and_recurrent_conv1d_equal_the_dense_model(model):
  """A scanned ``nn.remat`` stack (its own factors per layer), a layer called twice (its uses
  joined) and an ``nn.RNN`` cell (K-FAC-reduce over the time steps), with the ``thor`` and
  ``kfac`` aliases."""
  x, y = _batch(2)
  params = reference.init_params(model(), x)
  for make in (lambda layers: thor_optax.thor(0.1, 0.03, layers=layers),
               lambda layers: thor_optax.kfac(0.1, 0.03, layers=layers)):
    got, _, stats = _update(model(), params, x, y, make, captured=True)
    assert not stats.unhandled
    want, _, _ = _update(model("dense"), as_dense(params), x, y, make, captured=False)
    _assert_close(as_dense(got), want)


@pytest.mark.filterwarnings("error:gradient_stats. the gradients")  # no silent fallback
def test_plain_step_from_the_rows_equals_the_dense_model():
  """``gradient_stats=``: the transposed kernel's update in sample space, from the rows."""
  x, y = _batch(4, (N, 40))
  model = Mixed()
  params = reference.init_params(model, x)

  def run(model, params, captured):
    capture = value_and_grad_with_stats(model, softmax_ce)  # in the step's trace
    _, stats = jax.eval_shape(capture, params, x, y)
    tx = thor_optax.scale_by_thor(0.05, block_size=8,
                                  layers=thor_optax.captured_layers(stats) if captured else None)

    @jax.jit
    def steps(params):
      (_, grads), stats = capture(params, x, y)
      state = tx.update(grads, tx.init(params), params, curvature_stats=stats)[1]
      return (tx.update(grads, state, params)[0],
              tx.update(grads, state, params, gradient_stats=stats)[0])
    return steps(params)

  block, rows = run(model, params, True)
  _assert_close(rows, block, atol=1e-12)
  want_block, want_rows = run(Mixed("dense"), as_dense(params), False)
  _assert_close(as_dense(rows), want_rows, atol=1e-12)


@pytest.mark.parametrize("features", [D, 6])  # square kernel (taken for a Dense), and not
def test_transposed_kernel_without_the_captured_layout_says_what_to_do(features):
  class One(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Conv1D(K)(jnp.tanh(Conv1D(features)(x)))

  x, y = _batch(5)
  params = reference.init_params(One(), x)
  with pytest.raises(ValueError, match=r"layers=thor_optax.captured_layers\(stats\)"):
    _update(One(), params, x, y, TRANSFORMS["kfac"], captured=False)


class Scaled(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x @ (2.0 * self.param("kernel", nn.initializers.normal(), (x.shape[-1], D)))


class Activated(nn.Module):

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(x @ self.param("kernel", nn.initializers.normal(), (x.shape[-1], D)))


class Residual(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x + x @ self.param("kernel", nn.initializers.normal(), (x.shape[-1], D))


class Twice(nn.Module):

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.normal(), (x.shape[-1], D))
    return x @ kernel @ kernel


class BiasFirst(nn.Module):

  @nn.compact
  def __call__(self, x):
    bias = self.param("bias", nn.initializers.normal(), (D,))
    return (x + bias) @ self.param("kernel", nn.initializers.normal(), (D, D))


class BiasOverPositions(nn.Module):

  @nn.compact
  def __call__(self, x):  # (N, T, D) @ (D, T): a bias per position, not per feature
    kernel = self.param("kernel", nn.initializers.normal(), (x.shape[-1], T))
    return x @ kernel + self.param("bias", nn.initializers.normal(), (T,)).reshape(T, 1)


class OverPositions(nn.Module):

  @nn.compact
  def __call__(self, x):  # mixes the positions: (N, T, D) -> (N, D, D)
    return jnp.swapaxes(x, 1, 2) @ self.param("kernel", nn.initializers.normal(), (T, D))


class NeedsArgument(nn.Module):

  @nn.compact
  def __call__(self, x, scale):
    return scale * (x @ self.param("kernel", nn.initializers.normal(), (x.shape[-1], D)))


class TwoArrays(nn.Module):

  @nn.compact
  def __call__(self, x, mask):
    return (x * mask) @ self.param("kernel", nn.initializers.normal(), (x.shape[-1], D))


class Quantized(nn.Module):

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.normal(), (x.shape[-1], D))
    return x.astype(jnp.int8).astype(x.dtype) @ kernel


class DtypeBranch(nn.Module):

  @nn.compact
  def __call__(self, x):  # the traced call sees the input's own dtype (float64 here)
    kernel = self.param("kernel", nn.initializers.normal(), (x.shape[-1], D))
    return x @ (2.0 * kernel if x.dtype == jnp.float64 else kernel)


class Float8(nn.Module):

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.normal(), (x.shape[-1], D))
    return x @ kernel.astype(jnp.float8_e4m3fn).astype(x.dtype)


class TupleOutput(nn.Module):

  @nn.compact
  def __call__(self, x):
    return (x @ self.param("kernel", nn.initializers.normal(), (x.shape[-1], D)),)


class TupleInput(nn.Module):

  @nn.compact
  def __call__(self, xs):
    x, shift = xs
    return x @ self.param("kernel", nn.initializers.normal(), (x.shape[-1], D)) + shift


class ShapeBranch(nn.Module):

  @nn.compact
  def __call__(self, x):  # called on (N, T, D) and on (N, D): only the second is a product
    y = x @ self.param("kernel", nn.initializers.normal(), (x.shape[-1], D))
    return jnp.tanh(y) if x.ndim == 3 else y


NOT_A_PRODUCT = {Scaled: "applies mul to the weight", Activated: "applies tanh to the product",
                 Residual: "applies add to the input and product",
                 Twice: "applies dot_general to the product and weight",
                 BiasFirst: "applies add to the bias and input",
                 BiasOverPositions: "adds the bias along the input's positions",
                 OverPositions: "applies transpose to the input",
                 NeedsArgument: "applies mul to the product",
                 TwoArrays: "not on one array and Python constants",
                 DtypeBranch: "applies mul to the weight",
                 Float8: "casts the weight to float8_e4m3fn",
                 TupleOutput: "its output is not one array",
                 TupleInput: "a call of it is not on one array",
                 ShapeBranch: "applies tanh to the product",
                 Quantized: "casts the input to int8"}


def _listed(apply_layer, x, y, words):
  """``(params, grads, stats)`` of a model applying ``apply_layer(x)`` (which makes the module
  ``'layer'``), then a dense head; asserts that only the head is captured and that ``layer`` is
  listed with a reason containing ``words``."""

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      logits = nn.Dense(K, param_dtype=F64, name="head")(apply_layer(x).reshape(N, -1))
      return jnp.broadcast_to(logits[:, None], (N, T, K))

  params = reference.init_params(Model(), x)
  (_, grads), stats = reference.capture(Model(), softmax_ce)(params, x, y)
  assert set(stats.layers) == {"head"}
  (reason,) = [note for note in stats.unhandled if note.startswith("layer: ")]
  assert words in reason and "register_layer_kind" in reason, reason
  return params, grads, stats


@pytest.mark.parametrize("cls", list(NOT_A_PRODUCT), ids=lambda c: c.__name__)
def test_a_call_that_is_more_than_the_product_is_listed(cls):
  def apply_layer(x):
    layer = cls(name="layer")
    if cls is NeedsArgument:
      return layer(x, 0.5)  # traced with the constant: a scale of the product
    if cls is TwoArrays:
      return layer(x, jnp.ones_like(x))
    if cls is TupleOutput:
      return layer(x)[0]
    if cls is TupleInput:
      return layer((x, 1.0))
    if cls is ShapeBranch:
      return layer(x) + layer(x.mean(1))[:, None]
    return layer(x)

  params, grads, stats = _listed(apply_layer, *_batch(6), NOT_A_PRODUCT[cls])
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  with pytest.warns(UserWarning, match="layer: "):
    updates = tx.update(grads, tx.init(params), params, curvature_stats=stats)[0]
  _assert_close(updates["layer"], grads["layer"], atol=0)  # passes through


def test_conv1d_keys_of_attention_are_expanded_under_a_per_example_loss():
  """A classifier whose hand-written attention has Conv1D query, key and value: ``'auto'``
  folds the positions of every layer but the key (K-FAC-reduce: one row per example), and
  the key's reduced cotangents would be zero."""

  class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
      q, k, v = (Conv1D(4, name=n)(x) for n in ("query", "key", "value"))
      weights = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 2.0)
      h = Conv1D(D, name="out")(jnp.einsum("bqk,bkd->bqd", weights, v))
      return Conv1D(K, name="head")(h.mean(1))

  x = jnp.asarray(randn(7, (N, T, D)))
  y = jnp.asarray(np.arange(N) % K)
  params = reference.init_params(Classifier(), x)
  (_, _), stats = reference.capture(Classifier(), softmax_ce)(params, x, y)
  rows = {k: v.inputs.shape[:-1] for k, v in stats.layers.items()}
  assert rows == {"query": (N,), "value": (N,), "out": (N,), "head": (N,), "key": (N, T)}
  reduced = stats.layers["key"].cotangents.sum(axis=2)
  assert float(jnp.abs(reduced).max()) < 1e-14 * float(jnp.abs(stats.layers["key"].cotangents)
                                                        .max())


class NnxLinear(nnx.Module):
  """The ``Linear`` of Flax NNX's guides: ``x @ self.w + self.b``."""

  def __init__(self, d_in, d_out, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), F64) / np.sqrt(d_in))
    self.b = nnx.Param(jnp.full((d_out,), 0.1, F64))

  def __call__(self, x):
    return x @ self.w + self.b


class NnxConv1D(nnx.Module):
  """A kernel stored ``(d_out, d_in)``, applied transposed, no bias."""

  def __init__(self, d_in, d_out, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (d_out, d_in), F64) * 0.3)

  def __call__(self, x):
    return x @ self.kernel[...].T


class NnxScaled(NnxConv1D):

  def __call__(self, x):
    return 2.0 * (x @ self.kernel[...].T)


class NnxModel(nnx.Module):
  """``NnxLinear`` (4 -> 6), ``NnxConv1D`` (6 -> 5) or their ``nnx.Linear`` forms, a head."""

  def __init__(self, rngs, form="own"):
    def linear(*args, **kwargs):
      return nnx.Linear(*args, param_dtype=F64, **kwargs)

    self.a = NnxLinear(D - 1, 6, rngs) if form != "linear" else linear(D - 1, 6, rngs=rngs)
    self.t = ({"own": NnxConv1D, "scaled": NnxScaled}[form](6, D, rngs) if form != "linear"
              else linear(6, D, use_bias=False, rngs=rngs))
    self.head = linear(D, K, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.t(jnp.tanh(self.a(x)))))


def _nnx_update(model, x, y):
  (_, grads), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(model, x, y)
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None,
                                layers=thor_optax.captured_layers(stats))
  params = nnx.state(model, nnx.Param)
  updates, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats)
  return nnx.to_pure_dict(nnx.State(updates)), stats


def test_nnx_modules_equal_the_nnx_linear_model():
  """NNX modules of no Flax class (the guides' ``Linear``, a transposed kernel) are captured
  like their ``nnx.Linear`` forms; one whose call scales the product is listed."""
  x = jnp.asarray(randn(8, (N, D - 1)))
  y = jnp.arange(N) % K
  model = NnxModel(nnx.Rngs(0))
  got, stats = _nnx_update(model, x, y)
  assert not stats.unhandled
  assert {k: type(v).__name__ for k, v in stats.layers.items()} == {
      "a": "MatmulStats", "t": "MatmulStats", "head": "DenseStats"}
  own = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  reference_model = NnxModel(nnx.Rngs(1), form="linear")
  nnx.update(reference_model, nnx.State({
      "a": {"kernel": own["a"]["w"], "bias": own["a"]["b"]},
      "t": {"kernel": own["t"]["kernel"].T}, "head": own["head"]}))
  want, _ = _nnx_update(reference_model, x, y)
  _assert_close({"a": {"b": got["a"]["b"], "w": got["a"]["w"]}, "head": got["head"],
                 "t": {"kernel": got["t"]["kernel"].T}},
                {"a": {"b": want["a"]["bias"], "w": want["a"]["kernel"]}, "head": want["head"],
                 "t": {"kernel": want["t"]["kernel"]}})
  scaled = NnxModel(nnx.Rngs(0), form="scaled")
  (_, _), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(scaled, x, y)
  assert set(stats.layers) == {"a", "head"}
  assert any(n.startswith("t: ") and "applies mul to the product" in n for n in stats.unhandled)


class NnxBase(NnxLinear):
  pass


class NnxSuper(NnxLinear):

  def __call__(self, x):
    return super().__call__(x)


def test_nnx_subclass_calling_super_is_handled_once():
  """Two matched classes sharing a base whose ``__call__`` one of them calls through
  ``super()``: both methods are patched, and the call is handled once (before: its
  perturbation was added twice, so its cotangents were twice the true ones)."""

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.a, self.c = NnxBase(D - 1, 6, rngs), NnxSuper(6, 6, rngs)
      self.head = nnx.Linear(6, K, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
      return self.head(jnp.tanh(self.c(jnp.tanh(self.a(x)))))

  x = jnp.asarray(randn(9, (N, D - 1)))
  y = jnp.arange(N) % K
  (_, grads), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(
      Model(nnx.Rngs(0)), x, y)
  for name in ("a", "c"):
    layer = stats.layers[name]
    rows = layer.inputs.T @ layer.cotangents[0] / N  # the empirical Fisher's gradient
    np.testing.assert_allclose(rows, grads[name]["w"][...], rtol=0, atol=1e-14)


# ------------------------------------------------------------ weights of rank 3 and more

H, HD = 2, 3


class OwnEinsum(nn.Module):
  """Gemma's projection as Flax's example writes it (there in NNX): the equation an attribute,
  ``jnp.einsum(self.einsum_str, x, w)``, the weight ``w``."""
  einsum_str: str
  shape: tuple

  @nn.compact
  def __call__(self, x):
    return jnp.einsum(self.einsum_str, x, self.param("w", nn.initializers.normal(0.3),
                                                     self.shape, F64))


class CallTimeEinsum(nn.Module):
  """Gemma's linen ``Einsum``: the equation given at call time, first, ``Einsum(eqn, x)``."""
  shape: tuple

  @nn.compact
  def __call__(self, eqn, x):
    return jnp.einsum(eqn, x, self.param("w", nn.initializers.normal(0.3), self.shape, F64))


class Projections(nn.Module):
  """Gemma's fused ``'BTD,SNDH->SBTNH'`` (the weight's ``S`` before the positions in the
  output: a transpose after the product), its output ``'BTNH,NHD->BTD'`` (two contracted
  axes) and its query ``'BTD,NDH->BTNH'`` (the contracted axis in the weight's middle), as
  :class:`OwnEinsum` (``form='own'``), :class:`CallTimeEinsum` (``'call_time'``) or
  ``nn.Einsum`` (``'flax'``)."""
  form: str = "own"

  @nn.compact
  def __call__(self, x):
    def einsum(equation, shape, name):
      if self.form == "own":
        return OwnEinsum(equation, shape, name=name)
      if self.form == "call_time":
        return functools.partial(CallTimeEinsum(shape, name=name), equation)
      return nn.Einsum(shape, equation, use_bias=False, param_dtype=F64, name=name)

    q, k, v = einsum("BTD,SNDH->SBTNH", (3, H, D, HD), "qkv")(x)
    h = einsum("BTNH,NHD->BTD", (H, HD, D), "attn_vec")(jnp.tanh(q) * k + v)
    h = einsum("BTD,NDH->BTNH", (H, D, HD), "q")(jnp.tanh(h))
    return nn.Dense(K, param_dtype=F64, name="head")(jnp.tanh(h).reshape(h.shape[:2] + (-1,)))


def _renamed(tree, old, new):
  """Every module's leaf ``old`` renamed ``new``."""
  return {k: {new if n == old else n: v for n, v in leaves.items()} for k, leaves in tree.items()}


@pytest.mark.parametrize("form", ["own", "call_time"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_einsum_modules_of_their_own_equal_nn_einsum(name, form):
  """Gemma's einsums, written as its own module with the weight ``w`` (the equation an
  attribute, as in Flax's example, or given first at call time, as in Gemma's linen code), are
  preconditioned as ``nn.Einsum`` (the ``'einsum'`` kind, itself checked against the reshaped
  dense model) with the same values: :class:`MatmulStats` laid out by the weight's axes."""
  x, y = _batch(20)
  params = reference.init_params(Projections(form), x)
  got, grads, stats = _update(Projections(form), params, x, y, TRANSFORMS[name],
                              captured=True)
  assert not stats.unhandled
  assert {k: (type(v).__name__, v.kernel_perm, v.in_axes) for k, v in stats.layers.items()
          if k != "head"} == {"qkv": ("MatmulStats", (2, 0, 1, 3), 1),
                              "attn_vec": ("MatmulStats", (0, 1, 2), 2),
                              "q": ("MatmulStats", (1, 0, 2), 1)}
  want, _, _ = _update(Projections("flax"), _renamed(params, "w", "kernel"), x, y,
                       TRANSFORMS[name], captured=True)
  _assert_close(_renamed(got, "w", "kernel"), want)
  assert float(jnp.abs(got["qkv"]["w"] + grads["qkv"]["w"]).max()) > 1e-2


class OwnDenseGeneral(nn.Module):
  """A ``DenseGeneral`` of its own contracting the input's last axes by ``lax.dot_general``, in
  MaxText's style (a kernel ``in_shape + features``, a bias ``features``) or, ``flat=True``,
  flaxformer's (T5X's): the kernel stored ``(prod(in_shape), prod(features))`` and the bias
  ``(prod(features),)``, each reshaped before the product."""
  features: tuple
  axis: tuple = (-1,)
  flat: bool = False

  @nn.compact
  def __call__(self, x):
    axis = tuple(a % x.ndim for a in self.axis)
    in_shape = tuple(x.shape[a] for a in axis)
    shape = in_shape + self.features
    stored = (math.prod(in_shape), math.prod(self.features)) if self.flat else shape
    kernel = self.param("kernel", nn.initializers.normal(0.3), stored, F64).reshape(shape)
    y = jax.lax.dot_general(x, kernel, ((axis, tuple(range(len(axis)))), ((), ())))
    bias = self.param("bias", nn.initializers.normal(0.1),
                      (math.prod(self.features),) if self.flat else self.features, F64)
    return y + bias.reshape(self.features)


class Heads(nn.Module):
  """A query ``(D,) -> (H, HD)`` and an output ``(H, HD) -> (D,)`` projection with biases, as
  :class:`OwnDenseGeneral` (``form='own'``, the same leaves as ``nn.DenseGeneral``; ``'flat'``:
  stored flat) or ``nn.DenseGeneral`` (``'flax'``)."""
  form: str = "own"

  @nn.compact
  def __call__(self, x):
    def dense(features, axis, name):
      if self.form != "flax":
        return OwnDenseGeneral(features, axis, flat=self.form == "flat", name=name)
      return nn.DenseGeneral(features, axis, param_dtype=F64, name=name,
                             kernel_init=nn.initializers.normal(0.3))

    h = jnp.tanh(dense((H, HD), (-1,), "query")(x))
    h = jnp.tanh(dense((D,), (-2, -1), "out")(h))
    return nn.Dense(K, param_dtype=F64, name="head")(h)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_dense_general_of_its_own_equals_nn_dense_general(name):
  """A rank-3 kernel with a rank-2 bias, and one contracting two axes: the same update as
  ``nn.DenseGeneral`` on the same leaves, also without the captured layout (laid out from
  shapes as a ``DenseGeneral``, the same matrix: ``check_step.as_captured``)."""
  x, y = _batch(21)
  params = reference.init_params(Heads(), x)
  got, _, stats = _update(Heads(), params, x, y, TRANSFORMS[name], captured=True)
  assert not stats.unhandled
  assert (stats.layers["query"].bias_perm, stats.layers["out"].in_axes) == ((0, 1), 2)
  want, _, _ = _update(Heads("flax"), params, x, y, TRANSFORMS[name], captured=True)
  _assert_close(got, want)
  from_shapes, _, _ = _update(Heads(), params, x, y, TRANSFORMS[name], captured=False)
  _assert_close(from_shapes, want)


def _as_dense_general(tree):
  """The flat leaves of ``Heads('flat')`` as ``nn.DenseGeneral``'s."""
  return {**tree, "query": {"kernel": tree["query"]["kernel"].reshape(D, H, HD),
                            "bias": tree["query"]["bias"].reshape(H, HD)},
          "out": {"kernel": tree["out"]["kernel"].reshape(H, HD, D), "bias": tree["out"]["bias"]}}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_flat_kernels_reshaped_in_the_call_equal_nn_dense_general(name):
  """Kernels and biases stored flat and split by a reshape in the call (flaxformer): the flat
  kernel is the layer's matrix; the same update as ``nn.DenseGeneral``, also from shapes alone
  (before: listed, "applies reshape to the weight")."""
  x, y = _batch(26)
  params = reference.init_params(Heads("flat"), x)
  got, _, stats = _update(Heads("flat"), params, x, y, TRANSFORMS[name], captured=True)
  assert not stats.unhandled
  assert stats.layers["out"].inputs.shape[-1] == H * HD  # the input's two contracted axes
  want, _, _ = _update(Heads("flax"), _as_dense_general(params), x, y, TRANSFORMS[name],
                       captured=True)
  _assert_close(_as_dense_general(got), want)
  from_shapes, _, _ = _update(Heads("flat"), params, x, y, TRANSFORMS[name], captured=False)
  _assert_close(_as_dense_general(from_shapes), want)



class SplitProduct(nn.Module):
  """A projection to ``heads`` heads written ``(x @ w).reshape(..., heads, HD)``, ``w``
  ``(D, heads * HD)`` (``flax=True``: ``nn.DenseGeneral((heads, HD))``), then a head."""
  heads: int
  flax: bool = False

  @nn.compact
  def __call__(self, x):
    if self.flax:
      h = nn.DenseGeneral((self.heads, HD), use_bias=False, param_dtype=F64, name="proj")(x)
    else:
      h = SplitProjection(self.heads, name="proj")(x)
    return nn.Dense(K, param_dtype=F64, name="head")(jnp.tanh(h).reshape(x.shape[:-1] + (-1,)))


class SplitProjection(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.3), (x.shape[-1], self.heads * HD), F64)
    return (x @ w).reshape(x.shape[:-1] + (self.heads, HD))


@pytest.mark.parametrize("heads", [H, 1])
def test_product_split_into_heads_equals_nn_dense_general(heads):
  """The product reshaped into heads (one head too: an axis of size 1), and a batch of one
  example: the same update as ``nn.DenseGeneral`` (before: listed)."""
  for n in (N, 1):
    x, y = _batch(27, (n, T, D))
    params = reference.init_params(SplitProduct(heads), x)
    got, _, stats = _update(SplitProduct(heads), params, x, y, TRANSFORMS["kfac"], captured=True)
    assert not stats.unhandled
    as_flax = {**params, "proj": {"kernel": params["proj"]["w"].reshape(D, heads, HD)}}
    want, _, _ = _update(SplitProduct(heads, True), as_flax, x, y, TRANSFORMS["kfac"],
                         captured=True)
    _assert_close({**got, "proj": {"kernel": got["proj"]["w"].reshape(D, heads, HD)}}, want)

class PerHead(nn.Module):  # a kernel per head: the heads are batch axes of the product
  @nn.compact
  def __call__(self, x):
    return jnp.einsum("BTNH,NHK->BTNK", x, self.param("w", nn.initializers.normal(),
                                                       (H, HD, D), F64))


class HeadBias(nn.Module):  # one bias for every head: shared over the feature axis N
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (x.shape[-1], H, HD), F64)
    return jnp.einsum("BTND,DMH->BTNMH", x, w) + self.param("b", nn.initializers.normal(),
                                                           (HD,), F64)


class OverTime(nn.Module):  # contracts the positions, not the features
  @nn.compact
  def __call__(self, x):
    return jnp.einsum("BTNH,TK->BNHK", x, self.param("w", nn.initializers.normal(), (T, D),
                                                      F64))


class Shifted(nn.Module):  # a constant added to the product (before: a TypeError)
  @nn.compact
  def __call__(self, x):
    return jnp.einsum("BTNH,HK->BTNK", x, self.param("w", nn.initializers.normal(),
                                                      (HD, D), F64)) + 1.0


class BiasTransposedByReshape(nn.Module):  # lax.reshape with dimensions transposes the bias
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (x.shape[-1], HD, HD), F64)
    b = self.param("b", nn.initializers.normal(), (HD, HD), F64)
    return jnp.einsum("BTNE,EGH->BTNGH", x, w) + jax.lax.reshape(b, (HD, HD), (1, 0))


class Sliced(nn.Module):  # a rank-3 table of which one slice is applied
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (2, x.shape[-1], HD), F64)
    return jnp.einsum("BTNH,HK->BTNK", x, w[0])


NOT_AN_EINSUM_PRODUCT = {PerHead: "contracts the input's axes (3,) over batch axes",
                         HeadBias: "adds a bias broadcast over some of the output features",
                         OverTime: "contracts the input's axes (1,), not its last ones",
                         Sliced: "applies slice to the weight",
                         Shifted: "applies add to the product",
                         BiasTransposedByReshape: "lays the bias (3, 3) out as (3, 3)"}


@pytest.mark.parametrize("cls", list(NOT_AN_EINSUM_PRODUCT), ids=lambda c: c.__name__)
def test_an_einsum_that_is_not_a_product_per_position_is_listed(cls):
  x = jnp.asarray(randn(22, (N, T, H, HD)))
  y = jnp.asarray(np.random.default_rng(23).integers(0, K, (N, T)))
  _listed(lambda x: cls(name="layer")(x), x, y, NOT_AN_EINSUM_PRODUCT[cls])


class NnxEinsum(nnx.Module):
  """``layers.Einsum`` of Flax's Gemma example: the equation an attribute, the weight ``w``."""

  def __init__(self, einsum_str, shape, rngs):
    self.einsum_str = einsum_str
    self.w = nnx.Param(jax.random.normal(rngs.params(), shape, F64) * 0.3)

  def __call__(self, x):
    return jnp.einsum(self.einsum_str, x, self.w[...])


class NnxProjections(nnx.Module):
  """Gemma's fused query-key-value and output einsums, as :class:`NnxEinsum` or
  ``nnx.Einsum``."""

  def __init__(self, rngs, own=True):
    def einsum(equation, shape):
      if own:
        return NnxEinsum(equation, shape, rngs)
      return nnx.Einsum(equation, shape, param_dtype=F64, rngs=rngs)

    self.qkv = einsum("BTD,SNDH->SBTNH", (3, H, D, HD))
    self.attn_vec = einsum("BTNH,NHD->BTD", (H, HD, D))
    self.head = nnx.Linear(D, K, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    q, k, v = self.qkv(x)
    return self.head(jnp.tanh(self.attn_vec(jnp.tanh(q) * k + v)))


def test_nnx_einsum_modules_of_their_own_equal_nnx_einsum():
  """Flax's Gemma example's ``Einsum`` module, as it writes it, is preconditioned as
  ``nnx.Einsum`` with the same values."""
  x, y = _batch(24)
  model = NnxProjections(nnx.Rngs(0))
  got, stats = _nnx_update(model, x, y)
  assert not stats.unhandled
  assert {k: type(v).__name__ for k, v in stats.layers.items()} == {
      "qkv": "MatmulStats", "attn_vec": "MatmulStats", "head": "DenseStats"}
  own = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  reference_model = NnxProjections(nnx.Rngs(1), own=False)
  nnx.update(reference_model, nnx.State(_renamed(own, "w", "kernel")))
  want, _ = _nnx_update(reference_model, x, y)
  _assert_close(_renamed(got, "w", "kernel"), want)


class NnxStack(nnx.Module):
  """Flax's "scan over layers": a stack of residual blocks made by ``nnx.vmap``, run by
  ``nnx.scan``; each block's layer :class:`NnxLinear` (its weight ``(2, D, D)`` in the stack)
  or ``nnx.Linear``."""

  def __init__(self, rngs, own=True):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxLinear(D, D, rngs) if own else nnx.Linear(D, D, param_dtype=F64, rngs=rngs)

    self.blocks = make(rngs)
    self.head = nnx.Linear(D, K, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(h, layer):
      return h + jnp.tanh(layer(h))

    return self.head(forward(x, self.blocks))


def test_nnx_vmap_stack_of_modules_of_their_own_equals_the_nnx_linear_stack():
  """A stack of hand-written layers made by ``nnx.vmap`` (before: not matched, its rank-3
  weight listed) is preconditioned layer by layer as the ``nnx.Linear`` stack."""
  x, y = _batch(25)
  model = NnxStack(nnx.Rngs(0))
  got, stats = _nnx_update(model, x, y)
  assert not stats.unhandled
  assert stats.layers["blocks"].inputs.shape[0] == 2  # a statistic per layer of the stack
  own = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  reference_model = NnxStack(nnx.Rngs(1), own=False)
  nnx.update(reference_model, nnx.State({
      "blocks": {"kernel": own["blocks"]["w"], "bias": own["blocks"]["b"]},
      "head": own["head"]}))
  want, _ = _nnx_update(reference_model, x, y)
  _assert_close({"blocks": {"kernel": got["blocks"]["w"], "bias": got["blocks"]["b"]},
                 "head": got["head"]}, want)
