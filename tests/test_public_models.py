"""Models written the way public Flax code writes them (``public_models.py``), trained with the
README's steps.

* every linen model of ``public_models.LINEN_MODELS`` (ResNet with BatchNorm, a decoder-only
  transformer scanned over ``nn.remat``-ed blocks, an LSTM classifier, tuple / dict / dataclass
  outputs, a tied-embedding LM, a bare ``nn.Dense``, a weight-standardized conv, a rank-1
  regressor, ``nn.remat`` layers, a BERT-style classifier, a GPT-2-style LM whose ``Conv1D``
  kernels are applied transposed, given the capture's layout) trains under ``jax.jit`` with
  check and plain steps: exactly the expected layers are preconditioned (read from the
  optimizer state), exactly the expected ones are listed unhandled with the expected reason
  (one warning naming them), and the loss falls;
* outputs that are pytrees reach the loss exactly as the model returns them; tuple, dict,
  dataclass and rank-1 outputs without ``num_loss_terms`` raise; ``num_loss_terms`` makes a
  rank-1 output's statistics those of the same model returning ``(N, 1)``;
* ``nn.remat`` changes nothing and a scanned stack equals its unrolled equivalent (float64);
* a model none of whose layers can be captured trains with one warning; NNX layers run inside
  ``nnx.scan`` / ``nnx.remat`` are named in a warning and training still works.
"""

import functools
import warnings

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import thor_optax
import thor_optax.nnx
from thor_optax.flax import value_and_grad_with_stats

import public_models as pm

pytestmark = pytest.mark.usefixtures("fast_compiles")

TIGHT = dict(rtol=1e-10, atol=1e-12)
# Compiling is most of this file's run time (a check step is a few thousand HLO ops). XLA's
# backend optimizations and CPU fusion emitters do not change what is computed; without them
# the steps compile 2-3x faster.
FAST_COMPILE = pm.FAST_COMPILE
STEPS = 12
IS_CHECK = thor_optax.CheckSchedule(3)  # checks at steps 0, 3, 6, 9

# A couple of models train with the other aliases; the rest with THOR.
OPTIMIZERS = {
    "lstm": lambda lr, layers: thor_optax.kfac(lr, 0.03, layers=layers),
    "mlp_aux": lambda lr, layers: thor_optax.kfac(lr, 0.03, layers=layers),
    "std_conv": lambda lr, layers: thor_optax.skfac(lr, 0.03, layers=layers),
}


@pytest.fixture
def x64():
  """float64 for one test (JAX's x64 flag is process-wide; restored on exit)."""
  with jax.enable_x64(True):
    yield


def to_f64(tree):
  """Every floating leaf of ``tree`` as float64."""
  return jax.tree.map(  # in NumPy: no compilation
      lambda v: np.asarray(v, np.float64) if jnp.issubdtype(v.dtype, jnp.floating) else v, tree)


def init_params(model, x):
  """The model's initial parameters (initialization compiled once, as in ``pm.init_case``)."""
  init = jax.jit(lambda x: model.init(jax.random.PRNGKey(0), x), compiler_options=FAST_COMPILE)
  return init(x)["params"]


def abstract_params(model, x):
  """Shapes and dtypes of the model's parameters (traced, not compiled; unboxed)."""
  return nn.meta.unbox(jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x),
                                      x)["params"])


def kronecker_state(opt_state):
  """The one ``KroneckerState`` inside an optimizer state."""
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda v: isinstance(v, thor_optax.KroneckerState))
           if isinstance(s, thor_optax.KroneckerState)]
  assert len(found) == 1, found
  return found[0]


def preconditioned_layers(state):
  """Layer names whose curvature was refreshed: Kronecker-factored layers with
  ``total_refreshes > 0``, and normalization layers whose unit-wise inverse left the identity."""
  names = {name for name, d in state.diagnostics.items() if int(d.total_refreshes) > 0}
  for name, side in state.layers.items():
    if name not in state.diagnostics and hasattr(side, "inverse"):
      if not np.allclose(side.inverse, np.eye(2)):
        names.add(name)
  return names


