"""Dense layers over a sequence axis: the curvature of a loss per position is the Gauss-Newton
matrix of that loss, and equals that of the same batch flattened to ``(N T, d)``.

K-FAC-expand (Eschenhagen et al., NeurIPS 2023): for a mean loss of ``M`` terms,
``A = (1/M) sum_{n,t} a a^T`` and ``G = (1/(N T)) sum g g^T`` with one term's cotangents. The
capture regroups a layer's example axis to the loss terms (``LayerKind.per_loss_term``), so a
per-position loss (``M = N T``) divides ``A`` by ``N T``, not ``N``: before, the curvature was
``T`` times the Gauss-Newton matrix and the update differed from the flattened batch's.
K-FAC-reduce (``weight_sharing='reduce'``, the default for a loss per example): inputs
averaged and cotangents summed over positions. Each is exact for deep linear networks in its
setting. Float64, dense references.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
import thor_optax.flax

import reference
from reference import float64_mode, randn, softmax_ce, squared_error  # pylint: disable=unused-import

pytestmark = pytest.mark.usefixtures("fast_compiles")

N, T, D, K = 4, 5, 6, 3
DAMPING = 0.01


class Seq(nn.Module):
  """Dense -> tanh -> Dense over any leading axes."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(K, name="out")(jnp.tanh(nn.Dense(7, name="hidden")(x)))


def _update(model, loss_fn, params, x, y, tx, **capture_kwargs):
  (_, grads), stats = reference.capture(model, loss_fn, **capture_kwargs)(params, x, y)
  updates, _ = jax.jit(lambda g, p, s: tx.update(g, tx.init(p), p, curvature_stats=s))(
      grads, params, stats)
  return updates, stats


@pytest.mark.parametrize("method", ["cholesky", "eigh"])
def test_sequence_and_flattened_layouts_give_the_same_update(method):
  x = jnp.asarray(randn(0, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, K, (N, T)))
  params = reference.init_params(Seq(), x)
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None, inverse_method=method)
  seq, stats = _update(Seq(), softmax_ce, params, x, y, tx)
  flat, _ = _update(Seq(), softmax_ce, params, x.reshape(N * T, D), y.reshape(N * T), tx)
  # The per-position loss's N T terms became the statistics' example axis.
  assert stats.layers["hidden"].inputs.shape == (N * T, 1, D)
  for a, b in zip(jax.tree.leaves(seq), jax.tree.leaves(flat)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)
  grads = jax.grad(lambda p: softmax_ce(Seq().apply({"params": p}, x), y))(params)
  assert max(float(jnp.abs(u + g).max()) for u, g in
             zip(jax.tree.leaves(seq), jax.tree.leaves(grads))) > 1e-2  # preconditioned


def test_linear_layer_per_position_loss_gets_the_gauss_newton_matrix():
  """One linear layer, squared error per position, exact Fisher: ``G = I`` and
  ``A (x) G`` is the Gauss-Newton matrix ``(1/(N T)) X^T X (x) I`` of the mean loss."""
  x = jnp.asarray(randn(2, (N, T, D)))
  y = jnp.asarray(randn(3, (N, T, K)))
  model = nn.Dense(K, use_bias=False)
  params = reference.init_params(model, x)
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  updates, _ = _update(model, squared_error, params, x, y, tx, fisher_type="exact",
                       likelihood="squared_error")
  rows = np.asarray(x).reshape(-1, D)
  ggn = np.kron(rows.T @ rows / (N * T), np.eye(K))  # d^2 loss / d vec(W)^2, row-major vec
  hessian = jax.hessian(lambda w: squared_error(x @ w, y))(params["kernel"])
  np.testing.assert_allclose(hessian.reshape(D * K, D * K), ggn, rtol=0, atol=1e-13)
  a = rows.T @ rows / (N * T)
  s = np.sqrt(DAMPING)  # damping split sqrt(lambda) per factor
  grad = np.asarray(jax.grad(lambda w: squared_error(x @ w, y))(params["kernel"]))
  want = np.linalg.solve(a + s * np.eye(D), grad) / (1.0 + s)
  np.testing.assert_allclose(updates["kernel"], want, rtol=0, atol=1e-12)


