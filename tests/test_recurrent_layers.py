"""Layers whose one set of weights a lifted loop applies at every iteration: recurrent cells under
``nn.RNN`` / ``nn.scan`` / ``nnx.RNN`` / ``nnx.scan``, and layers broadcast into ``nn.vmap`` /
``nnx.vmap``, are captured with K-FAC-reduce over the iterations (``step_sharing.py``).

References (float64): a recurrent network unrolled by hand in plain JAX, with a zero
perturbation per time step on each dense output, gives every step's input ``a_t`` and output
cotangent ``g_t``; K-FAC-reduce's statistics are ``a_bar = (1/T) sum_t a_t`` and
``g_hat = sqrt(N / M) sum_t M dL/dy_t`` (Eschenhagen et al., NeurIPS 2023, section 3.2), for
a loss per sequence (``M = N``) and a loss per position (``M = N T``). A layer broadcast into a
vmap over the sequence axis equals the same layer applied to the sequence with
``weight_sharing='reduce'``.
"""

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
import thor_optax.flax
import thor_optax.nnx

import reference

pytestmark = pytest.mark.usefixtures("fast_compiles")


@pytest.fixture(autouse=True, scope="module")
def _float64():
  """float64 for this module's tests only (a ``jax.config.update`` at import leaked into every test
  collected after it, in the whole run)."""
  with jax.enable_x64(True):
    yield

N, T, F, H, K = 5, 6, 2, 4, 3


