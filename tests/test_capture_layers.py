"""Capture of normalization layers, embeddings and mutable collections, against float64 references.

* ``nn.BatchNorm`` (training and eval mode, dense and NHWC conv inputs, zero-init scale) and
  ``nn.LayerNorm`` (with and without bias, over positions): the captured per-example scale and
  bias gradients against rows of ``jax.jacrev`` of the vector of per-example losses of the
  full-batch forward pass (batch statistics as computed on the whole batch), and the per-channel
  Fisher built from them;
* the exact Fisher's cotangent directions for a LayerNorm against the output Jacobian;
* ``nn.Embed``: ids and per-example output cotangents against a forward pass written in
  ``jnp``; a tied embedding (``attend``) and a twice-called one are weight sharing, captured;
* ``model_state`` / ``mutable``: updated ``batch_stats``, loss and gradients against
  ``model.apply`` itself;
* normalization over other than the last axis is reported as unhandled.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thor_optax
from thor_optax.flax import value_and_grad_with_stats

from reference import F64, init_params, randn, softmax_ce, squared_error
from reference import float64_mode  # noqa: F401  pylint: disable=unused-import (autouse fixture)

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _norm(kind):
  if kind == "bn":
    return nn.BatchNorm(use_running_average=False, name="norm")
  if kind == "bn_eval":
    return nn.BatchNorm(use_running_average=True, name="norm")
  if kind == "ln":
    return nn.LayerNorm(name="norm")
  assert kind == "ln_no_bias"
  return nn.LayerNorm(use_bias=False, name="norm")


class NormMLP(nn.Module):
  """``Dense(5) -> norm -> act (-> mean over positions) -> Dense(3)``."""
  norm: str
  act: str = "tanh"

  @nn.compact
  def __call__(self, x):
    h = _norm(self.norm)(nn.Dense(5, name="dense_in")(x))
    h = getattr(jax.nn, self.act)(h)
    if h.ndim == 3:
      h = h.mean(axis=1)
    return nn.Dense(3, name="head")(h)


class ConvBN(nn.Module):
  """``Conv(3, 3x3) -> BatchNorm (training) -> relu -> spatial mean -> Dense(3)``."""

  @nn.compact
  def __call__(self, x):
    h = nn.Conv(3, (3, 3), padding="SAME", name="conv")(x)
    h = nn.relu(nn.BatchNorm(use_running_average=False, name="norm")(h))
    return nn.Dense(3, name="head")(h.mean(axis=(1, 2)))


NORM_CASES = {
    # name: (model, input shape, zero scale)
    "batchnorm_mlp": (NormMLP("bn", act="relu"), (6, 3), False),
    "batchnorm_eval": (NormMLP("bn_eval"), (6, 3), False),
    "batchnorm_zero_scale": (NormMLP("bn"), (6, 3), True),
    "batchnorm_conv_nhwc": (ConvBN(), (3, 4, 4, 2), False),
    "layernorm_positions": (NormMLP("ln"), (4, 3, 3), False),
    "layernorm_no_bias": (NormMLP("ln_no_bias"), (5, 3), False),
}


def _model_state(model, x, seed=0):
  """float64 ``batch_stats`` of the model's shapes (random means, positive variances)."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x))
  if "batch_stats" not in shapes:
    return {}
  rng = np.random.default_rng(200 + seed)
  stats = {}
  for path, s in jax.tree_util.tree_flatten_with_path(shapes["batch_stats"])[0]:
    name = path[-1].key
    value = (0.3 * rng.standard_normal(s.shape) if name == "mean"
             else 0.5 + rng.uniform(size=s.shape))
    stats.setdefault(path[0].key, {})[name] = jnp.asarray(value, F64)
  return {"batch_stats": stats}


def _norm_problem(name):
  model, shape, zero_scale = NORM_CASES[name]
  x = jnp.asarray(randn(1, shape))
  y = jnp.asarray(randn(2, (shape[0], 3)))
  params = init_params(model, x)
  if zero_scale:
    params["norm"]["scale"] = jnp.zeros_like(params["norm"]["scale"])
  state = _model_state(model, x)
  training = isinstance(model, ConvBN) or model.norm == "bn"
  return model, params, state, ["batch_stats"] if training else False, x, y


def _apply(model, params, state, mutable, x):
  if mutable:
    return model.apply({"params": params, **state}, x, mutable=mutable)[0]
  return model.apply({"params": params, **state}, x)