class Pooled(nn.Module):
  """Dense -> tanh -> mean over positions -> Dense: a loss per example."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(K, name="head")(jnp.tanh(nn.Dense(7, name="hidden")(x)).mean(axis=1))


def test_per_example_loss_reduces_by_default_and_expands_on_request():
  """A loss per example (the sequence pooled before the head): ``M = N``. ``'auto'`` reduces
  (inputs averaged, cotangents summed over positions); ``'expand'`` keeps KFC's rows."""
  x = jnp.asarray(randn(4, (N, T, D)))
  y = jnp.arange(N) % K
  params = reference.init_params(Pooled(), x)
  (_, _), auto = reference.capture(Pooled(), softmax_ce)(params, x, y)
  (_, _), expand = reference.capture(Pooled(), softmax_ce, weight_sharing="expand")(
      params, x, y)
  assert expand.layers["hidden"].inputs.shape == (N, T, D)
  assert auto.layers["hidden"].inputs.shape == (N, D)
  np.testing.assert_allclose(auto.layers["hidden"].inputs, np.asarray(x).mean(1), atol=1e-15)
  np.testing.assert_allclose(auto.layers["hidden"].cotangents,
                             np.asarray(expand.layers["hidden"].cotangents).sum(2), atol=1e-13)
  assert auto.layers["head"].inputs.shape == expand.layers["head"].inputs.shape == (N, 7)
  with pytest.raises(ValueError, match="weight_sharing"):
    thor_optax.flax.value_and_grad_with_stats(Pooled(), softmax_ce, weight_sharing="mean")


class DeepLinear(nn.Module):
  """Two bias-less dense layers shared over positions, optionally pooled before the loss."""
  pooled: bool

  @nn.compact
  def __call__(self, x):
    z = nn.Dense(K, use_bias=False, name="w2")(nn.Dense(7, use_bias=False, name="w1")(x))
    return z.mean(axis=1) if self.pooled else z


@pytest.mark.parametrize("weight_sharing,pooled", [("reduce", True), ("expand", False)])
def test_weight_sharing_is_exact_for_deep_linear_networks(weight_sharing, pooled):
  """Eschenhagen et al. 2023: for a deep linear network with weight sharing and squared error,
  K-FAC-reduce (positions pooled before the loss) and K-FAC-expand (a loss per position) give
  each layer's exact Gauss-Newton block: here the loss's Hessian block, ``A (x) G`` with
  ``A = (1/M) sum a a^T`` over the pooled inputs or every position, ``G = W_next W_next^T``."""
  x = jnp.asarray(randn(5, (N, T, D)))
  y = jnp.asarray(randn(6, (N, K) if pooled else (N, T, K)))
  model = DeepLinear(pooled)
  params = reference.init_params(model, x)
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  updates, _ = _update(model, squared_error, params, x, y, tx, fisher_type="exact",
                       likelihood="squared_error", weight_sharing=weight_sharing)

  def loss(p):
    return squared_error(model.apply({"params": p}, x), y)

  grads = jax.grad(loss)(params)
  w1, w2 = np.asarray(params["w1"]["kernel"]), np.asarray(params["w2"]["kernel"])
  xs = np.asarray(x)
  rows1 = xs.mean(1) if pooled else xs.reshape(-1, D)
  rows2 = rows1 @ w1
  factors = {"w1": (rows1.T @ rows1 / len(rows1), w2 @ w2.T),
             "w2": (rows2.T @ rows2 / len(rows2), np.eye(K))}
  s = np.sqrt(DAMPING)
  for name, (a, g) in factors.items():
    shape = params[name]["kernel"].shape
    hessian = jax.hessian(lambda w, name=name: loss({**params, name: {"kernel": w}}))(
        params[name]["kernel"]).reshape(np.prod(shape), np.prod(shape))
    np.testing.assert_allclose(np.kron(a, g), hessian, rtol=0, atol=1e-13)
    want = reference.kron_update(a, g, np.asarray(grads[name]["kernel"]), s, s)
    np.testing.assert_allclose(updates[name]["kernel"], want, rtol=0, atol=1e-12)


