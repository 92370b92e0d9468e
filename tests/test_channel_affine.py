"""Normalization layers of no Flax class (the ``'channel_affine'`` kind): the RMS and layer norms
model libraries write themselves, recognised from their traced call ``x_hat * (scale + c) +
(bias + c')``, preconditioned as the ``'norm'`` kind preconditions Flax's.

References (float64): the per-example gradients of the layer's vectors from ``jax.vmap`` of
``jax.grad`` over one-example batches, the per-channel 2x2 (or 1x1) damped Fisher built from them
and solved by ``numpy``; and, for a scanned stack, the same model written with ``nn.RMSNorm``.
Calls that are not such a map are listed with the reason.
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
from thor_optax import flax as thor_linen
from thor_optax import nnx as thor_nnx

import reference
from reference import F64, init_params, randn, squared_error
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)

pytestmark = pytest.mark.usefixtures("fast_compiles")

TIGHT = dict(rtol=1e-10, atol=1e-12)
LAM = 0.05
C = 4
EPS = 1e-6
_init = nn.initializers.normal(0.3)


def _rms(x):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + EPS)


class GemmaRMSNorm(nn.Module):
  """Gemma's: ``x / rms(x) * (1 + scale)``, the scale expanded over the leading axes."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", _init, (x.shape[-1],))
    return _rms(x) * (1 + jnp.expand_dims(scale, axis=range(x.ndim - 1)))


class LlamaRMSNorm(nn.Module):
  """Hugging Face's Flax Llama: leaf ``weight``, ``weight * x_hat`` after a cast round trip."""

  def setup(self):
    self.weight = self.param("weight", _init, (C,))

  def __call__(self, hidden_states):
    variance = jnp.power(jnp.asarray(hidden_states, jnp.float32), 2).mean(-1, keepdims=True)
    hidden_states = hidden_states / jnp.sqrt(variance.astype(hidden_states.dtype) + EPS)
    return self.weight * jnp.asarray(hidden_states, F64)


class T5LayerNorm(nn.Module):
  """T5's: scale only, the input cast first, the scale cast to the computation dtype."""
  dtype: jnp.dtype = F64

  @nn.compact
  def __call__(self, x):
    x = jnp.asarray(x, jnp.float64)
    scale = self.param("scale", _init, (x.shape[-1],))
    return _rms(x).astype(self.dtype) * jnp.asarray(scale, self.dtype)


class MaxTextRMSNorm(nn.Module):
  """MaxText's: a logically partitioned (boxed) scale, ``y * scale`` after casts."""

  @nn.compact
  def __call__(self, x):
    x = jnp.asarray(x, jnp.float64)
    y = jnp.asarray(x * jax.lax.rsqrt(jnp.mean(jax.lax.square(x), -1, keepdims=True) + EPS), F64)
    scale = self.param("scale", nn.with_logical_partitioning(_init, ("norm",)), (x.shape[-1],),
                       F64)
    return y * jnp.asarray(scale, F64)


class HandLayerNorm(nn.Module):
  """A tutorial's layer norm: ``gamma * (x - mean) / std + beta``."""

  @nn.compact
  def __call__(self, x):
    gamma = self.param("gamma", _init, (x.shape[-1],))
    beta = self.param("beta", _init, (x.shape[-1],))
    mean = x.mean(-1, keepdims=True)
    return gamma * (x - mean) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5) + beta


class LayerScale(nn.Module):
  """CaiT's / DeiT-III's ``gamma * x`` (no normalization at all)."""

  @nn.compact
  def __call__(self, x):
    return x * self.param("gamma", _init, (x.shape[-1],))


class Shift(nn.Module):
  """A learned shift per channel, ``x + offset`` (no scale)."""

  @nn.compact
  def __call__(self, x):
    return x + self.param("offset", _init, (x.shape[-1],))


class ChannelsFirst(nn.Module):
  """A scale over axis 1 of a channels-first ``(N, C, T)`` activation, ``scale[:, None]``."""

  @nn.compact
  def __call__(self, x):
    x = jnp.swapaxes(x, 1, 2)
    return jnp.swapaxes(x * self.param("scale", _init, (x.shape[1],))[:, None], 1, 2)


