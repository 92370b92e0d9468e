"""Kronecker factors and capture against independent float64 NumPy references.

* conv factors against an im2col written with explicit loops over output positions;
* dense layers applied at several positions (inputs ``(N, T, d)``);
* the capture: gradients, empirical cotangents, sampled and exact Fisher;
* modules that cannot be captured are reported and left alone by the transform.
"""

import functools

import jax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
from thor_optax._src import blocks
from thor_optax._src.layers import conv
from thor_optax.flax import value_and_grad_with_stats

import reference
from reference import F64, init_params, randn, softmax_ce, squared_error
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)


TIGHT = dict(rtol=1e-10, atol=1e-12)


def _package_factors(params, stats, name):
  """``A`` and ``G`` rows and scales of layer ``name`` as the package forms them."""
  spec = blocks.build_layout(params, None).layer(name)

  @jax.jit
  def rows(layer):
    a_rows, a_scale = spec.kind.input_rows(spec, layer, F64)
    g_rows, g_scale = spec.kind.cotangent_rows(spec, layer, F64)
    return a_rows, a_scale, g_rows, g_scale

  a_rows, a_scale, g_rows, g_scale = rows(stats.layers[name])
  return np.asarray(a_rows), float(a_scale), np.asarray(g_rows), float(g_scale)


class OneConv(nn.Module):
  """One conv layer, then a nonlinearity and a spatial mean: outputs ``(N, C_out)``."""
  features: int
  kernel_size: tuple
  strides: tuple
  padding: object
  kernel_dilation: tuple
  input_dilation: tuple
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    y = nn.Conv(self.features, self.kernel_size, strides=self.strides, padding=self.padding,
                input_dilation=self.input_dilation, kernel_dilation=self.kernel_dilation,
                use_bias=self.use_bias, name="conv")(x)
    return jnp.tanh(y).mean(axis=(1, 2))


CONV_CONFIGS = {
    # name: (hw, C_in, C_out, kernel, strides, padding, kernel_dilation, input_dilation, bias)
    "same_3x3": ((5, 5), 2, 3, (3, 3), (1, 1), "SAME", (1, 1), (1, 1), True),
    "valid_3x2_stride21": ((6, 5), 3, 2, (3, 2), (2, 1), "VALID", (1, 1), (1, 1), False),
    "same_2x3_stride2_asym": ((5, 6), 2, 3, (2, 3), (2, 2), "SAME", (1, 1), (1, 1), True),
    "explicit_dil21_stride12": ((6, 6), 2, 2, (3, 3), (1, 2), ((1, 0), (2, 1)), (2, 1), (1, 1),
                                True),
    "same_dil22": ((6, 5), 1, 2, (2, 2), (1, 1), "SAME", (2, 2), (1, 1), False),
    "explicit_input_dil": ((4, 4), 2, 3, (2, 2), (1, 1), ((1, 1), (0, 1)), (1, 1), (2, 1),
                           True),
}


