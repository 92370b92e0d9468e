"""A small pre-norm transformer LM through the capture: tied embedding, causal bias-less
attention, MLP, RMSNorm and LayerNorm. Every parameter is preconditioned (none listed), the
optimizer's state holds curvature for every layer, and a few THOR steps lower the loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
import thor_optax.flax

import reference

pytestmark = pytest.mark.usefixtures("fast_compiles")

VOCAB, WIDTH, HEADS, N, T = 11, 8, 2, 4, 6


class Block(nn.Module):
  """Pre-norm block: RMSNorm, causal attention without biases, LayerNorm, MLP."""

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = nn.RMSNorm(name="norm_attn")(x)
    x = x + nn.MultiHeadDotProductAttention(HEADS, use_bias=False, name="attn")(h, mask=mask)
    h = nn.LayerNorm(name="norm_mlp")(x)
    return x + nn.Dense(WIDTH, name="mlp_out")(nn.gelu(nn.Dense(2 * WIDTH, name="mlp_in")(h)))


class TinyLM(nn.Module):

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(VOCAB, WIDTH, name="embed")
    x = Block(name="block")(embed(ids))
    return embed.attend(nn.LayerNorm(name="norm_f")(x))


def _loss(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_every_parameter_of_a_tiny_transformer_is_preconditioned():
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, VOCAB, (N, T)))
  y = jnp.roll(ids, -1, axis=1)
  model = TinyLM()
  params = model.init(jax.random.PRNGKey(0), ids)["params"]
  capture = thor_optax.flax.value_and_grad_with_stats(model, _loss)
  _, stats = jax.eval_shape(capture, params, ids, y)
  assert stats.unhandled == ()
  modules = {"/".join(str(k.key) for k in path[:-1])
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
  assert set(thor_optax.captured_layers(stats).kinds) == modules
  tx = thor_optax.thor(0.05, 0.03, block_size=8, layers=thor_optax.captured_layers(stats))
  _, opt_state, losses = reference.train_with_capture(capture, tx, params, ids, y, steps=8)
  blocked = reference.refreshed_layers(opt_state)
  state = reference.kronecker_state(opt_state)
  unitwise = {name for name, side in state.layers.items() if hasattr(side, "inverse")
              and not np.allclose(side.inverse, np.eye(2))}
  assert blocked | unitwise == modules, modules - blocked - unitwise
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
