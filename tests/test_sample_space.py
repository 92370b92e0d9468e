"""Plain steps preconditioned in sample space: ``update(..., gradient_stats=stats)``.

A dense layer's gradient is ``a^T g / M``, so ``A^-1 X G^-1 = (a A^-1)^T (g G^-1) / M`` needs no
product with the ``(d_A, d_G)`` gradient matrix. In float64 the update from the rows equals the
update from the gradient (block products on ``X``, checked against dense references in
``test_exactness.py``) to 1e-12: on an MLP whose layers take each side combination (both factors
on the rows, one, none), on attention, an einsum and a language-model head (``DenseGeneral``, a
loss per position), on a scanned stack, with a summed loss, and with micro-batch statistics
joined by ``concatenate_stats``. Layers whose statistics are not the gradient's rows (K-FAC-reduce over
positions, a sampled Fisher) and methods that do not apply the factors one by one (``'eigh'``)
fall back to the block products. A check step given the rows too refreshes as without them and
preconditions from the rows. Compiled, the step does not compute the kernel gradients its
update does not read (FLOPs from XLA's cost analysis), and the aliases' guard still skips a step
whose rows are not finite. Under ``jax.pmap`` see ``test_pmap.py``.
"""

import dataclasses

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
from thor_optax._src import blocks
from thor_optax._src import sample_space
from thor_optax.flax import TrainState, value_and_grad_with_stats
from thor_optax.nnx import value_and_grad_with_stats as nnx_value_and_grad_with_stats
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)
from reference import F64, init_params, kronecker_state, randn, softmax_ce

# A plain step that silently fell back to the gradient form would pass these comparisons
# trivially: the warning that says so fails the test.
pytestmark = [pytest.mark.usefixtures("fast_compiles"),
              pytest.mark.filterwarnings("error:gradient_stats. the gradients")]

N = 16  # rows of the MLP's layers
TOL = 1e-12


class MLP(nn.Module):
  """Rows ``R = 16``: ``Dense_0`` (151 x 300) and ``Dense_1`` (300 x 200, no bias) take both
  factors on the rows, ``Dense_2`` (201 x 10) only ``G``, ``Dense_3`` (5 x 10) neither."""

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=F64, param_dtype=F64)
    h = nn.relu(nn.Dense(300, **kw)(x))
    h = nn.relu(nn.Dense(200, use_bias=False, **kw)(h))
    return nn.Dense(10, **kw)(h) + nn.Dense(10, **kw)(x[:, :4])


def _mlp_setup():
  model = MLP()
  x = jnp.asarray(randn(0, (N, 150)))
  y = jnp.asarray(np.arange(N) % 10)
  return model, init_params(model, x), x, y


def _refreshed(tx, capture, params, x, y):
  """The optimizer state after one check step on ``(x, y)``."""
  def step(params, state, x, y):
    (_, grads), stats = capture(params, x, y)
    return tx.update(grads, state, params, curvature_stats=stats)[1]
  return jax.jit(step)(params, tx.init(params), x, y)


def _plain_step(tx, capture):
  """A jitted plain step ``(params, state, x, y, with_rows) -> (updates, state, grads)``:
  capture and update in one trace, as a training loop runs them (the rows stand only for the
  gradient the capture returned in the same trace)."""
  def step(params, state, x, y, with_rows):
    (_, grads), stats = capture(params, x, y)
    kw = {"gradient_stats": stats} if with_rows else {}
    return tx.update(grads, state, params, **kw) + (grads,)
  return jax.jit(step, static_argnums=4)


def _both_forms(tx, state, capture, params, x, y):
  """``(from the gradient, from the rows, gradient)`` of a plain step after ``state``."""
  step = _plain_step(tx, capture)
  block, _, grads = step(params, state, x, y, False)
  rows, _, _ = step(params, state, x, y, True)
  return block, rows, grads


def _relative(a, b):
  """Largest difference per layer relative to the layer's largest entry (a layer's leaves
  together: an attention key's bias gets a zero gradient, its update is rounding)."""
  diff, scale = {}, {}
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    layer = jax.tree_util.keystr(path[:-1])
    diff[layer] = max(diff.get(layer, 0.0), float(np.max(np.abs(np.asarray(x) - np.asarray(y)))))
    scale[layer] = max(scale.get(layer, 0.0), float(np.max(np.abs(np.asarray(x)))))
  return max(diff[k] / scale[k] for k in diff)