@pytest.mark.parametrize("name", sorted(NORM_CASES))
def test_norm_per_example_grads(name):
  model, params, state, mutable, x, y = _norm_problem(name)
  n = x.shape[0]
  capture_fn = value_and_grad_with_stats(model, squared_error)

  def per_example_losses(norm_params):  # full batch: batch statistics over all N examples
    out = _apply(model, {**params, "norm": norm_params}, state, mutable, x)
    return 0.5 * jnp.sum((out - y) ** 2, axis=-1)

  @jax.jit
  def run(params, state, x, y):
    result = capture_fn(params, x, y, model_state=state, mutable=mutable)
    return result[:2], jax.jacrev(per_example_losses)(params["norm"])

  ((_, grads), stats), jac = run(params, state, x, y)
  assert stats.unhandled == ()
  layer = stats.layers["norm"]
  assert isinstance(layer, thor_optax.NormStats)
  c = params["norm"]["scale"].shape[0]
  assert layer.scale_grads.shape == layer.bias_grads.shape == (1, n, c)
  # loss = mean_n loss_n, so N * d(loss)/d(output) paired with x_hat is d(loss_n)/d(scale).
  np.testing.assert_allclose(layer.scale_grads[0], jac["scale"], **TIGHT)
  np.testing.assert_allclose(grads["norm"]["scale"], jac["scale"].mean(axis=0), **TIGHT)
  assert np.abs(jac["scale"]).max() > 1e-3  # nonzero, also for a zero scale
  if "bias" in jac:
    np.testing.assert_allclose(layer.bias_grads[0], jac["bias"], **TIGHT)
    np.testing.assert_allclose(grads["norm"]["bias"], jac["bias"].mean(axis=0), **TIGHT)
    per_example = np.stack([jac["scale"], jac["bias"]], axis=-1)
  else:
    np.testing.assert_array_equal(layer.bias_grads, np.zeros((1, n, c)))
    per_example = np.asarray(jac["scale"])[..., None]
  # Per-channel Fisher F_c = (1/N) sum_n [g_scale, g_bias] [g_scale, g_bias]^T.
  captured = np.stack([layer.scale_grads, layer.bias_grads], axis=-1)[..., :per_example.shape[-1]]
  fisher_ref = np.einsum("nci,ncj->cij", per_example, per_example) / n
  fisher = np.einsum("snci,sncj->cij", captured, captured) / n
  np.testing.assert_allclose(fisher, fisher_ref, **TIGHT)


def test_norm_exact_fisher_directions():
  """Exact squared-error Fisher: direction ``k`` of ``scale_grads`` is ``d out[n, k]/d scale``."""
  model, params, state, mutable, x, y = _norm_problem("layernorm_positions")
  capture_fn = value_and_grad_with_stats(model, squared_error, fisher_type="exact",
                                         likelihood="squared_error")

  @jax.jit
  def run(params, x, y):
    out_jac = jax.jacrev(lambda q: model.apply({"params": {**params, "norm": q}}, x))
    return capture_fn(params, x, y)[1], out_jac(params["norm"])

  stats, jac = run(params, x, y)
  layer = stats.layers["norm"]
  assert layer.scale_grads.shape == (3, x.shape[0], 5)
  np.testing.assert_allclose(layer.scale_grads, np.moveaxis(jac["scale"], 1, 0), **TIGHT)
  np.testing.assert_allclose(layer.bias_grads, np.moveaxis(jac["bias"], 1, 0), **TIGHT)