class SharedGain(nn.Module):
  """One gain shared by every channel, ``(1,)``: one entry over all positions and channels."""

  @nn.compact
  def __call__(self, x):
    return _rms(x) * self.param("gain", _init, (1,))


class AddPositionEmbs(nn.Module):
  """Google's vision transformer's: a learned ``(1, T, D)`` position embedding added to the
  patch embeddings (one entry per position and channel, shared by the examples)."""

  @nn.compact
  def __call__(self, inputs):
    pe = self.param("pos_embedding", _init, (1, inputs.shape[1], inputs.shape[2]))
    return inputs + pe


class LayerNormOneC(nn.Module):
  """A layer norm whose ``scale`` and ``bias`` are stored ``(1, C)``: not the ``'norm'`` kind's
  ``(C,)`` layout, so ``ChannelAffineStats`` (before: ``NormStats`` no layout took)."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", _init, (1, x.shape[-1]))
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5) * scale + self.param(
        "bias", _init, (1, x.shape[-1]))


class ShiftNamedScale(nn.Module):
  """A shift whose leaf is named ``scale``: the ``'norm'`` kind would read it as a scale from its
  name, so it needs the capture's layout (a ``ValueError`` says so)."""

  @nn.compact
  def __call__(self, x):
    return x + self.param("scale", _init, (x.shape[-1],))


# name: (module class, stats type, the leaves named (scale, bias) as the kind reads them)
LINEN = {
    "gemma": (GemmaRMSNorm, "NormStats", ("scale", None)),
    "llama": (LlamaRMSNorm, "ChannelAffineStats", ("weight", None)),
    "t5": (T5LayerNorm, "NormStats", ("scale", None)),
    "maxtext": (MaxTextRMSNorm, "NormStats", ("scale", None)),
    "layer_norm": (HandLayerNorm, "ChannelAffineStats", ("gamma", "beta")),
    "layer_scale": (LayerScale, "ChannelAffineStats", ("gamma", None)),
    "shift": (Shift, "ChannelAffineStats", (None, "offset")),
    "shift_named_scale": (ShiftNamedScale, "ChannelAffineStats", (None, "scale")),
    "channels_first": (ChannelsFirst, "NormStats", ("scale", None)),
    "shared_gain": (SharedGain, "ChannelAffineStats", ("gain", None)),
    "position_embedding": (AddPositionEmbs, "ChannelAffineStats", (None, "pos_embedding")),
    "layer_norm_1c": (LayerNormOneC, "ChannelAffineStats", ("scale", "bias")),
}


class LinenNet(nn.Module):
  """``Dense(C) -> norm -> tanh -> mean over positions -> Dense(3)`` (``swap``: the norm's
  output is time-major, swapped back after it)."""
  norm: type
  swap: bool = False

  @nn.compact
  def __call__(self, x):
    h = self.norm(name="norm")(nn.Dense(C, name="dense_in")(x))
    h = jnp.swapaxes(h, 0, 1) if self.swap else h
    return nn.Dense(3, name="head")(jnp.tanh(h).mean(1))


def _data():
  return jnp.asarray(randn(1, (5, 3, 2))), jnp.asarray(randn(2, (5, 3)))


def _leaf(x):
  return np.asarray(x[...] if isinstance(x, nnx.Variable) else nn.meta.unbox(x))


def _reference(per, grads, names, n):
  """``{leaf: update}`` per entry ``c`` of the vectors: ``(F_c + lambda I)^-1 g_c`` with
  ``F_c`` the 2x2 Fisher of the per-example gradients ``per`` of ``(scale, bias)``, a missing
  leaf's taken as zeros (so a scale alone gets ``g_s / (F_ss + lambda)``)."""
  shape = _leaf(grads[next(k for k in names if k)]).shape
  size = int(np.prod(shape))
  v = np.stack([_leaf(per[k]).reshape(n, size) if k else np.zeros((n, size)) for k in names],
               -1)  # (N, C, 2)
  fisher = np.einsum("nci,ncj->cij", v, v) / n
  g = np.stack([_leaf(grads[k]).reshape(size) if k else np.zeros(size) for k in names], -1)
  want = np.stack([np.linalg.solve(fisher[c] + LAM * np.eye(2), g[c]) for c in range(size)])
  return {k: want[:, i].reshape(shape) for i, k in enumerate(names) if k}