def module_names(params):
  """Names of the modules holding parameters (``'a/b'``; ``'(root)'`` for root parameters)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return {"/".join(str(k.key) for k in path[:-1]) or "(root)" for path, _ in flat}


def unhandled_dict(unhandled):
  """``stats.unhandled`` as ``{layer: reason}``."""
  return dict(note.split(": ", 1) for note in unhandled)


def thor_warnings(record):
  """The recorded warnings the curvature transforms issue."""
  return [w for w in record if issubclass(w.category, UserWarning)
          and "curvature_stats" in str(w.message)]


def train(case, tx, steps=STEPS):
  """README training loop on the case's fixed batch; returns ``(losses, opt_state, unhandled,
  warnings)``."""
  params, model_state, (x, y) = pm.init_case(case)
  seen = []
  check_step, plain_step = (jax.jit(f, compiler_options=FAST_COMPILE) for f in pm.make_steps(
      case, tx, on_stats=lambda s: seen.append(s.unhandled)))
  opt_state = jax.jit(tx.init, compiler_options=FAST_COMPILE)(params)
  losses = []
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for step in range(steps):
      step_fn = check_step if IS_CHECK(step) else plain_step
      params, model_state, opt_state, loss = step_fn(params, model_state, opt_state, x, y)
      losses.append(float(loss))
  assert len(seen) == 1  # the check step was traced once
  return losses, opt_state, seen[0], thor_warnings(record)


@pytest.mark.parametrize("name", sorted(pm.LINEN_MODELS))
def test_public_model_trains_and_preconditions_expected_layers(name):
  case = pm.LINEN_MODELS[name]
  layers = pm.captured_layout(case, *pm.init_case(case))
  tx = OPTIMIZERS.get(name, lambda lr, layers: thor_optax.thor(lr, 0.03, layers=layers))(
      case.learning_rate, layers)
  losses, opt_state, unhandled, warned = train(case, tx)

  state = kronecker_state(opt_state)
  assert preconditioned_layers(state) == case.preconditioned
  reasons = unhandled_dict(unhandled)
  assert set(reasons) == set(case.unhandled)
  for layer, words in case.unhandled.items():
    assert words in reasons[layer], (layer, reasons[layer])
  # Every module with parameters is either preconditioned or listed with a reason.
  params = abstract_params(case.model, case.make_batch()[0])
  assert module_names(params) == case.preconditioned | set(case.unhandled)
  # One warning per compilation of the check step, naming every unhandled layer.
  if case.unhandled:
    assert len(warned) == 1
    assert all(layer in str(warned[0].message) for layer in case.unhandled)
  else:
    assert not warned
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.9 * losses[0], losses


# ----------------------------------------------------------------- outputs that are pytrees


PYTREE_MODELS = ("mlp_aux", "dict_output", "dataclass_output")


def test_pytree_outputs_reach_the_loss_as_returned():
  for name in PYTREE_MODELS:
    case = pm.LINEN_MODELS[name]
    params, _, (x, y) = pm.init_case(case)
    n = x.shape[0]
    reference = jax.eval_shape(lambda p: case.model.apply({"params": p}, x), params)
    seen = []

    def loss_fn(out, y):  # depends on every output leaf, so a mixed-up tree changes it
      seen.append(out)
      return case.loss_fn(out, y) + 1e-2 * sum(jnp.mean(jnp.tanh(v)) for v in
                                               jax.tree.leaves(out))

    capture = value_and_grad_with_stats(case.model, loss_fn, num_loss_terms=n)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def run(params):
      plain = jax.value_and_grad(lambda p: loss_fn(case.model.apply({"params": p}, x), y))
      out = case.model.apply({"params": params}, x)
      return capture(params, x, y), plain(params), jax.grad(loss_fn)(out, y)

    ((loss, grads), stats), (ref_loss, ref_grads), dout = run(params)
    assert seen and all(type(o) is type(reference) for o in seen)
    assert all(jax.tree.structure(o) == jax.tree.structure(reference) for o in seen)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7),
                 grads, ref_grads)
    # The head's per-example cotangents: N times d(loss)/d(logits), the logits leaf of the
    # output tree (the other leaves also depend on the head's input, not its output).
    dlogits = {"mlp_aux": lambda d: d[0], "dict_output": lambda d: d["logits"],
               "dataclass_output": lambda d: d.logits}[name](dout)
    np.testing.assert_allclose(stats.layers["head"].cotangents[0], n * dlogits,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", PYTREE_MODELS + ("regression",))
def test_outputs_without_loss_terms_in_their_shape_need_num_loss_terms(name):
  case = pm.LINEN_MODELS[name]
  x, y = case.make_batch()
  params = abstract_params(case.model, x)
  capture = value_and_grad_with_stats(case.model, case.loss_fn)  # no num_loss_terms
  with pytest.raises(ValueError, match="num_loss_terms"):
    jax.eval_shape(capture, params, x, y)


def test_rank1_output_with_num_loss_terms_equals_column_output(x64):
  x, y = to_f64(pm.regression_batch(9, 16, 4))
  n = x.shape[0]
  rank1, column = pm.Regressor(), pm.Regressor(squeeze=False)
  params = to_f64(init_params(rank1, x))
  captures = {
      "rank1": value_and_grad_with_stats(rank1, pm.squared_error, num_loss_terms=n),
      "column": value_and_grad_with_stats(column, lambda out, t: pm.squared_error(out, t[:, None])),
      "rank1_2n": value_and_grad_with_stats(rank1, pm.squared_error, num_loss_terms=2 * n),
  }
  run = jax.jit(lambda p: {k: c(p, x, y) for k, c in captures.items()},
                compiler_options=FAST_COMPILE)
  out = run(params)
  ((l1, g1), s1), ((l2, g2), s2) = out["rank1"], out["column"]
  assert s1.layers["out"].cotangents.shape == (1, n, 1)
  np.testing.assert_allclose(l1, l2, **TIGHT)
  # Same gradients and statistics (so the same G factors and the same updates).
  for a, b in ((g1, g2), (s1, s2)):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), a, b)
  # The count matters: twice the terms, twice the per-example cotangents.
  np.testing.assert_allclose(out["rank1_2n"][1].layers["out"].cotangents,
                             2 * s1.layers["out"].cotangents, **TIGHT)


def _check_then_plain(model, loss_fn, tx, x, y):
  """One jitted function of the parameters: a check step then a plain step; returns the
  statistics, the first gradients, both updates and the optimizer state."""
  capture = value_and_grad_with_stats(model, loss_fn)

  @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  def run(params):
    (_, grads), stats = capture(params, x, y)
    opt_state = tx.init(params)
    u1, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    params2 = optax.apply_updates(params, u1)
    grads2 = jax.grad(lambda p: loss_fn(model.apply({"params": p}, x), y))(params2)
    u2, opt_state = tx.update(grads2, opt_state, params2)
    return stats, grads, u1, u2, opt_state

  return run


def test_remat_layers_give_the_same_updates(x64):
  x, y = to_f64(pm.classification_batch(10, (16, 6), 4))
  remat, plain = pm.RematMLP(remat=True), pm.RematMLP(remat=False)
  params = to_f64(init_params(remat, x))
  assert "remat" in str(jax.make_jaxpr(lambda p: remat.apply({"params": p}, x))(params))
  tx = thor_optax.thor(0.1, 0.03, block_size=8)
  captures = [jax.jit(value_and_grad_with_stats(m, pm.softmax_ce), compiler_options=FAST_COMPILE)
              for m in (remat, plain)]
  # One compiled update for both: the trees are the same (named layers), and so must be the
  # statistics.
  update = jax.jit(lambda g, s: tx.update(g, tx.init(params), params, curvature_stats=s),
                   compiler_options=FAST_COMPILE)
  (loss_r, grads_r), stats_r = captures[0](params, x, y)
  (loss_p, grads_p), stats_p = captures[1](params, x, y)
  updates_r, state_r = update(grads_r, stats_r)
  updates_p, _ = update(grads_p, stats_p)
  np.testing.assert_allclose(loss_r, loss_p, **TIGHT)
  for a, b in ((grads_r, grads_p), (stats_r, stats_p), (updates_r, updates_p)):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), a, b)
  assert preconditioned_layers(kronecker_state(state_r)) == {"dense_0", "dense_1", "head"}


def test_scanned_stack_equals_unrolled_stack(x64):
  num_layers = 2
  x, y = to_f64(pm.classification_batch(12, (6, 3, 8), 4, label_shape=(6, 3)))
  unrolled = pm.UnrolledMlpStack(num_layers=num_layers)
  scanned = pm.ScannedMlpStack(num_layers=num_layers)
  params_u = to_f64(init_params(unrolled, x))
  params_s = pm.scanned_from_unrolled(params_u, num_layers)
  assert (jax.tree.structure(params_s)
          == jax.tree.structure(abstract_params(scanned, x)))
  lr = 0.1
  tx = thor_optax.thor(lr, 0.03, block_size=8)
  stats_u, _, u1_u, u2_u, _ = _check_then_plain(unrolled, pm.softmax_ce, tx, x, y)(params_u)
  stats_s, grads_s, u1_s, u2_s, st_s = _check_then_plain(scanned, pm.softmax_ce, tx, x, y)(
      params_s)
  assert stats_s.unhandled == stats_u.unhandled == ()
  for a, b in ((u1_s, u1_u), (u2_s, u2_u)):  # the check step's and the plain step's
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TIGHT), a,
                 pm.scanned_from_unrolled(b, num_layers))
  stack = {"layers/ln", "layers/mlp/Dense_0", "layers/mlp/Dense_1"}
  assert preconditioned_layers(kronecker_state(st_s)) == stack | {"head"}
  # The stack was preconditioned: its first update is not the SGD one (-lr * grad).
  diff = jax.tree.map(lambda u, g: float(np.abs(np.asarray(u) + lr * np.asarray(g)).max()),
                      u1_s["layers"],
                      grads_s["layers"])
  assert min(jax.tree.leaves(diff)) > 1e-3, diff


# ---------------------------------------------------------- layers the capture cannot take


def test_model_without_capturable_layers_trains_with_one_warning():
  case = pm.Case("bare_lstm", pm.BareLSTM(), lambda: pm.classification_batch(13, (8, 5, 3), 3),
                 pm.softmax_ce, frozenset(), {})
  losses, opt_state, unhandled, warned = train(case, thor_optax.thor(0.3, 0.03), steps=9)
  reasons = unhandled_dict(unhandled)
  assert set(reasons) == {f"OptimizedLSTMCell_0/{g}" for g in ("ii", "if", "ig", "io",
                                                                "hi", "hf", "hg", "ho")}
  assert all("returns its parameters" in r for r in reasons.values()), reasons
  assert len(warned) == 1 and "none of the model's layers" in str(warned[0].message)
  assert preconditioned_layers(kronecker_state(opt_state)) == set()
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


_GEMMA_LAYERS = {"embedder", "final_norm"} | {
    f"layers/{i}/{m}" for i in (0, 1) for m in ("pre_attention_norm", "qkv_einsum",
                                                "attn_vec_einsum", "pre_ffw_norm", "gate_proj",
                                                "up_proj", "down_proj")}
NNX_MODELS = {  # (model, batch, layers expected preconditioned, learning rate)
    # An nnx.vmap-made stack run by nnx.scan, and a layer run under nnx.remat.
    "scan_mlp": (lambda: pm.NNXScanMLP(6, 16, 2, 4, nnx.Rngs(0)),
                 lambda: pm.classification_batch(11, (16, 6), 4),
                 {"proj", "blocks/linear", "mid", "head"}, 0.05),
    # Flax's NNX Gemma example, small: its embedder (encode / decode, tied), einsum modules and
    # RMS norms of its own (before this capture: the embedder was listed).
    "gemma": (lambda: pm.NNXGemma(16, 8, nnx.Rngs(0)), lambda: pm.token_batch(16, 4, 6, 16),
              _GEMMA_LAYERS, 0.05),
}


@pytest.mark.parametrize("name", sorted(NNX_MODELS))
def test_nnx_models_are_preconditioned_and_train(name):
  """NNX's functional training loop (``nnx.split`` once, ``jax.jit`` steps that ``nnx.merge``),
  the optimizer laid out from one abstract capture (``captured_layers``)."""
  make_model, make_batch, expected, lr = NNX_MODELS[name]
  x, y = make_batch()
  capture = thor_optax.nnx.value_and_grad_with_stats(pm.softmax_ce)
  _, abstract = nnx.eval_shape(lambda m: capture(m, x, y), nnx.eval_shape(make_model))
  tx = thor_optax.thor(lr, 0.03, layers=thor_optax.captured_layers(abstract))

  def build():
    model = make_model()
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, _ = nnx.split(nnx.eval_shape(build))
  state = jax.jit(lambda: nnx.state(build()), compiler_options=FAST_COMPILE)()
  seen = []

  @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  def check_step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    (loss, grads), stats = capture(model, x, y)
    seen.append(stats.unhandled)
    optimizer.update(model, grads, curvature_stats=stats)
    return nnx.state((model, optimizer)), loss

  @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  def plain_step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: pm.softmax_ce(m(x), y))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  losses = []
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for step in range(STEPS):
      state, loss = (check_step if IS_CHECK(step) else plain_step)(state, x, y)
      losses.append(float(loss))
  assert thor_warnings(record) == [] and seen[0] == ()
  _, optimizer = nnx.merge(graphdef, state)
  assert preconditioned_layers(kronecker_state(optimizer.opt_state)) == expected
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("name", ["std_conv"])
def test_captured_mask_drops_the_blocks_of_layers_never_preconditioned(name, x64):
  """``precondition_mask=captured_mask(stats)``: no Kronecker blocks for the layers the capture
  lists (a weight-standardized conv; the public models' other listed layer, ``tied_lm``'s
  embedding, is now captured), and the same updates."""
  case = pm.LINEN_MODELS[name]
  x, y = case.make_batch()
  x = to_f64(x)
  model = case.model
  params = to_f64(init_params(model, x))
  capture = value_and_grad_with_stats(model, case.loss_fn)
  _, abstract = jax.eval_shape(capture, params, x, y)  # which layers it takes: no FLOPs
  mask = thor_optax.captured_mask(abstract)(params)
  kept = {"/".join(str(k.key) for k in path[:-1]) for path, v in
          jax.tree_util.tree_flatten_with_path(mask)[0] if v}
  assert kept == case.preconditioned
  txs = [thor_optax.thor(case.learning_rate, 0.03),
         thor_optax.thor(case.learning_rate, 0.03,
                         precondition_mask=thor_optax.captured_mask(abstract))]
  runs = []
  for tx in txs:
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      runs.append(_check_then_plain(model, case.loss_fn, tx, x, y)(params))
    warned = thor_warnings(record)
  assert warned == []  # the masked run has no layer to warn about
  (_, _, u1_all, u2_all, st_all), (_, _, u1_mask, u2_mask, st_mask) = runs
  for got, want in ((u1_mask, u1_all), (u2_mask, u2_all)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
  sizes = [sum(int(np.prod(np.shape(v))) for v in jax.tree.leaves(kronecker_state(st).blocks))
           for st in (st_all, st_mask)]
  assert sizes[1] < sizes[0], sizes
  assert preconditioned_layers(kronecker_state(st_mask)) == case.preconditioned