def _assert_same_update(block, rows, grads):
  assert jax.tree.structure(block) == jax.tree.structure(rows)
  assert _relative(block, rows) < TOL
  assert _relative(block, grads) > 0.1  # the curvature did change the gradient


def test_mlp_rows_give_the_block_products_update_on_each_side_combination():
  model, params, x, y = _mlp_setup()
  capture = value_and_grad_with_stats(model, softmax_ce)
  tx = thor_optax.scale_by_thor(0.05, block_size=64)
  state = _refreshed(tx, capture, params, x, y)
  x2 = jnp.asarray(randn(1, (N, 150)))  # the plain step's batch is another one
  block, rows, grads = _both_forms(tx, state, capture, params, x2, y)
  _assert_same_update(block, rows, grads)
  _, stats = jax.eval_shape(capture, params, x2, y)
  assert stats.exact_rows == ("Dense_0", "Dense_1", "Dense_2", "Dense_3")
  assert stats.num_loss_terms == N
  specs = {spec.name: spec for spec in blocks.build_layout(params, 64).layers}
  want = {"Dense_0": (True, True), "Dense_1": (True, True), "Dense_2": (False, True),
          "Dense_3": (False, False)}
  assert {name: tuple(sample_space.sides(specs[name], N)) for name in want} == want


class Attention(nn.Module):
  """Embedding, self-attention (``DenseGeneral`` projections), a dense block, an ``nn.Einsum``
  and a head;
  ``per_position``: logits ``(N, T, V)`` (a language model), else pooled ``(N, V)``."""

  per_position: bool = True

  @nn.compact
  def __call__(self, ids):
    kw = dict(dtype=F64, param_dtype=F64)
    h = nn.Embed(12, 16, **kw)(ids)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, **kw)(h)
    h = h + nn.Dense(16, **kw)(nn.gelu(nn.Dense(40, **kw)(h)))
    h = h + nn.Einsum((16, 2, 8), "btd,dnh->btnh", name="einsum", **kw)(h).reshape(h.shape)
    if not self.per_position:
      h = h.mean(axis=1)
    return nn.Dense(12, name="head", **kw)(h)


def _attention_setup(per_position):
  model = Attention(per_position)
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 12, (2, 5)))
  targets = jnp.roll(ids, -1, axis=1) if per_position else ids[:, 0]
  return model, init_params(model, ids), ids, targets


def test_attention_and_a_language_model_head_with_a_loss_per_position():
  model, params, ids, targets = _attention_setup(per_position=True)
  capture = value_and_grad_with_stats(model, softmax_ce)
  _, stats = jax.eval_shape(capture, params, ids, targets)
  layers = thor_optax.captured_layers(stats)
  tx = thor_optax.scale_by_thor(0.05, block_size=8, layers=layers)
  state = _refreshed(tx, capture, params, ids, targets)
  block, rows, grads = _both_forms(tx, state, capture, params, ids[::-1], targets[::-1])
  _assert_same_update(block, rows, grads)
  assert stats.num_loss_terms == 10  # N T: every position is a row (K-FAC-expand)
  projections = {f"MultiHeadDotProductAttention_0/{p}" for p in ("query", "key", "value", "out")}
  assert projections | {"Dense_0", "Dense_1", "einsum", "head"} == set(stats.exact_rows)


def test_reduced_positions_and_sampled_fisher_fall_back_to_the_gradient():
  model, params, ids, labels = _attention_setup(per_position=False)
  capture = value_and_grad_with_stats(model, softmax_ce)  # 'auto': reduce
  _, stats = jax.eval_shape(capture, params, ids, labels)
  # After pooling, one row per example; the attention key is expanded under 'auto' (its
  # reduced cotangents vanish), so its rows stay exact.
  assert stats.exact_rows == ("MultiHeadDotProductAttention_0/key", "head")
  tx = thor_optax.scale_by_thor(0.05, block_size=8, layers=thor_optax.captured_layers(stats))
  state = _refreshed(tx, capture, params, ids, labels)
  block, rows, grads = _both_forms(tx, state, capture, params, ids[::-1], labels[::-1])
  _assert_same_update(block, rows, grads)
  sampled = value_and_grad_with_stats(model, softmax_ce, fisher_type="sampled",
                                      likelihood="softmax_cross_entropy")
  _, stats = jax.eval_shape(lambda: sampled(params, ids, labels, rng=jax.random.PRNGKey(0)))
  assert stats.exact_rows == ()