def test_mutable_batch_stats_match_apply():
  model, params, state, mutable, x, y = _norm_problem("batchnorm_mlp")
  capture_fn = value_and_grad_with_stats(model, squared_error)

  def plain_loss(p):
    out, mutated = model.apply({"params": p, **state}, x, mutable=["batch_stats"])
    return squared_error(out, y), mutated

  @jax.jit
  def run(params, state, x, y):
    return (capture_fn(params, x, y, model_state=state, mutable=["batch_stats"]),
            capture_fn(params, x, y, model_state=state, mutable="batch_stats"),
            jax.value_and_grad(plain_loss, has_aux=True)(params),
            capture_fn(params, x, y, model_state=state, mutable=["batch_stats"],
                       capture_intermediates=True)[2],
            model.apply({"params": params, **state}, x, mutable=["batch_stats"],
                        capture_intermediates=True)[1])

  result, result_str, ((ref_loss, ref_mutated), ref_grads), inter, ref_inter = run(
      params, state, x, y)
  assert len(result) == 3 and len(result_str) == 3
  # capture_intermediates adds 'intermediates', as in Module.apply (perturbations are zeros).
  assert jax.tree.structure(inter) == jax.tree.structure(ref_inter)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), inter, ref_inter)
  (loss, grads), stats, mutated = result
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-14)
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), grads, ref_grads)
  assert jax.tree.structure(mutated) == jax.tree.structure(ref_mutated)
  assert set(mutated) == {"batch_stats"}
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), mutated, ref_mutated)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), result_str[2], mutated)
  # The running statistics moved (the update is not a no-op the test would miss).
  assert not np.allclose(mutated["batch_stats"]["norm"]["mean"],
                         state["batch_stats"]["norm"]["mean"])
  assert set(stats.layers) == {"dense_in", "norm", "head"}

  with pytest.raises(ValueError, match="model_state"):
    capture_fn(params, x, y, model_state={"params": params})


class EmbedModel(nn.Module):
  """``Embed(7, 4)`` on ``(N, T)`` ids -> tanh -> mean over positions -> Dense(3)."""

  @nn.compact
  def __call__(self, ids):
    h = jnp.tanh(nn.Embed(7, 4, name="embed")(ids))
    return nn.Dense(3, name="head")(h.mean(axis=1))


def test_embed_ids_and_cotangents():
  model = EmbedModel()
  n, t = 5, 4
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 7, (n, t)))
  y = jnp.asarray(np.random.default_rng(1).integers(0, 3, n))
  params = init_params(model, ids)
  capture_fn = value_and_grad_with_stats(model, softmax_ce)

  def head_loss(e):  # the model after the lookup, written in jnp
    h = jnp.tanh(e).mean(axis=1)
    return softmax_ce(h @ params["head"]["kernel"] + params["head"]["bias"], y)

  @jax.jit
  def run(params, ids, y):
    return capture_fn(params, ids, y), jax.grad(head_loss)(params["embed"]["embedding"][ids])

  ((_, grads), stats), de = run(params, ids, y)
  assert stats.unhandled == ()
  layer = stats.layers["embed"]
  assert isinstance(layer, thor_optax.EmbedStats)
  np.testing.assert_array_equal(layer.inputs, ids)
  assert layer.cotangents.shape == (1, n, t, 4)
  np.testing.assert_allclose(layer.cotangents[0], n * np.asarray(de), **TIGHT)
  # sum_{n,t} onehot(ids)^T g = N * d(mean loss)/d(embedding).
  onehot = np.eye(7)[np.asarray(ids)].reshape(-1, 7)
  np.testing.assert_allclose(onehot.T @ np.asarray(layer.cotangents[0]).reshape(-1, 4) / n,
                             grads["embed"]["embedding"], **TIGHT)


class TiedEmbed(nn.Module):
  """Input embedding reused as the output layer through ``attend``."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(7, 4, name="embed")
    return embed.attend(jnp.tanh(nn.Dense(4, name="mix")(embed(ids))))


class TwiceEmbed(nn.Module):
  """One embedding looked up twice."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(7, 4, name="embed")
    h = embed(ids) + embed((ids + 1) % 7)
    return nn.Dense(7, name="head")(h)


@pytest.mark.parametrize("model, tied", [(TiedEmbed(), True), (TwiceEmbed(), False)])
def test_shared_embed_captured(model, tied):
  """A tied embedding and one looked up twice are weight sharing: captured with every use
  (tests/test_weight_sharing.py checks the factors); loss and gradients are the model's."""
  ids = jnp.asarray(np.random.default_rng(2).integers(0, 7, (3, 4)))
  y = jnp.asarray(np.random.default_rng(3).integers(0, 7, (3, 4)))
  params = init_params(model, ids)
  capture_fn = value_and_grad_with_stats(model, softmax_ce)

  @jax.jit
  def run(params, ids, y):
    ref = jax.value_and_grad(lambda p: softmax_ce(model.apply({"params": p}, ids), y))(params)
    return capture_fn(params, ids, y), ref

  ((loss, grads), stats), (ref_loss, ref_grads) = run(params, ids, y)
  assert not stats.unhandled and set(stats.layers) == set(params)
  embed = stats.layers["embed"]
  assert (embed.attend_inputs is not None) == tied
  # M = 12 loss terms; the lookups' positions (4, or 2 x 4 when looked up twice) regrouped.
  assert embed.inputs.shape == ((12, 1) if tied else (12, 2))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-14)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), grads, ref_grads)