@pytest.mark.parametrize("name", sorted(CONV_CONFIGS))
def test_conv_factors_match_loop_im2col(name):
  hw, c_in, c_out, ksize, strides, padding, kdil, idil, bias = CONV_CONFIGS[name]
  n = 3
  model = OneConv(c_out, ksize, strides, padding, kdil, idil, bias)
  x = jnp.asarray(randn(1, (n,) + hw + (c_in,)))
  y = jnp.asarray(randn(2, (n, c_out)))
  params = init_params(model, x)
  spec = blocks.build_layout(params, None).layer("conv")
  capture_fn = value_and_grad_with_stats(model, squared_error)

  @jax.jit
  def run(params, x, y):  # everything the package computes, in one compilation
    (_, grads), stats = capture_fn(params, x, y)
    layer = stats.layers["conv"]
    _, inter = model.apply({"params": params}, x, capture_intermediates=True)
    kmat = conv.Conv().kernel_matrix(params["conv"]["kernel"])
    return dict(
        stats=stats, grads=grads, conv_out=inter["intermediates"]["conv"]["__call__"][0],
        patches=conv.conv_patches(layer), kmat=kmat,
        kback=conv.Conv().kernel_from_matrix(kmat, spec.kernel_shape),
        grad_mat=conv.Conv().kernel_matrix(grads["conv"]["kernel"]),
        a=spec.kind.input_rows(spec, layer, F64), g=spec.kind.cotangent_rows(spec, layer, F64))

  out = run(params, x, y)
  stats, grads = out["stats"], out["grads"]
  layer = stats.layers["conv"]
  assert isinstance(layer, thor_optax.ConvStats)
  assert stats.unhandled == ()
  assert layer.kernel_size == ksize and layer.strides == strides
  assert layer.kernel_dilation == kdil and layer.input_dilation == idil
  assert layer.padding == (padding if isinstance(padding, str) else tuple(padding))
  np.testing.assert_array_equal(layer.inputs, x)

  ref = reference.im2col(layer.inputs, ksize, strides, padding, kdil, idil)
  _, ho, wo = ref.shape[:3]
  kh, kw = ksize
  d_in = c_in * kh * kw
  # The reference reproduces the layer output (validates the reference, SAME conventions too).
  conv_out = np.asarray(out["conv_out"])
  assert conv_out.shape == (n, ho, wo, c_out)
  kernel = np.asarray(params["conv"]["kernel"])
  b = np.asarray(params["conv"]["bias"]) if bias else np.zeros(c_out)
  np.testing.assert_allclose(ref.reshape(n, ho, wo, -1) @ kernel.reshape(-1, c_out) + b,
                             conv_out, **TIGHT)

  # Package patches: channel-major (C, k_h, k_w) order, and kernel_matrix matches it.
  patches = np.asarray(out["patches"])
  assert patches.shape == (n, ho, wo, d_in)
  np.testing.assert_allclose(
      patches, np.transpose(ref, (0, 1, 2, 5, 3, 4)).reshape(n, ho, wo, d_in), **TIGHT)
  kmat = np.asarray(out["kmat"])
  assert kmat.shape == (d_in, c_out)
  np.testing.assert_allclose(patches @ kmat + b, conv_out, **TIGHT)
  np.testing.assert_array_equal(out["kback"], kernel)

  # A = (1/N) sum_{n,t} a a^T over the reference patches (channel-major to match the package).
  a_ref = np.transpose(ref, (0, 1, 2, 5, 3, 4)).reshape(n * ho * wo, d_in)
  if bias:
    a_ref = np.concatenate([a_ref, np.ones((n * ho * wo, 1))], axis=1)
  A_ref = np.zeros((a_ref.shape[1],) * 2)
  for row in a_ref:
    A_ref += np.outer(row, row)
  A_ref /= n
  # G = (1/(N T)) sum_{s,n,t} g g^T over the raw cotangents.
  g = np.asarray(layer.cotangents)
  assert g.shape == (1, n, ho, wo, c_out)
  G_ref = np.zeros((c_out, c_out))
  for s in range(g.shape[0]):
    for i in range(n):
      for p in range(ho):
        for q in range(wo):
          G_ref += np.outer(g[s, i, p, q], g[s, i, p, q])
  G_ref /= n * ho * wo

  (a_rows, a_scale), (g_rows, g_scale) = jax.tree.map(np.asarray, (out["a"], out["g"]))
  assert a_rows.shape == (n * ho * wo, d_in + int(bias))
  assert g_rows.shape == (n * ho * wo, c_out)
  np.testing.assert_allclose(a_scale, 1.0 / n, rtol=1e-15)
  np.testing.assert_allclose(g_scale, 1.0 / (n * ho * wo), rtol=1e-15)
  np.testing.assert_allclose(a_scale * a_rows.T @ a_rows, A_ref, **TIGHT)
  np.testing.assert_allclose(g_scale * g_rows.T @ g_rows, G_ref, **TIGHT)

  # The package's kernel gradient is (rows of a)^T (cotangents) / N: the pairing of the patch
  # order with kernel_matrix is the one the gradient itself uses.
  grad_mat = np.asarray(out["grad_mat"])
  if bias:
    grad_mat = np.concatenate([grad_mat, np.asarray(grads["conv"]["bias"])[None]], axis=0)
  np.testing.assert_allclose(a_rows.T @ g.reshape(-1, c_out) / n, grad_mat, **TIGHT)


# ------------------------------------------------------------------------------------------------
# Dense layers with extra leading axes, and the capture itself.


class SeqMLP(nn.Module):
  """Dense on ``(N, T, d)``, tanh, mean over ``T``, Dense; ``perturb`` marks layer outputs."""

  @nn.compact
  def __call__(self, x, perturb=False):
    h = nn.Dense(4, name="Dense_0")(x)
    if perturb:
      h = self.perturb("Dense_0_out", h)
    h = jnp.tanh(h).mean(axis=1)
    out = nn.Dense(2, name="Dense_1")(h)
    if perturb:
      out = self.perturb("Dense_1_out", out)
    return out