class OnePosition(nn.Module):
  """A loss per position over ``(N, 4, 6)``, with a ``Dense`` on the first position alone,
  ``(N, 1, 6)``, broadcast back over the positions; and a ``Dense(dot_general=...)`` that
  scales its kernel (an equalized learning rate)."""

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=F64, param_dtype=F64)
    first = nn.Dense(6, name="first", **kw)(x[:, :1])
    scaled = nn.Dense(6, name="scaled", dot_general=lambda a, w, *args, **kwargs:
                      jax.lax.dot_general(a, 2.0 * w, *args, **kwargs), **kw)(x)
    return nn.Dense(3, name="head", **kw)(jnp.tanh(first + scaled))


def test_one_position_under_reduce_and_a_custom_dot_general():
  """With ``weight_sharing='reduce'`` a layer with one position has nothing to pool: its rows
  are the gradient's and its update from them is the gradient's (before: the reduce's scale
  ``sqrt(N / M)`` on exact rows, an update half the gradient form's). A ``Dense`` given its own
  ``dot_general`` applies ``2 W``, not its parameter: listed (before: exact rows, half)."""
  model = OnePosition()
  x = jnp.asarray(randn(3, (N, 4, 6)))
  y = jnp.asarray(np.arange(4 * N).reshape(N, 4) % 3)
  params = init_params(model, x)
  capture = value_and_grad_with_stats(model, softmax_ce, weight_sharing="reduce")
  _, stats = jax.eval_shape(capture, params, x, y)
  assert stats.exact_rows == ("first",)  # the head pools its four positions
  assert [n.split(":")[0] for n in stats.unhandled] == ["scaled"]
  assert "Dense is given its own dot_general" in stats.unhandled[0]
  tx = thor_optax.scale_by_thor(0.05, block_size=8, layers=thor_optax.captured_layers(stats))
  with pytest.warns(UserWarning, match="scaled"):
    state = _refreshed(tx, capture, params, x, y)
    block, rows, grads = _both_forms(tx, state, capture, params, x[::-1], y[::-1])
  _assert_same_update(block, rows, grads)
  module = nnx.Linear(3, 2, dot_general=lambda a, w, *args, **kwargs: jax.lax.dot_general(
      a, 2.0 * w, *args, **kwargs), rngs=nnx.Rngs(0))
  (_, _), stats = nnx_value_and_grad_with_stats(lambda out, t: jnp.mean((out - t) ** 2))(
      module, jnp.ones((4, 3)), jnp.zeros((4, 2)))
  assert not stats.layers and "Linear is given its own dot_general" in stats.unhandled[0]


class Scanned(nn.Module):
  """Three residual dense blocks under ``nn.scan`` over ``nn.remat``, then a head."""

  @nn.compact
  def __call__(self, x):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, h, _):
        return h + nn.tanh(nn.Dense(24, dtype=F64, param_dtype=F64)(h)), None

    stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                    length=3)
    h, _ = stack(name="blocks")(x, None)
    return nn.Dense(5, dtype=F64, param_dtype=F64)(h)


def test_scanned_stack_and_summed_loss():
  model = Scanned()
  x = jnp.asarray(randn(4, (6, 24)))
  y = jnp.asarray(np.arange(6) % 5)
  params = init_params(model, x)
  summed = lambda out, t: softmax_ce(out, t) * out.shape[0]  # noqa: E731
  for loss_fn, kw, terms in ((softmax_ce, {}, 6), (summed, dict(loss_reduction="sum"), 1)):
    capture = value_and_grad_with_stats(model, loss_fn, **kw)
    tx = thor_optax.scale_by_thor(0.05, block_size=16)
    state = _refreshed(tx, capture, params, x, y)
    block, rows, grads = _both_forms(tx, state, capture, params, x[::-1] * 1.5, y)
    _assert_same_update(block, rows, grads)
    _, stats = jax.eval_shape(capture, params, x, y)
    assert stats.num_loss_terms == terms
    assert "blocks/Dense_0" in stats.exact_rows