class OtherAxes(nn.Module):
  """Normalizations with scale and bias over other than the last axis, and one without params."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(reduction_axes=(1, 2), feature_axes=(1, 2), name="ln_12")(x)
    h = nn.BatchNorm(use_running_average=True, axis=1, name="bn_axis1")(h)
    h = nn.LayerNorm(use_scale=False, use_bias=False, name="ln_plain")(h)
    return nn.Dense(2, name="head")(h.mean(axis=1))


def test_norm_over_other_axes_unhandled():
  model = OtherAxes()
  x = jnp.asarray(randn(4, (3, 4, 5)))
  y = jnp.asarray(randn(5, (3, 2)))
  params = init_params(model, x)
  state = _model_state(model, x)
  capture_fn = value_and_grad_with_stats(model, squared_error)

  @jax.jit
  def run(params, state, x, y):
    ref = jax.value_and_grad(
        lambda p: squared_error(model.apply({"params": p, **state}, x), y))(params)
    return capture_fn(params, x, y, model_state=state), ref

  ((loss, grads), stats), (ref_loss, ref_grads) = run(params, state, x, y)
  unhandled = dict(s.split(": ", 1) for s in stats.unhandled)
  assert set(unhandled) == {"ln_12", "bn_axis1"}
  assert "feature_axes=(1, 2)" in unhandled["ln_12"] and "last axis" in unhandled["ln_12"]
  assert "axis=(1,)" in unhandled["bn_axis1"]
  assert set(stats.layers) == {"head"}  # ln_plain has no parameters
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-14)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), grads, ref_grads)


def test_bare_parameters_are_named_in_the_reason():
  """A ``self.param`` of the root module (a learned position table, a class token) is listed
  under ``(root)``, naming the parameters rather than only 'module kind not supported', and,
  since the root also has a submodule with parameters, saying that the capture takes a
  module's call as a whole (a position embedding in a module of its own is captured)."""

  class WithTable(nn.Module):
    @nn.compact
    def __call__(self, x):
      pos = self.param("pos", nn.initializers.normal(0.02), x.shape[1:], F64)
      cls = self.param("cls", nn.initializers.zeros, (x.shape[-1],), F64)
      return nn.Dense(3, param_dtype=F64)(x + pos + cls)

  x = jnp.asarray(randn(0, (4, 5)))
  params = init_params(WithTable(), x)
  (_, _), stats = value_and_grad_with_stats(WithTable(), softmax_ce)(params, x, jnp.arange(4) % 3)
  assert set(stats.layers) == {"Dense_0"}
  assert stats.unhandled == (
      "(root): parameters 'cls', 'pos' of a module that also has submodules, used in its own "
      "call (a class token, a position embedding, a layer scale), pass through "
      "unpreconditioned: the capture takes a module's call as a whole. A position embedding "
      "added, or a layer scale multiplied, in a module of its own is captured (the "
      "'channel_affine' kind)",)


def test_integer_inputs_are_recorded_as_flax_casts_them():
  """uint8 images into ``nn.Conv`` and int features into ``nn.Dense``: Flax casts them to float
  before the product, and so are they recorded (their integer dtype failed every step given
  statistics); a check step and a plain step from the rows then run, the latter equal to the
  step from the gradient."""

  class IntNet(nn.Module):
    @nn.compact
    def __call__(self, images, counts):
      h = nn.Conv(3, (2, 2), param_dtype=F64)(images).mean(axis=(1, 2))
      return nn.Dense(3, param_dtype=F64)(h) + nn.Dense(3, param_dtype=F64)(counts)

  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.integers(0, 255, (4, 3, 3, 1)), jnp.uint8)
  counts = jnp.asarray(rng.integers(0, 5, (4, 2)), jnp.int32)
  model = IntNet()
  params = model.init(jax.random.PRNGKey(0), images, counts)["params"]
  capture = value_and_grad_with_stats(model, softmax_ce)
  y = jnp.arange(4) % 3
  tx = thor_optax.scale_by_thor(1e-2, block_size=4)

  def step(params, state, stats_as):
    (_, grads), stats = capture(params, images, y, counts=counts)
    assert {stats.layers[k].inputs.dtype for k in stats.layers} == {jnp.dtype(jnp.float64)}
    kw = {stats_as: stats} if stats_as else {}
    return tx.update(grads, state, params, **kw)

  step = jax.jit(step, static_argnums=2)
  _, state = step(params, tx.init(params), "curvature_stats")
  rows, _ = step(params, state, "gradient_stats")
  block, _ = step(params, state, None)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), rows, block)