def _perturbation_grads(model, params, x, y, loss_fn):
  """d(mean loss)/d(layer output) for every perturbed layer, via ``nn.Module.perturb``."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x, perturb=True))
  perts = jax.tree.map(lambda s: jnp.zeros(s.shape, F64), shapes["perturbations"])

  def loss(p):
    return loss_fn(model.apply({"params": params, "perturbations": p}, x, perturb=True), y)

  return jax.jit(jax.grad(loss))(perts)


def test_dense_with_positions():
  n, t, d = 3, 4, 3
  model = SeqMLP()
  x = jnp.asarray(randn(3, (n, t, d)))
  y = jnp.asarray(randn(4, (n, 2)))
  params = init_params(model, x)
  # A loss per example: 'auto' would reduce the positions; expand keeps them as recorded.
  (_, _), stats = reference.capture(model, squared_error, weight_sharing="expand")(params, x, y)
  layer = stats.layers["Dense_0"]
  assert isinstance(layer, thor_optax.DenseStats)
  assert layer.inputs.shape == (n, t, d)
  assert layer.cotangents.shape == (1, n, t, 4)
  np.testing.assert_array_equal(layer.inputs, x)
  # Cotangents are per example: N * d(mean loss)/d(layer output).
  dh = _perturbation_grads(model, params, x, y, squared_error)
  np.testing.assert_allclose(layer.cotangents[0], n * np.asarray(dh["Dense_0_out"]), **TIGHT)

  a = np.asarray(x)
  g = np.asarray(layer.cotangents)
  A_ref = np.zeros((d + 1, d + 1))
  G_ref = np.zeros((4, 4))
  for i in range(n):
    for j in range(t):
      row = np.append(a[i, j], 1.0)
      A_ref += np.outer(row, row)
      G_ref += np.outer(g[0, i, j], g[0, i, j])
  A_ref /= n
  G_ref /= n * t
  a_rows, a_scale, g_rows, g_scale = _package_factors(params, stats, "Dense_0")
  assert a_rows.shape == (n * t, d + 1) and g_rows.shape == (n * t, 4)
  np.testing.assert_allclose(a_scale * a_rows.T @ a_rows, A_ref, **TIGHT)
  np.testing.assert_allclose(g_scale * g_rows.T @ g_rows, G_ref, **TIGHT)


class MLP(nn.Module):
  """``x -> Dense(4) -> tanh -> Dense(3)``; ``perturb`` marks layer outputs for references."""

  @nn.compact
  def __call__(self, x, perturb=False):
    h = nn.Dense(4, name="Dense_0")(x)
    if perturb:
      h = self.perturb("Dense_0_out", h)
    out = nn.Dense(3, name="Dense_1")(jnp.tanh(h))
    if perturb:
      out = self.perturb("Dense_1_out", out)
    return out


def _mlp_problem(n=6, seed=0):
  model = MLP()
  x = jnp.asarray(randn(10 + seed, (n, 3)))
  y = jnp.asarray(np.random.default_rng(20 + seed).integers(0, 3, n))
  return model, init_params(model, x, seed=seed), x, y


def test_capture_grads_and_empirical_cotangents():
  model, params, x, y = _mlp_problem()
  n = x.shape[0]
  (loss, grads), stats = reference.capture(model, softmax_ce)(params, x, y)

  def ref_loss(p):
    return softmax_ce(model.apply({"params": p}, x), y)

  ref_l, ref_g = jax.jit(jax.value_and_grad(ref_loss))(params)
  np.testing.assert_allclose(loss, ref_l, rtol=1e-14)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), grads, ref_g)
  assert jax.tree.structure(grads) == jax.tree.structure(ref_g)

  # Inputs are the layer inputs; cotangents are N * d(mean loss)/d(layer output).
  np.testing.assert_array_equal(stats.layers["Dense_0"].inputs, x)
  p0 = jax.tree.map(np.asarray, params)
  h = np.tanh(np.asarray(x) @ p0["Dense_0"]["kernel"] + p0["Dense_0"]["bias"])
  np.testing.assert_allclose(stats.layers["Dense_1"].inputs, h, **TIGHT)
  dh = _perturbation_grads(model, params, x, y, softmax_ce)
  for name in ("Dense_0", "Dense_1"):
    ct = stats.layers[name].cotangents
    assert ct.shape == (1,) + dh[name + "_out"].shape
    np.testing.assert_allclose(ct[0], n * np.asarray(dh[name + "_out"]), **TIGHT)
  # Last layer, by hand: softmax(out) - onehot(y).
  out = h @ p0["Dense_1"]["kernel"] + p0["Dense_1"]["bias"]
  np.testing.assert_allclose(stats.layers["Dense_1"].cotangents[0],
                             _softmax(out) - np.eye(3)[np.asarray(y)], **TIGHT)


def _softmax(z):
  z = np.asarray(z)
  e = np.exp(z - z.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def _softmax_fisher_G(params, x):
  """mean_n(diag(p_n) - p_n p_n^T) of the MLP's softmax, computed in NumPy."""
  p = jax.tree.map(np.asarray, params)
  h = np.tanh(np.asarray(x) @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
  probs = _softmax(h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"])
  return np.mean([np.diag(q) - np.outer(q, q) for q in probs], axis=0)


def test_sampled_fisher_approaches_exact():
  model, params, x, y = _mlp_problem(n=8, seed=1)
  exact_fn = reference.capture(model, softmax_ce, fisher_type="exact",
                      likelihood="softmax_cross_entropy")
  sampled_fn = reference.capture(model, softmax_ce, fisher_type="sampled",
                        likelihood="softmax_cross_entropy", num_samples=2000)
  (_, g_exact), exact = exact_fn(params, x, y)
  (_, g_sampled), sampled = sampled_fn(params, x, y, rng=jax.random.PRNGKey(0))
  # The training gradients do not depend on the Fisher type.
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), g_exact, g_sampled)
  assert sampled.layers["Dense_1"].cotangents.shape == (2000, 8, 3)
  assert exact.layers["Dense_1"].cotangents.shape == (3, 8, 3)
  for name in ("Dense_0", "Dense_1"):
    np.testing.assert_array_equal(sampled.layers[name].inputs, exact.layers[name].inputs)
    *_, gr_e, sc_e = _package_factors(params, exact, name)
    *_, gr_s, sc_s = _package_factors(params, sampled, name)
    G_e = sc_e * gr_e.T @ gr_e
    G_s = sc_s * gr_s.T @ gr_s
    np.testing.assert_allclose(G_s, G_e, rtol=0, atol=0.05 * np.abs(G_e).max())