def _check(stats, updates, grads, per, names, stats_type, n):
  layer = stats.layers["norm"]
  assert type(layer).__name__ == stats_type
  for k, field in zip(names, ("scale_grads", "bias_grads")):
    got = np.asarray(getattr(layer, field)[0])
    if k is None:
      np.testing.assert_array_equal(got, 0.0)
    else:
      assert np.abs(_leaf(per[k])).max() > 1e-3  # the comparison is not between zeros
      np.testing.assert_allclose(got, _leaf(per[k]).reshape(got.shape), **TIGHT)
  want = _reference(per, grads, names, n)
  assert set(updates) == set(want)
  for k, value in want.items():
    assert np.abs(_leaf(updates[k]) - _leaf(grads[k])).max() > 1e-3  # preconditioned
    np.testing.assert_allclose(_leaf(updates[k]), value, **TIGHT)


@pytest.mark.parametrize("captured", [True, False], ids=["captured_layout", "from_shapes"])
@pytest.mark.parametrize("case", sorted(LINEN))
def test_linen_norms_of_their_own_get_the_unit_wise_natural_gradient(case, captured):
  cls, stats_type, names = LINEN[case]
  model = LinenNet(cls)
  x, y = _data()
  params = init_params(model, x)
  capture = thor_linen.value_and_grad_with_stats(model, squared_error)
  _, shapes = jax.eval_shape(capture, params, x, y)
  layers = thor_optax.captured_layers(shapes) if captured else None
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None, layers=layers)

  def loss_one(norm, xn, yn):
    return squared_error(model.apply({"params": {**params, "norm": norm}}, xn[None]), yn[None])

  @jax.jit
  def run(params, x, y):
    (_, grads), stats = capture(params, x, y)
    updates = tx.update(grads, tx.init(params), params, curvature_stats=stats)[0]
    per = jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))(params["norm"], x, y)
    return stats, updates, grads, per

  if not captured and case == "shift_named_scale":  # the 'norm' kind reads 'scale' by name
    with pytest.raises(ValueError, match=r"captured_layers\(stats\)"):
      run(params, x, y)
    return
  stats, updates, grads, per = run(params, x, y)
  assert stats.unhandled == ()
  assert set(stats.layers) == {"dense_in", "norm", "head"}
  _check(stats, updates["norm"], grads["norm"], per, names, stats_type, x.shape[0])


class NnxGemmaRMSNorm(nnx.Module):
  """The RMS norm of Flax's NNX Gemma example: ``nnx.Param`` scale, ``(1 + scale)``."""

  def __init__(self, dim, rngs):
    self.scale = nnx.Param(0.3 * jax.random.normal(rngs.params(), (dim,), F64))

  def __call__(self, x):
    return _rms(x) * (1 + self.scale[...])


class NnxLayerNorm(nnx.Module):
  """A hand-written NNX layer norm with leaves ``w``, ``b``."""

  def __init__(self, dim, rngs):
    self.w = nnx.Param(1 + 0.3 * jax.random.normal(rngs.params(), (dim,), F64))
    self.b = nnx.Param(0.3 * jax.random.normal(rngs.params(), (dim,), F64))

  def __call__(self, x):
    centred = x - x.mean(-1, keepdims=True)
    return centred * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5) * self.w[...] + self.b[...]


class NnxNet(nnx.Module):

  def __init__(self, norm, rngs):
    self.dense_in = nnx.Linear(2, C, param_dtype=F64, rngs=rngs)
    self.norm = norm(C, rngs)
    self.head = nnx.Linear(C, 3, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.norm(self.dense_in(x))).mean(1))


@pytest.mark.parametrize("captured", [True, False], ids=["captured_layout", "from_shapes"])
@pytest.mark.parametrize("norm,stats_type,names", [
    (NnxGemmaRMSNorm, "NormStats", ("scale", None)),
    (NnxLayerNorm, "ChannelAffineStats", ("w", "b"))], ids=["gemma", "layer_norm"])