class Wrapped(nn.Module):
  """A ``Dense`` under ``nn.WeightNorm`` or ``nn.SpectralNorm`` (``nn.map_variables``), then a
  plain ``Dense`` head."""
  wrapper: str

  @nn.compact
  def __call__(self, x, train: bool = True):
    inner = nn.Dense(6, param_dtype=F64, name="inner")
    if self.wrapper == "weight_norm":
      h = nn.WeightNorm(inner, param_dtype=F64)(x)
    else:
      h = nn.SpectralNorm(inner)(x, update_stats=train)
    return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h))


@pytest.mark.parametrize("wrapper", ["weight_norm", "spectral_norm"])
def test_layers_whose_weights_are_mapped_are_listed(wrapper):
  """The layer's applied weight is a function of its parameter (``W / ||W||``, ``W / sigma``):
  listed with the reason, its gradient passed through exactly; the head is captured. Before,
  ``WeightNorm`` crashed the capture (params immutable inside ``map_variables``) and
  ``SpectralNorm`` asked for a PRNG, then normalized the capture's own perturbation and took
  the layer as an exact dense one."""
  model = Wrapped(wrapper)
  x = jnp.asarray(randn(0, (5, 4)))
  y = jnp.arange(5) % 3
  variables = model.init(jax.random.PRNGKey(0), x)
  params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
  capture = value_and_grad_with_stats(model, softmax_ce)
  kwargs = dict(model_state=state, mutable=list(state)) if state else {}
  (loss, grads), stats, *mutated = capture(params, x, y, **kwargs)
  assert list(stats.layers) == ["head"] and stats.exact_rows == ("head",)
  assert any(note.startswith("inner: its variables are mapped by nn.map_variables")
             for note in stats.unhandled), stats.unhandled

  def plain(p):
    out = model.apply({"params": p, **state}, x, mutable=list(state) or False)
    return softmax_ce(out[0] if state else out, y)

  want_loss, want = jax.value_and_grad(plain)(params)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-14)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)
  if state:  # the same collections as model.apply updates, nothing of the capture's in them
    ref = model.apply({"params": params, **state}, x, mutable=list(state))[1]
    assert jax.tree.structure(mutated[0]) == jax.tree.structure(ref)
  tx = thor_optax.thor(0.1)
  updates, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats,
                         gradient_stats=stats)
  assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))


class Branches(nn.Module):
  """A ``Dense`` used in ``nn.cond`` / ``nn.switch`` branches: created inside the branch under
  the module the branch receives (lifted, as Flax's docs write it), or closing over the outer
  module's layer."""
  control: str
  closure: bool

  @nn.compact
  def __call__(self, x, flag):
    outer = nn.Dense(6, param_dtype=F64, name="dense")
    if self.closure:
      if self.is_initializing():
        outer(x)
      branches = [lambda m, x: outer(x), lambda m, x: -outer(x)]
    else:
      branches = [lambda m, x: nn.Dense(6, param_dtype=F64, name="dense")(x),
                  lambda m, x: -nn.Dense(6, param_dtype=F64, name="dense")(x)]
    if self.control == "cond":
      h = nn.cond(flag, *branches, self, x)
    else:
      h = nn.switch(1 - flag.astype(jnp.int32), branches, self, x)
    return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h))


class Negated(nn.Module):
  @nn.compact
  def __call__(self, x, flag):
    h = -nn.Dense(6, param_dtype=F64, name="dense")(x)
    return nn.Dense(3, param_dtype=F64, name="head")(jnp.tanh(h))