def test_check_step_from_the_rows():
  """``curvature_stats=stats, gradient_stats=stats`` on a check step: the refresh is the same
  (state equal to 1e-12) and so is the update, preconditioned from the rows with the freshly
  refreshed inverses; compiled, it keeps no kernel-gradient GEMM of the layers taken from
  their rows (XLA's FLOP count drops by at least half of those GEMMs)."""
  model, params, x, y = _mlp_setup()
  capture = value_and_grad_with_stats(model, softmax_ce)
  for tx in (thor_optax.scale_by_thor(0.05, block_size=64), thor_optax.thor(0.1, 0.05)):
    state = _refreshed(tx, capture, params, x, y)

    def step(params, state, with_rows, tx=tx):
      (_, grads), stats = capture(params, x * 2, y)
      kw = {"gradient_stats": stats} if with_rows else {}
      return tx.update(grads, state, params, curvature_stats=stats, **kw)

    compiled = [jax.jit(step, static_argnums=2).lower(params, state, with_rows).compile()
                for with_rows in (False, True)]
    (block, block_state), (rows, rows_state) = (c(params, state) for c in compiled)
    (_, grads), _ = capture(params, x * 2, y)
    _assert_same_update(block, rows, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        np.asarray(a, F64), np.asarray(b, F64), rtol=TOL, atol=TOL),
        kronecker_state(rows_state), kronecker_state(block_state))
    flops = [c.cost_analysis()["flops"] for c in compiled]
    gemms = 2 * N * (151 * 300 + 300 * 200)  # Dense_0 and Dense_1, both factors on the rows
    assert flops[1] < flops[0] - 0.5 * gemms


def test_kl_clip_reads_the_inner_product_from_the_rows():
  """With a KL clip that binds, the clipped update from the rows equals the one from the
  gradient: ``<u, g>`` comes from the rows (sample space where both factors are on the rows,
  ``sum((a u) * g) / M`` where one is not; a scanned stack summed over its layers)."""
  mlp, mlp_params, x, y = _mlp_setup()
  cases = ((mlp, mlp_params, x, y, jnp.asarray(randn(1, (N, 150))), 64),
           (Scanned(), None, jnp.asarray(randn(4, (6, 24))), jnp.asarray(np.arange(6) % 5),
            None, 16))
  for model, params, x, y, x2, block in cases:
    params = params if params is not None else init_params(model, x)
    x2 = x2 if x2 is not None else x[::-1] * 1.5
    capture = value_and_grad_with_stats(model, softmax_ce)
    tx = thor_optax.scale_by_kl_clip(thor_optax.scale_by_thor(0.05, block_size=block), 0.1,
                                     max_kl=1e-6)
    state = _refreshed(tx, capture, params, x, y)
    step = _plain_step(tx, capture)
    block_u, block_state, grads = step(params, state, x2, y, False)
    rows_u, rows_state, _ = step(params, state, x2, y, True)
    assert float(block_state.scale) < 0.1  # the clip binds
    np.testing.assert_allclose(float(rows_state.scale), float(block_state.scale), rtol=1e-12)
    _assert_same_update(block_u, rows_u, grads)


@pytest.mark.filterwarnings("default:gradient_stats. the gradients")
def test_rows_stand_only_for_their_own_gradient():
  """The rows are those of one capture's gradient. A mean of two micro-batches' gradients (a new
  array, as optax.MultiSteps' average; with micro-batches of unequal sizes it is not the
  per-example mean the joined rows give), with their joined statistics or the last one's, and a
  gradient with another batch's statistics are each preconditioned from the gradient as it is,
  with the warning, equal to the step without ``gradient_stats``."""
  model, params, x, y = _mlp_setup()
  capture = value_and_grad_with_stats(model, softmax_ce)
  tx = thor_optax.scale_by_thor(0.05, block_size=64)
  state = _refreshed(tx, capture, params, x, y)

  def step(params, state, x, y, which):
    parts = [capture(params, x[:12], y[:12]), capture(params, x[12:], y[12:])]
    grads = jax.tree.map(lambda a, b: (a + b) / 2, parts[0][0][1], parts[1][0][1])
    (_, own), own_stats = capture(params, x, y)
    other = capture(params, x[::-1] * 2, y)[1]
    grads, stats = {"none": (grads, None),
                    "joined": (grads, thor_optax.concatenate_stats(parts[0][1], parts[1][1])),
                    "last": (grads, parts[1][1]), "own": (own, None),
                    "other": (own, other)}[which]
    return tx.update(grads, state, params, gradient_stats=stats)[0]

  step = jax.jit(step, static_argnums=4)
  block, own = step(params, state, x, y, "none"), step(params, state, x, y, "own")
  for which, want in (("joined", block), ("last", block), ("other", own)):
    with pytest.warns(UserWarning, match="gradient_stats: the gradients of"):
      got = step(params, state, x, y, which)
    assert _relative(want, got) < TOL, which


