"""rescale_weight_norms: kernel norms capped at sqrt(2 d_out), everything else untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax


def _params_and_updates():
  rng = np.random.default_rng(0)
  normal = lambda scale, shape: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
  params = {
      "Dense_0": {"kernel": normal(1.0, (4, 3)), "bias": jnp.ones((3,))},
      "Conv_0": {"kernel": normal(1.0, (3, 3, 2, 5)), "bias": jnp.ones((5,))},
      "Small": {"kernel": normal(0.01, (6, 8))},
      "BatchNorm_0": {"scale": jnp.full((5,), 7.0), "bias": jnp.full((5,), 9.0)},
      "Embed_0": {"embedding": normal(10.0, (10, 4))},
      "Odd": {"kernel": jnp.full((3,), 50.0)},  # rank-1 'kernel': not a weight matrix
  }
  updates = jax.tree_util.tree_map(jnp.ones_like, params)
  updates["Dense_0"]["kernel"] = normal(3.0, (4, 3))
  updates["Conv_0"]["kernel"] = normal(2.0, (3, 3, 2, 5))
  updates["Small"]["kernel"] = normal(0.01, (6, 8))
  return params, updates


def _norm(x):
  return float(np.sqrt(np.sum(np.asarray(x, np.float64) ** 2)))


def test_kernels_above_the_cap_land_on_it():
  params, updates = _params_and_updates()
  tx = thor_optax.rescale_weight_norms()
  new_updates, state = tx.update(updates, tx.init(params), params)
  assert isinstance(state, optax.EmptyState)
  new = optax.apply_updates(params, new_updates)
  for name, d_out in (("Dense_0", 3), ("Conv_0", 5)):  # conv HWIO: d_out = shape[-1]
    w = params[name]["kernel"] + updates[name]["kernel"]
    assert _norm(w) > np.sqrt(2 * d_out) * 1.5, "test setup: the kernel must exceed the cap"
    np.testing.assert_allclose(_norm(new[name]["kernel"]), np.sqrt(2 * d_out), rtol=1e-6)
    # Same direction as param + update.
    np.testing.assert_allclose(new[name]["kernel"], w * (np.sqrt(2 * d_out) / _norm(w)),
                               rtol=1e-5, atol=1e-6)
  # Below the cap (norm ~0.1 < 4): untouched, bit for bit.
  np.testing.assert_array_equal(new_updates["Small"]["kernel"], updates["Small"]["kernel"])
  # Biases, normalization parameters, embeddings and rank-1 'kernel' leaves: untouched.
  for name, leaf in (("Dense_0", "bias"), ("Conv_0", "bias"), ("BatchNorm_0", "scale"),
                     ("BatchNorm_0", "bias"), ("Embed_0", "embedding"), ("Odd", "kernel")):
    np.testing.assert_array_equal(new_updates[name][leaf], updates[name][leaf])


def test_custom_max_norm_gets_the_shape():
  params, updates = _params_and_updates()
  shapes = []

  def max_norm(shape):
    shapes.append(shape)
    return 0.5 * shape[-2]

  tx = thor_optax.rescale_weight_norms(max_norm)
  new = optax.apply_updates(params, tx.update(updates, tx.init(params), params)[0])
  assert sorted(shapes) == sorted([(4, 3), (3, 3, 2, 5), (6, 8)])
  np.testing.assert_allclose(_norm(new["Dense_0"]["kernel"]), 2.0, rtol=1e-6)
  np.testing.assert_allclose(_norm(new["Conv_0"]["kernel"]), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(new["Small"]["kernel"],
                                params["Small"]["kernel"] + updates["Small"]["kernel"])


def test_non_positive_cap_is_rejected():
  params, updates = _params_and_updates()
  tx = thor_optax.rescale_weight_norms(lambda shape: 0.0)
  with pytest.raises(ValueError, match="positive"):
    tx.update(updates, tx.init(params), params)


def test_params_are_required():
  params, updates = _params_and_updates()
  tx = thor_optax.rescale_weight_norms()
  with pytest.raises(ValueError, match="pass params"):
    tx.update(updates, tx.init(params))


def test_jit_and_chain_match_eager():
  params, updates = _params_and_updates()
  tx = thor_optax.rescale_weight_norms()
  eager, _ = tx.update(updates, tx.init(params), params)
  jitted, _ = jax.jit(tx.update)(updates, tx.init(params), params)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
                         eager, jitted)
  # Last in a chain: the SGD step is what gets rescaled.
  grads = jax.tree_util.tree_map(lambda u: -10.0 * u, updates)  # sgd(0.1): update = -0.1 g
  chain = optax.chain(optax.sgd(0.1), tx)
  chained, _ = jax.jit(chain.update)(grads, chain.init(params), params)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                         chained, eager)


def test_non_finite_kernel_is_left_alone_and_dtype_kept():
  params = {"d": {"kernel": jnp.ones((2, 2), jnp.bfloat16)},
            "e": {"kernel": jnp.ones((2, 2))}}
  updates = {"d": {"kernel": jnp.full((2, 2), 9.0, jnp.bfloat16)},
             "e": {"kernel": jnp.array([[jnp.inf, 0.0], [0.0, 0.0]])}}
  tx = thor_optax.rescale_weight_norms()
  new_updates, _ = jax.jit(tx.update)(updates, tx.init(params), params)
  assert new_updates["d"]["kernel"].dtype == jnp.bfloat16
  new = optax.apply_updates(params, new_updates)
  np.testing.assert_allclose(_norm(new["d"]["kernel"]), 2.0, rtol=1e-2)  # bf16 rounding
  np.testing.assert_array_equal(new_updates["e"]["kernel"], updates["e"]["kernel"])


def test_a_stack_of_layers_is_capped_layer_by_layer():
  """An ``nn.scan`` stack's kernel ``(L, d_in, d_out)``: each layer at ``sqrt(2 d_out)`` on its
  own, as unrolled (before, the stack was not claimed and no layer was capped)."""
  rng = np.random.default_rng(1)
  kernel = rng.standard_normal((3, 4, 6)) * np.asarray([3.0, 0.1, 2.0])[:, None, None]
  params = {"layers": {"Dense_0": {"kernel": jnp.asarray(kernel, jnp.float32),
                                   "bias": jnp.zeros((3, 6))}}}
  updates = jax.tree_util.tree_map(jnp.zeros_like, params)
  new_updates, _ = thor_optax.rescale_weight_norms().update(updates, None, params)
  new = np.asarray(params["layers"]["Dense_0"]["kernel"]
                   + new_updates["layers"]["Dense_0"]["kernel"])
  cap = np.sqrt(2 * 6)
  assert _norm(kernel[0]) > 1.5 * cap and _norm(kernel[2]) > 1.5 * cap > 5 * _norm(kernel[1])
  for i in (0, 2):
    np.testing.assert_allclose(_norm(new[i]), cap, rtol=1e-6)
    np.testing.assert_allclose(new[i], kernel[i] * cap / _norm(kernel[i]), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(new_updates["layers"]["Dense_0"]["kernel"][1], 0.0)