@pytest.mark.parametrize("control", ["cond", "switch"])
def test_layers_in_lifted_branches_are_captured_or_listed(control):
  """Created inside the branch: captured from the branch taken (the update of the same model
  without the branch). Closed over from the outer module: listed (before, the capture recorded
  the branch's tracers and the optimizer raised UnexpectedTracerError)."""
  x = jnp.asarray(randn(1, (5, 4)))
  y = jnp.arange(5) % 3
  flag = jnp.asarray(False)
  params = init_params(Branches(control, False), x, flag)
  tx = thor_optax.kfac(0.1, 0.03)
  updates = {}
  for name, model in (("lifted", Branches(control, False)), ("plain", Negated()),
                      ("closure", Branches(control, True))):
    (_, grads), stats = value_and_grad_with_stats(model, softmax_ce)(params, x, y, flag=flag)
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "curvature_stats: no statistics for some layers")
      updates[name] = jax.jit(lambda g, s: tx.update(g, tx.init(params), params,
                                                     curvature_stats=s))(grads, stats)[0]
    if name == "closure":
      assert list(stats.layers) == ["head"]
      assert any(note.startswith("dense: called inside a transform it is not lifted through")
                 for note in stats.unhandled), stats.unhandled
    else:
      assert list(stats.layers) == ["dense", "head"] and not stats.unhandled
  for a, b in zip(jax.tree.leaves(updates["lifted"]), jax.tree.leaves(updates["plain"])):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)
  assert float(jnp.abs(updates["closure"]["dense"]["kernel"]
                       - updates["plain"]["dense"]["kernel"]).max()) > 1e-3


class WithPredictions(nn.Module):
  """Logits and their integer ``argmax`` in a dict (a common evaluation-friendly output)."""

  @nn.compact
  def __call__(self, x):
    logits = nn.Dense(3, param_dtype=F64)(jnp.tanh(nn.Dense(4, param_dtype=F64)(x)))
    return {"logits": logits, "predictions": jnp.argmax(logits, -1)}


def test_integer_outputs_and_loss_fns_that_are_not_a_scalar():
  """An integer output leaf beside the logits is captured (its cotangent is ``float0``;
  before: a JAX ``TypeError`` from ``grad``); a ``loss_fn`` returning a per-example vector or
  a ``(loss, aux)`` tuple gets a ``ValueError`` saying what to return."""
  model = WithPredictions()
  x = jnp.asarray(randn(1, (5, 6)))
  y = jnp.arange(5) % 3
  params = init_params(model, x)
  loss_fn = lambda out, t: softmax_ce(out["logits"], t)  # noqa: E731
  (loss, grads), stats = value_and_grad_with_stats(model, loss_fn, num_loss_terms=5)(
      params, x, y)
  want_loss, want = jax.value_and_grad(lambda p: loss_fn(model.apply({"params": p}, x), y))(
      params)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-14)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)
  assert sorted(stats.layers) == ["Dense_0", "Dense_1"]
  bad = {"a per-example vector": lambda out, t: softmax_ce(out["logits"], t) * jnp.ones(5),
         "a (loss, aux) tuple": lambda out, t: (loss_fn(out, t), {"accuracy": 1.0})}
  for what, fn in bad.items():
    with pytest.raises(ValueError, match="loss_fn must return one floating-point scalar"):
      value_and_grad_with_stats(model, fn, num_loss_terms=5)(params, x, y)


def test_output_cotangents_checks_its_arguments():
  """The public ``output_cotangents`` validates as the capture does (before: a misspelled
  ``fisher_type`` was taken as ``'exact'``, a missing likelihood as squared error, and
  ``num_terms=0`` gave zero cotangents)."""
  out = jnp.asarray(randn(2, (4, 3)))
  d = jnp.ones_like(out) / 4
  fn = thor_optax.flax.output_cotangents
  np.testing.assert_allclose(fn(out, d, 4, "empirical", None, 1, None), np.ones((1, 4, 3)))
  for args, match in [((4, "Empirical", None, 1, None), "fisher_type"),
                      ((4, "exact", None, 1, None), "likelihood"),
                      ((4, "exact", "softmax", 1, None), "likelihood"),
                      ((0, "empirical", None, 1, None), "positive"),
                      ((4, "sampled", "squared_error", 0, None), "num_samples"),
                      ((4, "sampled", "squared_error", 1, 0), "one PRNG key")]:
    with pytest.raises(ValueError, match=match):
      fn(out, d, *args)
  with pytest.raises(ValueError, match="dloss must have the outputs' shape"):
    fn(out, d[0], 4, "empirical", None, 1, None)


