"""Dense layers over a sequence axis: the curvature of a loss per position is the Gauss-Newton
matrix of that loss, and equals that of the same batch flattened to ``(N T, d)``.

K-FAC-expand (Eschenhagen et al., NeurIPS 2023): for a mean loss of ``M`` terms,
``A = (1/M) sum_{n,t} a a^T`` and ``G = (1/(N T)) sum g g^T`` with one term's cotangents. The
capture regroups a layer's example axis to the loss terms (``LayerKind.per_loss_term``), so a
per-position loss (``M = N T``) divides ``A`` by ``N T``, not ``N``: before, the curvature was
``T`` times the Gauss-Newton matrix and the update differed from the flattened batch's.
Float64, dense references.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax

import reference
from reference import float64_mode, randn, softmax_ce, squared_error  # pylint: disable=unused-import

N, T, D, K = 4, 5, 6, 3
DAMPING = 0.01


class Seq(nn.Module):
  """Dense -> tanh -> Dense over any leading axes."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(K, name="out")(jnp.tanh(nn.Dense(7, name="hidden")(x)))


def _update(model, loss_fn, params, x, y, tx, **capture_kwargs):
  (_, grads), stats = reference.capture(model, loss_fn, **capture_kwargs)(params, x, y)
  updates, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats)
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


def test_per_example_loss_keeps_the_example_axis():
  """A loss per example (the sequence pooled before the head): ``M = N``, KFC's rule."""

  class Pooled(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(K, name="head")(jnp.tanh(nn.Dense(7, name="hidden")(x)).mean(axis=1))

  x = jnp.asarray(randn(4, (N, T, D)))
  y = jnp.arange(N) % K
  params = reference.init_params(Pooled(), x)
  (_, _), stats = reference.capture(Pooled(), softmax_ce)(params, x, y)
  assert stats.layers["hidden"].inputs.shape == (N, T, D)
  assert stats.layers["head"].inputs.shape == (N, 7)