def test_another_models_gradient_stats_are_an_error():
  """Statistics that do not fit the weights (a model with 160 inputs): the ``ValueError``
  naming the layer, as for ``curvature_stats`` (before: only the warning about the gradient
  arrays, which blamed the wrong thing)."""
  model, params, x, y = _mlp_setup()
  wide = jnp.asarray(randn(1, (N, 160)))
  (_, _), other = value_and_grad_with_stats(model, softmax_ce)(init_params(model, wide), wide, y)
  capture = value_and_grad_with_stats(model, softmax_ce)
  tx = thor_optax.scale_by_thor(0.05, block_size=64)

  def step(params, state):
    (_, grads), _ = capture(params, x, y)
    return tx.update(grads, state, params, gradient_stats=other)[0]

  with pytest.raises(ValueError, match=r"layer 'Dense_0'.*inputs have trailing dimension 160"):
    jax.jit(step)(params, tx.init(params))


@pytest.mark.filterwarnings("default:gradient_stats. the gradients")
def test_a_transform_before_the_preconditioner_is_not_bypassed():
  """``optax.chain(clip, scale_by_thor, ...)`` with ``gradient_stats=``: the clipped gradient
  reaches the preconditioner, which the rows do not stand for, so it is preconditioned as it is
  (equal to the step without ``gradient_stats``) and a warning says why; the raw gradient,
  passed along unchanged, is still taken from the rows."""
  model, params, x, y = _mlp_setup()
  capture = value_and_grad_with_stats(model, softmax_ce)
  thor = thor_optax.scale_by_thor(0.05, block_size=64)
  state = _refreshed(thor, capture, params, x, y)
  for pre in (optax.clip_by_global_norm(1e-3), optax.scale(0.5)):
    tx = optax.chain(pre, thor)
    step = _plain_step(tx, capture)
    chained_state = (pre.init(params), state)
    block, _, grads = step(params, chained_state, x * 2, y, False)
    with pytest.warns(UserWarning, match=r"gradient_stats: the gradients of \['Dense_0'"):
      rows, _, _ = step(params, chained_state, x * 2, y, True)
    assert _relative(block, rows) < TOL
    assert optax.tree.norm(rows) < 0.9 * optax.tree.norm(
        _plain_step(thor, capture)(params, state, x * 2, y, True)[0])


def test_eigh_and_masked_layers_use_the_gradient():
  model, params, x, y = _mlp_setup()
  capture = value_and_grad_with_stats(model, softmax_ce)
  mask = lambda p: {k: jax.tree.map(lambda _: k != "Dense_0", v) for k, v in p.items()}  # noqa
  for tx in (thor_optax.scale_by_kfac(0.05, inverse_method="eigh"),
             optax.masked(thor_optax.scale_by_thor(0.05, block_size=64), mask)):
    state = _refreshed(tx, capture, params, x, y)
    block, rows, grads = _both_forms(tx, state, capture, params, x * 2, y)
    _assert_same_update(block, rows, grads)


def test_train_state_and_nnx_optimizer_pass_gradient_stats():
  model, params, x, y = _mlp_setup()
  capture = value_and_grad_with_stats(model, softmax_ce)
  ts = TrainState.create(apply_fn=model.apply, params=params, tx=thor_optax.thor(0.1, 0.05))

  def step(ts, x, stats_as):
    (_, grads), stats = capture(ts.params, x, y)
    return ts.apply_gradients(grads=grads, **({stats_as: stats} if stats_as else {}))

  step = jax.jit(step, static_argnums=2)
  ts = step(ts, x, "curvature_stats")
  plain, rows = step(ts, x * 2, None), step(ts, x * 2, "gradient_stats")
  assert _relative(plain.params, rows.params) < TOL

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(150, 40, rngs=rngs, param_dtype=F64)
      self.l2 = nnx.Linear(40, 10, rngs=rngs, param_dtype=F64)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))

  nnx_capture = nnx_value_and_grad_with_stats(softmax_ce)
  results = []
  for with_rows in (False, True):
    net = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(net, thor_optax.thor(0.1, 0.05), wrt=nnx.Param)

    def step(net, opt, x, stats_as):
      (_, grads), stats = nnx_capture(net, x, y)
      opt.update(net, grads, **({stats_as: stats} if stats_as else {}))

    step = nnx.jit(step, static_argnames="stats_as")
    step(net, opt, x, "curvature_stats")
    step(net, opt, x * 2, "gradient_stats" if with_rows else None)
    results.append(nnx.state(net, nnx.Param))
  assert _relative(*results) < TOL