class SharedTables(nn.Module):
  """Layers on inputs that no example changes: a T5-style relative-position bias (an ``Embed`` of
  a ``(T, T)`` bucket table, broadcast over the batch after the layer, or before it), learned
  Perceiver latents projected by a ``Dense``, position ids ``jnp.arange(T)`` into an ``Embed``;
  and a ``Dense`` on noise drawn per example from the call's rngs."""
  broadcast_first: bool

  @nn.compact
  def __call__(self, x):
    n, t = x.shape[0], x.shape[1]
    buckets = jnp.clip(jnp.arange(t)[None] - jnp.arange(t)[:, None], -2, 2) + 2
    table = nn.Embed(5, 2, param_dtype=F64, name="bias")
    if self.broadcast_first:
      bias = table(jnp.broadcast_to(buckets, (n, t, t)))
    else:
      bias = jnp.broadcast_to(table(buckets)[None], (n, t, t, 2))
    latents = self.param("latents", nn.initializers.normal(), (6, 3), F64)
    q = nn.Dense(3, param_dtype=F64, name="latent_proj")(latents)
    h = jnp.einsum("ld,ntd->nl", q, x)
    noise = jax.random.normal(self.make_rng("noise"), (n, 4), F64)
    h = h + nn.Dense(6, param_dtype=F64, name="noise_proj")(noise)
    positions = nn.Embed(t, 2, param_dtype=F64, name="positions")(jnp.arange(t))  # (T,) ids
    return nn.Dense(3, param_dtype=F64, name="head")(jnp.concatenate(
        [h, bias.reshape(n, -1), jnp.broadcast_to(positions.reshape(-1), (n, 2 * t))], axis=-1))


@functools.partial(jax.jit, static_argnums=0)
def _buckets_in_a_jitted_function(t, x):
  """A jitted helper (a ``pjit`` in the model's jaxpr) given the examples: the table broadcast
  to their ``N`` rows, the table itself (``t`` rows) and the examples doubled."""
  table = jnp.clip(jnp.arange(t)[None] - jnp.arange(t)[:, None], -2, 2) + 2
  return jnp.broadcast_to(-(-table), (x.shape[0],) + table.shape), table, 2 * x


class TableAtBatchSize(nn.Module):
  """A ``(T, T)`` bucket table into an ``Embed`` at a batch of ``N = T`` examples, as given to
  the layer by ``form``; learned ``(N, d)`` latents into a ``Dense``."""
  form: str

  @nn.compact
  def __call__(self, x):
    n, t = x.shape[0], x.shape[1]
    buckets = jnp.clip(jnp.arange(t)[None] - jnp.arange(t)[:, None], -2, 2) + 2
    given = {"table": lambda: buckets,
             "broadcast_to": lambda: jnp.broadcast_to(buckets, (n, t, t)),
             "tile": lambda: jnp.tile(buckets[None], (n, 1, 1)),
             "repeat": lambda: jnp.repeat(buckets[None], n, axis=0),
             "jitted": lambda: _buckets_in_a_jitted_function(t, x)[0],
             "jitted_table": lambda: _buckets_in_a_jitted_function(t, x)[1]}[self.form]()
    bias = nn.Embed(5, 2, param_dtype=F64, name="bias")(given)
    bias = jnp.broadcast_to(bias, (n, t, t, 2)).reshape(n, -1)
    latents = self.param("latents", nn.initializers.normal(), (n, 3), F64)
    h = nn.Dense(3, param_dtype=F64, name="latent_proj")(latents).sum(0)
    x = _buckets_in_a_jitted_function(t, x)[2]
    return nn.Dense(3, param_dtype=F64, name="head")(jnp.concatenate(
        [x.reshape(n, -1) + h.sum(), bias], axis=-1))


@pytest.mark.parametrize("form", ["table", "broadcast_to", "tile", "repeat", "jitted",
                                  "jitted_table"])