@functools.lru_cache(maxsize=None)
def _exact_softmax_case():
  """Last layer of the MLP, exact softmax Fisher: (package G, analytic G, A (x) G, J^T H J)."""
  model, params, x, y = _mlp_problem(n=5, seed=2)
  fn = reference.capture(model, softmax_ce, fisher_type="exact", likelihood="softmax_cross_entropy")
  # N > 1: last-layer G = mean_n(diag(p_n) - p_n p_n^T).
  _, stats = fn(params, x, y)
  *_, g_rows, g_scale = _package_factors(params, stats, "Dense_1")
  G, G_ref = g_scale * g_rows.T @ g_rows, _softmax_fisher_G(params, x)
  # N = 1: A (x) G is the exact Fisher block J^T (diag(p) - p p^T) J of the last layer.
  x1, y1 = x[:1], y[:1]
  _, stats1 = fn(params, x1, y1)
  a_rows, a_scale, g_rows, g_scale = _package_factors(params, stats1, "Dense_1")
  kron = np.kron(a_scale * a_rows.T @ a_rows, g_scale * g_rows.T @ g_rows)
  w = np.concatenate([params["Dense_1"]["kernel"], params["Dense_1"]["bias"][None]], axis=0)

  def out_fn(m):
    p = {**params, "Dense_1": {"kernel": m[:-1], "bias": m[-1]}}
    return model.apply({"params": p}, x1)[0]

  J = np.asarray(jax.jit(jax.jacobian(out_fn))(w)).reshape(3, -1)
  F = J.T @ _softmax_fisher_G(params, x1) @ J
  return G, G_ref, kron, F


def test_exact_softmax_fisher():
  """The analytic softmax Fisher: G = mean(diag p - p p^T); for N=1, A (x) G = J^T H J."""
  G, G_ref, kron, F = _exact_softmax_case()
  np.testing.assert_allclose(G, G_ref, rtol=1e-10, atol=1e-13)
  np.testing.assert_allclose(kron, F, rtol=1e-10, atol=1e-13)


