"""SKFAC's conv statistics modes (``conv.ConvSampling``) against float64 NumPy references.

* ``reduce_sum``: patches and cotangents summed over positions per example, ``/(N T)``; the
  expand factors themselves on ``1 x 1`` output maps;
* ``spatial_subsample``: strided positions against a loop reference (``s = T`` is expand);
  random positions are reproducible, distinct per example, shared by ``A`` and ``G``, and give
  unbiased estimates of the expand factors;
* the option errors.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from thor_optax._src import blocks
from thor_optax._src.layers import conv
from thor_optax._src import stats as stats_lib

import reference
from reference import F64, randn
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)


EXPAND = conv.ConvSampling()
REDUCE = conv.ConvSampling("reduce_sum")
TIGHT = dict(rtol=1e-12, atol=1e-13)


def _spec(kernel_shape, bias, path=("conv",)):
  """LayerSpec of a conv layer with an HWIO kernel of ``kernel_shape`` (at ``path``)."""
  leaves = {"kernel": np.zeros(kernel_shape)}
  if bias:
    leaves["bias"] = np.zeros(kernel_shape[-1])
  tree = leaves
  for key in reversed(path):
    tree = {key: tree}
  return blocks.build_layout(tree, None).layer("/".join(path))


def _stats(x, g, kernel_size, strides=(1, 1), padding="VALID"):
  return stats_lib.ConvStats(inputs=jnp.asarray(x, F64), cotangents=jnp.asarray(g, F64),
                             kernel_size=kernel_size, strides=strides, padding=padding)


@jax.jit(static_argnums=(0, 2))
def _jit_rows(spec, stats, sampling, key):
  a = spec.kind.input_rows(spec, stats, F64, sampling=sampling, key=key)
  g = spec.kind.cotangent_rows(spec, stats, F64, sampling=sampling, key=key)
  return a + g


def _rows(spec, stats, sampling, key=None):
  """Jitted ``(a_rows, a_scale, g_rows, g_scale)`` as NumPy, one key for both factors."""
  a_rows, a_scale, g_rows, g_scale = jax.tree.map(np.asarray,
                                                  _jit_rows(spec, stats, sampling, key))
  return a_rows, float(a_scale), g_rows, float(g_scale)


def _factors(spec, stats, sampling, key=None):
  a_rows, a_scale, g_rows, g_scale = _rows(spec, stats, sampling, key)
  return a_scale * a_rows.T @ a_rows, g_scale * g_rows.T @ g_rows


def _ref_patches(x, kernel_size, strides, padding):
  """Loop im2col as ``(N, T, C k_h k_w)``, channel-major like the package."""
  p = reference.im2col(x, kernel_size, strides, padding)
  n, ho, wo = p.shape[:3]
  return np.transpose(p, (0, 1, 2, 5, 3, 4)).reshape(n, ho * wo, -1)


def _random_problem(seed, n, hw, c_in, c_out, ksize, strides, padding, num_samples):
  """Random inputs, and cotangents of the output grid the loop im2col gives."""
  x = randn(seed, (n,) + hw + (c_in,))
  ho, wo = reference.im2col(x, ksize, strides, padding).shape[1:3]
  g = randn(seed + 1, (num_samples, n, ho, wo, c_out))
  return x, g, _stats(x, g, ksize, strides, padding)


# ------------------------------------------------------------------------------------------------
# reduce_sum


@pytest.mark.parametrize("hw,ksize,bias", [
    ((3, 3), (3, 3), True),   # 3x3 VALID on 3x3: one output position
    ((1, 1), (1, 1), False),  # 1x1 kernel on a 1x1 map
    ((1, 1), (1, 1), True),
])
def test_reduce_sum_is_expand_on_1x1_outputs(hw, ksize, bias):
  n, c_in, c_out = 4, 2, 3
  x, g, stats = _random_problem(3, n, hw, c_in, c_out, ksize, (1, 1), "VALID", num_samples=2)
  assert g.shape[2:4] == (1, 1)
  spec = _spec(ksize + (c_in, c_out), bias)
  expand, reduce = _rows(spec, stats, EXPAND), _rows(spec, stats, REDUCE)
  d = c_in * ksize[0] * ksize[1] + int(bias)
  assert expand[0].shape == reduce[0].shape == (n, d)
  assert expand[2].shape == reduce[2].shape == (2 * n, c_out)
  for u, v in zip(expand, reduce):
    np.testing.assert_array_equal(u, v)
  for u, v in zip(_factors(spec, stats, EXPAND), _factors(spec, stats, REDUCE)):
    np.testing.assert_array_equal(u, v)


def test_every_mode_divides_a_by_the_loss_terms():
  """With ``num_terms`` (``M`` loss terms that are not the ``N`` examples: a loss per position,
  an ensemble member's share), ``A = (1/M) sum`` of the expanded patches in every mode:
  ``'reduce_sum'`` still equals expand on a 1 x 1 map and ``'spatial_subsample'`` with every
  position too (before: both divided by ``N``, ``M / N`` times expand's)."""
  n, c_in, c_out = 4, 2, 3
  x, g, stats = _random_problem(5, n, (1, 1), c_in, c_out, (1, 1), (1, 1), "VALID", 1)
  stats = dataclasses.replace(stats, num_terms=3 * n)
  spec = _spec((1, 1, c_in, c_out), True)
  rows = np.concatenate([np.asarray(x).reshape(n, c_in), np.ones((n, 1))], axis=1)
  want = rows.T @ rows / (3 * n)
  for sampling in (EXPAND, REDUCE, conv.ConvSampling("spatial_subsample", 1)):
    np.testing.assert_allclose(_factors(spec, stats, sampling)[0], want, **TIGHT)
  x, g, stats = _random_problem(6, n, (3, 4), c_in, c_out, (2, 2), (1, 1), "SAME", 1)
  stats = dataclasses.replace(stats, num_terms=12 * n)
  spec = _spec((2, 2, c_in, c_out), False)
  full = _factors(spec, stats, conv.ConvSampling("spatial_subsample", 12))
  for u, v in zip(full, _factors(spec, stats, EXPAND)):
    np.testing.assert_allclose(u, v, **TIGHT)
  patches = _ref_patches(x, (2, 2), (1, 1), "SAME").reshape(n * 12, -1)
  np.testing.assert_allclose(full[0], patches.T @ patches / (12 * n), **TIGHT)


@pytest.mark.parametrize("bias", [True, False])
def test_reduce_sum_against_loops(bias):
  n, hw, c_in, c_out, ksize, strides, num_samples = 3, (5, 6), 2, 4, (3, 3), (2, 2), 2
  x, g, stats = _random_problem(5, n, hw, c_in, c_out, ksize, strides, "SAME", num_samples)
  spec = _spec(ksize + (c_in, c_out), bias)
  patches = _ref_patches(x, ksize, strides, "SAME")
  t = patches.shape[1]
  assert t == 9 and g.shape[2:4] == (3, 3)
  d = patches.shape[2] + int(bias)

  A_ref = np.zeros((d, d))
  for i in range(n):
    a_hat = np.zeros(d)
    for p in range(t):
      a_hat += np.append(patches[i, p], 1.0) if bias else patches[i, p]
    A_ref += np.outer(a_hat, a_hat)
  A_ref /= n * t
  G_ref = np.zeros((c_out, c_out))
  for j in range(num_samples):
    for i in range(n):
      g_hat = np.zeros(c_out)
      for p in range(g.shape[2]):
        for q in range(g.shape[3]):
          g_hat += g[j, i, p, q]
      G_ref += np.outer(g_hat, g_hat)
  G_ref /= n * t

  a_rows, a_scale, g_rows, g_scale = _rows(spec, stats, REDUCE)
  assert a_rows.shape == (n, d) and g_rows.shape == (num_samples * n, c_out)
  np.testing.assert_allclose(a_scale, 1.0 / (n * t), rtol=1e-15)
  np.testing.assert_allclose(g_scale, 1.0 / (n * t), rtol=1e-15)
  if bias:
    np.testing.assert_array_equal(a_rows[:, -1], t)
  A, G = _factors(spec, stats, REDUCE)
  np.testing.assert_allclose(A, A_ref, **TIGHT)
  np.testing.assert_allclose(G, G_ref, **TIGHT)
  # Sums over correlated positions are not the expand factors here.
  A_exp, G_exp = _factors(spec, stats, EXPAND)
  assert not np.allclose(A, A_exp) and not np.allclose(G, G_exp)


# ------------------------------------------------------------------------------------------------
# spatial_subsample


def _subsample_reference(patches, g, positions, bias):
  """``A = (T/s)(1/N) sum_n sum_{t in P_n} a a^T``, ``G = (1/(N s)) sum_{j,n,t in P_n} g g^T``."""
  n, t, _ = patches.shape
  s = positions.shape[1]
  gf = g.reshape(g.shape[0], n, t, -1)
  d = patches.shape[2] + int(bias)
  A = np.zeros((d, d))
  G = np.zeros((gf.shape[-1],) * 2)
  for i in range(n):
    for p in positions[i]:
      a = np.append(patches[i, p], 1.0) if bias else patches[i, p]
      A += np.outer(a, a)
      for j in range(gf.shape[0]):
        G += np.outer(gf[j, i, p], gf[j, i, p])
  return A * t / (s * n), G / (n * s)


def test_strided_subsample_against_loops():
  n, hw, c_in, c_out, ksize, strides, num_samples = 3, (5, 6), 2, 4, (3, 3), (2, 2), 2
  x, g, stats = _random_problem(7, n, hw, c_in, c_out, ksize, strides, "SAME", num_samples)
  spec = _spec(ksize + (c_in, c_out), True)
  patches = _ref_patches(x, ksize, strides, "SAME")
  t, s = patches.shape[1], 5
  d = patches.shape[2] + 1
  want = np.array([k * t // s for k in range(s)])  # floor(k T / s)
  np.testing.assert_array_equal(want, [0, 1, 3, 5, 7])
  positions = np.asarray(conv.subsample_positions(None, n, t, s))
  assert positions.dtype == np.int32 and positions.shape == (n, s)
  np.testing.assert_array_equal(positions, np.broadcast_to(want, (n, s)))

  sampling = conv.ConvSampling("spatial_subsample", s)
  a_rows, a_scale, g_rows, g_scale = _rows(spec, stats, sampling)
  assert a_rows.shape == (n * s, d) and g_rows.shape == (num_samples * n * s, c_out)
  np.testing.assert_allclose(a_scale, t / (n * s), rtol=1e-15)
  np.testing.assert_allclose(g_scale, 1.0 / (n * s), rtol=1e-15)
  A_ref, G_ref = _subsample_reference(patches, g, positions, bias=True)
  A, G = _factors(spec, stats, sampling)
  np.testing.assert_allclose(A, A_ref, **TIGHT)
  np.testing.assert_allclose(G, G_ref, **TIGHT)

  # s = T keeps every position in order: expand, bit for bit.
  full = _rows(spec, stats, conv.ConvSampling("spatial_subsample", t))
  for u, v in zip(full, _rows(spec, stats, EXPAND)):
    np.testing.assert_array_equal(u, v)


def _position_problem(n, hw, num_samples):
  """1x1 conv whose patches and cotangents name their position: one-hot ``t``, times ``n+1``.

  Inputs have ``C_in = T`` channels with ``x[n, t] = (n + 1) e_t``; cotangents ``g[j, n, t] =
  (j + 1)(n + 1) e_t``, so every row says which example, sample and position it came from.
  """
  t = hw[0] * hw[1]
  eye = np.eye(t).reshape(hw + (t,))
  scale = np.arange(1.0, n + 1)[:, None, None, None]
  x = scale * eye[None]
  g = np.arange(1.0, num_samples + 1)[:, None, None, None, None] * (scale * eye[None])[None]
  return _stats(x, g, (1, 1)), _spec((1, 1, t, t), True)


def _decode(rows, leading):
  """Position (argmax) and multiplier (max) of one-hot rows, reshaped to ``leading``."""
  return rows.argmax(axis=1).reshape(leading), rows.max(axis=1).reshape(leading)


def test_random_subsample_positions():
  n, hw, num_samples, s = 5, (4, 4), 2, 4
  t = hw[0] * hw[1]
  stats, spec = _position_problem(n, hw, num_samples)
  sampling = conv.ConvSampling("spatial_subsample", s)
  key = jax.random.PRNGKey(0)
  a_rows, a_scale, g_rows, g_scale = _rows(spec, stats, sampling, key)
  assert a_rows.shape == (n * s, t + 1) and g_rows.shape == (num_samples * n * s, t)
  np.testing.assert_allclose(a_scale, t / (n * s), rtol=1e-15)
  np.testing.assert_allclose(g_scale, 1.0 / (n * s), rtol=1e-15)
  np.testing.assert_array_equal(a_rows[:, -1], 1.0)

  # A's positions, per example and in order; G's are the same for every cotangent sample.
  a_pos, a_mult = _decode(a_rows[:, :t], (n, s))
  g_pos, g_mult = _decode(g_rows, (num_samples, n, s))
  np.testing.assert_array_equal(a_mult, np.broadcast_to(np.arange(1, n + 1)[:, None], (n, s)))
  np.testing.assert_array_equal(
      g_mult, np.arange(1, num_samples + 1)[:, None, None] * a_mult[None])
  for j in range(num_samples):
    np.testing.assert_array_equal(g_pos[j], a_pos)
  np.testing.assert_array_equal(
      a_pos, jax.jit(conv.subsample_positions, static_argnums=(1, 2, 3))(key, n, t, s))
  # Distinct within an example, not all strided, not the same for every example.
  assert all(len(set(row)) == s for row in a_pos)
  assert not np.array_equal(a_pos, np.broadcast_to([k * t // s for k in range(s)], (n, s)))
  assert len({tuple(row) for row in a_pos}) > 1

  # Same key, same rows; another key, other positions.
  for u, v in zip(_rows(spec, stats, sampling, key), (a_rows, a_scale, g_rows, g_scale)):
    np.testing.assert_array_equal(u, v)
  other = _decode(_rows(spec, stats, sampling, jax.random.PRNGKey(1))[0][:, :t], (n, s))[0]
  assert not np.array_equal(other, a_pos)


def test_random_subsample_is_unbiased():
  n, hw, c_in, c_out, ksize, num_samples, s = 8, (4, 4), 2, 3, (3, 3), 2, 8
  _, _, stats = _random_problem(11, n, hw, c_in, c_out, ksize, (1, 1), "SAME", num_samples)
  spec = _spec(ksize + (c_in, c_out), True)
  sampling = conv.ConvSampling("spatial_subsample", s)
  A_exp, G_exp = _factors(spec, stats, EXPAND)

  @jax.jit
  @jax.vmap
  def draw(key):
    a_rows, a_scale = spec.kind.input_rows(spec, stats, F64, sampling=sampling, key=key)
    g_rows, g_scale = spec.kind.cotangent_rows(spec, stats, F64, sampling=sampling, key=key)
    return a_scale * a_rows.T @ a_rows, g_scale * g_rows.T @ g_rows

  A_draws, G_draws = map(np.asarray, draw(jax.random.split(jax.random.PRNGKey(3), 400)))

  def rel(F, ref):
    return np.linalg.norm(F - ref) / np.linalg.norm(ref)

  for draws, exp in ((A_draws, A_exp), (G_draws, G_exp)):
    err = rel(draws.mean(axis=0), exp)
    assert err < 0.04
    assert rel(draws[0], exp) > 5 * err  # one draw is far off: the average does the work


# ------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="mean"), "unknown mode 'mean'"),
    (dict(mode="spatial_subsample"), "num_positions"),
    (dict(mode="spatial_subsample", num_positions=0), "num_positions"),
    (dict(mode="spatial_subsample", num_positions=True), "num_positions"),
    (dict(mode="spatial_subsample", num_positions=2.0), "num_positions"),
])
def test_conv_sampling_rejects(kwargs, match):
  with pytest.raises(ValueError, match=match):
    conv.ConvSampling(**kwargs)


def test_too_many_positions_names_the_layer():
  _, _, stats = _random_problem(13, 2, (3, 3), 1, 2, (1, 1), (1, 1), "VALID", 1)
  spec = _spec((1, 1, 1, 2), True, path=("block", "conv"))
  sampling = conv.ConvSampling("spatial_subsample", 10)
  for fn in (spec.kind.input_rows, spec.kind.cotangent_rows):
    with pytest.raises(ValueError, match=r"'block/conv'.*num_positions=10.*T = .* = 9"):
      fn(spec, stats, F64, sampling=sampling)
  with pytest.raises(ValueError, match="s=10, T=9"):
    conv.subsample_positions(None, 2, 9, 10)


def test_dense_layers_ignore_sampling():
  spec = blocks.build_layout({"dense": {"kernel": np.zeros((3, 2)), "bias": np.zeros(2)}},
                             None).layer("dense")
  stats = stats_lib.DenseStats(inputs=jnp.asarray(randn(17, (4, 5, 3))),
                               cotangents=jnp.asarray(randn(18, (2, 4, 5, 2))))
  sampling = conv.ConvSampling("spatial_subsample", 2)
  for fn in (spec.kind.input_rows, spec.kind.cotangent_rows):
    default = fn(spec, stats, F64)
    for mode in (REDUCE, sampling):
      for u, v in zip(fn(spec, stats, F64, sampling=mode, key=jax.random.PRNGKey(0)), default):
        np.testing.assert_array_equal(u, v)