class Windowed(nn.Module):
  """``DeepLinear(pooled=True)`` with the positions split into ``W`` windows folded into the
  batch axis before the layers, as a Swin block does: ``(N W, T / W, d)``."""

  @nn.compact
  def __call__(self, x):
    n, t, d = x.shape
    windows = x.reshape(n * 2, t // 2, d)
    z = nn.Dense(K, use_bias=False, name="w2")(nn.Dense(7, use_bias=False, name="w1")(windows))
    return z.reshape(n, t, K).mean(axis=1)


@pytest.mark.parametrize("weight_sharing", ["auto", "reduce", "expand"])
def test_windows_folded_into_the_batch_are_positions_of_their_example(weight_sharing):
  """The same function as ``DeepLinear(pooled=True)``, so the same update: reduce pools each
  example's positions over all its windows (before, each window's: A divided by ``N W`` and
  the windows' cotangents not summed, an update 0.6 off relatively)."""
  x = jnp.asarray(randn(8, (N, 6, D)))
  y = jnp.asarray(randn(9, (N, K)))
  params = reference.init_params(DeepLinear(True), x)
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  kwargs = dict(fisher_type="exact", likelihood="squared_error", weight_sharing=weight_sharing)
  want, _ = _update(DeepLinear(True), squared_error, params, x, y, tx, **kwargs)
  got, stats = _update(Windowed(), squared_error, params, x, y, tx, **kwargs)
  assert stats.layers["w1"].inputs.shape == ((N, D) if weight_sharing != "expand"
                                             else (2 * N, 3, D))
  for name in ("w1", "w2"):
    np.testing.assert_allclose(got[name]["kernel"], want[name]["kernel"], rtol=0, atol=1e-13)


def test_summed_loss_has_the_mean_losss_factors_and_m_times_its_step():
  """``loss_reduction='sum'``: the same factors as the mean of the same terms (the capture keeps
  per-term cotangents), and a gradient ``M`` times larger, so the step is ``M`` times the mean
  loss's, as with SGD (README, Conventions). A per-position loss: ``M = N T`` terms."""
  x = jnp.asarray(randn(2, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(3).integers(0, K, (N, T)))
  params = reference.init_params(Seq(), x)
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  summed = lambda logits, labels: softmax_ce(logits, labels) * (N * T)
  mean_step, mean_stats = _update(Seq(), softmax_ce, params, x, y, tx)
  sum_step, sum_stats = _update(Seq(), summed, params, x, y, tx, loss_reduction="sum")
  state = lambda s: tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params,
                              curvature_stats=s)[1]
  for a, b in zip(jax.tree.leaves(state(mean_stats).blocks),
                  jax.tree.leaves(state(sum_stats).blocks)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
  for a, b in zip(jax.tree.leaves(mean_step), jax.tree.leaves(sum_step)):
    np.testing.assert_allclose(b, N * T * a, rtol=1e-10, atol=1e-14)


def _expand_reference(rows, cotangents, num_terms, grad):
  """K-FAC-expand's update of the first (dense, biased) layer by hand: ``A = (1/M) sum`` over
  every row with a ones column, ``G = (1/R) sum g g^T`` over the ``R`` rows' per-term
  cotangents ``g = M dL/dy``, damping ``sqrt(lambda)`` on each."""
  a = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)
  g = num_terms * cotangents
  return reference.kron_update(a.T @ a / num_terms, g.T @ g / rows.shape[0], grad,
                               np.sqrt(DAMPING), np.sqrt(DAMPING))


def _first_layer_update(model, loss_fn, params, x, y, name, **capture_kwargs):
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  updates, _ = _update(model, loss_fn, params, x, y, tx, **capture_kwargs)
  layer = updates[name]
  return np.concatenate([np.asarray(layer["kernel"]).reshape(-1, layer["bias"].shape[-1]),
                         np.asarray(layer["bias"]).reshape(1, -1)])


def _grad_matrix(grads):
  return np.concatenate([np.asarray(grads["kernel"]), np.asarray(grads["bias"])[None]])


def test_rows_that_are_not_the_loss_terms_divide_a_by_the_terms():
  """``A = (1/M) sum a a^T`` over all rows also when the rows do not regroup to the ``M`` loss
  terms (before: ``1/N``, the leading axis, silently): a next-token loss that drops the last
  position (``M = N (T - 1)`` of ``N T`` rows), a graph network's node rows under a per-graph
  loss (7 rows, 3 terms), and each member of an ``nn.vmap`` ensemble (``N`` rows of ``E N``
  terms). References from the rows and per-term cotangents computed by hand."""
  x = jnp.asarray(randn(5, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(6).integers(0, K, (N, T - 1)))
  params = reference.init_params(Seq(), x)
  m = N * (T - 1)
  shifted = lambda logits, labels: softmax_ce(logits[:, :-1], labels)
  got = _first_layer_update(Seq(), shifted, params, x, y, "hidden", num_loss_terms=m)

  def loss_of_hidden(p, eps):  # the model by hand, ``eps`` added to the hidden layer's output
    h = jnp.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"] + eps)
    return shifted(h @ p["out"]["kernel"] + p["out"]["bias"], y)

  zeros = jnp.zeros((N, T, 7))
  ct = np.asarray(jax.grad(loss_of_hidden, argnums=1)(params, zeros)).reshape(-1, 7)
  grad = _grad_matrix(jax.grad(loss_of_hidden)(params, zeros)["hidden"])
  want = _expand_reference(np.asarray(x).reshape(-1, D), ct, m, grad)
  np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)

  segments, graphs = np.array([0, 0, 1, 1, 1, 2, 2]), 3

  class Graph(nn.Module):
    @nn.compact
    def __call__(self, nodes):
      h = jnp.tanh(nn.Dense(7, name="node")(nodes))
      return nn.Dense(K, name="head")(jax.ops.segment_sum(h, segments, num_segments=graphs))

  nodes = jnp.asarray(randn(7, (7, D)))
  labels = jnp.arange(graphs) % K
  params = reference.init_params(Graph(), nodes)
  got = _first_layer_update(Graph(), softmax_ce, params, nodes, labels, "node")

  def loss_of_node(p, eps):
    h = jnp.tanh(nodes @ p["node"]["kernel"] + p["node"]["bias"] + eps)
    pooled = jax.ops.segment_sum(h, segments, num_segments=graphs)
    return softmax_ce(pooled @ p["head"]["kernel"] + p["head"]["bias"], labels)

  zeros = jnp.zeros((7, 7))
  ct = np.asarray(jax.grad(loss_of_node, argnums=1)(params, zeros))
  grad = _grad_matrix(jax.grad(loss_of_node)(params, zeros)["node"])
  np.testing.assert_allclose(got, _expand_reference(np.asarray(nodes), ct, graphs, grad),
                             rtol=1e-9, atol=1e-12)

  members = 3
  ensemble = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=None, out_axes=0, axis_size=members)
  model = ensemble(K, name="member")
  x = jnp.asarray(randn(8, (N, D)))
  labels = jnp.broadcast_to(jnp.arange(N) % K, (members, N))
  params = {"member": reference.init_params(model, x)}

  class Wrapped(nn.Module):
    @nn.compact
    def __call__(self, inputs):
      return ensemble(K, name="member")(inputs)

  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  updates, _ = _update(Wrapped(), softmax_ce, params, x, labels, tx)
  loss_of = lambda p: softmax_ce(jnp.einsum("nd,edk->enk", x, p["kernel"])
                                 + p["bias"][:, None], labels)
  grads = jax.grad(loss_of)(params["member"])
  ct = np.asarray(jax.grad(lambda logits: softmax_ce(logits, labels))(
      jnp.einsum("nd,edk->enk", x, params["member"]["kernel"])
      + params["member"]["bias"][:, None]))
  for e in range(members):
    got = np.concatenate([np.asarray(updates["member"]["kernel"][e]),
                          np.asarray(updates["member"]["bias"][e])[None]])
    grad = np.concatenate([np.asarray(grads["kernel"][e]), np.asarray(grads["bias"][e])[None]])
    want = _expand_reference(np.asarray(x), ct[e], members * N, grad)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