def test_nnx_norms_of_their_own_get_the_unit_wise_natural_gradient(norm, stats_type, names,
                                                                    captured):
  model = NnxNet(norm, nnx.Rngs(0))
  x, y = _data()
  capture = thor_nnx.value_and_grad_with_stats(squared_error)
  _, shapes = nnx.eval_shape(lambda m: capture(m, x, y), model)
  tx = thor_optax.scale_by_thor(LAM, trace_thresholds=(0.0, 0.0),
                                layers=thor_optax.captured_layers(shapes) if captured else None)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_one(p, xn, yn):
    return squared_error(nnx.merge(graphdef, p, rest, copy=True)(xn[None]), yn[None])

  @nnx.jit
  def run(model, x, y):
    (_, grads), stats = capture(model, x, y)
    params = nnx.state(model, nnx.Param)
    updates = tx.update(grads, tx.init(params), params, curvature_stats=stats)[0]
    per = jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))(params, x, y)
    return stats, updates, grads, per

  stats, updates, grads, per = run(model, x, y)
  assert stats.unhandled == ()
  assert set(stats.layers) == {"dense_in", "norm", "head"}
  _check(stats, updates["norm"], grads["norm"], per["norm"], names, stats_type, x.shape[0])


# The norm of the scanned model: one of its own, or the Flax class it equals.
NORMS = {"gemma": lambda name: GemmaRMSNorm(name=name),
         "flax_rms": lambda name: nn.RMSNorm(EPS, name=name, param_dtype=F64),
         "hand_ln": lambda name: HandLayerNorm(name=name),
         "flax_ln": lambda name: nn.LayerNorm(1e-5, name=name, param_dtype=F64)}


class Block(nn.Module):
  """A pre-norm residual MLP block, ``(carry, _) -> (carry, None)``."""
  norm: str

  @nn.compact
  def __call__(self, h, _):
    return h + nn.Dense(C, name="mlp")(jnp.tanh(NORMS[self.norm]("norm")(h))), None


class Scanned(nn.Module):
  """``nn.scan(nn.remat(Block))`` over two blocks, then a norm and a head."""
  norm: str = "gemma"

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=2)
    h, _ = stack(self.norm, name="blocks")(nn.Dense(C, name="dense_in")(x), None)
    return nn.Dense(3, name="head")(NORMS[self.norm]("final")(h).mean(1))


def _as_flax(tree, norm, offset):
  """The own-norm model's leaves as the Flax-norm model's: Gemma's scale plus ``offset`` (1 for
  parameters, 0 for updates), or ``gamma`` / ``beta`` renamed ``scale`` / ``bias``."""
  def convert(node, under_norm=False):
    if not isinstance(node, dict):
      return node + offset if under_norm and norm == "gemma" else node
    names = {"gamma": "scale", "beta": "bias"} if under_norm else {}
    return {names.get(k, k): convert(v, under_norm or k in ("norm", "final"))
            for k, v in node.items()}
  return convert(tree)


@pytest.mark.parametrize("make", ["thor", "kfac"])
@pytest.mark.parametrize("norm,flax_norm", [("gemma", "flax_rms"), ("hand_ln", "flax_ln")])
def test_scanned_norms_of_their_own_equal_flax_norms(norm, flax_norm, make):
  """Norms inside a scanned, rematerialized stack (statistics per layer of the stack): the
  update of Gemma's ``scale`` equals ``nn.RMSNorm``'s for ``scale + 1``, a hand-written layer
  norm's ``nn.LayerNorm``'s, with the aliases and the capture's layout (before, the stack of
  hand-written norms, whose statistics name ``gamma`` / ``beta``, was taken for one layer of
  stacked shapes and raised)."""
  x, y = _data()
  params = init_params(Scanned(norm), x)
  tx = {"thor": lambda layers: thor_optax.thor(0.1, LAM, layers=layers),
        "kfac": lambda layers: thor_optax.kfac(0.1, LAM, layers=layers)}[make]
  got, grads, stats = reference.captured_update(Scanned(norm), params, x, y, squared_error, tx,
                                                captured=True, jit=True)
  assert stats.unhandled == ()
  assert stats.layers["blocks"]["norm"].scale_grads.shape == (2, 1, 5, C)
  want, _, _ = reference.captured_update(Scanned(flax_norm), _as_flax(params, norm, 1.0), x, y,
                                         squared_error, tx, captured=True, jit=True)
  reference.assert_trees_close(_as_flax(got, norm, 0.0), want)
  leaf = "scale" if norm == "gemma" else "gamma"
  assert float(jnp.abs(got["final"][leaf] + 0.1 * grads["final"][leaf]).max()) > 1e-3