class TokenHead(nn.Module):
  """A dense head per position: outputs ``(N, T, K)``."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="head")(x)


def _masked_problem():
  """``(N, T)`` tokens of which the loss drops three (padding), a masked mean over the rest."""
  mask = np.ones((3, 4))
  mask[0, 2:] = 0
  mask[2, 3] = 0
  x = jnp.asarray(randn(30, (3, 4, 5)))
  y = jnp.asarray(np.random.default_rng(31).integers(0, 3, (3, 4)))
  return TokenHead(), init_params(TokenHead(), x), x, y, mask


@pytest.mark.parametrize("likelihood", ["softmax_cross_entropy", "squared_error"])
def test_exact_fisher_sums_over_the_positions_the_loss_reads(likelihood):
  """A masked loss (padding): the exact Fisher's ``G`` sums over the ``M`` positions the loss
  reads (softmax: ``diag p - p p^T``; squared error: the identity), not over every position
  (before: 31% too large for the softmax here). For the squared error, targets equal to the
  outputs at one read position (a zero gradient there) keep it counted."""
  model, params, x, y, mask = _masked_problem()
  m = int(mask.sum())
  out = np.asarray(model.apply({"params": params}, x))
  if likelihood == "softmax_cross_entropy":
    def loss(o, t):
      ce = -jnp.take_along_axis(jax.nn.log_softmax(o), t[..., None], -1)[..., 0]
      return jnp.sum(ce * mask) / m
    probs = _softmax(out).reshape(-1, 3)
    g_ref = sum(np.diag(q) - np.outer(q, q) for q, k in zip(probs, mask.reshape(-1)) if k) / m
  else:
    y = jnp.asarray(out + randn(32, out.shape)).at[1, 1].set(out[1, 1])  # an exact fit at a

    def loss(o, t):  # read position
      return 0.5 * jnp.sum(jnp.sum((o - t) ** 2, -1) * mask) / m
    g_ref = np.eye(3)
  (_, grads), stats = reference.capture(model, loss, fisher_type="exact", likelihood=likelihood,
                                        num_loss_terms=m)(params, x, y)
  g_rows = np.asarray(stats.layers["head"].cotangents).reshape(-1, 3)
  np.testing.assert_allclose(g_rows.T @ g_rows / m, g_ref, rtol=0, atol=1e-12)
  dropped = np.asarray(stats.layers["head"].cotangents)[:, mask == 0]
  assert dropped.shape[1] == 3 and not np.any(dropped)


def test_sampled_fisher_draws_nothing_at_dropped_positions():
  model, params, x, y, mask = _masked_problem()

  def loss(o, t):
    ce = -jnp.take_along_axis(jax.nn.log_softmax(o), t[..., None], -1)[..., 0]
    return jnp.sum(ce * mask) / mask.sum()

  _, stats = reference.capture(model, loss, fisher_type="sampled", num_samples=4,
                               likelihood="softmax_cross_entropy",
                               num_loss_terms=int(mask.sum()))(params, x, y,
                                                               rng=jax.random.PRNGKey(0))
  cts = np.asarray(stats.layers["head"].cotangents)
  assert not np.any(cts[:, mask == 0]) and np.all(np.any(cts[:, mask == 1] != 0, axis=-1))


# ------------------------------------------------------------------------------------------------
# Unsupported modules.


class Odd(nn.Module):
  """A PReLU (no layer kind) and a LayerNorm applied twice (weight sharing of a normalization
  layer): neither can be captured; the embedding and the head are."""

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(7, 4, name="embed")
    h = nn.PReLU(name="prelu")(embed(tokens))
    shared = nn.LayerNorm(name="shared")
    h = shared(jnp.tanh(shared(h)))
    return nn.Dense(3, name="head")(h.mean(axis=1))


def test_unhandled_modules_pass_through():
  model = Odd()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 7, (4, 5)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, 3, 4))
  params = init_params(model, tokens)
  (_, grads), stats = reference.capture(model, softmax_ce)(params, tokens, y)
  assert set(stats.layers) == {"embed", "head"}
  unhandled = dict(s.split(": ", 1) for s in stats.unhandled)
  assert set(unhandled) == {"prelu", "shared"}
  assert "shared layer" in unhandled["shared"] and "2 times" in unhandled["shared"]
  assert "not supported" in unhandled["prelu"]

  tx = thor_optax.scale_by_thor(0.1, block_size=None, trace_thresholds=(0.0, 0.0),
                              refresh_buckets=1)
  state = jax.jit(tx.init)(params)
  update = jax.jit(lambda g, s, c: tx.update(g, s, None, curvature_stats=c))
  with pytest.warns(UserWarning, match="shared"):
    updates, state = update(grads, state, stats)
  for name in ("prelu", "shared"):
    jax.tree.map(np.testing.assert_array_equal, updates[name], grads[name])
  assert not np.allclose(updates["head"]["kernel"], grads["head"]["kernel"])
  np.testing.assert_array_equal(state.layers["shared"].inverse, np.broadcast_to(np.eye(2),
                                                                                 (4, 2, 2)))
  assert int(state.diagnostics["head"].total_refreshes) == 2