class _RMSNorm(nn.Module):
  """Gemma's RMS norm of its own (``'channel_affine'`` kind, ``NormStats``)."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1 + scale)


class _PositionEmbs(nn.Module):
  """Google's ViT ``AddPositionEmbs``: an entry per position and channel (``'channel_affine'``,
  ``ChannelAffineStats``)."""

  @nn.compact
  def __call__(self, x):
    return x + self.param("pos_embedding", nn.initializers.normal(0.02), (1,) + x.shape[1:])


class Normed(nn.Module):
  """Per position: Dense -> tanh -> LayerNorm -> RMS norm -> position embedding -> Dense."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln")(jnp.tanh(nn.Dense(7, name="hidden")(x)))
    return nn.Dense(K, name="out")(_PositionEmbs(name="pos")(_RMSNorm(name="rms")(h)))


@pytest.mark.parametrize("case", ["expand", "reduce", "drop_last"])
def test_norm_layers_fisher_sums_each_loss_terms_positions(case):
  """A normalization layer's unit-wise Fisher under a loss per position is ``(1/M) sum`` over
  the ``M`` terms of their gradients' outer products per entry: with ``'auto'`` (expand) each
  token's gradient, as the dense layers get each token's rows; a loss dropping the last position
  (``M = N (T - 1)``) the same over its terms; ``'reduce'`` each sequence's summed gradient,
  divided by ``M`` as reduce's ``G`` is. Before, every case summed each sequence's positions and
  divided by ``N``: ``T`` times the expanded Fisher. The model mixes no positions, so the terms'
  gradients (``jax.jacrev``) are exact references; damping ``lambda`` on each 2x2 block."""
  x = jnp.asarray(randn(9, (N, T, D)))
  y = jnp.asarray(np.random.default_rng(10).integers(0, K, (N, T)))
  params = reference.init_params(Normed(), x)
  used = T - 1 if case == "drop_last" else T
  terms = lambda p: optax.softmax_cross_entropy_with_integer_labels(
      Normed().apply({"params": p}, x)[:, :used], y[:, :used])  # (N, used) terms
  loss = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :used], labels[:, :used]).mean()
  kwargs = dict(weight_sharing="reduce") if case == "reduce" else {}
  tx = thor_optax.scale_by_kfac(DAMPING, ema_decay=None)
  updates, _ = _update(Normed(), loss, params, x, y, tx, num_loss_terms=N * used, **kwargs)
  jac = jax.jacrev(terms)(params)  # leaves (N, used, *leaf shape)
  grads = jax.grad(lambda p: terms(p).mean())(params)
  for layer, (first, second) in {"ln": ("scale", "bias"), "rms": ("scale", None),
                                 "pos": ("pos_embedding", None)}.items():
    per_term = [np.asarray(jac[layer][leaf]).reshape(N, used, -1) if leaf
                else np.zeros((N, used, np.asarray(jac[layer][first][0, 0]).size))
                for leaf in (first, second)]
    rows = np.stack(per_term, -1)  # (N, used, entries, 2)
    rows = rows.sum(1) if case == "reduce" else rows.reshape(N * used, *rows.shape[2:])
    fisher = np.einsum("rci,rcj->cij", rows, rows) / (N * used)
    grad = np.stack([np.asarray(grads[layer][first]).ravel(),
                     np.asarray(grads[layer][second]).ravel() if second
                     else np.zeros(fisher.shape[0])], -1)
    want = np.linalg.solve(fisher + DAMPING * np.eye(2), grad[..., None])[..., 0]
    got = np.asarray(updates[layer][first]).ravel()
    np.testing.assert_allclose(got, want[:, 0], rtol=1e-10, atol=1e-13)
    if second:
      np.testing.assert_allclose(np.asarray(updates[layer][second]), want[:, 1], rtol=1e-10,
                                 atol=1e-13)