class ShiftBeforeScale(nn.Module):

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", _init, (x.shape[-1],))
    return (_rms(x) + self.param("bias", _init, (x.shape[-1],))) * scale


class OneMinus(nn.Module):

  @nn.compact
  def __call__(self, x):
    return _rms(x) * (1 - self.param("scale", _init, (x.shape[-1],)))


class Squared(nn.Module):

  @nn.compact
  def __call__(self, x):
    return _rms(x) * self.param("scale", _init, (x.shape[-1],)) ** 2


class ScaleInside(nn.Module):

  @nn.compact
  def __call__(self, x):  # the scale before the normalization: x_hat depends on it
    return _rms(x * self.param("scale", _init, (x.shape[-1],)))


class Unused(nn.Module):

  @nn.compact
  def __call__(self, x):
    self.param("bias", _init, (x.shape[-1],))
    return _rms(x) * self.param("scale", _init, (x.shape[-1],))


class Gated(nn.Module):

  @nn.compact
  def __call__(self, x):  # a PReLU-like slope
    slope = self.param("slope", _init, (x.shape[-1],))
    return jnp.where(x > 0, x, slope * x)


class SameParam(nn.Module):

  @nn.compact
  def __call__(self, x):  # one array as the scale and as the shift
    s = self.param("s", _init, (x.shape[-1],))
    return _rms(x) * s + s


class TimeMajorOutput(nn.Module):

  @nn.compact
  def __call__(self, x):  # (N, T, C) -> (T, N, C): axis 0 of its output is not the examples'
    return jnp.swapaxes(_rms(x) * self.param("scale", _init, (x.shape[-1],)), 0, 1)


NOT_AFFINE = {SameParam: "uses 's' both as the scale and as the shift",
              TimeMajorOutput: "does not keep the examples of its input (5, 3, 4) on axis 0",
              ShiftBeforeScale: "applies mul to its output ('bias', 'scale')",
              OneMinus: "applies sub to the parameter ('scale')",
              Squared: "applies integer_pow to the parameter ('scale')",
              ScaleInside: "applies square to its output ('scale')",
              Unused: "not scaled or shifted by ['bias']",
              Gated: "applies select_n to its output ('slope')"}


@pytest.mark.parametrize("cls", list(NOT_AFFINE), ids=lambda c: c.__name__)
def test_a_call_that_is_not_a_scale_and_shift_is_listed(cls):
  model = LinenNet(cls, swap=cls is TimeMajorOutput)
  x, y = _data()
  params = init_params(model, x)

  def reference_grads(p):
    return jax.grad(lambda p: squared_error(model.apply({"params": p}, x), y))(p)

  (_, grads), stats = jax.jit(thor_linen.value_and_grad_with_stats(model, squared_error))(
      params, x, y)
  assert set(stats.layers) == {"dense_in", "head"}
  (reason,) = [note for note in stats.unhandled if note.startswith("norm: ")]
  assert NOT_AFFINE[cls] in reason and "register_layer_kind" in reason, reason
  reference.assert_trees_close(grads, jax.jit(reference_grads)(params))


class NnxBlock(nnx.Module):
  """A pre-norm residual MLP block: :class:`NnxGemmaRMSNorm` or ``nnx.RMSNorm``, then a
  ``nnx.Linear``."""

  def __init__(self, rngs, own):
    self.norm = (NnxGemmaRMSNorm(C, rngs) if own
                 else nnx.RMSNorm(C, epsilon=EPS, param_dtype=F64, rngs=rngs))
    self.mlp = nnx.Linear(C, C, param_dtype=F64, rngs=rngs)

  def __call__(self, h):
    return h + self.mlp(jnp.tanh(self.norm(h)))