def softmax_ce(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class LinenRNN(nn.Module):
  """``nn.RNN(nn.SimpleCell)``: ``h_t = tanh(x_t W_i + b_i + h_{t-1} W_h)``, then a head on the
  last state (``per_position=False``) or on every state."""

  per_position: bool = False

  @nn.compact
  def __call__(self, x):
    hs = nn.RNN(nn.SimpleCell(H, param_dtype=jnp.float64), name="rnn")(x)
    head = nn.Dense(K, param_dtype=jnp.float64, name="head")
    return head(hs) if self.per_position else head(hs[:, -1])


class LinenScan(nn.Module):
  """The same network written as older public code does: ``nn.scan`` over the cell class with
  ``variable_broadcast='params'``."""

  per_position: bool = False

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(nn.SimpleCell, variable_broadcast="params", split_rngs={"params": False},
                   in_axes=1, out_axes=1)
    _, hs = scan(H, param_dtype=jnp.float64, name="cell")(jnp.zeros((x.shape[0], H)), x)
    head = nn.Dense(K, param_dtype=jnp.float64, name="head")
    return head(hs) if self.per_position else head(hs[:, -1])


class NNXRNN(nnx.Module):
  """``nnx.RNN(nnx.SimpleCell)`` with the same head."""

  def __init__(self, per_position: bool, rngs: nnx.Rngs):
    self.per_position = per_position
    self.rnn = nnx.RNN(nnx.SimpleCell(F, H, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs))
    self.head = nnx.Linear(H, K, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    hs = self.rnn(x)
    return self.head(hs) if self.per_position else self.head(hs[:, -1])


def data(per_position):
  x = jax.random.normal(jax.random.key(0), (N, T, F), jnp.float64)
  y = jax.random.randint(jax.random.key(1), (N, T) if per_position else (N,), 0, K)
  return x, y


def unrolled_reduce_stats(w, x, y, per_position):
  """``{'i': (a_bar, g_hat), 'h': (a_bar, g_hat)}`` of the hand-unrolled network with weights
  ``w = (W_i, b_i, W_h, W_head, b_head)``."""
  wi, bi, wh, wo, bo = w

  def loss(pi, ph):
    h, xs_i, xs_h, hs = jnp.zeros((N, H)), [], [], []
    for t in range(T):
      xs_i.append(x[:, t])
      xs_h.append(h)
      h = jnp.tanh(x[:, t] @ wi + bi + pi[t] + h @ wh + ph[t])
      hs.append(h)
    hs = jnp.stack(hs, 1)
    out = hs @ wo + bo
    return softmax_ce(out if per_position else out[:, -1], y), (xs_i, xs_h)

  zeros = jnp.zeros((T, N, H))
  (_, (xs_i, xs_h)), (gi, gh) = jax.value_and_grad(loss, (0, 1), has_aux=True)(zeros, zeros)
  m = N * T if per_position else N
  scale = m * np.sqrt(N / m)
  return {"i": (jnp.stack(xs_i).mean(0), (gi.sum(0) * scale)[None]),
          "h": (jnp.stack(xs_h).mean(0), (gh.sum(0) * scale)[None])}


def linen_stats(model_cls, per_position):
  x, y = data(per_position)
  model = model_cls(per_position)
  params = model.init(jax.random.key(2), x)["params"]
  capture = thor_optax.flax.value_and_grad_with_stats(model, softmax_ce)
  _, stats = jax.jit(capture)(params, x, y)
  cell_name = next(k for k in params if k != "head")
  cell = params[cell_name]
  cell = cell.get("cell", cell)  # nn.RNN names its cell's scope
  w = (cell["i"]["kernel"], cell["i"]["bias"], cell["h"]["kernel"],
       params["head"]["kernel"], params["head"]["bias"])
  got = stats.layers[cell_name]
  got = got.get("cell", got)
  return stats, {"i": got["i"], "h": got["h"]}, w, x, y


def nnx_stats(per_position):
  x, y = data(per_position)
  model = NNXRNN(per_position, nnx.Rngs(2))
  _, stats = nnx.jit(thor_optax.nnx.value_and_grad_with_stats(softmax_ce))(model, x, y)
  c = model.rnn.cell
  w = (c.dense_i.kernel[...], c.dense_i.bias[...], c.dense_h.kernel[...],
       model.head.kernel[...], model.head.bias[...])
  got = stats.layers["rnn"]["cell"]
  return stats, {"i": got["dense_i"], "h": got["dense_h"]}, w, x, y


@pytest.mark.parametrize("per_position", [False, True], ids=["per_sequence", "per_position"])
@pytest.mark.parametrize("frontend", ["nn.RNN", "nn.scan", "nnx.RNN"])
def test_recurrent_cell_statistics_are_k_fac_reduce_of_the_unrolled_network(frontend,
                                                                             per_position):
  if frontend == "nnx.RNN":
    stats, got, w, x, y = nnx_stats(per_position)
  else:
    stats, got, w, x, y = linen_stats(LinenRNN if frontend == "nn.RNN" else LinenScan,
                                      per_position)
  assert stats.unhandled == ()
  want = unrolled_reduce_stats(w, x, y, per_position)
  for name in ("i", "h"):
    assert got[name].inputs.shape == (N, want[name][0].shape[-1])
    np.testing.assert_allclose(got[name].inputs, want[name][0], rtol=0, atol=1e-13)
    np.testing.assert_allclose(got[name].cotangents, want[name][1], rtol=0, atol=1e-13)
    assert float(jnp.abs(want[name][1]).max()) > 0.1  # the check can fail


def test_expand_lists_a_recurrent_cell_with_the_reason():
  x, y = data(False)
  model = LinenRNN()
  params = model.init(jax.random.key(2), x)["params"]
  capture = thor_optax.flax.value_and_grad_with_stats(model, softmax_ce, weight_sharing="expand")
  _, stats = jax.eval_shape(capture, params, x, y)
  assert set(stats.layers) == {"head"}
  notes = [u for u in stats.unhandled if u.startswith("SimpleCell_0/")]
  assert len(notes) == 2
  assert all("nn.scan" in u and "weight_sharing='auto' or 'reduce'" in u for u in notes)


class LinenMapped(nn.Module):
  """A dense layer broadcast into ``nn.vmap`` over the sequence axis (``mapped=True``), or the
  same layer applied to the sequence directly."""

  mapped: bool

  @nn.compact
  def __call__(self, x):
    if self.mapped:
      dense = nn.vmap(nn.Dense, variable_axes={"params": None}, split_rngs={"params": False},
                      in_axes=1, out_axes=1)
      h = dense(H, param_dtype=jnp.float64, name="dense")(x)
    else:
      h = nn.Dense(H, param_dtype=jnp.float64, name="dense")(x)
    return nn.Dense(K, param_dtype=jnp.float64, name="head")(jnp.tanh(h).mean(1))


class NNXMapped(nnx.Module):
  """A layer broadcast into ``nnx.vmap`` over the sequence axis (``mapped=True``), or applied
  to the sequence directly."""

  def __init__(self, mapped: bool, rngs: nnx.Rngs):
    self.mapped = mapped
    self.dense = nnx.Linear(F, H, param_dtype=jnp.float64, rngs=rngs)
    self.head = nnx.Linear(H, K, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    if self.mapped:
      h = nnx.vmap(lambda m, v: m(v), in_axes=(None, 1), out_axes=1)(self.dense, x)
    else:
      h = self.dense(x)
    return self.head(jnp.tanh(h).mean(1))


@pytest.mark.parametrize("frontend", ["nn.vmap", "nnx.vmap"])
def test_layer_broadcast_into_vmap_equals_reduce_over_the_mapped_axis(frontend):
  x, y = data(False)
  if frontend == "nn.vmap":
    params = LinenMapped(False).init(jax.random.key(2), x)["params"]
    (_, grads), got = thor_optax.flax.value_and_grad_with_stats(LinenMapped(True), softmax_ce)(
        params, x, y)
    (_, grads_ref), want = thor_optax.flax.value_and_grad_with_stats(
        LinenMapped(False), softmax_ce, weight_sharing="reduce")(params, x, y)
  else:
    capture = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)
    (_, grads), got = capture(NNXMapped(True, nnx.Rngs(2)), x, y)
    (_, grads_ref), want = thor_optax.nnx.value_and_grad_with_stats(
        softmax_ce, weight_sharing="reduce")(NNXMapped(False, nnx.Rngs(2)), x, y)
  assert got.unhandled == ()
  for a, b in zip(jax.tree.leaves((got.layers, grads)), jax.tree.leaves((want.layers, grads_ref))):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)
  assert got.layers["dense"].inputs.shape == (N, F)


class NNXCellScan(nnx.Module):
  """A cell broadcast into ``nnx.scan`` written by hand (``in_axes=(None, nnx.Carry, 1)``)."""

  def __init__(self, rngs: nnx.Rngs):
    self.cell = nnx.Linear(H, H, param_dtype=jnp.float64, rngs=rngs)
    self.head = nnx.Linear(H, K, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, xs):
    @nnx.scan(in_axes=(None, nnx.Carry, 1), out_axes=(nnx.Carry, 1))
    def step(cell, h, x):
      h = jnp.tanh(cell(h) + x)
      return h, h

    _, hs = step(self.cell, jnp.zeros(xs.shape[:1] + (H,)), xs)
    return self.head(hs)


def test_thor_trains_recurrent_networks_with_every_layer_preconditioned():
  """Linen ``nn.RNN(nn.LSTMCell)``: nothing listed, every gate refreshed, loss falls under THOR;
  a hand-written ``nnx.scan`` cell with a per-position loss is captured too."""
  x = jax.random.normal(jax.random.key(0), (16, T, H), jnp.float64)
  y = jax.random.randint(jax.random.key(1), (16,), 0, K)

  class LSTM(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.RNN(nn.LSTMCell(8, param_dtype=jnp.float64), name="rnn")(x)
      return nn.Dense(K, param_dtype=jnp.float64, name="head")(h[:, -1])

  model = LSTM()
  params = model.init(jax.random.key(2), x)["params"]
  capture = thor_optax.flax.value_and_grad_with_stats(model, softmax_ce)
  assert jax.eval_shape(capture, params, x, y)[1].unhandled == ()
  _, opt_state, losses = reference.train_with_capture(capture, thor_optax.thor(0.1, 0.03),
                                                     params, x, y, steps=8)
  refreshed = reference.refreshed_layers(opt_state)
  gates = {f"LSTMCell_0/{g}" for g in ("ii", "if", "ig", "io", "hi", "hf", "hg", "ho")}
  assert refreshed == gates | {"head"}, refreshed
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses

  xs = jax.random.normal(jax.random.key(3), (N, T, H), jnp.float64)
  ys = jax.random.randint(jax.random.key(4), (N, T), 0, K)
  model = NNXCellScan(nnx.Rngs(0))
  _, stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(model, xs, ys)
  assert stats.unhandled == ()
  assert stats.layers["cell"].inputs.shape == (N, H)
  # K-FAC-reduce over the steps: the cell's inputs h_0 .. h_{T-1} averaged (before, after a
  # change of the discovery pass's arguments, the zeros of its channel, and exact rows).
  h, inputs = jnp.zeros((N, H)), []
  for t in range(T):
    inputs.append(h)
    h = jnp.tanh(model.cell(h) + xs[:, t])
  np.testing.assert_allclose(stats.layers["cell"].inputs, jnp.stack(inputs).mean(0), rtol=0,
                             atol=1e-14)
  assert stats.exact_rows == ("head",)