def test_guard_skips_a_step_whose_rows_are_not_finite():
  model, params, x, y = _mlp_setup()
  capture = value_and_grad_with_stats(model, softmax_ce)
  tx = thor_optax.thor(0.1, 0.05)
  state = _refreshed(tx, capture, params, x, y)
  bad = x.at[3, 7].set(jnp.nan)
  updates, new_state, _ = _plain_step(tx, capture)(params, state, bad, y, True)
  assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(updates))
  assert int(optax.tree_utils.tree_get(new_state, "total_notfinite")) == 1
  jax.tree.map(np.testing.assert_array_equal, kronecker_state(new_state), kronecker_state(state))


def test_errors_name_what_to_pass():
  model, params, x, y = _mlp_setup()
  capture = value_and_grad_with_stats(model, softmax_ce)
  tx = thor_optax.scale_by_thor(0.05)
  (_, grads), stats = capture(params, x, y)
  state = tx.init(params)
  with pytest.raises(TypeError, match="gradient_stats must be the CurvatureStats"):
    tx.update(grads, state, params, gradient_stats=stats.layers)
  renamed = dataclasses.replace(stats, layers={"Other": stats.layers["Dense_0"]})
  with pytest.raises(ValueError, match=r"gradient_stats has statistics for \['Other'\]"):
    tx.update(grads, state, params, gradient_stats=renamed)


def test_compiled_step_drops_the_kernel_gradients_it_does_not_read():
  """XLA's FLOP count: the step from the rows costs a capture-and-SGD step plus the products on
  the rows and matrices (computed from shapes here), not a second GEMM per layer."""
  model, params, x, y = _mlp_setup()
  capture = value_and_grad_with_stats(model, softmax_ce)

  def flops(opt, with_rows):
    def fn(params, state):
      (_, grads), stats = capture(params, x, y)
      kw = {"gradient_stats": stats} if with_rows else {}
      updates, state = opt.update(grads, state, params, **kw)
      return optax.apply_updates(params, updates), state
    return jax.jit(fn).lower(params, opt.init(params)).compile().cost_analysis()["flops"]

  tx = thor_optax.scale_by_thor(0.05, block_size=64)
  rows, block, baseline = flops(tx, True), flops(tx, False), flops(optax.sgd(0.1), False)
  extra = gemms = 0.0
  for spec in blocks.build_layout(params, 64).layers:
    a, g = spec.a, spec.g
    side = sample_space.sides(spec, N)
    # A factor of one padded block is applied as its true d x d corner.
    (wa, pa), (wg, pg) = ((s.dim, s.dim) if s.num_blocks == 1 else (s.block, s.padded_dim)
                          for s in (a, g))
    extra += 2 * wa * (N * pa if side.a else pa * g.dim)
    extra += 2 * wg * (N * pg if side.g else a.dim * pg)
    gemms += 2 * N * a.dim * g.dim
  # Kept kernel-gradient GEMMs would add `gemms` (3.4 M FLOPs) to `extra` (2.6 M).
  assert extra < rows - baseline < extra + 0.3 * gemms
  assert rows < 0.4 * block
  # The alias's guard judges these layers by their rows, so it keeps no GEMM alive either: its
  # first-order tail and guard (Nesterov momentum and the finiteness checks, about 20 FLOPs per
  # parameter) cost what they cost on the block form, which reads the kernel gradients anyway;
  # a kept GEMM of either large layer would add at least 0.42 `gemms` (1.45 M FLOPs).
  alias = thor_optax.thor(0.1, 0.05, block_size=64)
  tail = flops(alias, False) - block
  assert flops(alias, True) - rows < tail + 0.25 * gemms
