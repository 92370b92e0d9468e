"""clip_by_weight_ratio: each kernel's step at most a share of its norm, in float64; and its
place in ``kaisa``'s chain (after the learning rate and momentum, the momentum left as it is)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax

import reference
from reference import randn
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)

pytestmark = pytest.mark.usefixtures("fast_compiles")


def _clipped(u, w, ratio, eps_rms=1e-2):
  """The clip by hand (NumPy, float64)."""
  if u.ndim < 2:
    return u
  limit = ratio * max(np.linalg.norm(w), eps_rms * np.sqrt(u.size))
  return u * min(1.0, limit / np.linalg.norm(u))


def test_kernels_are_clipped_to_their_share_and_the_rest_passes():
  params = {"dense": {"kernel": randn(0, (5, 3)), "bias": randn(1, (3,))},
            "conv": {"kernel": randn(2, (3, 3, 2, 4))},
            "head": {"kernel": np.zeros((4, 2))},
            "small": {"kernel": randn(3, (2, 2))}}
  updates = {"dense": {"kernel": 10.0 * randn(4, (5, 3)), "bias": 100.0 * randn(5, (3,))},
             "conv": {"kernel": randn(6, (3, 3, 2, 4))},
             "head": {"kernel": randn(7, (4, 2))},
             "small": {"kernel": 1e-3 * randn(8, (2, 2))}}
  tx = thor_optax.clip_by_weight_ratio(0.1)
  got, _ = jax.jit(tx.update)(updates, tx.init(params), params)
  want = jax.tree.map(lambda u, w: _clipped(u, w, 0.1), updates, params)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-13), got, want)
  for name in ("dense", "conv"):  # these two were clipped, to exactly their share
    np.testing.assert_allclose(np.linalg.norm(got[name]["kernel"]),
                               0.1 * np.linalg.norm(params[name]["kernel"]), rtol=1e-13)
  # A zero kernel steps by at most 0.1 * 1e-2 per entry (RMS); biases and small steps pass.
  np.testing.assert_allclose(np.linalg.norm(got["head"]["kernel"]), 1e-3 * np.sqrt(8), rtol=1e-13)
  np.testing.assert_array_equal(got["dense"]["bias"], updates["dense"]["bias"])
  np.testing.assert_array_equal(got["small"]["kernel"], updates["small"]["kernel"])


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(jnp.tanh(nn.Dense(6)(x)))


def test_kaisa_clips_the_step_after_momentum_and_keeps_the_momentum():
  model = _Mlp()
  x, y = jnp.asarray(randn(0, (8, 5))), jnp.asarray([0, 1, 2, 0, 1, 2, 1, 0])
  params = reference.init_params(model, x, seed=1)
  (_, grads), stats = reference.capture(model, reference.softmax_ce)(params, x, y)
  # A tiny damping and no KL clip: a long step, which the clip must shorten.
  make = lambda ratio: thor_optax.kaisa(1.0, 1e-8, max_kl=None, max_update_ratio=ratio)
  free, clipped = make(None), make(0.1)
  s_free, s_clip = free.init(params), clipped.init(params)
  for _ in range(2):  # two updates at the same point: the second one carries momentum
    u_free, s_free = free.update(grads, s_free, params, curvature_stats=stats)
    u_clip, s_clip = clipped.update(grads, s_clip, params, curvature_stats=stats)
    want = jax.tree.map(lambda u, w: _clipped(np.asarray(u), np.asarray(w), 0.1), u_free, params)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14),
                 u_clip, want)
    ratio = np.linalg.norm(u_free["Dense_0"]["kernel"]) / np.linalg.norm(
        params["Dense_0"]["kernel"])
    assert ratio > 1.0  # the unclipped step is longer than the kernel
  jax.tree.map(np.testing.assert_array_equal, optax.tree_utils.tree_get(s_clip, "trace"),
               optax.tree_utils.tree_get(s_free, "trace"))


@pytest.mark.parametrize("ratio", [0.0, -0.1, float("inf"), float("nan")])
def test_a_ratio_that_cannot_clip_is_rejected(ratio):
  with pytest.raises(ValueError, match="clip_by_weight_ratio: max_ratio must be finite and > 0"):
    thor_optax.kaisa(0.1, max_update_ratio=ratio)


def test_the_clip_needs_the_parameters():
  tx = thor_optax.clip_by_weight_ratio(0.1)
  with pytest.raises(ValueError, match="clip_by_weight_ratio needs the parameters"):
    tx.update({"k": jnp.ones((2, 2))}, tx.init(None))
