"""Shared helpers of the float64 dense-reference tests (test_exactness.py, test_factors.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from thor_optax.flax import value_and_grad_with_stats

F64 = jnp.float64


@pytest.fixture(autouse=True, scope="module")
def float64_mode():
  """Dense references in float64, for the importing module's tests only."""
  with jax.enable_x64(True):
    yield


def randn(seed, shape):
  """Standard normal NumPy draws (float64)."""
  return np.random.default_rng(seed).standard_normal(shape)


def init_params(model, *args, seed=0):
  """float64 parameters of the model's shapes, drawn with NumPy (no compilation)."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args))["params"]
  rng = np.random.default_rng(100 + seed)

  def draw(leaf):
    scale = 1.0 / np.sqrt(np.prod(leaf.shape[:-1])) if len(leaf.shape) > 1 else 0.3
    return jnp.asarray(scale * rng.standard_normal(leaf.shape), F64)

  return jax.tree.map(draw, shapes)


def capture(model, loss_fn, **kwargs):
  """Jitted ``value_and_grad_with_stats``."""
  return jax.jit(value_and_grad_with_stats(model, loss_fn, **kwargs))


def squared_error(out, y):
  """``0.5 ||out - y||^2`` per example, averaged over examples."""
  return 0.5 * jnp.sum((out - y) ** 2, axis=-1).mean()


def softmax_ce(out, y):
  """Softmax cross-entropy with integer labels, averaged over examples."""
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def same_or_explicit_pads(sizes, eff_kernel, strides, padding):
  if padding == "VALID":
    return ((0, 0), (0, 0))
  if padding == "SAME":  # lax.padtype_to_pads: out = ceil(in / s), extra pad on the high side
    pads = []
    for size, k, s in zip(sizes, eff_kernel, strides):
      out = -(-size // s)
      total = max((out - 1) * s + k - size, 0)
      pads.append((total // 2, total - total // 2))
    return tuple(pads)
  return tuple(tuple(p) for p in padding)


def im2col(x, kernel_size, strides, padding, kernel_dilation=(1, 1),
                     input_dilation=(1, 1)):
  """Patches ``(N, H_out, W_out, k_h, k_w, C)`` of ``x (N, H, W, C)``, one loop per position."""
  x = np.asarray(x)
  n, h, w, c = x.shape
  kh, kw = kernel_size
  hd, wd = (h - 1) * input_dilation[0] + 1, (w - 1) * input_dilation[1] + 1
  xd = np.zeros((n, hd, wd, c), x.dtype)
  xd[:, ::input_dilation[0], ::input_dilation[1]] = x
  eff = ((kh - 1) * kernel_dilation[0] + 1, (kw - 1) * kernel_dilation[1] + 1)
  # (lax rejects string padding together with input dilation, so SAME/VALID see hd = h.)
  (plh, phh), (plw, phw) = same_or_explicit_pads((h, w), eff, strides, padding)
  ho = (hd + plh + phh - eff[0]) // strides[0] + 1
  wo = (wd + plw + phw - eff[1]) // strides[1] + 1
  patches = np.zeros((n, ho, wo, kh, kw, c), x.dtype)
  for i in range(ho):
    for j in range(wo):
      for a in range(kh):
        for b in range(kw):
          r = i * strides[0] + a * kernel_dilation[0] - plh
          q = j * strides[1] + b * kernel_dilation[1] - plw
          if 0 <= r < hd and 0 <= q < wd:
            patches[:, i, j, a, b, :] = xd[:, r, q, :]
  return patches