class NnxStack(nnx.Module):
  """Flax's "scan over layers": two :class:`NnxBlock` made by ``nnx.vmap``, run by
  ``nnx.scan``."""

  def __init__(self, rngs, own=True):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxBlock(rngs, own)

    self.dense_in = nnx.Linear(2, C, param_dtype=F64, rngs=rngs)
    self.blocks = make(rngs)
    self.head = nnx.Linear(C, 3, param_dtype=F64, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(h, block):
      return block(h)

    return self.head(forward(self.dense_in(x), self.blocks).mean(1))


def _nnx_update(model, x, y):
  return reference.nnx_captured_update(model, x, y, squared_error,
                                       lambda layers: thor_optax.kfac(0.1, LAM, layers=layers))


def test_nnx_vmap_stack_of_gemma_norms_equals_the_nnx_rmsnorm_stack():
  """Norms of a stack made by ``nnx.vmap`` (their scales ``(2, C)`` in the stack) get their
  statistics per layer, and the update of Gemma's ``scale`` equals ``nnx.RMSNorm``'s for
  ``scale + 1``."""
  x, y = _data()
  model = NnxStack(nnx.Rngs(0))
  got, stats = _nnx_update(model, x, y)
  assert stats.unhandled == ()
  assert stats.layers["blocks"]["norm"].scale_grads.shape == (2, 1, 5, C)
  own = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  reference_model = NnxStack(nnx.Rngs(1), own=False)
  nnx.update(reference_model, nnx.State(_as_flax(own, "gemma", 1.0)))
  want, _ = _nnx_update(reference_model, x, y)
  reference.assert_trees_close(_as_flax(got, "gemma", 0.0), want)


class DropoutNorm(nn.Module):
  """An RMS norm with dropout on ``x_hat``: its copy without the scale cannot draw the same
  mask (linen), so it is listed (before: ``InvalidRngError`` from the capture)."""

  @nn.compact
  def __call__(self, x):
    x_hat = nn.Dropout(0.5, deterministic=False)(_rms(x))
    return x_hat * self.param("scale", _init, (x.shape[-1],))


def test_a_linen_norm_drawing_random_numbers_is_listed():
  model = LinenNet(DropoutNorm)
  x, y = _data()
  params = init_params(model, x)
  rngs = {"dropout": jax.random.key(3)}
  capture = thor_linen.value_and_grad_with_stats(model, squared_error)
  (_, grads), stats = jax.jit(lambda p: capture(p, x, y, rngs=rngs))(params)
  (reason,) = stats.unhandled
  assert reason.startswith("norm: ") and "draws random numbers" in reason, reason
  want = jax.grad(lambda p: squared_error(model.apply({"params": p}, x, rngs=rngs), y))(params)
  reference.assert_trees_close(grads, want)


class RunningMeanShift(nn.Module):
  """``(x - running_mean) * s + b``, the running mean updated during the call (read first)."""

  @nn.compact
  def __call__(self, x):
    mean = self.variable("batch_stats", "mean", lambda: jnp.full((x.shape[-1],), 0.2, F64))
    x_hat = x - mean.value
    if self.is_mutable_collection("batch_stats"):
      mean.value = 0.5 * mean.value + 0.5 * jax.lax.stop_gradient(x.mean((0, 1)))
    return x_hat * self.param("s", _init, (x.shape[-1],)) + self.param("b", _init,
                                                                        (x.shape[-1],))


def test_x_hat_reads_the_collections_as_the_layer_read_them():
  """A layer that reads a collection and then updates it: ``x_hat`` comes from the values it
  read (before: from the updated ones, the statistics 23% off; the collections the capture
  passed were views the layer's call wrote through)."""
  model = LinenNet(RunningMeanShift)
  x, y = _data()
  params = init_params(model, x)
  state = {"batch_stats": {"norm": {"mean": jnp.full((C,), 0.2, F64)}}}
  capture = thor_linen.value_and_grad_with_stats(model, squared_error)
  tx = thor_optax.scale_by_kfac(LAM, ema_decay=None)

  def loss_one(norm, xn, yn):
    out, _ = model.apply({"params": {**params, "norm": norm}, **state}, xn[None],
                         mutable=["batch_stats"])
    return squared_error(out, yn[None])

  @jax.jit
  def run(params, x, y):
    (_, grads), stats, mutated = capture(params, x, y, model_state=state,
                                         mutable=["batch_stats"])
    updates = tx.update(grads, tx.init(params), params, curvature_stats=stats)[0]
    per = jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))(params["norm"], x, y)
    return stats, updates, grads, per, mutated

  stats, updates, grads, per, mutated = run(params, x, y)
  assert float(jnp.abs(mutated["batch_stats"]["norm"]["mean"] - 0.2).max()) > 1e-2
  _check(stats, updates["norm"], grads["norm"], per, ("s", "b"), "ChannelAffineStats",
         x.shape[0])