def test_a_table_with_as_many_rows_as_examples_is_not_taken_for_them(form):
  """A table whose leading axis happens to equal the batch size (T5's ``(T, T)`` relative
  bucket table at ``N = T``, learned latents ``(N, d)``) was taken for a batched input before,
  silently: the bias table's update 3.2x the broadcast capture's (found by the h_llm audit).
  Now a layer input that depends on no example is taken only when its leading axis is a
  broadcast (``example_rows.py``), through ``jnp.broadcast_to``, ``jnp.tile``, ``jnp.repeat``
  and a jitted function's body; otherwise listed, as at any other batch size."""
  x = jnp.asarray(randn(3, (5, 5, 3)))  # N = T = 5
  y = jnp.arange(5) % 3
  model = TableAtBatchSize(form)
  params = init_params(model, x)
  (_, _), stats = value_and_grad_with_stats(model, softmax_ce)(params, x, y)
  listed = dict(note.split(": ", 1) for note in stats.unhandled)
  assert listed["latent_proj"].startswith("applied to an input of shape (5, 3) that depends "
                                          "on no example")
  shared = form in ("table", "jitted_table")
  assert ("bias" in listed) == shared
  if shared:
    assert listed["bias"].startswith("applied to an input of shape (5, 5) that depends on no "
                                     "example")
  else:
    assert stats.layers["bias"].inputs.shape == (5, 5, 5)
  assert "head" in stats.layers


@pytest.mark.parametrize("broadcast_first", [False, True])
def test_layers_on_inputs_shared_by_every_example_are_listed(broadcast_first):
  """Before, the capture took the table's first axis for the examples: ``A`` of the bias table
  ``N`` times too small and ``G`` from cotangents summed over the batch (an update 2.4 off
  relatively), silently. A table broadcast before the layer has a row block per example: taken,
  as the README's convention says (``A`` counts every example's lookups)."""
  x = jnp.asarray(randn(2, (4, 5, 3)))
  y = jnp.arange(4) % 3
  model = SharedTables(broadcast_first)
  params = init_params(model, x)
  rngs = {"noise": jax.random.PRNGKey(1)}
  (_, _), stats = value_and_grad_with_stats(model, softmax_ce)(params, x, y, rngs=rngs)
  listed = dict(note.split(": ", 1) for note in stats.unhandled)
  assert listed["latent_proj"].startswith("applied to an input of shape (6, 3) that depends "
                                          "on no example")
  # Position ids of one axis into an Embed (before: captured with the positions for examples).
  assert listed["positions"].startswith("applied to an input of shape (5,) that depends on "
                                        "no example")
  assert ("bias" in listed) != broadcast_first
  assert {"noise_proj", "head"} <= set(stats.layers)
  if broadcast_first:
    assert stats.layers["bias"].inputs.shape == (4, 5, 5)


class InputsAndTargets(nn.Module):
  """Flax's WMT ``Transformer.__call__(inputs, targets)``: the model takes a keyword named as
  the capture's own third argument."""

  @nn.compact
  def __call__(self, inputs, targets):
    h = nn.Dense(4, param_dtype=F64, name="enc")(inputs).mean(1, keepdims=True)
    return nn.Dense(3, param_dtype=F64, name="dec")(h + targets)


def test_a_model_keyword_named_targets_goes_to_the_model():
  """Before, ``fn(params, inputs, targets, ...)`` took the model's ``targets=`` for its own
  third argument: a bare ``TypeError: got multiple values for argument 'targets'`` (found by
  the h_examples audit). Now its first three arguments are positional only, linen and NNX."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import thor_optax.nnx  # pylint: disable=import-outside-toplevel
  x = jnp.asarray(randn(12, (4, 3, 2)))
  dec_in = jnp.asarray(randn(13, (4, 5, 4)))
  y = jnp.arange(20).reshape(4, 5) % 3
  model = InputsAndTargets()
  params = init_params(model, x, dec_in)
  (loss, grads), stats = value_and_grad_with_stats(model, softmax_ce)(params, x, y,
                                                                      targets=dec_in)
  want, want_grads = jax.value_and_grad(
      lambda p: softmax_ce(model.apply({"params": p}, x, targets=dec_in), y))(params)
  np.testing.assert_allclose(loss, want, rtol=1e-14)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15),
               grads, want_grads)
  assert set(stats.layers) == {"enc", "dec"}

  class NnxInputsAndTargets(nnx.Module):
    def __init__(self):
      self.dec = nnx.Linear(4, 3, param_dtype=F64, rngs=nnx.Rngs(0))

    def __call__(self, inputs, targets):
      return self.dec(inputs + targets)

  nnx_model = NnxInputsAndTargets()
  (loss, _), stats = thor_optax.nnx.value_and_grad_with_stats(softmax_ce)(
      nnx_model, dec_in, y, targets=dec_in)
  np.testing.assert_allclose(loss, softmax_ce(nnx_model(dec_in, targets=dec_in), y),
                             rtol=1e-14)
  assert set(stats.layers) == {"dec"}
